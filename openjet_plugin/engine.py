"""load(), Engine and the per-request stats: the API the adapters and the CLI stand on.

The engine owns everything above "tokens in, logits out": sampling (sampling.py), stop strings,
UTF-8-safe streaming, conversation reuse, the slots and the stats. A backend (backends/base.py)
only holds the model state, so every backend behaves the same to a caller.

Slots: an engine holds n_slots conversations at once (`load(n_slots=...)`), each a slot with its
own sequence of the backend's state (KV cache region, recurrent state, n_past) and its own token
list; a request takes a free slot for its whole run (the one whose tokens share the longest
prefix with its prompt, else the least recently used; where the prefix cache below serves the
prompt as well, one it would not cut first: `_slot_preference`) and waits, in arrival order,
while none is free. Concurrent requests run the same generation loop in their own threads; the backend gathers
their evals into shared passes (backends/passes.py; llama.cpp: backends/llama_cpp_sequences.py, the
native engine: up to 8 sequences, backends/native.py). With one slot (the default) requests run one
at a time, as before. Speculative decoding: on a one-slot engine every request speculates where
the backend drafts; with several slots (native) only a request that starts while no other slot
is serving one (one client alone keeps MTP speculation; there is no verify pass over several
sequences' drafts): `_speculator_for`.

Conversation reuse: a slot's `tokens` is always exactly the token list in its sequence's state. A
new prompt is compared with it; the common prefix is kept and only the rest is evaluated. Going back
inside the state uses the backend's rollback; where that is refused (recurrent DeltaNet state) the
newest checkpoint before the difference is restored if the backend keeps checkpoints (one is saved
before the last token of every prompt), else the state is reset and re-prefilled. Either way the
model sees the same tokens, so the results are identical.

Prefix reuse across slots (prefix_cache.py): where the backend can copy a sequence's state out and
into another sequence (llama.cpp), the engine keeps copies of the state after prompt prefixes that
are likely to recur: the end of a prompt's first turn (a system prompt, an agent scaffold) and the
whole prompt but its last token. A request whose slot shares less of its prompt than a copy does
loads the longest such copy into its own sequence and evaluates only the rest
(`GenerationStats.prefix_cache_tokens`). On by default with several slots.
"""

from __future__ import annotations

import atexit
import codecs
import itertools
import logging
import os
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import chat_template
from .errors import ContextOverflowError, OpenJetError, WrongArchitectureError
from .prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, check_prefix_cache_bytes
from .sampling import Sampler, SamplingParams, top_ids

MAX_TOP_LOGPROBS = 20      # OpenAI's limit on top_logprobs

log = logging.getLogger("openjet_plugin")

# Token texts llama.cpp treats as end-of-generation when the vocabulary has them (llama-vocab.cpp).
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<EOT>")


@dataclass
class GenerationStats:
    """One request's numbers. decode_seconds runs from the end of prefill to the last token, less
    the time a streaming caller spent between chunks;
    tokens_per_second = generated_tokens / decode_seconds. generated_tokens counts every sampled
    token, the end-of-generation token included (it cost a decode step)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    # of cached_prompt_tokens, those loaded from the engine's prefix cache (a copy of the state
    # that an earlier request, in any slot, left) rather than kept in the slot's own state
    prefix_cache_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tokens_per_second: float = 0.0
    # speculative backends only
    cycles: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    backend: str = ""

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens actually evaluated for this request."""
        return self.prompt_tokens - self.cached_prompt_tokens

    def summary(self) -> str:
        cached = (f"{self.cached_prompt_tokens} cached, {self.prefix_cache_tokens} from the prefix cache"
                  if self.prefix_cache_tokens else f"{self.cached_prompt_tokens} cached")
        s = (f"prompt {self.prompt_tokens} tokens ({cached}) in "
             f"{self.prefill_seconds:.3f} s, generated {self.generated_tokens} tokens in "
             f"{self.decode_seconds:.3f} s ({self.tokens_per_second:.1f} tok/s) [{self.backend}]")
        if self.drafts_proposed:
            s += (f", drafts accepted {self.drafts_accepted}/{self.drafts_proposed} "
                  f"over {self.cycles} cycles")
        return s


@dataclass
class TokenLogprob:
    """One token's log-probability under the model: the log-softmax of the raw logits at its
    position over the whole vocabulary (before bias, penalties, a constraint's mask, temperature
    and top-k/p, as llama.cpp reports it); with speculation, the target model's logits."""

    token: int
    bytes: bytes                 # the token's bytes (may be part of a UTF-8 character)
    logprob: float
    top_logprobs: list["TokenLogprob"] = field(default_factory=list)   # most likely first

    @property
    def text(self) -> str:
        return self.bytes.decode("utf-8", errors="replace")


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]            # generated tokens; the end-of-generation token is not included
    finish_reason: str           # "stop" (EOS or a stop string) | "length" (max_tokens or n_ctx)
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None    # with logprobs=True: one per entry of tokens


@dataclass
class Chunk:
    text: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] | None = None    # with logprobs=True: one per entry of tokens


# Engines still open when the interpreter exits are closed first: llama-cpp-python's own finaliser
# fails noisily once module teardown has begun.
_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    for eng in list(_LIVE_ENGINES):
        if eng._held_by_another_thread():
            continue                    # another thread's stream is open: closing would wait for it
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class EngineBusyError(OpenJetError, RuntimeError):
    """A new request in the thread whose stream is still open, with no other slot free (it would
    wait for itself)."""


