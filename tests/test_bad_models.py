"""Every kind of bad model file gets its own error type, and a message naming the file and the
culprit (key, tensor, shapes, type) — never a bare struct.error/IndexError from the parser."""

from __future__ import annotations

import dataclasses
import os
import struct
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest_model_file import MICRO, micro_model, write_test_gguf  # noqa: F401
from openjet_plugin.errors import (
    InvalidMetadataError,
    MissingKeyError,
    MissingTensorError,
    ModelFileError,
    MTPMissingWarning,
    NotGGUFError,
    TensorShapeError,
    TruncatedFileError,
    UnsupportedTensorTypeError,
    WrongArchitectureError,
)
from openjet_plugin.model_file import open_model, validate
from openjet_plugin.tensors import mtp_tensors

Q = gguf.GGMLQuantizationType


def _raises(exc_type, path, *culprits):
    """open_model(path) raises exactly exc_type, naming the file and each culprit."""
    with pytest.raises(exc_type) as info:
        open_model(path)
    message = str(info.value)
    assert str(path) in message, message
    for culprit in culprits:
        assert str(culprit) in message, f"{culprit!r} not named in: {message}"
    assert info.value.path == str(path)
    # validate() reports the same problem instead of raising
    report = validate(path)
    assert not report.ok and type(report.errors[0]) is exc_type
    assert str(report.errors[0]) == message
    return info.value


# --- not a GGUF ---------------------------------------------------------------------------------

def test_random_bytes(tmp_path):
    path = tmp_path / "random.bin"
    path.write_bytes(b"\x00\x01" + np.random.default_rng(0).bytes(5000))
    _raises(NotGGUFError, path, "not a GGUF")


def test_text_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 17\n")
    _raises(NotGGUFError, path, "b'vers'")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _raises(NotGGUFError, path, "empty")


def test_directory(tmp_path):
    _raises(NotGGUFError, tmp_path, "directory")


def test_unreadable_gguf_version(tmp_path, micro_model):
    data = bytearray(Path(micro_model).read_bytes())
    data[4:8] = struct.pack("<I", 99)
    path = tmp_path / "v99.gguf"
    path.write_bytes(bytes(data))
    _raises(NotGGUFError, path, "version 99")


def test_nonexistent_path_is_file_not_found(tmp_path):
    path = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=str(path)):
        open_model(path)
    with pytest.raises(FileNotFoundError, match=str(path)):
        validate(path)


