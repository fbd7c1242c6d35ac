"""`openjet serve --workers 2`: two llama.cpp workers behind the front LiteLLM Router, called with
the official openai client; plus the pieces (GPU lists, the front's config, conversation keys,
the no-orphan guarantee) on their own.

One cluster (front + 2 workers, the embedded default model on the CPU) serves the slow tests of
this module, in file order: spread, affinity, a worker killed under load, its restart, shutdown.
Which worker answered comes from the front's `x-litellm-model-id` response header (the
deployment's id, `worker-<i>:<model>`) and is checked against the workers' own access logs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from openjet_plugin import cluster  # noqa: E402
from openjet_plugin.cluster import RouterPolicy, WorkerSpec, conversation_key, front_config, parse_gpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-openjet-cluster-test-" + "1" * 16
STARTUP_SECONDS = 240
COOLDOWN = 3


# --- without processes --------------------------------------------------------------------------

def test_parse_gpus():
    have = ["0", "1", "2"]
    assert parse_gpus("all", have) == have
    assert parse_gpus("2", have) == ["0", "1"]
    assert parse_gpus("2,0", have) == ["2", "0"]
    for bad, words in (("4", "only 3"), ("0,0", "twice"), ("0,7", "not visible"), ("x", "expected"),
                       ("0", "at least one")):
        with pytest.raises(ValueError, match=words):
            parse_gpus(bad, have)
    with pytest.raises(ValueError, match="--workers"):
        parse_gpus("all", [])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert cluster.visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cluster.visible_gpus() == []


def test_front_config_one_deployment_per_worker():
    workers = [WorkerSpec(0, 5001, "0"), WorkerSpec(1, 5002, "1")]
    cfg = front_config(workers, ["q27b"], "sk-internal", RouterPolicy(num_retries=2, cooldown_time=7))
    deployments = cfg["model_list"]
    assert [d["model_name"] for d in deployments] == ["q27b", "q27b"]
    assert [d["litellm_params"]["api_base"] for d in deployments] == ["http://127.0.0.1:5001/v1",
                                                                      "http://127.0.0.1:5002/v1"]
    assert {d["litellm_params"]["model"] for d in deployments} == {"openai/q27b"}
    assert {d["litellm_params"]["api_key"] for d in deployments} == {"sk-internal"}
    assert len({d["model_info"]["id"] for d in deployments}) == 2
    rs = cfg["router_settings"]
    assert (rs["num_retries"], rs["cooldown_time"], rs["allowed_fails"]) == (2, 7, 0)
    assert rs["optional_pre_call_checks"] == ["session_affinity"]
    assert cfg["litellm_settings"]["callbacks"] == ["openjet_plugin.cluster.conversation_session_id"]
    plain = front_config(workers, [], "k", RouterPolicy(session_affinity=False))
    assert "optional_pre_call_checks" not in plain["router_settings"]
    assert "callbacks" not in plain["litellm_settings"]
    assert plain["model_list"][0]["model_name"] == "openjet-default"


def test_worker_pinning_and_keys(monkeypatch):
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-front")
    spec = WorkerSpec(1, 5002, "1")
    env = cluster.worker_env(spec, "sk-internal")
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "LITELLM_MASTER_KEY" not in env                 # the front's key never reaches a worker
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert env["OPENJET_API_KEY"] == "sk-internal"         # the worker's key: in its environment
    argv = cluster.worker_argv(spec, ["--backend", "native"])
    assert argv[argv.index("--port") + 1] == "5002" and "sk-internal" not in argv   # never on the command line
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert "CUDA_VISIBLE_DEVICES" in cluster.worker_env(WorkerSpec(0, 1, None), "k")   # CPU workers: untouched


def test_conversation_key_is_the_same_on_every_turn():
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    later = opening + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    assert conversation_key(opening) == conversation_key(later)
    assert re.fullmatch(r"conv-[0-9a-f]{32}", conversation_key(opening))
    assert conversation_key([{"role": "user", "content": "Hi"}]) != conversation_key(opening)
    assert conversation_key(opening[:1] + [{"role": "user", "content": "Bye"}]) != conversation_key(opening)
    assert conversation_key([{"role": "system", "content": "x"}]) is None


@pytest.mark.slow                       # importing litellm.router takes seconds
def test_router_settings_are_routers_parameters():
    # LiteLLM's proxy passes router_settings to Router(); a misspelt key would be refused (or,
    # through the proxy, silently lost): check ours and the several-hosts example against it
    import yaml
    from litellm.router import router_arguments

    ours = front_config([WorkerSpec(0, 5001, "0")], [], "k")["router_settings"]
    assert set(router_arguments(**ours)) == set(ours)
    example = yaml.safe_load((REPO / "examples" / "cluster_router.yaml").read_text())
    assert set(router_arguments(**example["router_settings"])) == set(example["router_settings"])
    assert example["router_settings"]["optional_pre_call_checks"] == ["session_affinity"]
    hosts = example["model_list"]
    assert len(hosts) >= 2 and len({d["model_name"] for d in hosts}) == 1
    assert all(d["litellm_params"]["api_key"].startswith("os.environ/") for d in hosts)   # no key in the file
    assert len({d["model_info"]["id"] for d in hosts}) == len(hosts)
    for path in example["litellm_settings"]["callbacks"]:
        module, _, attr = path.rpartition(".")
        assert getattr(__import__(module, fromlist=[attr]), attr) is cluster.conversation_session_id


def test_print_config_hides_the_worker_key(capsys):
    from openjet_plugin.serve import main

    assert main(["--workers", "2", "--print-config", "--no-affinity"]) == 0
    out = capsys.readouterr().out
    assert out.count("api_key: <internal worker key>") == 2
    assert cluster.WORKER_KEY_PREFIX not in out
    assert "session_affinity" not in out


@pytest.mark.parametrize("argv, words", [
    (["--workers", "0"], "at least 1"),
    (["--workers", "2", "--gpus", "0"], "either --gpus or --workers"),
    (["--workers", "2", "--worker-ports", "4001"], "need 2 distinct ports"),
    (["--workers", "2", "--worker-ports", "4001,x"], "expected comma-separated port numbers"),
    (["--workers", "1", "--config", "examples/litellm_proxy.yaml"], "cannot be combined"),
    (["--workers", "1", "--host", "0.0.0.0"], "loopback"),
])
def test_bad_cluster_arguments(argv, words, capsys):
    from openjet_plugin.serve import main

    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_no_gpus_is_a_clear_error(monkeypatch, capsys):
    from openjet_plugin.serve import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["--gpus", "all"]) == 2
    assert "no GPU is visible" in capsys.readouterr().err


def test_workers_die_with_their_supervisor(tmp_path):
    # a supervisor killed with SIGKILL runs no cleanup; the kernel's parent-death signal must end
    # its workers anyway (this is what keeps `openjet serve --gpus` from leaving orphans)
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from openjet_plugin.cluster import _pdeathsig\n"
        "p = subprocess.Popen(['sleep', '120'], preexec_fn=_pdeathsig)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n")], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the supervisor did not start its child"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the worker outlived its killed supervisor"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


# --- a running cluster ----------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _listening(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, p = fields[1].rsplit(":", 1)
            if int(p, 16) == port and fields[3] == "0A":
                found.add(addr)
    return found


def _served_requests(log: Path) -> int:
    return log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1" 200')


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    import httpx

    import openjet_plugin

    openjet_plugin.default_model_path()
    port = cluster.free_port()
    work = tmp_path_factory.mktemp("cluster")
    log_path = work / "front.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENJET_MODELS", "LITELLM_MASTER_KEY"))}
    env.update(OPENJET_THREADS="1", LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1",
               OPENJET_API_KEY=API_KEY)
    cmd = [sys.executable, "-m", "openjet_plugin.serve", "--workers", "2", "--backend", "llama.cpp",
           "--port", str(port), "--log-dir", str(work / "logs"),
           "--cooldown", str(COOLDOWN), "--health-interval", "2"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the cluster exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the cluster did not start in {STARTUP_SECONDS} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        text = log_path.read_text()
        workers = {f"worker-{i}": {"pid": int(pid), "port": int(wport), "log": Path(wlog)}
                   for i, pid, wport, wlog in re.findall(
                       r"worker-(\d) pid (\d+) on http://127\.0\.0\.1:(\d+)/v1, log (\S+)", text)}
        assert sorted(workers) == ["worker-0", "worker-1"], text
        yield {"port": port, "proc": proc, "log": log_path, "workers": workers}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def client(front):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{front['port']}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def engine():
    from openjet_plugin.adapters._shared import shared_engine

    return shared_engine(None, backend="llama.cpp")


def _ask(client, messages, max_tokens=24, **kw):
    """(worker name, retries the front made, answer text, response)."""
    raw = client.chat.completions.with_raw_response.create(
        model="openjet-default", messages=messages, temperature=0, max_tokens=max_tokens, **kw)
    r = raw.parse()
    worker = raw.headers["x-litellm-model-id"].split(":")[0]
    return worker, int(raw.headers.get("x-litellm-attempted-retries") or 0), r.choices[0].message.content, r


def _stream(client, messages, max_tokens=24) -> str:
    chunks = client.chat.completions.create(model="openjet-default", messages=messages, temperature=0,
                                            max_tokens=max_tokens, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what does the module number {i} do?"}]


@pytest.mark.slow
def test_front_and_workers_listen_on_loopback_only(front):
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    for port in [front["port"]] + [w["port"] for w in front["workers"].values()]:
        addrs = _listening(port)
        assert addrs and addrs <= loopback, f"port {port} listens on {addrs}"


@pytest.mark.slow
def test_keys(front, client):
    import openai
    from openai import OpenAI

    bad = OpenAI(base_url=f"http://127.0.0.1:{front['port']}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        bad.chat.completions.create(model="openjet-default", messages=_question(0), max_tokens=2)
    assert 400 <= info.value.status_code < 500
    # the front's key opens no worker: their keys are internal
    port = front["workers"]["worker-0"]["port"]
    direct = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        direct.chat.completions.create(model="openjet-default", messages=_question(0), max_tokens=2)
    assert 400 <= info.value.status_code < 500


@pytest.mark.slow
def test_requests_are_spread_over_both_workers(front, client, engine):
    logs = {name: w["log"] for name, w in front["workers"].items()}
    before = {name: _served_requests(log) for name, log in logs.items()}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _ask(client, _question(i)), range(8)))
    by_worker = {name: sum(1 for w, *_ in results if w == name) for name in logs}
    assert all(n >= 1 for n in by_worker.values()), by_worker
    for i, (_, _, text, r) in enumerate(results):
        assert text == engine.chat(_question(i), temperature=0, max_tokens=24).text
        assert r.usage.completion_tokens >= 1
    time.sleep(0.5)                                        # access-log lines follow the response
    served = {name: _served_requests(log) - before[name] for name, log in logs.items()}
    assert served == by_worker, (served, by_worker)


def _pinned_despite_a_busy_worker(front, client, first, later, **kw):
    """Send `first`, then freeze the worker that answered it and send `later` twice at once: the
    first of those waits on the frozen worker, so for the second, least-busy alone would pick the
    other (idle) worker; a pin must keep it on the frozen one. -> (worker of first, workers of both)."""
    w_first, *_ = _ask(client, first, 8, **kw)
    pid = front["workers"][w_first]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(_ask, client, later, 8, **kw)
            time.sleep(0.5)
            second = pool.submit(_ask, client, later, 8, **kw)
            time.sleep(0.5)
            assert not waiting.done() and not second.done(), "the frozen worker answered"
            os.kill(pid, signal.SIGCONT)
            return w_first, (waiting.result()[0], second.result()[0]), second.result()[2]
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_conversation_stays_on_its_worker(front, client, engine):
    b = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Conversation B"}]
    w_b, _, text, _ = _ask(client, b, 8)
    b += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    first, later, answer = _pinned_despite_a_busy_worker(front, client, b, b)
    assert first == w_b and later == (w_b, w_b), (w_b, first, later)
    assert answer == engine.chat(b, temperature=0, max_tokens=8).text
    # further turns, one at a time, stay there too
    for turn in range(3):
        b += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Turn {turn}"}]
        w, _, answer, _ = _ask(client, b, max_tokens=8)
        assert w == w_b


@pytest.mark.slow
def test_a_client_session_id_pins_too(front, client):
    # conversations that open differently but name one session share its worker
    session = {"x-litellm-session-id": "openjet-test-session-0001"}
    first, later, _ = _pinned_despite_a_busy_worker(front, client, _question(100), _question(101),
                                                    extra_headers=session)
    assert later == (first, first)


@pytest.mark.slow
def test_without_a_pin_the_idle_worker_is_chosen(front, client):
    # the control for the two tests above: with one worker frozen holding a request, a new
    # conversation goes to the other worker, so the pins above are what kept those requests
    w_first, *_ = _ask(client, _question(110), 8)
    pid = front["workers"][w_first]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_ask, client, _question(110), 8)
            time.sleep(0.5)
            w_new, *_ = _ask(client, _question(111), 8)
            assert not waiting.done()
            os.kill(pid, signal.SIGCONT)
            assert waiting.result()[0] == w_first
    finally:
        os.kill(pid, signal.SIGCONT)
    assert w_new != w_first


@pytest.mark.slow
def test_a_killed_workers_requests_are_retried(front, client, engine):
    victim = front["workers"]["worker-1"]
    expected = {i: engine.chat(_question(i), temperature=0, max_tokens=24).text for i in range(20, 32)}
    # freeze the victim first, so requests are certainly in flight on it when it is killed
    streamed = {i: engine.chat(_question(i), temperature=0, max_tokens=24).text for i in range(32, 36)}
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(16) as pool:
            futures = {i: pool.submit(_ask, client, _question(i)) for i in expected}
            # streams whose worker dies before their first chunk are retried like the others
            streams = {i: pool.submit(_stream, client, _question(i)) for i in streamed}
            time.sleep(1.5)
            os.kill(victim["pid"], signal.SIGKILL)
            results = {i: f.result() for i, f in futures.items()}       # a failed request raises here
            stream_results = {i: f.result() for i, f in streams.items()}
    finally:
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert stream_results == streamed
    assert {i: text for i, (_, _, text, _) in results.items()} == expected
    assert {w for w, *_ in results.values()} == {"worker-0"}
    retried = [i for i, (_, retries, _, _) in results.items() if retries >= 1]
    assert retried, "no request was in flight on the killed worker; the test proves nothing"
    # and while it is down, new requests go to the survivor without failing
    for i in range(40, 44):
        w, _, text, _ = _ask(client, _question(i))
        assert w == "worker-0"


@pytest.mark.slow
def test_the_killed_worker_is_restarted_and_used_again(front, client):
    import httpx

    victim = front["workers"]["worker-1"]
    deadline = time.monotonic() + 150
    while True:
        log = front["log"].read_text()
        restarted = "worker-1 (pid" in log and "restarting it" in log
        try:
            up = restarted and httpx.get(f"http://127.0.0.1:{victim['port']}/health/liveliness",
                                         timeout=2).status_code == 200
        except httpx.HTTPError:
            up = False
        if up:
            break
        assert time.monotonic() < deadline, f"worker-1 did not come back:\n{log[-2000:]}"
        time.sleep(1)
    time.sleep(COOLDOWN + 1)                               # the Router's cooldown for it has passed
    seen = set()
    for round_ in range(5):
        with ThreadPoolExecutor(4) as pool:
            seen |= {w for w, *_ in pool.map(lambda i: _ask(client, _question(i), 8), range(60 + 4 * round_,
                                                                                           64 + 4 * round_))}
        if "worker-1" in seen:
            break
    assert seen == {"worker-0", "worker-1"}


@pytest.mark.slow
def test_zz_sigterm_stops_every_process(front):
    proc = front["proc"]
    pids = [int(p) for p in re.findall(r"worker-\d pid (\d+)", front["log"].read_text())]   # restarts too
    assert len(pids) >= 3, front["log"].read_text()[-2000:]
    live_children = _children(proc.pid)
    assert len(live_children) >= 2, live_children
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, front["log"].read_text()[-3000:]
    text = front["log"].read_text()
    assert "all workers stopped" in text
    for pid in set(pids) | set(live_children):
        assert not _alive(pid), f"process {pid} outlived the cluster"
    for port in [front["port"]] + [w["port"] for w in front["workers"].values()]:
        assert not _listening(port), f"port {port} still listens"


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out
