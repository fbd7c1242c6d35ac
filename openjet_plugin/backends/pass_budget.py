"""How many prompt tokens a shared pass may carry next to the sequences that decode (issue 29).

A pass that serves decode steps and a prompt chunk together costs the decoders the whole pass: a
512-token chunk next to 3 decode steps made their inter-token gap 70 times longer on a 2-core CPU.
Chunked prefill (Sarathi-Serve's token budget, vLLM's `max_num_batched_tokens`) caps the prompt
tokens of a mixed pass; here the cap is not a constant but sized from the passes' own timings, so
one policy fits a 2-core CPU and an H200: a mixed pass may cost at most `slowdown` times the
decode-only pass of the same decode steps.

The owner (a scheduler that composes passes) uses two calls per pass:

    n = budget.prompt_tokens(n_decode)          # before composing: prompt tokens allowed
    ... run the pass with n_decode decode tokens and n_prompt <= n prompt tokens ...
    budget.record(n_decode, n_prompt, seconds)  # after a pass that succeeded

`n_decode` counts the decode tokens of the pass (a sampled token, or a verify step's tokens);
with none, a prompt goes at full n_batch (its time to first token alone is what it always was).

The model behind the sizing, from the timings recorded:
- the decode-only pass time, per number of decode tokens (a moving average of the passes with
  no prompt tokens); for a count never seen alone, the nearest smaller one's (a cheaper pass, so
  a smaller chunk); with none smaller, the pass is a probe of one prompt token whose time stands
  for the decode-only pass until one is measured;
- the cost of one prompt token in a mixed pass: (pass time - decode-only time) / prompt tokens,
  a moving average, since the cost per token falls as the chunk grows (batched matmuls) and rises
  as the prompt's own context grows (attention). Before any mixed pass it is taken to be a decode
  token's cost (the decode-only time / decode tokens).
The chunk is (slowdown - 1) x decode-only time / cost per prompt token, at least 1 (a waiting
prompt always advances), at most n_batch - n_decode, and at most twice the previous mixed pass's
chunk (one fast timing never puts a whole n_batch chunk next to the decoders; a slow one shrinks
the next chunk at once).
"""

from __future__ import annotations

import math

# A mixed pass may take this times the decode-only pass. The issue's target is the decoders'
# inter-token p99 under 3x its value without the prompt. The chunk is sized from the passes before
# it, so single passes overshoot the estimate (the cost per token is not linear in the chunk size;
# timing noise on a shared CPU). Measured on the 2-core CPU (bench/concurrent.py, 3 streams, a
# 1,024-token prompt, the embedded model): at 2x the mixed passes took 1.82x the decode-only pass
# at the median, 2.41x at p99, 2.71x at most; at 2.5x, 2.37x / 2.86x / 3.66x, no room left under 3x
# where the decode-only passes are steady (a GPU's). Its price is the prompt's time to first token
# while others decode: about half of each pass goes to the prompt, in small chunks.
MIXED_PASS_SLOWDOWN = 2.0
SMOOTHING = 0.3               # weight of the newest timing in the moving averages
MAX_GROWTH = 2                # the chunk at most doubles from one mixed pass to the next


class PassBudget:
    """Prompt tokens per pass next to decode steps, sized from measured pass times (see the module
    docstring). Not thread-safe: the scheduler calls it from its own thread or under its lock."""

    def __init__(self, n_batch: int, slowdown: float = MIXED_PASS_SLOWDOWN):
        if isinstance(n_batch, bool) or not isinstance(n_batch, int) or n_batch < 1:
            raise ValueError(f"n_batch must be an integer >= 1, got {n_batch!r}")
        if not isinstance(slowdown, (int, float)) or isinstance(slowdown, bool) or not slowdown > 1:
            raise ValueError(f"slowdown must be a number > 1 (a mixed pass's cost over the decode-only "
                             f"pass's), got {slowdown!r}")
        self.n_batch = n_batch
        self.slowdown = float(slowdown)
        self._decode_seconds: dict[int, float] = {}     # decode tokens -> decode-only pass time
        self._prompt_token_seconds: float | None = None
        self._last_chunk = 0

    def decode_seconds(self, n_decode: int) -> float | None:
        """The decode-only pass time used for n_decode decode tokens: its own average, else the
        nearest smaller count's, else None (not known yet)."""
        known = [n for n in self._decode_seconds if n <= n_decode]
        return self._decode_seconds[max(known)] if known else None

    def prompt_tokens(self, n_decode: int) -> int:
        """Prompt tokens the next pass may carry next to n_decode decode tokens: n_batch with
        none; otherwise at least 1 while the pass has room, at most n_batch - n_decode."""
        _check_count("n_decode", n_decode)
        room = self.n_batch - n_decode
        if n_decode == 0 or room <= 0:
            return max(room, 0)
        t_decode = self.decode_seconds(n_decode)
        if t_decode is None:
            return 1                                    # the probe: its time stands for t_decode
        cost = self._prompt_token_seconds
        if cost is None:
            cost = t_decode / n_decode                  # a prompt token costs what a decode token does
        # (the factor: a quotient that is a whole number in exact arithmetic stays one)
        want = room if cost <= 0 else math.floor((self.slowdown - 1) * t_decode / cost * (1 + 1e-9))
        if self._last_chunk:
            want = min(want, MAX_GROWTH * self._last_chunk)
        return max(1, min(room, want))

    def record(self, n_decode: int, n_prompt: int, seconds: float) -> None:
        """A pass that ran: n_decode decode tokens, n_prompt prompt tokens, its seconds."""
        _check_count("n_decode", n_decode)
        _check_count("n_prompt", n_prompt)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        if n_decode == 0:
            return                                      # a prompt alone says nothing of the mix
        if n_prompt == 0:
            old = self._decode_seconds.get(n_decode)
            self._decode_seconds[n_decode] = seconds if old is None else _average(old, seconds)
            return
        t_decode = self.decode_seconds(n_decode)
        if t_decode is None:
            self._decode_seconds[n_decode] = seconds    # the probe's pass
            return
        cost = max(seconds - t_decode, 0.0) / n_prompt
        old = self._prompt_token_seconds
        self._prompt_token_seconds = cost if old is None else _average(old, cost)
        self._last_chunk = n_prompt


def _average(old: float, new: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * new


def _check_count(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {n!r}")
