"""NativeBackend's bookkeeping (MTP rows owed, verify/commit, checkpoints) and the engine's
speculative loop above it, on the CPU: `FakeLib` implements the C API of native/openjet.h with
engine.cu's rules — the hidden window (OJ_H_MAIN only reaches the hiddens of the last evaluation
and the position before it), contiguous MTP rows, commit of a prefix of the last verify,
checkpoints, oj_prefill (issue 9: a span committed at once, the MTP cache following only when it
ended at n_past on entry, the window left as after a one-token eval) — over a toy model whose next
token is a hash of the whole committed history (so a token lost or doubled in the state changes
every later output, as a recurrent state would). Every MTP row records the token and the hidden
(history hash) it was made from, so a row made from the wrong hidden is caught.
The GPU tests (tests/test_native_gpu.py, test_native_spec_gpu.py, test_native_prefill_gpu.py) run
the same paths on the real engine.
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

    abi = 3
    OJ_MAX_POSITIONS = 8   # the header constant the backend reads (this fake's oj_* take 8 positions)

    def __init__(self, ffi):
        self.ffi = ffi
        self.error = ffi.new("char[]", b"")
        self.n_ckpt = 64
        self.prefill_chunk = 0
        self.has_mtp = True
        self.created: list[dict] = []
        self.prefills: list[tuple[int, int]] = []     # (n_past on entry, tokens) of every oj_prefill
        self.saves: list[int] = []                    # n_past of every oj_checkpoint_save
        self.oj_reset(None)

    def oj_abi_version(self):
        return self.abi

    def oj_engine_create(self, desc, out):
        """Reads what the real engine reads from the description; the handle is a dummy."""
        self.n_ckpt = int(desc.n_checkpoints)
        self.prefill_chunk = int(desc.prefill_chunk)
        self.created.append({"n_ctx": int(desc.n_ctx), "n_checkpoints": self.n_ckpt,
                             "prefill_chunk": self.prefill_chunk, "n_tensors": int(desc.n_tensors)})
        if self.prefill_chunk and not 64 <= self.prefill_chunk <= 4096:
            return self._fail(f"prefill_chunk is {self.prefill_chunk}; allowed 0 (no oj_prefill) or 64..4096")
        out[0] = self.ffi.cast("oj_engine *", 1)
        return 0

    def oj_engine_free(self, h):
        pass

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
        self.mtp_rows: dict[int, tuple] = {}          # MTP position -> (token, hidden it was made from)
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

    def oj_prefill(self, h, buf, n):
        if self.prefill_chunk == 0:
            return self._fail("oj_prefill needs prefill buffers: create the engine with prefill_chunk > 0 (it was 0)")
        toks = [int(buf[i]) for i in range(n)]
        if n < 1 or any(not 0 <= t < V for t in toks):
            return self._fail("oj_prefill: no tokens, or a token id outside the vocabulary")
        start = len(self.hist)
        self.prefills.append((start, n))
        self.uncommitted = 0                     # a pending verify counts as oj_commit(0)
        follows = self.has_mtp and self.mtp_n_past == start
        for t in toks:
            self.hist.append(t)
            self.hashes.append(_mix(self.hashes[-1], t))
        if follows:                              # MTP position p from token p and h_{p-1}
            for p in range(start, len(self.hist)):
                self.mtp_rows[p] = (self.hist[p], self.hashes[p])
            self.mtp_n_past = len(self.hist)
            self.last_mtp_n, self.draft_h = 0, None   # no draft results until the next oj_mtp_eval
        # results and hidden window as after a one-token oj_eval of the last position
        self.last_start, self.last_n = len(self.hist) - 1, 1
        self.win = [self.hashes[-2], self.hashes[-1]]
        self.out = [self._next(self.hashes[-1])]
        self.verify_toks = []
        return 0

    def oj_mtp_n_past(self, h, out):
        out[0] = self.mtp_n_past
        return 0

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
            self.mtp_rows[pos0 + i] = (t, hh)
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
        self.saves.append(len(self.hist))
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


def install_fake(monkeypatch, lib_class) -> list:
    """_native.load gives a fresh lib_class(ffi) per backend (collected in the returned list), over
    the source tree's header, not a stale copy a local build left beside the library."""
    monkeypatch.setattr(_native, "header_path", lambda: _native.SOURCE_HEADER)
    ffi = _native.make_ffi()
    libs: list = []

    def load():
        lib = lib_class(ffi)
        libs.append(lib)
        return SimpleNamespace(ffi=ffi, lib=lib)

    monkeypatch.setattr(_native, "load", load)
    return libs


