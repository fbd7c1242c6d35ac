"""NativeBackend's bookkeeping (MTP rows owed, verify/commit, checkpoints) and the engine's
speculative loop above it, on the CPU: `FakeLib` implements the C API of native/openjet.h with
engine.cu's rules — the hidden window (OJ_H_MAIN only reaches the hiddens of the last evaluation
and the position before it), contiguous MTP rows, commit of a prefix of the last verify,
checkpoints — over a toy model whose next token is a hash of the whole committed history (so a
token lost or doubled in the state changes every later output, as a recurrent state would).
The GPU tests run the same paths on the real engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin import _native
from openjet_plugin.backends import native
from openjet_plugin.engine import Engine

V = 4096          # the default model's vocabulary: its tokenizer turns text into these ids


def _mix(h: int, t: int) -> int:
    return (h * 1000003 + t + 1) % (1 << 61)


class FakeLib:
    """The oj_* entry points NativeBackend calls, with engine.cu's state machine."""

    def __init__(self, ffi):
        self.ffi = ffi
        self.error = ffi.new("char[]", b"")
        self.n_ckpt = 64
        self.oj_reset(None)

    # --- the toy model: greedy next token after history h; the MTP head guesses it 3 times in 4
    def _next(self, h: int) -> int:
        return h % V

    def _fail(self, msg: str) -> int:
        self.error = self.ffi.new("char[]", msg.encode())
        return 1

    def oj_last_error(self, h):
        return self.error

    def oj_reset(self, h):
        self.hist: list[int] = []            # committed tokens
        self.hashes = [0]                    # hashes[p] = hash of hist[:p]
        self.last_start = self.last_n = self.prev_row = self.uncommitted = 0
        self.verify_toks: list[int] = []
        self.out: list[int] = []
        self.mtp_n_past = self.last_mtp_n = 0
        self.mtp_rows: dict[int, tuple] = {}
        self.draft: list[int] = []
        self.draft_h = None
        self.ckpt: dict[int, tuple] = {}
        self.verifies = 0
        return 0

    def oj_n_past(self, h, out):
        out[0] = len(self.hist)
        return 0

    def _evaluate(self, buf, n):
        toks = [int(buf[i]) for i in range(n)]
        if any(not 0 <= t < V for t in toks):
            return self._fail("token id outside the vocabulary")
        self.uncommitted = 0
        self.last_start = len(self.hist)
        self.last_n = n
        self.prev_row = 0
        hs, self.out = self.hashes[-1], []
        self.win = [self.hashes[-1]]          # window row 0 .. n: history hashes before/after each token
        for t in toks:
            hs = _mix(hs, t)
            self.out.append(self._next(hs))
            self.win.append(hs)
        self.verify_toks = toks
        self.uncommitted = n
        return 0

    def oj_verify(self, h, buf, n):
        self.verifies += 1
        return self._evaluate(buf, n)

    def oj_commit(self, h, n):
        if self.uncommitted == 0 or not 0 <= n <= self.uncommitted:
            return self._fail(f"commit({n}) after a verify of {self.uncommitted}")
        for t in self.verify_toks[:n]:
            self.hist.append(t)
            self.hashes.append(_mix(self.hashes[-1], t))
        self.uncommitted = 0
        return 0

    def oj_eval(self, h, buf, n):
        rc = self._evaluate(buf, n)
        return rc or self.oj_commit(h, n)

    def oj_get_argmax(self, h, out, n):
        if not 1 <= n <= self.last_n:
            return self._fail("argmax: n outside the last eval")
        for i in range(n):
            out[i] = self.out[i]
        return 0

    def oj_get_logits(self, h, index, out, n):
        if not 0 <= index < self.last_n:
            return self._fail("logits index")
        row = np.frombuffer(self.ffi.buffer(out, n * 4), dtype=np.float32)
        rng = np.random.default_rng(self.win[index + 1] % (1 << 32))
        row[:] = rng.normal(size=n).astype(np.float32)
        row[self.out[index]] = 8.0
        return 0

    def oj_mtp_eval(self, h, buf, n, pos0, source, hp):
        toks = [int(buf[i]) for i in range(n)]
        if pos0 > self.mtp_n_past:
            return self._fail(f"MTP pos0 {pos0} leaves a hole after {self.mtp_n_past}")
        if source == 0:                        # OJ_H_MAIN: the window of the last evaluation only
            first = pos0 - self.last_start
            if first < 0 or first + n - 1 > self.last_n:
                return self._fail(f"OJ_H_MAIN needs hiddens of {pos0 - 1}..{pos0 + n - 2}, the window holds "
                                  f"{self.last_start - 1}..{self.last_start + self.last_n - 1}")
            hs = [self.win[first + i] for i in range(n)]
        elif source == 1:
            if n != 1 or self.draft_h is None:
                return self._fail("OJ_H_DRAFT chains one position")
            hs = [self.draft_h]
        else:
            return self._fail("h source")
        self.draft = []
        for i, (t, hh) in enumerate(zip(toks, hs)):
            guess_h = _mix(hh, t)              # what the main model's history would be after t
            self.draft.append(self._next(guess_h) if guess_h % 4 else (self._next(guess_h) + 1) % V)
            self.draft_h = guess_h
        self.mtp_n_past = pos0 + n
        self.last_mtp_n = n
        return 0

    def oj_get_draft_logits(self, h, index, out, n):
        row = np.frombuffer(self.ffi.buffer(out, n * 4), dtype=np.float32)
        rng = np.random.default_rng(self.draft[index] + 17)
        row[:] = rng.normal(size=n).astype(np.float32)
        row[self.draft[index]] = 6.0
        return 0

    def oj_get_draft_argmax(self, h, out, n):
        for i in range(n):
            out[i] = self.draft[i]
        return 0

    def oj_checkpoint_save(self, h, slot):
        if not 0 <= slot < self.n_ckpt:
            return self._fail("slot")
        self.uncommitted = 0
        self.ckpt[slot] = (list(self.hist), list(self.hashes))
        return 0

    def oj_checkpoint_restore(self, h, slot, out):
        if slot not in self.ckpt:
            return self._fail("never saved")
        self.hist, self.hashes = list(self.ckpt[slot][0]), list(self.ckpt[slot][1])
        self.uncommitted = 0
        self.last_start, self.last_n = len(self.hist), 0
        self.win = [self.hashes[-1]]
        self.mtp_n_past = min(self.mtp_n_past, len(self.hist))
        if out != self.ffi.NULL:
            out[0] = len(self.hist)
        return 0

    def oj_draft_vocab_size(self, h, out):
        out[0] = V
        return 0

    def oj_set_draft_vocab(self, h, ids, n):
        return 0


