"""Open a qwen35 GGUF, read its `ModelConfig` and check every tensor against `tensors.py`.

    open_model(path) -> ModelFile          raises the first problem (a ModelFileError subclass)
    validate(path)   -> ValidationReport   collects every problem instead of raising
    describe(path)   -> str                the text `openjet info` prints

The file is memory-mapped read-only through `gguf.GGUFReader`; nothing is copied or written.
The checks run in the order a loader depends on them, and a failed stage stops the later ones
(tensor shapes derived from a nonsense head count would only add noise):

  1. structure: a GGUF at all, not cut short anywhere (header, metadata, tensor descriptions,
     tensor data: each tensor's byte range is compared with the file size here, because the
     parser does not guarantee that);
  2. `general.architecture == "qwen35"`;
  3. hyperparameters -> ModelConfig, then sanity (positive sizes, head counts that divide, ...);
  4. vocabulary: the tokenizer's token count must equal token_embd's rows;
  5. every tensor of `all_tensors(config)`: present, shape, type in SUPPORTED_TENSOR_TYPES.

MTP policy: a file without a usable MTP block still loads, with `has_mtp = False` and an
`MTPMissingWarning` (speculation off). "Unusable" means nextn_predict_layers == 0, no MTP tensors
at all, or some required MTP tensors missing (the warning names them); we turn speculation off
rather than refuse the file because the main model is complete and llama.cpp also runs such files
without MTP. An MTP tensor that is *present* with a wrong shape or type is still an error: that is
a damaged file, not a model without MTP. `config` always describes the file as written
(`n_layer_nextn` as in its metadata); `has_mtp` says whether the block can be used.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize as _gguf_dequantize

from .config import ARCH, PRESETS, SUPPORTED_TENSOR_TYPES, ModelConfig
from .errors import (
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
from .tensors import TensorSpec, all_tensors

__all__ = ["ModelFile", "TensorInfo", "TokenizerFields", "ValidationReport", "ArrayPreview",
           "open_model", "validate", "describe"]

GGUF_MAGIC = b"GGUF"
READABLE_GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
LLAMA_MAX_LAYERS = 512     # llama.cpp refuses more (src/llama-hparams.h)
TOKENS_KEY = "tokenizer.ggml.tokens"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# Arrays longer than this are shown as an ArrayPreview in ModelFile.metadata.
METADATA_ARRAY_LIMIT = 16

_INT_TYPES = frozenset({
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
})
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})

# What kind of value each architecture key holds, taken from the one place that lists the keys
# (ModelConfig.gguf_metadata) rather than repeated here: "int", "float" or "int_array".
_KEY_KINDS: dict[str, str] = {
    key: ("float" if isinstance(v, float) else "int_array" if isinstance(v, list) else "int")
    for key, v in PRESETS["tiny"].gguf_metadata().items()
}

_K = f"{ARCH}."
# Keys llama.cpp's loader treats as optional, with the default it then uses. A file llama.cpp runs
# must run here too, identically; a missing one is reported as a warning, not an error.
_LLAMA_CPP_DEFAULTS: dict[str, Callable[[Callable[[str], Any]], Any]] = {
    _K + "nextn_predict_layers": lambda get: 0,
    _K + "full_attention_interval": lambda get: 4,
    _K + "attention.head_count_kv": lambda get: get(_K + "attention.head_count"),
    _K + "attention.key_length":
        lambda get: get(_K + "embedding_length") // max(1, get(_K + "attention.head_count")),
    _K + "attention.value_length": lambda get: get(_K + "attention.key_length"),
    _K + "rope.dimension_count": lambda get: get(_K + "attention.key_length"),
    _K + "rope.freq_base": lambda get: 10000.0,
}


# --- public data types --------------------------------------------------------------------------

@dataclass(frozen=True)
class ArrayPreview:
    """A long metadata array, shortened for display: its length, element type and first items."""

    length: int
    element_type: str
    head: tuple

    def __repr__(self) -> str:
        items = ", ".join(repr(x) for x in self.head)
        return f"<{self.length} x {self.element_type}: [{items}, ...]>"


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor of the file. `ne` is ggml order (input dimension first); `data` is a read-only
    memory-mapped uint8 view of its raw bytes (quantised blocks as stored)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: str
    n_bytes: int
    offset: int          # absolute file offset of the first data byte
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The values as a new float32 array of numpy shape `ne[::-1]` (a 2-D weight is [out, in])."""
        qtype = GGMLQuantizationType[self.ggml_type]
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = self.data.reshape(-1, self.ne[0] // block * type_size)
        # a copy even for F32 (where gguf returns a view), so the result never pins the mapping
        return np.array(_gguf_dequantize(rows, qtype), dtype=np.float32).reshape(self.ne[::-1])


@dataclass(frozen=True)
class TokenizerFields:
    """The tokenizer.ggml.* arrays and ids, as the tokenizer module needs them."""

    model: str | None
    pre: str | None
    tokens: list[str]
    merges: list[str]
    token_type: list[int]
    bos_id: int | None
    eos_id: int | None
    padding_id: int | None
    add_bos: bool | None


@dataclass
class ValidationReport:
    """What `validate()` found. `ok` is True when the file can be loaded; warnings do not count."""

    path: str
    errors: list[ModelFileError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    config: ModelConfig | None = None
    type_counts: dict[str, int] = field(default_factory=dict)
    has_mtp: bool = False
    n_tensors: int = 0
    file_size: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


class ModelFile:
    """An open, validated qwen35 GGUF. Use as a context manager or call `close()`.

    After close() the file handle and mapping are released as soon as no TensorInfo.data view
    obtained earlier is still referenced (a view keeps its mapping alive, so it never dangles).
    """

    def __init__(self, path: str, reader: GGUFReader, config: ModelConfig, has_mtp: bool,
                 tensors: dict[str, TensorInfo]):
        self.path = path
        self.config = config
        self.has_mtp = has_mtp
        self._reader: GGUFReader | None = reader
        self.tensors = tensors
        self.metadata: dict[str, Any] = _metadata_dict(reader)
        self.chat_template: str | None = _string_field(reader, CHAT_TEMPLATE_KEY)

    def tensor_type_counts(self) -> dict[str, int]:
        return dict(Counter(t.ggml_type for t in self.tensors.values()))

    @cached_property
    def tokenizer_fields(self) -> TokenizerFields:
        reader = self._require_open()
        return _tokenizer_fields(reader)

    @property
    def closed(self) -> bool:
        return self._reader is None

    def close(self) -> None:
        # Dropping every reference to the reader's memmap (its field parts and tensor views hang
        # off it) lets CPython unmap the file and close the descriptor mmap duplicated.
        self._reader = None
        self.tensors = {}

    def _require_open(self) -> GGUFReader:
        if self._reader is None:
            raise ValueError(f"{self.path}: the model file is closed")
        return self._reader

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.tensors)} tensors"
        return f"ModelFile({self.path!r}, {state}, has_mtp={self.has_mtp})"


