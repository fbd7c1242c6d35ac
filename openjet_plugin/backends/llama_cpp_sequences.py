"""Several conversations on one llama.cpp context: a view per sequence, and the pass that serves
them together.

llama.cpp keeps n_seq_max sequences in one context: each its own KV stream (kv_unified off, so a
sequence's n_ctx positions are its own and one filling up never takes room from another) and, in
a hybrid model like qwen35, its own recurrent state. One `llama_decode` takes a batch whose tokens
name their sequence, so the weights are read once for every sequence in it.

`LlamaCppSequence` is what the engine's generation loop sees as its backend for one slot (the
same methods as `LlamaCppBackend`: eval, eval_argmax, rollback, n_past, checkpoints, reset,
tokenize); it is the one place that keeps a sequence's n_past and recurrent checkpoints. A
context of one sequence is its sequence 0 too (`LlamaCppBackend` with n_seq=1 delegates to it),
decoding through `OneSequencePasses`: the same batches, in the calling thread.

With several sequences a sequence's eval does not call llama.cpp itself: it hands its tokens to
the `PassScheduler` and waits. The scheduler's thread fills each pass from what the request
threads have handed in: every waiting decode step first, then prompt chunks in arrival order, at
most n_batch tokens in all. While sequences decode, the prompt tokens of a pass are capped by a
`PassBudget` (pass_budget.py): sized from the passes' measured times so that a mixed pass costs at
most about twice the decode-only pass, and a long prompt arriving does not stall the others' next
tokens (issue 29); with nobody decoding a prompt goes at full n_batch. Before a pass it waits (at
most one pass's duration) for the sequences of the previous pass to come back with their next
token: they are sampling, and a pass that waits for them serves them together instead of one pass
each.

There only the scheduler's thread decodes; every other use of the context (cutting a sequence,
copying its recurrent state, copying a whole sequence state out or in) takes `context_lock`, which
a pass holds while it runs: those happen between passes, and touch only their own sequence.

Copying a prefix from one sequence into another (the engine's prefix cache): llama.cpp has two
ways, and only one fits. `llama_memory_seq_cp` copies a *live* sequence: for the recurrent part it
shares the source's current state cell (the state at the source's n_past, not at an earlier p),
and across KV streams (kv_unified off, one stream per sequence) it accepts only a whole-stream
copy, applied at the next decode. So it needs the source idle at exactly p, and the copy would
depend on a slot that moves on. `llama_state_seq_get_data_ext` / `set_data_ext` (flags 0: the KV
cells and the recurrent state; PARTIAL_ONLY would leave out the KV) instead serialise one
sequence's state while it stands at p, and read it back into any destination sequence:
the KV cells go to the destination's own stream, the recurrent state to a cell of its own, after
the destination is emptied (llama-kv-cache.cpp / llama-memory-recurrent.cpp state_read_meta with
dest_seq_id). That snapshot is self-contained, so it is what `save_state` / `load_state` use.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time

import numpy as np

from ..errors import ContextOverflowError
from .base import SequenceState
from .pass_budget import PassBudget

MAX_CHECKPOINTS = 3
GATHER_MAX_SECONDS = 0.05      # the longest a pass waits for a sequence of the previous pass


# --- recurrent checkpoints of one sequence (llama.cpp's "partial" sequence state) -------------------

def save_partial_state(lib, ctx, seq: int) -> ctypes.Array | None:
    """The recurrent part of sequence seq's state (conv + delta-rule state, no KV), or None."""
    flags = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    size = lib.llama_state_seq_get_size_ext(ctx, seq, flags)
    buf = (ctypes.c_uint8 * size)()
    if lib.llama_state_seq_get_data_ext(ctx, buf, size, seq, flags) != size:
        return None
    return buf


def load_partial_state(lib, ctx, seq: int, buf: ctypes.Array) -> bool:
    flags = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    return lib.llama_state_seq_set_data_ext(ctx, buf, len(buf), seq, flags) == len(buf)


# --- a whole sequence state (KV cells + recurrent state), loadable into any sequence ---------------

