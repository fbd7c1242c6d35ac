"""Splitting a Qwen-style reply into reasoning, content and tool calls (used by every adapter)."""

from __future__ import annotations

from openjet_plugin.parsing import parse_tool_calls, split_reasoning


def test_split_reasoning_shapes():
    assert split_reasoning("<think>\nlet me see\n</think>\n\nThe answer is 4.") == ("let me see", "The answer is 4.")
    # the template opened <think> in the prompt: the reply starts inside it
    assert split_reasoning("counting...\n</think>\n\n4") == ("counting...", "4")
    # cut short by max_tokens inside the think block
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")
    assert split_reasoning("no reasoning here") == (None, "no reasoning here")
    # the empty block of non-thinking mode
    assert split_reasoning("<think>\n\n</think>\n\nhi") == ("", "hi")


def test_parse_tool_calls_valid_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>')
    content, calls, invalid = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                            ("get_time", {"tz": "CET"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert invalid == []


def test_parse_tool_calls_invalid_ones_are_reported_not_dropped():
    text = ('<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>'
            '<tool_call>\n{"arguments": {}}\n</tool_call>'
            '<tool_call>\n{"name": "g", "arguments": [1]}\n</tool_call>'
            '<tool_call>\n{"name": "h", "arguments": {"x": 1')
    content, calls, invalid = parse_tool_calls(text)
    assert calls == [] and content == ""
    errors = [i["error"] for i in invalid]
    assert "not valid JSON" in errors[0]
    assert "no \"name\"" in errors[1]
    assert "not a JSON object" in errors[2] and invalid[2]["name"] == "g"
    assert "never closed" in errors[3]
    assert invalid[0]["arguments"] == '{"name": "f", "arguments": {oops}}'


def test_no_tool_calls_leaves_text_alone():
    assert parse_tool_calls("  plain text  ") == ("  plain text  ", [], [])


# --- Qwen3.5's XML form -----------------------------------------------------------------------------

import json
import random

import pytest

from openjet_plugin import chat_template
from openjet_plugin.parsing import (
    ToolCallStreamer,
    format_tool_call,
    parameter_value,
    tool_call_format,
)
from openjet_plugin.testing.scripted import QWEN35_TEMPLATE_FILE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["C", "F"]},
        "detail": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_xml_call_typed_by_the_schema():
    content, calls, invalid = parse_tool_calls("Checking.\n\n" + XML_CALL, [WEATHER])
    assert content == "Checking." and invalid == []
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", {"city": "New York", "days": 3})]


def test_parameter_values():
    string = {"type": "string"}
    # a string parameter is verbatim, even when it reads as JSON
    assert parameter_value("42", string) == "42"
    assert parameter_value('{"a": 1}', string) == '{"a": 1}'
    assert parameter_value("two\nlines", string) == "two\nlines"
    assert parameter_value("42", {"type": "integer"}) == 42
    assert parameter_value("1.5", {"type": "number"}) == 1.5
    assert parameter_value("true", {"type": "boolean"}) is True
    assert parameter_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert parameter_value('{"x": [1]}', {"type": "object"}) == {"x": [1]}
    # union with string: JSON of another allowed type decodes, anything else stays the text
    assert parameter_value("null", {"anyOf": [{"type": "string"}, {"type": "null"}]}) is None
    assert parameter_value("hello", {"anyOf": [{"type": "string"}, {"type": "null"}]}) == "hello"
    assert parameter_value("7", {"type": ["string", "integer"]}) == 7
    # an enum of strings is a string
    assert parameter_value("C", {"enum": ["C", "F"]}) == "C"
    # no schema: JSON when it decodes, else the text
    assert parameter_value("3") == 3 and parameter_value("Paris") == "Paris"
    # a model that wrote a non-number for an integer: the text, for the tool's validation to name
    assert parameter_value("three", {"type": "integer"}) == "three"
    # a boolean is not an integer
    assert parameter_value("true", {"type": "integer"}) == "true"


def test_xml_value_newlines_and_all_types():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n\nTwo\nlines\n\n</parameter>\n"
            "<parameter=units>\nF\n</parameter>\n<parameter=detail>\nfalse\n</parameter>\n"
            "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
            "</function>\n</tool_call>")
    _, calls, invalid = parse_tool_calls(text, [WEATHER])
    assert invalid == []
    # one newline each side is the template's markup; the rest belongs to the value
    assert calls[0]["arguments"] == {"city": "\nTwo\nlines\n", "units": "F", "detail": False,
                                     "hours": [1, 2], "note": None}