class _Slot:
    """One conversation the engine holds: a sequence of the backend's state and exactly the
    tokens in it."""

    def __init__(self, index: int, backend):
        self.index = index
        self.backend = backend                  # the backend itself with one slot, else its sequence view
        self.tokens: list[int] = []             # exactly what the sequence's state holds
        self.logits: np.ndarray | None = None   # logits after tokens[-1], when known
        self.owner: int | None = None           # the thread whose request holds the slot
        self.last_used = 0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """One model and n_slots conversation states; one request per slot at a time. Use `load()`
    to make one."""

    def __init__(self, backend, *, model_path: str | os.PathLike[str], config, metadata: dict,
                 chat_template_source: str | None, eog_tokens: Sequence[int], token_eos: int | None,
                 backend_reason: str, model_file=None, prefix_cache_bytes: int | None = None):
        self._backend = backend
        self._model_file = model_file            # kept open while a native backend uses it
        self.model_path = Path(model_path)
        self.config = config
        self.metadata = metadata
        self.chat_template = chat_template_source
        self.eog_tokens = frozenset(int(t) for t in eog_tokens)
        self.token_eos = token_eos
        self.backend_name: str = backend.name
        self.backend_reason = backend_reason
        self.last_stats: GenerationStats | None = None
        # a backend holding several sequences hands out one view per sequence: a slot each
        views = backend.sequences() if getattr(backend, "n_sequences", 1) > 1 else [backend]
        self._slots = [_Slot(i, v) for i, v in enumerate(views)]
        self._prefix_cache = self._make_prefix_cache(prefix_cache_bytes)
        self._cv = threading.Condition()
        self._waiting: deque[object] = deque()  # requests waiting for a slot, in arrival order
        self._uses = itertools.count(1)
        self._closed = False
        self._streams: "weakref.WeakKeyDictionary[Iterator, int]" = weakref.WeakKeyDictionary()
        self._constraints = None                 # constraints.ConstraintCompiler, built at first use
        self._constraints_lock = threading.Lock()
        # a speculator per slot whose backend drafts; with several slots a request uses its slot's
        # only when it is served alone (_speculator_for)
        vocab = self._draft_vocab(backend)
        self._speculators = {s.index: spec for s in self._slots
                             if (spec := self._make_speculator(s.backend, vocab)) is not None}
        self._speculator = self._speculators.get(0)     # the one slot's, on a one-slot engine
        _LIVE_ENGINES.add(self)

    def _make_prefix_cache(self, budget: int | None) -> PrefixCache | None:
        """The prefix cache, where the budget is not 0 and every slot's backend copies state.
        None: DEFAULT_PREFIX_CACHE_BYTES with several slots, none with one (whose conversation
        reuse stays as it was: its own checkpoints)."""
        asked = check_prefix_cache_bytes(budget)
        if asked is None:
            asked = DEFAULT_PREFIX_CACHE_BYTES if len(self._slots) > 1 else 0
        if not asked:
            return None
        if not all(hasattr(s.backend, "save_state") and hasattr(s.backend, "load_state") for s in self._slots):
            log.info("no prefix cache: the %s backend cannot copy a sequence's state", self.backend_name)
            return None
        return PrefixCache(asked)

    @property
    def prefix_cache_stats(self) -> dict[str, int]:
        """The prefix cache's budget, bytes and entries held, and counters: hits (requests that
        loaded a copy), reused_tokens (prompt tokens they did not evaluate), stored, evicted.
        budget_bytes 0: no prefix cache."""
        if self._prefix_cache is None:
            return {"budget_bytes": 0, "bytes": 0, "entries": 0, "hits": 0, "reused_tokens": 0,
                    "stored": 0, "evicted": 0}
        return self._prefix_cache.stats()

    @staticmethod
    def _drafts(backend) -> bool:
        """The backend drafts with an MTP head (native with an MTP block and draft_depth > 0)."""
        return bool(getattr(backend, "supports_speculative", False)) and getattr(backend, "draft_depth", 0) >= 1

    @classmethod
    def _draft_vocab(cls, backend):
        """The draft head's vocabulary where the backend drafts over a large one (None otherwise)."""
        if not cls._drafts(backend):
            return None
        from .speculative import DEFAULT_DRAFT_VOCAB_SIZE, DraftVocab

        if backend.n_vocab <= DEFAULT_DRAFT_VOCAB_SIZE:
            return None
        return DraftVocab.from_gguf(backend._model_file.path, n_vocab=backend.n_vocab)

    @classmethod
    def _make_speculator(cls, backend, vocab=None):
        """MTP speculative decoding where the backend drafts; None otherwise."""
        if not cls._drafts(backend):
            return None
        from .speculative_native import NativeSpeculator

        return NativeSpeculator(backend, backend.draft_depth, vocab)

    def _speculator_for(self, slot: _Slot):
        """The speculator of this request: its slot's on a one-slot engine; with several slots, its
        slot's only when no other slot is serving a request and the slot's MTP cache follows its
        sequence (one client alone keeps MTP speculation), else None: the request decodes in the
        shared passes, and after its prefill its sequence's MTP cache stops following (`leave_mtp`:
        a shared pass makes no MTP rows)."""
        spec = self._speculators.get(slot.index)
        if spec is None or len(self._slots) == 1:
            return spec
        with self._cv:
            alone = all(s.owner is None for s in self._slots if s is not slot)
        return spec if alone and slot.backend.supports_speculative else None

    # --- properties ---------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self._backend.n_ctx

    @property
    def n_vocab(self) -> int:
        return self._backend.n_vocab

    @property
    def supports_speculative(self) -> bool:
        """Requests can speculate: every greedy-able one on a one-slot engine, one served alone with
        several slots."""
        return bool(self._speculators)

    @property
    def n_slots(self) -> int:
        """Conversations held at once: requests that run concurrently."""
        return len(self._slots)

    # slot 0's state (the only one on a one-slot engine), as the engine had before slots
    @property
    def _tokens(self) -> list[int]:
        return self._slots[0].tokens

    @_tokens.setter
    def _tokens(self, value: list[int]) -> None:
        self._slots[0].tokens = value

    @property
    def _logits(self) -> np.ndarray | None:
        return self._slots[0].logits

    # --- text <-> tokens -----------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = False, parse_special: bool = True) -> list[int]:
        self._check_open()
        if isinstance(text, str):
            text = text.encode("utf-8")
        elif not isinstance(text, (bytes, bytearray)):
            raise ValueError(f"text must be str or bytes, got {type(text).__name__}")
        return self._backend.tokenize(bytes(text), add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_open()
        return self._backend.detokenize(self._check_tokens(tokens, "tokens")).decode("utf-8", errors="replace")

    # --- generation ----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int | None = 256,
                 temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                 seed: int | None = None, stop: str | Sequence[str] | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repeat_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
                 constraint=None, logprobs: bool = False, top_logprobs: int = 0,
                 stream: bool = False):
        """Continue `prompt` (text, tokenised with the model's special tokens, or token ids).

        Returns a GenerationResult, or with stream=True an iterator of Chunks whose last one carries
        finish_reason and stats. max_tokens=None generates until the context is full.
        constraint: a constraints.Constraint (or its dict form): the output must match it; when
        the prompt leaves a <think> block open it applies after </think>.
        logprobs: report each generated token's log-probability (TokenLogprob), with its
        top_logprobs (0..20) most likely alternatives, in the result and in every chunk.
        Raises ValueError for a bad parameter and ContextOverflowError when the prompt plus
        max_tokens cannot fit n_ctx.
        """
        self._check_open()
        n_top = _check_logprobs(logprobs, top_logprobs)
        prompt_tokens = self._prompt_tokens(prompt)
        room = self.n_ctx - len(prompt_tokens)
        if max_tokens is None:
            if room < 1:
                raise ContextOverflowError(len(prompt_tokens), self.n_ctx,
                                           f"the prompt has {len(prompt_tokens)} tokens, which leaves no room "
                                           f"to generate in the context window n_ctx={self.n_ctx}")
            max_tokens = room
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, seed=seed, stop=stop, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty,
                                logit_bias=logit_bias,
                                # penalties count generated tokens only, as llama-cpp-python's
                                # sampler (which never sees the prompt) and OpenAI's do
                                penalty_start=len(prompt_tokens))
        if params.logit_bias and max(params.logit_bias) >= self.n_vocab:
            raise ValueError(f"logit_bias names token id {max(params.logit_bias)}, outside the "
                             f"vocabulary [0, {self.n_vocab})")
        if len(prompt_tokens) + params.max_tokens > self.n_ctx:
            raise ContextOverflowError(
                len(prompt_tokens) + params.max_tokens, self.n_ctx,
                f"prompt of {len(prompt_tokens)} tokens plus max_tokens={params.max_tokens} needs "
                f"{len(prompt_tokens) + params.max_tokens} positions, more than the context window "
                f"n_ctx={self.n_ctx}; shorten the prompt, lower max_tokens or load with a larger n_ctx")
        grammar = None
        if constraint is not None:
            grammar = self._grammar_state(constraint, prompt, prompt_tokens)
        events = self._run(prompt_tokens, params, grammar, n_top)
        if stream:
            self._streams[events] = threading.get_ident()
            return events
        parts: list[str] = []
        tokens: list[int] = []
        lps: list[TokenLogprob] | None = [] if n_top is not None else None
        last = None
        for chunk in events:
            parts.append(chunk.text)
            tokens += chunk.tokens
            if lps is not None:
                lps += chunk.logprobs
            last = chunk
        assert last is not None and last.stats is not None
        return GenerationResult("".join(parts), tokens, last.finish_reason or "stop", last.stats, lps)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    enable_thinking: bool = False, add_generation_prompt: bool = True) -> str:
        return chat_template.render(self.chat_template, messages, tools=tools,
                                    enable_thinking=enable_thinking,
                                    add_generation_prompt=add_generation_prompt)

    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, enable_thinking: bool = False,
             stream: bool = False, **sampling):
        """Render `messages` with the model's own template and generate the assistant's reply.

        The reply is the raw text (any <think> block and <tool_call> parts included; see
        parsing.py to split them). Sampling keywords are those of generate().
        """
        prompt = self.render_chat(messages, tools=tools, enable_thinking=enable_thinking)
        return self.generate(prompt, stream=stream, **sampling)

    # --- constraints ---------------------------------------------------------------------------
    @property
    def tool_call_format(self) -> str:
        """The tool-call form the chat template asks for: "qwen_xml" or "json" (parsing.py)."""
        from .parsing import tool_call_format
        return tool_call_format(self.chat_template)

    def _constraint_compiler(self):
        """The vocabulary as llguidance sees it: built from the GGUF's own tokenizer once (the
        first of concurrent requests builds it, the others wait for it)."""
        with self._constraints_lock:
            return self._build_constraint_compiler()

    def _build_constraint_compiler(self):
        if self._constraints is None:
            from .constraints import ConstraintCompiler
            from .errors import ModelFileError
            from .tokenizer import Tokenizer
            try:
                tok = Tokenizer.from_gguf(self.model_path)
            except ModelFileError as exc:
                raise ValueError(f"constraint: constrained decoding needs the model's byte-level BPE "
                                 f"vocabulary, which this model does not have ({exc})") from None
            self._constraints = ConstraintCompiler.from_tokenizer(tok, self.eog_tokens, self.n_vocab,
                                                                  self.tool_call_format)
        return self._constraints

    def _grammar_state(self, constraint, prompt, prompt_tokens: list[int]):
        from .constraints import Constraint, prompt_opens_think
        c = constraint if isinstance(constraint, Constraint) else Constraint.from_dict(constraint)
        if isinstance(prompt, str):
            head = prompt
        else:
            # where the prompt ends is all that decides whether a think block is open
            head = self._backend.detokenize(prompt_tokens[-256:]).decode("utf-8", errors="replace")
        return self._constraint_compiler().state(c, thinking=prompt_opens_think(head))

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        me = threading.get_ident()
        if any(s.owner == me for s in self._slots):
            # this thread's own open streams: end them (their cleanup frees their slots); other
            # threads' streams are waited for
            for stream, thread in list(self._streams.items()):
                if thread == me and not stream.gi_running:
                    stream.close()
        with self._cv:
            while any(s.owner is not None for s in self._slots):
                self._cv.wait()
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()           # requests waiting for a slot: the engine is closed
            self._backend.close()
            if self._prefix_cache is not None:
                self._prefix_cache.clear()
            if self._model_file is not None:
                self._model_file.close()

    def _held_by_another_thread(self) -> bool:
        me = threading.get_ident()
        return any(s.owner not in (None, me) for s in self._slots)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine({str(self.model_path)!r}, backend={self.backend_name!r}, n_ctx={self.n_ctx})"

    # --- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise OpenJetError("this engine is closed")

    def _check_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        if isinstance(tokens, (str, bytes)):
            raise ValueError(f"{what} must be a list of token ids")
        out = []
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{what} must contain integer token ids, got {t!r}")
            if not 0 <= int(t) < self.n_vocab:
                raise ValueError(f"{what} contains token id {int(t)}, outside the vocabulary [0, {self.n_vocab})")
            out.append(int(t))
        return out

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            # add_special: BOS only where the vocabulary asks for it (qwen35 does not), as llama.cpp
            tokens = self.tokenize(prompt, add_special=True, parse_special=True)
        elif isinstance(prompt, (bytes, bytearray)):
            tokens = self.tokenize(bytes(prompt), add_special=True, parse_special=True)
        else:
            tokens = self._check_tokens(prompt, "prompt")
        if not tokens:
            raise ValueError("prompt is empty: give at least one token of text")
        return tokens

    def _acquire(self, prompt: list[int]) -> _Slot:
        """A free slot for this request: the one whose tokens share the longest prefix with the
        prompt (the least recently used among equals). Waits, in arrival order, while none is
        free."""
        me = threading.get_ident()
        with self._cv:
            self._check_open()
            if any(s.owner == me for s in self._slots):
                # this thread's own open stream holds a slot: waiting could be waiting for itself
                if not any(s.owner is None for s in self._slots):
                    raise EngineBusyError("this thread still has an open stream on this engine; "
                                          "exhaust it or call .close() on it before the next request")
            else:
                ticket = object()
                self._waiting.append(ticket)
                try:
                    while not (self._waiting[0] is ticket and any(s.owner is None for s in self._slots)):
                        self._cv.wait()
                        self._check_open()
                finally:
                    self._waiting.remove(ticket)
                    self._cv.notify_all()
            free = [s for s in self._slots if s.owner is None]
            slot = max(free, key=self._slot_preference(prompt))
            slot.owner = me
            return slot

    def _slot_preference(self, prompt: list[int]):
        """The key a request picks its slot by (the largest wins). Without a prefix cache copy of
        the prompt: the longest shared prefix, then the fewest runs of consecutive ids among the busy
        slots with this one (below), then the least recently used. With one, a slot the
        request would cut (it holds tokens past the shared part) is counted at the copy's length:
        a recurrent state goes back only to a checkpoint, and every checkpoint the engine takes is
        a copy in the cache too (unless evicted), so any slot serves as much; a slot the request
        extends (an empty one, or its own conversation) then comes first, so the conversations in
        the others keep their state; then the longest shared prefix (the same conversation
        regenerated lands on its slot), then the fewest runs, then the least recently used."""
        hit = (self._prefix_cache.longest(prompt, len(prompt) - 1, touch=False)
               if self._prefix_cache is not None else None)
        busy = {s.index for s in self._slots if s.owner is not None}

        def runs(s: _Slot) -> int:
            # Runs of consecutive ids among the busy slots with s: llama.cpp makes one ubatch (one
            # read of the weights) of sequences whose ids follow one another
            # (backends/llama_cpp_sequences.py, _compose), so between slots that serve as much the
            # one that closes a gap or extends a run comes before the least recently used.
            ids = busy | {s.index}
            return sum(1 for i in ids if i - 1 not in ids)
        if hit is None:
            return lambda s: (_common_prefix(s.tokens, prompt), -runs(s), -s.last_used)
        cached = hit.state.n_past

        def key(s: _Slot):
            common = _common_prefix(s.tokens, prompt)
            extends = common == len(s.tokens)
            return (max(common, cached) if extends else cached), extends, common, -runs(s), -s.last_used
        return key

    def _release(self, slot: _Slot) -> None:
        with self._cv:
            slot.owner = None
            slot.last_used = next(self._uses)
            self._cv.notify_all()

    def _forget_state(self, slot: _Slot | None = None) -> None:
        """Empty a slot's state (None: every slot's; no request may be running)."""
        for s in ([slot] if slot is not None else self._slots):
            s.tokens, s.logits = [], None
            try:
                s.backend.reset()
            except Exception:  # noqa: BLE001 - the original error is the one to report
                log.exception("backend reset failed")

    def _prefill(self, slot: _Slot, prompt: list[int], want_logits: bool
                 ) -> tuple[np.ndarray | None, int | None, int, int]:
        """Bring the slot's state to `prompt`; return (logits or None, argmax or None, cached,
        of which loaded from the prefix cache)."""
        b = slot.backend
        common = _common_prefix(slot.tokens, prompt)
        if common == len(prompt) == len(slot.tokens) and slot.logits is not None:
            return slot.logits, None, common, 0       # the same prompt again: nothing to evaluate
        todo, common, from_cache = self._prefill_head(slot, prompt)
        if want_logits:
            logits = b.eval(todo)
            slot.tokens += todo
            slot.logits = logits
            return logits, None, common, from_cache
        top = b.eval_argmax(todo)
        slot.tokens += todo
        return None, top, common, from_cache

    def _prefill_head(self, slot: _Slot, prompt: list[int]) -> tuple[list[int], int, int]:
        """Bring the slot's state to the prompt but its last token (but its last tokens where the
        backend keeps no checkpoints and there is no prefix cache): from the shared prefix, a
        checkpoint or a prefix cache copy, keeping a copy at the end of the first turn and before
        the last token. Returns (the prompt tokens still to evaluate, cached, of which loaded from
        the prefix cache)."""
        b = slot.backend
        common = _common_prefix(slot.tokens, prompt)
        if common == len(prompt):
            common -= 1                                # at least one token must be evaluated for logits
        cache = self._prefix_cache
        last = len(prompt) - 1                         # a copy serves at most prompt[:-1]: no logits in it
        hit = cache.longest(prompt, last, common) if cache is not None else None
        if hit is None and common < b.n_past and not b.rollback(common):
            restore = getattr(b, "restore_checkpoint", None)
            if restore is not None:
                common = restore(common)               # newest checkpoint at or before common
            else:
                b.reset()
                common = 0
            log.debug("backend %s could not roll back; resumed from %d tokens", b.name, common)
            if cache is not None:
                hit = cache.longest(prompt, last, common)
        from_cache = 0
        if hit is not None:
            # the copy replaces the slot's whole state (other slots are not touched)
            if b.load_state(hit.state):
                common = from_cache = hit.state.n_past
                cache.count_hit(from_cache)
            else:
                common = 0
                log.warning("backend %s could not load a prefix cache copy; prefilling from the start", b.name)
        slot.tokens = list(prompt[:common])
        slot.logits = None
        todo = prompt[common:]
        if cache is not None:
            # the end of the first turn: where a system prompt or a scaffold's instructions end,
            # the prefix other conversations share
            turn = self._first_turn_end(prompt)
            if common < turn < last and prompt[:turn] not in cache:
                b.eval(prompt[common:turn])
                slot.tokens = list(prompt[:turn])
                todo = prompt[turn:]
                self._keep_prefix(b, slot.tokens)
        save = getattr(b, "save_checkpoint", None)
        if save is not None or cache is not None:
            # checkpoint before the last prompt token: asking for the same prompt again, or a
            # history that changes after it (a regenerated or re-rendered reply), resumes here
            if len(todo) > 1:
                b.eval(todo[:-1])
                slot.tokens += todo[:-1]
                todo = todo[-1:]
            if save is not None:
                save()
            if cache is not None and slot.tokens not in cache:
                self._keep_prefix(b, slot.tokens)
        return todo, common, from_cache

    def _first_turn_end(self, prompt: list[int]) -> int:
        """Tokens up to and including the prompt's first end-of-turn token (<|im_end|> in
        ChatML); 0 when it has none."""
        eog = self.eog_tokens
        return next((i + 1 for i, t in enumerate(prompt) if t in eog), 0)

    def _keep_prefix(self, backend, prefix: list[int]) -> None:
        """Copy the sequence's state (which holds exactly `prefix`) into the prefix cache."""
        cache = self._prefix_cache
        state = backend.save_state(cache.max_copy_bytes)
        if state is not None:
            cache.put(prefix, state)

    def _prefill_before_last(self, slot: _Slot, prompt: list[int]) -> tuple[int, int]:
        """Speculative requests: bring the state to prompt[:-1] (the last prompt token enters the
        first cycle, which emits the first tokens), as _prefill does before its last token.
        Returns (cached prompt tokens, of which loaded from the prefix cache)."""
        todo, common, from_cache = self._prefill_head(slot, prompt)
        if len(todo) > 1:
            slot.backend.eval(todo[:-1])
            slot.tokens += todo[:-1]
        slot.logits = None
        return common, from_cache

    def _run(self, prompt: list[int], params: SamplingParams, grammar=None,
             n_top: int | None = None) -> Iterator[Chunk]:
        """The generation loop, as a generator: a slot is taken at the first next() and freed
        when it finishes or is closed (a stream dropped early leaves the slot's tokens equal to
        its state)."""
        slot = self._acquire(prompt)
        try:
            self._check_open()
            yield from self._generate_locked(slot, prompt, params, grammar, n_top)
        except Exception:
            # a backend that failed mid-call may hold a partial state: forget it
            self._forget_state(slot)
            raise
        finally:
            self._release(slot)

    def _generate_locked(self, slot: _Slot, prompt: list[int], params: SamplingParams, grammar=None,
                         n_top: int | None = None) -> Iterator[Chunk]:
        """The loop of one request on its slot. grammar: a constraints.GrammarState that masks
        every draw and takes every emitted token (on a speculative backend the speculator feeds
        it, drafts included); n_top: None (no logprobs) or the number of alternatives per token."""
        b = slot.backend
        stats = GenerationStats(prompt_tokens=len(prompt), backend=b.name)
        self.last_stats = stats
        sampler = Sampler(params)
        want_rows = n_top is not None
        # greedy without penalties needs only the argmax: a GPU backend keeps the logits on the
        # device (not when a mask or the logprobs need the row)
        argmax_only = (params.greedy and not params.has_penalties and not params.logit_bias
                       and grammar is None and not want_rows)
        # greedy with negative biases only (bans, such as -inf on the end tokens): a bias only lowers
        # a logit, so the argmax stands unless it is a biased id; on shared passes such a request
        # chains as well, and a step whose argmax is biased ends the chain with its row kept
        # (passes.Chain.row), to which the biases apply; a new chain goes on from the token chosen
        # (the ids of a bias of 0 cannot change the choice: only the negative ones end a chain; a
        # row with NaN logits is left to the GPU's argmax, which skips NaN, as argmax-only requests do)
        bans = (frozenset(k for k, v in params.logit_bias.items() if v < 0)
                if params.greedy and not params.has_penalties and params.logit_bias and grammar is None
                and not want_rows and all(v <= 0 for v in params.logit_bias.values())
                else frozenset())

        spec = self._speculator_for(slot)
        queue: list[int] = []       # tokens a speculative cycle emitted, still to hand out
        rows: list[np.ndarray] = []  # with logprobs: the target's logits row of each queued token
        t0 = time.perf_counter()
        if spec is not None:
            cached, stats.prefix_cache_tokens = self._prefill_before_last(slot, prompt)
            if b.supports_speculative:
                spec.begin(prompt)
                rng = np.random.default_rng(None if params.seed is None else params.seed + 1)
                logits, top = None, prompt[-1]      # the last prompt token is the first cycle's current
            else:
                # the prefix cache's copy it loaded came from a sequence that decoded in shared
                # passes (no MTP rows): this request decodes without drafts, from its last token
                spec = None
                b.leave_mtp()
                last = prompt[-1:]
                if argmax_only:
                    logits, top = None, b.eval_argmax(last)
                else:
                    logits, top = b.eval(last), None
                    slot.logits = logits
                slot.tokens += last
        else:
            logits, top, cached, stats.prefix_cache_tokens = self._prefill(slot, prompt,
                                                                           want_logits=not argmax_only)
            if argmax_only and top is None:
                top = int(np.argmax(logits))
            if self._speculators and len(self._slots) > 1:
                # its decode steps go into the shared passes, which make no MTP rows (a restore in
                # the prefill may have brought the sequence back to where its rows reach)
                b.leave_mtp()
        t1 = time.perf_counter()
        stats.cached_prompt_tokens = cached
        stats.prefill_seconds = t1 - t0

        text = _TextAssembler(params.stop)
        history = list(prompt)
        generated: list[int] = []
        unreported: list[int] = []
        unreported_lp: list[TokenLogprob] | None = [] if want_rows else None
        finish: str | None = None
        paused = 0.0          # time the caller spent between stream chunks is not decode time
        chosen = top if argmax_only else None     # the next token when it is known without sampling
        # Greedy steps on a backend of shared passes: the token goes to the scheduler as soon as it
        # is chosen, and its pass runs while the text is assembled and the chunk goes out (the
        # caller's time with the chunk included); `early` waits for it. That work starts once the
        # pass has begun (`launched`): before, it would hold the interpreter lock the scheduler
        # needs to compose the pass (passes.Submitted). A token the text then ends on (a stop
        # string) is in the state anyway, and in slot.tokens with it.
        shared = spec is None and len(self._slots) > 1
        submit = getattr(b, "submit_argmax", None) if argmax_only and shared else None
        early = None
        # Better still, a chain (passes.submit_chain): the scheduler hands in each next step itself,
        # so no pass waits for this thread to wake; the loop below reads the same argmaxes in order,
        # and the tokens the chain evaluated past where the text ends go into slot.tokens at the end
        new_chain = getattr(b, "submit_chain", None) if shared and (argmax_only or bans) else None
        # without chains a request with bans takes each step's argmax, and its row only where the
        # argmax is biased (a backend's eval_argmax_rows)
        eval_rows = getattr(b, "eval_argmax_rows", None) if bans and spec is None else None
        start_chain = new_chain
        chain, chain_k, chain_base = None, 0, 0
        if spec is not None:
            queue = self._cycle(slot, spec, top, history, params, rng, params.max_tokens, stats, grammar,
                                rows if want_rows else None)
            chosen = queue.pop(0)
        try:
            while True:
                if spec is not None:
                    row = rows.pop(0) if want_rows else None
                    tok = chosen
                else:
                    row = logits
                    if chosen is not None:
                        tok = chosen
                    else:
                        tok = sampler.sample(grammar.mask_logits(logits) if grammar is not None else logits,
                                             history)
                stats.generated_tokens += 1
                if tok in self.eog_tokens:
                    finish = "stop"
                    break
                if grammar is not None and spec is None:
                    grammar.consume(tok)
                    grammar.prefetch()          # the next mask, while the model evaluates tok
                generated.append(tok)
                history.append(tok)
                unreported.append(tok)
                if want_rows:
                    unreported_lp.append(self._token_logprob(row, tok, n_top))
                if ((submit is not None or start_chain is not None or chain is not None)
                        and len(generated) < params.max_tokens and len(slot.tokens) + 1 <= self.n_ctx):
                    if chain is None and start_chain is not None:
                        # as many evaluations as this loop would hand in without a stop or an end token
                        chain_base, chain_k = len(slot.tokens), 0
                        chain = start_chain(tok, min(params.max_tokens - len(generated), self.n_ctx - chain_base),
                                            self.eog_tokens, rows_for=bans)
                        start_chain = None
                    if chain is not None:
                        if chain.token(chain_k) != tok:
                            raise RuntimeError(f"the chain's step {chain_k} is token {chain.token(chain_k)}, "
                                               f"the request's {tok}")
                        early = chain.step(chain_k)
                        chain_k += 1
                    elif submit is not None:
                        early = submit([tok])
                        early.launched()
                hit = text.feed(b.detokenize([tok]))
                if hit:
                    finish = "stop"
                    break
                if len(generated) >= params.max_tokens or len(slot.tokens) + 1 > self.n_ctx:
                    finish = "length"
                    break
                out = text.take()
                if out:
                    t_yield = time.perf_counter()
                    yield Chunk(out, unreported, logprobs=unreported_lp)
                    paused += time.perf_counter() - t_yield
                    unreported = []
                    unreported_lp = [] if want_rows else None
                # evaluate the token just sampled to get the next logits
                slot.logits = None
                if spec is not None:
                    if not queue:
                        queue = self._cycle(slot, spec, tok, history, params, rng,
                                            params.max_tokens - len(generated), stats, grammar,
                                            rows if want_rows else None)
                    chosen = queue.pop(0)
                elif early is not None:
                    wait, early = early, None
                    chosen = wait()
                    slot.tokens.append(tok)
                    if chosen in bans:          # the chain ended there, its row kept: the biases choose
                        logits, chosen = chain.row(), None
                        if logits is None:
                            raise RuntimeError(f"the chain ended at the biased token {wait()} without its "
                                               "logits row")
                        slot.logits = logits
                        chain, start_chain = None, new_chain
                elif argmax_only:
                    chosen = b.eval_argmax([tok])
                    slot.tokens.append(tok)
                elif bans and eval_rows is not None:
                    chosen, logits = eval_rows([tok], bans)
                    slot.tokens.append(tok)
                    if chosen in bans:          # the row came with it: the biases choose
                        chosen, slot.logits = None, logits
                else:
                    logits, chosen = b.eval([tok]), None
                    slot.tokens.append(tok)
                    slot.logits = logits
        finally:
            if early is not None:               # the text ended (or the caller left) on a token in its pass
                try:
                    early()
                    slot.tokens.append(tok)
                    slot.logits = None
                except Exception:  # noqa: BLE001 - the token did not go in; the request is over anyway
                    log.debug("the pass of the last token failed", exc_info=True)
            if chain is not None:               # stopped; what it evaluated beyond the text is in the state
                evaluated = chain.cancel()
                slot.tokens.extend(evaluated[len(slot.tokens) - chain_base:])
                slot.logits = None
            stats.decode_seconds = time.perf_counter() - t1 - paused
            stats.tokens_per_second = (stats.generated_tokens / stats.decode_seconds
                                       if stats.decode_seconds > 0 else 0.0)
        yield Chunk(text.finish(), unreported, finish, stats, logprobs=unreported_lp)

    def _token_logprob(self, logits: np.ndarray, tok: int, n_top: int) -> TokenLogprob:
        """tok's log-softmax under `logits` (the whole vocabulary), with the n_top most likely."""
        x = np.asarray(logits, dtype=np.float32)
        lse = _logsumexp(x)
        top: list[TokenLogprob] = []
        if n_top:
            ids = top_ids(x, n_top)
            top = [TokenLogprob(int(i), self._backend.detokenize([int(i)]), float(x[i]) - lse) for i in ids]
        return TokenLogprob(int(tok), self._backend.detokenize([int(tok)]), float(x[tok]) - lse, top)

    def _cycle(self, slot: _Slot, spec, tok: int, history: list[int], params: SamplingParams, rng,
               max_emit: int, stats: GenerationStats, grammar=None, rows: list | None = None) -> list[int]:
        """One speculative cycle from tok: the state takes tok and the accepted drafts; returns
        the emitted tokens (the last is the next cycle's current token). grammar (the request's
        GrammarState) is left after the emitted tokens; rows, when given, gets the target's
        logits row of each emitted token."""
        if len(self._slots) > 1:     # the cycle reads its own verify's results: no pass in between
            with slot.backend.exclusive():
                emitted, depth, accepted = spec.cycle(tok, history, params, rng, max_emit, grammar=grammar,
                                                      rows_out=rows)
        else:
            emitted, depth, accepted = spec.cycle(tok, history, params, rng, max_emit, grammar=grammar, rows_out=rows)
        slot.tokens += [tok] + emitted[:-1]
        stats.cycles += 1
        stats.drafts_proposed += depth
        stats.drafts_accepted += accepted
        return emitted


