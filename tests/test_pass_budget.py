"""The prompt-token budget of a shared pass (backends/pass_budget.py, issue 29): sized from pass
timings, so that a long prompt arriving does not stall the sequences that decode.

The budget alone: given timings -> chunk sizes; a waiting prompt always advances; alone it goes
at full n_batch; bad input names its parameter. The scheduler: it composes passes by the budget;
on the embedded model a 1,000-token prompt arriving while 3 sequences decode keeps their
inter-token p99 within a bound (the old behaviour, the whole n_batch chunk in one pass with the
decode steps, is tens of times over it), and every sequence's output is what it is alone.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin.backends.pass_budget import MAX_GROWTH, MIXED_PASS_SLOWDOWN, PassBudget

MS = 1e-3


def primed(n_batch=512, slowdown=2.0, n_decode=3, decode_s=3 * MS) -> PassBudget:
    b = PassBudget(n_batch, slowdown)
    b.record(n_decode, 0, decode_s)
    return b


# --- the budget ----------------------------------------------------------------------------------------

def test_alone_a_prompt_goes_at_full_n_batch():
    assert PassBudget(512).prompt_tokens(0) == 512
    b = primed()
    b.record(3, 4, 9 * MS)
    assert b.prompt_tokens(0) == 512          # whatever was measured while others decoded


def test_before_any_mixed_pass_a_prompt_token_costs_a_decode_token():
    # decode-only pass of 3 tokens: 3 ms; at 2x the mixed pass may add 3 ms, i.e. 3 tokens at 1 ms
    assert primed(slowdown=2.0).prompt_tokens(3) == 3
    assert primed(slowdown=3.0).prompt_tokens(3) == 6


def test_the_chunk_follows_the_measured_cost_of_a_prompt_token():
    b = primed()
    # 3 decode + 3 prompt tokens took 4.5 ms: 0.5 ms per prompt token -> 6 fit in the 3 ms allowed
    b.record(3, 3, 4.5 * MS)
    assert b.prompt_tokens(3) == 6
    for _ in range(30):
        b.record(3, 6, 6 * MS)                # exactly the target: the chunk stays
    assert b.prompt_tokens(3) == 6
    # prompt tokens got dearer (a longer context to attend to): 1.5 ms each, the next chunk shrinks at once
    b.record(3, 6, 12 * MS)
    assert b.prompt_tokens(3) < 6
    for _ in range(30):
        b.record(3, 2, 6 * MS)
    assert b.prompt_tokens(3) == 2


def test_the_chunk_at_most_doubles_from_one_mixed_pass_to_the_next():
    b = primed()
    b.record(3, 2, 3 * MS)                    # prompt tokens looked free
    assert b.prompt_tokens(3) == MAX_GROWTH * 2
    sizes = []
    for _ in range(12):
        n = b.prompt_tokens(3)
        sizes.append(n)
        b.record(3, n, 3 * MS)
    assert sizes[:4] == [4, 8, 16, 32] and max(sizes) == 512 - 3     # then the pass's room


def test_a_waiting_prompt_always_gets_tokens():
    b = primed(n_batch=64)
    b.record(3, 1, 10.0)                      # a pass that took seconds: a prompt token "costs" 10 s
    for n_decode in range(1, 64):
        assert 1 <= b.prompt_tokens(n_decode) <= 64 - n_decode
    assert b.prompt_tokens(64) == 0           # the decode steps fill the pass
    assert b.prompt_tokens(70) == 0


def test_decode_counts_never_seen_alone_use_a_smaller_one_or_probe_with_one_token():
    b = PassBudget(512)
    assert b.prompt_tokens(2) == 1            # nothing measured: one prompt token, timed as the decode pass
    b.record(2, 1, 2 * MS)
    assert b.decode_seconds(2) == pytest.approx(2 * MS)
    assert b.prompt_tokens(2) == 2            # (2 - 1) x 2 ms at 1 ms a token
    assert b.decode_seconds(5) == pytest.approx(2 * MS)     # the nearest smaller count: a smaller chunk
    assert b.decode_seconds(1) is None and b.prompt_tokens(1) == 1
    # decode-only passes refine the time by a moving average
    b.record(2, 0, 4 * MS)
    assert 2 * MS < b.decode_seconds(2) < 4 * MS


def test_a_prompt_only_pass_teaches_nothing():
    b = primed()
    before = b.prompt_tokens(3)
    b.record(0, 512, 0.2)
    assert b.prompt_tokens(3) == before


@pytest.mark.parametrize("args, needle", [
    ((0,), "n_batch"), ((2.5,), "n_batch"), ((True,), "n_batch"),
    ((512, 1.0), "slowdown"), ((512, 0.5), "slowdown"), ((512, "2"), "slowdown")])
def test_a_bad_budget_names_the_parameter(args, needle):
    with pytest.raises(ValueError, match=needle):
        PassBudget(*args)


@pytest.mark.parametrize("call, needle", [
    (lambda b: b.prompt_tokens(-1), "n_decode"), (lambda b: b.prompt_tokens(1.5), "n_decode"),
    (lambda b: b.record(-1, 0, MS), "n_decode"), (lambda b: b.record(1, -2, MS), "n_prompt"),
    (lambda b: b.record(1, 1, -MS), "seconds"), (lambda b: b.record(1, 1, float("nan")), "seconds")])
def test_bad_timings_name_the_parameter(call, needle):
    with pytest.raises(ValueError, match=needle):
        call(PassBudget(512))


def test_the_default_slowdown_leaves_room_under_the_issues_target():
    assert 1 < MIXED_PASS_SLOWDOWN < 3


# --- the scheduler composes passes by it ----------------------------------------------------------

class NoLlama:
    """Enough of llama_cpp for a PassScheduler that only composes (no thread, no decode)."""

    def llama_batch_init(self, *args):
        return None


def scheduler(n_batch=64):
    from openjet_plugin.backends.llama_cpp_sequences import PassScheduler
    from openjet_plugin.backends.passes import Work

    sched = PassScheduler(NoLlama(), None, 10, n_batch, 4)
    order = iter(range(100))

    def work(seq, n_tokens):
        w = Work(seq, list(range(n_tokens)), 0, next(order))
        sched._pending.append(w)
        return w
    return sched, work


def test_the_scheduler_caps_a_prompt_next_to_decode_steps_by_the_budget():
    sched, work = scheduler()
    sched.budget.record(3, 0, 3 * MS)
    sched.budget.record(3, 2, 4 * MS)          # 0.5 ms a prompt token -> 6 allowed, at most 2 x 2 now
    long = work(3, 500)
    decoders = [work(s, 1) for s in range(3)]
    chosen, n_decode = sched._compose()
    assert n_decode == 3 and [w for w, _ in chosen[:3]] == decoders
    assert chosen[3] == (long, sched.budget.prompt_tokens(3)) and chosen[3][1] == 4


def test_the_scheduler_orders_a_pass_by_sequence_id():
    """llama.cpp makes one ubatch of sequences whose ids follow one another in batch order: works
    arriving 3, 1, 2, 0 go into the batch 0, 1, 2, 3 (one read of the weights, not four)."""
    sched, work = scheduler()
    works = {s: work(s, 1) for s in (3, 1, 2, 0)}
    chosen, n_decode = sched._compose()
    assert n_decode == 4 and [w for w, _ in chosen] == [works[s] for s in range(4)]


def test_the_scheduler_gives_a_prompt_alone_full_n_batch_and_counts_decoders_still_sampling():
    sched, work = scheduler()
    sched.budget.record(3, 0, 3 * MS)
    long = work(3, 500)
    assert sched._compose() == ([(long, 64)], 0)
    # the three decoders of the last pass are sampling: not back yet, but the budget is theirs
    sched._decoders_of_last_pass = 3
    assert sched._compose() == ([(long, 3)], 0)


# --- on the embedded model ------------------------------------------------------------------------

LONG_PROMPT = [(7 * i) % 3000 + 10 for i in range(1000)]
DECODER_PROMPTS = [b"def fibonacci(n):", b"The quick brown fox", b"import os\nimport sys\n"]
LEAD = 8                  # every decoder has this many tokens before the prompt arrives
TAIL = 8                  # and decodes this many after it returns
# The bound on p99 with the prompt / p99 without, for a loaded 2-core CI machine: measured here
# about 2 (the budget's 2x on the pass, less the overheads a gap has besides the pass); the old
# behaviour, a 512-token chunk in the pass with the decode steps, gave 40-70.
ITL_P99_BOUND = 3 * MIXED_PASS_SLOWDOWN


def p99(xs):
    s = sorted(xs)
    return s[max(0, int(np.ceil(0.99 * len(s))) - 1)]


def decode_rounds(backend, prompts, with_prompt: bool, n_tokens: int = 128):
    """3 threads decode greedily on sequences 0..2; with_prompt: once each has LEAD tokens, sequence
    3 evaluates LONG_PROMPT, and they decode until TAIL tokens past its return. Returns (each
    decoder's tokens, each decoder's gaps in s during the prompt or all of them, prompt logits)."""
    seqs = backend.sequences()
    for s in seqs:
        s.reset()
    cv = threading.Condition()
    counts = [0, 0, 0]
    state: dict = {}
    out = [None, None, None]

    def decoder(i):
        seq, toks, times = seqs[i], [], []
        logits = seq.eval(backend.tokenize(prompts[i], True, True))
        limit = seq.n_ctx - seq.n_past - 1
        while len(toks) < limit:
            toks.append(int(np.argmax(logits)))
            logits = seq.eval([toks[-1]])
            times.append(time.perf_counter())
            with cv:
                counts[i] = len(toks)
                cv.notify_all()
            if not with_prompt and len(toks) >= n_tokens:
                break
            if with_prompt and "done" in state and times[-1] > state["done"] and \
                    sum(t > state["done"] for t in times) >= TAIL:
                break
        out[i] = (toks, times)

    def prompt():
        with cv:
            while min(counts) < LEAD:
                cv.wait()
        state["sent"] = time.perf_counter()
        state["logits"] = seqs[3].eval(LONG_PROMPT)
        state["done"] = time.perf_counter()

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(3)]
    if with_prompt:
        threads.append(threading.Thread(target=prompt))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    gaps = []
    for toks, times in out:
        for t0, t1 in zip(times, times[1:]):
            if not with_prompt or (t1 > state["sent"] and t0 < state["done"]):
                gaps.append(t1 - t0)
    return [o[0] for o in out], gaps, state


@pytest.fixture(scope="module")
def model():
    return openjet_plugin.default_model_path()


@pytest.mark.slow
def test_a_long_prompt_arriving_keeps_the_decoders_inter_token_p99_within_the_bound(model):
    from openjet_plugin.backends.llama_cpp import LlamaCppBackend

    multi = LlamaCppBackend(model, 2048, n_threads=1, n_seq=4)
    try:
        assert multi._passes.n_batch == 512
        decode_rounds(multi, DECODER_PROMPTS, False, 16)            # warm-up
        _, without, _ = decode_rounds(multi, DECODER_PROMPTS, False)
        tokens, during, state = decode_rounds(multi, DECODER_PROMPTS, True)
        ratio = p99(during) / p99(without)
        print(f"\nITL p99 without the prompt {1e3 * p99(without):.1f} ms, with it {1e3 * p99(during):.1f} ms "
              f"({ratio:.1f}x, {len(during)} gaps); the prompt among them {state['done'] - state['sent']:.2f} s")
        assert ratio < ITL_P99_BOUND, (ratio, sorted(during)[-5:])
        assert len(during) >= 3 * TAIL
        # every decoder outlasted the prompt, and each output is the one-sequence backend's
        assert all(len(t) > LEAD + TAIL for t in tokens)
    finally:
        multi.close()
    single = LlamaCppBackend(model, 2048, n_threads=1)
    try:
        # the prompt went in over hundreds of passes, the first token of each in llama.cpp's ubatch
        # of one token per sequence, its recurrent update the one-token path: as close to the
        # whole-prompt logits as a prompt fed token by token is (measured: 0.10 at most), same argmax
        want = single.eval(LONG_PROMPT)
        print(f"prompt logits: max |difference| from alone {np.abs(state['logits'] - want).max():.3f}")
        np.testing.assert_allclose(state["logits"], want, rtol=0, atol=0.25)
        assert np.argmax(state["logits"]) == np.argmax(want)
        for p, got in zip(DECODER_PROMPTS, tokens):
            single.reset()
            logits, want = single.eval(single.tokenize(p, True, True)), []
            while len(want) < len(got):
                want.append(int(np.argmax(logits)))
                logits = single.eval([want[-1]])
            assert got == want, p
    finally:
        single.close()
