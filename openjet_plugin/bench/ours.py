"""Our engine's measurements, run in a child process of `openjet bench` (so that its peak GPU
memory is its own and a fault cannot take the benchmark down):

    python -m openjet_plugin.bench.ours --model M --out RECORDS.jsonl [--verify 1,2,3,4,5]
        [--verify-depth 1024] [--decode-depths 0,8192,30720] [--decode-tokens 128] [--reps 6]
        [--spec 0.5:1,0.5:2,...] [--spec-mtp 1,2,3,4 | 1@0,1@8192,...] [--spec-depth 8192]
        [--spec-tokens 128] [--spec-tree 8 | 8@8192,8:calibrated@0,...]
        [--prefill 2700:1800,12000:29500] [--deadline EPOCH_SECONDS]
    python -m openjet_plugin.bench.ours --model default.gguf --out RECORDS.jsonl --verify '' \
        --decode-depths '' --accept 0.0:1,...,0.7:4 [--accept-prompts 12] [--accept-prompt-tokens 64]
        [--accept-tokens 64]

It talks to the native backend directly (`backends/native.py`), the layer under the engine API
that holds the model state, so that what is timed is the engine's work and not sampling on the
host — the same boundary llama-bench times for llama.cpp (llama_decode + synchronize).

- decode_tps at depth d: the state is filled to d with random tokens and saved in a checkpoint;
  after 8 warm-up steps each repetition restores the checkpoint (as llama-bench restores its saved
  state) and times 128 single-token steps feeding back the greedy token (`eval_argmax`, which waits
  for the GPU); one sample = 128 / elapsed.
- verify_ms for P positions at depth 1024: one `oj_eval` of P tokens plus the copy of their
  argmax to the host, i.e. one verification pass; the state is reset and refilled to the depth
  for every P.
- projection_gbps for P positions at depth 1024 (right after verify_ms, same state): the same passes
  with the engine's per-phase profile on (oj_profile: CUDA events at every phase boundary); one
  sample = the pass's projection weight bytes (DeltaNet, attention and FFN projections, the head)
  over the summed time of those phases. The phases summed over the samples go to the manifest
  (info "phase_tables", keyed like the row): per phase its time, bytes, launches and calls per
  pass, and the GPU span from the pass's first event to its last; report.py adds the floors.
- Both are passes of the main model alone (llama.cpp runs no MTP block): a backend made to
  speculate adds MTP rows to every evaluation, which `spec.main_model_only` switches off for them.
- prefill_tps for N new tokens at depth M: bench/prefill.py (oj_prefill from a checkpoint at M,
  main model only); measured first, from their own fill, so that no MTP row is in their state.
- spec_tps at the spec depth, spec_mtp_tps at each depth asked (D@DEPTH; a bare D: the spec
  depth): bench/spec.py (speculative cycles from a checkpoint, oracle drafts at a forced
  acceptance, or the model's MTP head). The state the decode and speculative rows start from is
  the shared token sequence (spec.prompt_tokens) that llama.cpp's spec_mtp_tps rows are given too
  (bench/peer_spec.py): at depth d, positions 0..d-1 filled and token d the current one. (At
  depth 0 the first cycle's MTP step has no previous position: it reads the engine's row 0, as a
  fill from a reset does; llama.cpp drafts first after its prompt's one token.)
- spec_tree_tps (--spec-tree BUDGET[:SHAPE][@DEPTH]): draft trees of B verify positions from the
  MTP head through the engine's tree decoder (bench/spec.py), from the same start points; a build
  without `speculative_native.native_tree_decoder` records each such row as not measured, and why.
- accepted_per_cycle (--accept, on the trained default model) and tree_accepted_per_cycle
  (--accept-trees, draft trees on it): bench/acceptance.py.

Every result line is a JSON object {"metric", "engine", "params", "unit", "samples"}; lines
{"skip": {...}, "reason"} name a measurement that was not made, and {"info": {...}} carries facts
for the manifest (memory report, fill rate, and under "spec_details" each speculative row's
tokens per cycle, acceptance per draft slot and the rest that has no samples of its own).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ENGINE = "openjet"
WARMUP_STEPS = 8
SPEC_WARMUP_TOKENS = 16        # one short warm-up run per speculative row (kernels of its D + 1)
DETAILS_KEY = "spec_details"   # info key: {row_key: details}, merged by the parent
PHASES_KEY = "phase_tables"    # info key: {row_key of a projection_gbps row: its phase table}, merged likewise
# the profile's phases (native/engine.cu PHASE_NAMES) whose bytes are projection weights
PROJECTION_PHASES = ("deltanet projections", "deltanet ssm_out", "attention q/k/v", "attention output",
                     "ffn gate+up", "ffn down", "head")


class Emitter:
    def __init__(self, path: Path):
        self.f = open(path, "a")

    def emit(self, obj: dict) -> None:
        self.f.write(json.dumps(obj) + "\n")
        self.f.flush()

    def result(self, metric: str, params: dict, unit: str, samples: list[float]) -> None:
        self.emit({"metric": metric, "engine": ENGINE, "params": params, "unit": unit,
                   "samples": [float(s) for s in samples]})

    def skip(self, metric: str, params: dict, reason: str) -> None:
        self.emit({"skip": {"metric": metric, "engine": ENGINE, "params": params}, "reason": reason})

    def details(self, metric: str, params: dict, details: dict) -> None:
        from .report import row_key

        self.emit({"info": {DETAILS_KEY: {row_key(metric, ENGINE, params): details}}})


FILL_TOKENS_PER_CALL = 8192   # one eval call: oj_prefill passes (or 8 positions per oj_eval without it)


class Filler:
    """Appends random tokens (as llama-bench does) in large calls, and keeps the rate so the caller
    can tell whether a fill fits the time left, and the tokens appended since the last reset (the
    history a speculative request starts from)."""

    def __init__(self, backend, rng: np.random.Generator):
        self.be = backend
        self.rng = rng
        self.tokens = 0
        self.seconds = 0.0
        self.appended: list[int] = []
        # when set, position i is filled with source[i] (the shared sequence) instead of a random token
        self.source: list[int] | None = None

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens >= 64 else None

    def estimate(self, n: int) -> float | None:
        r = self.rate
        return None if r is None else n / r

    def reset(self) -> None:
        self.be.reset()
        self.appended = []

    def fill_to(self, depth: int) -> None:
        del self.appended[self.be.n_past:]          # a checkpoint restored the state to here
        while self.be.n_past < depth:
            n = min(FILL_TOKENS_PER_CALL, depth - self.be.n_past)
            if self.source is not None:
                toks = self.source[self.be.n_past:self.be.n_past + n]
                if len(toks) != n:
                    raise ValueError(f"the fill's token source ends at {len(self.source)}, before depth {depth}")
            else:
                toks = self.rng.integers(0, self.be.n_vocab, size=n).tolist()
            t0 = time.perf_counter()
            self.be.eval_argmax(toks)
            self.seconds += time.perf_counter() - t0
            self.tokens += n
            self.appended += toks


def decode_samples(be, n_tokens: int, reps: int, first: int, restore=None) -> list[float]:
    """`reps` runs of `n_tokens` greedy steps after WARMUP_STEPS; with `restore` (a callable that
    puts the state back at the depth) every run starts from the same state and token."""
    tok = first
    for _ in range(WARMUP_STEPS):
        tok = be.eval_argmax([tok])
    samples = []
    for _ in range(reps):
        if restore is not None:
            restore()
            tok = first
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            tok = be.eval_argmax([tok])
        samples.append(n_tokens / (time.perf_counter() - t0))
    return samples


def verify_row_positions(positions: int, reps: int) -> int:
    """Positions a verify row appends after its fill: verify_samples' reps + 2 passes, then
    profiled_samples' twice that (profiled, then host time only), with no restore between them."""
    return 3 * positions * (reps + 2)


