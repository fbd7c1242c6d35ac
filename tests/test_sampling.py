"""Sampling: parameter validation, llama.cpp's transformation rules, seeded reproducibility, and a
chi-square test that the first sampled token follows the distribution computed here, independently,
from llama.cpp's own logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sstats

import openjet_plugin
from openjet_plugin.engine import _TextAssembler
from openjet_plugin.sampling import Sampler, SamplingParams, apply_penalties, candidate_distribution

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def model(synth_path):
    return synth_path("tiny", "Q8_0")


@pytest.fixture(scope="module")
def engine(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=512, n_threads=1)
    yield eng
    eng.close()


# --- validation ----------------------------------------------------------------------------------

BAD = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.01),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0),
    ("presence_penalty", -0.5), ("frequency_penalty", -1.0), ("frequency_penalty", float("inf")),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0),
    ("seed", "42"), ("seed", 1.5), ("seed", -1), ("seed", True),
    ("stop", [""]), ("stop", [3]), ("stop", 7),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {5: float("nan")}), ("logit_bias", [1, 2]),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_invalid_parameter_names_itself(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name,value", [("temperature", -1), ("top_p", 2), ("top_k", -3), ("min_p", 2),
                                        ("max_tokens", 0), ("repeat_penalty", 0), ("seed", "s"),
                                        ("presence_penalty", -1), ("logit_bias", {999999: 1.0})])
def test_engine_rejects_invalid_parameter_before_running(engine, name, value):
    with pytest.raises(ValueError, match=name):
        engine.generate(PROMPT, **{name: value})
    with pytest.raises(ValueError, match=name):
        engine.generate(PROMPT, stream=True, **{name: value})   # eagerly, not at the first next()


def test_valid_edge_values_are_accepted():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=0.0, seed=0, stop="x",
                       repeat_penalty=0.5, logit_bias={"7": -math.inf})
    assert p.greedy and p.stop == ("x",) and p.logit_bias == {7: -math.inf}


# --- the rules, checked on hand-made logits --------------------------------------------------------

def test_top_k_keeps_the_k_largest_in_order():
    logits = np.array([0.0, 3.0, 1.0, 2.0, -1.0])
    ids, probs = candidate_distribution(logits, SamplingParams(top_k=2, top_p=1, min_p=0, temperature=1))
    assert ids.tolist() == [1, 3]
    np.testing.assert_allclose(probs, np.exp([3, 2]) / np.exp([3, 2]).sum())


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    keep = lambda p: candidate_distribution(logits, SamplingParams(top_k=0, top_p=p, min_p=0))[0].tolist()
    assert keep(0.45) == [0]
    assert keep(0.55) == [0, 1]
    assert keep(0.81) == [0, 1, 2]
    assert keep(1.0) == [0, 1, 2, 3]


def test_min_p_is_relative_to_the_most_likely_token():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    ids, _ = candidate_distribution(logits, SamplingParams(top_k=0, top_p=1, min_p=0.5))
    assert ids.tolist() == [0, 1, 2]       # 0.1 < 0.5 * 0.4


def test_top_p_and_min_p_look_at_temperature_one():
    # llama.cpp's chain applies temp after top-p/min-p: a high temperature must not widen the set
    logits = np.log(np.array([0.7, 0.2, 0.1]))
    ids, probs = candidate_distribution(logits, SamplingParams(top_k=0, top_p=0.85, min_p=0, temperature=5))
    assert ids.tolist() == [0, 1]
    z = np.log([0.7, 0.2]) / 5
    np.testing.assert_allclose(probs, np.exp(z) / np.exp(z).sum())


def test_penalties_follow_llama_cpp_definitions():
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    history = [0, 0, 1, 3, 0]
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.3)
    out = apply_penalties(logits, history, p)
    # token 0 seen 3x: 2/2 - 3*0.1 - 0.3; token 1 (negative) seen 1x: -1*2 - 0.1 - 0.3
    np.testing.assert_allclose(out, [2 / 2 - 0.3 - 0.3, -2 - 0.1 - 0.3, 0.5, 3 / 2 - 0.1 - 0.3])
    # only the last penalty_last_n tokens count
    short = SamplingParams(repeat_penalty=2.0, penalty_last_n=1)
    np.testing.assert_allclose(apply_penalties(logits, history, short), [1.0, -1.0, 0.5, 3.0])


def test_greedy_takes_the_argmax_after_penalties_and_bias():
    logits = np.array([1.0, 5.0, 4.0])
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=2.0)).sample(logits, [1]) == 2
    assert Sampler(SamplingParams(temperature=0, logit_bias={1: -math.inf})).sample(logits) == 2


# --- seeded sampling on the model ------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(engine):
    kw = dict(max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = engine.generate(PROMPT, seed=1234, **kw)
    b = engine.generate(PROMPT, seed=1234, **kw)
    assert a.tokens == b.tokens and a.text == b.text
    others = [engine.generate(PROMPT, seed=s, **kw).tokens for s in (1, 2, 3)]
    assert any(o != a.tokens for o in others), "different seeds never changed the sample"
    # streaming draws the same tokens as the one-shot call
    streamed = [t for ch in engine.generate(PROMPT, seed=1234, stream=True, **kw) for t in ch.tokens]
    assert streamed == a.tokens


# --- chi-square: the first token's distribution ----------------------------------------------------

def expected_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                          min_p: float) -> dict[int, float]:
    """llama.cpp's chain, written out again here from its definitions (not sampling.py's code):
    top-k, then top-p and min-p on the temperature-1 softmax, then temperature."""
    order = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))
    if top_k > 0:
        order = order[:top_k]
    l1 = np.array([float(logits[i]) for i in order])
    p1 = np.exp(l1 - l1.max())
    p1 /= p1.sum()
    if top_p < 1.0:
        total, n = 0.0, 0
        for n, q in enumerate(p1, start=1):
            total += q
            if total >= top_p:
                break
        order, l1, p1 = order[:n], l1[:n], p1[:n]
    if min_p > 0:
        keep = [j for j in range(len(order)) if p1[j] >= min_p * p1[0]]
        order, l1 = [order[j] for j in keep], l1[keep]
    z = l1 / temperature
    w = np.exp(z - z.max())
    return dict(zip(order, w / w.sum()))


@pytest.fixture(scope="module")
def first_logits(model) -> np.ndarray:
    return llama_cpp_logits(model, PROMPT)


def llama_cpp_logits(model, prompt: str) -> np.ndarray:
    """The next-token logits straight from llama-cpp-python, not through our backend."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(tokens)
        return np.array(llm.scores[len(tokens) - 1], dtype=np.float64)
    finally:
        llm.close()


