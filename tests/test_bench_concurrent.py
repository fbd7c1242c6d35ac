"""The concurrent rows of `openjet bench` (bench/concurrent.py, issue 29): our engine on the CPU (the
embedded default model, llama.cpp backend), the llama-server side against a stand-in server (and the
real one where a build exists), the runner's groups and the report's section. CPU numbers check the
machinery; they are not results."""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from openjet_plugin.bench import concurrent, peer, peer_spec, report, runner
from openjet_plugin.bench.ours import Emitter
from openjet_plugin.bench.store import Store
from test_bench_peer_mtp import read_jsonl, write_fake_server

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = REPO / "openjet_plugin" / "data" / "default.gguf"

# small enough for two CPU cores: streams 1 and 4, latency rows with 3 streams and a 128-token prompt
SMALL = dict(streams=(1, 4), tokens=8, prompt_tokens=12, reps=2, spec_streams=4, drafts=2, latency_streams=3,
             latency_prompt=128, latency_tokens=12)


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# --- pieces -------------------------------------------------------------------------------------------

def test_token_gaps_share_a_gap_among_the_tokens_of_one_event():
    gaps, shared = concurrent.token_gaps([(0.0, 1), (0.010, 2), (0.040, 5), (0.050, 6)])
    assert gaps == pytest.approx([10.0, 10.0, 10.0, 10.0, 10.0]) and shared == 3
    assert concurrent.token_gaps([(1.0, 3)]) == ([], 0)        # the first event's tokens have no gap


def test_slow_gaps_are_split_into_the_passes_they_waited_for():
    """A stream's slow gap: 10 ms of a decode pass, a pass that waited 30 ms for the backend (a
    state copy holding it) then ran 20 ms with prompt tokens, and 5 ms between passes."""
    rec = concurrent.StreamRecord(0.0)
    for t, n in ((0.000, 1), (0.010, 2), (0.020, 3), (0.085, 4), (0.095, 5)):
        rec.add(t, n)
    trace = [(0.000, 0.010, 0.010, 3, 0), (0.010, 0.020, 0.010, 3, 0),
             (0.020, 0.030, 0.010, 3, 0), (0.035, 0.085, 0.020, 3, 64), (0.085, 0.095, 0.010, 3, 0)]
    b = concurrent.slow_gap_breakdown([rec], trace, median_ms=10.0)
    assert b == {"slow_gaps": 1, "ms": 65.0, "decode_pass_ms": 10.0, "mixed_pass_ms": 20.0,
                 "waiting_for_backend_ms": 30.0, "between_passes_ms": 5.0, "longest_mixed_pass_ms": 20.0,
                 "longest_wait_ms": 30.0}
    assert concurrent.slow_gap_breakdown([rec], trace, median_ms=40.0)["slow_gaps"] == 0


def test_pass_occupancy_counts_the_rounds_passes_and_their_share():
    trace = [(0.9, 1.0, 0.1, 2, 0), (1.0, 1.1, 0.1, 2, 0), (1.2, 1.5, 0.2, 2, 64), (1.5, 1.6, 0.1, 2, 0),
             (2.5, 2.6, 0.1, 2, 0)]
    o = concurrent.pass_occupancy(trace, 1.0, 2.0)
    assert o == {"passes": 3, "busy_share": 0.4, "gap_ms_median": 100.0, "decode_pass_ms_median": 100.0}
    assert concurrent.pass_occupancy([], 1.0, 2.0) == {}
    # with each pass's steps_in (the scheduler's trace today): the gap split at the last step's hand-in
    timed = [(1.0, 1.1, 0.1, 2, 0, 0.95), (1.2, 1.3, 0.1, 2, 0, 1.17), (1.35, 1.45, 0.1, 2, 0, 1.34),
             (1.5, 1.6, 0.1, 0, 64, 0.0)]
    o = concurrent.pass_occupancy(timed, 1.0, 2.0)
    # gaps (70 + 30) and (40 + 10) ms, nearest-rank medians; the prompt-only pass has no steps_in
    assert o["steps_in_ms_median"] == 40.0 and o["composing_ms_median"] == 10.0


def test_mixed_passes_give_a_prompt_pieces_cost_beside_the_decode_only_pass():
    trace = [(0.0, 0.01, 0.010, 7, 0), (0.01, 0.02, 0.012, 7, 0), (0.02, 0.08, 0.060, 7, 64),
             (0.08, 0.09, 0.014, 7, 0), (0.09, 0.16, 0.070, 7, 64), (0.16, 0.20, 0.040, 0, 512),
             (0.20, 0.24, 0.030, 6, 128)]
    m = concurrent.mixed_passes(trace)
    assert m == {"passes": 3, "prompt_tokens_median": 64, "ms_median": 60.0, "ms_max": 70.0,
                 "decode_steps_median": 7, "decode_only_ms_median": 12.0}
    assert concurrent.mixed_passes([(0.0, 0.01, 0.01, 7, 0), (0.01, 0.05, 0.04, 0, 512)]) == {}


