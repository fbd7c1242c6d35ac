"""Teacher-forced agreement of our engine with llama.cpp: the `agreement_top1` / `agreement_kl` rows
of `openjet bench` (issue 25), made in a child process:

    python -m openjet_plugin.bench.agreement --model M --label q27b --rows 30720:2048[,0:2048,...]
        (--llama-logits BINARY [--require-gpu] | --llama-python) [--engine native|reference]
        [--tokens random|stdlib] [--batch 8] [--chunk 64] [--near-tie 0.05] --out RECORDS.jsonl
        [--deadline EPOCH_SECONDS]

Both engines take the same token ids (seeded random ids, or held-out stdlib files tokenised with
the model's own tokenizer). For a row DEPTH:POSITIONS the first DEPTH tokens are prefilled (ours
through the native backend's batched prefill, oj_prefill; llama.cpp by native/tools/llama_logits
in batches of PREFILL_BATCH) and the next POSITIONS are teacher-forced, `--batch` positions per
call in both, their logits compared position by position as they come, `--chunk` positions at a
time: 2,048 rows of the 27B's 248,320 logits are 2 GB per engine, so neither side ever holds them
all. llama_logits streams its rows through a pipe (-o -) while our engine computes the same chunk;
`--llama-python` takes them from llama.cpp's Python API instead (llama-cpp-python, logits_all: the
CPU tests, with no llama.cpp source to compile llama_logits against). `--engine reference` puts the
numpy reference (testing/reference.py) in our engine's place, for a CPU run on a small model.

Per position, in float64: whether the two argmaxes agree, KL(llama.cpp || ours) of the softmaxes,
and for a disagreement whether it is a near-tie (llama.cpp's own logit of its choice minus its logit
of ours below `--near-tie`: the choices rounding differences between two correct engines flip).
Rows, params {model, depth, positions}, one sample each: agreement_top1 (the share of positions
whose argmaxes agree) and agreement_kl (the mean KL); the KL's p99 and max, the near-ties, the
relative L2 difference of the logits and both engines' timings are the row's details (the
manifest's info "spec_details", keyed by row). Thresholds: TOP1_MIN, KL_MAX over MIN_POSITIONS.
With `--engine reference` the rows are reference_agreement_top1 / reference_agreement_kl: the floor
the bar meets, float64 arithmetic with no activation rounding against the same llama.cpp on the
same positions (llama.cpp rounds activations to 8 bits in its products, which flips near-ties).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .report import AGREEMENT_METRICS as METRICS
from .report import METRICS as REPORT_METRICS
from .report import REFERENCE_AGREEMENT_METRICS as REFERENCE_METRICS   # --engine reference

ENGINE = "openjet"
UNITS = {m: REPORT_METRICS[m][0] for m in METRICS + REFERENCE_METRICS}   # the report's units, one copy
# issue 25's bar, over at least MIN_POSITIONS positions of a row
TOP1_MIN, KL_MAX, MIN_POSITIONS = 0.99, 1e-3, 2000
NEAR_TIE = 0.05              # logits: a disagreement closer than this in llama.cpp's own logits
PREFILL_BATCH = 512          # llama.cpp's positions per llama_decode in the prefill (its default ubatch)
FILL_TOKENS_PER_CALL = 8192  # ours: positions per prefill call (the bench's Filler does the same)
DETAIL_LIMIT = 16            # disagreements listed one by one in a row's details
LLAMA_LOGITS_SRC = Path(__file__).resolve().parents[2] / "native" / "tools" / "llama_logits.cpp"
STREAM_MAGIC = 0x474C4A4F    # "OJLG": the first int32 of llama_logits -o -'s header


class AgreementError(RuntimeError):
    """A step of the comparison failed; the message says which and why."""


def metrics_for(engine: str) -> tuple[str, str]:
    """The (top-1, KL) rows a child with `--engine engine` makes."""
    return METRICS if engine == "native" else REFERENCE_METRICS


def row_params(label: str, depth: int, positions: int) -> dict:
    return {"model": label, "depth": int(depth), "positions": int(positions)}


# --- the comparison ----------------------------------------------------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Comparison:
    """Agreement of our logits with llama.cpp's, accumulated chunk by chunk of positions
    (`add(llama, ours)`, each [positions, n_vocab]) and read with `result()`; per position it keeps
    a few floats, never a logits row."""

    def __init__(self, near_tie: float = NEAR_TIE):
        if not near_tie >= 0:
            raise ValueError(f"near_tie must be >= 0, got {near_tie!r}")
        self.near_tie = float(near_tie)
        self.n = self.agree = self.near = 0
        self.n_vocab: int | None = None
        self.kl: list[np.ndarray] = []
        self.margin: list[np.ndarray] = []       # llama.cpp's own top-1 minus top-2, every position
        self.nonfinite_llama = self.nonfinite_ours = 0
        self.sq_diff = self.sq_ref = self.max_abs = 0.0
        self.detail: list[dict] = []
        self.disagreements = 0

    def add(self, llama: np.ndarray, ours: np.ndarray) -> None:
        if llama.shape != ours.shape or llama.ndim != 2 or not llama.shape[0]:
            raise AgreementError(f"logits shapes differ or are not [positions, vocab]: llama.cpp "
                                 f"{llama.shape}, ours {ours.shape}")
        if self.n_vocab is None:
            self.n_vocab = int(llama.shape[1])
        elif llama.shape[1] != self.n_vocab:
            raise AgreementError(f"a chunk of {llama.shape[1]} logits per position after {self.n_vocab}")
        ll, oo = np.asarray(llama, dtype=np.float64), np.asarray(ours, dtype=np.float64)
        self.nonfinite_llama += int((~np.isfinite(ll).all(-1)).sum())
        self.nonfinite_ours += int((~np.isfinite(oo).all(-1)).sum())
        top_l, top_o = ll.argmax(-1), oo.argmax(-1)
        lp, lq = log_softmax(ll), log_softmax(oo)
        self.kl.append((np.exp(lp) * (lp - lq)).sum(-1))
        d = oo - ll
        self.sq_diff += float(np.square(d).sum())
        self.sq_ref += float(np.square(ll).sum())
        self.max_abs = max(self.max_abs, float(np.abs(d).max()))
        top2 = np.partition(ll, -2, axis=-1)[:, -2:] if ll.shape[1] > 1 else np.zeros((len(ll), 2))
        self.margin.append(top2[:, 1] - top2[:, 0])
        dis = np.flatnonzero(top_l != top_o)
        gap_llama = ll[dis, top_l[dis]] - ll[dis, top_o[dis]]
        gap_ours = oo[dis, top_o[dis]] - oo[dis, top_l[dis]]
        self.near += int((gap_llama < self.near_tie).sum())
        self.agree += int(len(ll) - dis.size)
        self.disagreements += int(dis.size)
        kl = self.kl[-1]
        for p, g, h in zip(dis, gap_llama, gap_ours):
            if len(self.detail) >= DETAIL_LIMIT:
                break
            self.detail.append({"position": int(self.n + p), "llama_top1": int(top_l[p]),
                                "ours_top1": int(top_o[p]), "llama_gap": float(g), "ours_gap": float(h),
                                "kl": float(kl[p])})
        self.n += len(ll)

    def result(self) -> dict:
        """The figures over every position added (positions: 0-based from the first row added)."""
        if not self.n:
            raise AgreementError("no positions compared")
        kl, margin = np.concatenate(self.kl), np.concatenate(self.margin)
        finite = not (self.nonfinite_llama or self.nonfinite_ours)
        return {
            "positions": self.n, "n_vocab": self.n_vocab, "finite": finite,
            "nonfinite_rows_llama": self.nonfinite_llama, "nonfinite_rows_ours": self.nonfinite_ours,
            "top1": self.agree / self.n,
            "disagreements": self.disagreements,
            "near_tie": self.near_tie,
            "near_tie_disagreements": self.near,
            "near_tie_fraction": self.near / self.disagreements if self.disagreements else None,
            "top1_excluding_near_ties": (self.agree + self.near) / self.n,
            "kl_mean": float(kl.mean()),
            "kl_p99": float(np.quantile(kl, 0.99)),
            "kl_max": float(kl.max()),
            "rel_l2": float(np.sqrt(self.sq_diff / self.sq_ref)) if self.sq_ref > 0 else None,
            "max_abs_diff": self.max_abs,
            "llama_top2_margin_median": float(np.median(margin)),
            "llama_top2_margin_min": float(margin.min()),
            "disagreement_detail": list(self.detail),
        }


def compare(llama: np.ndarray, ours: np.ndarray, near_tie: float = NEAR_TIE, chunk: int = 32) -> dict:
    """`Comparison` over two [positions, n_vocab] arrays held whole (tests, small models)."""
    if llama.shape != ours.shape or llama.ndim != 2:
        raise AgreementError(f"logits shapes differ or are not [positions, vocab]: llama.cpp "
                             f"{llama.shape}, ours {ours.shape}")
    c = Comparison(near_tie)
    for a in range(0, llama.shape[0], chunk):
        c.add(llama[a:a + chunk], ours[a:a + chunk])
    return c.result()


KL_DETAILS = ("kl_mean", "kl_p99", "kl_max", "rel_l2", "max_abs_diff")


def split_details(res: dict) -> tuple[dict, dict]:
    """A row pair's details: the KL's figures under agreement_kl, the rest under agreement_top1."""
    return ({k: v for k, v in res.items() if k not in KL_DETAILS}, {k: res[k] for k in KL_DETAILS if k in res})


def verdict(top1: float | None, kl_mean: float | None, positions: int) -> tuple[bool, str]:
    """(pass, why not) of one row against the thresholds."""
    why = []
    if top1 is None or top1 < TOP1_MIN:
        why.append(f"top-1 {'—' if top1 is None else f'{top1:.4f}'} < {TOP1_MIN}")
    if kl_mean is None or kl_mean > KL_MAX:
        why.append(f"mean KL {'—' if kl_mean is None else f'{kl_mean:.2e}'} > {KL_MAX:g}")
    if positions < MIN_POSITIONS:
        why.append(f"{positions} positions < {MIN_POSITIONS}")
    return not why, "; ".join(why)


# --- the token ids -----------------------------------------------------------------------------------

def token_ids(model: Path, n_vocab: int, n: int, source: str, seed: int = 0) -> tuple[list[int], str]:
    """`n` token ids both engines take, and where they come from."""
    if source == "random":
        return np.random.default_rng(seed).integers(0, n_vocab, n).tolist(), f"random ids, seed {seed}"
    if source != "stdlib":
        raise ValueError(f"--tokens must be random or stdlib, got {source!r}")
    from ..tokenizer import Tokenizer
    from .acceptance import heldout_files, stdlib_root

    tok = Tokenizer.from_gguf(model)
    out: list[int] = []
    for f in heldout_files():
        out += [int(t) for t in tok.encode(f.read_bytes(), add_special=False, parse_special=False)]
        if len(out) >= n:
            return out[:n], f"held-out stdlib files of Python {sys.version_info[0]}.{sys.version_info[1]}, concatenated"
    raise ValueError(f"the held-out stdlib files under {stdlib_root()} give {len(out)} tokens; {n} wanted")


# --- our side ----------------------------------------------------------------------------------------

class NativeSide:
    """The native engine (backends/native.py) with the main model only: prefill through oj_prefill,
    teacher forcing through oj_eval, `batch` positions per call."""

    name = "native"

    def __init__(self, model_file, n_ctx: int, batch: int):
        from ..backends.native import NativeBackend

        t0 = time.perf_counter()
        self.be = NativeBackend(model_file, n_ctx=n_ctx, draft_depth=0)
        self.load_s = time.perf_counter() - t0
        self.batch = batch
        self.prefill_s = 0.0

    def start(self, prefix: list[int]) -> None:
        self.be.reset()
        self.prefilled_before = self.be.prefilled_positions
        t0 = time.perf_counter()
        for a in range(0, len(prefix), FILL_TOKENS_PER_CALL):
            self.be.eval_argmax(prefix[a:a + FILL_TOKENS_PER_CALL])
        self.prefill_s = time.perf_counter() - t0
        if self.be.n_past != len(prefix):
            raise AgreementError(f"our engine is at position {self.be.n_past} after a prefill of {len(prefix)}")

    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.be.eval_all_logits(tokens, positions_per_call=self.batch)

    def info(self) -> dict:
        from .. import _native

        return {"engine": "native", "library": str(_native.load().path), "load_s": round(self.load_s, 2),
                "prefill_s": round(self.prefill_s, 3),
                "prefilled_by_oj_prefill": self.be.prefilled_positions - self.prefilled_before,
                "device_memory": self.be.memory()}

    def close(self) -> None:
        self.be.close()


class ReferenceSide:
    """The numpy reference in our engine's place (CPU runs on small models)."""

    name = "numpy reference"

    def __init__(self, path: Path, batch: int):
        from ..testing.reference import ReferenceModel

        t0 = time.perf_counter()
        self.ref = ReferenceModel(path)
        self.load_s = time.perf_counter() - t0
        self.batch = batch
        self.prefill_s = 0.0

    def start(self, prefix: list[int]) -> None:
        self.ref.reset()
        t0 = time.perf_counter()
        for a in range(0, len(prefix), PREFILL_BATCH):
            self.ref.forward(prefix[a:a + PREFILL_BATCH])
        self.prefill_s = time.perf_counter() - t0

    def logits(self, tokens: list[int]) -> np.ndarray:
        return np.concatenate([self.ref.forward(tokens[a:a + self.batch]) for a in range(0, len(tokens), self.batch)])

    def info(self) -> dict:
        return {"engine": "numpy reference", "load_s": round(self.load_s, 2), "prefill_s": round(self.prefill_s, 3)}

    def close(self) -> None:
        pass