# --- entry points -------------------------------------------------------------------------------

def open_model(path: str | os.PathLike[str]) -> ModelFile:
    """Open and validate `path`; raise the first problem found. MTP warnings go to `warnings`."""
    inspection = _inspect(path)
    if inspection.report.errors:
        inspection.release()
        raise inspection.report.errors[0]
    for message in inspection.report.warnings:
        category = MTPMissingWarning if message.startswith(_MTP_WARNING_PREFIX) else UserWarning
        warnings.warn(message, category, stacklevel=2)
    return inspection.model_file()


def validate(path: str | os.PathLike[str]) -> ValidationReport:
    """Check `path` and collect every problem. Raises only FileNotFoundError (there is no file)."""
    inspection = _inspect(path)
    inspection.release()
    return inspection.report


def describe(path: str | os.PathLike[str]) -> str:
    """A human-readable summary for `openjet info`: hyperparameters, tensor types, verdict."""
    report = validate(path)
    lines = [f"file: {report.path} ({_human_bytes(report.file_size)})"]
    c = report.config
    if c is not None:
        lines += [
            f"architecture: {ARCH}",
            f"layers: {c.n_layer} main ({len(c.deltanet_layers())} Gated DeltaNet, "
            f"{len(c.attention_layers())} full attention, every {c.full_attention_interval}th) "
            f"+ {c.n_layer_nextn} MTP",
            f"embedding: {c.n_embd}, feed-forward: {c.n_ff}, vocabulary: {c.n_vocab}",
            f"attention: {c.n_head} query heads, {c.n_head_kv} KV heads, head dim {c.head_dim}, "
            f"RoPE on {c.n_rot} dims (sections {list(c.rope_sections)}, base {c.rope_freq_base:g})",
            f"Gated DeltaNet: {c.ssm_n_group} key heads, {c.ssm_dt_rank} value heads, "
            f"head dim {c.ssm_d_state}, conv kernel {c.ssm_conv_kernel}",
            f"RMSNorm eps: {c.rms_eps:g}, training context: {c.n_ctx_train}",
        ]
    if report.type_counts:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(report.type_counts.items(),
                                                         key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"tensors: {report.n_tensors} ({counts})")
    if c is not None:
        lines.append(f"MTP block: {'present (speculative decoding available)' if report.has_mtp else 'absent (speculative decoding off)'}")
    lines.append("verdict: OK" if report.ok else f"verdict: NOT USABLE ({len(report.errors)} problem(s))")
    lines += [f"  error: {e.reason}" for e in report.errors]
    lines += [f"  warning: {w}" for w in report.warnings]
    return "\n".join(lines)