def verify_samples(be, positions: int, reps: int, rng: np.random.Generator) -> list[float]:
    samples = []
    for r in range(-2, reps):                      # two warm-up passes
        toks = rng.integers(0, be.n_vocab, size=positions).tolist()
        t0 = time.perf_counter()
        be.eval_pass_argmax(toks)                  # one oj_eval (one pass) + argmax copy
        dt = time.perf_counter() - t0
        if r >= 0:
            samples.append(dt * 1e3)
    return samples


def projection_gbps(read: dict) -> float:
    """One profile read (NativeBackend.profile_read): projection weight bytes over the summed time
    of the projection phases, GB/s."""
    rows = [ph for ph in read["phases"] if ph["name"] in PROJECTION_PHASES]
    ms = sum(ph["ms"] for ph in rows)
    if ms <= 0:
        raise ValueError(f"profile: the projection phases took {ms} ms over {read['passes']} passes")
    return sum(ph["bytes"] for ph in rows) / (ms * 1e-3) / 1e9


def phase_table(reads: list[dict]) -> dict:
    """Profile reads of one pass each -> per-pass means: {"passes", "span_ms", "host_ms", "phases":
    [{"name", "calls", "launches", "ms", "bytes"}]} (calls, launches and bytes are the same every
    pass)."""
    n = len(reads)
    names = [ph["name"] for ph in reads[0]["phases"]]
    phases = []
    for i, name in enumerate(names):
        rows = [r["phases"][i] for r in reads]
        phases.append({"name": name, "calls": rows[0]["calls"], "launches": rows[0]["launches"],
                       "ms": sum(r["ms"] for r in rows) / n, "bytes": rows[0]["bytes"]})
    return {"passes": n, "span_ms": sum(r["span_ms"] for r in reads) / n,
            "host_ms": sum(r.get("host_ms", 0.0) for r in reads) / n, "phases": phases}


