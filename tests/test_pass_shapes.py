"""engine.cuh's attention_split_bucket without a GPU (native/tools/pass_shape_check.cu, compiled here
with nvcc): the split count a captured pass's attention grid takes for the count the pass needs.

The rules: never fewer splits than needed nor more than allocated; up to 8 the next power of two,
then the next multiple of 8 (so past 2,048 positions a graph serves 2,048 positions of growth, and
at most 7 empty splits run a position and head pair); a count that grows never gets a smaller grid.
tests/test_native_graph_gpu.py checks on the GPU that such a grid gives the exact count's bits.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from cuda_tools import build_host_tool


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    exe = build_host_tool(tmp_path_factory.mktemp("passcheck") / "passcheck", ["native/tools/pass_shape_check.cu"],
                          "the pass shape check")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_split_bucket(rows):
    assert len(rows) == 128 + 300
    last = {}
    for r in rows:
        s, m, b = r["splits"], r["max_splits"], r["bucket"]
        assert s <= b <= m, r
        if s <= 8:
            assert b == 1 << (s - 1).bit_length(), r
        else:
            assert b == min(-(-s // 8) * 8, m), r
        assert b - s <= 7, r
        assert b >= last.get(m, 0), r
        last[m] = b
    # from 2,049 to 30,720 positions (9..120 splits of 256) 14 grids, where each count was its own (112)
    grids = {r["bucket"] for r in rows if r["max_splits"] == 128 and 8 < r["splits"] <= 120}
    assert len(grids) == 14, sorted(grids)
