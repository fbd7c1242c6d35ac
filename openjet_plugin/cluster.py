"""`openjet serve --gpus all|N|0,1` / `--workers N`: one engine worker per GPU behind one front
LiteLLM proxy whose Router spreads requests over them.

    openjet serve --gpus all --model /models/q27b.gguf --api-key sk-mine     # one worker per GPU
    openjet serve --workers 2 --backend llama.cpp                            # CPU workers (testing)
    openjet serve --gpus 0,1 --print-config                                  # the front's config, then exit

Each worker is an ordinary `openjet serve` process (the real LiteLLM proxy with the openjet
provider) pinned to its GPU with CUDA_VISIBLE_DEVICES, listening on its own loopback port, with an
internal API key only the front knows. The front is a LiteLLM proxy in this (the supervisor's)
process; its model_list has one deployment per worker, all under the served model name, so its
Router picks a worker per request:

- spread: routing strategy "least-busy" (fewest requests in flight), so new conversations go to
  the idle worker;
- conversation affinity: LiteLLM's "session_affinity" pre-call check pins a session id to the
  worker that served it; `ConversationSessionId` (a proxy callback) gives every request that brings
  no session id of its own one derived from the conversation's opening messages, so every turn of
  a conversation reaches the worker whose engine holds its prefix (see docs/CLUSTER.md);
- failures: a connection refused or reset is retried on another worker (num_retries; the failed
  worker is excluded for the rest of that request), and the worker is put in cooldown
  (allowed_fails, cooldown_time): out of the rotation for cooldown_time, then tried again;
- liveness: this process watches its workers: one that exits, or stops answering its
  /health/liveliness endpoint (served by its event loop, never queued behind a generation) for
  `health_failures` checks in a row, is killed and started again on the same port; the Router
  readmits it after its cooldown.

SIGTERM / SIGINT stop the front, then every worker (SIGTERM, then SIGKILL after a grace period);
each worker also gets SIGTERM from the kernel if this process dies without cleaning up
(PR_SET_PDEATHSIG), so no worker outlives its supervisor.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .serve import DEFAULT_MODEL_NAME

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no network fetch when litellm loads

WORKER_KEY_PREFIX = "sk-openjet-worker-"
STOP_GRACE_SECONDS = 20.0
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)
SESSION_ID_PREFIX = "conv-"


# --- which GPUs ---------------------------------------------------------------------------------

def visible_gpus() -> list[str]:
    """The GPU indices this process may use: $CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def parse_gpus(spec: str, available: list[str] | None = None) -> list[str]:
    """'all' -> every visible GPU; 'N' -> the first N; '0,1' -> exactly those. Raises ValueError
    naming --gpus when the machine does not have them."""
    spec = spec.strip()
    have = visible_gpus() if available is None else available
    if spec == "all":
        if not have:
            raise ValueError("--gpus all: no GPU is visible (nvidia-smi lists none and CUDA_VISIBLE_DEVICES "
                             "names none); use --workers N for CPU workers")
        return list(have)
    if "," not in spec and spec.isdigit():
        n = int(spec)
        if n < 1:
            raise ValueError(f"--gpus {spec}: need at least one GPU")
        if n > len(have):
            raise ValueError(f"--gpus {spec}: only {len(have)} GPU(s) visible ({','.join(have) or 'none'})")
        return have[:n]
    ids = [g.strip() for g in spec.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids):
        raise ValueError(f"--gpus {spec!r}: expected 'all', a count, or comma-separated GPU indices like 0,1")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--gpus {spec!r}: a GPU is named twice")
    missing = [g for g in ids if have and g not in have]
    if missing:
        raise ValueError(f"--gpus {spec!r}: GPU(s) {','.join(missing)} not visible (have {','.join(have)})")
    return ids


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --- the front's config -------------------------------------------------------------------------

@dataclass
class WorkerSpec:
    """Where one worker listens and what it may touch."""
    index: int
    port: int
    gpu: str | None                  # CUDA_VISIBLE_DEVICES for it; None: a CPU worker (no pinning)
    host: str = "127.0.0.1"

    @property
    def name(self) -> str:
        return f"worker-{self.index}" + (f"-gpu{self.gpu}" if self.gpu is not None else "")

    @property
    def api_base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"


