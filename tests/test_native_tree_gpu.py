"""Draft-tree verification in the native engine (issue 28): oj_verify_tree / oj_commit_path.

Needs an NVIDIA GPU and a library with oj_verify_tree (ABI 6); skips with the reason otherwise.
`scripts/gpu.sh check` runs it on the GPU machine; rows go to `$OPENJET_GPU_REPORT` like
tests/test_native_gpu.py's. Generated models (test_native_gpu.model_path), fresh random trees, and
outputs poisoned before every tree (a junk verify leaves other values in the engine's rows, the
host buffers are NaN):

(a) every node's logits against the numpy reference's `forward_tree` (top-1 and KL at the suite's
    bars), the conversation continuing through committed paths, the state at the end too;
(b) a chain tree is oj_verify bit for bit, and a tree's leading chain nodes are oj_verify's rows
    bit for bit (the tree kernels do the chain's arithmetic);
(c) after oj_commit_path the conv / ssm state, the K/V rows and the path's results equal those of
    evaluating the path one token at a time, bit for bit (f16 and q8_0 KV), and the MTP rows the
    backend then makes from the path's main hiddens equal the one-at-a-time engine's;
(d) greedy tree speculation on the native engine (speculative_native.native_tree_decoder) emits
    what plain greedy decoding does;
(e) bad parents, bad paths, no tree, n out of range: the named errors, the engine still usable.

Run on the device: python -m pytest -q -m gpu tests/test_native_tree_gpu.py
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_spec_gpu as ts  # noqa: E402
from test_native_gpu import KL_MAX, STATE_REL_MAX, TOP1_MIN, agreement, native_at_least, rel_err, report  # noqa: E402

pytestmark = pytest.mark.gpu

N_TREES = int(os.environ.get("OPENJET_TREE_TRIALS", "8"))
N_PROMPTS = int(os.environ.get("OPENJET_TREE_PROMPTS", "8"))
N_TOKENS = int(os.environ.get("OPENJET_TREE_TOKENS", "64"))
# the 27B's head shapes (w256: head_dim 256, d_state 128) and the small presets
REF_MODELS = ["tiny-F32", "tiny-Q4_K_M", "small-Q4_K_M", "w256-Q4_K_M", "w128-F32"]


@pytest.fixture(scope="module")
def native():
    from openjet_plugin.backends.native import TREE_ABI

    return native_at_least(TREE_ABI, "oj_verify_tree")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tree_models")


def _path(name: str, workdir: Path) -> Path:
    return ts._model(name, workdir)


def _backend(path: Path, n_ctx: int = 512, kv_type: str = "f16", depth: int = 0, prefill_chunk: int = 0):
    """A backend whose every evaluation goes through oj_eval / oj_verify (prefill_chunk 0: no
    batched prefill projections), as the reference and the one-at-a-time engine evaluate; with a
    prefill_chunk, prompts longer than one call go through oj_prefill."""
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    mf = open_model(path)
    return mf, NativeBackend(mf, n_ctx=n_ctx, kv_type=kv_type, draft_depth=depth, prefill_chunk=prefill_chunk)


def _close(*pairs) -> None:
    for mf, be in pairs:
        be.close()
        mf.close()


def _random_tree(rng: np.random.Generator, n: int) -> list[int]:
    """parent[i] < i; half the trees lean deep (the parent among the last few nodes)."""
    deep = rng.random() < 0.5
    parent = [-1]
    for i in range(1, n):
        lo = max(0, i - 2) if deep else 0
        parent.append(int(rng.integers(lo, i)))
    return parent


def _path_to(parent: list[int], node: int) -> list[int]:
    out = [node]
    while parent[out[-1]] >= 0:
        out.append(parent[out[-1]])
    return out[::-1]


def _off_prefix_node(rng: np.random.Generator, parent: list[int]) -> int:
    """A node whose path is not 0, 1, .., k (its rows must move on commit), when there is one."""
    moved = [i for i in range(len(parent)) if _path_to(parent, i) != list(range(len(_path_to(parent, i))))]
    return int(rng.choice(moved)) if moved else len(parent) - 1


def _poison(be, rng: np.random.Generator) -> None:
    """Other values in the engine's result rows, ring slot and KV rows beyond n_past."""
    be.verify(rng.integers(0, be.n_vocab, 8).tolist())
    be.commit(0)


