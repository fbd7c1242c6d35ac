"""A small byte-level BPE trainer, and the vocabulary it produced, for the generated test models.

No real Qwen tokenizer can be downloaded here, so the generated GGUFs carry a tokenizer of the
same kind: GPT-2 byte<->unicode mapping, the `qwen35` pre-tokenizer of llama.cpp, merges learned
from text that ships with every Python (the standard library's source, its docstrings and the
prose of `pydoc_data`). Training is deterministic for a given Python installation; its result is
shipped in `openjet_plugin/data/bpe_vocab.json` so that generating a model never retrains.
Regenerate with `python scripts/train_bpe.py` (or `python -m openjet_plugin.testing.bpe`).
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import json
import pathlib
import sys
import sysconfig
from dataclasses import dataclass
from typing import Iterable, Iterator

import regex

from ..tokenizer import bytes_to_unicode   # the runtime's map, one copy

DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "data"
VOCAB_FILE = DATA_DIR / "bpe_vocab.json"

# `tokenizer.ggml.pre` value: llama.cpp maps it to LLAMA_VOCAB_PRE_TYPE_QWEN35, whose split is
# exactly this expression from Qwen3.5's tokenizer.json (letter runs also take combining marks).
PRE_TOKENIZER = "qwen35"
QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The special tokens of Qwen3, in Qwen's order. As in Qwen3 GGUFs, the chat markers are CONTROL
# (rendered only when asked for) while the think/tool markers are USER_DEFINED: llama.cpp always
# parses them as single tokens and always detokenizes them as their text.
SPECIAL_TOKENS: tuple[tuple[str, int], ...] = (
    ("<|endoftext|>", TOKEN_CONTROL),
    ("<|im_start|>", TOKEN_CONTROL),
    ("<|im_end|>", TOKEN_CONTROL),
    ("<tool_call>", TOKEN_USER_DEFINED),
    ("</tool_call>", TOKEN_USER_DEFINED),
    ("<tool_response>", TOKEN_USER_DEFINED),
    ("</tool_response>", TOKEN_USER_DEFINED),
    ("<think>", TOKEN_USER_DEFINED),
    ("</think>", TOKEN_USER_DEFINED),
)
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|endoftext|>"   # Qwen's bos/padding; add_bos is false
VOCAB_SIZE = 4096              # regular + special tokens of the tiny/small presets


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def byte_encode(text: str) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


# --- corpus ---------------------------------------------------------------------------------

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus_files() -> list[pathlib.Path]:
    """The standard library's .py files (tests and third-party packages excluded), sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if not (_SKIP_DIRS & set(f.relative_to(root).parts))]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def read_corpus(files: Iterable[pathlib.Path]) -> Iterator[str]:
    for f in files:
        yield f.read_text(encoding="utf-8", errors="replace")


# --- trainer ----------------------------------------------------------------------------------

def count_words(texts: Iterable[str]) -> collections.Counter[str]:
    """Pre-tokenize with the qwen35 expression and count the byte-encoded pieces."""
    pattern = regex.compile(QWEN35_PATTERN)
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        counts.update(byte_encode(piece) for piece in pattern.findall(text))
    return counts


@dataclass
class TrainedBPE:
    tokens: list[str]               # regular tokens: the 256 byte characters then merge results
    merges: list[tuple[str, str]]   # in rank order