# --- llama.cpp's side --------------------------------------------------------------------------------

class LlamaLogitsStream:
    """native/tools/llama_logits with -o -: it prefills `depth` tokens, then streams one fp32 row per
    teacher-forced position through a pipe; `rows(n)` reads the next n. At `deadline` (epoch
    seconds) the process is killed, so a hung llama.cpp ends as a short read, not a hung bench."""

    def __init__(self, binary: Path, model: Path, tokens: list[int], depth: int, batch: int, n_ctx: int,
                 workdir: Path, require_gpu: bool, deadline: float | None, threads: int):
        workdir.mkdir(parents=True, exist_ok=True)
        self.tok_file = workdir / f"tokens-{os.getpid()}.i32"
        np.asarray(tokens, dtype="<i4").tofile(self.tok_file)
        self.err_path = workdir / f"llama_logits-{os.getpid()}.stderr"
        self.cmd = [str(binary), "-m", str(model), "-t", str(self.tok_file), "-o", "-", "-b", str(batch),
                    "--depth", str(depth), "--prefill-batch", str(PREFILL_BATCH), "-c", str(n_ctx),
                    "-ngl", "999", "-fa", "1", "--threads", str(threads)]
        if require_gpu:
            self.cmd.append("--require-gpu")
        self.depth, self.n_rows_asked = depth, len(tokens) - depth
        self.t0 = time.perf_counter()
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=err)
        self.timer = None
        if deadline is not None:
            self.timer = threading.Timer(max(1.0, deadline - time.time()), self.proc.kill)
            self.timer.daemon = True
            self.timer.start()
        self.read_rows = 0
        try:
            magic, n_rows, n_vocab, got_depth = np.frombuffer(self._read(16, "the header"), dtype="<i4").tolist()
            if magic != STREAM_MAGIC or n_rows != self.n_rows_asked or got_depth != depth:
                raise AgreementError(f"llama_logits' header is (magic {magic:#x}, rows {n_rows}, depth {got_depth}); "
                                     f"expected ({STREAM_MAGIC:#x}, {self.n_rows_asked}, {depth}): "
                                     f"{' '.join(self.cmd)}")
        except BaseException:
            self.close()
            raise
        self.n_vocab = n_vocab

    def _stderr_tail(self) -> str:
        try:
            return self.err_path.read_text(errors="replace").strip()[-1500:]
        except OSError:
            return ""

    def _read(self, n: int, what: str) -> bytes:
        buf = self.proc.stdout.read(n)
        if len(buf) != n:
            try:
                rc = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rc = "still running"
            raise AgreementError(f"llama_logits ended after {len(buf)} of {n} bytes of {what} (exit {rc}): "
                                 f"{' '.join(self.cmd)}\n{self._stderr_tail()}")
        return buf

    def rows(self, n: int) -> np.ndarray:
        if self.read_rows + n > self.n_rows_asked:
            raise AgreementError(f"asked for rows up to {self.read_rows + n}; llama_logits makes {self.n_rows_asked}")
        data = self._read(n * self.n_vocab * 4, f"rows {self.read_rows}..{self.read_rows + n - 1}")
        self.read_rows += n
        return np.frombuffer(data, dtype="<f4").reshape(n, self.n_vocab)

    def finish(self) -> dict:
        """After the last row: the process's exit and its JSON summary (the last line of stderr)."""
        extra = self.proc.stdout.read(1)
        rc = self.proc.wait(timeout=60)
        if extra or rc != 0:
            raise AgreementError(f"llama_logits {'wrote past its rows' if extra else f'exited {rc}'}: "
                                 f"{' '.join(self.cmd)}\n{self._stderr_tail()}")
        lines = [ln for ln in self.err_path.read_text(errors="replace").splitlines() if ln.startswith("{")]
        try:
            info = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise AgreementError(f"llama_logits printed no JSON summary: {self._stderr_tail()}") from None
        info["wall_s"] = round(time.perf_counter() - self.t0, 2)
        info["driver"] = "native/tools/llama_logits"
        return info

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.tok_file.unlink(missing_ok=True)


