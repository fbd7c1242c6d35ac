"""MTP speculative decoding (openjet_plugin/speculative.py) on the numpy reference and on toy models.

What is proved here, on the CPU:
- greedy speculative output equals greedy plain decoding (the reference model stepped one token
  at a time) on the tiny random model and the trained default model, with the MTP head at
  D = 1..4 and with oracle drafts at forced acceptance 0%, 50% and 100%; a divergence is allowed
  only at a logged near-tie (top-2 logit gap < 1e-3) and is counted;
- after a run with rejections the target's state equals the state of decoding the committed
  tokens one at a time, and the MTP cache equals one built from the main hiddens;
- sampled verification keeps the target distribution: chi-square tests (Bonferroni over every
  test of the suite, alpha = 0.001) on the first and second emitted token at D = 1 and D = 4,
  with and without top-k/top-p/min-p, on toy p/q and on p/q vectors of the trained model, and
  with a draft vocabulary that gives q zero mass on half the tokens; the same test rejects two
  deliberately broken rules;
- the draft vocabulary never changes which tokens can be emitted.
The accepted-tokens-per-cycle table of the trained model (held-out stdlib files, D = 1..4,
greedy and temperature 0.7) is printed in pytest's terminal summary.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from scipy import stats as sstats

from openjet_plugin.sampling import Sampler, SamplingParams
from openjet_plugin.speculative import (
    ContinuationDrafts, DepthPolicy, DraftVocab, ForcedAcceptanceDrafts, MTPDrafts, ReferenceDrafter,
    ReferenceTarget, SampledRule, SpeculativeDecoder, SpeculativeStats, TokenDistribution, Verdict,
    acceptance_probability, frequent_token_ids, reference_decoder, residual_distribution,
    verify_greedy, verify_sampled,
)
from openjet_plugin.testing.reference import ReferenceModel
from openjet_plugin.tokenizer import Tokenizer

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_GGUF = REPO / "openjet_plugin" / "data" / "default.gguf"
GREEDY = SamplingParams(temperature=0)
NEAR_TIE = 1e-3
ALPHA = 0.001


# --- shared pieces --------------------------------------------------------------------------------

def heldout_prompts(tok: Tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens from held-out stdlib files outside test directories (files
    the default model was not trained on), each starting at a line with a def after the first
    third of the file."""
    sys.path.insert(0, str(REPO))
    from training.data import heldout_files
    files = [f for f in heldout_files()
             if not {"test", "tests", "idle_test"} & set(f.parts) and f.stat().st_size > 4000]
    assert len(files) >= n, f"only {len(files)} held-out stdlib files"
    out = []
    for f in files[::max(1, len(files) // n)][:n]:
        src = f.read_text(encoding="utf-8", errors="replace")
        third = len(src) // 3
        starts = [i for i in (src.find("\n    def ", third), src.find("\ndef ", third)) if i >= 0]
        start = min(starts) + 1 if starts else third
        toks = tok.encode(src[start:start + 8 * length])[:length]
        assert len(toks) == length, f"{f}: only {len(toks)} tokens"
        out.append(toks)
    return out


class _Summary:
    """Registered as a pytest plugin: prints the speculative tables in the terminal summary."""

    def __init__(self):
        self.lines: list[str] = []

    def pytest_terminal_summary(self, terminalreporter):
        if self.lines:
            terminalreporter.write_sep("=", "MTP speculative decoding (numpy reference)")
            for line in self.lines:
                terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def summary(request):
    s = _Summary()
    request.config.pluginmanager.register(s, "openjet_speculative_summary")
    return s


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(DEFAULT_GGUF)


def greedy_plain(model: ReferenceModel, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding one token at a time, and the top-2 logit gap at every step."""
    logits = model.logits(prompt)[-1]
    out, gaps = [], []
    for _ in range(n):
        two = np.partition(logits, -2)[-2:]
        gaps.append(float(two[1] - two[0]))
        out.append(int(np.argmax(logits)))
        logits = model.step(out[-1])
    return out, gaps


def same_or_near_tie(spec: list[int], plain: list[int], gaps: list[float], label: str, ties: list) -> None:
    """spec == plain, except that from a position whose top-2 gap is below NEAR_TIE on they may
    differ (logged and counted in `ties`)."""
    for i, (a, b) in enumerate(zip(spec, plain)):
        if a != b:
            assert gaps[i] < NEAR_TIE, (f"{label}: speculative output differs at token {i} "
                                        f"({a} vs {b}) where the top-2 gap is {gaps[i]:.3g}")
            ties.append((label, i, gaps[i]))
            print(f"near-tie divergence: {label} at token {i}, top-2 gap {gaps[i]:.3g}")
            return
    assert len(spec) == len(plain), f"{label}: {len(spec)} tokens, plain decoding gave {len(plain)}"


# --- the pure pieces ------------------------------------------------------------------------------

def test_verify_greedy_accepts_the_matching_prefix():
    assert verify_greedy([5, 6, 7], [5, 6]) == Verdict(2, 7)        # all accepted, bonus 7
    assert verify_greedy([5, 6, 7], [5, 9]) == Verdict(1, 6)        # second rejected, corrected to 6
    assert verify_greedy([5, 6, 7], [4, 6]) == Verdict(0, 5)        # a later match does not count
    assert verify_greedy([3], []) == Verdict(0, 3)
    with pytest.raises(ValueError, match="target tokens"):
        verify_greedy([1, 2], [1, 2])


def test_sampled_rule_pieces():
    assert acceptance_probability(0.2, 0.4) == pytest.approx(0.5)
    assert acceptance_probability(0.5, 0.1) == 1.0
    with pytest.raises(ValueError, match="probability 0"):
        acceptance_probability(0.5, 0.0)
    p, q = np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.2, 0.5, 0.0, 0.3])
    np.testing.assert_allclose(residual_distribution(p, q), [0.6, 0.0, 0.4, 0.0])
    np.testing.assert_allclose(residual_distribution(p, p), p)       # no mass left: p itself
    # a point-mass draft: accepted with probability p(x), else drawn from p without x
    rng = np.random.default_rng(0)
    pd = TokenDistribution.from_probs(p)
    got = [verify_sampled([pd, pd], [TokenDistribution.point(1, 4)], [1], rng) for _ in range(4000)]
    accepted = np.mean([v.n_accepted for v in got])
    assert abs(accepted - 0.3) < 0.03
    assert {v.token for v in got if v.n_accepted == 0} <= {0, 2}


def test_token_distribution_matches_the_sampler():
    """A distribution built from logits draws exactly what Sampler.sample draws for the same uniform."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=300).astype(np.float32) * 3
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=7,
                            repeat_penalty=1.3, logit_bias={3: 2.0})
    history = [3, 4, 5, 4]
    d = TokenDistribution.from_logits(logits, params, history)
    s = Sampler(params)
    us = np.random.default_rng(7).random(50)
    assert [s.sample(logits, history) for _ in range(50)] == [d.draw(u) for u in us]
    assert d.dense().sum() == pytest.approx(1.0)
    assert len(d.ids) <= 20


def test_frequent_tokens_by_merge_rank():
    tokens = ["a", "b", "c", "ab", "abc", "<|end|>", "bc", "zz"]
    types = [1, 1, 1, 1, 1, 3, 1, 1]
    merges = ["a b", "b c", "ab c"]          # ranks: ab 0, bc 1, abc 2; zz is made by no merge
    assert frequent_token_ids(tokens, types, merges, 1).tolist() == [5]          # control first
    assert frequent_token_ids(tokens, types, merges, 4).tolist() == [0, 1, 2, 5]  # then base chars
    assert frequent_token_ids(tokens, types, merges, 6).tolist() == [0, 1, 2, 3, 5, 6]
    assert frequent_token_ids(tokens, types, merges, 100).tolist() == list(range(8))   # capped
    with pytest.raises(ValueError, match="positive integer"):
        frequent_token_ids(tokens, types, merges, 0)


def test_draft_vocab_from_the_model_file():
    full = DraftVocab.from_gguf(DEFAULT_GGUF)          # default 32,768, capped at n_vocab
    assert len(full) == full.n_vocab == 4096
    small = DraftVocab.from_gguf(DEFAULT_GGUF, size=300)
    assert len(small) == 300
    assert 4089 in small                              # <|im_end|>, a control token, is always in
    assert all(b in small for b in range(3))          # byte tokens come first
    req = small.copy()
    outside = [t for t in (4000, 4001) if t not in small]
    req.add(outside)                                  # tokens of the sequence join the request's copy
    assert all(t in req for t in outside) and len(req) == 300 + len(outside)
    assert all(t not in small for t in outside)       # the base set is untouched
    with pytest.raises(ValueError, match="outside"):
        DraftVocab([0, 5000], 4096)


def test_depth_policy():
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        DepthPolicy(9)
    with pytest.raises(ValueError, match="floor"):
        DepthPolicy(4, floor=0)
    p = DepthPolicy(4)                       # adaptive, floor 3 (the seed: 4 -> 3 after a rejection)
    seq = []
    for accepted in (4, 2, 1, 3, 0, 4):
        d = p.next_depth()
        seq.append(d)
        p.update(d, min(accepted, d))
    assert seq == [4, 4, 3, 3, 4, 3]
    p = DepthPolicy(4, floor=1)               # aggressive: down to 1, one step up per full acceptance
    seq = []
    for accepted in (0, 0, 0, 0, 1, 2):
        d = p.next_depth()
        seq.append(d)
        p.update(d, min(accepted, d))
    assert seq == [4, 3, 2, 1, 1, 2]
    f = DepthPolicy(4, adaptive=False)
    f.update(4, 0)
    assert f.next_depth() == 4


# --- greedy: speculative == plain ------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_cases(tiny_reference, default_reference, tokenizer):
    """Per model: prompts and their plain greedy continuations (with top-2 gaps)."""
    prompts = heldout_prompts(tokenizer, 3, 24)
    out = {}
    for name, model, n in (("tiny", tiny_reference, 24), ("default", default_reference, 24)):
        out[name] = (model, [(p,) + greedy_plain(model, p, n) for p in prompts], n)
    return out


@pytest.fixture(scope="module")
def near_ties():
    return []


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_greedy_mtp_equals_plain(greedy_cases, near_ties, name, summary):
    model, cases, n = greedy_cases[name]
    rows = []
    for D in (1, 2, 3, 4):
        total = SpeculativeStats(D)
        for k, (prompt, plain, gaps) in enumerate(cases):
            dec = reference_decoder(model, DepthPolicy(D, adaptive=(D == 4)))
            r = dec.generate(prompt, GREEDY, max_tokens=n)
            same_or_near_tie(r.tokens, plain, gaps, f"{name} D={D} prompt {k}", near_ties)
            total = total.merge(r.stats)
        assert total.generated_tokens == n * len(cases)
        rows.append(f"  {name:<8} D={D}: {total.tokens_per_cycle:.2f} tokens/cycle, "
                    f"{total.drafts_accepted}/{total.drafts_proposed} drafts accepted")
    summary.lines += [f"greedy MTP == plain ({name}, {len(cases)} prompts x {n} tokens; "
                      f"near-tie divergences so far: {len(near_ties)})"] + rows


@pytest.mark.parametrize("name", ["tiny", "default"])
@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_greedy_forced_acceptance_equals_plain(greedy_cases, near_ties, name, rate):
    model, cases, n = greedy_cases[name]
    D = 4
    total = SpeculativeStats(D)
    for k, (prompt, plain, gaps) in enumerate(cases[:2]):
        drafts = ForcedAcceptanceDrafts(prompt + plain, model.n_vocab, rate=rate, seed=k)
        dec = SpeculativeDecoder(ReferenceTarget(model), drafts, DepthPolicy(D, adaptive=False))
        r = dec.generate(prompt, GREEDY, max_tokens=n)
        same_or_near_tie(r.tokens, plain, gaps, f"{name} forced {rate:.0%} prompt {k}", near_ties)
        total = total.merge(r.stats)
    # the forced rate is what verification sees (the last cycle may draft fewer)
    if rate == 0.0:
        assert total.drafts_accepted == 0 and total.tokens_per_cycle == 1.0
    elif rate == 1.0:
        assert total.drafts_accepted == total.drafts_proposed
        assert total.tokens_per_cycle > D
    else:
        assert 0.2 < total.acceptance_at(0) < 0.8


def test_forced_pattern_gives_exactly_that_acceptance(greedy_cases):
    model, cases, n = greedy_cases["default"]
    prompt, plain, _ = cases[0]
    pattern = [0, 3, 1, 4, 2]
    drafts = ForcedAcceptanceDrafts(prompt + plain, model.n_vocab, pattern=pattern)
    dec = SpeculativeDecoder(ReferenceTarget(model), drafts, DepthPolicy(4, adaptive=False))
    per_cycle = [len(t) for t, _ in dec.cycles(prompt, GREEDY, max_tokens=n)]
    expect = [pattern[c % len(pattern)] + 1 for c in range(len(per_cycle))]
    assert per_cycle[:-1] == expect[:-1] and per_cycle[-1] <= expect[-1]
    assert sum(per_cycle) == n


def test_continuation_drafts(greedy_cases):
    """Drafts from a given continuation: all accepted while it lasts, none proposed past its end,
    and the output is plain greedy throughout."""
    model, cases, n = greedy_cases["default"]
    prompt, plain, gaps = cases[2]
    drafts = ContinuationDrafts(prompt + plain[:10], model.n_vocab)
    dec = SpeculativeDecoder(ReferenceTarget(model), drafts, DepthPolicy(4, adaptive=False))
    per_cycle = [len(t) for t, _ in dec.cycles(prompt, GREEDY, max_tokens=n)]
    r = dec.last_stats
    assert per_cycle[:2] == [5, 5]                     # 10 continuation tokens: two full cycles
    assert r.drafts_accepted == r.drafts_proposed == 8    # and 2 bonus tokens
    assert per_cycle[2:] == [1] * (n - 10)             # then plain decoding, one token a cycle
    r2 = SpeculativeDecoder(ReferenceTarget(model), drafts, 4).generate(prompt, GREEDY, max_tokens=n)
    same_or_near_tie(r2.tokens, plain, gaps, "continuation drafts", [])


def test_state_after_rejections_equals_one_at_a_time(default_reference, reference_model, tokenizer):
    """The committed state (DeltaNet conv/recurrent, K/V) and the MTP cache after a run with
    rejections equal those of evaluating the committed tokens one at a time."""
    model = default_reference
    prompt = heldout_prompts(tokenizer, 1, 24)[0]
    dec = reference_decoder(model, DepthPolicy(4, adaptive=False))
    r = dec.generate(prompt, GREEDY, max_tokens=20)
    assert r.stats.drafts_accepted < r.stats.drafts_proposed       # there were rejections
    assert 0 < r.stats.drafts_accepted                             # and acceptances
    committed = prompt + r.tokens[:-1]                             # the last token is not evaluated
    assert model.n_past == len(committed) and model.tokens == committed
    spec_state = model.state()

    fresh = reference_model(DEFAULT_GGUF, fresh=True)
    fresh.forward(committed[:1])
    for t in committed[1:]:
        fresh.step(t)
    fresh.mtp_prefill()
    want = fresh.state()
    for key, w in want.items():
        got = spec_state[key]
        if key.startswith("mtp."):
            # rows of rejected drafts beyond the committed positions may remain: they are
            # overwritten before use (a draft at position p drops rows >= p)
            keep = spec_state["mtp.pos"] < len(committed)
            got = got[keep]
        assert got.shape == w.shape, key
        err = np.abs(got - w).max() / max(np.abs(w).max(), 1e-30)
        assert err <= 1e-4, f"{key}: relative error {err:.2e}"


def test_restricted_draft_vocab_never_restricts_output(greedy_cases):
    """Drafts come from 64 tokens and the sequence's tokens are NOT added: every emitted token
    outside those 64 came from the correction or bonus, and the output is still plain greedy."""
    model, cases, n = greedy_cases["default"]
    prompt, plain, gaps = cases[1]
    small = DraftVocab(range(64), model.n_vocab, dynamic=False)
    dec = SpeculativeDecoder(ReferenceTarget(model), MTPDrafts(ReferenceDrafter(model), small),
                             DepthPolicy(4, adaptive=False))
    r = dec.generate(prompt, GREEDY, max_tokens=n)
    same_or_near_tie(r.tokens, plain, gaps, "restricted draft vocab", [])
    assert any(t not in small for t in r.tokens)


def test_plain_sampling_through_the_decoder_equals_the_sampler(tiny_reference):
    """Depth 0 draws exactly the tokens the engine's Sampler draws (same seed, same rule)."""
    model = tiny_reference
    prompt = [10, 200, 3000, 45, 7]
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, seed=3, repeat_penalty=1.1)
    r = SpeculativeDecoder(ReferenceTarget(model), None).generate(prompt, params, max_tokens=12)
    sampler, history = Sampler(params), list(prompt)
    logits, want = model.logits(prompt)[-1], []
    for _ in range(12):
        t = sampler.sample(logits, history)
        want.append(t)
        history.append(t)
        logits = model.step(t)
    assert r.tokens == want


def test_sampled_mtp_emits_only_target_candidates(default_reference, tokenizer):
    """Sampled speculation with the MTP head on the real model: reproducible for a seed, and every
    emitted token is a candidate of the target at its context (top-k 3), which a state or position
    bug would break."""
    model = default_reference
    prompt = heldout_prompts(tokenizer, 1, 24)[0]
    params = SamplingParams(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0, seed=11)
    a = reference_decoder(model, 4).generate(prompt, params, max_tokens=20)
    b = reference_decoder(model, 4).generate(prompt, params, max_tokens=20)
    assert a.tokens == b.tokens and a.stats.cycles < 20
    logits = model.logits(prompt + a.tokens[:-1])[len(prompt) - 1:]
    for i, t in enumerate(a.tokens):
        cand = TokenDistribution.from_logits(logits[i], params, prompt + a.tokens[:i]).ids
        assert t in cand, f"token {i} ({t}) is not among the target's candidates {cand.tolist()}"


# --- sampled: the distribution is the target's --------------------------------------------------

def _context_index(ctx) -> int:
    h = 0
    for t in ctx:
        h = (h * 1000003 + int(t) + 1) % (1 << 61)
    return h


class TableTarget:
    """A toy target: the logits after a context are row hash(context) of a table. Its hidden after
    a position is the context itself, which the TableDrafter reads."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows
        self.n_vocab = rows.shape[1]
        self.ctx: list[int] = []
        self._last: list[int] = []

    def logits_after(self, ctx) -> np.ndarray:
        return self.rows[_context_index(ctx) % len(self.rows)]

    @property
    def n_past(self):
        return len(self.ctx)

    def reset(self):
        self.ctx = []

    def prefill(self, tokens):
        self.ctx += list(tokens)
        return [tuple(self.ctx[:i + 1]) for i in range(len(self.ctx) - len(tokens), len(self.ctx))]

    def verify(self, tokens):
        self._last = list(tokens)
        ctxs = [tuple(self.ctx + self._last[:i + 1]) for i in range(len(tokens))]
        return np.array([self.logits_after(c) for c in ctxs]), ctxs

    def commit(self, n):
        self.ctx += self._last[:n]


class TableDrafter:
    """A toy MTP head: the draft logits after a context are row hash(context) of its own table."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows
        self.n_vocab = rows.shape[1]

    def reset(self):
        pass

    def step(self, pos, token, hidden, vocab_ids):
        ctx = (tuple(hidden) if hidden is not None else ()) + (int(token),)
        row = self.rows[_context_index(ctx) % len(self.rows)]
        return (row[vocab_ids] if vocab_ids is not None else None), ctx


_expected_cache: dict = {}


def expected_first_two(p_rows: np.ndarray, prompt: list[int], params: SamplingParams):
    """Exact distributions of the first and of the second emitted token under the target."""
    key = (id(p_rows), tuple(prompt), params)
    if key not in _expected_cache:
        _expected_cache[key] = _expected_first_two(p_rows, prompt, params)
    return _expected_cache[key]


def _expected_first_two(p_rows, prompt, params):
    t = TableTarget(p_rows)
    p1 = TokenDistribution.from_logits(t.logits_after(prompt), params, prompt)
    p2 = np.zeros(t.n_vocab)
    for x, px in zip(p1.ids, p1.probs):
        ctx = prompt + [int(x)]
        p2 += px * TokenDistribution.from_logits(t.logits_after(ctx), params, ctx).dense()
    return p1.dense(), p2


def chi_square_p(samples: np.ndarray, expected: np.ndarray) -> float:
    """p-value of the chi-square goodness-of-fit test; cells with expected count < 5 are pooled,
    and a sample the target gives probability 0 fails outright (p = 0)."""
    n = len(samples)
    counts = np.bincount(samples, minlength=expected.size)
    if counts[expected <= 0].sum():
        return 0.0
    e = expected * n
    big = e >= 5
    obs, exp = list(counts[big]), list(e[big])
    small = (~big) & (expected > 0)
    if small.any():
        if e[small].sum() >= 5 or not obs:
            obs.append(counts[small].sum())
            exp.append(e[small].sum())
        else:                                     # too little to stand alone: join the smallest cell
            j = int(np.argmin(exp))
            obs[j] += counts[small].sum()
            exp[j] += e[small].sum()
    if len(obs) < 2:
        return 1.0
    return float(sstats.chisquare(np.array(obs, float), np.array(exp, float)).pvalue)


N_SAMPLES = 2000
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
TOY_FILTERED = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05)
REAL_FILTERED = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)
# (p/q source, depth, filters, draft vocabulary restricted to half the tokens)
CASES = [(src, D, filt, False) for src in ("toy", "real") for D in (1, 4) for filt in (False, True)]
CASES += [("toy", D, False, True) for D in (1, 4)]
N_TESTS = 2 * len(CASES)                      # first and second emitted token of every case
ALPHA_EACH = ALPHA / N_TESTS                  # Bonferroni


