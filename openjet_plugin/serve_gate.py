"""The front door of `openjet serve`: what every request meets before the LiteLLM proxy sees it.

`Gate` is an ASGI middleware around the proxy's app. It
- serves only the inference routes (chat and text completions, models, health) and, when asked
  for (`--metrics`, on by default), `/metrics`; LiteLLM's admin UI, `/openapi.json`, `/routes`,
  key management and the rest answer 404 unless the server was started with `--admin`, and then
  only to the master key;
- authenticates: the client key (or the master key) in `Authorization: Bearer`, `x-api-key` or
  `api-key`, compared in constant time; anything else is 401. The proxy itself is then called with
  the master key, so the key clients hold is never one that can administer the proxy;
- checks the body of a completion request against the OpenAI API (`check_chat_body`,
  `check_completion_body`) and answers 400 naming the field, at once, before anything is queued;
- admits at most `capacity` inference requests at a time; beyond that 503 with Retry-After
  (one engine serves one request at a time; the rest wait in the provider's queue, which is
  bounded by this);
- turns a 5xx from inside the proxy into a short message without internals (the details go to
  the server's log).

`ServerMetrics` keeps the numbers `/metrics` shows in Prometheus' text format: requests by route
and status, refusals, the queue (admitted, waiting for an engine, running) and per-request engine
stats (tokens, cached tokens, drafts proposed / accepted, prefill and decode time).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import threading
import time
from typing import Any, Callable

log = logging.getLogger("openjet_plugin.serve")

CHAT_ROUTES = ("/v1/chat/completions", "/chat/completions")
COMPLETION_ROUTES = ("/v1/completions", "/completions")
MODEL_ROUTES = ("/v1/models", "/models")
HEALTH_ROUTES = ("/health/liveliness", "/health/readiness", "/health/liveness")
METRICS_ROUTE = "/metrics"
MAX_BODY_BYTES = 8 * 1024 * 1024


class RequestError(ValueError):
    """A request the server refuses: HTTP status, the field at fault (OpenAI's `param`), why."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "server_busy"}.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# --- request bodies (the OpenAI API's rules) ------------------------------------------------------

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")
_MEDIA_PART_TYPES = ("image_url", "input_image", "input_audio", "audio", "file", "image", "video")