# --- truncated ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layout(micro_model):
    """Offsets inside the valid micro model: where each part of the file lies."""
    r = gguf.GGUFReader(micro_model)
    t5 = r.tensors[5]
    tk = r.tensors[len(r.tensors) // 2]
    out = {
        "size": os.path.getsize(micro_model),
        "tokens_field": r.fields["tokenizer.ggml.tokens"].offset,
        "tensor5_info": t5.field.offset,
        "tensor5_name": t5.name,
        "data_start": r.data_offset,
        "first_tensor": min(r.tensors, key=lambda t: t.data_offset).name,
        "mid_data": tk.data_offset,
        "mid_tensor": tk.name,
        "mid_bytes": int(tk.n_bytes),
    }
    del r
    return out


def _cut(src: Path, dst: Path, n: int) -> Path:
    dst.write_bytes(Path(src).read_bytes()[:n])
    return dst


@pytest.mark.parametrize("cut,where", [
    (lambda L: 2, "header"),                                    # "GG"
    (lambda L: 10, "header"),                                   # inside the version/counts
    (lambda L: 20, "header"),                                   # inside the kv count
    (lambda L: L["tokens_field"] + 3, "metadata"),              # inside the key's name length
    (lambda L: L["tokens_field"] + 200, "tokenizer.ggml.tokens"),   # inside the vocabulary
    (lambda L: L["tensor5_info"] + 4, "tensor #5"),             # inside a tensor's name length
    (lambda L: L["tensor5_info"] + 8 + len(L["tensor5_name"]) + 6, "tensor5_name"),  # in its dims
    (lambda L: L["data_start"], "first_tensor"),                # descriptions complete, no data
    (lambda L: L["mid_data"] + L["mid_bytes"] // 2, "mid_tensor"),   # inside tensor data
    (lambda L: L["size"] - 1000, "output.weight|blk"),          # near the end
], ids=["magic", "version", "kv-count", "kv-key", "kv-array", "tensor-info-name",
        "tensor-info-dims", "data-start", "tensor-data", "near-end"])
def test_truncated(tmp_path, micro_model, layout, cut, where):
    n = cut(layout)
    path = _cut(micro_model, tmp_path / f"cut{n}.gguf", n)
    culprit = layout.get(where, where)
    with pytest.raises(TruncatedFileError) as info:
        open_model(path)
    message = str(info.value)
    assert str(path) in message and "truncated" in message
    if "|" in culprit:
        assert any(c in message for c in culprit.split("|")), message
    else:
        assert culprit in message, message
    assert info.value.file_size == n


def test_every_cut_is_a_model_file_error(tmp_path, micro_model, layout):
    """No offset lets a raw parser exception escape: cut at many places through the header,
    metadata and tensor descriptions, and a few inside the data."""
    data = Path(micro_model).read_bytes()
    offsets = sorted(set(range(0, layout["data_start"] + 64, 97))
                     | {layout["size"] - k for k in (1, 31, 33, 4096)})
    path = tmp_path / "cut.gguf"
    for n in offsets:
        path.write_bytes(data[:n])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                open_model(path).close()
            except ModelFileError as exc:
                assert str(path) in str(exc)
                assert isinstance(exc, (TruncatedFileError, NotGGUFError)), (n, exc)
            # a cut inside the final padding leaves every tensor intact: that file loads


def test_corrupted_counts_fail_fast_with_a_model_file_error(tmp_path, micro_model, layout):
    """A flipped byte in a length or count must not hang the loader or leak a parser error."""
    data = Path(micro_model).read_bytes()
    rng = np.random.default_rng(1)
    path = tmp_path / "flip.gguf"
    positions = rng.integers(4, layout["data_start"], size=60)
    for pos in positions:
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        path.write_bytes(bytes(damaged))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                open_model(path).close()
            except ModelFileError as exc:
                assert str(path) in str(exc)


# --- metadata -----------------------------------------------------------------------------------

def test_wrong_architecture(tmp_path):
    path = write_test_gguf(tmp_path / "llama.gguf", arch="llama")
    exc = _raises(WrongArchitectureError, path, "'llama'", "qwen35")
    assert exc.architecture == "llama"


@pytest.mark.parametrize("key", [
    "general.architecture",
    "tokenizer.ggml.tokens",
    "qwen35.embedding_length",
    "qwen35.block_count",
    "qwen35.attention.head_count",
    "qwen35.rope.dimension_sections",
    "qwen35.attention.layer_norm_rms_epsilon",
    "qwen35.ssm.state_size",
    "qwen35.ssm.inner_size",
    "qwen35.ssm.time_step_rank",
    "qwen35.context_length",
])
def test_missing_key(tmp_path, key):
    path = write_test_gguf(tmp_path / "k.gguf", drop_keys=[key])
    exc = _raises(MissingKeyError, path, repr(key))
    assert exc.key == key


@pytest.mark.parametrize("key,value,says", [
    ("qwen35.embedding_length", "64", "expected an integer"),
    ("qwen35.rope.freq_base", "1e7", "expected a number"),
    ("qwen35.rope.dimension_sections", (gguf.GGUFValueType.ARRAY, [1, 1, 1, 1, 1]), "at most 4"),
    ("tokenizer.ggml.tokens", (gguf.GGUFValueType.ARRAY, list(range(320))), "array of strings"),
    ("general.architecture", 7, "expected a string"),
])
def test_key_of_the_wrong_type(tmp_path, key, value, says):
    path = write_test_gguf(tmp_path / "t.gguf", set_keys={key: value})
    exc = _raises(InvalidMetadataError, path, repr(key), says)
    assert exc.key == key


@pytest.mark.parametrize("key,value,says", [
    ("qwen35.attention.head_count_kv", 0, "positive"),
    ("qwen35.attention.head_count_kv", 3, "must divide attention.head_count = 4"),
    ("qwen35.ssm.time_step_rank", 5, "multiple of ssm.group_count = 2"),
    ("qwen35.ssm.group_count", 0, "positive"),
    ("qwen35.embedding_length", 0, "positive"),
    ("qwen35.rope.dimension_count", 32, "at most attention.key_length = 16"),
    ("qwen35.full_attention_interval", 0, "positive"),
    ("qwen35.nextn_predict_layers", 5, "block_count"),
    ("qwen35.ssm.inner_size", 63, "ssm.state_size x ssm.time_step_rank = 64"),
    ("qwen35.attention.value_length", 32, "must equal attention.key_length"),
    ("qwen35.attention.layer_norm_rms_epsilon", 0.0, "positive"),
    ("qwen35.rope.dimension_sections", [0, 0, 0, 0], "not all zero"),
])
def test_nonsense_hyperparameter(tmp_path, key, value, says):
    path = write_test_gguf(tmp_path / "h.gguf", set_keys={key: value})
    exc = _raises(InvalidMetadataError, path, repr(key), says)
    assert exc.key == key and exc.value == value


def test_vocabulary_size_differs_from_the_embedding(tmp_path):
    path = write_test_gguf(tmp_path / "v.gguf", n_tokens=MICRO.n_vocab + 1)
    exc = _raises(TensorShapeError, path, "'token_embd.weight'", "tokenizer.ggml.tokens has 321 tokens",
                  f"{MICRO.n_vocab} rows")
    assert exc.tensor == "token_embd.weight"
    assert exc.expected == (MICRO.n_embd, MICRO.n_vocab + 1)
    assert exc.actual == (MICRO.n_embd, MICRO.n_vocab)


# --- tokenizer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,says", [
    ("tokenizer.ggml.token_type", [1] * 10, "one entry per token"),
    ("tokenizer.ggml.eos_token_id", MICRO.n_vocab, "is not a token id"),
    ("tokenizer.ggml.bos_token_id", 10**6, "is not a token id"),
])
def test_inconsistent_tokenizer(tmp_path, key, value, says):
    path = write_test_gguf(tmp_path / "tok.gguf", set_keys={key: value})
    exc = _raises(InvalidMetadataError, path, repr(key), says)
    assert exc.key == key