@pytest.fixture()
def fake_native(monkeypatch):
    ffi = _native.make_ffi()
    libs: list[FakeLib] = []

    def load():
        lib = FakeLib(ffi)
        libs.append(lib)
        return SimpleNamespace(ffi=ffi, lib=lib)

    monkeypatch.setattr(_native, "load", load)
    monkeypatch.setattr(native.NativeBackend, "_create", lambda self, mf, kv, dev: ffi.new("int32_t *"))
    return libs


@pytest.fixture(scope="module")
def template():
    eng = openjet_plugin.load(backend="llama.cpp", n_ctx=256)
    yield eng
    eng.close()


def _engine(template, depth: int, n_ctx: int = 256, **checkpoints) -> Engine:
    from openjet_plugin.model_file import open_model

    mf = open_model(template.model_path)
    be = native.NativeBackend(mf, n_ctx=n_ctx, draft_depth=depth, **checkpoints)
    return Engine(be, model_path=template.model_path, config=template.config, metadata=template.metadata,
                  chat_template_source=template.chat_template, eog_tokens=(), token_eos=None,
                  backend_reason="fake native library", model_file=mf)


PROMPTS = ["def f(x):\n    return", "import sys\n", "class A:\n    pass\n\n", "x"]


@pytest.mark.parametrize("depth", [1, 2, 4, 7])
def test_speculative_engine_on_the_native_bookkeeping_equals_plain(fake_native, template, depth):
    plain = _engine(template, 0)
    spec = _engine(template, depth)
    assert plain._speculator is None and spec._speculator is not None
    for max_tokens in (1, 2, 3, 17, 40):      # small limits force depth-0 (draft-less) cycles
        for p in PROMPTS:
            want = plain.generate(p, max_tokens=max_tokens, temperature=0)
            got = spec.generate(p, max_tokens=max_tokens, temperature=0)
            assert got.tokens == want.tokens, (p, max_tokens)
    lib = fake_native[-1]
    assert lib.hist == spec._tokens                          # the engine knows exactly what is in the state
    st = spec.last_stats
    assert st.drafts_accepted > 0 and st.cycles < st.generated_tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 7, 9])
