"""MTP speculative decoding: drafting, verification that keeps the target's distribution, and commit.

One cycle, as the seed describes it:

    current token + up to D drafts --(target evaluates all k = 1 + d positions together)--> logits
    verification accepts a prefix of j drafts and picks one more token (correction or bonus)
    the target commits positions n .. n+j (the current token and the accepted drafts)
    the MTP block catches up on the accepted positions and proposes the next drafts

Positions. The current token x_n sits at position n and is not yet in the target's state; the
target's hidden state after position t predicts x_{t+1}. The MTP step at position p takes
(token x_p, main hidden h_{p-1}) and predicts x_{p+1} (llama.cpp's convention, see
`testing/reference.py`); chained drafts feed the MTP block's own output back as the hidden.

Invariant (what "commit" means): after a cycle the target's state holds exactly the committed
positions 0 .. n+j, as if those tokens had been evaluated one at a time; nothing of a rejected
position survives. The MTP block's cache holds, for every committed position p, the row made from
(x_p, h_{p-1}) with the *main* model's hidden (rows made from draft hiddens are overwritten by the
catch-up). How a target keeps this invariant is its own business: the numpy reference restores a
snapshot and re-evaluates the accepted tokens; the native engine keeps a ring of per-position
DeltaNet intermediates and replays the accepted ones at the start of the next cycle.

Verification follows the target's selection rule exactly: greedy accepts a draft only if it is the
target's argmax; sampled verification is the speculative-sampling rule (accept x with probability
min(1, p(x)/q(x)), else draw from normalise(max(0, p - q)), and after all drafts a bonus draw from
p), where p is the target's next-token distribution after the same bias/penalties/top-k/top-p/
min-p/temperature as non-speculative sampling (`sampling.token_distribution`) and q the draft's own
distribution (zero outside the draft vocabulary). The emitted sequence therefore has the target's
distribution whatever the drafts are; drafts change only how many tokens a cycle yields.

Draft trees (speculative_tree.py, `SpeculativeDecoder(tree=...)`) replace the chain by a tree of
drafts verified in one pass; the same invariant holds for the accepted path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from .sampling import SamplingParams, apply_logit_bias, apply_penalties, draw_token, token_distribution
from .tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, read_gguf_metadata

MAX_DRAFT_DEPTH = 8
DEFAULT_DRAFT_DEPTH = 4
DEFAULT_DRAFT_VOCAB_SIZE = 32768


# --- distributions and the verification rules ---------------------------------------------------

def _restricted_row(logits: np.ndarray, vocab_ids: np.ndarray, n_vocab: int | None) -> np.ndarray:
    """A restricted draft head's row as given (one logit per id of `vocab_ids`); ValueError naming
    what does not fit."""
    if n_vocab is None:
        raise ValueError("n_vocab is required with vocab_ids")
    r = np.asarray(logits)
    if r.ndim > 1 and max(r.shape) == r.size:      # one row (or column) of a 2-D array
        r = r.reshape(-1)
    if r.shape != (len(vocab_ids),):
        raise ValueError(f"logits have shape {np.shape(logits)}, expected ({len(vocab_ids)},) for the draft vocabulary")
    return r


def _over_vocab(logits: np.ndarray, vocab_ids: np.ndarray | None, n_vocab: int | None) -> np.ndarray:
    """`logits` over the whole vocabulary: as given, or (with `vocab_ids`, a restricted draft head's
    tokens) scattered into -inf everywhere else."""
    if vocab_ids is None:
        return np.asarray(logits)
    x = _restricted_row(logits, vocab_ids, n_vocab)
    full = np.full(n_vocab, -np.inf, dtype=np.float32)
    full[vocab_ids] = x
    return full


class TokenDistribution:
    """A next-token distribution: `ids` in draw order with their `probs` (sum 1), over `n_vocab`.

    Draws walk `ids` in order by inverse CDF with one uniform (`sampling.draw_token`), so a
    distribution built by `from_logits` draws exactly as `Sampler.sample` does.
    """

    __slots__ = ("ids", "probs", "n_vocab", "_dense")

    def __init__(self, ids: np.ndarray, probs: np.ndarray, n_vocab: int):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        probs = np.asarray(probs, dtype=np.float64).reshape(-1)
        if ids.shape != probs.shape or ids.size == 0:
            raise ValueError(f"ids and probs must be non-empty and of one length, got {ids.shape} and {probs.shape}")
        if ids.min() < 0 or ids.max() >= n_vocab:
            raise ValueError(f"token id outside the vocabulary [0, {n_vocab}) in a distribution")
        keep = probs > 0                     # a zero-probability entry can never be drawn
        if not keep.any():
            raise ValueError("a distribution needs at least one token with probability > 0")
        self.ids, self.probs = ids[keep], probs[keep] / probs[keep].sum()
        self.n_vocab = int(n_vocab)
        self._dense: np.ndarray | None = None

    @classmethod
    def from_logits(cls, logits: np.ndarray, params: SamplingParams, history: Sequence[int] = (),
                    vocab_ids: np.ndarray | None = None, n_vocab: int | None = None) -> "TokenDistribution":
        """The distribution `Sampler.sample` would draw from. With `vocab_ids`, `logits` score only
        those tokens (a restricted draft head); every other token gets probability 0."""
        if (vocab_ids is not None and not params.has_penalties and not params.logit_bias
                and (params.greedy or 0 < params.top_k < len(vocab_ids))):
            # the restricted row where it is: its top-k are the full row's (every other token is
            # -inf), in the same order (vocab_ids ascending, so ties still go to the lower id), and
            # the pool's sums run over the same values in the same order, so the same ids and probs
            # without a scatter into the whole vocabulary (1.5 ms a draft on a 248K vocabulary)
            ids, probs = token_distribution(_restricted_row(logits, vocab_ids, n_vocab), params)
            return cls(np.asarray(vocab_ids, dtype=np.int64)[ids], probs, n_vocab)
        x = _over_vocab(logits, vocab_ids, n_vocab)
        ids, probs = token_distribution(x, params, history)
        return cls(ids, probs, x.shape[0])

    @classmethod
    def head(cls, logits: np.ndarray, params: SamplingParams, k: int, history: Sequence[int] = (),
             vocab_ids: np.ndarray | None = None, n_vocab: int | None = None) -> "TokenDistribution":
        """The k most probable tokens of `from_logits(logits, params, history, vocab_ids, n_vocab)`
        in its draw order (descending logit, ties: lower id first), each with its probability under
        that whole distribution: the mass is <= 1 and is not renormalised. For top-k = top-p off,
        min-p 0 at temperature 1 (a greedy draft tree's ranking, `MTPTreeDrafts`), where only the
        ranking and each candidate's probability are read: from_logits sorts the whole (restricted)
        vocabulary, 10 ms a node for 32K drafts on a 2-core host; this partitions it. The
        probabilities agree with from_logits' to rounding (the normaliser is summed in another
        order). Without penalties or a logit bias, restricted logits are read where they are (no
        copy over the whole vocabulary: 248K values a node on the 27B)."""
        if params.greedy or params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0 or params.temperature != 1.0:
            raise ValueError("TokenDistribution.head takes temperature 1 with top-k, top-p and min-p off")
        if vocab_ids is not None and not params.has_penalties and not params.logit_bias:
            r = _restricted_row(logits, vocab_ids, n_vocab)
            finite = np.isfinite(r)                      # the rest have probability 0
            ids = np.asarray(vocab_ids, dtype=np.int64)[finite]
            vals = r[finite].astype(np.float64)
            n_vocab = int(n_vocab)
        else:
            x = _over_vocab(logits, vocab_ids, n_vocab)
            x = apply_penalties(apply_logit_bias(x, params), history, params, inplace=True)
            ids = np.flatnonzero(np.isfinite(x))
            vals = x[ids].astype(np.float64)
            n_vocab = int(x.shape[0])
        if ids.size == 0:
            raise ValueError("a distribution needs at least one token with probability > 0")
        top = vals.max()
        total = np.exp(vals - top).sum()
        k = max(1, min(int(k), ids.size))
        if k < ids.size:
            cut = np.partition(vals, ids.size - k)[ids.size - k]        # the k-th largest logit
            sel = np.flatnonzero(vals >= cut)                            # ties at the cut: all, then by id
        else:
            sel = np.arange(ids.size)
        order = sel[np.lexsort((ids[sel], -vals[sel]))][:k]
        d = object.__new__(cls)
        d.ids, d.probs = ids[order].astype(np.int64), np.exp(vals[order] - top) / total
        d.n_vocab, d._dense = n_vocab, None
        return d

    @classmethod
    def point(cls, token: int, n_vocab: int) -> "TokenDistribution":
        """All mass on one token (a deterministic draft, or greedy)."""
        return cls(np.array([token]), np.ones(1), n_vocab)

    @classmethod
    def from_probs(cls, probs: np.ndarray) -> "TokenDistribution":
        """From a dense probability vector (ids in id order)."""
        p = np.asarray(probs, dtype=np.float64).reshape(-1)
        if (p < 0).any() or not np.isfinite(p).all():
            raise ValueError("probabilities must be finite and >= 0")
        ids = np.flatnonzero(p > 0)
        return cls(ids, p[ids], p.size)

    def dense(self) -> np.ndarray:
        """`[n_vocab]` float64 probabilities."""
        if self._dense is None:
            d = np.zeros(self.n_vocab)
            d[self.ids] = self.probs
            self._dense = d
        return self._dense

    def prob(self, token: int) -> float:
        if self._dense is not None:
            return float(self._dense[token])
        # a look-up in the support (top-k: a few dozen ids), not a dense row of the whole
        # vocabulary built for one value; where an id repeats, the last one, as dense() keeps
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[-1]]) if hit.size else 0.0

    def at(self, ids: np.ndarray) -> np.ndarray:
        """float64 probabilities at `ids` (ascending, unique), as dense()[ids] would give them,
        read from the support where no dense row exists."""
        if self._dense is not None:
            return self._dense[ids]
        order = np.argsort(self.ids, kind="stable")
        srt = self.ids[order]
        pos = np.searchsorted(srt, ids, side="right") - 1      # the last of a repeated id, as dense()
        safe = np.clip(pos, 0, None)
        return np.where((pos >= 0) & (srt[safe] == ids), self.probs[order[safe]], 0.0)

    def draw(self, u: float) -> int:
        return draw_token(self.ids, self.probs, u)

    def top(self) -> int:
        """The most probable token (ties: the first in draw order)."""
        return int(self.ids[int(np.argmax(self.probs))])


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one cycle: `n_accepted` leading drafts, then `token` (the correction
    after a rejection, or the bonus token when every draft was accepted)."""
    n_accepted: int
    token: int


