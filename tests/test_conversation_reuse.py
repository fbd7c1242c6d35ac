"""Conversation reuse: a prompt that extends what the engine already processed only prefills the new
tokens; an edited history re-prefills (from the first differing token where the backend can roll
back; with llama.cpp's qwen35 recurrent state, which cannot, from the newest checkpoint before the
difference — one is saved before the last token of each prompt — or from scratch); results are
identical to a fresh engine either way."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin.engine import Engine

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def model(synth_path):
    return synth_path("tiny", "Q8_0")


@pytest.fixture(scope="module")
def engine(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=1024, n_threads=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def fresh(model):
    """fresh(call) -> what a newly loaded engine answers."""
    def run(fn):
        with openjet_plugin.load(model, backend="llama.cpp", n_ctx=1024, n_threads=1) as eng:
            return fn(eng)
    return run


SAMPLING = dict(max_tokens=10, temperature=0.9, top_k=20, seed=11)


def test_extending_the_processed_tokens_prefills_only_the_new_ones(engine, fresh):
    a = engine.tokenize(PROMPT, add_special=True)
    r1 = engine.generate(a, **SAMPLING)
    assert r1.finish_reason == "length" or r1.stats.generated_tokens > len(r1.tokens)
    b = a + r1.tokens + engine.tokenize("\n    return fib(n - 1)")
    r2 = engine.generate(b, **SAMPLING)
    # the last sampled token of r1 was never evaluated (max_tokens stopped first), so it is new
    assert r2.stats.cached_prompt_tokens == len(a) + len(r1.tokens) - 1
    assert r2.stats.prefilled_tokens == len(b) - r2.stats.cached_prompt_tokens
    assert r2.tokens == fresh(lambda e: e.generate(b, **SAMPLING).tokens)


def test_edited_history_is_re_prefilled_with_identical_results(engine, fresh):
    engine.generate("The weather today is sunny and warm", **SAMPLING)
    edited = "The weather today is rainy and cold"
    r = engine.generate(edited, **SAMPLING)
    # the edit comes before the only checkpoint (before "warm"): qwen35's recurrent state cannot be
    # cut back, so everything is evaluated again
    assert r.stats.cached_prompt_tokens == 0
    assert r.tokens == fresh(lambda e: e.generate(edited, **SAMPLING).tokens)


def test_history_changed_after_the_checkpoint_resumes_from_it(engine, fresh):
    a = engine.tokenize("Once upon a time there was", add_special=True)
    r1 = engine.generate(a, **SAMPLING)
    other = engine.tokenize(" a dragon who liked tea")
    assert other[0] != r1.tokens[0]               # the new history leaves the reply at once
    b = a + other
    r2 = engine.generate(b, **SAMPLING)
    assert r2.stats.cached_prompt_tokens == len(a) - 1
    assert r2.tokens == fresh(lambda e: e.generate(b, **SAMPLING).tokens)


def test_repeating_the_prompt_after_a_generation(engine, fresh):
    r1 = engine.generate(PROMPT, **SAMPLING)
    r2 = engine.generate(PROMPT, **SAMPLING)       # state holds PROMPT + reply: must go back
    n = r2.stats.prompt_tokens
    assert r2.stats.cached_prompt_tokens == n - 1  # to the checkpoint before the last prompt token
    assert r2.tokens == r1.tokens == fresh(lambda e: e.generate(PROMPT, **SAMPLING).tokens)


def test_the_exact_processed_prompt_reuses_its_logits(engine):
    engine.generate(PROMPT, max_tokens=1, seed=1)   # state == PROMPT, logits of its last token kept
    r = engine.generate(PROMPT, max_tokens=1, seed=1)
    assert r.stats.cached_prompt_tokens == r.stats.prompt_tokens


# --- the 3-turn chat -------------------------------------------------------------------------------

def word_token_bias(eng: Engine) -> dict[int, float]:
    """Ban every token but whole lower-case words with a leading space (and end-of-turn).

    A random-weight model otherwise writes token sequences the tokenizer would never produce
    ("-like" as one token where BPE makes "-" "like", bytes that are not UTF-8), so its reply,
    rendered back as text into the history, would not tokenize to what it generated and the cache
    could not be reused. A trained model writes tokenizer-shaped text; here the bias makes sure."""
    allowed = set(eng.eog_tokens)
    for t in range(eng.n_vocab):
        text = eng.detokenize([t])
        if re.fullmatch(r" [a-z]{2,}", text) and eng.tokenize(text) == [t]:
            allowed.add(t)
    assert len(allowed) > 100
    return {t: -np.inf for t in range(eng.n_vocab) if t not in allowed}


TURNS = ["Write a haiku about the sea.", "Now make it about mountains.", "And one about rivers?"]


def run_chat(eng: Engine, enable_thinking: bool, bias):
    messages = [{"role": "system", "content": "You are a poet."}]
    results = []
    for i, user in enumerate(TURNS):
        messages.append({"role": "user", "content": user})
        r = eng.chat(messages, enable_thinking=enable_thinking, max_tokens=12, temperature=0.8,
                     seed=100 + i, logit_bias=bias)
        results.append((eng.tokenize(eng.render_chat(messages, enable_thinking=enable_thinking),
                                     add_special=True), r))
        messages.append({"role": "assistant", "content": r.text})
    return messages, results


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_three_turn_chat_prefills_only_new_tokens(engine, model, enable_thinking):
    bias = word_token_bias(engine)
    engine.generate("reset the state first", max_tokens=1)
    messages, results = run_chat(engine, enable_thinking, bias)
    for turn in (1, 2):
        prev_prompt, prev = results[turn - 1]
        prompt, r = results[turn]
        assert prompt[:len(prev_prompt) + len(prev.tokens)] == prev_prompt + prev.tokens, \
            "the rendered history does not start with the tokens processed on the previous turn"
        processed = len(prev_prompt) + len(prev.tokens) - (1 if prev.finish_reason == "length" else 0)
        assert r.stats.cached_prompt_tokens == processed
        assert r.stats.prefilled_tokens == len(prompt) - processed
        assert r.stats.prefilled_tokens < len(prompt) // 2
    # a fresh engine given the whole history answers the last turn identically
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=1024, n_threads=1) as eng2:
        last = eng2.chat(messages[:-1], enable_thinking=enable_thinking, max_tokens=12, temperature=0.8,
                         seed=100 + len(TURNS) - 1, logit_bias=bias)
        assert last.stats.cached_prompt_tokens == 0
    assert last.tokens == results[-1][1].tokens and last.text == results[-1][1].text


# --- rollback where the backend can: only the differing suffix is evaluated ------------------------

class PrefixHashBackend:
    """Logits that are a fixed function of the whole token prefix, with optional rollback: the
    answer cannot depend on how the engine got the state there."""

    name = "prefix-hash"
    supports_speculative = False
    n_vocab = 50
    n_ctx = 256

    def __init__(self, can_rollback: bool):
        self.can_rollback = can_rollback
        self.state: list[int] = []
        self.evaluated = 0

    def tokenize(self, text, add_special, parse_special):
        return [b % self.n_vocab for b in text]

    def detokenize(self, tokens):
        return bytes(65 + t % 26 for t in tokens)

    @property
    def n_past(self):
        return len(self.state)

    def eval(self, tokens):
        self.state += tokens
        self.evaluated += len(tokens)
        seed = int.from_bytes(hashlib.sha256(bytes(str(self.state), "ascii")).digest()[:8], "little")
        return np.random.default_rng(seed).standard_normal(self.n_vocab).astype(np.float32) * 3

    def eval_argmax(self, tokens):
        return int(np.argmax(self.eval(tokens)))

    def rollback(self, n_keep):
        if not self.can_rollback:
            return False
        del self.state[n_keep:]
        return True

    def reset(self):
        self.state = []

    def close(self):
        pass


def hash_engine(can_rollback):
    be = PrefixHashBackend(can_rollback)
    return Engine(be, model_path="hash", config=None, metadata={}, chat_template_source=None,
                  eog_tokens=(), token_eos=None, backend_reason="test"), be


def test_rollback_evaluates_only_from_the_first_difference_and_changes_nothing():
    base = list(range(1, 31))
    edited = base[:20] + [7, 7, 7]
    outs = {}
    for can in (True, False):
        eng, be = hash_engine(can)
        eng.generate(base, max_tokens=5, seed=3)
        before = be.evaluated
        r = eng.generate(edited, max_tokens=5, seed=3)
        outs[can] = r.tokens
        if can:
            assert r.stats.cached_prompt_tokens == 20 and be.evaluated - before == 3 + 4
        else:
            assert r.stats.cached_prompt_tokens == 0 and be.evaluated - before == len(edited) + 4
        assert be.state == edited + r.tokens[:-1]
    fresh_eng, _ = hash_engine(False)
    assert outs[True] == outs[False] == fresh_eng.generate(edited, max_tokens=5, seed=3).tokens


def test_llama_cpp_checkpoints_restore_the_exact_state(model):
    from openjet_plugin.backends.llama_cpp import MAX_CHECKPOINTS, LlamaCppBackend

    be = LlamaCppBackend(model, 256, n_threads=1)
    try:
        tok = lambda s: be.tokenize(s.encode(), False, True)
        a, b, c = tok("The weather today is"), tok(" sunny and warm, said"), tok(" rainy and cold")
        be.eval(a)
        be.save_checkpoint()
        be.eval(b)
        be.save_checkpoint()
        assert not be.rollback(len(a))                       # recurrent state: no plain rollback
        assert be.restore_checkpoint(len(a) + 2) == len(a)   # the newest one at or before n_max
        assert be.n_past == len(a)
        resumed = be.eval(c)
        be.reset()
        np.testing.assert_array_equal(resumed, be.eval(a + c))
        assert be.restore_checkpoint(3) == 0 and be.n_past == 0   # reset dropped them all
        for k in range(1, MAX_CHECKPOINTS + 3):
            be.eval(tok(" word"))
            be.save_checkpoint()
        assert len(be._checkpoints) == MAX_CHECKPOINTS
    finally:
        be.close()
