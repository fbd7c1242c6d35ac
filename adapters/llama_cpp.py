"""A drop-in for `llama_cpp.Llama` (llama-cpp-python) running on the openjet engine.

    from openjet_plugin.adapters.llama_cpp import Llama     # instead of: from llama_cpp import Llama
    llm = Llama(model_path="/models/qwen3.8-27b-q4_k_m.gguf", n_ctx=4096)
    llm("Q: Name the planets. A:", max_tokens=64, stop=["Q:"])["choices"][0]["text"]
    llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], stream=True)

Same constructor parameters, same methods, and responses with exactly llama-cpp-python's
structure (keys, types, `finish_reason`, `usage`, stream chunk shapes). The text rules are
llama-cpp-python's too, so that a program sees the same text: generation ends at an
end-of-generation token or at the first listed stop string found (`stop` is matched on the bytes
of the text so far), a token that leaves a multi-byte character unfinished does not count towards
`max_tokens` until the character is complete, control tokens are detokenized as nothing, and
invalid UTF-8 is dropped. The engine does the generation: the adapter takes its tokens one by one
and applies those rules. With greedy decoding (temperature 0) the text equals llama-cpp-python's
on the same file; sampled text differs (another sampler and random stream), with the same
distribution rules (top-k, top-p, min-p, temperature, penalties, in llama.cpp's order).

Extra constructor keywords: `backend` ("auto" | "native" | "llama.cpp") and `draft_depth`
(MTP drafts per cycle on the native backend).

`install()` makes `import llama_cpp` give a module that is llama-cpp-python's own (every public
name: `LlamaGrammar`, `LlamaCache`, `LlamaState`, `llama_types`, ...) with this `Llama` in place of
its own, so code written for llama-cpp-python (langchain-community's `LlamaCpp` and
`ChatLlamaCpp` included) runs on the engine unchanged; openjet's llama.cpp fallback backend keeps
the real library (the installed module holds it as `__openjet_real__`).

Constrained output and logprobs run on the engine (openjet_plugin/constraints.py): `grammar=` (a
`LlamaGrammar`, from_string / from_file / from_json_schema: its GBNF), the chat's
`response_format={"type": "json_object"[, "schema": {...}]}` and a forced `tool_choice` (a named
function, or "required"), returned in llama-cpp-python's shapes (`tool_calls` and `function_call`
with finish_reason "tool_calls"); `logprobs` (completions) and `logprobs`/`top_logprobs` (chat) in
llama-cpp-python's shapes, from the model's full distribution at each position, also without
`logits_all=True` (llama-cpp-python requires it).

Decisions for what the engine does not do (each raises `NotImplementedError` naming the feature,
rather than silently producing different output):
- `logits_processor`, `stopping_criteria`, `suffix` (infill), `mirostat_mode` != 0, `typical_p` != 1;
- logits-level access: `eval`, `sample`, `scores`, `eval_tokens`, `eval_logits`, and llama.cpp's
  own objects `ctx`, `model`, `context_params`, `model_params`;
- embeddings (`create_embedding`, `embed`); `Llama.from_pretrained` (a download).
`tfs_z` is accepted and ignored, as llama-cpp-python itself ignores it. `generate()` yields the
engine's tokens (sampling options as `create_completion`'s); at an end of generation it yields
`token_eos()` and ends. `set_cache()` is accepted: the engine keeps its own prompt cache (it reuses
the longest common prefix of the previous request), so the LlamaCache stays empty.
Constructor parameters that configure llama.cpp internals (GPU layers and splits, mmap/mlock,
batch sizes, RoPE/YaRN overrides, LoRA, NUMA, flash attention, KV overrides, a draft model, a
tokenizer or chat handler object, ...) are accepted with a warning when set to anything but their
default, and ignored: the engine picks its own. `type_k`/`type_v` map to the engine's KV type
(F16 or Q8_0).

State: `save_state()` returns a `llama_cpp.LlamaState` holding the token history and the seed,
not the model's KV/recurrent memory (`llama_state` is empty); `load_state()` restores them. The
engine re-evaluates what a later prompt needs, so outputs are the same; only that first call may
be slower. `reset()` forgets the history the same way.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import types
import uuid
import warnings
from typing import Any, Iterator

import numpy as np

# llama.cpp constants (llama.h), as llama-cpp-python spells its defaults
LLAMA_DEFAULT_SEED = 0xFFFFFFFF
LLAMA_SPLIT_MODE_LAYER = 1
LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_NONE = 0
LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1
_GGML_TYPE_TO_KV = {1: "f16", 8: "q8_0"}            # GGML_TYPE_F16, GGML_TYPE_Q8_0

# constructor parameters of llama_cpp.Llama the engine does not use, with llama-cpp-python's defaults
_IGNORED_DEFAULTS: dict[str, Any] = dict(
    n_gpu_layers=0, split_mode=LLAMA_SPLIT_MODE_LAYER, main_gpu=0, tensor_split=None, vocab_only=False,
    use_mmap=True, use_mlock=False, kv_overrides=None, n_batch=512, n_ubatch=512, n_threads_batch=None,
    rope_scaling_type=LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED, pooling_type=LLAMA_POOLING_TYPE_UNSPECIFIED,
    attention_type=LLAMA_ATTENTION_TYPE_UNSPECIFIED, rope_freq_base=0.0, rope_freq_scale=0.0,
    yarn_ext_factor=-1.0, yarn_attn_factor=1.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=0,
    logits_all=False, embedding=False, offload_kqv=True, flash_attn=False, op_offload=None, swa_full=None,
    no_perf=False, last_n_tokens_size=64, lora_base=None, lora_scale=1.0, lora_path=None, numa=False,
    chat_handler=None, draft_model=None, tokenizer=None, spm_infill=False,
)
# chat formats that mean "the model's own template"
_OWN_TEMPLATE_FORMATS = (None, "chat_template.default")


def _unsupported(feature: str) -> NotImplementedError:
    return NotImplementedError(
        f"{feature} is not supported by openjet's llama-cpp-python drop-in (the engine samples "
        f"inside its own loop and has no logits-level hooks); use llama-cpp-python's Llama for it")


def _grammar_constraint(grammar: Any) -> dict | None:
    """A llama_cpp.LlamaGrammar (or GBNF text) -> the engine's constraint."""
    if grammar is None:
        return None
    text = grammar if isinstance(grammar, str) else getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise TypeError(f"grammar must be a llama_cpp.LlamaGrammar, got {type(grammar).__name__}")
    return {"type": "gbnf", "grammar": text}


