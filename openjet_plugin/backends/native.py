"""The native CUDA backend: `native_status(model_file, n_ctx)` and `NativeBackend`.

The model file (openjet_plugin.model_file.ModelFile) is described to the engine tensor by tensor
(name, ggml type id, ne, pointer into the memory-mapped file); the engine uploads what it needs
once and keeps nothing of the host mapping. One NativeBackend holds one conversation on the GPU.
Logits stay on the device unless asked for: `eval_argmax` copies one int back per call.

Several conversations (issue 29): `NativeBackend(n_seq=N)` makes one engine of N sequences, each
its own KV cache, DeltaNet state, hidden window and n_past (oj_model_desc.n_seq), and hands out a
view per sequence (`sequences()`, the engine's slots): each view is a NativeBackend over the same
engine (`_SharedEngine`) with its own Python-side state and its own range of checkpoint slots,
selecting its sequence (oj_seq_select) before its calls. Every native call runs under the engine's
lock: the selected sequence and the results of the last pass (argmax and logits rows) are the
engine's, so a call and the reads of its results must not interleave with another sequence's. The
views' evals go through `NativePasses` (passes.py's scheduler): the decode steps of a pass in one
oj_eval_seqs (one read of the weights for up to 8 sequences), then each prompt chunk on its own
sequence through the eval path below. With several sequences a sequence speculates only while it
is served alone (its MTP cache follows it until it decodes in a shared pass: `leave_mtp`); a
verify pass over several sequences' drafts does not exist in the engine. `save_state` /
`load_state` copy a sequence's whole state to host memory and into any sequence (oj_seq_state_save
/ load), which is what the engine's prefix cache needs.

Speculative decoding (issue 6): `verify` evaluates the current token and the drafts together and
`commit` keeps the accepted prefix (the engine replays the accepted DeltaNet positions, see
native/deltanet.cu). With an MTP block and draft_depth > 0 the backend keeps the MTP cache in step
with the main model: every committed position p has its MTP row from (x_p, h_{p-1}) with the main
hidden state, made during prefill chunk by chunk and, in decoding, batched with the next cycle's
first draft step (`_uncaught` holds the committed tokens still waiting for their row).

Batched prefill (issue 9): spans of more than PREFILL_MIN_SPAN prompt tokens go through
oj_prefill (passes of `prefill_chunk` positions on the tensor cores); shorter ones, and everything
when prefill_chunk is 0, through oj_eval, 8 positions a call. The engine makes the MTP rows of a
prefill itself when its MTP cache ends at n_past on entry; a speculating backend arranges that.

Draft trees (issue 28): `verify_tree(tokens, parent)` evaluates a tree of drafts in one pass and
`commit_path(path)` keeps one root-first path of it (oj_verify_tree / oj_commit_path); the MTP rows
of the path are owed as after commit.

Fused cycles (issue 8): `cycle` is oj_cycle, a greedy cycle in one call (verify, accept, commit,
then the next token's MTP row and its drafts), no Python between its launches. The engine's
MTP cache then runs a row ahead of `_mtp_upto`: `_token_row` says for which (position, token).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np
from gguf import GGMLQuantizationType

from .. import _native, gpus
from ..config import SUPPORTED_TENSOR_TYPES, ModelConfig
from ..errors import BackendUnavailableError, ContextOverflowError, NativeEngineError
from .base import SequenceState
from .passes import PassScheduler, Submitted, Work

if TYPE_CHECKING:
    from ..sampling import SamplingParams

log = logging.getLogger("openjet_plugin")


MAX_POSITIONS = 16           # OJ_MAX_POSITIONS: positions of one evaluation (the engine's buffers; a verify or cycle)
CALL_POSITIONS = 8           # positions a call where the backend splits a run of tokens (eval, prompt spans, MTP rows)
MAX_TREE_NODES = 8           # OJ_MAX_TREE_NODES: nodes of a draft tree (oj_verify_tree, oj_draft_tree)
MAX_TREE_CHILDREN = 8        # OJ_TREE_MAX_CHILDREN: candidates a node of oj_draft_tree
TREE_TOP_BYTES = 8 * MAX_TREE_CHILDREN + 8   # engine.cuh's TreeTop: ids and logits, the row's max and sum
MIN_COMPUTE_CAPABILITY = (8, 6)
KV_TYPES = {"f16": 0, "q8_0": 1}   # oj_kv_type: fp16, or ggml q8_0 blocks (34 bytes per 32 values)
# The native engine's switches, read once per process, and the values each takes ("" = unset, the
# default): prefill.cu's projections, attention and DeltaNet kernels.
SWITCHES = {"OPENJET_PREFILL_GEMM": ("", "f16", "int8", "wgmma"),
            "OPENJET_PREFILL_ATTN": ("", "flash", "decode"),
            "OPENJET_PREFILL_DELTANET": ("", "sequential", "chunked")}
N_CHECKPOINTS = 2            # recurrent-state copies for conversation reuse (save/restore_checkpoint), per sequence
MAX_CHECKPOINT_SLOTS = 64    # oj_model_desc.n_checkpoints: the engine's slots, every sequence's together
MAX_SEQUENCES = 8            # OJ_MAX_SEQUENCES: sequences one engine holds (oj_model_desc.n_seq)
# positions of a multi-sequence pass with no decode steps in it (passes.py's n_batch): a prompt
# alone goes in prefill_chunk positions a pass, or this many through oj_eval when there is no
# batched prefill (8 a call, several calls a pass)
EVAL_PASS_POSITIONS = 64
MEMORY_FIELDS = ("weights", "kv_cache", "recurrent_state", "activations", "checkpoints", "prefill", "total")
PREFILL_CHUNK = 2048         # positions per oj_prefill pass (oj_model_desc.prefill_chunk); 0 = no oj_prefill
MIN_PREFILL_CHUNK = 64       # the header's allowed range: 0 or 64..OJ_MAX_PREFILL_CHUNK
MAX_PREFILL_CHUNK = 4096     # OJ_MAX_PREFILL_CHUNK
DELTANET_CHUNK = 64          # deltanet_chunked.cuh's chunk C
DELTANET_CHUNK_COEF_BYTES = 2 * DELTANET_CHUNK * DELTANET_CHUNK * 2 + 3 * DELTANET_CHUNK * 4   # its ChunkCoef::bytes
PREFILL_ABI = 3              # the first oj_abi_version() with oj_prefill
CYCLE_ABI = 4                # the first oj_abi_version() with oj_cycle
TREE_ABI = 6                 # the first oj_abi_version() with oj_verify_tree / oj_commit_path
DRAFT_TREE_ABI = 8           # the first oj_abi_version() with oj_draft_tree
PIECE_ABI = 12               # the first oj_abi_version() with oj_prefill_layers
SAMPLED_CYCLE_ABI = 13       # the first oj_abi_version() with oj_cycle_sampled
GRAPH_ABI = 14               # the first oj_abi_version() with oj_graph_stats (chain passes from CUDA graphs)
SAMPLE_TOP_MAX = 64          # OJ_SAMPLE_TOP_MAX: the largest top_k oj_cycle_sampled draws under
PREFILL_MIN_SPAN = CALL_POSITIONS  # spans of at most this many tokens keep oj_eval (one call anyway)
GEMM_POSITION_TILE = 64      # gemm_prefill.cuh's BN: the int8 X workspace is padded to a multiple
_FLOAT_TYPES = ("F32", "F16", "BF16")
_H_SOURCES = {"main": 0, "draft": 1}
_MEMORY_MARGIN = 256 << 20   # bytes kept free beyond the engine's own estimate


def _kv_layers(c: ModelConfig) -> int:
    return len(c.attention_layers()) + (1 if c.n_layer_nextn else 0)


def kv_cache_bytes(config: ModelConfig, n_ctx: int, kv_type: str = "f16") -> int:
    """Bytes of every K and V cache (attention layers + MTP block), as engine.cu's alloc_kv: fp16
    is 2 bytes a value; q8_0 an int8 plane plus one fp16 scale per 32 values (34 bytes per 32)."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type {kv_type!r} is not supported by the native engine "
                         f"(supported: {', '.join(KV_TYPES)})")
    values = _kv_layers(config) * 2 * config.kv_dim * n_ctx
    return values * 2 if kv_type == "f16" else values // 32 * 34


def check_prefill_chunk(prefill_chunk) -> int:
    """prefill_chunk as the engine takes it (0, or MIN..MAX_PREFILL_CHUNK), else ValueError naming it."""
    if (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer))
            or not (prefill_chunk == 0 or MIN_PREFILL_CHUNK <= prefill_chunk <= MAX_PREFILL_CHUNK)):
        raise ValueError(f"prefill_chunk must be 0 (no batched prefill) or an integer in "
                         f"[{MIN_PREFILL_CHUNK}, {MAX_PREFILL_CHUNK}], got {prefill_chunk!r}")
    return int(prefill_chunk)


