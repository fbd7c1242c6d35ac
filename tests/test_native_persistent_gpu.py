"""The persistent kernel (native/persistent.cu, issue 8: the main model's forward over 1..8 positions
in one cooperative launch) against the multi-kernel path, on the GPU.

Each model runs the same schedule twice, once per path (OJ_PERSISTENT is read at engine creation):
teacher-forced passes of 1..8 positions, then speculative-style verifies of which only a prefix is
committed (the DeltaNet replay of accepted positions and attention over rejected K/V both run
inside the launch). Compared per position: top-1 agreement, KL divergence of the softmax, the
logits' relative error, the argmax the engine computed, and afterwards the recurrent state and K/V.
The paths sum rows in different orders (a warp per vector in the fused norms), so the bars are
float-rounding bars. Also: the switch's values (a bad one refused by name at creation, `require`
refused by name on a model the kernel does not take) and oj_persistent_info.

The whole GPU suite runs on this path too with `OJ_PERSISTENT=1 bash scripts/gpu_check.sh`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_gpu as tg  # noqa: E402

pytestmark = pytest.mark.gpu

MODELS = [("w256", "Q4_K_M"), ("w128", "Q4_K_M"), ("small", "Q4_K_M"), ("tiny", "Q4_K_M")]
N_POSITIONS = int(os.environ.get("OPENJET_GPU_POSITIONS", "64"))


@pytest.fixture(scope="module")
def native():
    return tg._native_or_skip()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("persistent_models")


def _run(path: Path, tokens: list[int], mode: str, monkeypatch, prefill: int = 0) -> dict:
    """The schedule on a fresh engine with OJ_PERSISTENT=mode: logits and argmax per evaluated
    position (rejected ones included), then the state. prefill > 0: the first `prefill` tokens
    through oj_prefill (the batched multi-kernel path) first, their last position's logits kept."""
    monkeypatch.setenv("OJ_PERSISTENT", mode)
    mf, be = tg._backend(path, n_ctx=len(tokens) + 64)
    try:
        active, why = be.persistent_info()
        logits, argmax = [], []
        half = len(tokens) // 2
        sizes = [1, 3, 8, 5, 2, 7, 4, 6]
        a, k = 0, 0
        if prefill:
            logits.append(be.eval(tokens[:prefill]))
            argmax.append(be.argmax()[-1])
            a = prefill
        while a < half:   # teacher forced: every position committed
            chunk = tokens[a:a + min(sizes[k % len(sizes)], half - a)]
            be._eval_chunk(chunk)
            logits += [be.logits(j) for j in range(len(chunk))]
            argmax += be.argmax()[:len(chunk)]
            a += len(chunk)
            k += 1
        while a < len(tokens):   # verify n, keep a prefix (the rest re-evaluated by the next verify)
            n = min(sizes[k % len(sizes)], len(tokens) - a)
            chunk = tokens[a:a + n]
            be.verify(chunk)
            logits += [be.logits(j) for j in range(n)]
            argmax += be.argmax()[:n]
            keep = max(1, n // 2) if n > 1 else 1
            be.commit(keep)
            a += keep
            k += 1
        state = be.state()
    finally:
        be.close()
        mf.close()
    return {"active": active, "why": why, "logits": np.stack(logits), "argmax": np.array(argmax), "state": state}


# (schedule, positions, prefilled): "steps" from position 0; "prefill": a prompt through oj_prefill,
# then decoding past 256 and 512 cached positions (more than one split-K block of attention)
SCHEDULES = [("steps", N_POSITIONS, 0), ("prefill", 640, 300)]


@pytest.mark.parametrize("schedule,n_tokens,prefill", SCHEDULES, ids=[s[0] for s in SCHEDULES])
@pytest.mark.parametrize("preset,quant", MODELS, ids=[f"{p}-{q}" for p, q in MODELS])
def test_persistent_matches_the_multi_kernel_path(native, workdir, monkeypatch, preset, quant, schedule, n_tokens,
                                                  prefill):
    path, origin = tg.model_path(preset, quant, workdir)
    rng = np.random.default_rng(7)
    from openjet_plugin.model_file import open_model

    with open_model(path) as mf:
        n_vocab = mf.config.n_vocab
    tokens = [int(t) for t in rng.integers(0, n_vocab, n_tokens)]
    multi = _run(path, tokens, "0", monkeypatch, prefill)
    one = _run(path, tokens, "require", monkeypatch, prefill)
    assert not multi["active"] and "OJ_PERSISTENT" in multi["why"], multi["why"]
    assert one["active"], one["why"]
    ref, got = multi["logits"], one["logits"]
    assert got.shape == ref.shape and np.isfinite(got).all()
    top1, kl_mean, kl_max = tg.agreement(ref, got)
    err = tg.rel_err(got, ref)
    real = tg.real_disagreements(ref, got, tie=1e-2)
    # the engine's own argmax of each path is the argmax of its logits
    assert np.array_equal(one["argmax"], got.argmax(-1))
    state_err = {k: tg.rel_err(one["state"][k], multi["state"][k]) for k in multi["state"]}
    bad = np.nonzero(np.abs(got - ref).max(-1) > 1e-2 * np.abs(ref).max(-1))[0]
    tg.report({"test": "persistent_vs_multi", "schedule": schedule, "model": f"{preset}-{quant}", "origin": origin,
               "first_bad_rows": bad[:8].tolist(), "n_bad_rows": int(len(bad)),
               "positions": len(ref), "top1": top1, "kl_mean": kl_mean, "kl_max": kl_max, "logits_rel_err": err,
               "state_rel_err_max": max(state_err.values()) if state_err else 0.0})
    assert not real, f"top-1 differs beyond near-ties at {real[:5]}"
    assert kl_mean < 1e-5 and kl_max < 1e-3, (kl_mean, kl_max)
    assert err < 2e-3, err
    worst = max(state_err.items(), key=lambda kv: kv[1]) if state_err else ("", 0.0)
    assert worst[1] < 2e-3, worst


def test_prefetch_changes_no_result(native, workdir, monkeypatch):
    """OJ_PERSISTENT_PREFETCH=1 (each phase before a matvec phase prefetches the weights its block
    reads first there into L2) only moves data earlier: logits, argmax and state bit-identical."""
    path, _ = tg.model_path("w256", "Q4_K_M", workdir)
    rng = np.random.default_rng(11)
    from openjet_plugin.model_file import open_model

    with open_model(path) as mf:
        n_vocab = mf.config.n_vocab
    tokens = [int(t) for t in rng.integers(0, n_vocab, 80)]
    monkeypatch.setenv("OJ_PERSISTENT_PREFETCH", "0")
    plain = _run(path, tokens, "require", monkeypatch)
    monkeypatch.setenv("OJ_PERSISTENT_PREFETCH", "1")
    fetched = _run(path, tokens, "require", monkeypatch)
    assert plain["active"] and fetched["active"]
    assert np.array_equal(plain["logits"], fetched["logits"])
    assert np.array_equal(plain["argmax"], fetched["argmax"])
    for k, v in plain["state"].items():
        assert np.array_equal(v, fetched["state"][k]), k


def test_persistent_switch_values(native, workdir, monkeypatch):
    """A bad OJ_PERSISTENT (or OJ_PERSISTENT_STAGES / _SPLIT / _PREFETCH, not yet run on a GPU) is refused at creation with the variable and
    value in the message;
    `require` on a model with F32 matrices is refused naming a tensor; `1` there falls back to the
    multi-kernel path and says why."""
    from openjet_plugin.errors import NativeEngineError

    path, _ = tg.model_path("tiny", "F32", workdir)
    monkeypatch.setenv("OJ_PERSISTENT", "yes")
    with pytest.raises(NativeEngineError, match="OJ_PERSISTENT must be 0, 1 or require, not 'yes'"):
        tg._backend(path, n_ctx=64)
    monkeypatch.setenv("OJ_PERSISTENT", "require")
    with pytest.raises(NativeEngineError, match=r"OJ_PERSISTENT=require: tensor \S+ is F32"):
        tg._backend(path, n_ctx=64)
    monkeypatch.setenv("OJ_PERSISTENT_STAGES", "4")
    with pytest.raises(NativeEngineError, match="OJ_PERSISTENT_STAGES must be 2 or 3, not '4'"):
        tg._backend(path, n_ctx=64)
    monkeypatch.delenv("OJ_PERSISTENT_STAGES")
    monkeypatch.setenv("OJ_PERSISTENT_SPLIT", "auto")
    with pytest.raises(NativeEngineError, match="OJ_PERSISTENT_SPLIT must be pick or model, not 'auto'"):
        tg._backend(path, n_ctx=64)
    monkeypatch.delenv("OJ_PERSISTENT_SPLIT")
    monkeypatch.setenv("OJ_PERSISTENT_PREFETCH", "yes")
    with pytest.raises(NativeEngineError, match="OJ_PERSISTENT_PREFETCH must be 0 or 1, not 'yes'"):
        tg._backend(path, n_ctx=64)
    monkeypatch.delenv("OJ_PERSISTENT_PREFETCH")
    monkeypatch.setenv("OJ_PERSISTENT", "1")
    mf, be = tg._backend(path, n_ctx=64)
    try:
        active, why = be.persistent_info()
        assert not active and "F32" in why, why
        be._eval_chunk([1, 2, 3])   # the multi-kernel path still runs
        assert np.isfinite(be.logits(2)).all()
    finally:
        be.close()
        mf.close()
