"""Generated models whose MTP head ranks the right token second where it is wrong (`mtp_runner_up`).

With `mtp_accuracy=r` alone the head's draft is right after a share r of the tokens and, after the
others, some other token with the right one ranked last: a draft tree's second branch never wins.
`mtp_runner_up=q` (synth.py, "MTP runner-up") makes a fixed decoy token the head's first choice after
a share q of those wrong tokens and the right token its second. Measured here with the numpy
reference on tiny's own greedy continuation of a real-text prompt, teacher-forced (the main model's
hidden state and token, as tests/test_synth_acceptance.py measures mtp_accuracy): top-1 and top-2
acceptance of the first draft, and the share of misses whose right token is second.
"""

from __future__ import annotations

import numpy as np
import pytest

from openjet_plugin.config import PRESETS
from openjet_plugin.testing.llama_ref import tokenize
from openjet_plugin.testing.reference import ReferenceModel
from openjet_plugin.testing.synth import (
    MTP_RUNNER_UP_KEY, check_mtp_runner_up, mtp_decoy, mtp_runner_up_of, mtp_switch, synth_main, synth_model,
)
from test_reference import real_text
from test_synth_acceptance import N_GEN, N_PROMPT, _differing_tensors, _tensors, greedy_sequence

# (mtp_accuracy, mtp_runner_up) measured; None: the accuracy switch alone
SETTINGS = ((0.6, None), (0.6, 0.8), (0.75, None), (0.75, 0.5), (0.75, 0.8))
# Measured (tiny F32, seed 0, 300 positions; python /tmp/ru/measure.py when written):
#   acc 0.6: top-1 0.572, top-2 0.572 (q none) | 0.582, 0.913, second|miss 0.792 (q 0.8)
#   acc 0.75: top-1 0.702, top-2 0.702 (q none) | 0.716, 0.870, 0.541 (q 0.5) | 0.719, 0.946, 0.810 (q 0.8)
# The miss share is over ~90-130 misses: +-0.05 of sampling alone, plus the tokens near the decoy's
# threshold that the context half flips.
SHARE_TOL = 0.1
TOP1_TOL = 0.03            # the decoy leaves top-1 acceptance where the switch put it


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp-runner-up")
    out = {None: synth_model(d / "tiny-F32.gguf", "tiny", "F32")}
    for acc, q in SETTINGS:
        out[(acc, q)] = synth_model(d / f"tiny-F32-{acc}-{q}.gguf", "tiny", "F32", mtp_accuracy=acc, mtp_runner_up=q)
    out[(0.75, 0.0)] = synth_model(d / "tiny-F32-0.75-0.gguf", "tiny", "F32", mtp_accuracy=0.75, mtp_runner_up=0.0)
    return out


@pytest.fixture(scope="module")
def greedy(files):
    ref = ReferenceModel(files[None])
    prompt = tokenize(files[None], real_text())[:N_PROMPT]
    return greedy_sequence(ref, prompt, N_GEN)


def first_draft_ranks(path, seq, hidden) -> np.ndarray:
    """Rank (0 = top) of the sequence's next token in the MTP head's first draft, teacher-forced,
    at every generated position."""
    m = ReferenceModel(path)
    m.mtp_reset()
    zero = np.zeros(m.config.n_embd)
    ranks = []
    for p in range(len(seq) - 1):
        logits, _ = m.mtp_logits(hidden[p - 1] if p else zero, int(seq[p]), pos=p)
        if p >= N_PROMPT:
            ranks.append(int(np.sum(logits > logits[int(seq[p + 1])])))
    return np.array(ranks)


def test_arguments_are_checked():
    cfg = PRESETS["tiny"]
    for bad, match in ((1.0, "in \\[0, 1\\)"), (-0.1, "in \\[0, 1\\)"), (True, "number"), ("0.5", "number")):
        with pytest.raises(ValueError, match=match):
            check_mtp_runner_up(cfg, 0.75, bad)
    with pytest.raises(ValueError, match="needs mtp_accuracy"):
        check_mtp_runner_up(cfg, None, 0.5)
    with pytest.raises(ValueError, match="mtp_accuracy < 1"):
        check_mtp_runner_up(cfg, 1.0, 0.5)
    import dataclasses
    narrow = dataclasses.replace(cfg, n_ff=254)      # the switch's 254 units fit, the decoy's two do not
    with pytest.raises(ValueError, match="MTP FFN units"):
        check_mtp_runner_up(narrow, 0.75, 0.5)
    check_mtp_runner_up(cfg, 0.75, None)             # off: nothing to check


