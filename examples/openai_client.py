"""The official `openai` client against `openjet serve` (an OpenAI-compatible server on 127.0.0.1).

    export OPENJET_API_KEY=...                                 # the key clients send (never on argv)
    openjet serve &                                            # in one shell
    python examples/openai_client.py --base-url http://127.0.0.1:4000/v1

    python examples/openai_client.py --start                   # starts and stops a server itself
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

from openai import OpenAI


@contextmanager
def local_server(timeout: float = 180.0):
    """Run `openjet serve` on a free loopback port for the duration of the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "sk-example-" + secrets.token_hex(8)
    log = tempfile.TemporaryFile()          # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen([sys.executable, "-m", "openjet_plugin.serve", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OPENJET_API_KEY=key))
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=5)
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise SystemExit(f"openjet serve exited with {proc.returncode}: {log.read().decode()[-2000:]}")
            try:
                client.models.list()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise SystemExit("openjet serve did not start in time") from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1", key
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        print(f"server stopped (exit status {proc.returncode})")


def ask(base_url: str, api_key: str, model: str) -> None:
    client = OpenAI(base_url=base_url, api_key=api_key, timeout=120)
    print(f"models: {[m.id for m in client.models.list().data]}")
    messages = [{"role": "user", "content": "Write one line about the sea."}]
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
    print(f"reply: {r.choices[0].message.content!r}")
    print(f"usage: prompt {r.usage.prompt_tokens}, completion {r.usage.completion_tokens}, "
          f"total {r.usage.total_tokens}")
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                             stream=True) if c.choices]
    print(f"streamed {len(pieces)} pieces; same text: {''.join(pieces) == r.choices[0].message.content}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:4000/v1")
    ap.add_argument("--api-key", default=os.environ.get("OPENJET_API_KEY", ""),
                    help="the server's client key (default: $OPENJET_API_KEY)")
    ap.add_argument("--model", default="openjet-default")
    ap.add_argument("--start", action="store_true", help="start (and stop) a local `openjet serve`")
    args = ap.parse_args()
    if args.start:
        with local_server() as (base_url, key):
            ask(base_url, key, args.model)
    else:
        ask(args.base_url, args.api_key, args.model)


if __name__ == "__main__":
    main()
