"""Draft trees on the native backend's Python side (issue 28), on the CPU: NativeBackend.verify_tree /
commit_path and the generic decoder's native tree target and drafter (speculative_native.py) over a
fake library with engine.cu's rules for oj_verify_tree / oj_commit_path (tests/test_native_bookkeeping
.py's toy model: the next token is a hash of the committed history, so a token lost, doubled or taken
from the wrong branch changes every later output). The GPU runs the same paths on the real engine:
tests/test_native_tree_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_native_bookkeeping import V, FakeLib, _mix, _rows_in_step, install_fake  # noqa: E402

from openjet_plugin.backends import native  # noqa: E402
from openjet_plugin.sampling import SamplingParams  # noqa: E402
from openjet_plugin.speculative import SpeculativeDecoder  # noqa: E402

DEFAULT_GGUF = Path(__file__).resolve().parent.parent / "openjet_plugin" / "data" / "default.gguf"
GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


def _encode(h: int, n: int) -> np.ndarray:
    """A toy hidden (a 61-bit history hash) as n floats: 16-bit pieces, exact in float32."""
    out = np.zeros(n, dtype=np.float32)
    for k in range(4):
        out[k] = (h >> (16 * k)) & 0xFFFF
    return out


def _decode(row) -> int:
    return sum(int(row[k]) << (16 * k) for k in range(4))


class TreeFakeLib(FakeLib):
    """FakeLib with oj_verify_tree / oj_commit_path (openjet.h, ABI 6), the hidden rows, OJ_H_HOST
    and the draft vocabulary, by engine.cu's rules."""

    abi = native.TREE_ABI

    def oj_engine_create(self, desc, out):
        self.n_embd = int(desc.hparams.n_embd)
        return super().oj_engine_create(desc, out)

    draft_tree_calls = 0

    def oj_reset(self, h):
        self.parent: list[int] = []
        self.ids: np.ndarray | None = None
        self.draft_hs: list[int] = []
        return super().oj_reset(h)

    def oj_verify(self, h, buf, n):
        self.parent = list(range(-1, n - 1))
        return super().oj_verify(h, buf, n)

    def oj_verify_tree(self, h, buf, par, n):
        toks = [int(buf[i]) for i in range(n)]
        parent = [int(par[i]) for i in range(n)]
        if not 1 <= n <= 8 or any(not 0 <= t < V for t in toks):
            return self._fail("oj_verify_tree: n or a token id out of range")
        if parent[0] != -1 or any(not 0 <= parent[i] < i for i in range(1, n)):
            return self._fail("oj_verify_tree: bad parent array")
        self.verifies += 1
        self.uncommitted = 0
        self.last_start, self.last_n, self.prev_row = len(self.hist), n, 0
        hs: list[int] = []
        for i, t in enumerate(toks):
            hs.append(_mix(self.hashes[-1] if parent[i] < 0 else hs[parent[i]], t))
        self.win = [self.hashes[-1]] + hs
        self.out = [self._next(x) for x in hs]
        self.verify_toks, self.parent, self.uncommitted = toks, parent, n
        return 0

    def oj_commit(self, h, n):
        if any(self.parent[i] != i - 1 for i in range(1, min(n, len(self.parent)))):
            return self._fail("oj_commit: the nodes are not a chain; use oj_commit_path")
        return super().oj_commit(h, n)

    def oj_commit_path(self, h, path, n):
        p = [int(path[i]) for i in range(n)]
        if self.uncommitted == 0:
            return self._fail("oj_commit_path: no tree to commit")
        if not 1 <= n <= self.uncommitted or p[0] != 0 or any(
                not 0 < b < self.uncommitted or self.parent[b] != a for a, b in zip(p, p[1:])):
            return self._fail("oj_commit_path: not a path of the last tree")
        for i in p:
            self.hist.append(self.verify_toks[i])
            self.hashes.append(_mix(self.hashes[-1], self.verify_toks[i]))
        assert self.hashes[-1] == self.win[p[-1] + 1]
        # the results and the hidden window read the path, in path order
        self.win = [self.win[0]] + [self.win[i + 1] for i in p]
        self.out = [self.out[i] for i in p]
        self.last_n, self.uncommitted = n, 0
        return 0

    def oj_get_hidden(self, h, index, out, n):
        if not 0 <= index < self.last_n:
            return self._fail("hidden index")
        np.frombuffer(self.ffi.buffer(out, n * 4), dtype=np.float32)[:] = _encode(self.win[index + 1], n)
        return 0

    def oj_mtp_eval(self, h, buf, n, pos0, source, hp):
        if source != 2:
            rc = super().oj_mtp_eval(h, buf, n, pos0, source, hp)
            if rc == 0:
                self.draft_hs = [self.draft_h] * n if n == 1 else self._guesses(buf, n)
            return rc
        if pos0 > self.mtp_n_past:
            return self._fail(f"MTP pos0 {pos0} leaves a hole after {self.mtp_n_past}")
        E = self.n_embd
        rows = np.frombuffer(self.ffi.buffer(hp, n * E * 4), dtype=np.float32).reshape(n, E)
        self.draft, self.draft_hs = [], []
        for i in range(n):
            t, hh = int(buf[i]), _decode(rows[i])
            self.mtp_rows[pos0 + i] = (t, hh)
            g = _mix(hh, t)
            self.draft.append(self._next(g) if g % 4 else (self._next(g) + 1) % V)
            self.draft_hs.append(g)
        self.draft_h = self.draft_hs[-1]
        self.mtp_n_past, self.last_mtp_n = pos0 + n, n
        return 0

    def _guesses(self, buf, n):
        # the hidden each row's step would chain with (for OJ_H_MAIN batches)
        first = [self.mtp_rows[self.mtp_n_past - n + i] for i in range(n)]
        return [_mix(hh, t) for t, hh in first]

    def oj_get_draft_hidden(self, h, index, out, n):
        np.frombuffer(self.ffi.buffer(out, n * 4), dtype=np.float32)[:] = _encode(self.draft_hs[index], n)
        return 0

    def oj_set_draft_vocab(self, h, ids, n):
        self.ids = None if n == 0 else np.array([int(ids[i]) for i in range(n)])
        return 0

    def oj_draft_tree(self, h, rq, toks, par, prob, score, n_out, steps):
        """engine.cu's oj_draft_tree over this toy: grow_tree's best-first rule, each node's step
        through oj_mtp_eval with host rows (the root's from root_h, a branch's from its ancestors'
        MTP hiddens), candidates and probabilities from the draft logits row (float64 softmax)."""
        E = self.n_embd
        budget, K, max_depth, nb = int(rq.budget), int(rq.max_children), int(rq.max_depth), int(rq.n_bins)
        if not 1 <= budget <= 8 or not 1 <= K <= 8 or max_depth < 0 or not 1 <= nb <= 32:
            return self._fail("oj_draft_tree: budget, max_children, max_depth or n_bins out of range")
        edges = [float(rq.edges[i]) for i in range(nb)]
        a, c = [float(rq.accept_a[i]) for i in range(nb)], [float(rq.accept_c[i]) for i in range(nb)]
        root, pos = int(rq.root), int(rq.pos)
        root_h = np.frombuffer(self.ffi.buffer(rq.root_h, E * 4), dtype=np.float32).copy()
        self.draft_tree_calls += 1

        def estimate(q):
            b = 0
            while b + 1 < nb and q >= edges[b + 1]:
                b += 1
            return a[b] + c[b] * q

        def step(tokens, pos0, rows):
            arr = np.ascontiguousarray(np.stack(rows), dtype=np.float32)
            assert self.oj_mtp_eval(h, self.ffi.new("int32_t[]", tokens), len(tokens), pos0, 2,
                                    self.ffi.from_buffer("float[]", arr)) == 0
            width = V if self.ids is None else len(self.ids)
            row = np.empty(width, dtype=np.float32)
            self.oj_get_draft_logits(h, len(tokens) - 1, self.ffi.from_buffer("float[]", row, require_writable=True), width)
            hid = np.empty(E, dtype=np.float32)
            self.oj_get_draft_hidden(h, len(tokens) - 1, self.ffi.from_buffer("float[]", hid, require_writable=True), E)
            ids = np.arange(width) if self.ids is None else self.ids
            x = row.astype(np.float64)
            order = np.lexsort((np.arange(width), -x))[:K]
            p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
            return [int(ids[j]) for j in order], [float(p[j]) for j in order], hid

        T, P, D, Q, S = [root], [-1], [0], [1.0], [1.0]
        tops, hids, n_steps = {}, {}, 0
        max_depth = min(max_depth, budget - 1)
        if max_depth >= 1 and budget >= 2:
            ids0, pr0, hids[0] = step([root], pos, [root_h])
            tops[0], n_steps = (ids0, pr0), 1
            heap, order = [], 0

            def push(i, j):
                nonlocal order
                if j < len(tops[i][0]):
                    heap.append((-(S[i] * estimate(tops[i][1][j])), D[i] + 1, order, i, j))
                    order += 1
                    heap.sort()

            push(0, 0)
            while len(T) < budget and heap:
                neg, dep, _, i, j = heap.pop(0)
                T.append(tops[i][0][j])
                P.append(i)
                D.append(dep)
                Q.append(tops[i][1][j])
                S.append(-neg)
                push(i, j + 1)
                k = len(T) - 1
                if len(T) < budget and dep < max_depth:
                    path = []
                    v = k
                    while v > 0:
                        path.append(v)
                        v = P[v]
                    path.reverse()
                    ids_k, pr_k, hids[k] = step([T[v] for v in path], pos + 1, [hids[P[v]] for v in path])
                    tops[k] = (ids_k, pr_k)
                    n_steps += 1
                    push(k, 0)
                else:
                    tops[k] = ([], [])
        for i in range(len(T)):
            toks[i], par[i], prob[i], score[i] = T[i], P[i], Q[i], S[i]
        n_out[0], steps[0] = len(T), n_steps
        return 0

    def oj_get_draft_logits(self, h, index, out, n):
        row = np.frombuffer(self.ffi.buffer(out, n * 4), dtype=np.float32)
        rng = np.random.default_rng(self.draft[index] + 17)
        row[:] = 0.01 * rng.normal(size=n).astype(np.float32)
        ids = np.arange(V) if self.ids is None else self.ids
        # the head's guess first; when it is wrong (guess = truth + 1) the truth is second
        for tok, value in ((self.draft[index], 10.0), ((self.draft[index] - 1) % V, 9.0)):
            hit = np.flatnonzero(ids == tok)
            if hit.size:
                row[hit[0]] = value
        return 0


