"""Chain passes replayed from CUDA graphs (issue 25) against the same passes launched directly.

Needs an NVIDIA GPU and the built library (ABI 14+); skips with the reason otherwise. A profiled
backend (oj_profile 1: events at the phase boundaries) launches every kernel of a pass from the
stream; an unprofiled one replays its shape's graph, which reads the pass's first position and
replay count from device memory. Both are driven through the same script from the same random
tokens: verifies of 1..8 positions with commits of every length 0..n (so each graph replays with
other replay counts and positions than it was captured with), a draft tree now and then (two tree
shapes of one graph), past three 256-position boundaries (a graph's attention grid is sized by
attention_split_bucket: 1, 2, 4, 4 splits there, the last with an empty split a position), f16 and
q8_0 KV, and two sequences of one engine taking turns; and past 2,304 positions after a prefill,
where 9 and 10 needed splits share the bucket of 16, so no shape is captured twice. Every logits
row must be equal bit for bit, every pass of the unprofiled backend replayed from a graph and none
of the profiled one's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_native_gpu import native_at_least, report  # noqa: E402
import test_native_spec_gpu as ts  # noqa: E402

pytestmark = pytest.mark.gpu

POSITIONS = 800          # past the 256, 512 and 768 split boundaries
TREE_EVERY = 9           # every ninth step verifies a draft tree instead of a chain


@pytest.fixture(scope="module")
def native():
    from openjet_plugin.backends.native import GRAPH_ABI

    return native_at_least(GRAPH_ABI, "oj_graph_stats")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("graph_models")


def _backends(path: Path, kv_type: str, n_seq: int = 1, n_ctx: int = 1024):
    """(model file, profiled backend: direct launches, unprofiled backend: graphs)."""
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    mf = open_model(path)
    direct = NativeBackend(mf, n_ctx=n_ctx, kv_type=kv_type, n_seq=n_seq)
    graphs = NativeBackend(mf, n_ctx=n_ctx, kv_type=kv_type, n_seq=n_seq)
    direct.profile(True)
    return mf, direct, graphs


def _step(be, kind: str, toks: list[int], arg) -> list[np.ndarray]:
    """One step on one backend: a chain verify committing `arg` positions, or a tree committing
    the path `arg`; the logits rows the verify wrote."""
    if kind == "chain":
        be.verify(toks)
        rows = [be.logits(i) for i in range(len(toks))]
        be.commit(arg)
    else:
        parent, path = arg
        be.verify_tree(toks, parent)
        rows = [be.logits(i) for i in range(len(toks))]
        be.commit_path(path)
    return rows


def _script(rng: np.random.Generator, n_vocab: int, positions: int):
    """Steps (kind, tokens, commit) until `positions` are committed."""
    steps, done, i = [], 0, 0
    while done < positions:
        i += 1
        if i % TREE_EVERY == 0:
            toks = [int(t) for t in rng.integers(0, n_vocab, 5)]
            parent, path = ([-1, 0, 0, 1, 2], [0, 1, 3]) if i % 2 else ([-1, 0, 1, 0, 3], [0, 3, 4])
            steps.append(("tree", toks, (parent, path)))
            done += len(path)   # both paths keep 3
        else:
            n = int(rng.integers(1, 9))
            toks = [int(t) for t in rng.integers(0, n_vocab, n)]
            k = int(rng.integers(0, n + 1))
            steps.append(("chain", toks, k))
            done += k
    return steps


def _compare(label: str, direct, graphs, views_d, views_g, steps_per_view) -> int:
    """Runs each view's steps in turn on both backends; returns the rows compared. Fails at the
    first row that differs, naming the step."""
    rows = 0
    longest = max(len(s) for s in steps_per_view)
    for i in range(longest):
        for v, steps in enumerate(steps_per_view):
            if i >= len(steps):
                continue
            kind, toks, arg = steps[i]
            want = _step(views_d[v], kind, toks, arg)
            got = _step(views_g[v], kind, toks, arg)
            for r, (a, b) in enumerate(zip(want, got)):
                assert np.array_equal(a, b), (
                    f"{label}: sequence {v} step {i} ({kind}, {len(toks)} positions at n_past "
                    f"{views_d[v].n_past}) row {r}: the graph's logits differ from the direct launches' "
                    f"(max |diff| {float(np.max(np.abs(a - b))):.3e})")
                rows += 1
    return rows


@pytest.mark.parametrize("name,kv_type", [("tiny-Q4_K_M", "f16"), ("small-Q4_K_M", "q8_0"), ("default", "f16")])
def test_graph_replays_equal_direct_launches(native, workdir, name, kv_type):
    path = ts._model(name, workdir)
    mf, direct, graphs = _backends(path, kv_type)
    try:
        steps = _script(np.random.default_rng(25), direct.n_vocab, POSITIONS)
        rows = _compare(name, direct, graphs, [direct], [graphs], [steps])
        got, want = graphs.graph_stats(), direct.graph_stats()
        report({"test": "graph_replays_equal_direct", "model": name, "kv": kv_type, "steps": len(steps),
                "rows_equal": rows, "graphs": got, "profiled": want})
        assert got["replayed"] == len(steps) and got["direct"] == 0 and got["held"] >= 2, got
        assert got["captures"] >= got["held"] and got["capture_ms"] > 0, got
        assert want["captures"] == 0, want
        assert want["replayed"] == 0 and want["direct"] >= len(steps), want
    finally:
        direct.close()
        graphs.close()
        mf.close()


def test_graph_replays_follow_each_sequence(native, workdir):
    """Two sequences of one engine take turns: each graph belongs to one sequence's caches."""
    path = ts._model("small-Q4_K_M", workdir)
    mf, direct, graphs = _backends(path, "f16", n_seq=2)
    try:
        rng = np.random.default_rng(29)
        steps = [_script(rng, direct.n_vocab, 300), _script(rng, direct.n_vocab, 300)]
        rows = _compare("two sequences", direct, graphs, direct.sequences(), graphs.sequences(), steps)
        got = graphs.graph_stats()
        report({"test": "graph_replays_two_sequences", "rows_equal": rows, "graphs": got})
        assert got["replayed"] == sum(map(len, steps)) and got["direct"] == 0 and got["held"] >= 2, got
    finally:
        direct.close()
        graphs.close()
        mf.close()


