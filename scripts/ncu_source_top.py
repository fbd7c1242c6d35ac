"""Summarises `ncu --page source --csv --print-source sass` output: the SASS instructions with the
most warp stall samples, and the samples by stall reason (scripts/gpu_matvec_group.sh --ncu-source).

    python3 scripts/ncu_source_top.py source.csv [N]
"""
import csv
import sys


def num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, top: int) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head_i = next((i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r)), None)
    if head_i is None:
        print("no header found; first lines:")
        for r in rows[:5]:
            print(r)
        return
    head = rows[head_i]
    body = [r for r in rows[head_i + 1:] if len(r) == len(head)]
    print("columns:", " | ".join(head)[:1500])
    src = next(i for i, c in enumerate(head) if c == "Source")
    samp = [i for i, c in enumerate(head) if "Sampling" in c and "All" in c]
    samp = samp[0] if samp else next(i for i, c in enumerate(head) if "Sampling" in c)
    total = sum(num(r[samp]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} stall samples ({head[samp]})")
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != samp]
    if reasons:
        agg = sorted(((sum(num(r[i]) for r in body), head[i]) for i in reasons), reverse=True)
        print("by column:", "; ".join(f"{n} {v / total:.1%}" for v, n in agg[:14]))
    for r in sorted(body, key=lambda r: -num(r[samp]))[:top]:
        print(f"{num(r[samp]) / total:6.1%}  {r[0][:8]:>8}  {r[src][:90]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
