"""Bit-for-bit comparison of two native libraries: the correctness gate of a kernel A/B. A candidate
that changes no arithmetic (a load order, a launch shape, where a sum is staged) must give the
logits of the library it is measured against bit for bit; one that changes the arithmetic is judged
by top-1 and KL instead.

    OPENJET_NATIVE_LIB=A.so python -m openjet_plugin.bench.bits dump --model M --out a.npz
    OPENJET_NATIVE_LIB=B.so python -m openjet_plugin.bench.bits dump --model M --out b.npz
    python -m openjet_plugin.bench.bits compare a.npz b.npz

dump (a GPU): TOKENS seeded token ids evaluated in calls of 8, 5 and 1 positions (the main model's
logits, the first COLUMNS of each row: the argmax and the mass of a random-weight model's rows lie
anywhere, and 65,536 columns of every row keep a file small), and the MTP block's draft logits over
the same tokens, 8 at a time. `--depth D` puts D other seeded tokens before them (one prefill, the same
for every call size), so that attention runs over D + 1.. positions in several splits: what a
change to the split merge needs to be compared on (at depth 0 every call has one split).
compare: whether each file's calls of 8, 5 and 1 positions agree bit for bit (the engine's own
invariant: the number of positions per call never changes a result), then per row set (main, mtp)
whether the two files' rows are bit-identical, with top-1 agreement, KL(a || b) and the largest
absolute difference. Exit status 0 when every row set is bit-identical and both files keep the
invariant, 1 otherwise, 2 when a file is missing or is not a dump, or dump's model or
library is refused (named on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from .agreement import log_softmax

TOKENS = 40
COLUMNS = 65536
CALL_SIZES = (8, 5, 1)


def dump(model: Path, out: Path, seed: int = 7, depth: int = 0) -> dict[str, np.ndarray]:
    """The rows `compare` reads, from the native backend (OPENJET_NATIVE_LIB picks the library),
    after `depth` prefilled tokens."""
    from ..backends.native import NativeBackend
    from ..model_file import open_model

    if depth < 0:
        raise ValueError(f"--depth must be >= 0, got {depth}")
    be = NativeBackend(open_model(Path(model)), n_ctx=depth + 512)
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.integers(0, be.n_vocab, TOKENS)]
    prefix = [int(t) for t in rng.integers(0, be.n_vocab, depth)]
    cols = min(COLUMNS, be.n_vocab)

    def start() -> None:
        be.reset()
        if prefix:
            be._eval_chunks(prefix)

    main = []
    for size in CALL_SIZES:   # the same tokens in calls of 8, 5 and 1 positions
        start()
        main.append(be.eval_all_logits(toks, positions_per_call=size)[:, :cols])
    rows = {"main": np.stack(main)}
    if be.supports_speculative:
        start()
        mtp = []
        for a in range(0, TOKENS, 8):
            chunk = toks[a:a + 8]
            be._eval_chunk(chunk)
            be.mtp_eval(chunk, pos0=depth + a, h="main")
            mtp.append(np.stack([be.draft_logits(j)[:cols] for j in range(len(chunk))]))
        rows["mtp"] = np.concatenate(mtp)
    np.savez(out, **rows)
    return rows


def calls_agree(rows: dict[str, np.ndarray]) -> bool:
    """Whether a dump's calls of 8, 5 and 1 positions gave the same bits."""
    z = rows["main"]
    return all(np.array_equal(z[0], z[i]) for i in range(1, len(z)))


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per row set both dumps hold: bit-identical, top-1, mean / max KL(a || b), max |a - b|."""
    out = {}
    for key in ("main", "mtp"):
        if key not in a or key not in b:
            continue
        x, y = a[key].reshape(-1, a[key].shape[-1]), b[key].reshape(-1, b[key].shape[-1])
        if x.shape != y.shape:
            raise BitsError(f"{key}: rows of shape {x.shape} against {y.shape}: dumps of other models or settings")
        pa, pb = log_softmax(x), log_softmax(y)
        kl = (np.exp(pa) * (pa - pb)).sum(-1)
        out[key] = {"rows": int(len(x)), "bit_identical": bool(np.array_equal(x, y)),
                    "top1": float((x.argmax(-1) == y.argmax(-1)).mean()),
                    "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                    "max_abs": float(np.abs(x.astype(np.float64) - y).max())}
    return out


class BitsError(ValueError):
    """A dump that is missing, not a dump, or not comparable with the other one."""


def _load(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path) as z:
            rows = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise BitsError(f"{path}: not a dump that `bits dump` wrote ({e})") from None
    main = rows.get("main")
    if main is None or main.ndim != 3 or len(main) != len(CALL_SIZES):
        raise BitsError(f"{path}: no 'main' rows of {len(CALL_SIZES)} call sizes "
                        f"(holds {sorted(rows) or 'nothing'}): not a dump that `bits dump` wrote")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.bench.bits", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="this library's rows (a GPU; OPENJET_NATIVE_LIB picks the library)")
    d.add_argument("--model", required=True, type=Path)
    d.add_argument("--out", required=True, type=Path)
    d.add_argument("--depth", type=int, default=0, help="tokens prefilled before the compared ones (default 0)")
    c = sub.add_parser("compare", help="two dumps: exit 0 when they are bit-identical (and each keeps the invariant)")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        from ..errors import OpenJetError

        try:
            rows = dump(args.model, args.out, depth=args.depth)
        # a model missing or refused, no GPU, an unwritable --out, a negative --depth
        except (OpenJetError, OSError, ValueError) as e:
            print(f"bits: error: {e}", file=sys.stderr)
            return 2
        print(f"bits: {args.out}: " + ", ".join(f"{k} {v.shape}" for k, v in rows.items()))
        return 0
    try:
        a, b = _load(args.a), _load(args.b)
        result = compare(a, b)
    except BitsError as e:
        print(f"bits: error: {e}", file=sys.stderr)
        return 2
    for name, rows in ((args.a, a), (args.b, b)):
        print(f"{name}: calls of {' / '.join(map(str, CALL_SIZES))} positions bit-identical: {calls_agree(rows)}")
    for key, r in result.items():
        print(f"{key}: rows {r['rows']} bit-identical {r['bit_identical']} top1 {r['top1']:.4f} "
              f"KL mean {r['kl_mean']:.3e} max {r['kl_max']:.3e} max|d| {r['max_abs']:.3e}")
    same = bool(result) and all(r["bit_identical"] for r in result.values())
    return 0 if same and calls_agree(a) and calls_agree(b) else 1


if __name__ == "__main__":
    sys.exit(main())
