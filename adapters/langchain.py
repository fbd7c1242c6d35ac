"""LangChain integration: `ChatOpenJet` (a chat model) and `OpenJetLLM` (a text-completion LLM).

    from openjet_plugin.adapters.langchain import ChatOpenJet
    chat = ChatOpenJet(temperature=0, max_tokens=64)          # the embedded default model
    chat.invoke("Hello").content

Both translate LangChain calls into `Engine.generate` / `Engine.render_chat` and back; the engine
samples, stops and counts. Models are loaded once per (file, backend, n_ctx, draft depth, KV type)
and shared by every instance, so constructing a model is cheap and loads nothing.

Chat specifics:
- Thinking: `enable_thinking=True` (a field, or per call) renders the template in thinking mode;
  the `<think>` part of the reply goes to `additional_kwargs["reasoning_content"]` (streamed too),
  the rest to `content`.
- Tools: `bind_tools(...)` renders the tools into the chat template's tools section; the model's
  `<tool_call>` blocks (Qwen3.5's `<function=...><parameter=...>` form or the JSON form, see
  `openjet_plugin.parsing`) become `AIMessage.tool_calls`, streamed as `tool_call_chunks` as each
  call completes; malformed ones become `invalid_tool_calls` (never an exception).
  `AIMessage.tool_calls` and `ToolMessage`s in the history go back in as the template expects.
  `tool_choice`: "none" hides the tools; a tool name, "any", "required" or True force a call (the
  engine constrains decoding to a call of that tool / of one of the tools); "auto" lets the model
  decide.
- Constrained output: `response_format` (OpenAI's {"type": "json_object"} or {"type":
  "json_schema", "json_schema": {"schema": ...}}, per call or via `bind`) makes the engine decode
  only text that matches. `with_structured_output(schema, method=...)` uses it:
  "function_calling" (default: the schema as a forced tool), "json_schema", "json_mode". A reply
  that still does not parse (cut short by max_tokens) raises `OutputParserException`, or with
  `include_raw=True` comes back as `parsing_error`.
- `logprobs=True` / `top_logprobs=N` (fields or per call): `response_metadata["logprobs"]` in
  langchain-openai's shape ({"content": [{"token", "bytes", "logprob", "top_logprobs"}]}).
- Token counts (`get_token_ids`, `get_num_tokens`, `get_num_tokens_from_messages`, hence
  `trim_messages(token_counter=chat)`) come from the model's own tokenizer and chat template.
- `usage_metadata` on every reply (`input_token_details.cache_read` = prompt tokens reused from
  the previous request), `response_metadata` with the model name, backend, finish reason,
  timings and, on the native backend, the speculative-decoding counters.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, AsyncIterator, Iterator, Literal, Sequence

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.llms import LLM
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.v1 import ValidationError as ValidationErrorV1

from openjet_plugin.parsing import TOOL_OPEN

from ._shared import (
    Reply,
    ReplyStreamer,
    SAMPLING_KEYS,
    iterate_in_thread,
    model_label,
    prompt_opens_think,
    run_in_thread,
    select_tools,
    shared_engine,
    template_tool_call,
    text_of,
)

PROVIDER = "openjet"

# per-call keywords that are LangChain's own plumbing, not requests to the model
_IGNORED_CALL_KEYS = ("stream", "ls_structured_output_format")


class _OpenJetParams(BaseModel):
    """Fields shared by the chat model and the text LLM: which model, how it runs, how it samples."""

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model: str | None = Field(default=None, alias="model_path")
    """Path to a qwen35 GGUF file, or "default" / None for the embedded default model."""

    backend: Literal["auto", "llama.cpp", "native"] = "auto"
    """"native" (CUDA, speculative), "llama.cpp" (CPU), or "auto": native where it can run."""

    n_ctx: int = 4096
    """Context window in tokens (prompt plus reply)."""

    draft_depth: int = 4
    """MTP draft tokens per speculative cycle on the native backend (0 turns drafting off)."""

    kv_type: Literal["f16", "q8_0"] = "f16"
    """Type of the attention KV cache."""

    n_slots: int | None = 1
    """Conversations the engine holds at once: that many concurrent calls (threads, `abatch`)
    generate together, sharing the engine's passes. None: the backend's choice for a server (4;
    the native engine holds at most 8, and speculates for a request served alone)."""

    temperature: float = 0.8
    """Sampling temperature; 0 is greedy."""

    max_tokens: int | None = 256
    """Most tokens to generate; None: until the context is full."""

    top_p: float = 0.95
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    top_k: int = 40
    """Keep the k most likely tokens (0: no limit)."""

    min_p: float = 0.05
    """Drop tokens less likely than min_p times the most likely one."""

    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already present in the recent context."""

    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of a token in the recent context."""

    repeat_penalty: float = 1.0
    """llama.cpp's repetition penalty (1.0: off)."""

    seed: int | None = None
    """Seed of the sampler; None draws a fresh one per request."""

    stop: list[str] | None = None
    """Strings that end the reply (not included in it)."""

    def _engine_for(self, model: str | None):
        return shared_engine(model if model is not None else self.model, backend=self.backend,
                             n_ctx=self.n_ctx, draft_depth=self.draft_depth, kv_type=self.kv_type,
                             n_slots=self.n_slots)

    def _sampling(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """This call's sampling options: the fields, overridden by per-call keywords."""
        params = {k: getattr(self, k) for k in SAMPLING_KEYS}
        for k in SAMPLING_KEYS:
            if k in kwargs:
                params[k] = kwargs.pop(k)
        if stop is not None:
            params["stop"] = stop
        params["stop"] = list(params["stop"] or []) or None
        return params

    def _label(self, model: str | None) -> str:
        return model_label(model if model is not None else self.model)


def _usage(stats, output_tokens: int) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=stats.prompt_tokens,
        output_tokens=output_tokens,
        total_tokens=stats.prompt_tokens + output_tokens,
        input_token_details={"cache_read": stats.cached_prompt_tokens},
    )


