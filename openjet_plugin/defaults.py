"""The embedded default model: what `load()` and `openjet generate` use when no model is named.

A shipped file `openjet_plugin/data/default.gguf` wins. Without one, the package generates the tiny
qwen35 model once (fixed seed, Q8_0) into a cache directory — `$OPENJET_CACHE_DIR`, else
`~/.cache/openjet` — and reuses it afterwards. Generation writes a temporary file and renames it
into place under a file lock, so two processes starting together neither clash nor see half a file.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from . import __version__

DEFAULT_PRESET = "tiny"
DEFAULT_QUANT = "Q8_0"
DEFAULT_SEED = 0

SHIPPED_DEFAULT = Path(__file__).resolve().parent / "data" / "default.gguf"


def cache_dir() -> Path:
    env = os.environ.get("OPENJET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "openjet"


def generated_default_path() -> Path:
    # the package version is in the name: a release that generates a different model never
    # picks up an older release's file
    name = f"default-{DEFAULT_PRESET}-{DEFAULT_QUANT}-seed{DEFAULT_SEED}-v{__version__}.gguf"
    return cache_dir() / name


def default_model_path() -> Path:
    """Path of the default model file, generating it first if needed (a few seconds, once)."""
    if SHIPPED_DEFAULT.is_file():
        return SHIPPED_DEFAULT
    target = generated_default_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if target.is_file():          # another process made it while we waited for the lock
            return target
        from .testing.synth import synth_model

        tmp = target.with_name(f".{target.stem}.{os.getpid()}.tmp.gguf")
        try:
            with _quiet_stderr():       # llama.cpp's quantiser logs every tensor
                synth_model(tmp, preset=DEFAULT_PRESET, quant=DEFAULT_QUANT, seed=DEFAULT_SEED, force=True)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return target


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 (C libraries write there directly) to a temporary file for the block;
    if the block fails, what was written is replayed so the error keeps its context."""
    import sys
    import tempfile

    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # no real stderr (e.g. captured by a host app)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), fd)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            if not ok:
                log.seek(0)
                sys.stderr.write(log.read().decode("utf-8", errors="replace")[-4000:])


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock held for the block (fcntl where it exists; elsewhere the
    atomic rename alone keeps readers from seeing a partial file)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
