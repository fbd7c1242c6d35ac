"""Byte-level BPE encode/decode from a GGUF's `tokenizer.ggml.*` arrays, token for token as llama.cpp.

What llama.cpp does, in order (src/llama-vocab.cpp), and what this module repeats:
1. special-token partition: CONTROL and USER_DEFINED token texts are cut out of the text, longest
   text first, leftmost occurrence first; CONTROL ones only when `parse_special` is true;
2. each remaining fragment is split by the pre-tokenizer (`tokenizer.ggml.pre`: qwen35 or qwen2,
   the hand-written splitters of llama.cpp's unicode.cpp, which equal the tokenizer.json regex);
3. each piece is byte-encoded (GPT-2 map) and merged pair by pair, lowest merge rank first,
   leftmost first on ties; a final symbol missing from the vocabulary falls back to byte tokens.

Character classes come from Python's `unicodedata`. llama.cpp ships its own (newer) table; the two
agree on every code point assigned in Python's Unicode version, so only characters newer than
that (e.g. Unicode 15 additions under Python 3.11) may be split differently.
"""

from __future__ import annotations

import heapq
import os
import unicodedata
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

from .errors import InvalidMetadataError, MissingKeyError, ModelFileError

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_PRE = ("qwen35", "qwen2")

# Unicode White_Space: what llama.cpp's splitter calls whitespace (not str.isspace, which adds 0x1C-0x1F).
_WHITESPACE = frozenset(
    list(range(0x09, 0x0E)) + list(range(0x2000, 0x200B))
    + [0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what llama.cpp's byte_encode uses).

    Printable Latin-1 bytes map to themselves; the rest are shifted to U+0100.. in byte order.
    The trainer (testing/bpe.py) takes it from here: the runtime never imports the trainer.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(keep)
    shift = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + shift)
            shift += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_ENCODE_TABLE = [_BYTE_TO_CHAR[b] for b in range(256)]

# character class bits
_L, _M, _N, _WS = 1, 2, 4, 8


@lru_cache(maxsize=65536)
def _char_class(ch: str) -> int:
    cat = unicodedata.category(ch)[0]
    bits = {"L": _L, "M": _M, "N": _N}.get(cat, 0)
    if ord(ch) in _WHITESPACE:
        bits |= _WS
    return bits


def split_words(text: str, marks_in_words: bool = True) -> list[str]:
    """Pre-tokenize one fragment as llama.cpp's qwen35 (marks_in_words) or qwen2 splitter does.

    qwen35: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}
            | ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+
    qwen2 is the same without \\p{M} in the letter run and in the punctuation class.
    """
    n = len(text)
    cls = [_char_class(c) for c in text]
    word = _L | _M if marks_in_words else _L
    out: list[str] = []
    pos = 0

    def at(i: int) -> int:   # class bits; -1 outside the fragment (llama.cpp's empty flags)
        return cls[i] if i < n else -1

    while pos < n:
        c = text[pos]
        f = cls[pos]
        start = pos
        # contractions, ASCII case-insensitive
        if c == "'" and pos + 1 < n:
            c1 = text[pos + 1].lower()
            if c1 in ("s", "t", "m", "d"):
                out.append(text[pos:pos + 2]); pos += 2; continue
            if pos + 2 < n and c1 + text[pos + 2].lower() in ("re", "ve", "ll"):
                out.append(text[pos:pos + 3]); pos += 3; continue
        # [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+
        if not (c in "\r\n" or f & _N):
            nxt = at(pos + 1)
            if f & word or (nxt > 0 and nxt & word):
                pos += 1
                while pos < n and cls[pos] & word:
                    pos += 1
                out.append(text[start:pos]); continue
        # \p{N}
        if f & _N:
            out.append(c); pos += 1; continue
        # <space>?[^\s\p{L}\p{M}\p{N}]+[\r\n]*
        other = _WS | _N | word
        f2 = at(pos + 1) if c == " " else f
        if f2 < 0 or not (f2 & other):
            # (a lone space at the fragment's end also lands here, as in llama.cpp, and stays alone)
            pos += c == " "
            while pos < n and not (cls[pos] & other):
                pos += 1
            while pos < n and text[pos] in "\r\n":
                pos += 1
            out.append(text[start:pos]); continue
        # whitespace runs
        k = pos
        last_nl = -1
        while k < n and cls[k] & _WS:
            if text[k] in "\r\n":
                last_nl = k + 1
            k += 1
        if last_nl > 0:                      # \s*[\r\n]+
            pos = last_nl
        elif k - pos > 1 and k < n:          # \s+(?!\S): leave the last space to the next word
            pos = k - 1
        elif k > pos:                        # \s+
            pos = k
        else:
            pos += 1
        out.append(text[start:pos])
    return out


def byte_encode(text: str) -> str:
    return "".join(_BYTE_ENCODE_TABLE[b] for b in text.encode("utf-8"))


class Tokenizer:
    """A GGUF's byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`)."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Iterable[str], *,
                 eos_id: int | None, bos_id: int | None = None, pre: str = "qwen35",
                 add_bos: bool = False, add_eos: bool = False, source: str = "<memory>"):
        if pre not in SUPPORTED_PRE:
            raise InvalidMetadataError(source, "tokenizer.ggml.pre", pre,
                                       f"pre-tokenizer not supported (supported: {', '.join(SUPPORTED_PRE)})")
        if len(tokens) != len(token_types):
            raise InvalidMetadataError(source, "tokenizer.ggml.token_type", len(token_types),
                                       f"has {len(token_types)} entries but tokenizer.ggml.tokens has {len(tokens)}")
        self.source = source
        self.pre = pre
        self.tokens = list(tokens)
        self.token_types = [int(t) for t in token_types]
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self._marks_in_words = pre == "qwen35"
        self._token_to_id: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self._token_to_id[t] = i           # a duplicate text keeps the last id, as llama.cpp does
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep:
                raise InvalidMetadataError(source, "tokenizer.ggml.merges", m, f"merge {rank} has no space")
            self._ranks.setdefault((a, b), rank)
        # specials searched in the text: CONTROL, USER_DEFINED (and UNKNOWN), longest text first
        self.special_tokens: dict[str, int] = {
            t: i for i, (t, ty) in enumerate(zip(self.tokens, self.token_types))
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
        }
        self._specials = sorted(
            ((t, i, self.token_types[i] != TOKEN_USER_DEFINED) for t, i in self.special_tokens.items()
             if t),
            key=lambda s: (-len(s[0].encode("utf-8")), s[1]))
        self._word_cache: dict[str, list[int]] = {}
        self._byte_token = [self._token_to_id.get(_BYTE_TO_CHAR[b]) for b in range(256)]
        self._pieces: list[bytes | None] = [None] * len(self.tokens)

    # --- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader_or_path) -> "Tokenizer":
        """Read the tokenizer of a GGUF: a path (its metadata is parsed directly, which takes well
        under a second even for a 248K-token vocabulary) or an open `gguf.GGUFReader`."""
        if isinstance(reader_or_path, (str, bytes, os.PathLike)):
            path = os.fspath(reader_or_path)
            path = path.decode() if isinstance(path, bytes) else path
            meta = read_gguf_metadata(path, prefix="tokenizer.")
        else:
            reader = reader_or_path
            path = str(getattr(reader, "path", "<GGUFReader>"))
            meta = {}
            for key, f in reader.fields.items():
                if key.startswith("tokenizer."):
                    meta[key] = _string_array(f) if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") \
                        else f.contents()
        return cls.from_metadata(meta, source=path)

    @classmethod
    def from_metadata(cls, meta: dict, source: str = "<memory>") -> "Tokenizer":
        """Build from `tokenizer.ggml.*` values (key -> value, arrays as lists)."""
        def get(key: str, default=_REQUIRED):
            if key in meta:
                return meta[key]
            if default is _REQUIRED:
                raise MissingKeyError(source, key)
            return default

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise InvalidMetadataError(source, "tokenizer.ggml.model", model,
                                       "only byte-level BPE vocabularies ('gpt2') are supported")
        # a model file is untrusted: every value must have the type its key promises, or the
        # error names the key (not a TypeError from deep inside the constructor)
        def typed_list(key: str, kind: type, what: str, default=_REQUIRED) -> list:
            v = get(key, default)
            if not isinstance(v, list) or not all(isinstance(x, kind) for x in v):
                raise InvalidMetadataError(source, key, v, f"expected {what}")
            return v

        tokens = list(typed_list("tokenizer.ggml.tokens", str, "an array of strings (the vocabulary)"))
        types = [int(x) for x in typed_list("tokenizer.ggml.token_type", int, "an array of integers",
                                            [TOKEN_NORMAL] * len(tokens))]
        merges = list(typed_list("tokenizer.ggml.merges", str, "an array of strings ('left right')"))

        def token_id(key: str) -> int | None:
            v = get(key, None)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidMetadataError(source, key, v, "expected an integer token id")
            if not 0 <= v < len(tokens):
                raise InvalidMetadataError(source, key, v, f"is not a token id (the vocabulary has {len(tokens)})")
            return v

        return cls(tokens, types, merges, eos_id=token_id("tokenizer.ggml.eos_token_id"),
                   bos_id=token_id("tokenizer.ggml.bos_token_id"), pre=str(get("tokenizer.ggml.pre", "default")),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
                   add_eos=bool(get("tokenizer.ggml.add_eos_token", False)), source=source)

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    # --- encoding --------------------------------------------------------------------------------
    def encode(self, text: str | bytes, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; the same ids as llama.cpp's llama_tokenize(text, add_special, parse_special)."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise ModelFileError(self.source, "add_bos_token is true but there is no bos token")
            out.append(self.bos_id)
        for piece in self._partition(text, parse_special):
            if isinstance(piece, int):
                out.append(piece)
            else:
                for word in split_words(piece, self._marks_in_words):
                    out.extend(self._encode_word(word))
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special-token texts out of `text`, as llama.cpp's tokenizer_st_partition does."""
        parts: list[str | int] = [text] if text else []
        for stext, sid, is_control in self._specials:
            if is_control and not parse_special:
                continue
            if not any(isinstance(p, str) and stext in p for p in parts):
                continue
            new: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or stext not in p:
                    new.append(p)
                    continue
                chunks = p.split(stext)
                for j, chunk in enumerate(chunks):
                    if j:
                        new.append(sid)
                    if chunk:
                        new.append(chunk)
            parts = new
        return parts

    def _encode_word(self, word: str) -> list[int]:
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        ids = self._bpe(byte_encode(word))
        if len(self._word_cache) < 200_000:
            self._word_cache[word] = ids
        return ids

    def _bpe(self, encoded: str) -> list[int]:
        # llama.cpp's llm_tokenizer_bpe_session: a queue of adjacent pairs ordered by (rank, left
        # index); a popped pair whose texts changed since it was queued is skipped.
        sym = list(encoded)
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))
        ranks = self._ranks
        queue: list[tuple[int, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            r = ranks.get((sym[left], sym[right]))
            if r is not None:
                heapq.heappush(queue, (r, left, right, sym[left] + sym[right]))

        for i in range(len(sym) - 1):
            push(i, i + 1)
        while queue:
            _, left, right, text = heapq.heappop(queue)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != text:
                continue
            sym[left] = text
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        out: list[int] = []
        for s in sym:
            if not s:
                continue
            tid = self._token_to_id.get(s)
            if tid is not None:
                out.append(tid)
            else:
                for ch in s:   # byte fallback (a symbol the merges made but the vocabulary lacks)
                    bt = self._byte_token[_CHAR_TO_BYTE[ch]]
                    if bt is not None:
                        out.append(bt)
        return out

    # --- decoding --------------------------------------------------------------------------------
    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token, as llama.cpp's llama_token_to_piece(token, special).

        CONTROL tokens are empty unless `special`; USER_DEFINED tokens are always their text;
        UNUSED placeholders are empty.
        """
        if not 0 <= token < len(self.tokens):
            raise ValueError(f"token id {token} is outside the vocabulary of {len(self.tokens)} tokens")
        ty = self.token_types[token]
        if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return self.tokens[token].encode("utf-8") if special else b""
        if ty == TOKEN_USER_DEFINED:
            return self.tokens[token].encode("utf-8")
        piece = self._pieces[token]
        if piece is None:
            if ty == TOKEN_NORMAL:
                piece = bytes(_CHAR_TO_BYTE[c] if c in _CHAR_TO_BYTE else 0x3F for c in self.tokens[token])
            else:
                piece = b""
            self._pieces[token] = piece
        return piece

    def decode_bytes(self, tokens: Iterable[int], special: bool = False) -> bytes:
        return b"".join(self.token_to_piece(int(t), special) for t in tokens)

    def decode(self, tokens: Iterable[int], special: bool = False) -> str:
        """Text of `tokens`; bytes that are not valid UTF-8 (a cut multi-byte character) become U+FFFD."""
        return self.decode_bytes(tokens, special).decode("utf-8", errors="replace")


def _string_array(field) -> list[str]:
    # GGUFReader keeps each string of an array as its own part; data lists their indices.
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


_REQUIRED = object()

# GGUF metadata value types: code -> struct format (None: string / array)
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
               11: "<i8", 12: "<f8"}


def read_gguf_metadata(path: str | os.PathLike[str], prefix: str = "") -> dict[str, object]:
    """The key/value section of a GGUF (v2/v3, little-endian), keys starting with `prefix`.

    gguf.GGUFReader builds a numpy view per string, which takes ~25 s for a 248K-token vocabulary;
    this walks the same bytes with struct in well under a second. Arrays become lists.
    """
    import mmap
    import struct

    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise ModelFileError(path, f"cannot open the file: {exc.strerror or exc}") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:   # mmap refuses an empty file with a bare ValueError
            from .errors import NotGGUFError
            raise NotGGUFError(path, "the file is empty (0 bytes), not a GGUF model")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with buf:
        def need(off: int, n: int, what: str) -> None:
            if off + n > len(buf):
                from .errors import TruncatedFileError
                raise TruncatedFileError(path, what, off + n, len(buf))

        need(0, 24, "the header")
        if buf[:4] != b"GGUF":
            from .errors import NotGGUFError
            raise NotGGUFError(path, "not a GGUF file (the first 4 bytes are not 'GGUF')")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelFileError(path, f"GGUF version {version} is not supported (2 or 3 expected)")
        off = 24
        out: dict[str, object] = {}

        def read_str(what: str) -> str:
            nonlocal off
            need(off, 8, what)
            (n,) = struct.unpack_from("<Q", buf, off)
            need(off + 8, n, what)
            s = bytes(buf[off + 8:off + 8 + n]).decode("utf-8", errors="replace")
            off += 8 + n
            return s

        def read_value(vtype: int, key: str, keep: bool, depth: int = 0):
            nonlocal off
            what = f"metadata key {key!r}"
            if depth > 2:   # as model_file's walk: no real key nests deeper; recursion must not run out
                raise ModelFileError(path, f"{what}: arrays nested too deeply")
            if vtype in _GGUF_SCALAR:
                fmt = _GGUF_SCALAR[vtype]
                size = struct.calcsize(fmt)
                need(off, size, what)
                (v,) = struct.unpack_from(fmt, buf, off)
                off += size
                return v
            if vtype == 8:
                return read_str(what)
            if vtype == 9:
                need(off, 12, what)
                etype, n = struct.unpack_from("<IQ", buf, off)
                off += 12
                if etype in _GGUF_NUMPY:
                    dt = np.dtype(_GGUF_NUMPY[etype])
                    need(off, n * dt.itemsize, what)
                    arr = np.frombuffer(buf, dtype=dt, count=n, offset=off).tolist() if keep else None
                    off += n * dt.itemsize
                    return arr
                if etype == 8:
                    items = []
                    for _ in range(n):
                        need(off, 8, what)
                        (ln,) = struct.unpack_from("<Q", buf, off)
                        need(off + 8, ln, what)
                        if keep:
                            items.append(bytes(buf[off + 8:off + 8 + ln]).decode("utf-8", errors="replace"))
                        off += 8 + ln
                    return items
                return [read_value(etype, key, keep, depth + 1) for _ in range(n)]
            raise ModelFileError(path, f"metadata key {key!r} has unknown value type {vtype}")

        for _ in range(n_kv):
            key = read_str("a metadata key name")
            need(off, 4, f"metadata key {key!r}")
            (vtype,) = struct.unpack_from("<I", buf, off)
            off += 4
            keep = key.startswith(prefix)
            value = read_value(vtype, key, keep)
            if keep:
                out[key] = value
        return out
