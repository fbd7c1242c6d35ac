"""Our engine's measurements, run in a child process of `openjet bench` (so that its peak GPU
memory is its own and a fault cannot take the benchmark down):

    python -m openjet_plugin.bench.ours --model M --out RECORDS.jsonl [--verify 1,2,3,4,5]
        [--verify-depth 1024] [--decode-depths 0,8192,30720] [--decode-tokens 128] [--reps 6]
        [--deadline EPOCH_SECONDS]

It talks to the native backend directly (`backends/native.py`), the layer under the engine API
that holds the model state, so that what is timed is the engine's work and not sampling on the
host — the same boundary llama-bench times for llama.cpp (llama_decode + synchronize).

- decode_tps at depth d: the state is filled to d with random tokens, then each repetition is
  128 single-token steps feeding back the greedy token (`eval_argmax`, which waits for the GPU);
  one sample = 128 / elapsed. v1 cannot roll the recurrent state back, so repetition r starts at
  d + (warm-up + r) * 128 rather than exactly d (llama-bench restores a saved state); at 8K and
  30K that adds under 10% more attention reads to a pass dominated by 15.8 GB of weights.
- verify_ms for P positions at depth 1024: one `oj_eval` of P tokens plus the copy of their
  argmax to the host, i.e. one verification pass; the state is reset and refilled to the depth
  for every P.

Every result line is a JSON object {"metric", "engine", "params", "unit", "samples"}; lines
{"skip": {...}, "reason"} name a measurement that was not made, and {"info": {...}} carries facts
for the manifest (memory report, fill rate).
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


class Filler:
    """Appends random tokens (as llama-bench does) in the largest chunks the engine takes, and keeps
    the rate so the caller can tell whether a fill fits the time left."""

    def __init__(self, backend, rng: np.random.Generator):
        self.be = backend
        self.rng = rng
        self.tokens = 0
        self.seconds = 0.0

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens >= 64 else None

    def estimate(self, n: int) -> float | None:
        r = self.rate
        return None if r is None else n / r

    def fill_to(self, depth: int) -> None:
        from ..backends.native import MAX_POSITIONS

        while self.be.n_past < depth:
            n = min(MAX_POSITIONS * 64, depth - self.be.n_past)
            toks = self.rng.integers(0, self.be.n_vocab, size=n).tolist()
            t0 = time.perf_counter()
            self.be.eval_argmax(toks)
            self.seconds += time.perf_counter() - t0
            self.tokens += n


def decode_samples(be, n_tokens: int, reps: int, first: int) -> list[float]:
    tok = first
    for _ in range(WARMUP_STEPS):
        tok = be.eval_argmax([tok])
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            tok = be.eval_argmax([tok])
        samples.append(n_tokens / (time.perf_counter() - t0))
    return samples


def verify_samples(be, positions: int, reps: int, rng: np.random.Generator) -> list[float]:
    samples = []
    for r in range(-2, reps):                      # two warm-up passes
        toks = rng.integers(0, be.n_vocab, size=positions).tolist()
        t0 = time.perf_counter()
        be.eval_argmax(toks)                       # one oj_eval (positions <= 8) + argmax copy
        dt = time.perf_counter() - t0
        if r >= 0:
            samples.append(dt * 1e3)
    return samples


def run(args, out: Emitter) -> int:
    from ..backends.native import MAX_POSITIONS, NativeBackend, native_status
    from ..model_file import open_model

    verify = [int(x) for x in args.verify.split(",") if x] if args.verify else []
    depths = [int(x) for x in args.decode_depths.split(",") if x] if args.decode_depths else []
    planned = ([("verify_ms", {"positions": p, "depth": args.verify_depth}) for p in verify]
               + [("decode_tps", {"depth": d}) for d in depths])

    def skip_all(reason: str, which=None) -> None:
        for metric, params in (which or planned):
            out.skip(metric, params, reason)

    too_many = [p for p in verify if not 1 <= p <= MAX_POSITIONS]
    if too_many:
        raise ValueError(f"--verify: positions {too_many} outside 1..{MAX_POSITIONS} (one native call)")
    need_ctx = max([args.verify_depth + MAX_POSITIONS * (args.reps + 2)]
                   + [d + (args.reps + 1) * args.decode_tokens + WARMUP_STEPS for d in depths])
    n_ctx = args.n_ctx or need_ctx
    mf = open_model(args.model)
    ok, why = native_status(mf, n_ctx)
    if not ok:
        skip_all(f"native backend unavailable: {why}")
        return 0
    t0 = time.perf_counter()
    be = NativeBackend(mf, n_ctx, draft_depth=4, kv_type="f16", seed=0)
    out.emit({"info": {"openjet_load_seconds": round(time.perf_counter() - t0, 2), "openjet_n_ctx": n_ctx,
                       "openjet_memory_bytes": be.memory(), "openjet_backend": why}})
    rng = np.random.default_rng(0)
    fill = Filler(be, rng)

    def time_left() -> float:
        return args.deadline - time.time() if args.deadline else float("inf")

    for p in verify:
        params = {"positions": p, "depth": args.verify_depth}
        est = fill.estimate(args.verify_depth)
        if est is not None and est + 5 > time_left():
            out.skip("verify_ms", params, f"out of time: refilling to depth {args.verify_depth} takes ~{est:.0f} s")
            continue
        be.reset()
        fill.fill_to(args.verify_depth)
        out.result("verify_ms", params, "ms", verify_samples(be, p, args.reps, rng))

    be.reset()
    for i, d in enumerate(depths):
        params = {"depth": d}
        todo = max(0, d - be.n_past)
        est = fill.estimate(todo) or 0.0
        if est + 30 > time_left():
            rate = fill.rate
            skip_all(f"out of time: filling the state to depth {d} would take "
                     f"(~{est:.0f} s at {rate or 0:.0f} tokens/s with {MAX_POSITIONS} positions per call; "
                     f"batched prefill is issue 9)", [("decode_tps", {"depth": x}) for x in depths[i:]])
            break
        if be.n_past > d:
            raise ValueError(f"--decode-depths must be increasing, got {depths}")
        fill.fill_to(d)
        first = int(rng.integers(0, be.n_vocab))
        out.result("decode_tps", params, "tokens/s", decode_samples(be, args.decode_tokens, args.reps, first))
    if fill.rate:
        out.emit({"info": {"openjet_fill_tps": round(fill.rate, 1),
                           "openjet_fill_note": f"state filled {MAX_POSITIONS} positions per call (v1)"}})
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
