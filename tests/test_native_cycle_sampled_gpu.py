"""The sampled cycle (oj_cycle_sampled, issue 28) on the GPU.

Needs an NVIDIA GPU and the built library (ABI 13+); skips with the reason otherwise.
tests/test_native_spec_gpu.py's chi-square tests check that its draws keep the target
distribution (top-k on: every cycle there is one oj_cycle_sampled). Here:

- at top-k 1 every draw is the row's argmax, so sampled generation through the engine, one
  oj_cycle_sampled a cycle, equals plain greedy decoding (a divergence only at a logged near-tie);
- each call's draws are the row's candidates: with min-p 0.999 only the largest logit survives;
- drafts the last call did not draw, and settings out of range, come back as errors naming them,
  the engine usable and its state as before.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_spec_gpu as ts  # noqa: E402
from test_native_gpu import native_at_least, report  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def native():
    from openjet_plugin.backends.native import SAMPLED_CYCLE_ABI

    return native_at_least(SAMPLED_CYCLE_ABI, "oj_cycle_sampled")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("sampled_cycle_models")


@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "small-Q4_K_M", "default"])
def test_top_k_1_sampled_cycles_equal_plain(native, workdir, name):
    path = ts._model(name, workdir)
    prompts, plain = ts._plain(name, workdir)
    rows = []
    for depth in (1, 4, 7):
        eng = ts._engine(path, depth)
        calls = [0, 0]
        try:
            be = eng._backend
            assert be.supports_sampled_cycle
            cycle = be.cycle

            def counted(tokens, n_draft, sampled=None, _cycle=cycle):
                calls[sampled is not None] += 1
                return _cycle(tokens, n_draft, sampled=sampled)

            be.cycle = counted
            outs, n_cycles, acc = [], 0, 0
            for i, p in enumerate(prompts):
                r = eng.generate(p, max_tokens=ts.N_TOKENS, temperature=0.8, top_k=1, seed=i)
                outs.append(list(r.tokens))
                n_cycles += r.stats.cycles
                acc += r.stats.drafts_accepted
        finally:
            eng.close()
        ties = ts._compare(f"{name} D={depth} sampled top-k 1", path, prompts, outs, plain)
        # every cycle but each request's first host draw is one oj_cycle_sampled
        assert calls[0] == 0 and calls[1] >= n_cycles - len(prompts) and acc > 0, (calls, n_cycles, acc)
        tokens = sum(len(o) for o in outs)
        rows.append({"depth": depth, "tokens": tokens, "cycles": n_cycles, "gpu_cycles": calls[1],
                     "accepted": acc, "tokens_per_cycle": round(tokens / max(n_cycles, 1), 3), "near_ties": ties})
    report({"test": "cycle_sampled_top_k_1_equals_plain", "model": name, "prompts": len(prompts),
            "max_tokens": ts.N_TOKENS, "by_depth": rows})


def _backend(path: Path, depth: int = 4, n_ctx: int = 256):
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    mf = open_model(path)
    return NativeBackend(mf, n_ctx=n_ctx, draft_depth=depth), mf


def test_min_p_near_1_draws_the_rows_argmax(native, workdir):
    """min-p 0.999 keeps the largest logit alone (as a near-tie's runner-up may survive, rows with
    a top-2 gap under 1e-3 are not counted): every emitted token, accepted draft or drawn, is the
    argmax of its verify row, whatever the temperature and seed."""
    from openjet_plugin.sampling import SamplingParams

    be, mf = _backend(ts._model("small-Q4_K_M", workdir))
    try:
        rng = np.random.default_rng(5)
        prompt = rng.integers(0, be.n_vocab, 24).tolist()
        be.eval(prompt[:-1])
        x = prompt[-1]
        be.draft_first(x)
        params = SamplingParams(temperature=2.0, top_k=64, top_p=1.0, min_p=0.999)
        nd, checked = [], 0
        for c in range(12):
            k, em, nd = be.cycle([x] + nd, 3, sampled=(params, 100 + c))
            for i, t in enumerate(em):
                row = be.logits(i)
                two = np.partition(row, -2)[-2:]
                if two[1] - two[0] > 1e-3 * max(1.0, float(np.abs(row).max())):
                    assert t == int(np.argmax(row)), (c, i)
                    checked += 1
            x = em[-1]
        assert checked >= 12
        report({"test": "cycle_sampled_min_p_argmax", "rows_checked": checked})
    finally:
        be.close()
        mf.close()


def test_bad_drafts_and_settings_are_refused_by_name(native, workdir):
    from openjet_plugin.errors import NativeEngineError
    from openjet_plugin.sampling import SamplingParams

    be, mf = _backend(ts._model("tiny-Q4_K_M", workdir))
    try:
        params = SamplingParams(temperature=0.8, top_k=40)
        be.eval([5, 6, 7])
        be.draft_first(8)
        k, em, nd = be.cycle([8], 3, sampled=(params, 1))
        n = be.n_past
        x = em[-1]
        wrong = [(nd[0] + 1) % be.n_vocab] + nd[1:]
        with pytest.raises(NativeEngineError, match="are not drafts the last oj_cycle_sampled"):
            be.cycle([x] + wrong, 2, sampled=(params, 2))
        assert be.n_past == n
        with pytest.raises(NativeEngineError, match="are not drafts the last oj_cycle_sampled"):
            # another token's drafts (no drafting: the backend's own check of the token's MTP row
            # would refuse the call before the engine sees it)
            be.cycle([(x + 1) % be.n_vocab] + nd, 0, sampled=(params, 2))
        # the refusals kept the drafts: they verify now, once
        k, em2, nd2 = be.cycle([x] + nd, 2, sampled=(params, 3))
        assert be.n_past == n + 1 + k and len(nd2) == 2
        # the library's own checks of the settings (the backend refuses them before the call)
        nl = be._nl
        ffi = nl.ffi
        toks = ffi.new("int32_t[]", [em2[-1]])
        acc, out, dr = ffi.new("int32_t *"), ffi.new("int32_t[]", 8), ffi.new("int32_t[]", 8)
        for field, value, match in [("temperature", 0.0, "temperature is 0"), ("top_k", 65, "top_k is 65"),
                                    ("top_k", 0, "top_k is 0"), ("top_p", 0.0, "top_p is 0"),
                                    ("min_p", 1.0, "min_p is 1")]:
            sp = ffi.new("oj_sampling *", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1})
            setattr(sp, field, value)
            rc = nl.lib.oj_cycle_sampled(be._handle(), toks, 1, 0, sp, acc, out, dr)
            msg = ffi.string(nl.lib.oj_last_error(be._handle())).decode()
            assert rc != 0 and match in msg, (field, rc, msg)
        assert be.n_past == n + 1 + k
        k3, em3, _ = be.cycle([em2[-1]] + nd2, 0, sampled=(params, 4))
        assert len(em3) == k3 + 1 and be.n_past == n + 1 + k + len(em3)
    finally:
        be.close()
        mf.close()