class LlamaPython:
    """llama.cpp through llama-cpp-python (the libllama it loads: its own CPU build, or the one
    $LLAMA_CPP_LIB_PATH names): logits_all, flash attention, f16 KV; the prefill in batches of
    PREFILL_BATCH, then `batch` positions per llama_decode, as llama_logits does."""

    def __init__(self, model: Path, tokens: list[int], depth: int, batch: int, n_ctx: int, threads: int):
        from ..backends.llama_cpp import import_llama_cpp

        llama_cpp = import_llama_cpp()

        self.t0 = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_batch=max(batch, PREFILL_BATCH),
                                   n_ubatch=max(batch, PREFILL_BATCH), logits_all=True, flash_attn=True,
                                   n_gpu_layers=999, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.load_s = time.perf_counter() - self.t0
        self.tokens, self.batch, self.pos = tokens, batch, depth
        self.n_vocab = self.llm.n_vocab()
        t0 = time.perf_counter()
        if depth:
            self.llm.eval(tokens[:depth])
        self.prefill_s = time.perf_counter() - t0
        self.decode_s = 0.0
        self.version = llama_cpp.__version__

    def rows(self, n: int) -> np.ndarray:
        if self.pos + n > len(self.tokens):
            raise AgreementError(f"asked for rows up to position {self.pos + n}; there are {len(self.tokens)} tokens")
        t0 = time.perf_counter()
        for a in range(self.pos, self.pos + n, self.batch):
            self.llm.eval(self.tokens[a:min(a + self.batch, self.pos + n)])
        out = np.array(self.llm.scores[self.pos:self.pos + n], dtype=np.float32)
        self.decode_s += time.perf_counter() - t0
        self.pos += n
        return out

    def finish(self) -> dict:
        return {"driver": f"llama-cpp-python {self.version} (logits_all)", "n_vocab": self.n_vocab,
                "n_batch": self.batch, "prefill_batch": PREFILL_BATCH, "flash_attn": True,
                "load_s": round(self.load_s, 3), "prefill_s": round(self.prefill_s, 3),
                "decode_s": round(self.decode_s, 3), "wall_s": round(time.perf_counter() - self.t0, 2)}

    def close(self) -> None:
        self.llm.close()


