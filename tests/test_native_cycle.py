"""The fused speculative cycle (oj_cycle, issue 8) on the CPU.

- NativeSpeculator's fused path over `ToyBackend`, a backend whose main model is a deterministic
  function of the history and whose MTP head is right three times in four: the emitted stream is
  plain greedy decoding; the cycles, depths, acceptances and stats are the host path's; drafts of
  the last call are verified only for its (n_past, token); max_emit holds; sampled, penalised and
  biased requests, and a library without oj_cycle, take the host path.
- NativeBackend.cycle over test_native_bookkeeping's FakeLib with oj_cycle added under the
  header's contract (`CycleLib`): its argument checks, the MTP bookkeeping afterwards, the same
  results as verify + commit + draft_first/draft_next, and the bookkeeping tests of that file
  again with the fused cycle in the loop.
tests/test_native_cycle_gpu.py runs the same comparisons on the engine.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin import _native
from openjet_plugin.backends import native
from openjet_plugin.errors import ContextOverflowError
from openjet_plugin.sampling import SamplingParams
from openjet_plugin.speculative import DepthPolicy, DraftVocab, ForcedAcceptanceDrafts, verify_greedy
from openjet_plugin.speculative_native import NativeSpeculator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_bookkeeping as nb  # noqa: E402

GREEDY = SamplingParams(temperature=0)
VT = 50           # the toy's vocabulary


# --- a toy backend ---------------------------------------------------------------------------------

def _next(hist: list[int]) -> int:
    """The toy main model's greedy token after `hist` (it reads the last two tokens and the length,
    so a token lost or doubled in the state changes the output)."""
    b = hist[-2] if len(hist) > 1 else 0
    return (hist[-1] * 31 + b * 17 + len(hist) * 7) % VT


def _guess(hist: list[int]) -> int:
    """The toy MTP head: the main model's token, except at one history in four."""
    t = _next(hist)
    return t if (len(hist) * 13 + hist[-1]) % 4 else (t + 1) % VT


def _plain(prompt: list[int], n: int) -> list[int]:
    hist = list(prompt)
    for _ in range(n):
        hist.append(_next(hist))
    return hist[len(prompt):]


class ToyBackend:
    """The native backend's speculative surface over the toy model, with the engine's rules: the
    current token is not in the state, commit keeps a prefix of the last verify, and a cycle
    with n_draft > 0 needs the current token's MTP row (made by draft_first or by the last cycle
    for its next token)."""

    name = "toy"

    def __init__(self, n_ctx: int = 512, depth: int = 4, cycle: bool = True):
        self.n_ctx, self.n_vocab, self.draft_depth = n_ctx, VT, depth
        self.supports_speculative = depth > 0
        self.supports_cycle = cycle
        self.hist: list[int] = []
        self.row: tuple[int, int] | None = None   # (position, token) of the MTP row ahead
        self._chain: list[int] | None = None      # the history the next draft_next extends
        self._verify: list[int] | None = None
        self._top: list[int] = []
        self._draft_vocab_len = 0
        self.ids: set[int] | None = None
        self.calls: Counter = Counter()
        self.cycles: list[tuple] = []             # (n_past, tokens, n_draft, vocab or None)

    @property
    def n_past(self) -> int:
        return len(self.hist)

    def _targets(self, tokens: list[int]) -> list[int]:
        assert self.n_past + len(tokens) <= self.n_ctx, "verify beyond the context"
        return [_next(self.hist + tokens[:i + 1]) for i in range(len(tokens))]

    def _draft(self) -> int:
        d = _guess(self._chain)
        if self.ids is not None and d not in self.ids:
            d = min(self.ids)
        self._last_draft = d
        return d

    def verify(self, tokens):
        self.calls["verify"] += 1
        self._verify = [int(t) for t in tokens]
        self._top = self._targets(self._verify)

    def argmax(self):
        return list(self._top)

    def logits(self, i):
        row = np.zeros(VT, dtype=np.float32)
        row[self._top[i]] = 10.0
        return row

    def commit(self, n):
        self.calls["commit"] += 1
        self.hist += self._verify[:n]
        self._verify = None

    def _flush_mtp(self):
        pass

    def draft_first(self, token):
        if not self.supports_speculative:
            raise RuntimeError("no MTP head")
        self.calls["draft_first"] += 1
        self.row = (self.n_past, int(token))
        self._chain = self.hist + [int(token)]
        return self._draft()

    def draft_next(self, token, pos):
        assert self._chain is not None and pos == len(self._chain), "draft_next off the chain"
        self._chain.append(int(token))
        return self._draft()

    def draft_logits(self, index):
        row = np.full(VT, -4.0, dtype=np.float32)
        row[self._last_draft] = 4.0
        return row

    def set_draft_vocab(self, ids):
        self.ids = None if ids is None else {int(i) for i in ids}
        self._draft_vocab_len = 0 if ids is None else len(ids)

    def cycle(self, tokens, n_draft):
        tokens = [int(t) for t in tokens]
        pos = self.n_past
        if n_draft and self.row != (pos, tokens[0]):
            raise RuntimeError(f"no MTP row for token {tokens[0]} at {pos} (row: {self.row})")
        assert pos + len(tokens) + n_draft <= self.n_ctx, "drafts beyond the context"
        self.calls["cycle"] += 1
        self.cycles.append((pos, tokens, n_draft, None if self.ids is None else set(self.ids)))
        top = self._targets(tokens)
        v = verify_greedy(top, tokens[1:])
        self.hist += tokens[:1 + v.n_accepted]
        drafts = []
        if n_draft:
            self.row = (self.n_past, v.token)
            self._chain = self.hist + [v.token]
            for _ in range(n_draft):
                drafts.append(self._draft())
                self._chain.append(drafts[-1])
        self._chain = None                        # draft results are not readable after a cycle
        return v.n_accepted, tokens[1:1 + v.n_accepted] + [v.token], drafts