@pytest.fixture()
def fake_native(monkeypatch):
    return install_fake(monkeypatch, FakeLib)


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


def test_eval_pass_argmax_is_one_oj_eval_up_to_the_headers_limit(fake_native, template):
    # eval_argmax splits 9 tokens into calls of CALL_POSITIONS; eval_pass_argmax makes one oj_eval
    # of them where the library's OJ_MAX_POSITIONS allows it (this fake: 8), and names the limit
    # where it does not, leaving the state as it was
    from openjet_plugin.model_file import open_model

    with open_model(template.model_path) as mf:
        be = native.NativeBackend(mf, n_ctx=64, draft_depth=0, prefill_chunk=0)
        try:
            lib = fake_native[-1]
            assert be.max_positions == lib.OJ_MAX_POSITIONS == 8
            evals = []
            real = lib.oj_eval
            lib.oj_eval = lambda h, buf, n: evals.append(n) or real(h, buf, n)
            assert be.eval_pass_argmax(list(range(3, 11))) == be.argmax()[-1]
            assert evals == [8] and be.n_past == 8
            with pytest.raises(ValueError, match="1..8 tokens, got 9"):
                be.eval_pass_argmax(list(range(9)))
            assert evals == [8] and be.n_past == 8
            be.eval_argmax(list(range(9)))
            assert evals == [8, 8, 1] and be.n_past == 17
        finally:
            be.close()


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


# --- batched prefill (issue 9): oj_prefill under the same rules ---------------------------------------

def _rows_in_step(lib: FakeLib, be) -> None:
    """Every committed MTP row the backend counts as made from main hiddens is (token p, h_{p-1})."""
    upto = min(be._mtp_upto, len(lib.hist))    # a first draft step makes the current token's row too
    assert upto > 0
    wrong = [p for p in range(upto) if lib.mtp_rows.get(p) != (lib.hist[p], lib.hashes[p])]
    assert not wrong, f"MTP rows made from the wrong token or hidden at {wrong[:5]}"


def _long_prompts(n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, V, int(k)).tolist() for k in (9, 40, 300, 17, 120, 5)[:n]]


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_prefill_then_decoding_equals_the_eval_path(fake_native, template, depth):
    """Prompts through oj_prefill, then plain or speculative decoding: the tokens of the
    8-per-oj_eval engine, turn after turn (each turn extends the last: the span starts where a
    cycle left draft rows beyond n_past, which the backend must cut first)."""
    old = _engine(template, depth, n_ctx=2048, prefill_chunk=0)
    new = _engine(template, depth, n_ctx=2048)
    lib_old, lib_new = fake_native[-2], fake_native[-1]
    assert new._backend.prefill_chunk == native.PREFILL_CHUNK and lib_new.created[-1]["prefill_chunk"] == 2048
    assert lib_old.created[-1]["prefill_chunk"] == 0
    toks: list[int] = []
    for turn, p in enumerate(_long_prompts()):
        toks = toks + p
        want = old.generate(toks, max_tokens=13, temperature=0)
        got = new.generate(toks, max_tokens=13, temperature=0)
        assert got.tokens == want.tokens, turn
        assert got.stats.cached_prompt_tokens == want.stats.cached_prompt_tokens, turn
        toks = toks + list(got.tokens)
        assert lib_new.hist == new._tokens
        if new._speculator is not None:
            _rows_in_step(lib_new, new._backend)
    assert lib_old.prefills == [] and lib_new.prefills, "the prefill engine never called oj_prefill"
    assert new._backend.prefilled_positions == sum(n for _, n in lib_new.prefills) > 400
    assert old._backend.prefilled_positions == 0


def test_plain_and_speculating_backends_prefill_a_prompt_alike(fake_native, template):
    """draft_depth 0 and 4 send a fresh prompt through the same oj_prefill call (the same state, so
    greedy outputs can be compared exactly); the speculating one's MTP rows are the engine's."""
    plain, spec = _engine(template, 0, n_ctx=1024), _engine(template, 4, n_ctx=1024)
    lib_plain, lib_spec = fake_native[-2], fake_native[-1]
    prompt = _long_prompts()[2]
    assert plain.generate(prompt, max_tokens=4, temperature=0).tokens == \
        spec.generate(prompt, max_tokens=4, temperature=0).tokens
    assert lib_plain.prefills == lib_spec.prefills[:1] == [(0, len(prompt) - 1)]
    assert lib_spec.mtp_n_past >= len(prompt) - 1
    _rows_in_step(lib_spec, spec._backend)