def test_a_turn_that_extends_the_state_exactly(fake_native, template, max_tokens):
    """Token-list turns: the next prompt is the state plus the last emitted token plus more, so
    nothing is re-evaluated and the MTP rows owed by the last cycle (one that may have drafted
    nothing) must still be made from the right hiddens."""
    spec, plain = _engine(template, 4), _engine(template, 0)
    toks = spec.tokenize(PROMPTS[0])
    for turn in range(5):
        got = spec.generate(toks, max_tokens=max_tokens, temperature=0)
        want = plain.generate(toks, max_tokens=max_tokens, temperature=0)
        assert got.tokens == want.tokens, turn
        if turn:
            assert got.stats.cached_prompt_tokens == len(toks) - 3   # all but out[-1] and the 2 new
        toks = toks + list(got.tokens) + [17 + turn, 29]


def test_conversation_turns_and_repeats_resume_from_checkpoints(fake_native, template):
    spec, plain = _engine(template, 4), _engine(template, 0)
    text = PROMPTS[0]
    for turn in range(4):
        got = spec.generate(text, max_tokens=12, temperature=0)
        want = plain.generate(text, max_tokens=12, temperature=0)
        assert got.tokens == want.tokens, turn
        if turn:
            assert got.stats.cached_prompt_tokens > 0
        again = spec.generate(text, max_tokens=12, temperature=0)
        assert again.tokens == want.tokens
        assert again.stats.cached_prompt_tokens == len(spec.tokenize(text)) - 1
        text = text + got.text + f"\n# turn {turn}\n"
    # an edit earlier in the history goes back to a checkpoint or resets, with the same answer
    edited = "import os\n" + text
    assert spec.generate(edited, max_tokens=12, temperature=0).tokens == \
        plain.generate(edited, max_tokens=12, temperature=0).tokens


def test_sampled_speculation_on_the_native_bookkeeping(fake_native, template):
    spec = _engine(template, 3)
    a = spec.generate(PROMPTS[1], max_tokens=30, temperature=0.8, seed=3)
    b = spec.generate(PROMPTS[1], max_tokens=30, temperature=0.8, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 30
    assert fake_native[-1].hist == spec._tokens


def test_a_stream_dropped_mid_cycle_leaves_the_cache_consistent(fake_native, template):
    spec, plain = _engine(template, 4), _engine(template, 0)
    it = spec.generate(PROMPTS[2], max_tokens=40, temperature=0, stream=True)
    next(it)
    next(it)
    it.close()
    assert fake_native[-2].hist == spec._tokens
    assert spec.generate(PROMPTS[2], max_tokens=20, temperature=0).tokens == \
        plain.generate(PROMPTS[2], max_tokens=20, temperature=0).tokens


@pytest.mark.parametrize("depth", [0, 4])
def test_an_edit_in_a_long_conversation_resumes_from_the_nearest_checkpoint(fake_native, template, depth):
    """Issue 9's edit rule on the native bookkeeping: with a checkpoint every N tokens, changing a
    token in the middle re-evaluates at most N + (the tokens from the edit on), and answers as a
    fresh engine does."""
    N = 32
    spec = _engine(template, depth, n_ctx=1024, n_checkpoints=24, checkpoint_interval=N)
    plain = _engine(template, 0, n_ctx=1024)
    rng = np.random.default_rng(7)
    history = rng.integers(0, V, 600).tolist()
    spec.generate(history, max_tokens=4, temperature=0)
    for edit_at in (450, 301, 577):
        history = history[:edit_at] + [(history[edit_at] + 1) % V] + history[edit_at + 1:]
        got = spec.generate(history, max_tokens=6, temperature=0)
        want = plain.generate(history, max_tokens=6, temperature=0)
        assert got.tokens == want.tokens
        redone = len(history) - got.stats.cached_prompt_tokens
        assert redone <= N + (len(history) - edit_at), (edit_at, redone)
        assert got.stats.cached_prompt_tokens >= edit_at - N
    assert fake_native[-2].hist == spec._tokens