@pytest.fixture(scope="module")
def pq_tables(default_reference, tokenizer):
    """p and q tables. toy: 8 tokens, 16 random rows each, q drawn apart from p. real: the trained
    model's teacher-forced logits over 32 positions of a held-out file (p) and its MTP head's
    logits at the same positions (q), so q is the real draft of the same next token."""
    rng = np.random.default_rng(2024)
    toy = (rng.normal(scale=1.5, size=(16, 8)), rng.normal(scale=1.5, size=(16, 8)))
    prompt = heldout_prompts(tokenizer, 2, 32)[1]
    m = default_reference
    p_rows = m.logits(prompt)
    m.mtp_reset()
    q_rows = m.mtp_prefill()
    return {"toy": toy, "real": (p_rows[1:], q_rows[1:])}


def sample_first_two(p_rows, q_rows, depth, params, restrict, rule, seed, prompt):
    vocab = None
    if restrict:
        vocab = DraftVocab(range(0, q_rows.shape[1], 2), q_rows.shape[1], dynamic=False)
    dec = SpeculativeDecoder(TableTarget(p_rows), MTPDrafts(TableDrafter(q_rows), vocab),
                             DepthPolicy(depth, adaptive=False), rule=rule)
    rng = np.random.default_rng(seed)
    out = np.empty((N_SAMPLES, 2), dtype=np.int64)
    for i in range(N_SAMPLES):
        # room for full-depth cycles (the decoder never drafts past max_tokens); stop after two tokens
        got: list[int] = []
        for toks, _ in dec.cycles(prompt, params, max_tokens=depth + 2, rng=rng):
            got += toks
            if len(got) >= 2:
                break
        out[i] = got[:2]
    assert dec.last_stats.cycles_at_depth[depth] > 0
    return out


