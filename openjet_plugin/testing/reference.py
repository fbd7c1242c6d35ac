"""A plain numpy forward pass of a `qwen35` GGUF: the oracle for llama.cpp agreement and CUDA kernels.

It follows llama.cpp's graph (`src/models/qwen35.cpp`, `src/models/delta-net-base.cpp`) and ggml's
CPU ops step by step, in float64 by default, with every weight dequantised by `gguf.quants`.
It is slow and simple on purpose: one numpy expression per step of the model, no fusion.

Conventions (all as llama.cpp keeps them; the CUDA engine's state is compared against these):
- A 2-D weight with ggml ne = (n_in, n_out) is the numpy array `[n_out, n_in]`, so `y = x @ W.T`.
- Activations are row-major `[n_tokens, width]`.
- DeltaNet conv state: `[conv_dim, ssm_conv_kernel - 1]`, channel-major, oldest input first
  (ggml's `conv_states` tensor: ne = (kernel-1, conv_dim)).
- DeltaNet recurrent state: `[n_v_heads, d_state (value index j), d_state (key index i)]`,
  i.e. `S[h, j, i]`, the memory order of ggml's `[S_v, S_v, H_v]` state (ne0 = key index). The
  read-out is `o[h] = S[h] @ q[h]`, the update `S[h] += outer(delta[h], k[h])`.
- Value head h uses key head `h % ssm_n_group` (ggml_repeat_4d tiles the key heads; the fused
  gated_delta_net op indexes `iv1 % neq1`).
- Query head h of an attention layer uses KV head `h // (n_head // n_head_kv)` (ggml's broadcast
  in mul_mat and flash attention).
- Attention K and V caches: `[n_positions, n_head_kv, head_dim]`, K after q/k-norm and RoPE.
- MTP: llama.cpp's draft context holds, at MTP position p, the pair (token x_p, main hidden
  h_{p-1}), with h_{-1} = 0 for p = 0 (common/speculative.cpp `process()`), and predicts x_{p+1}
  there. In other words: with h = main hidden at t and the token at t+1, the MTP step sits at
  position t+1 and predicts token t+2. Drafts chain by feeding the MTP block's own normed output
  back as h at the next position (`draft()`: pos0 + i + 1).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import Q4_K, dequantize

from ..config import ARCH, ModelConfig


# --- small ops, each as ggml computes it ------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """ggml_rms_norm over the last axis (x / sqrt(mean(x^2) + eps)), then times weight (build_norm)."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def l2_norm_gdn(x: np.ndarray, eps: float) -> np.ndarray:
    """llama.cpp's build_gdn_l2_norm: rms_norm(x, eps/n) / sqrt(n) = x / sqrt(sum(x^2) + eps)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml's softplus: x above 20, else log(1 + exp(x))."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """x through ggml's Q8_0 (blocks of 32 along the last axis: d = amax/127 stored as fp16,
    q = round(x/d)), back to floats: what llama.cpp's CPU feeds a Q8_0 dot product."""
    b = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.max(np.abs(b), axis=1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.round(b * inv)
    return (q * d.astype(np.float16).astype(np.float32)).reshape(np.shape(x))


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """x through ggml's Q8_K (blocks of 256: scale -127/max of the largest-magnitude value,
    q = min(127, round(x * scale)), d = 1/scale in float32), back to floats."""
    b = np.asarray(x, dtype=np.float32).reshape(-1, 256)
    mx = b[np.arange(len(b)), np.argmax(np.abs(b), axis=1)][:, None]
    iscale = np.divide(np.float32(-127), mx, out=np.zeros_like(mx), where=mx != 0)
    q = np.minimum(127, np.round(b * iscale))
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return (q * d).reshape(np.shape(x))


KV_Q8_0_BLOCK = 32   # values per q8_0 block of a K/V head row


def quantize_kv_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K/V rows `[..., head_dim]` as the native engine stores them with OJ_KV_Q8_0 -> (quants
    int8 `[..., head_dim]`, scales fp16 `[..., head_dim // 32]`), block by block of 32 values:
    d = amax / 127 and q = roundf(x * (1 / d)) (half away from zero), all in float32 as ggml's
    quantize_row_q8_0_ref and native/attention.cu's q8_0_store compute them; d = 0 gives q = 0."""
    a = np.asarray(x, dtype=np.float32)
    if a.ndim == 0 or a.shape[-1] % KV_Q8_0_BLOCK:
        raise ValueError(f"q8_0 KV rows need a last axis that is a multiple of {KV_Q8_0_BLOCK}, got shape {a.shape}")
    b = a.reshape(*a.shape[:-1], a.shape[-1] // KV_Q8_0_BLOCK, KV_Q8_0_BLOCK)
    d = np.max(np.abs(b), axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    y = (b * inv).astype(np.float64)                        # the float32 product, exactly
    q = np.sign(y) * np.floor(np.abs(y) + 0.5)              # roundf; exact in float64
    return q.astype(np.int8).reshape(a.shape), d[..., 0].astype(np.float16)


def dequantize_kv_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Float32 values q * d of quantize_kv_q8_0's output (what the engine's decode reads)."""
    q = np.asarray(q)
    b = q.reshape(*q.shape[:-1], q.shape[-1] // KV_Q8_0_BLOCK, KV_Q8_0_BLOCK).astype(np.float32)
    return (b * np.asarray(d, dtype=np.float16).astype(np.float32)[..., None]).reshape(q.shape)


def round_kv_q8_0(x: np.ndarray, dtype=None) -> np.ndarray:
    """x through the engine's q8_0 KV storage and back (in x's dtype unless dtype is given)."""
    return dequantize_kv_q8_0(*quantize_kv_q8_0(x)).astype(np.asarray(x).dtype if dtype is None else dtype)


# --- int8 activations (the int8 prefill GEMM, OPENJET_PREFILL_GEMM=int8, native/gemm_prefill.cuh) --

ACT_INT8_BLOCK = 32                                  # activation values per scale
ACT_INT8_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")    # weight types whose products round x (launch_any)
_K_QUANT_BYTES = {"Q4_K": 144, "Q5_K": 176}          # block sizes of the types with mins


def quantize_act_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activation rows `[..., K]` as quantize_x_kernel stores them -> (q int8 `[..., K]`, d float32
    `[..., K/32]`, s float32 `[..., K/32]`), per block of 32 values of the float32 activations:
    amax = max |x| (fmaxf: NaN lanes ignored), d = amax / 127 and q = __float2int_rn(x / d) (a
    float32 division, not a product with 1/d; nearest, ties to even, unlike llama.cpp's q8_1
    roundf), q = 0 where amax == 0; s = the block's float32 sum of x, in the warp's butterfly
    order (lane i adds lane i ^ 16, then ^ 8, ^ 4, ^ 2, ^ 1), which the K-quant mins multiply.
    Beyond |x / d| <= 127 (only reachable for subnormal d) the conversion saturates to int32 with
    NaN -> 0 and the store keeps the low byte, as the GPU's cvt.rni.s32.f32 and (int8_t) do."""
    a = np.asarray(x, dtype=np.float32)
    if a.ndim == 0 or a.shape[-1] % ACT_INT8_BLOCK:
        raise ValueError(f"int8 activations need a last axis that is a multiple of {ACT_INT8_BLOCK}, "
                         f"got shape {a.shape}")
    b = a.reshape(*a.shape[:-1], a.shape[-1] // ACT_INT8_BLOCK, ACT_INT8_BLOCK)
    amax = np.fmax.reduce(np.abs(b), axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = np.rint((b / d).astype(np.float64))                 # the float32 quotient, rounded
    r = np.clip(np.nan_to_num(r, nan=0.0, posinf=2.0 ** 31 - 1, neginf=-2.0 ** 31), -2.0 ** 31, 2.0 ** 31 - 1)
    r = np.where(amax == 0, 0.0, r)
    q = r.astype(np.int64).astype(np.int8)                      # low byte, as the kernel's store
    s = b
    with np.errstate(invalid="ignore", over="ignore"):          # inf + -inf as the GPU does it
        while s.shape[-1] > 1:                                  # the butterfly, as lane 0 sees it
            h = s.shape[-1] // 2
            s = s[..., :h] + s[..., h:]
    return q.reshape(a.shape), d[..., 0], s[..., 0]


def dequantize_act_int8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Float64 values q * d of quantize_act_int8's output (exact: 8-bit times 24-bit)."""
    q = np.asarray(q)
    b = q.reshape(*q.shape[:-1], q.shape[-1] // ACT_INT8_BLOCK, ACT_INT8_BLOCK).astype(np.float64)
    return (b * np.asarray(d, dtype=np.float64)[..., None]).reshape(q.shape)


def round_act_int8(x: np.ndarray) -> np.ndarray:
    """x through the engine's int8 activation rounding and back, in float64."""
    q, d, _ = quantize_act_int8(x)
    return dequantize_act_int8(q, d)


# --- the native engine's fp16 activations (its decode matvecs, native/matvec_f16.cuh) ---------

ACT_F16_BLOCK = 256                  # activation values per power-of-two scale (a K-quant super-block)
ACT_F16_TYPES = ("Q4_K", "Q6_K")     # weight types launch_any sends to matvec_f16 (mvf16::supports)
ACT_F16_TOP_EXP = 15                 # max |x| * 2^e lands in [2^14, 2^15)
ACT_F16_EXP_LIMIT = 126              # |e| <= 126 keeps 2^-e a normal float32
ACT_F16_AMAX_LIMIT = np.float32(3.0e38)   # prep_kernel scales only 0 < amax <= 3.0e38f (else e = 0)


def act_f16_exponents(x: np.ndarray) -> np.ndarray:
    """The power-of-two exponents e (int64 `[..., K/256]`) that matvec_f16's prep_kernel picks
    for activation rows `[..., K]` (float32, as the engine holds them), per 256-value super-block:
    amax = max |x| (fmaxf: NaN lanes ignored); e = clamp(15 - frexp exponent of amax, -126, 126)
    so that amax * 2^e lies in [2^14, 2^15); e = 0 where amax is 0, infinite or above 3.0e38f."""
    a = np.asarray(x, dtype=np.float32)
    if a.ndim == 0 or a.shape[-1] % ACT_F16_BLOCK:
        raise ValueError(f"fp16 activations need a last axis that is a multiple of {ACT_F16_BLOCK}, "
                         f"got shape {a.shape}")
    b = a.reshape(*a.shape[:-1], a.shape[-1] // ACT_F16_BLOCK, ACT_F16_BLOCK)
    amax = np.fmax.reduce(np.abs(b), axis=-1)
    scaled = (amax > 0) & (amax <= ACT_F16_AMAX_LIMIT)
    _, ex = np.frexp(np.where(scaled, amax, np.float32(1)))
    e = np.clip(ACT_F16_TOP_EXP - ex.astype(np.int64), -ACT_F16_EXP_LIMIT, ACT_F16_EXP_LIMIT)
    return np.where(scaled, e, 0)


def round_act_f16(x: np.ndarray) -> np.ndarray:
    """x through the engine's fp16 activation rounding and back, in float64: per super-block,
    the float32 x times 2^e (float32), rounded to fp16 (nearest, ties to even, as
    __float2half_rn), times 2^-e (exact in float64)."""
    a = np.asarray(x, dtype=np.float32)
    e = act_f16_exponents(a)
    b = a.reshape(*a.shape[:-1], a.shape[-1] // ACT_F16_BLOCK, ACT_F16_BLOCK)
    scale = np.ldexp(np.float32(1), e).astype(np.float32)[..., None]   # 2^e, a normal float32
    with np.errstate(over="ignore", invalid="ignore"):                 # inf / NaN, as the GPU
        h = (b * scale).astype(np.float16)
    return np.ldexp(h.astype(np.float64), -e[..., None]).reshape(a.shape)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (nearest, ties to even, as ggml's fp32_to_bf16), back to float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _f16(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(dtype)


# The form in which llama.cpp's CPU backend hands a matrix product's input to the dot product,
# by weight type (ggml-cpu's vec_dot_type).
CPU_MATMUL_INPUT = {
    "F32": None,
    "F16": lambda x: np.asarray(x, dtype=np.float16).astype(np.float32),
    "BF16": round_bf16,
    "Q8_0": quantize_q8_0,
    "Q4_K": quantize_q8_k,
    "Q5_K": quantize_q8_k,
    "Q6_K": quantize_q8_k,
}


def imrope_angles(positions: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Rotation angles `[n_tokens, n_rot // 2]` of ggml_rope_multi with GGML_ROPE_TYPE_IMROPE.

    qwen35's rope type is IMROPE (llama_model_rope_type). For text tokens llama.cpp feeds the
    position as the t, h and w coordinates and 0 as the fourth (llm_graph_input_pos::set_input).
    Pair i takes its coordinate from the interleaved sector rule of ggml_mrope_cache_init and its
    frequency freq_base^(-2i/n_rot).
    """
    s = cfg.rope_sections
    sect_dims = sum(s)
    if sect_dims <= 0:
        raise ValueError(f"rope.dimension_sections {s} are all zero; qwen35 needs M-RoPE sections")
    n_pairs = cfg.n_rot // 2
    pos = np.asarray(positions, dtype=np.float64)
    coords = {"t": pos, "h": pos, "w": pos, "e": np.zeros_like(pos)}
    theta_scale = cfg.rope_freq_base ** (-2.0 / cfg.n_rot)
    out = np.empty((len(pos), n_pairs), dtype=np.float64)
    for i in range(n_pairs):
        sector = i % sect_dims
        if sector % 3 == 1 and sector < 3 * s[1]:
            c = "h"
        elif sector % 3 == 2 and sector < 3 * s[2]:
            c = "w"
        elif sector % 3 == 0 and sector < 3 * s[0]:
            c = "t"
        else:
            c = "e"
        out[:, i] = coords[c] * theta_scale ** i
    return out


def apply_rope(x: np.ndarray, angles: np.ndarray, n_rot: int) -> np.ndarray:
    """NEOX-ordered rotation (pairs (i, i + n_rot/2)) of the first n_rot dims; x is [n, heads, dim]."""
    half = n_rot // 2
    cos = np.cos(angles).astype(x.dtype)[:, None, :]
    sin = np.sin(angles).astype(x.dtype)[:, None, :]
    x0 = x[..., :half]
    x1 = x[..., half:n_rot]
    out = x.copy()
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:n_rot] = x0 * sin + x1 * cos
    return out


class _KVCache:
    """K and V rows `[n, n_head_kv, head_dim]` with the position of each row."""

    def __init__(self, n_head_kv: int, head_dim: int, dtype):
        self.k = np.zeros((0, n_head_kv, head_dim), dtype=dtype)
        self.v = np.zeros((0, n_head_kv, head_dim), dtype=dtype)
        self.pos = np.zeros((0,), dtype=np.int64)

    def append(self, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        self.k = np.concatenate([self.k, k])
        self.v = np.concatenate([self.v, v])
        self.pos = np.concatenate([self.pos, np.asarray(pos, dtype=np.int64)])

    def remove_from(self, p0: int) -> None:
        """Drop every row at position >= p0 (llama_memory_seq_rm(seq, p0, -1))."""
        keep = self.pos < p0
        self.k, self.v, self.pos = self.k[keep], self.v[keep], self.pos[keep]

    def prefix(self, p0: int, rows=()) -> "_KVCache":
        """A new cache: this one's rows at positions < p0, then `rows` ((k, v) pairs of one row
        each) at positions p0, p0 + 1, ..: what a draft-tree node sees of its own branch."""
        out = _KVCache.__new__(_KVCache)
        keep = self.pos < p0
        out.k = np.concatenate([self.k[keep]] + [k for k, _ in rows])
        out.v = np.concatenate([self.v[keep]] + [v for _, v in rows])
        out.pos = np.concatenate([self.pos[keep], np.arange(p0, p0 + len(rows), dtype=np.int64)])
        return out


class _TreeEval:
    """What `forward_tree` keeps for `commit_tree`: per node its position and hidden, per DeltaNet
    layer the conv and recurrent state after each node, per attention layer each node's K/V row."""

    def __init__(self, n_past, tokens, parent, positions, hidden, conv, ssm, kv):
        self.n_past, self.tokens, self.parent, self.positions = n_past, tokens, parent, positions
        self.hidden, self.conv, self.ssm, self.kv = hidden, conv, ssm, kv


# --- the model -----------------------------------------------------------------------------

class ReferenceModel:
    """numpy forward pass of a qwen35 GGUF, with incremental state like llama.cpp's contexts.

    - `logits(tokens)`: reset, then teacher-forced logits `[n, n_vocab]`.
    - `step(token)`: one more position, logits `[n_vocab]`.
    - `hidden`: `[n_past, n_embd]`, row t = the final hidden state after output_norm at position t.
    - `mtp_logits(h, next_token, pos=None)`: one MTP step -> (logits, h_mtp); `mtp_prefill()` runs
      it over the main positions seen so far as llama.cpp's draft context does; `mtp_reset()`.
    - `state()`: every piece of per-conversation state, by name (see `state`).
    - `forward_tree(tokens, parent)` / `commit_tree(path)`: a draft tree evaluated in one call
      (tree attention mask, DeltaNet from each node's parent state), then one path kept;
      `mtp_branch(h, token, pos, path)`: an MTP step of a tree node on its own branch.
    """

    def __init__(self, path: str | Path, dtype=np.float64, llama_cpu_rounding: bool = False,
                 kv_q8_0: bool = False, act_int8: bool = False, act_f16: bool = False):
        """`llama_cpu_rounding=True` adds the roundings of llama.cpp's CPU backend with its default
        context: every matrix product's input in the weight's `vec_dot_type` (Q8_0 blocks for
        Q8_0 weights, Q8_K for K-quants, F16 / BF16 for F16 / BF16; `CPU_MATMUL_INPUT`), and
        attention through an F16 KV cache (K and V stored as F16, q and the softmax weights
        rounded to F16 for the two products). Off by default: the reference computes the
        model's own math on the dequantised weights. On, each layer matches llama.cpp's CPU to
        float32 rounding, which is how the per-layer test checks the reference on quantised files.

        `kv_q8_0=True` stores every appended K and V row (main layers and the MTP block) as the
        native engine does with OJ_KV_Q8_0 (`round_kv_q8_0`: per 32 values, fp16 scale amax/127,
        int8 roundf) and attends over the dequantised values; q and the softmax stay unrounded
        (with llama_cpu_rounding, this replaces its F16 rounding of K and V).

        `act_int8=True` models the int8 prefill GEMM (OPENJET_PREFILL_GEMM=int8): every product with a
        Q4_K / Q5_K / Q6_K / Q8_0 weight (main layers, output head, MTP block) takes its input rows
        through `quantize_act_int8` (per 32 values, float32 d = amax/127, int8 q) and multiplies the
        dequantised weights by q * d in the reference's dtype; for Q4_K / Q5_K the mins multiply the
        block's float32 sum of the unrounded x instead, as the engine's kernels do. F32 / F16 /
        BF16 weights and the embedding lookups are unchanged. Not combinable with
        llama_cpu_rounding (another engine's roundings).

        `act_f16=True` models the native engine's decode matvecs (native/matvec_f16.cuh):
        every product with a Q4_K / Q6_K weight (main layers, output head, MTP block; K a multiple
        of 256) takes its input rows through `round_act_f16` (per 256-value super-block a
        power-of-two scale, fp16 round-to-nearest-even, undone exactly) and multiplies the
        dequantised weights in the reference's dtype; for Q4_K the mins multiply the sub-block sums
        of the unrounded x, which the engine carries as an fp16 hi + lo pair (effectively exact).
        Every other weight type keeps the engine's bf16-split path, ~float32: unchanged here. Not
        combinable with act_int8 or llama_cpu_rounding (other engines' roundings).
        """
        self.path = Path(path)
        if llama_cpu_rounding and act_int8:
            raise ValueError("llama_cpu_rounding and act_int8 model different engines; choose one")
        if act_f16 and act_int8:
            raise ValueError("act_f16 and act_int8 model different roundings (the decode matvecs, the int8 prefill GEMM); choose one")
        if act_f16 and llama_cpu_rounding:
            raise ValueError("llama_cpu_rounding and act_f16 model different engines; choose one")
        self.llama_cpu_rounding = llama_cpu_rounding
        self.kv_q8_0 = kv_q8_0
        self.act_int8 = act_int8
        self.act_f16 = act_f16
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF model file not found: {self.path}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ValueError(f"dtype must be float64 or float32, got {self.dtype}")
        self._reader = GGUFReader(str(self.path))
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self._field("general.architecture")
        if arch != ARCH:
            raise ValueError(f"{self.path}: general.architecture is {arch!r}, expected {ARCH!r}")
        if "token_embd.weight" not in self._tensors:
            raise KeyError(f"{self.path}: tensor 'token_embd.weight' is missing")
        n_vocab = int(self._tensors["token_embd.weight"].shape[1])
        self.config = ModelConfig.from_gguf_metadata(self._field, n_vocab)
        self.n_vocab = n_vocab
        self._weights: dict[str, np.ndarray] = {}
        self._mins: dict[str, np.ndarray] = {}
        self.reset()
        self.mtp_reset()

    # -- file access --
    def _field(self, key: str):
        f = self._reader.fields.get(key)
        if f is None:
            raise KeyError(f"{self.path}: metadata key {key!r} is missing")
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            return list(f.contents())
        return f.contents()

    def has(self, name: str) -> bool:
        return name in self._tensors

    def weight(self, name: str) -> np.ndarray:
        """Dequantised tensor in numpy order (reversed ne), cached after the first use."""
        w = self._weights.get(name)
        if w is None:
            t = self._tensors.get(name)
            if t is None:
                raise KeyError(f"{self.path}: tensor {name!r} is missing")
            shape = tuple(int(n) for n in reversed(t.shape))
            try:
                data = dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ValueError(f"{self.path}: tensor {name!r} has type {t.tensor_type.name}, "
                                 f"which gguf.quants cannot dequantise") from e
            w = np.ascontiguousarray(data.reshape(shape), dtype=self.dtype)
            self._weights[name] = w
        return w

    def tensor_type(self, name: str) -> str:
        t = self._tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path}: tensor {name!r} is missing")
        return t.tensor_type.name

    def _mm(self, x: np.ndarray, name: str) -> np.ndarray:
        if self.llama_cpu_rounding:
            kind = self.tensor_type(name)
            if kind not in CPU_MATMUL_INPUT:
                raise ValueError(f"{self.path}: tensor {name!r} has type {kind}, for which the "
                                 f"CPU input rounding is not modelled")
            rounding = CPU_MATMUL_INPUT[kind]
            if rounding is not None:
                x = rounding(x).astype(self.dtype)
        elif self.act_int8 and self.tensor_type(name) in ACT_INT8_TYPES:
            return self._mm_act_int8(x, name)
        elif self.act_f16 and self.tensor_type(name) in ACT_F16_TYPES:
            return self._mm_act_f16(x, name)
        return x @ self.weight(name).T

    def _mm_act_f16(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T as matvec_f16 computes it: W (= scale part - mins) times the fp16-rounded x,
        and for Q4_K the mins times the exact sub-block sums instead of the rounded ones:
        W @ xr + mins @ (sum_b xr - sum_b x)."""
        w = self.weight(name)
        if w.shape[1] % ACT_F16_BLOCK:   # launch_any refuses such a K-quant matrix outright
            raise ValueError(f"{self.path}: tensor {name!r} has {w.shape[1]} input columns, not a multiple "
                             f"of {ACT_F16_BLOCK} (the fp16 activation super-block)")
        xr = round_act_f16(x)
        y = xr.astype(self.dtype) @ w.T
        mins = self._block_mins(name)
        if mins is not None:
            exact = np.asarray(x, dtype=np.float32).astype(np.float64)
            diff = (xr - exact).reshape(*xr.shape[:-1], mins.shape[1], -1).sum(axis=-1)   # per 32-value sub-block
            y = y + (diff.astype(self.dtype) @ mins.T)
        return y

    def _mm_act_int8(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T as the engine's int8 kernels compute it: W (= scale part - mins) times the
        rounded x, and for Q4_K / Q5_K the mins times the exact block sums instead of the rounded
        ones: W @ xr + mins @ (sum_b xr - s_b)."""
        w = self.weight(name)
        if w.shape[1] % ACT_INT8_BLOCK:
            raise ValueError(f"{self.path}: tensor {name!r} has {w.shape[1]} input columns, not a multiple "
                             f"of {ACT_INT8_BLOCK} (the int8 activation block)")
        q, d, s = quantize_act_int8(x)
        xr = dequantize_act_int8(q, d)
        y = xr.astype(self.dtype) @ w.T
        mins = self._block_mins(name)
        if mins is not None:
            rounded_sum = xr.reshape(*xr.shape[:-1], -1, ACT_INT8_BLOCK).sum(axis=-1)
            y = y + ((rounded_sum - s).astype(self.dtype) @ mins.T)
        return y

    def _block_mins(self, name: str) -> np.ndarray | None:
        """dmin * m of every 32-value sub-block `[n_out, K/32]` of a Q4_K / Q5_K weight (what
        gguf.quants subtracts; ggml's get_scale_min_k4), else None; cached."""
        kind = self.tensor_type(name)
        if kind not in _K_QUANT_BYTES:
            return None
        m = self._mins.get(name)
        if m is None:
            t = self._tensors[name]
            blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, _K_QUANT_BYTES[kind])
            dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)   # [n_blocks, 1]
            _, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())                  # Q5_K packs them alike
            n_out = int(t.shape[1])
            m = np.ascontiguousarray((dmin * mn.astype(np.float64)).reshape(n_out, -1), dtype=self.dtype)
            self._mins[name] = m
        return m

    # -- state --
    def reset(self) -> None:
        """Forget the conversation: zero conv and recurrent states, empty KV caches."""
        c = self.config
        self.n_past = 0
        self.tokens: list[int] = []
        self.hidden = np.zeros((0, c.n_embd), dtype=self.dtype)
        self._tree: _TreeEval | None = None
        self._conv: dict[int, np.ndarray] = {}
        self._ssm: dict[int, np.ndarray] = {}
        self._kv: dict[int, _KVCache] = {}
        for il in c.deltanet_layers():
            self._conv[il] = np.zeros((c.ssm_conv_dim, c.ssm_conv_kernel - 1), dtype=self.dtype)
            self._ssm[il] = np.zeros((c.ssm_dt_rank, c.ssm_d_state, c.ssm_d_state), dtype=self.dtype)
        for il in c.attention_layers():
            self._kv[il] = _KVCache(c.n_head_kv, c.head_dim, self.dtype)

    def mtp_reset(self) -> None:
        c = self.config
        self._mtp_kv = _KVCache(c.n_head_kv, c.head_dim, self.dtype)

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the per-conversation state, by name.

        `blk.{il}.conv` `[conv_dim, kernel-1]` and `blk.{il}.ssm` `[H_v, S_v(j), S_k(i)]` per
        DeltaNet layer; `blk.{il}.k` / `blk.{il}.v` `[n_past, n_head_kv, head_dim]` per attention
        layer; `mtp.k` / `mtp.v` / `mtp.pos` for the MTP block's own cache.
        """
        out: dict[str, np.ndarray] = {}
        for il, s in self._conv.items():
            out[f"blk.{il}.conv"] = s.copy()
        for il, s in self._ssm.items():
            out[f"blk.{il}.ssm"] = s.copy()
        for il, kv in self._kv.items():
            out[f"blk.{il}.k"] = kv.k.copy()
            out[f"blk.{il}.v"] = kv.v.copy()
        out["mtp.k"] = self._mtp_kv.k.copy()
        out["mtp.v"] = self._mtp_kv.v.copy()
        out["mtp.pos"] = self._mtp_kv.pos.copy()
        return out

    # -- public forward --
    def logits(self, tokens) -> np.ndarray:
        """Teacher-forced logits `[n, n_vocab]` from a fresh state (the state is kept afterwards)."""
        self.reset()
        return self.forward(tokens)

    def step(self, token: int) -> np.ndarray:
        """Logits `[n_vocab]` for one more token at position n_past."""
        return self.forward([token])[0]

    def forward(self, tokens) -> np.ndarray:
        """Process tokens at positions n_past.. (one llama.cpp ubatch); logits `[n, n_vocab]`."""
        tokens = self._check_tokens(tokens)
        c = self.config
        n = len(tokens)
        self._tree = None
        positions = np.arange(self.n_past, self.n_past + n)
        x = self.weight("token_embd.weight")[tokens]
        for il in range(c.n_layer):
            x = self.layer(il, x, positions)
        h = rms_norm(x, self.weight("output_norm.weight"), c.rms_eps)
        self.hidden = np.concatenate([self.hidden, h])
        self.tokens.extend(int(t) for t in tokens)
        self.n_past += n
        return self.head(h)

    def forward_tree(self, tokens, parent) -> tuple[np.ndarray, np.ndarray]:
        """Evaluate a draft tree provisionally -> (logits `[n, n_vocab]`, hidden `[n, n_embd]`),
        row i for node i (its logits predict the token after node i on its path).

        The layout is speculative_tree's: node 0 is the current token at position n_past (parent
        -1); node i > 0 is a child of parent[i] < i and sits at n_past + its depth. Node i sees
        what decoding its path one token at a time would: every attention layer attends over the
        committed positions and node i's ancestors and itself (the tree mask
        `tree_ancestors(parent)`), every DeltaNet layer runs its conv and recurrence from
        parent[i]'s state (the root from the committed state). The committed state is unchanged
        until `commit_tree(path)` keeps one path.

        The nodes go through the layers together, layer by layer as one pass would, but each
        node's row on its own: a product of one row is what a one-token step computes, while
        OpenBLAS's rows of a many-row product differ from it in the last bits. So each node's
        logits, hidden and state equal those of one-token-at-a-time decoding of its path, bit for
        bit, which is the invariant a commit relies on.
        """
        from ..speculative_tree import check_tree_parents, tree_ancestors

        tokens = self._check_tokens(tokens)
        c = self.config
        n = len(tokens)
        parent = check_tree_parents(parent, n)
        seen = tree_ancestors(parent)
        depth = seen.sum(axis=1) - 1
        positions = (self.n_past + depth).astype(np.int64)
        emb = self.weight("token_embd.weight")
        xs = [emb[tokens[i:i + 1]] for i in range(n)]
        conv: dict[int, list] = {}
        ssm: dict[int, list] = {}
        kv: dict[int, list] = {}
        for il in range(c.n_layer):
            if c.is_recurrent(il):
                cs, ss = [None] * n, [None] * n
                for i in range(n):
                    c0 = self._conv[il] if parent[i] < 0 else cs[parent[i]]
                    s0 = self._ssm[il] if parent[i] < 0 else ss[parent[i]]

                    def mixer(cur, i=i, c0=c0, s0=s0):
                        out, cs[i], ss[i] = self._deltanet_from(il, cur, c0, s0)
                        return out
                    xs[i] = self._block(il, xs[i], mixer)
                conv[il], ssm[il] = cs, ss
            else:
                rows: list = [None] * n
                for i in range(n):
                    # the committed rows, then the ancestors' (positions n_past .. n_past + depth - 1)
                    view = self._kv[il].prefix(self.n_past, [rows[j] for j in np.flatnonzero(seen[i]) if j != i])

                    def mixer(cur, i=i, view=view):
                        out = self._attention(il, cur, positions[i:i + 1], view)
                        rows[i] = (view.k[-1:], view.v[-1:])
                        return out
                    xs[i] = self._block(il, xs[i], mixer)
                kv[il] = rows
        hs = [rms_norm(x, self.weight("output_norm.weight"), c.rms_eps) for x in xs]
        logits = np.concatenate([self.head(h) for h in hs])
        hidden = np.concatenate(hs)
        self._tree = _TreeEval(self.n_past, tokens, parent, positions, hidden, conv, ssm, kv)
        return logits, hidden

    def commit_tree(self, path) -> None:
        """Keep the nodes of `path` (node 0, then each a child of the one before) from the last
        `forward_tree` as positions n_past..: the DeltaNet layers take the last node's state, the
        attention layers the path's K/V rows; everything else of the tree is dropped."""
        t = self._tree
        if t is None or t.n_past != self.n_past:
            raise RuntimeError("commit_tree needs a forward_tree at the current position first")
        path = [int(i) for i in path]
        if not path or path[0] != 0:
            raise ValueError(f"a committed path starts at the root (node 0), got {path}")
        for a, b in zip(path, path[1:]):
            if not 0 < b < len(t.tokens) or t.parent[b] != a:
                raise ValueError(f"node {b} is not a child of node {a}: {path} is not a path of the tree")
        last = path[-1]
        for il in t.conv:
            self._conv[il], self._ssm[il] = t.conv[il][last], t.ssm[il][last]
        for il, rows in t.kv.items():
            for i in path:
                self._kv[il].append(rows[i][0], rows[i][1], t.positions[i:i + 1])
        self.hidden = np.concatenate([self.hidden, t.hidden[path]])
        self.tokens.extend(int(t.tokens[i]) for i in path)
        self.n_past += len(path)
        self._tree = None

    def layer(self, il: int, x: np.ndarray, positions) -> np.ndarray:
        """Main layer il on its input x `[n, n_embd]` at positions; updates that layer's state.

        Public so that a test can feed llama.cpp's own layer input and compare one layer at a time.
        """
        c = self.config
        if not 0 <= il < c.n_layer:
            raise ValueError(f"layer {il} is not a main layer (0..{c.n_layer - 1})")
        positions = np.asarray(positions, dtype=np.int64)
        if c.is_recurrent(il):
            return self._block(il, x, lambda cur: self._deltanet(il, cur))
        return self._block(il, x, lambda cur: self._attention(il, cur, positions, self._kv[il]))

    def _block(self, il: int, x: np.ndarray, mixer) -> np.ndarray:
        """Main layer il around its token mixer (`mixer(normed x)`: DeltaNet or attention)."""
        c = self.config
        p = f"blk.{il}."
        x = x + mixer(rms_norm(x, self.weight(p + "attn_norm.weight"), c.rms_eps))
        return x + self._ffn(il, rms_norm(x, self.weight(p + "post_attention_norm.weight"), c.rms_eps))

    def head(self, h: np.ndarray) -> np.ndarray:
        """Logits from hidden states after output_norm."""
        return self._mm(h, self._output_name())

    def _output_name(self) -> str:
        return "output.weight" if self.has("output.weight") else "token_embd.weight"

    def _check_tokens(self, tokens) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if t.size == 0:
            raise ValueError("tokens is empty")
        bad = t[(t < 0) | (t >= self.n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.n_vocab})")
        return t

    # -- blocks --
    def _ffn(self, il: int, x: np.ndarray) -> np.ndarray:
        """SwiGLU (LLM_FFN_SILU, LLM_FFN_PAR): down(silu(gate x) * up x)."""
        p = f"blk.{il}."
        return self._mm(silu(self._mm(x, p + "ffn_gate.weight")) * self._mm(x, p + "ffn_up.weight"),
                        p + "ffn_down.weight")

    def _attention(self, il: int, x: np.ndarray, positions: np.ndarray, cache: _KVCache) -> np.ndarray:
        """Gated attention of qwen35 (build_layer_attn, and the MTP graph's copy of it)."""
        c = self.config
        p = f"blk.{il}."
        n, D, H, Hkv = len(x), c.head_dim, c.n_head, c.n_head_kv
        # attn_q emits, per head, [query(D), gate(D)] (the ggml_view_3d strides of 2*D per head)
        qg = self._mm(x, p + "attn_q.weight").reshape(n, H, 2 * D)
        q = qg[:, :, :D]
        gate = qg[:, :, D:].reshape(n, H * D)
        k = self._mm(x, p + "attn_k.weight").reshape(n, Hkv, D)
        v = self._mm(x, p + "attn_v.weight").reshape(n, Hkv, D)
        q = rms_norm(q, self.weight(p + "attn_q_norm.weight"), c.rms_eps)
        k = rms_norm(k, self.weight(p + "attn_k_norm.weight"), c.rms_eps)
        ang = imrope_angles(positions, c)
        q = apply_rope(q, ang, c.n_rot)
        k = apply_rope(k, ang, c.n_rot)
        if self.llama_cpu_rounding:
            q = _f16(q, self.dtype)
            if not self.kv_q8_0:
                k, v = _f16(k, self.dtype), _f16(v, self.dtype)
        if self.kv_q8_0:
            k, v = round_kv_q8_0(k, self.dtype), round_kv_q8_0(v, self.dtype)
        cache.append(k, v, positions)

        group = H // Hkv
        kv_head = np.arange(H) // group
        K = cache.k[:, kv_head, :]                      # [m, H, D]
        V = cache.v[:, kv_head, :]
        scores = np.einsum("nhd,mhd->hnm", q, K) / math.sqrt(D)
        visible = cache.pos[None, :] <= positions[:, None]   # causal mask by position
        scores = np.where(visible[None], scores, -np.inf)
        att = softmax(scores, axis=-1)
        if self.llama_cpu_rounding:
            att = _f16(att, self.dtype)
        out = np.einsum("hnm,mhd->nhd", att, V).reshape(n, H * D)
        out = out * sigmoid(gate)
        return self._mm(out, p + "attn_output.weight")

    def _deltanet(self, il: int, x: np.ndarray) -> np.ndarray:
        """Gated DeltaNet (build_layer_attn_linear) over n tokens, updating conv and recurrent state."""
        out, self._conv[il], self._ssm[il] = self._deltanet_from(il, x, self._conv[il], self._ssm[il])
        return out

    def _deltanet_from(self, il: int, x: np.ndarray, conv_state: np.ndarray,
                       ssm_state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Gated DeltaNet of layer il over n tokens from the given conv and recurrent state ->
        (output, conv state, recurrent state after the last token); the inputs are not changed
        (a draft tree's siblings start from one parent state)."""
        c = self.config
        p = f"blk.{il}."
        n = len(x)
        S, Hk, Hv = c.ssm_d_state, c.ssm_n_group, c.ssm_dt_rank
        key_dim = c.ssm_key_dim

        qkv = self._mm(x, p + "attn_qkv.weight")                          # [n, conv_dim]
        z = self._mm(x, p + "attn_gate.weight").reshape(n, Hv, S)
        beta = sigmoid(self._mm(x, p + "ssm_beta.weight"))                # [n, Hv]
        alpha = self._mm(x, p + "ssm_alpha.weight") + self.weight(p + "ssm_dt.bias")
        g = softplus(alpha) * self.weight(p + "ssm_a")                    # [n, Hv], <= 0
        decay = np.exp(g)

        # causal depthwise conv (ggml_ssm_conv) over [state | new inputs] along time
        w = self.weight(p + "ssm_conv1d.weight")                          # [conv_dim, kernel]
        kernel = w.shape[1]
        conv_in = np.concatenate([conv_state.T, qkv])                     # [kernel-1+n, conv_dim]
        conv = np.zeros_like(qkv)
        for i in range(kernel):
            conv += conv_in[i:i + n] * w[:, i]
        conv_state = np.ascontiguousarray(conv_in[n:].T)                  # last kernel-1 inputs
        conv = silu(conv)

        q = conv[:, :key_dim].reshape(n, Hk, S)
        k = conv[:, key_dim:2 * key_dim].reshape(n, Hk, S)
        v = conv[:, 2 * key_dim:].reshape(n, Hv, S)
        q = l2_norm_gdn(q, c.rms_eps) / math.sqrt(S)
        k = l2_norm_gdn(k, c.rms_eps)
        key_head = np.arange(Hv) % Hk                                     # tiled (ggml_repeat_4d)
        q = q[:, key_head]
        k = k[:, key_head]

        state = ssm_state                                                 # [Hv, S(j), S(i)]
        out = np.empty((n, Hv, S), dtype=self.dtype)
        for t in range(n):
            state = state * decay[t][:, None, None]
            kt = k[t]
            sk = np.einsum("hji,hi->hj", state, kt)
            delta = (v[t] - sk) * beta[t][:, None]
            state = state + delta[:, :, None] * kt[:, None, :]
            out[t] = np.einsum("hji,hi->hj", state, q[t])

        out = rms_norm(out, self.weight(p + "ssm_norm.weight"), c.rms_eps) * silu(z)
        return self._mm(out.reshape(n, Hv * S), p + "ssm_out.weight"), conv_state, state

    # -- MTP --
    def mtp_logits(self, h: np.ndarray, next_token: int, pos: int | None = None):
        """One step of the MTP block -> (logits `[n_vocab]`, h_mtp `[n_embd]`).

        `h` is the main model's hidden state (after output_norm) at position t and `next_token`
        the token at t+1; the step sits at MTP position `pos` = t+1 and predicts token t+2.
        `pos` defaults to one past the newest row of the MTP cache; rows at positions >= pos are
        dropped first (a rollback, like llama_memory_seq_rm). Chain drafts by passing the returned
        h_mtp as the next h.
        """
        c = self.config
        il = c.mtp_layer
        if il is None:
            raise ValueError(f"{self.path}: model has no MTP block (nextn_predict_layers = 0)")
        tok = int(self._check_tokens([next_token])[0])
        h = np.asarray(h, dtype=self.dtype).reshape(-1)
        if h.shape != (c.n_embd,):
            raise ValueError(f"h must have {c.n_embd} values, got {h.shape}")
        if pos is None:
            pos = int(self._mtp_kv.pos.max()) + 1 if len(self._mtp_kv.pos) else 0
        self._mtp_kv.remove_from(pos)
        return self._mtp_block(h, tok, pos, self._mtp_kv)

    def mtp_branch(self, h: np.ndarray, next_token: int, pos: int, path: list[tuple[np.ndarray, np.ndarray]]):
        """One MTP step of a draft-tree node -> (logits `[n_vocab]`, h_mtp `[n_embd]`, its row).

        The node sits at MTP position `pos`; `path` holds the MTP cache rows `(k, v)` (each
        `[1, n_head_kv, head_dim]`, as this method returns them) of its ancestors at positions
        pos - len(path) .. pos - 1, oldest first. Its attention sees the MTP cache's rows before
        pos - len(path), then `path`, then its own row; the MTP cache itself is not changed (a
        sibling's rows never reach another branch). With the rows of the steps before it, a
        chain of branch steps computes exactly what `mtp_logits` steps compute.
        """
        c = self.config
        if c.mtp_layer is None:
            raise ValueError(f"{self.path}: model has no MTP block (nextn_predict_layers = 0)")
        tok = int(self._check_tokens([next_token])[0])
        h = np.asarray(h, dtype=self.dtype).reshape(-1)
        if h.shape != (c.n_embd,):
            raise ValueError(f"h must have {c.n_embd} values, got {h.shape}")
        base = int(pos) - len(path)
        if base < 0:
            raise ValueError(f"an MTP step at position {pos} cannot have {len(path)} ancestor rows")
        view = self._mtp_kv.prefix(base, path)
        logits, hm = self._mtp_block(h, tok, int(pos), view)
        return logits, hm, (view.k[-1:].copy(), view.v[-1:].copy())

    def _mtp_block(self, h: np.ndarray, tok: int, pos: int, cache: "_KVCache"):
        """The MTP block at position pos on (token tok, hidden h), attending over `cache` (which
        gets its K/V row) -> (logits `[n_vocab]`, h_mtp `[n_embd]`)."""
        c = self.config
        il = c.mtp_layer
        p = f"blk.{il}."
        emb_name = p + "nextn.embed_tokens.weight"
        e = self.weight(emb_name if self.has(emb_name) else "token_embd.weight")[tok]
        cat = np.concatenate([rms_norm(e, self.weight(p + "nextn.enorm.weight"), c.rms_eps),
                              rms_norm(h, self.weight(p + "nextn.hnorm.weight"), c.rms_eps)])
        x = self._mm(cat[None], p + "nextn.eh_proj.weight")                 # [1, n_embd]
        cur = rms_norm(x, self.weight(p + "attn_norm.weight"), c.rms_eps)
        x = x + self._attention(il, cur, np.array([pos]), cache)
        x = x + self._ffn(il, rms_norm(x, self.weight(p + "post_attention_norm.weight"), c.rms_eps))
        norm_name = p + "nextn.shared_head_norm.weight"
        hm = rms_norm(x, self.weight(norm_name if self.has(norm_name) else "output_norm.weight"),
                      c.rms_eps)
        head_name = p + "nextn.shared_head_head.weight"
        logits = self._mm(hm, head_name if self.has(head_name) else self._output_name())
        return logits[0], hm[0]

    def mtp_prefill(self) -> np.ndarray:
        """Bring the MTP cache up to the main positions, pairing as llama.cpp's process() does.

        Position p gets (token p, hidden p-1), with a zero hidden for p = 0. Returns the MTP
        logits of those positions `[n, n_vocab]`; the row for position p predicts token p+1.
        """
        start = int(self._mtp_kv.pos.max()) + 1 if len(self._mtp_kv.pos) else 0
        rows = []
        for p in range(start, self.n_past):
            h = self.hidden[p - 1] if p > 0 else np.zeros(self.config.n_embd, dtype=self.dtype)
            rows.append(self.mtp_logits(h, self.tokens[p], pos=p)[0])
        return np.array(rows).reshape(-1, self.n_vocab)