SETTINGS = [
    dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
    dict(temperature=1.5, top_k=8, top_p=1.0, min_p=0.0),
    dict(temperature=1.2, top_k=0, top_p=1.0, min_p=0.02),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_first_token_follows_the_transformed_distribution(engine, first_logits, setting):
    n = 2000
    expected = expected_distribution(first_logits, **setting)
    assert len(expected) >= 3, f"degenerate distribution, the test would prove nothing: {expected}"
    counts: dict[int, int] = {}
    for seed in range(n):
        tok = engine.generate(PROMPT, max_tokens=1, seed=seed, **setting).tokens[0]
        counts[tok] = counts.get(tok, 0) + 1
    outside = {t: c for t, c in counts.items() if t not in expected}
    assert not outside, f"sampled tokens the filters exclude: {outside}"
    # bins with an expected count below 5 are pooled, as the chi-square approximation needs
    ids = sorted(expected, key=lambda t: -expected[t])
    big = [t for t in ids if expected[t] * n >= 5]
    small = [t for t in ids if expected[t] * n < 5]
    obs = [counts.get(t, 0) for t in big]
    exp = [expected[t] * n for t in big]
    if small:
        obs.append(sum(counts.get(t, 0) for t in small))
        exp.append(sum(expected[t] for t in small) * n)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    chi2, p = sstats.chisquare(obs, exp)
    print(f"\n{setting}: {len(expected)} candidates, {len(big)} bins, chi2={chi2:.1f}, p={p:.3f}")
    assert p > 1e-3, f"sampled frequencies do not follow the expected distribution (p={p:.2e})"
    # and the test can fail: the same counts against the untransformed softmax are rejected
    raw = expected_distribution(first_logits, 1.0, 0, 1.0, 0.0)
    raw_exp = [raw[t] * n for t in big] + ([sum(raw[t] for t in small) * n] if small else [])
    rest = n - sum(raw_exp)
    obs_raw = obs + [0] if rest > 1e-6 else obs
    raw_exp = raw_exp + [rest] if rest > 1e-6 else raw_exp
    _, p_raw = sstats.chisquare(obs_raw, np.array(raw_exp) * (n / sum(raw_exp)))
    assert p_raw < 1e-3, "the untransformed distribution fits as well: the test has no power"


# --- streaming text assembly -----------------------------------------------------------------------

def test_stream_never_splits_a_utf8_character():
    asm = _TextAssembler(())
    euro = "€".encode()                    # 3 bytes
    asm.feed(euro[:1])
    assert asm.take() == ""
    asm.feed(euro[1:2])
    assert asm.take() == ""
    asm.feed(euro[2:] + b"x")
    assert asm.take() == "€x"


def test_stop_string_split_across_tokens_is_not_emitted():
    asm = _TextAssembler(["STOP"])
    out = []
    for piece in [b"Hel", b"lo S", b"T", b"OP and more"]:
        if asm.feed(piece):
            break
        out.append(asm.take())
    out.append(asm.finish())
    assert "".join(out) == "Hello "
    assert out[1] == "lo "                 # "S" held back: it may start "STOP"


def test_partial_stop_match_is_released_when_it_does_not_complete():
    asm = _TextAssembler(["STOP"])
    assert not asm.feed(b"ab ST")
    assert asm.take() == "ab "
    assert not asm.feed(b"X")
    assert asm.take() == "STX"


@pytest.mark.parametrize("setting", [dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0),
                                     dict(temperature=1.3, top_k=3000, top_p=0.5, min_p=0.0),
                                     dict(temperature=1.0, top_k=0, top_p=0.99, min_p=0.01),
                                     dict(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0)])
