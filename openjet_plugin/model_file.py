"""Open a qwen35 GGUF, read its `ModelConfig` and check every tensor against `tensors.py`.

    open_model(path) -> ModelFile          raises the first problem (a ModelFileError subclass)
    validate(path)   -> ValidationReport   collects every problem instead of raising
    describe(path)   -> str                the text `openjet info` prints

The file is memory-mapped read-only; nothing is copied or written. The checks run in the order a
loader depends on them, and a failed stage stops the later ones (tensor shapes derived from a
nonsense head count would only add noise):

  1. structure: a GGUF at all, not cut short anywhere (header, metadata, tensor descriptions,
     tensor data: every tensor's byte range is compared with the file size);
  2. `general.architecture == "qwen35"`;
  3. hyperparameters -> ModelConfig, then sanity (positive sizes, head counts that divide, ...);
  4. vocabulary: the tokenizer's token count must equal token_embd's rows; tokens and merges
     decode as UTF-8, token_type has one entry per token, bos/eos/padding ids are token ids;
  5. every tensor of `all_tensors(config)`: present, shape, type in SUPPORTED_TENSOR_TYPES.

Why not `gguf.GGUFReader`: it builds a numpy view per array element while opening, which took
42 s on a file with the 27B's vocabulary (248k tokens, 248k merges, 248k token types), does not
check every length against the file size (a corrupted count makes it loop for a long time), and
fails on a cut file with a bare IndexError. The layout walk below (`_GGUFLayout`) reads the same
format (gguf-py's constants, GGML_QUANT_SIZES) in about a second, bounds-checking every read, and
decodes metadata values only when asked. tests/test_model_file.py checks it against GGUFReader.

MTP policy: a file without a usable MTP block still loads, with `has_mtp = False` and an
`MTPMissingWarning` (speculation off). "Unusable" means nextn_predict_layers == 0, no MTP tensors
at all, some required MTP tensors missing (the warning names them), or more than one MTP block.
We turn speculation off rather than refuse the file because the main model is complete and
llama.cpp also runs such files without MTP. An MTP tensor that is *present* with a wrong shape or
type is still an error: that is a damaged file, not a model without MTP. `config` always
describes the file as written (`n_layer_nextn` as in its metadata); `has_mtp` says whether the
block can be used.
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
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
MERGES_KEY = "tokenizer.ggml.merges"
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

    close() unmaps the file at once unless a TensorInfo.data view obtained earlier is still
    referenced; such a view keeps its mapping alive (it never dangles) until it is dropped.
    """

    def __init__(self, path: str, layout: "_GGUFLayout", config: ModelConfig, has_mtp: bool,
                 tensors: dict[str, TensorInfo], tokenizer: TokenizerFields | None = None):
        self.path = path
        self.config = config
        self.has_mtp = has_mtp
        self._layout: _GGUFLayout | None = layout
        self.tensors = tensors
        self.metadata: dict[str, Any] = layout.metadata_dict()
        self.chat_template: str | None = layout.string_or_none(CHAT_TEMPLATE_KEY)
        if tokenizer is not None:
            self.__dict__["tokenizer_fields"] = tokenizer   # already decoded while validating

    def tensor_type_counts(self) -> dict[str, int]:
        return dict(Counter(t.ggml_type for t in self.tensors.values()))

    @cached_property
    def tokenizer_fields(self) -> TokenizerFields:
        if self._layout is None:
            raise ValueError(f"{self.path}: the model file is closed")
        return self._layout.tokenizer_fields()

    @property
    def closed(self) -> bool:
        return self._layout is None

    def close(self) -> None:
        self.tensors = {}
        if self._layout is not None:
            self._layout.close()
            self._layout = None

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


@dataclass
class ForeignModel:
    """What the engine needs of a GGUF the native engine does not take (another architecture),
    which llama.cpp then runs: its metadata, chat template, vocabulary (for the end-of-generation
    tokens) and sizes."""

    architecture: str
    metadata: dict[str, Any]
    chat_template: str | None
    tokenizer: TokenizerFields
    n_layers: int | None            # <arch>.block_count
    n_ctx_train: int | None         # <arch>.context_length


