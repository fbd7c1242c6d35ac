"""`openjet bench`: plan the measurements, run what is missing, write the report.

The run, in order (each step's finished measurements go to the resume folder at once):
  1. check for a GPU (none: say so, exit 1); read the manifest's start state;
  2. start building llama.cpp's llama-bench in the background (cached per machine);
  3. the model (--model, or the generated q27b Q4_K_M, made once into the cache); its sha256 in
     a background thread;
  4. the card: streaming read and copy rates (the roofline probe);
  5. our engine, in a child process: verification passes at depth 1K, decode at each depth, and
     speculative decoding (oracle drafts at forced acceptance rates at depth 8K, the model's own
     MTP head at each depth, in chains of D = 1..4 and B - 1 and in draft trees of budget B at each depth, last);
     in a second child, real MTP acceptance on the trained default model; in a
     third, the two prefill scenarios (oj_prefill; its own child so that the longer context they
     need does not count in the decode run's peak memory); in a fourth, the concurrent rows
     (bench/concurrent.py: streams of requests at once through the Engine's slots);
  6. llama.cpp (waiting for its build): decode at each depth, batches of 1..D+1 at depth 1K,
     the two prefill scenarios, and its own MTP speculative decoding at each depth and D through
     llama-server (bench/peer_spec.py; one server per D), from the same tokens as ours; the
     concurrent rows on llama-server -np 8 (bench/concurrent.py);
  7. teacher-forced agreement with llama.cpp (bench/agreement.py, a child per model: the bench
     model and the trained default one, each engine prefilling a depth and then compared position
     by position; llama.cpp through native/tools/llama_logits built against the same libllama),
     and on the default model the numpy reference in our engine's place (the floor rows);
  8. the manifest's end state; JSON and markdown out.
With --time-budget, steps that no longer fit are left for the next run with the same --resume.
Exit status: 0 complete; 1 no GPU or bad arguments; 3 incomplete for lack of time (run again
with --resume); 4 incomplete because a measurement failed (the report says why).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import manifest as manifest_mod
from . import peer, report, roofline, smi
from .store import ResumeMismatch, Store

OURS, PEER = "openjet", "llama.cpp"
OUT_OF_TIME = "out of time in this run; run again with the same --resume folder to finish it"


def is_time_reason(reason: str) -> bool:
    return reason.startswith("out of time")
EXIT_INCOMPLETE_TIME, EXIT_INCOMPLETE_FAILED = 3, 4


@dataclass(frozen=True)
class Settings:
    reps: int = 6
    quick: bool = False
    depths: tuple[int, ...] = (0, 8192, 30720)
    decode_tokens: int = 128
    verify_positions: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 16)   # 8: issue 25's 8 / 1 ratio, and the pass oj_eval_seqs takes for 8 sequences; 16: a verify budget of 16 (trees, drafts beside 8 sequences)
    verify_depth: int = 1024
    # 64:4096: an appended turn (an agent's tool result) and a prompt piece beside decoding streams
    # (the latency row's mixed passes take 64 tokens each): what one small oj_prefill costs
    prefill: tuple[tuple[int, int], ...] = ((2700, 1800), (12000, 29500), (64, 4096))
    spec_depth: int = 8192
    acceptances: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9)
    drafts: tuple[int, ...] = (1, 2, 3, 4)
    # spec_tree_tps: draft trees of these verify budgets (positions per cycle) and shapes at every
    # depth, beside our chains of D = budget - 1 (the chain with the same verify budget, which the
    # report compares the tree with together with every shorter chain measured)
    tree_budgets: tuple[int, ...] = (8,)
    tree_shapes: tuple[str, ...] = ("q",)
    # accepted_per_cycle: the trained default model on held-out stdlib files
    accept_temperatures: tuple[float, ...] = (0.0, 0.7)
    accept_prompts: int = 12
    accept_prompt_tokens: int = 64
    accept_tokens: int = 64
    peer_batch: int = 2048
    peer_ubatch: int = 512
    read_mib: int = 8192
    copy_mib: int = 4096
    # agreement_top1 / agreement_kl (bench/agreement.py): (model, depth, positions) per row pair;
    # the trained default model (context 4,096) at depth 0 and where its last position is its last
    agreement: tuple[tuple[str, int, int], ...] = (("q27b", 30720, 2048), ("default", 0, 2048),
                                                   ("default", 2048, 2048))
    # concurrent_tps / concurrent_itl_p99_ms (bench/concurrent.py): streams of N new tokens from
    # prompts of P tokens; 8 streams with speculation at D; the latency rows' streams, long prompt
    # and tokens per stream
    concurrent_streams: tuple[int, ...] = (1, 2, 4, 8)
    concurrent_tokens: int = 128
    concurrent_prompt_tokens: int = 64
    concurrent_drafts: int = 3
    latency_streams: int = 7
    latency_prompt_tokens: int = 12288
    latency_tokens: int = 128
    # planned_mem_gb / peak_mem_gb (bench/memory.py): (backend, slots, n_ctx) of each pair, what
    # `openjet info` plans for serving the model beside the device memory loading it takes
    memory: tuple[tuple[str, int, int], ...] = (("native", 1, 32768), ("native", 4, 8192), ("llama.cpp", 1, 32768),
                                                ("llama.cpp", 4, 8192))

    @classmethod
    def quick_run(cls, **kw) -> "Settings":
        base = dict(reps=3, quick=True, depths=(0, 8192), decode_tokens=32, prefill=((2700, 1800), (64, 4096)),
                    read_mib=2048, copy_mib=1024, concurrent_streams=(1, 8), concurrent_tokens=32,
                    latency_prompt_tokens=4096, latency_tokens=64,
                    memory=(("native", 1, 8192), ("native", 4, 4096), ("llama.cpp", 4, 4096)))
        base["agreement"] = (("q27b", 4096, 256), ("default", 0, 256), ("default", 3840, 256))
        base.update(kw)
        return cls(**base)


# Rows that wait for later issues: (metric, reason). None now: batched prefill (issue 9) is measured.
PENDING_REASONS: dict[str, str] = {}
ACCEPT_MODEL = "trained default"


def spec_params(s: Settings, acceptance: float, drafts: int) -> dict:
    return {"acceptance": float(acceptance), "drafts": int(drafts), "depth": s.spec_depth}


def spec_mtp_params(drafts: int, depth: int) -> dict:
    """spec_mtp_tps rows: measured at every decode depth, by both engines (same params)."""
    return {"drafts": int(drafts), "depth": int(depth)}


def accept_params(drafts: int, temperature: float) -> dict:
    return {"drafts": int(drafts), "model": ACCEPT_MODEL, "temperature": float(temperature)}


def accept_tree_params(budget: int, temperature: float) -> dict:
    return {"budget": int(budget), "model": ACCEPT_MODEL, "temperature": float(temperature)}


def tree_params(budget: int, shape: str, depth: int) -> dict:
    """spec_tree_tps rows: a draft tree of `budget` verify positions, shaped by `shape`."""
    return {"budget": int(budget), "depth": int(depth), "shape": shape}


def our_chain_drafts(s: Settings) -> tuple[int, ...]:
    """Our spec_mtp_tps depths: the ones both engines run, and D = B - 1 for each tree budget B."""
    return tuple(sorted(set(s.drafts) | {b - 1 for b in s.tree_budgets}))


def spec_rows(s: Settings) -> list[tuple[str, str, dict]]:
    """Speculative decoding on the bench model (our engine's child, bench/spec.py)."""
    return ([("spec_tps", OURS, spec_params(s, a, d)) for a in s.acceptances for d in s.drafts]
            + [("spec_mtp_tps", OURS, spec_mtp_params(d, dep)) for dep in s.depths for d in our_chain_drafts(s)]
            + [("spec_tree_tps", OURS, tree_params(b, sh, dep)) for dep in s.depths for b in s.tree_budgets
               for sh in s.tree_shapes])


def peer_spec_rows(s: Settings, drafts: int) -> list[tuple[str, str, dict]]:
    """llama.cpp's own MTP speculative decoding at draft depth D, every depth (bench/peer_spec.py)."""
    return [("spec_mtp_tps", PEER, spec_mtp_params(drafts, dep)) for dep in s.depths]


def accept_rows(s: Settings) -> list[tuple[str, str, dict]]:
    """Real acceptance on the trained default model (bench/acceptance.py)."""
    return ([("accepted_per_cycle", OURS, accept_params(d, t)) for t in s.accept_temperatures for d in s.drafts]
            + [("tree_accepted_per_cycle", OURS, accept_tree_params(b, t))
               for t in s.accept_temperatures for b in s.tree_budgets])


def prefill_params(new_tokens: int, depth: int) -> dict:
    return {"new_tokens": int(new_tokens), "depth": int(depth)}


def prefill_rows(s: Settings, engine: str) -> list[tuple[str, str, dict]]:
    return [("prefill_tps", engine, prefill_params(n, d)) for n, d in s.prefill]


def concurrent_plan(s: Settings):
    """The concurrent rows' plan (bench/concurrent.py), the same for both engines."""
    from .concurrent import Plan

    return Plan(streams=s.concurrent_streams, tokens=s.concurrent_tokens, prompt_tokens=s.concurrent_prompt_tokens,
                reps=s.reps, spec_streams=8, drafts=s.concurrent_drafts, latency_streams=s.latency_streams,
                latency_prompt=s.latency_prompt_tokens, latency_tokens=s.latency_tokens)


def concurrent_rows(s: Settings, engine: str) -> list[tuple[str, str, dict]]:
    return [(m, engine, p) for m, p in concurrent_plan(s).rows()]


AGREEMENT_METRICS = report.AGREEMENT_METRICS
REFERENCE_AGREEMENT_METRICS = report.REFERENCE_AGREEMENT_METRICS
BENCH_LABEL = "q27b"      # agreement rows of the bench model (the generated q27b unless --model)


def agreement_rows(s: Settings) -> list[tuple[str, str, dict]]:
    """Teacher-forced agreement with llama.cpp (bench/agreement.py), a top-1 and a KL row each."""
    from .agreement import row_params

    return [(m, OURS, row_params(label, d, p)) for label, d, p in s.agreement for m in AGREEMENT_METRICS]


def reference_agreement_rows(s: Settings) -> list[tuple[str, str, dict]]:
    """The numpy reference in our engine's place against the same llama.cpp, on the default model's
    agreement rows: the floor llama.cpp's own rounding sets (the bench model's 27B shapes are far
    beyond the reference's reach on a CPU)."""
    from .agreement import row_params

    return [(m, OURS, row_params(label, d, p)) for label, d, p in s.agreement if label != BENCH_LABEL
            for m in REFERENCE_AGREEMENT_METRICS]


MEMORY_METRICS = ("planned_mem_gb", "peak_mem_gb")


def memory_params(backend: str, slots: int, n_ctx: int) -> dict:
    return {"backend": backend, "slots": int(slots), "n_ctx": int(n_ctx)}


def memory_rows(s: Settings) -> list[tuple[str, str, dict]]:
    """The memory plan against the measured device memory (bench/memory.py), a pair per item."""
    return [(m, OURS, memory_params(b, sl, c)) for b, sl, c in s.memory for m in MEMORY_METRICS]


def plan(s: Settings) -> tuple[list[tuple[str, str, dict]], list[dict]]:
    """(rows to measure, pending rows). roofline_tps rows are derived, not measured."""
    rows: list[tuple[str, str, dict]] = [("read_gbps", OURS, {}), ("copy_gbps", OURS, {})]
    for eng in (OURS, PEER):
        rows += [("decode_tps", eng, {"depth": d}) for d in s.depths]
        rows += [("verify_ms", eng, {"positions": p, "depth": s.verify_depth}) for p in s.verify_positions]
        rows += prefill_rows(s, eng)
    rows += [("projection_gbps", OURS, {"positions": p, "depth": s.verify_depth}) for p in s.verify_positions]
    rows += [("peak_mem_gb", eng, {"max_depth": max(s.depths)}) for eng in (OURS, PEER)]
    rows += [("fallback_decode_tps", PEER, {"depth": 0})]
    rows += [CONSTRAINT_ROW]
    rows += spec_rows(s) + accept_rows(s)
    rows += [r for d in s.drafts for r in peer_spec_rows(s, d)]
    rows += agreement_rows(s) + reference_agreement_rows(s)
    rows += concurrent_rows(s, OURS) + concurrent_rows(s, PEER)
    rows += memory_rows(s)
    return rows, []


# --- the run's shared state ----------------------------------------------------------------------------

@dataclass
class Run:
    settings: Settings
    store: Store
    model: Path
    cache: Path
    deadline: float | None
    session: str
    arch: str
    no_ours: bool = False
    no_peer: bool = False
    only: tuple[str, ...] = ()      # group-name prefixes to run (--only); empty: every group
    sdist: Path | None = None
    peer_build: peer.PeerBuild | None = None
    peer_proc: subprocess.Popen | None = None
    peer_problem: str | None = None
    not_measured: dict[str, str] = field(default_factory=dict)
    t0: float = field(default_factory=time.time)

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def timeout(self) -> float | None:
        """For subprocess calls: None without a deadline (an infinite float overflows select)."""
        return None if self.deadline is None else max(1.0, self.left())

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def missing(self, rows) -> list[tuple[str, str, dict]]:
        return [r for r in rows if not self.store.has(*r)]

    def mark(self, rows, reason: str) -> None:
        for metric, engine, params in rows:
            self.not_measured[report.row_key(metric, engine, params)] = reason

    def add(self, metric: str, engine: str, params: dict, samples) -> None:
        self.store.add(metric, engine, params, report.METRICS[metric][0], list(samples), self.session)


# --- measurement groups --------------------------------------------------------------------------------

def group_card(run: Run) -> None:
    rows = run.missing([("read_gbps", OURS, {}), ("copy_gbps", OURS, {})])
    if not rows:
        return
    exe = roofline.build_probe(run.cache / "probe", run.arch)
    data = roofline.run_probe(exe, run.settings.read_mib, run.settings.copy_mib,
                              reps=max(10, run.settings.reps), timeout=min(run.left(), 300))
    run.add("read_gbps", OURS, {}, data["read_gbps"])
    run.add("copy_gbps", OURS, {}, data["copy_gbps"])
    run.store.update_info(device=data["device"], read_probe={
        "read_bytes": data["read_bytes"], "copy_bytes": data["copy_bytes"], "read_shape": data["read_shape"]})
    run.log(f"card: read {report._fmt(sorted(data['read_gbps'])[len(data['read_gbps']) // 2])} GB/s, "
            f"copy {report._fmt(sorted(data['copy_gbps'])[len(data['copy_gbps']) // 2])} GB/s")


# info keys whose values are dicts the child adds to row by row (kept, not replaced)
MERGED_INFO = ("spec_details", "phase_tables")


def _run_child(run: Run, tag: str, cmd: list[str], rows: list[tuple[str, str, dict]]) -> set[str]:
    """Run an `openjet_plugin.bench.ours` child, keep what it measured and mark every row it did
    not make with its reason. Returns the keys of the rows made."""
    out = run.cache / f"{tag}-{run.session}.jsonl"
    log_path = run.cache / f"{tag}-{run.session}.log"
    cmd = cmd + ["--out", str(out)]
    if run.deadline is not None:
        cmd += ["--deadline", f"{run.deadline - 5:.0f}"]
    timed_out = False
    with open(log_path, "a") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=run.timeout()).returncode
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    made: set[str] = set()
    error = None
    if out.is_file():
        for line in out.read_text().splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "metric" in obj:
                run.add(obj["metric"], OURS, obj["params"], obj["samples"])
                made.add(report.row_key(obj["metric"], OURS, obj["params"]))
            elif "skip" in obj:
                k = obj["skip"]
                run.mark([(k["metric"], k["engine"], k["params"])], obj["reason"])
            elif "info" in obj:
                info = dict(obj["info"])
                for k in MERGED_INFO:
                    if isinstance(info.get(k), dict):
                        info[k] = {**run.store.info.get(k, {}), **info[k]}
                run.store.update_info(**info)
            elif "error" in obj:
                error = obj["error"]
    left_over = [r for r in rows if report.row_key(*r) not in made and report.row_key(*r) not in run.not_measured]
    if timed_out:
        run.mark(left_over, OUT_OF_TIME)
    elif left_over:
        run.mark(left_over, f"our engine failed: {error or f'exit {rc}, see {log_path}'}")
    return made