def _logsumexp(x: np.ndarray) -> float:
    """log sum exp over a float32 row; the sum in float64 (a 248K-row's sum loses digits in
    float32), the exponentials in float32 (a third of the time of a float64 pass)."""
    m = float(x.max())
    return m + float(np.log(np.exp(x - np.float32(m)).sum(dtype=np.float64)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the vocabulary (float64), as TokenLogprob reports it."""
    x = np.asarray(logits, dtype=np.float32)
    return x.astype(np.float64) - _logsumexp(x)


def _check_logprobs(logprobs: object, top_logprobs: object) -> int | None:
    """None when logprobs are off, else the number of alternatives per token."""
    if not isinstance(logprobs, bool):
        raise ValueError(f"logprobs must be True or False, got {logprobs!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer)) \
            or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    if top_logprobs and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    return int(top_logprobs) if logprobs else None


class _TextAssembler:
    """Bytes of generated tokens in, text out: never half a UTF-8 character, never any part of a
    stop string. A suffix that could be the start of a stop string is held back until the next
    token decides it."""

    def __init__(self, stop: Sequence[str]):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._pending = ""

    def feed(self, piece: bytes) -> bool:
        """Add a token's bytes; True when a stop string is complete (the text before it is kept)."""
        self._pending += self._decoder.decode(piece)
        if not self._stop:
            return False
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = self._pending[:cut]
            self._decoder.reset()
            return True
        return False

    def take(self) -> str:
        """Text that can be emitted now."""
        hold = self._held_back()
        out = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return out

    def finish(self) -> str:
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out

    def _held_back(self) -> int:
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:n]):
                    best = n
                    break
        return best


