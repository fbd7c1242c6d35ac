"""LlamaCppBackend: llama.cpp (through llama-cpp-python) on the CPU, the backend that works everywhere.

It only turns tokens into logits; the engine samples. One `llama_cpp.Llama` holds the model and
one sequence's memory (KV cache for the attention layers, recurrent state for the DeltaNet layers).
Logits are requested for the last token of each batch only.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from ..errors import BackendUnavailableError

KV_TYPES = {"f16": 1, "q8_0": 8}   # GGML_TYPE_F16, GGML_TYPE_Q8_0
MAX_CHECKPOINTS = 3


def default_threads() -> int:
    env = os.environ.get("OPENJET_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"OPENJET_THREADS must be an integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"OPENJET_THREADS must be >= 1, got {n}")
        return n
    # llama-cpp-python's own default: half the logical CPUs (one per physical core on SMT
    # machines). llama.cpp's threads spin at barriers, so oversubscribing a busy machine costs
    # far more than it gains.
    return max(1, (os.cpu_count() or 2) // 2)


class LlamaCppBackend:
    name = "llama.cpp"
    supports_speculative = False

    def __init__(self, model_path: str | os.PathLike[str], n_ctx: int, *, kv_type: str = "f16",
                 n_threads: int | None = None, n_batch: int = 512):
        try:
            import llama_cpp
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise BackendUnavailableError(f"llama-cpp-python is not installed ({exc})") from None
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        self._lib = llama_cpp
        threads = n_threads or default_threads()
        kwargs = {}
        if kv_type != "f16":
            # a quantised V cache needs flash attention in llama.cpp
            kwargs = dict(type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type], flash_attn=True)
        try:
            self._llm = llama_cpp.Llama(
                model_path=os.fspath(model_path), n_ctx=n_ctx, n_batch=min(n_batch, n_ctx),
                n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                logits_all=False, verbose=False, **kwargs)
        except (ValueError, RuntimeError) as exc:
            raise BackendUnavailableError(
                f"llama.cpp could not load {os.fspath(model_path)}: {exc}") from None
        # llama.cpp rounds the context up (to a multiple of 256); the limit callers asked for is
        # the one the engine enforces
        self.n_ctx = min(n_ctx, self._llm.n_ctx())
        self.n_vocab = self._llm.n_vocab()
        self.n_threads = threads
        # (n_past, recurrent state) pairs, oldest first; see save_checkpoint
        self._checkpoints: list[tuple[int, ctypes.Array]] = []

    # --- tokens <-> text ------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        return list(self._llm.tokenize(text, add_bos=add_special, special=parse_special))

    def detokenize(self, tokens: list[int]) -> bytes:
        # special=True renders control tokens as their text, so detokenize(tokenize(s)) == s for
        # text containing them (a chat history fed back keeps its exact tokens)
        return self._llm.detokenize(list(tokens), special=True)

    # --- state ----------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return int(self._llm.n_tokens)

    def eval(self, tokens: list[int]) -> np.ndarray:
        if not tokens:
            raise ValueError("eval needs at least one token")
        self._llm.eval(tokens)
        ptr = self._lib.llama_get_logits_ith(self._llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True)

    def eval_argmax(self, tokens: list[int]) -> int:
        return int(np.argmax(self.eval(tokens)))

    # --- checkpoints: how a recurrent state goes back -------------------------------------------
    # llama.cpp cannot cut DeltaNet state back to an earlier position, but it can copy out just
    # the recurrent part of a sequence's state ("partial" state: conv + delta-rule state, no KV)
    # and put it back; the attention KV cache is then cut to the same position. This is what
    # llama.cpp's server calls context checkpoints. The engine saves one before the last prompt
    # token of each request, so a regenerated reply or a history that changes after that point
    # re-prefills from there instead of from the start.

    def save_checkpoint(self) -> None:
        """Remember the recurrent state at n_past (the oldest of MAX_CHECKPOINTS is dropped)."""
        n = self.n_past
        if n == 0 or any(p == n for p, _ in self._checkpoints):
            return
        lib, flags = self._lib, self._lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = lib.llama_state_seq_get_size_ext(self._llm.ctx, 0, flags)
        buf = (ctypes.c_uint8 * size)()
        if lib.llama_state_seq_get_data_ext(self._llm.ctx, buf, size, 0, flags) != size:
            return          # a checkpoint is an optimisation; without it we re-prefill
        self._checkpoints.append((n, buf))
        del self._checkpoints[:-MAX_CHECKPOINTS]

    def restore_checkpoint(self, n_max: int) -> int:
        """Go back to the newest checkpoint with at most n_max tokens; return its n_past.
        0 means none was usable and the state was reset."""
        usable = [c for c in self._checkpoints if c[0] <= n_max]
        if usable:
            pos, buf = max(usable, key=lambda c: c[0])
            lib, flags = self._lib, self._lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
            if (lib.llama_state_seq_set_data_ext(self._llm.ctx, buf, len(buf), 0, flags) == len(buf)
                    and self._llm._ctx.kv_cache_seq_rm(0, pos, -1)):
                self._llm.n_tokens = pos
                self._checkpoints = [c for c in self._checkpoints if c[0] <= pos]
                return pos
        self.reset()
        return 0

    def rollback(self, n_keep: int) -> bool:
        if not 0 <= n_keep <= self.n_past:
            raise ValueError(f"rollback to {n_keep} tokens, but the state holds {self.n_past}")
        if n_keep == self.n_past:
            return True
        if n_keep == 0:
            self.reset()
            return True
        # llama.cpp refuses to cut recurrent state partially (unless it keeps snapshots) and
        # then leaves the state as it was
        if not self._llm._ctx.kv_cache_seq_rm(0, n_keep, -1):
            return False
        self._llm.n_tokens = n_keep
        self._checkpoints = [c for c in self._checkpoints if c[0] <= n_keep]
        return True

    def reset(self) -> None:
        self._checkpoints = []
        self._llm.reset()
        mem = self._lib.llama_get_memory(self._llm.ctx)
        if mem is not None:
            self._lib.llama_memory_clear(mem, True)

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.close()