def run_case(pq_tables, src, depth, filt, restrict, rule=SampledRule()):
    p_rows, q_rows = pq_tables[src]
    params = (REAL_FILTERED if src == "real" else TOY_FILTERED) if filt else PLAIN
    prompt = [1, 2, 3]
    e1, e2 = expected_first_two(p_rows, prompt, params)
    s = sample_first_two(p_rows, q_rows, depth, params, restrict, rule, seed=depth * 10 + filt, prompt=prompt)
    return chi_square_p(s[:, 0], e1), chi_square_p(s[:, 1], e2)


@pytest.mark.parametrize("src,depth,filt,restrict", CASES,
                         ids=[f"{s}-D{d}-{'filtered' if f else 'plain'}{'-restricted' if r else ''}"
                              for s, d, f, r in CASES])
def test_sampled_verification_keeps_the_target_distribution(pq_tables, src, depth, filt, restrict, summary):
    p1, p2 = run_case(pq_tables, src, depth, filt, restrict)
    summary.lines.append(f"chi-square {src} D={depth} {'filtered' if filt else 'plain'}"
                         f"{' restricted-q' if restrict else ''}: p(first) = {p1:.3g}, "
                         f"p(second) = {p2:.3g} (alpha each {ALPHA_EACH:.1e}, {N_SAMPLES} samples)")
    assert p1 > ALPHA_EACH, f"first emitted token is not distributed as the target (p = {p1:.3g})"
    assert p2 > ALPHA_EACH, f"second emitted token is not distributed as the target (p = {p2:.3g})"