@pytest.mark.parametrize("key,value,says", [
    ("tokenizer.ggml.eos_token_id", "</s>", "expected an integer token id"),
    ("tokenizer.ggml.merges", [1, 2], "expected an array of strings"),
    ("tokenizer.ggml.token_type", ["normal"] * MICRO.n_vocab, "expected an array of integers"),
])
def test_tokenizer_key_of_the_wrong_type(tmp_path, key, value, says):
    path = write_test_gguf(tmp_path / "tok.gguf", set_keys={key: value})
    exc = _raises(InvalidMetadataError, path, repr(key), says)
    assert exc.key == key


def test_bpe_vocabulary_without_merges(tmp_path):
    path = write_test_gguf(tmp_path / "nomerges.gguf", drop_keys=["tokenizer.ggml.merges"])
    _raises(MissingKeyError, path, "'tokenizer.ggml.merges'")


def test_token_that_is_not_utf8(tmp_path, micro_model):
    data = Path(micro_model).read_bytes()
    assert data.count(b"<tok7>") == 1
    path = tmp_path / "utf8.gguf"
    path.write_bytes(data.replace(b"<tok7>", b"\xff\xfeok7>"))
    _raises(InvalidMetadataError, path, "'tokenizer.ggml.tokens'", "not valid UTF-8")


