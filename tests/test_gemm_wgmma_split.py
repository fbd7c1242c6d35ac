"""native/gemm_wgmma.cuh's split-K decision without a GPU (OJ_GEMMWG_SPLIT's path, off until its device
A/B): native/tools/gemm_wgmma_split_check.cu (compiled here with nvcc; the functions it calls touch no
device) prints the split of the 27B's Q4_K projection shapes and how many partial slices fit a prefill
workspace. The rules checked:

- a call whose blocks fill the SMs is not split; otherwise the split fills them at most once (one
  block per SM fits), each split at least two stages of super-blocks deep, at most MAX_SPLIT;
- at 64 positions the 5,120-row matrices (40 blocks on 132 SMs) split 3 ways, and the 17,408-row
  ones not at all;
- the partial slices go past the prepared X, 256-byte aligned, and as many fit as the workspace
  holds beyond it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cuda_tools import build_host_tool

N_SM = 132


@pytest.fixture(scope="module")
def exe(tmp_path_factory) -> Path:
    return build_host_tool(tmp_path_factory.mktemp("gwsplit") / "gwsplit", ["native/tools/gemm_wgmma_split_check.cu"],
                           "the split-K check")


@pytest.fixture(scope="module")
def rows(exe) -> list[dict]:
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.mark.parametrize("case, needle", [
    ("range", "gemm_wgmma: split 9 is outside 0..8"),
    ("room", "gemm_wgmma: split 3 needs 3 slices of 1310720 bytes past the prepared X; the workspace of "),
])
def test_a_bad_split_is_refused_with_its_reason_before_the_device(exe, case, needle):
    r = subprocess.run([str(exe), case], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not refused" not in r.stdout, (r.stdout, r.stderr)
    assert needle in r.stderr and "cudaGetDevice" not in r.stderr, r.stderr


def test_the_split_fills_idle_sms_once_and_keeps_each_split_deep(rows):
    max_split = next(r["max_split"] for r in rows if r["what"] == "max")
    splits = [r for r in rows if r["what"] == "split"]
    assert len(splits) == 7 * 4
    for r in splits:
        nb, S = r["K"] // 256, r["S"]
        if r["blocks"] >= N_SM:
            assert S == 1, r
        else:
            assert S == max(1, min(N_SM // r["blocks"], nb // (2 * r["stages"]), max_split)), r
            assert S * r["blocks"] <= N_SM, r          # one wave


def test_the_split_of_the_27b_shapes_at_64_positions(rows):
    at64 = {(r["K"], r["M"]): r["S"] for r in rows if r["what"] == "split" and r["P"] == 64}
    assert at64[(17408, 5120)] == 3 and at64[(6144, 5120)] == 3        # ffn_down, ssm_out: 40 blocks
    assert at64[(5120, 17408)] == 1                                     # 136 blocks fill 132 SMs
    assert at64[(5120, 10240)] == 1                                     # 80 blocks: a second split would not fit once
    assert at64[(5120, 1024)] == 5                                      # 8 blocks, 20 super-blocks: depth bounds it
    assert at64[(256, 72)] == 1                                         # one super-block
    at2048 = {(r["K"], r["M"]): r["S"] for r in rows if r["what"] == "split" and r["P"] == 2048}
    # a long prompt fills the SMs with position tiles; only the 48-row matrix (16 blocks) still splits
    assert {k: S for k, S in at2048.items() if S != 1} == {(5120, 48): 5}


def test_partial_slices_go_past_the_prepared_x(rows):
    for r in (r for r in rows if r["what"] == "fit"):
        assert r["offset"] >= r["x_bytes"] and r["offset"] % 256 == 0 and r["offset"] - r["x_bytes"] < 256, r
        slice_bytes = r["P"] * r["M"] * 4
        assert r["slices"] == (r["capacity"] - r["offset"]) // slice_bytes, r
        assert r["slices"] >= 3 or r["M"] > 10240, r                   # room for the splits it takes
