"""Shared passes for several sequences of one backend (issue 29): what the llama.cpp and the native
multi-sequence backends have in common.

Each sequence view's eval hands its tokens to a `PassScheduler` and waits. The scheduler's thread
fills each pass from what the request threads have handed in: every waiting decode step first
(a work of one token), then prompt chunks in arrival order, at most n_batch tokens in all. While
sequences decode, the prompt tokens of a pass are capped by a `PassBudget` (pass_budget.py), so a
long prompt arriving does not stall the others' next tokens. Before a pass it waits (at most one
pass's duration, GATHER_MAX_SECONDS at most) for the sequences of the previous pass to come back
with their next token: they are sampling, and a pass that waits for them serves them together
instead of one pass each. A work's `launched` event is set when a pass takes it: a request thread
that handed in its next step early (`Submitted`) does its own per-token work after that, beside the
pass, not while the scheduler (needing the same interpreter lock) composes it.

A greedy request can hand in a chain instead (`submit_chain`): after each pass the scheduler takes
the step's argmax as the sequence's next decode step itself, up to the evaluations the request
allows and never an end-of-generation token, so the next pass does not wait for the request thread
to wake and hand it in (0.20-0.27 ms a pass for 8 threads on the 2-core CPU with `launched`,
0.05 with chains; on an H100 the 8-stream rows' 2.6 ms gap turned out to be the bench's banned end
tokens taking every step's row to the host, which chains under negative biases now avoid). The
request reads the argmaxes in order (`Chain.step`), and when its text ends
early it cancels the chain: the tokens the chain evaluated past that point are in the state, and
`done` counts them, as a step handed in early is today. A greedy request with negative logit
biases chains too: the argmax stands unless it is one of the biased ids (a bias only lowers a
logit), so the chain also ends at those, and the backend keeps that evaluation's logits row
(`Chain.row`) for the request to apply its biases to.

A prompt piece can be no smaller than the backend's split allows (`_prompt_tokens`: the native
engine cuts a prompt only at DeltaNet chunks of 64, so that it meets the kernels it meets alone),
and a piece of 64 next to seven decoders costs them ~33 ms of a 48 ms pass on an H100, whatever the
budget says. A backend that can put a piece through its layers over several passes
(`pieces_in_layers`: the native engine's oj_prefill_layers) gets such a piece as the pass's one
prompt with `Work.share` = room / piece, the share of its layers this pass runs; it keeps
`Work.piece` set while the piece is part way, and the piece goes on, alone among the prompts, in
the next passes until it is in (only then does `done` count its tokens). The trace and the budget
count the share's tokens. A cancel waits for a piece part way to end.

What differs between backends is only how the chosen works run: `_run_pass(chosen)`, given
(work, tokens it puts in this pass) pairs, puts those tokens into each work's sequence, sets the
result of every work it finishes (`logits`, or `argmax` for a work that asked for no logits row)
and says per work whether its tokens went in. llama.cpp runs them as one `llama_decode` batch
(llama_cpp_sequences.py); the native engine as one `oj_eval_seqs` of the decode steps and a
prefill per prompt chunk (native.py). A failure of one work fails that work only, where the
backend can tell which one it was.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

import numpy as np

from .pass_budget import PassBudget

GATHER_MAX_SECONDS = 0.05      # the longest a pass waits for a sequence of the previous pass
PASS_TIMES_KEPT = 512           # decode-only pass times kept per number of decode steps
PASS_TRACE_KEPT = 8192          # the last passes' times kept for `trace` (openjet bench's latency rows)


def stage_share(room: int, piece: int) -> float:
    """The share of a piece's layers a pass with `room` prompt tokens runs (at most all of them)."""
    return min(1.0, room / piece) if piece else 1.0


