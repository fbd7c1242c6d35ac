"""Split a Qwen-style reply into its parts: reasoning (<think>), content, tool calls (<tool_call>).

The engine returns the raw text the model wrote; the adapters turn it into their frameworks'
messages with these two functions, so every adapter reads a reply the same way.
"""

from __future__ import annotations

import json
import re
import uuid

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

_TOOL_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|\Z)", re.S)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content). reasoning is None when the reply has no think block.

    Handles the three shapes a Qwen reply takes: "<think>R</think>C"; "R</think>C" (the template
    already opened <think> in the prompt); "<think>R" cut short before </think> (content "").
    """
    if THINK_CLOSE in text:
        reasoning, content = text.split(THINK_CLOSE, 1)
        head, sep, tail = reasoning.partition(THINK_OPEN)
        if sep and not head.strip():
            reasoning = tail
        return reasoning.strip("\n"), content.lstrip("\n")
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN):].strip("\n"), ""
    return None, text


def parse_tool_calls(text: str) -> tuple[str, list[dict], list[dict]]:
    """(content, tool_calls, invalid_tool_calls) from a reply's <tool_call> blocks.

    A valid call is {"id", "name", "arguments": dict}; an invalid one (not JSON, no name,
    arguments not an object, block never closed) is {"id", "name" or None, "arguments": raw text,
    "error": why}. content is the text with every block removed.
    """
    calls: list[dict] = []
    invalid: list[dict] = []
    if TOOL_OPEN not in text:
        return text, calls, invalid
    for m in _TOOL_BLOCK.finditer(text):
        raw = m.group(1).strip()
        call_id = "call_" + uuid.uuid4().hex[:24]
        closed = m.group(0).endswith(TOOL_CLOSE)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            why = "the tool call block was never closed" if not closed else f"not valid JSON: {exc.msg}"
            invalid.append({"id": call_id, "name": None, "arguments": raw, "error": why})
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(name, str) or not name:
            invalid.append({"id": call_id, "name": None, "arguments": raw,
                            "error": "the tool call has no \"name\""})
        elif not isinstance(args, dict):
            invalid.append({"id": call_id, "name": name, "arguments": raw,
                            "error": "\"arguments\" is not a JSON object"})
        elif not closed:
            invalid.append({"id": call_id, "name": name, "arguments": raw,
                            "error": "the tool call block was never closed"})
        else:
            calls.append({"id": call_id, "name": name, "arguments": args})
    content = _TOOL_BLOCK.sub("", text).strip()
    return content, calls, invalid