# --- the checks ---------------------------------------------------------------------------------

_MTP_WARNING_PREFIX = "speculative decoding is off"


class _Stop(Exception):
    """A stage failed; later stages depend on it, so the inspection ends here."""


class _Inspection:
    def __init__(self, path: str):
        self.path = path
        self.report = ValidationReport(path=path)
        self.reader: GGUFReader | None = None
        self.tensors: dict[str, TensorInfo] = {}

    def error(self, exc: ModelFileError) -> None:
        self.report.errors.append(exc)

    def stop(self, exc: ModelFileError) -> None:
        self.error(exc)
        raise _Stop

    def warn(self, message: str) -> None:
        self.report.warnings.append(message)

    def release(self) -> None:
        self.reader = None
        self.tensors = {}

    def model_file(self) -> ModelFile:
        assert self.reader is not None and self.report.config is not None
        mf = ModelFile(self.path, self.reader, self.report.config, self.report.has_mtp, self.tensors)
        self.release()
        return mf


def _inspect(path: str | os.PathLike[str]) -> _Inspection:
    spath = os.fspath(path)
    insp = _Inspection(spath)
    try:
        reader = _open_reader(insp)
        insp.reader = reader
        _collect_tensors(insp, reader)
        _check_architecture(insp, reader)
        config = _read_config(insp, reader)
        _check_vocabulary(insp, config)
        _check_tensors(insp, config)
    except _Stop:
        pass
    return insp


