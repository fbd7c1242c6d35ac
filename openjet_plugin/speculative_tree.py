"""Draft trees for MTP speculative decoding (issue 28): shape, verification rules, draft source.

A chain of D drafts yields on average sum_{i<=D} a^i accepted drafts at per-draft acceptance a:
at a = 0.7 that is 1.8 of 7 drafts. One verify pass over 8 positions costs little more than over
1, so the positions a deep chain wastes are better spent on alternatives: a tree of drafts, all
verified in one pass, of which the longest path the target agrees with is accepted.

Layout (what the CUDA verify pass will take, and what the numpy reference evaluates): n <= budget
nodes in topological order,

    tokens[n]  int64   node 0 is the current token (the root), nodes 1.. are the drafts
    parent[n]  int32   parent[0] = -1, and 0 <= parent[i] < i
    depth[n]   int32   depth[0] = 0, depth[i] = depth[parent[i]] + 1; node i sits at n_past + depth[i]

with siblings in draw order (verification tries them in index order). Node i sees the committed
positions, its ancestors and itself (`tree_ancestors(parent)`, the attention mask), and each
DeltaNet layer runs its conv and recurrence for node i from parent[i]'s state (the root from the
committed state). A commit keeps one root-to-node path; the state it leaves is that of decoding
the path one token at a time (the reference: bit for bit, `ReferenceModel.forward_tree`).

Shape (EAGLE-2's dynamic tree, best-first). Every node's MTP step gives the draft distribution of
the token after it; its children are candidate slots j = 1, 2, .. (the j-th most probable token
for greedy requests, the j-th draw without replacement for sampled ones) with the estimated
probability that verification reaches them: score(child) = score(parent) * a(q_j), where q_j is
the j-th largest draft probability and a() the acceptance estimate: q itself by default, or q
corrected by the acceptance measured on verified trees (`TreePolicy(calibrate=True)`,
`AcceptanceCalibration`). Measured on the reference (tests/test_tree_speculation.py, budget 8):
on the trained default model q itself did as well or better (greedy 3.61 vs 3.56 tokens per
cycle over 4 x 64 tokens, 3.56 vs 3.48 over 8 x 64, 3.51 with the calibration carried over 512
tokens), while the tiny generated model's under-confident head gained from it over 3 x 24 tokens
(7.20 vs 6.55; equal over 4 x 64). The tree takes slots in order of score until `budget`
positions are used. Scores never grow along a path, so
this picks the budget - 1 slots of highest score, which maximises the expected accepted length
sum_i P(node i reached) under the estimate; the shape follows the draft probabilities: a confident
head makes a deep chain, a hesitant one a wide bush. Each node taken is expanded by one MTP step
(its attention sees its own branch: `Drafter.step_branch`), except the last one taken.

Verification: `verify_tree_greedy` (the longest path whose every node is the target's argmax at its
parent) and `verify_tree_sampled` (recursive rejection over siblings drawn without replacement;
the proof that it keeps the target distribution is in its docstring).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .sampling import SamplingParams, draw_token
from .speculative import (Drafter, MTPDrafts, SpeculativeStats, TokenDistribution, acceptance_probability,
                          residual_distribution)

MAX_TREE_BUDGET = 16          # verified positions of one tree (the current token included)
DEFAULT_TREE_BUDGET = 8
DEFAULT_MAX_CHILDREN = 4


# --- the layout -------------------------------------------------------------------------------

def check_tree_parents(parent: Sequence[int], n: int | None = None) -> np.ndarray:
    """`parent` as an int32 array after checking the layout: parent[0] = -1 (the root), and
    0 <= parent[i] < i for every other node (topological order)."""
    p = np.asarray(parent, dtype=np.int64).reshape(-1)
    if n is not None and p.size != n:
        raise ValueError(f"a tree of {n} tokens needs {n} parents, got {p.size}")
    if p.size == 0 or p[0] != -1:
        raise ValueError("node 0 is the root (the current token): its parent must be -1")
    idx = np.arange(p.size)
    bad = np.flatnonzero((p[1:] < 0) | (p[1:] >= idx[1:])) + 1
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"node {i} has parent {int(p[i])}: a draft's parent must be an earlier node (0..{i - 1})")
    return p.astype(np.int32)


def tree_depths(parent: Sequence[int]) -> np.ndarray:
    """depth[i]: how many ancestors node i has (the root 0); node i sits at n_past + depth[i]."""
    p = check_tree_parents(parent)
    d = np.zeros(p.size, dtype=np.int32)
    for i in range(1, p.size):
        d[i] = d[p[i]] + 1
    return d


def tree_ancestors(parent: Sequence[int]) -> np.ndarray:
    """The tree attention mask, bool `[n, n]`: [i, j] is True where node j is node i or one of its
    ancestors (what node i sees of the tree, beside the committed positions)."""
    p = check_tree_parents(parent)
    m = np.zeros((p.size, p.size), dtype=bool)
    for i in range(p.size):
        if p[i] >= 0:
            m[i] = m[p[i]]
        m[i, i] = True
    return m


@dataclass
class DraftTree:
    """One cycle's draft tree in the kernel layout (module docstring), with what drafting knew.

    q[i]: the distribution node i was drawn from (its parent's draft distribution, without the
    siblings drawn before it for sampled requests; the unrestricted one for greedy requests, which
    verification does not read); None for the root. prob[i]: the draft probability its slot was
    scored by. score[i]: the estimated probability that verification reaches node i.
    draft_steps: MTP steps made to build it.
    """
    tokens: np.ndarray
    parent: np.ndarray
    q: list = field(default_factory=list)
    prob: np.ndarray | None = None
    score: np.ndarray | None = None
    draft_steps: int = 0

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        self.parent = check_tree_parents(self.parent, self.tokens.size)
        self.depth = tree_depths(self.parent)
        n = self.tokens.size
        if not self.q:
            self.q = [None] * n
        if len(self.q) != n:
            raise ValueError(f"a tree of {n} nodes needs {n} draft distributions (None for the root), "
                             f"got {len(self.q)}")
        self.prob = np.ones(n) if self.prob is None else np.asarray(self.prob, dtype=np.float64)
        self.score = np.ones(n) if self.score is None else np.asarray(self.score, dtype=np.float64)
        self._children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            self._children[self.parent[i]].append(i)

    @classmethod
    def chain(cls, token: int, drafts: Sequence[int], qs: Sequence[TokenDistribution] | None = None) -> "DraftTree":
        """A chain: the current token and drafts, each the child of the one before."""
        n = 1 + len(drafts)
        return cls([token] + [int(t) for t in drafts], np.arange(-1, n - 1),
                   [None] + (list(qs) if qs is not None else [None] * len(drafts)))

    @property
    def n(self) -> int:
        return int(self.tokens.size)

    def children(self, i: int) -> list[int]:
        """Node i's children in draw order."""
        return self._children[i]

    def path(self, i: int) -> list[int]:
        """The nodes from the root to node i."""
        out = [i]
        while self.parent[out[-1]] >= 0:
            out.append(int(self.parent[out[-1]]))
        return out[::-1]

    def first_sibling(self, i: int) -> int:
        """The first-drawn child of node i's parent (i itself for a first child)."""
        return self._children[self.parent[i]][0]


