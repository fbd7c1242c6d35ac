"""`openjet bench` on a machine without a GPU: aggregation, the report's shape, llama-bench's JSON,
the roofline's byte count, the manifest, the resume folder, and the no-GPU exit."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from openjet_plugin.bench import manifest, peer, report, roofline, runner, smi, stats
from openjet_plugin.bench.store import ResumeMismatch, Store

from cuda_tools import find_nvcc

REPO = Path(__file__).resolve().parents[1]


# --- helpers ----------------------------------------------------------------------------------------

def _fake_smi(folder: Path, *, fail: bool = False) -> Path:
    """An nvidia-smi stand-in: with fail=True it answers like a machine whose driver is missing;
    otherwise like an H200 (tests of everything that only reads nvidia-smi)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    if fail:
        body = """
            print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                  "Make sure that the latest NVIDIA driver is installed and running.")
            sys.exit(9)
        """
    else:
        body = """
            args = sys.argv[1:]
            vals = {"name": "Fake H200", "compute_cap": "9.0", "driver_version": "580.1",
                    "memory.total": "143771 MiB", "clocks.sm": "1980 MHz", "power.limit": "700.00 W"}
            if "-L" in args:
                print("GPU 0: Fake H200 (UUID: GPU-0000)"); sys.exit(0)
            q = [a for a in args if a.startswith("--query-gpu=")]
            if q:
                fields = q[0].split("=", 1)[1].split(",")
                if "nounits" in " ".join(args):        # memory.used: 1000 MiB first, 5000 after
                    import pathlib
                    counter = pathlib.Path(__file__).with_name("calls")
                    i = int(counter.read_text()) if counter.exists() else 0
                    counter.write_text(str(i + 1))
                    print(", ".join("1000" if i == 0 else "5000" for f in fields))
                else:
                    print(", ".join(vals.get(f, "[N/A]") for f in fields))
                sys.exit(0)
            print("| NVIDIA-SMI 580.1   Driver Version: 580.1   CUDA Version: 13.0 |")
        """
    script.write_text(f"#!{sys.executable}\nimport sys\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from openjet_plugin.testing.synth import synth_model

    path = tmp_path_factory.mktemp("bench_model") / "tiny-f32.gguf"
    return synth_model(path, preset="tiny", quant="F32", seed=1)


# --- stats: the numbers can be recomputed from the samples ----------------------------------------

def _coverage_scipy(n: int, k: int) -> float:
    from scipy.stats import binom
    return float(binom.cdf(n - k, n, 0.5) - binom.cdf(k - 1, n, 0.5))


@pytest.mark.parametrize("n", list(range(1, 26)))
def test_median_interval_is_the_order_statistic_95_interval(n):
    rng = random.Random(n)
    xs = [rng.lognormvariate(3, 0.3) for _ in range(n)]
    s = stats.summarize(xs)
    ys = np.sort(np.array(xs))
    assert s.median == pytest.approx(float(np.median(ys)), rel=0, abs=1e-12)
    # independent check of the rank: the widest k that still covers >= 95% (scipy's binomial)
    ks = [k for k in range(1, n // 2 + 1) if _coverage_scipy(n, k) >= 0.95]
    k = max(ks) if ks else 1
    assert (s.lo, s.hi) == (ys[k - 1], ys[n - k])
    assert s.coverage == pytest.approx(_coverage_scipy(n, k), abs=1e-12)
    assert s.lo <= s.median <= s.hi
    if n >= 6:
        assert s.coverage >= 0.95
    else:            # no 95% interval exists: min/max, with the coverage they have
        assert (s.lo, s.hi) == (ys[0], ys[-1]) and s.coverage < 0.95


def test_summarize_rejects_empty_and_non_finite():
    with pytest.raises(ValueError, match="no samples"):
        stats.summarize([])
    with pytest.raises(ValueError, match="non-finite"):
        stats.summarize([1.0, float("nan")])


def _sample_report() -> dict:
    rng = np.random.default_rng(7)
    results = [
        report.result("read_gbps", "openjet", {}, rng.normal(4400, 30, 10)),
        report.result("decode_tps", "openjet", {"depth": 0}, rng.normal(120, 2, 6)),
        report.result("decode_tps", "llama.cpp", {"depth": 0}, rng.normal(83, 1, 6)),
        report.result("verify_ms", "llama.cpp", {"positions": 3, "depth": 1024}, rng.normal(17.7, 0.2, 6)),
        report.result("prefill_tps", "llama.cpp", {"new_tokens": 2700, "depth": 1800}, rng.normal(2400, 20, 5)),
        report.result("roofline_tps", "openjet", {"depth": 0}, rng.normal(280, 2, 10)),
        report.result("peak_mem_gb", "llama.cpp", {"max_depth": 30720}, [19.5]),
    ]
    man = {"gpu": {"name": "H200"}, "pending": [
        {"metric": "spec_tps", "engine": "openjet", "params": {"acceptance": 0.7, "drafts": 3, "depth": 8192},
         "reason": "pending: issue 6"}],
        "not_measured": [{"metric": "decode_tps", "engine": "openjet", "params": {"depth": 8192},
                          "reason": "out of time"}]}
    return {"manifest": man, "results": results}


def test_report_json_medians_and_intervals_recompute_from_raw_samples():
    rep = json.loads(json.dumps(_sample_report()))          # what a reader of the file gets
    report.validate_report(rep)
    for r in rep["results"]:
        xs = sorted(r["samples"])
        n = len(xs)
        assert r["median"] == pytest.approx(float(np.median(xs)), rel=1e-12)
        ks = [k for k in range(1, n // 2 + 1) if _coverage_scipy(n, k) >= 0.95] or [1]
        assert (r["lo"], r["hi"]) == (xs[max(ks) - 1], xs[n - max(ks)])


def test_validate_report_names_what_is_wrong():
    good = _sample_report()
    report.validate_report(good)
    cases = [
        (lambda r: r["results"][1].__setitem__("median", r["results"][1]["median"] + 1.0), r"results\[1\]\.median"),
        (lambda r: r["results"][2].__setitem__("engine", "vllm"), r"results\[2\]\.engine"),
        (lambda r: r["results"][3]["params"].pop("positions"), r"results\[3\]\.params.*positions"),
        (lambda r: r["results"][0].__setitem__("extra", 1), r"results\[0\]: keys"),
        (lambda r: r["results"][0].__setitem__("unit", "GiB/s"), r"results\[0\]\.unit"),
        (lambda r: r["results"][4].__setitem__("samples", []), r"results\[4\]\.samples"),
        (lambda r: r.__setitem__("extra", {}), "top level"),
        (lambda r: r["results"].append(dict(r["results"][0])), "a second result"),
    ]
    for mutate, pattern in cases:
        bad = json.loads(json.dumps(good))
        mutate(bad)
        with pytest.raises(ValueError, match=pattern):
            report.validate_report(bad)


def test_markdown_has_ratio_roofline_and_pending_columns():
    md = report.markdown(_sample_report())
    row = next(line for line in md.splitlines() if line.startswith("| decode_tps | depth 0 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    rep = _sample_report()
    med = {(r["metric"], r["engine"]): r["median"] for r in rep["results"]}
    assert cells[5] == f"{med[('decode_tps', 'openjet')] / med[('decode_tps', 'llama.cpp')]:.2f}×"
    assert cells[6] == f"{med[('decode_tps', 'openjet')] / med[('roofline_tps', 'openjet')]:.0%}"
    assert cells[7] == f"{med[('decode_tps', 'llama.cpp')] / med[('roofline_tps', 'openjet')]:.0%}"
    assert "pending: issue 6" in md
    assert "not measured (1)" in md and "(1) out of time" in md


def test_engine_switches_are_recorded_and_printed():
    from openjet_plugin.bench import manifest
    env = {"OJ_MVF16_SPLIT": "1", "OPENJET_PREFILL_ATTN": "decode", "OJ_GEMM_CFG": "1", "PATH": "/usr/bin",
           "OPENJET_CACHE_DIR": "/tmp/x", "OPENJET_PREFILL_GEMM": "f16"}
    sw = manifest.engine_switches(env)
    assert sw == {"OJ_GEMM_CFG": "1", "OJ_MVF16_SPLIT": "1", "OPENJET_PREFILL_ATTN": "decode", "OPENJET_PREFILL_GEMM": "f16"}
    rep = _sample_report()
    rep["manifest"]["engine_switches"] = sw
    md = report.markdown(rep)
    assert ("Engine switches: `OJ_GEMM_CFG=1`, `OJ_MVF16_SPLIT=1`, `OPENJET_PREFILL_ATTN=decode`, "
            "`OPENJET_PREFILL_GEMM=f16`.") in md
    rep["manifest"]["engine_switches"] = manifest.engine_switches({"PATH": "/usr/bin"})
    assert "Engine switches: none set (the engine's defaults)." in report.markdown(rep)
    assert "Engine switches: not recorded." in report.markdown(_sample_report())   # a report from before


# --- llama-bench's JSON -------------------------------------------------------------------------------

# Field names and types as llama-bench's json_printer writes them: test::get_fields() in
# tools/llama-bench/llama-bench.cpp (STRING quoted, INT bare, BOOL true/false, FLOAT bare), then
# samples_ns and samples_ts. samples_ts[i] = 1e9 * (n_prompt + n_gen) / samples_ns[i].
def _llama_bench_record(n_prompt, n_gen, n_depth, samples_ns):
    n = n_prompt + n_gen
    ts = [1e9 * n / t for t in samples_ns]
    avg_ns = sum(samples_ns) // len(samples_ns)
    return f"""  {{
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "Intel(R) Xeon(R) Platinum 8480C",
    "gpu_info": "NVIDIA H200",
    "backends": "CUDA",
    "model_filename": "/root/build/cache/bench/q27b-Q4_K_M-seed0.gguf",
    "model_type": "qwen35 27B Q4_K - Medium",
    "model_size": 16829726720,
    "model_n_params": 27284865024,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 16,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 999,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "mmap",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": {n_prompt},
    "n_gen": {n_gen},
    "n_depth": {n_depth},
    "test_time": "2026-11-29T17:00:00Z",
    "avg_ns": {avg_ns},
    "stddev_ns": 1000,
    "avg_ts": {sum(ts) / len(ts):.6f},
    "stddev_ts": 0.1,
    "samples_ns": [ {", ".join(str(t) for t in samples_ns)} ],
    "samples_ts": [ {", ".join(f"{t:g}" for t in ts)} ]
  }}"""


LLAMA_BENCH_OUTPUT = "[\n" + ",\n".join([
    _llama_bench_record(0, 128, 8192, [1537000000, 1541000000, 1539500000, 1538000000, 1544000000, 1540000000]),
    _llama_bench_record(3, 0, 1024, [17700000, 17650000, 17810000, 17690000, 17720000, 17705000]),
]) + "\n]\n"


def test_parse_llama_bench_json_sample():
    tests = peer.parse_llama_bench_json(LLAMA_BENCH_OUTPUT)
    assert [t.kind for t in tests] == ["tg", "pp"]
    tg, pp = tests
    assert (tg.n_gen, tg.n_depth, tg.n_ubatch) == (128, 8192, 512)
    assert tg.tokens_per_second() == pytest.approx(tg.raw["samples_ts"], rel=1e-5)
    assert tg.tokens_per_second()[0] == pytest.approx(128 / 1.537)
    assert (pp.n_prompt, pp.n_depth) == (3, 1024)
    assert pp.milliseconds() == pytest.approx([17.7, 17.65, 17.81, 17.69, 17.72, 17.705])
    assert tg.raw["flash_attn"] == 1 and tg.raw["type_k"] == "f16"


def test_parse_llama_bench_json_errors_are_clear():
    with pytest.raises(peer.PeerError, match="not JSON"):
        peer.parse_llama_bench_json("| model | size |")           # the markdown output by mistake
    data = json.loads(LLAMA_BENCH_OUTPUT)
    del data[1]["samples_ns"]
    with pytest.raises(peer.PeerError, match="test 1 lacks field.*samples_ns"):
        peer.parse_llama_bench_json(json.dumps(data))
    data = json.loads(LLAMA_BENCH_OUTPUT)
    data[0]["samples_ns"] = []
    with pytest.raises(peer.PeerError, match="test 0 has no positive integer samples_ns"):
        peer.parse_llama_bench_json(json.dumps(data))


def test_llama_bench_fields_we_read_exist_in_its_source():
    """The fields we require are ones llama-bench's json_printer writes (read from its source
    where the vendored llama.cpp is present)."""
    src = Path("/opt/llama-src/vendor/llama.cpp/tools/llama-bench/llama-bench.cpp")
    if not src.is_file():
        pytest.skip(f"{src} not present")
    text = src.read_text()
    fields_block = text[text.index("get_fields()"):text.index("enum field_type")]
    for f in peer.REQUIRED_FIELDS:
        assert f'"{f}"' in fields_block or f'\\"{f}\\"' in text, f
    record = json.loads(LLAMA_BENCH_OUTPUT)[0]
    listed = [f for f in record if f not in ("samples_ns", "samples_ts")]
    import re
    source_fields = re.findall(r'"([a-z_0-9]+)"', fields_block)
    assert listed == source_fields          # the sample has exactly llama-bench's fields, in its order


def test_bench_command_is_the_documented_one(tmp_path):
    cmd = peer.bench_command(Path("/b/llama-bench"), Path("/m.gguf"), n_prompt=[1, 2, 3], depths=[1024], reps=6,
                             n_ubatch=512)
    s = " ".join(cmd)
    assert "-o json" in s and "-fa 1" in s and "-p 1,2,3" in s and "-n 0" in s and "-d 1024" in s
    assert "-r 6" in s and "-ngl 999" in s and "-ub 512" in s


@pytest.mark.slow
def test_slim_sdist_keeps_what_the_build_needs(tmp_path):
    full = Path("/tmp/sd") / peer.SDIST_NAME
    if not full.is_file():
        pytest.skip("the full sdist is not in /tmp/sd")
    slim = peer.pack_slim(full, tmp_path / peer.SLIM_NAME)
    import tarfile
    names = {m.name.split("/", 1)[-1] for m in tarfile.open(slim).getmembers()}
    assert "vendor/llama.cpp/tools/llama-bench/llama-bench.cpp" in names
    assert "vendor/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt" in names
    assert not any(n.startswith("vendor/llama.cpp/models/") for n in names)
    # llama-server (bench/peer_spec.py): its sources, and only tools/ui's CMake files of the web UI
    assert "vendor/llama.cpp/tools/server/server-context.cpp" in names
    assert {n for n in names if n.startswith("vendor/llama.cpp/tools/ui/")} == set(peer._SLIM_KEEP_FILES)
    assert slim.stat().st_size < 12e6
    info = peer.sdist_version(slim)
    assert info["llama_cpp_python"] == peer.PINNED_VERSION
    assert len(info["llama_cpp_commit"]) == 40


# --- roofline: the bytes a decoded position reads ----------------------------------------------------

def test_weight_bytes_per_position_on_a_generated_model(tiny_model):
    from gguf import GGUFReader
    from openjet_plugin.model_file import open_model

    reader = GGUFReader(str(tiny_model))
    n_blocks = int(reader.fields["qwen35.block_count"].parts[-1][0])
    n_nextn = int(reader.fields["qwen35.nextn_predict_layers"].parts[-1][0])
    mtp = f"blk.{n_blocks - n_nextn}."
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    expected = sum(n for name, n in sizes.items() if name != "token_embd.weight" and not name.startswith(mtp))
    assert any(name.startswith(mtp) for name in sizes) and "output.weight" in sizes
    with open_model(tiny_model) as mf:
        w = roofline.weight_bytes_per_position(mf)
    assert w["weight_bytes"] == expected
    assert w["weight_bytes"] + w["excluded_bytes"] == sum(sizes.values())
    assert not w["tied_output"]


def test_tied_output_head_counts_the_embedding_table():
    cfg = SimpleNamespace(n_layer=2, block_count=3)
    t = lambda n: SimpleNamespace(n_bytes=n)  # noqa: E731
    mf = SimpleNamespace(config=cfg, tensors={"token_embd.weight": t(1000), "blk.0.ffn_up.weight": t(10),
                                              "blk.1.ffn_up.weight": t(20), "blk.2.nextn.eh_proj.weight": t(5),
                                              "output_norm.weight": t(1)})
    w = roofline.weight_bytes_per_position(mf)
    assert w["tied_output"] and w["weight_bytes"] == 1031 and w["excluded_bytes"] == 5


def test_state_bytes_for_the_27b_shapes():
    from openjet_plugin.config import PRESETS

    c = PRESETS["q27b"]
    s = roofline.state_bytes(c, 30720)
    assert s["kv_bytes_per_token"] == 16 * 2 * 4 * 256 * 2          # 64 KiB per token in f16
    assert s["recurrent_bytes_read_written"] == 2 * 48 * 48 * 128 * 128 * 4
    assert roofline.bytes_per_position(10, c, 0) == 10 + s["recurrent_bytes_read_written"]


def test_roofline_probe_compiles_to_16_byte_loads(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not installed")
    src = tmp_path / "probe.cu"
    src.write_text(roofline.KERNEL_SOURCE)
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", "-o", str(tmp_path / "p.ptx"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "p.ptx").read_text()
    assert "ld.global.nc.v4" in ptx


# --- manifest and the no-GPU path ---------------------------------------------------------------------

def test_manifest_without_a_gpu_marks_fields_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(smi, "smi_path", lambda: None)
    man = manifest.collect(["--quick"])
    json.dumps(man)
    assert man["gpu"]["present"] is False
    assert str(man["gpu"]["name"]).startswith("unavailable")
    assert str(man["gpu"]["state_start"]["power.limit"]).startswith("unavailable")
    assert str(man["gpu"]["cuda_driver_version"]).startswith("unavailable")
    assert len(man["project"]["source_sha256"]) == 64
    assert man["bench_argv"] == ["--quick"] and man["date"].endswith("Z")
    man = manifest.finish(man)
    assert str(man["gpu"]["state_end"]["clocks.sm"]).startswith("unavailable")


def test_manifest_with_a_failing_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path / 'bin', fail=True)}{os.pathsep}{os.environ['PATH']}")
    ok, why = smi.gpu_presence()
    assert not ok and "couldn't communicate with the NVIDIA driver" in why
    man = manifest.collect([])
    assert man["gpu"]["present"] is False
    assert all(str(v).startswith("unavailable") for k, v in man["gpu"]["state_start"].items() if k != "read_at")


def test_manifest_reads_the_gpu_state(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    man = manifest.collect([])
    assert man["gpu"]["name"] == "Fake H200" and man["gpu"]["cuda_driver_version"] == "13.0"
    assert man["gpu"]["state_start"]["power.limit"] == "700.00 W"
    with smi.PeakMemory(interval_ms=10) as pm:
        import time
        time.sleep(0.3)
    assert pm.peak_gb == pytest.approx((5000 - 1000) * 2 ** 20 / 1e9)


def test_model_sha256_is_streamed_and_cached(tmp_path):
    import hashlib
    f = tmp_path / "m.bin"
    f.write_bytes(os.urandom(1 << 20))
    cache = tmp_path / "sha.json"
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert manifest.model_sha256(f, cache, chunk=4096) == want
    key = next(iter(json.loads(cache.read_text())))
    # a cached value is used as long as path, size and mtime match
    cache.write_text(json.dumps({key: "cached"}))
    assert manifest.model_sha256(f, cache) == "cached"


@pytest.mark.parametrize("fail", [False, True], ids=["no-nvidia-smi", "driver-fails"])
def test_openjet_bench_without_gpu_exits_nonzero_with_a_clear_message(tmp_path, fail):
    bin_dir = _fake_smi(tmp_path / "bin", fail=True) if fail else tmp_path / "empty"
    bin_dir.mkdir(exist_ok=True)
    env = dict(os.environ, PATH=str(bin_dir), OPENJET_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "openjet_plugin.cli", "bench", "--quick"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "no NVIDIA GPU here" in r.stderr
    assert ("couldn't communicate" in r.stderr) if fail else ("nvidia-smi is not on PATH" in r.stderr)
    assert r.stdout == ""
    assert not (tmp_path / "cache").exists()        # nothing generated or built before the check


# --- resume: idempotent across runs -------------------------------------------------------------------

def test_store_is_idempotent_and_refuses_another_identity(tmp_path):
    st = Store(tmp_path / "r", {"gpu": "H200", "model_bytes": 5})
    assert st.add("decode_tps", "openjet", {"depth": 0}, "tokens/s", [1.0, 2.0], "s1")
    assert not st.add("decode_tps", "openjet", {"depth": 0}, "tokens/s", [9.0], "s2")
    with open(st.records_path, "a") as f:
        f.write('{"metric": "decode_tps", "eng')                   # a run killed mid-write
    again = Store(tmp_path / "r", {"gpu": "H200", "model_bytes": 5})
    assert again.has("decode_tps", "openjet", {"depth": 0})
    assert again.records()[0]["samples"] == [1.0, 2.0]
    with pytest.raises(ResumeMismatch, match="gpu"):
        Store(tmp_path / "r", {"gpu": "A100", "model_bytes": 5})


def test_bench_resumes_where_it_stopped(tmp_path, monkeypatch, tiny_model):
    """Two runs on one --resume folder: the first runs out of time in its second group, the second
    makes only what is missing; the final JSON validates and holds every planned row once."""
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    calls: list[str] = []
    rng = np.random.default_rng(0)

    def fake(name, fail_first=False):
        def fn(run):
            calls.append(name)
            if fail_first and calls.count(name) == 1:
                raise TimeoutError("deadline")
            for metric, engine, params in run.missing(rows_of[name]):
                run.add(metric, engine, params, rng.normal(100, 1, run.settings.reps))
        return fn

    rows_of: dict = {}
    real_groups = runner.groups

    def fake_groups(run):
        real = real_groups(run)
        out = []
        for name, need, rows, _ in real:
            rows_of[name] = rows
            # renamed: a "llama.cpp ..." group would first wait for a real llama-bench build
            out.append((f"fake {name}", 0.0, rows, fake(name, fail_first=(name == "openjet"))))
        return out

    monkeypatch.setattr(runner, "groups", fake_groups)
    resume = tmp_path / "resume"
    args = ["--model", str(tiny_model), "--quick", "--resume", str(resume), "--cache-dir", str(tmp_path / "cache"),
            "--sdist", str(tmp_path / "missing.tar.gz")]
    rc1 = runner.main(args + ["--json", str(tmp_path / "1.json")])
    assert rc1 == runner.EXIT_INCOMPLETE_TIME
    first = json.loads((tmp_path / "1.json").read_text())
    assert any(m["reason"] == runner.OUT_OF_TIME for m in first["manifest"]["not_measured"])
    n_calls = len(calls)
    rc2 = runner.main(args + ["--json", str(tmp_path / "2.json")])
    assert rc2 == 0
    assert calls[n_calls:] == ["openjet"]                      # only the unfinished group ran again
    final = json.loads((tmp_path / "2.json").read_text())
    report.validate_report(final)
    planned, pending = runner.plan(runner.Settings.quick_run())
    got = {report.row_key(r["metric"], r["engine"], r["params"]) for r in final["results"]}
    assert {report.row_key(*p) for p in planned} <= got
    assert final["manifest"]["not_measured"] == []
    assert len(final["manifest"]["pending"]) == len(pending)
    assert final["manifest"]["model"]["sha256"] == manifest.model_sha256(tiny_model)
    # a third run changes nothing
    before = (resume / "records.jsonl").read_text()
    assert runner.main(args + ["--json", str(tmp_path / "3.json")]) == 0
    assert (resume / "records.jsonl").read_text() == before and calls[n_calls + 1:] == []


# --- our engine's timing loops (with a stand-in backend) ---------------------------------------------

class _FakeBackend:
    n_vocab = 1000

    def __init__(self):
        self.n_past = 0
        self.calls: list[int] = []     # eval_argmax: a run of tokens, split as the backend likes
        self.passes: list[int] = []    # eval_pass_argmax: one pass over the weights each

    def eval_argmax(self, tokens):
        self.calls.append(len(tokens))
        self.n_past += len(tokens)
        return (tokens[-1] * 7 + 1) % self.n_vocab

    def eval_pass_argmax(self, tokens):
        self.passes.append(len(tokens))
        self.n_past += len(tokens)
        return (tokens[-1] * 7 + 1) % self.n_vocab

    def reset(self):
        self.n_past = 0


def test_decode_and_verify_loops_time_what_they_say():
    from openjet_plugin.bench import ours

    be = _FakeBackend()
    samples = ours.decode_samples(be, n_tokens=16, reps=5, first=3)
    assert len(samples) == 5 and all(s > 0 and math.isfinite(s) for s in samples)
    assert be.calls == [1] * (ours.WARMUP_STEPS + 5 * 16)     # one position per decode step
    for positions in (4, 16):                                  # each sample one pass of all its positions
        be = _FakeBackend()
        ms = ours.verify_samples(be, positions=positions, reps=6, rng=np.random.default_rng(0))
        assert len(ms) == 6 and be.passes == [positions] * 8 and be.calls == []   # two warm-up passes, then the timed ones
    be = _FakeBackend()
    f = ours.Filler(be, np.random.default_rng(0))
    f.fill_to(1000)
    assert be.n_past == 1000 and f.tokens == 1000


def test_our_engine_child_reports_why_it_measured_nothing(tmp_path, monkeypatch, tiny_model):
    """The child-process protocol end to end on a machine where the native engine cannot run:
    every planned row of ours comes back marked with the backend's own reason, none is invented."""
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    from openjet_plugin.backends.native import native_status
    from openjet_plugin.model_file import open_model

    with open_model(tiny_model) as mf:
        ok, why = native_status(mf, 4096)
    if ok:
        pytest.skip("the native engine runs here; this test is about the machine without a GPU")
    s = runner.Settings.quick_run(depths=(0, 256), verify_positions=(1, 2), verify_depth=64)
    st = Store(tmp_path / "r", {"x": 1})
    run = runner.Run(settings=s, store=st, model=tiny_model, cache=tmp_path, deadline=None, session="t",
                     arch="90")
    runner.group_ours(run)
    assert st.records() == []
    rows = [("verify_ms", "openjet", {"positions": p, "depth": 64}) for p in (1, 2)] + \
           [("decode_tps", "openjet", {"depth": d}) for d in (0, 256)] + [("peak_mem_gb", "openjet", {"max_depth": 256})]
    for r in rows:
        assert run.not_measured[report.row_key(*r)].startswith("native backend unavailable"), r


class _ToyEngine:
    """The native engine's C API as far as the bench drives it, over a toy model: after token t at
    position p the greedy next token is g(t, p); the MTP head guesses it except when (t + p) % 4 == 0.
    It refuses what the real engine would make wrong: MTP rows that leave a hole, an MTP step whose
    main hidden is not there yet, a commit without a verify."""

    OJ_MAX_POSITIONS = 16   # the header constant the backend reads

    def __init__(self, ffi, n_vocab: int):
        self.ffi, self.V = ffi, n_vocab
        self.n_past, self.last, self.pending, self.slots = 0, [], 0, {}
        self.mtp_n_past, self.draft = 0, []
        self.evals = self.mtp_calls = 0
        self.prefill_chunk = 0
        self.prefills: list[tuple[int, int, bool]] = []     # (n_past, tokens, MTP followed)
        self.error = ffi.new("char[]", b"ok")

    def oj_abi_version(self):
        return 3

    def oj_prefill(self, h, buf, n):
        if self.prefill_chunk == 0:
            return self._fail("oj_prefill needs prefill_chunk > 0")
        toks = [buf[i] for i in range(n)]
        follows = self.mtp_n_past == self.n_past
        self.prefills.append((self.n_past, n, follows))
        self.last = [self.g(toks[-1], self.n_past + n - 1)]     # the last position's results only
        self.n_past += n
        self.pending = 0
        if follows:
            self.mtp_n_past = self.n_past
        return 0

    def oj_mtp_n_past(self, h, out):
        out[0] = self.mtp_n_past
        return 0

    def g(self, t, p):
        return (31 * t + 7 * p + 3) % self.V

    def _fail(self, msg):
        self.error = self.ffi.new("char[]", msg.encode())
        return 2

    def oj_last_error(self, h):
        return self.error

    def oj_n_past(self, h, out):
        out[0] = self.n_past
        return 0

    def oj_eval(self, h, buf, n):
        toks = [buf[i] for i in range(n)]
        self.last = [self.g(t, self.n_past + i) for i, t in enumerate(toks)]
        self.n_past += n
        self.pending = 0
        self.evals += 1
        self.profiled_passes += bool(self.profiling)
        return 0

    def oj_verify(self, h, buf, n):
        toks = [buf[i] for i in range(n)]
        self.last = [self.g(t, self.n_past + i) for i, t in enumerate(toks)]
        self.pending = n
        return 0

    def oj_commit(self, h, n):
        if not 1 <= n <= self.pending:
            return self._fail(f"commit {n} after a verify of {self.pending}")
        self.n_past += n
        self.pending = 0
        return 0

    def oj_get_argmax(self, h, out, n):
        if not 1 <= n <= len(self.last):
            return self._fail("argmax: no evaluation")
        for i in range(n):
            out[i] = self.last[i]
        return 0

    def oj_mtp_eval(self, h, buf, n, pos0, source, hp):
        if pos0 > self.mtp_n_past:
            return self._fail(f"MTP rows end at {self.mtp_n_past}, a step at {pos0} leaves a hole")
        if source == 0 and pos0 + n - 1 > self.n_past + self.pending:
            return self._fail(f"MTP step at {pos0 + n - 1} needs the main hidden of a position not evaluated")
        toks = [buf[i] for i in range(n)]
        self.draft = [self.g(t, pos0 + i) + ((t + pos0 + i) % 4 == 0) for i, t in enumerate(toks)]
        self.draft = [d % self.V for d in self.draft]
        self.mtp_n_past = pos0 + n
        self.mtp_calls += 1
        return 0

    def oj_get_draft_argmax(self, h, out, n):
        for i in range(n):
            out[i] = self.draft[i]
        return 0

    def _row(self, out, width, peak):
        # logits falling away from the argmax: a sampled request mostly follows the greedy one
        for j in range(width):
            out[j] = -abs(j - peak) * 2.0
        return 0

    def oj_get_logits(self, h, index, out, n_vocab):
        if not 0 <= index < len(self.last):
            return self._fail(f"logits row {index}: {len(self.last)} evaluated")
        return self._row(out, n_vocab, self.last[index])

    def oj_get_draft_logits(self, h, index, out, width):
        if not 0 <= index < len(self.draft):
            return self._fail(f"draft logits row {index}: {len(self.draft)} drafted")
        return self._row(out, width, self.draft[index])

    def oj_checkpoint_save(self, h, slot):
        self.slots[slot] = self.n_past
        return 0

    def oj_checkpoint_restore(self, h, slot, out):
        self.n_past = self.slots[slot]
        self.mtp_n_past = min(self.mtp_n_past, self.n_past)
        self.last, self.pending = [], 0
        out[0] = self.n_past
        return 0

    def oj_reset(self, h):
        self.n_past = self.mtp_n_past = self.pending = 0
        self.last = []
        return 0

    def oj_draft_vocab_size(self, h, out):
        out[0] = self.V
        return 0

    def oj_set_draft_vocab(self, h, ids, n):
        return 0

    def oj_memory(self, h, rep):
        rep.total = 123
        return 0

    # oj_profile: every oj_eval while on is one pass of two phases (a projection and a norm)
    OJ_MAX_PHASES = 16
    profiling = profiled_passes = 0

    def oj_profile(self, h, on):
        self.profiling, self.profiled_passes = on, 0
        return 0

    def oj_profile_read(self, h, rows, cap, n, passes, span, host):
        names = [b"ffn down", b"norms"]
        for i, name in enumerate(names):
            rows[i].name = name
            rows[i].calls = rows[i].launches = self.profiled_passes
            rows[i].ms = 0.5 * self.profiled_passes
            rows[i].bytes = 10**9 * self.profiled_passes if i == 0 else 0
        n[0], passes[0], span[0] = len(names), self.profiled_passes, 1.0 * self.profiled_passes
        host[0] = 0.25 * self.profiled_passes
        self.profiled_passes = 0
        return 0


@pytest.fixture()
def toy_native(monkeypatch):
    """The real NativeBackend (and NativeSpeculator above it) over _ToyEngine instead of the CUDA
    library: what the bench's child does on the GPU, dry-run on the CPU. Returns the engines made."""
    from openjet_plugin import _native
    from openjet_plugin.backends import native

    monkeypatch.setattr(_native, "header_path", lambda: _native.SOURCE_HEADER)   # ABI 3, not a stale copy
    ffi = _native.make_ffi()
    engines: list[_ToyEngine] = []

    def load():
        lib = _ToyEngine(ffi, 0)
        engines.append(lib)
        return SimpleNamespace(ffi=ffi, lib=lib)

    def create(self, model_file, kv_type, device):
        self._nl.lib.V = self.n_vocab
        self._nl.lib.prefill_chunk = self.prefill_chunk if self.batched_prefill else 0
        return ffi.new("int32_t *")

    monkeypatch.setattr(_native, "load", load)
    monkeypatch.setattr(native.NativeBackend, "_create", create)
    monkeypatch.setattr(native, "native_status", lambda mf, n_ctx: (True, "toy engine"))
    return engines


def _child_lines(out: Path) -> tuple[dict, dict, list[dict]]:
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    res = {report.row_key(x["metric"], x["engine"], x["params"]): x for x in lines if "metric" in x}
    skips = {report.row_key(x["skip"]["metric"], x["skip"]["engine"], x["skip"]["params"]): x["reason"]
             for x in lines if "skip" in x}
    return res, skips, lines


def test_our_engine_child_measures_every_planned_row(tmp_path, monkeypatch, tiny_model, toy_native):
    """ours.run's plan on the real NativeBackend over the toy engine: every verify/decode/spec row
    gets `reps` samples at the right parameters; every decode repetition starts at its depth."""
    from openjet_plugin.bench import ours

    starts: list[int] = []
    real_decode = ours.decode_samples

    def spy(be, n_tokens, reps, first, restore=None):
        def again():
            restore()
            starts.append(be.n_past)
        return real_decode(be, n_tokens, reps, first, restore=again)

    monkeypatch.setattr(ours, "decode_samples", spy)
    out = tmp_path / "o.jsonl"
    rc = ours.main(["--model", str(tiny_model), "--out", str(out), "--verify", "1,3", "--verify-depth", "100",
                    "--decode-depths", "0,300", "--decode-tokens", "4", "--reps", "6",
                    "--spec", "0.0:2,1.0:2,0.5:3", "--spec-mtp", "1,3", "--spec-depth", "200", "--spec-tokens", "24"])
    assert rc == 0
    res, skips, lines = _child_lines(out)
    assert skips == {}
    key = lambda m, p: report.row_key(m, "openjet", p)  # noqa: E731
    want = {key("verify_ms", {"positions": 1, "depth": 100}), key("verify_ms", {"positions": 3, "depth": 100}),
            key("decode_tps", {"depth": 0}), key("decode_tps", {"depth": 300}),
            key("spec_tps", {"acceptance": 0.0, "drafts": 2, "depth": 200}),
            key("spec_tps", {"acceptance": 1.0, "drafts": 2, "depth": 200}),
            key("spec_tps", {"acceptance": 0.5, "drafts": 3, "depth": 200}),
            key("spec_mtp_tps", {"drafts": 1, "depth": 200}), key("spec_mtp_tps", {"drafts": 3, "depth": 200}),
            key("projection_gbps", {"positions": 1, "depth": 100}), key("projection_gbps", {"positions": 3, "depth": 100})}
    assert set(res) == want
    assert all(len(x["samples"]) == 6 and x["engine"] == "openjet" for x in res.values())
    # the toy's profile: one projection phase of 1 GB in 0.5 ms per pass -> 2,000 GB/s; its table per row
    assert res[key("projection_gbps", {"positions": 1, "depth": 100})]["samples"] == [2000.0] * 6
    tables = {}
    for x in lines:
        tables.update(x.get("info", {}).get(ours.PHASES_KEY, {}))
    assert set(tables) == {k for k in want if k.startswith("projection_gbps")}
    t = tables[key("projection_gbps", {"positions": 3, "depth": 100})]
    assert t["passes"] == 6 and [p["name"] for p in t["phases"]] == ["ffn down", "norms"]
    assert starts == [0] * 6 + [300] * 6
    assert any("info" in x and x["info"].get("openjet_memory_bytes", {}).get("total") == 123 for x in lines)
    details = {}
    for x in lines:
        details.update(x.get("info", {}).get(ours.DETAILS_KEY, {}))
    assert set(details) == {k for k in want if k.startswith("spec")}
    for k, d in details.items():
        assert d["runs_differing_from_plain"] == 0, k          # greedy speculation == plain decode
        assert d["tokens"] == 24 and d["reps"] == 6 and len(d["ms_per_cycle"]) == 6
    never = details[key("spec_tps", {"acceptance": 0.0, "drafts": 2, "depth": 200})]
    always = details[key("spec_tps", {"acceptance": 1.0, "drafts": 2, "depth": 200})]
    half = details[key("spec_tps", {"acceptance": 0.5, "drafts": 3, "depth": 200})]
    assert never["acceptance_at"] == [0.0, 0.0] and never["tokens_per_cycle"] == 1.0
    assert always["acceptance_at"] == [1.0, 1.0] and always["tokens_per_cycle"] == 3.0
    assert 0.3 < half["acceptance_at"][0] < 0.7            # forced a = 0.5 at the first slot
    assert "no MTP draft pass" in never["drafts_from"]
    mtp3 = details[key("spec_mtp_tps", {"drafts": 3, "depth": 200})]
    assert 0.5 < mtp3["acceptance_at"][0] < 1.0 and "MTP head" in mtp3["drafts_from"]


def test_our_mtp_rows_at_each_depth_start_from_the_shared_tokens(tmp_path, monkeypatch, tiny_model, toy_native):
    """--spec-mtp D@DEPTH items: MTP rows at several depths, each from the state filled with the
    shared sequence (spec.prompt_tokens) and its next token as the current one, as llama.cpp's
    rows are given (bench/peer_spec.py)."""
    from openjet_plugin.bench import ours
    from openjet_plugin.bench import spec as spec_mod
    from openjet_plugin.model_file import open_model

    starts = []
    real = spec_mod.start_point

    def spy(be, depth, history, current, n_tokens):
        starts.append((depth, list(history), current))
        return real(be, depth, history, current, n_tokens)

    monkeypatch.setattr(spec_mod, "start_point", spy)
    out = tmp_path / "o.jsonl"
    assert ours.main(["--model", str(tiny_model), "--out", str(out), "--verify", "", "--decode-depths", "0,96",
                      "--decode-tokens", "4", "--spec-mtp", "1@0,2@0,2@96", "--spec-tokens", "12", "--reps", "2"]) == 0
    res, skips, _ = _child_lines(out)
    key = lambda m, p: report.row_key(m, "openjet", p)  # noqa: E731
    assert skips == {}
    assert set(res) == {key("decode_tps", {"depth": 0}), key("decode_tps", {"depth": 96}),
                        key("spec_mtp_tps", {"drafts": 1, "depth": 0}), key("spec_mtp_tps", {"drafts": 2, "depth": 0}),
                        key("spec_mtp_tps", {"drafts": 2, "depth": 96})}
    with open_model(tiny_model) as mf:
        tokens = spec_mod.prompt_tokens(mf.config.n_vocab, 97)
    assert [(d, h, c) for d, h, c in starts] == [(0, [], tokens[0]), (96, tokens[:96], tokens[96])]
    with pytest.raises(ValueError, match="DRAFTS@DEPTH"):
        ours._mtp_items("2@x", 64)
    assert ours._mtp_items("1,3@0", 64) == [(1, 64), (3, 0)]


def test_a_failing_profile_costs_its_row_only(tmp_path, monkeypatch, tiny_model, toy_native):
    """The per-phase profile failing (e.g. a library without oj_profile) skips projection_gbps with
    the error; verify_ms and the decode rows are still measured."""
    from openjet_plugin.bench import ours

    def broken(be, positions, reps, rng):
        raise RuntimeError("oj_profile: cudaEventRecord failed")

    monkeypatch.setattr(ours, "profiled_samples", broken)
    out = tmp_path / "o.jsonl"
    rc = ours.main(["--model", str(tiny_model), "--out", str(out), "--verify", "1", "--verify-depth", "50",
                    "--decode-depths", "0", "--decode-tokens", "4", "--reps", "3"])
    assert rc == 0
    res, skips, _ = _child_lines(out)
    key = lambda m, p: report.row_key(m, "openjet", p)  # noqa: E731
    assert set(res) == {key("verify_ms", {"positions": 1, "depth": 50}), key("decode_tps", {"depth": 0})}
    assert skips == {key("projection_gbps", {"positions": 1, "depth": 50}):
                     "the per-phase profile failed: RuntimeError: oj_profile: cudaEventRecord failed"}


def test_our_engine_child_skips_spec_rows_with_reasons(tmp_path, monkeypatch, tiny_model, toy_native):
    """A failing speculative row is a skip with the engine's message; an oracle row still runs; a
    deadline that cannot fit a row gives 'out of time' skips."""
    from openjet_plugin.bench import ours
    from openjet_plugin.bench import spec as spec_mod

    real = spec_mod.mtp_factory

    def broken(be, vocab, depth):
        make = real(be, vocab, depth)

        def bad(rep):
            s = make(rep)
            be.supports_speculative = True
            be._mtp_upto = -5                        # the MTP bookkeeping out of step: draft_first refuses
            return s
        return bad

    monkeypatch.setattr(spec_mod, "mtp_factory", broken)
    out = tmp_path / "o.jsonl"
    assert ours.main(["--model", str(tiny_model), "--out", str(out), "--verify", "", "--decode-depths", "",
                      "--spec", "0.8:2", "--spec-mtp", "2", "--spec-depth", "64", "--spec-tokens", "8",
                      "--reps", "2"]) == 0
    res, skips, _ = _child_lines(out)
    assert report.row_key("spec_tps", "openjet", {"acceptance": 0.8, "drafts": 2, "depth": 64}) in res
    reason = skips[report.row_key("spec_mtp_tps", "openjet", {"drafts": 2, "depth": 64})]
    assert "RuntimeError" in reason and "MTP rows end at" in reason
    out2 = tmp_path / "o2.jsonl"
    import time as _time
    assert ours.main(["--model", str(tiny_model), "--out", str(out2), "--verify", "", "--decode-depths", "",
                      "--spec", "0.8:2", "--spec-depth", "64", "--spec-tokens", "8",
                      "--deadline", str(_time.time() + 12)]) == 0
    res2, skips2, _ = _child_lines(out2)
    assert res2 == {} and all(r.startswith("out of time") for r in skips2.values()) and len(skips2) == 1


def test_accepted_per_cycle_child_without_the_engine_says_why(tmp_path):
    """On this machine the native engine cannot run the default model: every row is a skip with
    the reason, nothing is invented."""
    from openjet_plugin.bench import ours
    from openjet_plugin.defaults import SHIPPED_DEFAULT

    out = tmp_path / "a.jsonl"
    assert ours.main(["--model", str(SHIPPED_DEFAULT), "--out", str(out), "--accept", "0.0:1,0.7:4"]) == 0
    res, skips, _ = _child_lines(out)
    assert res == {} and len(skips) == 2
    assert all(r.startswith("native backend unavailable for default.gguf") for r in skips.values())


def test_accepted_per_cycle_load_error_names_the_tensor(tmp_path, monkeypatch):
    """Until the native kernels take the default model, its load error (naming the tensor) is the
    rows' reason."""
    import openjet_plugin
    from openjet_plugin.backends import native
    from openjet_plugin.bench import ours
    from openjet_plugin.defaults import SHIPPED_DEFAULT
    from openjet_plugin.errors import NativeEngineError

    def load(**kw):
        raise NativeEngineError(3, "loading default.gguf onto the GPU: tensor 'blk.0.ssm_out.weight' (Q8_0) "
                                   "has 48 columns, not a multiple of 32")

    monkeypatch.setattr(native, "native_status", lambda mf, n_ctx: (True, "toy"))
    monkeypatch.setattr(openjet_plugin, "load", load)
    out = tmp_path / "a.jsonl"
    ours.main(["--model", str(SHIPPED_DEFAULT), "--out", str(out), "--accept", "0.0:2,0.7:2",
               "--accept-prompts", "2", "--accept-prompt-tokens", "16"])
    res, skips, _ = _child_lines(out)
    assert res == {} and len(skips) == 2
    for r in skips.values():
        assert "could not load default.gguf" in r and "blk.0.ssm_out.weight" in r


def test_accepted_per_cycle_rows_count_cycles_and_greedy_differences(tmp_path, monkeypatch):
    """acceptance.measure over a stand-in Engine: per-prompt tokens/cycle samples, pooled ratio,
    per-slot acceptance, and greedy outputs that differ from plain decoding are counted."""
    import openjet_plugin
    from openjet_plugin.backends import native
    from openjet_plugin.bench import acceptance, ours
    from openjet_plugin.defaults import SHIPPED_DEFAULT
    from openjet_plugin.speculative import DepthPolicy, SpeculativeStats

    class Eng:
        def __init__(self, depth):
            self.depth = depth
            self.backend_name, self.backend_reason = "native", "toy"
            self._speculator = (SimpleNamespace(policy=DepthPolicy(depth), stats=SpeculativeStats(depth))
                                if depth else None)

        def generate(self, p, max_tokens, temperature, seed=None, **kw):
            toks = [(p[-1] + i) % 100 for i in range(max_tokens)]
            if self.depth == 2 and temperature == 0 and seed == 1:
                toks[5] += 1                                  # one greedy output differs from plain
            st = SpeculativeStats(max(self.depth, 1))
            cycles = 0
            while st.generated_tokens < max_tokens:          # every cycle accepts the first draft only
                st.record(self.depth, min(1, self.depth), min(1, self.depth) + 1)
                cycles += 1
            if self._speculator:
                self._speculator.stats = st
            return SimpleNamespace(tokens=toks, stats=SimpleNamespace(cycles=cycles if self.depth else 0,
                                                                        generated_tokens=max_tokens))

        def close(self):
            pass

    from openjet_plugin.speculative import SpeculativeResult
    from openjet_plugin.speculative_tree import TreeStats

    class TreeDec:
        # every cycle emits 3 tokens (2 drafts, one of them on a side branch) and the EOG token at the end
        def generate(self, p, params, max_tokens, stop_tokens, rng):
            st = TreeStats(7)
            st.cycles, st.generated_tokens = 3, 9
            st.drafts_accepted, st.side_accepts = 6, 3
            toks = [(p[-1] + i) % 100 for i in range(8)] + list(stop_tokens)[:1]
            if params.temperature == 0 and params.seed is None and p is prompts_seen[1]:
                toks[2] += 1                                  # one greedy output differs from plain
            return SpeculativeResult(toks, "stop", st)

    prompts_seen = []
    Eng.eog_tokens = (99,)
    orig_generate = Eng.generate

    def generate(self, p, max_tokens, temperature, seed=None, **kw):
        if self.depth == 0 and p not in prompts_seen:
            prompts_seen.append(p)
        return orig_generate(self, p, max_tokens, temperature, seed, **kw)

    Eng.generate = generate
    monkeypatch.setattr(native, "native_status", lambda mf, n_ctx: (True, "toy"))
    monkeypatch.setattr(openjet_plugin, "load", lambda **kw: Eng(kw["draft_depth"]))
    monkeypatch.setattr(acceptance, "tree_decoder", lambda path, n_ctx, budget: (TreeDec(), lambda: None))
    out = tmp_path / "a.jsonl"
    assert ours.main(["--model", str(SHIPPED_DEFAULT), "--out", str(out), "--accept", "0.0:2,0.7:3",
                      "--accept-trees", "0.0:8", "--accept-prompts", "3", "--accept-prompt-tokens", "16",
                      "--accept-tokens", "8"]) == 0
    res, skips, lines = _child_lines(out)
    assert skips == {}
    g = res[report.row_key("accepted_per_cycle", "openjet", acceptance.row_params(2, 0.0))]
    assert g["samples"] == [2.0, 2.0, 2.0] and g["unit"] == "tokens/cycle"
    details = {}
    for x in lines:
        details.update(x.get("info", {}).get(ours.DETAILS_KEY, {}))
    dg = details[report.row_key("accepted_per_cycle", "openjet", acceptance.row_params(2, 0.0))]
    assert dg["greedy_prompts_differing_from_plain"] == 1 and dg["greedy_differing_prompts"] == [1]
    assert dg["acceptance_at"] == [1.0, 0.0] and dg["tokens_per_cycle"] == 2.0
    ds = details[report.row_key("accepted_per_cycle", "openjet", acceptance.row_params(3, 0.7))]
    assert "greedy_prompts_differing_from_plain" not in ds and ds["sampling"]["top_k"] == 40
    tkey = report.row_key(acceptance.TREE_METRIC, "openjet", acceptance.tree_row_params(8, 0.0))
    assert res[tkey]["samples"] == [3.0, 3.0, 3.0]
    dt = details[tkey]
    assert dt["tokens_per_cycle"] == 3.0 and dt["side_accepts"] == 9 and dt["drafts_accepted"] == 18
    assert dt["greedy_prompts_differing_from_plain"] == 1 and dt["greedy_differing_prompts"] == [1]


def test_heldout_split_is_the_training_split():
    """The bench's copy of the held-out rule picks exactly training/data.py's files."""
    sys.path.insert(0, str(REPO))
    from training.data import heldout_files
    from openjet_plugin.bench import acceptance

    assert acceptance.heldout_files() == heldout_files()
    assert len(acceptance.heldout_files()) > 12


def test_heldout_prompts_are_python_from_unseen_files():
    from openjet_plugin.bench import acceptance
    from openjet_plugin.defaults import SHIPPED_DEFAULT
    from openjet_plugin.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(SHIPPED_DEFAULT)
    prompts = acceptance.heldout_prompts(tok, 12, 64)
    assert len(prompts) == 12 and all(len(p) == 64 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 12
    assert any("def " in tok.decode_bytes(p).decode("utf-8", "replace") for p in prompts)
    with pytest.raises(ValueError, match="held-out stdlib files"):
        acceptance.heldout_prompts(tok, 10 ** 6, 64)


@pytest.fixture(scope="module")
def fake_peer_build(tmp_path_factory):
    """peer.build on a stand-in source tree whose `llama-bench` prints the captured-format JSON
    (the CMake project is three lines of C; the real build needs CUDA and minutes)."""
    if shutil.which("cmake") is None or shutil.which("cc") is None:
        pytest.skip("cmake or a C compiler is missing")
    root = tmp_path_factory.mktemp("fake_peer")
    src = root / "sdist"
    (src / "vendor" / "llama.cpp").mkdir(parents=True)
    (root / "out.json").write_text(LLAMA_BENCH_OUTPUT)
    (src / "vendor" / "llama.cpp" / "main.c").write_text(
        '#include <unistd.h>\nint main(void) { execlp("cat", "cat", "%s", (char *)0); return 9; }\n'
        % (root / "out.json"))
    (src / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(fake C)\n"
        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\nadd_executable(llama-bench main.c)\n")
    cache = root / "cache"
    pb = peer.build_dir(cache, src, "90")
    binary = peer.build(src, pb, "90", jobs=2)
    return src, cache, pb, binary


def test_peer_build_is_cached_and_waited_for(fake_peer_build):
    src, cache, pb, binary = fake_peer_build
    assert binary == pb.binary and pb.ready()
    log_time = pb.log.stat().st_mtime_ns
    assert peer.build(src, pb, "90", jobs=2) == binary           # cached: cmake does not run again
    assert pb.log.stat().st_mtime_ns == log_time
    assert peer.start_background_build(src, pb, "90", 2) is None
    assert not peer.build_running(pb)
    assert peer.wait_for_build(pb, deadline=__import__("time").time() + 5) == binary
    assert peer.build_dir(cache, src, "89").root != pb.root       # another architecture, another build


def test_peer_groups_store_llama_bench_samples(fake_peer_build, tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    src, cache, pb, binary = fake_peer_build
    s = runner.Settings(depths=(0, 8192), verify_positions=(3,))
    st = Store(tmp_path / "r", {"x": 1})
    run = runner.Run(settings=s, store=st, model=tiny_model, cache=tmp_path, deadline=None, session="t",
                     arch="90", sdist=src, peer_build=pb)
    runner.group_peer_verify(run)
    (tmp_path / "bin" / "calls").unlink()        # the fake's memory readings start again at 1000 MiB
    runner.group_peer_decode(run)
    recs = {report.row_key(r["metric"], r["engine"], r["params"]): r for r in st.records()}
    tests = peer.parse_llama_bench_json(LLAMA_BENCH_OUTPUT)
    v = recs[report.row_key("verify_ms", "llama.cpp", {"positions": 3, "depth": 1024})]
    assert v["samples"] == pytest.approx([t / 1e6 for t in tests[1].samples_ns]) and v["unit"] == "ms"
    d = recs[report.row_key("decode_tps", "llama.cpp", {"depth": 8192})]
    assert d["samples"] == pytest.approx(tests[0].raw["samples_ts"], rel=1e-5)
    # the invocation covered the deepest depth, so the peak memory of that process was kept
    peak = recs[report.row_key("peak_mem_gb", "llama.cpp", {"max_depth": 8192})]
    assert peak["samples"] == [pytest.approx((5000 - 1000) * 2 ** 20 / 1e9)]
    assert st.info["llama_bench"]["gpu_info"] == "NVIDIA H200"


def test_existing_report_files_are_not_overwritten(tmp_path, capsys):
    """Issue 10 item 8: --json / --markdown refuse an existing file unless --force, before any work."""
    from openjet_plugin import bench

    existing = tmp_path / "mine.json"
    existing.write_text("keep me")
    assert bench.main(["--json", str(existing)]) == 2
    assert "--force" in capsys.readouterr().err and existing.read_text() == "keep me"
    existing_md = tmp_path / "mine.md"
    existing_md.write_text("keep me too")
    assert bench.main(["--markdown", str(existing_md)]) == 2
    assert existing_md.read_text() == "keep me too"


# --- speculative rows: plan, child protocol, tables ---------------------------------------------------

def test_plan_measures_speculative_rows_and_groups_cover_the_plan(tmp_path):
    s = runner.Settings()
    planned, pending = runner.plan(s)
    spec = [r for r in planned if r[0] == "spec_tps"]
    assert len(spec) == len(s.acceptances) * len(s.drafts) and all(r[2]["depth"] == 8192 for r in spec)
    mtp = [r for r in planned if r[0] == "spec_mtp_tps"]          # both engines, every depth (issue 28)
    assert sorted((r[1], r[2]["depth"], r[2]["drafts"]) for r in mtp) == \
        sorted([("llama.cpp", d, D) for d in (0, 8192, 30720) for D in (1, 2, 3, 4)]
               # ours also at D = 7: the chain with a budget-8 tree's verify budget
               + [("openjet", d, D) for d in (0, 8192, 30720) for D in (1, 2, 3, 4, 7)])
    trees = [r for r in planned if r[0] == "spec_tree_tps"]
    # trees at every depth: their target fills the state in one batched prefill (with its MTP rows)
    assert sorted((r[1], r[2]["depth"], r[2]["budget"], r[2]["shape"]) for r in trees) == \
        [("openjet", d, 8, "q") for d in (0, 8192, 30720)]
    accept = [r for r in planned if r[0] == "accepted_per_cycle"]
    assert {(r[2]["temperature"], r[2]["drafts"]) for r in accept} == {(t, d) for t in (0.0, 0.7) for d in (1, 2, 3, 4)}
    assert pending == []                                                # batched prefill is measured now
    pre = [r for r in planned if r[0] == "prefill_tps"]
    assert sorted((r[1], r[2]["new_tokens"], r[2]["depth"]) for r in pre) == \
        sorted((e, n, d) for e in ("openjet", "llama.cpp") for n, d in ((2700, 1800), (12000, 29500), (64, 4096)))
    run = runner.Run(settings=s, store=Store(tmp_path / "r", {"x": 1}), model=tmp_path / "m.gguf", cache=tmp_path,
                     deadline=None, session="t", arch="90")
    covered = {report.row_key(*r) for _, _, rows, _ in runner.groups(run) for r in rows}
    assert covered == {report.row_key(*r) for r in planned}
    names = [g[0] for g in runner.groups(run)]
    assert names.index("openjet acceptance") < names.index("openjet")   # cheap group before the long one


def test_child_protocol_merges_details_and_names_failures(tmp_path):
    """_run_child: results kept, skips marked with their reason, per-row details merged across
    lines and runs, and rows the child never reached marked with its error."""
    rows = [("spec_tps", "openjet", {"acceptance": a, "drafts": 2, "depth": 64}) for a in (0.5, 0.7, 0.8)]
    k = [report.row_key(*r) for r in rows]
    lines = [{"metric": "spec_tps", "engine": "openjet", "params": rows[0][2], "unit": "tokens/s", "samples": [1.0, 2.0]},
             {"info": {"spec_details": {k[0]: {"tokens_per_cycle": 1.5}}}},
             {"skip": {"metric": "spec_tps", "engine": "openjet", "params": rows[1][2]}, "reason": "boom: tensor x"},
             {"info": {"spec_details": {"other": {"tokens_per_cycle": 9}}, "openjet_n_ctx": 5}},
             {"error": "RuntimeError: the third row broke"}]
    script = tmp_path / "child.py"
    script.write_text("import json, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
                      f"lines = {json.dumps(lines)!r}\n"
                      "open(out, 'a').write(''.join(json.dumps(x) + '\\n' for x in json.loads(lines)))\nsys.exit(1)\n")
    st = Store(tmp_path / "r", {"x": 1})
    st.update_info(spec_details={"earlier": {"tokens_per_cycle": 3}})
    run = runner.Run(settings=runner.Settings(), store=st, model=tmp_path / "m", cache=tmp_path, deadline=None,
                     session="t", arch="90")
    made = runner._run_child(run, "ours", [sys.executable, str(script)], rows)
    assert made == {k[0]} and st.has(*rows[0])
    assert run.not_measured[k[1]] == "boom: tensor x"
    assert run.not_measured[k[2]] == "our engine failed: RuntimeError: the third row broke"
    assert set(st.info["spec_details"]) == {"earlier", k[0], "other"} and st.info["openjet_n_ctx"] == 5


def _spec_report() -> dict:
    rng = np.random.default_rng(3)
    spec_p = {"acceptance": 0.8, "drafts": 4, "depth": 8192}
    mtp_p = {"drafts": 4, "depth": 8192}
    acc_p = {"drafts": 4, "model": "trained default", "temperature": 0.0}
    results = [
        report.result("decode_tps", "openjet", {"depth": 8192}, rng.normal(45, 0.5, 6)),
        report.result("decode_tps", "llama.cpp", {"depth": 8192}, rng.normal(82, 0.5, 6)),
        report.result("roofline_tps", "openjet", {"depth": 8192}, rng.normal(278, 1, 10)),
        report.result("spec_tps", "openjet", spec_p, rng.normal(120, 2, 6)),
        report.result("spec_mtp_tps", "openjet", mtp_p, rng.normal(40, 1, 6)),
        report.result("accepted_per_cycle", "openjet", acc_p, rng.normal(2.4, 0.2, 12)),
    ]
    details = {report.row_key("spec_tps", "openjet", spec_p): {
                   "tokens_per_cycle": 3.36, "acceptance_at": [0.8, 0.79, 0.81, 0.8], "ms_per_cycle": [28.0, 28.5, 29.0],
                   "runs_differing_from_plain": 0, "reps": 6},
               report.row_key("spec_mtp_tps", "openjet", mtp_p): {
                   "tokens_per_cycle": 1.02, "acceptance_at": [0.02, 0.0, 0.0, 0.0], "ms_per_cycle": [40.0],
                   "runs_differing_from_plain": 1, "first_difference": 17, "reps": 6},
               report.row_key("accepted_per_cycle", "openjet", acc_p): {
                   "tokens_per_cycle": 2.41, "acceptance_at": [0.7, 0.5, 0.3, 0.2], "prompts": 12,
                   "greedy_prompts_differing_from_plain": 0}}
    man = {"gpu": {"name": "H200"}, "info": {"spec_details": details}, "pending": [],
           "not_measured": [{"metric": "spec_tps", "engine": "openjet", "params": {"acceptance": 0.9, "drafts": 4, "depth": 8192},
                             "reason": "out of time in this run"},
                            {"metric": "accepted_per_cycle", "engine": "openjet",
                             "params": {"drafts": 1, "model": "trained default", "temperature": 0.7},
                             "reason": "the native engine could not load default.gguf: tensor 'blk.0.x' (Q8_0)"}]}
    return {"manifest": man, "results": results}


def test_markdown_speculative_tables_compare_with_plain_decode_and_roofline():
    rep = json.loads(json.dumps(_spec_report()))
    report.validate_report(rep)
    md = report.markdown(rep)
    med = {(r["metric"], r["engine"]): r["median"] for r in rep["results"]}
    row = next(line for line in md.splitlines() if "| oracle, a = 0.8 |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["8192", "4", "oracle, a = 0.8"]
    assert cells[4] == "3.36" and cells[5] == "0.80 / 0.79 / 0.81 / 0.80" and cells[6] == "28.50"
    spec = med[("spec_tps", "openjet")]
    assert cells[7] == f"{spec / med[('decode_tps', 'openjet')]:.2f}×"
    assert cells[8] == f"{spec / med[('decode_tps', 'llama.cpp')]:.2f}×"
    assert cells[9] == f"{spec / med[('roofline_tps', 'openjet')]:.0%}" and cells[10] == "yes"
    mtp = next(line for line in md.splitlines() if "| MTP head |" in line)
    assert "1 of 6 runs differ (first at token 17)" in mtp
    acc = next(line for line in md.splitlines() if line.startswith("| 0.0 | 4 |"))
    assert "2.41" in acc and "12 of 12 prompts identical" in acc
    # rows not measured keep their reason, in their own table
    assert re.search(r"\| oracle, a = 0\.9 \| not measured \(\d\) \|", md)
    assert re.search(r"\| 0\.7 \| 1 \| not measured \(\d\) \|", md) and "tensor 'blk.0.x'" in md
    main_table = md.split("## Speculative")[0]
    assert "| spec_tps |" not in main_table and "| accepted_per_cycle |" not in main_table


def test_markdown_of_the_v1_report_still_renders():
    """A report of an earlier version (speculative rows pending) prints again."""
    rep = json.loads((REPO / "bench" / "results" / "2026-11-29-native-v1.json").read_text())
    report.validate_report(rep)
    md = report.markdown(rep)
    assert "- spec_tps (acceptance 0.5/0.7/0.8/0.9, drafts 1/2/3/4, depth 8192): pending: issue 6" in md
    assert "| decode_tps | depth 8192 |" in md


# --- prefill (issue 9): the rows, their FLOPs and the tensor-core share -------------------------------

def test_prefill_flops_of_the_27b_shapes_by_hand():
    from openjet_plugin.bench import prefill
    from openjet_plugin.config import PRESETS

    c = PRESETS["q27b"]
    E, F = 5120, 17408
    attn = E * 2 * 6144 + 2 * E * 1024 + 6144 * E                 # wq+gate, wk, wv, wo
    dn = E * 10240 + E * 6144 + 2 * E * 48 + 6144 * E             # qkv, gate, beta, alpha, ssm_out
    params = 64 * 3 * E * F + 16 * attn + 48 * dn
    assert prefill.projection_params(c) == params
    assert 24e9 < params < 25e9                                   # ~24.4B of the 27B multiply per token
    n, d = 12000, 29500
    attention = 4 * n * (d + (n + 1) / 2) * 256 * 24 * 16
    assert prefill.prefill_flops(c, n, d) == pytest.approx(2 * params * n + 2 * E * 248320 + attention, rel=1e-12)
    assert 0.15 < attention / prefill.prefill_flops(c, n, d) < 0.3     # attention matters at depth 29.5K
    # 2,000 tokens/s on 2,700 new tokens at depth 1,800: 2 * 24.4 GFLOP per token is ~10% of 989 TFLOP/s
    f = prefill.tensor_core_fraction(2000.0, prefill.prefill_flops(c, 2700, 1800), 2700, prefill.H200_BF16_DENSE_TFLOPS)
    assert f == pytest.approx(2000.0 / 2700 * prefill.prefill_flops(c, 2700, 1800) / 989e12) and 0.09 < f < 0.11
    assert prefill.peak_bf16_tflops("NVIDIA H200") == 989.0 and prefill.peak_bf16_tflops("Tesla T4") is None
    with pytest.raises(ValueError, match="new_tokens"):
        prefill.prefill_flops(c, 0, 10)


@pytest.mark.parametrize("text,needle", [("2700", "NEW_TOKENS:DEPTH"), ("a:1", "'a:1'"), ("0:5", "'0:5'"),
                                         ("10:-1", "'10:-1'")])
def test_prefill_rows_parse_errors_name_the_item(text, needle):
    from openjet_plugin.bench import prefill

    assert prefill.parse_rows("2700:1800, 12000:29500") == [(2700, 1800), (12000, 29500)]
    assert prefill.parse_rows("") == []
    with pytest.raises(ValueError, match=needle):
        prefill.parse_rows(text)


def test_our_engine_child_measures_prefill_rows(tmp_path, tiny_model, toy_native):
    """--prefill on the real NativeBackend over the toy engine: every timed append is one oj_prefill
    of N tokens from exactly the depth, with no MTP rows (the main model alone, as llama.cpp)."""
    from openjet_plugin.bench import ours, prefill

    out = tmp_path / "p.jsonl"
    rc = ours.main(["--model", str(tiny_model), "--out", str(out), "--verify", "", "--decode-depths", "",
                    "--prefill", "300:100,120:40,50:4", "--reps", "4"])
    assert rc == 0
    res, skips, lines = _child_lines(out)
    key = lambda n, d: report.row_key("prefill_tps", "openjet", {"new_tokens": n, "depth": d})  # noqa: E731
    assert list(skips) == [key(50, 4)] and "at least 8" in skips[key(50, 4)]
    assert set(res) == {key(300, 100), key(120, 40)}
    assert all(len(x["samples"]) == 4 and all(s > 0 for s in x["samples"]) for x in res.values())
    eng = toy_native[-1]
    timed = [(p, n) for p, n, _ in eng.prefills if n in (300, 120)]
    reps = 4 + prefill.PREFILL_WARMUP
    assert timed == [(40, 120)] * reps + [(100, 300)] * reps          # by depth, each from its checkpoint
    assert not any(follows for _, _, follows in eng.prefills) and eng.mtp_n_past == 0
    info = {k: v for x in lines if "info" in x for k, v in x["info"].items()}
    assert info["openjet_prefill_chunk"] == 2048 and "oj_prefill" in info["openjet_prefill_note"]


def test_prefill_group_runs_its_own_child_and_marks_what_it_missed(tmp_path, monkeypatch):
    calls = []

    def fake_child(run, tag, cmd, rows):
        calls.append((tag, cmd, rows))
        run.add(*rows[0], [100.0, 110.0, 105.0])
        return {report.row_key(*rows[0])}

    monkeypatch.setattr(runner, "_run_child", fake_child)
    s = runner.Settings.quick_run(prefill=((2700, 1800), (500, 100)))
    st = Store(tmp_path / "r", {"x": 1})
    run = runner.Run(settings=s, store=st, model=tmp_path / "m.gguf", cache=tmp_path, deadline=None, session="t",
                     arch="90")
    runner.group_ours_prefill(run)
    (tag, cmd, rows), = calls
    assert tag == "ours-prefill" and cmd[cmd.index("--prefill") + 1] == "2700:1800,500:100"
    assert cmd[cmd.index("--decode-depths") + 1] == "" and cmd[cmd.index("--verify") + 1] == ""
    assert rows == [("prefill_tps", "openjet", {"new_tokens": 2700, "depth": 1800}),
                    ("prefill_tps", "openjet", {"new_tokens": 500, "depth": 100})]
    runner.group_ours_prefill(run)                       # resumed: only the row still missing
    assert calls[-1][1][calls[-1][1].index("--prefill") + 1] == "500:100"


def test_markdown_prefill_table_has_ratio_and_tensor_core_share():
    from openjet_plugin.bench import prefill
    from openjet_plugin.config import PRESETS

    rng = np.random.default_rng(5)
    p = {"new_tokens": 2700, "depth": 1800}
    results = [report.result("prefill_tps", "openjet", p, rng.normal(6000, 50, 6)),
               report.result("prefill_tps", "llama.cpp", p, rng.normal(2400, 20, 6))]
    s = runner.Settings(prefill=((2700, 1800), (12000, 29500)))
    man = {"gpu": {"name": "NVIDIA H200"}, "pending": [], "not_measured": [],
           "prefill": runner.prefill_manifest(PRESETS["q27b"], s, "NVIDIA H200")}
    rep = json.loads(json.dumps({"manifest": man, "results": results}))
    report.validate_report(rep)
    md = report.markdown(rep)
    assert "## Prefill" in md and "989 TFLOP/s" in md
    med = {r["engine"]: r["median"] for r in rep["results"]}
    flops = prefill.prefill_flops(PRESETS["q27b"], 2700, 1800)
    row = next(line for line in md.splitlines() if line.startswith("| 2,700 | 1,800 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == f"{med['openjet'] / med['llama.cpp']:.2f}×" and cells[5] == f"{flops / 1e12:.2f}"
    assert cells[6] == f"{med['openjet'] / 2700 * flops / 989e12:.1%}"
    assert cells[7] == f"{med['llama.cpp'] / 2700 * flops / 989e12:.1%}"
    other = next(line for line in md.splitlines() if line.startswith("| 12,000 | 29,500 |"))
    assert "—" in other                                  # not measured: no share invented
    unknown = runner.prefill_manifest(PRESETS["q27b"], s, "Tesla T4")
    assert unknown["bf16_dense_tflops"] is None and "Tesla T4" in unknown["peak_source"]


def test_rows_left_out_by_only_are_listed_not_failed(tmp_path, monkeypatch, tiny_model):
    """--only: the selected groups measured in full exit 0; the rows of the other groups are listed
    as not selected (not as failures, which would exit EXIT_INCOMPLETE_FAILED); a selected group
    that fails still fails the run."""
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    rng = np.random.default_rng(1)
    real_groups = runner.groups
    broken = {"on": False}

    def fake_groups(run):
        out = []
        for name, need, rows, _ in real_groups(run):
            def fn(run, rows=rows, name=name):
                if broken["on"] and name == "openjet prefill":
                    raise ValueError("measurement failed")
                for metric, engine, params in run.missing(rows):
                    run.add(metric, engine, params, rng.normal(100, 1, run.settings.reps))
            out.append((name.replace("llama.cpp", "fake llama.cpp"), 0.0, rows, fn))
        return out

    monkeypatch.setattr(runner, "groups", fake_groups)
    base = ["--model", str(tiny_model), "--quick", "--cache-dir", str(tmp_path / "cache"),
            "--sdist", str(tmp_path / "missing.tar.gz"), "--only", "openjet prefill"]
    rc = runner.main(base + ["--resume", str(tmp_path / "r1"), "--json", str(tmp_path / "1.json")])
    assert rc == 0
    got = json.loads((tmp_path / "1.json").read_text())
    reasons = {m["reason"] for m in got["manifest"]["not_measured"]}
    assert reasons == {runner.NOT_SELECTED}
    assert {r["metric"] for r in got["results"]} == {"prefill_tps"}
    # --no-peer too: the peer's rows are asked not to be measured (listed with that reason, exit 0)
    rc = runner.main(base + ["--no-peer", "--resume", str(tmp_path / "r3"), "--json", str(tmp_path / "3.json")])
    assert rc == 0
    got = json.loads((tmp_path / "3.json").read_text())
    assert runner.NO_PEER in {m["reason"] for m in got["manifest"]["not_measured"]}
    broken["on"] = True
    rc = runner.main(base + ["--resume", str(tmp_path / "r2"), "--json", str(tmp_path / "2.json")])
    assert rc == runner.EXIT_INCOMPLETE_FAILED


def test_only_and_prefill_options_parse_and_refuse_bad_values():
    from openjet_plugin.bench import runner

    args = runner.parser().parse_args(["--only", "openjet prefill, llama.cpp prefill", "--prefill", "2700:1800,12000:29500"])
    assert args.only == ("openjet prefill", "llama.cpp prefill")
    assert args.prefill == ((2700, 1800), (12000, 29500))
    for bad in ("12000", "a:b", "0:5", "5:-1", ","):
        with pytest.raises(SystemExit):
            runner.parser().parse_args(["--prefill", bad])
    for bad in (" , ", "card,=", " = "):
        with pytest.raises(SystemExit):
            runner.parser().parse_args(["--only", bad])
    # an item ending in "=" selects that exact group; others select by prefix
    only = runner.parser().parse_args(["--only", "card,openjet=,llama.cpp decode"]).only
    names = ["card", "openjet acceptance", "openjet prefill", "openjet", "llama.cpp decode", "llama.cpp verify"]
    assert [n for n in names if runner.selected(n, only)] == ["card", "openjet", "llama.cpp decode"]
    assert [n for n in names if runner.selected(n, ("openjet",))] == ["openjet acceptance", "openjet prefill", "openjet"]


@pytest.mark.parametrize("value", ["0.0-8", "0.0:eight", "warm:8"])
def test_a_bad_accept_trees_item_is_refused_by_name(tmp_path, capsys, value):
    """--accept-trees takes TEMPERATURE:BUDGET items; anything else stops the child before any
    model is loaded, naming the option, the expected form and the item."""
    from openjet_plugin.bench import ours
    from openjet_plugin.defaults import SHIPPED_DEFAULT

    out = tmp_path / "a.jsonl"
    assert ours.main(["--model", str(SHIPPED_DEFAULT), "--out", str(out), "--accept-trees", value]) != 0
    err = capsys.readouterr().err
    assert "--accept-trees: expected VALUE:BUDGET items" in err and repr(value) in err
    assert not out.exists() or "metric" not in out.read_text()


def test_a_verify_row_fits_the_context_the_bench_sizes():
    """bench/ours.py sizes n_ctx for a verify row by verify_row_positions; the row's passes
    (verify_samples, then profiled_samples: profiled and host-time-only) append without a restore.
    A stand-in backend counts what they append and refuses past the context, as the engine does
    (the 8-position profile overflowed a 1,136-position context on the GPU before: session 24)."""
    from openjet_plugin.bench import ours

    class Counting:
        n_vocab = 100

        def __init__(self, n_ctx: int):
            self.n_ctx, self.n_past, self.host = n_ctx, 0, False

        def eval_pass_argmax(self, toks):
            if self.n_past + len(toks) > self.n_ctx:
                raise RuntimeError(f"{self.n_past + len(toks)} tokens do not fit {self.n_ctx}")
            self.n_past += len(toks)
            return 0

        def profile(self, on, host_only=False):
            self.host = host_only

        def profile_read(self):
            phases = [{"name": n, "calls": 1, "launches": 1, "ms": 0.1, "bytes": 10**6} for n in ours.PROJECTION_PHASES]
            return {"passes": 1, "span_ms": 1.0, "host_ms": 0.1, "phases": phases}

    rng = np.random.default_rng(0)
    for reps in (1, 5):
        for p in (1, 5, 8, 16):
            be = Counting(ours.verify_row_positions(p, reps))
            ours.verify_samples(be, p, reps, rng)
            ours.profiled_samples(be, p, reps, rng)
            assert be.n_past == be.n_ctx, (reps, p, be.n_past)