def _response_metadata(eng, label: str, finish_reason: str | None, stats) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "model_name": label,
        "model_provider": PROVIDER,
        "backend": eng.backend_name,
        "finish_reason": finish_reason,
        "prefill_seconds": stats.prefill_seconds,
        "decode_seconds": stats.decode_seconds,
        "tokens_per_second": stats.tokens_per_second,
    }
    if eng.supports_speculative:
        meta["speculative"] = {
            "cycles": stats.cycles,
            "drafts_proposed": stats.drafts_proposed,
            "drafts_accepted": stats.drafts_accepted,
            "acceptance_rate": (stats.drafts_accepted / stats.drafts_proposed
                                if stats.drafts_proposed else 0.0),
        }
    return meta


def _template_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages -> the OpenAI-style dicts the Qwen chat template reads."""
    out: list[dict] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": text_of(m.content)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": text_of(m.content)})
        elif isinstance(m, AIMessage):
            msg: dict[str, Any] = {"role": "assistant", "content": text_of(m.content)}
            calls = [template_tool_call(tc["name"], tc["args"], tc.get("id")) for tc in m.tool_calls]
            calls += [template_tool_call(tc.get("name") or "", tc.get("args") or "", tc.get("id"))
                      for tc in m.invalid_tool_calls]
            if calls:
                msg["tool_calls"] = calls
            reasoning = m.additional_kwargs.get("reasoning_content")
            if isinstance(reasoning, str):
                msg["reasoning_content"] = reasoning
            out.append(msg)
        elif isinstance(m, (ToolMessage, FunctionMessage)):
            content = m.content if isinstance(m.content, (str, list)) else json.dumps(m.content)
            msg = {"role": "tool", "content": text_of(content)}
            if isinstance(m, ToolMessage):
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": text_of(m.content)})
        else:
            raise ValueError(f"unsupported message type {type(m).__name__}")
    # Qwen's templates take one system message, first: consecutive ones at the start become one
    while len(out) > 1 and out[0]["role"] == out[1]["role"] == "system":
        out[0:2] = [{"role": "system", "content": out[0]["content"] + "\n\n" + out[1]["content"]}]
    return out


def _lc_tool_calls(reply: Reply) -> tuple[list, list]:
    calls = [tool_call(name=c["name"], args=c["arguments"], id=c["id"]) for c in reply.tool_calls]
    invalid = [invalid_tool_call(name=c["name"], args=_invalid_args(c["arguments"]), id=c["id"],
                                 error=c["error"]) for c in reply.invalid_tool_calls]
    return calls, invalid


class ChatOpenJet(_OpenJetParams, BaseChatModel):
    """Chat model on the openjet engine (qwen35 GGUF models, native CUDA or llama.cpp).

    Example:
        ```python
        from openjet_plugin.adapters.langchain import ChatOpenJet

        chat = ChatOpenJet(model="/models/qwen3.8-27b-q4_k_m.gguf", temperature=0.7)
        chat.invoke([("system", "Be brief."), ("human", "Name a prime.")])
        ```
    """

    enable_thinking: bool = False
    """Let the model think first; the thinking is returned in `additional_kwargs["reasoning_content"]`."""

    streaming: bool = False
    """Stream by default in `invoke` (tokens reach `on_llm_new_token` callbacks as they come)."""

    @property
    def _llm_type(self) -> str:
        return "openjet-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self._label(None), "backend": self.backend, "n_ctx": self.n_ctx,
                "draft_depth": self.draft_depth, "kv_type": self.kv_type,
                **{k: getattr(self, k) for k in SAMPLING_KEYS}, "enable_thinking": self.enable_thinking}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs["model"] if isinstance(kwargs.get("model"), str) else self._label(None)
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    logprobs: bool = False
    """Return each generated token's log-probability in `response_metadata["logprobs"]`."""

    top_logprobs: int | None = None
    """With logprobs: also the most likely alternatives at each position (0-20)."""

    # --- tools ---------------------------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Any | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer tools to the model (rendered into the template's tools section).

        tool_choice: None/"auto" (the model decides), "any"/"required"/True (a call to one of the
        tools is forced), "none"/False (tools hidden), or a tool name / {"function": {"name": ...}}
        (a call to that tool is forced). A forced call's arguments match the tool's schema.
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        select_tools(formatted, _normalise_tool_choice(tool_choice))   # validates a named choice now
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    # --- structured output -----------------------------------------------------------------------
    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """A runnable whose output is `schema` filled in by the model (a pydantic instance for a
        pydantic class, else a dict).

        method: "json_schema" (the default, as langchain-openai's) constrains the reply to the
        schema, with no tool-call wrapper for the model to get wrong; "function_calling" forces a
        call of the schema as a tool; "json_mode" to any JSON object, or to the schema when one is given
        (the prompt should ask for JSON either way: the model then writes it as it was trained to). Decoding is constrained in all three, so a reply fails to parse only when it is
        cut short (max_tokens): that raises `OutputParserException`, or with include_raw=True
        returns {"raw": message, "parsed": None, "parsing_error": the exception}.
        """
        if kwargs:
            raise ValueError(f"with_structured_output got unknown keyword arguments {sorted(kwargs)}")
        if method not in ("function_calling", "json_schema", "json_mode"):
            raise ValueError(f"with_structured_output: unknown method {method!r}; expected "
                             f"'function_calling', 'json_schema' or 'json_mode'")
        if schema is None and method != "json_mode":
            raise ValueError(f"with_structured_output: method {method!r} needs a schema")
        model_class = schema if isinstance(schema, type) and is_basemodel_subclass(schema) else None
        ls_format = {"kwargs": {"method": method, "strict": strict},
                     "schema": convert_to_json_schema(schema) if schema is not None else None}
        if method == "function_calling":
            tool = convert_to_openai_tool(schema, strict=strict)
            name = tool["function"]["name"]
            llm = self.bind_tools([tool], tool_choice=name, ls_structured_output_format=ls_format)
            parser = RunnableLambda(lambda msg: _parse_tool_output(msg, name, model_class))
        else:
            # json_mode with a schema is held to the schema too: the engine can enforce it, and a
            # caller who passes a schema wants output that matches it
            if schema is not None:
                json_schema = convert_to_json_schema(schema)
                if strict:
                    json_schema = _closed_objects(json_schema)
                fmt = {"type": "json_schema", "json_schema": {
                    "name": json_schema.get("title", "output"), "schema": json_schema, "strict": strict}}
            else:
                fmt = {"type": "json_object"}
            llm = self.bind(response_format=fmt, ls_structured_output_format=ls_format)
            parser = RunnableLambda(lambda msg: _parse_json_output(msg, model_class))
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    # --- token counts --------------------------------------------------------------------------
    def get_token_ids(self, text: str) -> list[int]:
        """The model's own tokens for `text` (special-token text such as <|im_end|> is one token)."""
        return self._engine_for(None).tokenize(text, add_special=False)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence | None = None) -> int:
        """Prompt tokens these messages (and tools) take in the model's chat template.

        The count is a sum over the messages, each measured as the template renders it after a
        user turn (minus that turn), so that it adds up over any slice of a conversation, as
        `trim_messages` needs (it counts slices, even reversed ones, which a template that checks
        the order of turns would refuse to render as a whole). It is exact for templates that
        render a turn the same wherever it stands (the default model's); Qwen3.5's writes an empty
        think block only in turns after the last question, so earlier assistant turns count a few
        tokens more than they take (a count that errs high, which trimming tolerates).
        """
        eng = self._engine_for(None)

        def size(msgs: list[dict], tools_: list[dict] | None = None) -> int:
            return len(eng.tokenize(eng.render_chat(msgs, tools=tools_, add_generation_prompt=False),
                                    add_special=False))

        anchor = [{"role": "user", "content": "?"}]
        base = size(anchor)
        total = 0
        for m in _template_messages(messages):
            if m["role"] == "system":
                total += size([m] + anchor) - base
            else:
                total += size(anchor + [m]) - base
        if tools:
            total += size(anchor, [convert_to_openai_tool(t) for t in tools]) - base
        return total

    # --- generation ------------------------------------------------------------------------------
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]):
        kwargs = dict(kwargs)
        for k in _IGNORED_CALL_KEYS:
            kwargs.pop(k, None)
        model = kwargs.pop("model", None)
        thinking = bool(kwargs.pop("enable_thinking", self.enable_thinking))
        choice = _normalise_tool_choice(kwargs.pop("tool_choice", None))
        tools = select_tools(kwargs.pop("tools", None), choice)
        constraint = _constraint(kwargs.pop("response_format", None), tools, choice)
        logprobs = bool(kwargs.pop("logprobs", self.logprobs))
        top_logprobs = kwargs.pop("top_logprobs", self.top_logprobs)
        params = self._sampling(stop, kwargs)
        if kwargs:
            raise ValueError(f"ChatOpenJet got unknown keyword arguments {sorted(kwargs)}; sampling "
                             f"options are {', '.join(SAMPLING_KEYS)}, plus enable_thinking, tools, "
                             f"tool_choice, response_format, logprobs, top_logprobs and model")
        if constraint is not None:
            params["constraint"] = constraint
        if logprobs or top_logprobs:
            params["logprobs"] = True
            params["top_logprobs"] = int(top_logprobs or 0)
        eng = self._engine_for(model)
        prompt = eng.render_chat(_template_messages(messages), tools=tools, enable_thinking=thinking)
        shape = dict(thinking=thinking, tools=tools or None, prompt_opens_think=prompt_opens_think(prompt))
        return eng, prompt, params, shape, self._label(model)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        eng, prompt, params, shape, label = self._prepare(messages, stop, kwargs)
        result = eng.generate(prompt, **params)
        reply = Reply(result.text, **shape)
        calls, invalid = _lc_tool_calls(reply)
        additional = {"reasoning_content": reply.reasoning} if reply.reasoning is not None else {}
        meta = _response_metadata(eng, label, result.finish_reason, result.stats)
        if params.get("logprobs"):
            meta["logprobs"] = _openai_logprobs(getattr(result, "logprobs", None))
        message = AIMessage(
            content=reply.content,
            additional_kwargs=additional,
            tool_calls=calls,
            invalid_tool_calls=invalid,
            usage_metadata=_usage(result.stats, len(result.tokens)),
            response_metadata=meta,
        )
        return ChatResult(generations=[ChatGeneration(
            message=message, generation_info={"finish_reason": result.finish_reason})])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        eng, prompt, params, shape, label = self._prepare(messages, stop, kwargs)
        streamer = ReplyStreamer(**shape)
        n_tokens = 0
        pending_logprobs: list = []      # logprobs of tokens whose text has not gone out yet
        named: set[int] = set()          # tool calls whose name has gone out
        stream = eng.generate(prompt, stream=True, **params)
        try:
            for piece in stream:
                n_tokens += len(piece.tokens)
                pending_logprobs += getattr(piece, "logprobs", None) or []
                if piece.finish_reason is None:
                    dr, dc = streamer.feed(piece.text)
                    calls = _tool_call_chunks(streamer.take_tool_events(), named)
                    if dr or dc or calls:
                        info = None
                        if params.get("logprobs"):
                            info = {"logprobs": _openai_logprobs(pending_logprobs)}
                            pending_logprobs = []
                        chunk = _chunk(dc, dr, calls, info)
                        if run_manager:
                            run_manager.on_llm_new_token(dc, chunk=chunk)
                        yield chunk
                    continue
                dr, dc, reply = streamer.finish(piece.text)
                info: dict[str, Any] = {"finish_reason": piece.finish_reason}
                if params.get("logprobs"):
                    info["logprobs"] = _openai_logprobs(pending_logprobs)
                last = ChatGenerationChunk(
                    message=AIMessageChunk(
                        content=dc,
                        additional_kwargs={"reasoning_content": dr} if dr else {},
                        tool_call_chunks=_tool_call_chunks(streamer.take_tool_events(), named),
                        usage_metadata=_usage(piece.stats, n_tokens),
                        response_metadata=_response_metadata(eng, label, piece.finish_reason, piece.stats),
                        chunk_position="last",
                    ),
                    generation_info=info,
                )
                if run_manager:
                    run_manager.on_llm_new_token(dc, chunk=last)
                yield last
        finally:
            stream.close()

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await run_in_thread(lambda: self._generate(messages, stop, None, **kwargs))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop, None, **kwargs)):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def _chunk(content: str, reasoning: str, tool_calls: list | None = None,
           info: dict | None = None) -> ChatGenerationChunk:
    return ChatGenerationChunk(
        message=AIMessageChunk(content=content,
                               additional_kwargs={"reasoning_content": reasoning} if reasoning else {},
                               tool_call_chunks=tool_calls or []),
        generation_info=info)