def save_sequence_state(lib, ctx, seq: int, max_bytes: int) -> ctypes.Array | None:
    """Sequence seq's KV cells and recurrent state (flags 0), or None when larger than max_bytes
    (llama.cpp sizes it without copying) or not copied out."""
    size = lib.llama_state_seq_get_size_ext(ctx, seq, 0)
    if size == 0 or size > max_bytes:
        return None
    buf = (ctypes.c_uint8 * size)()
    if lib.llama_state_seq_get_data_ext(ctx, buf, size, seq, 0) != size:
        return None
    return buf


def load_sequence_state(lib, ctx, seq: int, buf: ctypes.Array) -> bool:
    """Replace sequence seq's state by buf (saved from any sequence of this context); llama.cpp
    empties seq first and leaves it empty when the read fails."""
    return lib.llama_state_seq_set_data_ext(ctx, buf, len(buf), seq, 0) == len(buf)


# --- the pass -----------------------------------------------------------------------------------------

class _Work:
    """One eval call: tokens of one sequence to append at n_past; done counts those evaluated."""

    __slots__ = ("seq", "tokens", "n_past", "order", "done", "logits", "error", "cancelled", "event")

    def __init__(self, seq: int, tokens: list[int], n_past: int, order: int):
        self.seq, self.tokens, self.n_past, self.order = seq, tokens, n_past, order
        self.done = 0
        self.logits: np.ndarray | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.event = threading.Event()

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done


class _Passes:
    """What both ways of running passes share: the batch, its decode, and `context_lock`, held by
    every use of the context (a pass, cutting a sequence, copying its recurrent state)."""

    def __init__(self, lib, ctx, n_vocab: int, n_batch: int):
        self._lib, self._ctx = lib, ctx
        self.n_vocab, self.n_batch = n_vocab, n_batch
        self.context_lock = threading.Lock()
        self._batch = lib.llama_batch_init(n_batch, 0, 1)

    def _free_batch(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None

    def _decode(self, chosen: list[tuple[_Work, int]]) -> tuple[int, list[np.ndarray | None]]:
        """One llama_decode of the chosen tokens; a logits row for each work it finishes."""
        b, lib = self._batch, self._lib
        i = 0
        last = []
        for w, n in chosen:
            finishes = n == w.left
            for k in range(w.done, w.done + n):
                b.token[i] = w.tokens[k]
                b.pos[i] = w.n_past + k
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = w.seq
                b.logits[i] = 0
                i += 1
            b.logits[i - 1] = finishes
            last.append(i - 1 if finishes else None)
        b.n_tokens = i
        rc = lib.llama_decode(self._ctx, b)
        rows: list[np.ndarray | None] = []
        for j in last:
            if rc != 0 or j is None:
                rows.append(None)
            else:
                ptr = lib.llama_get_logits_ith(self._ctx, j)
                rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True))
        return rc, rows


class OneSequencePasses(_Passes):
    """The passes of a context that holds one sequence: its eval decodes in the calling thread,
    n_batch tokens a pass (the batches llama-cpp-python's Llama.eval makes), with no thread."""

    def submit(self, seq: int, tokens: list[int], n_past: int) -> _Work:
        if self._batch is None:
            raise RuntimeError("the llama.cpp context is closed")
        return _Work(seq, tokens, n_past, 0)

    def wait(self, work: _Work) -> None:
        """Run the work's passes; `done` counts each pass as it ends, so an interruption between
        two leaves it counting what went into the state."""
        while work.left:
            n = min(work.left, self.n_batch)
            with self.context_lock:
                rc, (row,) = self._decode([(work, n)])
            if rc != 0:
                work.error = RuntimeError(f"llama_decode returned {rc}")
                break
            work.done += n
            if not work.left:
                work.logits = row
        work.event.set()

    def cancel(self, seq: int) -> None:
        """Nothing runs on its own: an interrupted wait has already stopped."""

    def close(self) -> None:
        self._free_batch()