@dataclass
class RouterPolicy:
    """The front Router's settings (router_settings in the LiteLLM config)."""
    routing_strategy: str = "least-busy"
    num_retries: int = 3
    allowed_fails: int = 0            # the first failed request puts a worker in cooldown
    cooldown_time: float = 10.0       # seconds out of rotation before the Router tries it again
    timeout: float = 600.0            # per attempt; long generations are legitimate
    affinity_ttl: int = 3600          # seconds a conversation stays pinned to its worker
    session_affinity: bool = True

    def router_settings(self) -> dict:
        settings = {
            "routing_strategy": self.routing_strategy,
            "num_retries": self.num_retries,
            "retry_after": 0,
            "allowed_fails": self.allowed_fails,
            "cooldown_time": self.cooldown_time,
            "timeout": self.timeout,
        }
        if self.session_affinity:
            settings["optional_pre_call_checks"] = ["session_affinity"]
            settings["deployment_affinity_ttl_seconds"] = self.affinity_ttl
            # after a failover the conversation's cache is on the worker that answered: pin it there
            settings["session_affinity_repin_on_failover"] = True
        return settings


def front_config(workers: list[WorkerSpec], model_names: list[str], worker_key: str,
                 policy: RouterPolicy | None = None) -> dict:
    """The front LiteLLM proxy config: for every served model name, one deployment per worker
    (`openai/<name>` at the worker's api_base), all in one model group, so the Router balances
    over the workers; `model_info.id` names the worker (it shows in logs and cooldown lists)."""
    if not workers:
        raise ValueError("front_config: no workers")
    policy = policy or RouterPolicy()
    names = model_names or [DEFAULT_MODEL_NAME]
    model_list = []
    for name in names:
        for w in workers:
            model_list.append({
                "model_name": name,
                "litellm_params": {"model": f"openai/{name}", "api_base": w.api_base, "api_key": worker_key,
                                   "max_retries": 0},   # the Router retries, on another worker
                "model_info": {"id": f"{w.name}:{name}"},
            })
    config = {
        "model_list": model_list,
        "router_settings": policy.router_settings(),
        "litellm_settings": {"request_timeout": policy.timeout},
    }
    if policy.session_affinity:
        config["litellm_settings"]["callbacks"] = ["openjet_plugin.cluster.conversation_session_id"]
    return config


# --- conversation affinity ----------------------------------------------------------------------

def conversation_key(messages: list) -> str | None:
    """A session id for a conversation: a hash of its opening messages (every system message
    before the first user message, and that user message). Each later turn resends them
    unchanged, so every turn gets the same id; two conversations that open identically share a
    worker, which also shares their cached prefix. None when there is no user message."""
    opening = []
    for m in messages or ():
        if not isinstance(m, dict):
            m = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        opening.append({"role": m.get("role"), "content": m.get("content")})
        if m.get("role") == "user":
            digest = hashlib.sha256(json.dumps(opening, sort_keys=True, default=str).encode()).hexdigest()
            return SESSION_ID_PREFIX + digest[:32]
    return None


def _client_session_id(data: dict) -> str | None:
    """A session id the client chose (x-litellm-session-id header, litellm_session_id or
    metadata.session_id in the body), as the proxy recorded it."""
    from litellm.constants import SESSION_ID_GENERATED_METADATA_KEY

    if isinstance(data.get("litellm_session_id"), str) and data["litellm_session_id"]:
        return data["litellm_session_id"]
    for key in ("metadata", "litellm_metadata"):
        md = data.get(key)
        if isinstance(md, dict) and md.get("session_id") and not md.get(SESSION_ID_GENERATED_METADATA_KEY):
            return str(md["session_id"])
    return None


