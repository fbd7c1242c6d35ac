"""Time greedy speculative cycles on one model, the multi-kernel path against the persistent kernel
(OJ_PERSISTENT=1: oj_cycle as one launch), one engine after the other in this process: the MTP
head's own drafts and oracle drafts at a forced acceptance, tokens per second and milliseconds per
cycle (medians of `--reps` runs), with plain one-token decoding as the baseline of the same engine.
Every run's tokens are checked against the plain greedy continuation (a difference is reported: a
near-tie between a verify pass and a one-token pass, or a bug). A quick A/B for the device;
`openjet bench` is the measurement of record.

    python scripts/cycle_time.py MODEL.gguf [--depth 1024] [--tokens 128] [--drafts 4] [--rates 0.8]
    OJ_PERSISTENT_PROFILE=/tmp/p.jsonl python scripts/cycle_time.py ... ; python scripts/persistent_profile.py /tmp/p.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(path: str, mode: str, a) -> dict:
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.bench import spec
    from openjet_plugin.model_file import open_model
    from openjet_plugin.speculative import DepthPolicy
    from openjet_plugin.speculative_native import NativeSpeculator

    os.environ["OJ_PERSISTENT"] = mode
    mf = open_model(path)
    be = NativeBackend(mf, n_ctx=a.depth + 2 * a.tokens + 64, draft_depth=a.drafts)
    try:
        active, why = be.persistent_info()
        rng = np.random.default_rng(0)
        history = [int(t) for t in rng.integers(0, be.n_vocab, a.depth)]
        be.eval(history)
        be.save_checkpoint()
        point = spec.start_point(be, a.depth, history, int(rng.integers(0, be.n_vocab)), 2 * a.tokens)
        vocab, _ = spec.draft_vocab(path, be.n_vocab)
        rows = {"plain": {"tok_s": round(point.plain_tps, 2)}}

        def measure(name, make):
            samples, details = spec.measure_row(be, make, point, a.drafts, a.tokens, a.reps, 16)
            rows[name] = {"tok_s": round(statistics.median(samples), 2), "tok_s_all": [round(x, 2) for x in samples],
                          "ms_cycle": round(statistics.median(details["ms_per_cycle"]), 3),
                          "tokens_per_cycle": details["tokens_per_cycle"],
                          "runs_differing_from_plain": details["runs_differing_from_plain"],
                          "first_difference": details["first_difference"]}

        measure("mtp", lambda rep: NativeSpeculator(be, DepthPolicy(a.drafts, adaptive=False),
                                                     vocab.copy() if vocab is not None else None))
        for rate in a.rates:
            measure(f"oracle_{rate}", spec.oracle_factory(be, point, rate, a.drafts))
        return {"mode": mode, "active": active, "why": why, "fused": bool(getattr(be, "supports_cycle", False)),
                "rows": rows}
    finally:
        be.close()
        mf.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.8])
    ap.add_argument("--modes", default="0,1")
    a = ap.parse_args()
    out = [run(a.model, m, a) for m in a.modes.split(",")]
    for r in out:
        print(json.dumps(r))
    if len(out) == 2:
        for name in out[0]["rows"]:
            x, y = out[0]["rows"][name]["tok_s"], out[1]["rows"][name]["tok_s"]
            print(f"{name}: multi-kernel {x} tok/s, persistent {y} tok/s ({y / x:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