def read_foreign(path: str | os.PathLike[str]) -> ForeignModel:
    """Read any readable GGUF without checking it as a qwen35 model. Raises the ModelFileError
    that makes it unusable as a GGUF at all (not a GGUF, cut short, a broken tokenizer)."""
    insp = _Inspection(os.fspath(path))
    try:
        layout = _open_layout(insp)
    except _Stop:
        raise insp.report.errors[0] from None
    try:
        arch = layout.string_or_none("general.architecture") or "unknown"

        def int_or_none(key: str) -> int | None:
            f = layout.fields.get(key)
            v = layout.value(f) if f is not None else None
            return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

        return ForeignModel(arch, layout.metadata_dict(), layout.string_or_none(CHAT_TEMPLATE_KEY),
                            layout.tokenizer_fields(), int_or_none(f"{arch}.block_count"),
                            int_or_none(f"{arch}.context_length"))
    finally:
        layout.close()


def validate(path: str | os.PathLike[str]) -> ValidationReport:
    """Check `path` and collect every problem. Raises only OSError (no such file, no permission)."""
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
            f"layers: {c.n_layer} main ({_layer_kinds(c)}) + {c.n_layer_nextn} MTP",
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
        mtp = ("present (speculative decoding available)" if report.has_mtp
               else "absent or incomplete (speculative decoding off)")
        lines.append(f"MTP block: {mtp}")
    lines.append("verdict: OK" if report.ok
                 else f"verdict: NOT USABLE ({len(report.errors)} problem(s))")
    lines += [f"  error: {e.reason}" for e in report.errors]
    lines += [f"  warning: {w}" for w in report.warnings]
    return "\n".join(lines)


def _layer_kinds(c: ModelConfig) -> str:
    # counted, not listed: describe() also reports files whose values are nonsense (an interval
    # of 0, four billion layers) and must neither divide by zero nor loop over them
    if c.full_attention_interval < 1 or c.n_layer < 0:
        return f"full_attention_interval {c.full_attention_interval} is invalid"
    n_attn = c.n_layer // c.full_attention_interval
    return (f"{c.n_layer - n_attn} Gated DeltaNet, {n_attn} full attention, "
            f"every {c.full_attention_interval}th")


# --- the checks ---------------------------------------------------------------------------------

_MTP_WARNING_PREFIX = "speculative decoding is off"


class _Stop(Exception):
    """A stage failed; later stages depend on it, so the inspection ends here."""


class _Inspection:
    def __init__(self, path: str):
        self.path = path
        self.report = ValidationReport(path=path)
        self.layout: _GGUFLayout | None = None
        self.tensors: dict[str, TensorInfo] = {}
        self.tokenizer: TokenizerFields | None = None

    def error(self, exc: ModelFileError) -> None:
        self.report.errors.append(exc)

    def stop(self, exc: ModelFileError) -> None:
        self.error(exc)
        raise _Stop

    def warn(self, message: str) -> None:
        self.report.warnings.append(message)

    def release(self) -> None:
        self.tensors = {}
        if self.layout is not None:
            self.layout.close()
            self.layout = None

    def model_file(self) -> ModelFile:
        assert self.layout is not None and self.report.config is not None
        mf = ModelFile(self.path, self.layout, self.report.config, self.report.has_mtp, self.tensors,
                       self.tokenizer)
        self.layout, self.tensors = None, {}
        return mf


def _inspect(path: str | os.PathLike[str]) -> _Inspection:
    insp = _Inspection(os.fspath(path))
    try:
        layout = _open_layout(insp)
        insp.layout = layout
        insp.tensors = layout.tensor_infos()
        insp.report.n_tensors = len(insp.tensors)
        insp.report.type_counts = dict(Counter(t.ggml_type for t in insp.tensors.values()))
        _check_architecture(insp, layout)
        config = _read_config(insp, layout)
        _check_vocabulary(insp, config)
        _check_tokenizer(insp, layout, config)
        _check_tensors(insp, config)
    except _Stop:
        pass
    except BaseException:
        insp.release()    # an unexpected failure must not leave the file mapped
        raise
    return insp


def _open_layout(insp: _Inspection) -> "_GGUFLayout":
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
            insp.stop(NotGGUFError(path, f"not a GGUF file: it starts with {head!r}, a GGUF "
                                         f"starts with {GGUF_MAGIC!r}"))
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    layout = _GGUFLayout(path, buf, size)
    try:
        layout.walk()
    except ModelFileError as exc:
        layout.close()
        insp.stop(exc)
    return layout


