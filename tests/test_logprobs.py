"""logprobs / top_logprobs in the engine (issue 26) on the CPU.

- Each generated token's logprob and alternatives equal the log-softmax of llama.cpp's own
  logits at its position (llama-cpp-python with logits_all, an independent evaluation), greedy
  and sampled, with a constraint too (the model's distribution, not the masked one).
- Stream chunks carry the logprobs of their tokens; together they are the result's.
- Bad values are refused by parameter name.
- The native speculator's rows_out: the target's row of each emitted token (toy backend).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from openjet_plugin.constraints import Constraint
from openjet_plugin.engine import MAX_TOP_LOGPROBS, load, log_softmax
from openjet_plugin.sampling import SamplingParams
from openjet_plugin.speculative_native import NativeSpeculator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_constraints as tc  # noqa: E402

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def engine():
    eng = load(backend="llama.cpp", n_ctx=256)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine):
    """log-softmax rows of llama.cpp's logits after each prefix of prompt + tokens."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(engine.model_path), n_ctx=256, logits_all=True, verbose=False,
                          n_threads=1)

    def rows(prompt_tokens: list[int], tokens: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(prompt_tokens + tokens)
        scores = np.array(llm.scores[len(prompt_tokens) - 1:len(prompt_tokens) + len(tokens) - 1])
        return np.stack([log_softmax(r) for r in scores])

    yield rows
    llm.close()


def _check_against(reference, engine, prompt, result, k):
    assert len(result.logprobs) == len(result.tokens) > 0
    ref = reference(engine.tokenize(prompt, add_special=True), result.tokens)
    for pos, (tok, lp) in enumerate(zip(result.tokens, result.logprobs)):
        assert lp.token == tok and lp.bytes == engine._backend.detokenize([tok])
        assert lp.logprob == pytest.approx(ref[pos, tok], abs=2e-3)
        assert len(lp.top_logprobs) == k
        want = np.argsort(-ref[pos], kind="stable")[:k]
        got = [t.token for t in lp.top_logprobs]
        # the same set (up to ties at the cut) in descending order
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        np.testing.assert_allclose([t.logprob for t in lp.top_logprobs], ref[pos, want], atol=2e-3)
        assert set(got) == set(want.tolist()) or np.allclose(ref[pos, got], ref[pos, want], atol=2e-3)
        assert all(t.top_logprobs == [] for t in lp.top_logprobs)


def test_greedy_logprobs_are_the_models_log_softmax(engine, reference):
    r = engine.generate(PROMPT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    _check_against(reference, engine, PROMPT, r, 5)
    for lp in r.logprobs:                      # greedy picks the most likely token
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == lp.logprob


def test_sampled_and_constrained_logprobs_are_the_unmasked_distribution(engine, reference):
    r = engine.generate(PROMPT, max_tokens=12, temperature=1.0, seed=3, logprobs=True,
                        top_logprobs=MAX_TOP_LOGPROBS)
    _check_against(reference, engine, PROMPT, r, MAX_TOP_LOGPROBS)
    c = Constraint.regex("[0-9]{3,6}")
    r = engine.generate(PROMPT, max_tokens=8, temperature=1.0, seed=1, constraint=c, logprobs=True,
                        top_logprobs=3)
    _check_against(reference, engine, PROMPT, r, 3)
    # the masked-out tokens the model preferred are still among the alternatives
    assert any(not t.text.strip().isdigit() for lp in r.logprobs for t in lp.top_logprobs)


def test_logprobs_without_alternatives_and_off(engine):
    r = engine.generate(PROMPT, max_tokens=5, temperature=0, logprobs=True)
    assert len(r.logprobs) == len(r.tokens) and all(lp.top_logprobs == [] for lp in r.logprobs)
    assert all(lp.logprob <= 0 for lp in r.logprobs)
    r = engine.generate(PROMPT, max_tokens=5, temperature=0)
    assert r.logprobs is None
    assert all(c.logprobs is None for c in engine.generate(PROMPT, max_tokens=5, temperature=0, stream=True))


def test_stream_chunks_carry_their_tokens_logprobs(engine):
    kw = dict(max_tokens=20, temperature=0.9, seed=5, logprobs=True, top_logprobs=2, stop=["\n\n"])
    whole = engine.generate(PROMPT, **kw)
    chunks = list(engine.generate(PROMPT, stream=True, **kw))
    for c in chunks:
        assert len(c.logprobs) == len(c.tokens)
        assert [lp.token for lp in c.logprobs] == c.tokens
    joined = [lp for c in chunks for lp in c.logprobs]
    assert [(lp.token, lp.logprob) for lp in joined] == [(lp.token, lp.logprob) for lp in whole.logprobs]


@pytest.mark.parametrize("kw,words", [
    (dict(logprobs=True, top_logprobs=21), ["top_logprobs", "[0, 20]", "21"]),
    (dict(logprobs=True, top_logprobs=-1), ["top_logprobs", "-1"]),
    (dict(logprobs=True, top_logprobs="3"), ["top_logprobs", "'3'"]),
    (dict(logprobs=True, top_logprobs=True), ["top_logprobs"]),
    (dict(top_logprobs=2), ["top_logprobs needs logprobs=True"]),
    (dict(logprobs="yes"), ["logprobs must be True or False"]),
])
def test_bad_logprob_values_are_refused_by_name(engine, kw, words):
    with pytest.raises(ValueError) as exc:
        engine.generate(PROMPT, max_tokens=2, stream=True, **kw)
    for w in words:
        assert w in str(exc.value), str(exc.value)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=2)])
@pytest.mark.parametrize("constrained", [False, True])
def test_speculative_rows_are_the_targets_rows_of_the_emitted_tokens(params, constrained):
    b = tc.ToyTarget()
    prompt = [4, 8, 15]
    b.hist = prompt[:-1]
    spec = NativeSpeculator(b, 3)
    spec.begin(prompt)
    grammar = tc.toy_compiler().state(Constraint.json_schema(tc.SMALL)) if constrained else None
    rng = np.random.default_rng(0)
    hist, tok, out, rows = list(prompt), prompt[-1], [], []
    while len(out) < 30 and tc.TOY_EOS not in out:
        em, _, _ = spec.cycle(tok, hist, params, rng, 30 - len(out), grammar=grammar, rows_out=rows)
        out += em
        hist += em
        tok = em[-1]
    assert len(rows) == len(out) and spec.stats.drafts_accepted > 0
    for j in range(len(out)):
        np.testing.assert_array_equal(rows[j], tc._row(prompt + out[:j]))
