"""Several conversations on one native engine (issue 29), the Python side, on the CPU:
NativeBackend(n_seq=N)'s views, the pass scheduler that serves them together (NativePasses over
backends/passes.py), and the Engine with n_slots > 1 on the native backend.

`SeqFakeLib` extends tests/test_native_bookkeeping.py's FakeLib (the toy model: the next token is
a hash of the sequence's whole committed history, so a token lost, doubled or put into another
sequence changes every later output) to the C API of openjet.h ABI 9: n_seq sequences, each its
own history, n_past and MTP cache, switched by oj_seq_select; oj_eval_seqs appending one token to
each of several sequences, refusing the whole call before running anything on a bad id, a
duplicate, a sequence without room or a token it is told to refuse; the results of the last pass
(argmax, logits rows) the engine's; checkpoint slots the engine's, restored into whichever
sequence is selected. It also records two threads inside its entry points at once (the engine is
one CUDA stream: every native call must run under the backend's lock).

The GPU runs the same through the real engine: tests/test_native_seqs_engine_gpu.py.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import run_threads  # noqa: E402
from test_native_bookkeeping import V, FakeLib, _mix, install_fake  # noqa: E402

import openjet_plugin  # noqa: E402
from openjet_plugin.backends import native  # noqa: E402
from openjet_plugin.errors import BackendUnavailableError, ContextOverflowError, NativeEngineError  # noqa: E402

DEFAULT_GGUF = Path(__file__).resolve().parent.parent / "openjet_plugin" / "data" / "default.gguf"
REFUSED = V - 7           # a token id oj_eval_seqs / oj_eval of SeqFakeLib refuse (an engine failure)
PASS_SECONDS = 0.0005     # each evaluating call takes this long, so that threads interleave


# entry points the overlap and busy checks leave alone: oj_state_copy_wait runs without the lock
# by design; the others read nothing of the selected sequence
COPY_WAIT_AND_ENGINE_WIDE = ("oj_state_copy_wait", "oj_last_error", "oj_abi_version")
NOT_ON_THE_SELECTED = ("oj_seq_select", "oj_seq_selected", "oj_eval_seqs", "oj_get_argmax", "oj_get_logits",
                       "oj_engine_free", "oj_memory", "oj_n_past", "oj_mtp_n_past", "oj_device_info",
                       "oj_profile", "oj_profile_read", "oj_set_draft_vocab", "oj_draft_vocab_size")


class SeqFakeLib(FakeLib):
    """FakeLib with sequences (openjet.h ABI 9; see the module docstring)."""

    # what each sequence holds; the rest (results of the last pass, checkpoint slots, draft
    # vocabulary) is the engine's
    # (hwin, hlast_n: the sequence's own hidden window, which OJ_H_MAIN reads; win / last_n are
    # the rows of the engine's last pass, whichever sequence it served)
    PER_SEQUENCE = ("hist", "hashes", "last_start", "prev_row", "uncommitted", "verify_toks", "mtp_n_past",
                    "last_mtp_n", "mtp_rows", "draft_h", "verifies", "hwin", "hlast_n")

    def __init__(self, ffi):
        self.n_seq = 1
        self.selected = 0
        self.saved: dict[int, dict] = {}
        self.eval_seqs_calls: list[list[int]] = []     # the sequences of every oj_eval_seqs
        self.logits_reads = 0
        self.slot_saves: list[tuple[int, int]] = []    # (sequence, slot) of every oj_checkpoint_save
        self.overlaps: list[str] = []                  # entry points entered while another thread was inside
        self._inside: int | None = None
        self.busy: set[int] = set()                    # sequences with a state copy not yet waited for
        self.refused_busy: list[str] = []              # calls made on a busy sequence (a bug of the caller)
        self.copy_seconds = 0.0                        # how long oj_state_copy_wait takes
        self.copy_waits: list[tuple[int, int]] = []    # (sequence, oj_eval_seqs calls made while it waited)
        self._meta = threading.Lock()
        super().__init__(ffi)

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if not name.startswith("oj_") or not callable(attr):
            return attr
        get = object.__getattribute__

        if name in COPY_WAIT_AND_ENGINE_WIDE:
            return attr                        # the wait runs without the lock: no overlap to record

        def entry(*args):
            if name not in NOT_ON_THE_SELECTED and get(self, "selected") in get(self, "busy"):
                get(self, "refused_busy").append(name)
                return get(self, "_fail")(f"{name}: sequence {get(self, 'selected')} has a state copy in progress")
            me = threading.get_ident()
            with get(self, "_meta"):
                outer = get(self, "_inside")
                if outer not in (None, me):
                    get(self, "overlaps").append(name)
                self._inside = me
            try:
                return attr(*args)
            finally:
                self._inside = outer
        return entry

    def oj_device_info(self, device, major, minor, free, total, name, capacity):
        """An sm_90 card with room for anything (native_status runs its real checks)."""
        major[0], minor[0] = 9, 0
        if free != self.ffi.NULL:
            free[0] = total[0] = 80 << 30
        if name != self.ffi.NULL:
            text = b"Fake H100"
            for i, b in enumerate(text[:capacity - 1]):
                name[i] = bytes([b])
            name[min(len(text), capacity - 1)] = b"\0"
        return 0

    def oj_engine_create(self, desc, out):
        self.n_seq = max(1, int(desc.n_seq))
        self.n_ctx = int(desc.n_ctx)
        if self.n_seq > 8:
            return self._fail(f"n_seq is {self.n_seq}; allowed 0..8")
        rc = super().oj_engine_create(desc, out)
        self.created[-1]["n_seq"] = self.n_seq
        fresh = {k: getattr(self, k) for k in self.PER_SEQUENCE}
        self.saved = {s: _copy_state(fresh) for s in range(self.n_seq)}
        return rc

    def _keep_selected(self) -> None:
        self.saved[self.selected] = {k: getattr(self, k) for k in self.PER_SEQUENCE}

    def oj_seq_select(self, h, seq):
        if not 0 <= seq < self.n_seq:
            return self._fail(f"sequence {seq} is outside 0..{self.n_seq - 1}")
        self._keep_selected()
        for k, v in self.saved[seq].items():
            setattr(self, k, v)
        self.selected = seq
        return 0

    def oj_seq_selected(self, h, out):
        out[0] = self.selected
        return 0

    def oj_reset(self, h):
        keep = {k: getattr(self, k) for k in ("ckpt", "out", "last_n", "win", "draft") if hasattr(self, k)}
        super().oj_reset(h)
        for k, v in keep.items():                   # results and slots are the engine's
            setattr(self, k, v)
        self.hwin, self.hlast_n = [0], 0
        return 0

    def _own_window(self) -> None:
        """The selected sequence's hidden window is the pass it just ran."""
        self.hwin, self.hlast_n = list(self.win), self.last_n

    def _evaluate(self, buf, n):
        time.sleep(PASS_SECONDS)
        if any(int(buf[i]) == REFUSED for i in range(n)):
            return self._fail(f"sequence {self.selected}: token {REFUSED} refused")
        rc = super()._evaluate(buf, n)
        if rc == 0:
            self._own_window()
        return rc

    def oj_prefill(self, h, buf, n):
        time.sleep(PASS_SECONDS)
        if any(int(buf[i]) == REFUSED for i in range(n)):
            return self._fail(f"sequence {self.selected}: token {REFUSED} refused")
        rc = super().oj_prefill(h, buf, n)
        if rc == 0:
            self._own_window()
            self.seq_prefills = getattr(self, "seq_prefills", []) + [(self.selected, n)]
        return rc

    def oj_checkpoint_restore(self, h, slot, out):
        rc = super().oj_checkpoint_restore(h, slot, out)
        if rc == 0:
            self.hwin, self.hlast_n = list(self.win), 0
        return rc

    def oj_eval_seqs(self, h, seqs_buf, toks_buf, n):
        time.sleep(PASS_SECONDS)
        if not 1 <= n <= 8:
            return self._fail(f"n_seqs {n} outside 1..8")
        seqs = [int(seqs_buf[i]) for i in range(n)]
        toks = [int(toks_buf[i]) for i in range(n)]
        self.eval_seqs_calls.append(seqs)
        self._keep_selected()
        for s, t in zip(seqs, toks):                # checked before anything runs
            if not 0 <= s < self.n_seq or seqs.count(s) > 1:
                return self._fail(f"sequence {s}: out of range or twice in one oj_eval_seqs")
            if s in self.busy:
                self.refused_busy.append("oj_eval_seqs")
                return self._fail(f"oj_eval_seqs: sequence {s} has a state copy in progress")
            if not 0 <= t < V or t == REFUSED:
                return self._fail(f"sequence {s}: token {t} refused")
            if len(self.saved[s]["hist"]) + 1 > self.n_ctx:
                self._fail(f"sequence {s} is full ({self.n_ctx} positions)")
                return 5
        rows = []
        for s, t in zip(seqs, toks):
            st = self.saved[s]
            hs = _mix(st["hashes"][-1], t)
            st["hist"].append(t)
            st["hashes"].append(hs)
            st["uncommitted"], st["verify_toks"] = 0, []
            st["last_start"] = len(st["hist"]) - 1
            st["hwin"], st["hlast_n"] = [st["hashes"][-2], hs], 1   # as after its own one-token oj_eval
            rows.append(hs)
        for k, v in self.saved[self.selected].items():    # the selected sequence does not change
            setattr(self, k, v)
        self.out = [self._next(hs) for hs in rows]
        self.win = [0] + rows                     # logits(t) is row t's, as oj_get_logits reads it
        self.last_n = n
        return 0

    def oj_get_logits(self, h, index, out, n):
        self.logits_reads += 1
        return super().oj_get_logits(h, index, out, n)

    def oj_mtp_eval(self, h, buf, n, pos0, source, hp):
        """OJ_H_MAIN reads the sequence's own window, not the engine's last pass."""
        rows = (self.win, self.last_n)
        self.win, self.last_n = self.hwin, self.hlast_n
        try:
            return super().oj_mtp_eval(h, buf, n, pos0, source, hp)
        finally:
            self.win, self.last_n = rows

    def oj_checkpoint_save(self, h, slot):
        self.slot_saves.append((self.selected, slot))
        return super().oj_checkpoint_save(h, slot)

    # --- oj_seq_state_*: a copy of the selected sequence (its tokens, hashes and MTP rows up to
    # n_past, as the engine copies the DeltaNet state, K/V and MTP rows), the buffer holding its id
    def _state_bytes(self) -> int:
        return 16 + 8 * len(self.hist)

    def oj_seq_state_size(self, h, out):
        out[0] = self._state_bytes()
        return 0

    def oj_seq_state_save(self, h, buf, size, copy):
        if size < self._state_bytes():
            return self._fail(f"oj_seq_state_save: out holds {size} bytes, {self._state_bytes()} needed")
        n = len(self.hist)
        self.uncommitted, self.verify_toks = 0, []
        copy_ = {"hist": list(self.hist), "hashes": list(self.hashes),
                 "mtp_rows": {p: r for p, r in self.mtp_rows.items() if p < n}, "mtp_n_past": min(self.mtp_n_past, n)}
        self.copies = getattr(self, "copies", [])
        self.copies.append(copy_)
        self.ffi.memmove(buf, len(self.copies).to_bytes(8, "little") + b"\0" * 8, 16)
        self.state_saves = getattr(self, "state_saves", []) + [(self.selected, n)]
        return self._start_copy(copy)

    def oj_seq_state_load(self, h, buf, size, copy):
        ident = int.from_bytes(bytes(self.ffi.buffer(buf, 8)), "little")
        copies = getattr(self, "copies", [])
        if not 1 <= ident <= len(copies) or size != 16 + 8 * len(copies[ident - 1]["hist"]):
            return self._fail("oj_seq_state_load: not a sequence state of this engine")
        c = copies[ident - 1]
        self.hist, self.hashes = list(c["hist"]), list(c["hashes"])
        self.mtp_rows, self.mtp_n_past = dict(c["mtp_rows"]), c["mtp_n_past"]
        self.uncommitted, self.verify_toks, self.prev_row, self.last_mtp_n = 0, [], 0, 0
        self.last_start, self.hwin, self.hlast_n = len(self.hist), [self.hashes[-1]], 0
        self.state_loads = getattr(self, "state_loads", []) + [(self.selected, len(self.hist))]
        return self._start_copy(copy)

    def _start_copy(self, copy) -> int:
        """The bytes are this fake's at the start; the copy object names the sequence, busy until
        its wait (which takes copy_seconds, as a real copy of a long prompt's state does)."""
        self.busy.add(self.selected)
        copy[0] = self.ffi.cast("oj_state_copy *", self.selected + 1)
        return 0

    def oj_state_copy_wait(self, copy):
        seq = int(self.ffi.cast("uintptr_t", copy)) - 1
        before = len(self.eval_seqs_calls)
        time.sleep(self.copy_seconds)
        self.copy_waits.append((seq, len(self.eval_seqs_calls) - before))
        self.busy.discard(seq)
        return 0

    def history(self, seq: int) -> list[int]:
        """Sequence seq's committed tokens."""
        return list(self.hist) if seq == self.selected else list(self.saved[seq]["hist"])


