"""`openjet_plugin.adapters.llama_cpp.install()`: code written for llama-cpp-python runs on the
engine unchanged — langchain-community's `LlamaCpp` and `ChatLlamaCpp` included — while openjet's
own llama.cpp fallback keeps the real library. Also the drop-in's members beyond completions, its
grammar / response_format / forced tool_choice (engine constraints) and logprobs in
llama-cpp-python's shapes, on the embedded default model.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest

import openjet_plugin
from openjet_plugin.adapters import llama_cpp as dropin

N_CTX = 512
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def installed():
    real = sys.modules.get("llama_cpp")
    module = dropin.install()
    try:
        yield module
    finally:
        dropin.uninstall()
        assert sys.modules["llama_cpp"] is (real if real is not None else module.__openjet_real__)


@pytest.fixture(scope="module")
def path() -> str:
    return str(openjet_plugin.default_model_path())


@pytest.fixture(scope="module")
def llm(installed, path):
    import llama_cpp

    model = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, verbose=False)
    yield model
    model.close()


def test_import_llama_cpp_gives_the_drop_in_with_every_public_name(installed):
    import llama_cpp

    real = llama_cpp.__openjet_real__
    assert llama_cpp is installed and llama_cpp.Llama is dropin.Llama and real.Llama is not dropin.Llama
    public = {n for n in dir(real) if not n.startswith("_")}
    assert public <= set(dir(llama_cpp))
    from llama_cpp import LlamaCache, LlamaGrammar, LlamaRAMCache, LlamaState, llama_types  # noqa: F401
    from llama_cpp.llama_types import ChatCompletionRequestMessage  # noqa: F401
    assert LlamaGrammar is real.LlamaGrammar and llama_types is real.llama_types
    assert dropin.install() is llama_cpp                       # twice: the same module


def test_the_fallback_backend_keeps_the_real_library(installed, path):
    # the llama.cpp backend does `import llama_cpp`; with the drop-in installed it must still get
    # llama-cpp-python (else it would build the drop-in, which builds an engine: endless recursion)
    eng = openjet_plugin.load(path, backend="llama.cpp", n_ctx=256)
    try:
        assert eng.backend_name == "llama.cpp"
        assert type(eng._backend._llm) is installed.__openjet_real__.Llama
        assert eng.generate("Hello", max_tokens=3, temperature=0).finish_reason in ("stop", "length")
    finally:
        eng.close()


def test_langchain_community_llamacpp(llm, path):
    from langchain_community.llms import LlamaCpp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lc = LlamaCpp(model_path=path, n_ctx=N_CTX, temperature=0, max_tokens=12, verbose=False)
    assert isinstance(lc.client, dropin.Llama)
    text = lc.invoke("def fibonacci(n):")
    # LlamaCpp's defaults (top_p 0.95, repeat_penalty 1.1, ...) reach the drop-in unchanged
    expected = llm("def fibonacci(n):", max_tokens=12, temperature=0, top_p=0.95, top_k=40,
                   repeat_penalty=1.1, stop=[])["choices"][0]["text"]
    assert text == expected
    assert "".join(lc.stream("def fibonacci(n):")) == expected
    lc.client.close()


def test_langchain_community_llamacpp_with_a_grammar(installed, path):
    from langchain_community.llms import LlamaCpp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lc = LlamaCpp(model_path=path, n_ctx=N_CTX, temperature=0.9, max_tokens=20, verbose=False,
                      grammar='root ::= ("yes" | "no") "."')
    assert isinstance(lc.grammar, installed.LlamaGrammar)
    for _ in range(3):
        assert lc.invoke("Is the sea blue?") in ("yes.", "no.")
    lc.client.close()


def test_langchain_community_chatllamacpp_with_tools(installed, path):
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather forecast of a city for the next days."""
        return "sunny"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chat = ChatLlamaCpp(model_path=path, n_ctx=N_CTX, temperature=0, max_tokens=40, verbose=False)
    reply = chat.invoke("Say hi")
    assert isinstance(reply.content, str) and reply.response_metadata["finish_reason"] in ("stop", "length")
    # bind_tools with tool_choice: ChatLlamaCpp forces the call (a grammar in llama-cpp-python,
    # an engine constraint here); the call's arguments are valid for the tool's schema
    forced = chat.bind_tools([get_weather], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = forced.invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_weather"
    args = msg.tool_calls[0]["args"]
    assert isinstance(args["city"], str) and isinstance(args["days"], int)
    chat.client.close()


def test_grammar_from_json_schema_and_response_format(llm, installed):
    import jsonschema

    grammar = installed.LlamaGrammar.from_json_schema(json.dumps(PERSON))
    for seed in range(3):
        out = llm("A person as JSON:", grammar=grammar, max_tokens=80, temperature=1.0, seed=seed)
        assert out["choices"][0]["finish_reason"] == "stop"
        # llama-cpp-python's own converter writes `char ::= [^"\\] | ...`: raw control characters
        # are allowed inside strings, so the text is JSON in the lenient sense (strict=False)
        jsonschema.validate(json.loads(out["choices"][0]["text"], strict=False), PERSON)
    r = llm.create_chat_completion([{"role": "user", "content": "A person"}], max_tokens=80, temperature=1.0,
                                   seed=4, response_format={"type": "json_object", "schema": PERSON})
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), PERSON)
    r = llm.create_chat_completion([{"role": "user", "content": "Anything"}], max_tokens=120, temperature=0,
                                   response_format={"type": "json_object"})
    assert r["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_in_llama_cpp_pythons_shape(llm, stream):
    import jsonschema

    r = llm.create_chat_completion([{"role": "user", "content": "Weather?"}], tools=TOOLS, temperature=1.0, seed=2,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   max_tokens=80, stream=stream)
    if stream:
        chunks = list(r)
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        call = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")][0]["choices"][0]["delta"]["tool_calls"][0]
    else:
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        call = choice["message"]["tool_calls"][0]
        assert choice["message"]["function_call"] == call["function"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["id"].startswith("call__0_get_weather_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])


def test_logprobs_in_llama_cpp_pythons_shapes(llm):
    import math

    prompt = "Once upon a time"
    out = llm(prompt, max_tokens=5, temperature=0, logprobs=3)
    block = out["choices"][0]["logprobs"]
    assert set(block) == {"tokens", "text_offset", "token_logprobs", "top_logprobs"}
    assert "".join(block["tokens"]) == out["choices"][0]["text"]
    assert block["text_offset"][0] == len(prompt)
    for token, lp, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"]):
        assert lp <= 0 and top[token] == lp and 1 <= len(top) <= 4
        assert max(top.values()) == lp                      # greedy: the chosen token is the most likely
    # the distribution is the model's: the engine's own logprobs for the same request
    direct = llm._engine.generate(prompt, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    assert all(math.isclose(a, b.logprob, abs_tol=1e-6) for a, b in zip(block["token_logprobs"], direct.logprobs))
    streamed = [c["choices"][0]["logprobs"] for c in llm(prompt, max_tokens=5, temperature=0, logprobs=3, stream=True)]
    assert [t for b in streamed if b for t in b["token_logprobs"]] == block["token_logprobs"]
    chat = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
                                      logprobs=True, top_logprobs=2)
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == chat["choices"][0]["message"]["content"]
    assert all(set(e) == {"token", "bytes", "logprob", "top_logprobs"} for e in content)


def test_members_beyond_completions(llm, installed):
    tokens = llm.tokenize(b"def main():")
    gen = llm.generate(tokens, temp=0)
    got = [next(gen) for _ in range(5)]
    gen.close()
    expected = llm._engine.generate(tokens, max_tokens=5, temperature=0).tokens
    assert got[:len(expected)] == expected
    tok = llm.tokenizer()
    assert tok.encode("hello world", add_bos=False) == llm.tokenize(b"hello world", add_bos=False, special=True)
    assert tok.decode(tok.encode("hello world", add_bos=False)) == "hello world"
    cache = installed.LlamaRAMCache()
    llm.set_cache(cache)
    assert llm.cache is cache
    assert llm("Hi", max_tokens=2, temperature=0)["choices"][0]["text"] is not None
    for name in ("scores", "ctx", "model", "context_params", "eval_tokens", "eval_logits"):
        with pytest.raises(NotImplementedError, match=name.split("_")[0]):
            getattr(llm, name)
    with pytest.raises(NotImplementedError, match="eval"):
        llm.eval(tokens)
    with pytest.raises(NotImplementedError, match="sample"):
        llm.sample()
    with pytest.raises(NotImplementedError, match="from_pretrained"):
        installed.Llama.from_pretrained("Qwen/Qwen3-0.6B-GGUF", "*.gguf")