def test_the_decoy_makes_the_asked_share_on_the_weights():
    """On the head's token-half logits (the weights alone) exactly round(q * wrong tokens) wrong
    tokens rank the right token second, none of the right ones does, and the decoy is no wrong
    token's successor."""
    cfg = PRESETS["tiny"]
    for acc in (0.6, 0.75):
        sw = mtp_switch(0, cfg, acc)
        wrong = ~sw.right()
        for q in (0.3, 0.5, 0.8):
            dec = mtp_decoy(0, cfg, acc, q)
            assert dec.n_runner == round(q * wrong.sum())
            runner = dec.runner()
            assert runner.sum() == dec.n_runner and not (runner & ~wrong).any()
            assert 0 < dec.strength < 1
        assert mtp_decoy(0, cfg, acc, 0.0).strength == 0.0


def test_only_the_mtp_ffn_changes(files):
    """Against the accuracy switch alone: the same tensors and types, only the MTP FFN differs; the
    share is in the metadata; q = 0 writes the switch's values exactly."""
    cfg = PRESETS["tiny"]
    il = cfg.mtp_layer
    ffn = sorted(f"blk.{il}.{t}.weight" for t in ("ffn_gate", "ffn_up", "ffn_down"))
    assert _differing_tensors(files[(0.75, None)], files[(0.75, 0.8)]) == ffn
    assert _differing_tensors(files[(0.75, None)], files[(0.75, 0.0)]) == []
    assert mtp_runner_up_of(files[(0.75, 0.8)]) == 0.8
    assert mtp_runner_up_of(files[(0.75, None)]) is None
    reader, _ = _tensors(files[(0.75, None)])
    assert MTP_RUNNER_UP_KEY not in reader.fields


@pytest.mark.parametrize("acc,q", [s for s in SETTINGS if s[1] is not None])
def test_the_right_token_is_second_where_the_head_misses(files, greedy, acc, q):
    seq, hidden = greedy
    base = first_draft_ranks(files[(acc, None)], seq, hidden)
    ranks = first_draft_ranks(files[(acc, q)], seq, hidden)
    top1, top2 = np.mean(ranks == 0), np.mean(ranks <= 1)
    second = np.sum(ranks == 1) / max(1, np.sum(ranks > 0))
    print(f"acc {acc} q {q}: top-1 {top1:.3f} (switch alone {np.mean(base == 0):.3f}), top-2 {top2:.3f}, "
          f"second of misses {second:.3f}")
    assert abs(top1 - np.mean(base == 0)) <= TOP1_TOL
    assert np.mean(base <= 1) == np.mean(base == 0)        # the switch alone: never second
    assert abs(second - q) <= SHARE_TOL
    assert top2 >= top1 + (1 - top1) * (q - SHARE_TOL)


def test_the_direct_writer_makes_the_same_share(tmp_path, greedy):
    """tiny as Q4_K_M blocks written directly (q27b's path): the decoy's rows quantised from floats."""
    seq, hidden = greedy
    path = synth_model(tmp_path / "tiny-direct.gguf", "tiny", "Q4_K_M", direct=True, mtp_accuracy=0.75,
                       mtp_runner_up=0.8)
    ranks = first_draft_ranks(path, seq, hidden)
    second = np.sum(ranks == 1) / max(1, np.sum(ranks > 0))
    print(f"direct Q4_K_M acc 0.75 q 0.8: top-1 {np.mean(ranks == 0):.3f}, second of misses {second:.3f}")
    assert abs(second - 0.8) <= SHARE_TOL
    assert abs(np.mean(ranks == 0) - 0.75 * 0.97) <= 0.1