def profiled_samples(be, positions: int, reps: int, rng: np.random.Generator) -> tuple[list[float], dict]:
    """`reps` profiled passes of `positions` tokens (after two warm-up passes): projection GB/s
    per pass, and the phase table of the passes; then `reps` passes with only the host time on
    (as they run unprofiled): the table's "host_ms_unprofiled" (mean host time to enqueue the
    pass) and "wall_ms_unprofiled" (mean wall time of those passes, one eval_argmax each)."""
    def passes(host_only: bool) -> tuple[list[dict], list[float]]:
        be.profile(True, host_only=host_only)
        try:
            reads, walls = [], []
            for r in range(-2, reps):
                t0 = time.perf_counter()
                be.eval_pass_argmax(rng.integers(0, be.n_vocab, size=positions).tolist())
                dt = time.perf_counter() - t0
                read = be.profile_read()
                if read["passes"] != 1:
                    raise ValueError(f"profile: one eval of {positions} tokens read as {read['passes']} passes")
                if r >= 0:
                    reads.append(read)
                    walls.append(dt * 1e3)
        finally:
            be.profile(False)
        return reads, walls

    reads, _ = passes(False)
    table = phase_table(reads)
    host_reads, walls = passes(True)
    table["host_ms_unprofiled"] = sum(r["host_ms"] for r in host_reads) / len(host_reads)
    table["wall_ms_unprofiled"] = sum(walls) / len(walls)
    return [projection_gbps(x) for x in reads], table


def _pairs(text: str, what: str, second: str = "DRAFTS") -> list[tuple[float, int]]:
    """'0.5:1,0.7:4' -> [(0.5, 1), (0.7, 4)]; `second` names the integer in the error."""
    out = []
    for item in (x for x in (text or "").split(",") if x.strip()):
        a, sep, d = item.partition(":")
        try:
            if not sep:
                raise ValueError
            out.append((float(a), int(d)))
        except ValueError:
            raise ValueError(f"{what}: expected VALUE:{second} items like 0.5:4, got {item!r}") from None
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in (text or "").split(",") if x.strip()]