@pytest.fixture()
def fake_tree(monkeypatch):
    return install_fake(monkeypatch, TreeFakeLib)


def _backend(depth: int, n_ctx: int = 512):
    from openjet_plugin.model_file import open_model

    mf = open_model(DEFAULT_GGUF)
    assert mf.config.n_vocab == V
    return native.NativeBackend(mf, n_ctx=n_ctx, draft_depth=depth, prefill_chunk=0)


PROMPTS = [[5, 17, 300, 4000, 12], [7], list(range(100, 140)), [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def _plain(prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of the toy model itself: the next token is hash(history) % V."""
    hs = 0
    for t in prompt:
        hs = _mix(hs, t)
    out = []
    for _ in range(n):
        t = hs % V
        out.append(t)
        hs = _mix(hs, t)
    return out


@pytest.mark.parametrize("budget", [2, 3, 5, 8])
def test_tree_decoder_on_the_native_bookkeeping_equals_plain(fake_tree, budget):
    from openjet_plugin.speculative_native import native_tree_decoder
    from openjet_plugin.speculative_tree import TreePolicy

    be = _backend(0)
    dec = native_tree_decoder(be, TreePolicy(budget))
    side = acc = 0
    for prompt in PROMPTS:
        for max_tokens in (1, 2, 7, 40):
            r = dec.generate(prompt, GREEDY, max_tokens=max_tokens)
            assert r.tokens == _plain(prompt, max_tokens), (prompt, max_tokens)
            lib = fake_tree[-1]
            assert lib.hist == (prompt + r.tokens)[:len(lib.hist)]
            side += r.stats.side_accepts
            acc += r.stats.drafts_accepted
    assert acc > 0
    if budget >= 5:
        assert side > 0, "no side branch was ever accepted: the tree paths were not exercised"


def test_commit_path_owes_the_path_rows_and_the_mtp_cache_follows(fake_tree):
    """A speculating backend: after commit_path the path's tokens owe their MTP rows, made from the
    path's main hiddens (the window the engine compacted) at the next draft step."""
    be = _backend(4)
    lib = fake_tree[-1]
    be.eval([3, 1, 4, 1, 5])
    tok = be.argmax()[-1]
    be.draft_first(tok)
    for parent, path in (([-1, 0, 0, 1, 2, 2], [0, 2, 5]), ([-1, 0, 1, 0], [0, 3]), ([-1, 0], [0]),
                         ([-1, 0, 1, 2], [0, 1, 2, 3])):
        pos = be.n_past
        toks = [tok] + [int(x) for x in np.random.default_rng(pos).integers(0, V, len(parent) - 1)]
        be.verify_tree(toks, parent)
        be.commit_path(path)
        assert be.n_past == pos + len(path)
        assert lib.hist[pos:] == [toks[i] for i in path]
        assert be._last_n == len(path)
        tok = be.argmax()[-1]                      # results read the path: its last node's argmax
        assert tok == lib.hashes[-1] % V
        be.draft_first(tok)
        _rows_in_step(lib, be)


def test_tree_arguments_are_checked_before_the_engine(fake_tree):
    be = _backend(0)
    be.eval([1, 2, 3])
    with pytest.raises(RuntimeError, match="commit_path without a verify_tree"):
        be.commit_path([0])
    with pytest.raises(ValueError, match="root"):
        be.verify_tree([1, 2, 3], [0, 0, 1])
    with pytest.raises(ValueError, match="earlier node"):
        be.verify_tree([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="parents"):
        be.verify_tree([1, 2, 3], [-1, 0])
    with pytest.raises(ValueError, match="1..8"):
        be.verify_tree(list(range(9)), list(range(-1, 8)))
    be.verify_tree([1, 2, 3, 4], [-1, 0, 0, 1])
    for bad in ([1], [0, 3], [0, 2, 3], []):
        with pytest.raises(ValueError, match="not a root-first path"):
            be.commit_path(bad)
    be.commit_path([0, 1, 3])
    assert be.n_past == 6


def test_native_tree_target_refuses_a_backend_that_follows_the_mtp_cache(fake_tree):
    from openjet_plugin.speculative_native import NativeTreeTarget, native_tree_decoder

    with pytest.raises(ValueError, match="draft_depth=0"):
        NativeTreeTarget(_backend(4))
    with pytest.raises(ValueError, match="exceeds"):
        native_tree_decoder(_backend(0), 9)


def test_greedy_tree_verification_reads_the_engine_argmax_not_logits_rows(fake_tree, monkeypatch):
    """Greedy trees without penalties or bias verify on the engine's own argmax (NativeTreeTarget.
    argmax): no logits row is copied (a 248K-float copy a row on the 27B), and the output is plain
    decoding's. With a repetition penalty the rows are read (penalties change the argmax)."""
    from openjet_plugin.speculative_native import native_tree_decoder

    reads = {"n": 0}
    get_logits = TreeFakeLib.oj_get_logits

    def counted(self, *a):
        reads["n"] += 1
        return get_logits(self, *a)

    monkeypatch.setattr(TreeFakeLib, "oj_get_logits", counted)
    be = _backend(0)
    dec = native_tree_decoder(be, 8)
    dec.generate(PROMPTS[2], GREEDY, max_tokens=1)
    prefill_reads, reads["n"] = reads["n"], 0         # this toy's prefill returns its last row
    r = dec.generate(PROMPTS[2], GREEDY, max_tokens=40)
    assert r.tokens == _plain(PROMPTS[2], 40) and r.stats.drafts_accepted > 0
    assert reads["n"] == prefill_reads, "greedy tree verification read logits rows"
    reads["n"] = 0
    penalised = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.1)
    dec.generate(PROMPTS[2], penalised, max_tokens=10)
    assert reads["n"] > prefill_reads


class DraftTreeFakeLib(TreeFakeLib):
    """TreeFakeLib with oj_draft_tree (ABI 8)."""

    abi = native.DRAFT_TREE_ABI


@pytest.mark.parametrize("budget,calibrate", [(3, False), (5, False), (8, False), (8, True)])
def test_one_call_draft_tree_is_the_step_by_step_tree(monkeypatch, budget, calibrate):
    """Greedy trees grown in one engine call (oj_draft_tree, NativeTreeDrafter.grow) are the trees
    grow_tree builds step by step through step / step_branch: the same output (plain decoding's),
    cycles, accepted drafts, side branches and MTP steps; the one-call path made every tree."""
    from openjet_plugin import speculative_tree
    from openjet_plugin.speculative_native import native_tree_decoder
    from openjet_plugin.speculative_tree import TreePolicy

    proposed = {"n": 0}
    propose = speculative_tree.MTPTreeDrafts.propose_tree

    def counted(self, *a, **k):
        proposed["n"] += 1
        return propose(self, *a, **k)

    monkeypatch.setattr(speculative_tree.MTPTreeDrafts, "propose_tree", counted)
    runs = {}
    for cls in (TreeFakeLib, DraftTreeFakeLib):
        proposed["n"] = 0
        libs = install_fake(monkeypatch, cls)
        be = _backend(0)
        dec = native_tree_decoder(be, TreePolicy(budget, calibrate=calibrate))
        out = []
        for prompt in PROMPTS:
            r = dec.generate(prompt, GREEDY, max_tokens=30)
            assert r.tokens == _plain(prompt, 30), (cls.__name__, prompt)
            st = r.stats
            out.append((r.tokens, st.cycles, st.drafts_accepted, st.side_accepts, st.draft_steps))
        runs[cls] = (out, libs[-1].draft_tree_calls, be.supports_draft_tree, proposed["n"])
    (step_by_step, calls_a, sup_a, _), (one_call, calls_b, sup_b, n_b) = runs[TreeFakeLib], runs[DraftTreeFakeLib]
    assert not sup_a and calls_a == 0 and sup_b
    assert calls_b == n_b > 0, "a tree was not grown in one call"
    assert one_call == step_by_step


def test_a_tree_keeps_eight_nodes_where_a_verify_takes_sixteen(monkeypatch):
    """A library of OJ_MAX_POSITIONS 16 still takes trees of OJ_MAX_TREE_NODES (8): the backend
    refuses a ninth node by name before the engine, and a tree within the limit still runs."""
    class WideTreeLib(TreeFakeLib):
        OJ_MAX_POSITIONS = 16

    install_fake(monkeypatch, WideTreeLib)
    be = _backend(0)
    be.eval([1, 2, 3])
    assert be.max_positions == 16
    with pytest.raises(ValueError, match="verify_tree takes 1..8 nodes, got 9"):
        be.verify_tree(list(range(9)), list(range(-1, 8)))
    assert be.n_past == 3
    be.verify_tree([1, 2, 3, 4], [-1, 0, 0, 1])
    be.commit_path([0, 1, 3])
    assert be.n_past == 6


def test_draft_tree_arguments_are_checked(monkeypatch):
    """NativeBackend.draft_tree refuses a root hidden of the wrong size and mismatched bins by name;
    a library before ABI 8 is refused, naming the rebuild."""
    install_fake(monkeypatch, DraftTreeFakeLib)
    be = _backend(0)
    E = be.config.n_embd
    edges, a, c = np.zeros(2), np.zeros(2), np.ones(2)
    with pytest.raises(ValueError, match="root_h has 3 values"):
        be.draft_tree(5, 0, np.zeros(3), 4, 2, 3, edges, a, c)
    with pytest.raises(ValueError, match="one entry per bin"):
        be.draft_tree(5, 0, np.zeros(E), 4, 2, 3, edges, a, np.ones(3))
    install_fake(monkeypatch, TreeFakeLib)
    old = _backend(0)
    with pytest.raises(RuntimeError, match="oj_draft_tree needs 8: rebuild"):
        old.draft_tree(5, 0, np.zeros(E), 4, 2, 3, edges, a, c)


def test_tree_hiddens_are_read_before_commit_path_only(fake_tree):
    """NativeTreeTarget.verify_tree's hiddens are copied when read: a node's equals the backend's
    hidden(i) then; after commit_path (the engine's rows are the path's) a read is refused."""
    from openjet_plugin.speculative_native import NativeTreeTarget

    be = _backend(0)
    T = NativeTreeTarget(be)
    T.prefill([5, 17, 300])
    rows, hid = T.verify_tree([12, 40, 41, 7], [-1, 0, 0, 1])
    assert len(hid) == 4
    np.testing.assert_array_equal(hid[2], be.hidden(2))
    kept = hid[1]
    T.commit_path([0, 1])
    np.testing.assert_array_equal(hid[1], kept)               # read before: kept
    with pytest.raises(RuntimeError, match="after commit_path"):
        hid[3]


def test_chain_decoding_through_the_tree_target(fake_tree):
    """The same target also drives chains (verify/commit) and plain decoding."""
    from openjet_plugin.speculative_native import NativeTreeDrafter, NativeTreeTarget
    from openjet_plugin.speculative import MTPDrafts

    be = _backend(0)
    for drafts, depth in ((None, 0), (MTPDrafts(NativeTreeDrafter(be)), 3)):
        dec = SpeculativeDecoder(NativeTreeTarget(be), drafts, depth)
        for prompt in PROMPTS[:2]:
            assert dec.generate(prompt, GREEDY, max_tokens=20).tokens == _plain(prompt, 20)


@pytest.mark.parametrize("tree", [True, False])
def test_a_root_other_than_the_drafted_token_remakes_its_mtp_row(fake_tree, tree):
    """draft_first(t) makes the MTP row of position n_past for token t. A verify whose current token
    is another one (the GPU test's random trees, a caller that changed its mind) must not count that
    row as the committed token's: the commit owes it again, and the next draft step remakes it from
    the main hidden (as one-token-at-a-time evaluation does). The rows a matching root keeps are
    not remade."""
    be = _backend(4)
    lib = fake_tree[-1]
    be.eval([3, 1, 4, 1, 5])
    rng = np.random.default_rng(3)
    drafted = be.argmax()[-1]
    be.draft_first(drafted)
    for trial in range(6):
        pos = be.n_past
        root = drafted if trial % 2 else (drafted + 1 + int(rng.integers(0, V - 1))) % V
        parent, path = ([-1, 0, 0, 0, 1], [0, 1, 4]) if tree else ([-1, 0, 1], [0, 1])
        toks = [root] + rng.integers(0, V, len(parent) - 1).tolist()
        be.verify(rng.integers(0, V, 8).tolist())  # the GPU test's poison: a junk verify, nothing kept
        be.commit(0)
        if tree:
            be.verify_tree(toks, parent)
            be.commit_path(path)
        else:
            be.verify(toks)
            be.commit(len(path))
        assert lib.hist[pos:] == [toks[i] for i in path]
        assert be._uncaught == ([toks[i] for i in path] if root != drafted else [toks[i] for i in path[1:]])
        drafted = be.argmax()[-1]
        be.draft_first(drafted)
        _rows_in_step(lib, be)


class _CountingTreeLib(TreeFakeLib):
    def oj_mtp_eval(self, h, buf, n, pos0, source, hp):
        self.mtp_positions = getattr(self, "mtp_positions", 0) + n
        return super().oj_mtp_eval(h, buf, n, pos0, source, hp)


def test_tree_prefill_is_one_batched_pass_whose_mtp_rows_the_drafts_keep(monkeypatch):
    """A prompt longer than one oj_eval goes through one oj_prefill that makes its MTP rows in the
    engine: the draft source catches nothing up (before, every prompt position was its own MTP
    step, and the prompt 8 positions per oj_eval), and the output is still plain decoding's. A
    short prompt keeps the old path (its rows from the copied hiddens)."""
    from openjet_plugin.model_file import open_model
    from openjet_plugin.speculative_native import native_tree_decoder
    from openjet_plugin.speculative_tree import TreePolicy

    libs = install_fake(monkeypatch, _CountingTreeLib)
    be = native.NativeBackend(open_model(DEFAULT_GGUF), n_ctx=1024, draft_depth=0, prefill_chunk=64)
    dec = native_tree_decoder(be, TreePolicy(5))
    lib = libs[-1]
    for prompt in ([(i * 37) % V for i in range(300)], list(range(100, 140))):
        lib.prefills, lib.mtp_positions = [], 0
        r = dec.generate(prompt, GREEDY, max_tokens=1)           # the prefill and the first cycle
        assert r.tokens == _plain(prompt, 1)
        assert lib.prefills == [(0, len(prompt) - 1)]
        assert lib.mtp_positions <= 2 * 5, "the draft source remade the prompt's MTP rows"
        r = dec.generate(prompt, GREEDY, max_tokens=40)
        assert r.tokens == _plain(prompt, 40)
        assert r.stats.drafts_accepted > 0
    lib.prefills, lib.mtp_positions = [], 0
    short = [5, 17, 300, 4000, 12]
    assert dec.generate(short, GREEDY, max_tokens=12).tokens == _plain(short, 12)
    assert lib.prefills == [] and lib.mtp_positions >= len(short) - 1