def verify_greedy(target_tokens: Sequence[int], drafts: Sequence[int]) -> Verdict:
    """Greedy rule. `target_tokens[i]` is the target's argmax after position i of the cycle (the
    current token is position 0), so there is one more than there are drafts. A draft is
    accepted while it equals the argmax before it; the next argmax is the correction/bonus."""
    if len(target_tokens) != len(drafts) + 1:
        raise ValueError(f"verify_greedy needs len(drafts) + 1 = {len(drafts) + 1} target tokens, "
                         f"got {len(target_tokens)}")
    j = 0
    while j < len(drafts) and int(drafts[j]) == int(target_tokens[j]):
        j += 1
    return Verdict(j, int(target_tokens[j]))


def acceptance_probability(p_x: float, q_x: float) -> float:
    """min(1, p(x)/q(x)) for a draft x drawn from q."""
    if q_x <= 0:
        raise ValueError(f"draft token has probability {q_x} under its own draft distribution q; "
                         f"a draft must be drawn from q")
    return min(1.0, p_x / q_x)


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalise(max(0, p - q)): what a rejection draws from. When p <= q everywhere (p == q up to
    rounding) a rejection has probability 0, and p itself is returned for the rounding case."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else np.array(p, dtype=np.float64, copy=True)


@dataclass(frozen=True)
class SampledRule:
    """The two functions of sampled verification. A parameter so that the distribution test can
    show it catches a wrong rule; production code uses `STANDARD_RULE`."""
    accept: Callable[[float, float], float] = acceptance_probability
    residual: Callable[[np.ndarray, np.ndarray], np.ndarray] = residual_distribution


