"""The direct q27b writer's per-tensor types are exactly what llama.cpp's Q4_K_M quantiser picks.

llama.cpp's choices depend on the layer index and the number of layers (use_more_bits), not on the
widths, so the 64-layer narrow preset quantised by llama.cpp itself is the proof for the 27B map.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from openjet_plugin.config import PRESETS
from openjet_plugin.testing.synth import q4_k_m_type_map, synth_model, synth_specs

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

NARROW = PRESETS["q27b-narrow"]
Q27B = PRESETS["q27b"]


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def narrow_q4km(synth_path) -> Path:
    return synth_path("q27b-narrow", "Q4_K_M")


@pytest.mark.slow
def test_llama_cpp_quantiser_agrees_with_the_map(narrow_q4km):
    actual = _types(narrow_q4km)
    expected = q4_k_m_type_map(NARROW)
    assert set(actual) == set(expected)   # (llama.cpp writes them sorted by layer, then name)
    wrong = {n: (actual[n], t) for n, t in expected.items() if actual[n] != t}
    assert not wrong, f"{len(wrong)} tensors differ (llama.cpp, ours): {dict(list(wrong.items())[:8])}"
    # the recipe really is mixed: Q6_K where use_more_bits picks, Q4_K elsewhere, F32 vectors
    counts = Counter(actual.values())
    assert set(counts) == {"F32", "Q4_K", "Q6_K"}
    assert actual["output.weight"] == "Q6_K" and actual["token_embd.weight"] == "Q4_K"


def test_27b_map_has_the_narrow_presets_layer_pattern():
    wide, narrow = q4_k_m_type_map(Q27B), q4_k_m_type_map(NARROW)
    assert Q27B.n_layer == NARROW.n_layer and Q27B.n_layer_nextn == NARROW.n_layer_nextn
    assert wide == narrow   # same names, same types: the choice does not depend on widths
    q6 = sorted(int(m.group(1)) for n, t in wide.items() if t == "Q6_K"
                and (m := re.match(r"blk\.(\d+)\.(attn_v|attn_qkv)\.weight", n)))
    # llama.cpp's use_more_bits over 65 V-like tensors: first and last eighth, every third between
    assert q6[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 10] and q6[-9:] == [56, 57, 58, 59, 60, 61, 62, 63, 64]
    for il in range(Q27B.block_count):
        down = wide[f"blk.{il}.ffn_down.weight"]
        assert down == ("Q6_K" if il in q6 else "Q4_K"), il


def test_27b_q4_k_m_size_is_the_real_files():
    """Bytes implied by the map for the 27B shapes: about 16.8 GB, as a real Q4_K_M file."""
    block = {"Q4_K": (256, 144), "Q6_K": (256, 210), "F32": (1, 4)}
    types = q4_k_m_type_map(Q27B)
    total = 0
    for s in synth_specs(Q27B):
        per, nbytes = block[types[s.name]]
        total += int(np.prod(s.ne)) // per * nbytes
    assert 16.3e9 < total < 17.3e9, total


def test_direct_writer_file_loads_in_llama_cpp(tmp_path, narrow_q4km):
    path = synth_model(tmp_path / "narrow-direct.gguf", "q27b-narrow", "Q4_K_M", direct=True)
    assert _types(path) == q4_k_m_type_map(NARROW)
    # same types and shapes as llama.cpp's own Q4_K_M file, so the same size to the byte
    assert path.stat().st_size == narrow_q4km.stat().st_size
    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    try:
        ids = llm.tokenize(b"def main():\n    print('hello, world')\n", add_bos=False, special=True)
        llm.eval(ids)
        lg = np.asarray(llm.scores[: len(ids)])
        assert np.isfinite(lg).all()
        assert 1.0 < lg.std(axis=1).mean() < 20.0
        top1 = lg.argmax(axis=1)
        assert np.mean(top1[1:] != top1[:-1]) > 0.5
    finally:
        llm.close()


def test_direct_writer_is_deterministic(tmp_path):
    a = synth_model(tmp_path / "a.gguf", "tiny", "Q4_K_M", direct=True, seed=4)
    b = synth_model(tmp_path / "b.gguf", "tiny", "Q4_K_M", direct=True, seed=4)
    c = synth_model(tmp_path / "c.gguf", "tiny", "Q4_K_M", direct=True, seed=5)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_q27b_only_as_direct_q4_k_m(tmp_path):
    for quant in ("F32", "F16", "Q8_0", "Q6_K"):
        with pytest.raises(ValueError, match="only as Q4_K_M"):
            synth_model(tmp_path / "x.gguf", "q27b", quant)
    with pytest.raises(ValueError, match="only as Q4_K_M"):
        synth_model(tmp_path / "x.gguf", "q27b", "Q4_K_M", direct=False)
    assert list(tmp_path.iterdir()) == []


def test_padded_vocabulary_rows_stay_quiet(tmp_path):
    """With the 27B's padded vocabulary most rows are UNUSED placeholders; their output rows are
    scaled down (as untrained rows are), so sampling still lands on real tokens."""
    import dataclasses

    from openjet_plugin.testing.synth import PAD_BIAS_WEIGHT, PAD_ROW_SCALE, bias_dim, token_dims

    cfg = dataclasses.replace(PRESETS["tiny"], n_vocab=32768)       # 4096 real + 28672 [PADn]
    path = synth_model(tmp_path / "padded.gguf", config=cfg, quant="Q4_K_M", direct=True)
    out = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    from gguf.quants import dequantize

    w = dequantize(np.asarray(out.data), out.tensor_type)
    half = token_dims(cfg)
    # the context half (what every row reads of the context) is PAD_ROW_SCALE smaller in padding rows
    real, pad = w[:4096, half:].std(), w[4096:, half:].std()
    assert pad / real == pytest.approx(PAD_ROW_SCALE, rel=0.1)
    # of the token half a padding row reads only the stream's constant bias dim, with a negative
    # weight: its logit sits far below the real tokens' (244K of them must not outweigh 4K)
    pad_token_half = np.delete(w[4096:, :half], bias_dim(cfg), axis=1)
    assert not pad_token_half.any()
    np.testing.assert_allclose(w[4096:, bias_dim(cfg)], PAD_BIAS_WEIGHT, rtol=1e-2)
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    try:
        ids = llm.tokenize(b"for i in range(10):\n    total += i * i\n", add_bos=False, special=True)
        llm.eval(ids)
        lg = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        p = np.exp(lg - lg.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        assert p[:, :4096].sum(1).min() > 0.99
        assert (lg.argmax(1) < 4096).all()
    finally:
        llm.close()