def group_ours(run: Run) -> None:
    s = run.settings
    verify = [p for p in s.verify_positions
              if not all(run.store.has(m, OURS, {"positions": p, "depth": s.verify_depth}) for m in ("verify_ms", "projection_gbps"))]
    depths = [d for d in s.depths if not run.store.has("decode_tps", OURS, {"depth": d})]
    spec = [(a, d) for a in s.acceptances for d in s.drafts if not run.store.has("spec_tps", OURS, spec_params(s, a, d))]
    mtp = [(d, dep) for dep in s.depths for d in our_chain_drafts(s)
           if not run.store.has("spec_mtp_tps", OURS, spec_mtp_params(d, dep))]
    trees = [(b, sh, dep) for dep in s.depths for b in s.tree_budgets for sh in s.tree_shapes
             if not run.store.has("spec_tree_tps", OURS, tree_params(b, sh, dep))]
    peak_row = ("peak_mem_gb", OURS, {"max_depth": max(s.depths)})
    if not verify and not depths and not spec and not mtp and not trees and run.store.has(*peak_row):
        return
    from ..backends.native import MAX_POSITIONS
    n_ctx = max([s.verify_depth + 2 * MAX_POSITIONS * (s.reps + 2)]
                + [d + (s.reps + 1) * s.decode_tokens + 64 for d in s.depths]
                + [s.spec_depth + s.decode_tokens + max(our_chain_drafts(s)) + 64])
    cmd = [sys.executable, "-m", "openjet_plugin.bench.ours", "--model", str(run.model),
           "--verify", ",".join(map(str, verify)), "--verify-depth", str(s.verify_depth),
           "--decode-depths", ",".join(map(str, depths)), "--decode-tokens", str(s.decode_tokens),
           "--spec", ",".join(f"{a}:{d}" for a, d in spec), "--spec-mtp", ",".join(f"{d}@{dep}" for d, dep in mtp),
           "--spec-tree", ",".join(f"{b}:{sh}@{dep}" for b, sh, dep in trees),
           "--spec-depth", str(s.spec_depth), "--spec-tokens", str(s.decode_tokens),
           "--reps", str(s.reps), "--n-ctx", str(n_ctx)]
    rows = ([(m, OURS, {"positions": p, "depth": s.verify_depth}) for p in verify for m in ("verify_ms", "projection_gbps")]
            + [("decode_tps", OURS, {"depth": d}) for d in depths]
            + [("spec_tps", OURS, spec_params(s, a, d)) for a, d in spec]
            + [("spec_mtp_tps", OURS, spec_mtp_params(d, dep)) for d, dep in mtp]
            + [("spec_tree_tps", OURS, tree_params(b, sh, dep)) for b, sh, dep in trees])
    run.log(f"openjet: {len(rows)} measurements in a child process (n_ctx {n_ctx})")
    with smi.PeakMemory() as pm:
        made = _run_child(run, "ours", cmd, rows)
    if made and not run.store.has(*peak_row):
        if pm.peak_gb is not None:
            run.add(*peak_row, [pm.peak_gb])
        else:
            run.mark([peak_row], "nvidia-smi gave no memory readings")
    elif not made and not run.store.has(*peak_row):
        run.mark([peak_row], run.not_measured.get(report.row_key(*rows[0]), "our engine ran nothing") if rows
                 else "our engine ran nothing")
    run.log(f"openjet: {len(made)} of {len(rows)} measurements made")


