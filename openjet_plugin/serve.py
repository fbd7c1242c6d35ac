"""`openjet serve`: an OpenAI-compatible HTTP server — the real LiteLLM proxy with the openjet
provider registered, listening on the loopback interface only.

    openjet serve                                  # the embedded default model, port 4000
    OPENJET_API_KEY=sk-mine openjet serve --model /models/q27b.gguf --port 8080
    openjet serve --api-key-file ~/.config/openjet/key --host 0.0.0.0
    openjet serve --config examples/litellm_proxy.yaml
    openjet serve --print-config                   # the generated LiteLLM config, then exit
    openjet serve --gpus all --model /models/q27b.gguf   # one worker per GPU behind a router (cluster.py)
    openjet serve --workers 2 --backend llama.cpp        # the same with CPU workers

Without `--config` the LiteLLM config is generated: one entry per model, `openjet-default`
(the embedded model) first unless `--model` names others. The proxy's handler
(`openjet_plugin.adapters.litellm.proxy_handler`) knows only those names: a request naming a
file path as its model is refused by the proxy's router, and would be refused by the handler too,
so clients cannot make the server open files.

Keys: clients send the client key, read from `--api-key-file` or $OPENJET_API_KEY (never from the
command line, where every user of the machine can read it in `ps`); on the loopback interface a
random one is made and printed when neither is given; on any other address a key of at least 32
characters with at least 12 distinct ones is required. The LiteLLM proxy's own "master key" is
another one ($LITELLM_MASTER_KEY, else random and never shown), which the front door
(serve_gate.Gate) puts on a request it admitted; only with `--admin` does the master key reach
LiteLLM's admin routes (UI, key management, /openapi.json, /routes), which are closed otherwise.

Requests: a body that breaks the OpenAI API's rules is answered 400 naming the field before
anything is queued; an omitted max_tokens generates to the end of the context window for chat
(OpenAI's rule) and 16 tokens for text completions (OpenAI's default there); each engine runs
`--slots` requests at once (their tokens share the engine's passes; default 4; the native engine
holds up to 8, and speculates for a request served alone) and `--max-queue` more wait, beyond that
503 with Retry-After; a prompt prefix one request evaluated (a system prompt, an agent scaffold)
is loaded by the next from the engine's prefix cache (`--prefix-cache-mb`, host memory; 0 turns
it off); `/metrics`
(Prometheus text) shows the queue and per-request engine stats. Deterministic errors are not
retried (num_retries 0).
"""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import signal
import sys
import tempfile
from pathlib import Path

from .backends.llama_cpp import DEFAULT_SERVE_SEQUENCES
from .engine import MAX_SLOTS

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_KEY_LENGTH, MIN_KEY_DISTINCT = 32, 12
HANDLER = "openjet_plugin.adapters.litellm.proxy_handler"
DEFAULT_MODEL_NAME = "openjet-default"


