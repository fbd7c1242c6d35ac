"""Compare concurrent training runs, choose the one to ship, and package it for the trip home.

    python -m training.report --out $OUT RUN_DIR [RUN_DIR ...]

The run tagged `nomtp` (trained without the MTP loss, same seed, steps and batches) is the
ablation: for each MTP run, `main_ppl_hurt` = its held-out main-head perplexity over the ablation's,
minus 1. The shipped run is the MTP run with the best estimated tokens per cycle among those whose
hurt is <= 2%; if none qualifies, the one that hurts least. Its weight shards are copied to --out
with a summary.json; the table printed last is the summary.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

MAX_HURT = 0.02


def load_runs(dirs) -> dict[str, dict]:
    runs = {}
    for d in dirs:
        d = pathlib.Path(d)
        p = d / "log.json"
        if not p.is_file():
            runs[d.name] = {"dir": str(d), "error": f"{p} missing (the run failed; see its .log)"}
            continue
        log = json.loads(p.read_text())
        log["dir"] = str(d)
        runs[log.get("tag", d.name)] = log
    return runs


def choose(runs: dict[str, dict]) -> tuple[str | None, dict]:
    base = runs.get("nomtp", {}).get("final_eval", {}).get("main_ppl")
    verdict = {}
    for tag, log in runs.items():
        fe = log.get("final_eval")
        if not fe or not log.get("mtp_trained"):
            continue
        hurt = fe["main_ppl"] / base - 1.0 if base else None
        verdict[tag] = {"main_ppl_hurt": hurt, "est_tokens_per_cycle": fe.get("est_tokens_per_cycle", [1.0])[-1],
                        "ok": hurt is None or hurt <= MAX_HURT}
    if not verdict:
        return None, verdict
    ok = [t for t, v in verdict.items() if v["ok"]]
    if ok:
        pick = max(ok, key=lambda t: verdict[t]["est_tokens_per_cycle"])
    else:
        pick = min(verdict, key=lambda t: verdict[t]["main_ppl_hurt"])
    return pick, verdict


def table(runs: dict[str, dict], verdict: dict, pick: str | None) -> str:
    rows = ["run          steps  Mtok  train_s  heldout_ppl  unigram_ppl  hurt     mtp_top1          est_tok/cycle"]
    for tag, log in runs.items():
        if "error" in log:
            rows.append(f"{tag:<12} FAILED: {log['error']}")
            continue
        fe = log["final_eval"]
        v = verdict.get(tag, {})
        hurt = v.get("main_ppl_hurt")
        rows.append(
            f"{tag:<12} {log['steps']:>5}  {log['tokens_seen'] / 1e6:>4.0f}  {log['train_seconds']:>7.0f}  "
            f"{fe['main_ppl']:>11.3f}  {log['unigram_ppl']:>11.1f}  "
            f"{'' if hurt is None else f'{hurt * 100:+.2f}%':>7}  "
            f"{' '.join(f'{x:.2f}' for x in fe.get('mtp_top1', [])):<16}  "
            f"{' '.join(f'{x:.2f}' for x in fe.get('est_tokens_per_cycle', []))}"
            + ("  <- shipped" if tag == pick else ""))
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(args.runs)
    pick, verdict = choose(runs)
    shipped = []
    if pick:
        for name in runs[pick]["weights"]:
            dst = f"{pick}-{name}"
            shutil.copyfile(pathlib.Path(runs[pick]["dir"]) / name, out / dst)
            shipped.append(dst)
    summary = {"shipped": pick, "shipped_files": shipped, "max_hurt": MAX_HURT, "verdict": verdict,
               "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(runs, verdict, pick))
    if pick is None:
        print("no MTP run finished: nothing shipped", file=sys.stderr)
        return 1
    print(f"shipped: {pick} -> {', '.join(shipped)} (+ summary.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
