"""The fp16-activation option on the CPU side (the decode matvecs, native/matvec_f16.cuh).

The engine's decode matvecs round the input of every Q4_K / Q6_K product to fp16 under a power-of-two
scale per (vector, 256-value super-block); `ReferenceModel(act_f16=True)` must round the same way
so that the GPU test (tests/test_native_gpu.py::test_kv_q8_0_matches_q8_0_reference) can hold the engine's q8_0 KV cache to the same bar as the other paths: the
fp16 rounding moves K and V by ~5e-4 relative, enough to flip q8_0 roundings against a reference
that does not round. Checked here without a GPU:
- `round_act_f16` / `act_f16_exponents` against an element-by-element emulation of prep_kernel
  (np.frexp of each super-block's maximum, one np.float16 cast per value) on random and edge data;
- the products: Q4_K and Q6_K rounded (the Q4_K mins on exact sums), every other type untouched,
  embedding lookups untouched;
- the reference with the option: logits not identical to the plain one but within fp16 noise;
- act_f16 with act_int8 (or llama_cpu_rounding) refused by name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from openjet_plugin.testing.reference import (
    ACT_F16_TYPES,
    ReferenceModel,
    act_f16_exponents,
    round_act_f16,
)

SUPER = 256


# --- prep_kernel, value by value -------------------------------------------------------------------

def _emulate(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rounded x in float64, e per super-block), one super-block and one value at a time: amax
    ignores NaN (fmaxf), e = 15 - frexp exponent clamped to +-126 when 0 < amax <= 3.0e38f, else 0;
    each value is np.float16(float32 value * 2^e) times 2^-e."""
    x = np.asarray(x, dtype=np.float32)
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty(rows.shape, dtype=np.float64)
    es = np.empty((len(rows), rows.shape[1] // SUPER), dtype=np.int64)
    limit = float(np.float32(3.0e38))
    for r in range(len(rows)):
        for u in range(rows.shape[1] // SUPER):
            vals = [float(v) for v in rows[r, SUPER * u:SUPER * (u + 1)]]
            amax = max((abs(v) for v in vals if not math.isnan(v)), default=0.0)
            e = 0
            if 0.0 < amax <= limit:
                e = max(-126, min(126, 15 - int(np.frexp(amax)[1])))
            es[r, u] = e
            for i, v in enumerate(vals):
                with np.errstate(over="ignore"):
                    h = np.float16(v * 2.0 ** e)            # float64 product: exact here
                out[r, SUPER * u + i] = float(h) * 2.0 ** -e
    return out.reshape(x.shape), es.reshape(*x.shape[:-1], -1)


def _random_rows(seed: int, n: int = 5, k: int = 4 * SUPER) -> np.ndarray:
    """Activation-like rows whose super-blocks (and the values inside them) span many magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-3, 3, (n, k))
    x *= np.repeat(10.0 ** rng.uniform(-8, 8, (n, k // SUPER)), SUPER, axis=1)
    x[rng.random((n, k)) < 0.05] = 0.0                      # scattered zeros
    return x.astype(np.float32)


def _edge_rows() -> np.ndarray:
    x = np.zeros((1, 8 * SUPER), dtype=np.float32)
    b = x.reshape(8, SUPER)
    # super-block 0: all zeros (e = 0, stays 0)
    b[1, :6] = [2.0 ** 14, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(3.0 + 2.0 ** -10), 0.1, -7.3]   # e = 0: ties to even
    b[2, :] = np.float32(1e-42) * np.arange(SUPER, dtype=np.float32)   # subnormal float32: e clamps to 126
    b[3, :3] = [1e-30, -3e-31, 1e-38]                                  # tiny but normal
    b[4, :3] = [1e37, -2.5e36, 1.0]                                    # huge: e < 0, small values round to 0
    b[5, :3] = [3.2e38, 1.0, -5.0]                                     # above 3.0e38f: unscaled, fp16 overflow
    b[6, :3] = [np.nan, 1.5e-3, -2e-3]                                 # a NaN lane (fmaxf ignores it)
    b[7, :3] = [np.inf, 1.0, -np.inf]                                  # infinite amax: e = 0
    return x


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal (NaN and the sign of zero included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("case", ["random0", "random1", "edge"])
def test_rounding_equals_the_emulation(case):
    x = _edge_rows() if case == "edge" else _random_rows(int(case[-1]))
    want, want_e = _emulate(x)
    with np.errstate(over="ignore", invalid="ignore"):
        got = round_act_f16(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    assert np.array_equal(act_f16_exponents(x), want_e)
    assert _same(got, want), f"{int(np.sum(~((got == want) | (np.isnan(got) & np.isnan(want)))))} values differ"


def test_edge_values():
    with np.errstate(over="ignore", invalid="ignore"):
        y = round_act_f16(_edge_rows()).reshape(8, SUPER)
    e = act_f16_exponents(_edge_rows()).reshape(8)
    ex = lambda v: int(np.frexp(np.float32(v))[1])
    assert e.tolist() == [0, 0, 126, 15 - ex(1e-30), 15 - ex(1e37), 0, 15 - ex(2e-3), 0]
    assert not y[0].any()
    assert y[1, :4].tolist() == [2.0 ** 14, 1.0, 1.0 + 2.0 ** -9, -3.0]   # halfway cases: ties to even
    assert y[4, 2] == 0.0 and y[4, 0] == np.float64(np.float16(np.float32(1e37) * np.float32(2.0 ** e[4]))) * 2.0 ** -e[4]
    assert np.isinf(y[5, 0]) and y[5, 1:3].tolist() == [1.0, -5.0]
    assert np.isnan(y[6, 0]) and np.isinf(y[7, 0]) and np.isinf(y[7, 2]) and y[7, 1] == 1.0


def test_rounding_error_is_fp16_sized_per_super_block():
    x = _random_rows(2)
    y = round_act_f16(x)
    b, yb = x.reshape(-1, SUPER).astype(np.float64), y.reshape(-1, SUPER)
    amax = np.abs(b).max(axis=1, keepdims=True)
    err = np.abs(yb - b)
    # normal fp16 range after scaling: relative 2^-11; below it, the subnormal step 2^-24 / 2^e
    bound = np.maximum(np.abs(b) * 2.0 ** -11, amax * 2.0 ** -39)
    assert (err <= bound).all()
    assert float((err / np.maximum(np.abs(b), 1e-300)).max()) > 2.0 ** -13    # 11 bits, not a copy
    # the scale makes the rounding independent of the super-block's magnitude
    assert np.array_equal(round_act_f16(x * np.float32(2.0 ** 40)), y * 2.0 ** 40)


def test_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        round_act_f16(np.zeros((2, 384)))


# --- the products ----------------------------------------------------------------------------------

def test_products_use_the_engine_formula(synth_path):
    """Q4_K: fp16-rounded x times the scale part, the mins on the exact sums of x; Q6_K: rounded x
    times W; both differ from the unrounded product by more than float noise."""
    path = synth_path("tiny", "Q4_K_M")
    ref = ReferenceModel(path, act_f16=True)
    names = {"Q4_K": "blk.0.ffn_gate.weight", "Q6_K": "output.weight"}
    x = (np.random.default_rng(3).standard_normal((3, 256)) * 0.37).astype(np.float32).astype(np.float64)
    xr = round_act_f16(x)
    for kind, name in names.items():
        assert ref.tensor_type(name) == kind
        w = ref.weight(name)
        if kind == "Q4_K":
            mins = np.repeat(ref._block_mins(name), 32, axis=1)
            want = xr @ (w + mins).T - x @ mins.T
        else:
            want = xr @ w.T
        got = ref._mm(x, name)
        scale = np.abs(x) @ np.abs(w).T
        err = float((np.abs(got - want) / scale).max())
        gap = float((np.abs(x @ w.T - want) / scale).max())
        assert err < 1e-12, (kind, err)
        assert gap > 1e-5 and gap > 1000 * err, (kind, gap, err)


N_TOKENS = 64


@pytest.fixture(scope="module")
def q4_runs(synth_path):
    """tiny-Q4_K_M over N_TOKENS tokens (+ MTP): plain and act_f16."""
    path = synth_path("tiny", "Q4_K_M")
    tokens = np.random.default_rng(77).integers(0, 4096, N_TOKENS).tolist()
    out = {}
    for key, opt in (("plain", False), ("f16", True)):
        ref = ReferenceModel(path, act_f16=opt)
        out[key] = (ref.logits(tokens), ref.mtp_prefill(), ref.state())
    return path, tokens, out


def _kl_rows(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    lp = p - p.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_reference_f16_differs_but_stays_close(q4_runs):
    _, _, out = q4_runs
    plain, f16 = out["plain"], out["f16"]
    assert plain[0].shape[0] >= 64
    kl, mkl = float(_kl_rows(plain[0], f16[0]).mean()), float(_kl_rows(plain[1], f16[1]).mean())
    top1 = float(np.mean(plain[0].argmax(-1) == f16[0].argmax(-1)))
    mtop1 = float(np.mean(plain[1].argmax(-1) == f16[1].argmax(-1)))
    rel = max(float(np.linalg.norm(f16[2][k] - plain[2][k]) / np.linalg.norm(plain[2][k]))
              for k in plain[2] if k.endswith((".ssm", ".k", ".v")))
    print(f"\ntiny-Q4_K_M, {N_TOKENS} tokens: act_f16 vs float64 reference: mean KL {kl:.3e}, MTP mean KL "
          f"{mkl:.3e}, top-1 {top1:.4f}, MTP top-1 {mtop1:.4f}, worst state rel err {rel:.2e}")
    assert not np.array_equal(plain[0], f16[0]) and not np.array_equal(plain[1], f16[1])
    assert top1 >= 0.99 and mtop1 >= 0.99, (top1, mtop1)
    assert 0 < kl <= 1e-4 and 0 < mkl <= 1e-4, (kl, mkl)
    assert 0 < rel < 1e-2


def test_only_q4_k_and_q6_k_products_are_rounded(q4_runs, monkeypatch):
    """Every Q4_K / Q6_K product (main layers, head, MTP block) and nothing else goes through the
    fp16 rounding; the embedding row (a Q4_K tensor) is used as stored."""
    path, tokens, out = q4_runs
    ref = ReferenceModel(path, act_f16=True)
    calls, rounded, layer0 = [], [], []
    mm, mm_f16, layer = ReferenceModel._mm, ReferenceModel._mm_act_f16, ReferenceModel.layer

    def spy_mm(self, x, name):
        calls.append(name)
        return mm(self, x, name)

    def spy_f16(self, x, name):
        rounded.append(name)
        return mm_f16(self, x, name)

    def spy_layer(self, il, x, positions):
        if il == 0:
            layer0.append(x.copy())
        return layer(self, il, x, positions)

    monkeypatch.setattr(ReferenceModel, "_mm", spy_mm)
    monkeypatch.setattr(ReferenceModel, "_mm_act_f16", spy_f16)
    monkeypatch.setattr(ReferenceModel, "layer", spy_layer)
    logits = ref.logits(tokens[:8])
    ref.mtp_prefill()
    assert np.array_equal(logits, out["f16"][0][:8])      # the spies change nothing
    want = [n for n in calls if ref.tensor_type(n) in ACT_F16_TYPES]
    assert rounded == want and len(set(want)) >= 10
    assert {ref.tensor_type(n) for n in rounded} == {"Q4_K", "Q6_K"}
    mtp = f"blk.{ref.config.mtp_layer}."
    assert any(n.startswith(mtp) for n in rounded) and "output.weight" in rounded
    emb = ref.weight("token_embd.weight")[tokens[:8]]
    assert ref.tensor_type("token_embd.weight") == "Q4_K"
    assert np.array_equal(layer0[0], emb) and not np.array_equal(round_act_f16(emb), emb)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_other_weight_types_are_unchanged(synth_path, quant):
    """F32 and Q8_0 matrices stay on the engine's bf16-split path under f16: bit-identical logits."""
    path = synth_path("tiny", quant)
    tokens = np.random.default_rng(5).integers(0, 4096, 16).tolist()
    runs = []
    for opt in (False, True):
        ref = ReferenceModel(path, act_f16=opt)
        assert all(ref.tensor_type(t) not in ACT_F16_TYPES for t in ref._tensors)
        runs.append((ref.logits(tokens), ref.mtp_prefill()))
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])


def test_options_that_model_different_engines_are_refused(synth_path):
    path = synth_path("tiny", "F32")
    with pytest.raises(ValueError, match=r"act_f16 and act_int8"):
        ReferenceModel(path, act_f16=True, act_int8=True)
    with pytest.raises(ValueError, match=r"llama_cpu_rounding and act_f16"):
        ReferenceModel(path, act_f16=True, llama_cpu_rounding=True)