def _make_session_callback():
    from litellm.integrations.custom_logger import CustomLogger

    class ConversationSessionId(CustomLogger):
        """Proxy pre-call hook: a request without a client session id gets the conversation's
        key as its session id, which the Router's session_affinity check pins to a worker."""

        async def async_pre_call_hook(self, user_api_key_dict, cache, data: dict, call_type):
            if _client_session_id(data) is None:
                key = conversation_key(data.get("messages") or [])
                if key is not None:
                    md = data.get("metadata")
                    if not isinstance(md, dict):
                        md = data["metadata"] = {}
                    md["session_id"] = key
                    if isinstance(data.get("litellm_metadata"), dict):
                        data["litellm_metadata"]["session_id"] = key
            return data

    return ConversationSessionId()


_session_callback = None


def __getattr__(name: str):
    # `conversation_session_id`, the instance the front's config names
    # (litellm_settings.callbacks), is made on first use: importing this module (the supervisor,
    # the tests) need not import LiteLLM
    global _session_callback
    if name == "conversation_session_id":
        if _session_callback is None:
            _session_callback = _make_session_callback()
        return _session_callback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the workers --------------------------------------------------------------------------------

def _pdeathsig() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, however it dies (Linux).
    The kernel sends it when the *thread* that forked the child ends: the first workers come from
    the main thread, restarted ones from the watcher thread, and both live until stop()."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)            # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class WorkerProcess:
    spec: WorkerSpec
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    restart_at: float | None = None
    ready: bool = False                  # answered /health/liveliness since its last start
    failed_checks: int = 0
    history: list[int] = field(default_factory=list)   # exit statuses seen

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1} of {self.spec.name} on port {self.spec.port} ---\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig)
        self.starts += 1
        print(f"openjet serve: {self.spec.name} pid {self.proc.pid} on {self.spec.api_base}"
              + (f" (CUDA_VISIBLE_DEVICES={self.spec.gpu})" if self.spec.gpu is not None else "")
              + f", log {self.log_path}", file=sys.stderr, flush=True)
        self.restart_at = None
        self.ready = False
        self.failed_checks = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def worker_argv(spec: WorkerSpec, serve_args: list[str]) -> list[str]:
    """An `openjet serve` on the worker's loopback port; serve_args carry
    --model/--backend/--n-ctx/--draft-depth through unchanged (the key is in worker_env)."""
    return [sys.executable, "-m", "openjet_plugin.serve", "--host", spec.host, "--port", str(spec.port),
            *serve_args]