STANDARD_RULE = SampledRule()


def verify_sampled(p: Sequence[TokenDistribution], q: Sequence[TokenDistribution], drafts: Sequence[int],
                   rng: np.random.Generator, rule: SampledRule = STANDARD_RULE) -> Verdict:
    """Speculative sampling over one cycle.

    `p[i]` is the target's distribution after position i given the drafts before it accepted
    (len(drafts) + 1 of them), `q[i]` the distribution draft i was drawn from. One uniform per
    acceptance test and one per final draw, in that order, from `rng`.
    """
    if len(p) != len(drafts) + 1 or len(q) != len(drafts):
        raise ValueError(f"verify_sampled needs {len(drafts) + 1} target and {len(drafts)} draft "
                         f"distributions, got {len(p)} and {len(q)}")
    for i, x in enumerate(drafts):
        x = int(x)
        if rng.random() < rule.accept(p[i].prob(x), q[i].prob(x)):
            continue
        if p[i].ids.size + q[i].ids.size <= p[i].n_vocab // 64:
            # over the union of the two supports (outside it p and q are both 0, and so is the
            # residual), in id order as the dense row's nonzero entries: a few dozen values where
            # top-k applies, not passes over the whole vocabulary (3.4 ms on 248K)
            ids = np.union1d(p[i].ids, q[i].ids)
            r = rule.residual(p[i].at(ids), q[i].at(ids))
            keep = np.flatnonzero(r > 0)
            return Verdict(i, draw_token(ids[keep], r[keep], rng.random()))
        r = rule.residual(p[i].dense(), q[i].dense())
        ids = np.flatnonzero(r > 0)
        return Verdict(i, draw_token(ids, r[ids], rng.random()))
    return Verdict(len(drafts), p[-1].draw(rng.random()))


# --- draft vocabulary ---------------------------------------------------------------------------