# --- tensors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "token_embd.weight", "output_norm.weight", "blk.2.ssm_a", "blk.0.attn_qkv.weight",
    "blk.3.attn_k_norm.weight", "blk.1.ffn_down.weight",
])
def test_missing_tensor(tmp_path, name):
    path = write_test_gguf(tmp_path / "m.gguf", drop_tensors=[name])
    exc = _raises(MissingTensorError, path, repr(name))
    assert exc.tensor == name


@pytest.mark.parametrize("name,np_shape,expected_ne", [
    ("blk.1.ffn_up.weight", (256, 96), (64, 256)),           # input width wrong
    ("blk.0.ffn_down.weight", (256, 64), (256, 64)),         # stored transposed
    ("blk.3.attn_q_norm.weight", (17,), (16,)),               # a norm of the wrong length
    ("blk.3.attn_q.weight", (64, 64), (64, 128)),            # query without its gate half
    ("blk.2.ssm_conv1d.weight", (128, 3), (4, 128)),          # conv kernel 3 instead of 4
])
def test_wrong_shape(tmp_path, name, np_shape, expected_ne):
    path = write_test_gguf(tmp_path / "s.gguf", replace_tensors={
        name: (np.zeros(np_shape, np.float32), None)})
    actual = tuple(reversed(np_shape))
    exc = _raises(TensorShapeError, path, repr(name), list(expected_ne), list(actual))
    assert exc.tensor == name and exc.expected == expected_ne and exc.actual == actual


def test_wrong_shape_in_the_mtp_block_is_an_error_not_a_missing_mtp(tmp_path):
    name = "blk.4.nextn.eh_proj.weight"
    path = write_test_gguf(tmp_path / "s.gguf", replace_tensors={
        name: (np.zeros((64, 64), np.float32), None)})
    _raises(TensorShapeError, path, repr(name), "[128, 64]")


def test_q4_0_tensor_is_unsupported(tmp_path):
    w = np.random.default_rng(0).standard_normal((MICRO.n_ff, MICRO.n_embd), dtype=np.float32)
    q = gguf.quants.quantize(w, Q.Q4_0)
    name = "blk.0.ffn_gate.weight"
    path = write_test_gguf(tmp_path / "q40.gguf", replace_tensors={name: (q, Q.Q4_0)})
    exc = _raises(UnsupportedTensorTypeError, path, repr(name), "Q4_0", "Q4_K")
    assert exc.tensor == name and exc.ggml_type == "Q4_0"