def _invalid_args(raw: str) -> str:
    """A malformed call's args as LangChain sees them: the block as the model wrote it, which no
    JSON parser (LangChain's partial one included) mistakes for arguments, so a streamed
    malformed call stays invalid as it is in invoke."""
    return f"{TOOL_OPEN}\n{raw}"


def _tool_call_chunks(events, named: set[int]) -> list:
    """parsing.ToolCallEvents -> LangChain tool_call_chunks: the name (with the id) when the call
    begins, its whole arguments when it completes; one chunk per call and message (LangChain
    merges chunks by index across messages, not within one). `named`: the indices whose name
    went out already (kept by the caller across a stream)."""
    by_index: dict[int, dict] = {}
    for e in events:
        out = by_index.setdefault(e.index, {"name": None, "args": "", "id": None})
        if e.index not in named:
            named.add(e.index)
            out["name"], out["id"] = e.name, e.id
        if e.kind != "name":
            out["args"] += e.arguments if e.kind == "arguments" else _invalid_args(e.arguments)
    return [tool_call_chunk(name=c["name"], args=c["args"], id=c["id"], index=i) for i, c in by_index.items()]


def _constraint(response_format: Any, tools: list[dict] | None, choice: Any) -> dict | None:
    """The engine constraint (openjet_plugin.constraints' plain-dict form) for this call's
    response_format and tool_choice."""
    forced = None
    if tools and choice in ("any", "required", True):
        forced = {"type": "tool_call", "tools": tools, "name": None}
    elif tools and isinstance(choice, dict):
        forced = {"type": "tool_call", "tools": tools,
                  "name": (choice.get("function") or {}).get("name") or choice.get("name")}
    fmt = _response_format_constraint(response_format)
    if fmt is not None and forced is not None:
        raise ValueError("response_format and a forced tool_choice cannot both apply to one reply; "
                         "pass one of them")
    return fmt if fmt is not None else forced


