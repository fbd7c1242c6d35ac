"""Fuzz of `openjet serve`'s request bodies: every reply is a 2xx or a 4xx within a second, and
never carries a traceback or a file path.

Bodies are mutated from valid chat and text-completion requests by a seeded generator (so a
failure names its case and reproduces): values replaced at any depth by values of every JSON type
(huge numbers, NaN, lone surrogate escapes, long and empty strings, deep nesting), keys removed or
added, and the encoded bytes truncated, flipped or given invalid UTF-8. `max_tokens` stays small
where it stays valid (a valid request then generates a few tokens, well within the second).
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-openjet-fuzz-" + "0" * 16
CASES = 400
SEED = 20261205

pytestmark = pytest.mark.slow

CHAT = {"model": "openjet-default", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}}],
        "stop": ["\n\n"], "top_p": 0.9, "seed": 1, "stream": False}
COMPLETION = {"model": "openjet-default", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "stream": False}
VALUES = [None, True, False, 0, -1, 5, 2**31, 2**64, 10**400, 1.5, -1e308, float("nan"), float("inf"), "",
          "x" * 20000, "\ud800", "\u0000", "<|im_start|>system", "ünïcødé 🌊", [], [None], {}, {"role": "user"},
          [[[[[]]]]], {"a": {"b": {"c": []}}}, ["user", "hi"], [{"type": "image_url", "image_url": {"url": "x"}}]]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _delete(obj, path):
    for k in path[:-1]:
        obj = obj[k]
    del obj[path[-1]]


def mutate(rng: random.Random) -> tuple[str, bytes]:
    """(route, body bytes) of one fuzz case."""
    route, base = rng.choice([("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
    body = copy.deepcopy(base)
    body["stream"] = rng.random() < 0.3
    for _ in range(rng.randint(1, 3)):
        if not isinstance(body, dict):
            break
        paths = [p for p in _paths(body) if p and p != ("max_tokens",)]
        kind = rng.random()
        if kind < 0.6 and paths:
            _set(body, rng.choice(paths), copy.deepcopy(rng.choice(VALUES)))
        elif kind < 0.8 and paths:
            _delete(body, rng.choice(paths))
        elif kind < 0.9:
            body[rng.choice(["frobnicate", "n", "logit_bias", "response_format", "tool_choice", "logprobs",
                             "top_logprobs", "functions", "echo", "suffix"])] = copy.deepcopy(rng.choice(VALUES))
        else:
            body = copy.deepcopy(rng.choice(VALUES))
    raw = json.dumps(body).encode()
    r = rng.random()
    if r < 0.08:
        raw = raw[:rng.randint(0, len(raw))]
    elif r < 0.14:
        i = rng.randrange(max(1, len(raw)))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    elif r < 0.18:
        raw = raw.replace(b"Hi", b"H\xff\xfei") if b"Hi" in raw else b"\xc3(" + raw
    elif r < 0.2:
        raw = b"[" * 100000 + b"]" * 100000
    return route, raw


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import httpx

    sys.path.insert(0, str(REPO / "scripts"))
    from load_test import start_server, stop_server

    import openjet_plugin

    openjet_plugin.default_model_path()
    log_path = tmp_path_factory.mktemp("fuzz") / "serve.log"
    proc, base = start_server(log_path, threads="1", startup_s=120, env={"OPENJET_API_KEY": API_KEY},
                              args=["--n-ctx", "256", "--preload"])
    try:
        # the first streamed request through the proxy pays for LiteLLM's lazy imports (~0.5 s here,
        # after `--preload`'s own warm-up): the second counts
        httpx.post(f"{base}/v1/chat/completions", json=dict(CHAT, stream=True),
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).raise_for_status()
        yield {"url": base, "proc": proc, "log": log_path}
    finally:
        stop_server(proc)


def test_fuzzed_bodies_get_2xx_or_4xx_at_once_without_internals(server):
    import httpx

    rng = random.Random(SEED)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    statuses: dict[int, int] = {}
    problems = []
    with httpx.Client(timeout=10) as http:
        for case in range(CASES):
            route, raw = mutate(rng)
            t0 = time.monotonic()
            with http.stream("POST", server["url"] + route, content=raw, headers=headers) as r:
                text = r.read().decode("utf-8", errors="replace")
            seconds = time.monotonic() - t0
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            leaked = [w for w in ("Traceback", 'File "', "site-packages", ".py\"", "line ") if w in text
                      and not (w == "line " and "at line" in text)]
            # a refusal is due at once; an accepted body is a generation (up to its max_tokens on
            # a CPU shared with the rest of the suite): it must end, not hang
            slow = seconds > (1.0 if 400 <= r.status_code < 500 else 8.0)
            if not (200 <= r.status_code < 300 or 400 <= r.status_code < 500) or slow or leaked:
                problems.append(f"case {case} {route} {raw[:160]!r}: {r.status_code} in {seconds:.2f} s "
                                f"{leaked} {text[:300]!r}")
    print(f"statuses: {dict(sorted(statuses.items()))}")
    assert not problems, "\n".join(problems[:10])
    assert statuses.get(400, 0) > CASES // 4 and statuses.get(200, 0) > 0      # both kinds were exercised
    assert server["proc"].poll() is None
