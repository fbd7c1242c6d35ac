"""The int8-activation rounding on the CPU side (the int8 prefill GEMM, OPENJET_PREFILL_GEMM=int8,
native/gemm_prefill.cuh).

That GEMM rounds the input of every Q4_K / Q5_K / Q6_K / Q8_0 product to int8 per 32 values;
`ReferenceModel(act_int8=True)` must round the same way to hold it to tight bars. Checked here
without a GPU:
- `quantize_act_int8` against a lane-by-lane transcription of quantize_x_kernel (butterfly max and
  sum, d = amax / 127, __float2int_rn(x / d), the int8 store) on random and edge inputs;
- the K-quant mins decoded for the exact-sum term, and one product against the engine's formula
  written out on the integer quants;
- the reference with the option: deterministic, a small non-zero KL from the plain one, only
  quantised products rounded, embedding lookups (main and MTP) untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import Q4_K

from openjet_plugin.testing.reference import (
    ACT_INT8_BLOCK,
    ACT_INT8_TYPES,
    ReferenceModel,
    dequantize_act_int8,
    quantize_act_int8,
    rms_norm,
    round_act_int8,
)


# --- the kernel, transcribed lane by lane ------------------------------------------------------

def _float2int_rn(v: np.float32) -> int:
    """cvt.rni.s32.f32: nearest, ties to even; saturating; NaN -> 0."""
    if np.isnan(v):
        return 0
    if np.isinf(v):
        return 2 ** 31 - 1 if v > 0 else -2 ** 31
    r = int(np.rint(np.float64(v)))
    return max(-2 ** 31, min(2 ** 31 - 1, r))


def _fmaxf(a: np.float32, b: np.float32) -> np.float32:
    """fmaxf: a NaN operand yields the other one."""
    if np.isnan(a):
        return b
    if np.isnan(b):
        return a
    return a if a >= b else b


def _int8_store(v: int) -> int:
    """(int8_t) of an int: the low byte, two's complement."""
    return ((v & 0xFF) ^ 0x80) - 0x80


def _kernel_block(xb: np.ndarray) -> tuple[list[int], np.float32, np.float32]:
    """One warp of quantize_x_kernel on 32 float32 values: (q per lane, d, sum)."""
    lanes = [np.float32(v) for v in xb]
    amax = [np.float32(abs(v)) for v in lanes]
    acc = list(lanes)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):   # inf / NaN lanes, as the GPU
        for off in (16, 8, 4, 2, 1):   # __shfl_xor_sync butterflies, every lane at once
            amax = [_fmaxf(amax[i], amax[i ^ off]) for i in range(32)]
            acc = [np.float32(acc[i] + acc[i ^ off]) for i in range(32)]
        d = np.float32(amax[0] / np.float32(127.0))
        q = [0 if amax[0] == np.float32(0) else _int8_store(_float2int_rn(np.float32(lanes[i] / d)))
             for i in range(32)]
    return q, d, acc[0]