def test_large_flat_vocabulary_matches_the_definition(setting):
    """A flat 20,000-token distribution makes the top-p set far larger than the first sorted head,
    so the growing-head path is exercised; the result must still be the definition's."""
    logits = np.random.default_rng(5).standard_normal(20000).astype(np.float32)
    ids, probs = candidate_distribution(logits, SamplingParams(**setting))
    expected = expected_distribution(logits, **setting)
    assert len(ids) > 256
    assert ids.tolist() == list(expected)
    np.testing.assert_allclose(probs, list(expected.values()), rtol=1e-6, atol=1e-12)


def test_penalty_window_starts_after_penalty_start():
    """llama-cpp-python's sampler never sees the prompt: with penalty_start = the prompt's length,
    prompt tokens are not penalised, generated ones are (within the last penalty_last_n)."""
    logits = np.zeros(8, dtype=np.float32) + 1.0
    history = [1, 2, 3, 4, 5, 5]                  # prompt [1, 2, 3], generated [4, 5, 5]
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.25, penalty_start=3)
    out = apply_penalties(logits, history, p)
    np.testing.assert_allclose(out[[1, 2, 3]], 1.0)                       # the prompt: untouched
    np.testing.assert_allclose(out[4], 1.0 / 2.0 - 0.25)
    np.testing.assert_allclose(out[5], 1.0 / 2.0 - 0.5)
    everything = apply_penalties(logits, history, SamplingParams(repeat_penalty=2.0, frequency_penalty=0.25))
    np.testing.assert_allclose(everything[1], 1.0 / 2.0 - 0.25)           # penalty_start 0: prompt counts
    with pytest.raises(ValueError, match="penalty_start"):
        SamplingParams(penalty_start=-1)