def test_several_calls_both_forms_and_reasoning():
    reply = ("<think>\nI need two things.\n</think>\n\nLet me look.\n\n" + XML_CALL + "\n"
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n'
             "<tool_call>\n<function=no_args>\n</function>\n</tool_call>")
    reasoning, rest = split_reasoning(reply)
    assert reasoning == "I need two things."
    content, calls, invalid = parse_tool_calls(rest, [WEATHER])
    assert content == "Let me look." and invalid == []
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3}), ("get_time", {"tz": "CET"}), ("no_args", {})]
    assert len({c["id"] for c in calls}) == 3


@pytest.mark.parametrize("body,error", [
    ("<function=f>\n<parameter=a>\n1\n</function>", "unclosed <parameter=>"),
    ("<function=>\n</function>", "has no name"),
    ("<function=f>\nstray text\n</function>", "text outside its parameters"),
    ("<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>", "twice"),
    ("just words", "neither"),
])
def test_malformed_xml_calls_are_invalid_with_a_reason(body, error):
    content, calls, invalid = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>")
    assert calls == [] and content == ""
    assert len(invalid) == 1 and error in invalid[0]["error"]
    assert invalid[0]["arguments"] == body.strip()


def test_missing_function_close_is_read():
    _, calls, invalid = parse_tool_calls("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>")
    assert invalid == [] and [(c["name"], c["arguments"]) for c in calls] == [("f", {"a": 1})]


def test_unclosed_xml_call_keeps_its_name():
    _, calls, invalid = parse_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert calls == [] and invalid[0]["name"] == "get_weather" and "never closed" in invalid[0]["error"]


