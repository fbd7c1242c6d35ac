"""Shared fixtures: generated models are made once per test session and reused by every file."""

from __future__ import annotations

import os

# OpenBLAS threads on 2 busy cores make the reference model's small products 2-10x slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import threading
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

_lock = threading.Lock()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def synth_path(model_dir):
    """`synth_path(preset, quant, seed=0) -> Path`: a generated qwen35 GGUF, made once per session."""
    from openjet_plugin.testing.synth import synth_model

    cache: dict[tuple, Path] = {}

    def make(preset: str = "tiny", quant: str = "Q8_0", seed: int = 0) -> Path:
        key = (preset, quant, seed)
        with _lock:
            if key not in cache:
                out = model_dir / f"{preset}-{quant}-s{seed}.gguf"
                cache[key] = Path(synth_model(out, preset=preset, quant=quant, seed=seed, force=True))
            return cache[key]

    return make
