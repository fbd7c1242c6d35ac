"""Prefix reuse across slots (issue 29): a copy of a sequence's state at a prompt prefix (attention
KV of its positions + the recurrent state after them) loads into another sequence exactly, and
the engine keeps such copies (prefix_cache.py) so a conversation with a system prompt another slot
already evaluated evaluates only the rest.

Checked on the embedded default model with the llama.cpp backend: the copy gives the logits of a
fresh evaluation bit for bit, short prefixes included; a second conversation with the same
200-token system prompt in another slot evaluates only its suffix (counted at the backend) and
answers exactly as a fresh engine; the budget evicts the least recently used copies and refuses
bad values; a slot decoding while copies load into another is not disturbed.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin.backends.base import SequenceState
from openjet_plugin.backends.llama_cpp import LlamaCppBackend
from openjet_plugin.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache

SYSTEM = "You review Python code. Point out bugs first, then style. Quote the line you mean. " * 10
N_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return openjet_plugin.default_model_path()


def load(model, **kw):
    kw.setdefault("n_slots", 2)
    return openjet_plugin.load(model, backend="llama.cpp", n_ctx=512, n_threads=1, **kw)


def chat_prompt(eng, user: str, system: str = SYSTEM) -> list[int]:
    text = eng.render_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])
    return eng.tokenize(text, add_special=True)


def count_evals(eng) -> list[int]:
    """Tokens each slot's backend evaluates from now on (the backend's own count, not the stats)."""
    counts = [0] * eng.n_slots
    for s in eng._slots:
        view = s.backend
        for name in ("eval", "eval_argmax"):
            orig = getattr(view, name)

            def counted(tokens, orig=orig, i=s.index):
                counts[i] += len(tokens)
                return orig(tokens)
            setattr(view, name, counted)
    return counts


def logprob_rows(result) -> list[tuple]:
    return [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in result.logprobs]


# --- the copy ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [5, 50])
def test_a_state_copied_at_a_prefix_into_another_sequence_gives_the_fresh_logits(model, k):
    """A evaluates prompt[:k], its state is copied out, A moves on; the copy loads into B, which
    evaluates prompt[k:]: the logits equal a fresh context's on the same tokens, bit for bit, and
    A's own continuation is untouched. k=5: shorter than any block size."""
    multi = LlamaCppBackend(model, 256, n_threads=1, n_seq=2)
    ref = LlamaCppBackend(model, 256, n_threads=1, n_seq=2)
    try:
        a, b = multi.sequences()
        prompt = multi.tokenize(b"import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n"
                                b"        self.path = path\n        self.values = {}\n\n    def load(self):\n"
                                b"        with open(self.path) as f:\n            for line in f:\n"
                                b"                key, value = line.split('=')\n", True, True)
        assert len(prompt) > k + 4
        a.eval(prompt[:k])
        state = a.save_state(1 << 30)
        assert isinstance(state, SequenceState) and state.n_past == k and state.nbytes > 0
        a_next = a.eval([11, 12, 13])                       # A moves on past the copy
        b.eval(multi.tokenize(b"something else entirely", True, True))   # B held another state
        assert b.load_state(state) and b.n_past == k
        got = b.eval(prompt[k:])

        r, r2 = ref.sequences()
        r.eval(prompt[:k])
        want = r.eval(prompt[k:])                           # the same evals, in a fresh context
        assert np.array_equal(got, want)
        whole = r2.eval(prompt)                             # and in one eval
        assert np.array_equal(got, whole), np.abs(got - whole).max()
        # A was not disturbed by the copy or by B's load
        r.reset()
        r.eval(prompt[:k])
        assert np.array_equal(a_next, r.eval([11, 12, 13]))
        assert np.array_equal(a.eval([14]), r.eval([14]))
        # a budget below the state's size: no copy
        now = a.save_state(1 << 30)
        assert now.n_past == a.n_past and a.save_state(now.nbytes - 1) is None
        with pytest.raises(ValueError, match="another backend"):
            r.load_state(state)
    finally:
        multi.close()
        ref.close()


