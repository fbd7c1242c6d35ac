"""The q8_0 KV cache option on the CPU side (issue 5: "KV append in fp16 (q8_0 as an option)").

The native engine's OJ_KV_Q8_0 stores each 32 values of a K/V head row as ggml's q8_0 block; the
numpy reference's `kv_q8_0=True` must round K/V the same way so that the GPU test
(tests/test_native_gpu.py) can hold the engine to tight tolerances. Checked here without a GPU:
- the reference's quantiser is ggml's q8_0 byte for byte (gguf.quants, which is llama.cpp's
  quantize_row_q8_0_ref), including roundf's ties away from zero and all-zero blocks;
- the round-trip error bound of a block: |x - q * d| <= d / 2 + 127 * |d - fp16(d)|;
- ReferenceModel(kv_q8_0=True) keeps q8_0-representable K/V (main layers and MTP block), and its
  logits stay close to the unrounded reference;
- the memory estimate counts 34 bytes per 32 values, and kv_type reaches the engine description.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from openjet_plugin.testing.reference import (
    KV_Q8_0_BLOCK,
    ReferenceModel,
    dequantize_kv_q8_0,
    quantize_kv_q8_0,
    round_kv_q8_0,
)


def _rows(seed: int = 0, n: int = 64, head_dim: int = 128) -> np.ndarray:
    """K/V-like rows with blocks of very different magnitudes (and an all-zero block)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, head_dim)).astype(np.float32)
    scale = 10.0 ** rng.integers(-6, 4, (n, head_dim // KV_Q8_0_BLOCK, 1))   # per block
    x *= np.repeat(scale, KV_Q8_0_BLOCK, axis=-1).reshape(n, head_dim).astype(np.float32)
    x[3, :KV_Q8_0_BLOCK] = 0.0
    return x


def _as_ggml_blocks(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(quants, scales) packed as ggml's block_q8_0 {fp16 d; int8 qs[32]}: 34 bytes a block."""
    qb = q.reshape(-1, KV_Q8_0_BLOCK).view(np.uint8)
    db = d.reshape(-1, 1).astype(np.float16).view(np.uint8)
    return np.concatenate([db, qb], axis=1)


def test_quantiser_is_ggml_q8_0_byte_for_byte():
    x = _rows()
    q, d = quantize_kv_q8_0(x)
    assert q.dtype == np.int8 and q.shape == x.shape
    assert d.dtype == np.float16 and d.shape == (x.shape[0], x.shape[1] // KV_Q8_0_BLOCK)
    ours = _as_ggml_blocks(q, d)
    ggml = quantize(x.reshape(-1, KV_Q8_0_BLOCK), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    assert ours.shape == ggml.shape
    assert np.array_equal(ours, ggml), f"{int((ours != ggml).any(axis=1).sum())} blocks differ from gguf.quants"
    back = dequantize(ggml.reshape(-1), GGMLQuantizationType.Q8_0).reshape(x.shape)
    assert np.array_equal(dequantize_kv_q8_0(q, d), back)


def test_ties_round_away_from_zero_and_zero_blocks_stay_zero():
    # amax 127 -> d = 1 and 1/d = 1 exactly: x * (1/d) = +-2.5 is a tie; roundf gives +-3 (np.round: +-2)
    x = np.zeros((2, KV_Q8_0_BLOCK), dtype=np.float32)
    x[0, :4] = [127.0, 2.5, -2.5, 0.5]
    q, d = quantize_kv_q8_0(x)
    assert d[0, 0] == 1.0 and d[1, 0] == 0.0
    assert q[0, :4].tolist() == [127, 3, -3, 1]
    assert not q[1].any()
    assert not dequantize_kv_q8_0(q, d)[1].any()


def test_round_trip_error_bound():
    x = _rows(seed=1)
    y = round_kv_q8_0(x)
    assert y.dtype == np.float32
    b = x.reshape(-1, KV_Q8_0_BLOCK).astype(np.float64)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = amax / 127
    d16 = d.astype(np.float16).astype(np.float64)
    err = np.abs(y.reshape(b.shape).astype(np.float64) - b)
    bound = (d / 2 + 127 * np.abs(d16 - d)) * (1 + 1e-5) + 1e-30
    assert (err <= bound).all(), f"worst excess {float((err - bound).max())}"
    # where d is a normal fp16 (>= 2^-14; smaller scales lose bits, as in llama.cpp), a block's
    # worst error is half a step plus the scale's 2^-11 relative rounding: under 0.45% of amax
    normal = (d >= 2.0 ** -14)[:, 0]
    assert normal.sum() > len(normal) // 4
    assert (err[normal] <= amax[normal] * (0.5 / 127 + 2.0 ** -11) * 1.0001).all()
    # and the error is really there (this is 8 bits, not a copy)
    assert float(np.abs(y - x).max()) > 0


def test_round_keeps_dtype_and_rejects_ragged_rows():
    x = _rows(seed=2, n=4, head_dim=64).astype(np.float64)
    assert round_kv_q8_0(x).dtype == np.float64
    assert round_kv_q8_0(x, np.float32).dtype == np.float32
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_kv_q8_0(np.zeros((2, 48)))


def test_rounding_is_idempotent():
    """What the engine stores and reads back quantises to itself: the reference's K/V check below."""
    y = round_kv_q8_0(_rows(seed=3))
    assert np.array_equal(round_kv_q8_0(y), y)


@pytest.fixture(scope="module")
def tiny_runs(synth_path):
    """The tiny model's reference over 40 tokens (+ MTP), with and without q8_0 K/V."""
    path = synth_path("tiny", "F32")
    tokens = np.random.default_rng(11).integers(0, 200, 40).tolist()
    out = {}
    for q8 in (False, True):
        ref = ReferenceModel(path, kv_q8_0=q8)
        logits = ref.logits(tokens)
        mtp = ref.mtp_prefill() if ref.config.mtp_layer is not None else None
        out[q8] = (ref, logits, mtp, ref.state())
    return out


def test_reference_stores_q8_0_kv_rows(tiny_runs):
    ref, _, _, state = tiny_runs[True]
    _, _, _, plain = tiny_runs[False]
    names = [k for k in state if k.endswith((".k", ".v")) and state[k].size]
    assert any(k.startswith("mtp.") for k in names) == (ref.config.mtp_layer is not None)
    assert len(names) >= 2
    for k in names:
        s = state[k]
        assert s.dtype == np.float64 and s.shape == plain[k].shape, k
        assert np.array_equal(round_kv_q8_0(s, np.float64), s), f"{k} holds values that are not q8_0 blocks"
        # the rounding is q8_0's size: well above fp16's 2^-11, below half a step of the block max
        rel = float(np.linalg.norm(s - plain[k]) / np.linalg.norm(plain[k]))
        assert 1e-4 < rel < 1e-2, (k, rel)


def test_reference_logits_with_q8_0_kv_stay_close(tiny_runs):
    _, want, want_mtp, _ = tiny_runs[False]
    _, got, got_mtp, _ = tiny_runs[True]
    assert not np.array_equal(want, got)   # the option does change the computation

    def kl(p, q):
        lp = p - p.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        lq = q - q.max(-1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        return (np.exp(lp) * (lp - lq)).sum(-1)

    assert float(kl(want, got).mean()) < 1e-3
    assert float(np.mean(want.argmax(-1) == got.argmax(-1))) >= 0.95
    if want_mtp is not None:
        assert float(kl(want_mtp, got_mtp).mean()) < 1e-3


def test_memory_estimate_counts_q8_0_blocks(synth_path):
    from openjet_plugin.backends import native
    from openjet_plugin.model_file import open_model

    mf = open_model(synth_path("tiny", "F32"))
    try:
        c = mf.config
        n_ctx = 1000
        values = (len(c.attention_layers()) + (1 if c.n_layer_nextn else 0)) * 2 * c.kv_dim * n_ctx
        f16 = native.estimate_device_bytes(mf, n_ctx)
        q8 = native.estimate_device_bytes(mf, n_ctx, kv_type="q8_0")
        assert f16["kv_cache"] == values * 2
        assert q8["kv_cache"] == values // 32 * 34
        assert f16["total"] - q8["total"] == f16["kv_cache"] - q8["kv_cache"]
        assert {k: v for k, v in f16.items() if k not in ("kv_cache", "total")} == \
               {k: v for k, v in q8.items() if k not in ("kv_cache", "total")}
        with pytest.raises(ValueError, match="kv_type 'q4'"):
            native.estimate_device_bytes(mf, n_ctx, kv_type="q4")
    finally:
        mf.close()


def test_kv_type_ids_match_the_header():
    """KV_TYPES carries the C enum's values (cffi parses native/openjet.h; no library needed)."""
    from openjet_plugin import _native
    from openjet_plugin.backends.native import KV_TYPES

    enum = _native.make_ffi().typeof("oj_kv_type").relements
    assert KV_TYPES == {"f16": enum["OJ_KV_F16"], "q8_0": enum["OJ_KV_Q8_0"]}
