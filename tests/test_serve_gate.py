"""The front door of `openjet serve` (serve_gate.Gate) on a stand-in app, and the server's key
handling: fast, deterministic checks of what the proxy tests see from outside — admission beyond
capacity is a 503 with Retry-After and reaches no engine, keys are compared as documented, 5xx
bodies lose their internals, the key comes from a file or the environment and never argv.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from openjet_plugin import serve
from openjet_plugin.serve_gate import Gate, RequestError, ServerMetrics, check_chat_body, check_completion_body

MASTER, CLIENT = "sk-master-" + "m" * 30, "sk-client-" + "c" * 30
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class StandIn:
    """An ASGI app that records what reached it and answers when released."""

    def __init__(self, status: int = 200, body: bytes = b'{"ok": true}'):
        self.status, self.body = status, body
        self.seen: list[dict] = []
        self.release = asyncio.Event()
        self.hold = False

    async def __call__(self, scope, receive, send):
        msg = await receive()
        self.seen.append({"path": scope["path"], "headers": dict(scope["headers"]), "body": msg.get("body", b"")})
        if self.hold:
            await self.release.wait()
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


async def call(app, path: str, body=None, *, key: str | None = CLIENT, raw: bytes | None = None, method="POST"):
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", b"Bearer " + key.encode()))
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else b""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(3600)

    out = {"status": None, "headers": {}, "body": b""}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"], out["headers"] = message["status"], dict(message.get("headers", []))
        else:
            out["body"] += message.get("body", b"")

    await app({"type": "http", "method": method, "path": path, "headers": headers}, receive, send)
    return out


def gate(app, capacity: int = 2, **kw) -> Gate:
    return Gate(app, client_keys=[CLIENT], master_key=MASTER, capacity=capacity, metrics=ServerMetrics(), **kw)


def test_keys_routes_and_the_key_the_proxy_sees():
    async def run():
        inner = StandIn()
        g = gate(inner)
        assert (await call(g, "/v1/chat/completions", GOOD, key="sk-wrong"))["status"] == 401
        assert (await call(g, "/v1/chat/completions", GOOD, key=None))["status"] == 401
        assert (await call(g, "/v1/chat/completions", GOOD))["status"] == 200
        # the proxy is called with the master key, whatever the client sent
        assert inner.seen[-1]["headers"][b"authorization"] == b"Bearer " + MASTER.encode()
        for path in ("/openapi.json", "/routes", "/ui/", "/key/generate"):
            assert (await call(g, path, key=MASTER, method="GET"))["status"] == 404
        admin = gate(inner, admin=True)
        assert (await call(admin, "/key/generate", {}, key=CLIENT))["status"] == 404      # never to clients
        assert (await call(admin, "/key/generate", {}, key=MASTER))["status"] == 200
        assert len(inner.seen) == 2
    asyncio.run(run())


def test_admission_beyond_capacity_is_503_with_retry_after():
    async def run():
        inner = StandIn()
        inner.hold = True
        g = gate(inner, capacity=2)
        held = [asyncio.create_task(call(g, "/v1/chat/completions", GOOD)) for _ in range(2)]
        await asyncio.sleep(0.05)
        refused = await asyncio.wait_for(call(g, "/v1/chat/completions", GOOD), 5)   # at once, not queued
        assert refused["status"] == 503 and refused["headers"][b"retry-after"].isdigit()
        assert json.loads(refused["body"])["error"]["code"] == "server_busy"
        assert len(inner.seen) == 2                          # the refused one reached nothing
        assert "openjet_requests_admitted 2" in g.metrics.render()
        inner.release.set()
        assert [t["status"] for t in await asyncio.gather(*held)] == [200, 200]
        assert (await call(g, "/v1/chat/completions", GOOD))["status"] == 200   # room again
        assert 'openjet_requests_refused_total{reason="queue_full"} 1' in g.metrics.render()
    asyncio.run(run())


def test_a_bad_body_never_reaches_the_proxy():
    async def run():
        inner = StandIn()
        g = gate(inner)
        r = await call(g, "/v1/chat/completions", raw=b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}')
        assert r["status"] == 400 and "UTF-8" in json.loads(r["body"])["error"]["message"]
        r = await call(g, "/v1/chat/completions", raw=b"[" * 50000 + b"]" * 50000)
        assert r["status"] == 400
        r = await call(g, "/v1/chat/completions", raw=b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}')
        assert r["status"] == 400 and "surrogate" in json.loads(r["body"])["error"]["message"]
        assert inner.seen == []
    asyncio.run(run())


def test_internal_errors_lose_their_internals_and_litellm_wrapping_goes():
    async def run():
        trace = b'{"error": {"message": "Traceback (most recent call last):\\n  File \\"/x/y.py\\", line 3"}}'
        r = await call(gate(StandIn(500, trace)), "/v1/chat/completions", GOOD)
        assert r["status"] == 500 and b"Traceback" not in r["body"] and b".py" not in r["body"]
        wrapped = json.dumps({"error": {"message": "litellm.BadRequestError: OpenjetException - bad top_k\n\n"
                                                   "LiteLLM: model group 'm' failed with the error above.",
                                        "type": "invalid_request_error", "param": None, "code": "400"}}).encode()
        r = await call(gate(StandIn(400, wrapped)), "/v1/chat/completions", GOOD)
        assert r["status"] == 400 and json.loads(r["body"])["error"]["message"] == "bad top_k"
    asyncio.run(run())


@pytest.mark.parametrize("body,param", [
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({**GOOD, "messages": [{"role": "assistant"}]}, "messages[0].content"),
    ({**GOOD, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({**GOOD, "seed": 2**70}, "seed"),
    ({**GOOD, "temperature": float("nan")}, "temperature"),
    ({**GOOD, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({**GOOD, "tool_choice": "required"}, "tool_choice"),
    ({**GOOD, "response_format": {"type": "json_schema", "json_schema": {"name": "bad name"}}},
     "response_format.json_schema.name"),
    ({**GOOD, "reasoning_effort": "max"}, "reasoning_effort"),
])
def test_chat_body_checks_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        check_chat_body(body)
    assert info.value.param == param and info.value.status == 400


def test_good_bodies_pass():
    check_chat_body({**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                     "tool_choice": {"type": "function", "function": {"name": "f"}}, "logprobs": True,
                     "top_logprobs": 3, "response_format": {"type": "json_object"}, "logit_bias": {"5": -100},
                     "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "n": 1,
                     "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                  {"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": None, "tool_calls": [
                                      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})
    check_completion_body({"model": "m", "prompt": ["one prompt"], "max_tokens": 3, "logprobs": 2})


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, "host": "127.0.0.1", **kw})


def test_client_key_from_a_file_or_the_environment_never_argv(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENJET_API_KEY", raising=False)
    assert serve._client_key(_args()) is None                       # loopback: one is made
    with pytest.raises(ValueError, match="command line"):
        serve._client_key(_args(api_key="sk-anything"))
    f = tmp_path / "key"
    f.write_text("sk-from-a-file\n")
    assert serve._client_key(_args(api_key_file=str(f))) == "sk-from-a-file"
    f.write_text("")
    with pytest.raises(ValueError, match="one line"):
        serve._client_key(_args(api_key_file=str(f)))
    with pytest.raises(ValueError, match="No such file"):
        serve._client_key(_args(api_key_file=str(tmp_path / "missing")))
    monkeypatch.setenv("OPENJET_API_KEY", "sk-from-env")
    assert serve._client_key(_args()) == "sk-from-env"
    with pytest.raises(ValueError, match="weak"):
        serve._client_key(_args(host="0.0.0.0"))
    strong = "sk-" + "abcdefghijklmnopqrstuvwxyz0123456789"
    monkeypatch.setenv("OPENJET_API_KEY", strong)
    assert serve._client_key(_args(host="0.0.0.0")) == strong
    assert serve.weak_key_reason("a" * 40) and serve.weak_key_reason("abc") and not serve.weak_key_reason(strong)


def test_generated_config_never_retries():
    cfg = serve.build_config([])
    assert cfg["litellm_settings"]["num_retries"] == 0 and cfg["router_settings"]["num_retries"] == 0
