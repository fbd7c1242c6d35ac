"""The Engine API on the llama.cpp backend: greedy agreement with llama-cpp-python, stats, stop
conditions, context limits, streaming and its lock, bad model paths, and the default model."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin import defaults
from openjet_plugin.engine import Engine, EngineBusyError
from openjet_plugin.errors import ContextOverflowError, ModelFileError, OpenJetError

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n\nclass Config:"]


@pytest.fixture(scope="module")
def model(synth_path):
    return synth_path("tiny", "Q8_0")


@pytest.fixture(scope="module")
def engine(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=512, n_threads=1)
    yield eng
    eng.close()


def llama_cpp_greedy(model, prompt: str, n: int) -> list[int]:
    """llama-cpp-python's own greedy decoding (its sampler chain with temp 0), token by token."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=512, n_threads=1, verbose=False)
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        out = []
        for tok in llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0):
            if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), tok) or len(out) == n:
                break
            out.append(tok)
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_llama_cpp_python(engine, model, prompt):
    n = 40
    ours = engine.generate(prompt, max_tokens=n, temperature=0)
    theirs = llama_cpp_greedy(model, prompt, n)
    assert ours.tokens == theirs
    assert ours.text == engine.detokenize(ours.tokens)


def test_greedy_with_token_prompt_equals_text_prompt(engine):
    ids = engine.tokenize(PROMPTS[0], add_special=True)
    assert engine.generate(ids, max_tokens=12, temperature=0).tokens == \
        engine.generate(PROMPTS[0], max_tokens=12, temperature=0).tokens


