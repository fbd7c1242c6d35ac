"""The sampled cycle (oj_cycle_sampled, issue 28) on the CPU.

- NativeSpeculator over `SampledToy`, test_native_cycle's toy backend with a sampled cycle under
  the header's contract (the drafts a call verifies must be the ones the last call drew, for its
  next token at its position; every draw from the call's seed): sampled requests the engine can
  draw take it after one host step, with no host verify; the output is reproducible by the
  request's seed; max_emit and the context end hold; requests it cannot draw (top-k off or above
  OJ_SAMPLE_TOP_MAX, penalties, logit bias, logprob rows) and libraries without it take the host
  path.
- NativeBackend.cycle(sampled=...) over the fake library: the settings and seed reach the
  library as given; what it cannot draw, a bad seed or an older library is refused by name before
  the library is called, the backend unchanged.
tests/test_native_cycle_sampled_gpu.py checks the engine's draws against the target distribution.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from openjet_plugin import _native
from openjet_plugin.backends import native
from openjet_plugin.backends.native import SAMPLE_TOP_MAX, sampled_cycle_refusal
from openjet_plugin.sampling import SamplingParams
from openjet_plugin.speculative import DepthPolicy, TokenDistribution, verify_sampled
from openjet_plugin.speculative_native import NativeSpeculator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_bookkeeping as nb  # noqa: E402
import test_native_cycle as nc  # noqa: E402

SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def _row(hist: list[int], salt: int) -> np.ndarray:
    """The toy's logits after `hist` (salt 0: the main model; 1: its MTP head, near but not equal)."""
    g = np.random.default_rng([salt, len(hist)] + [int(t) for t in hist[-3:]])
    return (np.random.default_rng([len(hist)] + [int(t) for t in hist[-3:]]).normal(0, 2, nc.VT)
            + salt * g.normal(0, 1, nc.VT)).astype(np.float32)


class SampledToy(nc.ToyBackend):
    """The toy with oj_cycle_sampled: the main model's and the head's distributions from `_row`,
    the acceptance speculative.verify_sampled's, every uniform from the call's seed. It refuses
    drafts that are not the last sampled call's, as the engine does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.supports_sampled_cycle = True
        self.sampled: list[tuple] = []            # (n_past, tokens, n_draft, params, seed)
        self._drawn: tuple | None = None          # (n_past, token, drafts, their distributions)

    def cycle(self, tokens, n_draft, sampled=None):
        if sampled is None:
            return super().cycle(tokens, n_draft)
        params, seed = sampled
        assert sampled_cycle_refusal(params) is None
        tokens = [int(t) for t in tokens]
        pos = self.n_past
        if n_draft and self.row != (pos, tokens[0]):
            raise RuntimeError(f"no MTP row for token {tokens[0]} at {pos} (row: {self.row})")
        assert pos + len(tokens) + n_draft <= self.n_ctx, "drafts beyond the context"
        drawn, self._drawn = self._drawn, None     # used once
        drafts = tokens[1:]
        if drafts and not (drawn and drawn[:2] == (pos, tokens[0]) and drawn[2][:len(drafts)] == drafts):
            raise RuntimeError(f"drafts {drafts} at {pos} are not the last sampled call's ({drawn})")
        self.calls["cycle_sampled"] += 1
        self.sampled.append((pos, tokens, n_draft, params, seed))
        rng = np.random.default_rng(seed)
        p = [TokenDistribution.from_logits(_row(self.hist + tokens[:i + 1], 0), params)
             for i in range(len(tokens))]
        v = verify_sampled(p, drawn[3][:len(drafts)] if drafts else [], drafts, rng)
        self.hist += tokens[:1 + v.n_accepted]
        new, qs = [], []
        if n_draft:
            self.row = (self.n_past, v.token)
            chain = self.hist + [v.token]
            for _ in range(n_draft):
                q = TokenDistribution.from_logits(_row(chain, 1), params)
                new.append(q.draw(rng.random()))
                qs.append(q)
                chain.append(new[-1])
            self._drawn = (self.n_past, v.token, new, qs)
        return v.n_accepted, drafts[:v.n_accepted] + [v.token], new


def _run(spec: NativeSpeculator, prompt: list[int], n: int, params, seed: int = 0, max_emit: int | None = None):
    b = spec.b
    b.hist = list(prompt[:-1])
    spec.begin(prompt)
    rng = np.random.default_rng(seed)
    out, tok, hist = [], prompt[-1], list(prompt)
    while len(out) < n:
        cap = min(n - len(out), max_emit or n)
        em, depth, acc = spec.cycle(tok, hist, params, rng, cap)
        assert 1 <= len(em) <= cap and len(em) == acc + 1 and acc <= depth
        out += em
        hist += em
        tok = em[-1]
    assert b.hist == hist[:-1]
    return out


@pytest.mark.parametrize("params", [
    SAMPLED,
    SamplingParams(temperature=1.5, top_k=SAMPLE_TOP_MAX, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.3, top_k=1),
], ids=["defaults", "top_k_64", "top_k_1"])
@pytest.mark.parametrize("depth", [1, 4, 7])
def test_sampled_requests_take_the_sampled_cycle(params, depth):
    for prompt in nc.PROMPTS:
        b = SampledToy(depth=depth)
        spec = NativeSpeculator(b, DepthPolicy(depth, adaptive=False))
        _run(spec, prompt, 60, params)
        # one host step makes the first token's MTP row; every cycle after it is one call
        assert b.calls["draft_first"] == 1 and b.calls["verify"] == 0 and b.calls["cycle"] == 0
        assert all(nd == depth for _, _, nd, _, _ in b.sampled[:-1])
        # after the first call every call verifies the drafts the one before drew
        assert len(b.sampled[0][1]) == 1 and all(len(t) > 1 for _, t, _, _, _ in b.sampled[1:-1])
        assert all(s[3] is params for s in b.sampled)
        assert spec.stats.drafts_accepted > 0


def test_top_k_1_is_greedy_decoding_of_the_toy():
    """At top-k 1 every draw is the row's argmax: the output is greedy decoding, whatever the seed."""
    prompt = nc.PROMPTS[3]
    hist = list(prompt)
    for _ in range(40):
        hist.append(int(np.argmax(_row(hist, 0))))
    for seed in (0, 1):
        b = SampledToy(depth=4)
        out = _run(NativeSpeculator(b, 4), prompt, 40, SamplingParams(temperature=0.7, top_k=1), seed=seed)
        assert out == hist[len(prompt):]


