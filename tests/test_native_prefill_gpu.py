"""Batched prefill (oj_prefill, issue 9) against the 8-positions-per-oj_eval path it replaces.

Needs an NVIDIA GPU and a library with oj_prefill (ABI 3); everything here skips with the reason
otherwise. `scripts/gpu.sh check` runs it (PYTEST_FILES) and collects the rows it reports into
`$OPENJET_GPU_REPORT`, like tests/test_native_gpu.py's.

- the state a 600-token prefill leaves (passes of 256: several, and a ragged last one) — every
  DeltaNet conv/ssm state, the K/V of every attention layer, the MTP cache — equals the state plain
  one-token-at-a-time stepping leaves (default matvec), within 1e-3 relative: the prefill's
  projections round activations to fp16 under one power-of-two scale per position
  (native/gemm_f16.cuh), the stepping path keeps ~16 bits (bf16 high + remainder);
- 512 positions decoded one at a time after it, and the prefill's own last-position logits, agree
  with the same stepping on top-1 (>= 0.995) and mean KL (<= 1e-3);
- memory().prefill is what backends/native.py's prefill_bytes() says;
- an engine created with prefill_chunk 0 refuses oj_prefill naming prefill_chunk;
- greedy speculative generation after a prefilled prompt equals greedy plain generation;
- OPENJET_Q27B=1: 2,048 tokens prefilled on the 27B-shaped model, seconds and tokens/s.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_native_gpu import (_native_or_skip, agreement,  # noqa: E402
                             model_path, rel_err, report)

pytestmark = pytest.mark.gpu

PREFILL_MODELS = [("tiny", "F32"), ("tiny", "Q4_K_M"), ("small", "Q4_K_M"), ("small", "Q6_K"), ("w256", "Q4_K_M")]
N_PROMPT = 600
N_CONTINUE = 512
CHUNK = 256                  # 600 = 256 + 256 + 88: several passes and a ragged last one
STATE_REL_MAX = 1e-3
TOP1_MIN = 0.995
KL_MAX = 1e-3
MEMORY_TOL = 0.05
SPEC_PROMPTS = int(os.environ.get("OPENJET_PREFILL_SPEC_PROMPTS", "12"))
SPEC_TOKENS = 64
Q27B_TOKENS = 2048


@pytest.fixture(scope="module")
def native():
    nl = _native_or_skip()
    abi = int(nl.lib.oj_abi_version())
    if abi < 3:
        pytest.skip(f"the native library has ABI {abi}, before oj_prefill (3): rebuild it")
    return nl


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("prefill_models")


def _backend(path: Path, n_ctx: int, **kw):
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    mf = open_model(path)
    try:
        return mf, NativeBackend(mf, n_ctx=n_ctx, **kw)
    except BaseException:
        mf.close()
        raise


def _close(mf, be) -> None:
    be.close()
    mf.close()


@pytest.mark.parametrize("preset,quant", PREFILL_MODELS, ids=[f"{p}-{q}" for p, q in PREFILL_MODELS])
def test_prefill_matches_the_eval_path(native, workdir, preset, quant):
    from openjet_plugin.backends.native import prefill_bytes

    path, origin = model_path(preset, quant, workdir)
    n_ctx = N_PROMPT + N_CONTINUE + 16
    mf, be = _backend(path, n_ctx, prefill_chunk=CHUNK)        # draft_depth 4: the MTP cache follows
    try:
        rng = np.random.default_rng(2024)
        tokens = rng.integers(0, be.n_vocab, N_PROMPT).tolist()
        cont = rng.integers(0, be.n_vocab, N_CONTINUE).tolist()
        t0 = time.perf_counter()
        last = be.eval(tokens)
        prefill_s = time.perf_counter() - t0
        assert be.prefilled_positions == N_PROMPT, "the prompt did not go through oj_prefill"
        state = be.state()
        mem = be.memory()
        want_bytes = prefill_bytes(mf.config, CHUNK)
        after = be.eval_all_logits(cont, positions_per_call=1)
    finally:
        _close(mf, be)

    # plain one-token-at-a-time stepping in the default matvec mode: its state after the prompt,
    # its logits over the prompt and the continuation
    mf, ref = _backend(path, n_ctx, prefill_chunk=0)
    try:
        plain = ref.eval_all_logits(tokens, positions_per_call=1)
        want_state = ref.state()
        plain = np.concatenate([plain, ref.eval_all_logits(cont, positions_per_call=1)])
    finally:
        _close(mf, ref)

    assert np.isfinite(last).all() and np.isfinite(after).all(), "prefill logits contain NaN/inf"
    assert set(state) == set(want_state), (sorted(set(state) ^ set(want_state)))
    assert any(k.startswith("mtp.") for k in state), "no MTP cache rows after the prefill"
    assert all(state[k].shape == want_state[k].shape for k in state), \
        {k: (state[k].shape, want_state[k].shape) for k in state if state[k].shape != want_state[k].shape}
    errs = {k: rel_err(state[k], v) for k, v in want_state.items()}
    worst = max(errs, key=errs.get)
    top1, kl, kl_max = agreement(plain[N_PROMPT:], after)
    l_top1, l_kl, _ = agreement(plain[N_PROMPT - 1:N_PROMPT], last[None])
    report({"test": "prefill_vs_eval", "model": f"{preset}-{quant}", "origin": origin, "positions": N_PROMPT,
            "prefill_chunk": CHUNK, "state_worst": worst, "state_rel_err": errs[worst],
            "mtp_rel_err": max(v for k, v in errs.items() if k.startswith("mtp.")),
            "continue_top1": top1, "continue_kl_mean": kl, "continue_kl_max": kl_max,
            "last_top1": l_top1, "last_kl": l_kl, "continued": N_CONTINUE,
            "memory_prefill": mem["prefill"], "prefill_bytes": want_bytes, "prefill_s": round(prefill_s, 3)})
    bad = {k: e for k, e in errs.items() if not e <= STATE_REL_MAX}
    assert not bad, f"state after oj_prefill vs one-at-a-time stepping: relative errors above {STATE_REL_MAX}: {bad}"
    assert top1 >= TOP1_MIN and kl <= KL_MAX, \
        f"decoding after the prefill vs plain stepping: top-1 {top1:.4f}, mean KL {kl:.2e}"
    assert l_kl <= KL_MAX, f"the prefill's last logits vs plain stepping: KL {l_kl:.2e}"
    # (d) the memory report's prefill buffers are what prefill_bytes() says
    assert mem["prefill"] > 0 and abs(mem["prefill"] - want_bytes) <= MEMORY_TOL * want_bytes, \
        (mem["prefill"], want_bytes)


def test_prefill_chunk_0_refuses_oj_prefill_by_name(native, workdir):
    from openjet_plugin.errors import NativeEngineError

    path, _ = model_path("tiny", "Q4_K_M", workdir)
    mf, be = _backend(path, 256, prefill_chunk=0)
    try:
        assert not be.batched_prefill and be.memory()["prefill"] == 0
        buf = be._nl.ffi.new("int32_t[]", [1, 2, 3])
        with pytest.raises(NativeEngineError, match="prefill_chunk") as ei:
            be._check(be._nl.lib.oj_prefill(be._handle(), buf, 3), "prefill")
        assert ei.value.code == 1
        be.eval(list(range(40)))                       # the old path still runs the prompt
        assert be.prefilled_positions == 0 and be.n_past == 40
        # the engine's own check of the range, past the Python one
        be.prefill_chunk, be.batched_prefill = 32, True
        with pytest.raises(NativeEngineError, match="prefill_chunk"):
            be._create(mf, "f16", 0)
        report({"test": "prefill_chunk_0", "message": str(ei.value)[:200]})
    finally:
        _close(mf, be)


def test_oj_prefill_refuses_bad_input_by_name_and_stays_usable(native, workdir):
    """The C entry point itself (past the backend's own checks): a token outside the vocabulary
    (named with its prompt position), a count below 1, more tokens than the context holds; each
    an error with its message, n_past unchanged, and the engine prefills correctly afterwards."""
    from openjet_plugin.errors import NativeEngineError

    path, _ = model_path("tiny", "Q4_K_M", workdir)
    mf, be = _backend(path, 64, prefill_chunk=CHUNK)
    try:
        lib, ffi = be._nl.lib, be._nl.ffi
        V = be.n_vocab
        cases = {"token id %d (prompt position 2) is outside the vocabulary" % V: ([1, 2, V, 3], 4),
                 "oj_prefill of 0 tokens": ([1], 0),
                 "exceed n_ctx 64": (list(range(65)), 65)}
        for needle, (toks, n) in cases.items():
            buf = ffi.new("int32_t[]", toks)
            with pytest.raises(NativeEngineError, match=re.escape(needle)):
                be._check(lib.oj_prefill(be._handle(), buf, n), "prefill")
            assert be.n_past == 0, needle
        be.eval(list(range(1, 41)))
        assert be.prefilled_positions == 40 and be.n_past == 40
        assert np.isfinite(be.logits(0)).all()
    finally:
        _close(mf, be)


def test_greedy_speculative_after_a_prefilled_prompt_equals_plain(native, workdir):
    """Prompts of 300-400 tokens prefilled (oj_prefill, MTP rows made by the engine), then greedy
    speculative decoding at D = 1..4 against the plain engine (D = 0, whose prompts go through the
    same oj_prefill call); a divergence only at a near-tie."""
    import openjet_plugin
    from test_native_spec_gpu import _compare

    path, _ = model_path("tiny", "Q4_K_M", workdir)
    rng = np.random.default_rng(77)

    def engine(depth: int):
        eng = openjet_plugin.load(model_path=str(path), backend="native", n_ctx=1024, draft_depth=depth)
        assert eng.backend_name == "native", eng.backend_reason
        return eng

    eng = engine(0)
    try:
        prompts = [rng.integers(0, eng.n_vocab, int(rng.integers(301, 400))).tolist() for _ in range(SPEC_PROMPTS)]
        plain = [list(eng.generate(p, max_tokens=SPEC_TOKENS, temperature=0).tokens) for p in prompts]
    finally:
        eng.close()
    rows = []
    for depth in (1, 2, 3, 4):
        eng = engine(depth)
        try:
            outs, cycles, acc = [], 0, 0
            for p in prompts:
                r = eng.generate(p, max_tokens=SPEC_TOKENS, temperature=0)
                outs.append(list(r.tokens))
                cycles += r.stats.cycles
                acc += r.stats.drafts_accepted
            prefilled = eng._backend.prefilled_positions
        finally:
            eng.close()
        assert prefilled >= sum(len(p) - 1 for p in prompts), "the prompts did not go through oj_prefill"
        ties = _compare(f"prefilled D={depth}", path, prompts, outs, plain)
        rows.append({"depth": depth, "cycles": cycles, "accepted": acc, "near_ties": ties,
                     "tokens_per_cycle": round(sum(len(o) for o in outs) / max(cycles, 1), 3)})
    report({"test": "prefill_spec_greedy_equals_plain", "model": "tiny-Q4_K_M", "prompts": len(prompts),
            "by_depth": rows})


def test_q27b_prefill_rate(native):
    """OPENJET_Q27B=1 only: 2,048 tokens appended at depth 8 on the 27B-shaped model (generated once
    into $OPENJET_Q27B_PATH, default /tmp/q27b.gguf, as scripts/native_q27b.py does)."""
    if os.environ.get("OPENJET_Q27B") != "1":
        pytest.skip("the 27B-shaped model (16.8 GB) runs only with OPENJET_Q27B=1")
    from openjet_plugin.backends.native import prefill_bytes
    from openjet_plugin.bench import prefill as bench_prefill
    from openjet_plugin.testing.synth import synth_model

    path = Path(os.environ.get("OPENJET_Q27B_PATH", "/tmp/q27b.gguf"))
    if not path.is_file():
        synth_model(path, preset="q27b", quant="Q4_K_M")
    mf, be = _backend(path, 4096, draft_depth=0)
    try:
        rng = np.random.default_rng(0)
        be.eval(rng.integers(0, be.n_vocab, 8).tolist())        # depth 8 through oj_eval: no MTP rows follow
        be.save_checkpoint()
        toks = rng.integers(0, be.n_vocab, Q27B_TOKENS).tolist()
        be.eval_argmax(toks[:512])                                 # warm-up
        assert be.restore_checkpoint(8) == 8
        t0 = time.perf_counter()
        top = be.eval_argmax(toks)
        seconds = time.perf_counter() - t0
        logits = be.logits(0)
        mem = be.memory()
        config = mf.config
    finally:
        _close(mf, be)
    tps = Q27B_TOKENS / seconds
    flops = bench_prefill.prefill_flops(config, Q27B_TOKENS, 8)
    share = bench_prefill.tensor_core_fraction(tps, flops, Q27B_TOKENS, bench_prefill.H200_BF16_DENSE_TFLOPS)
    want_bytes = prefill_bytes(config, be.prefill_chunk)
    report({"test": "q27b_prefill", "tokens": Q27B_TOKENS, "seconds": round(seconds, 3), "tokens_per_s": round(tps, 1),
            "of_h200_bf16_peak": round(share, 4), "prefill_chunk": be.prefill_chunk,
            "memory_prefill": mem["prefill"], "prefill_bytes": want_bytes, "argmax": int(top)})
    assert np.isfinite(logits).all() and 0 <= top < config.n_vocab
    assert abs(mem["prefill"] - want_bytes) <= MEMORY_TOL * want_bytes, (mem["prefill"], want_bytes)


def test_q27b_prefill_then_decode_matches_stepping(native):
    """OPENJET_Q27B=1 only: issue 9's check on the 27B-shaped model: 1,024 prompt tokens prefilled
    (passes of 512), then 512 positions teacher-forced 8 per call (bit-identical to one at a time),
    against an engine without prefill buffers that evaluates all 1,536 positions 8 per call: the
    continuation's top-1 and mean KL, and the recurrent state / K/V after the prompt."""
    if os.environ.get("OPENJET_Q27B") != "1":
        pytest.skip("the 27B-shaped model (16.8 GB) runs only with OPENJET_Q27B=1")
    from openjet_plugin.testing.synth import synth_model

    path = Path(os.environ.get("OPENJET_Q27B_PATH", "/tmp/q27b.gguf"))
    if not path.is_file():
        synth_model(path, preset="q27b", quant="Q4_K_M")
    n_prompt, n_cont = 1024, 512
    rng = np.random.default_rng(27)
    mf, be = _backend(path, 2048, draft_depth=0, prefill_chunk=512)
    try:
        tokens = rng.integers(0, be.n_vocab, n_prompt).tolist()
        cont = rng.integers(0, be.n_vocab, n_cont).tolist()
        be.eval(tokens)
        assert be.prefilled_positions == n_prompt
        state = {k: v for k, v in be.state().items() if k.startswith("blk.")}
        after = be.eval_all_logits(cont)
    finally:
        _close(mf, be)
    mf, ref = _backend(path, 2048, draft_depth=0, prefill_chunk=0)
    try:
        ref.eval_all_logits(tokens)
        want_state = {k: v for k, v in ref.state().items() if k.startswith("blk.")}
        plain = ref.eval_all_logits(cont)
    finally:
        _close(mf, ref)
    top1, kl, kl_max = agreement(plain, after)
    errs = {k: rel_err(state[k], v) for k, v in want_state.items()}
    worst = max(errs, key=errs.get)
    report({"test": "q27b_prefill_vs_stepping", "prompt": n_prompt, "continued": n_cont, "continue_top1": top1,
            "continue_kl_mean": kl, "continue_kl_max": kl_max, "state_worst": worst, "state_rel_err": errs[worst]})
    assert np.isfinite(after).all()
    assert top1 >= TOP1_MIN and kl <= KL_MAX, f"q27b decoding after the prefill: top-1 {top1:.4f}, mean KL {kl:.2e}"
    bad = {k: e for k, e in errs.items() if not e <= STATE_REL_MAX}
    assert not bad, f"q27b state after oj_prefill vs stepping: relative errors above {STATE_REL_MAX}: {bad}"


def _prefill_to_file(path: str, tokens: list[int], cont: list[int], out: str, switch: str) -> dict:
    """In a child process (the engine reads its switches once per process): prefill `tokens`
    (passes of CHUNK), save the state, then the logits of `cont` one position at a time."""
    mf, be = _backend(Path(path), len(tokens) + len(cont) + 16, prefill_chunk=CHUNK)
    try:
        be.eval(tokens)
        state = be.state()
        prefilled = be.prefilled_positions
        after = be.eval_all_logits(cont, positions_per_call=1)
    finally:
        _close(mf, be)
    np.savez(out, after=after, **{f"state__{k}": v for k, v in state.items()})
    return {"prefilled": prefilled, "switch": os.environ.get(switch, "")}


def _gpu_is_hopper() -> bool:
    from openjet_plugin.build_native import local_gpu_archs

    return "90" in local_gpu_archs()


# The prefill switches other than the defaults, each against one-token-at-a-time stepping with the
# default prefill's bars: OPENJET_PREFILL_DELTANET=sequential (the decode path's recurrence kernel
# over the pass instead of deltanet_chunked.cuh's), OPENJET_PREFILL_GEMM=f16 (every projection on
# gemm_f16's mma.sync and the FFN unfused: on a cc 9.0 GPU the default takes Q4_K / Q6_K to wgmma and
# fuses gate + up with SwiGLU) and =wgmma (the default's kernels, asked for by name: a cc 9.0 GPU
# only, where the engine refuses rather than falls back), on a model whose every projection is Q6_K
# and one with the Q4_K_M map's mix.
SWITCH_CASES = [("OPENJET_PREFILL_DELTANET", "sequential", "small", "Q4_K_M"),
                ("OPENJET_PREFILL_DELTANET", "sequential", "w256", "Q4_K_M"),
                ("OPENJET_PREFILL_GEMM", "f16", "small", "Q6_K"),
                ("OPENJET_PREFILL_GEMM", "f16", "w256", "Q4_K_M"),
                ("OPENJET_PREFILL_GEMM", "wgmma", "small", "Q6_K"),
                ("OPENJET_PREFILL_GEMM", "wgmma", "w256", "Q4_K_M")]


@pytest.mark.parametrize("switch,value,preset,quant", SWITCH_CASES,
                         ids=[f"{v}-{p}-{q}" for _, v, p, q in SWITCH_CASES])
def test_prefill_switch_matches_stepping(native, workdir, tmp_path, switch, value, preset, quant):
    """A prefill switch's kernels: the state after the prefill and the logits of the positions
    decoded after it against an engine that stepped one token at a time (same bars as the default)."""
    import json
    import subprocess
    import textwrap

    if value == "wgmma" and not _gpu_is_hopper():
        pytest.skip("OPENJET_PREFILL_GEMM=wgmma needs a cc 9.0 GPU (H100 / H200)")
    path, origin = model_path(preset, quant, workdir)
    rng = np.random.default_rng(4096)
    mf, ref = _backend(path, N_PROMPT + N_CONTINUE + 16, prefill_chunk=0)
    try:
        tokens = rng.integers(0, ref.n_vocab, N_PROMPT).tolist()
        cont = rng.integers(0, ref.n_vocab, N_CONTINUE).tolist()
        ref.eval_all_logits(tokens, positions_per_call=1)
        want_state = ref.state()
        plain = ref.eval_all_logits(cont, positions_per_call=1)
    finally:
        _close(mf, ref)
    out = tmp_path / "switch.npz"
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import test_native_prefill_gpu as t
        args = json.loads(sys.argv[1])
        print("RESULT " + json.dumps(t._prefill_to_file({str(path)!r}, args[0], args[1], {str(out)!r}, {switch!r})))
    """)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps([tokens, cont])], capture_output=True, text=True,
                          timeout=600, env={**os.environ, switch: value})
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    info = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert info == {"prefilled": N_PROMPT, "switch": value}, info
    with np.load(out) as z:
        after = z["after"]
        state = {k[len("state__"):]: z[k] for k in z.files if k.startswith("state__")}
    errs = {k: rel_err(state[k], v) for k, v in want_state.items()}
    worst = max(errs, key=errs.get)
    top1, kl, kl_max = agreement(plain, after)
    report({"test": "prefill_switch", "switch": f"{switch}={value}", "model": f"{preset}-{quant}", "origin": origin,
            "positions": N_PROMPT, "state_worst": worst, "state_rel_err": errs[worst], "continue_top1": top1,
            "continue_kl_mean": kl, "continue_kl_max": kl_max, "continued": N_CONTINUE})
    assert np.isfinite(after).all()
    bad = {k: e for k, e in errs.items() if not e <= STATE_REL_MAX}
    assert not bad, f"{switch}={value} prefill vs stepping: relative errors above {STATE_REL_MAX}: {bad}"
    assert top1 >= TOP1_MIN and kl <= KL_MAX, f"decoding after the {switch}={value} prefill: top-1 {top1:.4f}, mean KL {kl:.2e}"