def parse_model(spec: str) -> tuple[str, str]:
    """'NAME=PATH' or 'PATH' (named after the file) -> (name, absolute path)."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = "", spec
    p = Path(path).expanduser()
    if not p.is_file():
        raise SystemExit(f"openjet serve: --model {spec!r}: no such model file {str(p)!r}")
    name = name or p.name.removesuffix(".gguf")
    if not name or any(c in name for c in ",=/ "):
        raise SystemExit(f"openjet serve: --model {spec!r}: the name {name!r} may not contain , = / or spaces")
    return name, str(p.resolve())


def build_config(models: list[tuple[str, str]]) -> dict:
    """The LiteLLM proxy config: each served name routes to `openjet/<name>`."""
    names = [n for n, _ in models] or [DEFAULT_MODEL_NAME]
    return {
        "model_list": [{"model_name": n, "litellm_params": {"model": f"openjet/{n}"}} for n in names],
        "litellm_settings": {
            "custom_provider_map": [{"provider": "openjet", "custom_handler": HANDLER}],
            # a request the engine refuses fails the same way every time: never retried
            "num_retries": 0,
        },
        "router_settings": {"num_retries": 0},
    }


def proxy_environment(models: list[tuple[str, str]], args: argparse.Namespace, master_key: str) -> dict[str, str]:
    """Environment the proxy and its openjet handler read (see adapters/litellm.py)."""
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",   # no network fetch of the cost map
        "LITELLM_EVENT_LOOP": "asyncio",          # the proxy's default, uvloop, is not a dependency
        "LITELLM_MASTER_KEY": master_key,
        "OPENJET_MODELS": ",".join(f"{n}={p}" for n, p in models),
    }
    if not args.admin:
        # no Swagger UI, ReDoc or /openapi.json (2 MB, seconds to build) unless asked for
        env.update(NO_DOCS="True", NO_REDOC="True", NO_OPENAPI="True")
    if not models:
        env["OPENJET_MODELS"] = ""
    if args.backend:
        env["OPENJET_BACKEND"] = args.backend
    if args.n_ctx:
        env["OPENJET_N_CTX"] = str(args.n_ctx)
    if args.draft_depth is not None:
        env["OPENJET_DRAFT_DEPTH"] = str(args.draft_depth)
    # "auto": the backend's choice (4 slots, see engine.load)
    env["OPENJET_SLOTS"] = "auto" if args.slots is None else str(args.slots)
    # "auto": the engine's default (2 GiB of host memory with several slots, none with one)
    env["OPENJET_PREFIX_CACHE_MB"] = "auto" if args.prefix_cache_mb is None else str(args.prefix_cache_mb)
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openjet serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1); anything but "
                   "loopback needs a strong client key ($OPENJET_API_KEY or --api-key-file)")
    p.add_argument("--port", type=int, default=4000)
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH",
                   help="serve this GGUF (repeatable); default: the embedded model as 'openjet-default'")
    p.add_argument("--config", help="use this LiteLLM proxy config instead of generating one")
    p.add_argument("--backend", choices=("auto", "llama.cpp", "native"), default=None)
    p.add_argument("--n-ctx", type=int, default=None, help="context window of every served model")
    p.add_argument("--draft-depth", type=int, default=None, help="MTP draft tokens per cycle (native)")
    p.add_argument("--api-key", help=argparse.SUPPRESS)      # refused with the reason: see _client_key
    p.add_argument("--api-key-file", help="file holding the key clients must send (default: $OPENJET_API_KEY, "
                   "else a random one on loopback)")
    p.add_argument("--slots", type=int, default=None,
                   help="requests each engine runs at once, sharing its passes (default 4; the native "
                   "engine holds up to 8 and speculates for a request served alone)")
    p.add_argument("--prefix-cache-mb", type=int, default=None, metavar="MB",
                   help="host memory for each engine's prefix cache: copies of the state after prompt "
                   "prefixes that recur across conversations (system prompts, agent scaffolds); 0 turns it "
                   "off (default: 2048 with several slots, none with one)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for a busy engine; more get 503 with Retry-After (default 16)")
    p.add_argument("--admin", action="store_true", help="open LiteLLM's admin routes (UI, key management, "
                   "/openapi.json, /routes) to the master key ($LITELLM_MASTER_KEY)")
    p.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    p.add_argument("--print-config", action="store_true", help="print the generated config and exit")
    p.add_argument("--preload", action="store_true", help="load the models before listening (default: on "
                   "the first request)")
    c = p.add_argument_group("several workers (see docs/CLUSTER.md)")
    c.add_argument("--gpus", help="one worker per GPU: 'all', a count N, or indices like 0,1")
    c.add_argument("--workers", type=int, default=None, help="N workers without GPU pinning (CPU testing)")
    c.add_argument("--worker-ports", help="comma-separated loopback ports of the workers (default: free ports)")
    c.add_argument("--log-dir", help="directory for the workers' logs (default: a temporary directory)")
    c.add_argument("--routing-strategy", default="least-busy",
                   choices=("least-busy", "simple-shuffle", "latency-based-routing", "usage-based-routing-v2"))
    c.add_argument("--num-retries", type=int, default=3, help="attempts on other workers after a failure")
    c.add_argument("--cooldown", type=float, default=10.0, help="seconds a failed worker stays out of rotation")
    c.add_argument("--no-affinity", action="store_true", help="do not keep a conversation on one worker")
    c.add_argument("--no-restart", action="store_true", help="do not start a worker again when it dies")
    c.add_argument("--health-interval", type=float, default=10.0,
                   help="seconds between liveness checks of each worker (0: none)")
    c.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the workers")
    return p


def main(argv: list[str] | None = None) -> int:
    import yaml

    args = _parser().parse_args(argv)
    try:
        client_key = _client_key(args)
    except ValueError as exc:
        print(f"openjet serve: {exc}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK:
        print(f"openjet serve: listening on {args.host!r}: reachable from other machines; clients must "
              f"send the API key", file=sys.stderr)
    if not 0 < args.port < 65536:
        print(f"openjet serve: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    if args.max_queue < 0:
        print(f"openjet serve: --max-queue must be >= 0, got {args.max_queue}", file=sys.stderr)
        return 2
    if args.slots is not None and not 1 <= args.slots <= MAX_SLOTS:
        print(f"openjet serve: --slots must be in 1..{MAX_SLOTS}, got {args.slots}", file=sys.stderr)
        return 2
    if args.prefix_cache_mb is not None and args.prefix_cache_mb < 0:
        print(f"openjet serve: --prefix-cache-mb must be >= 0 (MiB of host memory; 0: no prefix cache), "
              f"got {args.prefix_cache_mb}", file=sys.stderr)
        return 2
    models = [parse_model(m) for m in args.model]
    if args.gpus is not None or args.workers is not None:
        return serve_cluster(args, models)
    if args.config and models:
        print("openjet serve: give either --config or --model, not both", file=sys.stderr)
        return 2
    config = build_config(models)
    if args.print_config:
        print(yaml.safe_dump(config, sort_keys=False), end="")
        return 0

    if args.config:
        config_path = Path(args.config).expanduser()
        if not config_path.is_file():
            print(f"openjet serve: --config {args.config!r}: no such file", file=sys.stderr)
            return 2
    else:
        tmp = tempfile.TemporaryDirectory(prefix="openjet-serve-")
        atexit.register(tmp.cleanup)
        config_path = Path(tmp.name) / "litellm_config.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    client_key = _announce(client_key)
    master_key = os.environ.get("LITELLM_MASTER_KEY") or "sk-master-" + secrets.token_hex(24)
    os.environ.update(proxy_environment(models, args, master_key))

    from .adapters import litellm as openjet_litellm   # after the environment: it configures the handler
    from .adapters._shared import close_shared_engines
    from .serve_gate import ServerMetrics

    handler = openjet_litellm.configure_proxy_handler()
    metrics = ServerMetrics()
    handler.observer = metrics
    atexit.register(close_shared_engines)
    names = [n for n, _ in models] or [DEFAULT_MODEL_NAME]
    # requests running at once: the engines' slots (known once loaded; before that, what the
    # backend will take where --backend says which)
    running = len(names) * _slots_guess(args)
    if args.preload:
        # load every served model before listening, so "answers /health/liveliness" means "ready"
        # (the cluster waits for that before its front accepts requests)
        running = 0
        for name in names:
            eng = handler.engine(name)
            running += eng.n_slots
            print(f"openjet serve: loaded {name} ({eng.backend_name}: {eng.backend_reason}; "
                  f"{eng.n_slots} slot{'s' if eng.n_slots > 1 else ''})", file=sys.stderr, flush=True)
        _warm_up(handler, names)
    print(f"openjet serve: http://{args.host}:{args.port}/v1 (config {config_path})", file=sys.stderr, flush=True)

    _run_proxy(config_path, args.host, args.port,
               gate=dict(client_keys=[client_key], master_key=master_key, capacity=running + args.max_queue,
                         metrics=metrics, admin=args.admin, serve_metrics=not args.no_metrics))
    return 0


def _slots_guess(args: argparse.Namespace) -> int:
    """Slots per engine before any is loaded: --slots, else what either backend takes."""
    return args.slots or DEFAULT_SERVE_SEQUENCES


def _warm_up(handler, names: list[str]) -> None:
    """One streamed token per model through LiteLLM, so that the first client does not wait for
    LiteLLM's lazily imported streaming code (a second on a small machine)."""
    import litellm

    litellm.custom_provider_map = [e for e in litellm.custom_provider_map if e.get("provider") != "openjet"]
    litellm.custom_provider_map.append({"provider": "openjet", "custom_handler": handler})
    from litellm.utils import custom_llm_setup

    custom_llm_setup()
    for name in names:
        for _ in litellm.completion(model=f"openjet/{name}", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=1, temperature=0, stream=True, stream_options={"include_usage": True}):
            pass