# --- load -------------------------------------------------------------------------------------------

MAX_SLOTS = 64


def check_slots(n_slots: object) -> int | None:
    if n_slots is not None and (isinstance(n_slots, bool) or not isinstance(n_slots, int)
                                or not 1 <= n_slots <= MAX_SLOTS):
        raise ValueError(f"n_slots must be an integer in [1, {MAX_SLOTS}] or None (the backend's choice), "
                         f"got {n_slots!r}")
    return n_slots

def _eog_tokens(tokens: list[str], token_type: list[int], metadata: dict) -> tuple[set[int], int | None]:
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eog: set[int] = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = metadata.get(key)
        if isinstance(v, int) and 0 <= v < len(tokens):
            eog.add(v)
    wanted = set(_EOG_TEXTS)
    for i, t in enumerate(tokens):
        if t in wanted:
            eog.add(i)
    return eog, (int(eos) if isinstance(eos, int) else None)


def _load_foreign(path: Path, declined: "WrongArchitectureError", *, backend: str, n_ctx: int,
                  kv_type: str, n_threads: int | None, n_slots: int | None = 1,
                  prefix_cache_bytes: int | None = None) -> Engine:
    """A GGUF of another architecture: llama.cpp runs it (backend="native" raises, saying why)."""
    from .backends.select import create_backend
    from .model_file import read_foreign

    info = read_foreign(path)
    if info.n_ctx_train and n_ctx > info.n_ctx_train:
        raise ValueError(f"n_ctx={n_ctx} exceeds the model's training context {info.n_ctx_train} ({path.name})")
    why = f"{path.name} is a {info.architecture!r} model and the native engine runs only {declined.expected!r}"
    be, reason = create_backend(backend, path, None, n_ctx=n_ctx, kv_type=kv_type, n_threads=n_threads,
                                declined=why, n_layers=info.n_layers, n_slots=n_slots)
    tf = info.tokenizer
    eog, eos = _eog_tokens(tf.tokens, tf.token_type, info.metadata)
    return Engine(be, model_path=path, config=None, metadata=info.metadata, chat_template_source=info.chat_template,
                  eog_tokens=eog, token_eos=eos, backend_reason=reason, prefix_cache_bytes=prefix_cache_bytes)


