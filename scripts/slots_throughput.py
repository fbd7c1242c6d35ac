"""Throughput of concurrent requests on one engine's slots against the same requests one after
another (llama.cpp backend): the number behind docs/ARCHITECTURE.md's slot paragraph.

    python scripts/slots_throughput.py                          # the embedded model, 1 thread
    python scripts/slots_throughput.py --model small.gguf --threads 2 --rounds 9

Each round runs 4 greedy requests (--tokens each) one after another, then the same 4 (from a
cleared state) in 4 threads at once, on the same 4-slot engine; the prompts change every round so
nothing is cached. Printed: the median tokens/s of both, the median of the per-round ratios (a
shared machine's noise hits both halves of a round alike) and the scheduler's pass counters.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import openjet_plugin

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n\nclass Config:", "for i in range(10):"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with openjet_plugin.load(args.model, backend="llama.cpp", n_ctx=256, n_threads=args.threads,
                             n_slots=len(PROMPTS)) as eng:
        eng.generate("warm up", max_tokens=4, temperature=0)
        seq, par = [], []
        for r in range(args.rounds):
            prompts = [p + " " * (r + 1) for p in PROMPTS]
            eng._forget_state()
            t0 = time.perf_counter()
            n = sum(len(eng.generate(p, max_tokens=args.tokens, temperature=0).tokens) for p in prompts)
            seq.append(n / (time.perf_counter() - t0))
            eng._forget_state()
            counts: list[int] = []
            threads = [threading.Thread(target=lambda p=p: counts.append(
                len(eng.generate(p, max_tokens=args.tokens, temperature=0).tokens))) for p in prompts]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            par.append(sum(counts) / (time.perf_counter() - t0))
        ratios = [b / a for a, b in zip(seq, par)]
        print(f"{eng.model_path.name}, n_threads={args.threads}: one after another {statistics.median(seq):.0f} tok/s, "
              f"4 at once {statistics.median(par):.0f} tok/s; per-round ratio median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}); passes {eng._backend.pass_counts}")


if __name__ == "__main__":
    main()
