"""Split a Qwen-style reply into its parts: reasoning (<think>), content, tool calls (<tool_call>).

The engine returns the raw text the model wrote; the adapters turn it into their frameworks'
messages with these functions, so every adapter reads a reply the same way.

A tool call block holds one of the two forms Qwen templates ask for:
- the XML form of Qwen3.5 and later (and Qwen3-Coder):
      <tool_call>
      <function=NAME>
      <parameter=ARG>
      value
      </parameter>
      </function>
      </tool_call>
  a string value is written verbatim (it may span lines), any other value as JSON; the tool's JSON
  schema, where given, says which (a parameter typed "string" is never JSON-decoded);
- the JSON form of Qwen2.5 / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
Both are accepted whatever the template asked for (a model sometimes answers in the other form);
`tool_call_format` says which one a template asks for, for code that must write or force calls.

`ToolCallStreamer` reads the same markup incrementally and yields each call as soon as its text is
complete, so a stream and the whole reply always agree (`parse_tool_calls` is the streamer run
over the whole text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"

ToolCallFormat = Literal["qwen_xml", "json"]


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


def tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The form of tool call a chat template asks the model for: Qwen3.5's templates teach
    `<function=...>` blocks (and render past calls so), Qwen2.5/Qwen3's a JSON object."""
    if chat_template and FUNCTION_OPEN in chat_template and PARAMETER_OPEN in chat_template:
        return "qwen_xml"
    return "json"


def format_tool_call(name: str, arguments: dict[str, Any], fmt: ToolCallFormat) -> str:
    """One <tool_call> block as a model following `fmt` writes it (what the templates render for a
    past call): the text a forced call must look like."""
    if fmt == "json":
        return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CLOSE}"
    parts = [f"{TOOL_OPEN}\n{FUNCTION_OPEN}{name}>\n"]
    for key, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        parts.append(f"{PARAMETER_OPEN}{key}>\n{text}\n{PARAMETER_CLOSE}\n")
    parts.append(f"{FUNCTION_CLOSE}\n{TOOL_CLOSE}")
    return "".join(parts)


# --- one call ---------------------------------------------------------------------------------------

class MalformedToolCall(ValueError):
    """A <tool_call> block that is not a call in either form; `name` when it could still be read."""

    def __init__(self, why: str, name: str | None = None):
        super().__init__(why)
        self.name = name


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (empty: unknown, anything goes)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            sub_types = _schema_types(sub)
            if not sub_types:
                return set()
            out |= sub_types
    if "enum" in schema and not out:
        out = {type(v).__name__ for v in schema["enum"]}
        out = {{"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                "NoneType": "null", "dict": "object", "list": "array"}.get(x, x) for x in out}
    return out


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "null": type(None), "object": dict, "array": list}


def _fits(value: Any, types: set[str]) -> bool:
    for t in types:
        py = _JSON_TYPES.get(t)
        if py is None:
            continue
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, py):
            return True
    return False


def parameter_value(raw: str, schema: Any = None) -> Any:
    """A <parameter=...> value as the tool receives it.

    Strings are written verbatim and other values as JSON, so: a parameter the schema types as
    string only stays the text; otherwise the text is JSON-decoded when it decodes to a type the
    schema allows (any type when there is no schema), and stays the text when it does not (a
    string in a union type, or a model that wrote an unquoted string where a number was due: the
    tool's own validation then names the problem).
    """
    types = _schema_types(schema)
    if types == {"string"}:
        return raw
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return raw
    if not types or _fits(value, types - {"string"}):
        return value
    return raw