def frequent_token_ids(tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                       size: int = DEFAULT_DRAFT_VOCAB_SIZE) -> np.ndarray:
    """The `size` most frequent tokens of a byte-level BPE vocabulary by merge rank, sorted by id.

    BPE learns merges in order of pair frequency, so a lower merge rank means a more frequent
    token. Order: control tokens (few, and they end a turn), the single-character base tokens
    (the 256 bytes), merged tokens by the rank of the merge that makes them, then anything else
    by id. Capped at the vocabulary size.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"draft vocabulary size must be a positive integer, got {size!r}")
    n = len(tokens)
    if len(token_types) != n:
        raise ValueError(f"token_types has {len(token_types)} entries, tokens has {n}")
    made_by: dict[str, int] = {}
    for rank, m in enumerate(merges):
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"merge {rank} ({m!r}) has no space")
        made_by.setdefault(a + b, rank)
    late = len(merges) + 1
    key = np.empty(n, dtype=np.int64)
    for i, (t, ty) in enumerate(zip(tokens, token_types)):
        if int(ty) == TOKEN_CONTROL:
            key[i] = -2
        elif len(t) == 1:
            key[i] = -1
        else:
            key[i] = made_by.get(t, late + i)
    order = np.lexsort((np.arange(n), key))
    return np.sort(order[:min(size, n)])


class DraftVocab:
    """The tokens the draft head scores: a base set plus tokens of the current sequence.

    Only drafting uses it; verification always scores the full vocabulary, so the restriction
    changes how often drafts are accepted, never which tokens can be emitted.
    """

    def __init__(self, base_ids: Iterable[int], n_vocab: int, dynamic: bool = True):
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, (int, np.integer)) or n_vocab < 1:
            raise ValueError(f"n_vocab must be a positive integer, got {n_vocab!r}")
        if not isinstance(base_ids, (np.ndarray, range, list, tuple)):
            base_ids = list(base_ids)
        base = np.unique(np.asarray(base_ids, dtype=np.int64))
        if base.size == 0:
            raise ValueError("the draft vocabulary is empty")
        if base[0] < 0 or base[-1] >= n_vocab:
            bad = base[0] if base[0] < 0 else base[-1]
            raise ValueError(f"draft vocabulary token id {int(bad)} is outside [0, {n_vocab})")
        self.n_vocab = int(n_vocab)
        self.dynamic = dynamic
        self._mask = np.zeros(self.n_vocab, dtype=bool)
        self._mask[base] = True
        self._ids: np.ndarray | None = base

    @classmethod
    def full(cls, n_vocab: int) -> "DraftVocab":
        return cls(range(n_vocab), n_vocab)

    @classmethod
    def from_merges(cls, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                    size: int = DEFAULT_DRAFT_VOCAB_SIZE, dynamic: bool = True) -> "DraftVocab":
        return cls(frequent_token_ids(tokens, token_types, merges, size), len(tokens), dynamic)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, size: int = DEFAULT_DRAFT_VOCAB_SIZE,
                  n_vocab: int | None = None, dynamic: bool = True) -> "DraftVocab":
        """The default draft vocabulary of a model file, from its `tokenizer.ggml.*` arrays.
        `n_vocab` (the output head's rows) caps it when the head is smaller than the token list."""
        meta = read_gguf_metadata(os.fspath(path), prefix="tokenizer.")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in meta:
                raise ValueError(f"{path}: metadata key {key!r} is missing; it is needed for the draft vocabulary")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)))
        ids = frequent_token_ids(tokens, types, list(meta["tokenizer.ggml.merges"]), size)
        nv = len(tokens) if n_vocab is None else int(n_vocab)
        return cls(ids[ids < nv], nv, dynamic)

    def copy(self) -> "DraftVocab":
        """An independent copy (a request adds its sequence's tokens to its own copy)."""
        out = DraftVocab.__new__(DraftVocab)
        out.n_vocab, out.dynamic = self.n_vocab, self.dynamic
        out._mask, out._ids = self._mask.copy(), self._ids
        return out

    def add(self, tokens: Iterable[int]) -> None:
        """Add tokens of the current sequence (no-op unless dynamic)."""
        if not self.dynamic:
            return
        t = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64)
        t = t[(t >= 0) & (t < self.n_vocab)]
        if t.size and not self._mask[t].all():
            self._mask[t] = True
            self._ids = None

    @property
    def ids(self) -> np.ndarray:
        """Sorted token ids (int64)."""
        if self._ids is None:
            self._ids = np.flatnonzero(self._mask)
        return self._ids

    def __contains__(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and bool(self._mask[token])

    def __len__(self) -> int:
        return int(self.ids.size)


# --- adaptive depth -----------------------------------------------------------------------------

class DepthPolicy:
    """How many drafts the next cycle proposes.

    fixed: always `depth`. adaptive (default, the seed's rule): after a cycle with a rejection the
    next one drafts one fewer, not below `floor` (default depth - 1: 4 -> 3); after a cycle whose
    drafts were all accepted it drafts one more, up to `depth`. depth 0 turns speculation off.
    """

    def __init__(self, depth: int = DEFAULT_DRAFT_DEPTH, adaptive: bool = True, floor: int | None = None):
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_DRAFT_DEPTH:
            raise ValueError(f"draft depth must be an integer in [0, {MAX_DRAFT_DEPTH}], got {depth!r}")
        lo = min(1, depth)
        if floor is None:
            floor = max(lo, depth - 1)
        if isinstance(floor, bool) or not isinstance(floor, int) or not lo <= floor <= depth:
            raise ValueError(f"depth floor must be an integer in [{lo}, {depth}], got {floor!r}")
        self.depth = depth
        self.adaptive = bool(adaptive)
        self.floor = floor
        self.current = depth

    def reset(self) -> None:
        self.current = self.depth

    def next_depth(self) -> int:
        return self.current

    def update(self, depth: int, n_accepted: int) -> None:
        """Record a cycle that proposed `depth` drafts and accepted `n_accepted`."""
        if not self.adaptive or depth == 0:
            return
        if n_accepted < depth:
            self.current = max(self.floor, depth - 1)
        else:
            self.current = min(self.depth, depth + 1)

    def __repr__(self) -> str:
        kind = f"adaptive, floor {self.floor}" if self.adaptive else "fixed"
        return f"DepthPolicy(depth={self.depth}, {kind})"


# --- the interfaces a decoder drives ------------------------------------------------------------

class Target(Protocol):
    """The main model of one conversation. Hiddens are opaque to the decoder: it only hands them
    to the draft source (the native engine may keep them on the GPU)."""
    n_vocab: int

    @property
    def n_past(self) -> int: ...                       # committed positions

    def reset(self) -> None: ...

    def prefill(self, tokens: Sequence[int]) -> Sequence[Any]: ...
    # evaluate and commit tokens at n_past..; returns the hidden after each of them

    def verify(self, tokens: Sequence[int]) -> tuple[np.ndarray, Sequence[Any]]: ...
    # evaluate k tokens at n_past.. provisionally: logits [k, n_vocab] (row i predicts the token
    # after tokens[i]) and the hidden after each

    def commit(self, n: int) -> None: ...
    # keep the first n (1..k) positions of the last verify; drop the rest (the invariant above)


class Drafter(Protocol):
    """The MTP block of one conversation, with its own cache."""
    n_vocab: int

    def reset(self) -> None: ...

    def step(self, pos: int, token: int, hidden: Any | None,
             vocab_ids: np.ndarray | None) -> tuple[np.ndarray | None, Any]: ...
    # MTP step at position pos on (token x_pos, hidden h_{pos-1}; None = the zero hidden of
    # position 0), after dropping cache rows >= pos. Returns (logits over vocab_ids, or None when
    # vocab_ids is None and only the cache row is wanted; the MTP hidden to chain with).


class DraftSource(Protocol):
    """What proposes drafts: the MTP head, or an oracle."""

    def begin(self, tokens: Sequence[int], hiddens: Sequence[Any]) -> None: ...
    # a new request whose prompt positions 0..len-1 (all but the current token) are committed

    def propose(self, pos: int, token: int, hidden: Any | None, history: Sequence[int], depth: int,
                params: SamplingParams, rng: np.random.Generator
                ) -> tuple[list[int], list[TokenDistribution]]: ...
    # `depth` drafts for positions pos+1.. after the current token at pos, and for each the
    # distribution it was drawn from (point masses for deterministic drafts)

    def commit(self, pos: int, tokens: Sequence[int], hiddens: Sequence[Any]) -> None: ...
    # positions pos.. are now committed; hiddens[i] is the main hidden before tokens[i]


# --- draft sources ------------------------------------------------------------------------------

class MTPDrafts:
    """Drafts from the MTP head over a restricted (dynamic) vocabulary.

    Greedy requests draft the head's argmax; sampled requests draw each draft from the head's
    distribution under the request's own sampling transform (q), over the draft vocabulary.
    """

    def __init__(self, drafter: Drafter, vocab: DraftVocab | None = None):
        self.drafter = drafter
        self.n_vocab = drafter.n_vocab
        self.base_vocab = vocab if vocab is not None else DraftVocab.full(self.n_vocab)
        if self.base_vocab.n_vocab != self.n_vocab:
            raise ValueError(f"draft vocabulary is over {self.base_vocab.n_vocab} tokens, the model has {self.n_vocab}")
        self.vocab = self.base_vocab.copy()
        self._true_upto = 0      # cache rows at positions < this come from main hiddens

    def begin(self, tokens: Sequence[int], hiddens: Sequence[Any]) -> None:
        self.drafter.reset()
        self.vocab = self.base_vocab.copy()
        self.vocab.add(tokens)
        # rows a drafter already holds from the main model's hiddens (the native tree target's
        # batched prefill made them: its hiddens before those positions are None) are not remade
        made = getattr(self.drafter, "rows_made", None)
        self._true_upto = min(int(made()), len(tokens)) if made is not None else 0
        self.commit(0, tokens, [None] + list(hiddens[:len(tokens) - 1]))

    def propose(self, pos, token, hidden, history, depth, params, rng):
        if pos != self._true_upto:
            raise RuntimeError(f"MTP cache holds positions < {self._true_upto}, a draft at {pos} "
                               f"needs exactly the positions before it")
        self.vocab.add([token])
        ids = self.vocab.ids
        drafts: list[int] = []
        qs: list[TokenDistribution] = []
        hist = list(history)
        tok, h = int(token), hidden
        for i in range(depth):
            logits, h = self.drafter.step(pos + i, tok, h, ids)
            if i == 0:
                self._true_upto = pos + 1    # (x_pos, h_{pos-1}) used the main hidden
            q = TokenDistribution.from_logits(logits, params, hist, vocab_ids=ids, n_vocab=self.n_vocab)
            tok = q.top() if params.greedy else q.draw(rng.random())
            drafts.append(tok)
            qs.append(q)
            hist.append(tok)
        return drafts, qs

    def commit(self, pos, tokens, hiddens):
        self.vocab.add(tokens)
        for i, (t, h) in enumerate(zip(tokens, hiddens)):
            p = pos + i
            if p < self._true_upto:
                continue
            if p != self._true_upto:
                raise RuntimeError(f"MTP catch-up at position {p} but the cache holds positions < {self._true_upto}")
            self.drafter.step(p, int(t), h, None)
            self._true_upto = p + 1


class ContinuationDrafts:
    """Oracle: the drafts for positions pos+1.. are `continuation[pos+1..]` (absolute positions:
    the continuation includes the prompt). Past its end there are no drafts."""

    def __init__(self, continuation: Sequence[int], n_vocab: int):
        self.continuation = [int(t) for t in continuation]
        self.n_vocab = int(n_vocab)

    def begin(self, tokens, hiddens):
        pass

    def propose(self, pos, token, hidden, history, depth, params, rng):
        out = self.continuation[pos + 1:pos + 1 + depth]
        return out, [TokenDistribution.point(t, self.n_vocab) for t in out]

    def commit(self, pos, tokens, hiddens):
        pass


class ForcedAcceptanceDrafts(ContinuationDrafts):
    """Oracle that forces an acceptance pattern against a known greedy continuation.

    Either `rate` a: each draft is the continuation's token with probability a, otherwise a
    different token; or `pattern`: cycle c makes its first pattern[c % len] drafts right and the
    next one wrong. Against a target whose greedy output is the continuation, greedy verification
    then accepts exactly the right prefix, so commit and replay can be tested (and cycle cost
    timed) at any acceptance rate. Its own generator, so the request's draws are untouched.
    """

    def __init__(self, continuation: Sequence[int], n_vocab: int, rate: float | None = None,
                 pattern: Sequence[int] | None = None, seed: int = 0):
        super().__init__(continuation, n_vocab)
        if (rate is None) == (pattern is None):
            raise ValueError("give exactly one of rate or pattern")
        if rate is not None and not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate!r}")
        if pattern is not None and (not len(pattern) or min(pattern) < 0):
            raise ValueError(f"pattern must be a non-empty list of counts >= 0, got {pattern!r}")
        self.rate = rate
        self.pattern = list(pattern) if pattern is not None else None
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._cycle = 0

    def begin(self, tokens, hiddens):
        self.rng = np.random.default_rng(self.seed)
        self._cycle = 0

    def _wrong(self, t: int) -> int:
        return int((t + 1 + self.rng.integers(self.n_vocab - 1)) % self.n_vocab)

    def propose(self, pos, token, hidden, history, depth, params, rng):
        right = self.continuation[pos + 1:pos + 1 + depth]
        n_right = self.pattern[self._cycle % len(self.pattern)] if self.pattern is not None else None
        self._cycle += 1
        out = []
        for i, t in enumerate(right):
            ok = (i < n_right) if n_right is not None else bool(self.rng.random() < self.rate)
            out.append(t if ok else self._wrong(t))
        return out, [TokenDistribution.point(t, self.n_vocab) for t in out]