def _results(be, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    logits = np.full((n, be.n_vocab), np.nan, dtype=np.float32)
    hidden = np.full((n, be.config.n_embd), np.nan, dtype=np.float32)
    for i in range(n):
        logits[i] = be.logits(i)
        hidden[i] = be.hidden(i)
    return logits, hidden, np.array(be.argmax()[:n])


def _main_state(be) -> dict[str, np.ndarray]:
    return {k: v for k, v in be.state().items() if not k.startswith("mtp")}


# --- (a) against the reference ------------------------------------------------------------------

@pytest.mark.parametrize("name", REF_MODELS)
def test_tree_logits_match_the_reference(native, workdir, name):
    from openjet_plugin.testing.reference import ReferenceModel

    path = _path(name, workdir)
    mf, be = _backend(path, n_ctx=256)
    ref = ReferenceModel(path)
    rng = np.random.default_rng(28)
    try:
        prompt = rng.integers(0, be.n_vocab, 29).tolist()
        be.eval(prompt)
        ref.forward(prompt)
        got_all, want_all, hid_err, nodes, committed = [], [], 0.0, 0, 0
        shapes = [[-1] + [0] * 7, list(range(-1, 7)), [-1, 0, 1, 0, 3, 1, 2, 4]]
        for trial in range(N_TREES):
            parent = shapes[trial] if trial < len(shapes) else _random_tree(rng, int(rng.integers(2, 9)))
            n = len(parent)
            tokens = rng.integers(0, be.n_vocab, n).tolist()
            _poison(be, rng)
            be.verify_tree(tokens, parent)
            got, hid, top = _results(be, n)
            want, want_h = ref.forward_tree(tokens, parent)
            assert np.isfinite(got).all() and np.isfinite(hid).all(), f"tree {parent}: NaN/inf in the results"
            assert np.array_equal(top, got.argmax(-1)), f"tree {parent}: oj_get_argmax is not the logits' argmax"
            got_all.append(got)
            want_all.append(want)
            hid_err = max(hid_err, rel_err(hid, want_h))
            nodes += n
            path = _path_to(parent, _off_prefix_node(rng, parent))
            be.commit_path(path)
            ref.commit_tree(path)
            committed += len(path)
        assert be.n_past == ref.n_past == len(prompt) + committed
        state, want_state = _main_state(be), {k: v for k, v in ref.state().items() if not k.startswith("mtp")}
    finally:
        _close((mf, be))
    top1, kl, kl_max = agreement(np.concatenate(want_all), np.concatenate(got_all))
    errs = {k: rel_err(state[k], v) for k, v in want_state.items() if k in state}
    worst = max(errs, key=errs.get)
    report({"test": "tree_vs_reference", "model": name, "trees": N_TREES, "nodes": nodes, "top1": top1,
            "kl_mean": kl, "kl_max": kl_max, "hidden_rel_err": hid_err, "state_worst": worst,
            "state_rel_err": errs[worst]})
    assert top1 >= TOP1_MIN and kl <= KL_MAX, f"tree logits: top-1 {top1:.4f}, mean KL {kl:.2e}"
    assert sorted(errs) == sorted(want_state), f"native state lacks {sorted(set(want_state) - set(errs))}"
    assert errs[worst] <= STATE_REL_MAX, f"state after committed paths: {worst} relative error {errs[worst]:.2e}"


# --- (b) chains -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "w256-Q4_K_M", "tiny-F32"])
def test_a_chain_tree_is_oj_verify_bit_for_bit(native, workdir, name):
    mf, be = _backend(_path(name, workdir), n_ctx=256)
    rng = np.random.default_rng(5)
    try:
        be.eval(rng.integers(0, be.n_vocab, 13).tolist())
        for n in range(1, 9):
            tokens = rng.integers(0, be.n_vocab, n).tolist()
            _poison(be, rng)
            be.verify(tokens)
            want = _results(be, n)
            be.commit(0)
            _poison(be, rng)
            be.verify_tree(tokens, list(range(-1, n - 1)))
            got = _results(be, n)
            for what, a, b in zip(("logits", "hidden", "argmax"), got, want):
                assert np.array_equal(a, b), f"chain of {n}: {what} differ from oj_verify's (rel {rel_err(a, b):.2e})"
            be.commit_path(list(range(n)))          # the chain case commits as oj_commit
            # a tree whose first m nodes are a chain: those rows are oj_verify's, through the tree kernels
            if n >= 3:
                m = int(rng.integers(1, n))
                parent = list(range(-1, m - 1)) + [int(rng.integers(0, i)) for i in range(m, n)]
                if parent == list(range(-1, n - 1)):
                    parent[-1] = 0
                _poison(be, rng)
                be.verify(tokens)
                want = _results(be, n)
                be.commit(0)
                _poison(be, rng)
                be.verify_tree(tokens, parent)
                got = _results(be, n)
                for what, a, b in zip(("logits", "hidden", "argmax"), got, want):
                    assert np.array_equal(a[:m], b[:m]), (
                        f"tree {parent}: the leading chain's {what} differ from oj_verify's (rel {rel_err(a[:m], b[:m]):.2e})")
                be.commit(0)
    finally:
        _close((mf, be))
    report({"test": "tree_chain_bitwise", "model": name})


# --- (c) commit of a path -------------------------------------------------------------------------

@pytest.mark.parametrize("name,kv", [("tiny-Q4_K_M", "f16"), ("tiny-Q4_K_M", "q8_0"), ("w256-Q4_K_M", "f16"),
                                     ("small-Q4_K_M", "q8_0"), ("tiny-F32", "f16")])
def test_commit_path_equals_one_at_a_time(native, workdir, name, kv):
    path = _path(name, workdir)
    a = _backend(path, n_ctx=256, kv_type=kv, depth=4)     # trees
    b = _backend(path, n_ctx=256, kv_type=kv, depth=4)     # the path's tokens one at a time
    A, B = a[1], b[1]
    rng = np.random.default_rng(11)
    mtp_worst = 0.0
    try:
        prompt = rng.integers(0, A.n_vocab, 21).tolist()
        A.eval(prompt)
        B.eval(prompt)
        nxt = None
        for trial in range(N_TREES):
            n = int(rng.integers(2, 9))
            parent = _random_tree(rng, n)
            tokens = rng.integers(0, A.n_vocab, n).tolist()
            if trial % 2 and nxt is not None:
                # the root is the token draft_first drafted from (as in decoding): its MTP row is
                # kept; on the other trials a random root, whose row the commit owes again
                tokens[0] = nxt
            node = _off_prefix_node(rng, parent)
            keep = _path_to(parent, node)
            _poison(A, rng)
            A.verify_tree(tokens, parent)
            A.commit_path(keep)
            got = _results(A, len(keep))           # the path's results, in path order
            want = []
            for i in keep:
                B.eval([tokens[i]])
                want.append(_results(B, 1))
            for k, what in enumerate(("logits", "hidden", "argmax")):
                w = np.concatenate([x[k] for x in want])
                assert np.array_equal(got[k], w), (
                    f"tree {parent} path {keep}: {what} after commit_path differ (rel {rel_err(got[k], w):.2e})")
            sa, sb = _main_state(A), _main_state(B)
            assert sorted(sa) == sorted(sb) and A.n_past == B.n_past
            for key in sa:
                assert np.array_equal(sa[key], sb[key]), (
                    f"tree {parent} path {keep}: {key} differs from one-at-a-time (rel {rel_err(sa[key], sb[key]):.2e})")
            # the backend owes the path's MTP rows and makes them from the path's main hiddens
            nxt = int(got[2][-1])
            A.draft_first(nxt)
            B.draft_first(nxt)
            ma, mb = A.state(), B.state()
            for key in ("mtp.k", "mtp.v"):
                if key in mb:
                    rows = A.n_past
                    err = rel_err(ma[key][:rows], mb[key][:rows])
                    mtp_worst = max(mtp_worst, err)
                    if err > 1e-5:
                        bad = [r for r in range(rows) if rel_err(ma[key][r], mb[key][r]) > 1e-5]
                        where = (f"rows {bad[0]}..{bad[-1]} differ ({len(bad)} of {rows}: {bad[:8]})" if bad
                                 else "no single row over 1e-5")
                        raise AssertionError(
                            f"tree {parent} path {keep} (trial {trial}, path at positions {A.n_past - len(keep)}.."
                            f"{A.n_past - 1}, root {'= the drafted token' if trial % 2 else 'random'}): {key} rows "
                            f"from the path's hiddens: rel {err:.2e}; {where}")
    finally:
        _close(a, b)
    report({"test": "tree_commit_path_bitwise", "model": name, "kv": kv, "trees": N_TREES, "mtp_rel_err": mtp_worst})


# --- (d) greedy tree speculation == plain greedy -----------------------------------------------------

@pytest.mark.parametrize("name,prefill_chunk", [("tiny-Q4_K_M", 0), ("small-Q4_K_M", 0), ("default", 0),
                                                ("small-Q4_K_M", 256), ("default", 256)])
def test_greedy_tree_speculation_equals_plain(native, workdir, name, prefill_chunk):
    """With prefill_chunk, the tree decoder's prompt is one oj_prefill that makes its MTP rows in
    the engine (NativeTreeTarget.prefill), and plain decoding prefills the same way."""
    from test_native_spec_gpu import _prompts, _top2_gap

    from openjet_plugin.sampling import SamplingParams
    from openjet_plugin.speculative import SpeculativeDecoder
    from openjet_plugin.speculative_native import NativeTreeTarget, native_tree_decoder
    from openjet_plugin.speculative_tree import TreePolicy

    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    path = _path(name, workdir)
    t, p = (_backend(path, n_ctx=1024, prefill_chunk=prefill_chunk), _backend(path, n_ctx=1024, prefill_chunk=prefill_chunk))
    ties, cycles, emitted, side = 0, 0, 0, 0
    try:
        prompts = _prompts(name, t[1].n_vocab)[:N_PROMPTS]
        tree = native_tree_decoder(t[1], TreePolicy(8))
        plain = SpeculativeDecoder(NativeTreeTarget(p[1]), None)
        long_prompts = sum(len(x) > 9 for x in prompts)
        for prompt in prompts:
            want = plain.generate(prompt, greedy, max_tokens=N_TOKENS).tokens
            r = tree.generate(prompt, greedy, max_tokens=N_TOKENS)
            cycles += r.stats.cycles
            emitted += r.stats.generated_tokens
            side += r.stats.side_accepts
            for i, (x, y) in enumerate(zip(r.tokens, want)):
                if x != y:
                    gap = _top2_gap(path, prompt + want[:i])
                    assert gap < 1e-3, f"{name}: differs at token {i} ({x} vs {y}), top-2 gap {gap:.3g}"
                    ties += 1
                    break
            else:
                assert len(r.tokens) == len(want)
        if prefill_chunk:
            assert t[1].prefilled_positions > 0 and long_prompts > 0, "no prompt went through oj_prefill"
    finally:
        _close(t, p)
    report({"test": "tree_greedy_equals_plain", "model": name, "prefill_chunk": prefill_chunk, "prompts": len(prompts),
            "tokens": N_TOKENS, "tokens_per_cycle": emitted / max(cycles, 1), "side_accepts": side, "near_ties": ties})


@pytest.mark.parametrize("name", ["small-Q4_K_M", "default"])
def test_one_call_draft_tree_is_the_step_by_step_tree(native, workdir, name, monkeypatch):
    """oj_draft_tree (ABI 8: the greedy tree in one engine call) against grow_tree step by step on
    the same engine (NativeTreeDrafter.grow off): both decoders emit plain decoding's tokens, and
    cycle by cycle the trees have the same tokens and parents (a near-tie of two scores, rounded in
    float32 on the GPU and float64 on the host, may order two slots otherwise: at most 5% of the
    trees), their slot probabilities within 1e-4."""
    from openjet_plugin.backends.native import DRAFT_TREE_ABI
    from openjet_plugin import speculative_tree
    from openjet_plugin.sampling import SamplingParams
    from openjet_plugin.speculative_native import NativeTreeDrafter, native_tree_decoder
    from openjet_plugin.speculative_tree import TreePolicy
    from test_native_spec_gpu import _prompts

    native_at_least(DRAFT_TREE_ABI, "oj_draft_tree")
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    propose = speculative_tree.MTPTreeDrafts.propose_tree
    trees: list = []

    def recorded(self, *a, **k):
        t = propose(self, *a, **k)
        trees.append((t.tokens.tolist(), t.parent.tolist(), np.asarray(t.prob, dtype=np.float64)))
        return t

    monkeypatch.setattr(speculative_tree.MTPTreeDrafts, "propose_tree", recorded)
    path = _path(name, workdir)
    runs = {}
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(NativeTreeDrafter, "grow", lambda self, *a, **k: None)
        trees.clear()
        pair = _backend(path, n_ctx=1024)
        try:
            dec = native_tree_decoder(pair[1], TreePolicy(8))
            prompts = _prompts(name, pair[1].n_vocab)[:N_PROMPTS]
            toks = [dec.generate(prompt, greedy, max_tokens=N_TOKENS).tokens for prompt in prompts]
        finally:
            _close(pair)
        runs[one_call] = (toks, list(trees))
    (toks_a, trees_a), (toks_b, trees_b) = runs[True], runs[False]
    assert toks_a == toks_b
    same = [(a, b) for a, b in zip(trees_a, trees_b) if a[0] == b[0] and a[1] == b[1]]
    prob_err = max((float(np.max(np.abs(a[2] - b[2]))) for a, b in same), default=0.0)
    report({"test": "one_call_draft_tree", "model": name, "trees": len(trees_b), "identical": len(same),
            "prob_err": prob_err})
    assert len(trees_a) == len(trees_b) > 0
    assert len(same) >= 0.95 * len(trees_b), f"{len(same)} of {len(trees_b)} trees identical"
    assert prob_err <= 1e-4


@pytest.mark.parametrize("restricted", [True, False])
def test_draft_tree_root_candidates_are_the_heads_top(native, workdir, restricted):
    """oj_draft_tree at max_depth 1: the root's step and its max_children best candidates, which
    are row_top's (elementwise.cu) over the draft head's row: the same ids in the same order
    (descending logit, ties the smaller id) and the same probabilities as numpy over the row
    oj_mtp_eval leaves, for fresh roots, over a restricted draft vocabulary (ids mapped back) and
    the whole one (248K-wide rows on the 27B; here the model's). Outputs poisoned first."""
    from openjet_plugin.backends.native import DRAFT_TREE_ABI

    native_at_least(DRAFT_TREE_ABI, "oj_draft_tree")
    mf, be = _backend(_path("small-Q4_K_M", workdir), n_ctx=256)
    rng = np.random.default_rng(7)
    worst, checked = 0.0, 0
    try:
        V, E = be.n_vocab, be.config.n_embd
        be.eval(rng.integers(0, V, 6).tolist())
        if restricted:
            ids = np.sort(rng.choice(V, V // 3, replace=False))
            be.set_draft_vocab(ids)
        else:
            ids = np.arange(V)
            be.set_draft_vocab(None)
        edges, a, c = np.array([0.0]), np.zeros(1), np.ones(1)
        pos = 0   # this backend does not follow the MTP cache (draft_depth 0): position 0 is always in reach
        for trial in range(6):
            root = int(rng.integers(0, V))
            h = rng.standard_normal(E).astype(np.float32)
            k = int(rng.integers(1, 8))
            toks, par, prob, score, steps = be.draft_tree(root, pos, h, k + 1, k, 1, edges, a, c)
            assert steps == 1 and toks[0] == root and par == [-1] + [0] * k, (toks, par)
            be.mtp_eval([root], pos, h=h[None])
            row = be.draft_logits(0).astype(np.float64)
            order = np.lexsort((ids, -row))[:k]
            want_ids = ids[order].tolist()
            p = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            assert toks[1:] == want_ids, (trial, toks[1:], want_ids)
            err = float(np.max(np.abs(np.asarray(prob[1:]) - p[order]) / np.maximum(p[order], 1e-30)))
            worst, checked = max(worst, err), checked + k
            np.testing.assert_allclose(score[1:], prob[1:], rtol=1e-12)   # a = 0, c = 1: score = q
    finally:
        _close((mf, be))
    report({"test": "draft_tree_root_top", "restricted": restricted, "candidates": checked, "prob_rel_err": worst})
    assert worst <= 1e-4


# --- (e) errors -------------------------------------------------------------------------------------

def test_bad_draft_tree_requests_give_named_errors(native, workdir):
    """oj_draft_tree refuses each bad field of its request by name (budget, max_children, max_depth,
    bins, root token, pos, a NULL root_h or output) and oj_profile an unknown mode, before any step;
    a good tree afterwards is the one a fresh engine grows."""
    from openjet_plugin.backends.native import DRAFT_TREE_ABI
    from openjet_plugin.errors import NativeEngineError

    nl = native_at_least(DRAFT_TREE_ABI, "oj_draft_tree")
    ffi, lib = nl.ffi, nl.lib
    path = _path("small-Q4_K_M", workdir)
    mf, be = _backend(path, n_ctx=64)
    try:
        V, E = be.n_vocab, be.config.n_embd
        h = np.random.default_rng(3).standard_normal(E).astype(np.float32)
        one = (np.zeros(1), np.zeros(1), np.ones(1))
        for args, words in (((5, 0, h, 0, 2, 3, *one), "budget 0 is outside 1..8"),
                            ((5, 0, h, 9, 2, 3, *one), "budget 9 is outside 1..8"),
                            ((5, 0, h, 4, 0, 3, *one), "max_children 0 is outside 1..8"),
                            ((5, 0, h, 4, 9, 3, *one), "max_children 9 is outside 1..8"),
                            ((5, 0, h, 4, 2, -1, *one), "max_depth is negative"),
                            ((5, 0, h, 4, 2, 3, np.zeros(0), np.zeros(0), np.zeros(0)), "acceptance bins"),
                            ((V, 0, h, 4, 2, 3, *one), f"token id {V} is outside the vocabulary"),
                            ((5, 1, h, 4, 2, 3, *one), "pos 1 must be in [0, 0]")):
            with pytest.raises(NativeEngineError, match=re.escape(words)):
                be.draft_tree(*args)
        toks, par = ffi.new("int32_t[]", 4), ffi.new("int32_t[]", 4)
        prob, score, n, steps = ffi.new("double[]", 4), ffi.new("double[]", 4), ffi.new("int32_t *"), ffi.new("int32_t *")
        e, a, c = (ffi.new("double[]", [x]) for x in (0.0, 0.0, 1.0))
        rq = ffi.new("oj_tree_request *")
        rq.root, rq.pos, rq.root_h, rq.budget, rq.max_children, rq.max_depth = 5, 0, ffi.NULL, 4, 2, 3
        rq.n_bins, rq.edges, rq.accept_a, rq.accept_c = 1, e, a, c
        h_in = ffi.from_buffer("float[]", h)
        handle = be._handle()
        assert lib.oj_draft_tree(handle, rq, toks, par, prob, score, n, steps) == lib.OJ_ERR_INVALID_ARGUMENT
        assert "root_h is NULL" in ffi.string(lib.oj_last_error(handle)).decode()
        rq.root_h = h_in
        assert lib.oj_draft_tree(handle, rq, ffi.NULL, par, prob, score, n, steps) == lib.OJ_ERR_INVALID_ARGUMENT
        assert "output array is NULL" in ffi.string(lib.oj_last_error(handle)).decode()
        assert lib.oj_profile(handle, 3) == lib.OJ_ERR_INVALID_ARGUMENT
        assert "on must be 0, 1 or 2, got 3" in ffi.string(lib.oj_last_error(handle)).decode()
        got = be.draft_tree(5, 0, h, 4, 2, 3, *one)
    finally:
        _close((mf, be))
    fresh = _backend(path, n_ctx=64)
    try:
        want = fresh[1].draft_tree(5, 0, h, 4, 2, 3, *one)
    finally:
        _close(fresh)
    assert got[:2] == want[:2] and got[4] == want[4], (got, want)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6)

def test_bad_trees_and_paths_give_named_errors(native, workdir):
    from openjet_plugin.errors import NativeEngineError

    nl = native
    ffi, lib = nl.ffi, nl.lib
    mf, be = _backend(_path("tiny-Q4_K_M", workdir), n_ctx=64)
    try:
        h = be._handle()
        be.eval([1, 2, 3])

        def call(fn, *args):
            rc = fn(h, *args)
            return int(rc), ffi.string(lib.oj_last_error(h)).decode()

        toks = ffi.new("int32_t[]", [5, 6, 7, 8, 9, 10, 11, 12, 13])
        for parent, n, words in (([0, 0, 1], 3, "bad parent array"), ([-1, 0, 2], 3, "bad parent array"),
                                 ([-1, 5, 0], 3, "bad parent array"), ([-1, -1, 0], 3, "bad parent array"),
                                 (list(range(-1, 8)), 9, "n_tokens is 9"), ([-1], 0, "n_tokens is 0")):
            rc, msg = call(lib.oj_verify_tree, toks, ffi.new("int32_t[]", parent), n)
            assert rc == lib.OJ_ERR_INVALID_ARGUMENT and words in msg, (parent, rc, msg)
        rc, msg = call(lib.oj_verify_tree, toks, ffi.NULL, 3)
        assert rc == lib.OJ_ERR_INVALID_ARGUMENT and "parent is NULL" in msg, msg
        rc, msg = call(lib.oj_commit_path, ffi.new("int32_t[]", [0]), 1)
        assert rc == lib.OJ_ERR_INVALID_ARGUMENT and "no tree to commit" in msg, msg
        assert be.n_past == 3

        parent = [-1, 0, 0, 1]
        be.verify_tree([5, 6, 7, 8], parent)
        for path, n, words in (([0, 2, 3], 3, "not a path of the last tree"), ([1], 1, "not a path of the last tree"),
                               ([0, 0], 2, "not a path of the last tree"), ([0, 1, 3, 2, 1], 5, "n_path is 5"),
                               ([0], 0, "n_path is 0"), ([0, 4], 2, "not a path of the last tree")):
            rc, msg = call(lib.oj_commit_path, ffi.new("int32_t[]", path), n)
            assert rc == lib.OJ_ERR_INVALID_ARGUMENT and words in msg, (path, rc, msg)
        rc, msg = call(lib.oj_commit_path, ffi.NULL, 1)
        assert rc == lib.OJ_ERR_INVALID_ARGUMENT and "path is NULL" in msg, msg
        rc, msg = call(lib.oj_commit, 3)
        assert rc == lib.OJ_ERR_INVALID_ARGUMENT and "not a chain" in msg, msg
        assert be.n_past == 3
        # the refused calls left the tree pending: its path commits, and once only
        be.commit_path([0, 1, 3])
        assert be.n_past == 6
        with pytest.raises(NativeEngineError, match="no tree to commit"):
            be._check(lib.oj_commit_path(h, ffi.new("int32_t[]", [0]), 1), "commit_path")
        # and the engine still evaluates as one that never saw the refused calls
        want_mf, fresh = _backend(_path("tiny-Q4_K_M", workdir), n_ctx=64)
        try:
            for chunk in ([1, 2, 3], [5, 6, 8], [9]):
                fresh.eval(chunk)
            be.eval([9])
            assert rel_err(be.logits(0), fresh.logits(0)) <= 1e-5
        finally:
            _close((want_mf, fresh))
    finally:
        _close((mf, be))
