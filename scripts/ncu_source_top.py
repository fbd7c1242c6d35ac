"""Summarises `ncu --page source --csv --print-source sass` output: the SASS instructions with the
most warp stall samples, and the samples by stall reason (scripts/gpu.sh matvec-group --ncu-source).

    python3 scripts/ncu_source_top.py source.csv [N]
"""
import csv
import re
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
    regions(head, body, src, samp, total)
    for r in sorted(body, key=lambda r: -num(r[samp]))[:top]:
        print(f"{num(r[samp]) / total:6.1%}  {r[0][:8]:>8}  {r[src][:90]}")


def regions(head: list, body: list, src: int, samp: int, total: float) -> None:
    """Samples by region of the kernel: before its main loop (the loop: the backward branch whose body
    holds the most HMMA), the loop's head up to its first shared load (waiting for a stage, issuing
    the next copies), the rest of the loop (the step's arithmetic) and after it."""
    try:
        base = int(body[0][0], 16)
        addr = [int(r[0], 16) - base for r in body]
    except ValueError:
        return
    text = [r[src].strip() for r in body]
    best = None
    for a, t in zip(addr, text):
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) - base < a:
            lo = int(m.group(1), 16) - base
            n = sum(1 for b, u in zip(addr, text) if lo <= b <= a and "HMMA" in u)
            if n and (best is None or n > best[0]):
                best = (n, lo, a)
    if best is None:
        return
    _, lo, hi = best
    first = next((b for b, u in zip(addr, text) if lo <= b <= hi and u.startswith("LDS")), hi)
    names = {"before the loop": lambda b: b < lo, "loop: wait + issue": lambda b: lo <= b < first,
             "loop: arithmetic": lambda b: first <= b <= hi, "after the loop": lambda b: b > hi}
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    executed = head.index("Instructions Executed") if "Instructions Executed" in head else None
    for name, inside in names.items():
        sel = [r for b, r in zip(addr, body) if inside(b)]
        share = sum(num(r[samp]) for r in sel) / total
        ex = sum(num(r[executed]) for r in sel) if executed is not None else 0
        top = sorted(((sum(num(r[i]) for r in sel), head[i][6:]) for i in reasons), reverse=True)[:6]
        print(f"  {name:20s} {share:6.1%} of samples, {ex:12,.0f} warp instructions; " +
              "; ".join(f"{n} {v / total:.1%}" for v, n in top))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