class Llama:
    """`llama_cpp.Llama` on the openjet engine (see the module docstring for what differs)."""

    def __init__(
        self,
        model_path: str,
        *,
        n_gpu_layers: int = 0,
        split_mode: int = LLAMA_SPLIT_MODE_LAYER,
        main_gpu: int = 0,
        tensor_split: list[float] | None = None,
        vocab_only: bool = False,
        use_mmap: bool = True,
        use_mlock: bool = False,
        kv_overrides: dict[str, bool | int | float | str] | None = None,
        seed: int = LLAMA_DEFAULT_SEED,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        rope_scaling_type: int | None = LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
        pooling_type: int = LLAMA_POOLING_TYPE_UNSPECIFIED,
        attention_type: int = LLAMA_ATTENTION_TYPE_UNSPECIFIED,
        rope_freq_base: float = 0.0,
        rope_freq_scale: float = 0.0,
        yarn_ext_factor: float = -1.0,
        yarn_attn_factor: float = 1.0,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
        yarn_orig_ctx: int = 0,
        logits_all: bool = False,
        embedding: bool = False,
        offload_kqv: bool = True,
        flash_attn: bool = False,
        op_offload: bool | None = None,
        swa_full: bool | None = None,
        no_perf: bool = False,
        last_n_tokens_size: int = 64,
        lora_base: str | None = None,
        lora_scale: float = 1.0,
        lora_path: str | None = None,
        numa: bool | int = False,
        chat_format: str | None = None,
        chat_handler: Any = None,
        draft_model: Any = None,
        tokenizer: Any = None,
        type_k: int | None = None,
        type_v: int | None = None,
        spm_infill: bool = False,
        verbose: bool = True,
        backend: str = "auto",
        draft_depth: int = 4,
        **kwargs: Any,
    ):
        import openjet_plugin
        from openjet_plugin.tokenizer import Tokenizer

        given = dict(locals())
        for name, default in _IGNORED_DEFAULTS.items():
            value = given[name]
            if value is not default and value != default:
                warnings.warn(f"Llama({name}={value!r}) is accepted but ignored: the openjet engine "
                              f"configures this itself", UserWarning, stacklevel=2)
        for name in kwargs:
            warnings.warn(f"Llama({name}=...) is not a llama_cpp.Llama parameter; ignored",
                          UserWarning, stacklevel=2)
        if chat_format not in _OWN_TEMPLATE_FORMATS:
            warnings.warn(f"chat_format={chat_format!r} is ignored: chats are rendered with the model's own "
                          f"chat template (chat_format 'chat_template.default')", UserWarning, stacklevel=2)
        kv_types = {_GGML_TYPE_TO_KV.get(t) for t in (type_k, type_v) if t is not None}
        if None in kv_types or len(kv_types) > 1:
            raise ValueError(f"type_k={type_k!r}, type_v={type_v!r}: the engine's KV cache is F16 (1) or "
                             f"Q8_0 (8), the same for K and V")
        if not os.path.exists(model_path):
            raise ValueError(f"Model path does not exist: {model_path}")

        self.model_path = model_path
        self.verbose = verbose
        self.chat_format = "chat_template.default"
        self.chat_handler = None
        self._tokenizer = Tokenizer.from_gguf(model_path)
        if n_ctx == 0:                        # llama-cpp-python: 0 = the model's training context
            from openjet_plugin.model_file import open_model

            with open_model(model_path) as mf:
                n_ctx = mf.config.n_ctx_train
        self._engine = openjet_plugin.load(
            model_path, backend=backend, n_ctx=n_ctx, draft_depth=draft_depth,
            kv_type=kv_types.pop() if kv_types else "f16", n_threads=n_threads, verbose=False)
        self._seed = seed or LLAMA_DEFAULT_SEED
        self.metadata: dict[str, str] = _llama_cpp_metadata(self._engine.metadata)
        self.n_tokens = 0
        self.input_ids: np.ndarray = np.zeros((self._engine.n_ctx,), dtype=np.intc)
        # the constructor's settings, as llama-cpp-python keeps them (most are not used here)
        self.cache = None
        self.draft_model, self.kv_overrides, self.numa, self.spm_infill = draft_model, kv_overrides, numa, spm_infill
        self.lora_base, self.lora_path, self.lora_scale = lora_base, lora_path, lora_scale
        self.last_n_tokens_size, self.tensor_split = last_n_tokens_size, tensor_split
        self.n_batch = min(n_ctx, n_batch)
        self.n_threads = n_threads or max(1, (os.cpu_count() or 2) // 2)
        self.n_threads_batch = n_threads_batch or (os.cpu_count() or 1)
        self.tokenizer_ = LlamaTokenizer(self)

    # --- model facts ------------------------------------------------------------------------------
    def n_ctx(self) -> int:
        """Context window size."""
        return self._engine.n_ctx

    def n_vocab(self) -> int:
        """Vocabulary size."""
        return self._engine.n_vocab

    def n_embd(self) -> int:
        """Embedding size."""
        return self._engine.config.n_embd

    def token_eos(self) -> int:
        return -1 if self._engine.token_eos is None else int(self._engine.token_eos)

    def token_bos(self) -> int:
        return -1 if self._tokenizer.bos_id is None else int(self._tokenizer.bos_id)

    def token_nl(self) -> int:
        # llama.cpp's linefeed id for BPE vocabularies: the first token of "\n"
        return self._engine.tokenize("\n", add_special=False, parse_special=False)[0]

    @property
    def backend_name(self) -> str:
        """Which engine backend runs this model ("native" or "llama.cpp")."""
        return self._engine.backend_name

    # --- tokens -----------------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Tokenize utf-8 `text`; add_bos adds BOS where the vocabulary asks for it."""
        return self._engine.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None,
                   special: bool = False) -> bytes:
        """Bytes of `tokens` (control tokens only with special=True); prev_tokens is unused, as in
        llama-cpp-python."""
        out = self._tokenizer.decode_bytes(tokens, special=special)
        if tokens and tokens[0] == self.token_bos() and out[:1] == b" ":
            out = out[1:]
        return out

    # --- state ------------------------------------------------------------------------------------
    def set_seed(self, seed: int) -> None:
        self._seed = seed

    def reset(self) -> None:
        """Forget the token history (the engine reuses or re-evaluates the prompt as needed)."""
        self.n_tokens = 0

    def save_state(self):
        LlamaState = _real_llama_cpp().llama.LlamaState

        return LlamaState(input_ids=self.input_ids.copy(), scores=np.zeros((self.n_tokens, 0), np.single),
                          n_tokens=self.n_tokens, llama_state=b"", llama_state_size=0, seed=self._seed)

    def load_state(self, state) -> None:
        self.input_ids = np.array(state.input_ids, dtype=np.intc).copy()
        self.n_tokens = int(state.n_tokens)
        self._seed = state.seed

    def close(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def set_cache(self, cache) -> None:
        """Accepted: the engine keeps its own prompt cache (the longest common prefix of the
        previous request is reused), so `cache` is kept here and stays empty."""
        self.cache = cache

    def tokenizer(self) -> "LlamaTokenizer":
        """The model's tokenizer as llama-cpp-python's `LlamaTokenizer` interface."""
        return LlamaTokenizer(self)

    @staticmethod
    def logits_to_logprobs(logits, axis: int = -1):
        return _real_llama_cpp().Llama.logits_to_logprobs(logits, axis=axis)

    @staticmethod
    def longest_token_prefix(a, b) -> int:
        return _real_llama_cpp().Llama.longest_token_prefix(a, b)

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None = None, *args: Any, **kwargs: Any):
        raise _unsupported("Llama.from_pretrained (a download from the Hugging Face Hub; pass model_path= of a "
                           "local GGUF)")

    def eval(self, tokens) -> None:
        raise _unsupported("eval (evaluating tokens to read their logits)")

    def sample(self, *args: Any, **kwargs: Any) -> int:
        raise _unsupported("sample (sampling from logits left by eval); generate() samples on the engine")

    def generate(self, tokens, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                 temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                 mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, penalize_nl: bool = True,
                 logits_processor=None, stopping_criteria=None, grammar=None) -> Iterator[int]:
        """Generated token ids for `tokens`, as llama-cpp-python's generate() yields them, up to
        the end of the context; at an end of generation, `token_eos()` and the end."""
        for feature, used in (("logits_processor", logits_processor is not None),
                              ("stopping_criteria", stopping_criteria is not None),
                              ("mirostat sampling", mirostat_mode != 0), ("typical_p sampling", typical_p != 1.0)):
            if used:
                raise _unsupported(feature)
        prompt = [int(t) for t in tokens]
        stream = self._engine.generate(
            prompt, max_tokens=None, stream=True, temperature=max(temp, 0.0), top_p=top_p, top_k=top_k,
            min_p=min_p, repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, seed=self._seed & 0xFFFFFFFF, constraint=_grammar_constraint(grammar))
        generated: list[int] = []
        try:
            for piece in stream:
                for tok in piece.tokens:
                    generated.append(tok)
                    yield tok
                if piece.finish_reason == "stop" and self.token_eos() >= 0:
                    yield self.token_eos()
        finally:
            stream.close()
            history = prompt + generated
            n = min(len(history), len(self.input_ids))
            self.input_ids[:n] = history[:n]
            self.n_tokens = n

    def pooling_type(self) -> int:
        return LLAMA_POOLING_TYPE_NONE          # a generative model's context: no pooling

    # llama.cpp's own objects and the logits llama-cpp-python keeps: the engine has neither
    scores = property(lambda self: _no_logits("scores (the logits of every evaluated position)"))
    eval_tokens = property(lambda self: _no_logits("eval_tokens"))
    eval_logits = property(lambda self: _no_logits("eval_logits"))
    ctx = property(lambda self: _no_logits("ctx (llama.cpp's context)"))
    model = property(lambda self: _no_logits("model (llama.cpp's model object)"))
    context_params = property(lambda self: _no_logits("context_params (llama.cpp's context parameters)"))
    model_params = property(lambda self: _no_logits("model_params (llama.cpp's model parameters)"))

    # --- embeddings ---------------------------------------------------------------------------------
    def create_embedding(self, input, model=None):
        raise _unsupported("embeddings (create_embedding)")

    def embed(self, input, normalize=False, truncate=True, return_count=False):
        raise _unsupported("embeddings (embed)")

    # --- completions ------------------------------------------------------------------------------
    def __call__(self, prompt: str, suffix: str | None = None, max_tokens: int | None = 16,
                 temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                 logprobs: int | None = None, echo: bool = False, stop: str | list[str] | None = [],
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                 top_k: int = 40, stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 model: str | None = None, stopping_criteria=None, logits_processor=None, grammar=None,
                 logit_bias: dict[int, float] | None = None):
        """Generate text from a prompt (same as create_completion)."""
        return self.create_completion(
            prompt=prompt, suffix=suffix, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            min_p=min_p, typical_p=typical_p, logprobs=logprobs, echo=echo, stop=stop,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            repeat_penalty=repeat_penalty, top_k=top_k, stream=stream, seed=seed, tfs_z=tfs_z,
            mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
            stopping_criteria=stopping_criteria, logits_processor=logits_processor, grammar=grammar,
            logit_bias=logit_bias)

    def create_completion(self, prompt: str | list[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | list[str] | None = [], frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: str | None = None, stopping_criteria=None, logits_processor=None,
                          grammar=None, logit_bias: dict[int, float] | None = None):
        """Generate text from a prompt: a `CreateCompletionResponse` dict, or with stream=True an
        iterator of `CreateCompletionStreamResponse` dicts."""
        return self._create_completion(
            prompt, suffix=suffix, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
            typical_p=typical_p, logprobs=logprobs, echo=echo, stop=stop, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k, stream=stream, seed=seed,
            mirostat_mode=mirostat_mode, model=model, stopping_criteria=stopping_criteria,
            logits_processor=logits_processor, constraint=_grammar_constraint(grammar), logit_bias=logit_bias)

    def _create_completion(self, prompt, *, suffix, max_tokens, temperature, top_p, min_p, typical_p, logprobs, echo,
                           stop, frequency_penalty, presence_penalty, repeat_penalty, top_k, stream, seed,
                           mirostat_mode, model, stopping_criteria, logits_processor, constraint, logit_bias):
        for feature, used in (("suffix (infill)", suffix is not None), ("logits_processor", logits_processor is not None),
                              ("stopping_criteria", stopping_criteria is not None),
                              ("mirostat sampling", mirostat_mode != 0),
                              ("typical_p sampling", typical_p != 1.0)):
            if used:
                raise _unsupported(feature)
        if isinstance(prompt, str):
            prompt_tokens = self.tokenize(prompt.encode("utf-8"), add_bos=True, special=True) if prompt else []
        else:
            prompt_tokens = [int(t) for t in prompt]
        if not prompt_tokens:
            raise ValueError("the prompt is empty: give at least one token of text")
        n_ctx = self.n_ctx()
        if len(prompt_tokens) >= n_ctx:
            raise ValueError(f"Requested tokens ({len(prompt_tokens)}) exceed context window of {n_ctx}")
        if max_tokens is None or max_tokens <= 0:
            max_tokens = n_ctx - len(prompt_tokens)
        max_tokens = min(max_tokens, n_ctx - len(prompt_tokens))
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if seed is not None:
            self.set_seed(seed)
        else:                                   # llama-cpp-python's seed chain: reproducible per instance
            self.set_seed(random.Random(self._seed).randint(0, 2 ** 32))
        run = _Completion(
            self, prompt_tokens, max_tokens=max_tokens, stops=[s.encode("utf-8") for s in stops],
            sampling=dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                          repeat_penalty=repeat_penalty, seed=self._seed & 0xFFFFFFFF,
                          # llama-cpp-python adds the bias to the raw logits before sampling; so does the engine
                          logit_bias={int(k): float(v) for k, v in logit_bias.items()} if logit_bias else None,
                          constraint=constraint, logprobs=logprobs is not None,
                          top_logprobs=min(int(logprobs or 0), 20)),
            model=model if model is not None else self.model_path)
        run.n_logprobs = None if logprobs is None else int(logprobs)
        run.text_offset_base = len(prompt)
        if logprobs is not None and echo:
            raise _unsupported("logprobs with echo=True (the log-probabilities of the prompt's tokens)")
        if stream:
            return run.stream()
        text, finish_reason = run.whole()
        if echo:
            text = (prompt if isinstance(prompt, str) else self.detokenize(prompt_tokens).decode(
                "utf-8", errors="ignore")) + text
        return {
            "id": run.id,
            "object": "text_completion",
            "created": run.created,
            "model": run.model,
            "choices": [{"text": text, "index": 0, "logprobs": run.logprobs_block(logprobs, echo),
                         "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": len(prompt_tokens), "completion_tokens": len(run.completion_tokens),
                      "total_tokens": len(prompt_tokens) + len(run.completion_tokens)},
        }

    # --- chat -------------------------------------------------------------------------------------
    def create_chat_completion(self, messages: list[dict], functions: list[dict] | None = None,
                               function_call: Any = None, tools: list[dict] | None = None,
                               tool_choice: Any = None, temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0,
                               stream: bool = False, stop: str | list[str] | None = [],
                               seed: int | None = None, response_format: dict | None = None,
                               max_tokens: int | None = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                               tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                               mirostat_eta: float = 0.1, model: str | None = None, logits_processor=None,
                               grammar=None, logit_bias: dict[str, float] | None = None,
                               logprobs: bool | None = None, top_logprobs: int | None = None):
        """Chat with the model's own template: a `CreateChatCompletionResponse` dict, or with
        stream=True an iterator of `ChatCompletionChunk` dicts. The reply is the raw text, a
        <think> block included, as llama-cpp-python returns it."""
        if functions is not None:
            tools = [{"type": "function", "function": f} for f in functions]
        if isinstance(function_call, dict) and "name" in function_call:
            tool_choice = {"type": "function", "function": {"name": function_call["name"]}}
        forced = None
        if tools and (tool_choice == "required" or isinstance(tool_choice, dict)):
            forced = None if tool_choice == "required" else (tool_choice.get("function") or {}).get("name")
            constraint = {"type": "tool_call", "tools": tools, "name": forced}
            forced = forced or ""
        elif isinstance(response_format, dict) and response_format.get("type") == "json_object":
            schema = response_format.get("schema")
            constraint = {"type": "json_schema", "schema": schema} if schema is not None else {"type": "json_object"}
        else:
            constraint = _grammar_constraint(grammar)
        # the template's own defaults (thinking on), as llama-cpp-python renders it: it never sets
        # enable_thinking, and the template adds the empty think block only when it is false; a
        # grammar in llama-cpp-python holds from the first token, so with a constraint the think
        # block is closed in the prompt and the constrained text is the whole reply
        prompt = self._engine.render_chat(messages, tools=tools, enable_thinking=constraint is None)
        prompt_tokens = self.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        eos = self.token_eos()
        if eos >= 0:
            stops.append(self._tokenizer.token_to_piece(eos, special=True).decode("utf-8", errors="ignore"))
        out = self._create_completion(
            prompt_tokens, suffix=None, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            typical_p=typical_p, logprobs=(top_logprobs or 0) if logprobs else None, echo=False, stream=stream,
            stop=stops, seed=seed, max_tokens=max_tokens, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty, mirostat_mode=mirostat_mode,
            model=model, stopping_criteria=None, logits_processor=logits_processor, constraint=constraint,
            logit_bias=logit_bias)
        if forced is not None:
            return _chat_tool_call(out, tools, stream)
        if stream:
            return _chat_chunks(out)
        return {
            "id": "chat" + out["id"],
            "object": "chat.completion",
            "created": out["created"],
            "model": out["model"],
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": out["choices"][0]["text"]},
                         "logprobs": _chat_logprobs(out["choices"][0]["logprobs"]),
                         "finish_reason": out["choices"][0]["finish_reason"]}],
            "usage": out["usage"],
        }

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any):
        """create_chat_completion, returned as the openai package's ChatCompletion(Chunk) types."""
        from openai.types.chat import ChatCompletion, ChatCompletionChunk

        if kwargs.get("stream", False):
            return (ChatCompletionChunk(**chunk) for chunk in self.create_chat_completion(*args, **kwargs))
        return ChatCompletion(**self.create_chat_completion(*args, **kwargs))


