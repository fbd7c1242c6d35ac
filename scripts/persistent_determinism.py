"""Is the persistent kernel deterministic, and where do its greedy continuations part from the
multi-kernel path's? Generates 20 prompts x 128 tokens greedily on a generated model three times
(OJ_PERSISTENT=1 twice, on fresh engines; OJ_PERSISTENT=0 once) and prints, per pair, how many
continuations differ and the first differing token of each. A diagnostic for the device.

    python scripts/persistent_determinism.py [tiny-Q4_K_M] [--depth 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def generate(path: Path, prompts: list[list[int]], mode: str, depth: int) -> list[list[int]]:
    import openjet_plugin

    os.environ["OJ_PERSISTENT"] = mode
    eng = openjet_plugin.load(model_path=str(path), backend="native", n_ctx=1024, draft_depth=depth)
    try:
        return [list(eng.generate(p, max_tokens=128, temperature=0).tokens) for p in prompts]
    finally:
        eng.close()


def diff(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    out = []
    for k, (x, y) in enumerate(zip(a, b)):
        for i, (s, t) in enumerate(zip(x, y)):
            if s != t:
                out.append((k, i))
                break
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="tiny-Q4_K_M")
    ap.add_argument("--depth", type=int, default=0)
    a = ap.parse_args()
    import test_native_gpu as tg

    preset, quant = a.model.split("-", 1)
    path, _ = tg.model_path(preset, quant, Path(tempfile.mkdtemp()))
    rng = np.random.default_rng(42)
    from openjet_plugin.model_file import open_model

    with open_model(path) as mf:
        n_vocab = mf.config.n_vocab
    prompts = [rng.integers(0, n_vocab, int(rng.integers(4, 40))).tolist() for _ in range(20)]
    p1 = generate(path, prompts, "1", a.depth)
    p2 = generate(path, prompts, "1", a.depth)
    m0 = generate(path, prompts, "0", a.depth)
    print(json.dumps({"model": a.model, "depth": a.depth, "persistent_vs_persistent": diff(p1, p2),
                      "persistent_vs_multi": diff(p1, m0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