def _generate(spec: NativeSpeculator, prompt: list[int], n: int, params=GREEDY, log=None) -> list[int]:
    """The engine's loop: the state holds prompt[:-1], each cycle's last token starts the next."""
    b = spec.b
    b.hist = list(prompt[:-1])
    spec.begin(prompt)
    rng = np.random.default_rng(0)
    out, tok, hist = [], prompt[-1], list(prompt)
    while len(out) < n:
        max_emit = n - len(out)
        em, depth, acc = spec.cycle(tok, hist, params, rng, max_emit)
        assert 1 <= len(em) <= max_emit and len(em) == acc + 1 and acc <= depth
        if log is not None:
            log.append((b.n_past, em, depth, acc, spec.policy.current))
        out += em
        hist += em
        tok = em[-1]
    assert b.hist == hist[:-1]                    # the state holds exactly the history but the last
    return out


PROMPTS = [[3], [1, 2], [7, 7, 7, 7], [10, 20, 30, 40, 5, 6]]


@pytest.mark.parametrize("depth", [1, 2, 4, 7])
def test_fused_cycles_emit_plain_greedy_decoding(depth):
    for p in PROMPTS:
        for n in (1, 2, 3, 9, 60):
            b = ToyBackend(depth=depth)
            spec = NativeSpeculator(b, depth)
            assert _generate(spec, p, n) == _plain(p, n), (p, n)
            if n > 1:
                # one host draft step per request (the first cycle's row), then only fused calls
                assert b.calls["cycle"] >= 1 and b.calls["draft_first"] == 1 and b.calls["verify"] == 0
                assert all(nd == depth for _, _, nd, _ in b.cycles)
                assert sum(len(t) - 1 for _, t, _, _ in b.cycles) > 0


@pytest.mark.parametrize("depth,adaptive", [(1, True), (4, True), (4, False), (7, True)])
def test_fused_cycles_follow_the_host_path_cycle_by_cycle(depth, adaptive):
    """Without a draft vocabulary the in-call drafts are the host path's: the same cycles, depths,
    acceptances, policy and stats."""
    logs, stats = [], []
    for fused in (True, False):
        b = ToyBackend(depth=depth, cycle=fused)
        spec = NativeSpeculator(b, DepthPolicy(depth, adaptive=adaptive))
        log: list = []
        assert _generate(spec, PROMPTS[3], 80, log=log) == _plain(PROMPTS[3], 80)
        assert (b.calls["cycle"] > 0) == fused and (b.calls["verify"] > 0) != fused
        logs.append(log)
        stats.append(spec.stats)
    assert logs[0] == logs[1]
    assert stats[0] == stats[1] and stats[0].drafts_accepted > 0


