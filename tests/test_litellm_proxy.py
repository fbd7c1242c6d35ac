"""`openjet serve`: the real LiteLLM proxy in a subprocess, called with the official openai client.

One proxy process (started from examples/litellm_proxy.yaml, so the example is what is tested)
serves every test in this module; it is stopped with SIGTERM at the end and must exit cleanly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-openjet-test-" + "0" * 16
STARTUP_SECONDS = 120

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    import openjet_plugin

    openjet_plugin.default_model_path()            # generate the model before the server needs it
    port = _free_port()
    log_path = tmp_path_factory.mktemp("proxy") / "proxy.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENJET_MODELS", "LITELLM_MASTER_KEY"))}
    env["OPENJET_THREADS"] = env.get("OPENJET_THREADS", "2")
    cmd = [sys.executable, "-m", "openjet_plugin.serve", "--config", str(REPO / "examples" / "litellm_proxy.yaml"),
           "--port", str(port), "--api-key", API_KEY]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        import httpx

        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the proxy exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the proxy did not start in {STARTUP_SECONDS} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"port": port, "proc": proc, "log": log_path}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def engine():
    from openjet_plugin.adapters._shared import shared_engine

    return shared_engine(None)


MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


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
    import openai
    from openai import OpenAI

    bad = OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="sk-wrong", max_retries=0)
    # LiteLLM refuses an unknown key (401, or 400 "No connected db" when it has no key database)
    with pytest.raises(openai.APIStatusError) as info:
        bad.chat.completions.create(model="openjet-default", messages=MESSAGES, max_tokens=2)
    assert 400 <= info.value.status_code < 500


def test_zz_clean_shutdown(server):
    # runs last in the module (name order): stop the server the way a service manager would
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, server["log"].read_text()[-3000:]
    assert "Application shutdown complete" in server["log"].read_text()
    assert not _listening_addresses(server["port"])
