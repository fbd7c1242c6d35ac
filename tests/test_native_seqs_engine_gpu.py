"""Several conversations on the real native engine (issue 29): `load(backend="native", n_slots=N)`
serving N concurrent requests through one engine of N sequences, against the same requests run
alone on a one-slot engine.

Needs an NVIDIA GPU and the built library at ABI 9 (oj_seq_select, oj_eval_seqs); skips with the
reason otherwise. `scripts/gpu.sh check` runs it on the GPU machine; rows go to
`$OPENJET_GPU_REPORT` like tests/test_native_gpu.py's. The CPU side of the same paths (views, the
pass scheduler, the engine's slots) is tests/test_native_sequences.py, over a fake library.

- decode steps of several sequences in one oj_eval_seqs are bit for bit each sequence's own
  one-token oj_eval (the header's promise): prompts evaluated one at a time first, then every
  sequence decodes at once; argmax and logits rows equal the one-sequence engine's exactly;
- 4 and 8 concurrent greedy requests through the Engine (prompts arriving together, chunked next
  to the others' decode steps by the pass budget) each give exactly the tokens of the request run
  alone, and passes were shared;
- the engine's memory report for N sequences is estimate_device_bytes(n_seq=N), term by term.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import run_threads  # noqa: E402
from test_native_gpu import model_path, native_at_least, report  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = REPO / "openjet_plugin" / "data" / "default.gguf"
N_TOKENS = int(os.environ.get("OPENJET_SEQS_TOKENS", "64"))
SEQS_ABI = 9
# prompt lengths: through oj_eval (8 or fewer before the last token) and through oj_prefill spans
PROMPT_LENGTHS = (5, 40, 3, 200, 17, 9, 120, 64)


@pytest.fixture(scope="module")
def native():
    return native_at_least(SEQS_ABI, "several sequences (oj_seq_select, oj_eval_seqs)")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("seq_models")


def _model(name: str, workdir: Path) -> Path:
    if name == "default":
        return DEFAULT_GGUF
    preset, quant = name.split("-", 1)
    return model_path(preset, quant, workdir)[0]


def _prompts(n_vocab: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(29)
    return [rng.integers(0, n_vocab, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]).tolist() for i in range(n)]




def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "default"])
def test_decode_steps_of_several_sequences_are_each_ones_own(native, workdir, name):
    """Every sequence's prompt evaluated alone (the same oj_prefill / oj_eval calls as a
    one-sequence engine), then all of them decoding at once: each step's argmax is the
    one-sequence engine's, and the logits rows (read through eval) are equal bit for bit."""
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    n_seq, steps = 6, 24
    mf = open_model(_model(name, workdir))
    one = NativeBackend(mf, n_ctx=512, draft_depth=0)
    multi = NativeBackend(mf, n_ctx=512, n_seq=n_seq, draft_depth=0)   # no MTP rows: every step in oj_eval_seqs
    try:
        prompts = _prompts(one.n_vocab, n_seq)
        want_tokens, want_rows = [], []
        for p in prompts:
            one.reset()
            toks = [one.eval_argmax(p)]
            for _ in range(steps):
                toks.append(one.eval_argmax([toks[-1]]))
            want_tokens.append(toks)
            want_rows.append(one.eval([toks[-1]]))
        views = multi.sequences()
        firsts = [v.eval_argmax(p) for v, p in zip(views, prompts)]       # one at a time

        def decode(v, first):
            toks = [first]
            for _ in range(steps):
                toks.append(v.eval_argmax([toks[-1]]))
            return toks, v.eval([toks[-1]])

        got = run_threads([lambda v=v, f=f: decode(v, f) for v, f in zip(views, firsts)], timeout=600)
        counts = multi.pass_counts
        shared_calls = multi._shared.passes.eval_seqs_shared
        mem = multi.memory()
    finally:
        multi.close()
        one.close()
        mf.close()
    report({"test": "seqs_decode_bit_identity", "model": name, "sequences": n_seq, "steps": steps, **counts,
            "eval_seqs_shared": shared_calls})
    for i, (g, wt, wr) in enumerate(zip(got, want_tokens, want_rows)):
        assert not isinstance(g, BaseException), g
        toks, row = g
        assert toks == wt, f"sequence {i} differs at step {_first_difference(toks, wt)}"
        assert np.array_equal(row, wr), f"sequence {i}: logits differ by {np.abs(row - wr).max()}"
    assert shared_calls > 0 and counts["max_sequences_in_a_pass"] >= n_seq // 2, counts
    assert mem["kv_cache"] > 0