def test_graph_serves_its_split_bucket(native, workdir):
    """After a 2,200-token prefill (the same bits on both backends: launched directly), steps past
    2,304 positions, where the pass needs 10 splits instead of 9: both in the bucket of 16, so every
    shape is captured once (captures == held; without the bucket each shape used on both sides of
    2,304 would be captured again) and the rows with 6 or 7 empty splits a position equal the direct
    launches' exact count bit for bit."""
    path = ts._model("small-Q4_K_M", workdir)
    mf, direct, graphs = _backends(path, "q8_0", n_ctx=4096)
    try:
        rng = np.random.default_rng(31)
        prompt = [int(t) for t in rng.integers(0, direct.n_vocab, 2200)]
        a, b = direct.eval(prompt), graphs.eval(prompt)
        assert np.array_equal(a, b), "the prefill's last logits differ between two engines"
        steps = _script(rng, direct.n_vocab, 200)
        rows = _compare("split bucket", direct, graphs, [direct], [graphs], [steps])
        got = graphs.graph_stats()
        report({"test": "graph_split_bucket", "steps": len(steps), "rows_equal": rows,
                "n_past": graphs.n_past, "graphs": got})
        assert graphs.n_past > 2304 + 8, graphs.n_past
        assert got["replayed"] == len(steps) and got["direct"] == 0, got
        assert got["captures"] == got["held"], got
    finally:
        direct.close()
        graphs.close()
        mf.close()
