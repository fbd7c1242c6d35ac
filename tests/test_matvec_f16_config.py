"""native/matvec_f16.cuh's host-side configuration without a GPU: native/tools/matvec_f16_config_check.cu
(compiled here with nvcc; the functions it calls touch no device) prints which types stream on the
copy engine, the stage count stages_for picks per type, warps, vector count and device, each stage's
bytes and a launch's shared memory. The rules checked:

- Q4_K and Q6_K both stream on the copy engine (on a cc 9.0 device);
- a type on the copy engine takes 2 stages unless forced (a fourth block per SM); otherwise 3 when
  three fit a block and two such blocks fit an SM, else 2; a forced count is kept when it fits;
  never more shared memory than a block may have, and no copy-engine stages on a cc < 9.0 device;
- stages are whole multiples of 128 bytes (the tensor copies' destination alignment) holding the
  weights and the vectors' x (576 bytes a vector for Q4_K, with its min sums; 512 for Q6_K); a
  launch's shared memory is the rings plus one 8-byte mbarrier per stage and warp;
- on an H200's 228 KB per SM, 4 warps x 2 stages of Q6_K at 5 vectors still fit 3 blocks (the
  reason Q6_K's records have no pad), and Q4_K keeps 4 blocks up to 4 vectors;
- Q6_K's swizzled x (the halves of each 128 bytes swapped in odd vectors): every lane's load finds
  the columns the unswizzled order (x_dest, what step_q6 consumes) puts at its logical offset, each
  vector's 256 columns land on 256 distinct halfs of its 512 bytes, and the 8 lanes of each quarter
  warp load 8 distinct 16-byte bank quads (vectors 512 bytes apart: without the swizzle, 2-way
  conflicts).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cuda_tools import build_host_tool

REPO = Path(__file__).resolve().parent.parent
Q4_K, Q6_K = 12, 14
W_BYTES = {Q4_K: 32 * 144, Q6_K: 32 * (192 + 16 + 4)}
VEC_BYTES = {Q4_K: 576, Q6_K: 512}
H200_SMEM_SM, BLOCK_RESERVE = 233472, 1024


@pytest.fixture(scope="module")
def exe(tmp_path_factory) -> Path:
    return build_host_tool(tmp_path_factory.mktemp("mvcfg") / "mvcfg", ["native/tools/matvec_f16_config_check.cu"],
                           "the configuration check")


def _run(exe: Path) -> list[dict]:
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_types_on_the_copy_engine_and_their_stages(exe):
    rows = _run(exe)
    on = {r["type"]: r["on"] for r in rows if r["what"] == "tma_for"}
    assert on == {Q4_K: True, Q6_K: True}
    stages = [r for r in rows if r["what"] == "stages"]
    assert len(stages) == 2 * 2 * 2 * 3 * 3
    for r in stages:
        sb, warps, optin, smem_sm = r["stage_bytes"], r["warps"], r["optin"], r["smem_sm"]
        tma_here = on[r["type"]] and r["device"] == "h200"
        three = warps * 3 * sb
        if r["forced"]:
            want = r["forced"] if warps * r["forced"] * sb <= optin else 2
        elif tma_here:
            want = 2
        else:
            want = 3 if three <= optin and 2 * (three + 1024) <= smem_sm else 2
        assert r["stages"] == want, r
        assert warps * r["stages"] * sb <= optin or r["stages"] == 2, r


def test_stage_bytes_and_shared_memory(exe):
    rows = [r for r in _run(exe) if r["what"] == "smem"]
    assert len(rows) == 4 * 8
    for r in rows:
        sb = r["stage_bytes"]
        need = W_BYTES[r["type"]] + r["n_vec"] * VEC_BYTES[r["type"]] + 32
        assert sb % 128 == 0 and need <= sb < need + 128, r
        rings = r["warps"] * r["stages"] * sb
        assert r["smem"] == max(rings, r["warps"] * 8 * 32 * 4) + r["warps"] * r["stages"] * 8, r


def test_blocks_per_sm_at_five_vectors(exe):
    # Blocks of 4 warps x 2 stages that the shared memory of one H200 SM holds, each with the
    # runtime's per-block reserve: what the occupancy calculator finds (registers allow more).
    rows = [r for r in _run(exe) if r["what"] == "smem" and r["warps"] == 4 and r["stages"] == 2]
    fit = {(r["type"], r["n_vec"]): H200_SMEM_SM // (r["smem"] + BLOCK_RESERVE) for r in rows}
    assert fit[(Q6_K, 5)] == 3 and fit[(Q6_K, 4)] == 3 and fit[(Q6_K, 6)] == 2, fit
    assert fit[(Q4_K, 4)] == 4 and fit[(Q4_K, 5)] == 3, fit
    # the split model reads 1 and 8 vectors' occupancy: unchanged by the Q6_K stride (the same bits)
    assert fit[(Q6_K, 1)] == 3 and fit[(Q6_K, 8)] == 2, fit


def test_q6_k_swizzled_x_is_found_by_every_load(exe):
    (r,) = [r for r in _run(exe) if r["what"] == "q6_x"]
    dest, store, vb = r["dest"], r["store"], r["vec_bytes"]
    load = [r["load"][4 * g:4 * g + 4] for g in range(8)]
    assert vb == 512 and sorted(dest) == list(range(256))
    column_at = {p: c for c, p in enumerate(dest)}          # the unswizzled order: half p holds column
    for v in range(8):
        assert sorted(store[v]) == list(range(256)), v       # a permutation of the vector's halfs
        held = {p: c for c, p in enumerate(store[v])}         # what the swizzled record holds where
        for t in range(4):
            for half in range(2):
                for C in range(4):
                    for e in range(8):                         # the 8 halfs of one 16-byte load
                        phys = (load[v][t][half] + 128 * C) // 2 + e
                        logical = (16 * t + 64 * half + 128 * C) // 2 + e
                        assert held[phys] == column_at[logical], (v, t, half, C, e)
    # bank quads (16 bytes) of one quarter warp's loads: lanes 8q..8q+7 are vectors 2q, 2q+1, t 0..3
    for q in range(4):
        for half in range(2):
            for C in range(4):
                quads = [((g * vb + load[g][t][half] + 128 * C) // 16) % 8 for g in (2 * q, 2 * q + 1) for t in range(4)]
                assert len(set(quads)) == 8, (q, half, C, quads)
