"""The fused speculative cycle (oj_cycle, issue 8) on the GPU, against the host path.

Needs an NVIDIA GPU and the built library (ABI 4+); skips with the reason otherwise. oj_cycle runs
the same kernels as verify + commit + oj_mtp_eval, as separate launches.

- greedy generation through the engine's speculative loop, one oj_cycle a cycle now, equals plain
  one-token decoding (a divergence only at a logged near-tie), with MTP drafts and oracle drafts;
- oj_cycle against verify + commit + draft_first/draft_next on a second backend of the same model,
  from the same tokens and partly right drafts: the same argmax per position, acceptances and
  tokens, the next drafts up to near-ties, and afterwards the same state and MTP rows;
- bad arguments come back as error codes with a message and leave the engine usable.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_spec_gpu as ts  # noqa: E402
from test_native_gpu import native_at_least, rel_err, report  # noqa: E402

pytestmark = pytest.mark.gpu

NEAR_TIE = ts.NEAR_TIE
N_CYCLES = 40
N_DRAFTS = [4, 7, 1, 0, 3, 7, 2, 5, 0]      # n_draft of cycle c: N_DRAFTS[c % 9]
N_DRAFTS_WIDE = [15, 9, 1, 0, 12, 15, 3, 8, 0]   # the same, for verifies of up to 16 positions
STATE_REL_MAX = 1e-4                        # the same path: the main model's verify either way
# The bar the MTP rows had while a cycle could run inside one cooperative launch (rows summed in
# another order); both sides now run the same kernels.
MTP_REL_MAX = 2e-3
DRAFT_TIE = 1e-2


@pytest.fixture(scope="module")
def native():
    from openjet_plugin.backends.native import CYCLE_ABI

    return native_at_least(CYCLE_ABI, "oj_cycle")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("cycle_models")


def _model(name: str, workdir: Path) -> Path:
    return ts._model(name, workdir)


def _gap(row: np.ndarray) -> float:
    """Top-2 gap of a logits row relative to its max |logit| (test_native_spec_gpu's measure)."""
    two = np.partition(row, -2)[-2:]
    return float(two[1] - two[0]) / max(1.0, float(np.abs(row).max()))


def _path(be) -> str:
    """The path the report rows name: the multi-kernel one, the only path since the persistent kernel left."""
    return "launches"


def _counting(be, calls: Counter) -> None:
    """Count the backend's cycle() and verify() calls (the fused path and the host path)."""
    for name in ("cycle", "verify"):
        real = getattr(be, name)

        def wrapped(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        setattr(be, name, wrapped)


# --- (a) the engine's greedy loop ---------------------------------------------------------------

@pytest.mark.parametrize("name", ts.GREEDY_MODELS)
def test_greedy_fused_cycles_equal_plain(native, workdir, name):
    path = _model(name, workdir)
    prompts, plain = ts._plain(name, workdir)
    rows = []
    for depth in (1, 4, 7):
        eng = ts._engine(path, depth)
        calls: Counter = Counter()
        try:
            be = eng._backend
            assert be.supports_cycle
            _counting(be, calls)
            where = _path(be)
            outs, cycles, acc, prop = ts._generate_greedy(eng, prompts, ts.N_TOKENS)
        finally:
            eng.close()
        ties = ts._compare(f"{name} D={depth} fused", path, prompts, outs, plain)
        # every cycle is one oj_cycle: the host path only for a draft-less cycle without an MTP
        # row, which max_tokens > 1 and this context never make
        assert calls["cycle"] == cycles and calls["verify"] == 0, (calls, cycles)
        tokens = sum(len(o) for o in outs)
        rows.append({"depth": depth, "tokens": tokens, "cycles": cycles, "accepted": acc, "proposed": prop,
                     "tokens_per_cycle": round(tokens / max(cycles, 1), 3), "near_ties": ties})
    report({"test": "cycle_greedy_equals_plain", "model": name, "path": where, "prompts": len(prompts),
            "max_tokens": ts.N_TOKENS, "by_depth": rows})


@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "small-Q4_K_M"])
def test_oracle_drafts_through_fused_cycles_equal_plain(native, workdir, name):
    """Oracle drafts from the plain continuation, a known number right each cycle: the output is
    plain decoding and the acceptances are the oracle's (the in-call drafts are ignored)."""
    from openjet_plugin.speculative import ForcedAcceptanceDrafts

    path = _model(name, workdir)
    prompts, plain = ts._plain(name, workdir)
    eng = ts._engine(path, 4)
    calls: Counter = Counter()
    outs, acc, prop = [], 0, 0
    try:
        spec = eng._speculator
        spec.policy.adaptive = False
        _counting(eng._backend, calls)
        where = _path(eng._backend)
        for k, (p, q) in enumerate(zip(prompts, plain)):
            spec.oracle = ForcedAcceptanceDrafts(p + q, eng.n_vocab, rate=0.5, seed=k)
            r = eng.generate(p, max_tokens=ts.N_TOKENS, temperature=0)
            outs.append(list(r.tokens))
            acc += r.stats.drafts_accepted
            prop += r.stats.drafts_proposed
    finally:
        eng.close()
    ties = ts._compare(f"{name} oracle fused", path, prompts, outs, plain)
    report({"test": "cycle_oracle_equals_plain", "model": name, "path": where,
            "acceptance": round(acc / max(prop, 1), 4), "near_ties": ties})
    assert calls["cycle"] > 0 and calls["verify"] == 0
    assert 0 < acc < prop


