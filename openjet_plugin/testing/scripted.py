"""A generated qwen35 GGUF whose weights are scripted to write given replies (greedy decoding),
each chosen by a marker token in the prompt: an agent's tool call first, then an answer once a
tool result is in the context (`scripted_tool_model`), or a reply per test prompt
(`scripted_model`, used by LangChain's standard tests).

A random-weight model never writes a tool call; a trained one cannot be fetched here. This file
is a real model all the same: the engine loads it, renders the real chat template (Qwen3.5's, in
`openjet_plugin/data/qwen35_chat_template.jinja`), tokenizes, prefills and decodes it on its
backend; only the weights are set by hand, so that the whole path from a prompt to a parsed tool
call runs as it would on a trained model.

How the weights script a reply (shape: `tiny`; every residual branch writes zero except one):
- Each reply is cut into tokens that all differ from each other (over all replies), so that "the
  next token" is a function of the current one: a bigram chain from the prompt's last token to
  <|im_end|>. The markup of a tool call repeats "<" and "\n" more often than the vocabulary has
  distinct tokens for them, so a reply is cut into lines or other pieces no other reply uses
  (`_reply_tokens`), and a piece that is not a token of the vocabulary takes the place of one of
  its rarest tokens (one that no merge builds on; the merge that formed it is dropped, so the
  tokenizer never writes it and prompts tokenize as before). The text still detokenizes to the
  reply exactly.
- The output head's row of each next token is the current token's embedding (token half), one of
  mutually orthogonal +-1 rows (a Hadamard matrix), so the chain's token leads every other by
  ~20 nats. A token of no chain has row 0 (all ones), which no chain reads.
- Which chain starts depends on the context: each script has a marker token (<tool_response> for
  "after a tool result"), and the last script whose marker is in the prompt wins. The embedding
  has context dims: a constant 1 (every token), a level (a marker's rank) and a one-hot of the
  marker's script. In the attention layer, head 0's query is the constant and its key the level
  (on dims RoPE leaves alone, the constant filling the rest), with q/k-norm weights that put
  adjacent levels KEY_SPACING apart in score: the head attends to the highest marker present, and
  its value (the one-hot) raises that script's "flag" dim through attn_output, else nothing. The
  head reads the flags: +flag for the script's first token, -flag for the default reply's, sized
  so that a flag flips the first choice but never outweighs a chain's own next token.
- A reply may be written under a constraint (a forced tool call, a JSON schema). Where the
  grammar forces the next bytes (a call's head `<tool_call>\n<function=NAME>\n<parameter=ARG>\n`,
  JSON's '{"key": "', the markup between two values) llguidance's mask admits only the
  tokenizer's canonical tokens of them (near the end of the forced text also their beginnings,
  and tokens that run on into the free text after it), whatever the weights say; where it
  leaves them open, any token that fits. So the grammar writes the head in tokens of no chain,
  and after such a token (row 0) every chain token trails the tokens of no chain
  (OFF_CHAIN_SHARE), single bytes lead them (BYTE_SHARE: the head is finished a byte at a time)
  and the flag's first token leads all: the weights take over at the first open position, on
  the flag, whatever token ended the head ('>\n' ends every forced call's head: no chain could
  key on it). The rest is cut so that every token starts where the grammar leaves the next bytes
  open (`_free_positions`): the token that takes over forced markup between two values starts in
  the free text before it. The forced tail (a call's closing markup after its last value) may be
  cut anywhere: under the constraint the grammar finishes the reply, in its own tokens if need
  be; under one that leaves the tail open the chain writes it.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..config import PRESETS
from . import bpe
from .synth import RESIDUAL_OUTPUTS, synth_specs, tensor_values, token_dims, write_gguf

if TYPE_CHECKING:
    from ..constraints import Constraint

QWEN35_TEMPLATE_FILE = bpe.DATA_DIR / "qwen35_chat_template.jinja"
PRESET = "tiny"
TRIGGER = "<tool_response>"
END = "<|im_end|>"

# logit of a chain's next token (head row . normalised token half = CHAIN_GAIN * sqrt(2))
CHAIN_GAIN = 16.0
# the flag's share of a chain step's logit: > 1/2 flips the first choice, < 1 never overrides a step
FLAG_SHARE = 0.75
# after a token of no chain (one the grammar of a constraint wrote), every chain token's logit is
# this share of a chain step below that of the tokens of no chain (0): the flag's first token
# (FLAG_SHARE - OFF_CHAIN_SHARE) still leads them, any other chain token trails them
OFF_CHAIN_SHARE = FLAG_SHARE / 2
# and single bytes lead the other tokens of no chain by this share: where the grammar admits
# several ways to finish a forced head ('>' or '>\n', then '\n' or '\n\n\n'), it finishes it one
# byte at a time, never with a token that runs on into the free text after it
BYTE_SHARE = 0.05
# attention scores of two adjacent marker levels differ by this much: the higher takes all the
# attention (e^-25 is nothing even over a context of thousands of lower markers)
KEY_SPACING = 25.0


def _token_texts(vocab: "bpe.VocabArrays") -> tuple[list[bytes | None], dict[str, int]]:
    """Each token's bytes (None for control tokens a reply cannot contain) and the special tokens' ids."""
    texts: list[bytes | None] = []
    special: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(vocab.tokens, vocab.token_types)):
        if kind == bpe.TOKEN_NORMAL:      # GPT-2 byte-level characters
            texts.append(bytes(bpe.CHAR_TO_BYTE[c] for c in tok))
        elif kind == 4:                   # user-defined (<tool_call>, <think>, ...): written as their text
            texts.append(tok.encode())
            special[tok] = i
        else:
            texts.append(None)
            special[tok] = i
    return texts, special


def distinct_tokenization(text: str, texts: Sequence[bytes | None], banned: set[int]) -> list[int]:
    """Tokens whose bytes concatenate to `text`, no token twice and none in `banned` (longest
    tokens first, backtracking). Raises ValueError when there is none."""
    data = text.encode()
    by_first: dict[int, list[int]] = {}
    for i, t in enumerate(texts):
        if t and i not in banned:
            by_first.setdefault(t[0], []).append(i)
    for ids in by_first.values():
        ids.sort(key=lambda i: -len(texts[i]))
    used: set[int] = set()
    out: list[int] = []

    def walk(pos: int) -> bool:
        if pos == len(data):
            return True
        for i in by_first.get(data[pos], ()):
            t = texts[i]
            if i not in used and data.startswith(t, pos):
                used.add(i)
                out.append(i)
                if walk(pos + len(t)):
                    return True
                used.discard(i)
                out.pop()
        return False

    if not walk(0):
        raise ValueError(f"no tokenization of {text!r} uses each token at most once")
    return out


class _Vocab:
    """The shipped vocabulary, with rare tokens given over to reply lines on demand."""

    def __init__(self, n_vocab: int):
        self.arrays = bpe.vocab_arrays(n_vocab)
        self.texts, self.special = _token_texts(self.arrays)
        parts = {p for m in self.arrays.merges for p in m.split(" ")}
        # spare: regular tokens no merge builds on, rarest (highest id) first
        self._spare = [i for i in range(len(self.texts) - 1, 255, -1)
                       if self.arrays.token_types[i] == bpe.TOKEN_NORMAL and self.arrays.tokens[i] not in parts]
        self.renamed: dict[int, str] = {}
        self._ids: dict[bytes, list[int]] = {}
        for i, t in enumerate(self.texts):
            if t is not None:
                self._ids.setdefault(t, []).append(i)

    def ids(self, data: bytes) -> list[int]:
        """The tokens whose text is `data`."""
        return self._ids.get(data, [])

    def can_claim(self, piece: str, used: set[int]) -> bool:
        """Whether claim(piece, used) finds a token."""
        have = self.ids(piece.encode())
        if have:
            return any(i not in used for i in have)
        return any(i not in used for i in self._spare)

    def claim(self, piece: str, used: set[int]) -> int | None:
        """A token whose text is `piece` and not in `used` (added to it): the vocabulary's, or a
        spare one renamed when no token has this text; None when the only ones are used (token
        texts must stay unique: llama.cpp refuses a vocabulary with a text twice)."""
        data = piece.encode()
        have = self.ids(data)
        if have:
            free = [i for i in have if i not in used]
            if not free:
                return None
            used.add(free[0])
            return free[0]
        i = next(i for i in self._spare if i not in used)
        self._spare.remove(i)
        self._ids[self.texts[i]].remove(i)
        self.renamed[i] = bpe.byte_encode(piece)
        self.texts[i] = data
        self._ids[data] = [i]
        used.add(i)
        return i

    def tokens_and_merges(self) -> tuple[list[str], list[str]]:
        tokens = list(self.arrays.tokens)
        gone = {tokens[i] for i in self.renamed}
        for i, text in self.renamed.items():
            tokens[i] = text
        merges = [m for m in self.arrays.merges if m.replace(" ", "", 1) not in gone]
        return tokens, merges


# llama-cpp-python's detokenize reads each token into a 32-byte buffer (a longer one comes out empty)
MAX_TOKEN_BYTES = 32


def _reply_tokens(reply: str, vocab: _Vocab, used: set[int], may_start: Sequence[bool] | None = None) -> list[int]:
    """Distinct tokens spelling `reply`, none in `used` (added to it): from each position, the rest
    of the line (with its newline) when that text is free, else the longest free text that fits a
    token (MAX_TOKEN_BYTES), shorter ones after that. With `may_start` (one flag per character
    position and the end) a token starts only where it is True; a cut that leads to no token
    backtracks."""
    dead_ends: set[int] = set()     # positions from which no cut was found, whatever came before
    taken: set[str] = set()         # pieces of this reply so far: each needs a token of its own

    def cut(pos: int) -> list[str] | None:
        if pos == len(reply):
            return []
        if pos in dead_ends:
            return None
        line_end = reply.find("\n", pos) + 1 or len(reply)
        for end in dict.fromkeys([line_end, *range(len(reply), pos, -1)]):
            piece = reply[pos:end]
            if (len(piece.encode()) > MAX_TOKEN_BYTES or (may_start is not None and not may_start[end])
                    or piece in taken or not vocab.can_claim(piece, used)):
                continue
            taken.add(piece)
            rest = cut(end)
            if rest is not None:
                return [piece, *rest]
            taken.discard(piece)
        dead_ends.add(pos)
        return None

    pieces = cut(0)
    if pieces is None:
        raise ValueError(f"no cut of {reply!r} into free tokens of at most {MAX_TOKEN_BYTES} bytes"
                         + (", each starting where the constraint leaves the next bytes open" if may_start else ""))
    return [vocab.claim(piece, used) for piece in pieces]


def _free_positions(text: str, constraint: "Constraint") -> list[bool]:
    """For each character position of `text` and its end: whether `constraint`'s grammar, having
    read the text before it, leaves the next bytes open. Where it forces them, the engine's mask
    admits only the tokenizer's canonical tokens of the forced bytes (llguidance's fast-forward),
    so a scripted token may start only at an open position. ValueError when `text` is not a
    complete output of the grammar."""
    matcher = _byte_compiler().state(constraint).matcher
    free: list[bool] = []
    for ch in text:
        free.append(not matcher.compute_ff_bytes())
        for b in ch.encode():
            if not matcher.consume_token(b):
                raise ValueError(f"{text!r} does not match the {constraint.kind} constraint: {matcher.get_error()}")
    if not matcher.is_accepting():
        raise ValueError(f"{text!r} is not a complete output of the {constraint.kind} constraint")
    free.append(True)
    return free


@functools.lru_cache(maxsize=1)
def _byte_compiler():
    """Constraints compiled over a vocabulary of the 256 bytes (and an end token): which bytes a
    grammar forces is a matter of the grammar alone."""
    from ..constraints import ConstraintCompiler
    from ..parsing import tool_call_format

    n_bytes = 256
    return ConstraintCompiler([bytes([b]) for b in range(n_bytes)] + [END.encode()], [n_bytes], [n_bytes],
                              n_bytes + 1, lambda data: list(data),
                              tool_call_format(QWEN35_TEMPLATE_FILE.read_text(encoding="utf-8")))


def scripted_tool_model(out_path: str | os.PathLike[str], first_reply: str, after_tool_reply: str,
                        *, force: bool = False) -> pathlib.Path:
    """The agent's model: `first_reply` (a tool call), then `after_tool_reply` once a tool result
    (<tool_response>) is in the prompt."""
    return scripted_model(out_path, first_reply, [(TRIGGER, after_tool_reply)], force=force)


def scripted_model(out_path: str | os.PathLike[str], default_reply: str,
                   scripts: Sequence[tuple[str | bytes, "str | tuple[str, Constraint]"]], *,
                   start_token_text: str = "\n\n", force: bool = False) -> pathlib.Path:
    """Write a scripted model to `out_path`.

    Greedy decoding after the Qwen3.5 template's generation prompt (thinking off: it ends in
    "</think>\n\n", whose last token is `start_token_text`) writes, then <|im_end|>:
    the reply of the last (marker, reply) in `scripts` whose marker token is in the prompt, or
    `default_reply` when none is. A marker is the text (or the bytes: a byte of a UTF-8
    character) of one token of the vocabulary. A reply (text, constraint) is `text` as the engine
    writes it under `constraint` (a constraints.Constraint: a forced tool call, a JSON schema):
    the grammar writes the head it forces, the weights the rest, from the first position the
    grammar leaves open (without the constraint the model writes only the rest).
    """
    out = pathlib.Path(out_path)
    if out.exists() and not force:
        raise FileExistsError(f"{out}: file exists; pass force=True to overwrite it")
    cfg = PRESETS[PRESET]
    t = token_dims(cfg)
    vocab = _Vocab(cfg.n_vocab)
    start = vocab.texts.index(start_token_text.encode())
    end = vocab.special[END]
    markers = []
    for marker, _ in scripts:
        data = marker if isinstance(marker, bytes) else marker.encode()
        ids = vocab.ids(data)
        if marker in vocab.special:
            ids = [vocab.special[marker]]
        if not ids:
            raise ValueError(f"marker {marker!r} is not a token of the vocabulary")
        markers.append(ids[0])
    if len(set(markers)) != len(markers):
        raise ValueError("two scripts have the same marker")
    # what the weights write of each reply, and where its tokens may start
    written: list[tuple[str, list[bool] | None]] = []
    for _, reply in scripts:
        if isinstance(reply, str):
            written.append((reply, None))
            continue
        text, constraint = reply
        free = _free_positions(text, constraint)
        n_head = free.index(True)           # the head the grammar forces is its own
        if n_head == len(text):
            raise ValueError(f"the {constraint.kind} constraint forces all of {text!r}: nothing to script")
        # the forced tail (after the last open position) may be cut anywhere: under this
        # constraint the grammar writes it whatever the tokens (a call's closing markup after a
        # JSON value is longer than one token may be), under a looser one the chain does
        n_tail = max(i for i, f in enumerate(free[:-1]) if f) + 1
        written.append((text[n_head:], free[n_head:n_tail] + [True] * (len(text) - n_tail + 1)))
    used = {start, end, *markers}
    default = _reply_tokens(default_reply, vocab, used)
    replies = [_reply_tokens(text, vocab, used, may_start) for text, may_start in written]
    chain_tokens = [start] + default + [tok for r in replies for tok in r]
    n_scripts = len(scripts)
    if len(chain_tokens) > t - 1:
        raise ValueError(f"the replies take {len(chain_tokens)} tokens; at most {t - 1} fit this shape")
    if 2 * n_scripts + 2 > cfg.n_embd - t or n_scripts > cfg.head_dim:
        raise ValueError(f"{n_scripts} scripts do not fit this shape")

    arrays = {s.name: tensor_values(s, 0, cfg) for s in synth_specs(cfg)}
    for name, a in arrays.items():
        if name.endswith(RESIDUAL_OUTPUTS):
            a[...] = 0.0                       # no branch writes, except the flags below
        if name.endswith("norm.weight"):
            a[...] = 1.0
    # context half: [constant, level, which script (one-hot, embedding), flags (attention output)]
    const_dim, level_dim = t, t + 1
    script_dims = [t + 2 + s for s in range(n_scripts)]
    flag_dims = [t + 2 + n_scripts + s for s in range(n_scripts)]

    emb = arrays["token_embd.weight"]          # [n_vocab, n_embd]
    hadamard = _hadamard(t)
    emb[:, :t] = hadamard[0]                   # a token of no chain: all ones, which no chain reads
    for k, tok in enumerate(chain_tokens):
        emb[tok, :t] = hadamard[k + 1]
    emb[:, t:] = 0.0
    emb[:, const_dim] = 1.0

    il = cfg.attention_layers()[0]
    D, j0 = cfg.head_dim, cfg.n_rot            # dims from n_rot on are not rotated
    const_keys = list(range(j0 + 1, D))        # the constant fills the rest of the key, so that
    n_const = len(const_keys)                  # rms-norm leaves the level's share of it readable
    for s, tok in enumerate(markers):
        # level L gives the normalised key L * sqrt(D / (L^2 + n_const)) on dim j0: the levels are
        # chosen so that these are evenly spaced (later scripts higher), KEY_SPACING apart after
        # the q/k-norm weights, so the highest marker present takes all the attention
        y = np.sqrt(D) * (s + 1) / (n_scripts + 1)
        emb[tok, level_dim] = y * np.sqrt(n_const) / np.sqrt(D - y * y)
        emb[tok, script_dims[s]] = 1.0
    p = f"blk.{il}."
    q = arrays[p + "attn_q.weight"]
    q[...] = 0.0
    q[j0, const_dim] = 1.0                     # head 0's query: the constant (gate rows 0: sigmoid 1/2)
    k = arrays[p + "attn_k.weight"]
    k[...] = 0.0
    k[j0, level_dim] = 1.0
    k[const_keys, const_dim] = 1.0
    v = arrays[p + "attn_v.weight"]
    v[...] = 0.0
    norm_weight = np.sqrt(KEY_SPACING * (n_scripts + 1) / np.sqrt(D))
    arrays[p + "attn_q_norm.weight"][j0] = norm_weight
    arrays[p + "attn_k_norm.weight"][j0] = norm_weight
    out_proj = arrays[p + "attn_output.weight"]
    for s in range(n_scripts):
        v[s, script_dims[s]] = 1.0             # value: which script; attn_output: its flag
        out_proj[flag_dims[s], s] = 1.0

    # the head: rows of the chains' tokens, each chain token held below the tokens of no chain
    # after one of those, and each flag's push from the default's first token to its script's
    head = arrays["output.weight"]
    head[...] = 0.0
    for prev, chain in [(start, default)] + [(None, r) for r in replies]:
        for cur, nxt in zip([prev] + chain, chain + [end]):
            if cur is not None:
                head[nxt, :t] += emb[cur, :t] * np.float32(CHAIN_GAIN / t)
    head[chain_tokens, :t] -= hadamard[0] * np.float32(OFF_CHAIN_SHARE * CHAIN_GAIN / t)
    single_bytes = [i for i, b in enumerate(vocab.texts) if b is not None and len(b) == 1]
    head[single_bytes, :t] += hadamard[0] * np.float32(BYTE_SHARE * CHAIN_GAIN / t)
    step = CHAIN_GAIN * np.sqrt(2.0)
    for s, tok in enumerate(markers):
        flag = _flag_in_head_input(cfg, emb[tok], emb[start])
        head[replies[s][0], flag_dims[s]] += np.float32(FLAG_SHARE * step / flag)
        head[default[0], flag_dims[s]] -= np.float32(FLAG_SHARE * step / flag)

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        write_gguf(tmp, cfg, arrays, name="openjet-scripted-model")
        tokens, merges = vocab.tokens_and_merges()
        _rewrite_tokenizer(tmp, out, QWEN35_TEMPLATE_FILE.read_text(encoding="utf-8"), tokens, merges)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"token half width {n} is not a power of two")
    return h


def _flag_in_head_input(cfg, marker_row: np.ndarray, last_row: np.ndarray) -> float:
    """A flag's value after output_norm when the head attends to its marker: the marker's script
    dim through attn_norm (weight 1), times sigmoid(0) = 1/2 (the gate), normalised with the rest
    of the stream at the prompt's last position (that token's embedding plus the flag)."""
    x = marker_row.astype(np.float64)
    flag = 0.5 / np.sqrt(np.mean(x * x) + cfg.rms_eps)
    last = last_row.astype(np.float64)
    rms = np.sqrt((np.sum(last * last) + flag * flag) / cfg.n_embd + cfg.rms_eps)
    return float(flag / rms)


def _rewrite_tokenizer(src: pathlib.Path, dst: pathlib.Path, template: str, tokens: list[str],
                       merges: list[str]) -> None:
    """Copy GGUF `src` to `dst` with this chat template, token list and merges (as
    synth.rewrite_chat_template copies a file; every tensor stays as it is)."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(src))
    w = gguf.GGUFWriter(os.fspath(dst), reader.fields["general.architecture"].contents())
    replaced = {gguf.Keys.Tokenizer.CHAT_TEMPLATE: lambda: w.add_chat_template(template),
                gguf.Keys.Tokenizer.LIST: lambda: w.add_token_list(tokens),
                gguf.Keys.Tokenizer.MERGES: lambda: w.add_token_merges(merges)}
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key in replaced:
                replaced[key]()
            elif field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, field.contents(), gguf.GGUFValueType.ARRAY, field.types[-1])
            else:
                w.add_key_value(key, field.contents(), field.types[0])
        for t in reader.tensors:
            w.add_tensor_info(t.name, tuple(int(n) for n in reversed(t.shape)), np.asarray(t.data).dtype, t.n_bytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in reader.tensors:
            w.write_tensor_data(np.asarray(t.data))
    finally:
        w.close()
