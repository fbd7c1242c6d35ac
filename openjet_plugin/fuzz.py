"""Fuzz the load-and-validate path with mutated GGUF files: `python -m openjet_plugin.fuzz`.

A model file is untrusted input. This command takes real generated qwen35 GGUFs (made with
testing/synth.py), mutates them where a loader is most easily fooled — the header counts, the
metadata section (string lengths, value types, array counts), the tensor descriptions (dimension
counts, shapes, type ids, data offsets) and the data — and feeds each result to everything that
reads a model file before a backend sees it:

  model_file.open_model (+ metadata, chat template, tokenizer fields), model_file.validate,
  model_file.describe, tokenizer.Tokenizer.from_gguf, and for files the loader accepts, the
  tokenizer's encode/decode and the chat template's rendering.

The contract: the only exceptions that escape are the documented ones (ModelFileError and its
subclasses, FileNotFoundError; ChatTemplateError from rendering a template). Anything else, a
case that runs past its time limit, a MemoryError under the worker's address-space limit, or a
worker that dies (a native crash) is a finding: it is minimised (the smallest file that fails the
same way) and saved into the corpus directory, which tests/test_fuzz_regression.py replays.

Each case runs in a separate worker process (restarted after a hang or crash) with a per-case
time limit and an address-space limit, so one bad input can neither stall nor exhaust the run.
Mutations are drawn from a seeded generator: `--seed` makes a run reproducible.

    python -m openjet_plugin.fuzz --seconds 600 --corpus tests/fuzz_corpus
    python -m openjet_plugin.fuzz --replay tests/fuzz_corpus     # check every corpus file
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import random
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

CASE_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 120.0            # a worker's imports (numpy, gguf, jinja2) on a busy machine
MEMORY_LIMIT_BYTES = 3 << 30          # address space of a worker: a loader needing more is a finding
CORPUS_SUFFIXES = (".gguf", ".gguf.gz")
SMALL_FILE = 64 << 10                 # corpus files above this are stored gzip-compressed


# --- what one case runs (inside the worker) -----------------------------------------------------

def _documented_errors():
    from .chat_template import ChatTemplateError
    from .errors import ModelFileError

    return (ModelFileError, FileNotFoundError), (ModelFileError, FileNotFoundError, ChatTemplateError)


def run_targets(path: str) -> tuple[str, str, str]:
    """Run every loader entry point on `path`. Returns ("ok" | "bad", signature, detail):
    "bad" when an undocumented exception escaped one of them."""
    import warnings

    from . import chat_template
    from .model_file import describe, open_model, validate
    from .tokenizer import Tokenizer

    loader_errors, render_errors = _documented_errors()
    outcomes = []

    def attempt(name, fn, allowed):
        try:
            fn()
            outcomes.append(f"{name}:ok")
            return True
        except allowed as exc:
            outcomes.append(f"{name}:{type(exc).__name__}")
            return False
        except BaseException as exc:  # noqa: BLE001 - this is what the fuzzer looks for
            raise _Finding(name, exc) from exc

    state = {}

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mf = open_model(path)
        try:
            _ = mf.metadata, mf.chat_template, mf.tokenizer_fields, mf.tensor_type_counts()
            state["template"] = mf.chat_template
        finally:
            mf.close()

    def report():
        r = validate(path)
        _ = r.ok, [str(e) for e in r.errors], r.warnings

    def tokenizer():
        state["tok"] = Tokenizer.from_gguf(path)

    try:
        accepted = attempt("open_model", load, loader_errors)
        attempt("validate", report, loader_errors)
        attempt("describe", lambda: describe(path), loader_errors)
        have_tok = attempt("Tokenizer.from_gguf", tokenizer, loader_errors)
        if accepted and have_tok:
            tok = state["tok"]

            def roundtrip():
                ids = tok.encode("Hello, world! <|im_start|>user\nx = 1\t# é 中文<|im_end|>")
                tok.decode(ids)
                tok.decode(list(range(min(tok.n_vocab, 300))), special=True)

            attempt("Tokenizer.encode", roundtrip, loader_errors)
        if accepted and state.get("template"):
            attempt("chat_template.render", lambda: chat_template.render(
                state["template"], [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]),
                render_errors)
    except _Finding as f:
        return "bad", f.signature, f.detail
    return "ok", " ".join(outcomes), ""


class _Finding(Exception):
    def __init__(self, target: str, exc: BaseException):
        self.target = target
        tb = traceback.extract_tb(exc.__traceback__)
        # the deepest frame inside this package says where it went wrong
        ours = [fr for fr in tb if "openjet_plugin" in fr.filename and not fr.filename.endswith("fuzz.py")]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
        self.signature = f"{target}|{type(exc).__name__}|{where}"
        self.detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
        super().__init__(self.signature)


def _worker_main(conn) -> None:
    """Worker process: read paths from `conn`, answer with run_targets' outcome."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):  # pragma: no cover - non-POSIX
        pass
    import warnings
    warnings.simplefilter("ignore")
    from . import chat_template, model_file, tokenizer  # noqa: F401 - imported before the clock runs
    conn.send("ready")
    while True:
        try:
            path = conn.recv()
        except EOFError:
            return
        if path is None:
            return
        conn.send(run_targets(path))