def group_ours_prefill(run: Run) -> None:
    """prefill_tps of our engine (bench/prefill.py), in its own child process."""
    s = run.settings
    todo = [(n, d) for n, d in s.prefill if not run.store.has("prefill_tps", OURS, prefill_params(n, d))]
    if not todo:
        return
    rows = [("prefill_tps", OURS, prefill_params(n, d)) for n, d in todo]
    cmd = [sys.executable, "-m", "openjet_plugin.bench.ours", "--model", str(run.model),
           "--verify", "", "--decode-depths", "",
           "--prefill", ",".join(f"{n}:{d}" for n, d in todo), "--reps", str(s.reps)]
    run.log(f"openjet: prefill {todo} (new tokens, depth) in a child process")
    made = _run_child(run, "ours-prefill", cmd, rows)
    run.log(f"openjet: {len(made)} of {len(rows)} prefill measurements made")


def accept_model() -> Path:
    """The trained default model shipped with the package (what accepted_per_cycle measures)."""
    from ..defaults import SHIPPED_DEFAULT
    return SHIPPED_DEFAULT


def group_acceptance(run: Run) -> None:
    s = run.settings
    todo = [(t, d) for t in s.accept_temperatures for d in s.drafts
            if not run.store.has("accepted_per_cycle", OURS, accept_params(d, t))]
    trees = [(t, b) for t in s.accept_temperatures for b in s.tree_budgets
             if not run.store.has("tree_accepted_per_cycle", OURS, accept_tree_params(b, t))]
    if not todo and not trees:
        return
    rows = ([("accepted_per_cycle", OURS, accept_params(d, t)) for t, d in todo]
            + [("tree_accepted_per_cycle", OURS, accept_tree_params(b, t)) for t, b in trees])
    cmd = [sys.executable, "-m", "openjet_plugin.bench.ours", "--model", str(accept_model()),
           "--verify", "", "--decode-depths", "",
           "--accept", ",".join(f"{float(t)}:{d}" for t, d in todo),
           "--accept-trees", ",".join(f"{float(t)}:{b}" for t, b in trees),
           "--accept-prompts", str(s.accept_prompts), "--accept-prompt-tokens", str(s.accept_prompt_tokens),
           "--accept-tokens", str(s.accept_tokens), "--reps", str(s.reps)]
    run.log(f"openjet: {len(rows)} acceptance measurements on the trained default model")
    made = _run_child(run, "ours-accept", cmd, rows)
    run.log(f"openjet: {len(made)} of {len(rows)} acceptance measurements made")


def _peer_binary(run: Run) -> Path:
    if run.peer_problem:
        raise peer.PeerError(run.peer_problem)
    assert run.peer_build is not None
    if not run.peer_build.ready():
        run.log("llama.cpp: waiting for the llama-bench build")
    return peer.wait_for_build(run.peer_build, run.deadline or float("inf"), run.peer_proc)


def _llama_bench(run: Run, what: str, **kw) -> tuple[list[peer.PeerTest], float | None]:
    binary = _peer_binary(run)
    s = run.settings
    cmd = peer.bench_command(binary, run.model, reps=s.reps, n_batch=s.peer_batch, **kw)
    run.log(f"llama.cpp: {what}")
    with smi.PeakMemory() as pm:
        tests = peer.run_llama_bench(cmd, timeout=run.timeout(), log_path=run.cache / f"llama-bench-{run.session}.log")
    if tests:
        r = tests[0].raw
        run.store.update_info(llama_bench={k: r.get(k) for k in ("build_commit", "build_number", "gpu_info",
                                                                   "backends", "type_k", "type_v", "n_threads")})
    return tests, pm.peak_gb