def test_drafts_of_the_last_call_are_verified_only_for_its_token_and_position():
    b = ToyBackend(depth=4)
    spec = NativeSpeculator(b, DepthPolicy(4, adaptive=False))
    p = PROMPTS[2]
    b.hist = list(p[:-1])
    spec.begin(p)
    rng = np.random.default_rng(0)
    em, _, _ = spec.cycle(p[-1], p, GREEDY, rng, 50)
    pos, tok, drafts = spec._next
    assert (pos, tok) == (b.n_past, em[-1]) and len(drafts) == 4
    # the same token at the same position: the call's drafts, no host draft step
    first = b.calls["draft_first"]
    em2, _, _ = spec.cycle(em[-1], p + em, GREEDY, rng, 50)
    assert b.cycles[-1][1] == [em[-1]] + drafts and b.calls["draft_first"] == first
    # another token at that position: host drafts from its own row
    pos, tok, drafts = spec._next
    other = (tok + 1) % VT
    spec.cycle(other, p + em + em2[:-1] + [other], GREEDY, rng, 50)
    assert b.calls["draft_first"] == first + 1 and b.cycles[-1][0] == pos
    assert b.cycles[-1][1][0] == other and b.row[0] == b.n_past
    # the same token after the state moved on (a host cycle in between): host drafts again
    pos, tok, drafts = spec._next
    b.verify([tok])
    b.commit(1)
    spec.cycle(tok, [], GREEDY, rng, 50)
    assert b.calls["draft_first"] == first + 2 and b.cycles[-1][0] == pos + 1
    # begin() forgets the call's drafts
    spec.begin(p)
    assert spec._next is None


@pytest.mark.parametrize("max_emit", [1, 2, 3, 5, 8])
def test_max_emit_limits_the_drafts_verified(max_emit):
    b = ToyBackend(depth=7)
    spec = NativeSpeculator(b, DepthPolicy(7, adaptive=False))
    p = PROMPTS[3]
    b.hist = list(p[:-1])
    spec.begin(p)
    rng = np.random.default_rng(0)
    tok, hist = p[-1], list(p)
    for _ in range(6):
        em, depth, acc = spec.cycle(tok, hist, GREEDY, rng, max_emit)
        assert len(em) <= max_emit and depth <= max_emit - 1
        assert not b.cycles or len(b.cycles[-1][1]) <= max_emit
        hist += em
        tok = em[-1]
    assert _plain(p, len(hist) - len(p)) == hist[len(p):]
    if max_emit == 1:                     # never drafts and never has a row: the host path
        assert b.calls["cycle"] == 0 and b.calls["verify"] == 6
    else:
        assert b.calls["cycle"] == 6 and b.calls["verify"] == 0


def test_the_context_end_is_never_passed():
    """Drafts are asked only where the next verify fits (n_past + 1 + k + n_draft < n_ctx) and the
    last cycles, with no room for drafts, go through the host path."""
    for n_ctx in (9, 10, 13, 20):
        for depth in (1, 4, 7):
            p = PROMPTS[3]
            b = ToyBackend(n_ctx=n_ctx, depth=depth)
            spec = NativeSpeculator(b, depth)
            n = n_ctx - len(p) + 1           # up to the last position the context holds
            assert _generate(spec, p, n) == _plain(p, n), (n_ctx, depth)
            assert b.n_past == n_ctx
            for pos, toks, nd, _ in b.cycles:
                assert pos + len(toks) + nd < n_ctx if nd else pos + len(toks) <= n_ctx


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0, repeat_penalty=1.3),
    SamplingParams(temperature=0, presence_penalty=0.5),
    SamplingParams(temperature=0, logit_bias={3: 1.5}),
], ids=["sampled", "repeat_penalty", "presence_penalty", "logit_bias"])
def test_sampled_penalised_and_biased_requests_take_the_host_path(params):
    b = ToyBackend(depth=4)
    spec = NativeSpeculator(b, 4)
    _generate(spec, PROMPTS[1], 30, params=params)
    assert b.calls["cycle"] == 0 and b.calls["verify"] > 0


def test_a_library_without_oj_cycle_takes_the_host_path():
    b = ToyBackend(depth=4)
    del b.supports_cycle                     # a backend that does not say: no fused cycles
    spec = NativeSpeculator(b, 4)
    assert _generate(spec, PROMPTS[1], 30) == _plain(PROMPTS[1], 30)
    assert b.calls["cycle"] == 0 and b.calls["verify"] > 0


