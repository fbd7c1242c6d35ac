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