def test_prefill_returns_the_logits_and_argmax_of_the_last_position(fake_native, template):
    from openjet_plugin.model_file import open_model

    mf = open_model(template.model_path)
    a = native.NativeBackend(mf, n_ctx=512, draft_depth=4, prefill_chunk=0)
    b = native.NativeBackend(mf, n_ctx=512, draft_depth=4, prefill_chunk=64)
    prompt = _long_prompts()[1]
    assert np.array_equal(a.eval(prompt), b.eval(prompt))
    assert b.argmax() == [a.argmax()[-1]]                    # one position, as after a one-token eval
    assert fake_native[-1].prefills == [(0, len(prompt))]
    # the engine made the span's MTP rows: the first draft step finds h of the last position in
    # the window and no row owed
    assert b._mtp_upto == b.n_past and not b._uncaught
    assert b.draft_first(7) == a.draft_first(7)
    _rows_in_step(fake_native[-1], b)
    # a short span keeps oj_eval (per-position results)
    assert np.array_equal(a.eval([1, 2, 3]), b.eval([1, 2, 3]))
    assert len(b.argmax()) == 3 and fake_native[-1].prefills == [(0, len(prompt))]


def test_prefill_after_a_cycle_that_left_draft_rows_beyond_n_past(fake_native, template):
    """A cycle whose drafts were all rejected leaves MTP rows beyond n_past and none owed: the
    engine's prefill would not follow the cache, so the backend cuts it with a first oj_eval."""
    from openjet_plugin.model_file import open_model

    be = native.NativeBackend(open_model(template.model_path), n_ctx=512, draft_depth=4)
    lib = fake_native[-1]
    be.eval(_long_prompts()[1])
    pos = be.n_past
    d1 = be.draft_first(11)
    d2 = be.draft_next(d1, pos + 1)
    d3 = be.draft_next(d2, pos + 2)
    be.verify([11, d1, d2, d3])
    be.commit(1)
    assert lib.mtp_n_past == pos + 3 > be.n_past == pos + 1 and not be._uncaught
    tail = _long_prompts()[2]
    be.eval(tail)
    assert lib.prefills[-1] == (pos + 1 + 8, len(tail) - 8)      # the first 8 through oj_eval
    assert lib.mtp_n_past == be.n_past == be._mtp_upto
    _rows_in_step(lib, be)
    be.draft_first(5)                                              # the window and the rows line up
    _rows_in_step(lib, be)


