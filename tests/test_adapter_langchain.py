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
from langchain_core.exceptions import OutputParserException
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


def test_with_structured_output_function_calling(scripted):
    class Person(BaseModel):
        """A person."""
        name: str = Field(description="name")
        age: int = Field(description="age")

    scripted('<tool_call>\n{"name": "Person", "arguments": {"name": "Ada", "age": 36}}\n</tool_call>')
    person = ChatOpenJet().with_structured_output(Person, method="function_calling").invoke("Who wrote the first program?")
    assert person == Person(name="Ada", age=36)
    raw = ChatOpenJet().with_structured_output(Person, include_raw=True, method="function_calling").invoke("?")
    assert raw["parsed"] == Person(name="Ada", age=36) and raw["parsing_error"] is None
    as_dict = ChatOpenJet().with_structured_output(Person.model_json_schema(), method="function_calling").invoke("?")
    assert as_dict == {"name": "Ada", "age": 36}


def test_structured_output_that_does_not_parse_is_reported(scripted):
    class Person(BaseModel):
        """A person."""
        name: str

    scripted("I would rather not.")
    raw = ChatOpenJet().with_structured_output(Person, include_raw=True, method="function_calling").invoke("?")
    assert raw["parsed"] is None and raw["raw"].content == "I would rather not."
    assert isinstance(raw["parsing_error"], OutputParserException)
    assert "did not call 'Person'" in str(raw["parsing_error"])
    with pytest.raises(OutputParserException, match="did not call 'Person'"):
        ChatOpenJet().with_structured_output(Person, method="function_calling").invoke("?")


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


# --- Qwen3.5's XML calls, structured output, constraints, logprobs, token counts ---------------------

XML_ADD = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_xml_tool_call_streams_as_tool_call_chunks(scripted, piece):
    scripted("Adding.\n\n" + XML_ADD + "\n" + XML_ADD.replace("a>\n1", "a>\n5"), piece=piece)
    chat = ChatOpenJet(temperature=0).bind_tools([_adder_tool()])
    msg = chat.invoke("What is 1 + 2?")
    # values typed by the tool's schema (a: int): 1, not "1"
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 2})]
    chunks = list(chat.stream("What is 1 + 2?"))
    with_calls = [c for c in chunks if c.tool_call_chunks]
    flat = [tc for c in with_calls for tc in c.tool_call_chunks]
    if piece < 1000:
        # per call: the name (with its id) as soon as <function=add> is read, then the arguments
        assert [(tc["index"], tc["name"], tc["args"]) for tc in flat] == [
            (0, "add", ""), (0, None, '{"a": 1, "b": 2}'), (1, "add", ""), (1, None, '{"a": 5, "b": 2}')]
        assert flat[0]["id"] and flat[1]["id"] is None
    else:                # the whole reply in one piece: one chunk per call
        assert [(tc["index"], tc["name"], tc["args"]) for tc in flat] == [
            (0, "add", '{"a": 1, "b": 2}'), (1, "add", '{"a": 5, "b": 2}')]
    if piece == 1:       # the first call went out before the reply ended
        assert with_calls[0] is not chunks[-1] and chunks.index(with_calls[1]) < len(chunks) - 1
    full = _collect(iter(chunks))
    assert full.content == "Adding." == msg.content
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in msg.tool_calls]
    assert full.invalid_tool_calls == []


def test_streamed_malformed_call_stays_invalid(scripted):
    scripted('<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>', piece=4)
    chat = ChatOpenJet().bind_tools([_adder_tool()])
    full = _collect(chat.stream("?"))
    assert full.tool_calls == [] and len(full.invalid_tool_calls) == 1
    assert full.invalid_tool_calls[0]["name"] == "add"
    msg = chat.invoke("?")
    assert msg.invalid_tool_calls[0]["args"] == full.invalid_tool_calls[0]["args"]


class Person(BaseModel):
    """A person."""
    name: str = Field(description="name")
    age: int = Field(description="age")


def test_structured_output_default_method_is_json_schema(scripted):
    """As langchain-openai's: the reply constrained to the schema, no tool call to wrap it."""
    s = scripted('{"name": "Ada", "age": 36}')
    assert ChatOpenJet().with_structured_output(Person).invoke("?") == Person(name="Ada", age=36)
    c = s.calls[-1]["constraint"]
    assert c["type"] == "json_schema" and set(c["schema"]["properties"]) == {"name", "age"}