class PassScheduler(_Passes):
    """Gathers the eval calls of several sequences into shared `llama_decode` passes (see the
    module docstring). Counters: `passes`, `shared_passes` (passes with tokens of more than one
    sequence), `max_sequences_in_a_pass`. `budget`: the prompt tokens a pass may carry next to
    decode steps, fed with every pass's time."""

    def __init__(self, lib, ctx, n_vocab: int, n_batch: int, n_seq: int):
        super().__init__(lib, ctx, n_vocab, n_batch)
        self.n_seq = n_seq
        self._cv = threading.Condition()
        self._pending: list[_Work] = []
        self._in_pass: set[int] = set()        # sequences with tokens in the pass running now
        self._expected: set[int] = set()       # the sequences of the previous pass
        self._last_pass_seconds = 0.0
        self._decoders_of_last_pass = 0       # sequences sampling their next token now
        self.budget = PassBudget(n_batch)
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.passes = 0
        self.shared_passes = 0
        self.max_sequences_in_a_pass = 0

    # --- the request threads' side --------------------------------------------------------------
    def submit(self, seq: int, tokens: list[int], n_past: int) -> _Work:
        """Hand in tokens of sequence seq to evaluate at n_past..; its event is set when they
        are done (logits: those of the last token) or failed (error)."""
        work = _Work(seq, tokens, n_past, next(self._order))
        with self._cv:
            if self._closed:
                raise RuntimeError("the llama.cpp context is closed")
            if any(w.seq == seq for w in self._pending):
                raise RuntimeError(f"sequence {seq} already has an eval in progress")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="openjet-llama-pass", daemon=True)
                self._thread.start()
            self._pending.append(work)
            self._cv.notify_all()
        return work

    def wait(self, work: _Work) -> None:
        """Until the work is done or failed (the scheduler's thread runs its passes)."""
        work.event.wait()

    def cancel(self, seq: int) -> None:
        """Drop sequence seq's unfinished work (its caller gave up, e.g. on Ctrl-C) and wait for a
        pass that holds it to end: afterwards the scheduler touches the sequence no more, and the
        work's `done` counts exactly the tokens that went into its state."""
        with self._cv:
            for w in [w for w in self._pending if w.seq == seq]:
                w.cancelled = True
                self._pending.remove(w)
                w.error = RuntimeError("cancelled")
                w.event.set()
            while seq in self._in_pass:
                self._cv.wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            for w in self._pending:
                w.error = RuntimeError("the llama.cpp context was closed")
                w.event.set()
            self._pending = []
        self._free_batch()

    # --- the scheduler's thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                # the sequences of the last pass are sampling their next token: wait for them,
                # at most one pass's time (a later one would cost them a whole pass each)
                deadline = time.monotonic() + min(self._last_pass_seconds, GATHER_MAX_SECONDS)
                while not self._closed:
                    missing = self._expected - {w.seq for w in self._pending}
                    left = deadline - time.monotonic()
                    if not missing or left <= 0:
                        break
                    self._cv.wait(left)
                if self._closed:
                    return
                chosen, n_decode = self._compose()
                self._in_pass = {w.seq for w, _ in chosen}
            failure = ""
            seconds = 0.0
            try:
                with self.context_lock:
                    # timed inside the lock: a checkpoint copy holding it is not the pass's cost
                    t0 = time.perf_counter()
                    rc, rows = self._decode(chosen)
                    seconds = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - the callers get it; the thread serves on
                rc, rows, failure = -1, [None] * len(chosen), f": {type(exc).__name__}: {exc}"
            with self._cv:
                if rc == 0:
                    self.budget.record(n_decode, sum(n for _, n in chosen) - n_decode, seconds)
                    self._last_pass_seconds = seconds
                self._expected = {w.seq for w, _ in chosen}
                self._decoders_of_last_pass = n_decode
                self.passes += 1
                self.shared_passes += len(chosen) > 1
                self.max_sequences_in_a_pass = max(self.max_sequences_in_a_pass, len(chosen))
                for (w, n), row in zip(chosen, rows):
                    if rc == 0:
                        w.done += n             # in the sequence's state, cancelled or not
                    if w.cancelled:
                        continue
                    if rc != 0:
                        w.error = RuntimeError(f"llama_decode returned {rc}{failure}")
                    elif w.left:
                        continue                # more of its prompt in a later pass
                    else:
                        w.logits = row
                    self._pending.remove(w)
                    w.event.set()
                self._in_pass = set()
                self._cv.notify_all()

    def _compose(self) -> tuple[list[tuple[_Work, int]], int]:
        """(work, tokens it puts in this pass) and the pass's decode tokens: decode steps (works
        of one token) first, then prompts by arrival, at most n_batch tokens, the prompts' at most
        what the budget allows next to the sequences that decode."""
        decode = sorted((w for w in self._pending if w.left == 1), key=lambda w: w.order)[:self.n_batch]
        chosen = [(w, 1) for w in decode]
        # the decoders of the last pass count even when not back yet: the budget is for them,
        # and a full n_batch chunk now would be the stall it exists to prevent
        decoders = max(len(decode), self._decoders_of_last_pass)
        room = min(self.n_batch - len(decode), self.budget.prompt_tokens(min(decoders, self.n_batch)))
        for w in sorted((w for w in self._pending if w.left > 1), key=lambda w: w.order):
            n = min(w.left, room)
            if n == 0:
                break
            chosen.append((w, n))
            room -= n
        # In the batch by sequence id: with a KV stream per sequence llama.cpp splits a batch into
        # ubatches (one graph, one read of the weights each) of sequences whose ids follow one
        # another in the order they first appear (llama_batch_allocr::split_equal, sequential), so
        # 3, 1, 2, 0 in arrival order would be four passes over the weights and 0, 1, 2, 3 is one.
        # (A gap, 0 and 2 without 1, still makes two; equal tokens per sequence in a ubatch puts a
        # prompt chunk's tokens after its first in a ubatch of their own.)
        return sorted(chosen, key=lambda c: c[0].seq), len(decode)