def test_the_output_is_reproducible_by_the_request_seed():
    outs = {}
    for seed in (0, 0, 1):
        b = SampledToy(depth=4)
        outs.setdefault(seed, []).append(_run(NativeSpeculator(b, 4), nc.PROMPTS[1], 50, SAMPLED, seed=seed))
        # each call draws from a seed of its own
        seeds = [s[4] for s in b.sampled]
        assert len(set(seeds)) == len(seeds) and all(0 <= s < 1 << 63 for s in seeds)
    assert outs[0][0] == outs[0][1] and outs[0][0] != outs[1][0]


@pytest.mark.parametrize("max_emit", [1, 2, 3, 5, 8])
def test_max_emit_limits_the_drafts_verified(max_emit):
    b = SampledToy(depth=7)
    spec = NativeSpeculator(b, DepthPolicy(7, adaptive=False))
    _run(spec, nc.PROMPTS[3], 40, SAMPLED, max_emit=max_emit)
    assert all(len(t) <= max_emit for _, t, _, _, _ in b.sampled)
    if max_emit == 1:                     # never drafts and never has a row: the host path
        assert b.calls["cycle_sampled"] == 0 and b.calls["verify"] > 0
    else:
        assert b.calls["cycle_sampled"] > 0 and b.calls["verify"] == 0


def test_the_context_end_is_never_passed():
    for n_ctx in (9, 10, 13, 20):
        for depth in (1, 4, 7):
            p = nc.PROMPTS[3]
            b = SampledToy(n_ctx=n_ctx, depth=depth)
            _run(NativeSpeculator(b, depth), p, n_ctx - len(p) + 1, SAMPLED)
            assert b.n_past == n_ctx
            for pos, toks, nd, _, _ in b.sampled:
                assert pos + len(toks) + nd < n_ctx if nd else pos + len(toks) <= n_ctx


@pytest.mark.parametrize("params,why", [
    (SamplingParams(temperature=0.8, top_k=0), "top_k 0 is outside 1..64"),
    (SamplingParams(temperature=0.8, top_k=65), "top_k 65 is outside 1..64"),
    (SamplingParams(temperature=0.8, repeat_penalty=1.3), "penalties"),
    (SamplingParams(temperature=0.8, presence_penalty=0.5), "penalties"),
    (SamplingParams(temperature=0.8, logit_bias={3: 1.5}), "logit_bias"),
], ids=["top_k_off", "top_k_65", "repeat_penalty", "presence_penalty", "logit_bias"])
def test_requests_the_sampled_cycle_cannot_draw_take_the_host_path(params, why):
    assert why in sampled_cycle_refusal(params)
    b = SampledToy(depth=4)
    _run(NativeSpeculator(b, 4), nc.PROMPTS[1], 30, params)
    assert b.calls["cycle_sampled"] == 0 and b.calls["verify"] > 0


def test_refusal_reasons():
    assert sampled_cycle_refusal(SAMPLED) is None
    assert "greedy" in sampled_cycle_refusal(SamplingParams(temperature=0))


def test_logprob_rows_and_older_libraries_take_the_host_path():
    b = SampledToy(depth=4)
    spec = NativeSpeculator(b, 4)
    p = nc.PROMPTS[1]
    b.hist = list(p[:-1])
    spec.begin(p)
    rows: list = []
    spec.cycle(p[-1], p, SAMPLED, np.random.default_rng(0), 8, rows_out=rows)
    assert b.calls["cycle_sampled"] == 0 and b.calls["verify"] == 1 and rows
    b = SampledToy(depth=4)
    b.supports_sampled_cycle = False
    _run(NativeSpeculator(b, 4), p, 20, SAMPLED)
    assert b.calls["cycle_sampled"] == 0 and b.calls["verify"] > 0