# --- running cases with a time limit --------------------------------------------------------------

@dataclass
class Outcome:
    status: str          # "ok" | "bad" | "hang" | "crash"
    signature: str
    detail: str = ""

    @property
    def finding(self) -> bool:
        return self.status != "ok"


class Runner:
    """A worker process that runs cases one at a time; restarted after a hang or a crash."""

    def __init__(self, timeout: float = CASE_TIMEOUT_S):
        import multiprocessing as mp

        self.timeout = timeout
        self._ctx = mp.get_context("spawn")   # a clean interpreter: no inherited threads or locks
        self._proc = None
        self._conn = None
        self.restarts = 0

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        # imports are not part of any case's time
        try:
            ready = parent.poll(STARTUP_TIMEOUT_S) and parent.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._kill()
            raise RuntimeError("the fuzz worker process did not start (run the fuzzer from a "
                               "script guarded by `if __name__ == '__main__':`)")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.pid is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None
        self.restarts += 1

    def run(self, path: str | os.PathLike[str], timeout: float | None = None) -> Outcome:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        limit = self.timeout if timeout is None else timeout
        self._conn.send(os.fspath(path))
        if self._conn.poll(limit):
            try:
                status, sig, detail = self._conn.recv()
                return Outcome(status, sig, detail)
            except (EOFError, OSError):
                self._proc.join(5)        # the pipe closed: the worker is dying, let it finish
        if self._proc.is_alive():
            self._kill()
            return Outcome("hang", f"hang>{limit:g}s")
        self._proc.join(5)
        code = self._proc.exitcode
        self._kill()
        return Outcome("crash", f"crash|exit {code}")

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass
        if self._proc is not None and self._proc.pid is not None:
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
        self._proc = self._conn = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- where a GGUF's fields are (for structure-aware mutation) ---------------------------------------

@dataclass
class Layout:
    """Offsets of the fields a mutation targets, found by walking a valid seed file."""

    size: int
    u32_fields: list[int] = field(default_factory=list)   # version, value/element types, n_dims, ggml types
    u64_fields: list[int] = field(default_factory=list)   # counts, string lengths, ne, offsets
    kv_start: int = 24
    tensor_info_start: int = 0
    data_start: int = 0
    kv_entries: list[tuple[int, int]] = field(default_factory=list)   # (start, end) per metadata entry
    tensor_entries: list[tuple[int, int]] = field(default_factory=list)
    string_values: list[tuple[int, int]] = field(default_factory=list)  # (length field offset, length)


