"""Sampling parameters (validated once) and the numpy sampler every backend shares.

The engine samples on the logits a backend returns, so every backend picks tokens by the same
rule and a test can compute the expected distribution from the logits on its own. The rule is
llama.cpp's default chain, in its order:

    logit bias -> penalties -> (temperature 0: argmax) -> top-k -> top-p -> min-p -> temperature -> draw

top-p and min-p look at the temperature-1 distribution (as in llama.cpp, where `temp` comes after
them in the chain); the temperature then reshapes what survived. Penalties follow llama.cpp's
definitions over the last `penalty_last_n` tokens of the context (prompt and generated).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

# llama.cpp's default penalty window (`penalty_last_n`, llama-cpp-python's `last_n_tokens_size`).
PENALTY_LAST_N = 64


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; construction validates every value.

    temperature 0 means greedy (argmax, after penalties). top_k 0 disables top-k, top_p 1 and
    min_p 0 disable theirs. seed None draws fresh entropy; an int makes the draw reproducible.
    """

    max_tokens: int = 256
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    penalty_last_n: int = PENALTY_LAST_N
    # the first penalty_start tokens of a history (the prompt) are outside the penalty window:
    # llama-cpp-python's sampler sees only the tokens it sampled, never the prompt; the engine sets
    # it to the prompt's length
    penalty_start: int = 0
    # token id -> added to its logit before anything else (llama.cpp's logit_bias sampler comes
    # first in its chain); -inf bans a token
    logit_bias: dict | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        mt = _integer("max_tokens", self.max_tokens)
        if mt < 1:
            raise ValueError(f"max_tokens must be at least 1, got {mt}")
        set_("max_tokens", mt)

        t = _number("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t}")
        set_("temperature", t)

        p = _number("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        set_("top_p", p)

        k = _integer("top_k", self.top_k)
        if k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {k}")
        set_("top_k", k)

        mp = _number("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp}")
        set_("min_p", mp)

        if self.seed is not None:
            s = _integer("seed", self.seed)
            if s < 0:
                raise ValueError(f"seed must be a non-negative integer, got {s}")
            set_("seed", s)

        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name))
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
            set_(name, v)
        rp = _number("repeat_penalty", self.repeat_penalty)
        if rp <= 0:
            raise ValueError(f"repeat_penalty must be > 0 (1 disables it), got {rp}")
        set_("repeat_penalty", rp)
        n = _integer("penalty_last_n", self.penalty_last_n)
        if n < 0:
            raise ValueError(f"penalty_last_n must be >= 0, got {n}")
        set_("penalty_last_n", n)
        ps = _integer("penalty_start", self.penalty_start)
        if ps < 0:
            raise ValueError(f"penalty_start must be >= 0, got {ps}")
        set_("penalty_start", ps)

        set_("stop", _stop_strings(self.stop))
        set_("logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)


def _logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)      # JSON object keys arrive as strings ("123")
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        if tok < 0:
            raise ValueError(f"logit_bias has a negative token id {tok}")
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) or v == math.inf:
            raise ValueError(f"logit_bias[{k!r}] must be a finite number or -inf, got {v!r}")
        out[tok] = float(v)
    return out


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    out = []
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only strings, got {s!r}")
        if s == "":
            raise ValueError("stop strings must not be empty")
        out.append(s)
    return tuple(out)


# --- the transformations, each llama.cpp's definition ---------------------------------------------