class Work:
    """One eval call: tokens of one sequence to append at n_past; done counts those evaluated.
    want_logits False: the caller needs only the greedy id (`argmax`), so no logits row is copied
    off the device for it."""

    __slots__ = ("seq", "tokens", "n_past", "order", "done", "want_logits", "logits", "argmax", "error",
                 "cancelled", "event", "launched", "submitted", "chain_left", "chain_eog", "chain_out",
                 "rows_for", "share", "ran", "piece", "stop_after_piece")

    def __init__(self, seq: int, tokens: list[int], n_past: int, order: int, want_logits: bool = True):
        self.seq, self.tokens, self.n_past, self.order = seq, tokens, n_past, order
        self.want_logits = want_logits
        self.done = 0
        self.logits: np.ndarray | None = None
        self.argmax: int | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.event = threading.Event()       # done or failed
        self.launched = threading.Event()    # a pass that takes its tokens has begun (or event is set)
        self.submitted = time.perf_counter()  # when it was handed in (the trace's steps_in)
        # a chain (submit_chain): evaluations still allowed after the current step, the tokens that
        # end it unevaluated, and the argmax after each evaluation (None: not a chain)
        self.chain_left = 0
        self.chain_eog: frozenset[int] = frozenset()
        self.chain_out: list[int] | None = None
        # argmaxes for which the backend also keeps the logits row (in `logits`) of a work that
        # asked for none: the ids a request's negative biases may take the argmax from
        self.rows_for: frozenset[int] = frozenset()
        # a prompt piece in layers (a backend with pieces_in_layers): the share of the piece's
        # layers this pass asks for (1.0: the whole piece), the share it ran, the piece's tokens
        # while it is part way through them (0: none), and a cancel waiting for it to end
        self.share = 1.0
        self.ran = 1.0
        self.piece = 0
        self.stop_after_piece = False

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    def finish(self) -> None:
        """Done or failed: its waiters (of either event) go on."""
        self.launched.set()
        self.event.set()


class Submitted:
    """A step handed to the passes ahead of its wait (a backend's submit_argmax). Calling it waits
    for the step's pass and gives its result; `launched()` returns once that pass has begun (or the
    step ended), so that what the caller does in between runs beside the pass and not beside the
    scheduler composing it: all of them share one interpreter lock, and eight request threads
    assembling their text while the scheduler waits for it hold each pass back
    (tests/test_passes.py shows the effect without a GPU)."""

    __slots__ = ("_result", "_launched")

    def __init__(self, result, launched=None):
        self._result, self._launched = result, launched

    def launched(self) -> None:
        if self._launched is not None:
            self._launched()

    def __call__(self):
        return self._result()


class Chain:
    """A greedy chain handed to the passes (PassScheduler.submit_chain). `step(k)`: a Submitted for
    the evaluation of the chain's k-th token (k = 0 the token it started from, then each argmax it
    continued with), whose call waits for that evaluation and gives its argmax; `cancel()` stops it
    (after the pass that holds it) and returns the tokens evaluated, in order."""

    __slots__ = ("_passes", "work")

    def __init__(self, passes: "PassScheduler", work: Work):
        self._passes, self.work = passes, work

    def token(self, k: int) -> int | None:
        """The chain's k-th token once it is known (None before)."""
        w = self.work
        with self._passes._cv:
            return w.tokens[k] if k < len(w.tokens) else None

    def step(self, k: int) -> Submitted:
        return Submitted(lambda: self._result(k))

    def row(self) -> np.ndarray | None:
        """The logits row of the chain's last evaluation, kept when its argmax was one of the
        submit_chain's `rows_for` ids (which end the chain); None otherwise."""
        return self.work.logits

    def _result(self, k: int) -> int:
        w, cv = self.work, self._passes._cv
        with cv:
            while len(w.chain_out) <= k and not w.event.is_set():
                cv.wait()
            if len(w.chain_out) > k:
                return w.chain_out[k]
        if w.error is not None:
            raise w.error
        raise RuntimeError(f"the chain of sequence {w.seq} ended after {len(w.chain_out)} evaluations, "
                           f"before evaluation {k + 1}")

    def cancel(self) -> list[int]:
        w = self.work
        if not w.event.is_set():
            self._passes.cancel(w.seq)
        with self._passes._cv:
            return list(w.tokens[:w.done])