def _open_reader(insp: _Inspection) -> GGUFReader:
    path = insp.path
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"model file not found: {path}", path)
    if os.path.isdir(path):
        insp.stop(NotGGUFError(path, "this is a directory, not a GGUF model file"))
    size = os.path.getsize(path)
    insp.report.file_size = size
    if size == 0:
        insp.stop(NotGGUFError(path, "the file is empty (0 bytes), not a GGUF model"))
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        if len(head) < 4 and GGUF_MAGIC.startswith(head):
            insp.stop(TruncatedFileError(path, "the GGUF header", 4, size))
        insp.stop(NotGGUFError(path, f"not a GGUF file: it starts with {head!r}, a GGUF starts "
                                     f"with {GGUF_MAGIC!r}"))
    # Walk the layout ourselves first, bounds-checked: the parser reports a cut-short or corrupt
    # file as a bare IndexError/ValueError, and a corrupted array count can keep it looping over
    # empty slices for a very long time; the walk names the place and fails fast.
    found = _scan_layout(path, size)
    if found is not None:
        insp.stop(found)
    try:
        reader = GGUFReader(path, "r")
    except (MemoryError, PermissionError):
        raise
    except Exception as exc:
        # `from None` and no reference kept: the traceback would hold the half-built reader
        # and with it the mapping of the file.
        insp.stop(ModelFileError(path, f"the GGUF parser failed: {type(exc).__name__}: {exc}"))
    if reader.byte_order != "I":
        insp.stop(ModelFileError(path, "this GGUF is big-endian; the engine reads little-endian "
                                       "files only"))
    # The parser slices tensor data without checking that it lies inside the file.
    base = int(reader.data_offset)
    for t in sorted(reader.tensors, key=lambda t: int(t.data_offset)):
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            insp.stop(TruncatedFileError(path, f"the data of tensor {t.name!r}", end, size))
        if (int(t.data_offset) - base) % int(reader.alignment) != 0:
            insp.stop(ModelFileError(path, f"tensor {t.name!r}: its data offset is not a multiple "
                                           f"of the file's alignment {int(reader.alignment)}"))
    return reader


def _collect_tensors(insp: _Inspection, reader: GGUFReader) -> None:
    for t in reader.tensors:
        start = int(t.data_offset)
        insp.tensors[t.name] = TensorInfo(
            name=t.name,
            ne=tuple(int(d) for d in t.shape),
            ggml_type=_type_name(t.tensor_type),
            n_bytes=int(t.n_bytes),
            offset=start,
            data=reader.data[start:start + int(t.n_bytes)],
        )
    insp.report.n_tensors = len(insp.tensors)
    insp.report.type_counts = dict(Counter(t.ggml_type for t in insp.tensors.values()))


def _check_architecture(insp: _Inspection, reader: GGUFReader) -> None:
    f = reader.fields.get("general.architecture")
    if f is None:
        insp.stop(MissingKeyError(insp.path, "general.architecture"))
    if f.types != [GGUFValueType.STRING]:
        insp.stop(InvalidMetadataError(insp.path, "general.architecture", _field_value(f),
                                       "expected a string"))
    arch = f.contents()
    if arch != ARCH:
        insp.stop(WrongArchitectureError(insp.path, arch, ARCH))


def _read_config(insp: _Inspection, reader: GGUFReader) -> ModelConfig:
    path = insp.path
    tokens = reader.fields.get(TOKENS_KEY)
    if tokens is None:
        insp.stop(MissingKeyError(path, TOKENS_KEY))
    if tokens.types[:1] != [GGUFValueType.ARRAY] or tokens.types[-1] != GGUFValueType.STRING:
        insp.stop(InvalidMetadataError(path, TOKENS_KEY, _field_value(tokens),
                                       "expected an array of strings (the vocabulary)"))
    n_vocab = len(tokens.data)
    if n_vocab == 0:
        insp.stop(InvalidMetadataError(path, TOKENS_KEY, [], "the vocabulary is empty"))

    get = _KeyReader(insp, reader)
    try:
        config = ModelConfig.from_gguf_metadata(get, n_vocab)
        inner_size = get(_K + "ssm.inner_size")
        value_length = get(_K + "attention.value_length")
    except ModelFileError as exc:
        insp.stop(exc)
    insp.report.config = config

    for key, value, problem in _hyperparameter_problems(config, inner_size, value_length):
        insp.error(InvalidMetadataError(path, key, value, problem))
    if insp.report.errors:
        raise _Stop
    return config