def load(model_path: str | os.PathLike[str] | None = None, *, backend: str = "auto", n_ctx: int = 4096,
         draft_depth: int = 4, kv_type: str = "f16", seed: int | None = None, verbose: bool = False,
         n_threads: int | None = None, checkpoint_interval: int = 0, n_checkpoints: int | None = None,
         prefill_chunk: int | None = None, n_slots: int | None = 1,
         prefix_cache_bytes: int | None = None) -> Engine:
    """Open a GGUF and start a backend for it: a qwen35 model on the native engine where it can
    run, anything else llama.cpp runs (another architecture included) on llama.cpp.

    model_path None: the embedded default model (defaults.default_model_path()).
    backend: "auto" (native when this machine and model support it, else llama.cpp; the reason is
    in `engine.backend_reason`), "llama.cpp" or "native" (raises BackendUnavailableError, with the
    reason, where it cannot run).
    checkpoint_interval / n_checkpoints (native): also keep a copy of the recurrent state every N
    prompt tokens, in a ring of K device slots (each one DeltaNet state: ~157 MB for the 27B,
    `engine.memory()`-style figures in the backend's memory report), so an edit earlier in a long
    conversation re-evaluates from the nearest copy before it instead of from the start.
    prefill_chunk (native): positions per batched prefill pass (oj_prefill), 64..4096, or 0 for
    none (prompts then go 8 positions per call); None: the backend's default (2048). Its buffers
    grow with it (the backend's memory report, `prefill`).
    n_slots: conversations held at once, so that as many requests (threads) run concurrently and
    share the backend's passes (see Engine); each has its own n_ctx positions of KV cache and its
    own recurrent state. None: the backend's choice for a server (4, see backends/llama_cpp.py
    DEFAULT_SERVE_SEQUENCES). The native engine holds at most 8 (backend="auto" runs llama.cpp for
    more, saying why) and with more than one only a request served alone speculates (the others
    decode in shared passes); n_checkpoints is per slot there.
    prefix_cache_bytes: host memory for copies of the state after recurring prompt prefixes, so a
    request in any slot reuses a system prompt another request evaluated (see Engine;
    prefix_cache.py); least recently used copies go first. None: DEFAULT_PREFIX_CACHE_BYTES (2 GiB)
    with several slots, 0 with one; 0: no prefix cache.
    """
    from .backends.select import create_backend
    from .defaults import default_model_path
    from .model_file import open_model

    if verbose:
        logging.basicConfig(level=logging.INFO)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 16:
        raise ValueError(f"n_ctx must be an integer >= 16, got {n_ctx!r}")
    if isinstance(draft_depth, bool) or not isinstance(draft_depth, int) or not 0 <= draft_depth <= 8:
        raise ValueError(f"draft_depth must be an integer in [0, 8], got {draft_depth!r}")
    if kv_type not in ("f16", "q8_0"):
        raise ValueError(f"kv_type must be 'f16' or 'q8_0', got {kv_type!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) or checkpoint_interval < 0:
        raise ValueError(f"checkpoint_interval must be an integer >= 0 (0: off), got {checkpoint_interval!r}")
    if n_checkpoints is not None and (isinstance(n_checkpoints, bool) or not isinstance(n_checkpoints, int)
                                      or not 1 <= n_checkpoints <= 64):
        raise ValueError(f"n_checkpoints must be an integer in [1, 64], got {n_checkpoints!r}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or not (prefill_chunk == 0 or 64 <= prefill_chunk <= 4096)):
        # the native engine's range (backends/native.py check_prefill_chunk, openjet.h)
        raise ValueError(f"prefill_chunk must be 0 (no batched prefill) or an integer in [64, 4096], "
                         f"got {prefill_chunk!r}")
    if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int)
                                  or n_threads < 1):
        raise ValueError(f"n_threads must be a positive integer or None, got {n_threads!r}")
    check_slots(n_slots)
    check_prefix_cache_bytes(prefix_cache_bytes)

    path = Path(default_model_path() if model_path is None else model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model file not found: {path}")
    if path.is_dir():
        raise FileNotFoundError(f"model path is a directory, not a GGUF file: {path}")
    with warnings.catch_warnings():
        if not verbose:
            warnings.simplefilter("ignore")     # e.g. "no MTP block": relevant to native only
        try:
            mf = open_model(path)
        except WrongArchitectureError as exc:
            # another architecture is a fallback case, not an error: llama.cpp runs it
            return _load_foreign(path, exc, backend=backend, n_ctx=n_ctx, kv_type=kv_type, n_threads=n_threads,
                                 n_slots=n_slots, prefix_cache_bytes=prefix_cache_bytes)
    try:
        if n_ctx > mf.config.n_ctx_train:
            raise ValueError(f"n_ctx={n_ctx} exceeds the model's training context "
                             f"{mf.config.n_ctx_train} ({path.name})")
        tf = mf.tokenizer_fields
        eog, eos = _eog_tokens(tf.tokens, tf.token_type, mf.metadata)
        metadata = dict(mf.metadata)
        template = mf.chat_template
        config = mf.config
        ckpt = {}
        if checkpoint_interval:
            ckpt["checkpoint_interval"] = checkpoint_interval
        if n_checkpoints is not None:
            ckpt["n_checkpoints"] = n_checkpoints
        if prefill_chunk is not None:       # native only, like the checkpoint options
            ckpt["prefill_chunk"] = prefill_chunk
        be, reason = create_backend(backend, path, mf, n_ctx=n_ctx, draft_depth=draft_depth, checkpoints=ckpt,
                                    kv_type=kv_type, seed=seed, n_threads=n_threads, n_slots=n_slots)
    except BaseException:
        mf.close()
        raise
    keep_open = be.name == "native"
    if not keep_open:
        mf.close()
    return Engine(be, model_path=path, config=config, metadata=metadata, chat_template_source=template,
                  eog_tokens=eog, token_eos=eos, backend_reason=reason,
                  model_file=mf if keep_open else None, prefix_cache_bytes=prefix_cache_bytes)