def parse_layout(data: bytes) -> Layout:
    lay = Layout(size=len(data))
    lay.u32_fields.append(4)
    lay.u64_fields += [8, 16]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24
    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(pos):
        n = struct.unpack_from("<Q", data, pos)[0]
        return pos + 8 + n, n

    def value(pos, vtype, record):
        if vtype in scalar:
            return pos + scalar[vtype]
        if vtype == 8:
            end, n = string(pos)
            if record:
                lay.u64_fields.append(pos)
                lay.string_values.append((pos, n))
            return end
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, pos)
            if record:
                lay.u32_fields.append(pos)
                lay.u64_fields.append(pos + 4)
            pos += 12
            if etype in scalar:
                return pos + count * scalar[etype]
            for i in range(count):
                # record only the first few string lengths of a long array
                pos = value(pos, etype, record and i < 4)
            return pos
        raise ValueError(f"seed has unknown value type {vtype}")

    for _ in range(n_kv):
        start = pos
        lay.u64_fields.append(pos)
        pos, _n = string(pos)
        vtype = struct.unpack_from("<I", data, pos)[0]
        lay.u32_fields.append(pos)
        pos = value(pos + 4, vtype, True)
        lay.kv_entries.append((start, pos))
    lay.tensor_info_start = pos
    alignment = 32
    for _ in range(n_tensors):
        start = pos
        lay.u64_fields.append(pos)
        pos, _n = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        lay.u32_fields.append(pos)
        pos += 4
        for _d in range(n_dims):
            lay.u64_fields.append(pos)
            pos += 8
        lay.u32_fields.append(pos)          # ggml type
        lay.u64_fields.append(pos + 4)      # data offset
        pos += 12
        lay.tensor_entries.append((start, pos))
    lay.data_start = -(-pos // alignment) * alignment
    return lay


# --- mutations ------------------------------------------------------------------------------------

_INTERESTING_U64 = (0, 1, 2, 3, 4, 7, 8, 31, 32, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31,
                    2**32 - 1, 2**32, 2**32 + 1, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1)
_INTERESTING_U32 = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 24, 30, 31, 39, 40,
                    255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1)


