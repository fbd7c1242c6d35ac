"""LiteLLM integration: the custom provider "openjet".

    from openjet_plugin.adapters.litellm import register
    register()
    litellm.completion(model="openjet/default", messages=[{"role": "user", "content": "Hi"}])
    litellm.completion(model="openjet//models/qwen3.8-27b-q4_k_m.gguf", messages=...)

`OpenJetProvider` implements LiteLLM's `CustomLLM` (completion, streaming, acompletion,
astreaming). It renders the messages with the model's own chat template, runs `Engine.generate`
and returns LiteLLM's `ModelResponse` (or streaming chunks) with the engine's own token counts as
usage. One engine per model file and load options is loaded once and shared by every call
(`_shared.shared_engine`); async calls run on that engine's worker threads in arrival order, one
thread per engine slot (`n_slots`: that many requests generate at once and share the engine's
passes).

OpenAI's rules: without max_tokens a chat reply may run to the end of the context window; a text
completion (`litellm.text_completion`, the proxy's /v1/completions) continues the prompt as given
(no chat template) with OpenAI's default of 16 tokens; `n` > 1 is refused (400); `logit_bias`
goes to the engine. `response_format` (json_object, json_schema) and a forced `tool_choice`
("required" or a named function) become engine constraints, `logprobs` / `top_logprobs` the
engine's per-token log-probabilities (see openjet_plugin/constraints.py).

Request options beyond OpenAI's: `top_k`, `min_p`, `repeat_penalty`; thinking with
`enable_thinking=True` (or `chat_template_kwargs={"enable_thinking": True}`, or any
`reasoning_effort` but "none" — which LiteLLM lets through to a custom provider only with
`allowed_openai_params=["reasoning_effort"]`), returned in `message.reasoning_content` (streamed in
`delta.reasoning_content`). Tools are rendered into the template's tools section; the model's
tool-call blocks (Qwen's XML form or JSON, see parsing.py) come back as OpenAI `tool_calls`
(finish_reason "tool_calls"), streamed as OpenAI tool-call deltas (id and name first, then the
arguments when the call is complete); malformed blocks come back in
`message.provider_specific_fields["invalid_tool_calls"]` rather than raising.

Model names: "default" (the embedded model), an alias from the provider's `aliases`, or — only
when the provider was made with `allow_paths=True`, as `register()` does for library use — a path
to a GGUF file. The proxy's handler (`proxy_handler`) accepts aliases only, so a request cannot
make a server open a file of its choosing (see serve.py).

Embeddings, images and audio are not supported (LiteLLM reports CustomLLM's "not implemented").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import queue
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no network fetch at import

import litellm  # noqa: E402
from litellm import CustomLLM  # noqa: E402
from litellm.llms.custom_llm import CustomLLMError  # noqa: E402
from litellm.types.utils import (  # noqa: E402
    ChatCompletionDeltaToolCall,
    ChoiceLogprobs,
    Delta,
    Function,
    Message,
    ModelResponse,
    ModelResponseStream,
    StreamingChoices,
    Usage,
)

from ._shared import (  # noqa: E402
    DEFAULT_ALIASES,
    DONE,
    Reply,
    ReplyStreamer,
    drain,
    openai_messages_for_template,
    openai_tools,
    prompt_opens_think,
    run_in_thread,
    select_tools,
    shared_engine,
    text_of,
)

PROVIDER = "openjet"

# OpenAI request field -> Engine.generate keyword
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
             "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repeat_penalty": "repeat_penalty"}
# accepted and meaningless for one local sequence (or handled by LiteLLM itself)
_IGNORED = {"user", "stream", "stream_options", "parallel_tool_calls", "metadata", "extra_body", "max_retries",
            "timeout", "store", "service_tier"}
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# OpenAI's default max_tokens for (legacy) text completions; chat completions without max_tokens
# generate to the end of the context window, as OpenAI's do
TEXT_COMPLETION_MAX_TOKENS = 16


def _bad_request(message: str) -> CustomLLMError:
    return CustomLLMError(status_code=400, message=message)


@dataclass
class _Request:
    """One request, translated: what to run on which engine, and how to read the reply."""

    engine: Any
    prompt: str
    sampling: dict
    shape: dict                 # Reply / ReplyStreamer keywords (thinking, tools, prompt_opens_think)
    logprobs: bool = False
    text_completion: bool = False


class OpenJetProvider(CustomLLM):
    """LiteLLM custom provider running qwen35 GGUF models on the openjet engine.

    aliases: model name -> GGUF path ("default" always means the embedded model).
    allow_paths: accept a model name that is a path to a file (library use); False for servers.
    backend, n_ctx, draft_depth, kv_type, n_slots, prefix_cache_bytes: how engines are loaded (see
    `openjet_plugin.load`; n_slots None: the backend's choice for a server; prefix_cache_bytes
    None: the engine's default).
    observer: told about each request's queueing and its engine stats (`serve_gate.ServerMetrics`
    in `openjet serve`): engine_waiting(±1), engine_running(±1), engine_finished(stats).

    Async calls run on one worker thread per engine slot, in arrival order: a request waiting for
    a busy engine holds no thread, and one whose client leaves before its turn never runs.
    """

    def __init__(self, *, aliases: dict[str, str] | None = None, allow_paths: bool = True,
                 backend: str = "auto", n_ctx: int = 4096, draft_depth: int = 4, kv_type: str = "f16",
                 n_slots: int | None = 1, prefix_cache_bytes: int | None = None):
        super().__init__()
        self.aliases = dict(aliases or {})
        self.allow_paths = allow_paths
        self.load_options = dict(backend=backend, n_ctx=n_ctx, draft_depth=draft_depth, kv_type=kv_type,
                                 n_slots=n_slots, prefix_cache_bytes=prefix_cache_bytes)
        self.observer: Any = None

    # --- model names ------------------------------------------------------------------------------
    def model_file(self, model: str) -> str | None:
        """The file behind a model name (None: the embedded default); refuses unknown names."""
        name = model.split("/", 1)[1] if model.startswith(PROVIDER + "/") else model
        if name in self.aliases:
            return self.aliases[name]
        if name in DEFAULT_ALIASES:
            return None
        if self.allow_paths:
            return name
        known = sorted(set(self.aliases) | {"default"})
        raise CustomLLMError(status_code=404, message=f"unknown model {name!r}; this server offers {known}")

    def engine(self, model: str):
        try:
            return shared_engine(self.model_file(model), **self.load_options)
        except FileNotFoundError as exc:
            raise CustomLLMError(status_code=404, message=str(exc)) from None

    # --- request translation ----------------------------------------------------------------------
    def _request(self, model: str, messages: list, optional_params: dict, litellm_params: dict | None = None
                 ) -> _Request:
        params = dict(optional_params or {})
        text_completion = bool((litellm_params or {}).get("text_completion"))
        sampling: dict[str, Any] = {}
        for key, target in _SAMPLING.items():
            if params.get(key) is not None:
                sampling[target] = params.pop(key)
            else:
                params.pop(key, None)
        if "max_tokens" not in sampling:
            sampling["max_tokens"] = TEXT_COMPLETION_MAX_TOKENS if text_completion else None
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]
        n = params.pop("n", None)
        if n not in (None, 1):
            raise _bad_request(f"n={n!r} is not supported: openjet generates one choice per request")
        bias = params.pop("logit_bias", None)
        if bias:
            sampling["logit_bias"] = _logit_bias(bias)
        thinking = bool(params.pop("enable_thinking", False))
        template_kwargs = params.pop("chat_template_kwargs", None) or {}
        if "enable_thinking" in template_kwargs:
            thinking = bool(template_kwargs["enable_thinking"])
        effort = params.pop("reasoning_effort", None)
        if effort is not None:
            thinking = effort not in ("none", None, False)
        try:
            all_tools = openai_tools(params.pop("tools", None))
            tool_choice = params.pop("tool_choice", None)
            constraint = _constraint(all_tools, tool_choice, params.pop("response_format", None))
            tools = all_tools if constraint is not None and constraint.get("type") == "tool_call" \
                else select_tools(all_tools, tool_choice)
        except ValueError as exc:
            raise _bad_request(str(exc)) from None
        logprobs = params.pop("logprobs", None)
        top_logprobs = params.pop("top_logprobs", None)
        for key in _IGNORED:
            params.pop(key, None)
        if params:
            raise _bad_request(
                f"unsupported request options for openjet: {sorted(params)}; supported: "
                f"{sorted(_SAMPLING)}, n (1), logit_bias, tools, tool_choice, response_format, logprobs, "
                f"top_logprobs, enable_thinking, chat_template_kwargs, reasoning_effort")
        if text_completion and logprobs is not None:
            # LiteLLM rebuilds a text completion from the chat response and drops its logprobs
            # (convert_chat_to_text_completion keeps them only for HF TGI): refuse rather than lose them
            raise _bad_request("logprobs on a text completion are not supported here (LiteLLM's conversion "
                               "drops them); ask a chat completion with logprobs=true and top_logprobs")
        extra: dict[str, Any] = {}
        if constraint is not None:
            extra["constraint"] = constraint
        if logprobs:
            extra["logprobs"] = True
            if top_logprobs:
                extra["top_logprobs"] = int(top_logprobs)
        elif top_logprobs:
            raise _bad_request("top_logprobs needs logprobs=true")
        eng = self.engine(model)
        sampling.update(extra)
        if text_completion:
            # a completion continues the prompt as given: no chat template
            if len(messages) != 1:
                raise _bad_request("a text completion takes exactly one prompt")
            prompt = text_of(_as_dict(messages[0]).get("content"))
            if not prompt:
                raise _bad_request("the prompt is empty")
            return _Request(eng, prompt, sampling, dict(thinking=False, tools=None), bool(logprobs), True)
        try:
            _check_roles(messages)
            prompt = eng.render_chat(openai_messages_for_template(messages), tools=tools,
                                     enable_thinking=thinking)
        except ValueError as exc:
            raise _bad_request(str(exc)) from None
        shape = dict(thinking=thinking, tools=tools, prompt_opens_think=prompt_opens_think(prompt))
        return _Request(eng, prompt, sampling, shape, bool(logprobs))

    @staticmethod
    def _usage(stats, completion_tokens: int) -> Usage:
        return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=stats.prompt_tokens + completion_tokens,
                     prompt_tokens_details={"cached_tokens": stats.cached_prompt_tokens})

    @staticmethod
    def _finish_reason(reply: Reply, finish: str) -> str:
        return "tool_calls" if reply.tool_calls and finish == "stop" else finish

    @staticmethod
    def _tool_calls(reply: Reply) -> list[dict] | None:
        if not reply.tool_calls:
            return None
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in reply.tool_calls]

    def _generate(self, req: _Request, stream: bool):
        try:
            return req.engine.generate(req.prompt, stream=stream, **req.sampling)
        except ValueError as exc:          # bad sampling values, constraints, context overflow
            raise _bad_request(str(exc)) from None

    def _report(self, stats) -> None:
        if self.observer is not None and stats is not None:
            self.observer.engine_finished(stats)

    # --- CustomLLM --------------------------------------------------------------------------------
    def completion(self, model: str, messages: list, api_base: str = None, custom_prompt_dict: dict = None,
                   model_response: ModelResponse = None, print_verbose=None, encoding=None, api_key=None,
                   logging_obj=None, optional_params: dict = None, acompletion=None, litellm_params=None,
                   logger_fn=None, headers={}, timeout=None, client=None) -> ModelResponse:
        req = self._request(model, messages, optional_params, litellm_params)
        return self._complete(req, model, model_response)

    def _complete(self, req: _Request, model: str, model_response: ModelResponse | None) -> ModelResponse:
        result = self._generate(req, stream=False)
        self._report(result.stats)
        reply = Reply(result.text, **req.shape)
        message = Message(content=reply.content, role="assistant", tool_calls=self._tool_calls(reply),
                          reasoning_content=reply.reasoning)
        if reply.invalid_tool_calls:
            message.provider_specific_fields = {"invalid_tool_calls": reply.invalid_tool_calls}
        response = model_response if model_response is not None else ModelResponse()
        response.choices[0].message = message
        response.choices[0].finish_reason = self._finish_reason(reply, result.finish_reason)
        if req.logprobs:
            response.choices[0].logprobs = ChoiceLogprobs(content=_openai_logprobs(result.logprobs or []))
        response.model = model
        if req.text_completion:
            response.id = "cmpl-" + uuid.uuid4().hex          # OpenAI's prefix for completions
        response.usage = self._usage(result.stats, len(result.tokens))
        response._hidden_params["openjet"] = {"backend": req.engine.backend_name,
                                              "stats": vars(result.stats).copy()}
        return response

    def streaming(self, model: str, messages: list, api_base: str = None, custom_prompt_dict: dict = None,
                  model_response: ModelResponse = None, print_verbose=None, encoding=None, api_key=None,
                  logging_obj=None, optional_params: dict = None, acompletion=None, litellm_params=None,
                  logger_fn=None, headers={}, timeout=None, client=None) -> Iterator[ModelResponseStream]:
        req = self._request(model, messages, optional_params, litellm_params)
        return self._stream_chunks(self._generate(req, stream=True), req, model)

    def _stream_chunks(self, stream, req: _Request, model: str) -> Iterator[ModelResponseStream]:
        chunk_id = ("cmpl-" if req.text_completion else "chatcmpl-") + uuid.uuid4().hex
        created = int(time.time())
        streamer = ReplyStreamer(**req.shape)
        n_tokens = 0
        named: set[int] = set()          # tool calls whose id and name went out

        def chunk(delta: Delta, finish: str | None = None, usage: Usage | None = None,
                  logprobs: list | None = None) -> ModelResponseStream:
            kwargs = {"usage": usage} if usage is not None else {}
            choice = StreamingChoices(index=0, delta=delta, finish_reason=finish)
            if logprobs is not None:
                choice.logprobs = ChoiceLogprobs(content=logprobs)
            return ModelResponseStream(id=chunk_id, created=created, model=model, choices=[choice], **kwargs)

        def call_deltas() -> list[ChatCompletionDeltaToolCall] | None:
            out = []
            for ev in streamer.take_tool_events():
                if ev.kind == "invalid":
                    continue                 # reported with the last chunk (provider_specific_fields)
                first = ev.index not in named
                named.add(ev.index)
                out.append(ChatCompletionDeltaToolCall(
                    index=ev.index, id=ev.id if first else None, type="function" if first else None,
                    function=Function(name=ev.name if first else None,
                                      arguments=ev.arguments if ev.kind == "arguments" else "")))
            return out or None

        try:
            for piece in stream:
                n_tokens += len(piece.tokens)
                lp = _openai_logprobs(piece.logprobs) if req.logprobs and getattr(piece, "logprobs", None) else None
                if piece.finish_reason is None:
                    dr, dc = streamer.feed(piece.text)
                    calls = call_deltas()
                    if dr or dc or calls or lp:
                        yield chunk(Delta(content=dc or None, reasoning_content=dr or None, role="assistant",
                                          tool_calls=calls), logprobs=lp)
                    continue
                dr, dc, reply = streamer.finish(piece.text)
                delta = Delta(content=dc if (dc or req.text_completion) else None, reasoning_content=dr or None,
                              role="assistant", tool_calls=call_deltas())
                if reply.invalid_tool_calls:
                    delta.provider_specific_fields = {"invalid_tool_calls": reply.invalid_tool_calls}
                self._report(piece.stats)
                yield chunk(delta, self._finish_reason(reply, piece.finish_reason),
                            self._usage(piece.stats, n_tokens), logprobs=lp)
        finally:
            stream.close()

    async def acompletion(self, model: str, messages: list, api_base: str = None,
                          custom_prompt_dict: dict = None, model_response: ModelResponse = None,
                          print_verbose=None, encoding=None, api_key=None, logging_obj=None,
                          optional_params: dict = None, acompletion=None, litellm_params=None,
                          logger_fn=None, headers={}, timeout=None, client=None) -> ModelResponse:
        req = await run_in_thread(lambda: self._request(model, messages, optional_params, litellm_params))
        return await self._on_engine(req.engine, lambda: self._complete(req, model, model_response))

    async def astreaming(self, model: str, messages: list, api_base: str = None,
                         custom_prompt_dict: dict = None, model_response: ModelResponse = None,
                         print_verbose=None, encoding=None, api_key=None, logging_obj=None,
                         optional_params: dict = None, acompletion=None, litellm_params=None,
                         logger_fn=None, headers={}, timeout=None,
                         client=None) -> AsyncIterator[ModelResponseStream]:
        # the request is translated here, so a bad one fails before the stream starts
        req = await run_in_thread(lambda: self._request(model, messages, optional_params, litellm_params))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def put(item, exc=None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (item, exc))
            except RuntimeError:           # the loop is gone: nobody is listening any more
                pass

        def produce() -> None:
            try:
                if cancelled.is_set():
                    return
                chunks = self._stream_chunks(self._generate(req, stream=True), req, model)
                try:
                    for c in chunks:
                        if cancelled.is_set():
                            break
                        put(c)
                finally:
                    chunks.close()         # ends the engine's stream: the engine is free again
                put(DONE)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
                put(DONE, exc)

        job = self._submit(req.engine, produce)
        try:
            async for item in drain(queue):
                yield item
        finally:
            cancelled.set()
            job.cancel()                   # a request still waiting for the engine never runs

    # --- the engines' worker threads --------------------------------------------------------------
    def _submit(self, eng, fn) -> concurrent.futures.Future:
        observer = self.observer
        if observer is not None:
            observer.engine_waiting(1)

        def run():
            if observer is not None:
                observer.engine_waiting(-1)
                observer.engine_running(1)
            try:
                return fn()
            finally:
                if observer is not None:
                    observer.engine_running(-1)

        job = _engine_worker(eng).submit(run)
        if observer is not None:
            job.add_done_callback(lambda f: f.cancelled() and observer.engine_waiting(-1))
        return job

    async def _on_engine(self, eng, fn):
        return await asyncio.wrap_future(self._submit(eng, fn))



class _EngineWorkers:
    """The threads that run an engine's async requests, one per slot (the engine serves that many
    at once; the rest wait in this queue, not in threads of their own). All of them start with
    the pool: a burst of requests adds no thread."""

    def __init__(self, n: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"openjet-engine-{i}", daemon=True).start()
        self._n = n

    def submit(self, fn) -> concurrent.futures.Future:
        job: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((job, fn))
        return job

    def shutdown(self) -> None:
        for _ in range(self._n):
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fn = item
            if not job.set_running_or_notify_cancel():
                continue                    # cancelled while waiting: never runs
            try:
                job.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the job
                job.set_exception(exc)


_workers: "weakref.WeakKeyDictionary[Any, _EngineWorkers]" = weakref.WeakKeyDictionary()
_workers_lock = threading.Lock()


def _engine_worker(eng) -> _EngineWorkers:
    with _workers_lock:
        pool = _workers.get(eng)
        if pool is None:
            pool = _workers[eng] = _EngineWorkers(getattr(eng, "n_slots", 1))
            weakref.finalize(eng, pool.shutdown)     # the threads end with the engine
        return pool


def _as_dict(m: Any) -> dict:
    if isinstance(m, dict):
        return m
    return m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)


def _check_roles(messages: list) -> None:
    for i, m in enumerate(messages):
        role = _as_dict(m).get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}")


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": bias in [-100, 100]}) -> the engine's {id: bias}."""
    if not isinstance(bias, dict):
        raise _bad_request(f"logit_bias must be an object of token id -> bias, got {type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise _bad_request(f"logit_bias key {k!r} is not a token id") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100 or tok < 0:
            raise _bad_request(f"logit_bias[{k!r}] must be a number in [-100, 100] for a token id >= 0")
        out[tok] = float(v)
    return out


def _constraint(tools: list[dict] | None, tool_choice: Any, response_format: Any) -> dict | None:
    """The engine constraint (constraint_api's plain-dict form) a request asks for: a forced tool
    call (tool_choice "required" or a named function) or a response_format; None for free text."""
    forced = None
    if tools and tool_choice == "required":
        forced = {"type": "tool_call", "tools": tools, "name": None}
    elif tools and isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        forced = {"type": "tool_call", "tools": tools, "name": name}
    rf = None
    if isinstance(response_format, dict) and response_format.get("type") == "json_object":
        rf = {"type": "json_object"}
    elif isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema") if isinstance(js, dict) else None
        rf = {"type": "json_schema", "schema": schema} if schema is not None else {"type": "json_object"}
    elif response_format not in (None, {"type": "text"}) and not (
            isinstance(response_format, dict) and response_format.get("type") == "text"):
        raise ValueError(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema'}}, "
                         f"got {response_format!r}")
    if forced and rf:
        raise ValueError("tool_choice forces a tool call and response_format asks for JSON text: give one")
    return forced or rf


def _openai_logprobs(entries) -> list[dict]:
    """Engine TokenLogprobs -> OpenAI's choices[].logprobs.content entries."""
    def one(e) -> dict:
        return {"token": e.bytes.decode("utf-8", errors="replace"), "logprob": float(e.logprob),
                "bytes": list(e.bytes)}
    return [dict(one(e), top_logprobs=[one(t) for t in e.top_logprobs]) for e in entries]


def _aliases_from_env() -> dict[str, str]:
    """OPENJET_MODELS='name=/path/a.gguf,other=/path/b.gguf' (set by `openjet serve`)."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in os.environ.get("OPENJET_MODELS", "").split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"OPENJET_MODELS entry {item!r} is not name=path")
        out[name.strip()] = path.strip()
    return out


def _load_options_from_env() -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if os.environ.get("OPENJET_BACKEND"):
        opts["backend"] = os.environ["OPENJET_BACKEND"]
    for key, env in (("n_ctx", "OPENJET_N_CTX"), ("draft_depth", "OPENJET_DRAFT_DEPTH")):
        if os.environ.get(env):
            try:
                opts[key] = int(os.environ[env])
            except ValueError:
                raise ValueError(f"{env} must be an integer, got {os.environ[env]!r}") from None
    slots = os.environ.get("OPENJET_SLOTS")
    if slots:
        try:
            opts["n_slots"] = None if slots == "auto" else int(slots)
        except ValueError:
            raise ValueError(f"OPENJET_SLOTS must be an integer or 'auto', got {slots!r}") from None
    # MiB of host memory for each engine's prefix cache (0: none); "auto": the engine's default
    # (prefix_cache.DEFAULT_PREFIX_CACHE_BYTES with several slots)
    cache_mb = os.environ.get("OPENJET_PREFIX_CACHE_MB")
    if cache_mb:
        from openjet_plugin.cli import check_prefix_cache_mb

        mb = None if cache_mb == "auto" else check_prefix_cache_mb(cache_mb, "OPENJET_PREFIX_CACHE_MB")
        opts["prefix_cache_bytes"] = None if mb is None else mb << 20
    return opts


# The handler a LiteLLM proxy config names (`custom_handler: openjet_plugin.adapters.litellm.proxy_handler`):
# aliases only — "default", "openjet-default" and the names in OPENJET_MODELS — never a path
# from a request.
proxy_handler = OpenJetProvider(allow_paths=False)


def configure_proxy_handler() -> OpenJetProvider:
    """(Re)read OPENJET_MODELS / OPENJET_BACKEND / OPENJET_N_CTX / OPENJET_DRAFT_DEPTH / OPENJET_SLOTS /
    OPENJET_PREFIX_CACHE_MB into `proxy_handler` (done at import, and again by `openjet serve`
    after it sets them). OPENJET_SLOTS: requests each engine runs at once, or "auto" (the
    backend's choice); OPENJET_PREFIX_CACHE_MB: MiB of host memory for each engine's prefix cache,
    0 for none, or "auto" (2048 with several slots, none with one)."""
    proxy_handler.aliases = _aliases_from_env()
    proxy_handler.load_options.update(_load_options_from_env())
    return proxy_handler


configure_proxy_handler()


def register(provider: OpenJetProvider | None = None) -> OpenJetProvider:
    """Make `litellm.completion(model="openjet/<path or alias>")` use `provider` (a new one that
    accepts paths, if None). Registering again replaces the previous openjet entry."""
    handler = provider if provider is not None else OpenJetProvider()
    litellm.custom_provider_map = [entry for entry in litellm.custom_provider_map
                                   if entry.get("provider") != PROVIDER]
    litellm.custom_provider_map.append({"provider": PROVIDER, "custom_handler": handler})
    from litellm.utils import custom_llm_setup

    custom_llm_setup()
    return handler


__all__ = ["OpenJetProvider", "register", "proxy_handler", "configure_proxy_handler", "PROVIDER"]
