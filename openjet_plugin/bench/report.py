"""The benchmark's outputs: the JSON other tools read, its validation, and the markdown table.

JSON: {"manifest": {...}, "results": [{"metric", "engine", "params", "median", "lo", "hi", "unit",
"samples"}]}. Every result's median/lo/hi is `stats.summarize(samples)`; `validate_report` checks
the shape and recomputes them. Rows that were not measured are not results: the manifest lists
them under "pending" (waiting for a later issue) and "not_measured" (with the reason).

`python -m openjet_plugin.bench.report BENCH.json` prints the markdown table again from a JSON.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from typing import Iterable

from .stats import summarize

ENGINES = ("openjet", "llama.cpp")
RESULT_KEYS = ("metric", "engine", "params", "median", "lo", "hi", "unit", "samples")

# metric -> (unit, required params, higher is better); order = the table's order
METRICS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "read_gbps": ("GB/s", (), True),
    "copy_gbps": ("GB/s", (), True),
    "roofline_tps": ("tokens/s", ("depth",), True),
    "decode_tps": ("tokens/s", ("depth",), True),
    # openjet's llama.cpp backend (the fallback) on the same CUDA libllama, engine "llama.cpp"
    "fallback_decode_tps": ("tokens/s", ("depth",), True),
    # constrained decoding per token on the CPU (bench/constraint.py); target <= 500 (5 % of 10 ms)
    "constraint_mask_us": ("µs", ("n_vocab", "grammar"), False),
    "verify_ms": ("ms", ("positions", "depth"), False),
    # one verify pass's projection weight bytes over the summed time of its projection phases
    # (oj_profile); the per-phase table beside it is rendered from manifest.info["phase_tables"]
    "projection_gbps": ("GB/s", ("positions", "depth"), True),
    "spec_tps": ("tokens/s", ("acceptance", "drafts", "depth"), True),
    "spec_mtp_tps": ("tokens/s", ("drafts", "depth"), True),
    # draft trees of `budget` verify positions a cycle from the MTP head, shaped by `shape`
    "spec_tree_tps": ("tokens/s", ("budget", "depth", "shape"), True),
    "accepted_per_cycle": ("tokens/cycle", ("drafts", "model", "temperature"), True),
    "tree_accepted_per_cycle": ("tokens/cycle", ("budget", "model", "temperature"), True),
    # teacher-forced agreement with llama.cpp (bench/agreement.py), engine openjet: the share of
    # positions whose argmaxes agree, and the mean KL(llama.cpp || ours)
    "agreement_top1": ("fraction", ("model", "depth", "positions"), True),
    "agreement_kl": ("nats", ("model", "depth", "positions"), False),
    # the same with the numpy reference (float64, no activation rounding) in our engine's place:
    # the floor llama.cpp's own rounding sets for the two rows above (the default model only)
    "reference_agreement_top1": ("fraction", ("model", "depth", "positions"), True),
    "reference_agreement_kl": ("nats", ("model", "depth", "positions"), False),
    "prefill_tps": ("tokens/s", ("new_tokens", "depth"), True),
    # device memory a measured process added (max_depth: the decode group's; backend, slots,
    # n_ctx: bench/memory.py's child, beside planned_mem_gb, what `openjet info` plans for it)
    "peak_mem_gb": ("GB", (), False),
    "planned_mem_gb": ("GB", ("backend", "slots", "n_ctx"), False),
    # several requests at once (bench/concurrent.py): aggregate rate, and the inter-token p99 of
    # decoding streams without (prompt_tokens 0) and with a long prompt arriving
    "concurrent_tps": ("tokens/s", ("streams", "drafts"), True),
    "concurrent_itl_p99_ms": ("ms", ("streams", "prompt_tokens"), False),
}
CARD_METRICS = ("read_gbps", "copy_gbps", "roofline_tps")
# shown in their own tables under the main one (their columns differ)
SPEC_METRICS = ("spec_tps", "spec_mtp_tps")
TREE_METRICS = ("spec_tree_tps",)
ACCEPT_METRICS = ("accepted_per_cycle", "tree_accepted_per_cycle")
AGREEMENT_METRICS = ("agreement_top1", "agreement_kl")
REFERENCE_AGREEMENT_METRICS = ("reference_agreement_top1", "reference_agreement_kl")
FALLBACK_METRICS = ("fallback_decode_tps",)
CONCURRENT_METRICS = ("concurrent_tps", "concurrent_itl_p99_ms")
MEMORY_TOLERANCE = 0.10           # issue 29: the plan within 10% of the measured peak
DETAILS_KEY = "spec_details"      # manifest.info[DETAILS_KEY][row_key]: what a row has beyond samples
PHASES_KEY = "phase_tables"       # manifest.info[PHASES_KEY][row_key of a projection_gbps row]: bench/ours.py's phase_table


def result(metric: str, engine: str, params: dict, samples: Iterable[float]) -> dict:
    """One result object, aggregated from its raw samples."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}")
    xs = [float(x) for x in samples]
    s = summarize(xs)
    return {"metric": metric, "engine": engine, "params": dict(params), "median": s.median, "lo": s.lo,
            "hi": s.hi, "unit": METRICS[metric][0], "samples": xs}


def params_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def row_key(metric: str, engine: str, params: dict) -> str:
    return f"{metric}|{engine}|{params_key(params)}"


# --- validation --------------------------------------------------------------------------------------

