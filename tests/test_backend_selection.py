"""Backend selection: auto picks native only when native says it can run, else llama.cpp with the
reason recorded; backend="native" fails with that reason. The native module is replaced by
stand-ins here (absent, refusing, accepting, broken), so these tests run the real selection code
whether or not backends/native.py exists on this machine."""

from __future__ import annotations

import logging
import shutil
import sys
import types

import pytest

import openjet_plugin
from openjet_plugin.backends import select
from openjet_plugin.backends.llama_cpp import LlamaCppBackend
from openjet_plugin.errors import BackendUnavailableError
from openjet_plugin.model_file import open_model

NATIVE = select.NATIVE_MODULE


@pytest.fixture(scope="module")
def model(synth_path):
    return synth_path("tiny", "Q8_0")


def fake_native(status, backend_cls=None) -> types.ModuleType:
    mod = types.ModuleType(NATIVE)
    mod.native_status = status
    if backend_cls is not None:
        mod.NativeBackend = backend_cls
    return mod


class RecordingNative(LlamaCppBackend):
    """Stands in for the native backend: runs on llama.cpp, records how it was constructed."""

    name = "native"
    made: list = []

    def __init__(self, model_file, n_ctx, draft_depth, kv_type, seed):
        RecordingNative.made.append((model_file, n_ctx, draft_depth, kv_type, seed))
        self.model_file = model_file
        super().__init__(model_file.path, n_ctx, n_threads=1)


def test_native_module_absent_falls_back_with_reason(model, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, NATIVE, None)      # import now raises ImportError
    caplog.set_level(logging.INFO, logger="openjet_plugin")
    with openjet_plugin.load(model, backend="auto", n_ctx=64, n_threads=1) as eng:
        assert eng.backend_name == "llama.cpp"
        assert "native backend is not installed" in eng.backend_reason
    assert any("native backend is not installed" in r.getMessage() for r in caplog.records)
    with pytest.raises(BackendUnavailableError, match="not installed"):
        openjet_plugin.load(model, backend="native", n_ctx=64)


def test_native_refusing_falls_back_with_its_reason(model, monkeypatch):
    seen = []

    def status(model_file, n_ctx):
        seen.append((model_file.path, n_ctx))
        return False, "GPU sm_75 (Tesla T4) is not supported: needs sm_86, sm_89, sm_90 or sm_120"

    monkeypatch.setitem(sys.modules, NATIVE, fake_native(status, RecordingNative))
    with openjet_plugin.load(model, backend="auto", n_ctx=128, n_threads=1) as eng:
        assert eng.backend_name == "llama.cpp"
        assert "sm_75" in eng.backend_reason
    assert seen == [(str(model), 128)]          # asked about this model and this context size
    with pytest.raises(BackendUnavailableError, match="sm_75"):
        openjet_plugin.load(model, backend="native", n_ctx=128)


def test_native_accepting_is_chosen_and_gets_the_load_parameters(model, monkeypatch):
    RecordingNative.made.clear()
    monkeypatch.setitem(sys.modules, NATIVE, fake_native(lambda mf, n, kv_type="f16": (True, f"RTX 3090 sm_86, 22 GiB free, KV {kv_type}"),
                                                         RecordingNative))
    for backend in ("auto", "native"):
        eng = openjet_plugin.load(model, backend=backend, n_ctx=96, draft_depth=3, kv_type="q8_0", seed=5,
                                  n_threads=1)
        with eng:
            assert eng.backend_name == "native" and "sm_86" in eng.backend_reason
            assert "KV q8_0" in eng.backend_reason   # the status check was asked about the KV type
            assert eng.generate("x", max_tokens=3, temperature=0).stats.backend == "native"
            mf = RecordingNative.made[-1][0]
            assert not mf.closed                # the native backend may keep using the mapping
        assert mf.closed                        # ... until the engine closes
    assert [m[1:] for m in RecordingNative.made] == [(96, 3, "q8_0", 5)] * 2
    # an explicit llama.cpp request never consults native
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=64, n_threads=1) as eng:
        assert eng.backend_name == "llama.cpp" and "requested" in eng.backend_reason


def test_native_status_that_crashes_is_a_reason_not_a_crash(model, monkeypatch):
    def status(mf, n):
        raise OSError("libopenjet.so: cannot open shared object file")

    monkeypatch.setitem(sys.modules, NATIVE, fake_native(status))
    with open_model(model) as mf:
        name, reason = select.choose_backend("auto", mf, 64)
    assert name == "llama.cpp" and "libopenjet.so" in reason


def test_native_module_without_status_function(model, monkeypatch):
    monkeypatch.setitem(sys.modules, NATIVE, types.ModuleType(NATIVE))
    with open_model(model) as mf:
        ok, reason = select.native_verdict(mf, 64)
    assert not ok and "native_status" in reason


def test_native_that_fails_to_start(model, monkeypatch, caplog):
    class Broken:
        def __init__(self, *a):
            raise RuntimeError("cudaMalloc failed: out of memory")

    monkeypatch.setitem(sys.modules, NATIVE, fake_native(lambda mf, n: (True, "ok"), Broken))
    caplog.set_level(logging.WARNING, logger="openjet_plugin")
    with openjet_plugin.load(model, backend="auto", n_ctx=64, n_threads=1) as eng:
        assert eng.backend_name == "llama.cpp" and "out of memory" in eng.backend_reason
    assert any("out of memory" in r.getMessage() for r in caplog.records)
    with pytest.raises(BackendUnavailableError, match="out of memory"):
        openjet_plugin.load(model, backend="native", n_ctx=64)


def test_unknown_backend_name(model):
    with pytest.raises(ValueError, match="backend must be one of"):
        openjet_plugin.load(model, backend="vulkan")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA GPU")
def test_this_gpu_less_machine_uses_llama_cpp(model):
    """With whatever native module this checkout has (or none), a machine without a GPU ends up on
    llama.cpp under auto, and native refuses with a reason."""
    with openjet_plugin.load(model, backend="auto", n_ctx=64, n_threads=1) as eng:
        assert eng.backend_name == "llama.cpp" and eng.backend_reason.startswith("native backend unavailable")
    with pytest.raises(BackendUnavailableError) as ei:
        openjet_plugin.load(model, backend="native", n_ctx=64)
    assert len(str(ei.value)) > len("backend='native' is not available: ")