# --- NativeBackend.cycle(sampled=...) over the fake library ---------------------------------------

class SampledCycleLib(nc.CycleLib):
    """CycleLib with oj_cycle_sampled (ABI 13): it records the settings and seed it gets and then
    runs the fake oj_cycle (the fake model has no distributions to draw from)."""

    abi = native.SAMPLED_CYCLE_ABI

    def __init__(self, ffi):
        super().__init__(ffi)
        self.settings: list[tuple] = []

    def oj_cycle_sampled(self, h, buf, n, n_draft, sp, n_acc, out, drafts):
        self.settings.append((sp.temperature, sp.top_k, sp.top_p, sp.min_p, int(sp.seed)))
        return self.oj_cycle(h, buf, n, n_draft, n_acc, out, drafts)


@pytest.fixture()
def sampled_native(monkeypatch):
    return nb.install_fake(monkeypatch, SampledCycleLib)


template = nc.template           # the llama.cpp engine whose model file the backends open


def test_the_header_has_the_sampled_cycle():
    from cffi import FFI

    src = _native.cdef_source(_native.SOURCE_HEADER.read_text())
    ffi = FFI()
    ffi.cdef(src)
    lib = ffi.dlopen(None)
    assert lib.OJ_ABI_VERSION >= native.SAMPLED_CYCLE_ABI and lib.OJ_SAMPLE_TOP_MAX == SAMPLE_TOP_MAX
    assert "int32_t oj_cycle_sampled(" in src


def test_the_settings_and_seed_reach_the_library(sampled_native, template):
    be = nc._backend(template)
    lib = sampled_native[-1]
    assert be.supports_sampled_cycle
    be.eval([5, 6, 7])
    be.draft_first(8)
    params = SamplingParams(temperature=0.7, top_k=33, top_p=0.9, min_p=0.02)
    k, em, nd = be.cycle([8], 3, sampled=(params, (1 << 64) - 1))
    assert len(em) == 1 and len(nd) == 3 and be.n_past == 4 and be._token_row == (4, em[-1])
    (t, top_k, top_p, min_p, seed), = lib.settings
    assert (t, top_k, top_p, min_p) == pytest.approx((0.7, 33, 0.9, 0.02)) and seed == (1 << 64) - 1
    be.cycle([em[-1]] + nd, 2, sampled=(params, np.uint64(5)))
    assert lib.settings[-1][4] == 5 and len(lib.cycles) == 2


def test_sampled_cycle_arguments_are_refused_by_name(sampled_native, template, monkeypatch):
    be = nc._backend(template)
    lib = sampled_native[-1]
    be.eval([5, 6, 7])
    be.draft_first(8)
    for params, match in [(SamplingParams(temperature=0), "temperature 0 is greedy"),
                          (SamplingParams(top_k=0), "top_k 0 is outside 1..64"),
                          (SamplingParams(top_k=100), "top_k 100 is outside 1..64"),
                          (SamplingParams(frequency_penalty=0.2), "penalties"),
                          (SamplingParams(logit_bias={1: -1.0}), "logit_bias")]:
        nc._refused(be, lib, lambda: be.cycle([8], 2, sampled=(params, 1)), ValueError, match)
    for seed in (-1, 1 << 64, True, 1.0, "3", None):
        nc._refused(be, lib, lambda: be.cycle([8], 2, sampled=(SAMPLED, seed)), ValueError,
                    r"seed must be an integer in \[0, 2\*\*64\)")
    assert lib.settings == []
    monkeypatch.setattr(SampledCycleLib, "abi", native.SAMPLED_CYCLE_ABI - 1)
    old = nc._backend(template)
    assert not old.supports_sampled_cycle and old.supports_cycle
    old.eval([5, 6, 7])
    old.draft_first(8)
    nc._refused(old, sampled_native[-1], lambda: old.cycle([8], 2, sampled=(SAMPLED, 1)), ValueError,
                "needs oj_cycle_sampled")


def test_another_acceptance_rule_takes_the_host_path():
    """The engine has the standard rule only: a speculator given another (the distribution tests'
    broken rule) verifies on the host."""
    from openjet_plugin.speculative import SampledRule

    b = SampledToy(depth=4)
    _run(NativeSpeculator(b, 4, rule=SampledRule(accept=lambda p, q: 1.0)), nc.PROMPTS[1], 20, SAMPLED)
    assert b.calls["cycle_sampled"] == 0 and b.calls["verify"] > 0


def test_the_sampled_bookkeeping_test_with_oj_cycle_sampled(sampled_native, template):
    """test_native_bookkeeping's sampled test with the library's sampled cycle in the loop (the fake
    one draws greedily underneath): reproducible by seed, the state exactly the history."""
    nb.test_sampled_speculation_on_the_native_bookkeeping(sampled_native, template)
    assert sum(len(lib.settings) for lib in sampled_native) > 0
