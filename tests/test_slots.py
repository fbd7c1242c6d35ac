"""Several conversations at once (issue 29, the CPU side): an engine with n_slots > 1 on the
llama.cpp backend runs concurrent requests in their own slots, and their evals share llama_decode
passes (backends/llama_cpp_sequences.py).

Checked on the embedded default model: concurrent greedy streams are each exactly what the
stream gives alone; the passes were shared; a stream closed midway frees its slot without
disturbing the others; a request that cannot fit fails alone; a request takes the slot holding
its prefix; per-sequence rollback and recurrent checkpoints behave as the one-sequence backend's;
a long prompt goes in n_batch chunks while another sequence keeps decoding; `openjet serve
--slots 2` streams two requests interleaved.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import run_threads  # noqa: E402

import openjet_plugin  # noqa: E402
from openjet_plugin.errors import ContextOverflowError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n\nclass Config:",
           "for i in range(10):"]
N_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return openjet_plugin.default_model_path()


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy continuation on a one-slot engine: the reference."""
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1) as eng:
        assert eng.n_slots == 1
        return {p: eng.generate(p, max_tokens=N_TOKENS, temperature=0).tokens for p in PROMPTS}


@pytest.fixture(scope="module")
def engine(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1, n_slots=4)
    yield eng
    eng.close()




def stream_tokens(eng, prompt, n=N_TOKENS):
    return [t for c in eng.generate(prompt, max_tokens=n, temperature=0, stream=True) for t in c.tokens]


def test_concurrent_greedy_streams_equal_each_alone_and_share_passes(engine, alone):
    assert engine.n_slots == 4 and engine.n_ctx == 256
    before = engine._backend.pass_counts
    got = run_threads([lambda p=p: stream_tokens(engine, p) for p in PROMPTS])
    assert got == [alone[p] for p in PROMPTS]
    counts = engine._backend.pass_counts
    assert counts["shared_passes"] - before["shared_passes"] >= N_TOKENS // 2, counts
    assert counts["max_sequences_in_a_pass"] >= 3, counts


def test_concurrent_throughput(model, alone):
    """4 streams at once vs one after another on the same 4-slot engine (printed; asserted only
    not to collapse: on this 2-core CPU the 22 MB model is compute-bound, a 4-token pass costs
    about four 1-token passes, so sharing a pass saves little here)."""
    n = 48
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1, n_slots=4) as eng:
        prompts = [p + " " for p in PROMPTS]           # not cached by an earlier request
        t0 = time.perf_counter()
        seq = [eng.generate(p, max_tokens=n, temperature=0, seed=1).tokens for p in prompts]
        t_seq = time.perf_counter() - t0
        eng._forget_state()
        t0 = time.perf_counter()
        par = run_threads([lambda p=p: eng.generate(p, max_tokens=n, temperature=0, seed=1).tokens
                           for p in prompts])
        t_par = time.perf_counter() - t0
    tokens = sum(len(t) for t in seq)
    print(f"\n4 streams x {n} tokens: sequential {tokens / t_seq:.0f} tok/s, concurrent {tokens / t_par:.0f} tok/s "
          f"({t_seq / t_par:.2f}x)")
    assert par == seq
    assert t_par < 3 * t_seq


def test_a_stream_closed_midway_frees_its_slot_and_the_others_continue(model, alone):
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1, n_slots=2) as eng:
        started = threading.Event()

        def abandoned():
            stream = eng.generate(PROMPTS[0], max_tokens=200, temperature=0, stream=True)
            got = next(stream).tokens
            started.set()
            time.sleep(0.05)
            stream.close()                    # the client hung up
            return got

        def steady():
            started.wait(60)
            return stream_tokens(eng, PROMPTS[1])

        first, other = run_threads([abandoned, steady])
        assert other == alone[PROMPTS[1]]
        assert first == alone[PROMPTS[0]][:len(first)]
        assert all(s.owner is None for s in eng._slots)
        # both slots are free again: two more requests run at once and are right
        again = run_threads([lambda: stream_tokens(eng, PROMPTS[2]), lambda: stream_tokens(eng, PROMPTS[3])])
        assert again == [alone[PROMPTS[2]], alone[PROMPTS[3]]]