def _check_architecture(insp: _Inspection, layout: "_GGUFLayout") -> None:
    key = "general.architecture"
    f = layout.fields.get(key)
    if f is None:
        insp.stop(MissingKeyError(insp.path, key))
    if f.type != GGUFValueType.STRING:
        insp.stop(InvalidMetadataError(insp.path, key, layout.preview(f), "expected a string"))
    try:
        arch = layout.value(f)
    except ModelFileError as exc:
        insp.stop(exc)
    if arch != ARCH:
        insp.stop(WrongArchitectureError(insp.path, arch, ARCH))


def _read_config(insp: _Inspection, layout: "_GGUFLayout") -> ModelConfig:
    path = insp.path
    tokens = layout.fields.get(TOKENS_KEY)
    if tokens is None:
        insp.stop(MissingKeyError(path, TOKENS_KEY))
    if tokens.type != GGUFValueType.ARRAY or tokens.element_type != GGUFValueType.STRING:
        insp.stop(InvalidMetadataError(path, TOKENS_KEY, layout.preview(tokens),
                                       "expected an array of strings (the vocabulary)"))
    n_vocab = tokens.count
    if n_vocab == 0:
        insp.stop(InvalidMetadataError(path, TOKENS_KEY, [], "the vocabulary is empty"))

    get = _KeyReader(insp, layout)
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

    def __init__(self, insp: _Inspection, layout: "_GGUFLayout"):
        self.insp = insp
        self.layout = layout

    def __call__(self, key: str) -> Any:
        path, layout = self.insp.path, self.layout
        f = layout.fields.get(key)
        if f is None:
            default = _LLAMA_CPP_DEFAULTS.get(key)
            if default is None:
                raise MissingKeyError(path, key)
            value = default(self)
            self.insp.warn(f"metadata key {key!r} is missing; using llama.cpp's default {value!r}")
            return value
        kind = _KEY_KINDS.get(key, "int")
        if kind == "int":
            if f.type not in _INT_TYPES:
                raise InvalidMetadataError(path, key, layout.preview(f),
                                           f"expected an integer, the file has {f.describe_type()}")
            return int(layout.value(f))
        if kind == "float":
            if f.type not in _FLOAT_TYPES | _INT_TYPES:
                raise InvalidMetadataError(path, key, layout.preview(f),
                                           f"expected a number, the file has {f.describe_type()}")
            if f.type == GGUFValueType.FLOAT32:
                # the shortest decimal that is this float32 (1e-06, not 9.99999997e-07): the value
                # the converter meant, so configs read back compare equal to the ones written
                return float(str(np.float32(layout.value(f))))
            return float(layout.value(f))
        # int_array: llama.cpp's get_key_or_arr also takes a scalar for all four sections
        if f.type in _INT_TYPES:
            return [int(layout.value(f))] * 4
        if f.type != GGUFValueType.ARRAY or (f.count and f.element_type not in _INT_TYPES):
            raise InvalidMetadataError(path, key, layout.preview(f),
                                       f"expected an array of integers, the file has "
                                       f"{f.describe_type()}")
        if f.count > 4:
            raise InvalidMetadataError(path, key, layout.preview(f), "at most 4 entries are allowed")
        return [int(v) for v in layout.value(f)]


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
        "block_count": c.block_count,
    }
    bad = set()
    for name, value in positive.items():
        if value < 1:
            bad.add(name)
            yield k + name, value, "must be a positive integer"
    if c.block_count > LLAMA_MAX_LAYERS:
        yield (k + "block_count", c.block_count,
               f"more than llama.cpp's limit of {LLAMA_MAX_LAYERS} layers (a corrupt value?)")
    if "block_count" not in bad and (c.n_layer_nextn < 0 or c.n_layer < 1):
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


