"""What every adapter needs and no framework provides: one engine per model, model names,
OpenAI-style messages for the chat template, a reply splitter for streams, and async iteration of
the engine's (blocking) streams.

Nothing here samples or decides anything about the model: the engine does the work, and
`openjet_plugin.parsing` says how a reply splits into reasoning, content and tool calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

from openjet_plugin.parsing import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_OPEN,
    ToolCallEvent,
    ToolCallStreamer,
    parse_tool_calls,
    split_reasoning,
)

# Names that mean "the embedded default model" wherever a model name is accepted.
DEFAULT_ALIASES = ("default", "openjet-default")

# Sampling options every adapter forwards to Engine.generate / Engine.chat, under these names.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "presence_penalty", "frequency_penalty", "repeat_penalty")


# --- models and engines ---------------------------------------------------------------------------

def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The GGUF file a model name stands for: None or a default alias -> the embedded model,
    anything else -> that path (which must exist)."""
    if model is None or (isinstance(model, str) and model in DEFAULT_ALIASES):
        from openjet_plugin import default_model_path

        return Path(default_model_path()).resolve()
    path = Path(model).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"model {os.fspath(model)!r} is neither a model file nor one of the aliases "
            f"{', '.join(DEFAULT_ALIASES)}")
    return path.resolve()


def model_label(model: str | os.PathLike[str] | None) -> str:
    """A short name for responses and traces: the alias, or the file name without .gguf."""
    if model is None:
        return "openjet-default"
    if isinstance(model, str) and model in DEFAULT_ALIASES:
        return model if model != "default" else "openjet-default"
    return Path(model).name.removesuffix(".gguf")


_engines: dict[tuple, Any] = {}
_engines_lock = threading.Lock()


def shared_engine(model: str | os.PathLike[str] | None = None, *, backend: str = "auto",
                  n_ctx: int = 4096, draft_depth: int = 4, kv_type: str = "f16",
                  seed: int | None = None, n_slots: int | None = 1, prefix_cache_bytes: int | None = None):
    """The one Engine for these load options, loaded on first use and reused by every caller.

    The engine runs up to n_slots requests at once and queues the rest itself, so sharing it
    across threads is safe; the lock here only keeps two first callers from loading the same
    model twice.
    """
    import openjet_plugin

    path = resolve_model(model)
    key = (str(path), backend, int(n_ctx), int(draft_depth), kv_type, seed, n_slots, prefix_cache_bytes)
    with _engines_lock:
        eng = _engines.get(key)
        if eng is None or getattr(eng, "_closed", False):
            eng = openjet_plugin.load(path, backend=backend, n_ctx=n_ctx, draft_depth=draft_depth,
                                      kv_type=kv_type, seed=seed, n_slots=n_slots,
                                      prefix_cache_bytes=prefix_cache_bytes)
            _engines[key] = eng
        return eng


def close_shared_engines() -> None:
    """Close every shared engine (tests and servers call this at exit)."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        eng.close()


# --- messages -------------------------------------------------------------------------------------

def text_of(content: Any) -> str:
    """Plain text of a message content: a string, or a list of content blocks (text kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and block.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(block.get("text", "")))
            elif isinstance(block, dict) and block.get("type") in ("image", "image_url", "input_image",
                                                                     "audio", "input_audio", "file", "video"):
                raise ValueError(f"content blocks of type {block['type']!r} are not supported: "
                                 f"the qwen35 text model reads text only")
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of blocks, got {type(content).__name__}")