# --- stats and the decoder ----------------------------------------------------------------------

@dataclass
class SpeculativeStats:
    """Per request. Draft slot i (0-based) is the (i+1)-th draft of a cycle."""
    max_depth: int
    cycles: int = 0
    generated_tokens: int = 0          # tokens the cycles yielded (an end-of-generation token included)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    positions_verified: int = 0        # target positions evaluated: the cost side of the ratio
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    cycles_at_depth: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        D = self.max_depth
        self.proposed_at = self.proposed_at or [0] * D
        self.accepted_at = self.accepted_at or [0] * D
        self.cycles_at_depth = self.cycles_at_depth or [0] * (D + 1)

    @property
    def tokens_per_cycle(self) -> float:
        return self.generated_tokens / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    def acceptance_at(self, slot: int) -> float:
        """Fraction of proposed drafts at slot accepted (accepted implies the earlier ones were)."""
        return self.accepted_at[slot] / self.proposed_at[slot] if self.proposed_at[slot] else 0.0

    def record(self, depth: int, n_accepted: int, n_emitted: int) -> None:
        self.cycles += 1
        self.generated_tokens += n_emitted
        self.drafts_proposed += depth
        self.drafts_accepted += n_accepted
        self.positions_verified += depth + 1
        self.cycles_at_depth[depth] += 1
        for i in range(depth):
            self.proposed_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    def merge(self, other: "SpeculativeStats") -> "SpeculativeStats":
        if other.max_depth != self.max_depth:
            raise ValueError(f"cannot merge stats of depth {other.max_depth} into depth {self.max_depth}")
        out = SpeculativeStats(self.max_depth)
        for f in ("cycles", "generated_tokens", "drafts_proposed", "drafts_accepted", "positions_verified"):
            setattr(out, f, getattr(self, f) + getattr(other, f))
        for f in ("proposed_at", "accepted_at", "cycles_at_depth"):
            setattr(out, f, [a + b for a, b in zip(getattr(self, f), getattr(other, f))])
        return out

    def as_dict(self) -> dict:
        return {"max_depth": self.max_depth, "cycles": self.cycles,
                "generated_tokens": self.generated_tokens, "drafts_proposed": self.drafts_proposed,
                "drafts_accepted": self.drafts_accepted, "positions_verified": self.positions_verified,
                "tokens_per_cycle": round(self.tokens_per_cycle, 4),
                "acceptance_at": [round(self.acceptance_at(i), 4) for i in range(self.max_depth)],
                "proposed_at": list(self.proposed_at), "accepted_at": list(self.accepted_at),
                "cycles_at_depth": list(self.cycles_at_depth)}