@pytest.mark.parametrize("pattern", [[0], [4], [0, 2, 4, 1, 3]])
def test_oracle_drafts_are_verified_while_the_call_still_drafts(pattern):
    """With an oracle its drafts are the ones verified, and every cycle still drafts the policy's
    maximum in the call (the timing of the steady state); the call's drafts are ignored."""
    p = PROMPTS[3]
    want = _plain(p, 60)
    b = ToyBackend(depth=4)
    spec = NativeSpeculator(b, DepthPolicy(4, adaptive=False))
    spec.oracle = ForcedAcceptanceDrafts(p + want, VT, pattern=pattern)
    proposed = []
    real = spec.oracle.propose

    def propose(*a):
        drafts, qs = real(*a)
        proposed.append(list(drafts))
        return drafts, qs

    spec.oracle.propose = propose
    log: list = []
    assert _generate(spec, p, 60, log=log) == want
    assert [t[1:] for _, t, _, _ in b.cycles if len(t) > 1] == [d for d in proposed if d]
    assert len(b.cycles) == len(log) and all(nd == 4 for _, _, nd, _ in b.cycles)
    assert b.calls["verify"] == 0 and b.calls["draft_first"] == 1    # the first cycle's row only
    assert [acc for *_, acc, _ in log] == [min(pattern[i % len(pattern)], d) for i, (_, _, d, _, _) in enumerate(log)]


def test_the_draft_vocabulary_holds_what_was_emitted_before_each_call():
    p = PROMPTS[3]
    b = ToyBackend(depth=4)
    spec = NativeSpeculator(b, 4, vocab=DraftVocab(range(12), VT))
    assert spec.restricted
    assert _generate(spec, p, 80) == _plain(p, 80)
    assert b.calls["cycle"] > 5
    for pos, toks, nd, ids in b.cycles:
        seen = set(p) | set(b.hist[:pos]) | {toks[0]}
        assert ids is not None and seen <= ids, sorted(seen - ids)


# --- NativeBackend.cycle over the fake library ----------------------------------------------------

class CycleLib(nb.FakeLib):
    """FakeLib with oj_cycle as native/openjet.h states it (ABI 4)."""

    abi = 4

    def __init__(self, ffi):
        super().__init__(ffi)
        self.cycles: list[tuple[int, int, int]] = []      # (n_past, n_tokens, n_draft) of each call

    def oj_cycle(self, h, buf, n, n_draft, n_acc, out, drafts):
        if not 1 <= n <= 8:
            return self._fail(f"oj_cycle: n_tokens {n} outside 1..8")
        if not 0 <= n_draft <= 7:
            return self._fail(f"oj_cycle: n_draft {n_draft} outside 0..7")
        pos = len(self.hist)
        if n_draft and not (self.has_mtp and self.mtp_n_past > pos):
            return self._fail(f"oj_cycle: n_draft {n_draft} needs MTP rows through {pos}, they end at {self.mtp_n_past}")
        toks = [int(buf[i]) for i in range(n)]
        rc = self._evaluate(buf, n)
        if rc:
            return rc
        self.cycles.append((pos, n, n_draft))
        v = verify_greedy(self.out, toks[1:])
        self.oj_commit(h, 1 + v.n_accepted)
        n_acc[0] = v.n_accepted
        for i, t in enumerate(toks[1:1 + v.n_accepted] + [v.token]):
            out[i] = t
        if n_draft:
            # rows of the accepted drafts and of the next token from the verify's hiddens, then the chain
            rc = self.oj_mtp_eval(h, toks[1:1 + v.n_accepted] + [v.token], 1 + v.n_accepted, pos + 1, 0, None)
            for i in range(n_draft):
                if i:
                    rc = rc or self.oj_mtp_eval(h, [drafts[i - 1]], 1, len(self.hist) + i, 1, None)
                if rc:
                    return rc
                drafts[i] = self.draft[-1]
            self.mtp_n_past = len(self.hist) + 1          # the draft rows beyond are provisional
            self.draft, self.draft_h, self.last_mtp_n = [], None, 0    # not readable
        return 0


@pytest.fixture()
def cycle_native(monkeypatch):
    return nb.install_fake(monkeypatch, CycleLib)


@pytest.fixture(scope="module")
def template():
    eng = openjet_plugin.load(backend="llama.cpp", n_ctx=256)
    yield eng
    eng.close()