class PassScheduler:
    """Gathers the eval calls of several sequences into shared passes (see the module docstring).
    Counters: `passes`, `shared_passes` (passes with tokens of more than one sequence),
    `max_sequences_in_a_pass`. `budget`: the prompt tokens a pass may carry next to decode steps,
    fed with every pass's time. A subclass runs the passes (`_run_pass`) and names what it serves
    (`serves`, for messages)."""

    serves = "the backend"             # "the llama.cpp context", "the native engine"
    thread_name = "openjet-pass"
    # the backend can put a prompt piece through its layers over several passes (_run_pass honours
    # Work.share and keeps Work.piece): a piece larger than the budget's room goes in shares
    pieces_in_layers = False

    def __init__(self, n_batch: int, n_seq: int):
        self.n_batch = n_batch
        self.n_seq = n_seq
        self._cv = threading.Condition()
        self._pending: list[Work] = []
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
        self.piece_passes = 0                  # passes that ran a share of a prompt piece's layers
        # decode-only passes' seconds by their decode steps, the last PASS_TIMES_KEPT of each: what
        # a pass of k sequences costs as the scheduler runs it (openjet bench's concurrent details)
        self.decode_pass_seconds: dict[int, collections.deque] = {}
        # the last PASS_TRACE_KEPT passes: (perf_counter when the scheduler began it, when it
        # ended, the seconds it ran holding the backend, decode steps, prompt tokens, when its last
        # decode step was handed in (0.0: none)); the time before those seconds is the pass waiting
        # for the backend (another thread holding it). A gap between passes splits at steps_in:
        # before it the request threads were still handing their steps in, after it the scheduler
        # composed the pass (its wake-up included)
        self.trace: collections.deque = collections.deque(maxlen=PASS_TRACE_KEPT)

    def _run_pass(self, chosen: list[tuple[Work, int]]) -> tuple[list[BaseException | None], float]:
        """Put each chosen work's next n tokens into its sequence; set the result (logits or
        argmax) of each work they finish, and the logits row too where the argmax is in the
        work's rows_for. Returns, per chosen work, None where its n tokens went
        in or the exception that failed it, and the pass's seconds (timed where it held the
        backend, not waiting for it)."""
        raise NotImplementedError

    def counts(self) -> dict:
        """The counters a backend's `pass_counts` reports (openjet bench's concurrent details)."""
        return {"passes": self.passes, "shared_passes": self.shared_passes,
                "max_sequences_in_a_pass": self.max_sequences_in_a_pass, "piece_passes": self.piece_passes,
                "decode_pass_ms": self.decode_pass_ms()}

    def trace_since(self, t: float) -> list[tuple[float, float, float, int, int, float]]:
        """The kept passes that ended after perf_counter time t (`trace`'s entries)."""
        with self._cv:
            return [e for e in self.trace if e[1] > t]

    def decode_pass_ms(self) -> dict[int, float]:
        """The median decode-only pass in ms, by its decode steps (sequences)."""
        return {k: round(1e3 * float(np.median(v)), 3) for k, v in sorted(self.decode_pass_seconds.items()) if v}

    def _prompt_tokens(self, w: Work, n: int) -> int:
        """The prompt tokens of w this pass takes, given the n the budget allows (1..w.left): a
        backend whose kernels split a prompt only at some boundaries rounds here."""
        return n

    # --- the request threads' side --------------------------------------------------------------
    def submit(self, seq: int, tokens: list[int], n_past: int = 0, want_logits: bool = True,
               chain: tuple[int, frozenset, frozenset] | None = None) -> Work:
        """Hand in tokens of sequence seq to evaluate at n_past..; its event is set when they
        are done (logits or argmax: those of the last token) or failed (error). chain: (the
        evaluations after this one, the end-of-generation ids, the rows_for ids) of a
        submit_chain."""
        work = Work(seq, tokens, n_past, next(self._order), want_logits)
        if chain is not None:
            work.chain_left, work.chain_out = chain[0], []
            work.chain_eog, work.rows_for = chain[1] | chain[2], chain[2]
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.serves} is closed")
            if any(w.seq == seq for w in self._pending):
                raise RuntimeError(f"sequence {seq} already has an eval in progress")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
                self._thread.start()
            self._pending.append(work)
            self._cv.notify_all()
        return work

    def submit_chain(self, seq: int, token: int, evaluations: int, eog, n_past: int = 0, rows_for=()) -> Chain:
        """A greedy chain of sequence seq from `token`: evaluated, then each step's argmax as the
        next step, `evaluations` in all at most, ending at the first argmax in `eog` or in
        `rows_for` (not evaluated); for an argmax in rows_for the backend keeps the logits row
        (Chain.row). See the module docstring."""
        if isinstance(evaluations, bool) or not isinstance(evaluations, int) or evaluations < 1:
            raise ValueError(f"a chain needs evaluations >= 1, got {evaluations!r}")
        work = self.submit(seq, [int(token)], n_past, want_logits=False,
                           chain=(evaluations - 1, frozenset(eog), frozenset(int(t) for t in rows_for)))
        return Chain(self, work)

    def wait(self, work: Work) -> None:
        """Until the work is done or failed (the scheduler's thread runs its passes)."""
        work.event.wait()

    def wait_launched(self, work: Work) -> None:
        """Until a pass that takes the work's tokens has begun, or the work is done or failed."""
        work.launched.wait()

    def cancel(self, seq: int) -> None:
        """Drop sequence seq's unfinished work (its caller gave up, e.g. on Ctrl-C) and wait for a
        pass that holds it to end: afterwards the scheduler touches the sequence no more, and the
        work's `done` counts exactly the tokens that went into its state."""
        with self._cv:
            for w in [w for w in self._pending if w.seq == seq]:
                if w.piece or (self.pieces_in_layers and seq in self._in_pass):
                    # part way through a piece's layers, or in the pass running now (which may
                    # begin one): the piece ends first (the sequence's state takes it whole),
                    # then the work
                    w.stop_after_piece = True
                    continue
                w.cancelled = True
                self._pending.remove(w)
                w.error = RuntimeError("cancelled")
                w.finish()
            while not self._closed and (seq in self._in_pass or any(w.seq == seq for w in self._pending
                                                                    if w.stop_after_piece)):
                self._cv.wait()

    def close(self) -> None:
        """End the scheduler's thread (after the pass it runs) and fail the works still waiting."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            for w in self._pending:
                w.error = RuntimeError(f"{self.serves} was closed")
                w.finish()
            self._pending = []

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
                steps_in = max((w.submitted for w, n in chosen if n == 1 == len(w.tokens)), default=0.0)
                self._in_pass = {w.seq for w, _ in chosen}
                for w, _ in chosen:
                    w.launched.set()
            began = time.perf_counter()
            try:
                errors, seconds = self._run_pass(chosen)
            except Exception as exc:  # noqa: BLE001 - the callers get it; the thread serves on
                failure = RuntimeError(f"a pass of {self.serves} failed: {type(exc).__name__}: {exc}")
                errors, seconds = [failure] * len(chosen), 0.0
            ended = time.perf_counter()
            with self._cv:
                # a piece in layers counts the share of its tokens whose layers ran
                n_prompt = sum(n if w.ran >= 1 else max(1, round(n * w.ran)) for w, n in chosen) - n_decode
                self.trace.append((began, ended, seconds, n_decode, n_prompt, steps_in))
                if not any(errors):
                    self.budget.record(n_decode, n_prompt, seconds)
                    self._last_pass_seconds = seconds
                    if n_decode and n_decode == sum(n for _, n in chosen):
                        self.decode_pass_seconds.setdefault(
                            n_decode, collections.deque(maxlen=PASS_TIMES_KEPT)).append(seconds)
                self._expected = {w.seq for w, _ in chosen}
                self._decoders_of_last_pass = n_decode
                self.passes += 1
                self.shared_passes += len(chosen) > 1
                self.piece_passes += any(w.ran < 1 for w, _ in chosen)
                self.max_sequences_in_a_pass = max(self.max_sequences_in_a_pass, len(chosen))
                for (w, n), error in zip(chosen, errors):
                    if error is None and w.piece:
                        continue                # part way through its layers: on in the next pass
                    if error is None:
                        w.done += n             # in the sequence's state, cancelled or not
                    if w.cancelled:
                        continue
                    if w.stop_after_piece:
                        w.cancelled = True      # its cancel waited for the piece to end
                        self._pending.remove(w)
                        w.error = RuntimeError("cancelled")
                        w.finish()
                        continue
                    if error is not None:
                        w.error = error
                    elif w.left:
                        continue                # more of its prompt in a later pass
                    elif w.chain_out is not None:
                        w.chain_out.append(w.argmax)
                        if w.chain_left > 0 and w.argmax not in w.chain_eog:
                            w.chain_left -= 1
                            w.tokens.append(w.argmax)   # the next pass's step, already in hand
                            continue
                    self._pending.remove(w)
                    w.finish()
                self._in_pass = set()
                self._cv.notify_all()

    def _compose(self) -> tuple[list[tuple[Work, int]], int]:
        """(work, tokens it puts in this pass) and the pass's decode tokens: decode steps (works
        of one token) first, then prompts by arrival, at most n_batch tokens, the prompts' at most
        what the budget allows next to the sequences that decode."""
        decode = sorted((w for w in self._pending if w.left == 1), key=lambda w: w.order)[:self.n_batch]
        chosen = [(w, 1) for w in decode]
        # the decoders of the last pass count even when not back yet: the budget is for them,
        # and a full n_batch chunk now would be the stall it exists to prevent
        decoders = max(len(decode), self._decoders_of_last_pass)
        room = min(self.n_batch - len(decode), self.budget.prompt_tokens(min(decoders, self.n_batch)))
        piece = next((w for w in self._pending if w.piece), None)
        if piece is not None:
            # a piece part way through its layers goes on, the pass's one prompt (it holds the
            # backend's prompt buffers): the share of its layers the room allows
            piece.share, piece.ran = stage_share(room, piece.piece), 1.0
            chosen.append((piece, piece.piece))
        for w in sorted((w for w in self._pending if w.left > 1), key=lambda w: w.order):
            if piece is not None:
                break
            n = min(w.left, room)
            if n == 0:
                break
            m = self._prompt_tokens(w, n)
            w.share, w.ran = 1.0, 1.0
            if m > n and decode and self.pieces_in_layers:
                # rounded up past the room next to decoders: the piece in layers, the room's share
                # of them now, as the pass's one prompt (after another, it waits for the next pass)
                if len(chosen) == len(decode):
                    w.share = stage_share(n, m)
                    chosen.append((w, m))
                break
            chosen.append((w, m))
            room = max(room - m, 0)
        # In the pass by sequence id: with a KV stream per sequence llama.cpp splits a batch into
        # ubatches (one graph, one read of the weights each) of sequences whose ids follow one
        # another in the order they first appear (llama_batch_allocr::split_equal, sequential), so
        # 3, 1, 2, 0 in arrival order would be four passes over the weights and 0, 1, 2, 3 is one.
        # (A gap, 0 and 2 without 1, still makes two; equal tokens per sequence in a ubatch puts a
        # prompt chunk's tokens after its first in a ubatch of their own.) The native engine takes
        # its decode steps in any order; by sequence, its result rows come in a fixed one.
        return sorted(chosen, key=lambda c: c[0].seq), len(decode)
