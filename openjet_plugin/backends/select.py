"""Which backend runs a model: the native CUDA engine where it can, llama.cpp everywhere else.

backend="auto" asks the native side (`backends/native.py`: `native_status(model_file, n_ctx)`,
which checks its library loads, the GPU is sm_86/89/90/120 with enough free memory, and the model
passes its shape/type check) and falls back to llama.cpp with the reason recorded (logged, and
returned so the engine can show it as `backend_reason` and `openjet doctor` can print it).
backend="native" raises BackendUnavailableError with that reason instead of falling back.

Slots: both backends hold several conversations at once (`n_slots`, None: DEFAULT_SERVE_SEQUENCES,
a server's default): llama.cpp through its own sequences, the native engine through its
sequences (at most 8 of them; its memory check counts every one's KV cache and state). A count
the native engine cannot hold is, under auto, a reason to run llama.cpp.
"""

from __future__ import annotations

import importlib
import logging
import os

from ..errors import BackendUnavailableError

log = logging.getLogger("openjet_plugin")

BACKENDS = ("auto", "llama.cpp", "native")
NATIVE_MODULE = "openjet_plugin.backends.native"


def check_backend_name(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    return backend  # type: ignore[return-value]


def _native_module():
    """The native backend module, or (None, why not)."""
    try:
        return importlib.import_module(NATIVE_MODULE), ""
    except ImportError as exc:
        return None, f"the native backend is not installed ({exc})"
    except Exception as exc:  # noqa: BLE001 - a broken native module must not break the fallback
        return None, f"the native backend failed to import: {type(exc).__name__}: {exc}"


def slots_or_default(n_slots: int | None) -> int:
    """The sequences a backend holds for n_slots (None: a server's default, DEFAULT_SERVE_SEQUENCES)."""
    from .llama_cpp import DEFAULT_SERVE_SEQUENCES

    return DEFAULT_SERVE_SEQUENCES if n_slots is None else n_slots


def native_verdict(model_file, n_ctx: int, kv_type: str = "f16", n_slots: int | None = 1) -> tuple[bool, str]:
    """(True, why) when the native backend can run this model here with n_slots sequences of
    n_ctx positions (None: the default for a server), else (False, why not)."""
    mod, why = _native_module()
    if mod is None:
        return False, why
    status = getattr(mod, "native_status", None)
    if status is None:
        return False, f"{NATIVE_MODULE} has no native_status()"
    # the memory check counts the KV cache in the requested type (q8_0: 34 bytes per 32 values)
    # and of every sequence; the defaults are not passed (a status function of one sequence works)
    extra = {} if kv_type == "f16" else {"kv_type": kv_type}
    n_seq = slots_or_default(n_slots)
    if n_seq != 1:
        extra["n_seq"] = n_seq
    try:
        ok, reason = status(model_file, n_ctx, **extra)
    except Exception as exc:  # noqa: BLE001
        return False, f"the native status check failed: {type(exc).__name__}: {exc}"
    return bool(ok), str(reason)


def choose_backend(backend: str, model_file, n_ctx: int, kv_type: str = "f16",
                   n_slots: int | None = 1) -> tuple[str, str]:
    """Resolve `backend` to "native" or "llama.cpp" with the reason, without starting anything, for
    n_slots conversations at once (None: a server's default). Raises BackendUnavailableError for
    backend="native" where native cannot run."""
    check_backend_name(backend)
    if backend == "llama.cpp":
        return "llama.cpp", "llama.cpp requested (backend='llama.cpp')"
    ok, reason = native_verdict(model_file, n_ctx, kv_type, n_slots)
    if ok:
        return "native", reason or "native backend supported on this machine"
    if backend == "native":
        raise BackendUnavailableError(f"backend='native' is not available: {reason}")
    return "llama.cpp", f"native backend unavailable: {reason}; using llama.cpp"


def create_backend(backend: str, model_path: str | os.PathLike[str], model_file, *, n_ctx: int,
                   draft_depth: int = 4, kv_type: str = "f16", seed: int | None = None,
                   checkpoints: dict | None = None,
                   n_threads: int | None = None, declined: str | None = None, n_layers: int | None = None,
                   n_slots: int | None = 1):
    """Start the chosen backend; returns (backend object, reason).

    declined: why the native engine cannot take this file at all (another architecture:
    model_file is then None); the model goes to llama.cpp, or backend="native" raises.
    n_layers: the model's block count, for llama.cpp's GPU placement.
    n_slots: sequences the backend holds (None: DEFAULT_SERVE_SEQUENCES, a server's default);
    the native engine holds up to 8, and with more than one speculates for a request served alone."""
    from .llama_cpp import LlamaCppBackend, sequence_bytes

    n_seq = slots_or_default(n_slots)
    if declined is not None:
        check_backend_name(backend)
        if backend == "native":
            raise BackendUnavailableError(f"backend='native' is not available: {declined}")
        name = "llama.cpp"
        reason = ("llama.cpp requested (backend='llama.cpp')" if backend == "llama.cpp"
                  else f"native backend unavailable: {declined}; using llama.cpp")
    else:
        name, reason = choose_backend(backend, model_file, n_ctx, kv_type, n_seq)
    if name == "native":
        mod, _ = _native_module()
        try:
            # checkpoints: {"n_checkpoints": K, "checkpoint_interval": N}, only when asked for;
            # n_seq only where there are several (a one-sequence backend is built as before)
            seqs = {"n_seq": n_seq} if n_seq != 1 else {}
            be = mod.NativeBackend(model_file, n_ctx, draft_depth, kv_type, seed, **(checkpoints or {}), **seqs)
            return be, reason
        except Exception as exc:  # noqa: BLE001
            if backend == "native":
                raise BackendUnavailableError(
                    f"backend='native' failed to start: {type(exc).__name__}: {exc}") from exc
            reason = f"native backend failed to start ({type(exc).__name__}: {exc}); using llama.cpp"
    if n_layers is None and model_file is not None:
        n_layers = model_file.config.n_layer + model_file.config.n_layer_nextn
    # another architecture's dimensions are not known here: its sequences share GPU_RESERVE_BYTES
    seq_bytes = sequence_bytes(model_file.config, n_ctx, kv_type) if model_file is not None and n_seq > 1 else 0
    be = LlamaCppBackend(model_path, n_ctx, kv_type=kv_type, n_threads=n_threads, n_layers=n_layers,
                         n_seq=n_seq, seq_bytes=seq_bytes)
    reason = f"{reason}; llama.cpp runs on the {be.placement.where}"
    if backend == "auto":
        # no GPU is the normal case on many machines: say it, but do not warn about it
        (log.warning if "failed to start" in reason else log.info)("openjet: %s", reason)
    return be, reason
