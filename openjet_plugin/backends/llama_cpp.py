"""LlamaCppBackend: llama.cpp (through llama-cpp-python), the backend that works everywhere.

It only turns tokens into logits; the engine samples. One `llama_cpp.Llama` holds the model and
the context; a sequence's memory is its KV cache for the attention layers and recurrent state for
the DeltaNet layers. Logits are requested for the last token of each eval only.

A sequence's n_past, eval, rollback and recurrent checkpoints live in one place,
`LlamaCppSequence` (llama_cpp_sequences.py). With one sequence the backend is that of sequence 0
and decodes in the caller's thread. With n_seq > 1 the context holds n_seq sequences (llama.cpp's
own slots: n_seq_max, a KV stream of n_ctx positions and a recurrent state each) and the backend
is used through its `sequences()`, one view per engine slot, whose evals share `llama_decode`
passes.

Where it runs (`gpu_placement`): on the GPU when llama-cpp-python was built with GPU support
(setup_llama.py builds it so where a GPU and a CUDA toolkit are present) and one is visible —
every layer when the model fits in the free memory, else as many as fit — with flash attention,
as llama.cpp runs at its best; otherwise on the CPU. On a host that advertises AMX but does not
run it (cpu_features.py), llama.cpp's extra CPU buffer types (its AMX path) are turned off.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass

import numpy as np

from .. import cpu_features, gpus
from ..errors import BackendUnavailableError
from .llama_cpp_sequences import (  # noqa: F401 - MAX_CHECKPOINTS: callers read it here
    MAX_CHECKPOINTS,
    LlamaCppSequence,
    OneSequencePasses,
    PassScheduler,
)

KV_TYPES = {"f16": 1, "q8_0": 8}   # GGML_TYPE_F16, GGML_TYPE_Q8_0
MAX_SEQUENCES = 64
# Sequences (engine slots) a server opens where the user does not say: 4 concurrent requests
# share each pass, while the KV cache (n_ctx positions per sequence; only the attention layers'
# in qwen35) and the recurrent states stay at 4x one conversation's.
DEFAULT_SERVE_SEQUENCES = 4


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


# Free GPU memory kept back from the weights for the KV cache, recurrent state and llama.cpp's
# compute buffers when deciding how many layers fit.
GPU_RESERVE_BYTES = 1536 << 20


@dataclass(frozen=True)
class Placement:
    n_gpu_layers: int      # llama.cpp's n_gpu_layers: -1 all, 0 none
    where: str             # "GPU (...)" or "CPU (...)", with the reason

    @property
    def on_gpu(self) -> bool:
        return self.n_gpu_layers != 0


def sequence_memory(config, n_ctx: int, kv_type: str = "f16") -> dict[str, int]:
    """Memory one sequence takes in llama.cpp, by purpose: kv_cache, the attention layers' K and V
    for n_ctx positions; recurrent_state, the DeltaNet layers' conv window + delta-rule state (fp32)."""
    per_value = {"f16": 2.0, "q8_0": 34 / 32}[kv_type]
    kv = len(config.attention_layers()) * 2 * config.kv_dim * n_ctx * per_value
    state = (config.ssm_conv_dim * (config.ssm_conv_kernel - 1) + config.ssm_dt_rank * config.ssm_d_state ** 2) * 4
    return {"kv_cache": int(kv), "recurrent_state": len(config.deltanet_layers()) * state}


def sequence_bytes(config, n_ctx: int, kv_type: str = "f16") -> int:
    """Memory one more sequence takes in llama.cpp (`sequence_memory`, all of it)."""
    return sum(sequence_memory(config, n_ctx, kv_type).values())


def checkpoint_memory(config) -> int:
    """Host memory of one sequence's recurrent checkpoints at most (LlamaCppSequence keeps the
    last MAX_CHECKPOINTS copies of its recurrent state, one saved per request)."""
    return MAX_CHECKPOINTS * sequence_memory(config, 16)["recurrent_state"]


def uses_flash_attention(kv_type: str, on_gpu: bool) -> bool:
    """Whether LlamaCppBackend turns llama.cpp's flash attention on: for a quantised KV cache
    (llama.cpp needs it there) and on the GPU (its fastest path there)."""
    return kv_type != "f16" or on_gpu


# Bytes of llama.cpp's graph bookkeeping per graph node (its tensor headers, the graph's node and
# hash arrays: llm_graph_result's buf_compute_meta), host memory: 8.26 MiB for 20,480 nodes.
GRAPH_NODE_BYTES = 424