def test_a_request_that_cannot_fit_fails_alone(engine, alone):
    too_long = [100 + i % 500 for i in range(engine.n_ctx + 1)]

    def bad():
        time.sleep(0.02)                     # while the others decode
        return engine.generate(too_long, max_tokens=4, temperature=0)

    got = run_threads([lambda: stream_tokens(engine, PROMPTS[0]), bad, lambda: stream_tokens(engine, PROMPTS[1])])
    assert isinstance(got[1], ContextOverflowError)
    assert got[0] == alone[PROMPTS[0]] and got[2] == alone[PROMPTS[1]]
    # a sequence view refuses tokens beyond its own n_ctx before any pass sees them
    view = engine._slots[0].backend
    with pytest.raises(ContextOverflowError):
        view.eval([1] * (engine.n_ctx - view.n_past + 1))


def test_a_request_takes_the_slot_holding_its_prefix(model, alone):
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1, n_slots=3) as eng:
        toks = {p: eng.tokenize(p, add_special=True) for p in PROMPTS[:3]}
        for p in PROMPTS[:3]:
            eng.generate(p, max_tokens=8, temperature=0)
        holder = {p: next(s.index for s in eng._slots if s.tokens[:len(toks[p])] == toks[p]) for p in toks}
        assert sorted(holder.values()) == [0, 1, 2]          # three prompts, three slots
        # the conversation of PROMPTS[1] goes on: it lands on the slot that holds it
        follow = eng.generate(PROMPTS[1], max_tokens=N_TOKENS, temperature=0)
        assert follow.tokens == alone[PROMPTS[1]]
        # all but the last prompt token (evaluated again for its logits, from the checkpoint)
        assert follow.stats.cached_prompt_tokens == len(toks[PROMPTS[1]]) - 1
        last = max(eng._slots, key=lambda s: s.last_used)
        assert last.index == holder[PROMPTS[1]]
        # a prompt nobody holds takes the least recently used slot
        eng.generate(PROMPTS[3], max_tokens=4, temperature=0)
        assert max(eng._slots, key=lambda s: s.last_used).index == holder[PROMPTS[0]]


def test_a_new_request_closes_a_gap_in_the_busy_slots(model):
    """llama.cpp reads the weights once per run of consecutive busy sequence ids: with slots 0 and 2
    busy, a request that no slot's tokens help takes slot 1 (one run), not the least recently used
    slot 3 (two runs)."""
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1, n_slots=4) as eng:
        streams = [eng.generate(p, max_tokens=N_TOKENS, temperature=0, stream=True) for p in PROMPTS[:3]]
        for st in streams:
            next(st)                                         # each takes a slot: 0, 1, 2
        assert [s.owner is not None for s in eng._slots] == [True, True, True, False]
        streams[1].close()                                   # slot 1 is free and the most recent
        assert eng._slots[1].owner is None and eng._slots[1].last_used > eng._slots[3].last_used
        new = eng.generate("while True:\n    pass", max_tokens=4, temperature=0, stream=True)
        next(new)
        assert eng._slots[1].owner is not None and eng._slots[3].owner is None
        for st in (streams[0], streams[2], new):
            st.close()