def _response_format_constraint(fmt: Any) -> dict | None:
    """OpenAI's response_format (or a pydantic class / JSON schema dict) -> a constraint."""
    if fmt is None:
        return None
    if isinstance(fmt, type) and is_basemodel_subclass(fmt):
        return {"type": "json_schema", "schema": convert_to_json_schema(fmt)}
    if not isinstance(fmt, dict):
        raise ValueError(f"response_format must be a dict such as {{'type': 'json_object'}}, "
                         f"got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, str)):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema "
                             "(a JSON Schema object)")
        return {"type": "json_schema", "schema": schema}
    if "properties" in fmt or "$schema" in fmt or kind == "object":
        return {"type": "json_schema", "schema": fmt}       # a bare JSON schema
    raise ValueError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say (OpenAI's
    strict mode: only the declared fields)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _parse_tool_output(message: AIMessage, name: str, model_class: type | None) -> Any:
    """The arguments of the message's call to `name`, validated by `model_class`; raises
    OutputParserException when there is none or they do not validate."""
    for call in message.tool_calls:
        if call["name"] == name:
            return _validated(call["args"], model_class, message)
    errors = [f"{c.get('name')}: {c.get('error') or 'malformed'}" for c in message.invalid_tool_calls]
    why = f"the model wrote a malformed tool call ({'; '.join(errors)})" if errors else \
        f"the model did not call {name!r}"
    raise OutputParserException(f"{why}; reply: {_text(message)[:200]!r}", llm_output=_text(message))