def _mtp_items(text: str, spec_depth: int) -> list[tuple[int, int]]:
    """'1,2' -> [(1, spec_depth), (2, spec_depth)]; '1@0,4@8192' -> [(1, 0), (4, 8192)]: (drafts, depth)."""
    out = []
    for item in (x.strip() for x in (text or "").split(",") if x.strip()):
        d, sep, depth = item.partition("@")
        try:
            out.append((int(d), int(depth) if sep else spec_depth))
        except ValueError:
            raise ValueError(f"--spec-mtp: expected DRAFTS or DRAFTS@DEPTH items like 4@8192, got {item!r}") from None
    return out


def _tree_items(text: str, spec_depth: int) -> list[tuple[int, str, int]]:
    """'8,16:calibrated@0' -> [(8, 'q', spec_depth), (16, 'calibrated', 0)]: (budget, shape, depth)."""
    from .spec import TREE_SHAPES

    out = []
    for item in (x.strip() for x in (text or "").split(",") if x.strip()):
        head, sep, depth = item.partition("@")
        budget, _, shape = head.partition(":")
        try:
            out.append((int(budget), shape or "q", int(depth) if sep else spec_depth))
        except ValueError:
            raise ValueError(f"--spec-tree: expected BUDGET[:SHAPE][@DEPTH] items like 8:q@8192, got {item!r}") from None
        if out[-1][1] not in TREE_SHAPES:
            raise ValueError(f"--spec-tree: shape {out[-1][1]!r} in {item!r} is not one of {', '.join(TREE_SHAPES)}")
    return out


def tree_params(budget: int, shape: str, depth: int) -> dict:
    return {"budget": int(budget), "depth": int(depth), "shape": shape}


def spec_rows(pairs: list[tuple[float, int]], mtp: list[tuple[int, int]], depth: int,
              trees: list[tuple[int, str, int]] = ()) -> list[tuple[str, dict]]:
    """Oracle rows at the spec depth, MTP rows at their (drafts, depth), tree rows at their
    (budget, shape, depth)."""
    return ([("spec_tps", {"acceptance": a, "drafts": d, "depth": depth}) for a, d in pairs]
            + [("spec_mtp_tps", {"drafts": d, "depth": dep}) for d, dep in mtp]
            + [("spec_tree_tps", tree_params(b, sh, dep)) for b, sh, dep in trees])


def tree_phase(be, args, out: Emitter, rows: list[tuple[str, dict]], point, vocab, vocab_text, time_left,
               factory=None, prefill_seconds: float = 0.0) -> None:
    """The spec_tree_tps rows from one start point: each a result with its details, or a skip with
    its reason (no MTP head, no tree decoder in this build, not the native engine, out of time, a
    failure). `factory(be, budget, shape, vocab)` -> make(rep) (default: the native engine's). The
    tree decoder resets the engine and prefills the point's history at every run (about
    `prefill_seconds` each, not timed): run these rows after every row that restores a checkpoint."""
    from . import spec

    factory = factory or spec.native_tree_factory
    n = args.spec_tokens
    seconds_per_token = 1.5 / point.plain_tps
    for i, (metric, params) in enumerate(rows):
        est = (args.reps + 1) * prefill_seconds + (args.reps + 0.2) * n * seconds_per_token
        if est + 10 > time_left():
            for m, p in rows[i:]:
                out.skip(m, p, f"out of time: a speculative row of {args.reps} x {n} tokens takes ~{est:.0f} s")
            return
        if not getattr(be, "has_mtp", False):
            out.skip(metric, params, f"{Path(args.model).name} has no MTP block: nothing drafts")
            continue
        try:
            make = factory(be, params["budget"], params["shape"], vocab)
        except spec.TreeUnavailable as exc:
            out.skip(metric, params, str(exc))
            continue
        t0 = time.perf_counter()
        try:
            samples, details = spec.measure_tree_row(make, point, params["budget"], n, args.reps, SPEC_WARMUP_TOKENS)
        except Exception as exc:  # noqa: BLE001 - one row's failure is recorded and the rest go on
            out.skip(metric, params, f"{type(exc).__name__}: {exc}")
            continue
        seconds_per_token = 1.2 * (time.perf_counter() - t0) / ((args.reps + 0.2) * n)
        details["drafts_from"] = f"{spec.TREE_NOTE}; shape: {spec.TREE_SHAPES[params['shape']]}" + (
            f"; draft vocabulary: {vocab_text}" if vocab_text else "")
        out.result(metric, params, "tokens/s", samples)
        out.details(metric, params, details)