class Mutator:
    """Seeded, structure-aware byte mutations of one seed file."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def mutate(self, seed: bytes, lay: Layout) -> tuple[bytes, list[str]]:
        data = bytearray(seed)
        ops = []
        if self.rng.random() < 0.3:
            # type confusion: a metadata value re-encoded, well-formed, as another type; the file
            # stays walkable, so the readers past the structural checks see the wrong type
            op, data = self.retype_entry(data, lay)
            ops.append(op)
            if self.rng.random() < 0.7:
                return bytes(data), ops
            lay = parse_layout(bytes(data))
        for _ in range(self.rng.choice((1, 1, 1, 2, 2, 3, 4))):
            op = self.rng.choice(self._OPS)
            ops.append(op(self, data, lay))
        return bytes(data), ops

    # each op edits `data` in place and says what it did
    def _region(self, data, lay):
        r = self.rng.random()
        size = len(data)
        if r < 0.1:
            return 0, min(24, size)
        if r < 0.5:
            return min(24, size), min(lay.tensor_info_start, size)
        if r < 0.8:
            return min(lay.tensor_info_start, size), min(lay.data_start, size)
        return min(lay.data_start, size), size

    def bit_flip(self, data, lay):
        lo, hi = self._region(data, lay)
        if hi <= lo:
            return "noop"
        n = self.rng.choice((1, 1, 2, 8))
        for _ in range(n):
            i = self.rng.randrange(lo, hi)
            data[i] ^= 1 << self.rng.randrange(8)
        return f"flip{n}@{lo}-{hi}"

    def set_byte(self, data, lay):
        lo, hi = self._region(data, lay)
        if hi <= lo:
            return "noop"
        i = self.rng.randrange(lo, hi)
        data[i] = self.rng.choice((0, 1, 0x7F, 0x80, 0xFF, self.rng.randrange(256)))
        return f"byte@{i}"

    def u64_field(self, data, lay):
        offs = [o for o in lay.u64_fields if o + 8 <= len(data)]
        if not offs:
            return "noop"
        o = self.rng.choice(offs)
        old = struct.unpack_from("<Q", data, o)[0]
        v = self.rng.choice(_INTERESTING_U64 + (old + 1, max(old - 1, 0), old * 2, old + 8, len(data),
                                                 self.rng.getrandbits(64)))
        struct.pack_into("<Q", data, o, v % 2**64)
        return f"u64@{o}={v}"

    def u32_field(self, data, lay):
        offs = [o for o in lay.u32_fields if o + 4 <= len(data)]
        if not offs:
            return "noop"
        o = self.rng.choice(offs)
        v = self.rng.choice(_INTERESTING_U32 + (self.rng.getrandbits(32),))
        struct.pack_into("<I", data, o, v)
        return f"u32@{o}={v}"

    def truncate(self, data, lay):
        r = self.rng.random()
        if r < 0.5:
            cut = self.rng.choice((lay.tensor_info_start, lay.data_start, *[e for _, e in lay.kv_entries[:40]],
                                   *[s for s, _ in lay.tensor_entries[:20]]))
            cut = max(0, min(len(data), cut + self.rng.randint(-9, 9)))
        else:
            cut = self.rng.randrange(0, len(data) + 1)
        del data[cut:]
        return f"truncate@{cut}"

    def delete_range(self, data, lay):
        if len(data) < 2:
            return "noop"
        i = self.rng.randrange(len(data))
        n = self.rng.choice((1, 4, 8, 12, self.rng.randrange(1, 256)))
        del data[i:i + n]
        return f"del{n}@{i}"

    def insert_bytes(self, data, lay):
        i = self.rng.randrange(len(data) + 1)
        n = self.rng.choice((1, 4, 8, 12))
        data[i:i] = bytes(self.rng.randrange(256) for _ in range(n))
        return f"ins{n}@{i}"

    def duplicate_entry(self, data, lay):
        entries = lay.kv_entries if self.rng.random() < 0.6 else lay.tensor_entries
        entries = [(s, e) for s, e in entries if e <= len(data) and e - s < 4096]
        if not entries:
            return "noop"
        s, e = self.rng.choice(entries)
        data[e:e] = data[s:e]
        return f"dup@{s}-{e}"

    def swap_entries(self, data, lay):
        entries = [(s, e) for s, e in lay.kv_entries if e <= len(data) and e - s < 4096]
        if len(entries) < 2:
            return "noop"
        (a0, a1), (b0, b1) = sorted(self.rng.sample(entries, 2))
        data[a0:b1] = data[b0:b1] + data[a1:b0] + data[a0:a1]
        return f"swap@{a0},{b0}"

    def string_length(self, data, lay):
        strs = [(o, n) for o, n in lay.string_values if o + 8 <= len(data)]
        if not strs:
            return "noop"
        o, n = self.rng.choice(strs)
        v = self.rng.choice((0, 1, n - 1, n + 1, n + 8, len(data), 2**63, 2**64 - 1))
        struct.pack_into("<Q", data, o, max(v, 0) % 2**64)
        return f"strlen@{o}={v}"

    def bad_utf8(self, data, lay):
        strs = [(o, n) for o, n in lay.string_values if n and o + 8 + n <= len(data)]
        if not strs:
            return "noop"
        o, n = self.rng.choice(strs)
        data[o + 8 + self.rng.randrange(n)] = self.rng.choice((0xFF, 0xC0, 0x80, 0xED))
        return f"utf8@{o}"

    def retype_entry(self, data: bytearray, lay: Layout) -> tuple[str, bytearray]:
        """Replace one metadata entry's value with a random well-formed value of a random type
        (the tensor data is re-aligned, so only that entry differs)."""
        start, end = self.rng.choice(lay.kv_entries)
        n = struct.unpack_from("<Q", data, start)[0]
        key = bytes(data[start:start + 8 + n])
        vtype, payload = self._random_value(depth=0)
        infos_end = lay.tensor_entries[-1][1] if lay.tensor_entries else lay.tensor_info_start
        head = data[:start] + key + struct.pack("<I", vtype) + payload + data[end:infos_end]
        head += bytes(-len(head) % 32)
        return f"retype {key[8:].decode(errors='replace')} -> {vtype}", head + data[lay.data_start:]

    def _random_value(self, depth: int) -> tuple[int, bytes]:
        rng = self.rng
        vtype = rng.choice((0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 9, 9, 10, 11, 12))
        if depth and vtype == 9 and depth > 1:
            vtype = 8
        return vtype, self._payload(vtype, depth)

    def _payload(self, vtype: int, depth: int) -> bytes:
        rng = self.rng
        ints = {0: ("<B", (0, 1, 255)), 1: ("<b", (-128, -1, 0, 127)), 2: ("<H", (0, 1, 65535)),
                3: ("<h", (-32768, -1, 0, 32767)), 4: ("<I", (0, 1, 5, 4095, 4096, 2**31, 2**32 - 1)),
                5: ("<i", (-(2**31), -1, 0, 1, 4089, 2**31 - 1)), 10: ("<Q", (0, 1, 4096, 2**63, 2**64 - 1)),
                11: ("<q", (-(2**63), -1, 0, 1, 2**63 - 1))}
        if vtype in ints:
            fmt, values = ints[vtype]
            return struct.pack(fmt, rng.choice(values))
        if vtype == 6:
            return struct.pack("<f", rng.choice((0.0, -1.0, 1e-6, 1e38, float("nan"), float("inf"))))
        if vtype == 12:
            return struct.pack("<d", rng.choice((0.0, -1.0, 1e300, float("nan"), float("-inf"))))
        if vtype == 7:
            return struct.pack("<B", rng.choice((0, 1, 2, 255)))
        if vtype == 8:
            text = rng.choice(("", "a", "gpt2", "qwen35", "llama", " ", "a b", "<|im_end|>", "é",
                               "{{ x }}", "x" * 300))
            raw = text.encode("utf-8")
            return struct.pack("<Q", len(raw)) + raw
        # an array of 0..6 elements of one type (arrays of arrays only one level deep)
        etype = rng.choice((0, 1, 4, 5, 6, 7, 8, 8, 10, 11) + ((9,) if depth == 0 else ()))
        count = rng.choice((0, 1, 2, 4, 6))
        return struct.pack("<IQ", etype, count) + b"".join(self._payload(etype, depth + 1) for _ in range(count))

    _OPS = (bit_flip, bit_flip, set_byte, u64_field, u64_field, u64_field, u32_field, u32_field,
            u32_field, truncate, delete_range, insert_bytes, duplicate_entry, swap_entries,
            string_length, bad_utf8)


# --- seeds ----------------------------------------------------------------------------------------

def micro_config():
    """The smallest qwen35 shapes the validator accepts (3 DeltaNet + 1 attention layer + MTP)."""
    from .config import ModelConfig
    from .testing import bpe

    doc = bpe.load_shipped(bpe.VOCAB_FILE)
    n_vocab = len(doc["tokens"]) + len(doc["special_tokens"])
    return ModelConfig(n_vocab=n_vocab, n_embd=32, n_layer=4, n_ff=32, n_head=2, n_head_kv=1, head_dim=16,
                       n_rot=8, rope_sections=(2, 2, 0, 0), rope_freq_base=1e7, rms_eps=1e-6,
                       ssm_conv_kernel=4, ssm_d_state=16, ssm_n_group=1, ssm_dt_rank=2, n_ctx_train=256)


def make_seeds(folder: Path, include_tiny: bool = True) -> list[Path]:
    """Real generated GGUFs to mutate: micro F16 and Q8_0 files, and the tiny preset as Q8_0."""
    from .defaults import _quiet_stderr
    from .testing.synth import synth_model

    folder.mkdir(parents=True, exist_ok=True)
    wanted = [("micro-F16", dict(config=micro_config(), quant="F16")),
              ("micro-Q8_0", dict(config=micro_config(), quant="Q8_0"))]
    if include_tiny:
        wanted.append(("tiny-Q8_0", dict(preset="tiny", quant="Q8_0")))
    out = []
    for name, kw in wanted:
        p = folder / f"{name}.gguf"
        if not p.is_file():
            with _quiet_stderr():
                synth_model(p, force=True, **kw)
        out.append(p)
    return out


def edge_cases() -> dict[str, bytes]:
    """Hand-made files at the edges of the format, kept in the corpus beside the fuzzer's finds."""
    hdr = lambda version, n_t, n_kv: b"GGUF" + struct.pack("<IQQ", version, n_t, n_kv)  # noqa: E731

    def kv(key: bytes, vtype: int, payload: bytes) -> bytes:
        return struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + payload

    nested = struct.pack("<IQ", 9, 1)
    deep = b"".join(nested for _ in range(5000)) + struct.pack("<IQ", 4, 0)
    arch = kv(b"general.architecture", 8, struct.pack("<Q", 6) + b"qwen35")
    return {
        "edge-empty": b"",
        "edge-magic-only": b"GGUF",
        "edge-header-cut": b"GGUF" + struct.pack("<I", 3) + b"\x00\x00",
        "edge-version-0": hdr(0, 0, 0),
        "edge-big-endian": b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
        "edge-huge-kv-count": hdr(3, 0, 2**64 - 1),
        "edge-huge-tensor-count": hdr(3, 2**63, 0),
        "edge-no-metadata": hdr(3, 0, 0),
        "edge-huge-key-length": hdr(3, 0, 1) + struct.pack("<Q", 2**64 - 1) + b"k",
        "edge-huge-string-array": hdr(3, 0, 1) + kv(b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**62)),
        "edge-huge-int-array": hdr(3, 0, 1) + kv(b"tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, 2**61)),
        "edge-deep-nested-array": hdr(3, 0, 2) + arch + kv(b"tokenizer.ggml.tokens", 9, deep),
        "edge-unknown-value-type": hdr(3, 0, 1) + kv(b"x", 99, b"\x00" * 8),
        "edge-arch-not-utf8": hdr(3, 0, 1) + kv(b"general.architecture", 8, struct.pack("<Q", 2) + b"\xff\xfe"),
        "edge-tensor-5-dims": hdr(3, 1, 1) + arch + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 5)
        + struct.pack("<5Q", 1, 1, 1, 1, 1) + struct.pack("<IQ", 0, 0),
        "edge-tensor-huge-ne": hdr(3, 1, 1) + arch + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 2)
        + struct.pack("<2Q", 2**40, 2**40) + struct.pack("<IQ", 0, 0),
        "edge-tensor-unknown-type": hdr(3, 1, 1) + arch + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 1)
        + struct.pack("<Q", 32) + struct.pack("<IQ", 4242, 0),
    }