def _parse_json_output(message: AIMessage, model_class: type | None) -> Any:
    text = _text(message).strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OutputParserException(f"the reply is not valid JSON ({exc.msg} at character {exc.pos}): "
                                    f"{text[:200]!r}", llm_output=text) from None
    return _validated(value, model_class, message)


def _validated(value: Any, model_class: type | None, message: AIMessage) -> Any:
    if model_class is None:
        return value
    # a pydantic.v1 model (langchain still accepts them) validates with parse_obj
    validate = getattr(model_class, "model_validate", None) or model_class.parse_obj
    try:
        return validate(value)
    except (ValidationError, ValidationErrorV1) as exc:
        raise OutputParserException(f"the reply does not match {model_class.__name__}: {exc}",
                                    llm_output=_text(message)) from None


def _text(message: BaseMessage) -> str:
    return message.content if isinstance(message.content, str) else text_of(message.content)


def _openai_logprobs(entries) -> dict:
    """engine TokenLogprobs -> langchain-openai's response_metadata["logprobs"]."""
    def one(e) -> dict:
        return {"token": e.text, "bytes": list(e.bytes), "logprob": float(e.logprob)}
    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.top_logprobs]} for e in entries or []]}


def _normalise_tool_choice(choice: Any) -> Any:
    """LangChain's spellings -> OpenAI's: a bare tool name means that tool."""
    if isinstance(choice, str) and choice not in ("auto", "any", "required", "none"):
        return {"type": "function", "function": {"name": choice}}
    return choice