def _chat_chunks(chunks: Iterator[dict]) -> Iterator[dict]:
    for i, chunk in enumerate(chunks):
        if i == 0:
            yield {"id": "chat" + chunk["id"], "model": chunk["model"], "created": chunk["created"],
                   "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                "finish_reason": None}]}
        finish = chunk["choices"][0]["finish_reason"]
        yield {"id": "chat" + chunk["id"], "model": chunk["model"], "created": chunk["created"],
               "object": "chat.completion.chunk",
               "choices": [{"index": 0,
                            "delta": {"content": chunk["choices"][0]["text"]} if finish is None else {},
                            "logprobs": _chat_logprobs(chunk["choices"][0]["logprobs"]),
                            "finish_reason": finish}]}


def _chat_logprobs(block: dict | None) -> dict | None:
    """A completion's logprobs -> the chat shape, as llama-cpp-python converts them."""
    if block is None:
        return None
    return {"content": [{"token": token, "bytes": None, "logprob": lp,
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": None} for t, v in top.items()]}
                        for token, lp, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"])],
            "refusal": None}


def _chat_tool_call(out, tools: list[dict], stream: bool):
    """A forced tool call's completion -> llama-cpp-python's function-call response: the call in
    `tool_calls` and `function_call`, content None, finish_reason "tool_calls"."""
    from openjet_plugin.parsing import parse_tool_calls

    if stream:
        chunks = list(out)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        head = chunks[-1]
    else:
        text, head = out["choices"][0]["text"], out
    _, calls, invalid = parse_tool_calls(text, tools)
    if not calls:
        why = invalid[0]["error"] if invalid else "no tool call in the reply"
        raise RuntimeError(f"the forced tool call did not complete ({why}; finish_reason "
                           f"{head['choices'][0]['finish_reason']!r}): raise max_tokens")
    name, arguments = calls[0]["name"], json.dumps(calls[0]["arguments"], ensure_ascii=False)
    call = {"id": f"call__0_{name}_{head['id']}", "type": "function", "function": {"name": name, "arguments": arguments}}
    if not stream:
        return {"id": "chat" + out["id"], "object": "chat.completion", "created": out["created"],
                "model": out["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": None,
                                                     "function_call": {"name": name, "arguments": arguments},
                                                     "tool_calls": [call]},
                             "logprobs": _chat_logprobs(out["choices"][0]["logprobs"]), "finish_reason": "tool_calls"}],
                "usage": out["usage"]}

    def chunks_out():
        base = {"id": "chat" + head["id"], "object": "chat.completion.chunk", "created": head["created"],
                "model": head["model"]}
        yield dict(base, choices=[{"index": 0, "finish_reason": None, "logprobs": None,
                                   "delta": {"role": "assistant", "content": None, "function_call": None,
                                             "tool_calls": None}}])
        yield dict(base, choices=[{"index": 0, "finish_reason": None, "logprobs": None,
                                   "delta": {"role": None, "content": None,
                                             "function_call": {"name": name, "arguments": arguments},
                                             "tool_calls": [dict(call, index=0)]}}])
        yield dict(base, choices=[{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                                   "delta": {"role": None, "content": None, "function_call": None,
                                             "tool_calls": None}}])
    return chunks_out()


def _no_logits(feature: str):
    raise _unsupported(feature)


def _real_llama_cpp():
    """llama-cpp-python itself (also after `install()` took the name `llama_cpp`)."""
    from openjet_plugin.backends.llama_cpp import import_llama_cpp

    llama_cpp = import_llama_cpp()
    return getattr(llama_cpp, "__openjet_real__", llama_cpp)


class LlamaTokenizer:
    """llama-cpp-python's `LlamaTokenizer` interface on the drop-in's tokenizer."""

    def __init__(self, llama: Llama):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        return self._llama.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


def install() -> types.ModuleType:
    """Make `import llama_cpp` give llama-cpp-python's module with this drop-in's `Llama`.

    Every public name of llama-cpp-python's package stays (`LlamaGrammar`, `LlamaCache`,
    `LlamaState`, `llama_types`, the low-level bindings, ...); its submodules (`llama_cpp.llama`,
    `llama_cpp.llama_types`, ...) are llama-cpp-python's own. The real package is kept as the
    module's `__openjet_real__`, which openjet's llama.cpp fallback backend uses. Returns the
    installed module; installing twice is harmless. `uninstall()` undoes it.
    """
    current = sys.modules.get("llama_cpp")
    if current is not None and getattr(current, "__openjet_real__", None) is not None:
        return current
    import importlib

    from openjet_plugin.backends.llama_cpp import import_llama_cpp

    real = import_llama_cpp()
    for sub in ("llama", "llama_types", "llama_grammar", "llama_cache", "llama_tokenizer", "llama_chat_format"):
        importlib.import_module("llama_cpp." + sub)          # loaded now, as the real package's
    module = types.ModuleType("llama_cpp", real.__doc__)
    module.__dict__.update({k: v for k, v in vars(real).items() if k not in ("__name__", "__doc__", "__loader__",
                                                                             "__spec__")})
    module.__spec__ = real.__spec__
    module.__loader__ = real.__loader__
    module.Llama = Llama
    module.__openjet_real__ = real
    sys.modules["llama_cpp"] = module
    return module


def uninstall() -> None:
    """Give `import llama_cpp` back to llama-cpp-python."""
    current = sys.modules.get("llama_cpp")
    real = getattr(current, "__openjet_real__", None)
    if real is not None:
        sys.modules["llama_cpp"] = real


class _Completion:
    """One completion request: the engine's tokens in, llama-cpp-python's text rules applied.

    The engine generates with no stop strings and room up to the context end; the rules below
    decide where the completion ends and the generator is closed there (the engine keeps a
    consistent state either way).
    """

    def __init__(self, llama: Llama, prompt_tokens: list[int], *, max_tokens: int, stops: list[bytes],
                 sampling: dict, model: str):
        self.llama = llama
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.stops = stops
        self.sampling = sampling
        self.model = model
        self.id = f"cmpl-{uuid.uuid4()}"
        self.created = int(time.time())
        self.completion_tokens: list[int] = []
        self.token_logprobs: list = []          # the engine's TokenLogprob of each generated token
        self.n_logprobs: int | None = None      # the request's `logprobs` (alternatives per token)
        self._end_of_generation = False
        self.text_offset_base = 0               # llama-cpp-python's: len() of the prompt argument

    def _detok(self, tokens: list[int]) -> bytes:
        return self.llama.detokenize(tokens)

    def logprobs_block(self, n: int | None, echo: bool, start: int = 0, end: int | None = None) -> dict | None:
        """llama-cpp-python's `logprobs` of completion tokens [start, end): tokens (text), their
        text offsets, log-probabilities and the `n` most likely alternatives (plus the token)."""
        if n is None:
            return None
        if echo:
            raise _unsupported("logprobs with echo=True (the log-probabilities of the prompt's tokens)")
        toks = self.completion_tokens
        end = len(toks) if end is None else end
        out: dict[str, list] = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        for i in range(start, min(end, len(self.token_logprobs))):
            lp = self.token_logprobs[i]
            text = self._detok([toks[i]]).decode("utf-8", errors="ignore")
            out["tokens"].append(text)
            out["text_offset"].append(self.text_offset_base + len(self._detok(toks[:i]).decode("utf-8", errors="ignore")))
            out["token_logprobs"].append(float(lp.logprob))
            top = {self._detok([t.token]).decode("utf-8", errors="ignore"): float(t.logprob)
                   for t in lp.top_logprobs[:n]}
            top[text] = float(lp.logprob)
            out["top_logprobs"].append(top)
        return out

    def _tokens(self) -> Iterator[int | str]:
        """Generated token ids, then the engine's finish reason as a string: "stop" for an
        end-of-generation token, "length" when the context is full."""
        eng = self.llama._engine
        room = eng.n_ctx - len(self.prompt_tokens)
        stream = eng.generate(self.prompt_tokens, max_tokens=room, stream=True, **self.sampling)
        try:
            for piece in stream:
                if piece.logprobs:
                    self.token_logprobs += piece.logprobs
                yield from piece.tokens
                if piece.finish_reason is not None:
                    self._end_of_generation = piece.finish_reason == "stop"
                    yield piece.finish_reason
                    return
        finally:
            stream.close()               # releases the engine for the next request
            self._remember()

    def _remember(self) -> None:
        # as llama-cpp-python counts them: every token evaluated, so all but the last completion
        # token unless an end-of-generation token (evaluated after it) ended the completion
        history = self.prompt_tokens + self.completion_tokens
        if self.completion_tokens and not self._end_of_generation:
            history = history[:-1]
        n = min(len(history), len(self.llama.input_ids))
        self.llama.input_ids[:n] = history[:n]
        self.llama.n_tokens = n

    def _steps(self) -> Iterator[tuple[str, Any]]:
        """llama-cpp-python's generation loop as events: ("text", str) for stream pieces, then
        ("end", (text bytes, finish_reason))."""
        multibyte_fix = 0
        returned = 0
        finish_reason = "length"
        text = b""
        tokens = self._tokens()
        for token in tokens:
            if isinstance(token, str):         # end of generation, or no room left
                text = self._detok(self.completion_tokens)
                finish_reason = token
                break
            self.completion_tokens.append(token)
            all_text = self._detok(self.completion_tokens)
            # a lead byte whose continuation bytes have not come yet: wait for them
            for k, char in enumerate(all_text[-3:]):
                k = 3 - k
                for num, pattern in ((2, 192), (3, 224), (4, 240)):
                    if num > k and pattern & char == pattern:
                        multibyte_fix = num - k
            if multibyte_fix > 0:
                multibyte_fix -= 1
                continue
            hits = [s for s in self.stops if s in all_text]
            if hits:
                text = all_text[:all_text.index(hits[0])]
                finish_reason = "stop"
                break
            if self._streaming:
                for piece, n in self._stream_pieces(self.completion_tokens[returned:]):
                    returned += n
                    yield "text", (piece, returned - n, returned)
            if len(self.completion_tokens) >= self.max_tokens:
                text = self._detok(self.completion_tokens)
                finish_reason = "length"
                break
        tokens.close()
        self._returned = returned
        yield "end", (text, finish_reason)

    def _stream_pieces(self, remaining: list[int]) -> Iterator[tuple[str, int]]:
        """Whole UTF-8 characters of the not yet returned tokens, holding back a tail that could be
        the start of a stop string."""
        remaining_text = self._detok(remaining)
        held = 0
        for s in self.stops:
            for i in range(min(len(s), len(remaining_text)), 0, -1):
                if remaining_text.endswith(s[:i]):
                    held = max(held, i)
                    break
        end = 0
        while remaining:
            for i in range(1, len(remaining) + 1):
                bs = self._detok(remaining[:i])
                try:
                    piece = bs.decode("utf-8")
                    break
                except UnicodeError:
                    continue
            else:
                return
            end += len(bs)
            if end > len(remaining_text) - held:
                return
            remaining = remaining[i:]
            yield piece, i

    def whole(self) -> tuple[str, str]:
        self._streaming = False
        for kind, value in self._steps():
            if kind == "end":
                text, finish_reason = value
                return text.decode("utf-8", errors="ignore"), finish_reason
        raise AssertionError("unreachable: the loop always ends with an end event")

    def stream(self) -> Iterator[dict]:
        self._streaming = True
        finish_reason = "length"
        for kind, value in self._steps():
            if kind == "text":
                text, start, end = value
                yield self._chunk(text, None, self.logprobs_block(self.n_logprobs, False, start, end))
            else:
                finish_reason = value[1]
        # the rest: the tokens not yet returned, cut at the first stop string
        remaining = self.completion_tokens[self._returned:]
        remaining_text = self._detok(remaining)
        hits = [s for s in self.stops if s in remaining_text]
        end = min(remaining_text.index(s) for s in hits) if hits else len(remaining_text)
        position = 0
        for k, token in enumerate(remaining):
            piece = self._detok([token])
            position += len(piece)
            i = self._returned + k
            lp = self.logprobs_block(self.n_logprobs, False, i, i + 1)
            if position >= end:
                yield self._chunk(piece[:len(piece) - (position - end)].decode("utf-8", errors="ignore"), None, lp)
                break
            yield self._chunk(piece.decode("utf-8", errors="ignore"), None, lp)
        yield self._chunk("", finish_reason)

    def _chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}]}


def _llama_cpp_metadata(metadata: dict) -> dict[str, str]:
    """The GGUF metadata as llama.cpp reports it: every key that is not an array, its value as text
    (integers in decimal, floats with six decimals, booleans as true/false)."""
    out: dict[str, str] = {}
    for key, value in metadata.items():
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (int, np.integer)):
            out[key] = str(int(value))
        elif isinstance(value, (float, np.floating)):
            out[key] = f"{float(value):f}"
        elif isinstance(value, str):
            out[key] = value
        # arrays (lists, previews of long arrays) are not part of llama.cpp's metadata
    return out


__all__ = ["Llama", "LlamaTokenizer", "LLAMA_DEFAULT_SEED", "install", "uninstall"]
