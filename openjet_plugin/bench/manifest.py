"""The run manifest: what was measured, on what, with which code, when, and how it was invoked.

Every field that cannot be read on this machine says "unavailable: <why>" instead of failing, so
the manifest can be collected anywhere (the tests do it without a GPU). The GPU's state (clocks,
power limit, temperature, ...) is read at the start and at the end of a run.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from . import smi
from .smi import UNAVAILABLE

REPO_ROOT = Path(__file__).resolve().parents[2]
# what the project's source digest covers (works where the tree travels without .git)
_SOURCE_GLOBS = ("openjet_plugin/**/*.py", "native/*.cu", "native/*.cuh", "native/*.h", "adapters/*.py",
                 "pyproject.toml")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def source_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over the project's source files (relative names and bytes), sorted by name."""
    h = hashlib.sha256()
    files = sorted({p for g in _SOURCE_GLOBS for p in root.glob(g) if p.is_file()})
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


# environment variables that select the native engine's code paths (native/*.cu getenv; the
# OPENJET_PREFILL_* switches are read by backends/native.py): recorded with every run so that an
# A/B of a switch says which side each file is
ENGINE_SWITCHES = ("OPENJET_PREFILL_GEMM", "OPENJET_PREFILL_DELTANET", "OPENJET_PREFILL_ATTN")


def engine_switches(environ=None) -> dict:
    """The engine switches set in `environ` (default os.environ): ENGINE_SWITCHES and every OJ_*."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k in ENGINE_SWITCHES or k.startswith("OJ_")}


def project_info() -> dict:
    """Commit (git, else $OPENJET_COMMIT for a tree copied without .git), dirty flag, source digest."""
    commit = _git("rev-parse", "HEAD")
    info: dict = {}
    if os.environ.get("OPENJET_COMMIT"):
        # said explicitly by whoever copied the tree (a copy may carry a stale .git of its own)
        info["commit"] = os.environ["OPENJET_COMMIT"]
        info["dirty"] = f"{UNAVAILABLE}: commit from $OPENJET_COMMIT" + (f" (the copy's git says {commit})" if commit else "")
    elif commit:
        info["commit"] = commit
        status = _git("status", "--porcelain", "--untracked-files=no")
        info["dirty"] = bool(status) if status is not None else f"{UNAVAILABLE}: git status failed"
    elif os.environ.get("OPENJET_COMMIT"):
        info["commit"] = os.environ["OPENJET_COMMIT"]
        info["dirty"] = f"{UNAVAILABLE}: no git repository here; commit from $OPENJET_COMMIT"
    else:
        info["commit"] = f"{UNAVAILABLE}: no git repository and $OPENJET_COMMIT unset"
        info["dirty"] = UNAVAILABLE
    info["source_sha256"] = source_digest()
    from .. import __version__
    info["version"] = __version__
    return info


def model_sha256(path: Path, cache_file: Path | None = None, chunk: int = 16 << 20) -> str:
    """sha256 of a (large) file, streamed; cached in `cache_file` by path, size and mtime."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache: dict = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if key in cache:
            return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    digest = h.hexdigest()
    if cache_file is not None:
        cache[key] = digest
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(cache_file.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, cache_file)
    return digest


def model_fingerprint(path: Path, span: int = 16 << 20) -> str:
    """A fast content check (size + sha256 of the first and last 16 MiB): what the resume folder
    is keyed by, so a model regenerated with the same bytes on a fresh machine still matches."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            h.update(f.read(span))
    return h.hexdigest()


def nvcc_version() -> str:
    try:
        r = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{UNAVAILABLE}: nvcc ({type(exc).__name__})"
    m = re.search(r"release ([0-9.]+), (V[0-9.]+)", r.stdout)
    return f"{m.group(1)} ({m.group(2)})" if m else f"{UNAVAILABLE}: {r.stdout.strip()[-80:]}"


def gpu_state(index: int = 0) -> dict:
    """The card's current state (nvidia-smi), stamped with the time it was read."""
    state = smi.query(index=index)
    state["read_at"] = utc_now()
    return state


def collect(argv: list[str], *, gpu_index: int = 0) -> dict:
    """The parts of the manifest known at the start of a run."""
    ok, presence = smi.gpu_presence(gpu_index)
    start = gpu_state(gpu_index)
    return {
        "date": utc_now(),
        "command": shlex.join(sys.argv),
        "executable": sys.executable,
        "bench_argv": list(argv),
        "project": project_info(),
        "engine_switches": engine_switches(),
        "gpu": {
            "index": gpu_index,
            "present": ok,
            "listing": presence,
            "name": start.get("name", UNAVAILABLE),
            "sm_count": f"{UNAVAILABLE}: read by the roofline probe (CUDA), which has not run",
            "compute_cap": start.get("compute_cap", UNAVAILABLE),
            "driver": start.get("driver_version", UNAVAILABLE),
            "cuda_driver_version": smi.cuda_driver_version(),
            "cuda_toolkit": nvcc_version(),
            "state_start": start,
            "state_end": f"{UNAVAILABLE}: the run has not finished",
        },
        "host": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
    }


def finish(manifest: dict, gpu_index: int = 0) -> dict:
    manifest["gpu"]["state_end"] = gpu_state(gpu_index)
    manifest["date_end"] = utc_now()
    return manifest