def test_sequence_rollback_and_checkpoints_are_per_sequence(model):
    from openjet_plugin.backends.llama_cpp import LlamaCppBackend

    single = LlamaCppBackend(model, 128, n_threads=1)
    multi = LlamaCppBackend(model, 128, n_threads=1, n_seq=2)
    try:
        a, b = multi.sequences()
        assert multi.n_ctx == 128 and a.n_ctx == 128
        with pytest.raises(RuntimeError, match="sequences"):
            multi.eval([1])
        prompt = single.tokenize(b"import os\nimport sys", True, True)
        want = single.eval(prompt)
        b.eval(single.tokenize(b"something else entirely", True, True))
        got = a.eval(prompt)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # a recurrent state cannot be cut partially: refused, state kept
        assert a.rollback(len(prompt) - 2) is False and a.n_past == len(prompt)
        a.save_checkpoint()
        after = a.eval([10, 11])
        assert a.restore_checkpoint(a.n_past - 1) == len(prompt)
        np.testing.assert_allclose(a.eval([10, 11]), after, rtol=1e-5, atol=1e-5)
        n_b = b.n_past
        a.reset()
        assert a.n_past == 0 and b.n_past == n_b
        np.testing.assert_allclose(a.eval(prompt), want, rtol=1e-5, atol=1e-5)
    finally:
        single.close()
        multi.close()


def test_a_long_prompt_goes_in_chunks_while_another_sequence_decodes(model):
    from openjet_plugin.backends.llama_cpp import LlamaCppBackend

    ref = LlamaCppBackend(model, 256, n_threads=1)
    multi = LlamaCppBackend(model, 256, n_threads=1, n_batch=16, n_seq=2)
    try:
        long_prompt = [(7 * i) % 3000 + 10 for i in range(150)]
        short = ref.tokenize(b"def main():", True, True)
        want_long = ref.eval(long_prompt)
        ref.reset()
        want_short = [ref.eval(short)]
        for _ in range(12):
            want_short.append(ref.eval([int(np.argmax(want_short[-1]))]))
        a, b = multi.sequences()

        def decode_short():
            rows = [b.eval(short)]
            for _ in range(12):
                rows.append(b.eval([int(np.argmax(rows[-1]))]))
            return rows

        got_long, got_short = run_threads([lambda: a.eval(long_prompt), decode_short])
        # the prompt's pieces that share a pass with the decode step go through llama.cpp's ubatch of
        # one token a sequence (split_equal), as a prompt fed token by token does: its logits drift
        # up to ~0.1 from one pass (tests/test_pass_budget.py measures the same); the decoder is exact
        assert int(np.argmax(got_long)) == int(np.argmax(want_long))
        np.testing.assert_allclose(got_long, want_long, rtol=0, atol=0.25)
        for g, w in zip(got_short, want_short):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
        counts = multi.pass_counts
        assert counts["passes"] >= 150 // 16                 # n_batch tokens a pass at most
        assert counts["shared_passes"] >= 2, counts          # the short one decoded between the chunks
    finally:
        ref.close()
        multi.close()


def test_an_interrupted_eval_counts_exactly_what_went_into_the_state(model):
    """Ctrl-C while a sequence waits for its passes: the work is dropped, and n_past counts the
    tokens that did go in, so the engine's rollback / reset logic sees the true state."""
    from openjet_plugin.backends.llama_cpp import LlamaCppBackend

    multi = LlamaCppBackend(model, 256, n_threads=1, n_batch=16, n_seq=2)
    try:
        a, _ = multi.sequences()
        sched = multi._passes
        submit = sched.submit

        class InterruptedWait(threading.Event):
            work = None

            def wait(self, timeout=None):
                while self.work.done < 32:          # two passes in
                    time.sleep(0.001)
                raise KeyboardInterrupt

        def interrupted_submit(*args):
            work = submit(*args)
            ev = InterruptedWait()
            ev.work = work
            work.event = ev
            return work

        sched.submit = interrupted_submit
        long_prompt = [(7 * i) % 3000 + 10 for i in range(150)]
        with pytest.raises(KeyboardInterrupt):
            a.eval(long_prompt)
        sched.submit = submit
        in_state = multi._lib.llama_memory_seq_pos_max(a._mem, a.seq) + 1
        assert 32 <= a.n_past < 150 and a.n_past == in_state
        # the rest goes on from there and ends where one uninterrupted eval would
        got = a.eval(long_prompt[a.n_past:])
        a.reset()
        np.testing.assert_allclose(got, a.eval(long_prompt), rtol=1e-4, atol=1e-4)
    finally:
        multi.close()