class _KeyReader:
    """`get(key)` for ModelConfig.from_gguf_metadata: typed values, errors naming file and key."""

    def __init__(self, insp: _Inspection, reader: GGUFReader):
        self.insp = insp
        self.fields = reader.fields

    def __call__(self, key: str) -> Any:
        f = self.fields.get(key)
        if f is None:
            default = _LLAMA_CPP_DEFAULTS.get(key)
            if default is None:
                raise MissingKeyError(self.insp.path, key)
            value = default(self)
            self.insp.warn(f"metadata key {key!r} is missing; using llama.cpp's default {value!r}")
            return value
        kind = _KEY_KINDS.get(key, "int")
        t0, tn = f.types[0], f.types[-1]
        if kind == "int":
            if t0 not in _INT_TYPES:
                raise InvalidMetadataError(self.insp.path, key, _field_value(f),
                                           f"expected an integer, the file has {_vtype(f)}")
            return int(f.contents())
        if kind == "float":
            if t0 not in _FLOAT_TYPES | _INT_TYPES:
                raise InvalidMetadataError(self.insp.path, key, _field_value(f),
                                           f"expected a number, the file has {_vtype(f)}")
            if t0 == GGUFValueType.FLOAT32:
                # the shortest decimal that is this float32 (1e-06, not 9.99999997e-07): the value
                # the converter meant, so configs read back compare equal to the ones written
                return float(str(np.float32(f.contents())))
            return float(f.contents())
        # int_array: llama.cpp's get_key_or_arr also takes a scalar for all four sections
        if t0 in _INT_TYPES:
            return [int(f.contents())] * 4
        if t0 != GGUFValueType.ARRAY or (len(f.data) and tn not in _INT_TYPES):
            raise InvalidMetadataError(self.insp.path, key, _field_value(f),
                                       f"expected an array of integers, the file has {_vtype(f)}")
        values = [int(v) for v in f.contents()]
        if len(values) > 4:
            raise InvalidMetadataError(self.insp.path, key, values, "at most 4 entries are allowed")
        return values


def _hyperparameter_problems(c: ModelConfig, inner_size: int, value_length: int):
    """(key, value, problem) for every value this architecture cannot have."""
    k = _K
    positive = {
        "embedding_length": c.n_embd, "feed_forward_length": c.n_ff,
        "attention.head_count": c.n_head, "attention.head_count_kv": c.n_head_kv,
        "attention.key_length": c.head_dim, "rope.dimension_count": c.n_rot,
        "ssm.conv_kernel": c.ssm_conv_kernel, "ssm.state_size": c.ssm_d_state,
        "ssm.group_count": c.ssm_n_group, "ssm.time_step_rank": c.ssm_dt_rank,
        "full_attention_interval": c.full_attention_interval, "context_length": c.n_ctx_train,
    }
    bad = set()
    for name, value in positive.items():
        if value < 1:
            bad.add(name)
            yield k + name, value, "must be a positive integer"
    if c.block_count > LLAMA_MAX_LAYERS:
        yield (k + "block_count", c.block_count,
               f"more than llama.cpp's limit of {LLAMA_MAX_LAYERS} layers (a corrupt value?)")
    if c.n_layer_nextn < 0 or c.n_layer < 1:
        yield (k + "nextn_predict_layers", c.n_layer_nextn,
               f"must be between 0 and block_count - 1 = {c.block_count - 1} "
               f"(block_count counts the main layers plus the MTP blocks)")
    if not {"attention.head_count", "attention.head_count_kv"} & bad and c.n_head % c.n_head_kv:
        yield (k + "attention.head_count_kv", c.n_head_kv,
               f"must divide attention.head_count = {c.n_head} (grouped-query attention)")
    if not {"ssm.time_step_rank", "ssm.group_count"} & bad and c.ssm_dt_rank % c.ssm_n_group:
        yield (k + "ssm.time_step_rank", c.ssm_dt_rank,
               f"the number of value heads must be a multiple of ssm.group_count = {c.ssm_n_group} "
               f"(the number of key heads)")
    if "rope.dimension_count" not in bad and (c.n_rot > c.head_dim or c.n_rot % 2):
        yield (k + "rope.dimension_count", c.n_rot,
               f"must be even and at most attention.key_length = {c.head_dim}")
    if value_length != c.head_dim:
        yield (k + "attention.value_length", value_length,
               f"must equal attention.key_length = {c.head_dim} in this architecture")
    if inner_size != c.ssm_d_inner:
        yield (k + "ssm.inner_size", inner_size,
               f"must equal ssm.state_size x ssm.time_step_rank = {c.ssm_d_inner}")
    if any(s < 0 for s in c.rope_sections) or sum(c.rope_sections) == 0:
        yield (k + "rope.dimension_sections", list(c.rope_sections),
               "sections must be non-negative and not all zero")
    if not (math.isfinite(c.rms_eps) and c.rms_eps > 0):
        yield k + "attention.layer_norm_rms_epsilon", c.rms_eps, "must be a positive number"
    if not (math.isfinite(c.rope_freq_base) and c.rope_freq_base > 0):
        yield k + "rope.freq_base", c.rope_freq_base, "must be a positive number"