def test_percentile_is_nearest_rank():
    xs = list(range(1, 101))
    assert concurrent.percentile(xs, 99) == 99 and concurrent.percentile(xs, 50) == 50
    assert concurrent.percentile([5.0, 1.0], 99) == 5.0 and concurrent.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        concurrent.percentile([], 99)


def test_prompts_are_the_shared_sequence_and_each_long_request_gets_a_new_prompt():
    from openjet_plugin.bench.spec import prompt_tokens

    plan = concurrent.Plan(**SMALL)
    streams, longs = plan.prompts(1000)
    n_long = 4 + concurrent.LATENCY_RETRIES
    seq = prompt_tokens(1000, 4 * 12 + n_long * 128)
    assert len(streams) == 4 and streams[1] == seq[12:24] and all(len(p) == 12 for p in streams)
    # reps + 2 + spares: the prompt alone, the warm-up round's, one per timed round, the redone rounds'
    assert len(longs) == n_long and longs[0] == seq[48:176] and longs[3] == seq[432:560]
    assert len({tuple(x) for x in longs}) == n_long
    rows = plan.rows()
    assert ("concurrent_tps", {"streams": 4, "drafts": 2}) in rows
    assert [p for m, p in rows if m == "concurrent_itl_p99_ms"] == [{"streams": 3, "prompt_tokens": 0},
                                                                    {"streams": 3, "prompt_tokens": 128}]


@pytest.mark.parametrize("change, needle", [
    (dict(streams=()), "streams"), (dict(streams=(0, 2)), "streams"), (dict(tokens=1), "tokens"),
    (dict(reps=0), "reps"), (dict(latency_prompt=0), "latency_prompt"), (dict(latency_streams=0), "latency_streams"),
])
def test_a_plan_that_cannot_run_names_the_parameter(change, needle):
    with pytest.raises(ValueError, match=needle):
        concurrent.check_plan(concurrent.Plan(**{**SMALL, **change}))


# --- our engine on the CPU -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ours_cpu(tmp_path_factory):
    """run_ours on the embedded default model, llama.cpp backend: every row of SMALL."""
    out = tmp_path_factory.mktemp("ours") / "rows.jsonl"
    concurrent.run_ours(str(DEFAULT_GGUF), concurrent.Plan(**SMALL), "llama.cpp", Emitter(out), lambda: math.inf)
    return _records(out)


def test_ours_on_the_cpu_gives_every_row_with_identical_streams(ours_cpu):
    rows = {report.row_key(r["metric"], r["engine"], r["params"]): r for r in ours_cpu if "metric" in r}
    details = {}
    for r in ours_cpu:
        details.update(r.get("info", {}).get("spec_details", {}))
    for S in (1, 4):
        key = report.row_key("concurrent_tps", "openjet", {"streams": S, "drafts": 0})
        assert key in rows and len(rows[key]["samples"]) == 2 and all(x > 0 for x in rows[key]["samples"])
        d = details[key]
        assert d["backend"] == "llama.cpp" and d["sequences"] == S and d["slots_asked"] == S
        # every stream of every round (the warm-up too) equals its prompt run alone
        assert d["streams_checked"] == S * 3 and d["streams_differing_from_alone"] == 0
        assert d["solo_differing_from_reference"] == 0 and d["tokens"] == 8 and d["prompt_tokens"] == 12
        assert all(x > 0 for x in d["itl_ms_median"])
    for L in (0, 128):
        key = report.row_key("concurrent_itl_p99_ms", "openjet", {"streams": 3, "prompt_tokens": L})
        assert key in rows and all(x > 0 for x in rows[key]["samples"])
        runs = details[key]["runs"]
        assert len(runs) == 2 and all(r["gaps"] >= 3 * 11 for r in runs) and details[key]["sequences"] == 4
        if L:
            # the prompt came in while the streams decoded, and they went on past its return
            assert all(0 < r["prompt_sent_s"] < r["prompt_returned_s"] for r in runs)
            assert all(r["streams_outlasted_prompt"] for r in runs)
    assert all(isinstance(details[k].get("eog_banned"), bool) for k in details)
    # the llama.cpp backend does not speculate: the row says so instead of a number
    skips = [r for r in ours_cpu if "skip" in r]
    assert [s["skip"]["params"] for s in skips] == [{"streams": 4, "drafts": 2}]
    assert "llama.cpp backend does not speculate" in skips[0]["reason"]


