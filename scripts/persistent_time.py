"""Time oj_eval / oj_verify on the multi-kernel path and on the persistent kernel (OJ_PERSISTENT,
native/persistent.cu) for one model, one engine after the other in this process, and compare their
logits on the same tokens (top-1 agreement, KL). A quick A/B for the device; `openjet bench` is the
measurement of record.

    python scripts/persistent_time.py MODEL.gguf [--steps 40] [--verify 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(path: str, mode: str, steps: int, n_verify: int, tokens: list[int]) -> dict:
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    os.environ["OJ_PERSISTENT"] = mode
    mf = open_model(path)
    be = NativeBackend(mf, n_ctx=4096)
    try:
        active, why = be.persistent_info()
        logits = []
        for t in tokens[:16]:            # the first 16 positions one at a time: logits kept
            be._eval_chunk([t])
            logits.append(be.logits(0))
        one = []
        for t in tokens[16:16 + steps]:
            t0 = time.perf_counter()
            be._eval_chunk([t])
            one.append((time.perf_counter() - t0) * 1e3)
        five = []
        for i in range(steps // 2):
            chunk = tokens[16 + steps + i * n_verify:16 + steps + (i + 1) * n_verify]
            t0 = time.perf_counter()
            be.verify(chunk)
            five.append((time.perf_counter() - t0) * 1e3)
            be.commit(1)
        info = be.persistent_info()
    finally:
        be.close()
        mf.close()
    q = lambda v: [round(x, 3) for x in np.percentile(v, [10, 50, 90])]
    return {"mode": mode, "active": active, "why": info[1] if active else why, "eval1_ms_p10_50_90": q(one),
            f"verify{n_verify}_ms_p10_50_90": q(five), "tok_s_1": round(1e3 / statistics.median(one), 2),
            "ratio_verify_to_1": round(statistics.median(five) / statistics.median(one), 3), "logits": np.stack(logits)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--verify", type=int, default=5)
    a = ap.parse_args()
    from openjet_plugin.model_file import open_model

    with open_model(a.model) as mf:
        n_vocab = mf.config.n_vocab
    rng = np.random.default_rng(1)
    tokens = [int(t) for t in rng.integers(0, n_vocab, 16 + a.steps + a.steps // 2 * a.verify)]
    res = [run(a.model, m, a.steps, a.verify, tokens) for m in ("0", "1")]
    ref, got = res[0].pop("logits"), res[1].pop("logits")
    lp = ref - ref.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = got - got.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    for r in res:
        print(json.dumps(r))
    print(json.dumps({"positions": len(ref), "top1": float(np.mean(ref.argmax(-1) == got.argmax(-1))),
                      "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                      "speedup_1": round(res[1]["tok_s_1"] / res[0]["tok_s_1"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
