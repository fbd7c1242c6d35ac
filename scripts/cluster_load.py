"""Load test of `openjet serve --gpus`: aggregate decode throughput of 2 workers against 1, with 2
and 16 concurrent conversations, and one worker killed under load. Made for `nvidia-h200-x2`
(see docs/CLUSTER.md); runs on the CPU too (`--workers`, small model) to check the script itself.

    python scripts/cluster_load.py --gpus 0,1 --model q27b --out $OUT          # the x2 run
    python scripts/cluster_load.py --workers 2 --backend llama.cpp --max-tokens 16 --out /tmp/cl

For n = 1, then 2 workers (the first n of --gpus, or --workers n): start `openjet serve` (front +
workers), send one warm-up conversation per worker, then for each concurrency C run C
conversations at once, each `--turns` turns of `--max-tokens` greedy tokens (every turn resends
the whole conversation, as chat clients do). Throughput = generated tokens of all requests / wall
time from the first request to the last answer, so it counts prefill, queueing and HTTP too:
the end-to-end rate a user sees. With 2 workers, the kill phase runs --kill-concurrency
conversations and SIGKILLs the last worker `--kill-after` seconds in; every request that fails at
the client is counted (the Router should retry the dead worker's requests on the other).

Writes cluster_load.json (every request), cluster_load.md (the table) and the logs to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-openjet-load-" + os.urandom(8).hex()
MODEL_NAME = "load"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_model(spec: str, cache: Path) -> str | None:
    """'default' -> None (the embedded model), 'q27b' -> the generated 27B-shaped Q4_K_M, else a path."""
    if spec == "default":
        return None
    if spec == "q27b":
        from openjet_plugin.bench.runner import default_model

        return str(default_model(cache, lambda m: print(f"cluster_load: {m}", flush=True)))
    if not Path(spec).is_file():
        raise SystemExit(f"cluster_load: --model {spec!r}: no such file")
    return spec


class Front:
    """One `openjet serve` cluster (front + workers) in a subprocess."""

    def __init__(self, args, n: int, model: str | None, logs: Path):
        self.port = free_port()
        self.dir = logs / f"logs-{n}w"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "front.log"
        cmd = [sys.executable, "-m", "openjet_plugin.serve", "--port", str(self.port),
               "--log-dir", str(self.dir), "--startup-timeout", str(args.startup_timeout)]
        # a trailing comma keeps one index an index list ("--gpus 1" would mean "the first GPU")
        cmd += ["--gpus", ",".join(args.gpus.split(",")[:n]) + ","] if args.gpus else ["--workers", str(n)]
        if model:
            cmd += ["--model", f"{MODEL_NAME}={model}"]
        if args.backend:
            cmd += ["--backend", args.backend]
        if args.n_ctx:
            cmd += ["--n-ctx", str(args.n_ctx)]
        if args.no_affinity:
            cmd += ["--no-affinity"]
        self.model = MODEL_NAME if model else "openjet-default"
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1", OPENJET_API_KEY=API_KEY)
        env.pop("LITELLM_MASTER_KEY", None)
        self.t0 = time.monotonic()
        from openjet_plugin.cluster import _pdeathsig

        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_pdeathsig)
        try:
            self.wait_ready(args.startup_timeout + 60)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - self.t0

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the cluster exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health/liveliness", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start in {timeout:.0f} s:\n{self.tail()}")
            time.sleep(1)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def worker_pids(self) -> dict[str, int]:
        """The latest pid of each worker, from the front's log."""
        return {name: int(pid) for name, pid in re.findall(r"(worker-\d+\S*) pid (\d+) on", self.log.read_text())}

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=API_KEY, timeout=900, max_retries=0)

    def stop(self) -> dict:
        """SIGTERM the front; report its exit status and any worker still alive after it."""
        pids = set(self.worker_pids().values()) | {int(p) for p in re.findall(r"worker-\d+\S* pid (\d+)",
                                                                             self.log.read_text())}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        time.sleep(1)
        orphans = sorted(p for p in pids if _alive(p))
        for p in orphans:
            os.kill(p, signal.SIGKILL)
        return {"exit_status": rc, "orphans": orphans}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def conversation(front: Front, client, k: int, turns: int, max_tokens: int, tag: str) -> list[dict]:
    """One user's chat: `turns` requests, each resending the whole conversation."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"[{tag} conversation {k}] Explain, step by step, how a hash "
                                            f"table handles collisions, with an example in Python."}]
    records = []
    for turn in range(turns):
        rec = {"tag": tag, "conversation": k, "turn": turn, "start": time.monotonic()}
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=front.model, messages=messages, temperature=0, max_tokens=max_tokens)
            r = raw.parse()
            rec.update(ok=True, worker=(raw.headers.get("x-litellm-model-id") or "?").split(":")[0],
                       retries=int(raw.headers.get("x-litellm-attempted-retries") or 0),
                       completion_tokens=r.usage.completion_tokens, prompt_tokens=r.usage.prompt_tokens,
                       cached_tokens=getattr(r.usage.prompt_tokens_details, "cached_tokens", None),
                       finish_reason=r.choices[0].finish_reason)
            text = r.choices[0].message.content or ""
        except Exception as exc:  # noqa: BLE001 - every client-side failure is a result to count
            rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            text = None
        rec["end"] = time.monotonic()
        records.append(rec)
        if text is None:
            break                    # a failed turn ends this user's conversation, as it would for a client
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"Turn {turn + 1}: go on, with another example."}]
    return records


def run_phase(front: Front, concurrency: int, turns: int, max_tokens: int, tag: str,
              during=None) -> dict:
    client = front.client()
    t0 = time.monotonic()
    helper = threading.Thread(target=during, daemon=True) if during else None
    if helper:
        helper.start()
    with ThreadPoolExecutor(concurrency) as pool:
        per_user = list(pool.map(lambda k: conversation(front, client, k, turns, max_tokens, tag), range(concurrency)))
    wall = time.monotonic() - t0
    if helper:
        helper.join(60)
    records = [r for user in per_user for r in user]
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    by_worker: dict[str, int] = {}
    for r in ok:
        by_worker[r["worker"]] = by_worker.get(r["worker"], 0) + 1
    moved = sum(1 for user in per_user
                if len({r.get("worker") for r in user if r["ok"] and r.get("retries", 0) == 0}) > 1)
    latencies = sorted(r["end"] - r["start"] for r in ok)
    return {
        "tag": tag, "concurrency": concurrency, "turns": turns, "max_tokens": max_tokens,
        "requests": len(records), "failed": len(records) - len(ok),
        "retried": sum(1 for r in ok if r["retries"] >= 1),
        "generated_tokens": tokens, "wall_seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2) if wall > 0 else None,
        "latency_p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
        "latency_max_s": round(latencies[-1], 3) if latencies else None,
        "by_worker": by_worker, "conversations_that_changed_worker": moved,
        "cached_prompt_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "records": [{k: (round(v - t0, 3) if k in ("start", "end") else v) for k, v in r.items()} for r in records],
    }


def warm_up(front: Front, n: int, max_tokens: int) -> None:
    """Until every worker has answered once (the first request on a worker builds its caches)."""
    seen: set[str] = set()
    for round_ in range(6):
        phase = run_phase(front, n, 1, max_tokens, f"warmup{round_}")
        seen |= set(phase["by_worker"])
        if len(seen) >= n:
            return
    print(f"cluster_load: warm-up reached only {sorted(seen)}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", help="GPU indices to use, e.g. 0,1 (the 1-worker run uses the first)")
    ap.add_argument("--workers", type=int, default=2, help="without --gpus: CPU workers (script check)")
    ap.add_argument("--model", default="q27b", help="'q27b' (generated, 16.8 GB), 'default', or a GGUF path")
    ap.add_argument("--cache-dir", default=str(REPO / "build" / "cache" / "bench"))
    ap.add_argument("--backend", default=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--concurrency", default="2,16")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kill-concurrency", type=int, default=16)
    ap.add_argument("--kill-after", type=float, default=None,
                    help="seconds into the kill phase (default: 40%% of the 2-worker run at that concurrency)")
    ap.add_argument("--worker-counts", default="1,2")
    ap.add_argument("--no-affinity", action="store_true")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out", default="cluster_load_out")
    ap.add_argument("--logs", default=None, help="where the processes' logs go (default: a temporary "
                    "directory); they come back as cluster_logs.tar.gz in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="cluster-load-"))
    model = resolve_model(args.model, Path(args.cache_dir))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.worker_counts.split(",")]
    if args.gpus and max(counts) > len(args.gpus.split(",")):
        raise SystemExit(f"cluster_load: --worker-counts {args.worker_counts} needs more GPUs than --gpus {args.gpus}")
    report = {"model": model or "embedded default", "gpus": args.gpus, "backend": args.backend,
              "turns": args.turns, "max_tokens": args.max_tokens, "runs": []}

    def save():
        (out / "cluster_load.json").write_text(json.dumps(report, indent=1))

    for n in counts:
        print(f"cluster_load: starting {n} worker(s)", flush=True)
        front = Front(args, n, model, logs)
        run = {"workers": n, "startup_seconds": round(front.startup_seconds, 1), "phases": []}
        report["runs"].append(run)
        try:
            warm_up(front, n, 8)
            for c in concurrencies:
                phase = run_phase(front, c, args.turns, args.max_tokens, f"{n}w-c{c}")
                run["phases"].append(phase)
                print(f"cluster_load: {n} worker(s), {c} conversations: {phase['tokens_per_second']} tok/s, "
                      f"{phase['failed']} failed, by worker {phase['by_worker']}", flush=True)
                save()
            if n >= 2 and args.kill_concurrency:
                base = next((p for p in run["phases"] if p["concurrency"] == args.kill_concurrency), None)
                after = args.kill_after if args.kill_after is not None else (
                    0.4 * base["wall_seconds"] if base else 5.0)
                victim_name = sorted(front.worker_pids())[-1]
                victim = front.worker_pids()[victim_name]
                killed = {}

                def kill():
                    time.sleep(after)
                    os.kill(victim, signal.SIGKILL)
                    killed.update(worker=victim_name, pid=victim, at_seconds=round(after, 2))

                phase = run_phase(front, args.kill_concurrency, args.turns, args.max_tokens, f"{n}w-kill", kill)
                phase["killed"] = killed
                late = [r for r in phase["records"] if r["start"] > after]
                phase["after_kill"] = {"requests": len(late), "by_worker": {
                    w: sum(1 for r in late if r.get("worker") == w) for w in {r.get("worker") for r in late}}}
                phase["restarted"] = "restarting it" in front.log.read_text()
                run["phases"].append(phase)
                print(f"cluster_load: killed {victim_name} at {after:.1f} s: {phase['failed']} of "
                      f"{phase['requests']} requests failed, {phase['retried']} retried", flush=True)
        finally:
            run["shutdown"] = front.stop()
            save()

    write_markdown(report, out / "cluster_load.md")
    with tarfile.open(out / "cluster_logs.tar.gz", "w:gz") as tar:
        for d in sorted(logs.glob("logs-*")):
            tar.add(d, arcname=d.name)
    print((out / "cluster_load.md").read_text())
    return 0 if all(p["failed"] == 0 for r in report["runs"] for p in r["phases"]) else 1


def write_markdown(report: dict, path: Path) -> None:
    lines = [f"# openjet serve cluster load — model {report['model']}, GPUs {report['gpus'] or 'none (CPU)'}",
             "", f"{report['turns']} turns of {report['max_tokens']} greedy tokens per conversation; "
             "tokens/s = generated tokens / wall time (prefill, queueing and HTTP included).", "",
             "| workers | conversations | phase | tokens/s | speed-up vs 1 worker | requests | failed | retried "
             "| by worker | p50 latency s | cached/prompt tokens | conversations that changed worker |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    single = {p["concurrency"]: p["tokens_per_second"] for r in report["runs"] if r["workers"] == 1
              for p in r["phases"] if not p["tag"].endswith("kill")}
    for r in report["runs"]:
        for p in r["phases"]:
            kind = "kill " + p["killed"].get("worker", "?") if "killed" in p else "steady"
            base = single.get(p["concurrency"]) if kind == "steady" else None
            ratio = f"{p['tokens_per_second'] / base:.2f}×" if base and p["tokens_per_second"] else ""
            lines.append(f"| {r['workers']} | {p['concurrency']} | {kind} | {p['tokens_per_second']} | {ratio} | "
                         f"{p['requests']} | {p['failed']} | {p['retried']} | {p['by_worker']} | "
                         f"{p['latency_p50_s']} | {p['cached_prompt_tokens']}/{p['prompt_tokens']} | "
                         f"{p['conversations_that_changed_worker']} |")
    for r in report["runs"]:
        lines.append(f"\n{r['workers']} worker(s): started in {r['startup_seconds']} s; shutdown "
                     f"{r.get('shutdown')}")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
