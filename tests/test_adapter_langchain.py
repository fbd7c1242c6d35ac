"""ChatOpenJet / OpenJetLLM: the LangChain adapter translates, and adds nothing of its own.

Two kinds of tests: against the real engine on the embedded default model (the adapter's answer
equals the engine's own, usage numbers equal the engine's counts, streams equal invokes), and with
a scripted engine (adapter_scripted.py) for what a random-weight model never writes: tool calls,
malformed tool calls, think blocks.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel, Field

from adapter_scripted import ScriptedEngine
from openjet_plugin.adapters import langchain as lc_adapter
from openjet_plugin.adapters._shared import shared_engine
from openjet_plugin.adapters.langchain import ChatOpenJet, OpenJetLLM


@pytest.fixture(scope="module")
def engine():
    return shared_engine(None)


def _collect(stream):
    full = None
    for chunk in stream:
        full = chunk if full is None else full + chunk
    return full


# --- real engine ---------------------------------------------------------------------------------

def test_chat_reply_is_the_engines_reply(engine):
    chat = ChatOpenJet(temperature=0, max_tokens=12)
    msg = chat.invoke([SystemMessage("Be brief."), HumanMessage("Hello")])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    direct = engine.chat(messages, temperature=0, max_tokens=12)
    assert msg.content == direct.text
    prompt = engine.render_chat(messages)
    assert msg.usage_metadata["input_tokens"] == len(engine.tokenize(prompt, add_special=True))
    assert msg.usage_metadata["output_tokens"] == len(direct.tokens)
    assert msg.usage_metadata["total_tokens"] == msg.usage_metadata["input_tokens"] + len(direct.tokens)
    assert msg.response_metadata["backend"] == engine.backend_name
    assert msg.response_metadata["finish_reason"] == direct.finish_reason
    assert msg.response_metadata["model_name"] == "openjet-default"


def test_greedy_is_deterministic_and_stream_equals_invoke(engine):
    chat = ChatOpenJet(temperature=0, max_tokens=16)
    a, b = chat.invoke("Write a poem"), chat.invoke("Write a poem")
    assert a.content == b.content and a.content
    # cache_read is the engine's own count of prompt tokens it did not evaluate again
    assert b.usage_metadata["input_token_details"]["cache_read"] == engine.last_stats.cached_prompt_tokens

    tokens: list[str] = []

    class Recorder(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kwargs):
            tokens.append(token)

    full = _collect(chat.stream("Write a poem", config={"callbacks": [Recorder()]}))
    assert full.content == a.content
    assert "".join(tokens) == a.content and len(tokens) > 1
    assert full.usage_metadata["output_tokens"] == a.usage_metadata["output_tokens"]
    assert full.usage_metadata["input_tokens"] == a.usage_metadata["input_tokens"]
    assert full.chunk_position == "last"


def test_async_paths_equal_sync(engine):
    chat = ChatOpenJet(temperature=0, max_tokens=10)
    sync = chat.invoke("Tell me a story")

    async def run():
        msg = await chat.ainvoke("Tell me a story")
        full = None
        async for chunk in chat.astream("Tell me a story"):
            full = chunk if full is None else full + chunk
        return msg, full

    msg, full = asyncio.run(run())
    assert msg.content == sync.content == full.content


def test_stop_sequence_cuts_the_reply(engine):
    chat = ChatOpenJet(temperature=0, max_tokens=24)
    text = chat.invoke("Hello").content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "the greedy reply should have text to stop on"
    cut = chat.invoke("Hello", stop=[stop])
    assert cut.content == text[:text.index(stop)]
    assert cut.response_metadata["finish_reason"] == "stop"
    assert ChatOpenJet(temperature=0, max_tokens=24, stop=[stop]).invoke("Hello").content == cut.content


def test_sampling_options_reach_the_engine(monkeypatch, engine):
    scripted = ScriptedEngine(engine, "ok")
    monkeypatch.setattr(lc_adapter, "shared_engine", lambda *a, **k: scripted)
    chat = ChatOpenJet(temperature=0.3, top_k=7, max_tokens=5, seed=11)
    chat.invoke("hi", top_p=0.5, stop=["x"])
    assert scripted.calls[-1] == {"max_tokens": 5, "temperature": 0.3, "top_p": 0.5, "top_k": 7,
                                  "min_p": 0.05, "seed": 11, "stop": ["x"], "presence_penalty": 0.0,
                                  "frequency_penalty": 0.0, "repeat_penalty": 1.0}


def test_bad_input_is_a_clear_error(engine):
    chat = ChatOpenJet(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="top_q"):
        chat.invoke("hi", top_q=0.5)
    with pytest.raises(ValueError, match="image"):
        chat.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])])
    with pytest.raises(ValueError, match="nope"):
        chat.bind_tools([_adder_tool()], tool_choice="nope")
    with pytest.raises(FileNotFoundError, match="/no/such.gguf"):
        ChatOpenJet(model="/no/such.gguf").invoke("hi")


def test_text_llm_is_the_engines_generate(engine):
    llm = OpenJetLLM(temperature=0, max_tokens=12)
    text = llm.invoke("def fibonacci(n):")
    direct = engine.generate("def fibonacci(n):", temperature=0, max_tokens=12)
    assert text == direct.text
    assert "".join(llm.stream("def fibonacci(n):")) == text
    result = llm.generate(["def fibonacci(n):"])
    info = result.generations[0][0].generation_info
    assert info["finish_reason"] == direct.finish_reason
    assert info["usage"] == {"prompt_tokens": direct.stats.prompt_tokens,
                             "completion_tokens": len(direct.tokens),
                             "total_tokens": direct.stats.prompt_tokens + len(direct.tokens)}
    assert result.llm_output["token_usage"] == info["usage"]
    assert asyncio.run(llm.ainvoke("def fibonacci(n):")) == text


# --- scripted replies: tools, malformed tools, thinking --------------------------------------------

def _adder_tool():
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return add


@pytest.fixture
def scripted(monkeypatch, engine):
    def make(reply: str, piece: int = 3) -> ScriptedEngine:
        s = ScriptedEngine(engine, reply, piece=piece)
        monkeypatch.setattr(lc_adapter, "shared_engine", lambda *a, **k: s)
        return s
    return make


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_tool_call_becomes_tool_calls(scripted, piece):
    s = scripted("Let me add." + CALL, piece=piece)
    chat = ChatOpenJet(temperature=0).bind_tools([_adder_tool()])
    msg = chat.invoke("What is 1 + 2?")
    assert msg.content == "Let me add."
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert msg.tool_calls[0]["id"] and msg.invalid_tool_calls == []
    # the tools went into the template's tools section
    tools_section = s.prompts[-1].split("<tools>")[-1].split("</tools>")[0]
    assert json.loads(tools_section.strip())["function"]["name"] == "add"

    full = _collect(chat.stream("What is 1 + 2?"))
    assert full.content == "Let me add."
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("add", {"a": 1, "b": 2})]


def test_malformed_tool_call_is_invalid_not_an_exception(scripted):
    scripted('<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>')
    msg = ChatOpenJet().bind_tools([_adder_tool()]).invoke("What is 1 + 2?")
    assert msg.tool_calls == []
    assert len(msg.invalid_tool_calls) == 1
    bad = msg.invalid_tool_calls[0]
    assert bad["error"] and '"a": 1,' in bad["args"]


def test_tool_markup_without_tools_is_plain_text(scripted):
    scripted(CALL)
    msg = ChatOpenJet().invoke("hi")
    assert msg.content == CALL and msg.tool_calls == []


def test_tool_choice(scripted):
    s = scripted("ok")

    def mul(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    ChatOpenJet().bind_tools([_adder_tool(), mul], tool_choice="none").invoke("hi")
    assert "<tools>" not in s.prompts[-1]
    ChatOpenJet().bind_tools([_adder_tool(), mul], tool_choice="mul").invoke("hi")
    assert '"name": "mul"' in s.prompts[-1] and '"name": "add"' not in s.prompts[-1]
    ChatOpenJet().bind_tools([_adder_tool(), mul], tool_choice="any").invoke("hi")
    assert '"name": "mul"' in s.prompts[-1] and '"name": "add"' in s.prompts[-1]


def test_tool_history_goes_back_into_the_template(scripted):
    s = scripted("3")
    history = [
        HumanMessage("What is 1 + 2?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}]),
        ToolMessage(json.dumps({"result": 3}), tool_call_id="c1"),
    ]
    ChatOpenJet().bind_tools([_adder_tool()]).invoke(history)
    prompt = s.prompts[-1]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"result": 3}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_with_structured_output_default_path(scripted):
    class Person(BaseModel):
        """A person."""
        name: str = Field(description="name")
        age: int = Field(description="age")

    scripted('<tool_call>\n{"name": "Person", "arguments": {"name": "Ada", "age": 36}}\n</tool_call>')
    person = ChatOpenJet().with_structured_output(Person).invoke("Who wrote the first program?")
    assert person == Person(name="Ada", age=36)
    raw = ChatOpenJet().with_structured_output(Person, include_raw=True).invoke("?")
    assert raw["parsed"] == Person(name="Ada", age=36) and raw["parsing_error"] is None
    as_dict = ChatOpenJet().with_structured_output(Person.model_json_schema()).invoke("?")
    assert as_dict == {"name": "Ada", "age": 36}


def test_structured_output_that_does_not_parse_is_reported(scripted):
    class Person(BaseModel):
        """A person."""
        name: str

    scripted("I would rather not.")
    raw = ChatOpenJet().with_structured_output(Person, include_raw=True).invoke("?")
    assert raw["parsed"] is None and raw["raw"].content == "I would rather not."


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_thinking_is_returned_apart(scripted, piece):
    s = scripted("<think>\nadd the numbers\n</think>\n\nThe answer is 3.", piece=piece)
    chat = ChatOpenJet(enable_thinking=True)
    msg = chat.invoke("What is 1 + 2?")
    assert msg.content == "The answer is 3."
    assert msg.additional_kwargs["reasoning_content"] == "add the numbers"
    assert not s.prompts[-1].endswith("</think>\n\n")       # thinking mode: no empty think block

    chunks = list(chat.stream("What is 1 + 2?"))
    reasoning = "".join(c.additional_kwargs.get("reasoning_content", "") for c in chunks)
    content = "".join(c.content for c in chunks)
    assert reasoning == "add the numbers" and content == "The answer is 3."
    if piece == 1:   # streamed: reasoning arrives in pieces before any content
        first_content = next(i for i, c in enumerate(chunks) if c.content)
        assert sum(1 for c in chunks[:first_content] if c.additional_kwargs.get("reasoning_content")) > 1


def test_thinking_off_leaves_think_text_in_content(scripted):
    scripted("<think>x</think>y")
    assert ChatOpenJet().invoke("hi").content == "<think>x</think>y"


def test_agent_example_runs_tools_end_to_end(scripted):
    """examples/langchain_agent.py's loop with a model that does call a tool."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "langchain_agent.py"
    spec = importlib.util.spec_from_file_location("langchain_agent_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    s = scripted(['<tool_call>\n{"name": "calculator", "arguments": {"expression": "(3 + 4) * 12"}}\n</tool_call>',
                  '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>',
                  "The answer is 84."])
    answer = example.run_agent(ChatOpenJet(temperature=0), "What is (3 + 4) * 12?", max_steps=4)
    assert answer == "The answer is 84."
    assert len(s.prompts) == 3
    assert "<tool_response>\n84\n</tool_response>" in s.prompts[1]
    assert "malformed tool call" in s.prompts[2]