def spec_phase(be, args, out: Emitter, rows: list[tuple[str, dict]], history: list[int], current: int,
               time_left):
    """The speculative rows at depth len(history), from the checkpoint there (bench/spec.py), with
    `current` the token at that position. Each chain row becomes a result or a skip with its reason;
    the tree rows (spec_tree_tps) are left for `tree_phase`, after every checkpoint's last use, and
    skipped here only when the start point fails. Returns the start point (None: it failed)."""
    from . import spec

    d, n = len(history), args.spec_tokens
    pairs = [r for r in rows if r[0] == "spec_tps"]
    mtp = [r for r in rows if r[0] == "spec_mtp_tps"]
    trees = [r for r in rows if r[0] == "spec_tree_tps"]
    rows = pairs + mtp

    def skip(which, reason: str) -> None:
        for metric, params in which:
            out.skip(metric, params, reason)

    try:
        point = spec.start_point(be, d, history, int(current), n)
    except Exception as exc:  # noqa: BLE001 - the rows say why, the rest of the benchmark goes on
        skip(rows + trees, f"speculative start point at depth {d} failed: {type(exc).__name__}: {exc}")
        return None
    vocab = vocab_text = None
    if mtp and getattr(be, "has_mtp", False):
        try:
            vocab, vocab_text = spec.draft_vocab(args.model, be.n_vocab)
        except Exception as exc:  # noqa: BLE001
            skip(rows[len(pairs):], f"draft vocabulary of {args.model}: {type(exc).__name__}: {exc}")
            rows = rows[:len(pairs)]
    seconds_per_token = 1.5 / point.plain_tps      # a speculative row is rarely slower than this
    for i, (metric, params) in enumerate(rows):
        est = (args.reps + 0.2) * n * seconds_per_token
        if est + 10 > time_left():
            skip(rows[i:], f"out of time: a speculative row of {args.reps} x {n} tokens takes ~{est:.0f} s")
            return point
        D = params["drafts"]
        if metric == "spec_tps":
            make = spec.oracle_factory(be, point, params["acceptance"], D)
            note = spec.oracle_note(be)
        elif not getattr(be, "has_mtp", False):
            out.skip(metric, params, f"{Path(args.model).name} has no MTP block: nothing drafts")
            continue
        else:
            make = spec.mtp_factory(be, vocab, D)
            note = f"{spec.MTP_NOTE}; draft vocabulary: {vocab_text}"
        t0 = time.perf_counter()
        try:
            samples, details = spec.measure_row(be, make, point, D, n, args.reps, SPEC_WARMUP_TOKENS)
        except Exception as exc:  # noqa: BLE001 - one row's failure is recorded and the rest go on
            out.skip(metric, params, f"{type(exc).__name__}: {exc}")
            continue
        seconds_per_token = 1.2 * (time.perf_counter() - t0) / ((args.reps + 0.2) * n)
        details["drafts_from"] = note
        out.result(metric, params, "tokens/s", samples)
        out.details(metric, params, details)
    return point


def trees_last(be, args, out: Emitter, rows: list[tuple[str, dict]], points: dict, fill_rate, time_left) -> None:
    """The spec_tree_tps rows at every depth whose start point was made (the others were skipped
    with their reason already), as plain passes of the backend (the tree decoder keeps the MTP
    cache itself), after everything else: each run resets the engine."""
    from . import spec
    from .spec import main_model_only

    rows = [r for r in rows if r[1]["depth"] in points]
    if not rows:
        return
    vocab = vocab_text = None
    if getattr(be, "has_mtp", False):
        try:
            vocab, vocab_text = spec.draft_vocab(args.model, be.n_vocab)
        except Exception as exc:  # noqa: BLE001
            for metric, params in rows:
                out.skip(metric, params, f"draft vocabulary of {args.model}: {type(exc).__name__}: {exc}")
            return
    with main_model_only(be):
        for d in sorted({p["depth"] for _, p in rows}):
            tree_phase(be, args, out, [r for r in rows if r[1]["depth"] == d], points[d], vocab, vocab_text,
                       time_left, prefill_seconds=d / fill_rate if fill_rate else 0.0)