# fields of the OpenAI request (and the extensions this server documents) with their checks;
# anything else is refused by name
_COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
                  "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "logprobs",
                  # extensions (llama.cpp's sampling options; see adapters/litellm.py)
                  "top_k", "min_p", "repeat_penalty",
                  # LiteLLM proxy bookkeeping, harmless
                  "metadata", "litellm_metadata", "tags", "litellm_session_id"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "functions",
                                "function_call", "parallel_tool_calls", "response_format", "top_logprobs",
                                "store", "service_tier", "reasoning_effort", "enable_thinking",
                                "chat_template_kwargs", "modalities", "prediction"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(body: dict, key: str, lo: float | None = None, hi: float | None = None) -> None:
    v = body.get(key)
    if v is None:
        return
    if not _is_number(v):
        raise RequestError(key, f"'{key}' must be a number, got {_kind(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(key, f"'{key}' must be in [{lo}, {hi}], got {v}")


def _integer(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> None:
    v = body.get(key)
    if v is None:
        return
    if not _is_int(v):
        raise RequestError(key, f"'{key}' must be an integer, got {_kind(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(key, f"'{key}' must be {bound}, got {v}")


def _boolean(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise RequestError(key, f"'{key}' must be true or false, got {_kind(v)}")


def _kind(v: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _check_common(body: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise RequestError(unknown[0], f"unrecognized request field '{unknown[0]}'"
                           + (f" (and {unknown[1:]})" if len(unknown) > 1 else ""))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model", "'model' is required and must be a non-empty string")
    _boolean(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("stream_options", f"'stream_options' must be an object, got {_kind(so)}")
        for k, v in so.items():
            if k not in ("include_usage", "include_obfuscation"):
                raise RequestError(f"stream_options.{k}", f"unrecognized field 'stream_options.{k}'")
            if not isinstance(v, bool):
                raise RequestError(f"stream_options.{k}", f"'stream_options.{k}' must be true or false")
    for key in ("max_tokens", "max_completion_tokens"):
        _integer(body, key, 1, 2**31 - 1)
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    _number(body, "presence_penalty", -2, 2)
    _number(body, "frequency_penalty", -2, 2)
    _integer(body, "seed", 0, 2**63 - 1)
    _integer(body, "top_k", 0, 2**31 - 1)
    _number(body, "min_p", 0, 1)
    _number(body, "repeat_penalty", 0)
    n = body.get("n")
    if n is not None:
        _integer(body, "n", 1, 2**31 - 1)
        if n != 1:
            raise RequestError("n", f"'n' = {n} is not supported: this server generates one choice per "
                                    f"request (send {n} requests instead)")
    stop = body.get("stop")
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise RequestError("stop", "'stop' must be a non-empty string or an array of non-empty strings")
        if len(items) > 4:
            raise RequestError("stop", f"'stop' may hold at most 4 strings, got {len(items)}")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RequestError("logit_bias", f"'logit_bias' must be an object of token id -> bias, got {_kind(bias)}")
        for k, v in bias.items():
            if not re.fullmatch(r"[0-9]{1,9}", k):
                raise RequestError("logit_bias", f"'logit_bias' key {k!r} is not a token id (a decimal integer)")
            if not _is_number(v) or not -100 <= v <= 100:
                raise RequestError("logit_bias", f"'logit_bias' value for token {k} must be a number in [-100, 100]")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user", "'user' must be a string")
    for key in ("metadata", "litellm_metadata"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise RequestError(key, f"'{key}' must be an object")


def _check_content(content: Any, where: str, *, required: bool) -> None:
    if content is None:
        if required:
            raise RequestError(where, f"'{where}' is required")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(where, f"'{where}' must be a string or an array of content parts, got {_kind(content)}")
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(at, f"'{at}' must be a content part object with a 'type'")
        if part["type"] in _TEXT_PART_TYPES:
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{at}.text", f"'{at}.text' must be a string")
        elif part["type"] in _MEDIA_PART_TYPES:
            raise RequestError(f"{at}.type", f"content parts of type {part['type']!r} are not supported: the "
                                             f"model reads text only")
        elif part["type"] != "refusal":
            raise RequestError(f"{at}.type", f"unknown content part type {part['type']!r}")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise RequestError(where, f"'{where}' must be an array")
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(c, dict):
            raise RequestError(at, f"'{at}' must be an object")
        if c.get("type", "function") != "function":
            raise RequestError(f"{at}.type", f"'{at}.type' must be 'function'")
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{at}.function.name", f"'{at}.function.name' must be a non-empty string")
        if not isinstance(fn.get("arguments", ""), (str, dict)):
            raise RequestError(f"{at}.function.arguments", f"'{at}.function.arguments' must be a JSON string")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise RequestError(f"{at}.id", f"'{at}.id' must be a string")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise RequestError("messages", f"'messages' must be an array of message objects, got {_kind(messages)}")
    if not messages:
        raise RequestError("messages", "'messages' must hold at least one message")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(at, f"'{at}' must be an object, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{at}.role", f"'{at}.role' must be one of {list(ROLES)}, got {role!r}")
        has_calls = bool(m.get("tool_calls")) or bool(m.get("function_call"))
        _check_content(m.get("content"), f"{at}.content", required=not (role == "assistant"))
        if role == "assistant" and m.get("content") is None and not has_calls:
            raise RequestError(f"{at}.content", f"'{at}.content' is required unless the message has tool_calls")
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError(f"{at}.tool_calls", f"only assistant messages carry tool_calls ('{at}')")
            _check_tool_calls(m["tool_calls"], f"{at}.tool_calls")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise RequestError(f"{at}.tool_call_id", f"'{at}.tool_call_id' is required in a tool message")
        if role == "function" and not isinstance(m.get("name"), str):
            raise RequestError(f"{at}.name", f"'{at}.name' is required in a function message")
        for key in ("name", "reasoning_content", "refusal"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise RequestError(f"{at}.{key}", f"'{at}.{key}' must be a string")


def _check_function(fn: Any, at: str) -> str:
    if not isinstance(fn, dict):
        raise RequestError(at, f"'{at}' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise RequestError(f"{at}.name", f"'{at}.name' must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise RequestError(f"{at}.description", f"'{at}.description' must be a string")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise RequestError(f"{at}.parameters", f"'{at}.parameters' must be a JSON Schema object")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise RequestError(f"{at}.strict", f"'{at}.strict' must be true or false")
    return name


def _check_tools(body: dict) -> None:
    names: list[str] = []
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("tools", f"'tools' must be an array of tool objects, got {_kind(tools)}")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise RequestError(f"tools[{i}].type", f"'tools[{i}]' must be {{\"type\": \"function\", "
                                                       f"\"function\": {{...}}}}")
            names.append(_check_function(t.get("function"), f"tools[{i}].function"))
    functions = body.get("functions")
    if functions is not None:
        if not isinstance(functions, list):
            raise RequestError("functions", "'functions' must be an array")
        names += [_check_function(f, f"functions[{i}]") for i, f in enumerate(functions)]
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise RequestError("tool_choice", f"'tool_choice' must be 'none', 'auto', 'required' or "
                                                  f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
            if choice == "required" and not names:
                raise RequestError("tool_choice", "'tool_choice' is 'required' but the request has no tools")
        elif isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise RequestError("tool_choice", "'tool_choice' must be {\"type\": \"function\", \"function\": "
                                                  "{\"name\": ...}}")
            if name not in names:
                raise RequestError("tool_choice", f"'tool_choice' names {name!r}, which is not among the tools "
                                                  f"{names}")
        else:
            raise RequestError("tool_choice", f"'tool_choice' must be a string or an object, got {_kind(choice)}")
    _boolean(body, "parallel_tool_calls")


def _check_response_format(body: dict) -> None:
    rf = body.get("response_format")
    if rf is None:
        return
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("response_format.type", "'response_format.type' must be 'text', 'json_object' or "
                                                   "'json_schema'")
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError("response_format.json_schema", "'response_format.json_schema' is required with "
                                                              "type 'json_schema' and must be an object")
        if not isinstance(js.get("name"), str) or not _TOOL_NAME.match(js["name"]):
            raise RequestError("response_format.json_schema.name",
                               "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'")
        if js.get("schema") is not None and not isinstance(js["schema"], dict):
            raise RequestError("response_format.json_schema.schema",
                               "'response_format.json_schema.schema' must be a JSON Schema object")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise RequestError("response_format.json_schema.strict",
                               "'response_format.json_schema.strict' must be true or false")


def check_chat_body(body: Any) -> None:
    """Raise RequestError for a chat completion request the OpenAI API would refuse or that this
    server cannot honour; return None for a good one."""
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got {_kind(body)}")
    _check_common(body, CHAT_FIELDS)
    if "messages" not in body:
        raise RequestError("messages", "'messages' is required")
    _check_messages(body["messages"])
    _check_tools(body)
    _check_response_format(body)
    _boolean(body, "logprobs")
    _integer(body, "top_logprobs", 0, 20)
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise RequestError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    for key in ("enable_thinking", "store"):
        _boolean(body, key)
    if body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
        raise RequestError("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high"):
        raise RequestError("reasoning_effort", f"'reasoning_effort' must be one of none, minimal, low, medium, "
                                               f"high, got {effort!r}")
    if body.get("modalities") not in (None, ["text"]):
        raise RequestError("modalities", "'modalities' may only be [\"text\"]")
    if body.get("prediction") is not None:
        raise RequestError("prediction", "'prediction' (predicted outputs) is not supported")


def check_completion_body(body: Any) -> None:
    """The same for a (legacy) text completion request."""
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got {_kind(body)}")
    _check_common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            raise RequestError("prompt", "'prompt' as token ids is not supported: send the text")
        if isinstance(prompt, list) and len(prompt) > 1:
            raise RequestError("prompt", "'prompt' may hold one string: this server completes one prompt per "
                                         "request")
        raise RequestError("prompt", f"'prompt' is required and must be a string, got {_kind(prompt)}")
    if not prompt:
        raise RequestError("prompt", "'prompt' is empty")
    if body.get("echo"):
        raise RequestError("echo", "'echo' is not supported")
    if body.get("suffix") is not None:
        raise RequestError("suffix", "'suffix' (insertion) is not supported")
    _integer(body, "best_of", 1, 1)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 5):
        raise RequestError("logprobs", "'logprobs' must be an integer in [0, 5] for completions")


# --- metrics --------------------------------------------------------------------------------------

_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Counters and gauges for `/metrics`; every method is thread-safe (the engine's worker
    threads report here)."""

    _ENGINE_COUNTERS = ("prompt_tokens", "cached_prompt_tokens", "prefix_cache_tokens", "generated_tokens",
                        "drafts_proposed", "drafts_accepted", "cycles")

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.refused: dict[str, int] = {}
        self.admitted = 0
        self.waiting = 0         # admitted and waiting for an engine
        self.running = 0         # generating on an engine
        self.engine_totals = {k: 0 for k in self._ENGINE_COUNTERS}
        self.engine_requests = 0
        self.prefill = _Histogram(_DURATION_BUCKETS)
        self.decode = _Histogram(_DURATION_BUCKETS)
        self.tokens = _Histogram(_TOKEN_BUCKETS)
        self.last: dict[str, float] = {}
        self._durations: list[float] = []   # recent request durations (for Retry-After)

    # the provider's hooks (adapters/litellm.py calls these through its `observer`)
    def engine_waiting(self, delta: int) -> None:
        with self._lock:
            self.waiting += delta

    def engine_running(self, delta: int) -> None:
        with self._lock:
            self.running += delta

    def engine_finished(self, stats) -> None:
        with self._lock:
            self.engine_requests += 1
            for k in self._ENGINE_COUNTERS:
                self.engine_totals[k] += int(getattr(stats, k, 0) or 0)
            self.prefill.observe(float(stats.prefill_seconds))
            self.decode.observe(float(stats.decode_seconds))
            self.tokens.observe(float(stats.generated_tokens))
            self.last = {"prefill_seconds": float(stats.prefill_seconds),
                         "decode_seconds": float(stats.decode_seconds),
                         "tokens_per_second": float(stats.tokens_per_second),
                         "generated_tokens": float(stats.generated_tokens),
                         "acceptance": (stats.drafts_accepted / stats.drafts_proposed
                                        if stats.drafts_proposed else 0.0)}

    # the gate's
    def request_done(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1
            self._durations = (self._durations + [seconds])[-32:]

    def refusal(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1

    def typical_seconds(self) -> float:
        with self._lock:
            d = sorted(self._durations)
        return d[len(d) // 2] if d else 1.0

    def render(self) -> str:
        with self._lock:
            out = ["# HELP openjet_requests_total HTTP requests answered, by route and status",
                   "# TYPE openjet_requests_total counter"]
            out += [f'openjet_requests_total{{route="{r}",status="{s}"}} {n}'
                    for (r, s), n in sorted(self.requests.items())]
            out += ["# HELP openjet_requests_refused_total requests refused before reaching an engine, by reason",
                    "# TYPE openjet_requests_refused_total counter"]
            out += [f'openjet_requests_refused_total{{reason="{r}"}} {n}' for r, n in sorted(self.refused.items())]
            out += ["# HELP openjet_requests_admitted inference requests admitted and not yet answered",
                    "# TYPE openjet_requests_admitted gauge", f"openjet_requests_admitted {self.admitted}",
                    "# HELP openjet_queue_depth requests waiting for an engine",
                    "# TYPE openjet_queue_depth gauge", f"openjet_queue_depth {self.waiting}",
                    "# HELP openjet_requests_running requests generating on an engine",
                    "# TYPE openjet_requests_running gauge", f"openjet_requests_running {self.running}",
                    "# HELP openjet_engine_requests_total requests an engine finished",
                    "# TYPE openjet_engine_requests_total counter",
                    f"openjet_engine_requests_total {self.engine_requests}"]
            for k, v in self.engine_totals.items():
                out += [f"# TYPE openjet_engine_{k}_total counter", f"openjet_engine_{k}_total {v}"]
            for name, h in (("prefill_seconds", self.prefill), ("decode_seconds", self.decode),
                            ("generated_tokens", self.tokens)):
                out += [f"# HELP openjet_request_{name} per request", f"# TYPE openjet_request_{name} histogram"]
                out += h.lines(f"openjet_request_{name}")
            for k, v in self.last.items():
                out += [f"# TYPE openjet_last_request_{k} gauge", f"openjet_last_request_{k} {v:.6f}"]
            return "\n".join(out) + "\n"


# --- the middleware -------------------------------------------------------------------------------

class Gate:
    """ASGI middleware around the LiteLLM proxy app (see the module docstring).

    client_keys: keys clients may send; master_key: the proxy's own key (also accepted, and the one
    the proxy is called with); capacity: inference requests admitted at once; admin: let the
    master key reach LiteLLM's other routes; metrics: serve /metrics (to holders of a key).
    """

    def __init__(self, app, *, client_keys: list[str], master_key: str, capacity: int,
                 metrics: ServerMetrics, admin: bool = False, serve_metrics: bool = True):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.app = app
        self.client_keys = [k.encode() for k in client_keys if k]
        self.master_key = master_key
        self.capacity = capacity
        self.metrics = metrics
        self.admin = admin
        self.serve_metrics = serve_metrics
        self._admitted = 0
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":       # the proxy's realtime routes: not offered
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)   # lifespan
            return
        path = scope.get("path", "")
        t0 = time.monotonic()
        status_box = [0]

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            await self._route(scope, receive, counting_send, path)
        finally:
            route = path if path in _KNOWN_ROUTES else "other"
            self.metrics.request_done(route, status_box[0], time.monotonic() - t0)

    async def _route(self, scope, receive, send, path: str) -> None:
        method = scope.get("method", "GET")
        if path in HEALTH_ROUTES:
            await self.app(scope, receive, send)
            return
        is_chat, is_completion = path in CHAT_ROUTES, path in COMPLETION_ROUTES
        known = is_chat or is_completion or path in MODEL_ROUTES or (path == METRICS_ROUTE and self.serve_metrics)
        if not known and not self.admin:
            await _reply_error(send, RequestError(None, f"no route {path!r} on this server", 404))
            return
        role = self._authenticate(scope)
        if role is None:
            await _reply_error(send, RequestError(None, "invalid or missing API key: send it as 'Authorization: "
                                                        "Bearer <key>'", 401, "invalid_api_key"))
            return
        if not known and role != "master":
            await _reply_error(send, RequestError(None, f"no route {path!r} for this key", 404))
            return
        if path == METRICS_ROUTE and self.serve_metrics:
            await _reply(send, 200, self.metrics.render().encode(), b"text/plain; version=0.0.4; charset=utf-8")
            return
        scope = _with_key(scope, self.master_key)
        if not (is_chat or is_completion):
            await self.app(scope, receive, _hide_internal_errors(send))
            return
        if method != "POST":
            await _reply_error(send, RequestError(None, f"{path} takes POST, not {method}", 405))
            return
        try:
            raw = await _read_body(receive)
            try:
                body = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise RequestError(None, f"the request body is not valid UTF-8 (byte {exc.start})") from None
            except json.JSONDecodeError as exc:
                raise RequestError(None, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                                         f"column {exc.colno}") from None
            except RecursionError:
                raise RequestError(None, "the request body is nested too deeply") from None
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(None, "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                                         "without its pair): not Unicode text") from None
            except (RecursionError, ValueError):
                raise RequestError(None, "the request body is nested too deeply or holds a number out of range") \
                    from None
            (check_chat_body if is_chat else check_completion_body)(body)
        except RequestError as exc:
            await _reply_error(send, exc)
            return
        with self._lock:
            admitted = self._admitted < self.capacity
            if admitted:
                self._admitted += 1
                self.metrics.admitted = self._admitted
        if not admitted:
            self.metrics.refusal("queue_full")
            retry = max(1, math.ceil(self.metrics.typical_seconds() * self.capacity / 2))
            await _reply_error(send, RequestError(None, f"the server is busy: {self.capacity} requests are queued "
                                                        f"or running; retry after {retry} s", 503,
                                                  "server_busy"), headers=[(b"retry-after", str(retry).encode())])
            return
        out = _hide_internal_errors(send)
        if is_completion and body.get("stream"):
            out = _text_in_every_choice(out)
        try:
            await self.app(scope, _replay(raw, receive), out)
        finally:
            with self._lock:
                self._admitted -= 1
                self.metrics.admitted = self._admitted

    def _authenticate(self, scope) -> str | None:
        """'client', 'master' or None, from the request's key headers."""
        key = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    key = token.strip()
            elif name in (b"x-api-key", b"api-key") and key is None:
                key = value.strip()
        if not key:
            return None
        if hmac.compare_digest(key, self.master_key.encode()):
            return "master"
        ok = False
        for k in self.client_keys:              # every key compared: the time says nothing
            ok |= hmac.compare_digest(key, k)
        return "client" if ok else None


_KNOWN_ROUTES = set(CHAT_ROUTES + COMPLETION_ROUTES + MODEL_ROUTES + HEALTH_ROUTES + (METRICS_ROUTE,))


def _with_key(scope, key: str):
    headers = [(n, v) for n, v in scope.get("headers", ()) if n not in (b"authorization", b"x-api-key", b"api-key")]
    headers.append((b"authorization", b"Bearer " + key.encode()))
    return dict(scope, headers=headers)


async def _read_body(receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError(None, "the client went away", 400)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(None, f"the request body is larger than {MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(raw: bytes, receive):
    """A receive() that hands the body already read to the app, then the client's later messages
    (a disconnect), so the proxy still notices a client that goes away."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replayed


def _hide_internal_errors(send) -> Callable:
    """Pass responses through, except error bodies: a 5xx becomes a fixed message (the proxy's own
    body can carry exception text and file paths; the server log has the details), and a 4xx
    keeps its message without LiteLLM's wrapping ("litellm.BadRequestError: OpenjetException - ",
    "LiteLLM: model group ... failed ..."); an unknown model is 404 model_not_found, as OpenAI's."""
    state: dict[str, Any] = {"mode": None, "body": b""}

    async def filtered(message) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            state["mode"], state["start"] = ("hide" if message["status"] >= 500 else "clean"), message
            return
        if state["mode"] is not None and message["type"] == "http.response.body":
            state["body"] += message.get("body", b"")
            if message.get("more_body", False):
                return
            status, body = _error_body(state["start"]["status"], state["body"], hide=state["mode"] == "hide")
            await _reply(send, status, body)
            return
        await send(message)

    return filtered


_LITELLM_PREFIX = re.compile(r"^(litellm\.\w+: )?(\w+Exception - )?")
_LITELLM_SUFFIX = re.compile(r"\s*(LiteLLM: model group|Received Model Group|Available Model Group).*$", re.S)


def _error_body(status: int, raw: bytes, *, hide: bool) -> tuple[int, bytes]:
    if hide:
        return status, json.dumps({"error": {"message": "internal server error (details are in the server log)",
                                             "type": "server_error", "param": None, "code": None}}).encode()
    try:
        err = json.loads(raw)["error"]
        message = str(err.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return status, raw
    message = _LITELLM_SUFFIX.sub("", _LITELLM_PREFIX.sub("", message)).strip()
    code = err.get("code") if isinstance(err.get("code"), str) and not str(err.get("code")).isdigit() else None
    if "Invalid model name passed in model=" in message:
        status, code = 404, "model_not_found"
        message = message.replace("/chat/completions: ", "").replace("/completions: ", "")
    body = {"error": {"message": message, "type": err.get("type") or "invalid_request_error",
                      "param": err.get("param"), "code": code}}
    return status, json.dumps(body).encode()


def _text_in_every_choice(send) -> Callable:
    """A text completion stream whose every choice has `text` (OpenAI's last chunk carries
    text "" with its finish_reason; LiteLLM's conversion from chat chunks drops an empty text)."""
    buf = b""

    def fix(event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        try:
            obj = json.loads(event[len(b"data: "):])
        except ValueError:
            return event
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not choices or all("text" in c for c in choices if isinstance(c, dict)):
            return event
        for c in choices:
            if isinstance(c, dict):
                c.setdefault("text", "")
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode()

    async def fixed(message) -> None:
        nonlocal buf
        if message["type"] != "http.response.body":
            await send(message)
            return
        buf += message.get("body", b"")
        more = message.get("more_body", False)
        events = buf.split(b"\n\n")
        buf = events.pop() if more else b""
        out = b"".join(fix(e) + b"\n\n" for e in events if e)
        if out or not more:
            await send({"type": "http.response.body", "body": out, "more_body": more})

    return fixed


async def _reply(send, status: int, body: bytes, content_type: bytes = b"application/json",
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
                + list(headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _reply_error(send, exc: RequestError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _reply(send, exc.status, json.dumps(exc.body()).encode(), headers=headers)