def test_template_that_opens_the_think_block(scripted):
    """Templates that end the prompt with "<think>\\n" (Qwen3.5's own) make the reply start inside
    the block: "R</think>C"."""
    s = scripted("plan it\n</think>\n\nanswer", piece=2)
    real_render = s.render_chat
    s.render_chat = lambda *a, **k: real_render(*a, **k) + ("<think>\n" if k.get("enable_thinking") else "")
    chat = ChatOpenJet(enable_thinking=True)
    msg = chat.invoke("?")
    assert (msg.additional_kwargs["reasoning_content"], msg.content) == ("plan it", "answer")
    chunks = list(chat.stream("?"))
    assert "".join(c.additional_kwargs.get("reasoning_content", "") for c in chunks) == "plan it"
    assert "".join(c.content for c in chunks) == "answer"
    assert chunks[0].additional_kwargs.get("reasoning_content")      # streamed from the first piece


@pytest.mark.parametrize("thinking,tools", [(True, True), (True, False), (False, True)])
def test_stream_splitter_agrees_with_the_whole_reply(thinking, tools):
    """Whatever the piece boundaries, the streamed deltas add up to the parsed whole reply."""
    import random

    from openjet_plugin.adapters._shared import Reply, ReplyStreamer

    texts = ["<think>\na</think>\n\nb", "<think>x", "plain text", "a</think>b", "\n<think>r</think>c" + CALL,
             "pre" + CALL + "post", "<think>t</think>" + CALL, "<thi", "</th", "<tool_c", "x<tool_call>{bad",
             "<think></think>", "", "<<think>>", "<think>a<think>b</think>c"]
    rng = random.Random(0)
    for text in texts:
        for _ in range(20):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            st = ReplyStreamer(thinking=thinking, tools=tools)
            r_out = c_out = ""
            for p in pieces[:-1]:
                dr, dc = st.feed(p)
                r_out, c_out = r_out + dr, c_out + dc
            dr, dc, reply = st.finish(pieces[-1])
            r_out, c_out = r_out + dr, c_out + dc
            whole = Reply(text, thinking=thinking, tools=tools)
            assert (reply.reasoning, reply.content) == (whole.reasoning, whole.content)
            assert r_out == (whole.reasoning or ""), (text, pieces)
            assert c_out == whole.content, (text, pieces)
