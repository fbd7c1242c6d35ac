"""nvcc for the tests that compile CUDA here and in CI (no GPU needed to compile)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def find_nvcc() -> str | None:
    """nvcc on PATH, else /usr/local/cuda/bin/nvcc, else None (the caller skips and says why)."""
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def build_host_tool(out: Path, sources: list[str], what: str) -> Path:
    """Compile a CUDA host program of native/tools (`sources`, paths from the repository root) for
    sm_90 into `out`; skip, saying `what` needs nvcc, where there is none; fail with nvcc's output."""
    import pytest

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip(f"nvcc not found (PATH or /usr/local/cuda/bin): {what} is a CUDA host program")
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-Inative", *sources, "-o", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"nvcc failed:\n{r.stdout}\n{r.stderr}"
    return out