def group_peer_decode(run: Run) -> None:
    s = run.settings
    depths = [d for d in s.depths if not run.store.has("decode_tps", PEER, {"depth": d})]
    peak_row = ("peak_mem_gb", PEER, {"max_depth": max(s.depths)})
    if not depths:
        return
    tests, peak = _llama_bench(run, f"decode {s.decode_tokens} tokens at depths {depths}",
                               n_gen=[s.decode_tokens], depths=depths, n_ubatch=s.peer_ubatch)
    for t in tests:
        if t.kind == "tg":
            run.add("decode_tps", PEER, {"depth": t.n_depth}, t.tokens_per_second())
    if max(s.depths) in depths and not run.store.has(*peak_row):
        if peak is not None:
            run.add(*peak_row, [peak])
        else:
            run.mark([peak_row], "nvidia-smi gave no memory readings")


def group_peer_verify(run: Run) -> None:
    s = run.settings
    todo = [p for p in s.verify_positions
            if not run.store.has("verify_ms", PEER, {"positions": p, "depth": s.verify_depth})]
    if not todo:
        return
    tests, _ = _llama_bench(run, f"batches of {todo} positions at depth {s.verify_depth}",
                            n_prompt=todo, depths=[s.verify_depth], n_ubatch=max(s.peer_ubatch, max(todo)))
    for t in tests:
        if t.kind == "pp":
            run.add("verify_ms", PEER, {"positions": t.n_prompt, "depth": t.n_depth}, t.milliseconds())


def group_peer_prefill(run: Run, new_tokens: int, depth: int) -> None:
    params = {"new_tokens": new_tokens, "depth": depth}
    if run.store.has("prefill_tps", PEER, params):
        return
    tests, _ = _llama_bench(run, f"prefill {new_tokens} tokens at depth {depth}",
                            n_prompt=[new_tokens], depths=[depth], n_ubatch=run.settings.peer_ubatch)
    for t in tests:
        if t.kind == "pp":
            run.add("prefill_tps", PEER, {"new_tokens": t.n_prompt, "depth": t.n_depth}, t.tokens_per_second())


PEER_REQUEST_TIMEOUT = 900.0   # seconds for one llama-server request (a 30K prefill takes ~15 s on an H200)


def _peer_server(run: Run) -> tuple[peer.PeerBuild, int]:
    """The peer's build with its llama-server (PeerError naming what failed to build) and the
    model's vocabulary size, which the prompt token ids are drawn from."""
    from ..model_file import open_model

    _peer_binary(run)
    pb = run.peer_build
    assert pb is not None
    problem = pb.server_problem()
    if problem:
        raise peer.PeerError(problem)
    with open_model(run.model) as mf:
        return pb, mf.config.n_vocab


def group_peer_spec(run: Run, drafts: int) -> None:
    """llama.cpp's MTP speculative decoding at draft depth `drafts`, at every depth: one
    llama-server, the same prompt tokens as our spec_mtp_tps rows (bench/peer_spec.py)."""
    from functools import partial

    from . import peer_spec
    from .spec import prompt_tokens

    s = run.settings
    todo = [p for _, _, p in peer_spec_rows(s, drafts) if not run.store.has("spec_mtp_tps", PEER, p)]
    if not todo:
        return
    pb, n_vocab = _peer_server(run)
    default = peer_spec.default_draft_max(pb.llama_src)
    depths = sorted(p["depth"] for p in todo)
    tokens = prompt_tokens(n_vocab, depths[-1] + 1)
    n_ctx = depths[-1] + 1 + s.decode_tokens + 1 + drafts + 64
    command = partial(peer_spec.server_command, pb.server_binary, run.model, drafts, n_ctx)
    log_path = run.cache / f"llama-server-{run.session}.log"

    def on_row(depth: int, samples: list[float], runs) -> None:
        params = spec_mtp_params(drafts, depth)
        run.add("spec_mtp_tps", PEER, params, samples)
        details = peer_spec.row_details(runs, s.decode_tokens, drafts, default)
        key = report.row_key("spec_mtp_tps", PEER, params)
        run.store.update_info(spec_details={**run.store.info.get("spec_details", {}), key: details})
        run.log(f"llama.cpp spec D={drafts} depth {depth}: median "
                f"{report._fmt(sorted(samples)[len(samples) // 2])} tokens/s, acceptance {details['acceptance']:.2f}")

    run.log(f"llama.cpp: MTP speculation, D = {drafts}, depths {depths} (llama-server, n_ctx {n_ctx})")
    with peer_spec.LlamaServer(command, log_path, load_timeout=min(peer_spec.LOAD_TIMEOUT, run.left())) as server:
        run.store.update_info(llama_server={"command": server.cmd, "default_drafts": default})
        # a request that hangs must not hold the run forever: none takes minutes on the GPU
        peer_spec.measure(server, {d: tokens[:d + 1] for d in depths}, s.decode_tokens, s.reps,
                          lambda: min(run.left(), PEER_REQUEST_TIMEOUT), on_row)


def group_ours_concurrent(run: Run) -> None:
    """Our engine's concurrent rows (bench/concurrent.py), in a child process: the Engine with
    n_slots = streams on the backend load() picks."""
    todo = [(m, p) for m, _, p in run.missing(concurrent_rows(run.settings, OURS))]
    if not todo:
        return
    p = concurrent_plan(run.settings)
    cmd = [sys.executable, "-m", "openjet_plugin.bench.concurrent", "--model", str(run.model),
           "--streams", ",".join(map(str, p.streams)), "--tokens", str(p.tokens),
           "--prompt-tokens", str(p.prompt_tokens), "--reps", str(p.reps),
           "--spec", f"{p.spec_streams}:{p.drafts}",
           "--latency", f"{p.latency_streams}:{p.latency_prompt}:{p.latency_tokens}",
           "--rows", json.dumps(todo)]
    rows = [(m, OURS, params) for m, params in todo]
    run.log(f"openjet: {len(rows)} concurrent measurements in a child process")
    made = _run_child(run, "ours-concurrent", cmd, rows)
    run.log(f"openjet: {len(made)} of {len(rows)} concurrent measurements made")


def group_peer_concurrent(run: Run) -> None:
    """llama.cpp's concurrent rows: one llama-server of 8 slots on the same file for the plain rows,
    a second with MTP speculation for the speculative row, the same prompts as ours."""
    from functools import partial

    from . import concurrent, peer_spec

    s = run.settings
    todo = [(m, p) for m, _, p in run.missing(concurrent_rows(s, PEER))]
    if not todo:
        return
    plan_ = concurrent_plan(s)
    concurrent.check_plan(plan_)
    pb, n_vocab = _peer_server(run)
    prompts, long_prompts = plan_.prompts(n_vocab)
    slots = max(plan_.streams + (plan_.spec_streams, plan_.latency_streams + 1))
    n_ctx = concurrent.server_context(plan_, slots)
    log_path = run.cache / f"llama-server-concurrent-{run.session}.log"

    def on_row(metric: str, params: dict, samples: list[float], details: dict) -> None:
        run.add(metric, PEER, params, samples)
        key = report.row_key(metric, PEER, params)
        run.store.update_info(spec_details={**run.store.info.get("spec_details", {}), key: details})
        run.log(f"llama.cpp {metric} {params}: median {report._fmt(sorted(samples)[len(samples) // 2])}")

    def timeout() -> float:
        return min(run.left(), PEER_REQUEST_TIMEOUT)

    reference = None
    for drafts in (0, plan_.drafts):
        rows = [(m, p) for m, p in todo if p.get("drafts", 0) == drafts]
        if not rows:
            continue
        command = partial(peer_spec.server_command, pb.server_binary, run.model, drafts, n_ctx, slots=slots)
        run.log(f"llama.cpp: {len(rows)} concurrent measurements (llama-server -np {slots}, -c {n_ctx}, D {drafts})")
        with peer_spec.LlamaServer(command, log_path, load_timeout=min(peer_spec.LOAD_TIMEOUT, run.left())) as server:
            reference = concurrent.measure_server(server, plan_, prompts, long_prompts, rows, timeout, on_row,
                                                  reference, drafts)