class PieceFakeLib(SeqFakeLib):
    """SeqFakeLib with oj_prefill_layers (openjet.h ABI 12): a piece's tokens go into its sequence
    when the call that runs its last layer comes (the real engine's part state is nobody's to
    read: every call on the sequence but oj_prefill_layers with the same tokens and oj_reset is
    refused meanwhile, as are oj_prefill and oj_eval_seqs naming it; the fake refuses them too and
    records them in refused_piece). layer_calls: (sequence, tokens, layers asked, layers done after)."""

    abi = native.PIECE_ABI
    ALLOWED_WITH_A_PIECE = ("oj_prefill_layers", "oj_reset") + NOT_ON_THE_SELECTED + COPY_WAIT_AND_ENGINE_WIDE

    def __init__(self, ffi):
        self.piece: tuple[int, list[int], int] | None = None    # (sequence, tokens, layers done)
        self.layer_calls: list[tuple[int, int, int, int]] = []
        self.refused_piece: list[str] = []
        super().__init__(ffi)

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if not name.startswith("oj_") or not callable(attr) or name in PieceFakeLib.ALLOWED_WITH_A_PIECE:
            return attr
        get = object.__getattribute__

        def entry(*args):
            piece = get(self, "piece")
            if piece is not None and (get(self, "selected") == piece[0] or name == "oj_prefill"):
                get(self, "refused_piece").append(name)
                return get(self, "_fail")(f"{name}: sequence {piece[0]} has a prompt piece in flight")
            return attr(*args)
        return entry

    def oj_engine_create(self, desc, out):
        self.n_layer = int(desc.hparams.n_layer)
        return super().oj_engine_create(desc, out)

    def oj_eval_seqs(self, h, seqs_buf, toks_buf, n):
        if self.piece is not None and any(int(seqs_buf[i]) == self.piece[0] for i in range(n)):
            self.refused_piece.append("oj_eval_seqs")
            return self._fail(f"oj_eval_seqs: sequence {self.piece[0]} has a prompt piece in flight")
        return super().oj_eval_seqs(h, seqs_buf, toks_buf, n)

    def oj_reset(self, h):
        if self.piece is not None and self.piece[0] == self.selected:
            self.piece = None
        return super().oj_reset(h)

    def oj_prefill_layers(self, h, buf, n, layers, done):
        done[0] = 0
        toks = [int(buf[i]) for i in range(n)]
        if layers < 1:
            return self._fail(f"oj_prefill_layers: layers is {layers}")
        if self.piece is None:
            if n > self.prefill_chunk:
                return self._fail(f"oj_prefill_layers: a piece of {n} tokens; at most prefill_chunk")
            self.piece = (self.selected, toks, 0)
        elif self.piece[0] != self.selected or self.piece[1] != toks:
            self.refused_piece.append("oj_prefill_layers")
            return self._fail(f"oj_prefill_layers: sequence {self.piece[0]}'s piece holds the prefill buffers")
        seq, _, before = self.piece
        after = min(self.n_layer, before + layers)
        self.layer_calls.append((seq, n, layers, after))
        if after < self.n_layer:
            time.sleep(PASS_SECONDS)
            self.piece = (seq, toks, after)
            return 0
        self.piece = None
        rc = self.oj_prefill(h, buf, n)
        if rc == 0:
            done[0] = 1
            return 0
        error, done[0] = self.error, -1      # failed part way: the engine resets the sequence
        self.oj_reset(h)
        self.error = error
        return rc


