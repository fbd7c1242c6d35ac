"""Load test of `openjet serve` on 127.0.0.1: N concurrent streaming clients x R requests each.

    python scripts/load_test.py                       # 64 clients x 5 requests, timeouts and hang-ups mixed in
    python scripts/load_test.py --clients 8 --requests 3 --max-tokens 16 --abort-every 0

The server is started here (a subprocess on a free loopback port, `--max-queue` passed on) unless
--url names a running one. Requests are greedy (temperature 0), so every response has one right
answer: the text the engine itself produces for that conversation, computed in this process with
the same model before the load starts. Each round, every client sends one streaming request at
once. With --abort-every K, every K-th client of a round misbehaves instead: alternately it gives
up after --client-timeout seconds (a client timeout) or hangs up after its first chunks. A request
the server refuses must be a 429 or 503 with Retry-After; any other error, a missing or wrong
reply of a well-behaved client is a failure. After each round the server's resident memory (RSS,
its whole process tree) and thread count are read from /proc; after the load, the server must
answer correctly and report an empty queue on /metrics. Printed: ok / refused / aborted /
failed / wrong counts, latency p50/p99 (request sent -> last chunk), time to first token, RSS and
threads per round. Exit status 1 on any failure or wrong reply, memory growth beyond
--max-growth-mb, threads beyond --max-threads, or an unhealthy server after the load.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-openjet-load-" + "0" * 16
MODEL = "openjet-default"
CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "def fibonacci(n):"}],
    [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "What is a list?"}],
    [{"role": "user", "content": "import os\nimport sys\n\nclass Config:"}],
    [{"role": "user", "content": "Explain recursion."}, {"role": "assistant", "content": "It calls itself."},
     {"role": "user", "content": "Show an example."}],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path, port: int | None = None, threads: str | None = None,
                 startup_s: float = 180.0, max_queue: int | None = None, args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m openjet_plugin.serve` on a free loopback port (args: more of its options, env:
    more environment, over ours); returns (process, base URL) once it answers its health check.
    The models and master key of the caller's environment are left out: the server's own are used."""
    import httpx

    port = port or free_port()
    child = {k: v for k, v in os.environ.items() if not k.startswith(("OPENJET_MODELS", "LITELLM_MASTER_KEY"))}
    child["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    child["OPENJET_API_KEY"] = API_KEY
    if threads:
        child["OPENJET_THREADS"] = threads
    child.update(env or {})
    log = open(log_path, "wb")
    extra = ["--max-queue", str(max_queue)] if max_queue is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "openjet_plugin.serve", "--port", str(port), *extra, *args],
                            stdout=log, stderr=subprocess.STDOUT, env=child, cwd=REPO)
    log.close()
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server did not start in {startup_s:.0f} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)
    return proc.returncode