def _backend(template, depth: int = 4, n_ctx: int = 256) -> native.NativeBackend:
    from openjet_plugin.model_file import open_model

    return native.NativeBackend(open_model(template.model_path), n_ctx=n_ctx, draft_depth=depth)


def test_cycle_abi_matches_the_header():
    from cffi import FFI

    src = _native.cdef_source(_native.SOURCE_HEADER.read_text())
    ffi = FFI()
    ffi.cdef(src)
    assert ffi.dlopen(None).OJ_ABI_VERSION >= native.CYCLE_ABI
    assert "int32_t oj_cycle(" in src


def test_supports_cycle_follows_the_library(cycle_native, template, monkeypatch):
    assert _backend(template).supports_cycle
    monkeypatch.setattr(CycleLib, "abi", 3)
    assert not _backend(template).supports_cycle


def _refused(be, lib, call, exc, match):
    before = (be.n_past, lib.mtp_n_past, list(be._uncaught), be._mtp_upto, be._token_row)
    with pytest.raises(exc, match=match):
        call()
    assert lib.cycles == [] and (be.n_past, lib.mtp_n_past, list(be._uncaught), be._mtp_upto,
                                 be._token_row) == before


def test_cycle_arguments_are_refused_by_name(cycle_native, template):
    be = _backend(template, n_ctx=64)
    lib = cycle_native[-1]
    be.eval([5, 6, 7])
    _refused(be, lib, lambda: be.cycle([], 0), ValueError, "1..8 tokens.*got 0")
    _refused(be, lib, lambda: be.cycle(list(range(9)), 0), ValueError, "1..8 tokens.*got 9")
    for bad in (8, -1, True, 2.0, "1", None):
        _refused(be, lib, lambda: be.cycle([1], bad), ValueError, r"n_draft must be an integer in \[0, 7\]")
    _refused(be, lib, lambda: be.cycle([1, nb.V], 0), ValueError, "outside the vocabulary")
    _refused(be, lib, lambda: be.cycle([-1], 0), ValueError, "outside the vocabulary")
    # the current token's MTP row is missing: the rows end at n_past
    _refused(be, lib, lambda: be.cycle([1, 2], 3), RuntimeError, r"reach 3\b.*n_past \+ 1 = 4")
    # a row made for another token
    be.draft_first(9)
    _refused(be, lib, lambda: be.cycle([1, 2], 3), RuntimeError, r"made for token 9, not 1.*n_past \+ 1 = 4")
    # the context: the verify, and the rows the drafts come from when everything is accepted
    be.eval(list(range(55)))
    _refused(be, lib, lambda: be.cycle(list(range(8)), 0), ContextOverflowError, "66 tokens")
    _refused(be, lib, lambda: be.cycle([1, 2, 3], 4), ContextOverflowError, "n_draft 4 at n_past 58 needs 65")
    # a backend that does not draft takes n_draft 0 only
    plain = _backend(template, depth=0)
    plain.eval([5, 6])
    _refused(plain, cycle_native[-1], lambda: plain.cycle([1], 2), ValueError, "n_draft 2 needs the MTP head")
    k, em, nd = plain.cycle([1, 2], 0)
    assert nd == [] and len(em) == k + 1 and cycle_native[-1].cycles == [(2, 2, 0)]


def test_the_engine_refusals_leave_the_backend_usable(cycle_native, template):
    """A refusal from the library (here: no MTP row, bypassing the backend's own check) raises the
    engine's message and changes nothing: the next cycle runs."""
    from openjet_plugin.errors import NativeEngineError

    be = _backend(template)
    lib = cycle_native[-1]
    be.eval([5, 6, 7])
    be._token_row = (3, 1)                 # the backend believes in a row the engine does not have
    with pytest.raises(NativeEngineError, match="MTP rows through 3, they end at 3"):
        be.cycle([1, 2], 2)
    assert be.n_past == 3 and lib.cycles == []
    be.draft_first(1)
    k, em, nd = be.cycle([1, 2], 2)
    assert be.n_past == 4 + k and len(nd) == 2