def _check_vocabulary(insp: _Inspection, config: ModelConfig) -> None:
    emb = insp.tensors.get("token_embd.weight")
    if emb is not None and len(emb.ne) == 2 and emb.ne[1] != config.n_vocab:
        insp.stop(TensorShapeError(
            insp.path, "token_embd.weight", (config.n_embd, config.n_vocab), emb.ne,
            f"{TOKENS_KEY} has {config.n_vocab} tokens but the embedding has {emb.ne[1]} rows; "
            f"the tokenizer and the weights do not belong together"))


def _check_tensors(insp: _Inspection, config: ModelConfig) -> None:
    path, present = insp.path, insp.tensors
    specs = all_tensors(config)
    for spec in specs:
        if spec.part == "main":
            if spec.name in present:
                _check_one(insp, spec, present[spec.name])
            elif spec.required:
                insp.error(MissingTensorError(path, spec.name))

    mtp = [s for s in specs if s.part == "mtp"]
    found = [s for s in mtp if s.name in present]
    for spec in found:
        _check_one(insp, spec, present[spec.name])
    missing = [s.name for s in mtp if s.required and s.name not in present]
    if config.n_layer_nextn == 0:
        insp.report.has_mtp = False
        insp.warn(f"{_MTP_WARNING_PREFIX}: {_K}nextn_predict_layers is 0 (the file has no MTP block)")
    elif not found:
        insp.report.has_mtp = False
        insp.warn(f"{_MTP_WARNING_PREFIX}: the metadata announces {config.n_layer_nextn} MTP "
                  f"block(s) but the file has none of its tensors (blk.{config.n_layer}.*)")
    elif missing:
        insp.report.has_mtp = False
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        insp.warn(f"{_MTP_WARNING_PREFIX}: the MTP block is incomplete, missing {shown}")
    elif config.n_layer_nextn > 1:
        insp.report.has_mtp = False
        insp.warn(f"{_MTP_WARNING_PREFIX}: {config.n_layer_nextn} MTP blocks; only one is supported")
    else:
        insp.report.has_mtp = True

    known = {s.name for s in specs}
    extra = sorted(set(present) - known)
    if extra:
        shown = ", ".join(extra[:6]) + (f" and {len(extra) - 6} more" if len(extra) > 6 else "")
        insp.warn(f"{len(extra)} tensor(s) are not part of the {ARCH} layout and are ignored: {shown}")


