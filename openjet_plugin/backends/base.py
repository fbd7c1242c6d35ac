"""What the engine asks of a backend.

A backend holds one conversation's model state (KV cache and recurrent state) and turns tokens into
next-token logits; one that holds several hands out a view per conversation (below). Everything above that — sampling, stop strings, conversation reuse, the lock and
the stats — is the engine's, so every backend behaves the same way to a caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    name: str                 # "llama.cpp" | "native"
    n_ctx: int
    n_vocab: int
    supports_speculative: bool

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> bytes: ...

    @property
    def n_past(self) -> int:
        """Tokens already in the state (KV cache / recurrent state)."""
        ...

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Append `tokens` at n_past; return float32 logits [n_vocab] of the last one."""
        ...

    def eval_argmax(self, tokens: list[int]) -> int:
        """Same as eval, but only the greedy id (a GPU backend keeps the logits on the device)."""
        ...

    def rollback(self, n_keep: int) -> bool:
        """Keep the first n_keep tokens. False if the state cannot go back (recurrent layers);
        the state is then unchanged and the caller resets and re-prefills."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


# Optional, for backends whose state cannot roll back (recurrent layers) but can be copied:
#     def save_checkpoint(self) -> None: ...            # remember the state at n_past
#     def restore_checkpoint(self, n_max: int) -> int: ...
#         # back to the newest checkpoint with <= n_max tokens; returns its n_past (0: state reset)
# The engine saves one before the last token of every prompt and restores one when rollback()
# refuses; a backend without them is reset and re-prefilled instead.

# Optional, for backends that can copy a sequence's whole state out and into any of their
# sequences (the engine's prefix cache, prefix_cache.py: a prompt prefix evaluated in one slot is
# reused by a request in another, or by a later conversation in the same slot):
#     def save_state(self, max_bytes: int) -> SequenceState | None: ...
#         # a self-contained copy of this sequence's state at n_past: the attention KV of
#         # positions [0, n_past) and the recurrent state at n_past (a recurrent state cannot be
#         # cut back, so a copy at p can only be taken while the sequence stands at p); None when
#         # it would take more than max_bytes or cannot be taken
#     def load_state(self, state: SequenceState) -> bool: ...
#         # replace this sequence's whole state by `state`, taken from any sequence of the same
#         # backend: n_past becomes state.n_past and the sequence's own checkpoints are dropped;
#         # False if it failed (the sequence is then empty, n_past 0)
# Neither may disturb another sequence: a multi-sequence backend does both between its passes.
# The llama.cpp backend implements them (llama_cpp_sequences.py), the native one with
# oj_seq_state_save / load (backends/native.py: its KV rows [0, p), DeltaNet / conv state, h of
# p - 1 and MTP rows, in host memory).


@dataclass(frozen=True, eq=False)
class SequenceState:
    """One sequence's state at n_past, copied out by `save_state` (see above)."""

    n_past: int
    nbytes: int         # the memory the copy holds
    data: object        # the backend's own form (llama.cpp: its sequence-state bytes)
    origin: object      # the backend that made it: only that backend can load it

# Optional, for backends that hold several sequences (conversations) at once:
#     n_sequences: int                                  # > 1: the engine makes one slot per sequence
#     def sequences(self) -> list[Backend]: ...
#         # one view per sequence, each the protocol above over that sequence's own state
#         # (KV region, recurrent state, n_past); evals from different threads may run at once
#         # and the backend serves them together (passes.py: llama_cpp_sequences.py, native.py)
# A backend without them holds one sequence.
