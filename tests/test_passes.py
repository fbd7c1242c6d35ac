"""The pass scheduler's hand-over to request threads (backends/passes.py): a step's `launched`
event, and why the engine waits on it before its own per-token work; a greedy chain, whose next
steps the scheduler hands in itself.

The scheduler and the request threads share one interpreter lock. A request thread that hands in
its next greedy step and then assembles its text holds that lock while the scheduler wants it to
compose the next pass; with eight such threads the pass starts only after all of their work.
Waiting for the pass to begin first puts that work
beside the pass, where the GPU is busy anyway. No GPU here: the pass is a sleep (it releases the
lock, as the native engine's cffi call does).
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from openjet_plugin.backends.passes import Chain, PassScheduler, Submitted

PASS_S = 0.012          # a decode pass of 8 sequences is ~14.5 ms on an H100
STREAMS = 8


class SleepPasses(PassScheduler):
    """Passes that take PASS_S without the interpreter lock, each step's argmax its sequence id.
    `launched_before_pass`: per pass, whether every chosen work's launched event was set when the
    pass began."""

    def __init__(self, n_batch: int = 64, n_seq: int = STREAMS, pass_s: float = PASS_S):
        super().__init__(n_batch, n_seq)
        self.pass_s = pass_s
        self.launched_before_pass: list[bool] = []
        self.gate = threading.Event()
        self.gate.set()

    def _run_pass(self, chosen):
        self.launched_before_pass.append(all(w.launched.is_set() for w, _ in chosen))
        self.gate.wait()
        t0 = time.perf_counter()
        time.sleep(self.pass_s)
        for w, _ in chosen:
            w.argmax = w.seq
        return [None] * len(chosen), time.perf_counter() - t0


def _burn(seconds: float) -> int:
    """Python work holding the interpreter lock (detokenizing, the text, the caller's chunk)."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def _gaps_between_passes(wait_launched: bool, work_s: float, steps: int = 40) -> list[float]:
    """Eight request threads decoding greedily as Engine._generate_locked does (the next step
    handed in as soon as the token is known, then work_s of their own work); the seconds between
    one 8-sequence pass's end and the next one's start."""
    sched = SleepPasses()

    def client(seq: int) -> None:
        work = sched.submit(seq, [1], 0, want_logits=False)
        for _ in range(steps):
            sched.wait(work)
            nxt = sched.submit(seq, [1], 0, want_logits=False)
            if wait_launched:
                sched.wait_launched(nxt)
            _burn(work_s)
            work = nxt
        sched.wait(work)

    return _full_pass_gaps(sched, client)


def _full_pass_gaps(sched: PassScheduler, client) -> list[float]:
    """client(seq) on STREAMS request threads; the seconds between one STREAMS-sequence pass's end
    and the next one's start."""
    threads = [threading.Thread(target=client, args=(s,)) for s in range(STREAMS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request thread never got its step"
        trace = list(sched.trace)
    finally:
        sched.close()
    full = [k for k, e in enumerate(trace) if e[3] == STREAMS]
    return [trace[k + 1][0] - trace[k][1] for k in full if k + 1 < len(trace) and trace[k + 1][3] == STREAMS]


def test_request_threads_work_beside_the_pass_not_its_composing():
    work_s = 0.0005       # 8 x 0.5 ms: ~4 ms of Python per pass, a third of the pass
    without = statistics.median(_gaps_between_passes(False, work_s))
    with_launch = statistics.median(_gaps_between_passes(True, work_s))
    # handed in and then working, the threads hold the next pass back by about their work's sum
    assert without > 0.5 * STREAMS * work_s, without
    # waiting for the pass to begin, the gap is the hand-over alone, whatever their work
    assert with_launch < 0.5 * without, (with_launch, without)


def test_launched_is_set_before_the_pass_and_before_its_result():
    sched = SleepPasses(pass_s=0.0)
    sched.gate.clear()                       # the pass begins and holds until the gate opens
    try:
        work = sched.submit(0, [5], 0, want_logits=False)
        assert work.launched.wait(10), "the pass never began"
        assert not work.event.is_set()       # its result is not there yet
        sched.gate.set()
        sched.wait(work)
        assert work.argmax == 0 and sched.launched_before_pass == [True]
    finally:
        sched.gate.set()
        sched.close()


@pytest.mark.parametrize("end", ["cancel", "close"])
def test_a_step_that_never_runs_releases_its_launched_waiters(end):
    """A step cancelled (its caller left) or left when the scheduler closes: a thread waiting for
    its pass to begin goes on (no hang), and the step carries the error."""
    sched = SleepPasses(pass_s=0.0)
    sched.gate.clear()
    try:
        first = sched.submit(0, [1], 0, want_logits=False)      # holds the scheduler in its pass
        assert first.launched.wait(10)
        second = sched.submit(1, [1], 0, want_logits=False)     # waits for the next pass
        waiter = threading.Thread(target=sched.wait_launched, args=(second,))
        waiter.start()
        if end == "cancel":
            sched.cancel(1)
        else:
            threading.Thread(target=sched.close).start()
            time.sleep(0.05)
            sched.gate.set()
        waiter.join(10)
        assert not waiter.is_alive() and second.error is not None
    finally:
        sched.gate.set()
        sched.close()


def test_submitted_waits_for_its_result_and_passes_launched_on():
    calls = []
    s = Submitted(lambda: calls.append("result") or 7, lambda: calls.append("launched"))
    s.launched()
    assert s() == 7 and calls == ["launched", "result"]
    plain = Submitted(lambda: 3)             # one sequence: the eval runs in the call
    plain.launched()
    assert plain() == 3


def test_the_trace_says_when_each_pass_s_last_step_was_handed_in():
    """PassScheduler.trace's sixth field: the last decode step's hand-in time of each pass, between
    the previous pass's end and the pass's start when the scheduler waited for it (0.0 for a pass
    without decode steps)."""
    sched = SleepPasses(pass_s=0.005)
    try:
        first = sched.submit(0, [1], 0, want_logits=False)
        sched.wait(first)
        time.sleep(0.02)                     # the thread's own work before its next step
        second = sched.submit(0, [1], 0, want_logits=False)
        sched.wait(second)
        prompt = sched.submit(1, [1, 2, 3], 0, want_logits=False)
        sched.wait(prompt)
        trace = list(sched.trace)
    finally:
        sched.close()
    assert len(trace) >= 3 and all(len(e) == 6 for e in trace)
    (_, end0, *_), (began1, _, _, _, _, in1) = trace[:2]
    assert end0 + 0.015 < in1 <= began1
    assert sum(e[4] for e in trace[2:]) == 3 and all(e[5] == 0.0 for e in trace[2:])   # the prompt's passes
class TokenPasses(SleepPasses):
    """SleepPasses whose argmax is the evaluated token + 1 (a chain's steps are 5, 6, 7, ...)."""

    def _run_pass(self, chosen):
        errors, seconds = super()._run_pass(chosen)
        for w, n in chosen:
            w.argmax = w.tokens[w.done + n - 1] + 1
        return errors, seconds


def test_a_chain_continues_from_each_argmax_until_its_end():
    """submit_chain: each step's argmax is the next step, evaluated; an end-of-generation argmax
    ends it unevaluated, and so does the evaluations' count; step(k) gives the k-th argmax, and a
    step past the end says so; cancel stops it and returns exactly the tokens evaluated."""
    sched = TokenPasses(pass_s=0.0)
    try:
        eog = sched.submit_chain(0, 5, 50, {9})
        assert [eog.step(k)() for k in range(4)] == [6, 7, 8, 9]
        with pytest.raises(RuntimeError, match="ended after 4 evaluations"):
            eog.step(4)()
        assert eog.cancel() == [5, 6, 7, 8] and eog.work.done == 4      # 9 never went in
        short = sched.submit_chain(1, 20, 3, set())
        assert [short.step(k)() for k in range(3)] == [21, 22, 23] and short.cancel() == [20, 21, 22]
        assert isinstance(short, Chain) and short.token(0) == 20 and short.token(3) is None
        biased = sched.submit_chain(4, 30, 50, {99}, rows_for={33})   # ends at a rows_for argmax too
        assert [biased.step(k)() for k in range(3)] == [31, 32, 33] and biased.cancel() == [30, 31, 32]
        assert biased.work.rows_for == {33} and biased.row() is None    # TokenPasses keeps no rows

        sched.gate.clear()                   # a long chain, cancelled while a pass holds it
        long = sched.submit_chain(2, 100, 1000, set())
        assert long.work.launched.wait(10)
        threading.Timer(0.05, sched.gate.set).start()
        evaluated = long.cancel()
        assert evaluated == list(range(100, 100 + len(evaluated))) and len(evaluated) == long.work.done >= 1
        passes = sched.passes
        time.sleep(0.05)
        assert sched.passes == passes        # nothing of sequence 2 runs any more
        with pytest.raises(ValueError, match="evaluations >= 1"):
            sched.submit_chain(3, 1, 0, set())
    finally:
        sched.gate.set()
        sched.close()


def _chain_gaps(work_s: float, steps: int = 40) -> list[float]:
    """_gaps_between_passes with chains: each request thread reads its steps' argmaxes in order and
    does work_s of its own work after each; the scheduler hands in the next steps itself."""
    sched = TokenPasses()

    def client(seq: int) -> None:
        chain = sched.submit_chain(seq, 1, steps, set())
        for k in range(steps):
            chain.step(k)()
            _burn(work_s)
        chain.cancel()

    return _full_pass_gaps(sched, client)


def test_chains_put_the_next_pass_right_after_the_last():
    """With chains no pass waits for the request threads to hand their steps in: the gap between
    two 8-sequence passes is the scheduler's own bookkeeping, well under the hand-over of eight
    threads that each hand in their step (the launched path)."""
    work_s = 0.0005
    handed_in = statistics.median(_gaps_between_passes(True, work_s))
    chained = statistics.median(_chain_gaps(work_s))
    assert chained < 0.5 * handed_in, (chained, handed_in)


class PiecePasses(TokenPasses):
    """TokenPasses of a backend that puts prompt pieces through their layers over several passes
    (pieces_in_layers): pieces are whole multiples of 64 tokens (as the native engine's DeltaNet
    chunks make them), the budget allows `room` prompt tokens next to decode steps, and a piece
    asked for a share of its layers runs that share (`shares`: per sequence, the shares of its
    piece so far)."""

    pieces_in_layers = True

    def __init__(self, room: int, **kw):
        super().__init__(**kw)
        self.budget.prompt_tokens = lambda n_decode: room if n_decode else self.n_batch
        self.shares: dict[int, list[float]] = {}
        self.pieces_done: list[tuple[int, int]] = []      # (sequence, tokens) of every piece finished

    def _prompt_tokens(self, w, n):
        return n if n >= w.left else min(w.left, max(64, n - n % 64))

    def _run_pass(self, chosen):
        errors, seconds = super()._run_pass(chosen)
        for w, n in chosen:
            if w.share < 1 or w.piece:
                got = self.shares.setdefault(w.seq, [])
                w.ran = min(w.share, 1 - sum(got))
                got.append(w.ran)
                w.piece = n if sum(got) < 1 - 1e-9 else 0
                if not w.piece:
                    self.shares[w.seq] = []
                    self.pieces_done.append((w.seq, n))
        return errors, seconds


def test_a_piece_larger_than_the_room_goes_in_layers_beside_the_decoders():
    """Next to decode steps a prompt piece larger than the budget's room goes in shares of its
    layers, the pass's one prompt, until it is in; the trace and the budget count the share's
    tokens; a cancel while a piece is part way waits for it to end, and `done` counts it whole."""
    sched = PiecePasses(room=16, pass_s=0.001)
    try:
        decoder = sched.submit_chain(0, 5, 10_000, set())
        assert decoder.step(2)()
        prompt = sched.submit(1, list(range(200, 400)), want_logits=False)
        other = sched.submit(2, list(range(500, 600)), want_logits=False)
        sched.wait(prompt)
        assert sched.pieces_done[:3] == [(1, 64), (1, 64), (1, 64)] and prompt.done == 200
        assert prompt.argmax == 400                 # the last token's argmax: all 200 went in
        # each piece in shares of 16 / 64 of its layers, beside the decoder; the last piece of 8
        # fits the room whole
        shared = [e for e in sched.trace if e[4] and e[3]]
        assert sum(1 for e in shared if e[4] == 16) >= 12
        assert all(e[4] <= 16 for e in shared)
        sched.wait(other)
        # cancel part way through a piece: it waits for the piece to end
        sched.gate.clear()
        late = sched.submit(3, list(range(700, 1000)), want_logits=False)
        assert late.launched.wait(10)
        sched.gate.set()
        while not late.piece:
            time.sleep(0.0005)
        sched.cancel(3)
        assert late.event.is_set() and isinstance(late.error, RuntimeError) and late.done % 64 == 0 < late.done
        assert sched.shares.get(3, []) == []          # no piece of sequence 3 left part way
        n_done = len(sched.pieces_done)
        time.sleep(0.02)
        assert [p for p in sched.pieces_done[n_done:] if p[0] == 3] == []
        # cancel while the pass that begins a piece runs: it waits for that piece too
        sched.gate.clear()
        began = sched.submit(4, list(range(700, 1000)), want_logits=False)
        assert began.launched.wait(10) and began.piece == 0
        cancelled = threading.Thread(target=sched.cancel, args=(4,))
        cancelled.start()
        time.sleep(0.01)
        sched.gate.set()
        cancelled.join(10)
        assert not cancelled.is_alive() and began.done == 64 and isinstance(began.error, RuntimeError)
        assert sched.shares.get(4, []) == [] and (4, 64) in sched.pieces_done
        decoder.cancel()
    finally:
        sched.gate.set()
        sched.close()