def _check_one(insp: _Inspection, spec: TensorSpec, t: TensorInfo) -> None:
    if _pad4(t.ne) != _pad4(spec.ne):
        insp.error(TensorShapeError(insp.path, spec.name, spec.ne, t.ne))
        return
    if t.ggml_type not in SUPPORTED_TENSOR_TYPES:
        insp.error(UnsupportedTensorTypeError(insp.path, spec.name, t.ggml_type,
                                              SUPPORTED_TENSOR_TYPES))
        return
    block = GGML_QUANT_SIZES[GGMLQuantizationType[t.ggml_type]][0]
    if t.ne[0] % block:
        insp.error(TensorShapeError(insp.path, spec.name, spec.ne, t.ne,
                                    f"a {t.ggml_type} row must be a multiple of {block} values"))


def _pad4(ne: tuple[int, ...]) -> tuple[int, ...]:
    """ggml compares shapes as 4 dims with trailing 1s (a [n] vector equals [n, 1])."""
    return tuple(ne) + (1,) * (4 - len(ne))


# --- metadata helpers ---------------------------------------------------------------------------

def _type_name(tensor_type: int) -> str:
    return GGMLQuantizationType(int(tensor_type)).name


def _vtype(f) -> str:
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        inner = f.types[-1].name if len(f.types) > 1 else "empty"
        return f"an ARRAY of {inner}"
    return f"a {f.types[0].name}" if f.types else "no value"


def _field_value(f) -> Any:
    if f.types and f.types[0] == GGUFValueType.ARRAY and len(f.data) > METADATA_ARRAY_LIMIT:
        return ArrayPreview(len(f.data), f.types[-1].name, tuple(f.contents(slice(0, 4))))
    try:
        return f.contents()
    except UnicodeDecodeError:
        return "<invalid UTF-8>"


