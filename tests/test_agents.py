"""Agents on a real engine: a LangGraph ReAct agent completes a tool round trip on a generated model
with Qwen3.5's chat template whose weights write an XML tool call (openjet_plugin/testing/scripted.py).

Everything between the agent and the weights is the real thing: the template renders the tools
and the history, the engine tokenizes, prefills and decodes greedily, the parser reads Qwen's
`<function=...><parameter=...>` form, LangGraph runs the tool and feeds its result back.
"""

from __future__ import annotations

import warnings

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from openjet_plugin.adapters.langchain import ChatOpenJet

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
ANSWER = "It is sunny in Paris."


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    from openjet_plugin.testing.scripted import scripted_tool_model

    return scripted_tool_model(tmp_path_factory.mktemp("scripted") / "qwen35-tool.gguf", CALL, ANSWER)


@tool
def get_weather(city: str, days: int) -> str:
    """The weather forecast of a city for the next days."""
    return f"sunny in {city} for {days} days"


def test_the_scripted_model_writes_its_script(scripted_model):
    """The model itself (no agent): a call while no tool result is in the context, the answer after."""
    import openjet_plugin

    eng = openjet_plugin.load(scripted_model, backend="llama.cpp")
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
        first = eng.chat([{"role": "user", "content": "Weather?"}], tools=tools, temperature=0, max_tokens=40)
        assert first.text == CALL and first.finish_reason == "stop"
        # the prompt is the real Qwen3.5 template's: tools in <tools>, the XML form asked for
        prompt = eng.render_chat([{"role": "user", "content": "Weather?"}], tools=tools)
        assert "<tools>\n" in prompt and "<function=example_function_name>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    finally:
        eng.close()


@pytest.mark.parametrize("stream", [False, True])
def test_langgraph_react_agent_round_trip(scripted_model, stream):
    from langgraph.prebuilt import create_react_agent

    chat = ChatOpenJet(model=str(scripted_model), backend="llama.cpp", temperature=0, max_tokens=64,
                       streaming=stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the acceptance names create_react_agent (deprecated for
        agent = create_react_agent(chat, [get_weather])   # langchain.agents.create_agent in LangGraph 1.0)
    state = agent.invoke({"messages": [HumanMessage("What is the weather in Paris for two days?")]},
                         {"recursion_limit": 6})
    messages = state["messages"]
    kinds = [type(m).__name__ for m in messages]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    call_msg, result, final = messages[1], messages[2], messages[3]
    assert isinstance(call_msg, AIMessage) and call_msg.invalid_tool_calls == []
    # values typed by the tool's schema: "2" is the integer 2, "Paris" stays a string
    assert [(c["name"], c["args"]) for c in call_msg.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert isinstance(result, ToolMessage) and result.content == "sunny in Paris for 2 days"
    assert result.tool_call_id == call_msg.tool_calls[0]["id"]
    assert final.content == ANSWER and final.tool_calls == []
    assert final.response_metadata["finish_reason"] == "stop"


def test_the_examples_langgraph_agent_on_the_scripted_model(tmp_path, capsys):
    """examples/langchain_agent.py --langgraph: its calculator round trip on a model that calls it."""
    import importlib.util
    from pathlib import Path

    from openjet_plugin.testing.scripted import scripted_tool_model

    path = Path(__file__).resolve().parents[1] / "examples" / "langchain_agent.py"
    spec = importlib.util.spec_from_file_location("langchain_agent_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = scripted_tool_model(tmp_path / "calc.gguf", "<tool_call>\n<function=calculator>\n<parameter=expression>\n"
                                "(3 + 4) * 12\n</parameter>\n</function>\n</tool_call>", "It is 84.")
    chat = ChatOpenJet(model=str(model), backend="llama.cpp", temperature=0, max_tokens=64)
    assert example.run_langgraph(chat, "What is (3 + 4) * 12?", max_steps=3) == "It is 84."
    out = capsys.readouterr().out
    assert "calls calculator({'expression': '(3 + 4) * 12'})" in out and "ToolMessage: '84'" in out