# --- one row -----------------------------------------------------------------------------------------

def measure_row(ours, start_llama, tokens: list[int], depth: int, positions: int, chunk: int,
                near_tie: float) -> dict:
    """Prefill `depth` tokens in both engines, then teacher-force the next `positions` and compare
    them `chunk` at a time. `start_llama(tokens, depth)` starts llama.cpp's side (its prefill runs in
    its own process while ours runs)."""
    if depth + positions > len(tokens):
        raise AgreementError(f"depth {depth} + positions {positions} is more than the {len(tokens)} tokens")
    llama = start_llama(tokens[:depth + positions], depth)
    try:
        ours.start(tokens[:depth])
        cmp = Comparison(near_tie)
        t0 = time.perf_counter()
        for a in range(depth, depth + positions, chunk):
            toks = tokens[a:min(a + chunk, depth + positions)]
            mine = ours.logits(toks)
            theirs = llama.rows(len(toks))
            if theirs.shape[1] != mine.shape[1]:
                raise AgreementError(f"vocabulary sizes differ: llama.cpp {theirs.shape[1]}, ours {mine.shape[1]}")
            cmp.add(theirs, mine)
        compare_s = time.perf_counter() - t0
        llama_info = llama.finish()
    finally:
        llama.close()
    res = cmp.result()
    res["ours"] = {**ours.info(), "teacher_forced_and_compare_s": round(compare_s, 2)}
    res["llama_cpp"] = llama_info
    return res