def test_a_thread_with_an_open_stream_takes_another_free_slot(engine, alone):
    s1 = engine.generate(PROMPTS[0], max_tokens=N_TOKENS, temperature=0, stream=True)
    s2 = engine.generate(PROMPTS[1], max_tokens=N_TOKENS, temperature=0, stream=True)
    got: dict[int, list[int]] = {0: [], 1: []}
    live = {0: s1, 1: s2}
    while live:                                              # one thread, two slots, interleaved
        for k in list(live):
            try:
                got[k] += next(live[k]).tokens
            except StopIteration:
                del live[k]
    assert (got[0], got[1]) == (alone[PROMPTS[0]], alone[PROMPTS[1]])


# --- openjet serve --slots ----------------------------------------------------------------------------

API_KEY = "sk-openjet-test-" + "1" * 16


@pytest.mark.slow
def test_serve_with_two_slots_streams_two_requests_interleaved(model, tmp_path):
    import httpx

    sys.path.insert(0, str(REPO / "scripts"))
    from load_test import start_server, stop_server

    log_path = tmp_path / "serve.log"
    proc, base = start_server(log_path, threads="1", env={"OPENJET_API_KEY": API_KEY},
                              args=["--slots", "2", "--n-ctx", "512", "--backend", "llama.cpp", "--preload"])
    try:
        assert "2 slots" in log_path.read_text()

        def stream(prompt: str, delay: float, max_tokens: int) -> list[tuple[float, str]]:
            time.sleep(delay)
            body = {"model": "openjet-default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True}
            events = []
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text = json.loads(line[6:])["choices"][0].get("text") or ""
                        if text:
                            events.append((time.monotonic(), text))
            return events

        # the first runs long enough to outlast the second's prompt (its chunks come a few tokens
        # a pass while the first decodes: backends/pass_budget.py) on a loaded 2-core machine
        first, second = run_threads([lambda: stream("def fibonacci(n):", 0.0, 400),
                                     lambda: stream("The quick brown fox", 0.3, 160)])
        assert not isinstance(first, BaseException) and not isinstance(second, BaseException), (first, second)
        assert len(first) > 20 and second
        # the second request's first token came while the first was still streaming
        assert second[0][0] < first[-1][0], (second[0][0] - first[0][0], first[-1][0] - first[0][0])
    finally:
        stop_server(proc)


# --- where users set it ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 65, 2.0, True, "4"])
def test_load_refuses_a_bad_slot_count(model, bad):
    with pytest.raises(ValueError, match="n_slots"):
        openjet_plugin.load(model, backend="llama.cpp", n_ctx=64, n_slots=bad)


def test_load_n_slots_none_takes_the_backends_default(model):
    from openjet_plugin.backends.llama_cpp import DEFAULT_SERVE_SEQUENCES

    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=64, n_threads=1, n_slots=None) as eng:
        assert eng.n_slots == DEFAULT_SERVE_SEQUENCES and eng.n_ctx == 64


