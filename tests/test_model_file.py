"""Loading valid qwen35 GGUFs: config, tensors, metadata, tokenizer fields, and what the loader
must never do (modify the file, keep it open after close)."""

from __future__ import annotations

import gc
import hashlib
import os
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest_model_file import CHAT_TEMPLATE, MICRO, micro_model, write_test_gguf  # noqa: F401
from openjet_plugin.config import PRESETS, SUPPORTED_TENSOR_TYPES
from openjet_plugin.errors import MTPMissingWarning, MissingTensorError, ModelFileError
from openjet_plugin.model_file import ArrayPreview, describe, open_model, validate
from openjet_plugin.tensors import all_tensors


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _open_quietly(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a complete model must load without any warning
        return open_model(path)


def _fds_and_maps_of(path: Path) -> list[str]:
    """This process's open descriptors and memory mappings that refer to `path`."""
    real = os.path.realpath(path)
    hits = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                hits.append(f"fd {fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        hits += [line.strip() for line in maps if line.rstrip().endswith(real)]
    return hits


@pytest.fixture(scope="session")
def tiny_f32(tmp_path_factory) -> Path:
    """The `tiny` preset (the shapes CI runs end to end), F32 weights."""
    return write_test_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf", PRESETS["tiny"], seed=1)


def test_config_round_trips_through_the_file(micro_model, tiny_f32):
    for path, expected in ((micro_model, MICRO), (tiny_f32, PRESETS["tiny"])):
        mf = _open_quietly(path)
        try:
            assert mf.config == expected
            assert mf.has_mtp is True
            assert mf.path == str(path)
        finally:
            mf.close()


def test_every_tensor_is_listed_with_its_ggml_shape_and_bytes(micro_model):
    with _open_quietly(micro_model) as mf:
        specs = all_tensors(MICRO)
        assert set(mf.tensors) == {s.name for s in specs}
        for spec in specs:
            t = mf.tensors[spec.name]
            assert t.ne == spec.ne, spec.name
            assert t.ggml_type == "F32"
            assert t.n_bytes == 4 * int(np.prod(spec.ne))
            assert t.data.dtype == np.uint8 and t.data.size == t.n_bytes
        assert mf.tensor_type_counts() == {"F32": len(specs)}


def test_tensor_data_is_the_written_values(tmp_path):
    # a weight stored [out, in] in numpy is ne = (in, out) in the file; dequantize() gives it back
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2 * MICRO.q_dim, MICRO.n_embd), dtype=np.float32)
    ffn = rng.standard_normal((MICRO.n_embd, MICRO.n_ff), dtype=np.float32)
    path = write_test_gguf(tmp_path / "m.gguf", replace_tensors={
        "blk.3.attn_q.weight": (q, None),
        "blk.0.ffn_down.weight": (ffn.astype(np.float16), None),
    })
    with _open_quietly(path) as mf:
        np.testing.assert_array_equal(mf.tensors["blk.3.attn_q.weight"].dequantize(), q)
        assert mf.tensors["blk.0.ffn_down.weight"].ggml_type == "F16"
        np.testing.assert_array_equal(mf.tensors["blk.0.ffn_down.weight"].dequantize(),
                                      ffn.astype(np.float16).astype(np.float32))
        raw = mf.tensors["blk.3.attn_q.weight"].data
        np.testing.assert_array_equal(raw.view(np.float32).reshape(q.shape), q)