def test_cli(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert synth_main([str(out), "--mtp-accuracy", "0.75", "--mtp-runner-up", "0.5"]) == 0
    assert "mtp_runner_up=0.5" in capsys.readouterr().out
    assert mtp_runner_up_of(out) == 0.5
    assert synth_main([str(tmp_path / "n.gguf"), "--mtp-runner-up", "0.5"]) == 2
    assert "needs mtp_accuracy" in capsys.readouterr().err


# --- what it does for draft trees ----------------------------------------------------------------

def tokens_per_cycle(model, prompts, n: int, budget: int = 8) -> tuple[float, dict[int, float]]:
    """Greedy tokens per cycle: the tree of `budget` positions and the chains D = 1..budget - 1
    (verify budget D + 1), at most the chain's MAX_DRAFT_DEPTH."""
    import test_speculative as ts
    from openjet_plugin.speculative import MAX_DRAFT_DEPTH, DepthPolicy, SpeculativeStats, reference_decoder
    from openjet_plugin.speculative_tree import TreePolicy, TreeStats

    chains = {}
    for D in range(1, min(budget - 1, MAX_DRAFT_DEPTH) + 1):
        total = SpeculativeStats(D)
        for k, p in enumerate(prompts):
            r = reference_decoder(model, DepthPolicy(D, adaptive=False)).generate(
                p, ts.GREEDY, max_tokens=n, rng=np.random.default_rng(k))
            total = total.merge(r.stats)
        chains[D] = total.tokens_per_cycle
    total = TreeStats(budget - 1)
    for k, p in enumerate(prompts):
        r = reference_decoder(model, tree=TreePolicy(budget)).generate(p, ts.GREEDY, max_tokens=n,
                                                                        rng=np.random.default_rng(k))
        total = total.merge(r.stats)
    return total.tokens_per_cycle, chains


@pytest.mark.slow
def test_a_runner_up_head_lets_the_tree_beat_the_chain(tmp_path):
    """Greedy, tiny Q8_0 at accuracy 0.6, 4 held-out prompts x 64 tokens: without the option the
    tree of budget 8 is the chain (its second branches never win); with q = 0.8 it makes 1.19x the
    tokens per cycle of the best chain (when written; the independent-draft bound is 1.22x)."""
    import test_speculative as ts
    from openjet_plugin.tokenizer import Tokenizer

    prompts = ts.heldout_prompts(Tokenizer.from_gguf(ts.DEFAULT_GGUF), 4, 64)
    got = {}
    for q in (None, 0.8):
        path = synth_model(tmp_path / f"tiny-Q8_0-0.6-{q}.gguf", "tiny", "Q8_0", mtp_accuracy=0.6, mtp_runner_up=q)
        tree, chains = tokens_per_cycle(ReferenceModel(path), prompts, 64)
        got[q] = tree / max(chains.values())
        print(f"accuracy 0.6, runner-up {q}: tree B=8 {tree:.2f}, chains D=1..7 "
              + " ".join(f"{chains[D]:.2f}" for D in range(1, 8)) + f" ({got[q]:.2f}x the best)")
    assert got[None] <= 1.03
    assert got[0.8] >= 1.12


if __name__ == "__main__":
    # The measurement behind the issue-28 note (minutes on 2 cores): tree against chain at a verify
    # budget, on tiny Q8_0 with a head right at --accuracy and the right token second at
    # --runner-up of its misses; 4 held-out prompts x 64 tokens, greedy.
    #   python tests/test_synth_runner_up.py --budget 16 --accuracy 0.6 --runner-up 0.8
    import argparse
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_speculative as ts
    from openjet_plugin.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--accuracy", type=float, default=0.6)
    ap.add_argument("--runner-up", type=float, default=0.8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = synth_model(Path(tmp) / "tiny.gguf", "tiny", "Q8_0", mtp_accuracy=a.accuracy, mtp_runner_up=a.runner_up)
        prompts = ts.heldout_prompts(Tokenizer.from_gguf(ts.DEFAULT_GGUF), 4, 64)
        tree, chains = tokens_per_cycle(ReferenceModel(path), prompts, 64, a.budget)
    best = max(chains, key=chains.get)
    print(f"budget {a.budget}, accuracy {a.accuracy}, runner-up {a.runner_up}: tree {tree:.2f}, best chain "
          f"{chains[best]:.2f} (D = {best}): {tree / chains[best]:.2f}x; chains "
          + " ".join(f"{chains[D]:.2f}" for D in sorted(chains)))