BROKEN = {
    "accept min(1, q/p)": SampledRule(accept=lambda p, q: min(1.0, q / p) if p > 0 else 0.0),
    "resample from p": SampledRule(residual=lambda p, q: np.array(p, copy=True)),
}


@pytest.mark.parametrize("broken", list(BROKEN))
@pytest.mark.parametrize("depth", [1, 4])
def test_the_distribution_test_catches_a_broken_rule(pq_tables, broken, depth, summary):
    p1, p2 = run_case(pq_tables, "toy", depth, False, False, rule=BROKEN[broken])
    summary.lines.append(f"chi-square with broken rule '{broken}' toy D={depth}: "
                         f"p(first) = {p1:.3g}, p(second) = {p2:.3g} (must be caught)")
    assert min(p1, p2) <= ALPHA_EACH, f"the chi-square test did not catch '{broken}'"


# --- accepted tokens per cycle of the trained model ---------------------------------------------

@pytest.mark.slow
def test_tokens_per_cycle_of_the_trained_model(default_reference, tokenizer, summary):
    """The drafts are real: the trained MTP head's drafts are accepted. Held-out stdlib prompts
    (64 tokens) x 64 generated tokens, D = 1..4, greedy and temperature 0.7 (top-k 40, top-p 0.95,
    min-p 0.05), fixed depth, and adaptive at D = 4."""
    model = default_reference
    prompts = heldout_prompts(tokenizer, 3, 64)
    n = 64
    modes = [("greedy", GREEDY), ("T=0.7", SamplingParams(temperature=0.7, seed=5))]
    lines = [f"trained default model, reference target + its MTP head, {len(prompts)} held-out prompts "
             f"x {n} tokens per row", f"  {'mode':<7}{'D':>2} {'policy':<9}{'tok/cycle':>10}{'cycles':>7}"
             f"{'pos/token':>10}  P(drafts 1..i accepted), i = 1..D"]
    lines.append("  (pos/token: target positions verified per generated token, the cost side; "
                 "replay and MTP steps not counted)")
    results = {}
    for mode, params in modes:
        for D, adaptive in [(1, False), (2, False), (3, False), (4, False), (4, True)]:
            total = SpeculativeStats(D)
            for k, prompt in enumerate(prompts):
                dec = reference_decoder(model, DepthPolicy(D, adaptive=adaptive))
                r = dec.generate(prompt, params, max_tokens=n, rng=np.random.default_rng(k))
                total = total.merge(r.stats)
            results[(mode, D, adaptive)] = total
            lines.append(f"  {mode:<7}{D:>2} {'adaptive' if adaptive else 'fixed':<9}"
                         f"{total.tokens_per_cycle:>10.2f}{total.cycles:>7}"
                         f"{total.positions_verified / total.generated_tokens:>10.2f}  "
                         + " ".join(f"{total.acceptance_at(i):.2f}" for i in range(D)))
    summary.lines += lines
    print("\n".join(lines))
    for (mode, D, adaptive), s in results.items():
        assert s.generated_tokens == n * len(prompts)
        assert 1.0 <= s.tokens_per_cycle <= D + 1
    # a trained head drafts the right next token far more often than chance (1/4096)
    assert results[("greedy", 1, False)].acceptance_at(0) > 0.3
    # issue 11's target: >= 2 tokens per cycle at D = 4 greedy (3.00 here on 3 prompts; 2.61 on the
    # native engine over 12), and deeper drafting pays
    assert results[("greedy", 4, False)].tokens_per_cycle >= 2.0
    assert results[("greedy", 4, False)].tokens_per_cycle > results[("greedy", 1, False)].tokens_per_cycle


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),                                     # top-k 40, top-p 0.95, min-p 0.05
    SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.3, top_k=200, top_p=0.5, min_p=0.0),
    SamplingParams(temperature=0.0),                                     # greedy
])
def test_a_restricted_draft_row_gives_the_distribution_of_its_scatter(params):
    """TokenDistribution.from_logits over a restricted draft head's row (vocab_ids) reads the row where
    it is when no penalty or bias applies: the same ids and probabilities, bit for bit, as the row
    scattered into -inf over the whole vocabulary (ties at the cut included); prob() reads the support
    without a dense row and agrees with dense() in and out of it."""
    rng = np.random.default_rng(7)
    V = 5000
    ids = np.sort(rng.choice(V, 700, replace=False))
    for _ in range(20):
        row = np.round(rng.standard_normal(len(ids)) * 3, 1).astype(np.float32)    # many ties
        fast = TokenDistribution.from_logits(row, params, (), vocab_ids=ids, n_vocab=V)
        full = np.full(V, -np.inf, dtype=np.float32)
        full[ids] = row
        slow = TokenDistribution.from_logits(full, params)
        assert np.array_equal(fast.ids, slow.ids) and np.array_equal(fast.probs, slow.probs)
        assert fast.n_vocab == slow.n_vocab == V
        for tok in [int(fast.ids[0]), int(fast.ids[-1]), int(np.setdiff1d(np.arange(V), fast.ids)[0])]:
            assert fast.prob(tok) == slow.dense()[tok]
    # penalties read the history over the whole vocabulary: the scatter path, unchanged
    pen = SamplingParams(temperature=0.7, repeat_penalty=1.3)
    hist = [int(ids[3]), int(ids[9])]
    row = rng.standard_normal(len(ids)).astype(np.float32)
    full = np.full(V, -np.inf, dtype=np.float32)
    full[ids] = row
    a = TokenDistribution.from_logits(row, pen, hist, vocab_ids=ids, n_vocab=V)
    b = TokenDistribution.from_logits(full, pen, hist)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.probs, b.probs)
    with pytest.raises(ValueError, match="expected \\(700,\\)"):
        TokenDistribution.from_logits(row[:5], params, (), vocab_ids=ids, n_vocab=V)
    with pytest.raises(ValueError, match="n_vocab is required"):
        TokenDistribution.from_logits(row, params, (), vocab_ids=ids)