@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "default"])
@pytest.mark.parametrize("n_slots", [4, 8])
def test_concurrent_greedy_requests_equal_each_alone(native, workdir, name, n_slots):
    import openjet_plugin

    path = _model(name, workdir)
    with openjet_plugin.load(path, backend="native", n_ctx=1024, n_slots=1, draft_depth=0) as one:
        prompts = _prompts(one.n_vocab, n_slots)
        alone = [one.generate(p, max_tokens=N_TOKENS, temperature=0).tokens for p in prompts]
    with openjet_plugin.load(path, backend="native", n_ctx=1024, n_slots=n_slots, draft_depth=0) as eng:
        assert eng.backend_name == "native", eng.backend_reason
        assert eng.n_slots == n_slots and eng._speculator is None and not eng.supports_speculative

        def stream(p):
            return [t for c in eng.generate(p, max_tokens=N_TOKENS, temperature=0, stream=True) for t in c.tokens]

        got = run_threads([lambda p=p: stream(p) for p in prompts], timeout=600)
        counts = eng._backend.pass_counts
        shared_calls = eng._backend._shared.passes.eval_seqs_shared
    differing = [i for i, (g, a) in enumerate(zip(got, alone)) if g != a]
    report({"test": "seqs_engine_equals_alone", "model": name, "slots": n_slots, "tokens": N_TOKENS,
            "differing": differing, "first_difference": [_first_difference(got[i], alone[i]) for i in differing
                                                         if not isinstance(got[i], BaseException)],
            **counts, "eval_seqs_shared": shared_calls})
    for g in got:
        assert not isinstance(g, BaseException), g
    assert not differing, (f"{len(differing)} of {n_slots} requests differ from alone (streams {differing}; a "
                           f"prompt chunked next to decode steps differs from one prefilled alone only in "
                           f"the engine's arithmetic: see test_decode_steps_of_several_sequences_are_each_ones_own)")
    assert counts["shared_passes"] >= N_TOKENS // 2 and counts["max_sequences_in_a_pass"] >= n_slots // 2, counts
    assert shared_calls >= N_TOKENS // 2


@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "default"])
def test_prompt_pieces_in_layers_beside_decoders_equal_each_alone(native, workdir, name):
    """A 700-token prompt arriving while three streams decode, the budget's room next to them held
    at 16 tokens: its pieces of 64 go through their layers over several passes (oj_prefill_layers,
    ABI 12), the decode steps between; every request gives exactly its tokens alone."""
    import threading

    import openjet_plugin

    native_at_least(12, "prompt pieces in layers (oj_prefill_layers)")
    path = _model(name, workdir)
    rng = np.random.default_rng()
    with openjet_plugin.load(path, backend="native", n_ctx=2048, n_slots=1, draft_depth=0) as one:
        prompts = _prompts(one.n_vocab, 3)
        long_prompt = rng.integers(0, one.n_vocab, 700).tolist()
        alone = [one.generate(p, max_tokens=3 * N_TOKENS, temperature=0).tokens for p in prompts]
        alone_long = one.generate(long_prompt, max_tokens=8, temperature=0).tokens
    with openjet_plugin.load(path, backend="native", n_ctx=2048, n_slots=4, draft_depth=0) as eng:
        budget = eng._backend._shared.passes.budget
        budget.prompt_tokens = lambda n_decode, f=budget.prompt_tokens: min(f(n_decode), 16) if n_decode else f(0)
        decoding = threading.Event()

        def stream(p):
            out = []
            for c in eng.generate(p, max_tokens=3 * N_TOKENS, temperature=0, stream=True):
                out.extend(c.tokens)
                if len(out) >= 4:
                    decoding.set()
            return out

        def late_long():
            assert decoding.wait(120)
            return eng.generate(long_prompt, max_tokens=8, temperature=0).tokens

        got = run_threads([lambda p=p: stream(p) for p in prompts] + [late_long], timeout=600)
        counts = eng._backend.pass_counts
    report({"test": "seqs_engine_pieces_in_layers", "model": name, "long_prompt": len(long_prompt),
            "differing": [i for i, (g, a) in enumerate(zip(got, alone + [alone_long])) if g != a], **counts})
    for g in got:
        assert not isinstance(g, BaseException), g
    assert got == alone + [alone_long]
    assert counts["piece_passes"] >= 4, counts