@dataclass
class SpeculativeResult:
    tokens: list[int]          # generated tokens, an end-of-generation token excluded
    finish_reason: str         # "stop" | "length"
    stats: SpeculativeStats


class SpeculativeDecoder:
    """Runs speculative cycles of one request over a target and a draft source.

    `drafts=None` or depth 0 is plain decoding through the same target (one position a cycle).
    Randomness (draft draws, acceptance tests, corrections, bonus) comes from one generator,
    seeded by `params.seed` unless `rng` is given, so a request is reproducible.

    The native engine plugs in as a Target (verify = evaluate the current token and the drafts in
    one call, 1 + depth <= 9 positions; commit = keep the accepted positions by replay, see the
    module docstring) and a Drafter (its MTP block over the draft vocabulary) or a DraftSource
    of its own when drafting runs inside the engine.

    `tree` (a speculative_tree.TreePolicy, or a verify budget 2..16): each cycle drafts a tree
    (the draft source's propose_tree), verifies all its nodes in one pass (the target's
    verify_tree) and commits the accepted path (commit_path); `tree_rule` is the sampled rule
    (speculative_tree.STANDARD_TREE_RULE). Stats are then speculative_tree.TreeStats. A target
    without tree verification (the native engine, until its CUDA tree pass) is refused at once.
    """

    def __init__(self, target: Target, drafts: DraftSource | None,
                 policy: DepthPolicy | int = DEFAULT_DRAFT_DEPTH, rule: SampledRule = STANDARD_RULE,
                 *, tree=None, tree_rule=None):
        self.policy = policy if isinstance(policy, DepthPolicy) else DepthPolicy(policy)
        self.tree = None
        self.tree_rule = tree_rule
        if tree is not None:
            # draft trees (speculative_tree.py) instead of chains; the depth policy is not used
            from .speculative_tree import STANDARD_TREE_RULE, TreePolicy
            self.tree = tree if isinstance(tree, TreePolicy) else TreePolicy(tree)
            self.tree_rule = tree_rule if tree_rule is not None else STANDARD_TREE_RULE
            if not (hasattr(target, "verify_tree") and hasattr(target, "commit_path")):
                raise NotImplementedError(
                    f"tree={self.tree.budget}: {type(target).__name__} has no tree verification "
                    f"(verify_tree/commit_path); the native engine gets it with its CUDA tree pass "
                    f"(issue 28), until then use chains (tree=None)")
            if drafts is None or not hasattr(drafts, "propose_tree"):
                raise NotImplementedError(f"tree={self.tree.budget}: the draft source "
                                          f"{type(drafts).__name__} cannot propose trees (propose_tree)")
        elif drafts is None:
            self.policy = DepthPolicy(0)
        self.target = target
        self.drafts = drafts if self.policy.depth > 0 or self.tree is not None else None
        self.rule = rule
        self.last_stats: SpeculativeStats | None = None

    def generate(self, prompt: Sequence[int], params: SamplingParams, *, max_tokens: int | None = None,
                 stop_tokens: Iterable[int] = (), rng: np.random.Generator | None = None) -> SpeculativeResult:
        out: list[int] = []
        finish = "length"
        for toks, fin in self.cycles(prompt, params, max_tokens=max_tokens, stop_tokens=stop_tokens, rng=rng):
            out.extend(toks)
            if fin:
                finish = fin
        return SpeculativeResult(out, finish, self.last_stats)

    def cycles(self, prompt: Sequence[int], params: SamplingParams, *, max_tokens: int | None = None,
               stop_tokens: Iterable[int] = (), rng: np.random.Generator | None = None
               ) -> Iterator[tuple[list[int], str | None]]:
        """Yield (tokens emitted by a cycle, finish reason or None) until the request ends.
        Stats accumulate in `last_stats`."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt is empty: speculative decoding starts from the last prompt token")
        limit = params.max_tokens if max_tokens is None else int(max_tokens)
        if limit < 1:
            raise ValueError(f"max_tokens must be at least 1, got {limit}")
        stop = frozenset(int(t) for t in stop_tokens)
        rng = rng if rng is not None else np.random.default_rng(params.seed)
        tree = self.tree
        if tree is not None:
            from .speculative_tree import DraftTree, TreeStats, verify_tree_greedy, verify_tree_sampled
            stats = TreeStats(tree.budget - 1)
            tree.reset()
        else:
            stats = SpeculativeStats(self.policy.depth)
        self.last_stats = stats
        self.policy.reset()
        T = self.target

        T.reset()
        hiddens = list(T.prefill(prompt[:-1])) if len(prompt) > 1 else []
        if self.drafts is not None:
            self.drafts.begin(prompt[:-1], hiddens)
        pos, current = len(prompt) - 1, prompt[-1]
        prev_hidden = hiddens[-1] if hiddens else None
        history = list(prompt)
        n_out = 0
        while True:
            # a cycle yields at most (drafts on its accepted path) + 1 tokens: never draft past the
            # request's end
            room = limit - n_out - 1
            if tree is None:
                depth = min(self.policy.next_depth(), room)
                if depth > 0:
                    drafts, qs = self.drafts.propose(pos, current, prev_hidden, history, depth, params, rng)
                    drafts = [int(t) for t in drafts][:depth]
                    depth = len(drafts)          # an oracle may run out of continuation
                else:
                    drafts, qs = [], []
                tokens = [current] + drafts
                logits, hid = T.verify(tokens)
                hists = [history + drafts[:i] for i in range(len(tokens))]
                if params.greedy:
                    v = verify_greedy([int(token_distribution(logits[i], params, hists[i])[0][0])
                                       for i in range(len(tokens))], drafts)
                else:
                    p = _TargetDistributions(logits, params, hists)
                    v = verify_sampled(p, qs[:depth], drafts, rng, self.rule)
                n_accepted, path_hidden = v.n_accepted, hid
            else:
                dt = (self.drafts.propose_tree(pos, current, prev_hidden, history, tree, room, params, rng)
                      if room > 0 else DraftTree([current], [-1]))
                logits, hid = T.verify_tree(dt.tokens, dt.parent)
                hists = _PathHistories(history, dt)
                p = _TargetDistributions(logits, params, hists)
                if params.greedy and not params.has_penalties and not params.logit_bias and hasattr(T, "argmax"):
                    tv = verify_tree_greedy(dt, T.argmax())   # the target's argmax: no logits row read
                elif params.greedy:
                    tv = verify_tree_greedy(dt, _Tops(p))
                else:
                    tv = verify_tree_sampled(dt, p, rng, self.tree_rule)
                tokens = [int(dt.tokens[i]) for i in tv.path]
                drafts, v = tokens[1:], tv
                n_accepted, path_hidden = tv.n_accepted, [hid[i] for i in tv.path]
            emitted = drafts[:n_accepted] + [v.token]

            finish = None
            n_emit = len(emitted)
            for i, t in enumerate(emitted):
                if t in stop:
                    n_emit, finish = i + 1, "stop"
                    break
            if finish is None and n_out + n_emit >= limit:
                n_emit, finish = limit - n_out, "length"
            # committed: the current token and the drafts before the last token yielded
            n_commit = min(n_accepted + 1, n_emit)
            if tree is None:
                T.commit(n_commit)
            else:
                T.commit_path(tv.path[:n_commit])
            if self.drafts is not None:
                self.drafts.commit(pos, tokens[:n_commit], [prev_hidden] + list(path_hidden[:n_commit - 1]))
            if tree is None:
                stats.record(depth, n_accepted, n_emit)
                self.policy.update(depth, n_accepted)
            else:
                stats.record_tree(dt, tv, n_emit)
                tree.update(dt, tv)

            yielded = emitted[:n_emit]
            history.extend(yielded)
            out = yielded[:-1] if finish == "stop" else yielded
            n_out += len(yielded)
            yield out, finish
            if finish:
                return
            pos += n_accepted + 1
            current = v.token
            prev_hidden = path_hidden[n_accepted]


class _Tops:
    """The target's argmax after each position (greedy verification), computed when first read."""

    def __init__(self, p: "_TargetDistributions"):
        self.p = p

    def __len__(self) -> int:
        return len(self.p)

    def __getitem__(self, i: int) -> int:
        return self.p[i].top()