def test_structured_output_methods_pass_their_constraint(scripted):
    s = scripted("<tool_call>\n<function=Person>\n<parameter=name>\nAda\n</parameter>\n"
                 "<parameter=age>\n36\n</parameter>\n</function>\n</tool_call>")
    assert ChatOpenJet().with_structured_output(Person, method="function_calling").invoke("?") == Person(name="Ada", age=36)
    c = s.calls[-1]["constraint"]
    assert c["type"] == "tool_call" and c["name"] == "Person"
    assert [t["function"]["name"] for t in c["tools"]] == ["Person"]
    # strict=True reaches the tool definition, and closes a JSON schema's objects
    ChatOpenJet().with_structured_output(Person, strict=True, method="function_calling").invoke("?")
    assert s.calls[-1]["constraint"]["tools"][0]["function"]["strict"] is True

    s.reply = '{"name": "Ada", "age": 36}'
    for method in ("json_schema", "json_mode"):
        assert ChatOpenJet().with_structured_output(Person, method=method).invoke("?") == Person(name="Ada", age=36)
        c = s.calls[-1]["constraint"]
        assert c["type"] == "json_schema" and c["schema"]["properties"]["age"]["type"] == "integer"
    ChatOpenJet().with_structured_output(Person, method="json_schema", strict=True).invoke("?")
    assert s.calls[-1]["constraint"]["schema"]["additionalProperties"] is False
    assert ChatOpenJet().with_structured_output(method="json_mode").invoke("?") == {"name": "Ada", "age": 36}
    assert s.calls[-1]["constraint"] == {"type": "json_object"}
    as_dict = ChatOpenJet().with_structured_output(Person.model_json_schema(), method="json_schema").invoke("?")
    assert as_dict == {"name": "Ada", "age": 36}


def test_structured_output_failures_are_never_a_silent_none(scripted):
    s = scripted('{"name": "Ada", "age": ')                          # cut short by max_tokens
    for method in ("json_schema", "json_mode"):
        with pytest.raises(OutputParserException, match="not valid JSON"):
            ChatOpenJet().with_structured_output(Person, method=method).invoke("?")
        raw = ChatOpenJet().with_structured_output(Person, method=method, include_raw=True).invoke("?")
        assert raw["parsed"] is None and isinstance(raw["parsing_error"], OutputParserException)
    s.reply = '{"name": "Ada", "age": "old"}'                         # JSON, but not a Person
    with pytest.raises(OutputParserException, match="does not match Person"):
        ChatOpenJet().with_structured_output(Person, method="json_schema").invoke("?")
    s.reply = "<tool_call>\n<function=Person>\n<parameter=name>\nAda\n</parameter>\n"
    with pytest.raises(OutputParserException, match="malformed tool call"):
        ChatOpenJet().with_structured_output(Person, method="function_calling").invoke("?")
    with pytest.raises(ValueError, match="unknown method 'json'"):
        ChatOpenJet().with_structured_output(Person, method="json")
    with pytest.raises(ValueError, match="needs a schema"):
        ChatOpenJet().with_structured_output(None, method="json_schema")