# --- (b) oj_cycle against the host path's calls -------------------------------------------------

def _host_drafts(be, token: int, n_draft: int) -> tuple[list[int], list[float]]:
    """draft_first/draft_next from `token` at n_past: the drafts and each step's top-2 gap."""
    drafts, gaps = [], []
    for i in range(n_draft):
        drafts.append(be.draft_first(token) if i == 0 else be.draft_next(drafts[-1], be.n_past + i))
        gaps.append(_gap(be.draft_logits(-1)))
    return drafts, gaps


@pytest.mark.parametrize("wide", [False, True], ids=["8", "16"])
@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "small-Q4_K_M", "default"])
def test_cycle_equals_verify_commit_and_host_drafts(native, workdir, name, wide):
    """oj_cycle against oj_verify + oj_commit + the host's MTP steps, over verifies of up to 8
    positions, or (wide) up to 16 with up to 15 drafts a cycle."""
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model
    from openjet_plugin.speculative import ForcedAcceptanceDrafts, verify_greedy

    path = _model(name, workdir)
    prompts, plain = ts._plain(name, workdir)
    p, q = prompts[0], plain[0]
    mf = open_model(path)
    span, plan = (16, N_DRAFTS_WIDE) if wide else (8, N_DRAFTS)
    a = NativeBackend(mf, n_ctx=1024, draft_depth=span - 1)      # oj_cycle
    b = NativeBackend(mf, n_ctx=1024, draft_depth=span - 1)      # verify + commit + draft_first/draft_next
    assert a.max_positions >= span, f"the library takes {a.max_positions} positions a call"
    oracle = ForcedAcceptanceDrafts(p + q, a.n_vocab, pattern=[0, 3, 7, 1, 5, 2, 7, 4])
    ties = {"main": 0, "draft": 0}
    worst, errs = 0.0, {}
    accepted = 0
    try:
        where = _path(a)
        a.eval(p[:-1])
        b.eval(p[:-1])
        x, fused, last_nd, diverged = p[-1], [], 0, None
        for c in range(N_CYCLES):
            pos = a.n_past
            assert b.n_past == pos
            n_tokens, n_draft = 1 + c % span, plan[c % len(plan)]
            drafts = fused[:n_tokens - 1] if c % 3 == 1 else []
            if c % 3 != 1:                       # the plain continuation, some tokens wrong
                drafts = oracle.propose(pos, x, None, None, n_tokens - 1, None, None)[0]
                drafts = drafts or fused[:n_tokens - 1]      # past its end: the engine's drafts
            toks = [x] + drafts
            if n_draft and not last_nd:          # no call left this token's row: the host's step
                a.draft_first(x)
            ka, ema, nda = a.cycle(toks, n_draft)
            top_a = a.argmax()
            rows_a = [a.logits(i) for i in range(len(toks))]
            b.verify(toks)
            top_b = b.argmax()
            rows_b = [b.logits(i) for i in range(len(toks))]
            v = verify_greedy(top_b, drafts)
            b.commit(1 + v.n_accepted)
            if top_a != top_b:
                i = next(i for i, (s, t) in enumerate(zip(top_a, top_b)) if s != t)
                gap = _gap(rows_b[i])
                assert gap < NEAR_TIE, f"cycle {c}: argmax at {i} {top_a[i]} vs {top_b[i]}, top-2 gap {gap:.3g}"
                print(f"near-tie divergence: {name} cycle {c} position {i}, gap {gap:.3g}")
                ties["main"] += 1
                diverged = c
                break                            # the states part here
            assert (ka, ema) == (v.n_accepted, drafts[:v.n_accepted] + [v.token]), c
            worst = max(worst, max(rel_err(s, t) for s, t in zip(rows_a, rows_b)))
            assert worst <= STATE_REL_MAX, f"cycle {c}: logits relative error {worst:.2e}"
            ndb, gaps = _host_drafts(b, v.token, n_draft)
            assert len(nda) == n_draft
            if nda != ndb:
                i = next(i for i, (s, t) in enumerate(zip(nda, ndb)) if s != t)
                assert gaps[i] < DRAFT_TIE, f"cycle {c}: draft {i} {nda[i]} vs {ndb[i]}, top-2 gap {gaps[i]:.3g}"
                print(f"near-tie draft divergence: {name} cycle {c} draft {i}, gap {gaps[i]:.3g}")
                ties["draft"] += 1
            accepted += ka
            x, fused, last_nd = ema[-1], nda, n_draft
        if diverged is None:
            # the rows still owed, from each backend's last window, then the whole state
            a._flush_mtp()
            b._flush_mtp()
            n = a.n_past
            got, want = a.state(), b.state()
            for k in ("mtp.k", "mtp.v"):
                got[k], want[k] = got[k][:n], want[k][:n]
            errs = {k: rel_err(got[k], v) for k, v in want.items()}
            assert set(errs) and all(got[k].shape == want[k].shape for k in errs)
            for k, e in errs.items():
                bar = MTP_REL_MAX if k.startswith("mtp") else STATE_REL_MAX
                assert e <= bar, f"{k}: relative error {e:.2e} (bar {bar:g})"
    finally:
        a.close()
        b.close()
        mf.close()
    report({"test": "cycle_equals_host_path", "model": name, "span": span, "path": where, "cycles": N_CYCLES,
            "accepted": accepted, "logits_rel_err": worst, "near_ties": ties, "diverged_at": diverged,
            "state_rel_err": errs})
    assert accepted > 0


