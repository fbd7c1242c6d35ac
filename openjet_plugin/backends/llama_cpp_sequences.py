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
the `PassScheduler` and waits. The scheduling is passes.py's, shared with the native backend: the
scheduler's thread fills each pass from what the request threads have handed in (every waiting
decode step first, then prompt chunks in arrival order, at most n_batch tokens in all; the prompt
tokens next to decode steps capped by a `PassBudget`, pass_budget.py, so that a mixed pass costs at
most about twice the decode-only pass and a long prompt arriving does not stall the others' next
tokens; with nobody decoding a prompt goes at full n_batch), waiting at most one pass's duration
for the sequences of the previous pass. Here a pass is one `llama_decode` of every chosen token.

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
import threading
import time

import numpy as np

from ..errors import ContextOverflowError
from .base import SequenceState
from .passes import PassScheduler as SharedPasses
from .passes import Submitted, Work

MAX_CHECKPOINTS = 3


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

    def _decode(self, chosen: list[tuple[Work, int]]) -> tuple[int, list[np.ndarray | None]]:
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

    def submit(self, seq: int, tokens: list[int], n_past: int) -> Work:
        if self._batch is None:
            raise RuntimeError("the llama.cpp context is closed")
        return Work(seq, tokens, n_past, 0)

    def wait(self, work: Work) -> None:
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
        work.finish()

    def wait_launched(self, work: Work) -> None:
        """Nothing runs before the wait: its passes run in it."""

    def cancel(self, seq: int) -> None:
        """Nothing runs on its own: an interrupted wait has already stopped."""

    def close(self) -> None:
        self._free_batch()


class PassScheduler(_Passes, SharedPasses):
    """Gathers the eval calls of several sequences into shared `llama_decode` passes (passes.py:
    the scheduling; here the pass is one batch of every chosen token, each naming its sequence)."""

    serves = "the llama.cpp context"
    thread_name = "openjet-llama-pass"

    def __init__(self, lib, ctx, n_vocab: int, n_batch: int, n_seq: int):
        _Passes.__init__(self, lib, ctx, n_vocab, n_batch)
        SharedPasses.__init__(self, n_batch, n_seq)

    def _run_pass(self, chosen: list[tuple[Work, int]]) -> tuple[list[BaseException | None], float]:
        with self.context_lock:
            # timed inside the lock: a checkpoint copy holding it is not the pass's cost
            t0 = time.perf_counter()
            rc, rows = self._decode(chosen)
            seconds = time.perf_counter() - t0
        if rc != 0:
            # llama.cpp says only that the batch failed, not for which sequence
            return [RuntimeError(f"llama_decode returned {rc}")] * len(chosen), seconds
        for (w, _), row in zip(chosen, rows):
            if row is not None:
                w.logits = row
        return [None] * len(chosen), seconds

    def close(self) -> None:
        SharedPasses.close(self)
        self._free_batch()


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
        return self._wait(self._submit(tokens))

    def eval_argmax(self, tokens: list[int]) -> int:
        return int(np.argmax(self.eval(tokens)))

    def submit_argmax(self, tokens: list[int]):
        """eval_argmax in two halves: the tokens go to the scheduler now, the Submitted returned
        waits for their pass and gives the argmax (the caller's own work runs meanwhile, after its
        `launched()`)."""
        work = self._submit(tokens)
        return Submitted(lambda: int(np.argmax(self._wait(work))), lambda: self._passes.wait_launched(work))

    def _submit(self, tokens: list[int]) -> Work:
        if not tokens:
            raise ValueError("eval needs at least one token")
        if self._n_past + len(tokens) > self.n_ctx:
            # refused here, before the batch: another sequence's pass never sees it
            raise ContextOverflowError(self._n_past + len(tokens), self.n_ctx)
        return self._passes.submit(self.seq, list(tokens), self._n_past)

    def _wait(self, work: Work) -> np.ndarray:
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