def compute_memory(config, n_ctx: int, *, flash_attn: bool, on_gpu: bool, n_tensors: int = 0,
                   n_batch: int = 512) -> int:
    """The working memory llama.cpp allocates for one context of LlamaCppBackend, whatever its
    sequences: the compute buffer of its worst-case graph (a prompt chunk of n_ubatch =
    min(n_batch, n_ctx) positions against the whole context, which llama.cpp reserves when the
    context is made and prints as "compute buffer size") and, on the CPU, ggml's work buffer for
    that graph and the graph's bookkeeping.

    The compute buffer holds the attention mask of a chunk (f32 [n_kv, n_ubatch], f16 with flash
    attention; n_kv: a sequence's n_ctx rounded up to llama.cpp's 256) and the largest layer's
    intermediates, f32 per chunk position:
    - a Gated DeltaNet layer (chunked delta rule): 3 x (conv channels + n_embd);
    - an attention layer: q with its gate, q, k and v, the attention output and the residual,
      and without flash attention the scores [n_kv, n_ubatch, n_head], which grow with the
      context and dominate at long ones (the `small` preset at 4K: 200 of 213 MiB);
    - the FFN: gate, up and the residual.
    On the CPU without flash attention the product of the scores with the f16 V converts them to
    f16 in ggml's work buffer (n_kv x n_ubatch x n_head x 2). The compute buffer does not grow
    with sequences: each one's stream is attended separately. Against what llama.cpp prints
    (CPU, 1,024 and 4,096 positions, 1 and 4 sequences, the tiny / small / default presets and
    DeltaNet widths of 32..128 state x 16..48 heads): within 1.3 MiB with flash attention;
    without it up to 4.2 MiB under (10% of that buffer) where a DeltaNet layer is the largest.

    The graph's bookkeeping (host memory): qwen35 graphs get max(40 n_ubatch, 32 n_tensors)
    nodes (llama_context::graph_max_nodes), n_tensors those of the file; beside a GPU it is not
    counted, a few MiB against the device's."""
    n_ubatch = min(n_batch, n_ctx)
    n_kv = -(-n_ctx // 256) * 256
    mask = n_ubatch * n_kv * (2 if flash_attn else 4)
    scores = 0 if flash_attn else n_ubatch * n_kv * config.n_head * 4
    deltanet = 3 * (config.ssm_conv_dim + config.n_embd)
    attention = 4 * config.q_dim + 2 * config.kv_dim + config.n_embd
    ffn = 2 * config.n_ff + config.n_embd
    compute = mask + max(n_ubatch * 4 * deltanet, scores + n_ubatch * 4 * attention, n_ubatch * 4 * ffn)
    work = n_kv * n_ubatch * config.n_head * 2 if not flash_attn and not on_gpu else 0
    graph = 0 if on_gpu else max(40 * n_ubatch, 32 * n_tensors) * GRAPH_NODE_BYTES
    return compute + work + graph


def import_llama_cpp():
    """`import llama_cpp`, with the C++ runtime in the process's global symbol scope first.

    A CUDA build of libggml-cuda carries its own copies of some libstdc++ template functions
    (stream insertion among them). When libstdc++ was loaded before libllama only as a dependency
    of an extension module (numpy 2.x links it, and Python loads extensions RTLD_LOCAL), libllama
    binds those calls to libggml-cuda's copies, and llama.cpp's model loading crashed in them
    (SIGSEGV in llama_model::print_info, seen on the H100 machine with its numpy 2.5.2 imported
    first; with llama_cpp imported first, or libstdc++ made global as here, it loads). Promoting
    the already loaded libstdc++ to RTLD_GLOBAL makes every later library bind to the one runtime."""
    import ctypes
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass                                   # no shared libstdc++ (a static build): nothing to bind
    import llama_cpp
    return llama_cpp


def gpu_placement(llama_cpp_module, model_path: str | os.PathLike[str], n_layers: int | None,
                  extra_bytes: int = 0) -> Placement:
    """How many layers llama.cpp puts on the GPU, and why. extra_bytes: memory kept back beyond
    GPU_RESERVE_BYTES (the sequences after the first: `sequence_bytes` each)."""
    reserve = GPU_RESERVE_BYTES + extra_bytes
    gpu = gpus.first_gpu()
    if gpu is None:
        return Placement(0, "CPU (no NVIDIA GPU visible)")
    name, free = gpu
    if not llama_cpp_module.llama_supports_gpu_offload():
        return Placement(0, f"CPU ({name} is here, but this llama-cpp-python build has no GPU support: "
                            "`python -m openjet_plugin.setup_llama --force` builds one where a CUDA toolkit is present)")
    size = os.path.getsize(model_path)
    if size + reserve <= free:
        return Placement(-1, f"GPU ({name}: every layer, {free / 2**30:.1f} GiB free)")
    if not n_layers:
        return Placement(0, f"CPU ({name} has {free / 2**30:.1f} GiB free, the model is {size / 2**30:.1f} GiB)")
    fit = max(0, int(n_layers * (free - reserve) / size))
    if fit == 0:
        return Placement(0, f"CPU ({name} has {free / 2**30:.1f} GiB free: no layer fits)")
    return Placement(fit, f"GPU and CPU ({name}: {fit} of {n_layers} layers fit in {free / 2**30:.1f} GiB free)")


@contextlib.contextmanager
def _default_params(llama_cpp_module, function: str, **fields):
    """Llama() takes neither use_extra_bufts nor n_seq_max / kv_unified; its model and context
    parameters start from llama_model_default_params() / llama_context_default_params(), so that
    is where those fields are set, for one construction."""
    low = importlib.import_module(llama_cpp_module.__name__ + ".llama_cpp")
    original = getattr(low, function)

    def params():
        p = original()
        for k, v in fields.items():
            setattr(p, k, v)
        return p

    setattr(low, function, params)
    try:
        yield
    finally:
        setattr(low, function, original)


def _without_extra_buffers(llama_cpp_module):
    return _default_params(llama_cpp_module, "llama_model_default_params", use_extra_bufts=False)


class LlamaCppBackend:
    name = "llama.cpp"
    supports_speculative = False

    def __init__(self, model_path: str | os.PathLike[str], n_ctx: int, *, kv_type: str = "f16",
                 n_threads: int | None = None, n_batch: int = 512, n_layers: int | None = None,
                 n_seq: int = 1, seq_bytes: int = 0):
        """n_layers: the model's block count (from its metadata), to split a model that does not
        fit in GPU memory. n_seq: sequences (conversations) the context holds, n_ctx positions
        each; with more than one, use `sequences()`. seq_bytes: the memory of one sequence
        (`sequence_bytes`, where the model's dimensions are known), kept free on the GPU for each
        after the first."""
        try:
            llama_cpp = import_llama_cpp()
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise BackendUnavailableError(f"llama-cpp-python is not installed ({exc})") from None
        # after openjet's drop-in took the name (adapters/llama_cpp.install), `llama_cpp` is its
        # module; llama-cpp-python itself is kept there
        llama_cpp = getattr(llama_cpp, "__openjet_real__", llama_cpp)
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        self._lib = llama_cpp
        threads = n_threads or default_threads()
        self.placement = gpu_placement(llama_cpp, model_path, n_layers, extra_bytes=(n_seq - 1) * seq_bytes)
        kwargs = {}
        if kv_type != "f16":
            # a quantised V cache needs flash attention in llama.cpp
            kwargs = dict(type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type], flash_attn=True)
        if self.placement.on_gpu:
            kwargs["flash_attn"] = True      # llama.cpp's fastest GPU path (llama-bench -fa 1)
        # llama.cpp's AMX buffer type executes tile instructions that fault where they are only
        # advertised (cpu_features.py): no extra buffer types there
        self.extra_buffers = not cpu_features.amx_faults()
        guard = contextlib.nullcontext() if self.extra_buffers else _without_extra_buffers(llama_cpp)
        if isinstance(n_seq, bool) or not isinstance(n_seq, int) or not 1 <= n_seq <= MAX_SEQUENCES:
            raise ValueError(f"n_seq must be an integer in [1, {MAX_SEQUENCES}], got {n_seq!r}")
        # one KV stream per sequence (kv_unified off): each gets the n_ctx positions it was
        # promised, and a sequence that fills its own never takes room from another
        seq_guard = (contextlib.nullcontext() if n_seq == 1 else
                     _default_params(llama_cpp, "llama_context_default_params", n_seq_max=n_seq, kv_unified=False))
        try:
            with guard, seq_guard:
                self._llm = llama_cpp.Llama(
                    model_path=os.fspath(model_path), n_ctx=n_ctx * n_seq, n_batch=min(n_batch, n_ctx),
                    n_threads=threads, n_threads_batch=threads, n_gpu_layers=self.placement.n_gpu_layers,
                    logits_all=False, verbose=False, **kwargs)
        except (ValueError, RuntimeError) as exc:
            raise BackendUnavailableError(
                f"llama.cpp could not load {os.fspath(model_path)}: {exc}") from None
        # llama.cpp rounds the context up (to a multiple of 256); the limit callers asked for is
        # the one the engine enforces
        self.n_ctx = min(n_ctx, llama_cpp.llama_n_ctx_seq(self._llm.ctx))
        self.n_vocab = self._llm.n_vocab()
        self.n_threads = threads
        self.n_sequences = n_seq
        # one sequence decodes in the caller's thread; several share the scheduler's passes
        self._passes: OneSequencePasses | PassScheduler
        if n_seq == 1:
            self._passes = OneSequencePasses(llama_cpp, self._llm.ctx, self.n_vocab, self._llm.n_batch)
        else:
            self._passes = PassScheduler(llama_cpp, self._llm.ctx, self.n_vocab, self._llm.n_batch, n_seq)
        self._sequences = [LlamaCppSequence(self, i) for i in range(n_seq)]

    def sequences(self) -> list[LlamaCppSequence]:
        """One view per sequence: the backend an engine slot uses (with one, the backend itself
        is sequence 0's view)."""
        return list(self._sequences)

    @property
    def pass_counts(self) -> dict[str, int]:
        """Shared-pass counters of the multi-sequence scheduler (empty with one sequence)."""
        sc = self._passes
        return {} if not isinstance(sc, PassScheduler) else sc.counts()

    def pass_trace(self, since: float) -> list[tuple[float, float, float, int, int]]:
        """The scheduler's passes that ended after perf_counter time `since` (PassScheduler.trace;
        empty with one sequence)."""
        sc = self._passes
        return [] if not isinstance(sc, PassScheduler) else sc.trace_since(since)

    # --- tokens <-> text ------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        return list(self._llm.tokenize(text, add_bos=add_special, special=parse_special))

    def detokenize(self, tokens: list[int]) -> bytes:
        # special=True renders control tokens as their text, so detokenize(tokenize(s)) == s for
        # text containing them (a chat history fed back keeps its exact tokens)
        return self._llm.detokenize(list(tokens), special=True)

    # --- state: that of sequence 0 (n_past, eval, rollback, checkpoints: LlamaCppSequence) ------
    def _only_sequence(self) -> LlamaCppSequence:
        # with several sequences, acting on "the" state would cut into another slot's
        if self.n_sequences > 1:
            raise RuntimeError("this context holds several sequences: use them through sequences()")
        return self._sequences[0]

    @property
    def n_past(self) -> int:
        return self._only_sequence().n_past

    def eval(self, tokens: list[int]) -> np.ndarray:
        return self._only_sequence().eval(tokens)

    def eval_argmax(self, tokens: list[int]) -> int:
        return self._only_sequence().eval_argmax(tokens)

    def save_checkpoint(self) -> None:
        self._only_sequence().save_checkpoint()

    def restore_checkpoint(self, n_max: int) -> int:
        return self._only_sequence().restore_checkpoint(n_max)

    def rollback(self, n_keep: int) -> bool:
        return self._only_sequence().rollback(n_keep)

    def save_state(self, max_bytes: int):
        return self._only_sequence().save_state(max_bytes)

    def load_state(self, state) -> bool:
        return self._only_sequence().load_state(state)

    def reset(self) -> None:
        self._only_sequence().reset()

    @property
    def _checkpoints(self) -> list:
        """Sequence 0's (n_past, recurrent state) checkpoints, oldest first (tests count them)."""
        return self._only_sequence()._checkpoints

    def close(self) -> None:
        passes, self._passes = getattr(self, "_passes", None), None
        if passes is not None:
            passes.close()              # the scheduler's thread ends before the context is freed
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.close()