def thread_count(pid: int) -> int:
    """Threads of process `pid` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
        todo += children.get(p, [])
    return total


def expected_replies(max_tokens: int) -> list[str]:
    """The engine's own greedy replies, computed in this process with the server's model."""
    import openjet_plugin

    with openjet_plugin.load(None, backend="llama.cpp", n_ctx=4096) as eng:
        return [eng.chat(c, temperature=0, max_tokens=max_tokens).text for c in CONVERSATIONS]


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    ok: int = 0
    refused: int = 0
    aborted: int = 0
    wall: float = 0.0


def stream_once(client, conv: int, max_tokens: int, timeout: float) -> tuple[str, float, float]:
    t0 = time.perf_counter()
    first = None
    parts = []
    for chunk in client.with_options(timeout=timeout).chat.completions.create(
            model=MODEL, messages=CONVERSATIONS[conv], temperature=0, max_tokens=max_tokens, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - t0
    return "".join(parts), total, first if first is not None else total


def hang_up_after_first_chunks(client, conv: int, max_tokens: int, n_chunks: int = 2) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=CONVERSATIONS[conv], temperature=0,
                                            max_tokens=max_tokens, stream=True)
    for i, _ in enumerate(stream):
        if i + 1 >= n_chunks:
            break
    stream.close()                       # the connection goes away mid-stream


def run_load(base_url: str, expected: list[str], clients: int, requests: int, max_tokens: int,
             server_pid: int | None, timeout: float = 300.0, log=print, abort_every: int = 0,
             client_timeout: float = 0.3) -> Result:
    import httpx
    import openai
    from openai import OpenAI

    res = Result()
    lock = threading.Lock()
    # one HTTP connection pool per client thread, as independent clients would have
    pools = [OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0,
                    http_client=httpx.Client(timeout=timeout)) for _ in range(clients)]
    start = time.perf_counter()
    for rnd in range(requests):
        barrier = threading.Barrier(clients)

        def client_main(c: int) -> None:
            conv = (c + rnd) % len(CONVERSATIONS)
            misbehave = abort_every and (c + rnd) % abort_every == abort_every - 1
            barrier.wait()
            try:
                if misbehave and (c // abort_every) % 2 == 0:
                    try:
                        stream_once(pools[c], conv, max_tokens, client_timeout)
                    except openai.APITimeoutError:
                        pass
                    with lock:
                        res.aborted += 1
                    return
                if misbehave:
                    hang_up_after_first_chunks(pools[c], conv, max_tokens)
                    with lock:
                        res.aborted += 1
                    return
                text, total, first = stream_once(pools[c], conv, max_tokens, timeout)
            except openai.APIStatusError as exc:
                refusal = exc.status_code in (429, 503) and exc.response.headers.get("retry-after", "").isdigit()
                with lock:
                    if refusal:
                        res.refused += 1
                    else:
                        res.failures.append(f"round {rnd} client {c}: status {exc.status_code} "
                                            f"(retry-after {exc.response.headers.get('retry-after')!r}): {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                with lock:
                    res.failures.append(f"round {rnd} client {c}: {type(exc).__name__}: {exc}")
                return
            with lock:
                res.latencies.append(total)
                res.first_token.append(first)
                if text != expected[conv]:
                    res.wrong.append(f"round {rnd} client {c} conversation {conv}: {text!r} != {expected[conv]!r}")
                else:
                    res.ok += 1

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client_main, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rss = tree_rss_bytes(server_pid) if server_pid else 0
        n_threads = thread_count(server_pid) if server_pid else 0
        res.rss.append(rss)
        res.threads.append(n_threads)
        log(f"round {rnd + 1}/{requests}: {clients} streams in {time.perf_counter() - t0:.1f} s, "
            f"server RSS {rss / 2**20:.1f} MiB, {n_threads} threads; ok {res.ok}, refused {res.refused}, "
            f"aborted {res.aborted}, failures {len(res.failures)}, wrong {len(res.wrong)}")
    res.wall = time.perf_counter() - start
    for p in pools:
        p.close()
    return res


def healthy_after(base_url: str, expected: list[str], max_tokens: int, settle_s: float = 30.0) -> list[str]:
    """Problems with the server after the load (empty: healthy): the queue drains, a request gets
    the right answer."""
    import httpx
    from openai import OpenAI

    problems = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + settle_s
    while True:
        metrics = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
        values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        busy = [k for k in ("openjet_queue_depth", "openjet_requests_running", "openjet_requests_admitted")
                if float(values.get(k, "nan")) != 0]
        if not busy:
            break
        if time.monotonic() > deadline:
            problems.append(f"after {settle_s:.0f} s still busy: " + ", ".join(f"{k}={values[k]}" for k in busy))
            break
        time.sleep(0.2)
    client = OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    text = stream_once(client, 0, max_tokens, timeout=60)[0]
    if text != expected[0]:
        problems.append(f"after the load: {text!r} != {expected[0]!r}")
    return problems


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def summary(res: Result, clients: int, requests: int) -> str:
    n, wall = clients * requests, res.wall
    lat, ttft = res.latencies, res.first_token
    rss = " ".join(f"{r / 2**20:.1f}" for r in res.rss)
    return "\n".join([
        f"requests: {n} ({clients} clients x {requests}), ok {res.ok}, refused (429/503) {res.refused}, "
        f"aborted by their clients {res.aborted}, failed {len(res.failures)}, wrong {len(res.wrong)}, "
        f"wall {wall:.1f} s, {n / wall:.2f} req/s",
        f"latency (request -> last chunk): p50 {percentile(lat, 50):.3f} s, p99 {percentile(lat, 99):.3f} s, "
        f"mean {statistics.fmean(lat) if lat else float('nan'):.3f} s, max {max(lat, default=float('nan')):.3f} s",
        f"time to first token: p50 {percentile(ttft, 50):.3f} s, p99 {percentile(ttft, 99):.3f} s",
        f"server RSS per round (MiB): {rss}",
        f"server threads per round: {' '.join(map(str, res.threads))}",
        f"RSS growth first -> last round: {(res.rss[-1] - res.rss[0]) / 2**20:+.1f} MiB" if res.rss else "",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5, help="requests per client (= rounds)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--abort-every", type=int, default=8,
                    help="every K-th client per round times out or hangs up (0: none)")
    ap.add_argument("--client-timeout", type=float, default=0.3, help="seconds a timing-out client waits")
    ap.add_argument("--max-queue", type=int, default=16, help="--max-queue of the started server")
    ap.add_argument("--url", help="a running server (default: start one here)")
    ap.add_argument("--threads", default=None, help="OPENJET_THREADS for the started server")
    ap.add_argument("--max-growth-mb", type=float, default=32.0,
                    help="allowed server RSS growth from the first to the last round")
    ap.add_argument("--max-threads", type=int, default=64, help="allowed server threads after any round")
    ap.add_argument("--log", type=Path, default=Path("/tmp/openjet-load-test-server.log"))
    args = ap.parse_args(argv)

    expected = expected_replies(args.max_tokens)
    proc = None
    if args.url:
        base, pid = args.url.rstrip("/").removesuffix("/v1"), None
    else:
        proc, base = start_server(args.log, threads=args.threads, max_queue=args.max_queue)
        pid = proc.pid
    try:
        res = run_load(base, expected, args.clients, args.requests, args.max_tokens, pid,
                       abort_every=args.abort_every, client_timeout=args.client_timeout)
        problems = healthy_after(base, expected, args.max_tokens)
    finally:
        rc = stop_server(proc) if proc is not None else 0
    print(summary(res, args.clients, args.requests))
    for line in (res.failures + res.wrong + problems)[:10]:
        print("  " + line)
    print("healthy after the load" if not problems else "NOT healthy after the load")
    if proc is not None:
        print(f"server exit status after SIGTERM: {rc}")
    growth = (res.rss[-1] - res.rss[0]) / 2**20 if len(res.rss) > 1 else 0.0
    bad = (res.failures or res.wrong or problems or growth > args.max_growth_mb
           or max(res.threads, default=0) > args.max_threads or rc != 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