def _copy_state(st: dict) -> dict:
    return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in st.items()}


@pytest.fixture()
def fake_seqs(monkeypatch):
    return install_fake(monkeypatch, SeqFakeLib)


def _backend(n_seq: int, n_ctx: int = 512, **kw) -> native.NativeBackend:
    """Views that do not follow the MTP cache unless draft_depth is given (these tests are about
    shared passes; a following view takes even one token through its eval path)."""
    from openjet_plugin.model_file import open_model

    kw.setdefault("draft_depth", 0)
    return native.NativeBackend(open_model(DEFAULT_GGUF), n_ctx=n_ctx, n_seq=n_seq, **kw)




def greedy(view, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt on a sequence view, through eval_argmax (the engine's greedy path)."""
    toks = [view.eval_argmax(prompt)]
    while len(toks) < n:
        toks.append(view.eval_argmax([toks[-1]]))
    return toks


PROMPTS = [list(range(10 + 7 * k, 10 + 7 * k + m)) for k, m in enumerate((5, 40, 1, 150, 12, 3, 77, 9))]


# --- the backend: views and their shared passes --------------------------------------------------------

def test_views_decode_together_and_each_equals_its_sequence_alone(fake_seqs):
    alone = _backend(1)
    want = []
    for p in PROMPTS[:4]:
        alone.reset()
        want.append(greedy(alone, p, 30))
    be = _backend(4)
    lib = fake_seqs[-1]
    views = be.sequences()
    assert be.n_sequences == 4 and [v.seq for v in views] == [0, 1, 2, 3] and views[0] is be
    assert lib.created[-1]["n_seq"] == 4 and lib.created[-1]["n_checkpoints"] == 4 * native.N_CHECKPOINTS
    got = run_threads([lambda v=v, p=p: greedy(v, p, 30) for v, p in zip(views, PROMPTS)])
    assert got == want
    for v, p, toks in zip(views, PROMPTS, got):
        assert lib.history(v.seq) == p + toks[:-1]     # exactly its own tokens went into its sequence
        assert v.n_past == len(p) + 29
    # decode steps of several sequences went through one oj_eval_seqs
    together = [s for s in lib.eval_seqs_calls if len(s) > 1]
    assert len(together) >= 20 and max(len(s) for s in together) == 4, lib.eval_seqs_calls[:10]
    assert all(s == sorted(s) for s in lib.eval_seqs_calls)
    counts = be.pass_counts
    assert counts["shared_passes"] >= 20 and counts["max_sequences_in_a_pass"] == 4
    assert lib.overlaps == []
    # greedy steps read no logits row; a prompt's last chunk read through eval does (and only then)
    assert lib.logits_reads == 0
    rows = run_threads([lambda v=v: v.eval([5, 6, 7]) for v in views[:2]])
    assert lib.logits_reads == 2 and all(int(np.argmax(r)) == int(r.argmax()) for r in rows)
    be.close()
    alone.close()


def test_eval_returns_each_sequences_own_logits(fake_seqs):
    one = _backend(1)
    want = []
    for p in PROMPTS[:3]:
        one.reset()
        rows = [one.eval(p)]
        for t in (3, 4, 5):
            rows.append(one.eval([t]))
        want.append(rows)
    be = _backend(3)

    def run(v, p):
        rows = [v.eval(p)]
        for t in (3, 4, 5):
            rows.append(v.eval([t]))
        return rows
    got = run_threads([lambda v=v, p=p: run(v, p) for v, p in zip(be.sequences(), PROMPTS)])
    for g, w in zip(got, want):
        assert len(g) == len(w) and all(np.array_equal(a, b) for a, b in zip(g, w))
    assert fake_seqs[-1].overlaps == []


def test_a_refused_step_fails_only_its_own_sequence(fake_seqs):
    """oj_eval_seqs refuses the whole call for one sequence's token: the call is run again one
    sequence at a time, and only that sequence's eval fails; the others' tokens are their own."""
    alone = _backend(1)
    want = []
    for p in PROMPTS[:3]:
        alone.reset()
        want.append(greedy(alone, p, 25))
    be = _backend(4)
    lib = fake_seqs[-1]
    views = be.sequences()

    since = {}

    def shared_a_call() -> bool:
        """A call with others since the refused steps began (its prompt's last token may have had one)."""
        return "start" in since and any(3 in s and len(s) > 1 for s in lib.eval_seqs_calls[since["start"]:])

    def refused():
        v = views[3]
        v.eval_argmax([1, 2, 3])
        since["start"] = len(lib.eval_seqs_calls)
        errors = []
        while not shared_a_call() and len(errors) < 20:       # until it went into a call with others
            try:
                v.eval_argmax([REFUSED])
            except NativeEngineError as exc:
                errors.append(exc)
        return errors

    got = run_threads([lambda v=v, p=p: greedy(v, p, 25) for v, p in zip(views, PROMPTS[:3])] + [refused])
    assert got[:3] == want
    assert shared_a_call(), "the refused step never shared a call"
    assert got[3] and all(f"token {REFUSED} refused" in str(e) for e in got[3])
    assert [3] in lib.eval_seqs_calls                          # then ran alone
    assert lib.history(3) == [1, 2, 3] and views[3].n_past == 3
    assert lib.overlaps == []


def test_a_sequence_without_room_is_refused_before_any_pass(fake_seqs):
    be = _backend(2, n_ctx=64)
    a, b = be.sequences()
    a.eval_argmax(list(range(60)))
    with pytest.raises(ContextOverflowError):
        a.eval_argmax(list(range(5)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        b.eval([V])
    assert a.n_past == 60 and b.n_past == 0
    assert greedy(b, [1, 2], 3) and fake_seqs[-1].history(0) == list(range(60))


def test_an_interrupted_eval_counts_exactly_what_went_into_the_sequence(fake_seqs):
    """Ctrl-C while a view waits for its passes: the rest of its prompt is dropped after the pass
    that holds it, n_past (the engine's) counts what went in, and going on from there ends where
    one uninterrupted eval ends."""
    be = _backend(2, prefill_chunk=64)
    a, _ = be.sequences()
    lib = fake_seqs[-1]
    sched = be._shared.passes
    assert sched.n_batch == 64
    submit = sched.submit
    interrupted = threading.Event()

    def second_chunk_waits(h, buf, n):
        # the second pass is running when its caller gives up: it goes in, nothing after it
        if len(lib.prefills) == 1:
            assert interrupted.wait(30)
        return SeqFakeLib.oj_prefill(lib, h, buf, n)
    lib.oj_prefill = second_chunk_waits

    class InterruptedWait(threading.Event):
        work = None

        def wait(self, timeout=None):
            while self.work.done < 64:          # one pass in
                time.sleep(0.001)
            interrupted.set()
            raise KeyboardInterrupt

    def interrupted_submit(*args, **kw):
        work = submit(*args, **kw)
        ev = InterruptedWait()
        ev.work = work
        work.event = ev
        return work

    sched.submit = interrupted_submit
    prompt = list(range(300))
    with pytest.raises(KeyboardInterrupt):
        a.eval(prompt)
    sched.submit = submit
    assert a.n_past == 128 and lib.history(0) == prompt[:128] and [n for _, n in lib.prefills] == [64, 64]
    got = a.eval(prompt[a.n_past:])
    a.reset()
    assert a.n_past == 0 and np.array_equal(got, a.eval(prompt))


def test_checkpoint_slots_of_different_views_never_collide(fake_seqs):
    be = _backend(3, n_checkpoints=2)
    lib = fake_seqs[-1]
    assert lib.created[-1]["n_checkpoints"] == 6
    views = be.sequences()
    for turn in range(3):                       # three checkpoints each: the ring of two reused
        for k, v in enumerate(views):
            v.eval_argmax([100 * k + 10 * turn + i for i in range(4)])
            v.save_checkpoint()
    for s, slot in lib.slot_saves:
        assert 2 * s <= slot < 2 * s + 2, (s, slot)
    for k, v in enumerate(views):
        assert v.restore_checkpoint(8) == 8                     # its own second checkpoint
        assert lib.history(v.seq) == [100 * k + i for i in range(4)] + [100 * k + 10 + i for i in range(4)]
    assert views[1].restore_checkpoint(3) == 0 and views[1].n_past == 0      # none that early: reset
    assert views[2].n_past == 8 and views[0].n_past == 8


def test_too_many_checkpoint_slots_or_sequences_are_refused_with_their_names(fake_seqs):
    with pytest.raises(ValueError, match=r"n_checkpoints 24 per sequence x n_seq 4 is 96 .* at most 64"):
        _backend(4, n_checkpoints=24)
    for bad in (0, 9, True, 2.0):
        with pytest.raises(ValueError, match="n_seq"):
            _backend(bad)
    assert fake_seqs == []                     # refused before the library is touched


def test_a_sequence_leaves_the_mtp_cache_when_it_decodes_in_shared_passes(fake_seqs):
    be = _backend(2, draft_depth=4)
    a, b = be.sequences()
    lib = fake_seqs[-1]
    assert a.supports_speculative and b.supports_speculative and a.draft_depth == 4
    # a following sequence takes its tokens through its eval path, which makes their MTP rows
    a.eval_argmax(PROMPTS[1])
    a.eval_argmax([5])
    assert a._mtp_upto == a.n_past == len(PROMPTS[1]) + 1 and lib.eval_seqs_calls == []
    # b leaves it: its decode steps go into oj_eval_seqs, which makes no rows
    b.eval_argmax(PROMPTS[0])
    b.leave_mtp()
    assert not b.supports_speculative and a.supports_speculative
    rows = b._mtp_upto
    for t in range(3):
        b.eval_argmax([7 + t])
    assert lib.eval_seqs_calls and all(s == [1] for s in lib.eval_seqs_calls) and b._mtp_upto == rows
    # a restore to where its rows reach follows again; a reset too
    b.save_checkpoint()                                  # at n_past, past its rows: no use
    assert b.restore_checkpoint(b.n_past) == b.n_past and not b.supports_speculative
    b.reset()
    assert b.supports_speculative and b._mtp_upto == 0
    one = _backend(1, draft_depth=4)
    assert one.supports_speculative and one.draft_depth == 4 and one.sequences() == [one]


def test_closing_fails_waiting_work_and_frees_the_engine(fake_seqs):
    be = _backend(2)
    a, b = be.sequences()
    greedy(a, [1, 2, 3], 4)
    b.close()                                   # a view's close leaves the engine to its owner
    assert greedy(b, [4, 5], 2)
    be.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.eval_argmax([1])
    with pytest.raises(NativeEngineError, match="closed"):
        b.n_past


# --- the engine: n_slots on the native backend ----------------------------------------------------------

def _load(n_slots, **kw):
    return openjet_plugin.load(DEFAULT_GGUF, backend="native", n_ctx=kw.pop("n_ctx", 512), n_slots=n_slots, **kw)


TEXTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n\nclass Config:", "for i in range(10):",
         "x"]


def _stream(eng, prompt, n=24, **kw):
    return [t for c in eng.generate(prompt, max_tokens=n, temperature=0, stream=True, **kw) for t in c.tokens]


def test_concurrent_requests_on_four_native_slots_equal_each_alone(fake_seqs):
    with _load(1, draft_depth=0) as one:
        alone = {p: one.generate(p, max_tokens=24, temperature=0).tokens for p in TEXTS[:4]}
        sampled = one.generate(TEXTS[4], max_tokens=24, temperature=0.8, seed=5).tokens
    with _load(4, draft_depth=0) as eng:
        lib = fake_seqs[-1]
        assert eng.n_slots == 4 and eng.backend_name == "native" and eng._speculator is None
        assert not eng.supports_speculative and lib.created[-1]["n_seq"] == 4
        got = run_threads([lambda p=p: _stream(eng, p) for p in TEXTS[:4]])
        assert got == [alone[p] for p in TEXTS[:4]]
        counts = eng._backend.pass_counts
        assert counts["max_sequences_in_a_pass"] >= 3
        # decode-only passes timed by their sequences (the bench's decode_pass_ms detail)
        assert max(counts["decode_pass_ms"]) >= 2 and all(ms > 0 for ms in counts["decode_pass_ms"].values())
        assert sum(len(s) > 1 for s in lib.eval_seqs_calls) >= 10
        # a sampled request (the logits path) beside greedy ones
        more = run_threads([lambda: eng.generate(TEXTS[4], max_tokens=24, temperature=0.8, seed=5).tokens,
                            lambda: _stream(eng, TEXTS[0]), lambda: _stream(eng, TEXTS[1])])
        assert more == [sampled, alone[TEXTS[0]], alone[TEXTS[1]]]
        assert lib.overlaps == []
        for s in eng._slots:                    # every slot's tokens are exactly its sequence's
            assert lib.history(s.backend.seq) == s.tokens


def _spy_submissions(monkeypatch) -> tuple[list[tuple[int, int, set]], list[list[int]]]:
    """What the engine hands the native passes from here on: (token, evaluations, rows_for) of
    every submit_chain and the tokens of every submit_argmax."""
    chains, steps = [], []
    real_chain, real_step = native.NativeBackend.submit_chain, native.NativeBackend.submit_argmax

    def spy_chain(self, token, evaluations, eog, rows_for=()):
        chains.append((token, evaluations, set(rows_for)))
        return real_chain(self, token, evaluations, eog, rows_for)

    def spy_step(self, tokens):
        steps.append(list(tokens))
        return real_step(self, tokens)

    monkeypatch.setattr(native.NativeBackend, "submit_chain", spy_chain)
    monkeypatch.setattr(native.NativeBackend, "submit_argmax", spy_step)
    return chains, steps


def test_greedy_requests_decode_as_chains_and_a_stop_leaves_state_and_tokens_alike(fake_seqs, monkeypatch):
    """On shared passes a greedy request hands the scheduler a chain (passes.submit_chain) and no
    single steps: the chunks are those of plain decoding; a stop string that ends the text while
    the chain has evaluated further leaves those tokens in the state and in the slot's tokens
    alike, and the next request on the slot is what it is alone."""
    with _load(1, draft_depth=0) as one:
        full = one.generate(TEXTS[0], max_tokens=24, temperature=0)
        stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
        cut = one.generate(TEXTS[0], max_tokens=24, temperature=0, stop=[stop])
        after = one.generate(TEXTS[1], max_tokens=12, temperature=0).tokens
    assert cut.finish_reason == "stop" and len(cut.tokens) < len(full.tokens)
    with _load(2, draft_depth=0) as eng:
        lib = fake_seqs[-1]
        chains, steps = _spy_submissions(monkeypatch)
        chunks = list(eng.generate(TEXTS[0], max_tokens=24, temperature=0, stop=[stop], stream=True))
        got = run_threads([lambda: eng.generate(TEXTS[1], max_tokens=12, temperature=0).tokens,
                           lambda: eng.generate(TEXTS[0], max_tokens=24, temperature=0).tokens])
        assert "".join(c.text for c in chunks) == cut.text and chunks[-1].finish_reason == "stop"
        assert [t for c in chunks for t in c.tokens] == cut.tokens
        assert got == [after, full.tokens]
        assert len(chains) == 3 and steps == []                 # one chain a request, no single steps
        assert sorted(n for _, n, _ in chains) == [11, 23, 23]  # the evaluations each request allows
        for s in eng._slots:                    # what the chains evaluated went in: state and tokens agree
            assert lib.history(s.backend.seq) == s.tokens
        assert lib.refused_busy == [] and lib.overlaps == []


def test_greedy_requests_with_negative_biases_chain_and_equal_the_request_alone(fake_seqs, monkeypatch):
    """Negative logit biases (bans) keep a greedy request off the row-per-token path. On shared
    passes it chains: a step whose argmax is a biased id ends the chain with its logits row kept,
    the biases choose from it, and a new chain goes on from that token. On one slot each step
    copies its row only where the argmax is biased (eval_argmax_rows). The tokens are those of
    the row-per-token path, with state and tokens alike. A positive bias can lift another id over
    the argmax: no chain."""
    with _load(1, draft_depth=0) as one:
        plain = one.generate(TEXTS[0], max_tokens=24, temperature=0).tokens
        bans = {plain[3]: -math.inf, plain[9]: -50.0}
        with monkeypatch.context() as m:        # the reference: a row every token, the biases applied
            m.delattr(native.NativeBackend, "eval_argmax_rows")
            lib = fake_seqs[-1]
            reads = lib.logits_reads
            want = one.generate(TEXTS[0], max_tokens=24, temperature=0, logit_bias=bans).tokens
            assert lib.logits_reads - reads >= 24
            want1 = one.generate(TEXTS[1], max_tokens=16, temperature=0, logit_bias=bans).tokens
        lifted = one.generate(TEXTS[0], max_tokens=24, temperature=0, logit_bias={plain[5]: 9.0}).tokens
        reads = lib.logits_reads
        assert one.generate(TEXTS[0], max_tokens=24, temperature=0, logit_bias=bans).tokens == want
        assert lib.logits_reads - reads < 24 // 2     # the prompt's and the biased steps' rows only
    assert want != plain and lifted != plain      # the biases change what the argmax alone would give
    with _load(2, draft_depth=0) as eng:
        lib = fake_seqs[-1]
        chains, steps = _spy_submissions(monkeypatch)
        reads = lib.logits_reads
        alone = eng.generate(TEXTS[0], max_tokens=24, temperature=0, logit_bias=bans).tokens
        alone_chains, alone_reads = len(chains), lib.logits_reads - reads
        got = run_threads([lambda: eng.generate(TEXTS[0], max_tokens=24, temperature=0, logit_bias=bans).tokens,
                           lambda: eng.generate(TEXTS[1], max_tokens=16, temperature=0, logit_bias=bans).tokens])
        n_chains = len(chains)
        up = eng.generate(TEXTS[0], max_tokens=24, temperature=0, logit_bias={plain[5]: 9.0}).tokens
        assert alone == want and got == [want, want1] and up == lifted
        # a new chain after each step the bans decided; rows read only for the steps whose argmax is
        # biased (at most one a chain) and the prompt's (two on the fake), not one a token
        assert alone_chains >= 2 and all(r == set(bans) for _, _, r in chains) and steps == []
        assert alone_reads <= alone_chains + 2 < 24 // 2
        assert len(chains) == n_chains           # the positive bias: no chain
        for s in eng._slots:
            assert lib.history(s.backend.seq) == s.tokens
        assert lib.refused_busy == [] and lib.overlaps == []


def test_a_biased_step_whose_row_fails_fails_only_its_own_chain(fake_seqs, monkeypatch):
    """A chain step whose argmax is biased needs its logits row; where reading it fails, that
    chain fails and the other sequences of the same pass go on."""
    one = _backend(1)
    try:
        want_b = greedy(one, [8, 9, 12], 4)
    finally:
        one.close()
    be = _backend(2)
    try:
        a, b = be.sequences()
        lib = fake_seqs[-1]
        a.eval_argmax([5, 6, 7])
        b.eval_argmax([8, 9])
        monkeypatch.setattr(lib, "oj_get_logits", lambda h, i, out, n: lib._fail("logits refused"))
        passes = be._shared.passes
        calls = len(lib.eval_seqs_calls)
        cb = passes.submit_chain(b.seq, 12, 5, set())
        ca = passes.submit_chain(a.seq, 11, 5, set(), rows_for=range(V))   # every argmax needs its row
        with pytest.raises(NativeEngineError, match="logits refused"):
            ca.step(0)()
        assert [cb.step(k)() for k in range(4)] == want_b
        assert any(sorted(c) == [a.seq, b.seq] for c in lib.eval_seqs_calls[calls:]), lib.eval_seqs_calls[calls:]
    finally:
        be.close()


def test_a_state_copied_into_another_sequence_continues_as_the_original(fake_seqs):
    be = _backend(3)
    try:
        a, b, c = be.sequences()
        prompt = [(17 * i + 5) % 400 + 3 for i in range(40)]
        a.eval_argmax(prompt)
        assert a.save_state(max_bytes=10) is None          # larger than allowed: no copy
        state = a.save_state(max_bytes=1 << 20)
        assert state is not None and state.n_past == 40 and state.nbytes == 16 + 8 * 40
        c.eval_argmax([9, 9, 9])                          # c held something else before
        assert b.load_state(state) and c.load_state(state)
        assert b.n_past == c.n_past == 40 and b._checkpoints == [] == c._checkpoints
        # all three continue from the same 40 tokens: the same greedy tokens
        got = run_threads([lambda v=v: greedy(v, [11], 20) for v in (a, b, c)])
        assert got[0] == got[1] == got[2]
        lib = fake_seqs[-1]
        assert [lib.history(q)[:40] for q in range(3)] == [prompt] * 3
        with pytest.raises(ValueError, match="another backend"):
            b.load_state(native.SequenceState(40, state.nbytes, state.data, object()))
        bad = native.SequenceState(40, state.nbytes, np.zeros(state.nbytes, dtype=np.uint8), be._shared)
        assert not c.load_state(bad) and c.n_past == 0    # refused: the sequence is empty, as the protocol says
        assert be.save_state(1 << 20) is not None and b.sequences()[0] is be
    finally:
        be.close()


def test_native_slots_reuse_a_prompt_prefix_another_slot_evaluated(fake_seqs):
    with _load(1, draft_depth=0) as one:
        # token prompts whose first turn (a system prompt of 60 tokens) ends in an end-of-turn
        # token: the engine keeps a copy of the state there
        end_of_turn = min(t for t in one.eog_tokens if t != REFUSED)
        system = [(13 * i + 7) % 900 + 3 for i in range(60)] + [end_of_turn]
        questions = [tuple(system + [(5 * i + k) % 700 + 3 for i in range(6 + k)]) for k in range(3)]
        alone = {q: one.generate(list(q), max_tokens=16, temperature=0).tokens for q in questions}
    with _load(3) as eng:
        lib = fake_seqs[-1]
        assert eng.prefix_cache_stats["budget_bytes"] > 0        # on by default with several slots
        first = eng.generate(list(questions[0]), max_tokens=16, temperature=0)
        assert first.tokens == alone[questions[0]]
        # the others, at once, in other slots: each loads a copy another slot saved
        got = run_threads([lambda q=q: eng.generate(list(q), max_tokens=16, temperature=0) for q in questions[1:]])
        assert [r.tokens for r in got] == [alone[q] for q in questions[1:]]
        assert all(r.stats.prefix_cache_tokens > 0 for r in got), [r.stats.prefix_cache_tokens for r in got]
        assert eng.prefix_cache_stats["hits"] >= 2
        assert getattr(lib, "state_loads", []) and lib.overlaps == []


def test_state_copies_run_beside_the_other_sequences_passes(fake_seqs):
    """A prompt's prefix-cache copies (each as long as a long prompt's, 80 ms here) move after the
    engine's lock is let go: the other streams' passes go on meanwhile, nothing runs on the copying
    sequence until its wait returns, and every stream's tokens are its tokens alone."""
    long_prompt = [(11 * i + 3) % 900 + 3 for i in range(300)]
    with _load(1, draft_depth=0) as one:
        alone = {p: one.generate(p, max_tokens=40, temperature=0).tokens for p in TEXTS[:3]}
        long_alone = one.generate(long_prompt, max_tokens=4, temperature=0).tokens
    with _load(4, draft_depth=0) as eng:
        lib = fake_seqs[-1]
        lib.copy_seconds = 0.08
        started = threading.Event()

        def stream(p):
            out = []
            for c in eng.generate(p, max_tokens=40, temperature=0, stream=True):
                out += c.tokens
                if len(out) >= 4:
                    started.set()
            return out

        def arrive():
            started.wait(30)
            return eng.generate(long_prompt, max_tokens=4, temperature=0).tokens

        got = run_threads([lambda p=p: stream(p) for p in TEXTS[:3]] + [arrive])
        assert got == [alone[p] for p in TEXTS[:3]] + [long_alone]
        assert lib.copy_waits and lib.refused_busy == [] and lib.overlaps == [] and not lib.busy
        # the streams' shared passes went on while the copies moved
        assert max(passes for _, passes in lib.copy_waits) >= 3, lib.copy_waits
        for s in eng._slots:
            assert lib.history(s.backend.seq) == s.tokens


def test_a_sequence_is_refused_while_its_state_copy_is_in_flight(fake_seqs):
    be = _backend(2)
    try:
        a, b = be.sequences()
        a.eval_argmax([5, 6, 7])
        ffi, lib = be._nl.ffi, be._nl.lib
        copy = ffi.new("oj_state_copy **")
        data = np.empty(1 << 12, dtype=np.uint8)
        with be._shared.lock:
            assert lib.oj_seq_state_save(a._handle(), ffi.from_buffer("char[]", data), data.size, copy) == 0
            be._shared.copies += 1
        with pytest.raises(NativeEngineError, match="state copy in progress"):
            a.eval_argmax([8])
        assert greedy(b, [1, 2], 3)                       # another sequence is served meanwhile
        a._wait_copy(copy, "test copy")
        assert a.eval_argmax([8]) is not None and a.n_past == 4
    finally:
        be.close()


def test_a_request_served_alone_speculates_and_concurrent_ones_share_passes(fake_seqs):
    with _load(1, draft_depth=0) as one:
        alone = {p: one.generate(p, max_tokens=24, temperature=0).tokens for p in TEXTS}
    with _load(4, draft_depth=4) as eng:
        lib = fake_seqs[-1]
        assert eng.supports_speculative and eng.n_slots == 4
        # one client alone: MTP speculation, the output of plain greedy decoding
        r = eng.generate(TEXTS[0], max_tokens=24, temperature=0)
        assert r.tokens == alone[TEXTS[0]] and r.stats.cycles > 0 and r.stats.drafts_accepted > 0
        assert lib.eval_seqs_calls == []
        # four at once: at most the first one speculates, the others decode in shared passes
        got = run_threads([lambda p=p: eng.generate(p, max_tokens=24, temperature=0) for p in TEXTS[:4]])
        assert [g.tokens for g in got] == [alone[p] for p in TEXTS[:4]]
        assert sum(g.stats.cycles > 0 for g in got) <= 1
        assert sum(len(s) > 1 for s in lib.eval_seqs_calls) >= 5, (lib.eval_seqs_calls, [g.stats for g in got])
        assert lib.overlaps == []
        for s in eng._slots:
            assert lib.history(s.backend.seq) == s.tokens
        # a slot that decoded in shared passes keeps no MTP rows: alone again, its conversation
        # continues without drafts (the same tokens); a new conversation in it speculates again
        left = next(s for s in eng._slots if s.tokens and not s.backend.supports_speculative)
        prompt = left.tokens + [11]
        more = eng.generate(prompt, max_tokens=8, temperature=0)
        assert more.stats.cycles == 0 and more.stats.cached_prompt_tokens == len(prompt) - 1
        with _load(1, draft_depth=0) as one:
            assert more.tokens == one.generate(prompt, max_tokens=8, temperature=0).tokens
        for s in eng._slots:
            s.backend.reset()
            s.tokens, s.logits = [], None
        fresh = eng.generate(TEXTS[4], max_tokens=24, temperature=0)    # no copy of it cached
        assert fresh.tokens == alone[TEXTS[4]] and fresh.stats.cycles > 0
        # a prompt whose prefix copy came from a shared pass's sequence (no MTP rows in it) loads the
        # copy and decodes without drafts: the same tokens
        cached = eng.generate(TEXTS[1], max_tokens=24, temperature=0)
        assert cached.tokens == alone[TEXTS[1]] and cached.stats.prefix_cache_tokens > 0
        assert lib.overlaps == []


def _long_prompt_beside_two_streams(libs: list) -> tuple:
    """Two greedy streams of 120 tokens on a 3-slot engine, and a 646-token prompt arriving once
    they decode; every output must equal its request alone. Returns the engine's fake library, the
    long prompt's sequence, its length and the scheduler's trace."""
    with _load(1, draft_depth=0, n_ctx=1024) as one:
        long_prompt = [(37 * i + 11) % 3000 + 5 for i in range(10 * 64 + 6)]   # a work of 645: 5 past the chunks
        want_long = one.generate(long_prompt, max_tokens=8, temperature=0).tokens
        want = {p: one.generate(p, max_tokens=120, temperature=0).tokens for p in TEXTS[:2]}
    with _load(3, draft_depth=0, n_ctx=1024) as eng:
        decoding = threading.Event()

        def first_stream():
            out = []
            for c in eng.generate(TEXTS[0], max_tokens=120, temperature=0, stream=True):
                out.extend(c.tokens)
                if len(out) >= 8:
                    decoding.set()
            return out

        def late_long():
            # once the streams decode (a fixed sleep raced the greedy chains, which decode their 120
            # tokens without waiting for the request threads)
            assert decoding.wait(30)
            return eng.generate(long_prompt, max_tokens=8, temperature=0).tokens

        got = run_threads([first_stream, lambda: _stream(eng, TEXTS[1], n=120), late_long])
        assert got == [want[TEXTS[0]], want[TEXTS[1]], want_long]
        seq = next(s.backend.seq for s in eng._slots if s.tokens[:len(long_prompt)] == long_prompt)
        return libs[-1], seq, len(long_prompt), list(eng._slots[0].backend._shared.passes.trace)


def test_a_long_prompt_beside_decoders_goes_through_prefill_in_whole_deltanet_chunks(fake_seqs):
    """A prompt arriving while others decode is cut by the pass budget; its pieces go through
    oj_prefill as the whole prompt would alone, each but the last a whole number of DeltaNet
    chunks, so its positions meet the same kernels at the same chunk boundaries."""
    lib, seq, n_long, _ = _long_prompt_beside_two_streams(fake_seqs)
    pieces = [n for q, n in getattr(lib, "seq_prefills", []) if q == seq]
    assert sum(pieces) == n_long - 1 and len(pieces) > 1, pieces   # cut, all through oj_prefill
    assert all(n % native.DELTANET_CHUNK == 0 for n in pieces[:-1]), pieces
    assert lib.overlaps == []


def test_prompt_pieces_are_whole_deltanet_chunks_through_prefill(fake_seqs):
    be = _backend(2)
    try:
        passes, b = be._shared.passes, be.sequences()[1]
        C = native.DELTANET_CHUNK
        long, short = native.Work(1, list(range(5, 650)), 0, 0), native.Work(1, [5, 6, 7], 0, 1)
        assert [passes._prompt_tokens(long, n) for n in (1, 30, C, 100, 200, 645)] == [C, C, C, C, 3 * C, 645]
        assert passes._prompt_tokens(short, 2) == 2               # oj_eval takes any split alike
        lib = fake_seqs[-1]
        b.eval_argmax([9] * 20)
        b._eval_chunks([1, 2, 3, 4, 5], prefill_all=True)           # a tail of a long prompt: oj_prefill
        b._eval_chunks([6, 7])                                      # a short prompt: oj_eval
        assert [n for q, n in lib.seq_prefills if q == 1] == [20, 5]
    finally:
        be.close()


@pytest.fixture()
def fake_pieces(monkeypatch):
    return install_fake(monkeypatch, PieceFakeLib)


def test_a_piece_in_layers_equals_the_piece_whole_with_other_sequences_between(fake_pieces):
    """prefill_piece puts a piece through oj_prefill_layers a share of the layers a call; another
    sequence decodes between the calls; the piece's sequence then holds what one oj_prefill of
    the piece leaves (the same tokens, results and MTP rows), and nothing touched it meanwhile."""
    whole = _backend(1, draft_depth=4)
    be = _backend(2, draft_depth=4)
    try:
        lib = fake_pieces[-1]
        n_layer = lib.n_layer
        a, b = be.sequences()
        head, piece = PROMPTS[3][:20], PROMPTS[3][20:20 + 100]
        for v in (whole, b):
            v.eval_argmax(head)
        whole._eval_chunks(piece, prefill_all=True)
        want = (whole.argmax(), whole.n_past, whole._mtp_n_past(), whole.logits(0))
        a.eval_argmax(PROMPTS[0])
        shares, other = [], []
        while True:
            shares.append(b.prefill_piece(piece, 0.3))
            if not b.piece_in_flight:
                break
            other.append(a.eval_argmax([7]))                  # a decode step of sequence 0 between
        step = max(1, int(n_layer * 0.3))
        assert len(shares) == -(-n_layer // step) > 1, (shares, n_layer)
        assert [c[2] for c in lib.layer_calls] == [step] * (len(shares) - 1) + [n_layer - step * (len(shares) - 1)]
        assert math.isclose(sum(shares), 1.0)
        got = (b.argmax(), b.n_past, b._mtp_n_past(), b.logits(0))
        assert got[:3] == want[:3] and np.array_equal(got[3], want[3])
        assert lib.history(1) == head + piece and b.prefilled_positions == whole.prefilled_positions
        assert lib.history(0) == PROMPTS[0] + [7] * len(other)
        assert lib.refused_piece == []
        # a share of 1, or a piece the engine cannot take in layers, goes in whole
        assert b.prefill_piece([5, 6, 7], 1.0) == 1.0 and not b.piece_in_flight
        assert lib.history(1)[-3:] == [5, 6, 7] and len(lib.layer_calls) == len(shares)
    finally:
        be.close()
        whole.close()


def test_a_piece_in_flight_refuses_other_tokens_and_a_reset_drops_it(fake_pieces):
    be = _backend(2)
    try:
        lib = fake_pieces[-1]
        b = be.sequences()[1]
        b.eval_argmax([9] * 10)
        assert b.prefill_piece(list(range(5, 105)), 0.25) < 1 and b.piece_in_flight
        with pytest.raises(ValueError, match="piece of 100 tokens in flight"):
            b.prefill_piece(list(range(6, 106)), 0.25)
        with pytest.raises(NativeEngineError, match="prompt piece in flight"):
            b.eval_argmax([3])
        assert lib.refused_piece == ["oj_eval_seqs"]
        b.reset()
        assert not b.piece_in_flight and b.n_past == 0
        b.eval_argmax([9] * 10)                                  # the sequence serves again
        assert lib.history(1) == [9] * 10 and lib.piece is None
    finally:
        be.close()


def test_a_long_prompt_beside_decoders_goes_in_layers_and_every_stream_equals_it_alone(fake_pieces):
    """With oj_prefill_layers, a prompt piece larger than the budget's room next to decoders goes
    through its layers over several passes, decode steps of the others between them; every output
    equals its request alone, and no call touched the piece's sequence while it was in flight."""
    lib, seq, n_long, trace = _long_prompt_beside_two_streams(fake_pieces)
    calls = [c for c in lib.layer_calls if c[0] == seq]
    assert any(c[3] < lib.n_layer for c in calls), calls       # some piece went in layers
    pieces = [n for q, n in lib.seq_prefills if q == seq]
    assert sum(pieces) == n_long - 1 and all(n % native.DELTANET_CHUNK == 0 for n in pieces[:-1])
    assert any(0 < e[4] < native.DELTANET_CHUNK and e[3] > 0 for e in trace)   # a share beside decoders
    assert lib.refused_piece == [] and lib.overlaps == []


def test_a_bad_request_among_native_slots_fails_alone(fake_seqs):
    with _load(1, draft_depth=0) as one:
        alone = {p: one.generate(p, max_tokens=24, temperature=0).tokens for p in TEXTS[:2]}
    with _load(4, n_ctx=256) as eng:
        too_long = [100 + i % 500 for i in range(eng.n_ctx + 1)]

        def overflow():
            time.sleep(0.01)
            return eng.generate(too_long, max_tokens=4, temperature=0)

        def refused():
            time.sleep(0.01)
            return eng.generate([5, 6, 7, REFUSED], max_tokens=4, temperature=0)

        got = run_threads([lambda: _stream(eng, TEXTS[0]), overflow, refused, lambda: _stream(eng, TEXTS[1])])
        assert isinstance(got[1], ContextOverflowError)
        assert isinstance(got[2], NativeEngineError) and "refused" in str(got[2])
        assert got[0] == alone[TEXTS[0]] and got[3] == alone[TEXTS[1]]
        assert all(s.owner is None for s in eng._slots)
        # the slots that failed were emptied, and serve again
        assert run_threads([lambda: _stream(eng, TEXTS[1]), lambda: _stream(eng, TEXTS[0])]) == \
            [alone[TEXTS[1]], alone[TEXTS[0]]]


def test_a_stream_closed_midway_frees_its_native_slot(fake_seqs):
    with _load(1, draft_depth=0) as one:
        alone = {p: one.generate(p, max_tokens=24, temperature=0).tokens for p in TEXTS[:3]}
    with _load(2) as eng:
        started = threading.Event()

        def abandoned():
            stream = eng.generate(TEXTS[0], max_tokens=200, temperature=0, stream=True)
            got = next(stream).tokens
            started.set()
            time.sleep(0.02)
            stream.close()
            return got

        def steady():
            started.wait(30)
            return _stream(eng, TEXTS[1])

        first, other = run_threads([abandoned, steady])
        assert other == alone[TEXTS[1]] and first == alone[TEXTS[0]][:len(first)]
        assert all(s.owner is None for s in eng._slots)
        # the abandoned conversation goes on from its slot's checkpoint, as on one slot
        again = eng.generate(TEXTS[0], max_tokens=24, temperature=0)
        assert again.tokens == alone[TEXTS[0]] and again.stats.cached_prompt_tokens > 0
        assert _stream(eng, TEXTS[2]) == alone[TEXTS[2]]


def test_load_n_slots_on_native(fake_seqs, caplog):
    from openjet_plugin.backends.llama_cpp import DEFAULT_SERVE_SEQUENCES

    with _load(None) as eng:
        assert eng.n_slots == DEFAULT_SERVE_SEQUENCES and eng._backend.n_seq == DEFAULT_SERVE_SEQUENCES
    with pytest.raises(BackendUnavailableError, match="1..8 sequences"):
        _load(9)
    caplog.set_level(logging.INFO, logger="openjet_plugin")
    with openjet_plugin.load(DEFAULT_GGUF, backend="auto", n_ctx=64, n_slots=9, n_threads=1) as eng:
        assert eng.backend_name == "llama.cpp" and eng.n_slots == 9
        assert "1..8 sequences" in eng.backend_reason
    assert not any("becomes 1" in r.getMessage() for r in caplog.records)


def test_a_one_slot_native_engine_is_unchanged(monkeypatch):
    """FakeLib has neither oj_seq_select nor oj_eval_seqs: a one-sequence backend never calls
    them, gives the engine n_seq 1 and N_CHECKPOINTS slots, and speculates as before."""
    libs = install_fake(monkeypatch, FakeLib)
    monkeypatch.setattr(native, "native_status", lambda mf, n_ctx, **kw: (True, f"fake, {kw}"))
    with openjet_plugin.load(DEFAULT_GGUF, backend="native", n_ctx=256) as spec, \
            openjet_plugin.load(DEFAULT_GGUF, backend="native", n_ctx=256, draft_depth=0) as plain:
        assert spec.n_slots == 1 and spec._speculator is not None and plain._speculator is None
        assert spec.backend_reason == "fake, {}"          # no n_seq asked of the status check
        for p in TEXTS:
            assert spec.generate(p, max_tokens=20, temperature=0).tokens == \
                plain.generate(p, max_tokens=20, temperature=0).tokens
        assert spec.last_stats.drafts_accepted > 0
        assert spec._backend._shared.passes is None and spec._backend.pass_counts == {}
    assert len(libs) == 2 and all(lib.created[-1]["n_checkpoints"] == native.N_CHECKPOINTS for lib in libs)


# --- memory: the plan of N slots before loading ---------------------------------------------------------

def test_estimate_scales_with_sequences_as_the_engine_allocates():
    from types import SimpleNamespace

    from openjet_plugin.config import PRESETS

    c = PRESETS["q27b"]
    mf = SimpleNamespace(config=c, tensors={})
    one = native.estimate_device_bytes(mf, 8192)
    assert native.estimate_device_bytes(mf, 8192, n_seq=1) == one
    window = (native.MAX_POSITIONS + 1) * c.n_embd * 4
    for n in (2, 4, 8):
        est = native.estimate_device_bytes(mf, 8192, n_seq=n)
        for k in ("kv_cache", "recurrent_state", "checkpoints"):
            assert est[k] == n * one[k], k
        assert est["activations"] == one["activations"] + (n - 1) * window
        assert est["weights"] == one["weights"] and est["prefill"] == one["prefill"]
        assert est["total"] == sum(v for k, v in est.items() if k != "total")
    # the 27B at 8K: a sequence is 0.5 GiB of KV cache (16 attention layers + MTP) and 150 MiB of state
    assert one["kv_cache"] == native.kv_cache_bytes(c, 8192) == 17 * 2 * 1024 * 8192 * 2
    with pytest.raises(ValueError, match="n_seq"):
        native.estimate_device_bytes(mf, 8192, n_seq=9)


def test_info_and_doctor_plan_slots_times_context_on_native():
    from openjet_plugin.cli import serving_memory
    from openjet_plugin.model_file import open_model

    with open_model(DEFAULT_GGUF) as mf:
        for slots in (1, 4, 8):
            plan = serving_memory(mf, "native", 2048, slots)
            est = native.estimate_device_bytes(mf, 2048, n_seq=slots)
            assert plan.slots == slots and plan.total == est["total"]
            assert plan.per_slot == {k: est[k] // slots for k in ("kv_cache", "recurrent_state", "checkpoints")}
            rows = dict(plan.rows())
            assert rows["serving"].startswith(f"{slots} slot{'s' if slots > 1 else ''} x 2048 context on native")
            assert "becomes 1" not in rows["serving"]
        default = serving_memory(mf, "native", 2048)
        assert default.slots == 4
        with pytest.raises(ValueError, match="at most 8"):
            serving_memory(mf, "native", 2048, 9)


def test_native_status_counts_every_sequence(fake_seqs, monkeypatch):
    from openjet_plugin.model_file import open_model

    with open_model(DEFAULT_GGUF) as mf:
        ok, why = native.native_status(mf, 2048, n_seq=9)
        assert not ok and "1..8 sequences" in why
        need = {n: native.estimate_device_bytes(mf, 2048, n_seq=n)["total"] + native._MEMORY_MARGIN for n in (1, 4)}
        free = (need[1] + need[4]) // 2               # room for one sequence, not for four

        def device_info(self, device, major, minor, f, total, name, capacity):
            major[0], minor[0] = 9, 0
            f[0] = total[0] = free
            return 0
        monkeypatch.setattr(SeqFakeLib, "oj_device_info", device_info)
        assert native.native_status(mf, 2048)[0]
        ok, why = native.native_status(mf, 2048, n_seq=4)
        assert not ok and "x 4 sequences" in why


def test_sequence_limits_match_the_header():
    from openjet_plugin import _native

    ffi = _native.make_ffi()
    lib = ffi.dlopen(None)
    assert lib.OJ_MAX_SEQUENCES == native.MAX_SEQUENCES and lib.OJ_ABI_VERSION >= 9
    assert "n_seq" in dict(ffi.typeof("oj_model_desc").fields)