# --- the child ---------------------------------------------------------------------------------------

def _rows(text: str) -> list[tuple[int, int]]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        d, sep, p = item.partition(":")
        try:
            depth, positions = int(d), int(p)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rows: expected DEPTH:POSITIONS items like 30720:2048, "
                                             f"got {item!r}") from None
        if not sep or depth < 0 or positions < 1:
            raise argparse.ArgumentTypeError(f"--rows: {item!r}: DEPTH must be >= 0 and POSITIONS >= 1")
        out.append((depth, positions))
    if not out:
        raise argparse.ArgumentTypeError(f"--rows: no DEPTH:POSITIONS item in {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.bench.agreement",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="GGUF both engines run")
    ap.add_argument("--label", required=True, help="the rows' model param (q27b, default)")
    ap.add_argument("--rows", type=_rows, required=True, help="DEPTH:POSITIONS items, comma-separated")
    llama = ap.add_mutually_exclusive_group(required=True)
    llama.add_argument("--llama-logits", type=Path, help="native/tools/llama_logits built against a libllama")
    llama.add_argument("--llama-python", action="store_true", help="llama.cpp through llama-cpp-python")
    ap.add_argument("--require-gpu", action="store_true", help="refuse a libllama without GPU offload")
    ap.add_argument("--engine", choices=("native", "reference"), default="native")
    ap.add_argument("--tokens", choices=("random", "stdlib"), default="random")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    ap.add_argument("--batch", type=int, default=8, help="teacher-forced positions per call, both engines (1..8)")
    ap.add_argument("--chunk", type=int, default=64, help="positions compared at a time")
    ap.add_argument("--near-tie", type=float, default=NEAR_TIE, help="logit gap of a near-tie disagreement")
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 4), help="llama.cpp's CPU threads")
    ap.add_argument("--workdir", type=Path, help="token files and llama_logits' stderr (default: a temporary folder)")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines: results, skips, info")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds; 0 = none")
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..model_file import open_model
    from .ours import Emitter

    args = parser().parse_args(argv)
    if not 1 <= args.batch <= 8:
        parser().error(f"--batch must be 1..8, got {args.batch}")
    if args.chunk < 1:
        parser().error(f"--chunk must be >= 1, got {args.chunk}")
    if args.llama_logits is not None and not (args.llama_logits.is_file() and os.access(args.llama_logits, os.X_OK)):
        parser().error(f"--llama-logits {args.llama_logits}: not an executable file")
    if not args.model.is_file():
        parser().error(f"--model {args.model}: file not found")
    out = Emitter(args.out)
    deadline = args.deadline or None
    todo = list(args.rows)
    top1_m, kl_m = metrics_for(args.engine)

    def skip(items, reason: str) -> None:
        for d, p in items:
            for m in (top1_m, kl_m):
                out.skip(m, row_params(args.label, d, p), reason)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="openjet-agreement-"))
    need = max(d + p for d, p in todo)
    n_ctx = -(-need // 256) * 256
    ours = None
    mf = open_model(args.model)
    try:
        n_vocab = mf.config.n_vocab
        tokens, source = token_ids(args.model, n_vocab, need, args.tokens, args.seed)
        out.emit({"info": {"agreement_tokens": {args.label: source}}})
        ours = (NativeSide(mf, n_ctx, args.batch) if args.engine == "native"
                else ReferenceSide(args.model, args.batch))

        def start_llama(toks: list[int], depth: int):
            if args.llama_python:
                return LlamaPython(args.model, toks, depth, args.batch, n_ctx, args.threads)
            return LlamaLogitsStream(args.llama_logits, args.model, toks, depth, args.batch, n_ctx, workdir,
                                     args.require_gpu, deadline, args.threads)

        for i, (depth, positions) in enumerate(todo):
            if deadline is not None and time.time() > deadline - 10:
                skip(todo[i:], "out of time in this run; run again with the same --resume folder to finish it")
                return 3
            params = row_params(args.label, depth, positions)
            print(f"agreement {args.label} depth {depth}: {positions} positions ({ours.name} vs llama.cpp)",
                  file=sys.stderr, flush=True)
            try:
                res = measure_row(ours, start_llama, tokens, depth, positions, args.chunk, args.near_tie)
            except (AgreementError, OSError, ValueError, RuntimeError) as exc:
                skip([(depth, positions)], f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                print(f"agreement {args.label} depth {depth}: failed: {exc}", file=sys.stderr, flush=True)
                continue
            res.update(tokens=source, batch=args.batch, chunk=args.chunk)
            ok, why = verdict(res["top1"], res["kl_mean"], res["positions"])
            if not res["finite"]:
                skip([(depth, positions)], f"non-finite logits: {res['nonfinite_rows_ours']} of our rows, "
                                           f"{res['nonfinite_rows_llama']} of llama.cpp's")
            else:
                out.result(top1_m, params, UNITS[top1_m], [res["top1"]])
                out.result(kl_m, params, UNITS[kl_m], [res["kl_mean"]])
            top1_part, kl_part = split_details(res)
            out.details(top1_m, params, top1_part)
            out.details(kl_m, params, kl_part)
            print(f"agreement {args.label} depth {depth}: top-1 {res['top1']:.4f} over {res['positions']} "
                  f"positions ({res['disagreements']} disagreements, {res['near_tie_disagreements']} near-ties "
                  f"< {args.near_tie}); KL mean {res['kl_mean']:.2e}, p99 {res['kl_p99']:.2e}, max "
                  f"{res['kl_max']:.2e}; rel L2 {res['rel_l2'] or 0:.2e} -> {'PASS' if ok else 'FAIL: ' + why}",
                  file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - the parent reads the reason from the records
        out.emit({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"})
        raise
    finally:
        if ours is not None:
            ours.close()
        mf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
