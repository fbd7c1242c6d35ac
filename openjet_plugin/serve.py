"""`openjet serve`: an OpenAI-compatible HTTP server — the real LiteLLM proxy with the openjet
provider registered, listening on the loopback interface only.

    openjet serve                                  # the embedded default model, port 4000
    openjet serve --model /models/q27b.gguf --port 8080 --api-key sk-mine
    openjet serve --config examples/litellm_proxy.yaml
    openjet serve --print-config                   # the generated LiteLLM config, then exit

Without `--config` the LiteLLM config is generated: one entry per model, `openjet-default`
(the embedded model) first unless `--model` names others. The proxy's handler
(`openjet_plugin.adapters.litellm.proxy_handler`) knows only those names: a request naming a
file path as its model is refused by the proxy's router, and would be refused by the handler too,
so clients cannot make the server open files. The proxy insists on an API key (its "master key"):
`--api-key`, else $LITELLM_MASTER_KEY, else a random one printed at start.
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

LOOPBACK = ("127.0.0.1", "localhost", "::1")
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
        },
    }


def proxy_environment(models: list[tuple[str, str]], args: argparse.Namespace, api_key: str) -> dict[str, str]:
    """Environment the proxy and its openjet handler read (see adapters/litellm.py)."""
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",   # no network fetch of the cost map
        "LITELLM_EVENT_LOOP": "asyncio",          # the proxy's default, uvloop, is not a dependency
        "LITELLM_MASTER_KEY": api_key,
        "OPENJET_MODELS": ",".join(f"{n}={p}" for n, p in models),
    }
    if not models:
        env["OPENJET_MODELS"] = ""
    if args.backend:
        env["OPENJET_BACKEND"] = args.backend
    if args.n_ctx:
        env["OPENJET_N_CTX"] = str(args.n_ctx)
    if args.draft_depth is not None:
        env["OPENJET_DRAFT_DEPTH"] = str(args.draft_depth)
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openjet serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind (127.0.0.1, localhost or ::1)")
    p.add_argument("--port", type=int, default=4000)
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH",
                   help="serve this GGUF (repeatable); default: the embedded model as 'openjet-default'")
    p.add_argument("--config", help="use this LiteLLM proxy config instead of generating one")
    p.add_argument("--backend", choices=("auto", "llama.cpp", "native"), default=None)
    p.add_argument("--n-ctx", type=int, default=None, help="context window of every served model")
    p.add_argument("--draft-depth", type=int, default=None, help="MTP draft tokens per cycle (native)")
    p.add_argument("--api-key", help="the key clients must send (default: $LITELLM_MASTER_KEY or a random one)")
    p.add_argument("--print-config", action="store_true", help="print the generated config and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    import yaml

    args = _parser().parse_args(argv)
    if args.host not in LOOPBACK:
        print(f"openjet serve: refusing to bind {args.host!r}: the server listens on the loopback "
              f"interface only ({', '.join(LOOPBACK)}); put an authenticating reverse proxy in front "
              f"to expose it", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"openjet serve: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    models = [parse_model(m) for m in args.model]
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

    api_key = args.api_key or os.environ.get("LITELLM_MASTER_KEY")
    if not api_key:
        api_key = "sk-openjet-" + secrets.token_hex(16)
        print(f"openjet serve: API key for this run: {api_key}", file=sys.stderr, flush=True)
    os.environ.update(proxy_environment(models, args, api_key))

    from .adapters import litellm as openjet_litellm   # after the environment: it configures the handler
    from .adapters._shared import close_shared_engines

    openjet_litellm.configure_proxy_handler()
    atexit.register(close_shared_engines)
    print(f"openjet serve: http://{args.host}:{args.port}/v1 (config {config_path})", file=sys.stderr, flush=True)

    from litellm.proxy.proxy_cli import run_server

    # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal to the handler that
    # was there before; make that a normal exit (status 0, atexit hooks run: engines are closed)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        run_server.main(args=["--config", str(config_path), "--host", args.host, "--port", str(args.port)],
                        prog_name="openjet serve", standalone_mode=False)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
