"""The engine's prefix cache: copies of a sequence's state at the end of a prompt prefix, so a
request in any slot whose prompt starts with that prefix loads the copy instead of evaluating it.

A hybrid model's recurrent (DeltaNet) state cannot be cut back to an earlier position, only
restored from a copy taken at that position; so the engine takes copies where a prefix is likely
to recur (engine.py `_prefill`): before the last token of each prompt, and at the end of the
prompt's first turn (its first end-of-turn token: a system prompt or an agent scaffold's
instructions end there). A copy holds the attention KV of its positions and the recurrent state
after them (backends/base.py `save_state`), at any length: a prompt shorter than any block size
is reused as well as a long one.

Bounded by a byte budget; the least recently used copies go first. One copy takes at most a
quarter of it (MAX_COPY_SHARE): a larger one is never taken.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

# 2 GiB of host memory: a copy of the 27B (q27b) is its recurrent state, 157 MB whatever the
# length (48 DeltaNet layers of conv window + 48x128x128 delta-rule state, fp32), plus 64 KiB per
# position of attention KV (16 layers, K and V, 4 KV heads x 256, f16); so about 8 copies at 2K
# positions, two (first turn, whole prompt) for each of the 4 slots a server opens by default
# (backends/llama_cpp.py DEFAULT_SERVE_SEQUENCES), and prompts up to 5.6K positions copied whole
# (MAX_COPY_SHARE). llama.cpp's server keeps 8 GiB for its own
# prompt cache (--cache-ram); this one lives beside an application, so it takes a quarter.
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30

# The largest copy, as a share of the budget: one long prompt (the 27B: 12K positions are 0.9 GB)
# does not flush the copies of the system prompts every conversation shares, and taking a copy
# holds the context (the other slots' passes wait for it; llama.cpp copies a state in one call),
# so a bound on its size bounds that stall too.
MAX_COPY_SHARE = 4


def check_prefix_cache_bytes(value: object) -> int | None:
    """The budget as given to load(): None (the default) or an integer >= 0 (0: no cache)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"prefix_cache_bytes must be an integer >= 0 (bytes of host memory; 0: no "
                         f"prefix cache) or None (the default, {DEFAULT_PREFIX_CACHE_BYTES} with several "
                         f"slots), got {value!r}")
    return value


@dataclass(eq=False)
class PrefixEntry:
    tokens: tuple[int, ...]      # the prefix; the state holds exactly these
    state: object                # backends/base.py SequenceState

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


class PrefixCache:
    """Prefix (token tuple) -> a copy of the state after it, in LRU order, at most budget_bytes
    in all. Safe to use from the request threads at once. Counters: `stats()`."""

    def __init__(self, budget_bytes: int):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ValueError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()   # oldest use first
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0                 # requests that loaded a copy
        self.reused_tokens = 0        # prompt tokens those requests did not evaluate
        self.stored = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def max_copy_bytes(self) -> int:
        """The largest copy `put` keeps: budget_bytes // MAX_COPY_SHARE."""
        return self.budget_bytes // MAX_COPY_SHARE

    def __contains__(self, prefix: Sequence[int]) -> bool:
        """Whether this prefix has a copy (and, if so, it becomes the most recently used)."""
        key = tuple(prefix)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            return False

    def longest(self, prompt: Sequence[int], max_len: int, longer_than: int = 0,
                touch: bool = True) -> PrefixEntry | None:
        """The longest copy whose prefix starts `prompt`, with longer_than < length <= max_len,
        or None. With touch, it becomes the most recently used."""
        best: PrefixEntry | None = None
        with self._lock:
            for key, e in self._entries.items():
                n = len(key)
                if longer_than < n <= max_len and (best is None or n > len(best.tokens)) \
                        and tuple(prompt[:n]) == key:
                    best = e
            if best is not None and touch:
                self._entries.move_to_end(best.tokens)
        return best

    def count_hit(self, n_tokens: int) -> None:
        with self._lock:
            self.hits += 1
            self.reused_tokens += n_tokens

    def put(self, prefix: Sequence[int], state) -> bool:
        """Keep `state` (the state after `prefix`) as the most recently used copy, evicting the
        least recently used until it fits; False (nothing kept) when it exceeds max_copy_bytes."""
        key = tuple(prefix)
        if state.n_past != len(key):
            raise ValueError(f"the state holds {state.n_past} positions, the prefix {len(key)} tokens")
        if state.nbytes > self.max_copy_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._entries and self._bytes + state.nbytes > self.budget_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.nbytes
                self.evicted += 1
            self._entries[key] = PrefixEntry(key, state)
            self._bytes += state.nbytes
            self.stored += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"budget_bytes": self.budget_bytes, "bytes": self._bytes, "entries": len(self._entries),
                    "hits": self.hits, "reused_tokens": self.reused_tokens, "stored": self.stored,
                    "evicted": self.evicted}