@pytest.mark.parametrize("depth", [0, 4])
def test_checkpoint_interval_with_prefill_saves_at_the_same_positions(fake_native, template, depth):
    N = 32
    kw = dict(n_ctx=1024, n_checkpoints=24, checkpoint_interval=N)
    old = _engine(template, depth, prefill_chunk=0, **kw)
    new = _engine(template, depth, prefill_chunk=64, **kw)
    lib_old, lib_new = fake_native[-2], fake_native[-1]
    history = np.random.default_rng(7).integers(0, V, 600).tolist()
    for edit_at in (None, 450, 301):
        if edit_at is not None:
            history = history[:edit_at] + [(history[edit_at] + 1) % V] + history[edit_at + 1:]
        want = old.generate(history, max_tokens=6, temperature=0)
        got = new.generate(history, max_tokens=6, temperature=0)
        assert got.tokens == want.tokens
        assert got.stats.cached_prompt_tokens == want.stats.cached_prompt_tokens
    assert lib_new.saves == lib_old.saves and any(s % N == 0 for s in lib_new.saves)
    assert [k for _, k in new._backend._checkpoints] == [k for _, k in old._backend._checkpoints]
    # every prefill span lies inside one interval
    assert lib_new.prefills and all(s // N == (s + n - 1) // N for s, n in lib_new.prefills)


def test_a_verify_pending_before_prefill_is_dropped(fake_native, template):
    from openjet_plugin.model_file import open_model

    be = native.NativeBackend(open_model(template.model_path), n_ctx=512, draft_depth=4)
    lib = fake_native[-1]
    be.eval([5, 6])
    be.verify([7, 8, 9])
    tail = _long_prompts()[1]
    be.eval(tail)
    assert lib.hist == [5, 6] + tail and be.n_past == 42     # nothing of the verify was committed
    with pytest.raises(RuntimeError, match="commit without a verify"):
        be.commit(2)
    assert lib.prefills == [(2, 40)]


def test_prefill_chunk_0_keeps_the_eval_path(fake_native, template):
    from openjet_plugin.model_file import open_model

    be = native.NativeBackend(open_model(template.model_path), n_ctx=512, prefill_chunk=0)
    be.eval(_long_prompts()[2])
    assert not be.batched_prefill and fake_native[-1].prefills == []
    assert fake_native[-1].created[-1]["prefill_chunk"] == 0
    # the engine refuses oj_prefill without buffers, with a message naming the parameter
    from openjet_plugin.errors import NativeEngineError
    buf = be._nl.ffi.new("int32_t[]", [1, 2])
    with pytest.raises(NativeEngineError, match="prefill_chunk"):
        be._check(be._nl.lib.oj_prefill(be._handle(), buf, 2), "prefill")


def test_a_library_before_abi_3_keeps_the_eval_path(fake_native, template, monkeypatch):
    from openjet_plugin.model_file import open_model

    monkeypatch.setattr(FakeLib, "abi", 2)
    be = native.NativeBackend(open_model(template.model_path), n_ctx=512)
    be.eval(_long_prompts()[2])
    assert not be.batched_prefill and fake_native[-1].prefills == []
    assert fake_native[-1].created[-1]["prefill_chunk"] == 0


BAD_CHUNKS = [-1, 1, 8, 63, 4097, 1 << 20, True, 2048.0, "2048"]


@pytest.mark.parametrize("value", BAD_CHUNKS)
def test_bad_prefill_chunk_is_refused_with_its_name(fake_native, template, value):
    from openjet_plugin.model_file import open_model

    with pytest.raises(ValueError, match="prefill_chunk"):
        native.NativeBackend(open_model(template.model_path), n_ctx=64, prefill_chunk=value)
    with pytest.raises(ValueError, match="prefill_chunk"):
        openjet_plugin.load(template.model_path, backend="llama.cpp", n_ctx=64, prefill_chunk=value)
    assert fake_native == []                  # refused before the library is touched


@pytest.mark.parametrize("value", [0, 64, 256, 4096])
def test_good_prefill_chunk_reaches_the_engine(fake_native, template, value):
    from openjet_plugin.model_file import open_model

    be = native.NativeBackend(open_model(template.model_path), n_ctx=64, prefill_chunk=value)
    assert fake_native[-1].created[-1]["prefill_chunk"] == value and be.batched_prefill == (value > 0)


def test_load_passes_prefill_chunk_to_native_only(template, monkeypatch):
    """load(prefill_chunk=...) reaches the native backend's constructor; llama.cpp ignores it."""
    from openjet_plugin.backends import select

    seen = []

    def create_backend(backend, path, mf, **kw):
        seen.append(kw.get("checkpoints"))
        from openjet_plugin.backends.llama_cpp import LlamaCppBackend
        return LlamaCppBackend(path, kw["n_ctx"], n_threads=1), "test"

    monkeypatch.setattr(select, "create_backend", create_backend)
    for value, want in ((None, {}), (0, {"prefill_chunk": 0}), (512, {"prefill_chunk": 512})):
        with openjet_plugin.load(template.model_path, n_ctx=64, prefill_chunk=value) as eng:
            assert eng.generate("x", max_tokens=2, temperature=0).tokens
        assert seen[-1] == want
    with openjet_plugin.load(template.model_path, backend="llama.cpp", n_ctx=64, n_threads=1,
                             prefill_chunk=256) as eng:      # the fallback runs without it
        assert eng.backend_name == "llama.cpp"


def test_cli_prefill_chunk_option(template, monkeypatch, capsys):
    from openjet_plugin import cli, engine

    assert cli.main(["generate", "x", "-m", str(template.model_path), "--prefill-chunk", "5"]) == 1
    err = capsys.readouterr().err
    assert "openjet: error: prefill_chunk" in err and "Traceback" not in err
    seen = {}
    real = engine.load

    def spy(*a, **kw):
        seen.update(kw)
        kw["backend"] = "llama.cpp"
        return real(*a, **kw)

    monkeypatch.setattr(engine, "load", spy)
    assert cli.main(["generate", "x", "-m", str(template.model_path), "--prefill-chunk", "128",
                     "--max-tokens", "2", "--temperature", "0"]) == 0
    assert seen["prefill_chunk"] == 128


def test_prefill_bytes_formula():
    """prefill_bytes follows native/prefill.cu's alloc_prefill buffer by buffer (the GPU test checks
    it against the engine's memory report); 0 without buffers; part of the estimate's total."""
    from openjet_plugin.config import PRESETS

    c = PRESETS["q27b"]
    P = 2048
    floats = P * (2 * 5120 + 2 * 17408 + 2 * 6144 + 2 * 10240 + 2 * 48 + 4 * 6144 + 2 * 1024 + 2 * 5120) + (P + 1) * 5120
    # the workspace: the larger of the int8 GEMM's (X, (d, sum) per 32) and the fp16 GEMM's (X,
    # xsum hi/lo per 256, one scale per position)
    int8_ws, f16_ws = P * 17408 + 17408 // 32 * P * 8, 2 * P * 17408 + 17408 // 256 * P * 32 + 4 * P
    assert f16_ws > int8_ws
    dn_coef = P // 64 * 48 * (2 * 64 * 64 * 2 + 3 * 64 * 4)   # the chunked DeltaNet's coefficients
    assert native.prefill_bytes(c, P) == 4 * P + 4 * floats + f16_ws + dn_coef
    assert native.prefill_bytes(c, 0) == 0
    t = PRESETS["tiny"]                      # widest input there: ssm_out's value_dim 768 > n_ff 512
    assert native.prefill_bytes(t, 100) - native.prefill_bytes(t, 64) > 36 * 4 * 2 * t.n_embd
    assert (native.prefill_bytes(t, 65) - 4 * 65 - 4 * (65 * 7448 + 66 * 256)
            == 2 * 128 * 768 + 3 * 128 * 32 + 4 * 128 + 2 * t.ssm_dt_rank * 17152)
    with pytest.raises(ValueError, match="prefill_chunk"):
        native.prefill_bytes(c, 32)


def test_memory_estimate_counts_the_prefill_buffers(template):
    from openjet_plugin.model_file import open_model

    mf = open_model(template.model_path)
    try:
        on = native.estimate_device_bytes(mf, 1024)
        off = native.estimate_device_bytes(mf, 1024, prefill_chunk=0)
    finally:
        mf.close()
    assert off["prefill"] == 0 and on["prefill"] == native.prefill_bytes(mf.config, native.PREFILL_CHUNK)
    assert on["total"] - off["total"] == on["prefill"] and on["total"] == sum(v for k, v in on.items() if k != "total")
    assert set(native.MEMORY_FIELDS) == set(on)


def test_prefill_limits_match_the_header():
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(_native.cdef_source(_native.SOURCE_HEADER.read_text()))
    lib = ffi.dlopen(None)
    assert lib.OJ_MAX_PREFILL_CHUNK == native.MAX_PREFILL_CHUNK
    assert lib.OJ_ABI_VERSION >= native.PREFILL_ABI
    assert "prefill_chunk" in dict(ffi.typeof("oj_model_desc").fields)
    assert "prefill" in dict(ffi.typeof("oj_memory_report").fields)


class GraphFakeLib(FakeLib):
    """FakeLib at ABI 14 with oj_graph_stats: counts its verifies as replays."""

    abi = 14

    def oj_graph_stats(self, h, replayed, direct, held, captures, capture_ms):
        if replayed != self.ffi.NULL:
            replayed[0] = self.verifies
        if direct != self.ffi.NULL:
            direct[0] = 0
        if held != self.ffi.NULL:
            held[0] = min(self.verifies, 2)
        if captures != self.ffi.NULL:
            captures[0] = min(self.verifies, 2)
        if capture_ms != self.ffi.NULL:
            capture_ms[0] = 2.5 * min(self.verifies, 2)
        return 0


def test_graph_stats_read_the_library_or_say_none_before_abi_14(monkeypatch, template):
    from openjet_plugin.model_file import open_model

    install_fake(monkeypatch, GraphFakeLib)
    be = native.NativeBackend(open_model(template.model_path), n_ctx=512)
    be.verify([1, 2, 3])
    be.commit(3)
    be.verify([4])
    assert be.graph_stats() == {"replayed": 2, "direct": 0, "held": 2, "captures": 2, "capture_ms": 5.0}
    monkeypatch.setattr(GraphFakeLib, "abi", 13)
    assert be.graph_stats() is None
