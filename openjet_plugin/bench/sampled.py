"""What a sampled request costs against a greedy one, with and without MTP speculation, through the
Engine API (issue 28): greedy requests without penalties run each speculative cycle in one engine
call (oj_cycle) and read only the argmax back; sampled requests with top-k on run it through
oj_cycle_sampled, which draws on the GPU (a library before ABI 13, or top-k off, penalties or bias:
the host path, which copies each draft's and each verified position's logits row off the device
and builds the distribution in numpy; speculative_native.py). This measures the difference as a
user meets it.

    python -m openjet_plugin.bench.sampled --model M [--backend native] [--depth 0] [--drafts 0,3]
        [--temperatures 0,0.7] [--tokens 128] [--reps 3] [--out OUT.jsonl]

One engine per drafts value (`load(draft_depth=D)`; 0: no speculation). Every request continues
the same prompt: the first `depth` token ids of the sequence the other speculative rows start from
(bench/spec.py prompt_tokens), which the engine keeps after the first request (conversation
reuse), so only that one prefills. Each (drafts, temperature) row: one warm-up request, then
`reps` requests of `tokens` new tokens at the Engine's default top-k / top-p / min-p (temperature
0: greedy), seeded per repetition. A sample is GenerationStats.tokens_per_second (decode only);
the details hold the drafts proposed and accepted and the tokens each request generated (one may
end early at an end-of-generation token: banning those with a logit bias would move greedy
requests off the fused cycle, which is what is measured).

Output: JSON lines as bench/ours.py's ({"metric": "sampled_tps", ...}, {"skip": ...}, {"info":
...}); a table on stdout, the ratio of each row to the greedy row of the same drafts last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

METRIC = "sampled_tps"


def row_params(depth: int, drafts: int, temperature: float) -> dict:
    return {"depth": depth, "drafts": drafts, "temperature": temperature}


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative numbers, got {text!r}")
    return vals


def measure(engine, prompt: list[int], tokens: int, reps: int, temperature: float) -> tuple[list[float], dict]:
    """`reps` timed requests after one warm-up: (tokens/s samples, details)."""
    samples, generated = [], []
    proposed = accepted = 0
    for rep in range(-1, reps):
        engine.generate(list(prompt), max_tokens=tokens, temperature=temperature, seed=1000 + rep)
        st = engine.last_stats
        if rep < 0:
            continue
        if st.generated_tokens < 2 or st.decode_seconds <= 0:
            raise RuntimeError(f"request {rep} generated {st.generated_tokens} tokens: nothing to time")
        samples.append(st.tokens_per_second)
        generated.append(st.generated_tokens)
        proposed += st.drafts_proposed
        accepted += st.drafts_accepted
    return samples, {"backend": engine.backend_name, "tokens_generated": generated,
                     "drafts_proposed": proposed, "drafts_accepted": accepted,
                     "acceptance": round(accepted / proposed, 4) if proposed else None}


def run(args, out) -> list[tuple[dict, list[float] | None, str, dict | None]]:
    """Every row, each a result or a skip with its reason: [(params, samples or None, reason,
    details or None)]."""
    from .. import load
    from .spec import prompt_tokens

    rows = []
    for drafts in args.drafts:
        try:
            engine = load(args.model, backend=args.backend, n_ctx=args.depth + args.tokens + 64,
                          draft_depth=drafts)
        except Exception as exc:  # noqa: BLE001 - every row of this engine says why, the others go on
            for t in args.temperatures:
                p = row_params(args.depth, drafts, t)
                reason = f"load(draft_depth={drafts}) failed: {type(exc).__name__}: {exc}"
                out.skip(METRIC, p, reason)
                rows.append((p, None, reason, None))
            continue
        try:
            prompt = prompt_tokens(engine.n_vocab, max(args.depth, 1))
            for t in args.temperatures:
                p = row_params(args.depth, drafts, t)
                try:
                    samples, details = measure(engine, prompt, args.tokens, args.reps, t)
                except Exception as exc:  # noqa: BLE001 - one row's failure is recorded
                    reason = f"{type(exc).__name__}: {exc}"
                    out.skip(METRIC, p, reason)
                    rows.append((p, None, reason, None))
                    continue
                out.result(METRIC, p, "tokens/s", samples)
                out.details(METRIC, p, details)
                rows.append((p, samples, "", details))
        finally:
            engine.close()
    return rows


def table(rows) -> str:
    """The rows as markdown: the median with the samples' range, the ratio to the greedy row of the
    same drafts, and the acceptance per draft (a sampled row's loss against greedy is its acceptance
    or its cost per cycle; the two columns tell which)."""
    greedy = {p["drafts"]: statistics.median(s) for p, s, _, _ in rows if s and p["temperature"] == 0}
    lines = ["| depth | drafts | temperature | tokens/s (median [min, max]) | × greedy, same drafts | acceptance per draft |",
             "|---|---|---|---|---|---|"]
    for p, s, reason, details in rows:
        head = f"| {p['depth']} | {p['drafts']} | {p['temperature']:g} |"
        if not s:
            lines.append(f"{head} not measured: {reason} | | |")
            continue
        m = statistics.median(s)
        g = greedy.get(p["drafts"])
        acc = (details or {}).get("acceptance")
        lines.append(f"{head} {m:.1f} [{min(s):.1f}, {max(s):.1f}] | {f'{m / g:.2f}×' if g else ''} | "
                     f"{'' if acc is None else f'{acc:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .ours import Emitter
    from .runner import _int_list

    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.bench.sampled",
                                 description="sampled against greedy requests through the Engine (issue 28)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", default="auto", help="as load(backend=...): auto, native or llama.cpp")
    ap.add_argument("--depth", type=int, default=0, help="prompt tokens before the timed ones (default 0)")
    ap.add_argument("--drafts", type=_int_list, default=(0, 3), help="draft depths, one engine each (default 0,3)")
    ap.add_argument("--temperatures", type=_floats, default=[0.0, 0.7], help="default 0,0.7 (0: greedy)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.reps < 1 or args.depth < 0:
        ap.error("--tokens must be >= 2, --reps >= 1 and --depth >= 0")
    if not Path(args.model).is_file():
        ap.error(f"--model {args.model}: no such file")
    out = Emitter(args.out)
    try:
        rows = run(args, out)
    except Exception as exc:  # noqa: BLE001 - the caller gets the reason, not a traceback
        out.emit({"error": f"{type(exc).__name__}: {exc}"})
        print(f"openjet bench (sampled): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(table(rows))
    return 0 if all(s for _, s, _, _ in rows) else 4


if __name__ == "__main__":
    sys.exit(main())
