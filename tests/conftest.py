"""Shared fixtures: generated models are made once per test session and reused by every file."""

from __future__ import annotations

import os

# OpenBLAS threads on 2 busy cores make the reference model's small products 2-10x slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import threading
import weakref
from collections import OrderedDict
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


# --- numpy reference models (openjet_plugin.testing.reference) ---------------------------------------
# A ReferenceModel dequantises each weight on first use, which is most of what a test on it costs,
# and keeps one conversation's state. One model per (file, options) serves every test that asks
# for it while it is among the last few used, and every test starts it empty; a test that compares
# two states asks for a fresh one.

_REFERENCE_MODELS_KEPT = 6        # the small preset's four quants in float64 are ~1.3 GB together
_reference_models: OrderedDict[tuple, object] = OrderedDict()    # least recently used first
_reference_models_alive: weakref.WeakSet[object] = weakref.WeakSet()   # kept, or held by a fixture


@pytest.fixture(scope="session")
def reference_model():
    """`reference_model(path, fresh=False, **options) -> ReferenceModel` (options: those of
    ReferenceModel). The shared model for (path, options), its state emptied before each test;
    fresh=True: another model with its own state over the same dequantised weights."""
    import copy
    import inspect

    from openjet_plugin.testing.reference import ReferenceModel

    defaults = {k: p.default for k, p in inspect.signature(ReferenceModel).parameters.items()
                if p.default is not p.empty}

    def get(path, fresh: bool = False, **options):
        options = {k: v for k, v in options.items() if not (k in defaults and v == defaults[k])}
        key = (Path(path).resolve(), tuple(sorted(options.items())))
        with _lock:
            shared = _reference_models.pop(key, None)
            if shared is None:
                shared = ReferenceModel(key[0], **options)
            _reference_models[key] = shared
            _reference_models_alive.add(shared)
            while len(_reference_models) > _REFERENCE_MODELS_KEPT:
                _reference_models.popitem(last=False)
        if not fresh:
            return shared
        # a shallow copy shares the weight caches; reset / mtp_reset give it state of its own
        model = copy.copy(shared)
        model.reset()
        model.mtp_reset()
        return model

    return get


@pytest.fixture(autouse=True)
def _reference_models_start_empty():
    # runs after the session and module fixtures (which may have used them), before the test
    for model in list(_reference_models_alive):
        model.reset()
        model.mtp_reset()


@pytest.fixture(scope="session")
def default_reference(reference_model):
    """The trained embedded default model (openjet_plugin/data/default.gguf) on the reference."""
    from openjet_plugin.defaults import SHIPPED_DEFAULT

    return reference_model(SHIPPED_DEFAULT)


@pytest.fixture(scope="session")
def tiny_reference(reference_model, synth_path):
    """The generated tiny Q8_0 model on the reference."""
    return reference_model(synth_path("tiny", "Q8_0"))