def _kernel(x: np.ndarray):
    x = np.asarray(x, dtype=np.float32)
    rows = x.reshape(-1, x.shape[-1])
    nb = rows.shape[1] // 32
    q = np.zeros(rows.shape, dtype=np.int8)
    d = np.zeros((len(rows), nb), dtype=np.float32)
    s = np.zeros((len(rows), nb), dtype=np.float32)
    for r in range(len(rows)):
        for b in range(nb):
            qb, d[r, b], s[r, b] = _kernel_block(rows[r, 32 * b:32 * b + 32])
            q[r, 32 * b:32 * b + 32] = qb
    return q.reshape(x.shape), d.reshape(*x.shape[:-1], nb), s.reshape(*x.shape[:-1], nb)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal, NaN included."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _random_rows(seed: int, n: int = 6, k: int = 256) -> np.ndarray:
    """Activation-like rows, blocks of very different magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k)).astype(np.float32)
    scale = 10.0 ** rng.uniform(-5, 4, (n, k // 32, 1))
    return (x.reshape(n, k // 32, 32) * scale).reshape(n, k).astype(np.float32)


def _edge_rows() -> np.ndarray:
    x = np.zeros((1, 9 * 32), dtype=np.float32)
    b = x.reshape(9, 32)
    # block 0 all zeros
    b[1, :] = np.linspace(-1e-3, 1e-3, 32)
    b[1, 7] = 3.0e38                                # one huge value: the rest round to 0
    b[2, :4] = [127.0, 2.5, -2.5, 3.5]              # d = 1: ties at .5, to even
    b[2, 4:8] = [0.5, -0.5, 1.5, -126.5]
    b[3, :2] = [222.25, 11.375]                     # d = 1.75: x / d = 6.5 exactly, x * (1/d) is not
    b[4, :] = -np.arange(32, dtype=np.float32)      # negative maximum
    b[5, :3] = [np.nan, 1.0, -2.0]                  # a NaN lane (fmaxf ignores it)
    b[6, :3] = [np.inf, 1.0, -np.inf]
    b[7, :2] = [1e-44, -7e-45]                      # subnormal amax: d underflows to 0
    b[8, :] = np.float32(2.0 ** -130) * np.arange(32, dtype=np.float32)   # subnormal, d > 0
    return x


# --- the rounding function -------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["random", "edge"])
def test_quantiser_equals_the_kernel_transcription(case):
    x = _random_rows(0) if case == "random" else _edge_rows()
    q, d, s = quantize_act_int8(x)
    kq, kd, ks = _kernel(x)
    assert q.dtype == np.int8 and d.dtype == np.float32 and s.dtype == np.float32
    assert _same(q, kq), f"{int((q != kq).sum())} quants differ from the kernel's"
    assert _same(d, kd) and _same(s, ks)


def test_edge_values():
    q, d, s = quantize_act_int8(_edge_rows())
    qb, db = q.reshape(9, 32), d.reshape(9)
    assert db[0] == 0 and not qb[0].any() and s.reshape(9)[0] == 0
    assert qb[1, 7] == 127 and not np.delete(qb[1], 7).any()
    assert db[2] == 1.0 and qb[2, :8].tolist() == [127, 2, -2, 4, 0, 0, 2, -126]
    # the kernel divides: 11.375 / 1.75 = 6.5 -> 6 (ties to even); a product with 1/d gives 7
    assert db[3] == np.float32(1.75) and qb[3, 1] == 6
    assert np.rint(np.float32(11.375) * (np.float32(1) / np.float32(1.75))) == 7
    assert qb[4, 31] == -127 and qb[5, 0] == 0 and qb[5, 2] == -127 and db[5] == np.float32(2) / np.float32(127)


def test_round_trip_error_and_exactness():
    x = _random_rows(1)
    y = round_act_int8(x)
    assert y.dtype == np.float64 and y.shape == x.shape
    b = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(b).max(axis=1, keepdims=True)
    err = np.abs(y.reshape(b.shape) - b)
    assert (err <= amax * (0.5 / 127) * (1 + 1e-6)).all()
    assert float(err.max()) > 0                      # 8 bits, not a copy
    q, d, _ = quantize_act_int8(x)
    # q * d in float64 is exact (8-bit integer times 24-bit float): the division recovers q
    assert np.array_equal(y.reshape(-1, 32) / d.reshape(-1, 1).astype(np.float64), q.reshape(-1, 32))


def test_idempotent_where_the_scale_is_reproduced():
    # d a power of two and max |q| = 127: q * d is a float32 and its block maximum gives d back
    rng = np.random.default_rng(2)
    q = rng.integers(-127, 128, (4, 128)).astype(np.float32)
    q[:, ::32] = 127
    x = q * (np.float32(2.0) ** rng.integers(-20, 20, (4, 1))).astype(np.float32)
    assert np.array_equal(round_act_int8(x), x.astype(np.float64))
    # any block: rounding the rounded values (as float32) again gives the same quants
    for seed in range(3):
        y = round_act_int8(_random_rows(seed)).astype(np.float32)
        q1, _, _ = quantize_act_int8(_random_rows(seed))
        q2, _, _ = quantize_act_int8(y)
        assert np.array_equal(q1, q2)


def test_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_act_int8(np.zeros((2, 48)))


# --- the reference with the option ---------------------------------------------------------------

N_TOKENS = 48


@pytest.fixture(scope="module")
def q4_runs(synth_path):
    """tiny-Q4_K_M over N_TOKENS tokens (+ MTP): plain, act_int8, and act_int8 again."""
    path = synth_path("tiny", "Q4_K_M")
    tokens = np.random.default_rng(21).integers(0, 4096, N_TOKENS).tolist()
    out = {}
    for key, opt in (("plain", False), ("int8", True), ("int8_again", True)):
        ref = ReferenceModel(path, act_int8=opt)
        out[key] = (ref.logits(tokens), ref.mtp_prefill(), ref.state())
    return path, tokens, out


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    lp = p - p.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def test_reference_int8_is_deterministic_and_close(q4_runs):
    _, _, out = q4_runs
    plain, int8, again = out["plain"], out["int8"], out["int8_again"]
    assert np.array_equal(int8[0], again[0]) and np.array_equal(int8[1], again[1])
    assert all(np.array_equal(int8[2][k], again[2][k]) for k in int8[2])
    kl, mkl = _kl(plain[0], int8[0]), _kl(plain[1], int8[1])
    top1 = float(np.mean(plain[0].argmax(-1) == int8[0].argmax(-1)))
    rel = max(float(np.linalg.norm(int8[2][k] - plain[2][k]) / np.linalg.norm(plain[2][k]))
              for k in plain[2] if k.endswith(".ssm"))
    print(f"\ntiny-Q4_K_M, {N_TOKENS} tokens: act_int8 vs float64 reference: mean KL {kl:.3e}, "
          f"MTP mean KL {mkl:.3e}, top-1 {top1:.4f}, worst DeltaNet state rel err {rel:.2e}")
    # the rounding is really applied (8 bits: far above float noise) and stays a small perturbation
    assert 1e-7 < kl < 1e-2 and 1e-8 < mkl < 1e-2, (kl, mkl)
    assert 1e-4 < rel < 5e-2 and top1 >= 0.9


def test_only_quantised_products_are_rounded(q4_runs, monkeypatch):
    """Every product with a Q4_K/Q5_K/Q6_K/Q8_0 weight (main, head, MTP) and nothing else goes
    through the int8 rounding; the embedding lookups (main and MTP) feed unrounded rows."""
    path, tokens, out = q4_runs
    ref = ReferenceModel(path, act_int8=True)
    calls, rounded, inputs, layer0 = [], [], {}, []
    mm, mm_i8, layer = ReferenceModel._mm, ReferenceModel._mm_act_int8, ReferenceModel.layer

    def spy_mm(self, x, name):
        calls.append(name)
        inputs.setdefault(name, x.copy())
        return mm(self, x, name)

    def spy_i8(self, x, name):
        rounded.append(name)
        return mm_i8(self, x, name)

    def spy_layer(self, il, x, positions):
        if il == 0:
            layer0.append(x.copy())
        return layer(self, il, x, positions)

    monkeypatch.setattr(ReferenceModel, "_mm", spy_mm)
    monkeypatch.setattr(ReferenceModel, "_mm_act_int8", spy_i8)
    monkeypatch.setattr(ReferenceModel, "layer", spy_layer)
    logits = ref.logits(tokens[:8])
    ref.mtp_prefill()
    assert np.array_equal(logits, out["int8"][0][:8])      # the spies change nothing
    want = [n for n in calls if ref.tensor_type(n) in ACT_INT8_TYPES]
    assert rounded == want and len(set(want)) >= 10
    mtp = f"blk.{ref.config.mtp_layer}."
    assert any(n.startswith(mtp) for n in rounded) and "output.weight" in rounded
    # the embedding row is used as stored (a Q4_K tensor whose rows int8 rounding would change)
    emb = ref.weight("token_embd.weight")[tokens[:8]]
    assert ref.tensor_type("token_embd.weight") in ACT_INT8_TYPES
    assert np.array_equal(layer0[0], emb) and not np.array_equal(round_act_int8(emb), emb)
    # the MTP block's first product sees rms_norm(embedding row) unrounded, next to rms_norm(h)
    E = ref.config.n_embd
    cat = inputs[mtp + "nextn.eh_proj.weight"]
    want_e = rms_norm(ref.weight("token_embd.weight")[tokens[0]], ref.weight(mtp + "nextn.enorm.weight"),
                      ref.config.rms_eps)
    assert np.array_equal(cat[0, :E], want_e)


@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_float_weights_are_unchanged(synth_path, model_dir, kind):
    """A model whose matrices are all float gives bit-identical logits with and without the option."""
    from openjet_plugin.testing.synth import synth_uniform

    path = synth_path("tiny", "F32") if kind == "F32" else synth_uniform(model_dir / "tiny-uniform-F16.gguf", "F16",
                                                                         force=True)
    tokens = np.random.default_rng(5).integers(0, 4096, 16).tolist()
    runs = []
    for opt in (False, True):
        ref = ReferenceModel(path, act_int8=opt)
        assert all(ref.tensor_type(t) not in ACT_INT8_TYPES for t in ref._tensors)
        runs.append((ref.logits(tokens), ref.mtp_prefill()))
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])


def _k_quant_ints(blocks: np.ndarray, kind: str):
    """(d, dmin, sc, m, q) of Q4_K / Q5_K blocks: q `[n, 8, 32]` the integer quants, sub-block order."""
    n = len(blocks)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)[:, 0]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)[:, 0]
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32).astype(np.int64)
    if kind == "Q5_K":
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q + 16 * (qh & 1).astype(np.int64)
    return d, dmin, sc.astype(np.int64), m.astype(np.int64), q


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quant_product_is_the_engine_formula(synth_path, model_dir, kind):
    """y = sum over sub-blocks of d*sc*(q_w . q_x)*d_x - dmin*m*s_x (the kernel's integer dot and
    exact-sum mins), written out on the raw blocks, against the reference's _mm with act_int8."""
    from openjet_plugin.testing.synth import synth_uniform

    if kind == "Q4_K":
        path, name = synth_path("tiny", "Q4_K_M"), "blk.0.ffn_gate.weight"
    else:
        path, name = synth_uniform(model_dir / "tiny-uniform-Q5_K.gguf", "Q5_K", force=True), "blk.0.ffn_up.weight"
    ref = ReferenceModel(path, act_int8=True)
    assert ref.tensor_type(name) == kind
    t = ref._tensors[name]
    n_out, K = int(t.shape[1]), int(t.shape[0])
    d, dmin, sc, m, qw = _k_quant_ints(np.asarray(t.data, dtype=np.uint8).reshape(-1, 144 if kind == "Q4_K" else 176),
                                       kind)
    # the mins the reference decodes are dmin * m, and W + mins is d * sc * q: integers 0..15 / 0..31
    mins = ref._block_mins(name)
    assert np.array_equal(mins.reshape(-1, 8), dmin[:, None] * m)
    scale_part = (ref.weight(name) + np.repeat(mins, 32, axis=1)).reshape(-1, 8, 32)
    assert np.allclose(scale_part, (d[:, None] * sc)[:, :, None] * qw, rtol=1e-6, atol=1e-7 * np.abs(scale_part).max())

    x = np.random.default_rng(9).standard_normal((3, K)).astype(np.float32) * 0.7
    xq, xd, xs = quantize_act_int8(x)
    nsb = K // 32
    dots = np.einsum("obk,nbk->nob", qw.reshape(n_out, nsb, 32), xq.reshape(3, nsb, 32).astype(np.int64))
    d_o, dmin_o = np.repeat(d, 8).reshape(n_out, nsb), np.repeat(dmin, 8).reshape(n_out, nsb)   # 8 sub-blocks
    sc_o, m_o = sc.reshape(n_out, nsb), m.reshape(n_out, nsb)
    want = ((d_o * sc_o)[None] * dots * xd.astype(np.float64)[:, None, :]
            - (dmin_o * m_o)[None] * xs.astype(np.float64)[:, None, :]).sum(-1)
    got = ref._mm(x.astype(np.float64), name)
    plain = x.astype(np.float64) @ ref.weight(name).T
    scale = np.abs(x).astype(np.float64) @ np.abs(ref.weight(name)).T
    err, gap = float((np.abs(got - want) / scale).max()), float((np.abs(plain - want) / scale).max())
    assert err < 1e-6, err               # float32 weights from gguf.quants; the rounding is exact
    assert gap > 100 * err, (gap, err)   # the unrounded product is far from the engine's


def test_options_that_model_different_engines_are_refused(synth_path):
    with pytest.raises(ValueError, match="act_int8"):
        ReferenceModel(synth_path("tiny", "F32"), llama_cpu_rounding=True, act_int8=True)


def test_dequantize_is_exact():
    q = np.array([[127, -127, 1, -1] * 8], dtype=np.int8)
    d = np.array([[np.float32(1.0) / np.float32(3.0)]], dtype=np.float32)
    y = dequantize_act_int8(q, d)
    assert y.dtype == np.float64 and np.array_equal(y[0, :4], np.array([127, -127, 1, -1]) * np.float64(d[0, 0]))
    assert ACT_INT8_BLOCK == 32
