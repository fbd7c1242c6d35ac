"""One prefill piece on the native engine, for a per-kernel profile (`bash scripts/gpu.sh prefill-kernels`).

    python scripts/prefill_piece.py MODEL [--positions 64] [--depth 4096]
        fills the state to DEPTH with random tokens (the main model alone, as the bench's
        prefill_tps rows), times three pieces of POSITIONS tokens, then runs one more inside the
        CUDA profiler range (cudaProfilerStart / Stop), which `ncu --profile-from-start off` records.
    python scripts/prefill_piece.py --summary NCU_CSV
        the per-kernel totals of an `ncu --csv --page raw --metrics gpu__time_duration.sum,
        dram__bytes_read.sum,dram__bytes_write.sum` log (scripts/phase_breakdown.py reads it):
        milliseconds and launches per kernel name, largest first, and the sum.

A piece of 64 positions is what a prompt contributes to each pass beside decoding streams (the
latency row of issue 29); the kernels are serialised under ncu, so the sum is above the wall time.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import phase_breakdown  # noqa: E402 - scripts/ is not a package: the ncu CSV reader beside it


def kernel_totals(csv_path: Path) -> tuple[list[tuple[str, int, float]], float]:
    """(kernel name without its arguments, launches, ms) largest first, and the total ms, from an
    `ncu --csv --page raw` log read by phase_breakdown.parse_ncu_csv (units, the header, the
    program's own lines); a log it cannot read raises ValueError naming the file."""
    kernels = phase_breakdown.parse_ncu_csv(csv_path.read_text(errors="replace"), str(csv_path))
    if not kernels:
        raise ValueError(f"{csv_path}: no kernel rows")
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        name = k.name.split("(")[0].strip()
        agg[name][0] += 1
        agg[name][1] += 1e3 * k.time_s
    out = sorted(((k, n, ms) for k, (n, ms) in agg.items()), key=lambda x: -x[2])
    return out, sum(ms for _, _, ms in out)


def profile_piece(model: str, positions: int, depth: int) -> None:
    import cupy   # the GPU machine's image has it; the profiler range is all it is used for

    from openjet_plugin.backends.native import CALL_POSITIONS, NativeBackend
    from openjet_plugin.bench.spec import main_model_only
    from openjet_plugin.model_file import open_model

    be = NativeBackend(open_model(model), depth + 5 * positions + 16, draft_depth=0, kv_type="f16", seed=0)
    rng = np.random.default_rng(0)
    with main_model_only(be):
        be.eval_argmax(rng.integers(0, be.n_vocab, size=CALL_POSITIONS).tolist())
        if depth > CALL_POSITIONS:
            be.eval_argmax(rng.integers(0, be.n_vocab, size=depth - CALL_POSITIONS).tolist())
        for _ in range(3):
            t = time.perf_counter()
            be.eval_argmax(rng.integers(0, be.n_vocab, size=positions).tolist())
            print(f"piece of {positions} at depth ~{depth}: {(time.perf_counter() - t) * 1e3:.2f} ms", flush=True)
        cupy.cuda.runtime.profilerStart()
        be.eval_argmax(rng.integers(0, be.n_vocab, size=positions).tolist())
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.runtime.profilerStop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--summary", type=Path, help="print the per-kernel totals of this ncu CSV log")
    a = ap.parse_args(argv)
    if a.summary:
        try:
            kernels, total = kernel_totals(a.summary)
        except (OSError, ValueError) as e:
            print(f"prefill_piece: {e}", file=sys.stderr)
            return 1
        print(f"total {total:.3f} ms over {sum(n for _, n, _ in kernels)} kernels")
        for name, n, ms in kernels:
            print(f"{ms:9.3f} ms {n:5d}x  {name}")
        return 0
    if not a.model:
        ap.error("MODEL is needed (or --summary NCU_CSV)")
    if a.positions < 1:
        ap.error(f"--positions must be >= 1, got {a.positions}")
    from openjet_plugin.backends.native import CALL_POSITIONS

    if a.depth < CALL_POSITIONS:   # the state starts with one oj_eval of that many (the main model alone)
        ap.error(f"--depth {a.depth}: the first {CALL_POSITIONS} positions go through oj_eval")
    profile_piece(a.model, a.positions, a.depth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