def _metadata_dict(reader: GGUFReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the parser's own header pseudo-fields
        v = _field_value(f)
        if isinstance(v, np.generic):
            v = v.item()
        out[key] = v
    return out


def _string_field(reader: GGUFReader, key: str) -> str | None:
    f = reader.fields.get(key)
    if f is None or f.types != [GGUFValueType.STRING]:
        return None
    return f.contents()


def _tokenizer_fields(reader: GGUFReader) -> TokenizerFields:
    def arr(key: str) -> list:
        f = reader.fields.get(key)
        return [] if f is None or not f.types or f.types[0] != GGUFValueType.ARRAY else f.contents()

    def scalar(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    return TokenizerFields(
        model=_string_field(reader, "tokenizer.ggml.model"),
        pre=_string_field(reader, "tokenizer.ggml.pre"),
        tokens=arr(TOKENS_KEY),
        merges=arr("tokenizer.ggml.merges"),
        token_type=[int(x) for x in arr("tokenizer.ggml.token_type")],
        bos_id=_opt_int(scalar("tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(scalar("tokenizer.ggml.eos_token_id")),
        padding_id=_opt_int(scalar("tokenizer.ggml.padding_token_id")),
        add_bos=None if scalar("tokenizer.ggml.add_bos_token") is None
        else bool(scalar("tokenizer.ggml.add_bos_token")),
    )


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# --- walking the layout before the parser does ------------------------------------------------------

_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


class _Layout:
    """A bounds-checked walk over the GGUF layout (header, metadata, tensor descriptions, data
    ranges) that says where and how the file is broken, where the parser's errors are vague."""

    def __init__(self, path: str, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def take(self, n: int, where: str) -> int:
        start = self.pos
        if start + n > self.size:
            raise TruncatedFileError(self.path, where, start + n, self.size)
        self.pos += n
        return start

    def u32(self, where: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, where))[0]

    def u64(self, where: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, where))[0]

    def string(self, where: str) -> str:
        n = self.u64(where)
        start = self.take(n, where)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, f"{where}: a string is not valid UTF-8") from None

    def value(self, vtype: int, where: str, depth: int = 0) -> Any:
        try:
            t = GGUFValueType(vtype)
        except ValueError:
            raise ModelFileError(self.path, f"{where}: unknown value type id {vtype}") from None
        if t in _SCALAR_SIZES:
            start = self.take(_SCALAR_SIZES[t], where)
            return self.buf[start:start + _SCALAR_SIZES[t]]
        if t == GGUFValueType.STRING:
            return self.string(where)
        if depth > 2:
            raise ModelFileError(self.path, f"{where}: arrays nested too deeply")
        etype = self.u32(where)
        count = self.u64(where)
        if count * 8 > self.size - self.pos and etype == GGUFValueType.STRING:
            # each string needs at least its 8-byte length: fail now, not after `count` reads
            raise TruncatedFileError(self.path, where, self.pos + count * 8, self.size)
        scalar = next((n for t_, n in _SCALAR_SIZES.items() if int(t_) == etype), None)
        if scalar is not None:
            self.take(count * scalar, where)   # skipped in one step: token_type has 248k entries
        else:
            for _ in range(count):
                self.value(etype, where, depth + 1)
        return None

    def walk(self) -> None:
        header = "the GGUF header"
        if bytes(self.buf[self.take(4, header):4]) != GGUF_MAGIC:
            raise NotGGUFError(self.path, "not a GGUF file (bad magic)")
        version = self.u32(header)
        if version & 0xFFFF == 0:
            raise ModelFileError(self.path, "this GGUF is big-endian; the engine reads "
                                            "little-endian files only")
        if version not in READABLE_GGUF_VERSIONS:
            raise NotGGUFError(self.path, f"GGUF version {version} cannot be read "
                                          f"(readable: {list(READABLE_GGUF_VERSIONS)})")
        n_tensors = self.u64(header)
        n_kv = self.u64(header)
        alignment = DEFAULT_ALIGNMENT
        keys: set[str] = set()
        for i in range(n_kv):
            key = self.string(f"metadata entry #{i} (of {n_kv})")
            where = f"metadata key {key!r}"
            if key in keys:
                raise ModelFileError(self.path, f"metadata key {key!r} appears twice")
            keys.add(key)
            vtype = self.u32(where)
            raw = self.value(vtype, where)
            if key == "general.alignment":
                if vtype != GGUFValueType.UINT32:
                    raise InvalidMetadataError(self.path, key, None, "must be a UINT32")
                alignment = struct.unpack("<I", raw)[0]
        if alignment == 0 or alignment & (alignment - 1):
            raise InvalidMetadataError(self.path, "general.alignment", alignment,
                                       "must be a power of two")

        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = self.string(f"the description of tensor #{i} (of {n_tensors})")
            where = f"the description of tensor {name!r}"
            if name in names:
                raise ModelFileError(self.path, f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = self.u32(where)
            if n_dims > 4:
                raise ModelFileError(self.path, f"tensor {name!r} has {n_dims} dimensions (at most 4)")
            ne = [self.u64(where) for _ in range(n_dims)]
            type_id = self.u32(where)
            offset = self.u64(where)
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedTensorTypeError(self.path, name, f"unknown type id {type_id}",
                                                 SUPPORTED_TENSOR_TYPES) from None
            infos.append((name, ne, qtype, offset))

        data_start = -(-self.pos // alignment) * alignment
        ends = []
        for name, ne, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = math.prod(ne)
            if ne and ne[0] % block:
                raise TensorShapeError(self.path, name, tuple(ne), tuple(ne),
                                       f"a {qtype.name} row must be a multiple of {block} values")
            ends.append((data_start + offset, data_start + offset + n_elements // block * type_size,
                         name))
        for start, end, name in sorted(ends):
            if end > self.size:
                raise TruncatedFileError(self.path, f"the data of tensor {name!r}", end, self.size)


def _scan_layout(path: str, size: int) -> ModelFileError | None:
    """The first structural problem of the file (where it is cut short, ...), or None."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            _Layout(path, buf, size).walk()
        except ModelFileError as exc:
            return exc
    return None
