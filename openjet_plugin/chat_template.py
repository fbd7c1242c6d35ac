"""Render a model's own chat template (the GGUF's `tokenizer.chat_template`) safely.

Templates come from model files, i.e. from whoever made the file, so they run in Jinja2's
immutable sandbox: a template can loop, test and format, but reaching for Python internals
(`__class__`, `__globals__`, mutating methods) fails with a `ChatTemplateError` instead of running.
The globals and filters are the ones Hugging Face's `apply_chat_template` provides, which is what
published templates are written against.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import OpenJetError


class ChatTemplateError(OpenJetError, ValueError):
    """The chat template is missing, does not compile, refuses the messages, or broke the sandbox."""


class _TemplateRaised(Exception):
    """`raise_exception(...)` called by the template itself (e.g. roles out of order)."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's tojson: no HTML escaping (jinja's default filter escapes <, > and & for HTML)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Work a template may do in one rendering. Jinja's sandbox caps a single range() at 100,000 items
# but not nested ones, nor `'x' * 10**9`: a hostile template could spin or fill memory for ever.
MAX_RANGE_ITEMS = 1_000_000        # all range() items of one rendering together
MAX_SEQUENCE = 4_000_000           # characters/items of a string or list made with * or **
_budget = threading.local()


def _budgeted_range(*args: int) -> range:
    rng = range(*args)
    left = getattr(_budget, "range_items", MAX_RANGE_ITEMS) - len(rng)
    if left < 0:
        raise _TemplateTooCostly(f"its range() calls exceed {MAX_RANGE_ITEMS} items in one rendering")
    _budget.range_items = left
    return rng


class _TemplateTooCostly(Exception):
    pass


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64 and isinstance(left, (int, float)) \
                    and abs(left) > 1:
                raise _TemplateTooCostly(f"{left!r} ** {right!r} is too large")
            return left ** right
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_SEQUENCE:
                raise _TemplateTooCostly(f"a repeated sequence of {len(seq) * n} items is too large")
        return left * right


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _budgeted_range
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc.message} "
                                f"(template line {exc.lineno})") from None


def render(template: str | None, messages: list[dict], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = True, enable_thinking: bool = False,
           **extra) -> str:
    """Render `messages` (OpenAI-style dicts) with `template`; returns the prompt text."""
    if not template:
        raise ChatTemplateError("the model has no chat template (tokenizer.chat_template is missing); "
                                "use generate() with a plain prompt instead")
    _check_messages(messages)
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    tpl = _compile(template)
    _budget.range_items = MAX_RANGE_ITEMS
    try:
        return tpl.render(messages=messages, tools=tools or None,
                          add_generation_prompt=add_generation_prompt,
                          enable_thinking=enable_thinking, **extra)
    except SecurityError as exc:
        raise ChatTemplateError(f"the chat template tried something the sandbox forbids: {exc}") from None
    except _TemplateRaised as exc:
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None
    except _TemplateTooCostly as exc:
        raise ChatTemplateError(f"the chat template does too much work: {exc}") from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from None
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError, RecursionError,
            MemoryError) as exc:
        # a template is code from the model file: its own runtime errors (1/0, range too big,
        # a macro calling itself) are the template's fault, reported as such
        raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