def _check_tokenizer(insp: _Inspection, layout: "_GGUFLayout", config: ModelConfig) -> None:
    """Decode the vocabulary and merges (the engine needs them anyway) and check that the ids and
    arrays agree, so that a broken tokenizer fails here by name instead of as an IndexError later."""
    path = insp.path
    try:
        tok = layout.tokenizer_fields()
    except ModelFileError as exc:   # a token that is not UTF-8, an id that is a string, ...
        insp.error(exc)
        return
    if tok.model == "gpt2" and MERGES_KEY not in layout.fields:
        insp.error(MissingKeyError(path, MERGES_KEY))   # llama.cpp needs merges for BPE too
    if tok.token_type and len(tok.token_type) != config.n_vocab:
        insp.error(InvalidMetadataError(
            path, "tokenizer.ggml.token_type", f"<{len(tok.token_type)} entries>",
            f"must have one entry per token ({TOKENS_KEY} has {config.n_vocab})"))
    for key, value in (("tokenizer.ggml.bos_token_id", tok.bos_id),
                       ("tokenizer.ggml.eos_token_id", tok.eos_id),
                       ("tokenizer.ggml.padding_token_id", tok.padding_id)):
        if value is not None and not 0 <= value < config.n_vocab:
            insp.error(InvalidMetadataError(path, key, value,
                                            f"is not a token id (the vocabulary has {config.n_vocab})"))
    insp.tokenizer = tok


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


# --- reading the GGUF layout --------------------------------------------------------------------

# struct formats of the scalar value types (little-endian; big-endian files are refused)
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_SCALAR_SIZES: dict[int, int] = {int(t): struct.calcsize("<" + f) for t, f in _SCALAR_FORMATS.items()}


@dataclass(frozen=True)
class _Field:
    """Where one metadata value lies. For an array, `offset` is its first element."""

    key: str
    type: GGUFValueType
    offset: int
    element_type: GGUFValueType | None = None
    count: int = 1

    def describe_type(self) -> str:
        if self.type == GGUFValueType.ARRAY:
            inner = self.element_type.name if self.element_type is not None else "?"
            return f"an ARRAY of {inner}" if self.count else "an empty ARRAY"
        return f"a {self.type.name}"


@dataclass(frozen=True)
class _TensorRecord:
    name: str
    ne: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int        # absolute
    n_bytes: int