def test_quantised_tensor_is_dequantised_like_gguf_does(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((MICRO.n_ff, MICRO.n_embd), dtype=np.float32)
    q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    path = write_test_gguf(tmp_path / "q8.gguf", replace_tensors={
        "blk.0.ffn_up.weight": (q8, gguf.GGMLQuantizationType.Q8_0)})
    with _open_quietly(path) as mf:
        t = mf.tensors["blk.0.ffn_up.weight"]
        assert t.ggml_type == "Q8_0" and t.ne == (MICRO.n_embd, MICRO.n_ff)
        assert t.n_bytes == q8.nbytes
        got = t.dequantize()
        np.testing.assert_array_equal(got, gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
        assert np.abs(got - w).max() < 0.05   # Q8_0 is close to the original
        assert mf.tensor_type_counts()["Q8_0"] == 1


def test_metadata_and_tokenizer_fields(micro_model):
    with _open_quietly(micro_model) as mf:
        md = mf.metadata
        assert md["general.architecture"] == "qwen35"
        assert md["qwen35.embedding_length"] == MICRO.n_embd
        assert md["qwen35.rope.dimension_sections"] == list(MICRO.rope_sections)
        # the vocabulary is long, so metadata shows a preview, not 320 strings
        preview = md["tokenizer.ggml.tokens"]
        assert isinstance(preview, ArrayPreview) and preview.length == MICRO.n_vocab
        assert preview.head[0] == "<tok0>" and "STRING" in repr(preview)
        assert mf.chat_template == CHAT_TEMPLATE

        tok = mf.tokenizer_fields
        assert len(tok.tokens) == MICRO.n_vocab and tok.tokens[5] == "<tok5>"
        assert tok.merges == ["a b", "ab c"]
        assert tok.token_type == [1] * MICRO.n_vocab
        assert tok.eos_id == MICRO.n_vocab - 1 and tok.bos_id == MICRO.n_vocab - 2
        assert tok.model == "gpt2" and tok.pre == "qwen35"


def test_validate_reports_ok_and_describe_names_the_verdict(micro_model):
    report = validate(micro_model)
    assert report.ok and report.errors == [] and report.warnings == []
    assert report.config == MICRO and report.has_mtp
    assert report.type_counts == {"F32": len(all_tensors(MICRO))}
    text = describe(micro_model)
    assert str(micro_model) in text
    assert "verdict: OK" in text
    assert f"{MICRO.n_layer} main (3 Gated DeltaNet, 1 full attention" in text
    assert f"{len(all_tensors(MICRO))} F32" in text
    assert "MTP block: present" in text


def test_describe_of_a_broken_file_lists_the_problems(tmp_path):
    path = write_test_gguf(tmp_path / "b.gguf", drop_tensors=["blk.0.ffn_up.weight"])
    text = describe(path)
    assert "verdict: NOT USABLE" in text
    assert "blk.0.ffn_up.weight" in text


def test_loader_never_modifies_the_file_and_reads_a_read_only_file(tmp_path, micro_model):
    path = tmp_path / "ro.gguf"
    path.write_bytes(Path(micro_model).read_bytes())
    before = _sha256(path)
    path.chmod(0o444)
    try:
        with _open_quietly(path) as mf:
            for t in mf.tensors.values():
                t.dequantize()
            _ = mf.tokenizer_fields
            with pytest.raises(ValueError):   # the mapping is read-only
                mf.tensors["output_norm.weight"].data[0] = 1
        validate(path)
        describe(path)
    finally:
        path.chmod(0o644)
    assert _sha256(path) == before


def test_close_releases_the_file(tmp_path, micro_model):
    path = tmp_path / "c.gguf"
    path.write_bytes(Path(micro_model).read_bytes())
    mf = _open_quietly(path)
    mf.tensors["token_embd.weight"].dequantize()
    assert _fds_and_maps_of(path), "an open model maps its file"
    mf.close()
    gc.collect()
    assert mf.closed and mf.tensors == {}
    assert _fds_and_maps_of(path) == []
    # what was read stays readable: the config and the tokenizer (decoded while validating)
    assert mf.config == MICRO and len(mf.tokenizer_fields.tokens) == MICRO.n_vocab


def test_a_rejected_file_is_not_left_open(tmp_path):
    path = write_test_gguf(tmp_path / "bad.gguf", drop_tensors=["output_norm.weight"])
    with pytest.raises(MissingTensorError):
        open_model(path)
    gc.collect()
    assert _fds_and_maps_of(path) == []
    # and a file the parser itself rejects (cut inside the tensor data)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(ModelFileError):
        open_model(cut)
    gc.collect()
    assert _fds_and_maps_of(cut) == []


def test_optional_tensors_may_be_absent(tmp_path):
    # output.weight absent: tied to token_embd; nextn.* extras absent: token_embd/output serve
    path = write_test_gguf(tmp_path / "tied.gguf", drop_tensors=[
        "output.weight", "blk.4.nextn.shared_head_norm.weight",
        "blk.4.nextn.embed_tokens.weight", "blk.4.nextn.shared_head_head.weight"])
    with _open_quietly(path) as mf:
        assert "output.weight" not in mf.tensors
        assert mf.has_mtp


def test_unknown_extra_tensors_are_a_warning_not_an_error(tmp_path):
    path = write_test_gguf(tmp_path / "x.gguf", extra_tensors={
        "blk.0.something_new.weight": (np.zeros((4, 64), np.float32), None)})
    with pytest.warns(UserWarning, match="blk.0.something_new.weight"):
        mf = open_model(path)
    mf.close()


def test_a_missing_optional_key_takes_llama_cpps_default_with_a_warning(tmp_path):
    path = write_test_gguf(tmp_path / "k.gguf", drop_keys=["qwen35.full_attention_interval"])
    with pytest.warns(UserWarning, match="full_attention_interval"):
        mf = open_model(path)
    assert mf.config.full_attention_interval == 4 and mf.config == MICRO
    mf.close()


def _gguf_reader_view(path):
    """What gguf's own GGUFReader sees: metadata values and tensor (ne, type, offset, bytes)."""
    r = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name, int(t.data_offset),
                        int(t.n_bytes), bytes(t.data.tobytes()[:64])) for t in r.tensors}
    return fields, tensors