# --- (c) the boundary: bad calls are error codes, the engine stays usable ------------------------

def test_cycle_errors_leave_the_engine_usable(native, workdir):
    from openjet_plugin import _native
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.errors import ContextOverflowError
    from openjet_plugin.model_file import open_model

    path = _model("tiny-Q4_K_M", workdir)
    mf = open_model(path)
    be = NativeBackend(mf, n_ctx=64, draft_depth=4)
    lib, ffi = be._nl.lib, be._nl.ffi
    p = np.random.default_rng(5).integers(0, be.n_vocab, 12).tolist()
    messages = {}

    def raw(toks: list[int], n_tokens: int, n_draft: int) -> int:
        buf = ffi.new("int32_t[]", toks or [0])
        n_acc, out, drafts = ffi.new("int32_t *"), ffi.new("int32_t[]", 16), ffi.new("int32_t[]", 16)
        return lib.oj_cycle(be._handle(), buf, n_tokens, n_draft, n_acc, out, drafts)

    try:
        where = _path(be)
        be.eval(p[:-1])
        be.save_checkpoint()
        want = be.eval(p[-1:])                   # the plain step the cycle must give afterwards
        be.restore_checkpoint(len(p) - 1)        # MTP rows cut to n_past: none for p[-1]
        n0, m0 = be.n_past, be._mtp_n_past()
        assert m0 == n0
        cases = {
            "n_tokens 0": ([], 0, 0, lib.OJ_ERR_INVALID_ARGUMENT),
            "n_tokens 9": (p[:9], 9, 0, lib.OJ_ERR_INVALID_ARGUMENT),
            "n_draft 8": (p[-1:], 1, 8, lib.OJ_ERR_INVALID_ARGUMENT),
            "n_draft -1": (p[-1:], 1, -1, lib.OJ_ERR_INVALID_ARGUMENT),
            "n_draft 2 without the current token's MTP row": (p[-1:], 1, 2, lib.OJ_ERR_INVALID_ARGUMENT),
        }
        for what, (toks, n, nd, code) in cases.items():
            rc = raw(toks, n, nd)
            messages[what] = _native.last_error(be._nl, be._handle())
            assert rc == code, f"{what}: status {rc} ({messages[what]!r}), expected {code}"
            assert messages[what], what
            assert (be.n_past, be._mtp_n_past()) == (n0, m0), what
        # the backend refuses the same before the library sees them
        for call, exc in ((lambda: be.cycle([], 0), ValueError), (lambda: be.cycle(p[:9], 0), ValueError),
                          (lambda: be.cycle(p[-1:], 8), ValueError), (lambda: be.cycle(p[-1:], 2), RuntimeError)):
            with pytest.raises(exc):
                call()
            assert (be.n_past, be._mtp_n_past()) == (n0, m0)
        # usable: a draft-less cycle is the plain step, then a drafting one from a fresh row
        k, em, nd = be.cycle(p[-1:], 0)
        got = be.logits(0)
        assert k == 0 and nd == [] and be.n_past == n0 + 1 and be._mtp_n_past() == m0
        assert rel_err(got, want) <= STATE_REL_MAX
        assert em == [int(np.argmax(want))] or _gap(want) < NEAR_TIE
        be.draft_first(em[-1])
        k, em2, nd2 = be.cycle(em, 3)
        assert len(nd2) == 3 and be.n_past == n0 + 2 + k and be._mtp_n_past() == be.n_past + 1
        # the context: a verify past n_ctx is the engine's CONTEXT_FULL, the backend's overflow
        be.eval(p * 4)
        assert be.n_past > 64 - 8
        n1, m1 = be.n_past, be._mtp_n_past()
        rc = raw(p[:8], 8, 0)
        messages["past the context"] = _native.last_error(be._nl, be._handle())
        assert rc == lib.OJ_ERR_CONTEXT_FULL, (rc, messages["past the context"])
        with pytest.raises(ContextOverflowError):
            be.cycle(p[:8], 0)
        assert (be.n_past, be._mtp_n_past()) == (n1, m1)
        k, em3, _ = be.cycle(p[:1], 0)
        assert be.n_past == n1 + 1
    finally:
        be.close()
        mf.close()
    report({"test": "cycle_boundary", "path": where, "messages": messages})
