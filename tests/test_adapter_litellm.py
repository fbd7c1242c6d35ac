"""OpenJetProvider: `litellm.completion(model="openjet/...")` answers what the engine answers.

Real engine on the embedded default model for text, usage, streaming, async and engine sharing; a
scripted engine (adapter_scripted.py) for tool calls and thinking, which a random model never writes.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from adapter_scripted import ScriptedEngine
from openjet_plugin.adapters import _shared
from openjet_plugin.adapters import litellm as lt_adapter
from openjet_plugin.adapters.litellm import OpenJetProvider, register

import litellm  # after the adapter: it sets LITELLM_LOCAL_MODEL_COST_MAP first

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def provider():
    return register()


@pytest.fixture(scope="module")
def engine(provider):
    return _shared.shared_engine(None)


def test_completion_is_the_engines_reply(provider, engine):
    r = litellm.completion(model="openjet/default", messages=MESSAGES, temperature=0, max_tokens=12)
    direct = engine.chat(MESSAGES, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == direct.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == direct.finish_reason
    prompt_tokens = len(engine.tokenize(engine.render_chat(MESSAGES), add_special=True))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt_tokens, len(direct.tokens), prompt_tokens + len(direct.tokens))


def test_model_path_and_alias_share_one_engine(provider, engine):
    path = str(engine.model_path)
    a = litellm.completion(model="openjet/default", messages=MESSAGES, temperature=0, max_tokens=8)
    b = litellm.completion(model="openjet/" + path, messages=MESSAGES, temperature=0, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert provider.engine("default") is provider.engine("openjet/" + path) is engine


def test_streaming_equals_completion_and_carries_usage(provider):
    kw = dict(model="openjet/default", messages=MESSAGES, temperature=0, max_tokens=16)
    whole = litellm.completion(**kw)
    chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = [c.usage for c in chunks if getattr(c, "usage", None)][-1]
    assert (usage.prompt_tokens, usage.completion_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_async_equals_sync(provider):
    kw = dict(model="openjet/default", messages=MESSAGES, temperature=0, max_tokens=10)
    sync = litellm.completion(**kw).choices[0].message.content

    async def run():
        r = await litellm.acompletion(**kw)
        parts = []
        async for c in await litellm.acompletion(stream=True, **kw):
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
        return r.choices[0].message.content, "".join(parts)

    assert asyncio.run(run()) == (sync, sync)


def test_concurrent_requests_are_serialised_not_mixed(provider):
    kw = dict(model="openjet/default", messages=MESSAGES, temperature=0, max_tokens=10)
    expected = litellm.completion(**kw).choices[0].message.content
    results, errors = [], []

    def worker():
        try:
            results.append(litellm.completion(**kw).choices[0].message.content)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [expected] * 4
    assert len([k for k in _shared._engines if k[0] == str(provider.engine("default").model_path)]) == 1


def test_concurrent_async_streams_and_completions(provider):
    kw = dict(model="openjet/default", messages=MESSAGES, temperature=0, max_tokens=10)
    expected = litellm.completion(**kw).choices[0].message.content

    async def streamed():
        parts = []
        async for c in await litellm.acompletion(stream=True, **kw):
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
        return "".join(parts)

    async def whole():
        return (await litellm.acompletion(**kw)).choices[0].message.content

    async def run():
        return await asyncio.gather(streamed(), whole(), streamed(), whole(), streamed())

    assert asyncio.run(run()) == [expected] * 5


def test_sampling_options_reach_the_engine(monkeypatch, engine):
    s = ScriptedEngine(engine, "ok")
    monkeypatch.setattr(lt_adapter, "shared_engine", lambda *a, **k: s)
    litellm.completion(model="openjet/default", messages=MESSAGES, temperature=0.5, top_p=0.9,
                       max_tokens=7, stop="\n", seed=3, top_k=5, min_p=0.1, repeat_penalty=1.1,
                       presence_penalty=0.2, frequency_penalty=0.3)
    assert s.calls[-1] == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "stop": ["\n"], "seed": 3,
                           "top_k": 5, "min_p": 0.1, "repeat_penalty": 1.1, "presence_penalty": 0.2,
                           "frequency_penalty": 0.3}


def test_unknown_option_and_unknown_model_are_clear_errors(provider):
    with pytest.raises(Exception, match="mirostat"):
        litellm.completion(model="openjet/default", messages=MESSAGES, mirostat=2, max_tokens=2)
    with pytest.raises(Exception, match="/no/such.gguf"):
        litellm.completion(model="openjet//no/such.gguf", messages=MESSAGES, max_tokens=2)


def test_a_server_handler_refuses_paths(tmp_path):
    from litellm.llms.custom_llm import CustomLLMError

    handler = OpenJetProvider(aliases={"mine": "/models/mine.gguf"}, allow_paths=False)
    assert handler.model_file("openjet/mine") == "/models/mine.gguf"
    assert handler.model_file("default") is None
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF")
    with pytest.raises(CustomLLMError, match="unknown model") as info:
        handler.engine(str(secret))
    assert info.value.status_code == 404


# --- scripted replies -------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                          "parameters": {"type": "object",
                                                         "properties": {"a": {"type": "integer"},
                                                                        "b": {"type": "integer"}},
                                                         "required": ["a", "b"]}}}]


@pytest.fixture
def scripted(monkeypatch, engine, provider):
    def make(reply: str, piece: int = 3) -> ScriptedEngine:
        s = ScriptedEngine(engine, reply, piece=piece)
        monkeypatch.setattr(lt_adapter, "shared_engine", lambda *a, **k: s)
        return s
    return make


def test_tool_calls_come_back_in_openai_form(scripted):
    s = scripted('Adding.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    r = litellm.completion(model="openjet/default", messages=[{"role": "user", "content": "1+2?"}], tools=TOOLS)
    msg = r.choices[0].message
    assert msg.content == "Adding."
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert '"name": "add"' in s.prompts[-1].split("<tools>")[-1]

    chunks = list(litellm.completion(model="openjet/default", messages=[{"role": "user", "content": "1+2?"}],
                                     tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Adding."


def test_tool_history_is_rendered(scripted):
    s = scripted("3")
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    litellm.completion(model="openjet/default", messages=history, tools=TOOLS)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in s.prompts[-1]
    assert "<tool_response>\n3\n</tool_response>" in s.prompts[-1]


def test_malformed_tool_call_does_not_raise(scripted):
    scripted('<tool_call>\n{"name": "add", "arguments": \n</tool_call>')
    r = litellm.completion(model="openjet/default", messages=[{"role": "user", "content": "1+2?"}], tools=TOOLS)
    msg = r.choices[0].message
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert msg.provider_specific_fields["invalid_tool_calls"][0]["error"]


@pytest.mark.parametrize("how", [{"enable_thinking": True},
                                 {"chat_template_kwargs": {"enable_thinking": True}},
                                 # LiteLLM gates reasoning_effort for custom providers unless allowed
                                 {"reasoning_effort": "low", "allowed_openai_params": ["reasoning_effort"]}])
def test_thinking_goes_to_reasoning_content(scripted, how):
    s = scripted("<think>\nfirst 1, then 2\n</think>\n\nThree.", piece=2)
    r = litellm.completion(model="openjet/default", messages=[{"role": "user", "content": "1+2?"}], **how)
    assert r.choices[0].message.reasoning_content == "first 1, then 2"
    assert r.choices[0].message.content == "Three."
    assert not s.prompts[-1].endswith("</think>\n\n")
    chunks = list(litellm.completion(model="openjet/default", messages=[{"role": "user", "content": "1+2?"}],
                                     stream=True, **how))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("first 1, then 2", "Three.")


# --- `openjet serve` without starting the proxy (test_litellm_proxy.py starts it) -----------------

def test_serve_config_and_refusals(engine, capsys, monkeypatch):
    import yaml

    from openjet_plugin import serve

    path = str(engine.model_path)
    assert serve.main(["--print-config", "--model", f"mine={path}"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model_list"] == [{"model_name": "mine", "litellm_params": {"model": "openjet/mine"}}]
    assert config["litellm_settings"]["custom_provider_map"] == [
        {"provider": "openjet", "custom_handler": "openjet_plugin.adapters.litellm.proxy_handler"}]
    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)   # without a key: refused
    assert serve.main(["--host", "0.0.0.0"]) == 2
    assert "loopback" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no such model file"):
        serve.main(["--model", "/no/such.gguf"])

    # what serve exports is what the proxy's handler serves: the alias, not paths
    monkeypatch.setenv("OPENJET_MODELS", f"mine={path}")
    handler = lt_adapter.configure_proxy_handler()
    try:
        assert handler.model_file("openjet/mine") == path
        from litellm.llms.custom_llm import CustomLLMError

        with pytest.raises(CustomLLMError, match="unknown model"):
            handler.model_file(path)
    finally:
        monkeypatch.delenv("OPENJET_MODELS")
        lt_adapter.configure_proxy_handler()


# --- OpenAI's rules (issue 27) and constraints / tool-call deltas (issue 26) -----------------------

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def test_omitted_max_tokens_is_the_context_end_for_chat_and_16_for_text(monkeypatch, engine):
    s = ScriptedEngine(engine, "ok")
    monkeypatch.setattr(lt_adapter, "shared_engine", lambda *a, **k: s)
    litellm.completion(model="openjet/default", messages=MESSAGES)
    assert s.calls[-1]["max_tokens"] is None                    # Engine.generate: to the end of the context
    litellm.text_completion(model="openjet/default", prompt="def f(x):")
    assert s.calls[-1]["max_tokens"] == lt_adapter.TEXT_COMPLETION_MAX_TOKENS == 16


def test_text_completion_continues_the_raw_prompt(monkeypatch, engine):
    s = ScriptedEngine(engine, " return x")
    monkeypatch.setattr(lt_adapter, "shared_engine", lambda *a, **k: s)
    r = litellm.text_completion(model="openjet/default", prompt="def f(x):", max_tokens=4)
    assert s.prompts[-1] == "def f(x):"                         # no chat template around it
    assert r.choices[0].text == " return x" and r.id.startswith("cmpl-")
    with pytest.raises(litellm.BadRequestError, match="logprobs"):   # LiteLLM would drop them: refused
        litellm.text_completion(model="openjet/default", prompt="def f(x):", max_tokens=4, logprobs=2)


def test_n_logit_bias_and_roles(monkeypatch, engine):
    s = ScriptedEngine(engine, "ok")
    monkeypatch.setattr(lt_adapter, "shared_engine", lambda *a, **k: s)
    with pytest.raises(litellm.BadRequestError, match="n=2"):
        litellm.completion(model="openjet/default", messages=MESSAGES, n=2, max_tokens=2)
    with pytest.raises(litellm.BadRequestError, match="role"):
        litellm.completion(model="openjet/default", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(litellm.BadRequestError, match="logit_bias"):
        litellm.completion(model="openjet/default", messages=MESSAGES, logit_bias={"x": 1}, max_tokens=2)
    litellm.completion(model="openjet/default", messages=MESSAGES, logit_bias={"17": -100, "5": 2.5}, max_tokens=2)
    assert s.calls[-1]["logit_bias"] == {17: -100.0, 5: 2.5}


@pytest.mark.parametrize("kw,constraint", [
    (dict(tools=WEATHER, tool_choice="required"), {"type": "tool_call", "tools": WEATHER, "name": None}),
    (dict(tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     {"type": "tool_call", "tools": WEATHER, "name": "get_weather"}),
    (dict(response_format={"type": "json_object"}), {"type": "json_object"}),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"},
                                                                  "strict": True}}),
     {"type": "json_schema", "schema": {"type": "object"}}),
])
def test_forced_tool_choice_and_response_format_become_engine_constraints(monkeypatch, engine, kw, constraint):
    s = ScriptedEngine(engine, XML_CALL if "tools" in kw else "{}")
    monkeypatch.setattr(lt_adapter, "shared_engine", lambda *a, **k: s)
    litellm.completion(model="openjet/default", messages=MESSAGES, max_tokens=40, **kw)
    assert s.calls[-1]["constraint"] == constraint


def test_tool_calls_stream_as_openai_deltas(monkeypatch, engine):
    s = ScriptedEngine(engine, "Let me look.\n" + XML_CALL, piece=5)
    monkeypatch.setattr(lt_adapter, "shared_engine", lambda *a, **k: s)
    whole = litellm.completion(model="openjet/default", messages=MESSAGES, tools=WEATHER, max_tokens=60)
    chunks = list(litellm.completion(model="openjet/default", messages=MESSAGES, tools=WEATHER, max_tokens=60,
                                     stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    # the name (with the id) as soon as <function=...> is read, the arguments when the call closes
    assert deltas[0].id and deltas[0].function.name == "get_weather" and not deltas[0].function.arguments
    assert "".join(d.function.arguments or "" for d in deltas) == whole.choices[0].message.tool_calls[0].function.arguments
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris", "days": 2}
    assert {d.index for d in deltas} == {0}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