def _host_cycle(be, tokens: list[int], n_draft: int) -> tuple[int, list[int], list[int]]:
    """What oj_cycle does, through the host path's calls."""
    be.verify(tokens)
    v = verify_greedy(be.argmax(), tokens[1:])
    be.commit(1 + v.n_accepted)
    drafts = []
    for i in range(n_draft):
        drafts.append(be.draft_first(v.token) if i == 0 else be.draft_next(drafts[-1], be.n_past + i))
    return v.n_accepted, tokens[1:1 + v.n_accepted] + [v.token], drafts


def test_cycle_equals_verify_commit_and_host_drafts(cycle_native, template):
    """Two backends, one through cycle() and one through the host path's calls, from the same
    tokens and partly right drafts: the same acceptances, tokens, drafts, state and MTP rows."""
    a, b = _backend(template, depth=7, n_ctx=512), _backend(template, depth=7, n_ctx=512)
    la, lb = cycle_native[-2], cycle_native[-1]
    prompt = np.random.default_rng(1).integers(0, nb.V, 20).tolist()
    a.eval(prompt[:-1])
    b.eval(prompt[:-1])
    x, fused, last_nd = prompt[-1], [], 0
    rng = np.random.default_rng(2)
    for c in range(40):
        n_tokens, n_draft = 1 + c % 8, [4, 7, 1, 0, 3, 7, 2, 5, 0][c % 9]
        if c % 3 == 1:                      # the engine's own drafts
            drafts = fused[:n_tokens - 1]
        else:                               # the true continuation, some tokens perturbed
            drafts, hs = [], nb._mix(la.hashes[-1], x)
            for _ in range(n_tokens - 1):
                t = la._next(hs)
                drafts.append(t if rng.random() < 0.7 else (t + 1) % nb.V)
                hs = nb._mix(hs, drafts[-1])
        if n_draft and not last_nd:         # no call left this token's row: the host's first step
            a.draft_first(x)
        ka, ema, nda = a.cycle([x] + drafts, n_draft)
        kb, emb, ndb = _host_cycle(b, [x] + drafts, n_draft)
        assert (ka, ema, nda) == (kb, emb, ndb), c
        assert a.argmax() == b.argmax() and np.array_equal(a.logits(len(drafts)), b.logits(len(drafts)))
        assert a.n_past == b.n_past and la.hist == lb.hist
        assert a._uncaught == [] or not n_draft
        x, fused, last_nd = ema[-1], nda, n_draft
    assert len(la.cycles) == 40 and la.verifies == 0 and lb.cycles == []
    nb._rows_in_step(la, a)
    upto = a.n_past
    assert [la.mtp_rows[p] for p in range(upto)] == [lb.mtp_rows[p] for p in range(upto)]


def test_bookkeeping_after_a_cycle(cycle_native, template):
    be = _backend(template)
    lib = cycle_native[-1]
    be.eval([5, 6, 7])
    d = be.draft_first(8)
    assert be._mtp_upto == 4 and be._token_row == (3, 8)
    # n_draft > 0: nothing owed, the rows counted up to the new n_past, the next token's row known
    k, em, nd = be.cycle([8, d], 3)
    n = 4 + k
    assert be.n_past == n and be._uncaught == [] and be._mtp_upto == n and be._token_row == (n, em[-1])
    assert be._last_n == 2 and be._verify_tokens == [] and lib.mtp_n_past == n + 1
    nb._rows_in_step(lib, be)
    # the host path remakes the next token's row identically: its first draft is the call's
    assert be.draft_first(em[-1]) == nd[0] and be._token_row == (n, em[-1])
    # a cycle from that token (its row made by draft_first) without drafting: rows owed as after
    # commit() -- the current token's row exists, the accepted drafts' do not
    x = em[-1]
    right = lib._next(nb._mix(lib.hashes[-1], x))
    k, em, nd = be.cycle([x, right, 0], 0)
    assert k >= 1 and nd == [] and be._uncaught == [right] + ([0] if k == 2 else [])
    assert be._mtp_upto == n + 1 and be._token_row is None and lib.mtp_n_past == n + 1
    # the next evaluation makes the owed rows from the cycle's hiddens
    be.verify([em[-1]])
    be.commit(1)
    assert be._uncaught == [em[-1]]
    be._flush_mtp()
    nb._rows_in_step(lib, be)


