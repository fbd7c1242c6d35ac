"""The passes whose phases scripts/phase_breakdown.py tables (issue 8), on the native engine.

Loads the model (default: the generated q27b, found or made as openjet bench does)
into one NativeBackend (n_ctx 4096, draft depth 4), evaluates a 512-token random prompt, saves a
checkpoint there, and then for each group restores that checkpoint and runs its passes:

  decode1   verify(1 token) + commit(1), the main model alone (no MTP rows: as a plain decode step)
  verify5   verify(5 tokens) + commit(5), the main model alone (the verification of D = 4 drafts)
  mtp       MTP draft steps of one position: draft_first (h = the main model's hidden) then
            draft_next (h = the MTP block's own output), as a speculative cycle drafts

Profile mode (default; run under `ncu --profile-from-start off`): one warm-up pass of the group
outside the window, then --reps passes between cuProfilerStart and cuProfilerStop (the driver's
profiler API through ctypes, so only these passes are profiled). Time mode (--time N): no
profiler calls; N passes of each group, each timed on the host clock. Every backend call ends
with a stream synchronisation in the engine, so the host time around a call is the pass's wall
time, launches and host work included. The JSON (--out) has each pass's microseconds.

    ncu --profile-from-start off ... python scripts/phase_probe.py --group decode1 --reps 3
    python scripts/phase_probe.py --time 20 --out timing.json
    python scripts/phase_probe.py --print-model          # the model path (generated if missing)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GROUPS = ("decode1", "verify5", "mtp")
DRAFT_DEPTH = 4
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def find_model(cache: Path) -> Path:
    """The bench's generated q27b, else scripts/native_q27b.py's, else generated into the cache."""
    for p in (cache / "q27b-Q4_K_M-seed0.gguf", Path("/tmp/q27b.gguf")):
        if p.is_file():
            return p
    from openjet_plugin.bench.runner import default_model as generate

    return generate(cache, log)


# --- the profiler window ------------------------------------------------------------------------

class ProfilerWindow:
    """cuProfilerStart/Stop of the current context. The driver library first (it is wherever the
    GPU works, and the engine's runtime has made its primary context current on this thread),
    then the runtime libraries that may be on the path (system, torch's, the nvidia wheels')."""

    def __init__(self):
        self.lib, self.start_fn, self.stop_fn, self.tried = None, None, None, []
        for name, start, stop in self._candidates():
            try:
                lib = ctypes.CDLL(name)
                s, e = getattr(lib, start), getattr(lib, stop)
            except (OSError, AttributeError) as err:
                self.tried.append(f"{name}: {err}")
                continue
            s.restype = e.restype = ctypes.c_int
            self.lib, self.start_fn, self.stop_fn, self.name = lib, s, e, name
            return
        raise RuntimeError("no CUDA profiler API found (tried: " + "; ".join(self.tried) + ")")

    @staticmethod
    def _candidates():
        yield "libcuda.so.1", "cuProfilerStart", "cuProfilerStop"
        yield "libcuda.so", "cuProfilerStart", "cuProfilerStop"
        names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
        try:
            import importlib.util

            for pkg in ("torch", "nvidia.cuda_runtime"):
                spec = importlib.util.find_spec(pkg)
                if spec and spec.submodule_search_locations:
                    for root in spec.submodule_search_locations:
                        lib = Path(root) / "lib"
                        names += sorted(str(p) for p in lib.glob("libcudart.so*"))
        except (ImportError, ValueError):
            pass
        for n in names:
            yield n, "cudaProfilerStart", "cudaProfilerStop"

    @contextmanager
    def window(self):
        rc = self.start_fn()
        if rc != 0:
            raise RuntimeError(f"{self.name}: profiler start returned {rc}")
        try:
            yield
        finally:
            rc = self.stop_fn()
            if rc != 0:
                raise RuntimeError(f"{self.name}: profiler stop returned {rc}")


# --- the groups -----------------------------------------------------------------------------------

class Probe:
    def __init__(self, model: Path, n_ctx: int, prompt: int, seed: int):
        from openjet_plugin.backends.native import NativeBackend
        from openjet_plugin.model_file import open_model

        self.rng = np.random.default_rng(seed)
        self.mf = open_model(model)
        t0 = time.perf_counter()
        self.be = NativeBackend(self.mf, n_ctx=n_ctx, draft_depth=DRAFT_DEPTH)
        log(f"loaded {model.name} in {time.perf_counter() - t0:.1f} s")
        if not self.be.supports_speculative:
            log("the model has no MTP block: the mtp group is skipped")
        self.vocab = self.be.n_vocab
        t0 = time.perf_counter()
        self.be.eval(self.tokens(prompt))
        log(f"prompt of {prompt} tokens in {time.perf_counter() - t0:.1f} s")
        self.be.save_checkpoint()
        self.depth = self.be.n_past

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, self.vocab, n)]

    def restore(self) -> None:
        got = self.be.restore_checkpoint(self.depth)
        if got != self.depth:
            raise RuntimeError(f"checkpoint restore gave n_past {got}, expected {self.depth}")

    def passes(self, group: str):
        """A generator of callables, one pass each, from the checkpoint."""
        be = self.be
        if group in ("decode1", "verify5"):
            n = 1 if group == "decode1" else DRAFT_DEPTH + 1

            def step(toks):
                be.verify(toks)
                be.commit(n)
            while True:       # tokens drawn before the pass, outside its time
                yield lambda t=self.tokens(n): step(t)
        elif group == "mtp":
            if not be.supports_speculative:
                raise RuntimeError("the mtp group needs a model with an MTP block")
            pos = be.n_past

            yield lambda t=self.tokens(1)[0]: be.draft_first(t)
            k = 1
            while True:       # chained steps at the next MTP positions, as a cycle drafts
                yield lambda t=self.tokens(1)[0], p=pos + k: be.draft_next(t, p)
                k += 1
        else:
            raise ValueError(f"group {group!r} is not one of {', '.join(GROUPS)}")

    @contextmanager
    def main_only(self, group: str):
        """Main-model groups run as a plain decode (no MTP rows), as bench/spec.main_model_only."""
        was = self.be.supports_speculative
        if group != "mtp":
            self.be.supports_speculative = False
        try:
            yield
        finally:
            self.be.supports_speculative = was

    def run(self, group: str, reps: int, window=None) -> list[float]:
        times = []
        with self.main_only(group):
            self.restore()
            warm = self.passes(group)
            next(warm)()                 # lazy set-up (the int8 path's buffers, occupancy queries)
            self.restore()
            gen = self.passes(group)
            steps = [next(gen) for _ in range(reps)]
            if window is not None:
                with window():
                    for s in steps:
                        s()
            else:
                for s in steps:
                    t0 = time.perf_counter_ns()
                    s()
                    times.append((time.perf_counter_ns() - t0) / 1e3)
        return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("OPENJET_CACHE_DIR", REPO / "build" / "cache")) / "bench")
    ap.add_argument("--group", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    ap.add_argument("--reps", type=int, default=3, help="passes per group inside the profiler window")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="time N passes per group instead (no profiler)")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON of the run (timing mode: wall µs per pass)")
    ap.add_argument("--print-model", action="store_true", help="print the model path (generating it) and exit")
    args = ap.parse_args(argv)

    model = args.model or find_model(args.cache)
    if args.print_model:
        print(model)
        return 0
    groups = [g.strip() for g in args.group.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"--group {bad[0]!r} is not one of {', '.join(GROUPS)}")
    if args.reps < 1 or args.time < 0:
        ap.error("--reps must be >= 1 and --time >= 0")
    if args.prompt < 1 or args.prompt + max(args.reps, args.time) * (DRAFT_DEPTH + 2) + 8 > args.n_ctx:
        ap.error(f"--prompt {args.prompt} and the passes do not fit --n-ctx {args.n_ctx}")

    probe = Probe(model, args.n_ctx, args.prompt, args.seed)
    if not probe.be.supports_speculative and "mtp" in groups:
        groups.remove("mtp")
    res = {"model": str(model), "depth": probe.depth, "n_ctx": args.n_ctx,
           "matvec_path": "f16", "groups": {}}
    if args.time:
        for g in groups:
            us = probe.run(g, args.time)
            res["groups"][g] = {"wall_us": us, "median_us": statistics.median(us)}
            log(f"{g}: median {statistics.median(us):.1f} µs per pass over {len(us)}")
    else:
        win = ProfilerWindow()
        log(f"profiler window through {win.name}")
        for g in groups:
            probe.run(g, args.reps, window=win.window)
            res["groups"][g] = {"reps": args.reps}
            log(f"{g}: {args.reps} passes profiled")
    probe.be.close()
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "groups"} |
                     {"groups": {g: v.get("median_us", v.get("reps")) for g, v in res["groups"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