# --- the engine: two conversations, one system prompt ---------------------------------------------

def test_second_conversation_with_the_same_system_prompt_evaluates_only_its_suffix(model):
    with load(model) as eng:
        first = chat_prompt(eng, "def add(a, b): return a - b")
        second = chat_prompt(eng, "import os\nprint(os.getcwd())")
        turn = eng._first_turn_end(first)
        assert turn == eng._first_turn_end(second) >= 200        # the system prompt's turn
        assert first[:turn] == second[:turn] and len(second) - turn < 40
        evaluated = count_evals(eng)
        held = eng.generate(first, max_tokens=N_TOKENS, temperature=0, stream=True)
        first_out = next(held).tokens                             # conversation 1 holds slot 0
        assert eng._slots[0].owner is not None
        r = eng.generate(second, max_tokens=N_TOKENS, temperature=0, logprobs=True, top_logprobs=5)
        assert eng._slots[1].last_used > 0                        # it ran in the other slot
        assert r.stats.prefix_cache_tokens == r.stats.cached_prompt_tokens == turn
        assert r.stats.prefilled_tokens == len(second) - turn
        # the backend evaluated the suffix and the generated tokens but the last, nothing more
        assert evaluated[1] == len(second) - turn + len(r.tokens) - (r.finish_reason == "length")
        stats = eng.prefix_cache_stats
        assert stats["hits"] == 1 and stats["reused_tokens"] == turn
        first_out += [t for c in held for t in c.tokens]
    with load(model) as fresh:          # the same engine, nothing cached: every token evaluated
        want = fresh.generate(second, max_tokens=N_TOKENS, temperature=0, logprobs=True, top_logprobs=5)
        assert want.stats.cached_prompt_tokens == 0
    assert r.tokens == want.tokens and r.text == want.text
    assert logprob_rows(r) == logprob_rows(want)                  # every step's logits, exactly
    with load(model, n_slots=1) as one:                           # the one-slot engine, no cache
        alone = one.generate(second, max_tokens=N_TOKENS, temperature=0, logprobs=True, top_logprobs=5)
        assert one.prefix_cache_stats["budget_bytes"] == 0 and alone.stats.prefix_cache_tokens == 0
        first_alone = one.generate(first, max_tokens=N_TOKENS, temperature=0).tokens
    assert alone.tokens == r.tokens
    np.testing.assert_allclose([x[1] for x in logprob_rows(alone)], [x[1] for x in logprob_rows(r)],
                               rtol=0, atol=1e-5)
    assert first_out == first_alone             # the conversation in slot 0 went on undisturbed


def test_a_short_shared_prefix_is_reused_too(model):
    """Prompts of under 32 tokens: the first turn's copy and the whole-prompt copy (all but the
    last token) serve the other slot."""
    with load(model) as eng:
        eot = min(eng.eog_tokens)
        head = eng.tokenize("def main():") + [eot]
        a = head + eng.tokenize(" return 1")
        b = head + eng.tokenize(" print(2)")
        assert len(a) < 32 and len(b) < 32 and a[:len(head)] == b[:len(head)]
        held = eng.generate(a, max_tokens=4, temperature=0, stream=True)
        next(held)
        rb = eng.generate(b, max_tokens=8, temperature=0)
        assert rb.stats.prefix_cache_tokens == len(head)
        held.close()
        # no turn boundary: the copy of all but the last token of a prompt of a few tokens
        c = eng.tokenize("x = 1")
        held = eng.generate(c, max_tokens=4, temperature=0, stream=True)
        next(held)
        longer = c + eng.tokenize(" + 2")
        assert len(c) <= 4 and eng._first_turn_end(longer) == 0
        rl = eng.generate(longer, max_tokens=8, temperature=0)
        assert rl.stats.prefix_cache_tokens == len(c) - 1
        held.close()
    with load(model) as fresh:
        assert fresh.generate(b, max_tokens=8, temperature=0).tokens == rb.tokens
        assert fresh.generate(longer, max_tokens=8, temperature=0).tokens == rl.tokens