def template_tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict:
    """An assistant tool call as the chat template reads it (arguments as an object when they
    parse, so the template writes them as JSON exactly once)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
            if isinstance(parsed, dict):
                arguments = parsed
        except json.JSONDecodeError:
            pass
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id:
        call["id"] = call_id
    return call


def openai_messages_for_template(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages (as LiteLLM and llama-cpp-python callers send them) -> the template's
    form: text content, tool-call arguments as objects, tool results with role "tool"."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            # pydantic message objects (LiteLLM's Message) -> dict
            m = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role == "function":
            role = "tool"
        msg: dict[str, Any] = {"role": role, "content": text_of(m.get("content"))}
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = tc.get("function") or {}
                calls.append(template_tool_call(fn.get("name", ""), fn.get("arguments", {}), tc.get("id")))
            msg["tool_calls"] = calls
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") and role == "tool":
            msg["name"] = m["name"]
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no 'role'")
        out.append(msg)
    return out


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tool definitions in the OpenAI form {"type": "function", "function": {...}} (what the
    Qwen template writes into its <tools> section)."""
    if not tools:
        return None
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function" and "function" in t:
            out.append(t)
        elif isinstance(t, dict) and "name" in t:
            out.append({"type": "function", "function": t})
        else:
            raise ValueError(f"a tool must be {{'type': 'function', 'function': {{...}}}}, got {t!r}")
    return out


def select_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict] | None:
    """Apply an OpenAI-style tool_choice to the tools the model is shown.

    "none" hides the tools; a named choice shows only that tool; "auto", "any" and "required"
    show them all (the engine has no grammar to force a call, so these are requests to the model).
    """
    if not tools or tool_choice in (None, "auto", "any", "required", True):
        return tools
    if tool_choice in ("none", False):
        return None
    name = None
    if isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    picked = [t for t in tools if t["function"].get("name") == name]
    if not picked:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools "
                         f"{[t['function'].get('name') for t in tools]}")
    return picked


# --- replies ----------------------------------------------------------------------------------------

class Reply:
    """A finished reply split into its parts (the non-streaming view).

    `tools`: the tool definitions the model was shown (they type the XML form's parameter
    values), or a bool saying whether it was shown any.
    """

    def __init__(self, text: str, *, thinking: bool, tools: bool | list[dict] | None,
                 prompt_opens_think: bool = False):
        self.raw = text
        body = (THINK_OPEN + text) if (thinking and prompt_opens_think) else text
        reasoning, content = split_reasoning(body) if thinking else (None, text)
        self.reasoning: str | None = reasoning
        calls: list[dict] = []
        invalid: list[dict] = []
        if tools and TOOL_OPEN in content:
            content, calls, invalid = parse_tool_calls(content, tools if isinstance(tools, list) else None)
        elif tools:
            # parse_tool_calls strips the text around the calls; strip a call-less reply alike, so
            # that a stream (which cannot know whether a call is coming) agrees with the whole
            content = content.strip()
        self.content: str = content
        self.tool_calls: list[dict] = calls
        self.invalid_tool_calls: list[dict] = invalid


