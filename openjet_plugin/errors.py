"""Every exception type the package raises.

Model-file problems are `ModelFileError`s (also `ValueError`s, so generic callers can catch what
they already catch); each carries the file's path and the culprit (key, tensor, shapes, type) as
attributes, and its message names both in plain words, so that `str(exc)` alone tells a user what
is wrong with which file.
"""

from __future__ import annotations

import os


class OpenJetError(Exception):
    """Base of every error this package raises on purpose."""


# --- model files ------------------------------------------------------------------------------

class ModelFileError(OpenJetError, ValueError):
    """A model file cannot be used. `path` is the file; the message says why."""

    def __init__(self, path: str | os.PathLike[str], message: str):
        self.path = os.fspath(path)
        self.reason = message
        super().__init__(f"{self.path}: {message}")


class NotGGUFError(ModelFileError):
    """The file is not a GGUF model at all (wrong magic, a text file, a directory, empty)."""


class TruncatedFileError(ModelFileError):
    """The file ends before the data its own header announces (an interrupted download or copy).

    `where` says which part was cut (header, a metadata key, a tensor's description, a tensor's data).
    """

    def __init__(self, path: str | os.PathLike[str], where: str, needed: int | None = None,
                 file_size: int | None = None):
        self.where = where
        self.needed = needed
        self.file_size = file_size
        msg = f"the file is truncated: it ends inside {where}"
        if needed is not None and file_size is not None:
            msg += f" (needs at least {needed} bytes, the file has {file_size})"
        super().__init__(path, msg + "; the download or copy was probably interrupted")


class WrongArchitectureError(ModelFileError):
    def __init__(self, path: str | os.PathLike[str], architecture: object, expected: str = "qwen35"):
        self.architecture = architecture
        self.expected = expected
        super().__init__(
            path,
            f"general.architecture is {architecture!r}, but this engine only runs {expected!r} "
            f"models (the Qwen3.5/3.6/3.8 dense family)",
        )


class MissingKeyError(ModelFileError):
    def __init__(self, path: str | os.PathLike[str], key: str):
        self.key = key
        super().__init__(path, f"required metadata key {key!r} is missing")


class InvalidMetadataError(ModelFileError):
    """A metadata key is present but has the wrong type or a value the model cannot have."""

    def __init__(self, path: str | os.PathLike[str], key: str, value: object, problem: str):
        self.key = key
        self.value = value
        self.problem = problem
        super().__init__(path, f"metadata key {key!r} = {_short(value)}: {problem}")


class MissingTensorError(ModelFileError):
    def __init__(self, path: str | os.PathLike[str], tensor: str):
        self.tensor = tensor
        super().__init__(path, f"required tensor {tensor!r} is missing")


class TensorShapeError(ModelFileError):
    """A tensor's shape (ggml `ne` order: input dimension first) differs from what the metadata implies."""

    def __init__(self, path: str | os.PathLike[str], tensor: str, expected: tuple[int, ...],
                 actual: tuple[int, ...], detail: str = ""):
        self.tensor = tensor
        self.expected = tuple(expected)
        self.actual = tuple(actual)
        msg = (f"tensor {tensor!r} has shape {list(self.actual)}, expected {list(self.expected)} "
               f"(ggml ne order)")
        if detail:
            msg += f": {detail}"
        super().__init__(path, msg)


class UnsupportedTensorTypeError(ModelFileError):
    def __init__(self, path: str | os.PathLike[str], tensor: str, ggml_type: str,
                 supported: tuple[str, ...] | None = None):
        self.tensor = tensor
        self.ggml_type = ggml_type
        self.supported = supported
        msg = f"tensor {tensor!r} has type {ggml_type}, which this engine does not support"
        if supported:
            msg += f" (supported: {', '.join(supported)}); re-quantise the model, e.g. to Q4_K_M"
        super().__init__(path, msg)


# --- runtime ----------------------------------------------------------------------------------

class BackendUnavailableError(OpenJetError, RuntimeError):
    """The requested backend cannot run here (no GPU, library not built, package missing)."""


class NativeEngineError(OpenJetError, RuntimeError):
    """The native engine returned an error code; `code` is that code, the message its text."""

    def __init__(self, code: int, message: str):
        self.code = code
        super().__init__(f"native engine error {code}: {message}")


class ContextOverflowError(OpenJetError, ValueError):
    def __init__(self, n_tokens: int, n_ctx: int, message: str | None = None):
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx
        super().__init__(message or (
            f"{n_tokens} tokens do not fit the context window of {n_ctx} tokens; "
            f"shorten the prompt or load the model with a larger n_ctx"))


# --- warnings ---------------------------------------------------------------------------------

class MTPMissingWarning(UserWarning):
    """The model has no usable MTP (nextn) block, so speculative decoding is off."""


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