def worker_env(spec: WorkerSpec, worker_key: str, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.pop("LITELLM_MASTER_KEY", None)           # the front's keys never reach a worker
    env["OPENJET_API_KEY"] = worker_key           # the worker's client key: the internal one (not on argv)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env["PYTHONUNBUFFERED"] = "1"
    if spec.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpu    # the worker sees exactly one GPU, as device 0
    return env


class Cluster:
    """Starts, watches, restarts and stops the worker processes (the front runs in this process)."""

    def __init__(self, specs: list[WorkerSpec], serve_args: list[str], worker_key: str, log_dir: Path,
                 restart: bool = True, poll_seconds: float = 0.5, health_interval: float = 10.0,
                 health_failures: int = 3, health_timeout: float = 5.0):
        self.workers = [WorkerProcess(s, worker_argv(s, serve_args), worker_env(s, worker_key),
                                      Path(log_dir) / f"{s.name}.log") for s in specs]
        self.restart = restart
        self.poll_seconds = poll_seconds
        self.health_interval = health_interval      # 0: no liveness checks (exits are still seen)
        self.health_failures = health_failures
        self.health_timeout = health_timeout
        self._next_health = 0.0
        self._started = threading.Event()          # wait_ready passed: from now on, restart the dead
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        for w in self.workers:
            w.start()
        # the front's LiteLLM import (seconds of CPU) overlaps the workers' start-up
        threading.Thread(target=_import_proxy, name="openjet-front-import", daemon=True).start()
        self._watcher = threading.Thread(target=self._watch, name="openjet-cluster-watch", daemon=True)
        self._watcher.start()

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker answers /health/liveliness; raise RuntimeError naming the
        worker (and the tail of its log) that exits or does not answer in time. A worker that
        dies before it ever answered is a configuration error (a bad model, no GPU), not a
        crash to restart from."""
        deadline = time.monotonic() + timeout
        pending = list(self.workers)
        while pending:
            for w in list(pending):
                if w.history or (w.proc is not None and w.proc.poll() is not None):
                    code = w.history[0] if w.history else w.proc.returncode
                    raise RuntimeError(f"{w.spec.name} exited with {code} while starting; log "
                                       f"{w.log_path}:\n{_tail(w.log_path)}")
                if self._answers(w, 2.0):
                    pending.remove(w)
            if pending and time.monotonic() > deadline:
                names = ", ".join(w.spec.name for w in pending)
                raise RuntimeError(f"worker(s) {names} did not answer in {timeout:.0f} s; log "
                                   f"{pending[0].log_path}:\n{_tail(pending[0].log_path)}")
            if pending:
                time.sleep(0.25)
        self._started.set()

    @staticmethod
    def _answers(w: WorkerProcess, timeout: float) -> bool:
        import httpx

        host = f"[{w.spec.host}]" if ":" in w.spec.host else w.spec.host
        try:
            ok = httpx.get(f"http://{host}:{w.spec.port}/health/liveliness", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            w.ready = True
        return ok

    def _check_health(self) -> None:
        """Kill a started worker that has stopped answering (the exit watch then restarts it)."""
        for w in self.workers:
            if self._stopping.is_set() or not w.alive():
                continue
            was_ready = w.ready
            if self._answers(w, self.health_timeout):
                w.failed_checks = 0
                continue
            if not was_ready:
                continue                            # still loading: a start may take minutes
            w.failed_checks += 1
            if w.failed_checks >= self.health_failures:
                print(f"openjet serve: {w.spec.name} (pid {w.pid}) failed {w.failed_checks} health checks; "
                      f"killing it", file=sys.stderr, flush=True)
                try:
                    w.proc.kill()
                except ProcessLookupError:
                    pass

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_seconds):
            if self.health_interval > 0 and time.monotonic() >= self._next_health:
                self._next_health = time.monotonic() + self.health_interval
                self._check_health()
            with self._lock:
                if self._stopping.is_set():
                    return
                for w in self.workers:
                    if w.proc is None or w.proc.poll() is None:
                        continue
                    now = time.monotonic()
                    if not self._started.is_set():
                        continue                    # wait_ready reports a failed start
                    if w.restart_at is None:
                        w.history.append(w.proc.returncode)
                        print(f"openjet serve: {w.spec.name} (pid {w.proc.pid}) exited with {w.proc.returncode}"
                              + ("; restarting it" if self.restart else ""), file=sys.stderr, flush=True)
                        if not self.restart:
                            w.restart_at = float("inf")
                            continue
                        delay = RESTART_BACKOFF_SECONDS[min(len(w.history) - 1, len(RESTART_BACKOFF_SECONDS) - 1)]
                        w.restart_at = now + delay
                    if now >= w.restart_at:
                        w.start()

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM every worker, wait up to `grace` seconds, SIGKILL what is left, reap all."""
        self._stopping.set()
        with self._lock:
            live = [w.proc for w in self.workers if w.proc is not None and w.proc.poll() is None]
            for p in live:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            for p in live:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)

    def status(self) -> list[dict]:
        return [{"name": w.spec.name, "port": w.spec.port, "gpu": w.spec.gpu, "pid": w.pid,
                 "alive": w.alive(), "starts": w.starts, "log": str(w.log_path)} for w in self.workers]


def _import_proxy() -> None:
    try:
        import litellm.proxy.proxy_server  # noqa: F401
    except Exception:  # noqa: BLE001 - the front's own import reports it properly
        pass


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def new_worker_key() -> str:
    return WORKER_KEY_PREFIX + secrets.token_hex(16)


__all__ = ["Cluster", "WorkerSpec", "RouterPolicy", "front_config", "conversation_key", "parse_gpus",
           "visible_gpus", "worker_argv", "worker_env", "conversation_session_id"]