def test_greedy_requests_with_negative_biases_equal_the_row_per_token_path(native, workdir, monkeypatch):
    """Negative logit biases (bans on end tokens and on tokens the plain greedy output holds) keep
    the argmax on the GPU: one slot copies a row only where the argmax is biased
    (eval_argmax_rows), four slots chain and end a chain at such a step with its row kept. Both
    give exactly the tokens of the row-per-token path, where every step's row is copied off and
    biased on the host."""
    import math

    import openjet_plugin
    from openjet_plugin.backends import native as native_backend

    path, n = _model("tiny-Q4_K_M", workdir), 4
    with openjet_plugin.load(path, backend="native", n_ctx=1024, n_slots=1, draft_depth=0) as one:
        prompts = _prompts(one.n_vocab, n)
        plain = [one.generate(p, max_tokens=N_TOKENS, temperature=0).tokens for p in prompts]
        bans = {int(t): -math.inf for t in one.eog_tokens}
        bans.update({plain[i][k]: -30.0 for i in range(n) for k in (3, 10) if k < len(plain[i])})
        with monkeypatch.context() as m:
            m.delattr(native_backend.NativeBackend, "eval_argmax_rows")
            want = [one.generate(p, max_tokens=N_TOKENS, temperature=0, logit_bias=bans).tokens for p in prompts]
        alone = [one.generate(p, max_tokens=N_TOKENS, temperature=0, logit_bias=bans).tokens for p in prompts]
    with openjet_plugin.load(path, backend="native", n_ctx=1024, n_slots=n, draft_depth=0) as eng:
        def stream(p):
            return [t for c in eng.generate(p, max_tokens=N_TOKENS, temperature=0, logit_bias=bans, stream=True)
                    for t in c.tokens]

        got = run_threads([lambda p=p: stream(p) for p in prompts], timeout=600)
        counts = eng._backend.pass_counts
    changed = sum(w != p for w, p in zip(want, plain))
    report({"test": "seqs_engine_bans", "model": "tiny-Q4_K_M", "slots": n, "tokens": N_TOKENS,
            "bans": len(bans), "requests_the_bans_changed": changed,
            "one_slot_differing": [i for i in range(n) if alone[i] != want[i]],
            "slots_differing": [i for i in range(n) if got[i] != want[i]], **counts})
    assert changed >= n // 2, "the bans should change what plain greedy decoding gives"
    assert alone == want
    assert got == want
    assert counts["shared_passes"] >= N_TOKENS // 2, counts


def test_a_request_alone_speculates_and_concurrent_ones_share_passes(native, workdir):
    """With several slots and an MTP head: a request served alone speculates (cycles, drafts
    accepted) and gives plain greedy decoding's tokens; four at once give each its tokens alone,
    at most one of them speculating, the others in shared passes."""
    import openjet_plugin

    path = _model("default", workdir)
    with openjet_plugin.load(path, backend="native", n_ctx=1024, n_slots=1, draft_depth=0) as one:
        prompts = _prompts(one.n_vocab, 4)
        alone = [one.generate(p, max_tokens=N_TOKENS, temperature=0).tokens for p in prompts]
    with openjet_plugin.load(path, backend="native", n_ctx=1024, n_slots=4) as eng:
        assert eng.supports_speculative
        first = eng.generate(prompts[0], max_tokens=N_TOKENS, temperature=0)
        got = run_threads([lambda p=p: eng.generate(p, max_tokens=N_TOKENS, temperature=0) for p in prompts],
                          timeout=600)
        counts = eng._backend.pass_counts
    for g in got:
        assert not isinstance(g, BaseException), g
    report({"test": "seqs_engine_alone_speculates", "cycles_alone": first.stats.cycles,
            "accepted_alone": first.stats.drafts_accepted, "speculating_of_4": sum(g.stats.cycles > 0 for g in got),
            **counts})
    assert first.tokens == alone[0] and first.stats.cycles > 0 and first.stats.drafts_accepted > 0
    assert [g.tokens for g in got] == alone
    assert sum(g.stats.cycles > 0 for g in got) <= 1 and counts["shared_passes"] > 0


@pytest.mark.parametrize("n_seq", [1, 4, 8])
def test_memory_report_of_n_sequences_is_the_estimate(native, workdir, n_seq):
    """The engine's memory report against estimate_device_bytes(n_seq=N) (what `openjet info`
    plans): kv_cache, recurrent_state and checkpoints exactly N times one sequence's, the
    activations one hidden window more per further sequence."""
    from openjet_plugin.backends.native import NativeBackend, estimate_device_bytes
    from openjet_plugin.model_file import open_model

    path = _model("tiny-Q4_K_M", workdir)
    mf = open_model(path)
    try:
        be = NativeBackend(mf, n_ctx=1000, n_seq=n_seq)
        try:
            mem = be.memory()
        finally:
            be.close()
        est = estimate_device_bytes(mf, 1000, n_seq=n_seq)
    finally:
        mf.close()
    report({"test": "seqs_memory", "sequences": n_seq, "memory": mem, "estimate": est})
    for k in ("kv_cache", "recurrent_state", "checkpoints"):
        assert mem[k] == est[k], (k, mem[k], est[k])
    assert abs(mem["total"] - est["total"]) <= 0.1 * est["total"], (mem["total"], est["total"])