def group_agreement(run: Run) -> None:
    """Teacher-forced agreement with llama.cpp (bench/agreement.py): one child per model, our
    engine in it and llama_logits (compiled against the peer's libllama) streaming beside it; then,
    for the default model, a child with the numpy reference in our engine's place (the floor rows)."""
    from . import agreement

    todo = [(label, d, p) for label, d, p in run.settings.agreement
            if run.missing([(m, OURS, agreement.row_params(label, d, p)) for m in AGREEMENT_METRICS])]
    floor = [(label, d, p) for label, d, p in run.settings.agreement if label != BENCH_LABEL
             and run.missing([(m, OURS, agreement.row_params(label, d, p)) for m in REFERENCE_AGREEMENT_METRICS])]
    if not todo and not floor:
        return
    _peer_binary(run)
    pb = run.peer_build
    assert pb is not None
    binary = peer.compile_llama_logits(agreement.LLAMA_LOGITS_SRC, pb.root / "llama_logits",
                                       peer.llama_include_dirs(pb.llama_src), pb.lib_dir)
    for engine, items_all, metrics in (("native", todo, AGREEMENT_METRICS), ("reference", floor, REFERENCE_AGREEMENT_METRICS)):
        for label in dict.fromkeys(label for label, _, _ in items_all):
            items = [(d, p) for lb, d, p in items_all if lb == label]
            model = run.model if label == BENCH_LABEL else accept_model()
            rows = [(m, OURS, agreement.row_params(label, d, p)) for d, p in items for m in metrics]
            # random ids on the random-weight bench model; text the trained model reads as text
            cmd = [sys.executable, "-m", "openjet_plugin.bench.agreement", "--model", str(model), "--label", label,
                   "--rows", ",".join(f"{d}:{p}" for d, p in items), "--engine", engine,
                   "--tokens", "random" if label == BENCH_LABEL else "stdlib",
                   "--llama-logits", str(binary), "--require-gpu", "--workdir", str(run.cache / "agreement")]
            side = "our engine" if engine == "native" else "the numpy reference"
            run.log(f"agreement: {label} ({model.name}) at depths {[d for d, _ in items]}, {side} teacher-forced "
                    "against llama.cpp")
            tag = f"agreement-{label}" + ("" if engine == "native" else "-reference")
            made = _run_child(run, tag, cmd, rows)
            run.log(f"agreement: {len(made)} of {len(rows)} {label} rows made ({side})")


def _fallback_env(run: Run) -> dict[str, str]:
    """The environment of a child that runs openjet's llama.cpp backend on the peer's CUDA
    libllama (waits for the peer build)."""
    _peer_binary(run)
    assert run.peer_build is not None
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(run.peer_build.lib_dir)}
    if importlib.util.find_spec("llama_cpp") is None:
        # a host without llama-cpp-python (the GPU machine): its Python package from the peer's
        # sdist, on the libllama built beside llama-bench
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(run.peer_build.root / "src"), env.get("PYTHONPATH")) if p)
    return env