def train(word_counts: collections.Counter[str], n_tokens: int) -> TrainedBPE:
    """Learn merges until there are `n_tokens` regular tokens.

    Each step merges the most frequent adjacent pair; ties go to the smallest pair in string
    order, so the result depends only on the counts. Pair counts are kept incrementally and the
    heap holds stale entries that are skipped when popped.
    """
    if n_tokens < 256:
        raise ValueError(f"n_tokens={n_tokens}: a byte-level vocabulary needs at least 256 tokens")
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    known = set(tokens)
    merges: list[tuple[str, str]] = []

    items = sorted(word_counts.items())
    words = [list(w) for w, _ in items]
    freqs = [c for _, c in items]
    pair_count: collections.Counter[tuple[str, str]] = collections.Counter()
    pair_words: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for i, (w, f) in enumerate(zip(words, freqs)):
        for p in zip(w, w[1:]):
            pair_count[p] += f
            pair_words[p].add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)

    while len(tokens) < n_tokens and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or -neg <= 0:
            continue   # stale entry
        a, b = pair
        merged = a + b
        merges.append(pair)
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        changed: set[tuple[str, str]] = set()
        for i in sorted(pair_words.pop(pair, ())):
            w, f = words[i], freqs[i]
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                changed.add(p)
            out: list[str] = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(merged)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pair_count[p] += f
                pair_words[p].add(i)
                changed.add(p)
        pair_count.pop(pair, None)
        for p in sorted(changed):
            c = pair_count.get(p, 0)
            if c > 0 and p != pair:
                heapq.heappush(heap, (-c, p))
            elif c <= 0:
                pair_count.pop(p, None)
    if len(tokens) < n_tokens:
        raise ValueError(f"corpus too small: only {len(tokens)} tokens learned, {n_tokens} wanted")
    return TrainedBPE(tokens=tokens, merges=merges)


def train_from_stdlib(vocab_size: int = VOCAB_SIZE) -> dict:
    """Train on the standard library and return the JSON document that is shipped."""
    files = stdlib_corpus_files()
    texts = list(read_corpus(files))
    digest = hashlib.sha256("\0".join(texts).encode("utf-8", errors="replace")).hexdigest()
    trained = train(count_words(texts), vocab_size - len(SPECIAL_TOKENS))
    return {
        "pre": PRE_TOKENIZER,
        "model": "gpt2",
        "source": {
            "python": sys.version.split()[0],
            "files": len(files),
            "chars": sum(len(t) for t in texts),
            "sha256": digest,
        },
        "tokens": trained.tokens,
        "merges": [f"{a} {b}" for a, b in trained.merges],
        "special_tokens": [{"text": t, "type": ty} for t, ty in SPECIAL_TOKENS],
    }


# --- the shipped vocabulary, as GGUF arrays ------------------------------------------------------

@dataclass(frozen=True)
class VocabArrays:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    bos_id: int


def load_shipped(path: pathlib.Path = VOCAB_FILE) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: shipped BPE vocabulary missing; run scripts/train_bpe.py") from None
    for key in ("pre", "tokens", "merges", "special_tokens"):
        if key not in doc:
            raise ValueError(f"{path}: key {key!r} missing from the BPE vocabulary file")
    return doc


def vocab_arrays(n_vocab: int, path: pathlib.Path = VOCAB_FILE) -> VocabArrays:
    """The `tokenizer.ggml.*` arrays for a model of `n_vocab` rows.

    Regular tokens come first, then the specials; a larger n_vocab (the 27B's 248,320) is filled
    with UNUSED `[PADn]` placeholders as llama.cpp's converter does for Qwen's padded rows, so they
    are never produced by the tokenizer and never matched as specials.
    """
    doc = load_shipped(path)
    tokens = list(doc["tokens"])
    types = [TOKEN_NORMAL] * len(tokens)
    for st in doc["special_tokens"]:
        tokens.append(st["text"])
        types.append(int(st["type"]))
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab={n_vocab} is smaller than the shipped vocabulary ({len(tokens)} tokens)")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(TOKEN_UNUSED)
    return VocabArrays(tokens=tokens, token_types=types, merges=list(doc["merges"]),
                       eos_id=tokens.index(EOS_TOKEN), bos_id=tokens.index(BOS_TOKEN))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Train the test models' BPE vocabulary on the Python stdlib.")
    ap.add_argument("--out", type=pathlib.Path, default=VOCAB_FILE)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    doc = train_from_stdlib(args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(doc['tokens'])} tokens, {len(doc['merges'])} merges, "
          f"{len(doc['special_tokens'])} special, from {doc['source']['files']} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