def prefill_bytes(config: ModelConfig, prefill_chunk: int) -> int:
    """Device bytes of the batched prefill path's buffers for passes of P = prefill_chunk positions,
    as native/prefill.cu's alloc_prefill makes them (0 when P is 0):

        4 * P                      token ids (int32)
      + 4 * P * (2E                x, xn
                 + 2F              ffn_gate, ffn_up (one buffer: attention_prefill's segment
                                   partials while an attention pass runs)
                 + 2Vd             z, dn_out
                 + 2C              qkv, conv
                 + 2Hv             beta, alpha
                 + 2Q + Q + Q      qg (query and gate), q_rot, attn_out
                 + 2KV             k, v
                 + 2E)             cat (the MTP block's [embedding, hidden] input)
      + 4 * (P + 1) * E            hidden rows (row 0: h of the position before the pass)
      + max(P_pad * K + (K / 32) * P_pad * 8,            the int8 GEMM's X and (d, sum) per 32,
            2 P_pad * K + (K / 256) * P_pad * 32 + 4 P_pad)  the fp16 GEMM's X, xsum hi/lo, scale
      + ceil(P / 64) * Hv * 17152  the chunked DeltaNet's per-chunk coefficients (64 x 64 fp16 T and
                                   M, 3 x 64 fp32; native/deltanet_chunked.cuh's ChunkCoef)

    with E = n_embd, F = n_ff, Vd = ssm_value_dim, C = ssm_conv_dim (2 key_dim + value_dim),
    Hv = ssm_dt_rank, Q = n_head * head_dim, KV = n_head_kv * head_dim, P_pad = P rounded up to
    the GEMM's 64-position tile, and K the widest input of any projection of a pass:
    max(E, 2E (the MTP eh_proj), F (ffn_down), Vd (ssm_out), Q (attn_output)). The MTP cat buffer
    is allocated whether or not the model has an MTP block."""
    P = check_prefill_chunk(prefill_chunk)
    if P == 0:
        return 0
    c = config
    E, F, Vd, C, Hv = c.n_embd, c.n_ff, c.ssm_value_dim, c.ssm_conv_dim, c.ssm_dt_rank
    Q, KV = c.q_dim, c.kv_dim
    floats = P * (2 * E + 2 * F + 2 * Vd + 2 * C + 2 * Hv + 2 * Q + Q + Q + 2 * KV + 2 * E) + (P + 1) * E
    K = max(E, 2 * E, F, Vd, Q)
    p_pad = -(-P // GEMM_POSITION_TILE) * GEMM_POSITION_TILE
    workspace = max(p_pad * K + (K // 32) * p_pad * 8, 2 * p_pad * K + (K // 256) * p_pad * 32 + 4 * p_pad)
    dn_coef = -(-P // DELTANET_CHUNK) * Hv * DELTANET_CHUNK_COEF_BYTES
    return 4 * P + 4 * floats + workspace + dn_coef


def sampled_cycle_refusal(params) -> str | None:
    """Why oj_cycle_sampled cannot draw a request under `params` (a SamplingParams), or None: it
    draws at temperature > 0 from at most SAMPLE_TOP_MAX candidates, with no penalties or bias
    (those take the host path, which applies them to the whole row)."""
    if params.greedy:
        return "temperature 0 is greedy (oj_cycle)"
    if not 0 < params.top_k <= SAMPLE_TOP_MAX:
        return f"top_k {params.top_k} is outside 1..{SAMPLE_TOP_MAX}"
    if params.has_penalties:
        return "repetition, frequency or presence penalties are on"
    if params.logit_bias:
        return "logit_bias is set"
    return None


def check_sequences(n_seq) -> int:
    """n_seq as the engine takes it (1..MAX_SEQUENCES), else ValueError naming it."""
    if isinstance(n_seq, bool) or not isinstance(n_seq, (int, np.integer)) or not 1 <= n_seq <= MAX_SEQUENCES:
        raise ValueError(f"n_seq must be an integer in [1, {MAX_SEQUENCES}] (sequences one native engine holds), "
                         f"got {n_seq!r}")
    return int(n_seq)


def estimate_device_bytes(model_file, n_ctx: int, n_checkpoints: int = N_CHECKPOINTS,
                          kv_type: str = "f16", prefill_chunk: int = PREFILL_CHUNK, n_seq: int = 1) -> dict[str, int]:
    """What the engine will allocate, by purpose (mirrors engine.cu's allocations), for n_seq
    sequences of n_ctx positions each with n_checkpoints checkpoint slots each (the engine's pool
    is n_checkpoints x n_seq slots): the KV cache, the recurrent state (state and replay ring per
    DeltaNet layer) and the checkpoints scale with n_seq; the activations gain a hidden window
    ((OJ_MAX_POSITIONS + 1) x n_embd floats) for each sequence after the first; the weights and the
    prefill buffers are held once."""
    n_seq = check_sequences(n_seq)
    c = model_file.config
    weights = sum(int(t.n_bytes) for t in model_file.tensors.values())
    # vectors are widened to fp32 on the device
    weights += sum(int(t.n_bytes) for t in model_file.tensors.values()
                   if len(t.ne) == 1 and t.ggml_type in ("F16", "BF16"))
    kv = n_seq * kv_cache_bytes(c, n_ctx, kv_type)
    dn = len(c.deltanet_layers())
    n = MAX_POSITIONS
    state = (c.ssm_conv_dim * (c.ssm_conv_kernel - 1) + c.ssm_dt_rank * c.ssm_d_state ** 2) * 4
    ring = 2 * n * (2 * c.ssm_conv_dim + 2 * c.ssm_dt_rank) * 4    # two slots of replay intermediates
    recurrent = n_seq * dn * (state + ring)
    checkpoints = n_checkpoints * n_seq * (dn * state + c.n_embd * 4)
    splits = (n_ctx + 255) // 256
    act = 4 * n * (2 * c.n_embd + 2 * c.n_ff + 2 * c.ssm_value_dim + 2 * c.q_dim + 2 * c.kv_dim + c.q_dim
                   + c.n_head * splits * (c.head_dim + 2) + 3 * c.n_embd + 2 * c.n_vocab + 2 * c.n_embd)
    act += 4 * c.n_vocab if c.n_layer_nextn else 0
    act += 4 * n * c.n_embd + TREE_TOP_BYTES if c.n_layer_nextn else 0   # oj_draft_tree's node hiddens, TreeTop
    act += (n_seq - 1) * 4 * (n + 1) * c.n_embd      # each further sequence's hidden window
    prefill = prefill_bytes(c, prefill_chunk)
    return {"weights": weights, "kv_cache": kv, "recurrent_state": recurrent, "activations": act,
            "checkpoints": checkpoints, "prefill": prefill,
            "total": weights + kv + recurrent + act + checkpoints + prefill}


def model_problems(model_file) -> list[str]:
    """Why the native kernels cannot run this model (empty when they can)."""
    problems = []
    c = model_file.config
    if c.head_dim not in (64, 128, 256):
        problems.append(f"head_dim {c.head_dim} (the attention kernels take 64, 128 or 256)")
    if c.ssm_d_state not in (32, 64, 128):
        problems.append(f"ssm.state_size {c.ssm_d_state} (the DeltaNet kernels take 32, 64 or 128)")
    if not 2 <= c.ssm_conv_kernel <= 4:
        problems.append(f"ssm.conv_kernel {c.ssm_conv_kernel} (2..4)")
    for t in model_file.tensors.values():
        if t.ggml_type not in SUPPORTED_TENSOR_TYPES:
            problems.append(f"tensor {t.name!r} has type {t.ggml_type} "
                            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
        elif len(t.ne) == 2 and t.ne[0] > 1 and not t.name.endswith("ssm_conv1d.weight"):
            unit = 8 if t.ggml_type in _FLOAT_TYPES else (32 if t.ggml_type == "Q8_0" else 256)
            if t.ne[0] % unit:
                problems.append(f"tensor {t.name!r} ({t.ggml_type}) has {t.ne[0]} columns, "
                                f"not a multiple of {unit}")
    return problems


def native_status(model_file, n_ctx: int, kv_type: str = "f16",
                  prefill_chunk: int = PREFILL_CHUNK, n_seq: int = 1) -> tuple[bool, str]:
    """(True, what will run) or (False, why not): sequences, library, GPU, memory (n_seq sequences
    of n_ctx positions), model shape/types."""
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or not 1 <= n_seq <= MAX_SEQUENCES:
        return False, f"the native engine holds 1..{MAX_SEQUENCES} sequences at once, {n_seq!r} asked"
    for env, allowed in SWITCHES.items():
        value = os.environ.get(env, "")
        if value not in allowed:
            # the native code reads these itself and would take any other value as the default
            return False, (f"${env}={value!r} is not one of {', '.join(repr(p) for p in allowed if p)} "
                           f"(or unset)")
    try:
        nl = _native.load()
    except BackendUnavailableError as e:
        if gpus.first_gpu() is None:     # the first thing to say on a machine without a GPU
            return False, f"no NVIDIA GPU visible (and {e})"
        return False, str(e)
    ffi, lib = nl.ffi, nl.lib
    major, minor = ffi.new("int32_t *"), ffi.new("int32_t *")
    free, total = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    name = ffi.new("char[256]")
    rc = lib.oj_device_info(0, major, minor, free, total, name, 256)
    if rc != 0:
        where = "no NVIDIA GPU visible" if gpus.first_gpu() is None else "no usable CUDA device"
        return False, f"{where} (the CUDA runtime says: {_native.last_error(nl)})"
    gpu = ffi.string(name).decode(errors="replace")
    cc = (int(major[0]), int(minor[0]))
    if cc < MIN_COMPUTE_CAPABILITY:
        return False, f"GPU {gpu} is sm_{cc[0]}{cc[1]}; the native engine needs sm_86 or newer"
    problems = model_problems(model_file)
    if problems:
        return False, "the model does not fit the native kernels: " + "; ".join(problems[:5])
    need = estimate_device_bytes(model_file, n_ctx, kv_type=kv_type, prefill_chunk=prefill_chunk,
                                 n_seq=n_seq)["total"] + _MEMORY_MARGIN
    if need > int(free[0]):
        seqs = f" x {n_seq} sequences" if n_seq > 1 else ""
        return False, (f"GPU {gpu} has {int(free[0]) / 2**30:.1f} GiB free, the model at n_ctx {n_ctx}{seqs} "
                       f"needs about {need / 2**30:.1f} GiB")
    return True, f"native CUDA engine on {gpu} (sm_{cc[0]}{cc[1]}, {int(free[0]) / 2**30:.1f} GiB free)"


class _SharedEngine:
    """What the sequences of one native engine share, held by each of its views: the handle, the
    lock every native call runs under, the sequence oj_seq_select chose last, the views, the pass
    scheduler of a multi-sequence engine, and the tokenizer."""

    def __init__(self, nl, handle, n_seq: int):
        self.nl = nl
        self.handle = handle
        self.n_seq = n_seq
        # re-entrant: a view's method calls others (eval -> n_past -> ...) under one hold
        self.lock = threading.RLock()
        self.selected = 0                       # oj_seq_select's: sequence 0 after creation
        self.views: list[NativeBackend] = []
        self.passes: NativePasses | None = None
        self.tokenizer = None
        self.tokenizer_lock = threading.Lock()
        self.draft_vocab_len = 0                # oj_set_draft_vocab's: the engine's, not a sequence's
        # state copies started and not yet waited for (NativeBackend._wait_copy): they run without
        # the lock, beside other sequences' passes; the engine is not freed before they end
        self.copies = 0
        self.copies_done = threading.Condition(self.lock)


def _on_engine(method):
    """The method runs under the engine's lock: its native calls (each on the view's sequence:
    _handle selects it) and the reads of their results come in one piece, between another
    sequence's calls and passes."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._shared.lock:
            return method(self, *args, **kwargs)
    return run


class NativeBackend:
    """Conversations on the GPU through the native engine (see backends/base.py's protocol).

    With n_seq 1 (the default) the backend is its engine's one conversation and speculates where
    the model has an MTP block and draft_depth > 0. With n_seq > 1 the engine holds n_seq
    conversations and `sequences()` gives a view of each (this backend is sequence 0's); their
    evals share passes (NativePasses). There a sequence speculates only while it is served alone:
    its MTP cache follows the main model (supports_speculative) until it decodes in a shared pass
    (oj_eval_seqs makes no MTP rows: `leave_mtp` says so first), and follows again after a reset,
    a restore to where its rows reach, or a loaded copy that has them (the engine has no verify pass
    over several sequences' drafts). n_checkpoints is per sequence: the engine is given
    n_checkpoints x n_seq slots (at most MAX_CHECKPOINT_SLOTS), each sequence its own range."""

    name = "native"

    def __init__(self, model_file, n_ctx: int, draft_depth: int = 4, kv_type: str = "f16",
                 seed: int | None = None, device: int = 0, n_checkpoints: int = N_CHECKPOINTS,
                 checkpoint_interval: int = 0, prefill_chunk: int = PREFILL_CHUNK, n_seq: int = 1):
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type {kv_type!r} is not supported by the native engine "
                             f"(supported: {', '.join(KV_TYPES)})")
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        if (isinstance(n_checkpoints, bool) or not isinstance(n_checkpoints, int)
                or not 0 <= n_checkpoints <= MAX_CHECKPOINT_SLOTS):
            raise ValueError(f"n_checkpoints must be an integer in [0, {MAX_CHECKPOINT_SLOTS}], got {n_checkpoints!r}")
        if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) or checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be an integer >= 0 (0: off), got {checkpoint_interval!r}")
        self.n_seq = check_sequences(n_seq)
        if n_checkpoints * self.n_seq > MAX_CHECKPOINT_SLOTS:
            raise ValueError(f"n_checkpoints {n_checkpoints} per sequence x n_seq {self.n_seq} is "
                             f"{n_checkpoints * self.n_seq} checkpoint slots; the engine holds at most "
                             f"{MAX_CHECKPOINT_SLOTS}: fewer checkpoints or fewer sequences")
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self._nl = _native.load()
        self._model_file = model_file
        self.config: ModelConfig = model_file.config
        self.n_ctx = int(n_ctx)
        self.n_vocab = int(self.config.n_vocab)
        self.draft_depth = int(draft_depth)
        self.n_sequences = self.n_seq             # backends/base.py: > 1, the engine makes a slot per view
        self.n_checkpoints = int(n_checkpoints)   # per sequence
        # also save a checkpoint each time n_past crosses a multiple of this (0: off)
        self.checkpoint_interval = int(checkpoint_interval)
        self.kv_type = kv_type
        # oj_prefill where the library has it (load() already insists on the header's ABI) and
        # the engine was given its buffers
        self.batched_prefill = (self.prefill_chunk > 0
                                and int(self._nl.lib.oj_abi_version()) >= PREFILL_ABI)
        self.supports_cycle = int(self._nl.lib.oj_abi_version()) >= CYCLE_ABI
        # positions of one evaluation as the loaded library's header says (a library of ABI 14 or
        # before, carried with its own openjet.h for an A/B: 8)
        self.max_positions = int(self._nl.lib.OJ_MAX_POSITIONS)
        self.supports_sampled_cycle = int(self._nl.lib.oj_abi_version()) >= SAMPLED_CYCLE_ABI
        self.supports_tree = int(self._nl.lib.oj_abi_version()) >= TREE_ABI
        self.supports_draft_tree = int(self._nl.lib.oj_abi_version()) >= DRAFT_TREE_ABI
        self.supports_pieces = self.batched_prefill and int(self._nl.lib.oj_abi_version()) >= PIECE_ABI
        self._shared = _SharedEngine(self._nl, self._create(model_file, kv_type, device), self.n_seq)
        # engine.cu's own rule for loading the MTP block: nextn layer present with its eh_proj
        il = model_file.config.mtp_layer
        self.has_mtp = il is not None and f"blk.{il}.nextn.eh_proj.weight" in model_file.tensors
        # the MTP cache follows the main model when drafting is possible at all (supports_speculative)
        self._speculates = self.has_mtp and self.draft_depth > 0
        self._owns_engine = True
        self._begin_sequence(0)
        self._shared.views = [self] + [self._view(s) for s in range(1, self.n_seq)]
        if self.n_seq > 1:
            # a pass with no decode steps takes a prompt in prefill_chunk positions, as one
            # sequence's eval does
            n_batch = self.prefill_chunk if self.batched_prefill else EVAL_PASS_POSITIONS
            self._shared.passes = NativePasses(self._shared, n_batch)

    def _begin_sequence(self, seq: int) -> None:
        """The Python-side state of sequence seq, as after oj_reset."""
        self.seq = seq
        # its checkpoint slots: _checkpoint_base .. _checkpoint_base + n_checkpoints - 1
        self._checkpoint_base = seq * self.n_checkpoints
        self._last_n = 0               # positions of this sequence's last call, whose results are readable
        self._checkpoints: list[tuple[int, int]] = []   # (slot, n_past), oldest first
        self.prefilled_positions = 0     # positions that went through oj_prefill (tests, bench)
        # True once the sequence decoded in a shared pass: MTP rows from _mtp_upto on are missing
        self._mtp_left = False
        self._mtp_upto = 0          # MTP rows of positions < this are made from main hiddens
        self._uncaught: list[int] = []   # committed tokens at positions _mtp_upto.. without a row
        # (position, token) of the current token's MTP row made ahead of the committed rows, by
        # draft_first or by the last cycle for its next token: what oj_cycle drafts from. It stays
        # valid while n_past is that position and no MTP call rewrites the row.
        self._token_row: tuple[int, int] | None = None
        self._verify_tokens: list[int] = []
        self._verify_parent: list[int] | None = None   # the last verify_tree's parents (None: a chain)
        # the prompt piece in flight (prefill_piece: oj_prefill_layers): its tokens and layers done
        self._piece: tuple[list[int], int] | None = None

    @property
    def supports_speculative(self) -> bool:
        """The MTP cache follows the main model: drafting is possible (an MTP block, draft_depth > 0)
        and the sequence has not decoded in a shared pass since its rows last reached n_past."""
        return self._speculates and not self._mtp_left

    @supports_speculative.setter
    def supports_speculative(self, on: bool) -> None:
        # bench/spec.py's main_model_only: plain passes without the MTP rows, then back
        self._speculates = bool(on)

    @property
    def _draft_vocab_len(self) -> int:
        return self._shared.draft_vocab_len

    @_on_engine
    def leave_mtp(self) -> None:
        """This sequence is about to decode in shared passes, which make no MTP rows: its MTP cache
        stops following the main model (no more rows made for it) until a reset, a restore to a
        position its rows reach, or a loaded copy with its rows."""
        if self._speculates and not self._mtp_left:
            self._flush_mtp()                   # the rows still owed, while their hiddens are here
            self._mtp_left = True
            self._uncaught, self._token_row = [], None

    def exclusive(self):
        """The engine's lock, for a run of calls that must not interleave with another sequence's
        passes (a speculative cycle reads the results of its own verify)."""
        return self._shared.lock

    def _view(self, seq: int) -> "NativeBackend":
        """Sequence seq's view: this backend's settings over the same engine, its own state."""
        view = copy.copy(self)
        view._owns_engine = False
        view._begin_sequence(seq)
        return view

    def sequences(self) -> list["NativeBackend"]:
        """One view per sequence, the backend an engine slot uses (this backend is sequence 0's)."""
        return list(self._shared.views)

    @property
    def pass_counts(self) -> dict[str, int]:
        """Shared-pass counters of the multi-sequence scheduler (empty with one sequence)."""
        sc = self._shared.passes
        return {} if sc is None else sc.counts()

    def pass_trace(self, since: float) -> list[tuple]:
        """The scheduler's passes that ended after perf_counter time `since` (PassScheduler.trace;
        empty with one sequence)."""
        sc = self._shared.passes
        return [] if sc is None else sc.trace_since(since)

    # --- creation ------------------------------------------------------------------------------
    def _create(self, model_file, kv_type: str, device: int):
        ffi, lib = self._nl.ffi, self._nl.lib
        c = self.config
        keep = []   # cffi objects that must outlive oj_engine_create
        desc = ffi.new("oj_model_desc *")
        hp = desc.hparams
        for field in ("n_vocab", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim", "n_rot",
                      "ssm_conv_kernel", "ssm_d_state", "ssm_n_group", "ssm_dt_rank",
                      "full_attention_interval", "n_layer_nextn"):
            setattr(hp, field, int(getattr(c, field)))
        for i, s in enumerate(c.rope_sections):
            hp.rope_sections[i] = int(s)
        hp.rope_freq_base = float(c.rope_freq_base)
        hp.rms_eps = float(c.rms_eps)
        tensors = list(model_file.tensors.values())
        arr = ffi.new("oj_tensor[]", len(tensors))
        for i, t in enumerate(tensors):
            name = ffi.new("char[]", t.name.encode())
            data = np.ascontiguousarray(t.data)
            buf = ffi.from_buffer("char[]", data)
            keep += [name, data, buf]
            arr[i].name = name
            arr[i].type = int(GGMLQuantizationType[t.ggml_type].value)
            arr[i].n_dims = len(t.ne)
            for d, n in enumerate(t.ne):
                arr[i].ne[d] = int(n)
            for d in range(len(t.ne), 4):
                arr[i].ne[d] = 1
            arr[i].data = buf
            arr[i].n_bytes = int(t.n_bytes)
        desc.tensors = arr
        desc.n_tensors = len(tensors)
        desc.n_ctx = self.n_ctx
        desc.kv_type = KV_TYPES[kv_type]
        desc.device = int(device)
        desc.n_checkpoints = self.n_checkpoints * self.n_seq    # the engine's pool: every sequence's slots
        desc.n_seq = self.n_seq
        if self.batched_prefill:     # an ABI 2 header has no such field (0 = no buffers otherwise)
            desc.prefill_chunk = self.prefill_chunk
        out = ffi.new("oj_engine **")
        rc = lib.oj_engine_create(desc, out)
        del keep
        _native.check(self._nl, rc, None, f"loading {getattr(model_file, 'path', 'model')} onto the GPU")
        return ffi.gc(out[0], lib.oj_engine_free)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            _native.check(self._nl, rc, self._shared.handle, what)

    def _handle(self):
        """The engine, with this view's sequence selected (every call below applies to it)."""
        sh = self._shared
        if sh.handle is None:
            raise NativeEngineError(-1, "the native engine is closed")
        if sh.selected != self.seq:
            self._check(self._nl.lib.oj_seq_select(sh.handle, self.seq), f"selecting sequence {self.seq}")
            sh.selected = self.seq
        return sh.handle

    # --- tokenizer -----------------------------------------------------------------------------
    def _tok(self):
        sh = self._shared
        with sh.tokenizer_lock:
            if sh.tokenizer is None:
                from ..tokenizer import Tokenizer
                sh.tokenizer = Tokenizer.from_gguf(self._model_file.path)
            return sh.tokenizer

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        return list(self._tok().encode(bytes(text), add_special=add_special, parse_special=parse_special))

    def detokenize(self, tokens: list[int]) -> bytes:
        return self._tok().decode_bytes(tokens, special=True)

    # --- state ---------------------------------------------------------------------------------
    @property
    @_on_engine
    def n_past(self) -> int:
        out = self._nl.ffi.new("int32_t *")
        self._check(self._nl.lib.oj_n_past(self._handle(), out), "n_past")
        return int(out[0])

    def _chunks(self, tokens: Iterable[int], size: int = CALL_POSITIONS) -> list[list[int]]:
        toks = [int(t) for t in tokens]
        if not toks:
            raise ValueError("tokens is empty")
        bad = [t for t in toks if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.n_vocab})")
        if self.n_past + len(toks) > self.n_ctx:
            raise ContextOverflowError(self.n_past + len(toks), self.n_ctx)
        return [toks[i:i + size] for i in range(0, len(toks), size)]

    def _eval_chunk(self, chunk: list[int]) -> None:
        ffi = self._nl.ffi
        self._flush_mtp()
        start = self.n_past
        buf = ffi.new("int32_t[]", chunk)
        self._check(self._nl.lib.oj_eval(self._handle(), buf, len(chunk)), "eval")
        self._last_n = len(chunk)
        self._verify_tokens = []
        if self.supports_speculative:
            # the chunk's MTP rows, while its main hiddens are in the engine's window
            self._mtp_call(chunk, start, "main")
            self._mtp_upto = start + len(chunk)

    def _eval_chunks(self, tokens: list[int], prefill_all: bool = False) -> None:
        """Append `tokens`: spans longer than PREFILL_MIN_SPAN through oj_prefill (when the engine
        has it), the rest 8 positions per oj_eval; prefill_all: every span through oj_prefill (a
        piece of a longer prompt, which alone would have gone through it whole: NativePasses).
        With checkpoint_interval N a span ends at every multiple of N, where a checkpoint is saved
        (not after the last token: the engine saves its own before the prompt's last one)."""
        every = self.checkpoint_interval
        toks = [int(t) for t in tokens]
        self._chunks(toks)            # validation: ids, context
        i = 0
        while i < len(toks):
            n = len(toks) - i
            if every:                 # spans end on the interval's multiples
                n = min(n, every - self.n_past % every)
            if self.batched_prefill and (n > PREFILL_MIN_SPAN or prefill_all):
                self._prefill_span(toks[i:i + n])
            else:
                n = min(n, CALL_POSITIONS)
                self._eval_chunk(toks[i:i + n])
            i += n
            if every and self.n_past % every == 0 and i < len(toks):
                self.save_checkpoint()

    def _mtp_n_past(self) -> int:
        out = self._nl.ffi.new("int32_t *")
        self._check(self._nl.lib.oj_mtp_n_past(self._handle(), out), "mtp n_past")
        return int(out[0])

    def _prefill_span(self, span: list[int]) -> None:
        """One oj_prefill of `span` at n_past. The engine makes the span's MTP rows itself when its
        MTP cache ends exactly at n_past on entry, and leaves the cache alone otherwise. So first
        the rows still owed are made (_flush_mtp, from the last verify's window); then a
        speculating backend whose MTP cache is not at n_past (draft rows beyond it: the last cycle
        had all its drafts rejected) evaluates the first positions with oj_eval, which cuts the
        cache there and makes their rows. A backend that does not speculate takes whatever the
        engine does: its prompts then go through the same arithmetic as a speculating one's (the
        same state, so greedy output is the same), at the cost of the MTP block's rows (one layer
        of 65 on the 27B) when a conversation starts."""
        self._flush_mtp()
        if self.supports_speculative:
            if self._mtp_n_past() != self.n_past:
                head, span = span[:CALL_POSITIONS], span[CALL_POSITIONS:]
                self._eval_chunk(head)
                if len(span) <= PREFILL_MIN_SPAN:
                    if span:
                        self._eval_chunk(span)
                    return
        buf = self._nl.ffi.new("int32_t[]", span)
        self._check(self._nl.lib.oj_prefill(self._handle(), buf, len(span)), "prefill")
        self.prefilled_positions += len(span)
        # results read as after a one-position oj_eval of the last token; a pending verify is gone
        self._last_n = 1
        self._verify_tokens = []
        if self.supports_speculative:
            self._mtp_upto = self.n_past     # the engine made every row of the span

    def _piece_fits(self, n: int) -> bool:
        """A piece of n tokens at n_past can go in layers (oj_prefill_layers) with the state and
        results of _eval_chunks(prefill_all=True) of it: one oj_prefill pass (n <= prefill_chunk),
        no checkpoint interval strictly inside it (where _eval_chunks would split it and save one),
        and for a speculating sequence an MTP cache that ends at n_past once the rows owed are made
        (the engine then makes the piece's rows, as _prefill_span's oj_prefill does; otherwise
        _prefill_span evaluates its head by oj_eval first)."""
        if not self.supports_pieces or n > self.prefill_chunk:
            return False
        every = self.checkpoint_interval
        if every and self.n_past % every + n > every:
            return False
        if self.supports_speculative:
            self._flush_mtp()
            return self._mtp_n_past() == self.n_past
        return True

    @_on_engine
    def prefill_piece(self, span: list[int], share: float) -> float:
        """A share (0 < share <= 1) of the layers of `span`, a piece of a prompt that alone would go
        through oj_prefill (NativePasses): oj_prefill_layers over max(1, floor(n_layer x share))
        more layers, so that the decoders beside it wait for that share only. The first call starts
        the piece; the next ones pass the same span. Returns the share of the piece's layers this
        call ran; `piece_in_flight` is False once the piece is in the sequence, whose state and
        results are then those of _eval_chunks(span, prefill_all=True), bit for bit. A piece that
        cannot go in layers (_piece_fits) goes in whole (returns 1.0). A failure on the way ends
        the piece and the sequence (the engine reset it: its state was part piece)."""
        toks = [int(t) for t in span]
        n_layer = self.config.n_layer
        if self._piece is None:
            self._chunks(toks)            # validation: ids, context
            if not 0 < share < 1 or not self._piece_fits(len(toks)):
                self._eval_chunks(toks, prefill_all=True)
                return 1.0
            done_before = 0
        else:
            if toks != self._piece[0]:
                raise ValueError(f"sequence {self.seq} has a piece of {len(self._piece[0])} tokens in flight; "
                                 f"go on with the same tokens")
            done_before = self._piece[1]
        layers = min(n_layer - done_before, max(1, int(n_layer * share)))
        ffi = self._nl.ffi
        done = ffi.new("int32_t *")
        rc = self._nl.lib.oj_prefill_layers(self._handle(), ffi.new("int32_t[]", toks), len(toks), layers, done)
        if rc != 0:
            if done[0] < 0:               # the engine reset the sequence
                self._piece = None
                self._after_reset()
            self._check(rc, "prefill piece")
        if done[0] == 0:
            self._piece = (toks, done_before + layers)
            return layers / n_layer
        self._piece = None
        self.prefilled_positions += len(toks)
        self._last_n = 1
        self._verify_tokens = []
        if self.supports_speculative:
            self._mtp_upto = self.n_past     # the engine made every row of the piece
        return layers / n_layer

    @property
    def piece_in_flight(self) -> bool:
        """A prompt piece of this sequence is part way through its layers (prefill_piece)."""
        return self._piece is not None

    @_on_engine
    def prefill_with_mtp_rows(self, tokens: list[int]) -> bool:
        """Append `tokens` in one oj_prefill that also makes their MTP rows in the engine (the
        draft source of a tree decoder, which keeps the MTP cache itself, then has nothing to catch
        up). False, with nothing done, where it cannot: no batched prefill or no MTP block, a span
        that oj_eval takes anyway (PREFILL_MIN_SPAN or fewer), or an MTP cache that does not end at
        n_past (the engine would leave it alone). Results then read as after a one-position eval of
        the last token; no checkpoint is saved on the way."""
        toks = [int(t) for t in tokens]
        self._chunks(toks)            # validation: ids, context
        if not (self.batched_prefill and self.has_mtp and len(toks) > PREFILL_MIN_SPAN and not self._uncaught
                and self._mtp_n_past() == self.n_past):
            return False
        self._prefill_span(toks)
        return True

    def eval(self, tokens: list[int]) -> np.ndarray:
        if self._shared.passes is not None:
            return self._eval_in_passes(tokens, want_logits=True).logits
        with self._shared.lock:
            self._eval_chunks(tokens)
            return self.logits(self._last_n - 1)

    def eval_argmax(self, tokens: list[int]) -> int:
        if self._shared.passes is not None:
            return self._eval_in_passes(tokens, want_logits=False).argmax
        with self._shared.lock:
            self._eval_chunks(tokens)
            return self.argmax()[-1]

    @_on_engine
    def eval_pass_argmax(self, tokens: list[int]) -> int:
        """eval_argmax in exactly one oj_eval of every token (1..max_positions: one pass over the
        weights), which the bench's verify_ms and phase rows time; eval_argmax itself splits a run
        into calls of CALL_POSITIONS and sends a longer span through oj_prefill."""
        if self._shared.passes is not None:
            raise RuntimeError("eval_pass_argmax: not under a pass scheduler (it evaluates alone)")
        toks = self._chunks(tokens, self.max_positions)
        if len(toks) != 1:
            raise ValueError(f"eval_pass_argmax takes 1..{self.max_positions} tokens, got {len(tokens)}")
        with self._shared.lock:
            self._eval_chunk(toks[0])
            return self.argmax()[-1]

    def eval_argmax_rows(self, tokens: list[int], rows_for) -> tuple[int, np.ndarray | None]:
        """eval_argmax, and the logits row of the last token where its argmax is in `rows_for` (a
        greedy request's negatively biased ids: only there can its biases change the choice), so
        that the other steps copy no row off the device. With a scheduler, the row always (the
        engine's requests there chain instead: submit_chain)."""
        if self._shared.passes is not None:
            row = self.eval(tokens)
            return int(np.argmax(row)), row
        with self._shared.lock:
            self._eval_chunks(tokens)
            top = self.argmax()[-1]
            return top, (self.logits(self._last_n - 1) if top in rows_for else None)

    def submit_argmax(self, tokens: list[int]):
        """eval_argmax in two halves: the tokens go to the pass scheduler now, and the Submitted
        returned waits for their pass and gives the argmax. Between them the caller does its own
        work while the pass runs (the engine assembles and streams the text of the token being
        evaluated), after its `launched()`. Without a scheduler (one sequence) the eval runs when
        the Submitted is called."""
        if self._shared.passes is None:
            return Submitted(lambda: self.eval_argmax(tokens))
        work = self._submit_work(tokens, want_logits=False)
        return Submitted(lambda: self._wait_work(work).argmax, lambda: self._shared.passes.wait_launched(work))

    def submit_chain(self, token: int, evaluations: int, eog, rows_for=()):
        """A greedy chain on the shared passes (PassScheduler.submit_chain): `token` evaluated, then
        each argmax as the next step, `evaluations` at most, stopping at an id in `eog` or in
        `rows_for` (whose logits row it keeps); the scheduler hands each next step in itself, so
        no pass waits for this request's thread. None without a scheduler (one sequence: the
        caller steps as before)."""
        if self._shared.passes is None:
            return None
        tok = int(token)
        with self._shared.lock:
            self._chunks([tok] * evaluations)   # the id, and room for every evaluation: refused here
        return self._shared.passes.submit_chain(self.seq, tok, evaluations, eog, rows_for=rows_for)

    def _eval_in_passes(self, tokens: list[int], want_logits: bool) -> Work:
        """An eval of a multi-sequence engine: handed to the pass scheduler, which runs it with the
        other sequences' (NativePasses)."""
        return self._wait_work(self._submit_work(tokens, want_logits))

    def _submit_work(self, tokens: list[int], want_logits: bool) -> Work:
        """Hand the tokens to the pass scheduler. The token ids and the sequence's room are checked
        here, so that no pass sees a request that cannot run; with want_logits False no logits
        row is copied off the device (only the argmax)."""
        toks = [int(t) for t in tokens]
        with self._shared.lock:
            self._chunks(toks)                  # ids and context: refused here, alone
        return self._shared.passes.submit(self.seq, toks, want_logits=want_logits)

    def _wait_work(self, work: Work) -> Work:
        """Until the scheduler ran the work (_submit_work's); its error raised."""
        passes = self._shared.passes
        try:
            passes.wait(work)
        finally:
            if not work.event.is_set():
                # interrupted (Ctrl-C): the work is dropped after the pass that holds it; n_past,
                # read from the engine, counts what went in
                passes.cancel(self.seq)
        if work.error is not None:
            raise work.error
        return work

    def _after_shared_pass(self) -> None:
        """This sequence took one token in an oj_eval_seqs: committed (a pending verify counts as
        oj_commit(0)); its result row is the pass's, read there, not this view's to read again."""
        self._last_n = 0
        self._verify_tokens, self._verify_parent = [], None
        if self._speculates:                    # no MTP row for this token (leave_mtp said so)
            self._mtp_left, self._uncaught, self._token_row = True, [], None

    @_on_engine
    def eval_all_logits(self, tokens: list[int], positions_per_call: int = CALL_POSITIONS) -> np.ndarray:
        """Logits `[n, n_vocab]` of every token (teacher forcing), `positions_per_call` at a time."""
        if not 1 <= positions_per_call <= self.max_positions:
            raise ValueError(f"positions_per_call must be 1..{self.max_positions}")
        toks = [int(t) for t in tokens]
        self._chunks(toks)   # validation
        out = np.empty((len(toks), self.n_vocab), dtype=np.float32)
        for i in range(0, len(toks), positions_per_call):
            chunk = toks[i:i + positions_per_call]
            self._eval_chunk(chunk)
            for j in range(len(chunk)):
                out[i + j] = self.logits(j)
        return out

    @_on_engine
    def argmax(self) -> list[int]:
        """Argmax of every position of the last native call."""
        ffi = self._nl.ffi
        out = ffi.new("int32_t[]", self._last_n)
        self._check(self._nl.lib.oj_get_argmax(self._handle(), out, self._last_n), "argmax")
        return [int(x) for x in out]

    @_on_engine
    def logits(self, index: int) -> np.ndarray:
        out = np.empty(self.n_vocab, dtype=np.float32)
        ptr = self._nl.ffi.from_buffer("float[]", out, require_writable=True)
        self._check(self._nl.lib.oj_get_logits(self._handle(), index, ptr, self.n_vocab), "logits")
        return out

    @_on_engine
    def hidden(self, index: int) -> np.ndarray:
        """Final hidden state (after output_norm) of position `index` of the last call."""
        out = np.empty(self.config.n_embd, dtype=np.float32)
        ptr = self._nl.ffi.from_buffer("float[]", out, require_writable=True)
        self._check(self._nl.lib.oj_get_hidden(self._handle(), index, ptr, self.config.n_embd), "hidden")
        return out

    def rollback(self, n_keep: int) -> bool:
        # The recurrent state cannot go back by itself: checkpoints do that (restore_checkpoint).
        return n_keep == self.n_past

    def reset(self) -> None:
        if self._shared.passes is not None:
            self._shared.passes.cancel(self.seq)        # no pass touches the sequence after this
        with self._shared.lock:
            self._reset()

    def _reset(self) -> None:
        self._check(self._nl.lib.oj_reset(self._handle()), "reset")
        self._after_reset()

    def _after_reset(self) -> None:
        """The Python side of an oj_reset of this sequence (a piece in flight goes with it)."""
        self._piece = None
        self._last_n = 0
        self._checkpoints = []
        self._mtp_upto, self._uncaught, self._verify_tokens = 0, [], []
        self._token_row = None
        self._mtp_left = False                          # an empty sequence's MTP cache is in step

    # --- checkpoints (backends/base.py's optional protocol) ------------------------------------
    @_on_engine
    def save_checkpoint(self) -> None:
        """Copy the recurrent state at n_past into a slot (on the device; the oldest is reused)."""
        if self.n_checkpoints < 1:
            return
        self._flush_mtp()
        n = self.n_past
        self._checkpoints = [(s, k) for s, k in self._checkpoints if k != n]
        used = {s for s, _ in self._checkpoints}
        # this sequence's own slots: another sequence's checkpoints are never overwritten
        base = self._checkpoint_base
        free = [s for s in range(base, base + self.n_checkpoints) if s not in used]
        slot = free[0] if free else self._checkpoints.pop(0)[0]
        self._check(self._nl.lib.oj_checkpoint_save(self._handle(), slot), "checkpoint save")
        self._checkpoints.append((slot, n))

    @_on_engine
    def restore_checkpoint(self, n_max: int) -> int:
        """Back to the newest checkpoint with <= n_max tokens (checkpoints after n_max belong to a
        history that no longer holds: dropped). Returns its n_past; 0 after a reset."""
        keep = [(s, k) for s, k in self._checkpoints if k <= n_max]
        if not keep:
            self._reset()
            return 0
        slot, n = max(keep, key=lambda sk: sk[1])
        out = self._nl.ffi.new("int32_t *")
        self._check(self._nl.lib.oj_checkpoint_restore(self._handle(), slot, out), "checkpoint restore")
        self._checkpoints = keep
        self._last_n = 0
        if self._mtp_left and self._mtp_upto >= n:      # back to where its MTP rows reach
            self._mtp_left = False
        self._mtp_upto, self._uncaught, self._verify_tokens = min(self._mtp_upto, n), [], []
        self._cut_rows(n)                               # the engine cut the MTP cache to n
        return int(out[0])

    # --- whole-state copies (backends/base.py's optional protocol: the engine's prefix cache) ----
    def save_state(self, max_bytes: int) -> SequenceState | None:
        """A copy of this sequence's state at n_past in host memory (oj_seq_state_save: the DeltaNet
        state, h of n_past - 1, the K/V rows [0, n_past) and the MTP rows), loadable into any
        sequence of this engine; None when n_past is 0, when it would take more than max_bytes, or
        when a speculating backend's MTP rows do not reach n_past (a copy without them would draft
        from a cache with a gap). The bytes move after the engine's lock is let go, while other
        sequences' passes run (_wait_copy)."""
        ffi, lib = self._nl.ffi, self._nl.lib
        with self._shared.lock:
            self._flush_mtp()                   # rows still owed, while their hiddens are in the window
            n = self.n_past
            if n == 0:
                return None
            size = ffi.new("uint64_t *")
            self._check(lib.oj_seq_state_size(self._handle(), size), "sequence state size")
            if int(size[0]) > max_bytes:
                return None
            if self.supports_speculative and self._mtp_n_past() < n:
                return None
            data = np.empty(int(size[0]), dtype=np.uint8)
            buf = ffi.from_buffer("char[]", data, require_writable=True)
            copy = ffi.new("oj_state_copy **")
            self._check(lib.oj_seq_state_save(self._handle(), buf, data.size, copy), "sequence state save")
            self._shared.copies += 1
        self._wait_copy(copy, "sequence state save")
        return SequenceState(n, int(data.size), data, self._shared)

    def load_state(self, state: SequenceState) -> bool:
        """Replace this sequence's state by `state` (saved by any sequence of this engine). False,
        with the sequence empty, if the engine refused it. The bytes move after the engine's lock
        is let go, while other sequences' passes run (_wait_copy)."""
        if state.origin is not self._shared:
            raise ValueError("load_state: the state was saved by another backend")
        if state.n_past > self.n_ctx:
            raise ContextOverflowError(state.n_past, self.n_ctx)
        if self._shared.passes is not None:
            self._shared.passes.cancel(self.seq)        # no pass touches the sequence after this
        ffi, lib = self._nl.ffi, self._nl.lib
        with self._shared.lock:
            buf = ffi.from_buffer("char[]", state.data)
            copy = ffi.new("oj_state_copy **")
            if lib.oj_seq_state_load(self._handle(), buf, state.nbytes, copy) != 0:
                log.warning("the native engine refused a state copy: %s", _native.last_error(self._nl, self._shared.handle))
                self._reset()
                return False
            self._shared.copies += 1
        try:
            self._wait_copy(copy, "sequence state load")
        except NativeEngineError:
            with self._shared.lock:
                self._reset()                           # what the copy left is undefined
            raise
        with self._shared.lock:
            # the sequence's own checkpoints and pending work were of the state it held before; its
            # MTP cache follows the main model again where the copy's rows reach its n_past (a
            # speculating sequence's copies do: save_state's rule)
            self._checkpoints = []
            self._last_n = 0
            self._verify_tokens, self._verify_parent = [], None
            self._uncaught, self._token_row = [], None
            self._mtp_upto = min(self._mtp_n_past(), state.n_past)
            self._mtp_left = self._speculates and self._mtp_upto < state.n_past
            return True

    def _wait_copy(self, copy, what: str) -> None:
        """Carry out a started state copy (oj_state_copy_wait). Called after the engine's lock is
        let go (unless an outer caller holds it), so other sequences' passes run while the bytes
        move; this sequence is busy meanwhile (its request's thread is here, and the engine refuses
        calls on it)."""
        sh = self._shared
        try:
            rc = int(self._nl.lib.oj_state_copy_wait(copy[0]))
        finally:
            with sh.lock:
                sh.copies -= 1
                sh.copies_done.notify_all()
        if rc != 0:
            _native.check(self._nl, rc, None, what)   # the wait's message is its thread's

    # --- speculative cycles (used by speculative_native.NativeSpeculator) ----------------------
    @_on_engine
    def verify(self, tokens: list[int]) -> None:
        """Evaluate the current token and the drafts at n_past provisionally (read the results
        with argmax()/logits()); nothing is kept until commit()."""
        toks = self._chunks(tokens, self.max_positions)
        if len(toks) != 1:
            raise ValueError(f"verify takes 1..{self.max_positions} tokens, got {len(tokens)}")
        # rows still owed (a cycle that drafted nothing) need this window's hiddens: make them now
        self._flush_mtp()
        buf = self._nl.ffi.new("int32_t[]", toks[0])
        self._check(self._nl.lib.oj_verify(self._handle(), buf, len(toks[0])), "verify")
        self._last_n = len(toks[0])
        self._verify_tokens = toks[0]
        self._verify_parent = None

    @_on_engine
    def commit(self, n_accept: int) -> None:
        """Keep the first n_accept positions of the last verify."""
        if not self._verify_tokens:
            raise RuntimeError("commit without a verify")
        start = self.n_past
        self._check(self._nl.lib.oj_commit(self._handle(), int(n_accept)), "commit")
        kept = self._verify_tokens[:n_accept]
        self._verify_tokens = []
        self._owe_rows(start, kept)

    @_on_engine
    def verify_tree(self, tokens: list[int], parent) -> None:
        """Evaluate a draft tree at n_past provisionally (oj_verify_tree; the layout of
        speculative_tree: node 0 the current token with parent -1, parent[i] < i): argmax(),
        logits(i) and hidden(i) then read node i. Nothing is kept until commit_path()."""
        from ..speculative_tree import check_tree_parents

        if not self.supports_tree:
            raise RuntimeError(f"the native library is ABI {int(self._nl.lib.oj_abi_version())}; "
                               f"oj_verify_tree needs {TREE_ABI}: rebuild it")
        toks = self._chunks(tokens)
        if len(toks) != 1 or len(tokens) > MAX_TREE_NODES:
            raise ValueError(f"verify_tree takes 1..{MAX_TREE_NODES} nodes, got {len(tokens)}")
        par = check_tree_parents(parent, len(toks[0]))
        self._flush_mtp()                          # as verify: owed rows need this window's hiddens
        ffi = self._nl.ffi
        self._check(self._nl.lib.oj_verify_tree(self._handle(), ffi.new("int32_t[]", toks[0]),
                                                ffi.new("int32_t[]", par.tolist()), len(toks[0])), "verify_tree")
        self._last_n = len(toks[0])
        self._verify_tokens = toks[0]
        self._verify_parent = par.tolist()

    @_on_engine
    def commit_path(self, path) -> None:
        """Keep one root-first path of the last verify_tree (or verify) as positions n_past..
        (oj_commit_path). Its tokens then owe their MTP rows like commit()'s: the engine moved the
        path's hidden states into the window, where the next MTP call finds them."""
        if not self._verify_tokens:
            raise RuntimeError("commit_path without a verify_tree")
        p = [int(i) for i in path]
        parent = self._verify_parent or list(range(-1, len(self._verify_tokens) - 1))
        if not p or p[0] != 0 or any(not 0 < b < len(parent) or parent[b] != a for a, b in zip(p, p[1:])):
            raise ValueError(f"{p} is not a root-first path of the last tree (parents {parent})")
        start = self.n_past
        self._check(self._nl.lib.oj_commit_path(self._handle(), self._nl.ffi.new("int32_t[]", p), len(p)),
                    "commit_path")
        kept = [self._verify_tokens[i] for i in p]
        self._verify_tokens, self._verify_parent = [], None
        self._last_n = len(p)                      # results now read the path, in path order
        self._owe_rows(start, kept)

    def _owe_rows(self, start: int, kept: list[int]) -> None:
        """Committed tokens at start.. owe their MTP rows, but for those the first draft step
        already made (rows below _mtp_upto). The row at `start` counts as made only when it is
        the committed token's: draft_first(t) made it for t (_token_row), and a verify whose
        first token is not t (or a row rewritten since) leaves it owed again, to be remade from
        the main hidden h_{start-1} (row 0 of the window the verify left)."""
        if not self.supports_speculative:
            return
        if kept and self._mtp_upto > start and self._token_row != (start, int(kept[0])):
            self._mtp_upto = start
            self._token_row = None
        self._uncaught += kept[max(0, self._mtp_upto - start):]

    @_on_engine
    def cycle(self, tokens: list[int], n_draft: int,
              sampled: tuple[SamplingParams, int] | None = None) -> tuple[int, list[int], list[int]]:
        """One greedy cycle in one call (oj_cycle): verify tokens = [current token, drafts] at
        n_past, accept the drafts equal to the main model's argmax before them, commit the current
        token and those, and with n_draft > 0 draft n_draft tokens from the next token. Returns
        (n_accepted, emitted: the accepted drafts then the next token, the next token's drafts).
        n_draft > 0 drafts from the current token's MTP row: draft_first(token) makes it, and so
        does a cycle whose next token it was. Results read afterwards (argmax, logits) are the
        verify's positions.

        sampled = (params, seed): the sampled cycle (oj_cycle_sampled): every draw on the GPU under
        params' temperature, top-k (1..SAMPLE_TOP_MAX), top-p and min-p, the uniforms from seed;
        the drafts verified must be the ones the last sampled cycle returned for this token here
        (the engine keeps the distributions they were drawn from)."""
        if sampled is not None:
            params, seed = sampled
            why = sampled_cycle_refusal(params)
            if why:
                raise ValueError(f"a sampled cycle cannot draw this request: {why}")
            if not self.supports_sampled_cycle:
                raise ValueError(f"a sampled cycle needs oj_cycle_sampled (ABI {SAMPLED_CYCLE_ABI}); the "
                                 f"library has ABI {int(self._nl.lib.oj_abi_version())}")
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 1 << 64:
                raise ValueError(f"the sampled cycle's seed must be an integer in [0, 2**64), got {seed!r}")
        toks = [int(t) for t in tokens]
        if not 1 <= len(toks) <= self.max_positions:
            raise ValueError(f"cycle takes 1..{self.max_positions} tokens (the current token and up to "
                             f"{self.max_positions - 1} drafts), got {len(toks)}")
        if (isinstance(n_draft, bool) or not isinstance(n_draft, (int, np.integer))
                or not 0 <= n_draft < self.max_positions):
            raise ValueError(f"n_draft must be an integer in [0, {self.max_positions - 1}] (the drafts of the "
                             f"next verify), got {n_draft!r}")
        n_draft = int(n_draft)
        if n_draft and not self.supports_speculative:
            raise ValueError(f"n_draft {n_draft} needs the MTP head (this backend: MTP block "
                             f"{'present' if self.has_mtp else 'absent'}, draft_depth {self.draft_depth})")
        self._chunks(toks)                             # ids, the verify's positions in the context
        pos = self.n_past
        if pos + len(toks) + n_draft > self.n_ctx:
            # the last draft comes from MTP row pos + len(toks) + n_draft - 1 when all are accepted
            raise ContextOverflowError(pos + len(toks) + n_draft, self.n_ctx, (
                f"a cycle of {len(toks)} tokens with n_draft {n_draft} at n_past {pos} needs "
                f"{pos + len(toks) + n_draft} positions; the context window has {self.n_ctx}"))
        # rows still owed need the last verify's hiddens, which the cycle's own verify replaces
        self._flush_mtp()
        if n_draft and self._token_row != (pos, toks[0]):
            row = self._token_row
            upto, why = self._mtp_upto, ""
            if row is not None and row[0] == pos:
                upto, why = pos + 1, f" (the row at {pos} was made for token {row[1]}, not {toks[0]})"
            raise RuntimeError(f"cycle with n_draft {n_draft} drafts from the current token's MTP row: "
                               f"MTP rows reach {upto}{why}, they must reach n_past + 1 = {pos + 1} "
                               f"(draft_first(token) makes the row)")
        ffi = self._nl.ffi
        buf = ffi.new("int32_t[]", toks)
        n_acc = ffi.new("int32_t *")
        out = ffi.new("int32_t[]", len(toks))
        drafts = ffi.new("int32_t[]", n_draft) if n_draft else ffi.NULL
        if sampled is None:
            self._check(self._nl.lib.oj_cycle(self._handle(), buf, len(toks), n_draft, n_acc, out, drafts), "cycle")
        else:
            sp = ffi.new("oj_sampling *", {"temperature": params.temperature, "top_k": params.top_k,
                                           "top_p": params.top_p, "min_p": params.min_p, "seed": int(seed)})
            self._check(self._nl.lib.oj_cycle_sampled(self._handle(), buf, len(toks), n_draft, sp, n_acc, out, drafts),
                        "sampled cycle")
        k = int(n_acc[0])
        emitted = [int(out[i]) for i in range(k + 1)]
        self._last_n = len(toks)
        self._verify_tokens = []
        if n_draft:
            # the engine made the rows of the accepted drafts and of the next token; the next
            # token's row counts as not made, so a host draft_first remakes it (the same row) and
            # only a cycle from that very token relies on it
            self._uncaught = []
            self._mtp_upto = pos + 1 + k
            self._token_row = (pos + 1 + k, emitted[-1])
        else:
            # the MTP cache is as before: the committed tokens owe their rows, as after commit()
            self._owe_rows(pos, toks[:1 + k])     # (reads _token_row: the row at pos kept if toks[0]'s)
            self._token_row = None
        return k, emitted, [int(drafts[i]) for i in range(n_draft)]

    def _cut_rows(self, pos0: int) -> None:
        """MTP rows from pos0 on are dropped or rewritten: a current token's row there is gone."""
        if self._token_row is not None and self._token_row[0] >= pos0:
            self._token_row = None

    def _mtp_call(self, tokens: list[int], pos0: int, h: str) -> None:
        self._cut_rows(pos0)
        buf = self._nl.ffi.new("int32_t[]", tokens)
        self._check(self._nl.lib.oj_mtp_eval(self._handle(), buf, len(tokens), int(pos0), _H_SOURCES[h],
                                             self._nl.ffi.NULL), "mtp_eval")

    def _flush_mtp(self) -> None:
        """Rows for committed tokens still without one (needs the last verify's hidden window)."""
        if self._uncaught:
            toks, self._uncaught = self._uncaught, []
            self._mtp_call(toks, self._mtp_upto, "main")
            self._mtp_upto += len(toks)

    @_on_engine
    def draft_first(self, token: int) -> int:
        """The MTP step for the current (not yet evaluated) token at n_past, batched with the rows
        still owed; returns the draft argmax (a token id). Draft logits: draft_logits(-1)."""
        if not self.supports_speculative:
            raise RuntimeError("this backend does not draft (no MTP block or draft_depth 0)")
        pos = self.n_past
        toks = self._uncaught + [int(token)]
        if self._mtp_upto + len(self._uncaught) != pos:
            raise RuntimeError(f"MTP rows end at {self._mtp_upto} with {len(self._uncaught)} owed, "
                               f"the main model is at {pos}")
        while len(toks) > CALL_POSITIONS:                      # more rows owed than one call takes
            self._mtp_call(toks[:CALL_POSITIONS], self._mtp_upto, "main")
            self._mtp_upto += CALL_POSITIONS
            toks = toks[CALL_POSITIONS:]
        self._mtp_call(toks, self._mtp_upto, "main")
        self._uncaught = []
        self._mtp_upto = pos + 1
        self._token_row = (pos, int(token))
        self._mtp_last = len(toks)
        out = self._nl.ffi.new("int32_t[]", len(toks))
        self._check(self._nl.lib.oj_get_draft_argmax(self._handle(), out, len(toks)), "draft argmax")
        return int(out[len(toks) - 1])

    @_on_engine
    def draft_next(self, token: int, pos: int) -> int:
        """A chained draft step: `token` at MTP position pos with the MTP block's own last output
        as the hidden; returns the draft argmax."""
        self._mtp_call([int(token)], pos, "draft")
        self._mtp_last = 1
        out = self._nl.ffi.new("int32_t[]", 1)
        self._check(self._nl.lib.oj_get_draft_argmax(self._handle(), out, 1), "draft argmax")
        return int(out[0])

    @_on_engine
    def set_draft_vocab(self, ids: np.ndarray | None) -> None:
        """Restrict the draft head to `ids` (None: the whole vocabulary)."""
        ffi = self._nl.ffi
        if ids is None:
            self._check(self._nl.lib.oj_set_draft_vocab(self._handle(), ffi.NULL, 0), "draft vocabulary")
            self._shared.draft_vocab_len = 0
            return
        arr = np.ascontiguousarray(ids, dtype=np.int32)
        self._check(self._nl.lib.oj_set_draft_vocab(self._handle(), ffi.from_buffer("int32_t[]", arr), arr.size),
                    "draft vocabulary")
        self._shared.draft_vocab_len = int(arr.size)

    def close(self) -> None:
        """Free the engine, every sequence's (a view of a later sequence leaves that to the backend
        that made it, sequence 0's)."""
        if not self._owns_engine:
            return
        sh = self._shared
        if sh.passes is not None:
            sh.passes.close()                    # the scheduler's thread ends before the engine goes
        with sh.lock:
            sh.copies_done.wait_for(lambda: sh.copies == 0)   # a state copy in flight ends first
            if sh.handle is not None:
                self._nl.ffi.release(sh.handle)  # runs oj_engine_free now
                sh.handle = None

    def __enter__(self) -> "NativeBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- MTP draft head ------------------------------------------------------------------------
    @_on_engine
    def mtp_eval(self, tokens: list[int], pos0: int, h: str | np.ndarray = "main") -> list[int]:
        """Run the MTP block on tokens at MTP positions pos0..; returns the draft argmax of each.

        h: "main" (main hidden state of the previous position, from the last eval), "draft" (the
        MTP block's own last output, one token), or an array `[n, n_embd]` of hidden states.
        """
        ffi, lib = self._nl.ffi, self._nl.lib
        toks = [int(t) for t in tokens]
        if not 1 <= len(toks) <= self.max_positions:
            raise ValueError(f"mtp_eval takes 1..{self.max_positions} tokens, got {len(toks)}")
        h_ptr = ffi.NULL
        if isinstance(h, str):
            if h not in _H_SOURCES:
                raise ValueError(f"h must be 'main', 'draft' or an array, got {h!r}")
            source = _H_SOURCES[h]
        else:
            arr = np.ascontiguousarray(h, dtype=np.float32).reshape(len(toks), self.config.n_embd)
            h_ptr = ffi.from_buffer("float[]", arr)
            source = 2
        buf = ffi.new("int32_t[]", toks)
        self._cut_rows(int(pos0))
        self._check(lib.oj_mtp_eval(self._handle(), buf, len(toks), int(pos0), source, h_ptr), "mtp_eval")
        self._mtp_last = len(toks)
        self._mtp_upto = min(self._mtp_upto, int(pos0))   # rows from here on are the caller's
        out = ffi.new("int32_t[]", len(toks))
        self._check(lib.oj_get_draft_argmax(self._handle(), out, len(toks)), "draft argmax")
        return [int(x) for x in out]

    @_on_engine
    def draft_tree(self, root: int, pos: int, root_h: np.ndarray, budget: int, max_children: int, max_depth: int,
                   edges: np.ndarray, accept_a: np.ndarray, accept_c: np.ndarray) -> tuple:
        """oj_draft_tree: a greedy draft tree from the MTP head in one call (openjet.h says the rule;
        speculative_tree.grow_tree is the same rule step by step). Returns (tokens, parent, prob,
        score, steps): the nodes in the order taken."""
        ffi, lib = self._nl.ffi, self._nl.lib
        if not self.supports_draft_tree:
            raise RuntimeError(f"the native library is ABI {int(lib.oj_abi_version())}; oj_draft_tree needs "
                               f"{DRAFT_TREE_ABI}: rebuild it")
        n_bins = len(edges)
        if not (len(accept_a) == len(accept_c) == n_bins):
            raise ValueError("edges, accept_a and accept_c must have one entry per bin")
        h = np.ascontiguousarray(root_h, dtype=np.float32).reshape(-1)
        if h.size != self.config.n_embd:
            raise ValueError(f"root_h has {h.size} values, the model's hidden has {self.config.n_embd}")
        e, a, c = (np.ascontiguousarray(x, dtype=np.float64) for x in (edges, accept_a, accept_c))
        rq = ffi.new("oj_tree_request *")
        rq.root, rq.pos, rq.root_h = int(root), int(pos), ffi.from_buffer("float[]", h)
        rq.budget, rq.max_children, rq.max_depth, rq.n_bins = int(budget), int(max_children), int(max_depth), n_bins
        rq.edges, rq.accept_a, rq.accept_c = (ffi.from_buffer("double[]", x) for x in (e, a, c))
        cap = max(1, int(budget))
        toks, par = ffi.new("int32_t[]", cap), ffi.new("int32_t[]", cap)
        prob, score = ffi.new("double[]", cap), ffi.new("double[]", cap)
        n, steps = ffi.new("int32_t *"), ffi.new("int32_t *")
        self._cut_rows(int(pos))
        self._mtp_upto = min(self._mtp_upto, int(pos))
        self._check(lib.oj_draft_tree(self._handle(), rq, toks, par, prob, score, n, steps), "draft tree")
        self._mtp_last = 0                         # the tree's steps: no draft row is read after them
        k = int(n[0])
        return (list(toks[0:k]), list(par[0:k]), list(prob[0:k]), list(score[0:k]), int(steps[0]))

    @_on_engine
    def draft_logits(self, index: int) -> np.ndarray:
        """Draft-head logits of position `index` of the last MTP call (negative: from the end),
        over the draft vocabulary (set_draft_vocab's order) or the whole vocabulary."""
        if index < 0:
            index += getattr(self, "_mtp_last", 1)
        width = self._draft_vocab_len or self.n_vocab
        out = np.empty(width, dtype=np.float32)
        ptr = self._nl.ffi.from_buffer("float[]", out, require_writable=True)
        self._check(self._nl.lib.oj_get_draft_logits(self._handle(), index, ptr, width), "draft logits")
        return out

    @_on_engine
    def draft_hidden(self, index: int) -> np.ndarray:
        out = np.empty(self.config.n_embd, dtype=np.float32)
        ptr = self._nl.ffi.from_buffer("float[]", out, require_writable=True)
        self._check(self._nl.lib.oj_get_draft_hidden(self._handle(), index, ptr, self.config.n_embd),
                    "draft hidden")
        return out

    # --- introspection -------------------------------------------------------------------------
    @_on_engine
    def state(self) -> dict[str, np.ndarray]:
        """Per-conversation state under the numpy reference's names and layouts."""
        ffi, lib = self._nl.ffi, self._nl.lib
        c = self.config
        h = self._handle()
        out: dict[str, np.ndarray] = {}

        def read(fn, shape, *args):
            a = np.empty(shape, dtype=np.float32)
            self._check(fn(h, *args, ffi.from_buffer("float[]", a, require_writable=True), a.size),
                        fn.__name__ if hasattr(fn, "__name__") else "state")
            return a

        for il in c.deltanet_layers():
            out[f"blk.{il}.conv"] = read(lib.oj_read_conv_state, (c.ssm_conv_dim, c.ssm_conv_kernel - 1), il)
            out[f"blk.{il}.ssm"] = read(lib.oj_read_ssm_state, (c.ssm_dt_rank, c.ssm_d_state, c.ssm_d_state), il)
        n_past = self.n_past
        kv_shape = (n_past, c.n_head_kv, c.head_dim)
        for il in c.attention_layers():
            out[f"blk.{il}.k"] = read(lib.oj_read_kv, kv_shape, il, 0, 0, n_past)
            out[f"blk.{il}.v"] = read(lib.oj_read_kv, kv_shape, il, 1, 0, n_past)
        if c.mtp_layer is not None:
            m = ffi.new("int32_t *")
            self._check(lib.oj_mtp_n_past(h, m), "mtp n_past")
            if m[0] > 0:
                shape = (int(m[0]), c.n_head_kv, c.head_dim)
                out["mtp.k"] = read(lib.oj_read_kv, shape, c.mtp_layer, 0, 0, int(m[0]))
                out["mtp.v"] = read(lib.oj_read_kv, shape, c.mtp_layer, 1, 0, int(m[0]))
        return out

    @_on_engine
    def memory(self) -> dict[str, int]:
        rep = self._nl.ffi.new("oj_memory_report *")
        self._check(self._nl.lib.oj_memory(self._handle(), rep), "memory")
        # `prefill` is ABI 3's: a library of an older header reports none
        return {k: int(getattr(rep, k, 0)) for k in MEMORY_FIELDS}

    @_on_engine
    def profile(self, on: bool, host_only: bool = False) -> None:
        """oj_profile: from now, CUDA events at the phase boundaries of every main-model pass and
        its host time (on), only the host time (on, host_only: the pass as it runs unprofiled), or
        neither; each way the totals start from zero (openjet bench's per-phase table)."""
        mode = (2 if host_only else 1) if on else 0
        self._check(self._nl.lib.oj_profile(self._handle(), mode), "profile")

    @_on_engine
    def profile_read(self) -> dict:
        """oj_profile_read: {"passes", "span_ms", "host_ms", "phases": [{"name", "calls",
        "launches", "ms", "bytes"}, ...] in pass order}, summed over the passes since profile() or
        the last read (host_ms: from each pass's start to its last launch enqueued); the totals
        then start from zero."""
        ffi, lib = self._nl.ffi, self._nl.lib
        cap = int(lib.OJ_MAX_PHASES)
        rows = ffi.new("oj_phase[]", cap)
        n, passes = ffi.new("int32_t *"), ffi.new("int32_t *")
        span, host = ffi.new("double *"), ffi.new("double *")
        self._check(lib.oj_profile_read(self._handle(), rows, cap, n, passes, span, host), "profile_read")
        phases = [{"name": ffi.string(r.name).decode(), "calls": int(r.calls), "launches": int(r.launches),
                   "ms": float(r.ms), "bytes": int(r.bytes)} for r in rows[0:n[0]]]
        return {"passes": int(passes[0]), "span_ms": float(span[0]), "host_ms": float(host[0]), "phases": phases}

    @_on_engine
    def graph_stats(self) -> dict | None:
        """oj_graph_stats: {"replayed", "direct", "held", "captures", "capture_ms"}: the main-model
        passes replayed from a captured CUDA graph and launched directly since the engine was made,
        the graphs held, the captures made and their host time (ms); None from a library before
        ABI 14 (every pass launched directly)."""
        ffi, lib = self._nl.ffi, self._nl.lib
        if int(lib.oj_abi_version()) < GRAPH_ABI:
            return None
        replayed, direct, held = ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("int32_t *")
        captures, ms = ffi.new("int64_t *"), ffi.new("double *")
        self._check(lib.oj_graph_stats(self._handle(), replayed, direct, held, captures, ms), "graph_stats")
        return {"replayed": int(replayed[0]), "direct": int(direct[0]), "held": int(held[0]),
                "captures": int(captures[0]), "capture_ms": float(ms[0])}

    @_on_engine
    def debug_fault(self, kind: int) -> None:
        """Test hook (see oj_debug_fault): 1 = illegal address in a kernel, 2 = out of memory."""
        self._check(self._nl.lib.oj_debug_fault(self._handle(), int(kind)), "debug fault")


class NativePasses(PassScheduler):
    """The passes of a multi-sequence native engine; passes.py chooses what goes in each. A pass,
    under the engine's lock: the decode steps (one token each, finishing their work) in
    oj_eval_seqs, MAX_SEQUENCES a call, one read of the weights for all of them; then each prompt
    chunk on its own sequence through its view's eval path (oj_prefill spans, or oj_eval 8
    positions a call), which selects the sequence; a piece the scheduler gives a share of its
    layers (Work.share < 1, passes.py) goes through oj_prefill_layers (prefill_piece), the same
    kernels in the same order as its oj_prefill, so the sequence ends bit for bit as alone. A
    work that asked only for the argmax gets no logits row copied (a sequence whose MTP cache
    follows the main model, a speculating request's, takes its tokens through the eval path, which
    makes their MTP rows). A sequence the engine refuses fails alone: oj_eval_seqs checks every
    sequence before it runs anything, so where it refuses a call of several, each runs again by
    itself."""

    serves = "the native engine"
    thread_name = "openjet-native-pass"
    pieces_in_layers = True

    def __init__(self, shared: _SharedEngine, n_batch: int):
        super().__init__(n_batch, shared.n_seq)
        self._shared = shared
        self.eval_seqs_calls = 0              # oj_eval_seqs calls, and those with several sequences
        self.eval_seqs_shared = 0

    def _run_pass(self, chosen: list[tuple[Work, int]]) -> tuple[list[BaseException | None], float]:
        errors: list[BaseException | None] = [None] * len(chosen)
        # a sequence whose MTP cache follows the main model (a speculating request's prompt) takes
        # even one token through its eval path, which makes the token's MTP row
        steps = [i for i, (w, n) in enumerate(chosen)
                 if n == w.left == 1 and not self._shared.views[w.seq].supports_speculative]
        stepping = set(steps)
        with self._shared.lock:
            # timed inside the lock: a checkpoint copy holding it is not the pass's cost
            t0 = time.perf_counter()
            for k in range(0, len(steps), MAX_SEQUENCES):
                self._decode_steps(chosen, steps[k:k + MAX_SEQUENCES], errors)
            for i, (w, n) in enumerate(chosen):
                if i in stepping:
                    continue
                view = self._shared.views[w.seq]
                try:
                    if w.share < 1 or w.piece:
                        # a piece in layers (_compose): a share of them now, the rest in later passes
                        w.ran = view.prefill_piece(w.tokens[w.done:w.done + n], w.share)
                        w.piece = n if view.piece_in_flight else 0
                        if w.piece:
                            continue
                    else:
                        view._eval_chunks(w.tokens[w.done:w.done + n], prefill_all=self._prefills_whole(w))
                    if n == w.left:
                        if w.want_logits:
                            w.logits = view.logits(view._last_n - 1)
                        else:
                            w.argmax = view.argmax()[-1]
                            if w.argmax in w.rows_for:
                                w.logits = view.logits(view._last_n - 1)
                except Exception as exc:  # noqa: BLE001 - its own caller gets it; the pass goes on
                    if view.piece_in_flight:     # refused part way: the sequence cannot go on
                        try:
                            view._reset()
                        except Exception:  # noqa: BLE001 - the work fails with the first error
                            pass
                    w.piece = 0
                    errors[i] = exc
            seconds = time.perf_counter() - t0
        return errors, seconds

    def _prefills_whole(self, w: Work) -> bool:
        """The work's prompt alone would go through oj_prefill whole (more than PREFILL_MIN_SPAN
        tokens, batched prefill on): its pieces here go through it too, each piece but the last a
        whole number of DeltaNet chunks (_prompt_tokens), so the positions meet the same kernels
        and the same chunk boundaries as alone, and the sequence's state and output are those of
        the request run alone."""
        return self._shared.views[w.seq].batched_prefill and len(w.tokens) > PREFILL_MIN_SPAN

    def _prompt_tokens(self, w: Work, n: int) -> int:
        if not self._prefills_whole(w) or n >= w.left:
            return n
        return min(w.left, max(DELTANET_CHUNK, n - n % DELTANET_CHUNK))

    def _decode_steps(self, chosen: list[tuple[Work, int]], idx: list[int], errors: list) -> None:
        """oj_eval_seqs of the works chosen[i] for i in idx (distinct sequences, one token each);
        their results, or their errors."""
        sh = self._shared
        ffi, lib = sh.nl.ffi, sh.nl.lib
        works = [chosen[i][0] for i in idx]
        seqs = [w.seq for w in works]
        try:
            if sh.handle is None:
                raise NativeEngineError(-1, "the native engine is closed")
            rc = lib.oj_eval_seqs(sh.handle, ffi.new("int32_t[]", seqs),
                                  ffi.new("int32_t[]", [w.tokens[w.done] for w in works]), len(works))
            self.eval_seqs_calls += 1
            self.eval_seqs_shared += len(works) > 1
            status = ffi.typeof("oj_status").relements
            if rc != 0 and len(works) > 1 and rc in (status["OJ_ERR_INVALID_ARGUMENT"], status["OJ_ERR_CONTEXT_FULL"]):
                # refused before anything ran: each alone, so that only the refused one fails
                for i in idx:
                    self._decode_steps(chosen, [i], errors)
                return
            _native.check(sh.nl, rc, sh.handle, f"eval of sequences {seqs}")
            for w in works:
                sh.views[w.seq]._after_shared_pass()
            out = ffi.new("int32_t[]", len(works))
            _native.check(sh.nl, lib.oj_get_argmax(sh.handle, out, len(works)), sh.handle, "argmax")
            for t, w in enumerate(works):
                if not w.want_logits:
                    w.argmax = int(out[t])
                if w.want_logits or w.argmax in w.rows_for:
                    row = np.empty(sh.views[w.seq].n_vocab, dtype=np.float32)
                    rc = lib.oj_get_logits(sh.handle, t, ffi.from_buffer("float[]", row, require_writable=True),
                                           row.size)
                    try:
                        _native.check(sh.nl, rc, sh.handle, "logits")
                    except NativeEngineError as exc:
                        if w.want_logits:
                            raise
                        errors[idx[t]] = exc        # a biased step's row: that work's failure only
                        continue
                    w.logits = row
        except Exception as exc:  # noqa: BLE001 - the works of this call get it
            for i in idx:
                errors[i] = exc
