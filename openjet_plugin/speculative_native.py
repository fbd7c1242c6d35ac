"""Speculative cycles on the native engine (issue 6): `NativeSpeculator.cycle`.

One cycle from the current token x at position n (sampled, not yet in the state):

    MTP: the rows still owed for the last accepted drafts + (x, h_{n-1})  -> draft 1   (one call)
         chained on the MTP block's own output                            -> drafts 2..D
    main model: oj_verify([x, d_1..d_D]) at n..n+D                           (one call)
    verification on the target's logits (speculative.verify_greedy / verify_sampled)
    oj_commit(1 + accepted): DeltaNet state advances by replay at the next evaluation

The rules and the invariant are speculative.py's; this module only drives the native backend
(backends/native.py), whose verify/commit/draft_* calls keep the MTP cache in step. Greedy
requests without penalties or bias verify on the GPU's argmax (one copy of D + 1 ints); otherwise
the target's rows are copied only as far as verification reads them.

Fused cycles (issue 8): where the library has oj_cycle (backend.supports_cycle), those greedy
requests run each cycle as one call that verifies, commits, makes the next token's MTP row and
drafts from it; the next cycle verifies those drafts (`_next`). Sampled requests the engine can
draw (top-k 1..64, no penalties or bias, the standard rule; backends/native.sampled_cycle_refusal)
do the same through oj_cycle_sampled (issue 28), every draw on the GPU from a seed the request's
generator gives each call; they verify only drafts the last call drew, so a request's first cycle
verifies its token alone. A cycle drafts on the host
(draft_first/draft_next) only where no call left drafts for its token: the first of a request, or
after a call with no room left in the context to draft.
The in-call drafts see the draft vocabulary of the call: the tokens a cycle emits join it for the
next call, one cycle later than on the host path (acceptance may differ, never the output).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .backends.native import sampled_cycle_refusal
from .sampling import SamplingParams, token_distribution
from .speculative import (STANDARD_RULE, DepthPolicy, DraftVocab, SampledRule, SpeculativeStats,
                          TokenDistribution, verify_greedy, verify_sampled)

MAX_NATIVE_DEPTH = 7          # drafts a native cycle takes: 8 positions a verify (OJ_MAX_POSITIONS is 16; 8 is the
                              # trees' limit, OJ_MAX_TREE_NODES, and the deepest chain measured)


class _LazyRows:
    """Rows of the target's last verify (`read`: the backend's logits or hidden), copied from the
    GPU when first read. After the commit (`drop`) a row not read by then is refused: the engine's
    rows are the kept path's."""

    def __init__(self, read, n: int, what: str = "logits"):
        self.read, self.n, self.what, self._rows = read, n, what, {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        i = range(self.n)[i]
        if i not in self._rows:
            if self.read is None:
                raise RuntimeError(f"the last verify's {self.what} row {i} read after commit_path or commit: "
                                   f"the engine's rows are the kept path's now")
            self._rows[i] = self.read(i)
        return self._rows[i]

    def drop(self) -> None:
        self.read = None


class _Targets:
    """p[i]: the target distribution after position i, built when verification asks for it;
    masks[i] (a constraint's allowed tokens there, or None) applied first."""

    def __init__(self, rows: _LazyRows, params: SamplingParams, histories: list[list[int]],
                 grammar=None, masks: list | None = None):
        self.rows, self.params, self.histories, self._d = rows, params, histories, {}
        self.grammar, self.masks = grammar, masks

    def __len__(self) -> int:
        return len(self.histories)

    def __getitem__(self, i: int) -> TokenDistribution:
        i = range(len(self))[i]
        if i not in self._d:
            self._d[i] = TokenDistribution.from_logits(self.row(i), self.params, self.histories[i])
        return self._d[i]

    def row(self, i: int) -> np.ndarray:
        """The target's logits after position i, the constraint's mask applied."""
        if self.masks is None or self.masks[i] is None:
            return self.rows[i]
        return self.grammar.mask_logits(self.rows[i], self.masks[i])


class NativeSpeculator:
    """MTP speculative decoding for one native backend (one conversation).

    `vocab`: the draft head's vocabulary (None or the whole vocabulary: unrestricted); tokens of
    the request's sequence are added as they appear. `oracle`: a draft source from speculative.py
    (ContinuationDrafts, ForcedAcceptanceDrafts) used instead of the MTP head, for tests and for
    timing cycles at a chosen acceptance rate.
    """

    def __init__(self, backend, depth: int | DepthPolicy, vocab: DraftVocab | None = None,
                 rule: SampledRule = STANDARD_RULE, oracle=None):
        self.b = backend
        self.policy = depth if isinstance(depth, DepthPolicy) else DepthPolicy(min(int(depth), MAX_NATIVE_DEPTH))
        if self.policy.depth > MAX_NATIVE_DEPTH:
            raise ValueError(f"draft depth {self.policy.depth} exceeds the native engine's {MAX_NATIVE_DEPTH}")
        self.restricted = vocab is not None and len(vocab) < backend.n_vocab
        self.base_vocab = vocab if self.restricted else None
        self.vocab: DraftVocab | None = None
        self.rule = rule
        self.oracle = oracle
        self.stats = SpeculativeStats(self.policy.depth)
        # (n_past, token, drafts) from the last fused call: its next token's MTP row and drafts
        self._next: tuple[int, int, list[int]] | None = None

    def begin(self, history: Sequence[int]) -> None:
        """A new request whose tokens so far (prompt) are `history`."""
        self.policy.reset()
        self.stats = SpeculativeStats(self.policy.depth)
        self._next = None
        if self.restricted:
            self.vocab = self.base_vocab.copy()
            self.vocab.add(history)
            self._upload()
        if self.oracle is not None:
            self.oracle.begin(list(history)[:-1], [])

    def _upload(self) -> None:
        if self.restricted and len(self.vocab) != self.b._draft_vocab_len:
            self.b.set_draft_vocab(self.vocab.ids)

    def _drafts(self, token: int, pos: int, depth: int, history: list[int], params: SamplingParams,
                rng: np.random.Generator, grammar=None,
                masks: list | None = None) -> tuple[list[int], list[TokenDistribution]]:
        """Up to `depth` drafts after `token`. With a grammar (a constraint's GrammarState, left
        after `token`), each draft is drawn under the mask of its position and consumed; the
        drafts end at the first one the grammar forbids (it could never be accepted). masks gets
        the mask after token and after each draft (None while the grammar is not active); each
        one is computed while the GPU makes the next draft (GrammarState.prefetch), the last
        one, after the last draft, while it verifies (cycle collects it)."""
        if grammar is not None:
            grammar.prefetch()
        if self.oracle is not None:
            if grammar is not None:
                masks.append(grammar.allowed())
            drafts, qs = self.oracle.propose(pos, token, None, history, depth, params, rng)
            drafts = [int(t) for t in drafts][:depth]
            if grammar is not None:
                n = 0
                while n < len(drafts) and grammar.try_consume(drafts[n]):
                    masks.append(grammar.allowed())
                    n += 1
                drafts = drafts[:n]
            return drafts, list(qs)[:len(drafts)]
        if self.restricted:
            self.vocab.add([token])
            self._upload()
        ids = self.vocab.ids if self.restricted else None
        drafts: list[int] = []
        qs: list[TokenDistribution] = []
        hist = list(history)
        for i in range(depth):
            top = self.b.draft_first(token) if i == 0 else self.b.draft_next(drafts[-1], pos + i)
            allowed = None
            if grammar is not None:
                masks.append(grammar.allowed())        # after token + drafts[:i]
                allowed = masks[-1]
            if allowed is not None:
                x = self.b.draft_logits(-1)
                x = np.where(allowed[ids] if ids is not None else allowed[:len(x)], x, -np.inf)
                if not np.isfinite(x).any():
                    break                              # the draft vocabulary has no allowed token
                if params.greedy:
                    top = int(ids[int(np.argmax(x))]) if ids is not None else int(np.argmax(x))
                    q = TokenDistribution.point(top, self.b.n_vocab)
                    tok = top
                else:
                    q = TokenDistribution.from_logits(x, params, hist, vocab_ids=ids, n_vocab=self.b.n_vocab)
                    tok = q.draw(rng.random())
            elif params.greedy:
                # greedy verification never reads q: the head's plain argmax is the draft
                tok, q = top, TokenDistribution.point(top, self.b.n_vocab)
            else:
                q = TokenDistribution.from_logits(self.b.draft_logits(-1), params, hist, vocab_ids=ids,
                                                  n_vocab=self.b.n_vocab)
                tok = q.draw(rng.random())
            if grammar is not None:
                if not grammar.try_consume(int(tok)):
                    break
                grammar.prefetch()
            drafts.append(int(tok))
            qs.append(q)
            hist.append(int(tok))
        return drafts, qs

    def cycle(self, token: int, history: Sequence[int], params: SamplingParams, rng: np.random.Generator,
              max_emit: int, grammar=None, rows_out: list | None = None) -> tuple[list[int], int, int]:
        """One cycle from `token` (the last of `history`, not yet in the state). Returns (emitted:
        the accepted drafts and one more token, depth, accepted); the state then holds `token`
        and the accepted drafts, and the last emitted token starts the next cycle.

        grammar: a constraint's GrammarState, after `token`: drafts and every verified position
        are drawn under its masks, the rejected drafts are rolled back out of it, and it is left
        after the emitted tokens. rows_out: gets the target's logits row of each emitted token
        (for logprobs). Either one takes the host path: the fused oj_cycle picks its tokens on
        the GPU from unmasked logits and keeps the rows there."""
        plain = not params.has_penalties and not params.logit_bias and grammar is None and rows_out is None
        if plain and params.greedy and getattr(self.b, "supports_cycle", False):
            out = self._cycle_fused(int(token), history, params, rng, max_emit)
            if out is not None:
                return out
        elif (plain and self.oracle is None and self.rule == STANDARD_RULE
                and getattr(self.b, "supports_sampled_cycle", False) and sampled_cycle_refusal(params) is None):
            out = self._cycle_fused(int(token), history, params, rng, max_emit, sampled=True)
            if out is not None:
                return out
        self._next = None
        b = self.b
        pos = b.n_past
        room = b.n_ctx - pos - 1                       # positions left after the current token's
        depth = max(0, min(self.policy.next_depth(), max_emit - 1, room))
        history = [int(t) for t in history]
        masks: list | None = [] if grammar is not None else None
        if depth > 0:
            drafts, qs = self._drafts(int(token), pos, depth, history, params, rng, grammar, masks)
        else:
            drafts, qs = [], []
            if grammar is not None:
                grammar.prefetch()
        depth = len(drafts)                            # an oracle or the grammar may end them early
        tokens = [int(token)] + drafts
        b.verify(tokens)
        if masks is not None and len(masks) == depth:
            masks.append(grammar.allowed())            # after the last draft, computed meanwhile
        rows = _LazyRows(b.logits, len(tokens))
        if (params.greedy and not params.has_penalties and not params.logit_bias
                and grammar is None):
            v = verify_greedy(b.argmax(), drafts)
        else:
            hists = [history + drafts[:i] for i in range(len(tokens))]
            targets_p = _Targets(rows, params, hists, grammar, masks)
            if params.greedy:
                targets, j = [], 0
                while True:                            # rows only up to the first mismatch
                    targets.append(int(token_distribution(targets_p.row(j), params, hists[j])[0][0]))
                    if j == depth or targets[j] != drafts[j]:
                        break
                    j += 1
                v = verify_greedy(targets + [0] * (depth + 1 - len(targets)), drafts)
            else:
                v = verify_sampled(targets_p, qs, drafts, rng, self.rule)
        if grammar is not None:
            # the grammar took every draft: the rejected ones go, the correction comes in
            grammar.rollback(depth - v.n_accepted)
            grammar.consume(v.token)
        emitted = drafts[:v.n_accepted] + [v.token]
        if rows_out is not None:
            rows_out.extend(rows[i] for i in range(len(emitted)))
        b.commit(v.n_accepted + 1)
        if self.oracle is not None and b.supports_speculative:
            b._flush_mtp()                             # keep the MTP cache in step while the window holds
        self.policy.update(depth, v.n_accepted)
        self.stats.record(depth, v.n_accepted, len(emitted))
        if self.restricted:
            self.vocab.add(emitted)
        return emitted, depth, v.n_accepted

    def _cycle_fused(self, token: int, history: Sequence[int], params: SamplingParams,
                     rng: np.random.Generator, max_emit: int,
                     sampled: bool = False) -> tuple[list[int], int, int] | None:
        """cycle() through oj_cycle (sampled: oj_cycle_sampled); None (nothing done) where the host
        path is the one to take: no drafts this cycle and no MTP row for the token, which a
        draft-less cycle would not make.

        A sampled cycle verifies only drafts the last call drew (the engine holds the
        distributions they were drawn from): after any other step it verifies the token alone and
        drafts for the next one."""
        b = self.b
        pos = b.n_past
        room = b.n_ctx - pos - 1
        depth = max(0, min(self.policy.next_depth(), max_emit - 1, room))
        last, self._next = self._next, None
        # the last call left this token's MTP row, and drafts from it, in the engine
        row = last is not None and last[:2] == (pos, token)
        if depth == 0 and not row:
            return None
        if row and self.oracle is None:
            drafts = last[2][:depth]
        elif sampled:
            drafts = []
        elif depth > 0:
            # the host's drafts; the MTP head's first step makes the token's row (not the oracle's)
            drafts = self._drafts(token, pos, depth, [int(t) for t in history], params, rng)[0]
            row = row or self.oracle is None
        else:
            drafts = []
        # drafts for the next cycle, which verifies 1 + n_draft positions after up to 1 + len(drafts)
        # committed here: pos + 1 + len(drafts) + n_draft < n_ctx
        n_draft = 0
        if b.supports_speculative:
            n_draft = max(0, min(self.policy.depth, b.n_ctx - pos - 2 - len(drafts)))
        if n_draft and not row:
            b.draft_first(token)                       # oracle drafts: the head's row of the token only
        if n_draft:
            self._upload()                             # the tokens emitted so far draft with this call
        if sampled:
            k, emitted, nxt = b.cycle([token] + drafts, n_draft, sampled=(params, int(rng.integers(0, 1 << 63))))
        else:
            k, emitted, nxt = b.cycle([token] + drafts, n_draft)
        if n_draft:
            self._next = (pos + 1 + k, emitted[-1], nxt)
        depth = len(drafts)
        self.policy.update(depth, k)
        self.stats.record(depth, k, len(emitted))
        if self.restricted:
            self.vocab.add(emitted)
        return emitted, depth, k


# --- draft trees (issue 28) on the generic decoder ------------------------------------------------

class NativeTreeTarget:
    """A NativeBackend as `speculative.Target` and `speculative_tree.TreeTarget`: what
    `SpeculativeDecoder(tree=...)` drives (`native_tree_decoder`).

    verify_tree is oj_verify_tree (all nodes in one pass) and commit_path oj_commit_path. Logits
    rows and hiddens are copied from the GPU only when read (the decoder reads its accepted path's
    hiddens, for the draft source, before commit_path; after it the engine's rows are the path's). The draft source keeps the MTP cache itself (MTPTreeDrafts' catch-up
    through NativeTreeDrafter), so the backend must not also follow it: draft_depth 0.
    """

    def __init__(self, backend):
        if getattr(backend, "supports_speculative", False):
            raise ValueError("NativeTreeTarget drives the MTP cache through its draft source: create the "
                             "NativeBackend with draft_depth=0 (its own MTP catch-up would rewrite the rows)")
        if not getattr(backend, "supports_tree", False):
            raise RuntimeError("the native library has no oj_verify_tree: rebuild it")
        self.b = backend
        self.n_vocab = backend.n_vocab
        self._rows: _LazyRows | None = None
        self._hiddens: _LazyRows | None = None

    @property
    def n_past(self) -> int:
        return self.b.n_past

    def reset(self) -> None:
        self.b.reset()

    def prefill(self, tokens: Sequence[int]) -> list[np.ndarray | None]:
        """Evaluate and commit `tokens`; the hidden after each. Where the backend can, one batched
        prefill that also makes the tokens' MTP rows (`prefill_with_mtp_rows`): only the last
        hidden is then returned (the others None), and the draft source finds the rows made
        (NativeTreeDrafter.rows_made). Else MAX_POSITIONS a call, every hidden copied out."""
        toks = [int(t) for t in tokens]
        if toks and self.b.prefill_with_mtp_rows(toks):
            return [None] * (len(toks) - 1) + [self.b.hidden(0)]
        out: list[np.ndarray] = []
        for i in range(0, len(toks), MAX_NATIVE_DEPTH + 1):
            chunk = toks[i:i + MAX_NATIVE_DEPTH + 1]
            self.b.eval(chunk)
            out += [self.b.hidden(j) for j in range(len(chunk))]
        return out

    def _results(self, n: int) -> tuple["_LazyRows", list[np.ndarray]]:
        self._rows = _LazyRows(self.b.logits, n)
        return self._rows, [self.b.hidden(i) for i in range(n)]

    def verify(self, tokens: Sequence[int]):
        self.b.verify([int(t) for t in tokens])
        return self._results(len(tokens))

    def commit(self, n: int) -> None:
        self._stale()
        self.b.commit(int(n))

    def verify_tree(self, tokens: Sequence[int], parent: Sequence[int]):
        self.b.verify_tree([int(t) for t in tokens], parent)
        n = len(tokens)
        self._rows, self._hiddens = _LazyRows(self.b.logits, n), _LazyRows(self.b.hidden, n, "hidden")
        return self._rows, self._hiddens

    def argmax(self) -> list[int]:
        """The engine's argmax after each node of the last verify_tree (its pass computes them;
        ties: the lowest id)."""
        return self.b.argmax()

    def commit_path(self, path: Sequence[int]) -> None:
        self._stale()
        self.b.commit_path([int(i) for i in path])

    def _stale(self) -> None:
        # rows not read by now are gone: after commit_path the engine's rows are the path's
        for rows in (self._rows, self._hiddens):
            if rows is not None:
                rows.drop()
        self._rows = self._hiddens = None


class NativeTreeDrafter:
    """The native MTP head as `speculative_tree.TreeDrafter` (hiddens are host arrays, OJ_H_HOST).

    step(pos, token, hidden) is one oj_mtp_eval at pos (the cache cut there first). A tree node's
    step_branch rewrites its ancestors' rows first: its row is (token, hidden in), and the step
    evaluates [ancestors' tokens, token] at pos - len(path) in one oj_mtp_eval from their host
    hiddens, then reads the last position. What it costs: a node at depth d evaluates d positions
    instead of 1 (one MTP block, weight-bound: ~1/65 of a main pass on the 27B for up to 8
    positions) plus a host round trip of the hidden per step; the rows it overwrites are beyond
    the committed ones (the root's row at pos - len(path) - 1 stays), which MTPTreeDrafts'
    catch-up rewrites from the main hiddens after the commit.
    """

    def __init__(self, backend):
        if not backend.has_mtp:
            raise ValueError("the model has no MTP block: there is no draft head")
        self.b = backend
        self.n_vocab = backend.n_vocab
        self._vocab: np.ndarray | None = None      # the draft vocabulary uploaded (None: all)

    def reset(self) -> None:
        """Nothing to do: the target's reset emptied the MTP cache, and the catch-up rewrites it
        from the first position whose row the target's prefill did not make (rows_made)."""

    def rows_made(self) -> int:
        """Positions whose MTP rows the engine holds from the main model's hiddens: those of a
        batched prefill (NativeTreeTarget.prefill), 0 otherwise."""
        return self.b._mtp_n_past()

    def _use_vocab(self, ids: np.ndarray | None) -> None:
        if ids is not None and len(ids) == self.n_vocab and np.array_equal(ids, np.arange(self.n_vocab)):
            ids = None                             # the whole vocabulary in id order: the plain head
        if ids is None and self._vocab is None:
            return
        if ids is not None and self._vocab is not None and np.array_equal(ids, self._vocab):
            return
        self.b.set_draft_vocab(ids)
        self._vocab = None if ids is None else np.array(ids, copy=True)

    def _h(self, hidden) -> np.ndarray:
        if hidden is None:
            return np.zeros(self.b.config.n_embd, dtype=np.float32)
        return np.asarray(hidden, dtype=np.float32).reshape(-1)

    def step(self, pos, token, hidden, vocab_ids):
        if vocab_ids is not None:
            self._use_vocab(vocab_ids)
        self.b.mtp_eval([int(token)], int(pos), h=self._h(hidden)[None])
        logits = self.b.draft_logits(0) if vocab_ids is not None else None
        return logits, self.b.draft_hidden(0)

    def grow(self, pos: int, token: int, hidden, vocab_ids, policy, max_depth: int):
        """A greedy draft tree in one engine call (oj_draft_tree), by grow_tree's rule with the
        policy's acceptance estimate: a DraftTree, or None where the engine cannot (an older
        library, a budget or fan-out beyond it)."""
        from .backends.native import MAX_TREE_CHILDREN
        from .speculative_tree import DraftTree

        if (not getattr(self.b, "supports_draft_tree", False) or policy.budget > MAX_NATIVE_DEPTH + 1
                or policy.max_children > MAX_TREE_CHILDREN):
            return None
        self._use_vocab(vocab_ids)
        edges, a, c = policy.estimate_table()
        toks, par, prob, score, steps = self.b.draft_tree(int(token), int(pos), self._h(hidden), policy.budget,
                                                          policy.max_children, int(max_depth), edges, a, c)
        return DraftTree(toks, par, prob=prob, score=score, draft_steps=steps)

    def step_branch(self, pos, token, hidden, vocab_ids, path):
        self._use_vocab(vocab_ids)
        rows = list(path) + [(int(token), self._h(hidden))]
        pos0 = int(pos) - len(path)
        self.b.mtp_eval([t for t, _ in rows], pos0, h=np.stack([h for _, h in rows]))
        last = len(rows) - 1
        return self.b.draft_logits(last), self.b.draft_hidden(last), rows[-1]


def native_tree_decoder(backend, tree, vocab=None):
    """SpeculativeDecoder with draft trees on the native engine: target NativeTreeTarget(backend),
    drafts MTPTreeDrafts(NativeTreeDrafter(backend), vocab); `tree` a TreePolicy or a budget
    (2..OJ_MAX_POSITIONS). The backend: draft_depth=0 (NativeTreeTarget says why)."""
    from .speculative import SpeculativeDecoder
    from .speculative_tree import MTPTreeDrafts, TreePolicy

    policy = tree if isinstance(tree, TreePolicy) else TreePolicy(tree)
    if policy.budget > MAX_NATIVE_DEPTH + 1:
        raise ValueError(f"tree budget {policy.budget} exceeds the native engine's {MAX_NATIVE_DEPTH + 1} "
                         f"positions per verify")
    return SpeculativeDecoder(NativeTreeTarget(backend), MTPTreeDrafts(NativeTreeDrafter(backend), vocab),
                              tree=policy)
