"""cffi (ABI mode) binding of the native engine; the declarations come from `native/openjet.h`.

The header is the single source of truth: `cdef_source()` feeds it to `ffi.cdef` after dropping
preprocessor lines and everything inside `#ifdef __cplusplus` blocks. Nothing here repeats a
declaration by hand.

`load()` returns a `NativeLibrary` (ffi + lib) or raises `BackendUnavailableError` saying why;
`check(lib, rc, engine)` turns a status code into a `NativeEngineError` with the engine's message.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import BackendUnavailableError, NativeEngineError

PACKAGE_NATIVE_DIR = Path(__file__).resolve().parent / "native"
SOURCE_HEADER = Path(__file__).resolve().parent.parent / "native" / "openjet.h"
LIB_NAME = "libopenjet.so"
LIB_ENV = "OPENJET_NATIVE_LIB"


def header_path() -> Path:
    """The copy beside the library (the folder of OPENJET_NATIVE_LIB's library when it has one: a
    library built from another tree, an A/B's candidate, carries the header of its own ABI), else
    the package's, else the source tree's."""
    places = [library_path().parent / "openjet.h", PACKAGE_NATIVE_DIR / "openjet.h", SOURCE_HEADER]
    for p in places:
        if p.is_file():
            return p
    raise BackendUnavailableError(
        f"native/openjet.h not found (looked in {', '.join(str(p.parent) for p in dict.fromkeys(places))})")


def cdef_source(header_text: str) -> str:
    """The header as ffi.cdef accepts it: no preprocessor lines, no C++-only blocks."""
    out: list[str] = []
    depth = 0            # nesting of #if blocks
    skip_from: int | None = None   # depth at which a `#ifdef __cplusplus` block started
    for line in header_text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            directive = s[1:].strip()
            if directive.startswith("if"):          # if, ifdef, ifndef
                depth += 1
                if skip_from is None and "__cplusplus" in directive and not directive.startswith("ifndef"):
                    skip_from = depth
            elif directive.startswith("endif"):
                if skip_from == depth:
                    skip_from = None
                depth -= 1
            continue
        if skip_from is None:
            out.append(line)
    return "\n".join(out)


def library_path() -> Path:
    env = os.environ.get(LIB_ENV)
    if env:
        return Path(env)
    return PACKAGE_NATIVE_DIR / LIB_NAME


@dataclass(frozen=True)
class NativeLibrary:
    ffi: object
    lib: object
    path: Path


_lock = threading.Lock()
_cached: NativeLibrary | None = None


def make_ffi():
    """An FFI with the header's declarations (no library needed: tests parse the header with it)."""
    try:
        from cffi import FFI
    except ImportError as e:   # pragma: no cover - cffi is a dependency
        raise BackendUnavailableError(f"the cffi package is not installed ({e})") from e
    ffi = FFI()
    ffi.cdef(cdef_source(header_path().read_text()))
    return ffi


def load() -> NativeLibrary:
    """Load the built library once per process; BackendUnavailableError says why it cannot be."""
    global _cached
    with _lock:
        if _cached is not None:
            return _cached
        path = library_path()
        if not path.is_file():
            raise BackendUnavailableError(
                f"native library {path} is not built (run `python -m openjet_plugin.build_native` "
                f"with a CUDA toolkit installed, or set {LIB_ENV})")
        ffi = make_ffi()
        try:
            lib = ffi.dlopen(str(path))
        except OSError as e:
            raise BackendUnavailableError(f"cannot load {path}: {e}") from e
        if int(lib.oj_abi_version()) != int(lib.OJ_ABI_VERSION):
            raise BackendUnavailableError(
                f"{path} has ABI version {lib.oj_abi_version()}, the header {header_path()} "
                f"{lib.OJ_ABI_VERSION}; rebuild it (or put its own openjet.h beside it)")
        _cached = NativeLibrary(ffi, lib, path)
        return _cached


def last_error(nl: NativeLibrary, engine=None) -> str:
    ffi = nl.ffi
    msg = nl.lib.oj_last_error(engine if engine is not None else ffi.NULL)
    return ffi.string(msg).decode("utf-8", "replace")


def check(nl: NativeLibrary, rc: int, engine=None, what: str = "") -> None:
    """Raise NativeEngineError for a non-zero status, with the native message."""
    if rc != 0:
        msg = last_error(nl, engine)
        raise NativeEngineError(int(rc), f"{what}: {msg}" if what else msg)
