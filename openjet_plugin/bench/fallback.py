"""The fallback's decode rate: openjet's llama.cpp backend (LlamaCppBackend, as `backend="llama.cpp"`
runs it) on the CUDA libllama the peer build made, in a child process (LLAMA_CPP_LIB_PATH must be
set before llama_cpp is imported). Compared with llama-bench's decode on the same file in the same
run, it shows what our Python layer costs over llama.cpp itself, and that every layer is on the GPU.

One sample = `tokens` single-token greedy steps from an empty state (the token after each one is
the argmax of its logits, as the engine's greedy decoding does) / their time, like llama-bench's
`-n tokens` at depth 0. Writes JSON lines: {"metric", "params", "samples"} and {"info"}.
"""

from __future__ import annotations

import argparse
import json
import time


def measure(model: str, tokens: int, reps: int) -> tuple[list[float], str, int]:
    from openjet_plugin.backends.llama_cpp import LlamaCppBackend
    from openjet_plugin.model_file import read_foreign

    be = LlamaCppBackend(model, tokens + 64, n_layers=read_foreign(model).n_layers)
    try:
        samples = []
        for rep in range(reps + 1):            # the first repetition is the warm-up
            be.reset()
            tok = 0
            t0 = time.perf_counter()
            for _ in range(tokens):
                tok = be.eval_argmax([tok])
            dt = time.perf_counter() - t0
            if rep:
                samples.append(tokens / dt)
        return samples, be.placement.where, be.placement.n_gpu_layers
    finally:
        be.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    samples, where, layers = measure(args.model, args.tokens, args.reps)
    with open(args.out, "a") as fh:
        fh.write(json.dumps({"metric": "fallback_decode_tps", "params": {"depth": 0}, "samples": samples}) + "\n")
        fh.write(json.dumps({"info": {"fallback": {"where": where, "n_gpu_layers": layers}}}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
