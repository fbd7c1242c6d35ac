"""`openjet serve`: the real LiteLLM proxy in a subprocess, called with the official openai client
(sync, async, streaming), LiteLLM (SDK and Router) and raw HTTP.

One proxy process (started from examples/litellm_proxy.yaml, so the example is what is tested)
serves every test in this module; it is stopped with SIGTERM at the end and must exit cleanly.
Conformance (issue 27): bad bodies get 400 at once naming the field, a wrong key 401, the admin
routes are closed, text completions continue the raw prompt, usage is the engine's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-openjet-test-" + "0" * 16
STARTUP_SECONDS = 120
N_CTX = 512             # small, so a request without max_tokens (to the context's end) is quick

pytestmark = pytest.mark.slow


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, p = fields[1].rsplit(":", 1)
            if int(p, 16) == port and fields[3] == "0A":        # 0A = LISTEN
                found.add(addr)
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sys.path.insert(0, str(REPO / "scripts"))
    from load_test import start_server, stop_server

    import openjet_plugin

    openjet_plugin.default_model_path()            # generate the model before the server needs it
    log_path = tmp_path_factory.mktemp("proxy") / "proxy.log"
    proc, base = start_server(log_path, startup_s=STARTUP_SECONDS,
                              env={"OPENJET_API_KEY": API_KEY,
                                   "OPENJET_THREADS": os.environ.get("OPENJET_THREADS", "2")},
                              args=["--config", str(REPO / "examples" / "litellm_proxy.yaml"), "--n-ctx", str(N_CTX)])
    try:
        yield {"port": int(base.rsplit(":", 1)[1]), "proc": proc, "log": log_path}
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def engine():
    from openjet_plugin.adapters._shared import shared_engine

    return shared_engine(None)


MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


def test_example_config_keeps_keys_out_and_separate():
    import yaml

    text = (REPO / "examples" / "litellm_proxy.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"   # not a literal key
    assert config["litellm_settings"]["num_retries"] == 0 == config["router_settings"]["num_retries"]
    assert "sk-" not in text.replace("sk-mine", "")
    assert "--api-key " not in text and "--host 0.0.0.0" not in text


def test_binds_loopback_only(server):
    addrs = _listening_addresses(server["port"])
    assert addrs, "nothing listens on the proxy's port"
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert addrs <= loopback, f"the proxy listens on {addrs}, not only on the loopback interface"


def test_chat_completion_answer_and_usage(client, engine):
    r = client.chat.completions.create(model="openjet-default", messages=MESSAGES, temperature=0, max_tokens=12)
    direct = engine.chat(MESSAGES, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == direct.text
    assert r.choices[0].finish_reason == direct.finish_reason
    prompt_tokens = len(engine.tokenize(engine.render_chat(MESSAGES), add_special=True))
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == len(direct.tokens)
    assert r.usage.total_tokens == prompt_tokens + len(direct.tokens)


def test_streaming_matches_and_reports_usage(client):
    kw = dict(model="openjet-default", messages=MESSAGES, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage][-1]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_extra_request_options_reach_the_engine(client, engine):
    # options beyond OpenAI's travel in the body (extra_body) through the proxy to the provider
    r = client.chat.completions.create(model="openjet-default", messages=MESSAGES, temperature=0, max_tokens=8,
                                       extra_body={"enable_thinking": True, "top_k": 5, "repeat_penalty": 1.3})
    direct = engine.chat(MESSAGES, enable_thinking=True, temperature=0, max_tokens=8, top_k=5, repeat_penalty=1.3)
    assert r.choices[0].message.content == direct.text


def test_parallel_clients(client):
    from concurrent.futures import ThreadPoolExecutor

    kw = dict(model="openjet-default", messages=MESSAGES, temperature=0, max_tokens=8)
    expected = client.chat.completions.create(**kw).choices[0].message.content

    def ask(stream: bool) -> str:
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, [True, False, True, False])) == [expected] * 4


def test_models_endpoint_lists_only_configured_models(client):
    assert [m.id for m in client.models.list().data] == ["openjet-default"]


def test_a_file_path_as_model_is_never_opened(client, server, tmp_path):
    import openai

    # a FIFO: opening it for reading blocks until a writer comes, so a server that tried to load
    # it would hang this request instead of answering
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for name in (str(fifo), "openjet/" + str(fifo), "openjet//etc/passwd"):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
            client.with_options(timeout=20).chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=2)
    # and the server still answers
    assert client.chat.completions.create(model="openjet-default", messages=MESSAGES, max_tokens=2).choices


def test_requests_need_the_key(server):
    import httpx
    import openai
    from openai import OpenAI

    bad = OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="openjet-default", messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 401
    url = f"http://127.0.0.1:{server['port']}"
    body = {"model": "openjet-default", "messages": MESSAGES, "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401          # no key
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": "sk-wrong"}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200   # other header


# --- conformance (issue 27) -----------------------------------------------------------------------

def _post(server, path: str, body, *, raw: bytes | None = None, key: str = API_KEY):
    import httpx

    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    t0 = time.monotonic()
    r = httpx.post(f"http://127.0.0.1:{server['port']}{path}", headers=headers, timeout=30,
                   content=raw if raw is not None else json.dumps(body).encode())
    return r, time.monotonic() - t0


def _assert_clean_refusal(r, seconds: float, status: int = 400, param: str | None = "-") -> dict:
    assert r.status_code == status, r.text
    assert seconds < 1.0, f"refused after {seconds:.2f} s"
    assert "Traceback" not in r.text and 'File "' not in r.text and ".py" not in r.text, r.text
    err = r.json()["error"]
    assert err["message"]
    if param != "-":
        assert err["param"] == param, err
    return err


GOOD = {"model": "openjet-default", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
BAD_BODIES = [
    ({**GOOD, "messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
    ({**GOOD, "messages": "hello"}, "messages"),
    ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({**GOOD, "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    ({**GOOD, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({**GOOD, "tools": "get_weather"}, "tools"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({**GOOD, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({**GOOD, "n": 2}, "n"),
    ({**GOOD, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**GOOD, "logit_bias": {"5": 1000}}, "logit_bias"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "temperature": 5}, "temperature"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": 2.5}, "max_tokens"),
    ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**GOOD, "top_logprobs": 3}, "top_logprobs"),
    ({**GOOD, "frobnicate": 1}, "frobnicate"),
    ({k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ({k: v for k, v in GOOD.items() if k != "messages"}, "messages"),
    ([GOOD], None),
]


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[p or "array" for _, p in BAD_BODIES])
def test_bad_chat_bodies_get_400_at_once_naming_the_field(server, body, param):
    r, seconds = _post(server, "/v1/chat/completions", body)
    _assert_clean_refusal(r, seconds, 400, param)


@pytest.mark.parametrize("raw,words", [
    (b'{"model": "openjet-default", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
    (b'{"model": "openjet-default", "messages": [', "JSON"),
    (b"", "JSON"),
])
def test_undecodable_bodies_get_400(server, raw, words):
    r, seconds = _post(server, "/v1/chat/completions", None, raw=raw)
    assert words in _assert_clean_refusal(r, seconds)["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": "openjet-default", "prompt": 42}, "prompt"),
    ({"model": "openjet-default", "prompt": [1, 2, 3]}, "prompt"),
    ({"model": "openjet-default", "prompt": "a", "echo": True}, "echo"),
    ({"model": "openjet-default", "prompt": "a", "suffix": "b"}, "suffix"),
    ({"model": "openjet-default", "prompt": "a", "best_of": 3}, "best_of"),
    ({"model": "openjet-default", "prompt": "a", "n": 3}, "n"),
])
def test_bad_completion_bodies_get_400(server, body, param):
    r, seconds = _post(server, "/v1/completions", body)
    _assert_clean_refusal(r, seconds, 400, param)


def test_engine_refusals_are_400_and_not_retried(server):
    # context overflow is found by the engine, behind LiteLLM: still 400 at once (LiteLLM retrying
    # a deterministic error waits seconds between attempts)
    r, seconds = _post(server, "/v1/chat/completions", {**GOOD, "max_tokens": N_CTX * 4})
    err = _assert_clean_refusal(r, seconds, 400, param="-")
    assert "context window" in err["message"]


@pytest.mark.parametrize("path", ["/openapi.json", "/routes", "/ui/", "/docs", "/redoc", "/key/generate",
                                  "/model/info", "/config/yaml", "/spend/logs"])
def test_admin_and_docs_routes_are_closed(server, path):
    import httpx

    r = httpx.get(f"http://127.0.0.1:{server['port']}{path}", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404, (path, r.status_code, r.text[:200])


def test_logit_bias_reaches_the_engine(client, engine):
    # a +100 bias on one token makes greedy decoding write only that token
    tok = engine.tokenize(" sea", add_special=False)[0]
    r = client.chat.completions.create(model="openjet-default", messages=MESSAGES, temperature=0, max_tokens=4,
                                       logit_bias={str(tok): 100})
    assert r.choices[0].message.content == engine.detokenize([tok] * 4)


def test_omitted_max_tokens_generates_to_the_end_of_the_context(client):
    # (up to ~490 tokens: seconds here, more on a busy machine)
    r = client.with_options(timeout=300).chat.completions.create(model="openjet-default", messages=MESSAGES,
                                                                 temperature=0)
    # OpenAI's rule: no max_tokens, no cap but the context window (not a hidden default)
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "length":
        assert r.usage.prompt_tokens + r.usage.completion_tokens == N_CTX
    else:
        assert r.usage.completion_tokens > 0


def test_text_completion_continues_the_raw_prompt(client, engine):
    prompt = "def fibonacci(n):"
    r = client.completions.create(model="openjet-default", prompt=prompt, temperature=0, max_tokens=10)
    direct = engine.generate(prompt, temperature=0, max_tokens=10)
    assert r.choices[0].text == direct.text                     # no chat template around the prompt
    assert r.usage.prompt_tokens == len(engine.tokenize(prompt, add_special=True))
    assert r.usage.completion_tokens == len(direct.tokens)
    chunks = list(client.completions.create(model="openjet-default", prompt=prompt, temperature=0, max_tokens=10,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.text
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == direct.finish_reason
    assert last.choices[0].text is not None                    # every chunk has its text, the last included


def test_text_completion_default_max_tokens_is_openais_16(client):
    r = client.completions.create(model="openjet-default", prompt="import os\n", temperature=0)
    assert r.usage.completion_tokens <= 16
    assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == 16


def test_async_openai_client(server, engine):
    import asyncio

    from openai import AsyncOpenAI

    async def run():
        c = AsyncOpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=API_KEY, max_retries=0)
        whole = await c.chat.completions.create(model="openjet-default", messages=MESSAGES, temperature=0,
                                                max_tokens=8)
        parts = []
        async for ch in await c.chat.completions.create(model="openjet-default", messages=MESSAGES, temperature=0,
                                                        max_tokens=8, stream=True):
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
        await c.close()
        return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed == engine.chat(MESSAGES, temperature=0, max_tokens=8).text


def test_litellm_sdk_and_router_against_the_server(server, engine):
    import litellm

    base = f"http://127.0.0.1:{server['port']}/v1"
    expected = engine.chat(MESSAGES, temperature=0, max_tokens=8).text
    r = litellm.completion(model="openai/openjet-default", api_base=base, api_key=API_KEY, messages=MESSAGES,
                           temperature=0, max_tokens=8)
    assert r.choices[0].message.content == expected
    router = litellm.Router(model_list=[{"model_name": "local", "litellm_params": {
        "model": "openai/openjet-default", "api_base": base, "api_key": API_KEY}}], num_retries=0)
    chunks = list(router.completion(model="local", messages=MESSAGES, temperature=0, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    with pytest.raises(litellm.BadRequestError):
        litellm.completion(model="openai/openjet-default", api_base=base, api_key=API_KEY,
                           messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3)


def test_metrics_in_prometheus_format(server, client):
    import httpx

    client.chat.completions.create(model="openjet-default", messages=MESSAGES, temperature=0, max_tokens=3)
    r = httpx.get(f"http://127.0.0.1:{server['port']}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["openjet_queue_depth"] == 0 and values["openjet_requests_running"] == 0
    assert values["openjet_engine_requests_total"] >= 1
    assert values["openjet_engine_generated_tokens_total"] >= 3
    assert values["openjet_request_decode_seconds_count"] == values["openjet_engine_requests_total"]
    assert values['openjet_requests_total{route="/v1/chat/completions",status="200"}'] >= 1


# --- constraints and logprobs (issue 26) ----------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    import jsonschema

    kw = dict(model="openjet-default", messages=MESSAGES, temperature=1.0, max_tokens=120, seed=3,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object(client):
    r = client.chat.completions.create(model="openjet-default", messages=MESSAGES, temperature=1.0, max_tokens=120,
                                       seed=5, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice(client, choice, stream):
    import jsonschema

    kw = dict(model="openjet-default", messages=MESSAGES, temperature=1.0, max_tokens=120, seed=1, tools=WEATHER,
              tool_choice=choice)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for c in client.chat.completions.create(stream=True, **kw):
            if not c.choices:
                continue
            finish = c.choices[0].finish_reason or finish
            for d in c.choices[0].delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or "" if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
        got = list(calls.values())
    else:
        r = client.chat.completions.create(**kw)
        finish = r.choices[0].finish_reason
        got = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
               for c in r.choices[0].message.tool_calls or []]
    assert finish == "tool_calls" and len(got) == 1 and got[0]["id"]
    if isinstance(choice, dict):
        assert got[0]["name"] == "get_time"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}[got[0]["name"]]
    jsonschema.validate(json.loads(got[0]["arguments"]), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_and_top_logprobs(client, engine, stream):
    import math

    kw = dict(model="openjet-default", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    direct = engine.chat(MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    if stream:
        content = [e for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [e.bytes for e in content] == [list(lp.bytes) for lp in direct.logprobs]
    for e, lp in zip(content, direct.logprobs):
        assert math.isclose(e.logprob, lp.logprob, rel_tol=1e-6, abs_tol=1e-6)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-9


def test_zz_clean_shutdown(server):
    # runs last in the module (name order): stop the server the way a service manager would
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, server["log"].read_text()[-3000:]
    assert "Application shutdown complete" in server["log"].read_text()
    assert not _listening_addresses(server["port"])
