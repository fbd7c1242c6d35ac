"""Bad values of the native engine's own parameters are refused with the parameter's name, before
anything is loaded (they run here, without a GPU)."""

from __future__ import annotations

import pytest

import openjet_plugin
from openjet_plugin.backends import native
from openjet_plugin.model_file import open_model


@pytest.fixture(scope="module")
def model_file(synth_path):
    mf = open_model(synth_path("tiny", "Q8_0"))
    yield mf
    mf.close()


@pytest.mark.parametrize("kwargs,needle", [
    ({"n_checkpoints": -1}, "n_checkpoints"),
    ({"n_checkpoints": 65}, "n_checkpoints"),
    ({"n_checkpoints": True}, "n_checkpoints"),
    ({"checkpoint_interval": -8}, "checkpoint_interval"),
    ({"checkpoint_interval": 2.5}, "checkpoint_interval"),
    ({"kv_type": "q4_0"}, "kv_type"),
])
def test_native_backend_refuses_bad_parameters(model_file, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        native.NativeBackend(model_file, n_ctx=64, **kwargs)


@pytest.mark.parametrize("kwargs,needle", [
    ({"checkpoint_interval": -1}, "checkpoint_interval"),
    ({"checkpoint_interval": "64"}, "checkpoint_interval"),
    ({"n_checkpoints": 0}, "n_checkpoints"),
    ({"n_checkpoints": 100}, "n_checkpoints"),
])
def test_load_refuses_bad_checkpoint_parameters(synth_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        openjet_plugin.load(synth_path("tiny", "Q8_0"), backend="llama.cpp", **kwargs)


@pytest.mark.parametrize("env,value", [("OPENJET_PREFILL_GEMM", "fp8"), ("OPENJET_PREFILL_ATTN", "flash2"),
                                       ("OPENJET_PREFILL_DELTANET", "Chunked")])
def test_an_unknown_prefill_switch_is_a_reason_not_a_silent_default(model_file, monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    ok, reason = native.native_status(model_file, 64)
    assert not ok and env in reason and repr(value) in reason
    assert all(repr(v) in reason for v in native.SWITCHES[env] if v)


@pytest.mark.parametrize("env,value", [("OPENJET_PREFILL_GEMM", "int8"), ("OPENJET_PREFILL_GEMM", "wgmma"),
                                       ("OPENJET_PREFILL_ATTN", "decode"), ("OPENJET_PREFILL_DELTANET", "chunked"),
                                       ("OPENJET_PREFILL_DELTANET", "sequential")])
def test_a_known_prefill_switch_is_not_refused_for_it(model_file, monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    ok, reason = native.native_status(model_file, 64)
    assert env not in reason
