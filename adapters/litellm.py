"""LiteLLM integration: the custom provider "openjet".

    from openjet_plugin.adapters.litellm import register
    register()
    litellm.completion(model="openjet/default", messages=[{"role": "user", "content": "Hi"}])
    litellm.completion(model="openjet//models/qwen3.8-27b-q4_k_m.gguf", messages=...)

`OpenJetProvider` implements LiteLLM's `CustomLLM` (completion, streaming, acompletion,
astreaming). It renders the messages with the model's own chat template, runs `Engine.generate`
and returns LiteLLM's `ModelResponse` (or streaming chunks) with usage. One engine per model file
and load options is loaded once and shared by every call (`_shared.shared_engine`); the engine's
lock serialises concurrent requests.

Request options beyond OpenAI's: `top_k`, `min_p`, `repeat_penalty`; thinking with
`enable_thinking=True` (or `chat_template_kwargs={"enable_thinking": True}`, or any
`reasoning_effort` but "none" — which LiteLLM lets through to a custom provider only with
`allowed_openai_params=["reasoning_effort"]`), returned in `message.reasoning_content` (streamed in
`delta.reasoning_content`). Tools are rendered into the template's tools section; the model's
`<tool_call>{json}</tool_call>` blocks come back as OpenAI `tool_calls` (finish_reason
"tool_calls"); malformed blocks come back in `message.provider_specific_fields["invalid_tool_calls"]`
rather than raising.

Model names: "default" (the embedded model), an alias from the provider's `aliases`, or — only
when the provider was made with `allow_paths=True`, as `register()` does for library use — a path
to a GGUF file. The proxy's handler (`proxy_handler`) accepts aliases only, so a request cannot
make a server open a file of its choosing (see serve.py).

Embeddings, images and audio are not supported (LiteLLM reports CustomLLM's "not implemented").
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, AsyncIterator, Iterator

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no network fetch at import

import litellm  # noqa: E402
from litellm import CustomLLM  # noqa: E402
from litellm.llms.custom_llm import CustomLLMError  # noqa: E402
from litellm.types.utils import (  # noqa: E402
    ChatCompletionDeltaToolCall,
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
    Reply,
    ReplyStreamer,
    iterate_in_thread,
    openai_messages_for_template,
    openai_tools,
    prompt_opens_think,
    run_in_thread,
    select_tools,
    shared_engine,
)

PROVIDER = "openjet"

# OpenAI request field -> Engine.generate keyword
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
             "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repeat_penalty": "repeat_penalty"}
# accepted and meaningless for one local sequence (or handled by LiteLLM itself)
_IGNORED = {"n", "user", "stream", "stream_options", "logit_bias", "parallel_tool_calls", "metadata",
            "extra_body", "max_retries", "timeout", "store", "service_tier"}


class OpenJetProvider(CustomLLM):
    """LiteLLM custom provider running qwen35 GGUF models on the openjet engine.

    aliases: model name -> GGUF path ("default" always means the embedded model).
    allow_paths: accept a model name that is a path to a file (library use); False for servers.
    backend, n_ctx, draft_depth, kv_type: how engines are loaded (see `openjet_plugin.load`).
    """

    def __init__(self, *, aliases: dict[str, str] | None = None, allow_paths: bool = True,
                 backend: str = "auto", n_ctx: int = 4096, draft_depth: int = 4, kv_type: str = "f16"):
        super().__init__()
        self.aliases = dict(aliases or {})
        self.allow_paths = allow_paths
        self.load_options = dict(backend=backend, n_ctx=n_ctx, draft_depth=draft_depth, kv_type=kv_type)

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
    def _request(self, model: str, messages: list, optional_params: dict):
        params = dict(optional_params or {})
        sampling: dict[str, Any] = {}
        for key, target in _SAMPLING.items():
            if params.get(key) is not None:
                sampling[target] = params.pop(key)
            else:
                params.pop(key, None)
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]
        thinking = bool(params.pop("enable_thinking", False))
        template_kwargs = params.pop("chat_template_kwargs", None) or {}
        if "enable_thinking" in template_kwargs:
            thinking = bool(template_kwargs["enable_thinking"])
        effort = params.pop("reasoning_effort", None)
        if effort is not None:
            thinking = effort not in ("none", None, False)
        tools = select_tools(openai_tools(params.pop("tools", None)), params.pop("tool_choice", None))
        for key in _IGNORED:
            params.pop(key, None)
        if params:
            raise CustomLLMError(status_code=400, message=(
                f"unsupported request options for openjet: {sorted(params)}; supported: "
                f"{sorted(_SAMPLING)}, tools, tool_choice, enable_thinking, chat_template_kwargs, "
                f"reasoning_effort"))
        eng = self.engine(model)
        try:
            prompt = eng.render_chat(openai_messages_for_template(messages), tools=tools,
                                     enable_thinking=thinking)
        except ValueError as exc:
            raise CustomLLMError(status_code=400, message=str(exc)) from None
        shape = dict(thinking=thinking, tools=bool(tools), prompt_opens_think=prompt_opens_think(prompt))
        return eng, prompt, sampling, shape

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
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for c in reply.tool_calls]

    # --- CustomLLM --------------------------------------------------------------------------------
    def completion(self, model: str, messages: list, api_base: str = None, custom_prompt_dict: dict = None,
                   model_response: ModelResponse = None, print_verbose=None, encoding=None, api_key=None,
                   logging_obj=None, optional_params: dict = None, acompletion=None, litellm_params=None,
                   logger_fn=None, headers={}, timeout=None, client=None) -> ModelResponse:
        eng, prompt, sampling, shape = self._request(model, messages, optional_params)
        try:
            result = eng.generate(prompt, **sampling)
        except ValueError as exc:          # bad sampling values, context overflow
            raise CustomLLMError(status_code=400, message=str(exc)) from None
        reply = Reply(result.text, **shape)
        message = Message(content=reply.content, role="assistant", tool_calls=self._tool_calls(reply),
                          reasoning_content=reply.reasoning)
        if reply.invalid_tool_calls:
            message.provider_specific_fields = {"invalid_tool_calls": reply.invalid_tool_calls}
        response = model_response if model_response is not None else ModelResponse()
        response.choices[0].message = message
        response.choices[0].finish_reason = self._finish_reason(reply, result.finish_reason)
        response.model = model
        response.usage = self._usage(result.stats, len(result.tokens))
        response._hidden_params["openjet"] = {"backend": eng.backend_name,
                                              "stats": vars(result.stats).copy()}
        return response

    def streaming(self, model: str, messages: list, api_base: str = None, custom_prompt_dict: dict = None,
                  model_response: ModelResponse = None, print_verbose=None, encoding=None, api_key=None,
                  logging_obj=None, optional_params: dict = None, acompletion=None, litellm_params=None,
                  logger_fn=None, headers={}, timeout=None, client=None) -> Iterator[ModelResponseStream]:
        eng, prompt, sampling, shape = self._request(model, messages, optional_params)
        try:
            stream = eng.generate(prompt, stream=True, **sampling)
        except ValueError as exc:
            raise CustomLLMError(status_code=400, message=str(exc)) from None
        return self._stream_chunks(stream, shape, model)

    def _stream_chunks(self, stream, shape: dict, model: str) -> Iterator[ModelResponseStream]:
        chunk_id = "chatcmpl-" + uuid.uuid4().hex
        created = int(time.time())
        streamer = ReplyStreamer(**shape)
        n_tokens = 0

        def chunk(delta: Delta, finish: str | None = None, usage: Usage | None = None) -> ModelResponseStream:
            kwargs = {"usage": usage} if usage is not None else {}
            return ModelResponseStream(id=chunk_id, created=created, model=model,
                                       choices=[StreamingChoices(index=0, delta=delta, finish_reason=finish)],
                                       **kwargs)

        try:
            for piece in stream:
                n_tokens += len(piece.tokens)
                if piece.finish_reason is None:
                    dr, dc = streamer.feed(piece.text)
                    if dr or dc:
                        yield chunk(Delta(content=dc or None, reasoning_content=dr or None, role="assistant"))
                    continue
                dr, dc, reply = streamer.finish(piece.text)
                calls = self._tool_calls(reply)
                delta_calls = ([ChatCompletionDeltaToolCall(id=c["id"], type="function", index=i,
                                                            function=Function(**c["function"]))
                                for i, c in enumerate(calls)] if calls else None)
                delta = Delta(content=dc or None, reasoning_content=dr or None, role="assistant",
                              tool_calls=delta_calls)
                if reply.invalid_tool_calls:
                    delta.provider_specific_fields = {"invalid_tool_calls": reply.invalid_tool_calls}
                yield chunk(delta, self._finish_reason(reply, piece.finish_reason),
                            self._usage(piece.stats, n_tokens))
        finally:
            stream.close()

    async def acompletion(self, model: str, messages: list, api_base: str = None,
                          custom_prompt_dict: dict = None, model_response: ModelResponse = None,
                          print_verbose=None, encoding=None, api_key=None, logging_obj=None,
                          optional_params: dict = None, acompletion=None, litellm_params=None,
                          logger_fn=None, headers={}, timeout=None, client=None) -> ModelResponse:
        return await run_in_thread(lambda: self.completion(
            model, messages, model_response=model_response, optional_params=optional_params))

    async def astreaming(self, model: str, messages: list, api_base: str = None,
                         custom_prompt_dict: dict = None, model_response: ModelResponse = None,
                         print_verbose=None, encoding=None, api_key=None, logging_obj=None,
                         optional_params: dict = None, acompletion=None, litellm_params=None,
                         logger_fn=None, headers={}, timeout=None,
                         client=None) -> AsyncIterator[ModelResponseStream]:
        # the request is translated here, so a bad one fails before the stream starts
        eng, prompt, sampling, shape = await run_in_thread(
            lambda: self._request(model, messages, optional_params))

        def chunks():
            try:
                stream = eng.generate(prompt, stream=True, **sampling)
            except ValueError as exc:
                raise CustomLLMError(status_code=400, message=str(exc)) from None
            return self._stream_chunks(stream, shape, model)

        async for c in iterate_in_thread(chunks):
            yield c


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
    return opts


# The handler a LiteLLM proxy config names (`custom_handler: openjet_plugin.adapters.litellm.proxy_handler`):
# aliases only — "default", "openjet-default" and the names in OPENJET_MODELS — never a path
# from a request.
proxy_handler = OpenJetProvider(allow_paths=False)


def configure_proxy_handler() -> OpenJetProvider:
    """(Re)read OPENJET_MODELS / OPENJET_BACKEND / OPENJET_N_CTX / OPENJET_DRAFT_DEPTH into
    `proxy_handler` (done at import, and again by `openjet serve` after it sets them)."""
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