class _GGUFLayout:
    """A bounds-checked walk over a memory-mapped GGUF: header, metadata (positions only; values
    are decoded on demand), tensor descriptions, and every tensor's byte range against the file
    size. Every error names the file and the place."""

    def __init__(self, path: str, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0
        self.fields: dict[str, _Field] = {}
        self.tensors: list[_TensorRecord] = []
        self.alignment = DEFAULT_ALIGNMENT
        self.data_start = 0
        self._bytes: np.ndarray | None = None

    # -- primitives (bounds-checked) --
    def _take(self, n: int, where: str) -> int:
        start = self.pos
        if start + n > self.size:
            raise TruncatedFileError(self.path, where, start + n, self.size)
        self.pos += n
        return start

    def _u32(self, where: str) -> int:
        return struct.unpack_from("<I", self.buf, self._take(4, where))[0]

    def _u64(self, where: str) -> int:
        return struct.unpack_from("<Q", self.buf, self._take(8, where))[0]

    def _name(self, where: str) -> str:
        n = self._u64(where)
        start = self._take(n, where)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, f"{where}: a name is not valid UTF-8") from None

    def _skip_value(self, vtype: int, where: str, depth: int = 0) -> None:
        size = _SCALAR_SIZES.get(vtype)
        if size is not None:
            self._take(size, where)
        elif vtype == GGUFValueType.STRING:
            self._take(self._u64(where), where)
        elif vtype == GGUFValueType.ARRAY:
            if depth > 2:
                raise ModelFileError(self.path, f"{where}: arrays nested too deeply")
            etype, count = self._u32(where), self._u64(where)
            self._skip_array(etype, count, where, depth)
        else:
            raise ModelFileError(self.path, f"{where}: unknown value type id {vtype}")

    def _skip_array(self, etype: int, count: int, where: str, depth: int) -> None:
        size = _SCALAR_SIZES.get(etype)
        if size is not None:
            self._take(count * size, where)     # one step even for 248k token types
        elif etype == GGUFValueType.STRING:
            # every string needs at least its 8-byte length: a corrupt count fails here at once
            if count * 8 > self.size - self.pos:
                raise TruncatedFileError(self.path, where, self.pos + count * 8, self.size)
            buf, pos, size_ = self.buf, self.pos, self.size
            unpack = struct.unpack_from
            for _ in range(count):              # the hot loop of opening a 248k vocabulary
                if pos + 8 > size_:
                    raise TruncatedFileError(self.path, where, pos + 8, size_)
                pos += 8 + unpack("<Q", buf, pos)[0]
            if pos > size_:
                raise TruncatedFileError(self.path, where, pos, size_)
            self.pos = pos
        else:
            for _ in range(count):
                self._skip_value(etype, where, depth + 1)

    # -- the walk --
    def walk(self) -> None:
        header = "the GGUF header"
        if self.buf[self._take(4, header):4] != GGUF_MAGIC:
            raise NotGGUFError(self.path, "not a GGUF file (bad magic)")
        version = self._u32(header)
        if version & 0xFFFF == 0:
            raise ModelFileError(self.path, "this GGUF is big-endian; the engine reads "
                                            "little-endian files only")
        if version not in READABLE_GGUF_VERSIONS:
            raise NotGGUFError(self.path, f"GGUF version {version} cannot be read "
                                          f"(readable: {list(READABLE_GGUF_VERSIONS)})")
        n_tensors = self._u64(header)
        n_kv = self._u64(header)

        for i in range(n_kv):
            key = self._name(f"metadata entry #{i} (of {n_kv})")
            where = f"metadata key {key!r}"
            if key in self.fields:
                raise ModelFileError(self.path, f"metadata key {key!r} appears twice")
            vtype = self._u32(where)
            if vtype == GGUFValueType.ARRAY:
                etype, count = self._u32(where), self._u64(where)
                f = _Field(key, GGUFValueType.ARRAY, self.pos, _value_type(self.path, etype, where),
                           count)
                self._skip_array(etype, count, where, 0)
            else:
                f = _Field(key, _value_type(self.path, vtype, where), self.pos)
                self._skip_value(vtype, where)
            self.fields[key] = f

        align = self.fields.get("general.alignment")
        if align is not None:
            if align.type != GGUFValueType.UINT32:
                raise InvalidMetadataError(self.path, align.key, self.preview(align),
                                           "must be a UINT32")
            self.alignment = self.value(align)
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise InvalidMetadataError(self.path, align.key, self.alignment,
                                           "must be a power of two")

        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = self._name(f"the description of tensor #{i} (of {n_tensors})")
            where = f"the description of tensor {name!r}"
            if name in names:
                raise ModelFileError(self.path, f"tensor {name!r} appears twice")
            names.add(name)
            n_dims = self._u32(where)
            if n_dims > 4:
                raise ModelFileError(self.path, f"tensor {name!r} has {n_dims} dimensions (at most 4)")
            ne = tuple(self._u64(where) for _ in range(n_dims))
            type_id = self._u32(where)
            offset = self._u64(where)
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedTensorTypeError(self.path, name, f"unknown type id {type_id}",
                                                 SUPPORTED_TENSOR_TYPES) from None
            infos.append((name, ne, qtype, offset))

        self.data_start = -(-self.pos // self.alignment) * self.alignment
        records = []
        for name, ne, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            if ne and ne[0] % block:
                raise TensorShapeError(self.path, name, ne, ne,
                                       f"a {qtype.name} row must be a multiple of {block} values")
            if offset % self.alignment:
                raise ModelFileError(self.path, f"tensor {name!r}: its data offset {offset} is not "
                                                f"a multiple of the alignment {self.alignment}")
            n_bytes = math.prod(ne) // block * type_size
            records.append(_TensorRecord(name, ne, qtype, self.data_start + offset, n_bytes))
        # the first tensor (by position) that runs past the end is where the file was cut
        for r in sorted(records, key=lambda r: r.offset):
            if r.offset + r.n_bytes > self.size:
                raise TruncatedFileError(self.path, f"the data of tensor {r.name!r}",
                                         r.offset + r.n_bytes, self.size)
        self.tensors = records

    # -- values, decoded on demand --
    def value(self, f: _Field, limit: int | None = None) -> Any:
        """The field's value: int/float/bool/str, or a list for an array (first `limit` items)."""
        if f.type != GGUFValueType.ARRAY:
            return self._read(f.type, f.offset, f.key)[0]
        n = f.count if limit is None else min(limit, f.count)
        fmt = _SCALAR_FORMATS.get(f.element_type)
        if fmt is not None:
            values = list(struct.unpack_from(f"<{n}{fmt}", self.buf, f.offset))
            return [bool(v) for v in values] if fmt == "?" else values
        out, pos = [], f.offset
        for _ in range(n):
            v, pos = self._read(f.element_type, pos, f.key)
            out.append(v)
        return out

    def _read(self, vtype: GGUFValueType, pos: int, key: str) -> tuple[Any, int]:
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            return struct.unpack_from("<" + fmt, self.buf, pos)[0], pos + _SCALAR_SIZES[int(vtype)]
        if vtype == GGUFValueType.STRING:
            n = struct.unpack_from("<Q", self.buf, pos)[0]
            try:
                return self.buf[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n
            except UnicodeDecodeError:
                raise InvalidMetadataError(self.path, key, "<bytes>",
                                           "a string in it is not valid UTF-8") from None
        # an array inside an array (the walk has bounded its nesting)
        etype = _value_type(self.path, struct.unpack_from("<I", self.buf, pos)[0], key)
        count = struct.unpack_from("<Q", self.buf, pos + 4)[0]
        out, pos = [], pos + 12
        for _ in range(count):
            v, pos = self._read(etype, pos, key)
            out.append(v)
        return out, pos

    def preview(self, f: _Field) -> Any:
        """The value for display: long arrays shortened to an ArrayPreview."""
        try:
            if f.type == GGUFValueType.ARRAY and f.count > METADATA_ARRAY_LIMIT:
                return ArrayPreview(f.count, f.element_type.name, tuple(self.value(f, limit=4)))
            return self.value(f)
        except ModelFileError:
            return "<invalid UTF-8>"

    def string_or_none(self, key: str) -> str | None:
        f = self.fields.get(key)
        if f is None or f.type != GGUFValueType.STRING:
            return None
        return self.value(f)

    def metadata_dict(self) -> dict[str, Any]:
        return {key: self.preview(f) for key, f in self.fields.items()}

    def tokenizer_fields(self) -> TokenizerFields:
        """The tokenizer.ggml.* values, type-checked (InvalidMetadataError names a wrong key)."""

        def get(key: str, types: frozenset, what: str, array: bool) -> Any:
            f = self.fields.get(key)
            if f is None:
                return None
            kind = f.element_type if f.type == GGUFValueType.ARRAY else f.type
            if (f.type == GGUFValueType.ARRAY) != array or (f.count and kind not in types):
                raise InvalidMetadataError(self.path, key, self.preview(f),
                                           f"expected {what}, the file has {f.describe_type()}")
            return self.value(f)

        strings = frozenset({GGUFValueType.STRING})
        ids = _INT_TYPES
        add_bos = get("tokenizer.ggml.add_bos_token", frozenset({GGUFValueType.BOOL}), "a BOOL", False)
        return TokenizerFields(
            model=get("tokenizer.ggml.model", strings, "a string", False),
            pre=get("tokenizer.ggml.pre", strings, "a string", False),
            tokens=get(TOKENS_KEY, strings, "an array of strings", True) or [],
            merges=get(MERGES_KEY, strings, "an array of strings", True) or [],
            token_type=get("tokenizer.ggml.token_type", ids, "an array of integers", True) or [],
            bos_id=get("tokenizer.ggml.bos_token_id", ids, "an integer token id", False),
            eos_id=get("tokenizer.ggml.eos_token_id", ids, "an integer token id", False),
            padding_id=get("tokenizer.ggml.padding_token_id", ids, "an integer token id", False),
            add_bos=add_bos,
        )

    # -- tensors --
    def tensor_infos(self) -> dict[str, TensorInfo]:
        if self._bytes is None:
            self._bytes = np.frombuffer(self.buf, dtype=np.uint8)   # read-only: ACCESS_READ
        return {
            r.name: TensorInfo(r.name, r.ne, r.qtype.name, r.n_bytes, r.offset,
                               self._bytes[r.offset:r.offset + r.n_bytes])
            for r in self.tensors
        }

    def close(self) -> None:
        self._bytes = None
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:
                pass    # a TensorInfo.data view is still held; the mapping goes with it
            self.buf = None


def _value_type(path: str, vtype: int, where: str) -> GGUFValueType:
    try:
        return GGUFValueType(vtype)
    except ValueError:
        raise ModelFileError(path, f"{where}: unknown value type id {vtype}") from None


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