def test_serve_slots_option_reaches_the_provider(monkeypatch, capsys):
    from openjet_plugin import serve

    args = serve._parser().parse_args(["--slots", "3"])
    assert serve.proxy_environment([], args, "sk-m")["OPENJET_SLOTS"] == "3"
    assert serve.proxy_environment([], serve._parser().parse_args([]), "sk-m")["OPENJET_SLOTS"] == "auto"
    # the native engine holds several sequences too: the same default before it loads
    from openjet_plugin.backends.llama_cpp import DEFAULT_SERVE_SEQUENCES
    assert serve._slots_guess(serve._parser().parse_args(["--backend", "native"])) == DEFAULT_SERVE_SEQUENCES
    monkeypatch.setattr(serve, "_run_proxy", lambda *a, **k: pytest.fail("the server started"))
    assert serve.main(["--slots", "0"]) == 2
    assert "--slots" in capsys.readouterr().err

    from openjet_plugin.adapters import litellm as provider

    for value, want in (("auto", None), ("2", 2)):
        monkeypatch.setenv("OPENJET_SLOTS", value)
        assert provider._load_options_from_env()["n_slots"] == want
    monkeypatch.setenv("OPENJET_SLOTS", "many")
    with pytest.raises(ValueError, match="OPENJET_SLOTS"):
        provider._load_options_from_env()


def test_concurrent_sampled_requests_with_logprobs_and_a_constraint_equal_each_alone(model):
    """Per-request state (sampler, seed, grammar, logprobs) stays with its request."""
    asks = [dict(prompt=PROMPTS[0], temperature=0.9, seed=7),
            dict(prompt=PROMPTS[1], temperature=0.7, seed=3, top_k=20, logprobs=True, top_logprobs=3),
            dict(prompt=PROMPTS[2], temperature=0, repeat_penalty=1.3, presence_penalty=0.5),
            dict(prompt="Answer in JSON: ", temperature=0.8, seed=11, constraint={"type": "json_object"})]

    def run(eng, ask):
        ask = dict(ask)
        r = eng.generate(ask.pop("prompt"), max_tokens=N_TOKENS, **ask)
        return r.tokens, [(lp.token, round(lp.logprob, 4)) for lp in (r.logprobs or [])]

    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1) as one:
        want = [run(one, a) for a in asks]
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1, n_slots=4) as eng:
        got = run_threads([lambda a=a: run(eng, a) for a in asks])
    assert got == want


def test_more_threads_than_slots_with_abandoned_streams_all_correct(model, alone):
    """6 threads x 3 requests on 2 slots: requests wait for a slot, some streams are dropped
    midway; every finished reply is the one-slot engine's, and all slots end free."""
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1, n_slots=2) as eng:
        def worker(t):
            out = []
            for k in range(3):
                p = PROMPTS[(t + k) % len(PROMPTS)]
                if (t + k) % 3 == 0:
                    stream = eng.generate(p, max_tokens=N_TOKENS, temperature=0, stream=True)
                    next(stream)
                    stream.close()                            # a client that hung up
                else:
                    out.append((p, stream_tokens(eng, p)))
            return out

        results = run_threads([lambda t=t: worker(t) for t in range(6)])
        for r in results:
            assert not isinstance(r, BaseException), r
            for p, toks in r:
                assert toks == alone[p], p
        assert all(s.owner is None for s in eng._slots) and not eng._waiting
        assert eng._backend.pass_counts["shared_passes"] > 0


def test_gpu_placement_keeps_room_for_the_extra_sequences(model, monkeypatch, tmp_path):
    from openjet_plugin.backends import llama_cpp as llama_backend
    from openjet_plugin.config import PRESETS

    class Offload:
        def llama_supports_gpu_offload(self):
            return True

    per_seq = llama_backend.sequence_bytes(PRESETS["q27b"], 4096)
    assert 200 << 20 < per_seq < 2 << 30                  # 16 attention layers' KV at 4096 + 48 DeltaNet states
    f = tmp_path / "m.gguf"
    f.write_bytes(b"\0" * (4 << 20))
    monkeypatch.setattr(llama_backend.gpus, "first_gpu",
                        lambda: ("Test GPU", (4 << 20) + llama_backend.GPU_RESERVE_BYTES + per_seq))
    assert llama_backend.gpu_placement(Offload(), f, 10, extra_bytes=per_seq).n_gpu_layers == -1
    assert llama_backend.gpu_placement(Offload(), f, 10, extra_bytes=3 * per_seq).n_gpu_layers == 0