def _xml_call(body: str, schemas: dict[str, dict]) -> tuple[str, dict]:
    """(name, arguments) of a `<function=NAME>...</function>` block body (the text between
    <tool_call> and </tool_call>)."""
    text = body.strip()
    head = re.match(re.escape(FUNCTION_OPEN) + r"([^>\n]*)>", text)
    if head is None:
        raise MalformedToolCall("the tool call does not start with <function=NAME>")
    name = head.group(1).strip()
    if not name:
        raise MalformedToolCall("the tool call's <function=> has no name")
    # a missing </function> before </tool_call> is a slip, not doubt about the call: read it
    end = len(text) - len(FUNCTION_CLOSE) if text.endswith(FUNCTION_CLOSE) else len(text)
    inner = text[head.end():end]
    props = (schemas.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    pos = 0
    for m in re.finditer(re.escape(PARAMETER_OPEN) + r"([^>\n]*)>(.*?)" + re.escape(PARAMETER_CLOSE), inner, re.S):
        if inner[pos:m.start()].strip():
            raise MalformedToolCall(f"the tool call for {name!r} has text outside its parameters: "
                                    f"{inner[pos:m.start()].strip()[:40]!r}", name)
        key = m.group(1).strip()
        if not key:
            raise MalformedToolCall(f"the tool call for {name!r} has a <parameter=> without a name", name)
        if key in args:
            raise MalformedToolCall(f"the tool call for {name!r} sets parameter {key!r} twice", name)
        raw = m.group(2)
        # the template writes "<parameter=K>\n" + value + "\n</parameter>": one newline each side
        # is markup, anything further is the value's own
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        args[key] = parameter_value(raw, props.get(key))
        pos = m.end()
    rest = inner[pos:].strip()
    if rest:
        why = (f"the tool call for {name!r} has an unclosed <parameter=>" if PARAMETER_OPEN in rest
               else f"the tool call for {name!r} has text outside its parameters: {rest[:40]!r}")
        raise MalformedToolCall(why, name)
    return name, args


def _json_call(body: str) -> tuple[str, dict]:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        named = re.match(r'\{\s*"name"\s*:\s*"([^"\\]+)"', body)     # the name of a call cut short
        raise MalformedToolCall(f"not valid JSON: {msg}", named.group(1) if named else None) from None
    name = obj.get("name") if isinstance(obj, dict) else None
    args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        raise MalformedToolCall("the tool call has no \"name\"")
    if not isinstance(args, dict):
        raise MalformedToolCall("\"arguments\" is not a JSON object", name)
    return name, args


def parse_tool_call_body(body: str, tools: Iterable[dict] | None = None) -> tuple[str, dict]:
    """(name, arguments) of the text inside one <tool_call> block, in either form; raises
    MalformedToolCall saying what is wrong."""
    return _call_of(body, tool_schemas(tools))


def _call_of(body: str, schemas: dict[str, dict]) -> tuple[str, dict]:
    stripped = body.strip()
    if stripped.startswith(FUNCTION_OPEN):
        return _xml_call(stripped, schemas)
    if stripped.startswith("{"):
        return _json_call(stripped)
    raise MalformedToolCall("the tool call is neither <function=NAME>...</function> nor a JSON object")


def tool_schemas(tools: Iterable[dict] | None) -> dict[str, dict]:
    """name -> parameters schema, from OpenAI-style tool definitions (or bare function dicts)."""
    out: dict[str, dict] = {}
    for t in tools or ():
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --- streaming --------------------------------------------------------------------------------------

@dataclass
class ToolCallEvent:
    """One step of a streamed tool call.

    kind "name": the call at `index` has begun (`id`, `name` known, no arguments yet);
    kind "arguments": its arguments, whole, as a JSON text (`arguments`) and parsed (`args`);
    kind "invalid": the call is malformed (`error`; `arguments` is its raw text); `name` set when
    it could be read. Every call gets exactly one "arguments" or "invalid" event, after at most one
    "name" event.
    """

    kind: Literal["name", "arguments", "invalid"]
    index: int
    id: str
    name: str | None = None
    arguments: str = ""
    args: dict | None = None
    error: str | None = None


def openai_tool_call_deltas(events: Iterable[ToolCallEvent], named: set[int]) -> list[dict]:
    """ToolCallEvents -> OpenAI chat-completion stream deltas (`choices[0].delta.tool_calls`):
    a call's first delta carries its index, id, type and name (arguments ""), later ones its
    index and an arguments piece; events of one call in one batch share a delta. A malformed call
    has no OpenAI form: its name delta (if sent) is followed by nothing, and the caller reports it
    as it reports content. `named`: indices whose first delta went out (kept across a stream)."""
    out: dict[int, dict] = {}
    for e in events:
        if e.kind == "invalid":
            continue
        delta = out.setdefault(e.index, {"index": e.index, "function": {}})
        if e.index not in named:
            named.add(e.index)
            delta.update(id=e.id, type="function")
            delta["function"] = {"name": e.name, "arguments": ""}
        if e.kind == "arguments":
            delta["function"]["arguments"] = delta["function"].get("arguments", "") + e.arguments
    return list(out.values())


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallStreamer:
    """Reply text (after the reasoning) in, content deltas and tool-call events out.

    `feed(text)` returns (content delta, events); `finish()` the same for the end of the reply.
    Content is the text outside the <tool_call> blocks, stripped of surrounding whitespace as a
    whole (leading and trailing whitespace is held back until more text or the end decides); a
    tail that could begin "<tool_call>" waits for the next piece. Within a block the name event
    goes out as soon as `<function=NAME>` (XML form) is read, the arguments when the block closes.
    `calls` and `invalid` collect the parsed calls as `parse_tool_calls` returns them.
    """

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools
        self.content = ""                  # the text outside the blocks so far, as written
        self.calls: list[dict] = []
        self.invalid: list[dict] = []
        self._schemas = tool_schemas(tools)
        self._buf = ""                     # text not yet decided
        self._sent = ""                    # content handed out
        self._in_call = False
        self._index = 0                    # the current (or next) call's index
        self._named = False                # the current call's name event went out
        self._id = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallEvent]]:
        self._buf += text
        events: list[ToolCallEvent] = []
        while True:
            if not self._in_call:
                at = self._buf.find(TOOL_OPEN)
                if at < 0:
                    keep = _held_prefix(self._buf, TOOL_OPEN)
                    self.content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self.content += self._buf[:at]
                self._buf = self._buf[at + len(TOOL_OPEN):]
                self._in_call, self._named, self._id = True, False, new_call_id()
                continue
            end = self._buf.find(TOOL_CLOSE)
            if not self._named:
                head = re.match(r"\s*" + re.escape(FUNCTION_OPEN) + r"([^>\n]*)>", self._buf)
                if head is not None and head.group(1).strip():
                    self._named = True
                    events.append(ToolCallEvent("name", self._index, self._id, name=head.group(1).strip()))
            if end < 0:
                break
            body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CLOSE):]
            events.append(self._close(body, closed=True))
        return self._content_delta(final=False), events

    def finish(self) -> tuple[str, list[ToolCallEvent]]:
        events: list[ToolCallEvent] = []
        if self._in_call:
            events.append(self._close(self._buf, closed=False))
        else:
            self.content += self._buf
        self._buf = ""
        return self._content_delta(final=True), events

    def _close(self, body: str, *, closed: bool) -> ToolCallEvent:
        index, call_id = self._index, self._id
        self._in_call, self._index = False, self._index + 1
        try:
            name, args = _call_of(body, self._schemas)
            if not closed:
                raise MalformedToolCall("the tool call block was never closed", name)
        except MalformedToolCall as exc:
            name = exc.name
            why = str(exc)
            if not closed and "never closed" not in why:
                why = "the tool call block was never closed"
            self.invalid.append({"id": call_id, "name": name, "arguments": body.strip(), "error": why})
            return ToolCallEvent("invalid", index, call_id, name=name, arguments=body.strip(), error=why)
        self.calls.append({"id": call_id, "name": name, "arguments": args})
        return ToolCallEvent("arguments", index, call_id, name=name,
                             arguments=json.dumps(args, ensure_ascii=False), args=args)

    def _content_delta(self, *, final: bool) -> str:
        whole = self.content.strip() if final else self.content.lstrip()
        if not final:
            # trailing whitespace waits: a call or the end may follow, and both strip it
            whole = whole.rstrip()
        if not whole.startswith(self._sent):
            return ""
        delta, self._sent = whole[len(self._sent):], whole
        return delta


def parse_tool_calls(text: str, tools: Iterable[dict] | None = None) -> tuple[str, list[dict], list[dict]]:
    """(content, tool_calls, invalid_tool_calls) from a reply's <tool_call> blocks.

    A valid call is {"id", "name", "arguments": dict}; an invalid one (neither form, no name,
    arguments not an object, block never closed) is {"id", "name" or None, "arguments": raw text,
    "error": why}. content is the text outside the blocks, stripped. `tools` (OpenAI-style
    definitions) type the XML form's parameter values.
    """
    if TOOL_OPEN not in text:
        return text, [], []
    streamer = ToolCallStreamer(tools=list(tools) if tools else None)
    streamer.feed(text)
    streamer.finish()
    return streamer.content.strip(), streamer.calls, streamer.invalid
