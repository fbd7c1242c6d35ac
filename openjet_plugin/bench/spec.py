"""Speculative decoding on the bench model: the `spec_tps` and `spec_mtp_tps` rows of `openjet bench`,
run by the child process (bench/ours.py) on one NativeBackend.

Every repetition starts from the same point: the state filled to the depth d with random tokens
and saved in a checkpoint, and a current token x at position d (not yet in the state). Before the
rows, the model's own greedy continuation of x is decoded plainly (one position per call), then:

- spec_tps (acceptance a, drafts D, depth d): NativeSpeculator cycles with oracle drafts
  (`ForcedAcceptanceDrafts` over that continuation: each draft is the continuation's token with
  probability a, else a wrong one) at a fixed depth D (no adaptive policy). Oracle drafts cost no
  MTP pass, so the draft cost is not in these numbers; the MTP catch-up on the accepted positions
  is (the backend keeps the MTP cache in step as it would in serving).
- spec_mtp_tps (drafts D, depth d): the same cycles with the model's own MTP head drafting (over the
  draft vocabulary the engine would use), whatever acceptance it gets: the draft cost made visible.

One sample = N tokens emitted / wall time of the cycles that emitted them (greedy verification
copies the D + 1 argmax ids to the host every cycle, so each cycle waits for the GPU). Details per
row (tokens per cycle, acceptance per draft slot, ms per cycle, whether the output equals the plain
continuation) are returned beside the samples; the parent keeps them in the manifest.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

ORACLE_NOTE = ("oracle drafts (forced acceptance): no MTP draft pass is timed; the MTP catch-up on "
               "accepted positions is")
# with oj_cycle (NativeBackend.supports_cycle) every cycle also drafts from the MTP head, as a real
# cycle does, and the oracle's drafts are the ones verified
ORACLE_CYCLE_NOTE = ("oracle drafts (forced acceptance) verified by oj_cycle: each cycle's MTP catch-up and "
                     "its D-step MTP draft pass are timed (their drafts unused)")


def oracle_note(be) -> str:
    """What a spec_tps row times on this backend."""
    fused = getattr(be, "supports_cycle", False) and getattr(be, "supports_speculative", False)
    return ORACLE_CYCLE_NOTE if fused else ORACLE_NOTE
MTP_NOTE = "the model's MTP head drafts (its passes are timed)"

# The token sequence every speculative row starts from, on both engines: positions 0..d-1 are the
# state at depth d, position d is the current token (bench/peer_spec.py sends tokens[0..d] to
# llama-server). Made in blocks, each from its own seed, so that every prefix is the same whatever
# length a caller asks for.
PROMPT_SEED, PROMPT_BLOCK = 28, 4096


def prompt_tokens(n_vocab: int, n: int) -> list[int]:
    """The first n tokens of the shared sequence (uniform over the vocabulary, as llama-bench's)."""
    blocks = [np.random.default_rng([PROMPT_SEED, b]).integers(0, n_vocab, size=PROMPT_BLOCK)
              for b in range(-(-n // PROMPT_BLOCK))]
    return np.concatenate(blocks)[:n].tolist() if blocks else []
# the history handed to each cycle: greedy verification without penalties reads none of it, and
# copying the whole 8K-token history every cycle would time host list copies
HISTORY_TAIL = 64


def greedy_params():
    from ..sampling import SamplingParams

    return SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


@contextmanager
def main_model_only(be):
    """Plain passes of the main model without the MTP rows a speculating backend adds to every
    evaluation (plain decode and verification are timed like llama.cpp's, which has no MTP).

    The backend then holds positions without MTP rows: before speculating again, restore a
    checkpoint taken while the MTP cache was in step (at or before the end of its rows)."""
    was = bool(getattr(be, "supports_speculative", False))
    be.supports_speculative = False
    try:
        yield
    finally:
        be.supports_speculative = was


def restore_to(be, depth: int) -> None:
    """Back to the checkpoint at exactly `depth`."""
    got = be.restore_checkpoint(depth)
    if got != depth:
        raise RuntimeError(f"no checkpoint at depth {depth} (restored to {got})")


@dataclass
class StartPoint:
    """What every repetition restores: the state at `depth`, the current token, the history."""
    depth: int
    history: list[int]           # tokens at positions 0..depth-1, then the current token
    continuation: list[int]      # the model's greedy tokens after the current token
    plain_tps: float             # the plain decode rate while making the continuation

    @property
    def current(self) -> int:
        return self.history[-1]

    def absolute(self) -> list[int]:
        """The continuation by absolute position, as the oracles read it (position depth is the
        current token; only positions after it are ever read)."""
        return list(self.history) + list(self.continuation)


def start_point(be, depth: int, history: list[int], current: int, n_tokens: int) -> StartPoint:
    """The plain greedy continuation of `current` from the checkpoint at `depth`."""
    if len(history) != depth:
        raise ValueError(f"history has {len(history)} tokens, the state is at depth {depth}")
    with main_model_only(be):
        restore_to(be, depth)
        tok, out = int(current), []
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            tok = be.eval_argmax([tok])
            out.append(int(tok))
        dt = time.perf_counter() - t0
    restore_to(be, depth)
    return StartPoint(depth, list(history) + [int(current)], out, n_tokens / dt)


def run_cycles(be, spec, point: StartPoint, n_tokens: int) -> tuple[list[int], float]:
    """Greedy cycles from the start point until `n_tokens` are emitted: (tokens, seconds)."""
    params = greedy_params()
    restore_to(be, point.depth)
    spec.begin(point.history)
    rng = np.random.default_rng(0)
    tok = point.current
    tail = list(point.history[-HISTORY_TAIL:])
    out: list[int] = []
    t0 = time.perf_counter()
    while len(out) < n_tokens:
        emitted, _, _ = spec.cycle(tok, tail, params, rng, n_tokens - len(out))
        out += emitted
        tail = (tail + emitted)[-HISTORY_TAIL:]
        tok = emitted[-1]
    return out, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (-1: none over the shorter length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1


def measure_row(be, make_spec, point: StartPoint, depth: int, n_tokens: int, reps: int,
                warmup_tokens: int) -> tuple[list[float], dict]:
    """`reps` timed runs of `n_tokens` (after one short warm-up): (tokens/s samples, details).
    `make_spec(rep)` gives a fresh NativeSpeculator for each run (an oracle seeded per run)."""
    from ..speculative import SpeculativeStats

    samples, ms_cycle, diverged = [], [], []
    total = SpeculativeStats(depth)
    for r in range(-1, reps):
        spec = make_spec(r)
        n = min(warmup_tokens, n_tokens) if r < 0 else n_tokens
        out, dt = run_cycles(be, spec, point, n)
        if r < 0:
            continue
        st = spec.stats
        samples.append(n / dt)
        ms_cycle.append(1e3 * dt / max(st.cycles, 1))
        total = total.merge(st)
        diverged.append(first_difference(out, point.continuation[:n]))
    details = {
        "tokens_per_cycle": round(total.tokens_per_cycle, 4),
        "acceptance_at": [round(total.acceptance_at(i), 4) for i in range(depth)],
        "ms_per_cycle": [round(x, 3) for x in ms_cycle],
        "cycles": total.cycles, "drafts_proposed": total.drafts_proposed,
        "drafts_accepted": total.drafts_accepted, "tokens": n_tokens, "reps": reps,
        # greedy speculative output must be the plain continuation (a divergence is a near-tie
        # between a D+1-position verify and a one-position decode, or a bug): counted, not hidden
        "runs_differing_from_plain": sum(1 for d in diverged if d >= 0),
        "first_difference": min((d for d in diverged if d >= 0), default=-1),
        "plain_tps_at_start": round(point.plain_tps, 2),
    }
    return samples, details


def oracle_factory(be, point: StartPoint, rate: float, depth: int):
    from ..speculative import DepthPolicy, ForcedAcceptanceDrafts
    from ..speculative_native import NativeSpeculator

    cont = point.absolute()

    def make(rep: int):
        oracle = ForcedAcceptanceDrafts(cont, be.n_vocab, rate=rate, seed=1000 + rep)
        return NativeSpeculator(be, DepthPolicy(depth, adaptive=False), oracle=oracle)
    return make


def draft_vocab(model_path: str, n_vocab: int):
    """The draft vocabulary the engine would use (engine.Engine._make_speculator's rule):
    (DraftVocab or None for the whole vocabulary, description)."""
    from ..speculative import DEFAULT_DRAFT_VOCAB_SIZE, DraftVocab

    if n_vocab <= DEFAULT_DRAFT_VOCAB_SIZE:
        return None, f"the whole vocabulary ({n_vocab})"
    vocab = DraftVocab.from_gguf(model_path, n_vocab=n_vocab)
    return vocab, f"{len(vocab)} frequent tokens + the sequence's own"


def mtp_factory(be, vocab, depth: int):
    from ..speculative import DepthPolicy
    from ..speculative_native import NativeSpeculator

    def make(rep: int):
        return NativeSpeculator(be, DepthPolicy(depth, adaptive=False), vocab)
    return make