def prompt_opens_think(prompt: str) -> bool:
    """True when the rendered prompt already opened the think block (the model starts inside it)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)


class ReplyStreamer:
    """Raw text deltas in, (reasoning delta, content delta) out, consistent with `Reply`.

    A delta is emitted only once it can no longer change: a tail that could be the start of a
    marker (<think>, </think>, <tool_call>) waits for the next piece; with thinking on, text with no
    opening <think> waits until </think> or the end decides whether it was reasoning; with tools,
    each <tool_call> block is parsed when it closes (`take_tool_events`), the content outside
    the blocks streams on, stripped of surrounding whitespace as the parsed reply is.
    """

    _MARKERS = (THINK_OPEN, THINK_CLOSE, TOOL_OPEN)

    def __init__(self, *, thinking: bool, tools: bool | list[dict] | None, prompt_opens_think: bool = False):
        self.thinking, self.tools, self.opens = thinking, tools, prompt_opens_think
        self.raw = ""
        self.sent_reasoning = ""
        self.sent_content = ""
        # tool calls are parsed as they complete (parsing.ToolCallStreamer); their events wait in
        # tool_events until the adapter takes them (take_tool_events)
        self._calls = ToolCallStreamer(tools=tools if isinstance(tools, list) else None) if tools else None
        self._fed = ""
        self.tool_events: list[ToolCallEvent] = []

    def take_tool_events(self) -> list[ToolCallEvent]:
        """The tool-call events (a call's name, its whole arguments, or its being malformed) since
        the last take, in order."""
        events, self.tool_events = self.tool_events, []
        return events

    def _feed_calls(self, content: str) -> str:
        """Feed the content's new text to the tool-call parser; the content outside calls so far."""
        if content.startswith(self._fed):
            _, events = self._calls.feed(content[len(self._fed):])
            self._fed = content
            self.tool_events += events
        return self._calls.content.strip()

    def feed(self, text: str) -> tuple[str, str]:
        self.raw += text
        safe = self.raw[:len(self.raw) - self._held_tail(self.raw)]
        if self.thinking:
            body = (THINK_OPEN + safe) if self.opens else safe
            if THINK_CLOSE not in body and not body.lstrip().startswith(THINK_OPEN):
                # not (yet) inside a think block: "<think>" may still come, or this is content
                # that a later "</think>" turns into reasoning; the end decides
                return "", ""
            reasoning, content = split_reasoning(body)
        else:
            reasoning, content = None, safe
        if self._calls is not None:
            # the whole reply is stripped around its calls: leading and trailing whitespace waits
            content = self._feed_calls(content)
        return self._deltas(reasoning or "", content)

    def finish(self, text: str = "") -> tuple[str, str, Reply]:
        """The last piece of text: the remaining deltas and the whole reply, parsed."""
        self.raw += text
        reply = Reply(self.raw, thinking=self.thinking, tools=None, prompt_opens_think=self.opens)
        if self._calls is not None:
            # the calls as streamed (same parser, same ids), not parsed a second time
            if not reply.content.startswith(self._fed):     # cannot happen: content only grows
                raise AssertionError(f"reply content {reply.content!r} does not extend {self._fed!r}")
            self._feed_calls(reply.content)
            _, events = self._calls.finish()
            self.tool_events += events
            reply.content = self._calls.content.strip()
            reply.tool_calls, reply.invalid_tool_calls = self._calls.calls, self._calls.invalid
        r, c = self._deltas(reply.reasoning or "", reply.content)
        return r, c, reply

    def _deltas(self, reasoning: str, content: str) -> tuple[str, str]:
        dr = dc = ""
        if reasoning.startswith(self.sent_reasoning):
            dr = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        if content.startswith(self.sent_content):
            dc = content[len(self.sent_content):]
            self.sent_content = content
        return dr, dc

    def _held_tail(self, text: str) -> int:
        best = 0
        for m in self._MARKERS:
            for n in range(min(len(m) - 1, len(text)), best, -1):
                if text.endswith(m[:n]):
                    best = n
                    break
        return best


# --- async ------------------------------------------------------------------------------------------

# a producer thread's last item on a stream's queue: (DONE, None), or (DONE, exc) when it failed
DONE = object()


async def drain(queue: asyncio.Queue) -> AsyncIterator[Any]:
    """Yield the items a producer thread puts on `queue` as (item, None) until (DONE, exc); then
    raise exc if there is one (the producer's error reaches the consumer)."""
    while True:
        item, exc = await queue.get()
        if item is DONE:
            if exc is not None:
                raise exc
            return
        yield item


async def iterate_in_thread(make_iterator: Callable[[], Iterator[Any]]) -> AsyncIterator[Any]:
    """Run a blocking iterator in its own thread and yield its items to the event loop.

    One dedicated thread per stream: the engine ties an open stream to the thread that started it,
    so the items must all come from the same thread (a shared pool could hand the next step to a
    thread that is already waiting for the engine).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def produce() -> None:
        try:
            it = make_iterator()
            try:
                for item in it:
                    if cancelled.is_set():
                        break
                    loop.call_soon_threadsafe(queue.put_nowait, (item, None))
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            loop.call_soon_threadsafe(queue.put_nowait, (DONE, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (DONE, exc))
            except RuntimeError:       # the loop is gone: nobody is listening any more
                pass

    thread = threading.Thread(target=produce, name="openjet-stream", daemon=True)
    thread.start()
    try:
        async for item in drain(queue):
            yield item
    finally:
        cancelled.set()


async def run_in_thread(fn: Callable[[], Any]) -> Any:
    """Run a blocking call (a whole non-streamed generation) off the event loop."""
    return await asyncio.to_thread(fn)