# --- a sequence, as the engine's loop sees a backend --------------------------------------------

class LlamaCppSequence:
    """Sequence `seq` of a LlamaCppBackend: the Backend protocol (backends/base.py) over that
    sequence's own KV stream, recurrent state and n_past. With one sequence the backend is this
    view of sequence 0; with several, the engine holds one per slot."""

    supports_speculative = False

    def __init__(self, owner, seq: int):
        self._owner = owner
        self._lib = owner._lib
        self._ctx = owner._llm.ctx
        self._mem = owner._lib.llama_get_memory(owner._llm.ctx)
        self._passes: OneSequencePasses | PassScheduler = owner._passes
        self.seq = seq
        self.name = owner.name
        self.n_ctx = owner.n_ctx
        self.n_vocab = owner.n_vocab
        self._n_past = 0
        self._checkpoints: list[tuple[int, ctypes.Array]] = []

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        return self._owner.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: list[int]) -> bytes:
        return self._owner.detokenize(tokens)

    @property
    def n_past(self) -> int:
        return self._n_past

    def eval(self, tokens: list[int]) -> np.ndarray:
        if not tokens:
            raise ValueError("eval needs at least one token")
        if self._n_past + len(tokens) > self.n_ctx:
            # refused here, before the batch: another sequence's pass never sees it
            raise ContextOverflowError(self._n_past + len(tokens), self.n_ctx)
        work = self._passes.submit(self.seq, list(tokens), self._n_past)
        try:
            self._passes.wait(work)
        finally:
            if not work.event.is_set():
                self._passes.cancel(self.seq)       # interrupted (Ctrl-C): stop it, count what went in
            self._n_past += work.done
        if work.error is not None:
            raise work.error
        assert work.logits is not None
        return work.logits

    def eval_argmax(self, tokens: list[int]) -> int:
        return int(np.argmax(self.eval(tokens)))

    def rollback(self, n_keep: int) -> bool:
        if not 0 <= n_keep <= self._n_past:
            raise ValueError(f"rollback to {n_keep} tokens, but the state holds {self._n_past}")
        if n_keep == self._n_past:
            return True
        if n_keep == 0:
            self.reset()
            return True
        # llama.cpp refuses to cut a recurrent state partially (unless it keeps snapshots) and
        # then leaves it as it was
        with self._passes.context_lock:
            if not self._lib.llama_memory_seq_rm(self._mem, self.seq, n_keep, -1):
                return False
        self._n_past = n_keep
        self._checkpoints = [c for c in self._checkpoints if c[0] <= n_keep]
        return True

    # --- checkpoints: how a recurrent state goes back -------------------------------------------
    # llama.cpp cannot cut DeltaNet state back to an earlier position, but it can copy out just
    # the recurrent part of a sequence's state ("partial" state: conv + delta-rule state, no KV)
    # and put it back; the attention KV cache is then cut to the same position. This is what
    # llama.cpp's server calls context checkpoints. The engine saves one before the last prompt
    # token of each request, so a regenerated reply or a history that changes after that point
    # re-prefills from there instead of from the start.

    def save_checkpoint(self) -> None:
        """Remember the recurrent state at n_past (the oldest of MAX_CHECKPOINTS is dropped)."""
        n = self._n_past
        if n == 0 or any(p == n for p, _ in self._checkpoints):
            return
        with self._passes.context_lock:
            buf = save_partial_state(self._lib, self._ctx, self.seq)
        if buf is None:
            return          # a checkpoint is an optimisation; without it we re-prefill
        self._checkpoints.append((n, buf))
        del self._checkpoints[:-MAX_CHECKPOINTS]

    def restore_checkpoint(self, n_max: int) -> int:
        """Go back to the newest checkpoint with at most n_max tokens; return its n_past.
        0 means none was usable and the state was reset."""
        usable = [c for c in self._checkpoints if c[0] <= n_max]
        if usable:
            pos, buf = max(usable, key=lambda c: c[0])
            with self._passes.context_lock:
                ok = (load_partial_state(self._lib, self._ctx, self.seq, buf)
                      and self._lib.llama_memory_seq_rm(self._mem, self.seq, pos, -1))
            if ok:
                self._n_past = pos
                self._checkpoints = [c for c in self._checkpoints if c[0] <= pos]
                return pos
        self.reset()
        return 0

    # --- whole-state copies: a prefix evaluated in one sequence, reused in another ------------------
    def save_state(self, max_bytes: int) -> SequenceState | None:
        """A copy of this sequence's state at n_past (KV of [0, n_past) + recurrent state), or
        None when it would take more than max_bytes (base.py)."""
        if self._n_past == 0:
            return None
        with self._passes.context_lock:
            buf = save_sequence_state(self._lib, self._ctx, self.seq, max_bytes)
        if buf is None:
            return None
        return SequenceState(self._n_past, len(buf), buf, self._owner)

    def load_state(self, state: SequenceState) -> bool:
        """Replace this sequence's state by `state` (from any sequence of this backend); False,
        with the sequence empty, if llama.cpp refused it."""
        if state.origin is not self._owner:
            raise ValueError("load_state: the state was saved by another backend")
        if state.n_past > self.n_ctx:
            raise ContextOverflowError(state.n_past, self.n_ctx)
        self._passes.cancel(self.seq)
        with self._passes.context_lock:
            ok = (load_sequence_state(self._lib, self._ctx, self.seq, state.data)
                  and self._lib.llama_memory_seq_pos_max(self._mem, self.seq) == state.n_past - 1)
            if not ok:
                self._lib.llama_memory_seq_rm(self._mem, self.seq, -1, -1)
        # the sequence's own checkpoints were of the state it held before
        self._checkpoints = []
        self._n_past = state.n_past if ok else 0
        return ok

    def reset(self) -> None:
        self._passes.cancel(self.seq)
        with self._passes.context_lock:
            self._lib.llama_memory_seq_rm(self._mem, self.seq, -1, -1)
        self._n_past = 0
        self._checkpoints = []

    def close(self) -> None:
        """The context is the backend's: closing the engine closes it."""