def fill_note(be) -> str:
    from ..backends.native import CALL_POSITIONS

    if getattr(be, "batched_prefill", False):
        return f"state filled by oj_prefill, passes of {be.prefill_chunk} positions"
    return f"state filled {CALL_POSITIONS} positions per call (no oj_prefill)"


def _main_model_start(be, fill: Filler) -> None:
    """A fresh state whose MTP cache stays behind: the first positions through oj_eval with no MTP
    row (main_model_only), so the engine's prefill never makes MTP rows after it (it follows the
    MTP cache only when that ends at n_past). llama.cpp runs no MTP block either."""
    from ..backends.native import CALL_POSITIONS

    fill.reset()
    toks = fill.rng.integers(0, be.n_vocab, size=CALL_POSITIONS).tolist()
    be.eval_argmax(toks)
    fill.appended += toks


def prefill_phase(be, rows: list[tuple[int, int]], args, out: Emitter, fill: Filler, rng, time_left) -> None:
    """prefill_tps rows, by increasing depth: one fill from a reset (main model only, the MTP cache
    left behind: _main_model_start), a checkpoint at each depth, and the timed appends from it
    (bench/prefill.py). Each row is a result or a skip with its reason."""
    from ..backends.native import CALL_POSITIONS
    from . import prefill
    from .spec import main_model_only, restore_to

    with main_model_only(be):
        _main_model_start(be, fill)
        for i, (n, d) in enumerate(sorted(rows, key=lambda r: (r[1], r[0]))):
            params = {"new_tokens": n, "depth": d}
            if d < CALL_POSITIONS:
                out.skip("prefill_tps", params, f"depth {d}: the first {CALL_POSITIONS} positions go through oj_eval "
                                               "(to keep the MTP block out of the timed prefill); use a depth of at "
                                               f"least {CALL_POSITIONS}")
                continue
            est_fill = fill.estimate(max(0, d - be.n_past)) or 0.0
            est_rows = fill.estimate(n * (args.reps + prefill.PREFILL_WARMUP)) or 0.0
            if est_fill + est_rows + 10 > time_left():
                out.skip("prefill_tps", params, f"out of time: the fill to depth {d} and {args.reps} appends of "
                                               f"{n} tokens take ~{est_fill + est_rows:.0f} s")
                continue
            try:
                if be.n_past > d:
                    _main_model_start(be, fill)
                fill.fill_to(d)
                be.save_checkpoint()
                samples = prefill.prefill_samples(be, n, args.reps, rng, lambda d=d: restore_to(be, d))
                restore_to(be, d)
            except Exception as exc:  # noqa: BLE001 - the row says why, the rest goes on
                out.skip("prefill_tps", params, f"{type(exc).__name__}: {exc}")
                continue
            out.result("prefill_tps", params, "tokens/s", samples)
    out.emit({"info": {"openjet_prefill_chunk": getattr(be, "prefill_chunk", 0),
                       "openjet_prefill_note": fill_note(be) + "; main model only (no MTP rows)"}})


