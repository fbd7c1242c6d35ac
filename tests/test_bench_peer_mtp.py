"""llama.cpp's MTP speculation rows (bench/peer_spec.py): the server's command line and request, its
response read, the machinery against a stand-in server, the runner's group and the spec-vs-spec
table. No llama.cpp is built here; one test runs the real llama-server where a build exists."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest

from openjet_plugin.bench import peer, peer_spec, report, runner
from openjet_plugin.bench.spec import prompt_tokens
from openjet_plugin.bench.store import Store

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = REPO / "openjet_plugin" / "data" / "default.gguf"

# One /completion response of the pinned llama-server (a CPU build, default.gguf, D = 2, depth 64:
# prompt_tokens(4096, 65), 16 + 1 tokens), trimmed to the keys we read and a few beside them.
RECORDED_COMPLETION = {
    "tokens": [35, 399, 2667, 292, 1356, 44, 1057, 3300, 3849, 95, 3920, 351, 292, 1100, 383, 292, 1186],
    "stop_type": "limit", "tokens_predicted": 17, "tokens_evaluated": 65,
    "timings": {"cache_n": 0, "prompt_n": 65, "prompt_ms": 463.88, "prompt_per_token_ms": 7.136615384615385,
                "prompt_per_second": 140.12244546003276, "predicted_n": 17, "predicted_ms": 931.034,
                "predicted_per_token_ms": 58.189625, "predicted_per_second": 17.185194096026567,
                "draft_n": 24, "draft_n_accepted": 4},
}


# --- command line, request, response ---------------------------------------------------------------

def test_server_command_is_one_greedy_slot_with_mtp_drafts():
    cmd = peer_spec.server_command(Path("/b/llama-server"), Path("/m.gguf"), 3, 40000, 8123)
    s = " ".join(cmd)
    assert cmd[0] == "/b/llama-server" and "-m /m.gguf" in s and "--port 8123" in s and "-c 40000" in s
    for flag in ("-np 1", "-fa on", "-ngl 999", "--spec-type draft-mtp", "--spec-draft-n-max 3",
                 "--spec-draft-p-min 0", "--cache-ram 0", "--host 127.0.0.1"):
        assert flag in s, flag


def test_request_sends_token_ids_and_asks_one_token_more():
    body = peer_spec.completion_request([5, 7, 11], 32)
    assert body["prompt"] == [5, 7, 11]                  # ids, not text: nothing re-tokenized
    assert body["n_predict"] == 33                       # the first token is free (from the prompt)
    assert body["temperature"] == 0.0 and body["cache_prompt"] is False and body["ignore_eos"] is True
    assert body["stream"] is False


def test_parse_completion_reads_llamas_own_timings():
    c = peer_spec.parse_completion(RECORDED_COMPLETION, 16)
    assert c.predicted_n == 17 and c.draft_n == 24 and c.draft_n_accepted == 4 and len(c.tokens) == 17
    assert c.prompt_n == 65 and c.cache_n == 0
    # predicted_per_second is (predicted_n - 1) / predicted_ms: the 16 tokens after the first
    assert c.tokens_per_second == pytest.approx(16 / 931.034e-3, rel=1e-9)


@pytest.mark.parametrize("change, needle", [
    (lambda r: r.pop("timings"), "no timings"),
    (lambda r: r["timings"].pop("predicted_per_second"), "predicted_per_second"),
    (lambda r: r["timings"].update(predicted_n=9), "9 tokens generated, asked for 17"),
    (lambda r: [r["timings"].pop("draft_n"), r["timings"].pop("draft_n_accepted")], "drafted nothing"),
    (lambda r: r["timings"].update(predicted_ms=0.0), "non-positive"),
])
def test_parse_completion_errors_name_the_problem(change, needle):
    r = json.loads(json.dumps(RECORDED_COMPLETION))
    change(r)
    with pytest.raises(peer.PeerError, match=needle):
        peer_spec.parse_completion(r, 16)


def test_row_details_pool_acceptance_over_repetitions():
    C = peer_spec.Completion
    runs = [C(100.0, 17, 160.0, 16, 8, (1, 2, 5), 4, 61), C(110.0, 17, 150.0, 14, 14, (1, 2, 5), 4, 61),
            C(90.0, 17, 170.0, 10, 0, (1, 3, 5), 4, 61)]
    d = peer_spec.row_details(runs, 16, 3, 3)
    assert d["acceptance"] == round(22 / 40, 4) and d["acceptance_per_rep"] == [0.5, 1.0, 0.0]
    assert d["drafts_proposed"] == 40 and d["drafts_accepted"] == 22 and d["prompt_tokens_processed"] == [4] * 3
    assert d["reps_differing_from_first"] == 1 and d["is_llama_cpp_default"] and d["reps"] == 3


def test_shared_prompt_tokens_have_the_same_prefix_at_every_length():
    long = prompt_tokens(1000, 9000)
    assert prompt_tokens(1000, 5000) == long[:5000] and prompt_tokens(1000, 1) == long[:1]
    assert prompt_tokens(1000, 0) == [] and all(0 <= t < 1000 for t in long)
    assert len(set(long[:4096]) & set(range(1000))) > 900 and long[:10] != long[4096:4106]


def _llama_src() -> Path | None:
    """The vendored llama.cpp of the pinned sdist, unpacked by a peer build or by hand."""
    for p in sorted(REPO.glob(".cache/bench*/llama.cpp-*/src/vendor/llama.cpp")) + [Path("/opt/llama-src/vendor/llama.cpp")]:
        if (p / "tools" / "server" / "server-common.cpp").is_file():
            return p
    return None


def test_what_we_read_and_pass_exists_in_the_pinned_source(tmp_path):
    """The response fields, the options and the default D are those of the pinned llama.cpp."""
    src = _llama_src()
    if src is None:
        pytest.skip("no unpacked llama.cpp source (a peer build's src/, or /opt/llama-src)")
    server = (src / "tools" / "server" / "server-common.cpp").read_text()
    for f in ("predicted_n", "predicted_ms", "predicted_per_second", "draft_n", "draft_n_accepted"):
        assert f'"{f}"' in server, f
    stats = (src / "tools" / "server" / "server-common.h").read_text()
    assert "1e3 / t_ms * n_gen_steps()" in stats and "n_gen > 0 ? n_gen - 1 : 0" in stats
    schema = (src / "tools" / "server" / "server-schema.cpp").read_text()
    for f in ("cache_prompt", "ignore_eos", "return_tokens"):
        assert f'"{f}"' in schema, f
    args = (src / "common" / "arg.cpp").read_text()
    for flag in ("--spec-type", "--spec-draft-n-max", "--spec-draft-p-min", "--cache-ram", "--no-webui", "--fit"):
        assert f'"{flag}"' in args, flag
    assert '"draft-mtp"' in (src / "common" / "speculative.cpp").read_text()
    assert peer_spec.default_draft_max(src) == 3
    assert 3 in runner.Settings().drafts and 3 in runner.Settings.quick_run().drafts   # its default is a row
    assert peer.server_source_problem(src) is None
    assert peer_spec.default_draft_max(tmp_path) is None


# --- the machinery against a stand-in llama-server ------------------------------------------------------

FAKE_SERVER = """
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    D = int(args[args.index("--spec-draft-n-max") + 1])
    log = __import__("os").environ["FAKE_SERVER_LOG"]
    t0 = time.time()

    class H(BaseHTTPRequestHandler):
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
            # loading for the first 0.3 s, as the real one answers 503 while it loads
            self.reply(200 if time.time() - t0 > 0.3 else 503, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(log, "a") as f:
                f.write(json.dumps({"D": D, "argv": args, "body": body}) + "\\n")
            n = body["n_predict"]
            ms = 10.0 * (len(body["prompt"]) + n) / D
            self.reply(200, {"tokens": list(range(n)), "stop_type": "limit", "timings": {
                "predicted_n": n, "predicted_ms": ms, "predicted_per_second": 1e3 * (n - 1) / ms,
                "draft_n": 2 * n, "draft_n_accepted": n}})

    HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def write_fake_server(folder: Path, source: str = FAKE_SERVER) -> Path:
    """An executable llama-server in folder that runs `source` (a stand-in's Python code)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(source))
    script.chmod(0o755)
    return script


def read_jsonl(log: Path) -> list[dict]:
    """The records a stand-in server logged, one JSON object a line ([] before the first)."""
    return [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []



def test_measure_warms_up_then_times_each_depth(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_LOG", str(tmp_path / "requests.jsonl"))
    binary = write_fake_server(tmp_path / "bin")
    rows = []
    command = partial(peer_spec.server_command, binary, tmp_path / "m.gguf", 2, 4096)
    with peer_spec.LlamaServer(command, tmp_path / "server.log", load_timeout=30) as server:
        peer_spec.measure(server, {0: [9], 64: list(range(65))}, 16, 3, lambda: 30.0,
                          lambda depth, samples, runs: rows.append((depth, samples, runs)))
        proc = server.proc
    assert proc.poll() is not None                       # stopped on the way out
    assert [r[0] for r in rows] == [0, 64] and all(len(r[1]) == 3 for r in rows)
    assert rows[1][1][0] == pytest.approx(1e3 * 16 / (10.0 * (65 + 17) / 2))
    reqs = read_jsonl(tmp_path / "requests.jsonl")
    # per depth: a warm-up of WARMUP_TOKENS + 1, then three of 16 + 1, all with the depth's ids
    assert [r["body"]["n_predict"] for r in reqs] == [peer_spec.WARMUP_TOKENS + 1] + [17] * 3 + \
        [peer_spec.WARMUP_TOKENS + 1] + [17] * 3
    assert [len(r["body"]["prompt"]) for r in reqs] == [1] * 4 + [65] * 4
    assert not any(r["body"]["cache_prompt"] for r in reqs)   # every request from a fresh state
    with pytest.raises(ValueError, match="65 tokens, not 9"):
        with peer_spec.LlamaServer(command, tmp_path / "server.log", load_timeout=30) as server:
            peer_spec.measure(server, {8: list(range(65))}, 16, 1, lambda: 30.0, lambda *a: None)


def test_a_server_that_dies_while_loading_says_why(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\nimport sys\nprint('error: unknown argument: --spec-type')\nsys.exit(1)\n")
    script.chmod(0o755)
    command = partial(peer_spec.server_command, script, tmp_path / "m.gguf", 2, 4096)
    with pytest.raises(peer.PeerError, match="exited 1 while loading(.|\n)*unknown argument"):
        with peer_spec.LlamaServer(command, tmp_path / "server.log", load_timeout=30):
            pass


def _fake_peer_build(tmp_path: Path, server_ok: bool = True) -> peer.PeerBuild:
    pb = peer.PeerBuild(tmp_path / "llama.cpp-fake")
    pb.binary.parent.mkdir(parents=True)
    pb.binary.write_text("")
    pb.ok_marker.write_text("1\n")
    common = pb.llama_src / "common"
    common.mkdir(parents=True)
    (common / "common.h").write_text("struct common_params_speculative_draft {\n"
                                     "    int32_t n_max = 3; // maximum number of tokens to draft\n};\n")
    if server_ok:
        write_fake_server(pb.binary.parent)
    else:
        pb.server_failed_marker.write_text("exit 1: tools/server/server.cpp:1: error: boom\n")
    return pb


def test_the_spec_group_stores_rows_with_acceptance_from_the_shared_tokens(tmp_path, monkeypatch):
    from openjet_plugin.model_file import open_model
    from openjet_plugin.testing.synth import synth_model

    model = synth_model(tmp_path / "tiny.gguf", preset="tiny", quant="F32", seed=1)
    with open_model(model) as mf:
        n_vocab = mf.config.n_vocab
    monkeypatch.setenv("FAKE_SERVER_LOG", str(tmp_path / "requests.jsonl"))
    pb = _fake_peer_build(tmp_path)
    s = runner.Settings(depths=(0, 96), reps=3, decode_tokens=12)
    st = Store(tmp_path / "r", {"x": 1})
    run = runner.Run(settings=s, store=st, model=model, cache=tmp_path, deadline=None, session="t",
                     arch="90", peer_build=pb)
    runner.group_peer_spec(run, 2)
    recs = {report.row_key(r["metric"], r["engine"], r["params"]): r for r in st.records()}
    want = [report.row_key("spec_mtp_tps", "llama.cpp", {"drafts": 2, "depth": d}) for d in (0, 96)]
    assert sorted(recs) == sorted(want) and all(len(recs[k]["samples"]) == 3 for k in want)
    details = st.info["spec_details"]
    assert details[want[0]]["acceptance"] == 0.5 and details[want[0]]["llama_cpp_default_drafts"] == 3
    assert st.info["llama_server"]["default_drafts"] == 3
    assert "--spec-draft-n-max" in st.info["llama_server"]["command"]
    reqs = read_jsonl(tmp_path / "requests.jsonl")
    tokens = prompt_tokens(n_vocab, 97)
    assert {tuple(r["body"]["prompt"]) for r in reqs} == {tuple(tokens[:1]), tuple(tokens[:97])}
    assert all(r["D"] == 2 for r in reqs)
    argv = reqs[0]["argv"]
    assert int(argv[argv.index("-c") + 1]) >= 96 + 1 + 12 + 1 + 2
    runner.group_peer_spec(run, 2)                        # resumed: nothing left to do, no server
    assert len(read_jsonl(tmp_path / "requests.jsonl")) == len(reqs)


def test_a_server_that_failed_to_build_costs_the_spec_rows_only(tmp_path):
    pb = _fake_peer_build(tmp_path, server_ok=False)
    s = runner.Settings(depths=(0,), reps=1, drafts=(1,))
    run = runner.Run(settings=s, store=Store(tmp_path / "r", {"x": 1}), model=tmp_path / "m.gguf", cache=tmp_path,
                     deadline=None, session="t", arch="90", peer_build=pb)
    with pytest.raises(peer.PeerError, match="llama-server failed to build: exit 1: .*error: boom"):
        runner.group_peer_spec(run, 1)


def test_plan_and_groups_have_both_engines_mtp_rows_at_every_depth(tmp_path):
    for s in (runner.Settings(), runner.Settings.quick_run()):
        planned, _ = runner.plan(s)
        for eng in ("openjet", "llama.cpp"):
            got = sorted((r[2]["depth"], r[2]["drafts"]) for r in planned if r[0] == "spec_mtp_tps" and r[1] == eng)
            drafts = s.drafts if eng == "llama.cpp" else runner.our_chain_drafts(s)   # ours: + D = B - 1 of trees
            assert got == sorted((d, D) for d in s.depths for D in drafts), eng
        run = runner.Run(settings=s, store=Store(tmp_path / f"r{s.quick}", {"x": 1}), model=tmp_path / "m.gguf",
                         cache=tmp_path, deadline=None, session="t", arch="90")
        groups = runner.groups(run)
        spec = [g for g in groups if g[0].startswith("llama.cpp spec")]
        assert [g[0] for g in spec] == [f"llama.cpp spec D={D}" for D in s.drafts]
        assert all(runner.selected(g[0], ("llama.cpp spec",)) for g in spec)
    assert runner.Settings().depths == (0, 8192, 30720) and runner.Settings.quick_run().depths == (0, 8192)


def test_peer_cmake_options_build_the_server_without_network_or_cuda_on_cpu():
    cuda = peer.cmake_options("90")
    assert "-DLLAMA_BUILD_SERVER=ON" in cuda and "-DLLAMA_USE_PREBUILT_UI=OFF" in cuda
    assert "-DGGML_CUDA=ON" in cuda and "-DCMAKE_CUDA_ARCHITECTURES=90" in cuda
    cpu = peer.cmake_options(peer.CPU_ARCHS)
    assert "-DGGML_CUDA=OFF" in cpu and not any("CUDA_ARCHITECTURES" in o for o in cpu)


# --- the spec-vs-spec table -----------------------------------------------------------------------------

def test_markdown_spec_vs_spec_table_has_both_acceptances_and_the_ratio():
    rows, details = [], {}
    for depth in (0, 8192):
        rows += [report.result("decode_tps", "openjet", {"depth": depth}, [100.0] * 6),
                 report.result("decode_tps", "llama.cpp", {"depth": depth}, [80.0] * 6)]
        for D in (1, 3):
            p = {"drafts": D, "depth": depth}
            rows += [report.result("spec_mtp_tps", "openjet", p, [200.0 + D] * 6)]
            details[report.row_key("spec_mtp_tps", "openjet", p)] = {"drafts_proposed": 100, "drafts_accepted": 90}
            if (depth, D) != (8192, 3):
                rows += [report.result("spec_mtp_tps", "llama.cpp", p, [100.0] * 6)]
                details[report.row_key("spec_mtp_tps", "llama.cpp", p)] = {
                    "drafts_proposed": 50, "drafts_accepted": 40, "llama_cpp_default_drafts": 3, "reps": 6,
                    "reps_differing_from_first": 2 if D == 1 else 0}
    man = {"info": {report.DETAILS_KEY: details},
           "not_measured": [{"metric": "spec_mtp_tps", "engine": "llama.cpp", "params": {"drafts": 3, "depth": 8192},
                             "reason": "llama.cpp spec D=3 failed: boom"}]}
    rep = {"manifest": man, "results": rows}
    report.validate_report(rep)
    md = report.markdown(rep)
    section = md[md.index("## MTP speculation, openjet against llama.cpp"):]
    lines = [x for x in section.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| depth | D | openjet tokens/s | openjet acceptance | llama.cpp tokens/s")
    assert lines[1] == ("| 0 | 1 | 201.0 [201.0, 201.0] | 90.0% | 100.0 [100.0, 100.0] | 80.0% | 2.01× | 2.01× "
                        "| 1.25× |")
    assert lines[2].startswith("| 0 | 3 * |")                       # llama.cpp's default D is marked
    assert "not measured (1)" in lines[4] and lines[4].startswith("| 8192 | 3 * | 203")
    assert "(1) llama.cpp spec D=3 failed: boom" in md
    assert "- llama.cpp, depth 8192, D 1: 2 of 6 repetitions generated other tokens than the first" in section
    assert "depth 0, D 3:" not in section
    assert "(--model, or --mtp-accuracy none)" in section          # the random head is called what it is
    man["model"] = {"mtp_accuracy": 0.75}
    section = report.markdown(rep)
    assert "made to be right after 75% of the tokens" in section[section.index("## MTP speculation"):]


# --- the real llama-server, where a build exists -----------------------------------------------------------

def _built_server() -> Path | None:
    env = os.environ.get("OPENJET_LLAMA_SERVER")
    if env:
        return Path(env)
    found = sorted(REPO.glob(".cache/bench*/llama.cpp-*/build/bin/llama-server"))
    return found[0] if found else None


@pytest.mark.slow
@pytest.mark.skipif(_built_server() is None, reason="no llama-server built (python -m openjet_plugin.bench.peer "
                    "build --archs cpu --cache .cache/bench-cpu ..., or set OPENJET_LLAMA_SERVER)")
def test_real_llama_server_drafts_with_the_default_models_mtp_head(tmp_path):
    """The pinned llama-server (a CPU build is enough) on the shipped default model, whose MTP head
    is trained: rows come out with tokens/s and an acceptance well above chance."""
    from openjet_plugin.model_file import open_model

    binary = _built_server()
    rows = []
    with open_model(DEFAULT_GGUF) as mf:
        tokens = prompt_tokens(mf.config.n_vocab, 257)
    command = partial(peer_spec.server_command, binary, DEFAULT_GGUF, 2, 1024)
    with peer_spec.LlamaServer(command, tmp_path / "server.log", load_timeout=120) as server:
        peer_spec.measure(server, {0: tokens[:1], 256: tokens[:257]}, 16, 2, lambda: 120.0,
                          lambda depth, samples, runs: rows.append((depth, samples, runs)))
    assert [r[0] for r in rows] == [0, 256]
    for depth, samples, runs in rows:
        d = peer_spec.row_details(runs, 16, 2, 3)
        assert all(x > 0 for x in samples) and d["drafts_proposed"] > 0, (depth, d)
        assert 0.0 <= d["acceptance"] <= 1.0 and d["reps_differing_from_first"] == 0
        # every repetition processed the whole prompt: the same fresh state, the same drafts
        assert d["prompt_tokens_processed"] == [depth + 1] * 2 and len(set(d["acceptance_per_rep"])) == 1, d