def test_a_cycle_without_drafting_after_a_drafting_one(cycle_native, template):
    """The row the last call made for this token counts as not made: a draft-less cycle from it
    owes every committed row, remade from the same hiddens."""
    be = _backend(template)
    lib = cycle_native[-1]
    be.eval([5, 6, 7])
    be.draft_first(8)
    k, em, nd = be.cycle([8], 2)
    n = be.n_past
    k, em2, _ = be.cycle([em[-1]] + nd, 0)
    assert be._uncaught == [em[-1]] + nd[:k] and be._mtp_upto == n
    # another draft-less cycle: the rows owed so far are made from the last cycle's hiddens first
    k, em3, _ = be.cycle([em2[-1]], 0)
    assert be._uncaught == [em2[-1]] and be._mtp_upto == n + len(em2)
    nb._rows_in_step(lib, be)
    be.draft_first(em3[-1])
    assert be._uncaught == [] and be._mtp_upto == be.n_past + 1
    nb._rows_in_step(lib, be)


def test_the_row_of_the_last_call_is_forgotten_where_the_cache_changes(cycle_native, template):
    be = _backend(template)
    be.eval([5, 6, 7])
    be.draft_first(8)
    k, em, nd = be.cycle([8], 2)
    row = be._token_row
    assert row == (be.n_past, em[-1])
    be.save_checkpoint()
    assert be._token_row == row                          # a checkpoint leaves the MTP cache alone
    be.verify([em[-1]])
    be.commit(0)
    assert be._token_row == row                          # commit(0) keeps nothing: the row holds
    be.mtp_eval([nd[0]], be.n_past + 1, "main")
    assert be._token_row == row                          # a row beyond it
    be.mtp_eval([em[-1]], be.n_past, "main")
    assert be._token_row is None                         # rewritten by a caller
    be.draft_first(em[-1])
    be.restore_checkpoint(be.n_past)
    assert be._token_row is None                         # the engine cut the MTP cache at n_past
    be.draft_first(em[-1])
    be.reset()
    assert be._token_row is None
    be.eval([1, 2, 3])
    with pytest.raises(RuntimeError, match=r"n_past \+ 1 = 4"):
        be.cycle([4], 1)


# the bookkeeping tests of test_native_bookkeeping.py again, the library now with oj_cycle
BOOKKEEPING = [
    (nb.test_speculative_engine_on_the_native_bookkeeping_equals_plain, (1,), True),
    (nb.test_speculative_engine_on_the_native_bookkeeping_equals_plain, (4,), True),
    (nb.test_speculative_engine_on_the_native_bookkeeping_equals_plain, (7,), True),
    (nb.test_a_turn_that_extends_the_state_exactly, (1,), False),
    (nb.test_a_turn_that_extends_the_state_exactly, (2,), True),
    (nb.test_a_turn_that_extends_the_state_exactly, (7,), True),
    (nb.test_conversation_turns_and_repeats_resume_from_checkpoints, (), True),
    (nb.test_sampled_speculation_on_the_native_bookkeeping, (), False),
    (nb.test_a_stream_dropped_mid_cycle_leaves_the_cache_consistent, (), True),
    (nb.test_an_edit_in_a_long_conversation_resumes_from_the_nearest_checkpoint, (4,), True),
    (nb.test_prefill_then_decoding_equals_the_eval_path, (4,), True),
    (nb.test_prefill_then_decoding_equals_the_eval_path, (1,), True),
]


@pytest.mark.parametrize("test,args,fused", BOOKKEEPING,
                         ids=[f"{t.__name__[5:]}{list(a)}" for t, a, _ in BOOKKEEPING])
def test_the_bookkeeping_tests_with_oj_cycle(cycle_native, template, test, args, fused):
    test(cycle_native, template, *args)
    calls = sum(len(lib.cycles) for lib in cycle_native)
    assert (calls > 0) == fused, calls


def test_bench_oracle_rows_say_whether_the_draft_pass_is_timed():
    """openjet bench's spec_tps rows: with oj_cycle every cycle also runs the MTP head's draft pass
    (timed, its drafts unused); without it the oracle costs no MTP pass. The note says which."""
    from openjet_plugin.bench import spec

    class Fused:
        supports_cycle = True
        supports_speculative = True

    class Host:
        supports_cycle = False
        supports_speculative = True

    assert spec.oracle_note(Fused()) == spec.ORACLE_CYCLE_NOTE and "draft pass are timed" in spec.ORACLE_CYCLE_NOTE
    assert spec.oracle_note(Host()) == spec.ORACLE_NOTE and "no MTP draft pass" in spec.ORACLE_NOTE