def run(args, out: Emitter) -> int:
    from ..backends.native import MAX_POSITIONS, NativeBackend, native_status
    from ..model_file import open_model
    from .spec import main_model_only, restore_to

    def time_left() -> float:
        return args.deadline - time.time() if args.deadline else float("inf")

    accept = _pairs(args.accept, "--accept")
    accept_trees = _pairs(args.accept_trees, "--accept-trees", "BUDGET")
    if accept or accept_trees:
        from . import acceptance
        acceptance.measure(args.model, accept, args.accept_prompts, args.accept_prompt_tokens,
                           args.accept_tokens, out, time_left, trees=accept_trees)
        return 0

    verify = _ints(args.verify)
    depths = _ints(args.decode_depths)
    if depths != sorted(set(depths)):
        raise ValueError(f"--decode-depths must be increasing, got {depths}")
    spec_todo = spec_rows(_pairs(args.spec, "--spec"), _mtp_items(args.spec_mtp, args.spec_depth), args.spec_depth,
                          _tree_items(args.spec_tree, args.spec_depth))
    spec_depths = sorted({p["depth"] for _, p in spec_todo})
    from .prefill import parse_rows
    prefill_todo = parse_rows(args.prefill)
    planned = ([(m, {"positions": p, "depth": args.verify_depth}) for p in verify for m in ("verify_ms", "projection_gbps")]
               + [("decode_tps", {"depth": d}) for d in depths] + spec_todo
               + [("prefill_tps", {"new_tokens": n, "depth": d}) for n, d in prefill_todo])
    if not planned:
        return 0

    def skip_all(reason: str, which=None) -> None:
        for metric, params in (planned if which is None else which):
            out.skip(metric, params, reason)

    too_many = [p for p in verify if not 1 <= p <= MAX_POSITIONS]
    if too_many:
        raise ValueError(f"--verify: positions {too_many} outside 1..{MAX_POSITIONS} (one native call)")
    # a tree of budget B drafts up to B - 1 tokens deep
    max_drafts = max([p["drafts"] if "drafts" in p else p["budget"] - 1 for _, p in spec_todo], default=0)
    need_ctx = max([args.verify_depth + verify_row_positions(MAX_POSITIONS, args.reps)]
                   + [d + (args.reps + 1) * args.decode_tokens + WARMUP_STEPS for d in depths]
                   + [d + args.spec_tokens + max_drafts + 16 for d in spec_depths]
                   + [d + n + 16 for n, d in prefill_todo])
    n_ctx = max(args.n_ctx, need_ctx)
    mf = open_model(args.model)
    ok, why = native_status(mf, n_ctx)
    if not ok:
        skip_all(f"native backend unavailable: {why}")
        return 0
    t0 = time.perf_counter()
    # speculating needs a backend that keeps the MTP cache (draft depth > 0); plain passes switch
    # that off (main_model_only)
    be = NativeBackend(mf, n_ctx, draft_depth=max_drafts, kv_type="f16", seed=0)
    out.emit({"info": {"openjet_load_seconds": round(time.perf_counter() - t0, 2), "openjet_n_ctx": n_ctx,
                       "openjet_memory_bytes": be.memory(), "openjet_backend": why}})
    rng = np.random.default_rng(0)
    fill = Filler(be, rng)
    if prefill_todo:
        prefill_phase(be, prefill_todo, args, out, fill, rng, time_left)

    with main_model_only(be):
        for p in verify:
            params = {"positions": p, "depth": args.verify_depth}
            est = fill.estimate(args.verify_depth)
            if est is not None and est + 5 > time_left():
                for m in ("verify_ms", "projection_gbps"):
                    out.skip(m, params, f"out of time: refilling to depth {args.verify_depth} takes ~{est:.0f} s")
                continue
            fill.reset()
            fill.fill_to(args.verify_depth)
            out.result("verify_ms", params, "ms", verify_samples(be, p, args.reps, rng))
            try:
                samples, table = profiled_samples(be, p, args.reps, rng)
            except Exception as exc:  # noqa: BLE001 - the profile's failure costs its row, not the rest
                out.skip("projection_gbps", params, f"the per-phase profile failed: {type(exc).__name__}: {exc}")
                continue
            out.result("projection_gbps", params, "GB/s", samples)
            from .report import row_key
            out.emit({"info": {PHASES_KEY: {row_key("projection_gbps", ENGINE, params): table}}})

    # decode depths and the speculative rows' depths, in order; the state only grows between them,
    # filled with the shared sequence (one token more: the current token at the deepest depth)
    targets = sorted(set(depths) | set(spec_depths))

    def spec_at(d: int) -> list[tuple[str, dict]]:
        return [r for r in spec_todo if r[1]["depth"] == d]

    def rows_at(d: int) -> list[tuple[str, dict]]:
        return ([("decode_tps", {"depth": d})] if d in depths else []) + spec_at(d)

    from .spec import prompt_tokens
    points: dict[int, object] = {}          # depth -> its speculative start point (the tree rows')
    fill.reset()
    fill.source = prompt_tokens(be.n_vocab, max(targets, default=0) + 1)
    for i, d in enumerate(targets):
        todo = max(0, d - be.n_past)
        est = fill.estimate(todo) or 0.0
        if est + 30 > time_left():
            rate = fill.rate
            skip_all(f"out of time: filling the state to depth {d} would take "
                     f"~{est:.0f} s at {rate or 0:.0f} tokens/s ({fill_note(be)})",
                     [r for x in targets[i:] for r in rows_at(x)])
            break
        if spec_depths and d <= spec_depths[-1]:
            fill.fill_to(d)                        # with MTP rows: the speculative rows need them
        else:
            with main_model_only(be):
                fill.fill_to(d)
        be.save_checkpoint()
        if d in depths:
            first = int(rng.integers(0, be.n_vocab))
            with main_model_only(be):
                samples = decode_samples(be, args.decode_tokens, args.reps, first,
                                         restore=lambda d=d: restore_to(be, d))
            out.result("decode_tps", {"depth": d}, "tokens/s", samples)
            restore_to(be, d)
        if spec_at(d):
            point = spec_phase(be, args, out, spec_at(d), fill.appended[:d], fill.source[d], time_left)
            if point is not None:
                points[d] = point
            restore_to(be, d)
    if fill.rate:
        out.emit({"info": {"openjet_fill_tps": round(fill.rate, 1), "openjet_fill_note": fill_note(be)}})
    trees_last(be, args, out, [r for r in spec_todo if r[0] == "spec_tree_tps"], points, fill.rate, time_left)
    be.close()
    mf.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.bench.ours")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--verify", default="1,2,3,4,5")
    ap.add_argument("--verify-depth", type=int, default=1024)
    ap.add_argument("--decode-depths", default="0,8192,30720")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--spec", default="", help="oracle rows as ACCEPTANCE:DRAFTS items, e.g. 0.8:4,0.9:4")
    ap.add_argument("--spec-mtp", default="", help="MTP-head rows as DRAFTS (at --spec-depth) or DRAFTS@DEPTH "
                                                   "items, e.g. 1,2,3,4 or 1@0,1@8192")
    ap.add_argument("--spec-tree", default="", help="draft-tree rows as BUDGET[:SHAPE][@DEPTH] items (SHAPE: q or "
                                                    "calibrated; DEPTH: --spec-depth), e.g. 8,8@0")
    ap.add_argument("--spec-depth", type=int, default=8192)
    ap.add_argument("--spec-tokens", type=int, default=128)
    ap.add_argument("--prefill", default="", help="prefill_tps rows as NEW_TOKENS:DEPTH items, e.g. 2700:1800")
    ap.add_argument("--accept", default="", help="accepted_per_cycle rows as TEMPERATURE:DRAFTS items (--model: "
                                                 "the trained default model); nothing else runs")
    ap.add_argument("--accept-trees", default="", help="tree_accepted_per_cycle rows as TEMPERATURE:BUDGET items "
                                                       "(with --accept's model and prompts)")
    ap.add_argument("--accept-prompts", type=int, default=12)
    ap.add_argument("--accept-prompt-tokens", type=int, default=64)
    ap.add_argument("--accept-tokens", type=int, default=64)
    ap.add_argument("--n-ctx", type=int, default=0, help="default: what the depths need")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds; 0 = none")
    args = ap.parse_args(argv)
    out = Emitter(args.out)
    try:
        return run(args, out)
    except Exception as exc:  # noqa: BLE001 - the parent records why, then carries on with the peer
        out.emit({"error": f"{type(exc).__name__}: {exc}"})
        print(f"openjet bench (ours): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