# --- does llama.cpp run here? -------------------------------------------------------------------
# `openjet doctor` asks in a child process: an instruction the host cannot execute kills the
# child (SIGILL), not the caller.

def check_runs(model_path: str | os.PathLike[str], timeout: float = 300.0) -> tuple[bool, str]:
    """(True, what ran) when llama.cpp loads `model_path` and decodes one token in a child
    process, else (False, why)."""
    import json
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "openjet_plugin.backends.llama_cpp", os.fspath(model_path)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"a one-token decode did not finish in {timeout:.0f} s"
    if p.returncode < 0:
        try:
            sig = signal.Signals(-p.returncode).name
        except ValueError:
            sig = f"signal {-p.returncode}"
        hint = (" (an instruction this machine does not run: see the cpu rows)" if sig == "SIGILL" else "")
        return False, f"the one-token decode was killed by {sig}{hint}"
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return False, f"the one-token decode failed: {last}"
    r = json.loads(lines[-1])
    return True, f"a one-token decode took {r['seconds']:.2f} s on the {r['where']}"


def _check_main(argv: list[str]) -> int:
    import json
    import time

    from ..model_file import read_foreign

    path = argv[0]
    t0 = time.perf_counter()
    n_layers = read_foreign(path).n_layers
    be = LlamaCppBackend(path, 64, n_threads=None, n_layers=n_layers)
    logits = be.eval([0])
    if not np.isfinite(logits).all():
        raise SystemExit("llama.cpp returned non-finite logits")
    print(json.dumps({"where": be.placement.where, "seconds": time.perf_counter() - t0}))
    be.close()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_check_main(sys.argv[1:]))