class OpenJetLLM(_OpenJetParams, LLM):
    """Text-completion LLM on the openjet engine: the prompt is continued as is (no chat template).

    Example:
        ```python
        from openjet_plugin.adapters.langchain import OpenJetLLM

        llm = OpenJetLLM(temperature=0, max_tokens=32)
        llm.invoke("def fibonacci(n):")
        ```
    """

    @property
    def _llm_type(self) -> str:
        return "openjet"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self._label(None), "backend": self.backend, "n_ctx": self.n_ctx,
                "draft_depth": self.draft_depth, "kv_type": self.kv_type,
                **{k: getattr(self, k) for k in SAMPLING_KEYS}}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs["model"] if isinstance(kwargs.get("model"), str) else self._label(None)
        return params

    def _prepare(self, stop: list[str] | None, kwargs: dict[str, Any]):
        kwargs = dict(kwargs)
        kwargs.pop("stream", None)
        model = kwargs.pop("model", None)
        params = self._sampling(stop, kwargs)
        if kwargs:
            raise ValueError(f"OpenJetLLM got unknown keyword arguments {sorted(kwargs)}; sampling "
                             f"options are {', '.join(SAMPLING_KEYS)}, plus model")
        return self._engine_for(model), params, self._label(model)

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        eng, params, _ = self._prepare(stop, kwargs)
        return eng.generate(prompt, **params).text

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        label = self._label(kwargs.get("model"))
        for prompt in prompts:
            eng, params, _ = self._prepare(stop, kwargs)
            result = eng.generate(prompt, **params)
            usage = {"prompt_tokens": result.stats.prompt_tokens,
                     "completion_tokens": len(result.tokens),
                     "total_tokens": result.stats.prompt_tokens + len(result.tokens)}
            info = {"finish_reason": result.finish_reason, "usage": usage,
                    **_response_metadata(eng, label, result.finish_reason, result.stats)}
            generations.append([Generation(text=result.text, generation_info=info)])
            for k in totals:
                totals[k] += usage.get(k, 0)
        return LLMResult(generations=generations, llm_output={"token_usage": totals, "model_name": label})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        eng, params, label = self._prepare(stop, kwargs)
        n_tokens = 0
        stream = eng.generate(prompt, stream=True, **params)
        try:
            for piece in stream:
                n_tokens += len(piece.tokens)
                info = None
                if piece.finish_reason is not None:
                    usage = {"prompt_tokens": piece.stats.prompt_tokens, "completion_tokens": n_tokens,
                             "total_tokens": piece.stats.prompt_tokens + n_tokens}
                    info = {"finish_reason": piece.finish_reason, "usage": usage,
                            **_response_metadata(eng, label, piece.finish_reason, piece.stats)}
                if not piece.text and info is None:
                    continue
                chunk = GenerationChunk(text=piece.text, generation_info=info)
                if run_manager:
                    run_manager.on_llm_new_token(piece.text, chunk=chunk)
                yield chunk
        finally:
            stream.close()

    async def _acall(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return await run_in_thread(lambda: self._call(prompt, stop, None, **kwargs))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        return await run_in_thread(lambda: self._generate(prompts, stop, None, **kwargs))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._stream(prompt, stop, None, **kwargs)):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


__all__ = ["ChatOpenJet", "OpenJetLLM"]