def test_the_next_conversation_takes_a_free_slot_and_keeps_the_first_ones_state(model):
    """Sequential requests: a new conversation with a cached system prompt goes to the empty slot
    (the copy serves it there as well), so the first conversation's next turn still finds its
    whole state in its own slot."""
    with load(model) as eng:
        first = chat_prompt(eng, "def add(a, b):")
        r1 = eng.generate(first, max_tokens=8, temperature=0)
        r2 = eng.generate(chat_prompt(eng, "import os"), max_tokens=8, temperature=0)
        assert r2.stats.prefix_cache_tokens == eng._first_turn_end(first)
        assert {len(s.tokens) > 0 for s in eng._slots} == {True}     # one slot each
        follow = first + r1.tokens + eng.tokenize("\nmore")
        r3 = eng.generate(follow, max_tokens=8, temperature=0)
        assert r3.stats.prefix_cache_tokens == 0
        # the last sampled token was never evaluated when max_tokens stopped it
        assert r3.stats.cached_prompt_tokens == len(first) + len(r1.tokens) - (r1.finish_reason == "length")


# --- the budget -------------------------------------------------------------------------------------

def test_a_small_budget_evicts_the_least_recently_used_copies(model):
    with load(model, n_slots=2, prefix_cache_bytes=1) as eng:        # smaller than any copy
        r = eng.generate(chat_prompt(eng, "x = 1"), max_tokens=4, temperature=0)
        assert eng.prefix_cache_stats["entries"] == 0 and eng.prefix_cache_stats["stored"] == 0
        assert r.stats.prefix_cache_tokens == 0
    systems = ["Answer in one word. " * 8, "Answer in two words. " * 8, "Answer in three words. " * 8]
    sizes = []
    with load(model, n_slots=2) as probe:
        for s in systems:
            probe.generate(chat_prompt(probe, "x = 1", system=s), max_tokens=1, temperature=0)
        sizes = [e.nbytes for e in probe._prefix_cache._entries.values()]
    assert len(sizes) == 6                                # a first-turn and a whole-prompt copy each
    budget = 4 * max(sizes)                               # four copies fit (and each is a quarter at most)
    assert budget < 5 * min(sizes)
    with load(model, n_slots=2, prefix_cache_bytes=budget) as eng:
        for s in systems:
            eng.generate(chat_prompt(eng, "x = 1", system=s), max_tokens=4, temperature=0)
        st = eng.prefix_cache_stats
        assert st["stored"] == 6 and st["entries"] == 4 and st["evicted"] == 2 and st["bytes"] <= budget
        # the first conversation's copies were the least recently used: its system prompt is
        # evaluated again; the last one's is reused
        eng._forget_state()
        r = eng.generate(chat_prompt(eng, "y = 2", system=systems[0]), max_tokens=4, temperature=0)
        assert r.stats.prefix_cache_tokens == 0 and r.stats.cached_prompt_tokens == 0
        eng._forget_state()
        last = chat_prompt(eng, "y = 2", system=systems[2])
        r = eng.generate(last, max_tokens=4, temperature=0)
        assert r.stats.prefix_cache_tokens == eng._first_turn_end(last)


