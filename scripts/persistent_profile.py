"""Per-phase time of the persistent kernel (native/persistent.cu) from OJ_PERSISTENT_PROFILE's file:
each launch's phases (block 0's timer at the end of each phase, the grid barrier included) summed
per label (dn.proj, ffn.down, at.partial, mtp.eh_proj, draft.head.matvec ...), averaged over the
launches of each program (position count, and drafts for oj_cycle's launches), with the weight bytes each matvec phase streams, its rate and its floor at the read bandwidth.

    OJ_PERSISTENT=1 OJ_PERSISTENT_PROFILE=/tmp/prof.jsonl python scripts/persistent_time.py MODEL
    python scripts/persistent_profile.py /tmp/prof.jsonl [--bandwidth 4470] [--skip 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def read_profile(path: str) -> list[dict]:
    """The launches of an OJ_PERSISTENT_PROFILE file; a line that is not one raises ValueError
    naming the file and the line."""
    out = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ok = isinstance(r, dict) and isinstance(r.get("n"), int) and isinstance(r.get("drafts", -1), int) and all(
                    isinstance(ph, list) and len(ph) == 3 and isinstance(ph[0], str) and ph[1] >= 0 and ph[2] >= 0
                    for ph in r["phases"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{no}: not a persistent-kernel profile line ({e})") from None
            if not ok:
                raise ValueError(f"{path}:{no}: not a persistent-kernel profile line "
                                 "(want n, an integer drafts if any, and phases of [label, ns, bytes])")
            out.append(r)
    if not out:
        raise ValueError(f"{path}: no launches (was OJ_PERSISTENT=1 active when it was written?)")
    return out


def program(r: dict) -> tuple[int, int]:
    """(positions, drafts): drafts -1 for a verify's launch (and in files written before oj_cycle)."""
    return int(r["n"]), int(r.get("drafts", -1))


def summarise(lines: list[dict], bandwidth_gbs: float) -> dict[tuple[int, int], dict]:
    by_n: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in lines:
        by_n[program(r)].append(r)
    out = {}
    for n, runs in sorted(by_n.items()):
        ns: dict[str, float] = defaultdict(float)
        nbytes: dict[str, float] = defaultdict(float)
        count: dict[str, int] = defaultdict(int)
        for r in runs:
            for label, t, b in r["phases"]:
                ns[label] += t
                nbytes[label] += b
                count[label] += 1
        k = len(runs)
        total = sum(ns.values()) / k
        rows = []
        for label in sorted(ns, key=lambda x: -ns[x]):
            t = ns[label] / k
            b = nbytes[label] / k
            rows.append({"label": label, "phases": count[label] // k, "ms": t / 1e6, "share": t / total,
                         "gb": b / 1e9, "gbs": b / t if t and b else 0.0,
                         "floor_ms": b / (bandwidth_gbs * 1e9) * 1e3 if b else 0.0})
        out[n] = {"launches": k, "ms": total / 1e6, "rows": rows,
                  "phases": sum(r["phases"] for r in rows),
                  "floor_ms": sum(r["floor_ms"] for r in rows)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--bandwidth", type=float, default=4470.0, help="read bandwidth, GB/s (gpu.md: 4,470)")
    ap.add_argument("--skip", type=int, default=5, help="first launches per position count left out (warm-up)")
    a = ap.parse_args()
    try:
        lines = read_profile(a.file)
    except (OSError, ValueError) as e:
        print(f"persistent_profile: {e}", file=sys.stderr)
        return 2
    seen: dict[tuple[int, int], int] = defaultdict(int)
    kept = []
    for r in lines:
        seen[program(r)] += 1
        if seen[program(r)] > a.skip:
            kept.append(r)
    for (n, drafts), s in summarise(kept, a.bandwidth).items():
        what = f"{n} position(s)" + (f", a cycle drafting {drafts}" if drafts >= 0 else "")
        print(f"## {what}: {s['launches']} launches, {s['ms']:.3f} ms per launch, {s['phases']} phases, "
              f"weight-byte floor {s['floor_ms']:.3f} ms")
        print("| phase | per launch | ms | share | GB | GB/s | floor ms |")
        print("|---|---|---|---|---|---|---|")
        for r in s["rows"]:
            print(f"| {r['label']} | {r['phases']} | {r['ms']:.3f} | {r['share'] * 100:.1f}% | {r['gb']:.3f} | "
                  f"{r['gbs']:.0f} | {r['floor_ms']:.3f} |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
