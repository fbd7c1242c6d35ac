"""An agent written against the openai client completes a tool round trip through `openjet serve`
on a generated model with Qwen3.5's chat template whose weights write an XML tool call
(openjet_plugin/testing/scripted.py), sync and streamed (issue 26's acceptance).

Everything between the client and the weights is the real thing: the server's front door, the
LiteLLM proxy, the provider, the template rendering the tools and the tool result, greedy decoding
on llama.cpp, Qwen's `<function=...><parameter=...>` form parsed into OpenAI `tool_calls`
(streamed as OpenAI tool-call deltas).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-openjet-agent-" + "0" * 16
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
ANSWER = "It is sunny in Paris."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city for the next days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}]

pytestmark = pytest.mark.slow


def get_weather(city: str, days: int) -> str:
    return f"sunny in {city} for {days} days"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from openjet_plugin.testing.scripted import scripted_tool_model

    work = tmp_path_factory.mktemp("agent")
    model = scripted_tool_model(work / "qwen35-tool.gguf", CALL, ANSWER)
    sys.path.insert(0, str(REPO / "scripts"))
    from load_test import start_server, stop_server

    proc, base = start_server(work / "serve.log", threads="1", startup_s=120, env={"OPENJET_API_KEY": API_KEY},
                              args=["--model", f"qwen-tool={model}", "--backend", "llama.cpp", "--n-ctx", "1024"])
    try:
        yield f"{base}/v1"
    finally:
        stop_server(proc)


def _ask(client, messages: list, stream: bool) -> dict:
    """One assistant turn as the OpenAI API returns it (streamed deltas merged the way SDK users do)."""
    kw = dict(model="qwen-tool", messages=messages, tools=TOOLS, temperature=0, max_tokens=64)
    if not stream:
        m = client.chat.completions.create(**kw).choices[0]
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                 for c in m.message.tool_calls or []]
        return {"content": m.message.content, "tool_calls": calls, "finish_reason": m.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] += d.id or ""
            if d.function is not None:
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_agent_round_trip(server, stream):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
    first = _ask(client, messages, stream)
    assert first["finish_reason"] == "tool_calls"
    assert not first["content"]
    assert len(first["tool_calls"]) == 1
    call = first["tool_calls"][0]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args == {"city": "Paris", "days": 2}                 # days typed by the tool's schema
    messages.append({"role": "assistant", "content": None, "tool_calls": first["tool_calls"]})
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": get_weather(**args)})
    second = _ask(client, messages, stream)
    assert second == {"content": ANSWER, "tool_calls": [], "finish_reason": "stop"}