def test_an_engine_of_one_sequence_runs_the_streams_in_turn_and_says_so(tmp_path, monkeypatch):
    """An engine of fewer slots than the streams (one here): the rate rows are measured with
    sequences 1, the latency rows are not, with the reason."""
    import openjet_plugin

    real = openjet_plugin.load
    monkeypatch.setattr(openjet_plugin, "load", lambda *a, **kw: real(*a, **{**kw, "n_slots": 1}))
    out = tmp_path / "rows.jsonl"
    plan = concurrent.Plan(**{**SMALL, "streams": (2,)})
    concurrent.run_ours(str(DEFAULT_GGUF), plan, "llama.cpp", Emitter(out), lambda: math.inf)
    recs = _records(out)
    key = report.row_key("concurrent_tps", "openjet", {"streams": 2, "drafts": 0})
    d = next(r["info"]["spec_details"][key] for r in recs if key in r.get("info", {}).get("spec_details", {}))
    assert d["sequences"] == 1 and d["slots_asked"] == 2 and d["streams_differing_from_alone"] == 0
    skips = {json.dumps(r["skip"]["params"], sort_keys=True): r["reason"] for r in recs if "skip" in r}
    for L in (0, 128):
        reason = skips[json.dumps({"prompt_tokens": L, "streams": 3}, sort_keys=True)]
        assert reason == ("the engine serves 1 sequence(s) at once on the llama.cpp backend; 3 streams and a "
                          "prompt need 4")


def test_a_stream_that_differs_from_running_alone_is_counted():
    """The identity check against an engine whose output changes when several requests run: the
    stand-in's tokens depend on how many run at once."""
    import threading
    import time

    class Client:
        active = peak = 0                          # requests running now, and the most since all were idle
        lock = threading.Lock()

        def run(self, prompt, n, rec, keep_going=None):
            with self.lock:
                Client.active += 1
                Client.peak = max(Client.peak, Client.active)
            try:
                time.sleep(0.05)                   # long enough for the others to start
                shift = int(Client.peak > 1)
                rec.add(time.perf_counter(), n)
                rec.tokens = [(prompt[0] + i + shift) % 50 for i in range(n)]
            finally:
                with self.lock:
                    Client.active -= 1
                    Client.peak = Client.peak if Client.active else 0

    prompts = [[3], [7], [9]]
    reference = concurrent.solo_outputs(Client(), prompts, 5)
    samples, d = concurrent.measure_tps(Client(), prompts, 5, 2, reference)
    assert len(samples) == 2 and d["streams_checked"] == 9 and d["streams_differing_from_alone"] == 9
    assert d["first_difference"] == 0
    md = report._alone(d)
    assert md.startswith("0 of 9")
    samples, d = concurrent.measure_tps(Client(), prompts[:1], 5, 2, reference)
    assert d["streams_differing_from_alone"] == 0 and report._alone(d) == "yes"


def test_the_runner_group_runs_the_child_and_stores_its_rows(tmp_path):
    """openjet bench's group: the child process on the backend load() picks (the CPU: llama.cpp)."""
    s = runner.Settings(reps=1, concurrent_streams=(2,), concurrent_tokens=6, concurrent_prompt_tokens=8,
                        concurrent_drafts=2, latency_streams=2, latency_prompt_tokens=64, latency_tokens=8)
    st = Store(tmp_path / "r", {"x": 1})
    run = runner.Run(settings=s, store=st, model=DEFAULT_GGUF, cache=tmp_path, deadline=None, session="t", arch="90")
    runner.group_ours_concurrent(run)
    have = {report.row_key(r["metric"], r["engine"], r["params"]) for r in st.records()}
    planned = {report.row_key(*r) for r in runner.concurrent_rows(s, "openjet")}
    assert planned == {report.row_key(m, "openjet", p) for m, p in runner.concurrent_plan(s).rows()}
    # every planned row is measured or carries the child's reason
    assert planned == have | set(run.not_measured), (have, run.not_measured, (tmp_path / "ours-concurrent-t.log").read_text()[-2000:])
    assert report.row_key("concurrent_tps", "openjet", {"streams": 2, "drafts": 0}) in have
    assert st.info["spec_details"][report.row_key("concurrent_tps", "openjet", {"streams": 2, "drafts": 0})][
        "streams_differing_from_alone"] == 0
    runner.group_ours_concurrent(run)                     # resumed: nothing left to do
    assert len(st.records()) == len(have)


def test_plan_and_groups_have_both_engines_concurrent_rows(tmp_path):
    for s in (runner.Settings(), runner.Settings.quick_run()):
        planned, _ = runner.plan(s)
        for eng in ("openjet", "llama.cpp"):
            tps = sorted((p["streams"], p["drafts"]) for m, e, p in planned if m == "concurrent_tps" and e == eng)
            assert tps == sorted([(S, 0) for S in s.concurrent_streams] + [(8, s.concurrent_drafts)]), eng
            itl = [p for m, e, p in planned if m == "concurrent_itl_p99_ms" and e == eng]
            assert itl == [{"streams": 7, "prompt_tokens": 0}, {"streams": 7, "prompt_tokens": s.latency_prompt_tokens}]
        run = runner.Run(settings=s, store=Store(tmp_path / f"r{s.quick}", {"x": 1}), model=tmp_path / "m.gguf",
                         cache=tmp_path, deadline=None, session="t", arch="90")
        names = [g[0] for g in runner.groups(run)]
        assert "openjet concurrent" in names and "llama.cpp concurrent" in names
        assert runner.selected("openjet concurrent", ("openjet concurrent",))
        assert not runner.selected("openjet concurrent", ("openjet=",))
    assert runner.Settings().concurrent_streams == (1, 2, 4, 8) and runner.Settings().latency_prompt_tokens == 12288
    assert runner.Settings.quick_run().concurrent_streams == (1, 8)