def test_q2_k_tensor_is_unsupported(tmp_path):
    # Q2_K: 84-byte blocks of 256 values; gguf can't quantise to it, so write raw blocks
    block, type_size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
    raw = np.zeros((MICRO.n_embd, MICRO.n_ff // block * type_size), np.uint8)
    name = "blk.1.ffn_down.weight"
    path = write_test_gguf(tmp_path / "q2k.gguf", replace_tensors={name: (raw, Q.Q2_K)})
    exc = _raises(UnsupportedTensorTypeError, path, repr(name), "Q2_K")
    assert exc.ggml_type == "Q2_K"


def test_integer_tensor_is_unsupported(tmp_path):
    name = "blk.0.attn_norm.weight"
    path = write_test_gguf(tmp_path / "i32.gguf", replace_tensors={
        name: (np.zeros(MICRO.n_embd, np.int32), None)})
    _raises(UnsupportedTensorTypeError, path, repr(name), "I32")


def test_unknown_type_id(tmp_path, micro_model):
    # a type id newer than our gguf package (or garbage): named as such, not a parser crash
    r = gguf.GGUFReader(micro_model)
    t = r.tensors[3]
    type_pos = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    name = t.name
    del r, t
    data = bytearray(Path(micro_model).read_bytes())
    assert struct.unpack_from("<I", data, type_pos)[0] == int(Q.F32)
    struct.pack_into("<I", data, type_pos, 99)
    path = tmp_path / "t99.gguf"
    path.write_bytes(bytes(data))
    exc = _raises(UnsupportedTensorTypeError, path, repr(name), "unknown type id 99")
    assert exc.tensor == name


# --- the MTP block ------------------------------------------------------------------------------

def _open_expecting_mtp_warning(path, *named):
    with pytest.warns(MTPMissingWarning) as record:
        mf = open_model(path)
    message = " ".join(str(w.message) for w in record if w.category is MTPMissingWarning)
    assert "speculative decoding is off" in message
    for n in named:
        assert n in message, message
    return mf


def test_model_without_mtp_block_loads_with_speculation_off(tmp_path):
    config = dataclasses.replace(MICRO, n_layer_nextn=0)
    path = write_test_gguf(tmp_path / "nomtp.gguf", config)
    with _open_expecting_mtp_warning(path, "nextn_predict_layers is 0") as mf:
        assert mf.has_mtp is False
        assert mf.config == config and mf.config.n_layer == MICRO.n_layer
    report = validate(path)
    assert report.ok and not report.has_mtp and report.warnings


def test_mtp_announced_but_no_tensors(tmp_path):
    mtp = [s.name for s in mtp_tensors(MICRO)]
    path = write_test_gguf(tmp_path / "nomtp2.gguf", drop_tensors=mtp)
    with _open_expecting_mtp_warning(path, "blk.4.") as mf:
        assert mf.has_mtp is False
        assert mf.config == MICRO     # the config still says what the file says


def test_incomplete_mtp_block_turns_speculation_off_naming_the_missing_tensors(tmp_path):
    missing = ["blk.4.nextn.eh_proj.weight", "blk.4.attn_k.weight"]
    path = write_test_gguf(tmp_path / "halfmtp.gguf", drop_tensors=missing)
    with _open_expecting_mtp_warning(path, *missing) as mf:
        assert mf.has_mtp is False
        assert "blk.4.attn_q.weight" in mf.tensors   # the rest of the block is still listed


# --- validate() collects ------------------------------------------------------------------------

def test_validate_collects_every_tensor_problem(tmp_path):
    w = np.zeros((MICRO.n_ff, MICRO.n_embd), np.float32)
    path = write_test_gguf(tmp_path / "many.gguf",
                           drop_tensors=["blk.0.ssm_a", "blk.3.attn_v.weight"],
                           replace_tensors={
                               "blk.1.ffn_gate.weight": (gguf.quants.quantize(w, Q.Q4_0), Q.Q4_0),
                               "blk.2.ssm_norm.weight": (np.zeros(8, np.float32), None)})
    report = validate(path)
    assert not report.ok
    found = {(type(e).__name__, getattr(e, "tensor", None)) for e in report.errors}
    assert found == {
        ("MissingTensorError", "blk.0.ssm_a"),
        ("MissingTensorError", "blk.3.attn_v.weight"),
        ("UnsupportedTensorTypeError", "blk.1.ffn_gate.weight"),
        ("TensorShapeError", "blk.2.ssm_norm.weight"),
    }
    assert all(str(path) in str(e) for e in report.errors)
    assert report.config == MICRO
    # open_model raises the first of them, in the order the checks walk the tensors
    with pytest.raises(ModelFileError) as info:
        open_model(path)
    assert type(info.value) is type(report.errors[0]) and str(info.value) == str(report.errors[0])


def test_errors_are_value_errors_for_generic_callers(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello")
    with pytest.raises(ValueError):
        open_model(path)


def test_runtime_errors_carry_their_numbers():
    from openjet_plugin.errors import (BackendUnavailableError, ContextOverflowError,
                                       NativeEngineError, OpenJetError)
    e = ContextOverflowError(5000, 4096)
    assert isinstance(e, (OpenJetError, ValueError)) and (e.n_tokens, e.n_ctx) == (5000, 4096)
    assert "5000" in str(e) and "4096" in str(e)
    n = NativeEngineError(3, "out of device memory")
    assert isinstance(n, RuntimeError) and n.code == 3 and "out of device memory" in str(n)
    assert issubclass(BackendUnavailableError, (OpenJetError, RuntimeError))