def test_prefix_cache_lru_order():
    class State:
        def __init__(self, n, nbytes):
            self.n_past, self.nbytes = n, nbytes

    c = PrefixCache(400)
    assert c.max_copy_bytes == 100
    assert c.put((1, 2), State(2, 100)) and c.put((1, 2, 3), State(3, 100))
    assert c.longest([1, 2, 3, 4], 3).tokens == (1, 2, 3)
    assert c.longest([1, 2, 3, 4], 3, longer_than=3) is None
    assert c.longest([1, 2, 3, 4], 2).tokens == (1, 2)          # (1, 2) is now the most recent
    assert c.longest([1, 2, 3, 4], 3, touch=False).tokens == (1, 2, 3)   # and stays so
    assert c.put((5,), State(1, 100)) and c.put((6,), State(1, 100))
    assert c.put((7,), State(1, 100))                              # evicts (1, 2, 3), the oldest
    assert (1, 2, 3) not in c and (1, 2) in c and (7,) in c and c.nbytes == 400
    assert not c.put((8,), State(1, 101)) and len(c) == 4          # more than a quarter of the budget
    with pytest.raises(ValueError, match="positions"):
        c.put((9, 9), State(3, 1))
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(0)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2GiB"])
def test_load_refuses_a_bad_prefix_cache_budget(model, bad):
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        load(model, prefix_cache_bytes=bad)


def test_budget_defaults(model):
    with load(model, n_slots=2) as eng:
        assert eng.prefix_cache_stats["budget_bytes"] == DEFAULT_PREFIX_CACHE_BYTES
    with load(model, n_slots=2, prefix_cache_bytes=0) as eng:
        assert eng.prefix_cache_stats["budget_bytes"] == 0
        eng.generate(chat_prompt(eng, "a"), max_tokens=2, temperature=0)
        assert eng.prefix_cache_stats["entries"] == 0
    with load(model, n_slots=1, prefix_cache_bytes=16 << 20) as eng:   # one slot, asked for
        eng.generate(chat_prompt(eng, "a"), max_tokens=2, temperature=0)
        r = eng.generate(chat_prompt(eng, "b"), max_tokens=2, temperature=0)
        assert r.stats.prefix_cache_tokens == eng._first_turn_end(chat_prompt(eng, "b"))


# --- a busy slot ----------------------------------------------------------------------------------

def test_copies_loading_into_one_slot_do_not_disturb_another_decoding(model):
    """One slot decodes a long greedy stream while conversation after conversation with a cached
    system prompt loads its copy into the other: the stream is exactly what it gives alone, and
    every conversation answers as on a fresh engine."""
    users = [f"value_{i} = compute({i})" for i in range(6)]
    n_long = 400
    with load(model, n_slots=1) as one:
        long_prompt = one.tokenize("import collections\n\n\ndef group(items):", add_special=True)
        long_alone = one.generate(long_prompt, max_tokens=n_long, temperature=0).tokens
        want = {u: one.generate(chat_prompt(one, u), max_tokens=8, temperature=0).tokens for u in users}
    assert len(long_alone) > 200
    with load(model) as eng:
        eng.generate(chat_prompt(eng, "warm up"), max_tokens=1, temperature=0)   # caches the system prompt
        eng._forget_state()
        progress = [0]
        started = threading.Event()

        def long_stream():
            out = []
            stream = eng.generate(long_prompt, max_tokens=n_long, temperature=0, stream=True)
            for c in stream:
                out += c.tokens
                progress[0] = len(out)
                started.set()
            return out

        def conversations():
            started.wait(60)
            got = {}
            for u in users:
                before = progress[0]
                got[u] = eng.generate(chat_prompt(eng, u), max_tokens=8, temperature=0)
                got[u].during = 0 < before and progress[0] < len(long_alone)
            return got

        out: dict = {}
        threads = [threading.Thread(target=lambda: out.__setitem__("long", long_stream())),
                   threading.Thread(target=lambda: out.__setitem__("conv", conversations()))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert out["long"] == long_alone
        for u in users:
            r = out["conv"][u]
            assert r.tokens == want[u]
            assert r.stats.prefix_cache_tokens == eng._first_turn_end(chat_prompt(eng, u))
        assert sum(out["conv"][u].during for u in users) >= 3       # while slot 0 decoded
        assert eng._backend.pass_counts["shared_passes"] > 0