def apply_logit_bias(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits + bias, as a new float32 array (llama.cpp's logits are float32 too)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        out[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    return out


def apply_penalties(logits: np.ndarray, history: Sequence[int], params: SamplingParams,
                    inplace: bool = False) -> np.ndarray:
    """llama.cpp's `penalties` sampler: over the last `penalty_last_n` tokens after the first
    `penalty_start` of `history`, a token seen c times gets its logit divided by repeat_penalty
    (multiplied when <= 0), minus c * frequency_penalty, minus presence_penalty. Returns a new
    array unless inplace (then `logits` itself)."""
    out = logits if inplace else np.array(logits, copy=True)
    history = history[params.penalty_start:]
    if not params.has_penalties or not len(history):
        return out
    window = np.asarray(history[-params.penalty_last_n:], dtype=np.int64)
    ids, counts = np.unique(window, return_counts=True)
    keep = ids < out.shape[0]
    ids, counts = ids[keep], counts[keep]
    vals = out[ids].astype(np.float64)
    vals = np.where(vals <= 0, vals * params.repeat_penalty, vals / params.repeat_penalty)
    vals = vals - counts * params.frequency_penalty - params.presence_penalty
    out[ids] = vals
    return out


def top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' ids, largest first (ties: lower id first). The k-th largest of every
    16th entry bounds the whole row's k-th largest from below, so only the entries at or above it
    (about 16 k of them) are sorted: a third of the time of an argpartition over 248K for k = 40."""
    sample = x[::16]
    cand = np.flatnonzero(x >= np.partition(sample, len(sample) - k)[len(sample) - k]) \
        if len(sample) > k else np.arange(len(x))
    order = np.lexsort((cand, -x[cand]))
    return cand[order[:k]]


def candidate_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids that survive top-k, top-p and min-p, with their probabilities after temperature.

    `logits` are already biased and penalised. Ids come in descending logit order (ties: lower
    id first). Not for temperature 0 (greedy has no distribution to draw from).

    top-p and min-p each keep a prefix of that order (min-p: every logit >= max + log(min_p)), so
    the survivors are the shorter prefix; only that many tokens are sorted, which keeps a 248K
    vocabulary with top-k off cheap. The top-p mass is always normalised over the whole top-k pool.
    """
    x = np.asarray(logits)
    n = x.shape[0]
    k = params.top_k if 0 < params.top_k < n else n
    if k < n:
        pool = top_ids(x, k)                    # ties at the k-th value: lower ids first, as the draw order
        vals = x[pool].astype(np.float64)
        top = vals.max()
        weights = np.exp(vals - top)
        total = weights.sum()                   # temperature-1 normaliser of the pool
        if params.min_p > 0.0:
            keep = vals >= top + math.log(params.min_p)
            pool, vals, weights = pool[keep], vals[keep], weights[keep]
    else:
        # the whole vocabulary: normalise in one float32 pass, then touch only the survivors
        top = float(x.max())
        total = float(np.exp(x - np.float32(top)).sum(dtype=np.float64))
        pool = (np.flatnonzero(x >= top + math.log(params.min_p)) if params.min_p > 0.0
                else np.arange(n))
        vals = x[pool].astype(np.float64)
        weights = np.exp(vals - top)
    if params.top_p < 1.0:
        ids, vals, weights = _top_p_prefix(pool, vals, weights, total, params.top_p)
    else:
        order = np.lexsort((pool, -vals))
        ids, vals = pool[order], vals[order]

    z = vals / params.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    return ids, probs


def _top_p_prefix(pool, vals, weights, total, top_p):
    """The shortest prefix of `pool` in descending order whose mass reaches top_p (the crossing
    token included). Sorts a growing head of the pool until the cut falls strictly inside it."""
    m = min(len(pool), 256)
    while True:
        head = np.arange(len(pool)) if m >= len(pool) else np.argpartition(-vals, m - 1)[:m]
        order = head[np.lexsort((pool[head], -vals[head]))]
        cum = np.cumsum(weights[order]) / total
        last = int(np.searchsorted(cum, top_p, side="left")) + 1
        if last < len(order) or m >= len(pool):
            order = order[:max(1, min(last, len(order)))]
            return pool[order], vals[order], weights[order]
        m *= 8


class Sampler:
    """Draws tokens for one request: holds the seeded generator so a request is reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        ids, probs = token_distribution(logits, self.params, history)
        if self.params.greedy:
            return int(ids[0])
        # one uniform draw per token: the same draw count whatever the candidates, so a seed
        # fixes the whole sequence
        return draw_token(ids, probs, self.rng.random())


def token_distribution(logits: np.ndarray, params: SamplingParams,
                       history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The next token's distribution exactly as `Sampler.sample` draws it: `(ids, probs)` after
    logit bias, penalties over `history` and top-k/top-p/min-p/temperature, ids in the order the
    draw walks them. At temperature 0 it is the argmax with probability 1.

    Speculative verification compares this distribution of the target with the draft's, so both
    paths must come from this one function."""
    x = apply_penalties(apply_logit_bias(logits, params), history, params, inplace=True)
    if params.greedy:
        return np.array([int(np.argmax(x))], dtype=np.int64), np.ones(1)
    return candidate_distribution(x, params)


def draw_token(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """The token at uniform draw `u` in [0, 1) by inverse CDF over `probs` in the order of `ids`
    (probs need not sum to exactly 1; a zero-probability token is never drawn)."""
    j = int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))
    return int(ids[min(j, len(ids) - 1)])