# --- minimising a finding -------------------------------------------------------------------------

def minimise(data: bytes, signature: str, runner: Runner, scratch: Path, budget_s: float = 60.0,
             timeout: float | None = None) -> bytes:
    """A smaller file that fails with the same signature: zero the tensor data, cut the tail, then
    delete chunks (delta debugging), within `budget_s`. Hangs are minimised with a short limit."""
    deadline = time.monotonic() + budget_s
    probe = scratch / "minimise.gguf"
    runs = 0

    def same(candidate: bytes) -> bool:
        nonlocal runs
        runs += 1
        probe.write_bytes(candidate)
        return runner.run(probe, timeout=timeout).signature == signature

    best = data
    # 1. zero the data region (it compresses to nothing and rarely matters)
    try:
        start = parse_layout(best).data_start
    except Exception:  # noqa: BLE001 - a mutated header need not parse
        start = None
    if start is not None and start < len(best):
        cand = best[:start] + bytes(len(best) - start)
        if same(cand):
            best = cand
    # 2. cut the tail: the shortest prefix that still fails the same way (binary search, then steps)
    lo, hi = 0, len(best)
    while lo < hi and time.monotonic() < deadline:
        mid = (lo + hi) // 2
        if same(best[:mid]):
            hi = mid
        else:
            lo = mid + 1
    best = best[:hi] if hi < len(best) and same(best[:hi]) else best
    # 3. delete chunks, halving the chunk size
    chunk = max(1, len(best) // 8)
    while chunk >= 1 and time.monotonic() < deadline:
        i = 0
        changed = False
        while i < len(best) and time.monotonic() < deadline:
            cand = best[:i] + best[i + chunk:]
            if cand and same(cand):
                best, changed = cand, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return best


def save_finding(corpus: Path, data: bytes, signature: str, detail: str) -> Path:
    corpus.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(data).hexdigest()[:12]
    kind = signature.split("|")[0].replace(".", "_").replace(">", "").replace(" ", "")
    stem = f"crash-{kind}-{digest}"
    path = _write_corpus_file(corpus, stem, data)
    (corpus / f"{stem}.txt").write_text(f"{signature}\n\n{detail}\n", encoding="utf-8")
    return path


def _write_corpus_file(corpus: Path, stem: str, data: bytes) -> Path:
    if len(data) > SMALL_FILE:
        path, payload = corpus / f"{stem}.gguf.gz", gzip.compress(data, 9, mtime=0)
    else:
        path, payload = corpus / f"{stem}.gguf", data
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)          # a corpus file is never seen half-written
    return path