def test_eog_tokens_match_llama_cpp(engine, model):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=64, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    theirs = {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    llm.close()
    assert engine.eog_tokens == theirs
    assert engine.tokenize("<|im_end|>")[0] in engine.eog_tokens


def test_stats_describe_the_request(engine):
    r = engine.generate(PROMPTS[1], max_tokens=16, temperature=0)
    s = r.stats
    assert engine.last_stats is s
    assert s.prompt_tokens == len(engine.tokenize(PROMPTS[1], add_special=True))
    assert s.generated_tokens == len(r.tokens) == 16 and r.finish_reason == "length"
    assert s.prefill_seconds > 0 and s.decode_seconds > 0
    assert s.tokens_per_second == pytest.approx(s.generated_tokens / s.decode_seconds)
    assert s.backend == "llama.cpp" and s.drafts_proposed == 0
    assert "tok/s" in s.summary()


def test_stream_chunks_add_up_to_the_result(engine):
    whole = engine.generate(PROMPTS[2], max_tokens=30, temperature=0.9, seed=7)
    chunks = list(engine.generate(PROMPTS[2], max_tokens=30, temperature=0.9, seed=7, stream=True))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == whole.finish_reason and chunks[-1].stats is not None


def test_stop_string_ends_generation_without_emitting_it(engine):
    full = engine.generate(PROMPTS[0], max_tokens=40, temperature=0)
    # a stop string that spans a token boundary in the middle of the reply
    toks = full.tokens
    cut = len(engine.detokenize(toks[:10]))
    stop = full.text[cut - 2: cut + 3]
    assert len(stop) == 5
    first = full.text.find(stop)
    r = engine.generate(PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert r.finish_reason == "stop"
    assert r.text == full.text[:first]
    streamed = list(engine.generate(PROMPTS[0], max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(c.text for c in streamed) == full.text[:first]


def test_prompt_plus_max_tokens_beyond_n_ctx_is_refused(model):
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=32, n_threads=1) as eng:
        n_prompt = len(eng.tokenize(PROMPTS[2], add_special=True))
        with pytest.raises(ContextOverflowError) as ei:
            eng.generate(PROMPTS[2], max_tokens=32)
        msg = str(ei.value)
        assert str(n_prompt) in msg and "max_tokens=32" in msg and "n_ctx=32" in msg
        # max_tokens=None fills the context and stops with "length"
        r = eng.generate(PROMPTS[2], max_tokens=None, temperature=0, logit_bias={t: -np.inf for t in eng.eog_tokens})
        assert r.finish_reason == "length" and len(r.tokens) == 32 - n_prompt
        with pytest.raises(ContextOverflowError, match="no room"):
            eng.generate(list(range(100, 132)), max_tokens=None)


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate("")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([1, 2, engine.n_vocab])
    with pytest.raises(ValueError, match="integer token ids"):
        engine.generate([1, "2"])


# --- bad model paths and load parameters ----------------------------------------------------------

def test_missing_model_file_is_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        openjet_plugin.load(missing)


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory"):
        openjet_plugin.load(tmp_path)


def test_non_gguf_file_is_rejected_with_its_name(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model\n")
    with pytest.raises(ModelFileError, match="notes.gguf"):
        openjet_plugin.load(bad)


def test_truncated_model_is_rejected(tmp_path, model):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        openjet_plugin.load(cut)


@pytest.mark.parametrize("kw,name", [(dict(backend="cuda"), "backend"), (dict(n_ctx=0), "n_ctx"),
                                     (dict(n_ctx="big"), "n_ctx"), (dict(n_ctx=10**6), "n_ctx"),
                                     (dict(kv_type="q4"), "kv_type"), (dict(draft_depth=-1), "draft_depth"),
                                     (dict(seed=-2), "seed"), (dict(n_threads=0), "n_threads")])
def test_invalid_load_parameters(model, kw, name):
    with pytest.raises(ValueError, match=name):
        openjet_plugin.load(model, **kw)


def test_closed_engine_refuses_work(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=64, n_threads=1)
    with eng:
        assert eng.generate("x", max_tokens=2).stats.generated_tokens >= 1
    with pytest.raises(OpenJetError, match="closed"):
        eng.generate("x", max_tokens=2)
    eng.close()   # idempotent


# --- streams and the lock --------------------------------------------------------------------------

def test_closing_a_stream_early_leaves_a_consistent_engine(engine, model):
    stream = engine.generate(PROMPTS[0], max_tokens=30, temperature=0, stream=True)
    next(stream), next(stream)
    stream.close()
    # the next request must behave exactly as on a fresh engine
    after = engine.generate(PROMPTS[1], max_tokens=20, temperature=0).tokens
    assert after == llama_cpp_greedy(model, PROMPTS[1], 20)


def test_same_thread_cannot_start_a_request_while_its_stream_is_open(engine):
    stream = engine.generate(PROMPTS[0], max_tokens=30, temperature=0, stream=True)
    next(stream)
    with pytest.raises(EngineBusyError, match="close"):
        engine.generate(PROMPTS[1], max_tokens=2)
    stream.close()
    assert engine.generate(PROMPTS[1], max_tokens=2).stats.generated_tokens >= 1


def test_other_threads_wait_for_an_open_stream(engine):
    stream = engine.generate(PROMPTS[0], max_tokens=30, temperature=0, stream=True)
    next(stream)
    done = threading.Event()
    result = {}

    def other():
        result["r"] = engine.generate(PROMPTS[1], max_tokens=3, temperature=0)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert not done.wait(0.5), "a second request ran while a stream held the engine"
    rest = list(stream)                    # exhausting the stream releases the lock
    assert rest[-1].finish_reason is not None
    t.join(30)
    assert done.is_set() and len(result["r"].tokens) == 3


# --- the default model -----------------------------------------------------------------------------

def test_default_model_is_generated_once_atomically(tmp_path, monkeypatch):
    from openjet_plugin.testing import synth

    monkeypatch.setenv("OPENJET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(defaults, "SHIPPED_DEFAULT", tmp_path / "absent.gguf")
    calls = []
    real = synth.synth_model

    def counting(*a, **k):
        calls.append(a)
        time.sleep(0.3)                     # widen the window two racing callers could clash in
        return real(*a, **k)

    monkeypatch.setattr(synth, "synth_model", counting)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(openjet_plugin.default_model_path()))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(calls) == 1, "the default model was generated more than once"
    assert len(set(paths)) == 1 and paths[0].is_file()
    assert paths[0].parent == tmp_path / "cache"
    assert not [p for p in paths[0].parent.iterdir() if p.suffix == ".gguf" and p != paths[0]]
    mtime = paths[0].stat().st_mtime_ns
    assert openjet_plugin.default_model_path() == paths[0] and paths[0].stat().st_mtime_ns == mtime
    with openjet_plugin.load(None, n_ctx=64, n_threads=1) as eng:
        assert eng.model_path == paths[0] and eng.backend_name == "llama.cpp"


def test_shipped_default_wins(tmp_path, monkeypatch, model):
    monkeypatch.setattr(defaults, "SHIPPED_DEFAULT", model)
    monkeypatch.setenv("OPENJET_CACHE_DIR", str(tmp_path / "unused"))
    assert openjet_plugin.default_model_path() == model
    assert not (tmp_path / "unused").exists()


# --- engine logic that needs a model to behave in a set way: a scripted backend --------------------

class ScriptedBackend:
    """A backend whose logits follow a script: after `k` evaluated tokens it prefers script[k]."""

    name = "scripted"
    supports_speculative = False

    def __init__(self, script, n_vocab=16, n_ctx=64):
        self.script, self.n_vocab, self.n_ctx = script, n_vocab, n_ctx
        self.state: list[int] = []
        self.evals: list[list[int]] = []

    def tokenize(self, text, add_special, parse_special):
        return list(text)

    def detokenize(self, tokens):
        return bytes(tokens)

    @property
    def n_past(self):
        return len(self.state)

    def eval(self, tokens):
        self.evals.append(list(tokens))
        self.state += tokens
        logits = np.zeros(self.n_vocab, dtype=np.float32)
        logits[self.script[min(len(self.state), len(self.script) - 1)]] = 10
        return logits

    def eval_argmax(self, tokens):
        return int(np.argmax(self.eval(tokens)))

    def rollback(self, n_keep):
        return False

    def reset(self):
        self.state = []

    def close(self):
        pass


def scripted_engine(script, eog=(15,), **kw):
    be = ScriptedBackend(script, **kw)
    return Engine(be, model_path="scripted", config=None, metadata={}, chat_template_source=None,
                  eog_tokens=eog, token_eos=eog[0], backend_reason="test"), be


def test_generation_stops_at_an_end_of_generation_token():
    # prompt [1, 2]: after 2 tokens -> 'A'(65), after 3 -> 'B'(66), after 4 -> eog 15
    eng, be = scripted_engine([0, 0, 65, 66, 15, 67], n_vocab=128)
    r = eng.generate([1, 2], max_tokens=10, temperature=0)
    assert r.tokens == [65, 66] and r.text == "AB" and r.finish_reason == "stop"
    assert r.stats.generated_tokens == 3          # the end-of-generation token was sampled
    assert be.state == [1, 2, 65, 66]             # ... but never evaluated


def test_generation_stops_when_the_context_is_full():
    eng, be = scripted_engine([0] + [65] * 20, n_vocab=128, n_ctx=8)
    r = eng.generate([1, 2, 3], max_tokens=None, temperature=0)
    assert r.finish_reason == "length" and len(r.tokens) == 5 and be.n_past <= 8


def test_closing_the_engine_ends_this_threads_open_stream(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=64, n_threads=1)
    with eng:
        stream = eng.generate("Hello", max_tokens=20, temperature=0, stream=True)
        next(stream)
    # the with-block closed the engine without waiting for the stream; the stream is over
    with pytest.raises(StopIteration):
        next(stream)
    with pytest.raises(OpenJetError, match="closed"):
        eng.generate("Hello", max_tokens=2)