def test_response_format_and_tool_choice_become_constraints(scripted):
    s = scripted("{}")
    ChatOpenJet().bind(response_format={"type": "json_object"}).invoke("?")
    assert s.calls[-1]["constraint"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    ChatOpenJet().invoke("?", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert s.calls[-1]["constraint"] == {"type": "json_schema", "schema": schema}
    ChatOpenJet().invoke("?", response_format=Person)
    assert s.calls[-1]["constraint"]["schema"]["title"] == "Person"
    ChatOpenJet().invoke("?", response_format={"type": "text"})
    assert "constraint" not in s.calls[-1]
    ChatOpenJet().bind_tools([_adder_tool()], tool_choice="any").invoke("?")
    assert s.calls[-1]["constraint"]["type"] == "tool_call" and s.calls[-1]["constraint"]["name"] is None
    ChatOpenJet().bind_tools([_adder_tool()], tool_choice="add").invoke("?")
    assert s.calls[-1]["constraint"]["name"] == "add"
    ChatOpenJet().bind_tools([_adder_tool()]).invoke("?")
    assert "constraint" not in s.calls[-1]
    with pytest.raises(ValueError, match="response_format type 'xml'"):
        ChatOpenJet().invoke("?", response_format={"type": "xml"})
    with pytest.raises(ValueError, match="json_schema.schema"):
        ChatOpenJet().invoke("?", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="cannot both apply"):
        ChatOpenJet().bind_tools([_adder_tool()], tool_choice="add").invoke("?", response_format={"type": "json_object"})


def test_json_schema_constraint_on_the_real_engine(engine):
    """The default model's random weights write a valid Person because the engine constrains them."""
    chat = ChatOpenJet(temperature=0, max_tokens=64)
    structured = chat.with_structured_output(Person, method="json_schema", strict=True, include_raw=True)
    raw = structured.invoke("Who wrote the first program?")
    assert raw["parsing_error"] is None, raw["raw"].content
    assert isinstance(raw["parsed"], Person)
    assert json.loads(raw["raw"].content) == raw["parsed"].model_dump()


def test_logprobs_in_the_langchain_openai_shape(engine):
    chat = ChatOpenJet(temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    msg = chat.invoke("Hello")
    content = msg.response_metadata["logprobs"]["content"]
    direct = engine.chat([{"role": "user", "content": "Hello"}], temperature=0, max_tokens=8,
                         logprobs=True, top_logprobs=3)
    assert len(content) == len(direct.tokens) == msg.usage_metadata["output_tokens"]
    assert "".join(e["token"] for e in content) == msg.content
    for entry, ref in zip(content, direct.logprobs):
        assert entry["logprob"] == pytest.approx(ref.logprob) and entry["bytes"] == list(ref.bytes)
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6     # greedy: the top one
    full = _collect(chat.stream("Hello"))
    streamed = full.response_metadata["logprobs"]["content"]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content])
    assert "logprobs" not in ChatOpenJet(temperature=0, max_tokens=4).invoke("Hello").response_metadata


def test_token_counts_from_the_models_tokenizer_and_template(engine):
    from langchain_core.messages import trim_messages

    chat = ChatOpenJet()
    text = "Hello <|im_end|> world"
    assert chat.get_token_ids(text) == engine.tokenize(text, add_special=False)
    assert chat.get_num_tokens(text) == len(engine.tokenize(text, add_special=False))
    history = [SystemMessage("Be brief."), HumanMessage("What is 1 + 2?"),
               AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}]),
               ToolMessage("3", tool_call_id="c1"), AIMessage("3."), HumanMessage("And 2 + 2?")]
    rendered = engine.render_chat(lc_adapter._template_messages(history), add_generation_prompt=False)
    # the template renders turns one after another, so the per-message sum is the whole prompt
    assert chat.get_num_tokens_from_messages(history) == len(engine.tokenize(rendered, add_special=False))
    with_tools = chat.get_num_tokens_from_messages(history, tools=[_adder_tool()])
    assert with_tools > chat.get_num_tokens_from_messages(history)
    # trim_messages counts slices (reversed ones too), which the template could not render whole
    trimmed = trim_messages(history, max_tokens=30, token_counter=chat, strategy="last",
                            include_system=True, start_on="human")
    assert trimmed[0] == history[0] and trimmed[-1] == history[-1] and len(trimmed) < len(history)
    assert chat.get_num_tokens_from_messages(trimmed) <= 30


@pytest.mark.parametrize("piece", [1, 6, 1000])
def test_reasoning_then_xml_call_as_qwen35_writes_it(scripted, piece):
    """Qwen3.5's template opens <think> in the prompt; the reply is "R</think>\\n\\n" then the call."""
    s = scripted("I should add.\n</think>\n\n" + XML_ADD, piece=piece)
    real_render = s.render_chat
    s.render_chat = lambda *a, **k: real_render(*a, **k) + ("<think>\n" if k.get("enable_thinking") else "")
    chat = ChatOpenJet(enable_thinking=True).bind_tools([_adder_tool()])
    msg = chat.invoke("1 + 2?")
    assert msg.additional_kwargs["reasoning_content"] == "I should add."
    assert msg.content == "" and [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 1, "b": 2})]
    chunks = list(chat.stream("1 + 2?"))
    assert "".join(c.additional_kwargs.get("reasoning_content", "") for c in chunks) == "I should add."
    full = _collect(iter(chunks))
    assert full.content == "" and [(c["name"], c["args"]) for c in full.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert full.tool_calls[0]["id"] and full.invalid_tool_calls == []