def corpus_files(corpus: Path) -> list[Path]:
    return sorted(p for p in corpus.iterdir() if p.name.endswith(CORPUS_SUFFIXES)) if corpus.is_dir() else []


def read_corpus_file(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.name.endswith(".gz") else raw


# --- the command ----------------------------------------------------------------------------------

@dataclass
class FuzzStats:
    executions: int = 0
    findings: dict[str, str] = field(default_factory=dict)    # signature -> saved file
    outcomes: dict[str, int] = field(default_factory=dict)    # how far cases got, for coverage's sake
    seconds: float = 0.0
    restarts: int = 0


def fuzz(seconds: float, corpus: Path, seed: int = 0, workdir: Path | None = None,
         case_timeout: float = CASE_TIMEOUT_S, include_tiny: bool = True, log=print) -> FuzzStats:
    rng = random.Random(seed)
    stats = FuzzStats()
    with tempfile.TemporaryDirectory(prefix="openjet-fuzz-", dir=_scratch_parent()) as tmp:
        scratch = Path(tmp)
        seed_dir = workdir or scratch / "seeds"
        seeds = [(p.name, p.read_bytes()) for p in make_seeds(seed_dir, include_tiny)]
        layouts = {name: parse_layout(b) for name, b in seeds}
        # the micro seeds run ~10x faster than the tiny one: weight them so
        weights = [1 if name.startswith("tiny") else 4 for name, _ in seeds]
        mut = Mutator(rng)
        case = scratch / "case.gguf"
        t0 = time.monotonic()
        last_log = t0
        with Runner(case_timeout) as runner:
            # the seeds themselves must pass (a loader that rejects a good file is also a bug)
            for name, b in seeds:
                case.write_bytes(b)
                o = runner.run(case)
                if o.status != "ok" or "open_model:ok" not in o.signature:
                    raise RuntimeError(f"seed {name} does not load cleanly: {o.signature}\n{o.detail}")
            while time.monotonic() - t0 < seconds:
                (name, base), = rng.choices(seeds, weights)
                data, ops = mut.mutate(base, layouts[name])
                case.write_bytes(data)
                o = runner.run(case)
                stats.executions += 1
                key = o.signature.split(" ")[0] if o.status == "ok" else o.status
                stats.outcomes[key] = stats.outcomes.get(key, 0) + 1
                if o.finding and o.signature not in stats.findings:
                    log(f"finding: {o.signature} (seed {name}, ops {ops}); minimising")
                    small = minimise(data, o.signature, runner, scratch,
                                     timeout=min(case_timeout, 3.0) if o.status == "hang" else None)
                    saved = save_finding(corpus, small, o.signature, o.detail + f"\nseed {name}, ops {ops}")
                    stats.findings[o.signature] = str(saved)
                    log(f"  saved {saved} ({len(small)} bytes)")
                now = time.monotonic()
                if now - last_log > 30:
                    last_log = now
                    log(f"[{now - t0:6.0f} s] {stats.executions} executions, "
                        f"{stats.executions / (now - t0):.0f}/s, {len(stats.findings)} findings")
            stats.restarts = runner.restarts
        stats.seconds = time.monotonic() - t0
    return stats


def replay(corpus: Path, case_timeout: float = CASE_TIMEOUT_S) -> list[tuple[Path, Outcome]]:
    """Run every corpus file; returns (file, outcome) for each."""
    results = []
    with tempfile.TemporaryDirectory(prefix="openjet-replay-", dir=_scratch_parent()) as tmp, \
            Runner(case_timeout) as runner:
        case = Path(tmp) / "case.gguf"
        for p in corpus_files(corpus):
            case.write_bytes(read_corpus_file(p))
            results.append((p, runner.run(case)))
    return results


def write_edge_cases(corpus: Path) -> list[Path]:
    corpus.mkdir(parents=True, exist_ok=True)
    return [_write_corpus_file(corpus, name, data) for name, data in edge_cases().items()]


def _scratch_parent() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz (default 60)")
    ap.add_argument("--corpus", type=Path, default=Path("tests/fuzz_corpus"),
                    help="where findings are saved (default tests/fuzz_corpus)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the mutations (default 0)")
    ap.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S,
                    help=f"seconds one case may take (default {CASE_TIMEOUT_S:g})")
    ap.add_argument("--seeds-dir", type=Path, default=None, help="keep the generated seed files here")
    ap.add_argument("--no-tiny", action="store_true", help="mutate only the micro seeds (faster)")
    ap.add_argument("--replay", action="store_true", help="only replay the corpus and report")
    ap.add_argument("--write-edge-cases", action="store_true",
                    help="(re)write the hand-made edge cases into the corpus first")
    args = ap.parse_args(argv)
    if args.write_edge_cases:
        for p in write_edge_cases(args.corpus):
            print(f"wrote {p}")
    if args.replay:
        bad = 0
        for p, o in replay(args.corpus, args.case_timeout):
            print(f"{'FAIL' if o.finding else 'ok  '} {p.name}: {o.signature}")
            if o.finding:
                bad += 1
                print(o.detail)
        print(f"{bad} of {len(corpus_files(args.corpus))} corpus files fail")
        return 1 if bad else 0
    st = fuzz(args.seconds, args.corpus, seed=args.seed, workdir=args.seeds_dir,
              case_timeout=args.case_timeout, include_tiny=not args.no_tiny)
    print(f"fuzzed {st.seconds:.0f} s: {st.executions} executions "
          f"({st.executions / max(st.seconds, 1e-9):.0f}/s), {len(st.findings)} distinct findings, "
          f"{st.restarts} worker restarts")
    for sig, path in st.findings.items():
        print(f"  {sig} -> {path}")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(st.outcomes.items(), key=lambda kv: -kv[1])))
    return 1 if st.findings else 0


if __name__ == "__main__":
    sys.exit(main())