# --- verification -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a tree: the accepted `path` (node indices from the root, node 0, to the
    last accepted draft), then `token` (the correction, or the bonus after a leaf)."""
    path: tuple[int, ...]
    token: int

    @property
    def n_accepted(self) -> int:
        return len(self.path) - 1


def verify_tree_greedy(tree: DraftTree, target_tokens: Sequence[int]) -> TreeVerdict:
    """Greedy rule on a tree. `target_tokens[i]` is the target's argmax after node i (on node i's
    path); it is read only along the accepted path. From the root, move to the child equal to the
    argmax there while there is one (siblings are distinct tokens: at most one is); the argmax at
    the last node is the correction or bonus. The accepted path is therefore exactly what plain
    greedy decoding produces next, and the longest such path in the tree."""
    node, path = 0, [0]
    while True:
        want = int(target_tokens[node])
        nxt = next((c for c in tree.children(node) if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return TreeVerdict(tuple(path), want)
        path.append(nxt)
        node = nxt


@dataclass(frozen=True)
class TreeRule:
    """The pieces of sampled tree verification, a parameter so that the distribution test can
    show it catches a wrong rule; production code uses `STANDARD_TREE_RULE`. sibling_q(tree, c):
    the draft distribution child c is tested against."""
    accept: Callable[[float, float], float] = acceptance_probability
    residual: Callable[[np.ndarray, np.ndarray], np.ndarray] = residual_distribution
    sibling_q: Callable[[DraftTree, int], TokenDistribution] = lambda tree, c: tree.q[c]


STANDARD_TREE_RULE = TreeRule()


def verify_tree_sampled(tree: DraftTree, p: Sequence[TokenDistribution], rng: np.random.Generator,
                        rule: TreeRule = STANDARD_TREE_RULE) -> TreeVerdict:
    """Multi-draft speculative sampling down a tree (recursive rejection over siblings).

    `p[i]` is the target's distribution after node i (read only along the accepted path). At a node
    with target distribution r = p[node] and children x_1, x_2, .. in draw order: test x_k with
    one uniform, accepting with probability min(1, r(x_k) / q_k(x_k)); on acceptance continue from
    x_k with r = p[x_k]; on rejection set r <- normalise(max(0, r - q_k)) and test x_{k+1}. After
    the last child is rejected, draw the token from r (one uniform, over r's ids in id order); at a
    node without children, draw from p[node] itself (in its draw order). On a chain this is
    `speculative.verify_sampled`, uniform for uniform.

    Sibling sampling: x_k ~ q_k, where q_1 = q (the node's draft distribution) and q_{k+1} is q_k
    with x_k removed, renormalised: siblings are drawn without replacement, and q_k is what each
    one is tested against (`DraftTree.q`).

    Why the output has the target's distribution. Claim: from any node with current target r and
    remaining children whose next one, x, is drawn from a known q' (given everything before it),
    the token emitted at this level has distribution r. By induction on the number of remaining
    children. None left: the token is drawn from r. Otherwise P(x = y and x accepted) =
    q'(y) min(1, r(y)/q'(y)) = min(r(y), q'(y)), so acceptance emits y with that probability.
    Rejection happens with probability beta = sum_y (q'(y) - min(r(y), q'(y))) = 1 - sum_y min(r, q')
    = sum_y max(0, r(y) - q'(y)), for whichever x was drawn; the level then continues with target
    r' = max(0, r - q') / beta and a next child drawn from its own known distribution (q' without x),
    so by induction it emits y with probability r'(y). Total: min(r, q')(y) + beta r'(y) =
    min(r(y), q'(y)) + max(0, r(y) - q'(y)) = r(y). The induction needs only that each child's
    distribution is fixed before it is drawn and is the one it is tested against; how many
    children a node gets may depend on anything drawn before (a stopping rule), never on the draw
    itself, which `MTPTreeDrafts` keeps by scoring slot k from q's k-th largest probability rather
    than from the token drawn. After an acceptance the level below starts afresh from p[x] with
    fresh uniforms, so by the chain rule the emitted sequence has the target's distribution.
    Testing later siblings against the first one's q (ignoring the removal), or against r instead
    of the residual, breaks the claim; the chi-square tests show both.
    """
    node, path = 0, [0]
    while True:
        kids = tree.children(node)
        if not kids:
            return TreeVerdict(tuple(path), p[node].draw(rng.random()))
        r = p[node].dense()
        accepted = None
        for c in kids:
            x = int(tree.tokens[c])
            q = rule.sibling_q(tree, c)
            if rng.random() < rule.accept(float(r[x]), q.prob(x)):
                accepted = c
                break
            r = rule.residual(r, q.dense())
        if accepted is None:
            ids = np.flatnonzero(r > 0)
            return TreeVerdict(tuple(path), draw_token(ids, r[ids], rng.random()))
        path.append(accepted)
        node = accepted


# --- shape --------------------------------------------------------------------------------------

class AcceptanceCalibration:
    """P(a draft is accepted | its parent was, and its slot's draft probability is q).

    Binned by q; a bin's estimate is (accepted + prior * q) / (tested + prior): the raw draft
    probability until the request's verified trees say otherwise.
    """

    EDGES = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0])

    def __init__(self, prior: float = 4.0):
        if not prior > 0:
            raise ValueError(f"prior must be > 0, got {prior!r}")
        self.prior = float(prior)
        self.reset()

    def reset(self) -> None:
        self.tested = np.zeros(self.EDGES.size - 1)
        self.accepted = np.zeros(self.EDGES.size - 1)

    def _bin(self, q: float) -> int:
        return int(np.clip(np.searchsorted(self.EDGES, q, side="right") - 1, 0, self.EDGES.size - 2))

    def estimate(self, q: float) -> float:
        b = self._bin(q)
        return float((self.accepted[b] + self.prior * q) / (self.tested[b] + self.prior))

    def record(self, q: float, accepted: bool) -> None:
        b = self._bin(q)
        self.tested[b] += 1
        self.accepted[b] += bool(accepted)


class TreePolicy:
    """How the draft tree of each cycle is shaped (module docstring).

    budget: positions one verify evaluates, the current token included (2..16; 8 by default, the
    native engine's OJ_MAX_POSITIONS). max_children: candidate slots per node. calibrate: correct
    the draft probabilities by the acceptance measured on verified trees (module docstring).
    carry: keep those
    measurements from request to request (a property of the model's head, and more data than one
    request has); then a seeded sampled request is reproducible only from the same measurements
    (`calibration.reset()` clears them). Without carry they start afresh with each request.
    """

    def __init__(self, budget: int = DEFAULT_TREE_BUDGET, max_children: int = DEFAULT_MAX_CHILDREN,
                 calibrate: bool = False, prior: float = 4.0, carry: bool = False):
        if isinstance(budget, bool) or not isinstance(budget, int) or not 2 <= budget <= MAX_TREE_BUDGET:
            raise ValueError(f"tree budget must be an integer in [2, {MAX_TREE_BUDGET}], got {budget!r}")
        if isinstance(max_children, bool) or not isinstance(max_children, int) or max_children < 1:
            raise ValueError(f"max_children must be a positive integer, got {max_children!r}")
        self.budget = budget
        self.max_children = max_children
        self.calibrate = bool(calibrate)
        self.carry = bool(carry)
        self.calibration = AcceptanceCalibration(prior)

    def reset(self) -> None:
        """A new request."""
        if not self.carry:
            self.calibration.reset()

    def estimate(self, q: float) -> float:
        return self.calibration.estimate(q) if self.calibrate else float(q)

    def estimate_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """estimate() as (edges, a, c): q in bin b (the last b with edges[b] <= q) estimates to
        a[b] + c[b] q (what a native tree grower takes)."""
        cal = self.calibration
        edges = cal.EDGES[:-1].astype(np.float64)
        if not self.calibrate:
            return edges, np.zeros(edges.size), np.ones(edges.size)
        den = cal.tested + cal.prior
        return edges, cal.accepted / den, cal.prior / den

    def update(self, tree: DraftTree, verdict: TreeVerdict) -> None:
        """Record a verified tree: each child of an accepted node was accepted or not. Children a
        sampled verification never tested (a sibling before them was accepted) count as not
        accepted, so the estimate is P(accepted | parent accepted), what a score multiplies."""
        on_path = set(verdict.path)
        for node in verdict.path:
            for c in tree.children(node):
                self.calibration.record(float(tree.prob[c]), c in on_path)

    def __repr__(self) -> str:
        return (f"TreePolicy(budget={self.budget}, max_children={self.max_children}, "
                f"{'calibrated' if self.calibrate else 'raw probabilities'})")


def _without(d: TokenDistribution, tokens: Sequence[int]) -> TokenDistribution | None:
    """d with `tokens` removed, renormalised (None when nothing is left)."""
    probs = np.where(np.isin(d.ids, np.asarray(tokens, dtype=np.int64)), 0.0, d.probs)
    if not (probs > 0).any():
        return None
    return TokenDistribution(d.ids, probs, d.n_vocab)


def grow_tree(root: int, expand: Callable[[int, int, int, int], TokenDistribution], policy: TreePolicy,
              max_depth: int, greedy: bool, rng: np.random.Generator) -> DraftTree:
    """Best-first draft tree from the current token `root` (module docstring).

    expand(node, token, parent, depth) -> the draft distribution of the token after that node (one
    MTP step); it is called for the root first, then for each node taken, in the order taken
    (except the last one taken and nodes at `max_depth`). greedy: slot j is the j-th most probable
    token (q unused by verification); else a draw without replacement from the node's
    distribution, one uniform from `rng` when the slot is taken.
    """
    tokens, parent, depth = [int(root)], [-1], [0]
    qs: list = [None]
    prob, score = [1.0], [1.0]
    if max_depth < 1 or policy.budget < 2:
        return DraftTree(tokens, parent, qs, prob, score, 0)
    dists: dict[int, tuple[TokenDistribution, np.ndarray, np.ndarray]] = {}
    drawn: dict[int, list[int]] = {}
    heap: list = []
    order = itertools.count()
    steps = 0

    def push_slot(i: int, j: int) -> None:
        _, ids, probs = dists[i]
        if j < ids.size:
            s = score[i] * policy.estimate(float(probs[j]))
            # ties: shallower first, then the order pushed, so a parent always precedes its child
            heapq.heappush(heap, (-s, depth[i] + 1, next(order), i, j))

    def open_node(i: int) -> None:
        nonlocal steps
        d = expand(i, tokens[i], parent[i], depth[i])
        steps += 1
        top = np.argsort(-d.probs, kind="stable")[:policy.max_children]
        dists[i], drawn[i] = (d, d.ids[top], d.probs[top]), []
        push_slot(i, 0)

    open_node(0)
    while len(tokens) < policy.budget and heap:
        neg, dep, _, i, j = heapq.heappop(heap)
        d, ids, probs = dists[i]
        if greedy:
            x, q = int(ids[j]), d
        else:
            q = _without(d, drawn[i]) if drawn[i] else d
            if q is None:                      # the node's distribution has no token left
                continue
            x = q.draw(rng.random())
        drawn[i].append(x)
        tokens.append(x)
        parent.append(i)
        depth.append(dep)
        qs.append(q)
        prob.append(float(probs[j]))
        score.append(-neg)
        push_slot(i, j + 1)
        if len(tokens) < policy.budget and dep < max_depth:
            open_node(len(tokens) - 1)
    return DraftTree(tokens, parent, qs, prob, score, steps)


# --- the draft source and the target's side -----------------------------------------------------

class TreeDrafter(Drafter, Protocol):
    """A Drafter that can step a draft-tree node on its own branch."""

    def step_branch(self, pos: int, token: int, hidden: Any, vocab_ids: np.ndarray | None,
                    path: Sequence[Any]) -> tuple[np.ndarray, Any, Any]: ...
    # MTP step at pos for a node whose ancestors' rows (made by earlier step_branch calls, at
    # positions pos - len(path) .. pos - 1) are `path`; the cache rows before them stay, the cache
    # is not changed. Returns (logits over vocab_ids, the MTP hidden to chain with, its own row).


class TreeTarget(Protocol):
    """A Target that verifies a draft tree in one pass (the layout of the module docstring)."""

    def verify_tree(self, tokens: Sequence[int], parent: Sequence[int]) -> tuple[np.ndarray, Sequence[Any]]: ...
    # evaluate the tree at n_past.. provisionally: logits [n, n_vocab] (row i predicts the token
    # after node i on its path) and the hidden after each node

    def commit_path(self, path: Sequence[int]) -> None: ...
    # keep the nodes of `path` (node 0, then each a child of the one before) as positions n_past..;
    # drop everything else of the last verify_tree

    # Optional: argmax() -> list[int], the target's own argmax after each node of the last
    # verify_tree (ties: the lowest id, as from_logits orders them). Greedy verification without
    # penalties or a logit bias reads it instead of the logits rows (a 248K-float copy a row).


class MTPTreeDrafts(MTPDrafts):
    """Draft trees from the MTP head over a restricted (dynamic) vocabulary (`grow_tree`).

    The root's step is the chain's first step (its cache row (x_pos, h_{pos-1}) is the committed
    one); every deeper node steps on its own branch (`TreeDrafter.step_branch`), so no draft's row
    enters the MTP cache, and the catch-up after a commit (`commit`) writes the accepted positions'
    rows from the main hiddens, as for a chain. Greedy requests rank each node's candidates by the
    head's probabilities at temperature 1 (the request's bias and penalties applied); sampled ones
    draw them from q, the head's distribution under the request's own sampling transform.
    """

    def propose_tree(self, pos: int, token: int, hidden: Any | None, history: Sequence[int],
                     policy: TreePolicy, max_depth: int, params: SamplingParams,
                     rng: np.random.Generator) -> DraftTree:
        if pos != self._true_upto:
            raise RuntimeError(f"MTP cache holds positions < {self._true_upto}, a draft tree at {pos} "
                               f"needs exactly the positions before it")
        if not hasattr(self.drafter, "step_branch"):
            raise NotImplementedError(f"{type(self.drafter).__name__} cannot step a draft-tree branch "
                                      f"(step_branch): draft trees need it")
        self.vocab.add([token])
        ids = self.vocab.ids
        greedy = params.greedy
        if greedy and not params.has_penalties and not params.logit_bias and hasattr(self.drafter, "grow"):
            tree = self.drafter.grow(pos, int(token), hidden, ids, policy, max_depth)
            if tree is not None:                     # the whole tree in one engine call
                if tree.draft_steps:
                    self._true_upto = pos + 1        # the root's row (x_pos, h_{pos-1}) used the main hidden
                return tree
        rank = replace(params, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) if greedy else params
        # a node's history (the request's, then its path's tokens) is read only for penalties:
        # built then, not copied at every node (8K tokens a copy at depth 8K)
        path_of: dict[int, list[int]] = {0: []}
        penalised = params.has_penalties

        def hist(i: int) -> Sequence[int]:
            return list(history) + path_of[i] if penalised else ()

        state: dict[int, tuple[Any, list]] = {}          # node -> (MTP hidden after it, its branch's rows)

        def expand(i: int, tok: int, par: int, dep: int) -> TokenDistribution:
            if par < 0:
                logits, h = self.drafter.step(pos, int(tok), hidden, ids)
                self._true_upto = pos + 1                # (x_pos, h_{pos-1}) used the main hidden
                rows: list = []
            else:
                path_of[i] = path_of[par] + [int(tok)]
                h_par, rows_par = state[par]
                logits, h, row = self.drafter.step_branch(pos + dep, int(tok), h_par, ids, rows_par)
                rows = rows_par + [row]
            state[i] = (h, rows)
            if greedy:       # only the ranking and each candidate's probability are read (grow_tree)
                return TokenDistribution.head(logits, rank, policy.max_children, hist(i), vocab_ids=ids,
                                              n_vocab=self.n_vocab)
            return TokenDistribution.from_logits(logits, rank, hist(i), vocab_ids=ids, n_vocab=self.n_vocab)

        return grow_tree(int(token), expand, policy, max_depth, greedy, rng)


@dataclass
class TreeStats(SpeculativeStats):
    """SpeculativeStats of tree cycles. max_depth = budget - 1. A cycle counts its drafts as
    proposed, its accepted path as accepted and every node as a verified position; proposed_at[d]
    counts cycles whose tree reaches depth d + 1 (accepted_at[d]: whose path does), so
    acceptance_at(d) reads as a chain's. draft_steps: MTP steps; nodes_at_depth[d]: drafts at depth
    d + 1; side_accepts: accepted drafts that are not their parent's first child (a chain of first
    children would have stopped there)."""
    draft_steps: int = 0
    nodes_at_depth: list[int] = field(default_factory=list)
    side_accepts: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.nodes_at_depth = self.nodes_at_depth or [0] * self.max_depth

    def record_tree(self, tree: DraftTree, verdict: TreeVerdict, n_emitted: int) -> None:
        reach = int(tree.depth.max())
        n_acc = verdict.n_accepted
        self.cycles += 1
        self.generated_tokens += n_emitted
        self.drafts_proposed += tree.n - 1
        self.drafts_accepted += n_acc
        self.positions_verified += tree.n
        self.cycles_at_depth[reach] += 1
        for d in range(reach):
            self.proposed_at[d] += 1
        for d in range(n_acc):
            self.accepted_at[d] += 1
        for d in tree.depth[1:]:
            self.nodes_at_depth[d - 1] += 1
        self.draft_steps += tree.draft_steps
        self.side_accepts += sum(1 for c in verdict.path[1:] if tree.first_sibling(c) != c)

    def merge(self, other: "TreeStats") -> "TreeStats":
        base = SpeculativeStats.merge(self, other)
        out = TreeStats(self.max_depth, **{k: getattr(base, k) for k in (
            "cycles", "generated_tokens", "drafts_proposed", "drafts_accepted", "positions_verified",
            "proposed_at", "accepted_at", "cycles_at_depth")})
        out.draft_steps = self.draft_steps + other.draft_steps
        out.side_accepts = self.side_accepts + other.side_accepts
        out.nodes_at_depth = [a + b for a, b in zip(self.nodes_at_depth, other.nodes_at_depth)]
        return out

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update(tree_budget=self.max_depth + 1, draft_steps=self.draft_steps,
                 nodes_at_depth=list(self.nodes_at_depth), side_accepts=self.side_accepts)
        return d