def test_template_format_detection_and_writing():
    qwen35 = QWEN35_TEMPLATE_FILE.read_text(encoding="utf-8")
    from openjet_plugin.testing.synth import CHAT_TEMPLATE_FILE

    assert tool_call_format(qwen35) == "qwen_xml"
    assert tool_call_format(CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")) == "json"
    assert tool_call_format(None) == "json"
    assert format_tool_call("get_weather", {"city": "New York", "days": 3}, "qwen_xml") == XML_CALL
    js = format_tool_call("f", {"a": [1]}, "json")
    assert parse_tool_calls(js)[1][0]["arguments"] == {"a": [1]}


def test_real_qwen35_template_renders_calls_the_parser_reads_back():
    """Render a conversation with tool calls and results through Qwen3.5's own template, then
    parse the assistant turn it wrote: the calls come back as they went in."""
    template = QWEN35_TEMPLATE_FILE.read_text(encoding="utf-8")
    calls_in = [{"name": "get_weather", "arguments": {"city": "New York", "days": 3, "hours": [9, 17],
                                                      "detail": True, "note": None}},
                {"name": "get_weather", "arguments": {"city": "Multi\nline", "units": "C"}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in New York?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two calls.",
         "tool_calls": [{"type": "function", "function": c} for c in calls_in]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    prompt = chat_template.render(template, messages, tools=[WEATHER], enable_thinking=True)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    assert "<tool_call>\n<function=example_function_name>" in prompt          # asks for the XML form
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    reasoning, rest = split_reasoning(turn)
    assert reasoning == "Two calls."
    content, calls, invalid = parse_tool_calls(rest, [WEATHER])
    assert content == "Let me check." and invalid == []
    assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in calls_in]
    # non-thinking mode closes an empty think block in the generation prompt
    no_think = chat_template.render(template, messages[:2], tools=[WEATHER], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# --- streaming ----------------------------------------------------------------------------------------

def _stream(text: str, cuts: list[int], tools=None):
    st = ToolCallStreamer(tools=tools)
    content, events = "", []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        d, ev = st.feed(text[a:b])
        content, events = content + d, events + ev
    d, ev = st.finish()
    return st, content + d, events + ev


def test_streamer_events_in_order():
    text = "Checking.\n" + XML_CALL + '\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    st = ToolCallStreamer(tools=[WEATHER])
    out = []
    for ch in text:                          # one character at a time: markers split everywhere
        d, ev = st.feed(ch)
        out.append((d, [(e.kind, e.index, e.name) for e in ev]))
    d, ev = st.finish()
    kinds = [k for _, evs in out for k in evs] + [(e.kind, e.index, e.name) for e in ev]
    assert kinds == [("name", 0, "get_weather"), ("arguments", 0, "get_weather"), ("arguments", 1, "g")]
    # the name event comes once "<function=get_weather>" is read, long before the call closes
    at_name = next(i for i, (_, evs) in enumerate(out) if evs and evs[0][0] == "name")
    assert text[:at_name + 1].endswith("<function=get_weather>")
    # the content went out before the call began, without the trailing newline
    assert "".join(d for d, _ in out) == "Checking."
    args = [e for e in st.calls]
    assert args[0]["arguments"] == {"city": "New York", "days": 3}


def test_streamed_arguments_are_the_json_of_the_parsed_call():
    _, _, events = _stream(XML_CALL, [5, 40], [WEATHER])
    done = [e for e in events if e.kind == "arguments"]
    assert json.loads(done[0].arguments) == {"city": "New York", "days": 3} == done[0].args


@pytest.mark.parametrize("seed", range(30))
def test_streamer_agrees_with_the_whole_parse_at_any_cuts(seed):
    rng = random.Random(seed)
    texts = ["  pre " + XML_CALL + " mid " + XML_CALL + " post ", "<tool_call>\n<function=f>\n<para",
             "a <tool_c", "<tool_call>{bad}</tool_call>x", "x<tool_call>\n{\"name\": \"f\", \"arguments\": {}}",
             "plain", "", "<<tool_call>>"]
    for text in texts:
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        st, content, events = _stream(text, cuts, [WEATHER])
        whole_content, calls, invalid = parse_tool_calls(text, [WEATHER])
        if "<tool_call>" in text:
            assert content == whole_content, (text, cuts)
        assert [(c["name"], c["arguments"]) for c in st.calls] == [(c["name"], c["arguments"]) for c in calls]
        assert [(c["name"], c["error"]) for c in st.invalid] == [(c["name"], c["error"]) for c in invalid]
        # one final event per call, with the ids of the streamer's parsed calls
        finals = [e for e in events if e.kind != "name"]
        assert sorted(e.id for e in finals) == sorted(c["id"] for c in st.calls + st.invalid)
        assert len(finals) == len(calls) + len(invalid)


def test_openai_deltas_add_up_to_the_calls():
    from openjet_plugin.parsing import openai_tool_call_deltas

    text = XML_CALL + '<tool_call>{"name": "g", "arguments": {"x": 1}}</tool_call><tool_call>\n<function=h>\nbad'
    st = ToolCallStreamer(tools=[WEATHER])
    named: set[int] = set()
    deltas = []
    for i in range(0, len(text), 9):
        deltas += openai_tool_call_deltas(st.feed(text[i:i + 9])[1], named)
    deltas += openai_tool_call_deltas(st.finish()[1], named)
    # what the openai client's stream accumulator does: first delta per index opens the call
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["name"]
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert "id" not in d and "name" not in d["function"]
        calls[d["index"]]["arguments"] += d["function"].get("arguments", "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values() if c["arguments"]] == [
        ("get_weather", {"city": "New York", "days": 3}), ("g", {"x": 1})]
    assert calls[2] == {"id": st.invalid[0]["id"], "name": "h", "arguments": ""}   # malformed: named only
    assert [c["id"] for c in list(calls.values())[:2]] == [c["id"] for c in st.calls]