def test_a_rejection_draws_from_the_supports_union_as_from_the_dense_rows():
    """verify_sampled's residual over the union of p's and q's supports (where top-k keeps them small)
    gives the verdicts the dense rows over the whole vocabulary give, uniform for uniform; at() reads
    dense()[ids] from the support, repeated ids included."""
    def dense_verify(p, q, drafts, rng):                     # the rule over whole-vocabulary rows
        for i, x in enumerate(drafts):
            if rng.random() < acceptance_probability(p[i].prob(int(x)), q[i].prob(int(x))):
                continue
            r = residual_distribution(p[i].dense(), q[i].dense())
            ids = np.flatnonzero(r > 0)
            return Verdict(i, int(ids[np.searchsorted(np.cumsum(r[ids]), rng.random() * r[ids].sum(), side="right")
                                    .clip(max=len(ids) - 1)]))
        return Verdict(len(drafts), p[-1].draw(rng.random()))

    gen = np.random.default_rng(11)
    V, params = 4000, SamplingParams(temperature=0.8, top_k=12, top_p=1.0, min_p=0.0)
    rejected = 0
    for seed in range(300):
        p = [TokenDistribution.from_logits(gen.standard_normal(V).astype(np.float32) * 2, params) for _ in range(3)]
        q = [TokenDistribution.from_logits(gen.standard_normal(V).astype(np.float32) * 2, params) for _ in range(2)]
        drafts = [q[0].draw(gen.random()), q[1].draw(gen.random())]
        a = verify_sampled(p, q, drafts, np.random.default_rng(seed))
        b = dense_verify(p, q, drafts, np.random.default_rng(seed))
        assert a == b
        rejected += a.n_accepted < 2
    assert rejected > 100                                    # the residual path ran, many times
    d = TokenDistribution(np.array([5, 2, 5, 9]), np.array([0.1, 0.2, 0.3, 0.4]), 12)
    ids = np.arange(12)
    assert np.array_equal(d.at(ids), TokenDistribution(d.ids, d.probs, 12).dense()[ids])
    assert d.prob(5) == d.dense()[5] and d.prob(3) == 0.0
