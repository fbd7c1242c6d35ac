"""The NVIDIA GPUs this process can see, asked of nvidia-smi (no CUDA library needed): what the
llama.cpp placement, the native engine's refusal message and `openjet doctor` say about the GPU."""

from __future__ import annotations

import os
import shutil
import subprocess


def first_gpu() -> tuple[str, int] | None:
    """(name, free bytes) of the first GPU this process may use (CUDA_VISIBLE_DEVICES), or None."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        lines = [lines[i] for i in ids if i < len(lines)]
    if not lines:
        return None
    name, _, free_mib = lines[0].rpartition(",")
    try:
        return name.strip(), int(free_mib.strip()) << 20
    except ValueError:
        return None