def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_report(obj) -> None:
    """Raise ValueError naming the first place where `obj` departs from the required shape, or
    where a median/lo/hi differs from what its samples give."""
    if not isinstance(obj, dict) or set(obj) != {"manifest", "results"}:
        raise ValueError(f"report: top level must be an object with exactly 'manifest' and 'results', "
                         f"got {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
    if not isinstance(obj["manifest"], dict):
        raise ValueError("report.manifest: must be an object")
    if not isinstance(obj["results"], list):
        raise ValueError("report.results: must be a list")
    seen = set()
    for i, r in enumerate(obj["results"]):
        where = f"report.results[{i}]"
        if not isinstance(r, dict) or tuple(sorted(r)) != tuple(sorted(RESULT_KEYS)):
            raise ValueError(f"{where}: keys must be exactly {list(RESULT_KEYS)}, "
                             f"got {sorted(r) if isinstance(r, dict) else type(r).__name__}")
        if r["metric"] not in METRICS:
            raise ValueError(f"{where}.metric: {r['metric']!r} is not one of {list(METRICS)}")
        unit, required, _ = METRICS[r["metric"]]
        if r["engine"] not in ENGINES:
            raise ValueError(f"{where}.engine: {r['engine']!r} is not one of {list(ENGINES)}")
        if not isinstance(r["params"], dict):
            raise ValueError(f"{where}.params: must be an object")
        missing = [k for k in required if k not in r["params"]]
        if missing:
            raise ValueError(f"{where}.params: {r['metric']} needs {missing}")
        if r["unit"] != unit:
            raise ValueError(f"{where}.unit: {r['metric']} is in {unit!r}, got {r['unit']!r}")
        xs = r["samples"]
        if not isinstance(xs, list) or not xs or not all(_finite(x) for x in xs):
            raise ValueError(f"{where}.samples: must be a non-empty list of finite numbers")
        s = summarize(xs)
        for k in ("median", "lo", "hi"):
            if not _finite(r[k]):
                raise ValueError(f"{where}.{k}: must be a finite number, got {r[k]!r}")
            want = getattr(s, k)
            if abs(r[k] - want) > 1e-9 * max(1.0, abs(want)):
                raise ValueError(f"{where}.{k}: {r[k]!r} is not what its samples give ({want!r})")
        key = row_key(r["metric"], r["engine"], r["params"])
        if key in seen:
            raise ValueError(f"{where}: a second result for {key}")
        seen.add(key)


# --- markdown ----------------------------------------------------------------------------------------

def _fmt(x: float) -> str:
    a = abs(x)
    return f"{x:,.0f}" if a >= 1000 else f"{x:.1f}" if a >= 100 else f"{x:.2f}" if a >= 1 else f"{x:.3f}"


def _cell(r: dict | None) -> str:
    return "—" if r is None else f"{_fmt(r['median'])} [{_fmt(r['lo'])}, {_fmt(r['hi'])}]"


def _params_text(params: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in params.items()) or "—"


def _collapse(items: list[dict]) -> list[tuple[str, str, str]]:
    """Pending rows grouped per (metric, reason): (metric, params summary, reason)."""
    groups: dict[tuple[str, str], dict[str, list]] = {}
    for it in items:
        g = groups.setdefault((it["metric"], it["reason"]), {})
        for k, v in it["params"].items():
            if v not in g.setdefault(k, []):
                g[k].append(v)
    return [(metric, ", ".join(f"{k} {'/'.join(str(v) for v in vs)}" for k, vs in g.items()), reason)
            for (metric, reason), g in groups.items()]


def switches_line(switches) -> str:
    """The engine switches the run was made under (manifest.engine_switches), or that it ran the
    defaults; a report from before they were recorded says so."""
    if switches is None:
        return "Engine switches: not recorded."
    if not switches:
        return "Engine switches: none set (the engine's defaults)."
    return "Engine switches: " + ", ".join(f"`{k}={v}`" for k, v in sorted(switches.items())) + "."


def markdown(report: dict) -> str:
    results = report["results"]
    man = report["manifest"]
    by_key = {row_key(r["metric"], r["engine"], r["params"]): r for r in results}
    notes: list[str] = []
    status: dict[str, str] = {}
    for item in man.get("not_measured", []):
        if item["reason"] not in notes:
            notes.append(item["reason"])
        status[row_key(item["metric"], item["engine"], item["params"])] = \
            f"not measured ({notes.index(item['reason']) + 1})"

    for item in man.get("pending", []):
        status[row_key(item["metric"], item["engine"], item["params"])] = item["reason"]

    def cell(metric, engine, params) -> str:
        k = row_key(metric, engine, params)
        return _cell(by_key[k]) if k in by_key else status.get(k, "—")

    def median_of(metric, engine, params):
        r = by_key.get(row_key(metric, engine, params))
        return None if r is None else r["median"]

    # every measured or unmeasured (metric, params), in METRICS order; pending rows are collapsed
    rows: dict[tuple[str, str], dict] = {}
    for src in (results, man.get("not_measured", [])):
        for r in src:
            rows.setdefault((r["metric"], params_key(r["params"])), r["params"])
    side = {k: v for k, v in rows.items()
            if k[0] in SPEC_METRICS + TREE_METRICS + ACCEPT_METRICS + FALLBACK_METRICS + CONCURRENT_METRICS
            or _is_memory_plan_row(k[0], v)}
    rows = {k: v for k, v in rows.items() if k not in side}
    agreement = {k: v for k, v in rows.items() if k[0] in AGREEMENT_METRICS + REFERENCE_AGREEMENT_METRICS}
    rows = {k: v for k, v in rows.items() if k not in agreement}
    order = list(METRICS)
    ordered = sorted(rows.items(), key=lambda kv: (order.index(kv[0][0]), [
        (str(type(v)), v) for v in kv[1].values()]))

    gpu = man.get("gpu", {})
    model = man.get("model", {})
    llama = man.get("llama_cpp", {})
    sms = gpu.get("sm_count")
    sms = sms if isinstance(sms, int) else "?"
    lines = [f"# openjet bench — {gpu.get('name', '?')}, {man.get('date', '?')}", "",
             f"model `{model.get('path', '?')}` (sha256 {str(model.get('sha256', '?'))[:16]}…), "
             f"openjet commit {str(man.get('project', {}).get('commit', '?'))[:12]}, llama.cpp "
             f"{str(llama.get('llama_cpp_commit', '?'))[:12]} (llama-cpp-python "
             f"{llama.get('llama_cpp_python', '?')}), {sms} SMs, driver "
             f"{gpu.get('driver', '?')}, CUDA {gpu.get('cuda_driver_version', '?')}", "",
             switches_line(man.get("engine_switches")), "",
             "Cells: median [lo, hi] (lo/hi: 95% interval for the median, bench/README.md). "
             "Ratios are of medians, openjet/llama.cpp: above 1 is better for tokens/s and GB/s, "
             "below 1 for ms and GB.", "",
             "| metric | params | card / openjet | llama.cpp | unit | openjet/llama.cpp "
             "| openjet of roofline | llama.cpp of roofline |",
             "|---|---|---|---|---|---|---|---|"]
    for (metric, _), params in ordered:
        unit = METRICS[metric][0]
        ours = cell(metric, "openjet", params)
        peer = "" if metric in CARD_METRICS else cell(metric, "llama.cpp", params)
        ratio = roof_o = roof_p = ""
        mo = median_of(metric, "openjet", params)
        mp = median_of(metric, "llama.cpp", params)
        if mo and mp:
            ratio = f"{mo / mp:.2f}×"
        if metric == "decode_tps":
            roof = median_of("roofline_tps", "openjet", {"depth": params["depth"]})
            if roof:
                roof_o = f"{mo / roof:.0%}" if mo else ""
                roof_p = f"{mp / roof:.0%}" if mp else ""
        if metric == "projection_gbps":   # of the card's read rate
            read = median_of("read_gbps", "openjet", {})
            roof_o = f"{mo / read:.0%}" if mo and read else ""
        lines.append(f"| {metric} | {_params_text(params)} | {ours} | {peer} | {unit} | {ratio} "
                     f"| {roof_o} | {roof_p} |")
    alone = [p for p in man.get("pending", []) if (p["metric"], params_key(p["params"])) not in rows
             and p["metric"] not in SPEC_METRICS + TREE_METRICS + ACCEPT_METRICS]
    for metric, params_text, reason in _collapse(alone):
        lines.append(f"| {metric} | {params_text} | {reason} | | {METRICS[metric][0]} | | | |")
    details = man.get("info", {}).get(DETAILS_KEY, {})
    pending = [p for p in man.get("pending", []) if (p["metric"], params_key(p["params"])) not in side]
    lines += _fallback_section(man, cell, median_of)
    lines += phase_section(man.get("info", {}).get(PHASES_KEY, {}), median_of)
    lines += _prefill_section(man.get("prefill"), median_of)
    lines += _spec_section(side, by_key, status, details, pending, median_of)
    lines += spec_vs_spec_section(side, by_key, status, details, median_of,
                                  man.get("model", {}).get("mtp_accuracy"))
    lines += tree_section(side, by_key, status, details, median_of, man.get("model", {}))
    lines += _accept_section(side, by_key, status, details, pending)
    lines += agreement_section(agreement, by_key, status, details)
    lines += concurrent_section(side, by_key, status, details)
    lines += memory_section(side, cell, median_of)
    if notes:
        lines.append("")
        lines += [f"({i}) {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


def phase_section(tables: dict, median_of) -> list[str]:
    """One table per profiled pass shape (manifest.info["phase_tables"]): each phase's time, bytes,
    floor (bytes over the card's read rate), % of floor, launches and calls per pass; then the
    sum of the phases, the profiled pass's GPU span and the wall time of an unprofiled pass
    (verify_ms), whose difference is the time no phase accounts for (host, launch gaps); the host
    time to enqueue a pass, profiled and not (where it nears the wall time, the GPU waits on the
    host's launches)."""
    read = median_of("read_gbps", "openjet", {})
    out: list[str] = []
    for key in sorted(tables):
        t = tables[key]
        params = json.loads(key.split("|", 2)[2]) if key.count("|") >= 2 else {}
        wall = median_of("verify_ms", "openjet", params) if params else None
        out += ["", f"## One verify pass, phase by phase ({_params_text(params) or key}; mean of {t['passes']} profiled passes)", "",
                "Time: between the CUDA events the engine records at each phase boundary (oj_profile), so a "
                "phase's launch gaps are inside its time. Bytes: the fewest it must move (weights, KV rows "
                f"read, recurrent state read and written). Floor: bytes over the card's read rate "
                f"({_fmt(read) + ' GB/s' if read else 'not measured'}).", "",
                "| phase | ms per pass | MB per pass | floor ms | % of floor | launches per pass | calls per pass |",
                "|---|---|---|---|---|---|---|"]
        tot_ms = tot_b = tot_l = 0.0
        for ph in t["phases"]:
            if not ph["calls"]:
                continue
            ms, b = ph["ms"], ph["bytes"]
            tot_ms, tot_b, tot_l = tot_ms + ms, tot_b + b, tot_l + ph["launches"]
            floor = b / (read * 1e9) * 1e3 if read and b else None
            pct = f"{floor / ms:.0%}" if floor and ms > 0 else ""
            out.append(f"| {ph['name']} | {ms:.3f} | {b / 1e6:,.1f} | {'' if floor is None else f'{floor:.3f}'} | {pct} "
                       f"| {ph['launches']} | {ph['calls']} |")
        floor = tot_b / (read * 1e9) * 1e3 if read else None
        out.append(f"| **sum of phases** | **{tot_ms:.3f}** | {tot_b / 1e6:,.1f} | {'' if floor is None else f'{floor:.3f}'} "
                   f"| {f'{floor / tot_ms:.0%}' if floor and tot_ms > 0 else ''} | {int(tot_l)} | |")
        out.append(f"| profiled pass, first event to last | {t['span_ms']:.3f} | | | | | |")
        if t.get("host_ms"):
            out.append(f"| host: the profiled pass enqueued (start to its last launch) | {t['host_ms']:.3f} | | | | | |")
        if t.get("host_ms_unprofiled"):
            out.append(f"| host: an unprofiled pass enqueued / its wall time | {t['host_ms_unprofiled']:.3f} / "
                       f"{t.get('wall_ms_unprofiled', 0.0):.3f} | | | | | |")
        if wall:
            out.append(f"| unprofiled pass, wall (verify_ms median) | {wall:.3f} | | | | | |")
            out.append(f"| wall − sum of phases (host, launch before the first kernel, copy back) | {wall - tot_ms:.3f} | | | | | |")
            if wall < tot_ms:   # the CUDA events at the phase boundaries cost the profiled pass time
                out.append(f"| (negative: the profiled pass took {tot_ms / wall - 1:.0%} longer than the unprofiled one; "
                           "its phase times include what its events at the phase boundaries cost) | | | | | | |")
        fit = launch_fit(t["phases"])
        if fit is not None:
            a_us, gbps = fit
            n_l = sum(ph["launches"] for ph in t["phases"] if ph["calls"])
            out += ["", f"Fit over the projection phases, ms = a × launches + bytes / B: a = {a_us:.1f} µs a launch, "
                        f"B = {gbps:,.0f} GB/s. At that a, the pass's {n_l} launches account for "
                        f"{n_l * a_us / 1e3:.2f} ms of the {tot_ms:.2f} ms its phases take."]
    return out


def launch_fit(phases: list[dict]) -> tuple[float, float] | None:
    """Least squares over the projection phases (bench/ours.py PROJECTION_PHASES) of
    ms = a * launches + bytes / B, no intercept: (a in µs, B in GB/s), or None where fewer than
    three phases have both or the fit is not positive. What one launch costs beyond streaming its
    bytes: the per-kernel overhead issue 25's pass has to shed."""
    from .ours import PROJECTION_PHASES

    rows = [(float(ph["launches"]), float(ph["bytes"]), float(ph["ms"])) for ph in phases
            if ph["name"] in PROJECTION_PHASES and ph["launches"] and ph["bytes"] and ph["ms"] > 0]
    if len(rows) < 3:
        return None
    sll = sum(l * l for l, _, _ in rows)
    slb = sum(l * b for l, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    slt = sum(l * t for l, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = sll * sbb - slb * slb
    if det <= 0:
        return None
    a = (slt * sbb - slb * sbt) / det            # ms a launch
    c = (sll * sbt - slb * slt) / det            # ms a byte
    if a <= 0 or c <= 0:
        return None
    return a * 1e3, 1.0 / c / 1e6


def _fallback_section(man: dict, cell, median_of) -> list[str]:
    """openjet's llama.cpp backend against llama-bench on the same file and libllama."""
    params = {"depth": 0}
    fb = median_of("fallback_decode_tps", "llama.cpp", params)
    text = cell("fallback_decode_tps", "llama.cpp", params)
    if text == "—":
        return []
    bench = median_of("decode_tps", "llama.cpp", params)
    where = man.get("info", {}).get("fallback", {}).get("where", "?")
    return ["", "## The fallback (backend=\"llama.cpp\") against llama-bench", "",
            "| decode, depth 0 | openjet's llama.cpp backend | llama-bench | fallback/llama-bench | placement |",
            "|---|---|---|---|---|",
            f"| tokens/s | {text} | {cell('decode_tps', 'llama.cpp', params)} | {_ratio(fb, bench)} | {where} |"]


def _is_memory_plan_row(metric: str, params: dict) -> bool:
    return metric == "planned_mem_gb" or (metric == "peak_mem_gb" and "slots" in params)


def memory_section(side: dict, cell, median_of) -> list[str]:
    """planned_mem_gb beside peak_mem_gb per (backend, slots, n_ctx): what `openjet info` /
    `doctor` plan before loading against the device memory the child measured, and their ratio
    (issue 29: within MEMORY_TOLERANCE)."""
    items = sorted({json.dumps(p, sort_keys=True): p for (m, _), p in side.items() if _is_memory_plan_row(m, p)}.values(),
                   key=lambda p: (str(p["backend"]), p["slots"], p["n_ctx"]))
    if not items:
        return []
    out = ["", "## Memory: the plan of `openjet info` against the measured device memory", "",
           "Measured: device memory in use (cudaMemGetInfo) after the CUDA context, at its least free while a "
           "fresh child loads the engine, fills every slot's context and decodes (bench/memory.py); planned: "
           f"cli.serving_memory for the same backend, slots and context. Target: the ratio within "
           f"{1 - MEMORY_TOLERANCE:.2f}..{1 + MEMORY_TOLERANCE:.2f}.", "",
           "| backend | slots | n_ctx | planned GB | measured GB | planned/measured | within |",
           "|---|---|---|---|---|---|---|"]
    for p in items:
        planned, peak = median_of("planned_mem_gb", "openjet", p), median_of("peak_mem_gb", "openjet", p)
        ok = ""
        if planned and peak:
            ok = "yes" if abs(planned / peak - 1) <= MEMORY_TOLERANCE else "NO"
        out.append(f"| {p['backend']} | {p['slots']} | {p['n_ctx']} | {cell('planned_mem_gb', 'openjet', p)} "
                   f"| {cell('peak_mem_gb', 'openjet', p)} | {_ratio(planned, peak)} | {ok} |")
    return out


def _ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a and b else ""


def _slots(d: dict) -> str:
    acc = d.get("acceptance_at")
    return " / ".join(f"{x:.2f}" for x in acc) if acc else ""


def _pending_lines(pending: list[dict], metrics: tuple[str, ...]) -> list[str]:
    return [f"- {metric} ({params_text}): {reason}"
            for metric, params_text, reason in _collapse([p for p in pending if p["metric"] in metrics])]


def _prefill_section(info: dict | None, median_of) -> list[str]:
    """Prefill scenarios: tokens/s of both engines and the share of the card's dense bf16
    tensor-core rate each achieves (manifest.prefill: FLOPs per scenario, the card's rate)."""
    from .prefill import tensor_core_fraction

    if not info or not info.get("rows"):
        return []
    peak = info.get("bf16_dense_tflops")
    out = ["", "## Prefill (tokens appended at a depth, one call)", "",
           f"FLOPs per run: {info.get('flops_formula', '?')} (projection_params "
           f"{info.get('projection_params', '?'):,}). Of bf16 peak: achieved FLOP/s over the card's dense "
           f"bf16 tensor-core rate ({f'{peak:g} TFLOP/s' if peak else 'unknown for this card'}; "
           f"{info.get('peak_source', '')}).", "",
           "| new tokens | depth | openjet tokens/s | llama.cpp tokens/s | openjet/llama.cpp | TFLOP per run "
           "| openjet of bf16 peak | llama.cpp of bf16 peak |",
           "|---|---|---|---|---|---|---|---|"]
    for row in info["rows"]:
        n, d, flops = row["new_tokens"], row["depth"], row["flops"]
        params = {"new_tokens": n, "depth": d}
        mo, mp = median_of("prefill_tps", "openjet", params), median_of("prefill_tps", "llama.cpp", params)

        def share(tps):
            return f"{tensor_core_fraction(tps, flops, n, peak):.1%}" if tps and peak else ""
        out.append(f"| {n:,} | {d:,} | {_fmt(mo) if mo else '—'} | {_fmt(mp) if mp else '—'} | {_ratio(mo, mp)} "
                   f"| {flops / 1e12:.2f} | {share(mo)} | {share(mp)} |")
    return out


def _spec_section(side, by_key, status, details, pending, median_of) -> list[str]:
    """Speculative decoding on the bench model: one row per (draft source, D, forced acceptance)."""
    keys = sorted((k for k in side if k[0] in SPEC_METRICS),
                  key=lambda k: (side[k].get("depth", 0), side[k]["drafts"], k[0] == "spec_mtp_tps",
                                 side[k].get("acceptance", 0)))
    extra = _pending_lines(pending, SPEC_METRICS)
    if not keys and not extra:
        return []
    out = ["", "## Speculative decoding (bench model, greedy)", "",
           "spec_tps: drafts from an oracle over the model's own greedy continuation, each right with "
           "probability a (forced acceptance), D drafts every cycle; where the engine has oj_cycle, each "
           "cycle still runs and times the MTP head's draft pass (a real cycle's cost, its drafts unused), "
           "elsewhere the oracle costs no MTP pass (the MTP catch-up on accepted positions is timed; the "
           "row's drafts_from says which). spec_mtp_tps: the "
           "model's MTP head drafts, at whatever acceptance it gets. tokens/cycle, acceptance per draft "
           "slot and ms/cycle are over all repetitions; ×: ratio of medians to plain decode at the same "
           "depth (openjet's, llama.cpp's); of roofline: over the plain-decode roofline at that depth "
           "(speculation may pass it: one weight pass yields several tokens).", "",
           "| depth | D | drafts | tokens/s | tokens/cycle | accepted at slot 1..D | ms/cycle "
           "| × openjet decode | × llama.cpp decode | of roofline | greedy = plain |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        metric, params = k[0], side[k]
        key = row_key(metric, "openjet", params)
        r = by_key.get(key)
        d = details.get(key, {})
        depth = params.get("depth")
        src = f"oracle, a = {params['acceptance']}" if metric == "spec_tps" else "MTP head"
        if r is None:
            out.append(f"| {depth} | {params['drafts']} | {src} | {status.get(key, '—')} | | | | | | | |")
            continue
        mo = r["median"]
        ours = median_of("decode_tps", "openjet", {"depth": depth})
        peer = median_of("decode_tps", "llama.cpp", {"depth": depth})
        roof = median_of("roofline_tps", "openjet", {"depth": depth})
        ms = d.get("ms_per_cycle")
        ms_text = _fmt(sorted(ms)[len(ms) // 2]) if ms else ""
        tpc = d.get("tokens_per_cycle")
        same = ""
        if "runs_differing_from_plain" in d:
            bad = d["runs_differing_from_plain"]
            same = "yes" if bad == 0 else f"{bad} of {d.get('reps', '?')} runs differ (first at token {d.get('first_difference')})"
        out.append(f"| {depth} | {params['drafts']} | {src} | {_cell(r)} | {_fmt(tpc) if tpc else ''} "
                   f"| {_slots(d)} | {ms_text} | {_ratio(mo, ours)} | {_ratio(mo, peer)} "
                   f"| {f'{mo / roof:.0%}' if roof else ''} | {same} |")
    if extra:
        out += [""] + extra
    return out


def _acceptance(d: dict) -> float | None:
    """Accepted drafts over drafts made, pooled over a row's repetitions (either engine's details)."""
    made, taken = d.get("drafts_proposed"), d.get("drafts_accepted")
    return taken / made if isinstance(made, int) and made > 0 and isinstance(taken, int) else None


def spec_vs_spec_section(side, by_key, status, details, median_of, mtp_accuracy: float | None = None) -> list[str]:
    """spec_mtp_tps of both engines row by row (depth x D): each drafting with its model's MTP head
    from the same prompt tokens, each with the acceptance it measured. mtp_accuracy: the rate a
    generated model's MTP head was made right at (`openjet bench --mtp-accuracy`), None otherwise."""
    keys = sorted((k for k in side if k[0] == "spec_mtp_tps"),
                  key=lambda k: (side[k]["depth"], side[k]["drafts"]))
    peer_keys = [k for k in keys if row_key(k[0], "llama.cpp", side[k]) in by_key
                 or row_key(k[0], "llama.cpp", side[k]) in status]
    if not peer_keys:
        return []
    default = next((d.get("llama_cpp_default_drafts") for d in details.values()
                    if d.get("llama_cpp_default_drafts") is not None), None)
    out = ["", "## MTP speculation, openjet against llama.cpp (same prompt tokens, greedy, one sequence)", "",
           "Both engines start each repetition at the depth from the same token ids (bench/spec.py "
           "prompt_tokens), draft D tokens every cycle with the model's MTP head and verify greedily. "
           "openjet: its speculative cycles on our clock (N tokens from the current token on). llama.cpp: "
           "llama-server --spec-type draft-mtp --spec-draft-n-max D, one slot, flash attention, each "
           "repetition one request timed by llama.cpp itself (predicted_per_second: the N tokens after "
           "the first, which comes from the prompt). Acceptance: accepted drafts / drafts made, over all "
           "repetitions, as each engine counts them. ×: ratio of medians to the same engine's plain "
           "decode at that depth"
           + (f"; D = {default} is llama.cpp's default (*)." if default is not None else ".")
           + (f" The model's MTP head was made to be right after {mtp_accuracy:.0%} of the tokens "
              "(--mtp-accuracy): the measured acceptance is that rate times the share of positions where "
              "the main model follows its successor map (0.97-0.99)." if mtp_accuracy is not None else
              " The model's MTP head is as generated or trained (--model, or --mtp-accuracy none): on a "
              "random-weight model it is right ~99% of the time, far above a real model's."), "",
           "| depth | D | openjet tokens/s | openjet acceptance | llama.cpp tokens/s | llama.cpp acceptance "
           "| openjet/llama.cpp | openjet × its decode | llama.cpp × its decode |",
           "|---|---|---|---|---|---|---|---|---|"]
    warnings: list[str] = []
    for k in peer_keys:                 # our chains that llama.cpp does not run are in the spec table only
        params = side[k]
        depth, D = params["depth"], params["drafts"]
        cells, meds, accs = [], [], []
        for eng in ENGINES:
            key = row_key("spec_mtp_tps", eng, params)
            r = by_key.get(key)
            cells.append(_cell(r) if r else status.get(key, "—"))
            meds.append(r["median"] if r else None)
            a = _acceptance(details.get(key, {})) if r else None
            accs.append(f"{a:.1%}" if a is not None else "")
        plain = [median_of("decode_tps", eng, {"depth": depth}) for eng in ENGINES]
        mark = " *" if default is not None and D == default else ""
        out.append(f"| {depth} | {D}{mark} | {cells[0]} | {accs[0]} | {cells[1]} | {accs[1]} | {_ratio(*meds)} "
                   f"| {_ratio(meds[0], plain[0])} | {_ratio(meds[1], plain[1])} |")
        # greedy output from the same fresh state must not depend on the repetition
        d = details.get(row_key("spec_mtp_tps", "llama.cpp", params), {})
        if d.get("reps_differing_from_first"):
            warnings.append(f"- llama.cpp, depth {depth}, D {D}: {d['reps_differing_from_first']} of "
                            f"{d.get('reps', '?')} repetitions generated other tokens than the first")
    return out + ([""] + warnings if warnings else [])


def head_text(model: dict) -> str:
    """What the bench model's MTP head was made to do (manifest.model: mtp_accuracy, mtp_runner_up)."""
    acc, second = model.get("mtp_accuracy"), model.get("mtp_runner_up")
    if acc is None:
        return ("The model's MTP head is as generated or trained (--model, or --mtp-accuracy none): on a "
                "random-weight model it is right ~99% of the time.")
    text = f"The model's MTP head was made to be right after {acc:.0%} of the tokens (--mtp-accuracy {acc:g})"
    if second is None:
        return text + "; where it is wrong its second choice is no better (no --mtp-runner-up)."
    return (text + f", and where it is wrong to rank the right token second after {second:.0%} of those tokens "
            f"(--mtp-runner-up {second:g}).")


def tree_section(side, by_key, status, details, median_of, model: dict) -> list[str]:
    """spec_tree_tps rows against our chains with the same verify budget: the chain of the most
    tokens per cycle among D <= budget - 1, and the fastest such chain, at the same depth."""
    keys = sorted((k for k in side if k[0] in TREE_METRICS),
                  key=lambda k: (side[k]["depth"], side[k]["budget"], side[k]["shape"]))
    if not keys:
        return []
    out = ["", "## Draft trees against chains with the same verify budget (openjet, greedy)", "",
           "A tree of B positions (the current token and B - 1 drafts from the MTP head's top choices, "
           "shaped every cycle; shape q: best-first by the head's probabilities, calibrated: corrected by "
           "the acceptance measured) verified in one pass, against our spec_mtp_tps chains at the same "
           "depth whose verify budget D + 1 is at most B: best by tokens per cycle and fastest by tokens/s "
           "(they may differ). Ratios: tree over that chain (tokens/s: of medians). " + head_text(model), "",
           "| depth | B | shape | tree tokens/s | tree tokens/cycle | positions/cycle | side accepts/cycle "
           "| best chain (tokens/cycle) | tree/chain tokens/cycle | fastest chain (tokens/s) "
           "| tree/chain tokens/s | greedy = plain |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        params = side[k]
        depth, budget, shape = params["depth"], params["budget"], params["shape"]
        key = row_key("spec_tree_tps", "openjet", params)
        r = by_key.get(key)
        if r is None:
            out.append(f"| {depth} | {budget} | {shape} | {status.get(key, '—')} | | | | | | | | |")
            continue
        d = details.get(key, {})
        chains = []
        for D in range(1, budget):
            ck = row_key("spec_mtp_tps", "openjet", {"drafts": D, "depth": depth})
            c = by_key.get(ck)
            tpc = details.get(ck, {}).get("tokens_per_cycle")
            if c is not None:
                chains.append((D, c["median"], tpc))
        with_tpc = [c for c in chains if c[2]]
        best = max(with_tpc, key=lambda c: c[2]) if with_tpc else None
        fastest = max(chains, key=lambda c: c[1]) if chains else None
        tpc = d.get("tokens_per_cycle")
        same = ""
        if "runs_differing_from_plain" in d:
            bad = d["runs_differing_from_plain"]
            same = "yes" if bad == 0 else f"{bad} of {d.get('reps', '?')} runs differ (first at token {d.get('first_difference')})"
        out.append(
            f"| {depth} | {budget} | {shape} | {_cell(r)} | {_fmt(tpc) if tpc else ''} "
            f"| {_fmt(d['positions_per_cycle']) if d.get('positions_per_cycle') else ''} "
            f"| {_fmt(d['side_accepts_per_cycle']) if 'side_accepts_per_cycle' in d else ''} "
            f"| {f'D = {best[0]}: {_fmt(best[2])}' if best else 'no chain measured'} "
            f"| {_ratio(tpc, best[2]) if best else ''} "
            f"| {f'D = {fastest[0]}: {_fmt(fastest[1])}' if fastest else 'no chain measured'} "
            f"| {_ratio(r['median'], fastest[1]) if fastest else ''} | {same} |")
    return out


def _accept_section(side, by_key, status, details, pending) -> list[str]:
    """Real MTP acceptance on the trained default model (held-out stdlib files)."""
    keys = sorted((k for k in side if k[0] in ACCEPT_METRICS),
                  key=lambda k: (side[k]["temperature"], k[0], side[k].get("drafts", side[k].get("budget"))))
    extra = _pending_lines(pending, ACCEPT_METRICS)
    if not keys and not extra:
        return []
    out = ["", "## Accepted tokens per cycle (trained default model, held-out stdlib files)", "",
           "Cell: median [lo, hi] over prompts of generated tokens / cycles; all prompts: the pooled "
           "ratio; D drafts every cycle, or a draft tree of B positions (tree B; slots: the accepted "
           "drafts on side branches, not their parent's first child).", "",
           "| temperature | D | tokens/cycle | all prompts | accepted at slot 1..D | greedy = plain |",
           "|---|---|---|---|---|---|"]
    for k in keys:
        params = side[k]
        key = row_key(k[0], "openjet", params)
        r = by_key.get(key)
        d = details.get(key, {})
        what = params["drafts"] if "drafts" in params else f"tree {params['budget']}"
        if r is None:
            out.append(f"| {params['temperature']} | {what} | {status.get(key, '—')} | | | |")
            continue
        same = ""
        if "greedy_prompts_differing_from_plain" in d:
            bad, n = d["greedy_prompts_differing_from_plain"], d.get("prompts", "?")
            same = f"{n - bad if isinstance(n, int) else '?'} of {n} prompts identical"
        tpc = d.get("tokens_per_cycle")
        slots = _slots(d) if "drafts" in params else f"side branches: {d.get('side_accepts', '?')} of {d.get('drafts_accepted', '?')}"
        out.append(f"| {params['temperature']} | {what} | {_cell(r)} | {_fmt(tpc) if tpc else ''} "
                   f"| {slots} | {same} |")
    if extra:
        out += [""] + extra
    return out


def _alone(d: dict) -> str:
    """Streams whose tokens equal the request run alone, over every round of a row."""
    n, bad = d.get("streams_checked"), d.get("streams_differing_from_alone")
    if not isinstance(n, int) or not isinstance(bad, int):
        return ""
    return "yes" if bad == 0 else f"{n - bad} of {n} (first difference at token {d.get('first_difference')})"


def concurrent_section(side, by_key, status, details) -> list[str]:
    """concurrent_tps (streams x drafts) and concurrent_itl_p99_ms of both engines."""
    tps = sorted((k for k in side if k[0] == "concurrent_tps"),
                 key=lambda k: (side[k]["drafts"], side[k]["streams"]))
    itl = sorted((k for k in side if k[0] == "concurrent_itl_p99_ms"),
                 key=lambda k: (side[k]["streams"], side[k]["prompt_tokens"]))
    if not tps and not itl:
        return []

    def get(metric, eng, params):
        key = row_key(metric, eng, params)
        return key, by_key.get(key), details.get(key, {})

    out = ["", "## Concurrent streams (greedy, the same prompt token ids on both engines)", "",
           "concurrent_tps: `streams` requests started at once, each N new tokens from its own prompt; one "
           "sample = all tokens / the wall time from the first request to the last token. openjet: the Engine "
           "with n_slots = streams, one thread per request; llama.cpp: llama-server -np 8 on the same file. "
           "× base: over the same engine's 1-stream row (D 0), or its plain row of as many streams (D > 0). "
           "sequences: how many the engine served at once (fewer than the streams: they ran one after "
           "another), and where counted the most that shared one pass. = alone: streams, over every round, whose tokens equal the request run alone.", "",
           "| streams | D | openjet tokens/s | × base | sequences | = alone | llama.cpp tokens/s | × base "
           "| = alone | openjet/llama.cpp |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for k in tps:
        params = side[k]
        base = {"streams": 1, "drafts": 0} if params["drafts"] == 0 else {"streams": params["streams"], "drafts": 0}
        cells, meds = [], []
        for eng in ENGINES:
            key, r, d = get("concurrent_tps", eng, params)
            _, b, _ = get("concurrent_tps", eng, base)
            meds.append(r["median"] if r else None)
            ratio = _ratio(r["median"], b["median"]) if r and b and base != params else ""
            seq = f"{d['sequences']} ({d.get('backend', '?')})" if "sequences" in d else ""
            if seq and "max_sequences_in_a_pass" in d:
                seq += f", {d['max_sequences_in_a_pass']} a pass"
            cells.append((_cell(r) if r else status.get(key, "—"), ratio, seq, _alone(d)))
        (o, o_x, o_seq, o_same), (q, q_x, _, q_same) = cells
        out.append(f"| {params['streams']} | {params['drafts']} | {o} | {o_x} | {o_seq} | {o_same} | {q} | {q_x} "
                   f"| {q_same} | {_ratio(*meds)} |")
    # where the time between the most streams' passes goes (the scheduler's trace, median round)
    plain = [k for k in tps if side[k]["drafts"] == 0]
    if plain:
        params = side[plain[-1]]
        occ = [o for o in get("concurrent_tps", "openjet", params)[2].get("pass_occupancy", []) if o.get("passes")]
        if occ:
            o = sorted(occ, key=lambda x: x["gap_ms_median"] if x["gap_ms_median"] is not None else 0.0)[len(occ) // 2]
            line = (f"\nopenjet, {params['streams']} streams: the backend busy {100 * o['busy_share']:.0f}% of a round, "
                    f"a decode pass of {o['decode_pass_ms_median']} ms and {o['gap_ms_median']} ms between passes (medians")
            if "steps_in_ms_median" in o:
                line += (f"; of the gap, {o['steps_in_ms_median']} ms until the last step was handed in and "
                         f"{o['composing_ms_median']} ms from then to the pass's start")
            out.append(line + ").")
    if itl:
        out += ["", "concurrent_itl_p99_ms: `streams` requests decoding; with a prompt of `prompt tokens`, it "
                "arrives (a request of one new token) once every stream has a quarter of its tokens, and the "
                "streams go on past its return. One sample = the 99th percentile of the streams' inter-token "
                "gaps in one run. × without: over the same engine's run without the prompt (the target: "
                "under 3×). prompt inside: runs where every stream was still decoding when the prompt's "
                "request returned. prompt × alone: the prompt's request time among the streams over its time "
                "alone (median of the runs): what the streams' latency costs it.", "",
                "| streams | prompt tokens | openjet p99 ms | × without | prompt inside | prompt × alone "
                "| llama.cpp p99 ms | × without | prompt inside | prompt × alone |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for k in itl:
            params = side[k]
            without = {"streams": params["streams"], "prompt_tokens": 0}
            cells = []
            for eng in ENGINES:
                key, r, d = get("concurrent_itl_p99_ms", eng, params)
                _, b, _ = get("concurrent_itl_p99_ms", eng, without)
                ratio = _ratio(r["median"], b["median"]) if r and b and params["prompt_tokens"] else ""
                runs = [x for x in d.get("runs", []) if "streams_outlasted_prompt" in x]
                inside = (f"{sum(bool(x['streams_outlasted_prompt']) for x in runs)} of {len(runs)}"
                          if runs else "")
                took = [x["prompt_returned_s"] - x["prompt_sent_s"] for x in runs
                        if "prompt_returned_s" in x and "prompt_sent_s" in x]
                alone = d.get("prompt_alone_s")
                slower = f"{statistics.median(took) / alone:.1f}×" if took and alone else ""
                cells += [_cell(r) if r else status.get(key, "—"), ratio, inside, slower]
            out.append(f"| {params['streams']} | {params['prompt_tokens']} | " + " | ".join(cells) + " |")
        for k in itl:      # where a prompt's gaps go: its pieces' passes against the decode-only one
            params = side[k]
            _, _, d = get("concurrent_itl_p99_ms", "openjet", params)
            mixed = [x["mixed_passes"] for x in d.get("runs", []) if x.get("mixed_passes")]
            if mixed:
                m = mixed[len(mixed) // 2]
                out.append(f"\nopenjet, {params['streams']} streams and a {params['prompt_tokens']:,}-token prompt: "
                           f"{m['passes']} passes with prompt tokens in a run, a median {m['prompt_tokens_median']} "
                           f"tokens next to {m['decode_steps_median']} decode steps in {m['ms_median']:.1f} ms "
                           f"(at most {m['ms_max']:.1f}), where the decode-only pass of as many steps takes "
                           f"{m['decode_only_ms_median'] if m['decode_only_ms_median'] is not None else '?'} ms.")
    return out


def agreement_section(rows: dict, by_key: dict, status: dict, details: dict) -> list[str]:
    """agreement_top1 / agreement_kl per (model, depth, positions) against issue 25's thresholds,
    with the figures the rows' details keep (bench/agreement.py); under a row, where measured or
    planned, the numpy reference's figures against the same llama.cpp on the same positions."""
    from .agreement import KL_MAX, MIN_POSITIONS, TOP1_MIN, verdict

    keys = sorted({params_key(p): p for p in rows.values()}.values(),
                  key=lambda p: (p["model"], p["depth"], p["positions"]))
    if not keys:
        return []
    floors = {params_key(p) for (m, _), p in rows.items() if m in REFERENCE_AGREEMENT_METRICS}
    out = ["", "## Agreement with llama.cpp (teacher-forced, the same token ids)", "",
           f"Both engines prefill `depth` tokens, then take `positions` more 8 per call; per position the "
           f"argmaxes and KL(llama.cpp || openjet) of the softmaxes, in float64. Pass: top-1 >= {TOP1_MIN} and "
           f"mean KL <= {KL_MAX:g} over >= {MIN_POSITIONS:,} positions (issue 25). Near-ties: disagreements "
           "where llama.cpp's own logits of the two choices are closer than the near-tie gap.", ""]
    if floors:
        out += ["Rows marked \"numpy reference\" put the numpy reference (testing/reference.py: float64 over the "
                "dequantised weights, no activation rounding) in our engine's place against the same llama.cpp "
                "on the same positions: where an exact computation lands, i.e. the floor llama.cpp's own "
                "rounding (8-bit activations in its products) sets for the bar.", ""]
    out += ["| model | depth | positions | top-1 | mean KL | KL p99 | KL max | disagreements (near-ties) "
            "| rel L2 | tokens | pass |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]

    def line(metrics, label: str, params: dict, floor: bool) -> str:
        k_top1, k_kl = (row_key(m, "openjet", params) for m in metrics)
        top1, kl = by_key.get(k_top1), by_key.get(k_kl)
        d = {**details.get(k_top1, {}), **details.get(k_kl, {})}
        head = f"| {label} | {params['depth']:,} | {params['positions']:,} "
        if top1 is None or kl is None:
            why = status.get(k_top1) or status.get(k_kl) or "—"
            return head + f"| {why} | | | | | | | {'' if floor else 'fail (not measured)'} |"
        ok, why = verdict(top1["median"], kl["median"], int(d.get("positions", params["positions"])))
        dis = f"{d['disagreements']} ({d.get('near_tie_disagreements', '?')})" if "disagreements" in d else ""
        p99, kmax, rel = d.get("kl_p99"), d.get("kl_max"), d.get("rel_l2")
        verdict_cell = ("the floor: " + ("within the bar" if ok else why)) if floor else \
            ("**pass**" if ok else "fail: " + why)
        return (head + f"| {top1['median']:.4f} | {kl['median']:.2e} "
                f"| {'' if p99 is None else f'{p99:.2e}'} | {'' if kmax is None else f'{kmax:.2e}'} | {dis} "
                f"| {'' if rel is None else f'{rel:.2e}'} | {d.get('tokens', '')} | {verdict_cell} |")

    for params in keys:
        if (AGREEMENT_METRICS[0], params_key(params)) in rows or (AGREEMENT_METRICS[1], params_key(params)) in rows:
            out.append(line(AGREEMENT_METRICS, params["model"], params, False))
        if params_key(params) in floors:
            out.append(line(REFERENCE_AGREEMENT_METRICS, f"{params['model']}, numpy reference", params, True))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m openjet_plugin.bench.report BENCH.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        report = json.load(f)
    validate_report(report)
    sys.stdout.write(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
