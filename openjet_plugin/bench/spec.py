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
- spec_tree_tps (budget B, depth d, shape): draft trees from the MTP head (speculative_tree.py), all
  B positions of a tree verified in one pass, through the SpeculativeDecoder that the engine's
  `speculative_native.native_tree_decoder(backend, budget, vocab)` returns (imported when the row
  runs: a build without it, or a backend that is not the native engine, records the row as not
  measured with the reason). The decoder starts from the tokens of the start point (a prefill of
  the depth: not timed); one sample = the tokens after its first cycle / the wall time from the end
  of the first cycle to the last. `measure_tree_row` takes any factory of such decoders (the
  tests give it the numpy reference's).

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
    return samples, run_details(total, depth, ms_cycle, diverged, n_tokens, reps, point)


def run_details(total, depth: int, ms_cycle: list[float], diverged: list[int], n_tokens: int, reps: int,
                point: StartPoint) -> dict:
    """A speculative row's details over all its runs (chain or tree: `total` their merged stats)."""
    return {
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


# --- draft trees (spec_tree_tps) ---------------------------------------------------------------------

# shape policies of a spec_tree_tps row (speculative_tree.TreePolicy): the slots of each cycle's tree
# are the budget - 1 best of the candidate tree, scored by the head's own probabilities ("q") or by
# those corrected with the acceptance measured on verified trees ("calibrated")
TREE_SHAPES = {"q": "best-first by the MTP head's probabilities",
               "calibrated": "best-first by the MTP head's probabilities corrected by measured acceptance"}
TREE_NOTE = ("draft trees from the model's MTP head, every node verified in one pass; timed from the end "
             "of each run's first cycle (its prefill of the depth is not timed)")


class TreeUnavailable(Exception):
    """A spec_tree_tps row cannot run here; the message says why (it becomes the row's reason)."""


def tree_policy(budget: int, shape: str):
    """The TreePolicy of a row's (budget, shape)."""
    from ..speculative_tree import TreePolicy

    if shape not in TREE_SHAPES:
        raise ValueError(f"tree shape {shape!r} is not one of {', '.join(TREE_SHAPES)}")
    return TreePolicy(int(budget), calibrate=shape == "calibrated")


def native_tree_factory(be, budget: int, shape: str, vocab):
    """`make(rep)` -> a tree SpeculativeDecoder on the native engine `be`, or TreeUnavailable: `be` is
    not the native engine, or this build's speculative_native has no `native_tree_decoder`."""
    try:
        from ..backends.native import NativeBackend
    except Exception as exc:  # noqa: BLE001 - no native binding at all: the row says so
        raise TreeUnavailable(f"no native engine here ({type(exc).__name__}: {exc})") from exc
    if not isinstance(be, NativeBackend):
        raise TreeUnavailable(f"the backend is {type(be).__name__}, not the native engine: tree verification "
                              f"runs on the native engine's tree pass only")
    try:
        from .. import speculative_native
        make_decoder = speculative_native.native_tree_decoder
    except (ImportError, AttributeError) as exc:
        raise TreeUnavailable(f"this build has no native tree decoder (speculative_native.native_tree_decoder: "
                              f"{type(exc).__name__}: {exc})") from exc
    # the documented signature takes a budget; the calibrated shape hands it the TreePolicy instead
    # (as SpeculativeDecoder(tree=...) accepts either)
    tree = int(budget) if shape == "q" else tree_policy(budget, shape)

    def make(rep: int):
        return make_decoder(be, tree, vocab)
    return make


def reference_tree_factory(model, budget: int, shape: str, vocab=None):
    """`make(rep)` -> a tree SpeculativeDecoder on the numpy reference (the CPU tests' stand-in)."""
    from ..speculative import reference_decoder

    def make(rep: int):
        return reference_decoder(model, vocab=vocab, tree=tree_policy(budget, shape))
    return make


def run_tree_cycles(decoder, prompt: list[int], n_tokens: int) -> tuple[list[int], int, float, object]:
    """Greedy tree cycles of `decoder` from `prompt` until n_tokens are emitted: (tokens, tokens of the
    first cycle, seconds from the end of the first cycle to the end, stats)."""
    out: list[int] = []
    first, t0 = 0, None
    for toks, _ in decoder.cycles(prompt, greedy_params(), max_tokens=n_tokens, rng=np.random.default_rng(0)):
        out += toks
        if t0 is None:
            first, t0 = len(out), time.perf_counter()
    return out, first, time.perf_counter() - t0, decoder.last_stats


def measure_tree_row(make_decoder, point: StartPoint, budget: int, n_tokens: int, reps: int,
                     warmup_tokens: int) -> tuple[list[float], dict]:
    """`reps` timed runs of `n_tokens` from the start point (after one short warm-up):
    (tokens/s samples, details as a spec row's, plus the tree's positions, MTP steps and side
    branches per cycle)."""
    from ..speculative_tree import TreeStats

    samples, ms_cycle, diverged = [], [], []
    total = TreeStats(budget - 1)
    for r in range(-1, reps):
        n = min(warmup_tokens, n_tokens) if r < 0 else n_tokens
        out, first, dt, st = run_tree_cycles(make_decoder(r), point.history, n)
        if r < 0:
            continue
        # the first cycle (and the prefill before it) is outside the clock
        samples.append((len(out) - first) / dt if dt > 0 and len(out) > first else float("nan"))
        ms_cycle.append(1e3 * dt / max(st.cycles - 1, 1))
        total = total.merge(st)
        diverged.append(first_difference(out, point.continuation[:n]))
    if not all(np.isfinite(samples)):
        raise RuntimeError(f"a run of {n_tokens} tokens ended in its first cycle: nothing was timed "
                           f"(ask for more tokens than a cycle yields, {budget})")
    cycles = max(total.cycles, 1)
    details = run_details(total, budget - 1, ms_cycle, diverged, n_tokens, reps, point)
    details.update(positions_per_cycle=round(total.positions_verified / cycles, 4),
                   draft_steps_per_cycle=round(total.draft_steps / cycles, 4),
                   side_accepts_per_cycle=round(total.side_accepts / cycles, 4))
    return samples, details
