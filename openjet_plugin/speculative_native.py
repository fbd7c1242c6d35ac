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
drafts from it; the next cycle verifies those drafts (`_next`). A cycle drafts on the host
(draft_first/draft_next) only where no call left drafts for its token: the first of a request, or
after a call with no room left in the context to draft.
The in-call drafts see the draft vocabulary of the call: the tokens a cycle emits join it for the
next call, one cycle later than on the host path (acceptance may differ, never the output).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import SamplingParams, token_distribution
from .speculative import (STANDARD_RULE, DepthPolicy, DraftVocab, SampledRule, SpeculativeStats,
                          TokenDistribution, verify_greedy, verify_sampled)

MAX_NATIVE_DEPTH = 7          # one oj_verify takes the current token + 7 drafts (OJ_MAX_POSITIONS 8)


class _LazyRows:
    """The target's logits rows of the last verify, copied from the GPU when first read."""

    def __init__(self, backend, n: int):
        self.b, self.n, self._rows = backend, n, {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        i = range(self.n)[i]
        if i not in self._rows:
            self._rows[i] = self.b.logits(i)
        return self._rows[i]


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
        if (params.greedy and not params.has_penalties and not params.logit_bias
                and grammar is None and rows_out is None
                and getattr(self.b, "supports_cycle", False)):
            out = self._cycle_fused(int(token), history, params, rng, max_emit)
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
        rows = _LazyRows(b, len(tokens))
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
                     rng: np.random.Generator, max_emit: int) -> tuple[list[int], int, int] | None:
        """cycle() through oj_cycle; None (nothing done) where the host path is the one to take:
        no drafts this cycle and no MTP row for the token, which a draft-less cycle would not make."""
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
        k, emitted, nxt = b.cycle([token] + drafts, n_draft)
        if n_draft:
            self._next = (pos + 1 + k, emitted[-1], nxt)
        depth = len(drafts)
        self.policy.update(depth, k)
        self.stats.record(depth, k, len(emitted))
        if self.restricted:
            self.vocab.add(emitted)
        return emitted, depth, k