class _PathHistories:
    """The history before each node of a draft tree (the request's, then the node's path), built
    when first read: penalties read it, nothing else does."""

    def __init__(self, history: list[int], tree):
        self.history, self.tree = history, tree
        self._made: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.tree.n

    def __getitem__(self, i: int) -> list[int]:
        i = range(len(self))[i]
        if i not in self._made:
            self._made[i] = self.history + [int(self.tree.tokens[j]) for j in self.tree.path(i)[1:]]
        return self._made[i]


class _TargetDistributions:
    """The target's distribution after each position of a cycle, built when verification first
    asks for it: positions after a rejection are never transformed."""

    def __init__(self, logits: np.ndarray, params: SamplingParams, histories: list[list[int]]):
        self.logits, self.params, self.histories = logits, params, histories
        self._rows: dict[int, TokenDistribution] = {}

    def __len__(self) -> int:
        return len(self.histories)

    def __getitem__(self, i: int) -> TokenDistribution:
        i = range(len(self))[i]
        if i not in self._rows:
            self._rows[i] = TokenDistribution.from_logits(self.logits[i], self.params, self.histories[i])
        return self._rows[i]


# --- the numpy reference as target and drafter --------------------------------------------------

class ReferenceTarget:
    """`testing.reference.ReferenceModel` as a Target.

    Commit of a partial acceptance restores the state saved before the verify and re-evaluates the
    accepted tokens: whole-state copies are fine for the reference (the native engine instead
    replays the accepted positions' DeltaNet intermediates). The K/V caches only grow, so they
    are cut back by position rather than copied. Reaches into the reference's state attributes
    (`_conv`, `_ssm`, `_kv`), which hold the whole per-conversation state. A draft tree needs no
    copy: `verify_tree` leaves the committed state alone and `commit_path` takes the path's.
    """

    def __init__(self, model):
        self.model = model
        self.n_vocab = model.n_vocab
        self._saved = None
        self._last: list[int] = []

    @property
    def n_past(self) -> int:
        return self.model.n_past

    def reset(self) -> None:
        self.model.reset()
        self._saved, self._last = None, []

    def prefill(self, tokens):
        if not len(tokens):
            return []
        self.model.forward(list(tokens))
        return list(self.model.hidden[-len(tokens):].copy())

    def verify(self, tokens):
        m = self.model
        self._saved = (m.n_past, {k: v.copy() for k, v in m._conv.items()},
                       {k: v.copy() for k, v in m._ssm.items()})
        self._last = [int(t) for t in tokens]
        logits = m.forward(self._last)
        return logits, list(m.hidden[-len(tokens):].copy())

    def commit(self, n: int) -> None:
        k = len(self._last)
        if not 1 <= n <= k:
            raise ValueError(f"commit({n}): the last verify evaluated {k} positions")
        if n < k:
            m = self.model
            n_past, conv, ssm = self._saved
            m.n_past = n_past
            del m.tokens[n_past:]
            m.hidden = m.hidden[:n_past]
            m._conv, m._ssm = conv, ssm
            for kv in m._kv.values():
                kv.remove_from(n_past)
            m.forward(self._last[:n])          # the replay of the accepted positions
        self._saved, self._last = None, []

    def verify_tree(self, tokens, parent):
        """A draft tree in one evaluation (`ReferenceModel.forward_tree`): the committed state is
        untouched until commit_path, so nothing needs saving."""
        logits, hidden = self.model.forward_tree([int(t) for t in tokens], parent)
        return logits, list(hidden.copy())

    def commit_path(self, path) -> None:
        self.model.commit_tree(path)