def _layout_agrees_with_gguf_reader(path):
    fields, tensors = _gguf_reader_view(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mf = open_model(path)
    with mf:
        layout = mf._layout
        assert set(layout.fields) == set(fields)
        for key, expected in fields.items():
            got = layout.value(layout.fields[key])
            if isinstance(expected, float):
                assert got == pytest.approx(expected, rel=1e-7), key
            else:
                assert got == expected, key
        assert set(mf.tensors) == set(tensors)
        for name, (ne, qtype, offset, n_bytes, head) in tensors.items():
            t = mf.tensors[name]
            assert (t.ne, t.ggml_type, t.offset, t.n_bytes) == (ne, qtype, offset, n_bytes), name
            assert t.data[:64].tobytes() == head, name


def test_our_layout_reader_agrees_with_gguf_reader(tmp_path, micro_model):
    _layout_agrees_with_gguf_reader(micro_model)
    # a file with every metadata value type, an empty array and a custom alignment
    w = np.random.default_rng(5).standard_normal((MICRO.n_ff, MICRO.n_embd), dtype=np.float32)
    V = gguf.GGUFValueType
    path = write_test_gguf(tmp_path / "types.gguf", set_keys={
        "general.alignment": (V.UINT32, 64),
        "test.u8": (V.UINT8, 200), "test.i8": (V.INT8, -5), "test.u16": (V.UINT16, 60000),
        "test.i16": (V.INT16, -30000), "test.i32": (V.INT32, -7), "test.u64": (V.UINT64, 2**40),
        "test.i64": (V.INT64, -2**40), "test.f64": (V.FLOAT64, 0.1), "test.bool": (V.BOOL, True),
        "test.f32s": [0.5, 1.5], "test.strs": ["a", "ü", ""], "test.bools": [True, False],
    }, replace_tensors={"blk.0.ffn_up.weight": (gguf.quants.quantize(w, Q8), Q8)})
    _layout_agrees_with_gguf_reader(path)


Q8 = gguf.GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("preset,quant,expect_types", [
    ("tiny", "Q8_0", {"Q8_0"}),
    ("tiny", "Q4_K_M", {"Q4_K", "Q6_K"}),
    # 64 layers: the 27B's per-layer type mix (the file is shared with the type-map tests)
    pytest.param("q27b-narrow", "Q4_K_M", {"Q4_K", "Q6_K"}, marks=pytest.mark.slow),
])
def test_generated_models_pass_validation(synth_path, preset, quant, expect_types):
    path = synth_path(preset, quant)
    report = validate(path)
    assert report.ok, [str(e) for e in report.errors]
    assert report.warnings == []
    assert report.config == PRESETS[preset]
    assert report.has_mtp
    assert set(report.type_counts) <= set(SUPPORTED_TENSOR_TYPES)
    assert expect_types <= set(report.type_counts)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MTPMissingWarning)
        with open_model(path) as mf:
            assert len(mf.tokenizer_fields.tokens) == mf.config.n_vocab
            assert mf.tokenizer_fields.merges and mf.chat_template
    _layout_agrees_with_gguf_reader(path)