# --- llama-server: a stand-in ------------------------------------------------------------------------------

# Answers like llama-server's /completion: plain (every token id, llama.cpp's timings) or streamed
# (one server-sent event per token, tokens_predicted counting). Its tokens follow from the prompt,
# except with FAKE_MODE=crowd (another token while several requests run: output that depends on the
# others) or FAKE_MODE=short (one token fewer than asked).
FAKE_SERVER = """
    import json, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    slots = int(args[args.index("-np") + 1])
    spec = "--spec-draft-n-max" in args
    mode = os.environ.get("FAKE_MODE", "")
    log = os.environ["FAKE_SERVER_LOG"]
    lock = threading.Lock()
    active = [0]

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(200, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                active[0] += 1
                with open(log, "a") as f:
                    f.write(json.dumps({"argv": args, "body": body, "active": active[0]}) + "\\n")
            try:
                self.answer(body)
            finally:
                with lock:
                    active[0] -= 1

        def answer(self, body):
            n = body["n_predict"] - (1 if mode == "short" else 0)
            p = body["prompt"]
            time.sleep(0.05)                       # the prompt; long enough for the others to arrive
            crowd = 1 if mode == "crowd" and active[0] > 1 else 0
            toks = [(sum(p) + 7 * i + crowd) % 4096 for i in range(n)]
            per_token = 0.002 * max(1, active[0]) ** 0.5 + (0.02 * len(p) / 1000 if active[0] > 1 else 0)
            timings = {"prompt_n": len(p), "predicted_n": n, "predicted_ms": 1e3 * per_token * n,
                       "predicted_per_second": (n - 1) / (per_token * n)}
            if spec:
                timings.update(draft_n=2 * n, draft_n_accepted=n)
            if not body.get("stream"):
                time.sleep(per_token * n)
                self.reply(200, {"tokens": toks, "stop_type": "limit", "timings": timings})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(obj):
                data = ("data: " + json.dumps(obj) + "\\n\\n").encode()
                self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
                self.wfile.flush()
            try:
                for i in range(n):
                    time.sleep(per_token)
                    send({"content": "x", "tokens": [toks[i]], "stop": False, "tokens_predicted": i + 1})
                send({"content": "", "tokens": [], "stop": True, "tokens_predicted": n, "timings": timings})
                self.wfile.write(b"0\\r\\n\\r\\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                with open(log, "a") as f:          # the client stopped reading: the request was cut short
                    f.write(json.dumps({"cut_short": body["n_predict"]}) + "\\n")

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _fake_server(folder: Path) -> Path:
    return write_fake_server(folder, FAKE_SERVER)


_log = read_jsonl


def _requests(log: Path) -> list[dict]:
    return [r for r in _log(log) if "body" in r]


def _measure_on(binary: Path, tmp_path: Path, plan: concurrent.Plan, rows, drafts=0, n_vocab=4096, reference=None):
    prompts, longs = plan.prompts(n_vocab)
    got = {}
    command = partial(peer_spec.server_command, binary, tmp_path / "m.gguf", drafts,
                      concurrent.server_context(plan, 8), slots=8)
    with peer_spec.LlamaServer(command, tmp_path / "server.log", load_timeout=30) as server:
        ref = concurrent.measure_server(server, plan, prompts, longs, rows, lambda: 60.0,
                                        lambda m, p, s, d: got.setdefault(report.row_key(m, "llama.cpp", p), (s, d)),
                                        reference, drafts)
    return got, ref, prompts


def test_server_rows_from_the_stand_in(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_LOG", str(tmp_path / "requests.jsonl"))
    binary = _fake_server(tmp_path / "bin")
    plan = concurrent.Plan(**SMALL)
    rows = [r for r in plan.rows() if r[1].get("drafts", 0) == 0]
    got, ref, prompts = _measure_on(binary, tmp_path, plan, rows)
    assert sorted(got) == sorted(report.row_key(m, "llama.cpp", p) for m, p in rows)
    for S in (1, 4):
        samples, d = got[report.row_key("concurrent_tps", "llama.cpp", {"streams": S, "drafts": 0})]
        assert len(samples) == 2 and all(x > 0 for x in samples)
        assert d["streams_differing_from_alone"] == 0 and d["streams_checked"] == 3 * S
        assert d["sequences"] == 8 and d["backend"] == "llama-server" and "-np" in d["command"]
        assert all(x > 0 for x in d["itl_ms_reported_mean"])
    samples, d = got[report.row_key("concurrent_itl_p99_ms", "llama.cpp", {"streams": 3, "prompt_tokens": 128})]
    assert len(samples) == 2 and all(r["streams_outlasted_prompt"] for r in d["runs"])
    reqs = _requests(tmp_path / "requests.jsonl")
    # the prompts are the plan's token ids; N tokens in all per request; streamed for the latency rows
    assert {tuple(r["body"]["prompt"]) for r in reqs} >= {tuple(p) for p in prompts[:4]}
    assert {r["body"]["n_predict"] for r in reqs if not r["body"].get("stream")} >= {8, 1}
    assert any(r["body"].get("stream") for r in reqs) and max(r["active"] for r in reqs) >= 4
    # the long prompt: alone, in the warm-up round, in each timed round, a new one every time
    long_bodies = [r["body"] for r in reqs if len(r["body"]["prompt"]) == 128]
    assert len(long_bodies) == 4 and all(b["n_predict"] == 1 for b in long_bodies)
    assert len({tuple(b["prompt"]) for b in long_bodies}) == 4
    # no request is cut short (the streams with the prompt are sized to outlast it)
    assert not any("cut_short" in r for r in _log(tmp_path / "requests.jsonl"))
    assert d["tokens"] >= 12 and d["warm_up"]["streams_outlasted_prompt"]
    argv = reqs[0]["argv"]
    assert argv[argv.index("-np") + 1] == "8" and "--spec-type" not in argv
    assert int(argv[argv.index("-c") + 1]) >= 8 * (128 + 1)

    # the speculative row: a server with MTP drafts, the plain server's outputs as the reference
    got, _, _ = _measure_on(binary, tmp_path, plan, [("concurrent_tps", {"streams": 4, "drafts": 2})], drafts=2,
                            reference=ref)
    samples, d = got[report.row_key("concurrent_tps", "llama.cpp", {"streams": 4, "drafts": 2})]
    assert d["drafts"] == 2 and d["streams_differing_from_alone"] == 0
    argv = _requests(tmp_path / "requests.jsonl")[-1]["argv"]
    assert "--spec-type" in argv and argv[argv.index("--spec-draft-n-max") + 1] == "2"


def test_server_output_that_changes_with_company_is_caught(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_LOG", str(tmp_path / "requests.jsonl"))
    monkeypatch.setenv("FAKE_MODE", "crowd")
    plan = concurrent.Plan(**SMALL)
    got, _, _ = _measure_on(_fake_server(tmp_path / "bin"), tmp_path, plan,
                            [("concurrent_tps", {"streams": 4, "drafts": 0})])
    _, d = got[report.row_key("concurrent_tps", "llama.cpp", {"streams": 4, "drafts": 0})]
    assert d["streams_differing_from_alone"] == 12 and d["first_difference"] == 0


def test_a_bad_server_response_fails_the_rows_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_LOG", str(tmp_path / "requests.jsonl"))
    monkeypatch.setenv("FAKE_MODE", "short")
    plan = concurrent.Plan(**SMALL)
    with pytest.raises(peer.PeerError, match="7 tokens generated, asked for 8"):
        _measure_on(_fake_server(tmp_path / "bin"), tmp_path, plan, [("concurrent_tps", {"streams": 1, "drafts": 0})])


def _fake_peer_build(tmp_path: Path) -> peer.PeerBuild:
    pb = peer.PeerBuild(tmp_path / "llama.cpp-fake")
    pb.binary.parent.mkdir(parents=True)
    pb.binary.write_text("")
    pb.ok_marker.write_text("1\n")
    _fake_server(pb.binary.parent)
    return pb


def test_the_peer_group_stores_rows_and_a_bad_server_costs_its_rows_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_LOG", str(tmp_path / "requests.jsonl"))
    s = runner.Settings(reps=1, concurrent_streams=(1, 2), concurrent_tokens=6, concurrent_prompt_tokens=8,
                        concurrent_drafts=2, latency_streams=2, latency_prompt_tokens=64, latency_tokens=8)
    st = Store(tmp_path / "r", {"x": 1})
    run = runner.Run(settings=s, store=st, model=DEFAULT_GGUF, cache=tmp_path, deadline=None, session="t",
                     arch="90", peer_build=_fake_peer_build(tmp_path))
    runner.group_peer_concurrent(run)
    have = {report.row_key(r["metric"], r["engine"], r["params"]) for r in st.records()}
    assert have == {report.row_key(*r) for r in runner.concurrent_rows(s, "llama.cpp")}
    assert all(st.info["spec_details"][k]["sequences"] == 8 for k in have)
    n = len(_requests(tmp_path / "requests.jsonl"))
    runner.group_peer_concurrent(run)                    # resumed: no server, no request
    assert len(_requests(tmp_path / "requests.jsonl")) == n

    # a server whose responses are wrong: its rows say why, the run goes on
    monkeypatch.setenv("FAKE_MODE", "short")
    run = runner.Run(settings=s, store=Store(tmp_path / "r2", {"x": 1}), model=DEFAULT_GGUF, cache=tmp_path,
                     deadline=None, session="t2", arch="90", peer_build=_fake_peer_build(tmp_path / "b2"),
                     only=("llama.cpp concurrent",))
    runner.run_groups(run)
    reasons = {run.not_measured[report.row_key(*r)] for r in runner.concurrent_rows(s, "llama.cpp")}
    assert len(reasons) == 1 and reasons.pop().startswith("llama.cpp concurrent failed: llama-server (concurrent")
    assert run.not_measured[report.row_key("concurrent_tps", "openjet", {"streams": 1, "drafts": 0})] == \
        runner.NOT_SELECTED


# --- the report --------------------------------------------------------------------------------------------

def test_markdown_concurrent_section_has_ratios_sequences_and_reasons():
    rows, details = [], {}
    for eng, one, eight in (("openjet", 50.0, 60.0), ("llama.cpp", 40.0, 200.0)):
        rows += [report.result("concurrent_tps", eng, {"streams": 1, "drafts": 0}, [one] * 3),
                 report.result("concurrent_tps", eng, {"streams": 8, "drafts": 0}, [eight] * 3),
                 report.result("concurrent_itl_p99_ms", eng, {"streams": 7, "prompt_tokens": 0}, [10.0] * 3)]
        for S in (1, 8):
            details[report.row_key("concurrent_tps", eng, {"streams": S, "drafts": 0})] = {
                "sequences": 1 if eng == "openjet" else 8, "backend": "native" if eng == "openjet" else "llama-server",
                "streams_checked": 3 * S, "streams_differing_from_alone": 2 if (eng, S) == ("llama.cpp", 8) else 0,
                "first_difference": 5}
    rows += [report.result("concurrent_tps", "llama.cpp", {"streams": 8, "drafts": 3}, [150.0] * 3),
             report.result("concurrent_itl_p99_ms", "llama.cpp", {"streams": 7, "prompt_tokens": 12288}, [45.0] * 3)]
    details[report.row_key("concurrent_itl_p99_ms", "llama.cpp", {"streams": 7, "prompt_tokens": 12288})] = {
        "runs": [{"streams_outlasted_prompt": True, "prompt_sent_s": 1.0, "prompt_returned_s": 4.0},
                 {"streams_outlasted_prompt": False, "prompt_sent_s": 1.0, "prompt_returned_s": 3.0}],
        "prompt_alone_s": 1.0}
    man = {"info": {report.DETAILS_KEY: details}, "not_measured": [
        {"metric": "concurrent_tps", "engine": "openjet", "params": {"streams": 8, "drafts": 3},
         "reason": "the engine refuses speculation with 8 slots: boom"},
        {"metric": "concurrent_itl_p99_ms", "engine": "openjet", "params": {"streams": 7, "prompt_tokens": 12288},
         "reason": "the engine serves 1 sequence(s) at once on the native backend; 7 streams and a prompt need 8"}]}
    rep = {"manifest": man, "results": rows}
    report.validate_report(rep)
    md = report.markdown(rep)
    main_table = md[md.index("| metric |"):md.index("## Concurrent streams")]
    assert "concurrent" not in main_table                          # its own tables only
    section = md[md.index("## Concurrent streams"):]
    lines = [x for x in section.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| streams | D | openjet tokens/s | × base | sequences | = alone")
    assert lines[1] == "| 1 | 0 | 50.00 [50.00, 50.00] |  | 1 (native) | yes | 40.00 [40.00, 40.00] |  | yes | 1.25× |"
    # 8 streams over 1 stream of the same engine; the streams that differ from their request alone
    assert lines[2] == ("| 8 | 0 | 60.00 [60.00, 60.00] | 1.20× | 1 (native) | yes | 200.0 [200.0, 200.0] | 5.00× "
                        "| 22 of 24 (first difference at token 5) | 0.30× |")
    # speculation over the plain row of as many streams; ours not measured, with the reason
    assert lines[3] == "| 8 | 3 | not measured (1) |  |  |  | 150.0 [150.0, 150.0] | 0.75× |  |  |"
    assert lines[5] == "| 7 | 0 | 10.00 [10.00, 10.00] |  |  |  | 10.00 [10.00, 10.00] |  |  |  |"
    # the prompt's request among the streams: 3 s and 2 s against 1 s alone
    assert lines[6] == "| 7 | 12288 | not measured (2) |  |  |  | 45.00 [45.00, 45.00] | 4.50× | 1 of 2 | 2.5× |"
    assert "(1) the engine refuses speculation with 8 slots: boom" in md
    assert "(2) the engine serves 1 sequence(s) at once on the native backend" in md


def test_markdown_says_what_a_prompt_piece_costs_the_decoders():
    params = {"streams": 7, "prompt_tokens": 12288}
    rows = [report.result("concurrent_itl_p99_ms", "openjet", {"streams": 7, "prompt_tokens": 0}, [22.0] * 3),
            report.result("concurrent_itl_p99_ms", "openjet", params, [78.0] * 3)]
    mixed = [{"passes": n, "prompt_tokens_median": 64, "ms_median": ms, "ms_max": ms + 9, "decode_steps_median": 7,
              "decode_only_ms_median": 14.2} for n, ms in ((190, 66.0), (191, 65.5), (189, 67.0))]
    details = {report.row_key("concurrent_itl_p99_ms", "openjet", params): {
        "runs": [{"streams_outlasted_prompt": True, "prompt_sent_s": 0.5, "prompt_returned_s": 13.5, "mixed_passes": m}
                 for m in mixed], "prompt_alone_s": 2.2}}
    rep = {"manifest": {"info": {report.DETAILS_KEY: details}, "not_measured": []}, "results": rows}
    report.validate_report(rep)
    md = report.markdown(rep)
    assert ("openjet, 7 streams and a 12,288-token prompt: 191 passes with prompt tokens in a run, a median 64 "
            "tokens next to 7 decode steps in 65.5 ms (at most 74.5), where the decode-only pass of as many steps "
            "takes 14.2 ms.") in md


def test_markdown_splits_the_gap_between_the_most_streams_passes():
    """The plain row of the most streams: the round of median gap, and where the trace has it, the
    gap's part until the last step was handed in and the part after (the scheduler); none without a
    trace."""
    params = {"streams": 8, "drafts": 0}
    rows = [report.result("concurrent_tps", "openjet", {"streams": 1, "drafts": 0}, [95.0] * 3),
            report.result("concurrent_tps", "openjet", params, [458.0] * 3)]
    occ = [{"passes": 128, "busy_share": 0.8371, "gap_ms_median": g, "decode_pass_ms_median": 14.4,
            "steps_in_ms_median": round(g - 0.3, 3), "composing_ms_median": 0.3} for g in (2.9, 2.64, 2.5)]
    details = {report.row_key("concurrent_tps", "openjet", params): {"pass_occupancy": occ}}
    rep = {"manifest": {"info": {report.DETAILS_KEY: details}, "not_measured": []}, "results": rows}
    report.validate_report(rep)
    assert ("openjet, 8 streams: the backend busy 84% of a round, a decode pass of 14.4 ms and 2.64 ms between "
            "passes (medians; of the gap, 2.34 ms until the last step was handed in and 0.3 ms from then to the "
            "pass's start).") in report.markdown(rep)
    for o in occ:                            # an older trace: the gap whole
        del o["steps_in_ms_median"], o["composing_ms_median"]
    assert "2.64 ms between passes (medians)." in report.markdown(rep)
    details.clear()
    assert "streams: the backend busy" not in report.markdown(rep)


# --- the real llama-server, where a build exists -------------------------------------------------------------

def _built_server() -> Path | None:
    env = os.environ.get("OPENJET_LLAMA_SERVER")
    if env:
        return Path(env)
    found = sorted(list(REPO.glob("build/cache/bench*/llama.cpp-*/build/bin/llama-server"))
                   + list(REPO.glob(".cache/bench*/llama.cpp-*/build/bin/llama-server")))
    return found[0] if found else None


@pytest.mark.slow
@pytest.mark.skipif(_built_server() is None, reason="no llama-server built (build/cache/bench*/ or .cache/bench*/: "
                    "python -m openjet_plugin.bench.peer build --archs cpu ..., or set OPENJET_LLAMA_SERVER)")
def test_real_llama_server_serves_concurrent_streams_identical_to_alone(tmp_path):
    """The pinned llama-server (a CPU build) with 8 slots on the default model: concurrent plain
    rows and the latency rows, every stream identical to its request alone."""
    from openjet_plugin.model_file import open_model

    with open_model(DEFAULT_GGUF) as mf:
        n_vocab = mf.config.n_vocab
    plan = concurrent.Plan(**SMALL)
    rows = [r for r in plan.rows() if r[1].get("drafts", 0) == 0]
    prompts, longs = plan.prompts(n_vocab)
    got = {}
    command = partial(peer_spec.server_command, _built_server(), DEFAULT_GGUF, 0, concurrent.server_context(plan, 8),
                      slots=8)
    with peer_spec.LlamaServer(command, tmp_path / "server.log", load_timeout=120) as server:
        concurrent.measure_server(server, plan, prompts, longs, rows, lambda: 120.0,
                                  lambda m, p, s, d: got.setdefault((m, json.dumps(p, sort_keys=True)), (s, d)))
    for S in (1, 4):
        samples, d = got[("concurrent_tps", json.dumps({"drafts": 0, "streams": S}))]
        assert all(x > 0 for x in samples) and d["streams_differing_from_alone"] == 0, d
    samples, d = got[("concurrent_itl_p99_ms", json.dumps({"prompt_tokens": 128, "streams": 3}))]
    assert all(x > 0 for x in samples) and len(d["runs"]) == 2


def test_a_round_the_prompt_outlasted_runs_again_longer_on_a_spare_prompt(monkeypatch):
    """measure_latency: a timed round whose streams ended before the long prompt returned (a loaded
    host) is not kept; it runs again with longer streams on the next spare long prompt (never the
    same one: the prefix cache would serve it), and the details keep the round redone."""
    plan = concurrent.Plan(**SMALL)
    prompts, longs = plan.prompts(1000)
    seen = []

    def fake_round(client, ps, n, long, lead):
        seen.append((n, None if long is None else tuple(long)))
        run = {"p99_ms": 1.0, "median_ms": 1.0, "tokens": n, "gaps": 3, "tokens_sharing_a_gap": 0, "seconds": 1.0}
        if long is not None:
            short = tuple(long) == tuple(longs[2]) and n < 100      # the first timed round comes up short
            run.update(prompt_sent_s=1.0, prompt_returned_s=1.05, streams_outlasted_prompt=not short,
                       tokens_during_prompt=2)
        return run, [1.0, 1.0, 1.0]

    monkeypatch.setattr(concurrent, "latency_round", fake_round)
    client = SimpleNamespace(run=lambda *a, **k: None)
    out = concurrent.measure_latency(client, prompts[:3], longs, plan.latency_tokens, plan.reps)
    samples, d = out[len(longs[0])]
    assert len(samples) == 2 and all(r["streams_outlasted_prompt"] for r in d["runs"])
    assert len(d["rounds_redone_longer"]) == 1 and not d["rounds_redone_longer"][0]["streams_outlasted_prompt"]
    timed = [(n, lp) for n, lp in seen if lp is not None][1:]      # after the warm-up round's
    assert [lp for _, lp in timed] == [tuple(longs[2]), tuple(longs[4]), tuple(longs[3])]
    assert timed[1][0] >= 2 * timed[0][0] and d["tokens"] == timed[1][0]


def test_ours_on_the_native_sequences_serves_the_streams_together(tmp_path, monkeypatch):
    """run_ours on the native backend over tests/test_native_sequences.py's fake engine of
    sequences: the rate rows run S streams on S sequences (passes shared, every stream equal to
    its prompt alone), the latency rows on streams + 1, and the speculative row says why not."""
    from test_native_bookkeeping import install_fake
    from test_native_sequences import SeqFakeLib

    libs = install_fake(monkeypatch, SeqFakeLib)
    out = tmp_path / "rows.jsonl"
    concurrent.run_ours(str(DEFAULT_GGUF), concurrent.Plan(**SMALL), "native", Emitter(out), lambda: math.inf)
    recs = _records(out)
    details = {}
    for r in recs:
        details.update(r.get("info", {}).get("spec_details", {}))
    assert not [r for r in recs if "error" in r], recs
    for S in (1, 4):
        d = details[report.row_key("concurrent_tps", "openjet", {"streams": S, "drafts": 0})]
        assert d["backend"] == "native" and d["sequences"] == S and d["streams_differing_from_alone"] == 0
        if S > 1:
            assert d["max_sequences_in_a_pass"] >= 3 and d["shared_passes"] > 0, d
            occ = d["pass_occupancy"]           # every timed round's passes, accounted
            assert len(occ) == 2 and all(o["passes"] >= 8 and 0 < o["busy_share"] <= 1 for o in occ), occ
            assert max(map(int, d["decode_pass_ms"])) >= 2, d
        else:
            assert "max_sequences_in_a_pass" not in d           # one sequence: no scheduler
    for L in (0, 128):
        d = details[report.row_key("concurrent_itl_p99_ms", "openjet", {"streams": 3, "prompt_tokens": L})]
        assert d["sequences"] == 4 and d["max_sequences_in_a_pass"] >= 3
        for run in d["runs"]:   # the slow gaps' time, accounted for in full by the pass trace
            b = run["slow_gaps"]
            parts = b["decode_pass_ms"] + b["mixed_pass_ms"] + b["waiting_for_backend_ms"] + b["between_passes_ms"]
            assert b["slow_gaps"] >= 0 and abs(parts - b["ms"]) < 0.01 * max(b["ms"], 1), b
    # the engines loaded (native_status's own library loads made none): rows 1, 4, the latency rows, the speculative
    assert [lib.created[-1]["n_seq"] for lib in libs if lib.created] == [1, 4, 4, 4]
    skips = [r for r in recs if "skip" in r]
    assert [s["skip"]["params"] for s in skips] == [{"streams": 4, "drafts": 2}]
    assert "speculates only for a request served alone: 4 concurrent streams" in skips[0]["reason"]