class ReferenceDrafter:
    """The reference model's MTP block as a Drafter (its cache is the model's MTP cache)."""

    def __init__(self, model):
        if model.config.mtp_layer is None:
            raise ValueError(f"{model.path}: model has no MTP block (nextn_predict_layers = 0)")
        self.model = model
        self.n_vocab = model.n_vocab

    def reset(self) -> None:
        self.model.mtp_reset()

    def step(self, pos, token, hidden, vocab_ids):
        h = np.zeros(self.model.config.n_embd) if hidden is None else hidden
        logits, h_mtp = self.model.mtp_logits(h, int(token), pos=pos)
        return (logits[vocab_ids] if vocab_ids is not None else None), h_mtp

    def step_branch(self, pos, token, hidden, vocab_ids, path):
        """A draft-tree node's step on its own branch (`ReferenceModel.mtp_branch`)."""
        logits, h_mtp, row = self.model.mtp_branch(hidden, int(token), pos, list(path))
        return (logits[vocab_ids] if vocab_ids is not None else logits), h_mtp, row


def reference_decoder(model, depth: int | DepthPolicy = DEFAULT_DRAFT_DEPTH,
                      vocab: DraftVocab | None = None, tree=None) -> SpeculativeDecoder:
    """A speculative decoder with the reference model as target and its MTP head as drafter;
    `tree` (a TreePolicy, or a budget) drafts and verifies trees instead of chains."""
    policy = depth if isinstance(depth, DepthPolicy) else DepthPolicy(depth)
    if tree is not None:
        from .speculative_tree import MTPTreeDrafts
        return SpeculativeDecoder(ReferenceTarget(model), MTPTreeDrafts(ReferenceDrafter(model), vocab),
                                  policy, tree=tree)
    drafts = MTPDrafts(ReferenceDrafter(model), vocab) if policy.depth > 0 else None
    return SpeculativeDecoder(ReferenceTarget(model), drafts, policy)