def group_fallback(run: Run) -> None:
    """openjet's llama.cpp backend on the peer's CUDA libllama: decode at depth 0 (bench/fallback.py)."""
    s = run.settings
    row = ("fallback_decode_tps", PEER, {"depth": 0})
    if run.store.has(*row):
        return
    env = _fallback_env(run)
    out = run.cache / f"fallback-{run.session}.jsonl"
    log_path = run.cache / f"fallback-{run.session}.log"
    cmd = [sys.executable, "-m", "openjet_plugin.bench.fallback", "--model", str(run.model),
           "--tokens", str(s.decode_tokens), "--reps", str(s.reps), "--out", str(out)]
    run.log(f"openjet fallback (llama.cpp backend): decode {s.decode_tokens} tokens at depth 0")
    with open(log_path, "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=run.timeout()).returncode
    for line in (out.read_text().splitlines() if out.is_file() else []):
        obj = json.loads(line)
        if "metric" in obj:
            run.add(obj["metric"], PEER, obj["params"], obj["samples"])
        elif "info" in obj:
            run.store.update_info(**obj["info"])
    if not run.store.has(*row):
        run.mark([row], f"the fallback child failed (exit {rc}, see {log_path})")


def group_memory(run: Run) -> None:
    """What `openjet info` plans for serving the model (planned_mem_gb) beside the device memory
    loading it, filling every slot and decoding takes (peak_mem_gb), each (backend, slots, n_ctx)
    in a fresh child (bench/memory.py); the llama.cpp backend on the peer's CUDA libllama."""
    from . import memory

    log_path = run.cache / f"memory-{run.session}.log"
    for backend, slots, n_ctx in run.settings.memory:
        params = memory_params(backend, slots, n_ctx)
        rows = [(m, OURS, params) for m in MEMORY_METRICS]
        if all(run.store.has(*r) for r in rows):
            continue
        if backend == "llama.cpp" and run.no_peer:
            run.mark(rows, NO_PEER)          # no llama.cpp build in this run
            continue
        try:
            env = _fallback_env(run) if backend == "llama.cpp" else None
        except peer.PeerError as exc:
            run.mark(rows, f"llama.cpp build: {str(exc).splitlines()[0][:300]}")
            continue
        run.log(f"openjet memory: {backend}, {slots} slot(s) x {n_ctx} in a child")
        try:
            m = memory.measure(run.model, backend=backend, n_ctx=n_ctx, slots=slots, env=env,
                               timeout=run.timeout(), log_path=log_path)
        except subprocess.TimeoutExpired:
            run.mark(rows, OUT_OF_TIME)
            return
        except RuntimeError as exc:
            run.mark(rows, f"{exc} (see {log_path})")
            continue
        if m.device_bytes is None:
            run.mark(rows, "no device memory reading in the child (it reads cudaMemGetInfo through torch)")
            continue
        run.add("planned_mem_gb", OURS, params, [m.planned_bytes / 1e9])
        run.add("peak_mem_gb", OURS, params, [m.device_bytes / 1e9])
        run.log(f"openjet memory: planned {m.planned_bytes / 1e9:.2f} GB, device {m.device_bytes / 1e9:.2f} GB "
                f"(planned/measured {m.ratio:.3f})")


# constrained decoding's CPU cost per token on the 27B's vocabulary size (bench/constraint.py)
CONSTRAINT_ROW = ("constraint_mask_us", OURS, {"n_vocab": 248320, "grammar": "json_schema"})


def group_constraint(run: Run) -> None:
    """llguidance's mask + its application + the grammar step per token (bench/constraint.py)."""
    if run.store.has(*CONSTRAINT_ROW):
        return
    out = run.cache / f"constraint-{run.session}.jsonl"
    log_path = run.cache / f"constraint-{run.session}.log"
    cmd = [sys.executable, "-m", "openjet_plugin.bench.constraint", "--reps", str(run.settings.reps),
           "--vocab", str(run.model), "--out", str(out)]
    run.log("openjet constraint: mask cost per token, 248K vocabulary, on the CPU")
    with open(log_path, "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=run.timeout()).returncode
    for line in (out.read_text().splitlines() if out.is_file() else []):
        obj = json.loads(line)
        if "metric" in obj:
            run.add(obj["metric"], OURS, obj["params"], obj["samples"])
        elif "info" in obj:
            run.store.update_info(**obj["info"])
    if not run.store.has(*CONSTRAINT_ROW):
        run.mark([CONSTRAINT_ROW], f"the constraint child failed (exit {rc}, see {log_path})")


NOT_SELECTED = "not selected (--only)"   # the reason given to rows that --only leaves out
NO_OURS, NO_PEER = "disabled by --no-ours", "disabled by --no-peer"
ASKED_NOT_TO = (NOT_SELECTED, NO_OURS, NO_PEER)   # rows the command line left out: not failures


def groups(run: Run) -> list[tuple[str, float, list, object]]:
    """(name, seconds it needs at least, its rows, function) in the order they run."""
    s = run.settings
    card = [("read_gbps", OURS, {}), ("copy_gbps", OURS, {})]
    ours = ([(m, OURS, {"positions": p, "depth": s.verify_depth}) for p in s.verify_positions
             for m in ("verify_ms", "projection_gbps")]
            + [("decode_tps", OURS, {"depth": d}) for d in s.depths] + [("peak_mem_gb", OURS, {"max_depth": max(s.depths)})]
            + spec_rows(s))
    pdec = [("decode_tps", PEER, {"depth": d}) for d in s.depths] + [("peak_mem_gb", PEER, {"max_depth": max(s.depths)})]
    pver = [("verify_ms", PEER, {"positions": p, "depth": s.verify_depth}) for p in s.verify_positions]
    # seconds each group needs at least, from llama.cpp's rates on the H200 (shared/notes/gpu.md:
    # ~2,000 tokens/s prefill, ~80 tokens/s decode) plus loading the model: groups that cannot
    # finish before the deadline are left for the next run instead of being cut off half-way
    load, pp, tg = 15.0, 1800.0, 75.0
    out = [("card", 20.0, card, group_card)]
    if not run.no_ours:
        # the default model is 22 MB: loading and 12 prompts x 64 tokens per row take seconds, so it
        # goes before the group that can take all the time left
        out.append(("openjet acceptance", 45.0, accept_rows(s), group_acceptance))   # chains and trees
        out.append(("openjet constraint", 20.0, [CONSTRAINT_ROW], group_constraint))
        # prefill: loading plus fills and appends at a few thousand tokens/s
        pre = load + sum(d / (2 * pp) + (s.reps + 1) * n / (2 * pp) for n, d in s.prefill)
        out.append(("openjet prefill", pre, prefill_rows(s, OURS), group_ours_prefill))
        out.append(("openjet", 60.0, ours, group_ours))
        out.append(("openjet concurrent", concurrent_seconds(s, load, pp, tg, len(s.concurrent_streams) + 2),
                    concurrent_rows(s, OURS), group_ours_concurrent))
        # two loads per item (the child's warm-up engine and the measured one), every slot filled
        out.append(("openjet memory", sum(2 * load + slots * n_ctx / pp for _, slots, n_ctx in s.memory),
                    memory_rows(s), group_memory))
    if not run.no_peer:
        dec = load + sum(d / pp + (s.reps + 1) * s.decode_tokens / tg for d in s.depths)
        ver = load + s.verify_depth / pp + len(s.verify_positions) * (s.reps + 1) * 0.05
        out += [("llama.cpp decode", dec, pdec, group_peer_decode),
                ("llama.cpp verify", ver, pver, group_peer_verify),
                # the fallback backend through our API on the same CUDA libllama (issue 24)
                ("llama.cpp fallback", load + (s.reps + 1) * s.decode_tokens / tg,
                 [("fallback_decode_tps", PEER, {"depth": 0})], group_fallback)]
        for n, d in s.prefill:
            need = load + (d + (s.reps + 1) * n) / pp
            out.append((f"llama.cpp prefill {n}@{d}", need, [("prefill_tps", PEER, {"new_tokens": n, "depth": d})],
                        lambda r, n=n, d=d: group_peer_prefill(r, n, d)))
        # one llama-server per D; every repetition (and each row's warm-up) prefills its depth
        # afresh (peer_spec.py says why), and speculation decodes at least as fast as plain decode
        spec = load + sum((s.reps + 1) * (dep / pp + s.decode_tokens / tg) for dep in s.depths)
        for D in s.drafts:
            out.append((f"llama.cpp spec D={D}", spec, peer_spec_rows(s, D),
                        lambda r, D=D: group_peer_spec(r, D)))
        if not run.no_ours:
            # both engines load the model and prefill each depth (at the same time; the default
            # model's 22 MB take seconds), then the teacher-forced positions 8 per call, each chunk's
            # logits compared on the CPU in float64 (~200 rows of 248K logits a second)
            agree = sum((2 * load + d / pp if label == BENCH_LABEL else 5.0) + p / 200.0 for label, d, p in s.agreement)
            # the numpy reference on the default model: ~150 positions a second on 2 cores
            agree += sum(5.0 + (d + p) / 150.0 for label, d, p in s.agreement if label != BENCH_LABEL)
            out.append(("agreement", agree, agreement_rows(s) + reference_agreement_rows(s), group_agreement))
        out.append(("llama.cpp concurrent", concurrent_seconds(s, load, pp, tg, 2), concurrent_rows(s, PEER),
                    group_peer_concurrent))
    return out


def concurrent_seconds(s: Settings, load: float, pp: float, tg: float, loads: int) -> float:
    """The least the concurrent rows take: `loads` model loads (ours: an engine per stream count,
    the latency rows' and the speculative one's; llama.cpp: two servers), the requests alone, every
    round at least one stream's decode time, the long prompts."""
    p = concurrent_plan(s)
    solo = max(p.streams + (p.spec_streams,)) * p.tokens / tg
    rounds = (p.reps + 1) * (len(p.streams) + 1) * p.tokens / tg
    latency = (p.reps + 1) * (2 * p.latency_tokens / tg + p.latency_prompt / pp)
    return loads * load + solo + rounds + latency


def selected(name: str, only: tuple[str, ...]) -> bool:
    """--only: a group is selected by an item it starts with, or, for an item ending in "=", by
    that exact name ("openjet=": decode, verify and speculation without the other openjet groups)."""
    return any(name == item[:-1] if item.endswith("=") else name.startswith(item) for item in only)


def run_groups(run: Run) -> None:
    todo_groups = groups(run)
    if run.peer_build is not None and run.peer_build.ready():
        # llama.cpp is already built (a resumed run): measure it first, since our engine's part
        # is the one that can take all the time left (filling deep states 8 positions per call)
        todo_groups.sort(key=lambda g: 1 if g[0] == "openjet" else 0)
    for name, need, rows, fn in todo_groups:
        todo = run.missing(rows)
        if not todo:
            continue
        if run.only and not selected(name, run.only):
            run.mark(todo, NOT_SELECTED)
            continue
        try:
            if name.startswith("llama.cpp"):
                _peer_binary(run)          # waits for the build: check the time after it
            if run.left() < need:
                run.log(f"{name}: left for the next run ({run.left():.0f} s left, it needs about {need:.0f} s)")
                run.mark(todo, OUT_OF_TIME)
                continue
            fn(run)
        except TimeoutError as exc:
            run.log(f"{name}: {exc}")
            run.mark(run.missing(rows), OUT_OF_TIME)
        except (peer.PeerError, roofline.RooflineError, OSError, ValueError) as exc:
            run.log(f"{name}: failed: {exc}")
            run.mark(run.missing(rows), f"{name} failed: {str(exc).splitlines()[0][:300]}")
        still = [r for r in run.missing(rows) if report.row_key(*r) not in run.not_measured]
        if still:
            run.mark(still, f"{name} did not produce this measurement")


# --- model, report ---------------------------------------------------------------------------------------

# The generated bench model's MTP head (issue 28): right after 75% of the tokens and, where it is
# wrong, the right token second after half of those. The random-weight head is right ~97-99% of the
# time at every slot, which no real model's is (Qwen3.8-27B's: ~0.9 on code, ~0.5 on prose, teacher-
# forced): speculation's rows and the targets are read at a per-draft acceptance of 0.75, and
# a draft tree can gain only where the head's second choice is sometimes right.
BENCH_MTP_ACCURACY = 0.75
BENCH_MTP_RUNNER_UP = 0.5


def default_model(cache: Path, log, mtp_accuracy: float | None = BENCH_MTP_ACCURACY,
                  mtp_runner_up: float | None = BENCH_MTP_RUNNER_UP) -> Path:
    """The generated q27b Q4_K_M (exact 27B shapes, 16.8 GB), made once into the cache; one file per
    MTP head: its accuracy (right after that share of the tokens; synth.py, "MTP accuracy"; None: the
    random-weight head as generated) and runner-up share (where it is wrong, the right token second
    after that share; "MTP runner-up"; None: never). The defaults are the bench's own head."""
    path = cache / ("q27b-Q4_K_M-seed0.gguf" if mtp_accuracy is None
                    else f"q27b-Q4_K_M-seed0-mtp{float(mtp_accuracy):g}"
                         + ("" if mtp_runner_up is None else f"-ru{float(mtp_runner_up):g}") + ".gguf")
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if free < 18e9:
        raise OSError(f"{cache}: {free / 1e9:.1f} GB free, generating the q27b model needs about 17 GB "
                      "(pass --model, or --cache-dir on a larger disk)")
    from ..testing.synth import synth_model

    tmp = cache / f".q27b-{os.getpid()}.gguf"
    log(f"generating the q27b Q4_K_M model into {path} (once)")
    try:
        extra = {} if mtp_runner_up is None else {"mtp_runner_up": mtp_runner_up}
        synth_model(tmp, preset="q27b", quant="Q4_K_M", seed=0, force=True, mtp_accuracy=mtp_accuracy, **extra)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def derived_roofline(store: Store, weight_bytes: int, config, depths) -> list[dict]:
    reads = [r for r in store.records() if r["metric"] == "read_gbps"]
    if not reads:
        return []
    out = []
    for d in depths:
        b = roofline.bytes_per_position(weight_bytes, config, d)
        out.append(report.result("roofline_tps", OURS, {"depth": d},
                                 [g * 1e9 / b for g in reads[0]["samples"]]))
    return out


def prefill_manifest(config, s: Settings, gpu_name: str | None) -> dict:
    """What the prefill table divides by: each scenario's FLOPs (bench/prefill.py) and the card's
    dense bf16 tensor-core rate (None for a card we have no figure for)."""
    from . import prefill

    peak = prefill.peak_bf16_tflops(gpu_name)
    return {"bf16_dense_tflops": peak,
            "peak_source": ("NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, 989 dense"
                            if peak else f"no dense bf16 figure for {gpu_name!r}"),
            "projection_params": prefill.projection_params(config),
            "flops_formula": ("2 * projection_params * N + 2 * n_embd * n_vocab + 4 * N * (depth + (N + 1) / 2) "
                              "* head_dim * n_head * n_attention_layers"),
            "rows": [{"new_tokens": n, "depth": d, "flops": prefill.prefill_flops(config, n, d)} for n, d in s.prefill]}


def build_report(run: Run, man: dict, pending: list[dict], planned, weight: dict, config) -> dict:
    results = [report.result(r["metric"], r["engine"], r["params"], r["samples"]) for r in run.store.records()]
    results += derived_roofline(run.store, weight["weight_bytes"], config, run.settings.depths)
    not_measured = []
    for metric, engine, params in planned:
        if not run.store.has(metric, engine, params):
            key = report.row_key(metric, engine, params)
            not_measured.append({"metric": metric, "engine": engine, "params": params,
                                 "reason": run.not_measured.get(key, "not measured in this run")})
    man["pending"] = pending
    man["not_measured"] = not_measured
    rep = {"manifest": man, "results": results}
    report.validate_report(rep)
    return rep


# --- entry point ---------------------------------------------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return vals


def _share_or_none(text: str) -> float | str:
    if text.strip().lower() == "none":
        return "none"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def head_of_args(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """The generated model's MTP head that `--mtp-accuracy` / `--mtp-runner-up` ask for: the bench's
    (BENCH_MTP_ACCURACY, BENCH_MTP_RUNNER_UP) where neither is given; an accuracy given alone has no
    runner-up; 'none' is the random-weight head as generated. ValueError naming the option where they
    do not go together or are given with --model (that file's head is its own)."""
    acc, ru = args.mtp_accuracy, args.mtp_runner_up
    if getattr(args, "model", None):
        if acc is not None or ru is not None:
            raise ValueError("--mtp-accuracy and --mtp-runner-up apply to the generated bench model, not to --model")
        return None, None
    if acc is None and ru is None:
        return BENCH_MTP_ACCURACY, BENCH_MTP_RUNNER_UP
    if acc is None:
        acc = BENCH_MTP_ACCURACY
    if acc == "none":
        if ru not in (None, "none"):
            raise ValueError("--mtp-runner-up needs an --mtp-accuracy below 1, not 'none' (the random head)")
        return None, None
    return acc, None if ru in (None, "none") else ru


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated group names, got {text!r}")
    if any(not x.rstrip("=").strip() for x in names):
        raise argparse.ArgumentTypeError(f"an item of {text!r} names no group (just '=')")
    return names


def _prefill_list(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            n, d = (int(v) for v in item.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NEW_TOKENS:DEPTH items, got {item!r}") from None
        if n < 1 or d < 0:
            raise argparse.ArgumentTypeError(f"{item!r}: NEW_TOKENS must be >= 1 and DEPTH >= 0")
        out.append((n, d))
    if not out:
        raise argparse.ArgumentTypeError(f"expected NEW_TOKENS:DEPTH items, got {text!r}")
    return tuple(out)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="openjet bench", description=(
        "Benchmark the native engine against llama.cpp (llama-bench, CUDA) and the card's bandwidth "
        "roofline on one GPU; prints a markdown table, writes every raw sample and a manifest as JSON."))
    ap.add_argument("--model", "-m", help="GGUF to run (default: a generated q27b Q4_K_M, made once into the cache)")
    ap.add_argument("--json", help="write the report JSON here (default: <run folder>/bench.json)")
    ap.add_argument("--markdown", help="write the markdown table here too (default: <run folder>/bench.md)")
    ap.add_argument("--force", action="store_true", help="overwrite existing --json / --markdown files")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 repetitions, fewer depths, smaller sizes")
    ap.add_argument("--resume", help="folder of finished measurements: kept, skipped, and completed by this run")
    ap.add_argument("--reps", type=int, help="repetitions per measurement after warm-up (default 6, --quick 3)")
    ap.add_argument("--depths", type=_int_list, help="decode depths (default 0,8192,30720)")
    ap.add_argument("--time-budget", type=float, help="seconds this run may take; what does not fit is left for --resume")
    ap.add_argument("--cache-dir", help="models, builds and runs (default: $OPENJET_CACHE_DIR/bench or ~/.cache/openjet/bench)")
    ap.add_argument("--sdist", help="llama-cpp-python sdist (tarball or folder) to build llama-bench from")
    ap.add_argument("--peer-ubatch", type=int, default=512, help="llama.cpp ubatch size for prefill (default 512, its default)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="parallel jobs for the llama.cpp build")
    ap.add_argument("--no-peer", action="store_true", help="do not build or run llama.cpp")
    ap.add_argument("--only", type=_name_list, default=(),
                    help="run only the measurement groups whose names start with these, comma-separated "
                         "(groups: card, openjet acceptance, openjet prefill, openjet, openjet concurrent, "
                         "llama.cpp decode, llama.cpp verify, llama.cpp prefill, llama.cpp spec, agreement, "
                         "llama.cpp concurrent); e.g. --only 'openjet prefill,"
                         "llama.cpp prefill'; "
                         "an item ending in '=' selects that exact name ('openjet=': not acceptance or prefill)")
    ap.add_argument("--prefill", type=_prefill_list,
                    help="prefill scenarios as NEW_TOKENS:DEPTH items (default 2700:1800,12000:29500,64:4096; --quick 2700:1800,64:4096)")
    ap.add_argument("--no-ours", action="store_true", help="do not run our engine")
    ap.add_argument("--mtp-accuracy", type=_share_or_none, metavar="R",
                    help="generate the bench model with an MTP head right after a share R of the tokens "
                         f"(default {BENCH_MTP_ACCURACY}, with --mtp-runner-up {BENCH_MTP_RUNNER_UP}; 'none': the "
                         "random-weight head, right after nearly all); not with --model")
    ap.add_argument("--mtp-runner-up", type=_share_or_none, metavar="Q",
                    help="where the generated model's MTP head is wrong, rank the right token second after a "
                         f"share Q of those tokens (default {BENCH_MTP_RUNNER_UP} where neither option is given; "
                         "with --mtp-accuracy alone: never); not with --model")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    # Nothing the user gave is overwritten unless asked: checked before anything is measured.
    for flag, value in (("--json", args.json), ("--markdown", args.markdown)):
        if value and Path(value).exists() and not args.force:
            print(f"openjet bench: {flag} {value} already exists; pass --force to overwrite it", file=sys.stderr)
            return 2
    t_start = time.time()
    ok, why = smi.gpu_presence(0)
    if not ok:
        print(f"openjet bench: no NVIDIA GPU here: {why}.\nThe benchmark measures a GPU (our CUDA "
              "engine, llama.cpp's CUDA build and the card's bandwidth); run it on a machine with one, "
              "e.g. scripts/gpu.sh bench on the GPU machine.", file=sys.stderr)
        return 1
    if args.reps is not None and args.reps < 1:
        print("openjet bench: --reps must be at least 1", file=sys.stderr)
        return 1
    kw = {}
    if args.reps is not None:
        kw["reps"] = args.reps
    if args.depths is not None:
        kw["depths"] = tuple(sorted(set(args.depths)))
    kw["peer_ubatch"] = args.peer_ubatch
    if args.prefill is not None:
        kw["prefill"] = args.prefill
    settings = Settings.quick_run(**kw) if args.quick else Settings(**kw)

    from ..defaults import cache_dir
    cache = Path(args.cache_dir) if args.cache_dir else cache_dir() / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    session = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    run_dir = Path(args.resume) if args.resume else cache / "runs" / session
    deadline = t_start + args.time_budget if args.time_budget else None

    man = manifest_mod.collect(argv)
    arch = str(man["gpu"]["compute_cap"]).replace(".", "")
    if not arch.isdigit():
        arch = "90"

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    log(f"GPU: {why}; results in {run_dir}")
    # llama.cpp builds in the background from the start: it takes minutes
    sdist = pb = proc = None
    peer_problem = None
    if not args.no_peer:
        try:
            sdist = peer.find_sdist(manifest_mod.REPO_ROOT, args.sdist)
            pb = peer.build_dir(cache, sdist, arch)
            proc = peer.start_background_build(sdist, pb, arch, args.jobs)
            state = ("building llama-bench in the background" if proc else "llama-bench already built"
                     if pb.ready() else "llama-bench is being built by another process")
            log(f"llama.cpp: {state} ({pb.root})")
        except peer.PeerError as exc:
            peer_problem = str(exc)
            log(f"llama.cpp: {exc}")

    try:
        mtp_accuracy, mtp_runner_up = head_of_args(args)
        if not args.model:
            from ..testing.synth import check_mtp_accuracy, check_mtp_runner_up
            from ..config import PRESETS
            check_mtp_accuracy(PRESETS["q27b"], mtp_accuracy)
            check_mtp_runner_up(PRESETS["q27b"], mtp_accuracy, mtp_runner_up)
        model = Path(args.model) if args.model else default_model(cache, log, mtp_accuracy, mtp_runner_up)
        if not model.is_file():
            raise FileNotFoundError(f"--model {model}: no such file")
        from ..model_file import open_model
        with open_model(model) as mf:
            config = mf.config
            weight = roofline.weight_bytes_per_position(mf)
        st = model.stat()
        identity = json.loads(json.dumps({"model_bytes": st.st_size,
                                          "model_fingerprint": manifest_mod.model_fingerprint(model),
                                          "gpu": man["gpu"]["name"], "settings": asdict(settings)}))
        store = Store(run_dir, identity)
    except (ResumeMismatch, OSError, ValueError, RuntimeError) as exc:
        print(f"openjet bench: error: {exc}", file=sys.stderr)
        if proc is not None:
            proc.terminate()
        return 1

    sha: dict = {}
    hasher = threading.Thread(target=lambda: sha.setdefault(
        "v", manifest_mod.model_sha256(model, cache / "sha256-cache.json")), daemon=True)
    hasher.start()

    run = Run(settings=settings, store=store, model=model, cache=cache, deadline=deadline, session=session,
              arch=arch, no_ours=args.no_ours, no_peer=args.no_peer, only=args.only, sdist=sdist, peer_build=pb,
              peer_proc=proc, peer_problem=peer_problem, t0=t_start)
    planned, pending = plan(settings)
    if args.no_ours:
        run.mark([r for r in planned if r[1] == OURS and r[0] not in ("read_gbps", "copy_gbps")], NO_OURS)
    if args.no_peer:
        # the agreement rows are ours, but compare with llama.cpp: nothing to compare with
        run.mark([r for r in planned if r[1] == PEER or r[0] in AGREEMENT_METRICS + REFERENCE_AGREEMENT_METRICS],
                 NO_PEER)
    try:
        run_groups(run)
    finally:
        if proc is not None and proc.poll() is None and (deadline is not None and run.left() <= 0):
            log("llama.cpp: build still running; it finishes in the background for the next run")

    hasher.join(timeout=max(5.0, run.left()) if deadline else None)
    man = manifest_mod.finish(man)
    info = store.info
    dev = info.get("device", {})
    if dev:
        man["gpu"]["sm_count"] = dev.get("sm_count")
        man["gpu"]["probe"] = dev
    man["model"] = {"path": str(model), "bytes": model.stat().st_size,
                    "sha256": sha.get("v", "unavailable: still hashing at the end of the run"),
                    "weight_bytes_per_position": weight["weight_bytes"], "weights_not_read": weight["excluded_bytes"],
                    "tied_output": weight["tied_output"], "config": config.to_dict(),
                    "bytes_per_position_by_depth": {str(d): roofline.bytes_per_position(weight["weight_bytes"], config, d)
                                                    for d in settings.depths}}
    # the rate the generated model's MTP head was made right at (--mtp-accuracy; None: not set); the
    # spec rows' details hold the acceptance each measured
    from ..testing.synth import mtp_accuracy_of, mtp_runner_up_of
    man["model"]["mtp_accuracy"] = mtp_accuracy_of(model)
    man["model"]["mtp_runner_up"] = mtp_runner_up_of(model)
    man["prefill"] = prefill_manifest(config, settings, man["gpu"].get("name"))
    man["llama_cpp"] = dict(peer.sdist_version(sdist) if sdist else {"sdist": f"unavailable: {peer_problem}"})
    if pb is not None:
        man["llama_cpp"]["build"] = str(pb.root)
        man["llama_cpp"]["cmake_options"] = peer.cmake_options(arch)
    man["llama_cpp"]["llama_bench"] = info.get("llama_bench", "unavailable: llama-bench did not run")
    man["settings"] = asdict(settings)
    man["stats"] = ("median of the samples; lo/hi: order-statistic 95% confidence interval for the median "
                    "(min/max from 6 samples up; with fewer, min/max with coverage 1 - 2^(1-n)); "
                    "see openjet_plugin/bench/stats.py")
    man["resume_folder"] = str(run_dir)
    man["sessions"] = sorted({r.get("session", "?") for r in store.records()} | {session})
    man["info"] = {k: v for k, v in info.items() if k not in ("device", "llama_bench")}
    rep = build_report(run, man, pending, planned, weight, config)

    json_path = Path(args.json) if args.json else run_dir / "bench.json"
    md_path = Path(args.markdown) if args.markdown else run_dir / "bench.md"
    md = report.markdown(rep)
    for path, text in ((json_path, json.dumps(rep, indent=1)), (md_path, md)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sys.stdout.write(md)
    log(f"wrote {json_path} and {md_path}")
    # rows left out by --only, --no-ours or --no-peer were asked not to be measured: listed, not failures
    missing = [m for m in man["not_measured"] if m["reason"] not in ASKED_NOT_TO]
    if not missing:
        return 0
    if any(is_time_reason(m["reason"]) for m in missing):
        print(f"openjet bench: {len(missing)} measurement(s) not made yet; run again with --resume {run_dir}",
              file=sys.stderr)
        return EXIT_INCOMPLETE_TIME
    print(f"openjet bench: {len(missing)} measurement(s) could not be made; see the notes under the table",
          file=sys.stderr)
    return EXIT_INCOMPLETE_FAILED