def _run_proxy(config_path: Path, host: str, port: int, gate: dict) -> None:
    """The LiteLLM proxy in this process, behind the front door (serve_gate.Gate, with these
    settings), until SIGTERM/SIGINT (then it returns)."""
    from litellm.proxy.proxy_cli import run_server
    from litellm.proxy.proxy_server import app

    from .serve_gate import Gate

    # outermost of the app's middleware: the proxy sees only what the gate admitted
    app.add_middleware(Gate, **gate)

    # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal to the handler that
    # was there before; make that a normal exit (status 0, atexit hooks run: engines are closed)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        run_server.main(args=["--config", str(config_path), "--host", host, "--port", str(port)],
                        prog_name="openjet serve", standalone_mode=False)
    except KeyboardInterrupt:
        pass


def weak_key_reason(key: str) -> str | None:
    """Why a client key is too weak for a non-loopback address (None: strong enough)."""
    if len(key) < MIN_KEY_LENGTH:
        return f"it has {len(key)} characters, fewer than {MIN_KEY_LENGTH}"
    if len(set(key)) < MIN_KEY_DISTINCT:
        return f"it has only {len(set(key))} distinct characters (at least {MIN_KEY_DISTINCT} needed)"
    return None


def _client_key(args: argparse.Namespace) -> str | None:
    """The client key from --api-key-file or $OPENJET_API_KEY (None: make one); raises ValueError
    for a key on the command line, an unreadable or empty file, or a weak key off loopback."""
    if args.api_key is not None:
        raise ValueError("--api-key is refused: a key on the command line is visible to every user of this "
                         "machine (ps); put it in $OPENJET_API_KEY or in a file named by --api-key-file")
    key = None
    if args.api_key_file:
        path = Path(args.api_key_file).expanduser()
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {str(path)!r}: {exc.strerror or exc}") from None
        if not key or "\n" in key:
            raise ValueError(f"--api-key-file {str(path)!r}: expected one line holding the key")
    elif os.environ.get("OPENJET_API_KEY"):
        key = os.environ["OPENJET_API_KEY"].strip()
    if args.host not in LOOPBACK:
        if key is None:
            raise ValueError(f"refusing to bind {args.host!r} without an API key: outside the loopback interface "
                             f"every client must authenticate; set $OPENJET_API_KEY or pass --api-key-file")
        why = weak_key_reason(key)
        if why:
            raise ValueError(f"refusing to bind {args.host!r} with a weak client key ({why}); make one with "
                             f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return key


def _announce(client_key: str | None) -> str:
    if client_key is None:
        client_key = "sk-openjet-" + secrets.token_hex(16)
        print(f"openjet serve: API key for this run: {client_key}", file=sys.stderr, flush=True)
    return client_key


def serve_cluster(args: argparse.Namespace, models: list[tuple[str, str]]) -> int:
    """`--gpus` / `--workers`: start the workers, then the front proxy here; stop them all at exit."""
    import yaml

    from . import cluster

    if args.config:
        print("openjet serve: --config cannot be combined with --gpus/--workers (the front's config is "
              "generated; see --print-config and docs/CLUSTER.md)", file=sys.stderr)
        return 2
    if args.gpus is not None and args.workers is not None:
        print("openjet serve: give either --gpus or --workers, not both", file=sys.stderr)
        return 2
    try:
        gpus: list[str | None] = cluster.parse_gpus(args.gpus) if args.gpus is not None else [None] * args.workers
        if args.workers is not None and args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        if args.worker_ports:
            try:
                ports = [int(p) for p in args.worker_ports.split(",")]
            except ValueError:
                raise ValueError(f"--worker-ports {args.worker_ports!r}: expected comma-separated port "
                                 f"numbers") from None
            if len(ports) != len(gpus) or len(set(ports + [args.port])) != len(ports) + 1:
                raise ValueError(f"--worker-ports {args.worker_ports!r}: need {len(gpus)} distinct ports, "
                                 f"none equal to --port {args.port}")
        else:
            ports = []
            while len(ports) < len(gpus):
                p = cluster.free_port(args.host if args.host != "localhost" else "127.0.0.1")
                if p != args.port and p not in ports:
                    ports.append(p)
        if not all(0 < p < 65536 for p in ports):
            raise ValueError(f"--worker-ports {args.worker_ports!r}: ports must be in 1..65535")
    except ValueError as exc:
        print(f"openjet serve: {exc}", file=sys.stderr)
        return 2
    worker_host = "::1" if args.host == "::1" else "127.0.0.1"
    specs = [cluster.WorkerSpec(i, port, gpu, worker_host) for i, (gpu, port) in enumerate(zip(gpus, ports))]
    policy = cluster.RouterPolicy(routing_strategy=args.routing_strategy, num_retries=args.num_retries,
                                  cooldown_time=args.cooldown, session_affinity=not args.no_affinity)
    worker_key = cluster.new_worker_key()
    names = [n for n, _ in models]
    try:
        client_key = _client_key(args)
    except ValueError as exc:
        print(f"openjet serve: {exc}", file=sys.stderr)
        return 2
    config = cluster.front_config(specs, names, worker_key, policy)
    if args.print_config:
        shown = yaml.safe_dump(config, sort_keys=False).replace(worker_key, "<internal worker key>")
        print(shown, end="")
        return 0

    serve_args = ["--preload"] + [a for m in args.model for a in ("--model", m)]
    for flag, value in (("--backend", args.backend), ("--n-ctx", args.n_ctx), ("--draft-depth", args.draft_depth),
                        ("--max-queue", args.max_queue), ("--slots", args.slots),
                        ("--prefix-cache-mb", args.prefix_cache_mb)):
        if value is not None:
            serve_args += [flag, str(value)]
    tmp = tempfile.TemporaryDirectory(prefix="openjet-cluster-")
    log_dir = Path(args.log_dir).expanduser() if args.log_dir else Path(tmp.name) / "logs"
    config_path = Path(tmp.name) / "front_config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    os.chmod(config_path, 0o600)                  # it holds the internal worker key
    client_key = _announce(client_key)
    master_key = os.environ.get("LITELLM_MASTER_KEY") or "sk-master-" + secrets.token_hex(24)
    os.environ.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_EVENT_LOOP": "asyncio",
                       "LITELLM_MASTER_KEY": master_key})
    if not args.admin:
        os.environ.update(NO_DOCS="True", NO_REDOC="True", NO_OPENAPI="True")
    from .serve_gate import ServerMetrics

    if not models:
        from . import default_model_path

        default_model_path()                  # where missing, generate the embedded model once, not per worker
    group = cluster.Cluster(specs, serve_args, worker_key, log_dir, restart=not args.no_restart,
                            health_interval=args.health_interval)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        group.start()
        group.wait_ready(args.startup_timeout)
        print(f"openjet serve: {len(specs)} workers ready; front http://{args.host}:{args.port}/v1 "
              f"(config {config_path})", file=sys.stderr, flush=True)
        # the front has no engine: its queue is the workers' (each refuses beyond its own)
        _run_proxy(config_path, args.host, args.port,
                   gate=dict(client_keys=[client_key], master_key=master_key,
                             capacity=len(specs) * (_slots_guess(args) + args.max_queue),
                             metrics=ServerMetrics(),
                             admin=args.admin, serve_metrics=not args.no_metrics))
    except RuntimeError as exc:
        print(f"openjet serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        group.stop()
        print("openjet serve: all workers stopped", file=sys.stderr, flush=True)
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
