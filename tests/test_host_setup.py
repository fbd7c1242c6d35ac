"""The first run on any host (issue 24): instruction sets probed in child processes and cached,
llama.cpp configured from the verdicts (no AMX buffers where AMX faults), the native build skipped
without a GPU, llama.cpp placed on the GPU where there is one, a model of another architecture run
by llama.cpp through every adapter, and `openjet doctor` saying which backend runs, where and why."""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys

import pytest

from openjet_plugin import build_native, cpu_features, setup_llama
from openjet_plugin.backends import llama_cpp as llama_backend
from openjet_plugin.defaults import default_model_path

X86 = platform.machine().lower() in ("x86_64", "amd64")
UD2_RET = bytes.fromhex("0f0bc3")       # ud2: an instruction no x86 processor runs


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENJET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_features.FORCE_ENV, raising=False)
    return tmp_path


# --- the probe ------------------------------------------------------------------------------------

@pytest.mark.skipif(not X86, reason="the probes are x86-64 machine code")
def test_faulting_instruction_is_a_verdict_not_a_crash():
    ok, why = cpu_features.probe("fault", code=UD2_RET)
    assert not ok and "SIGILL" in why
    # the same code in this process would have killed it; the probe ran it in a child
    child = subprocess.run([sys.executable, "-m", "openjet_plugin.cpu_features", "--probe", "x", UD2_RET.hex()])
    assert child.returncode == -signal.SIGILL


@pytest.mark.skipif(not X86, reason="the probes are x86-64 machine code")
def test_real_probes_run_in_a_child_and_are_cached(cache_dir):
    flags = cpu_features.cpu_flags()
    verdicts = cpu_features.host_verdicts()
    for name, (needs, _) in cpu_features.PROBES.items():
        v = verdicts[name]
        assert v.advertised == all(f in flags for f in needs), name
        assert not v.usable or v.advertised
    if "avx2" in flags:     # every x86-64 CI host of this project has it
        assert verdicts["avx2"].usable and "probe process" in verdicts["avx2"].why
    cache = list(cache_dir.glob("cpu-*.json"))
    assert len(cache) == 1
    stored = json.loads(cache[0].read_text())
    assert set(stored) == {n for n, v in verdicts.items() if v.advertised}
    again = cpu_features.host_verdicts()
    assert all(again[n].usable == verdicts[n].usable for n in verdicts)
    assert all(again[n].why.endswith("(cached)") for n in stored)


def test_cached_verdict_is_used_and_forcing_off_wins(cache_dir, monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: {"avx2", "amx_tile", "amx_int8", "amx_bf16"})
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    key = cpu_features.host_key()
    # a verdict an earlier run left: AMX advertised but faulting; the probe must not run again
    (cache_dir / f"cpu-{key}.json").write_text(json.dumps({
        "avx2": {"usable": True, "why": "ran"}, "amx": {"usable": False, "why": "killed (SIGILL)"}}))
    monkeypatch.setattr(cpu_features, "probe", lambda *a, **k: pytest.fail("probed although cached"))
    v = cpu_features.host_verdicts()
    assert v["avx2"].usable and not v["amx"].usable and v["amx"].advertised
    assert cpu_features.amx_faults()
    monkeypatch.setenv(cpu_features.FORCE_ENV, "avx2")
    v = cpu_features.host_verdicts()
    assert not v["avx2"].usable and cpu_features.FORCE_ENV in v["avx2"].why


def test_llama_build_options_follow_the_verdicts():
    V = cpu_features.FeatureVerdict
    verdicts = {n: V(n, True, n in ("avx2", "fma", "f16c", "bmi2"), "") for n in cpu_features.PROBES}
    args = cpu_features.ggml_cmake_args(verdicts)
    assert "-DGGML_NATIVE=OFF" in args      # never the compiler's view of the advertised set
    assert "-DGGML_AVX2=ON" in args and "-DGGML_FMA=ON" in args
    assert "-DGGML_AVX512=OFF" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    # a host that runs only part of the set gets only that part; AVX-512 / AMX stay out even where
    # they run (the build the agreement suite validates)
    partial = {n: V(n, True, n == "avx2", "") for n in cpu_features.PROBES}
    assert "-DGGML_FMA=OFF" in cpu_features.ggml_cmake_args(partial)
    everything = {n: V(n, True, True, "") for n in cpu_features.PROBES}
    args = cpu_features.ggml_cmake_args(everything)
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AMX_INT8=OFF" in args and "-DGGML_AVX2=ON" in args


def test_setup_config_is_keyed_and_uses_cuda_only_with_a_gpu(monkeypatch, cache_dir):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(setup_llama, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(setup_llama, "local_gpu_archs", lambda: [])
    cpu_only = setup_llama.build_config()
    assert not any("GGML_CUDA" in a for a in cpu_only["cmake_args"]) and "no GPU" in cpu_only["gpu"]
    assert "-DGGML_NATIVE=OFF" in cpu_only["cmake_args"]
    monkeypatch.setattr(setup_llama, "local_gpu_archs", lambda: ["90"])
    gpu = setup_llama.build_config()
    assert "-DGGML_CUDA=ON" in gpu["cmake_args"] and "-DCMAKE_CUDA_ARCHITECTURES=90" in gpu["cmake_args"]
    assert gpu["key"] != cpu_only["key"]
    # a user's CMAKE_ARGS come last (they win) and are part of the key: no stale wheel comes back
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_BLAS=ON")
    user = setup_llama.build_config()
    assert user["cmake_args"][-1] == "-DGGML_BLAS=ON" and user["key"] != gpu["key"]


# --- the guard in the backend -----------------------------------------------------------------------

@pytest.mark.parametrize("faults", [True, False])
def test_backend_turns_amx_buffers_off_where_amx_faults(monkeypatch, faults):
    monkeypatch.setattr(cpu_features, "amx_faults", lambda: faults)
    be = llama_backend.LlamaCppBackend(default_model_path(), 64, n_layers=None)
    try:
        assert be.extra_buffers is (not faults)
        assert bool(be._llm.model_params.use_extra_bufts) is (not faults)
        logits = be.eval(be.tokenize(b"def parse_args(", False, True))
        assert logits.shape == (be.n_vocab,) and logits.std() > 0
    finally:
        be.close()
    import llama_cpp.llama_cpp as low
    assert low.llama_model_default_params().use_extra_bufts     # the patch did not outlive the load


class _FakeLlamaCpp:
    def __init__(self, offload: bool):
        self.offload = offload

    def llama_supports_gpu_offload(self):
        return self.offload


def test_gpu_placement(monkeypatch, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (4 << 20))
    size = 4 << 20
    reserve = llama_backend.GPU_RESERVE_BYTES
    monkeypatch.setattr(llama_backend.gpus, "first_gpu", lambda: None)
    p = llama_backend.gpu_placement(_FakeLlamaCpp(True), model, 10)
    assert p.n_gpu_layers == 0 and "no NVIDIA GPU" in p.where
    monkeypatch.setattr(llama_backend.gpus, "first_gpu", lambda: ("Test GPU", reserve + 2 * size))
    p = llama_backend.gpu_placement(_FakeLlamaCpp(True), model, 10)
    assert p.n_gpu_layers == -1 and "every layer" in p.where
    p = llama_backend.gpu_placement(_FakeLlamaCpp(False), model, 10)
    assert p.n_gpu_layers == 0 and "no GPU support" in p.where
    monkeypatch.setattr(llama_backend.gpus, "first_gpu", lambda: ("Test GPU", reserve + size // 2))
    p = llama_backend.gpu_placement(_FakeLlamaCpp(True), model, 10)
    assert p.n_gpu_layers == 5 and "5 of 10" in p.where
    monkeypatch.setattr(llama_backend.gpus, "first_gpu", lambda: ("Test GPU", reserve // 2))
    assert llama_backend.gpu_placement(_FakeLlamaCpp(True), model, 10).n_gpu_layers == 0


# --- the native build without a GPU ---------------------------------------------------------------

def test_native_build_skipped_without_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(build_native.ARCH_ENV, raising=False)
    monkeypatch.setattr(build_native, "local_gpu_archs", lambda: [])
    monkeypatch.setattr(build_native, "build", lambda *a, **k: pytest.fail("compiled without a GPU"))
    assert build_native.main(["--out-dir", str(tmp_path), "--if-stale"]) == 0
    err = capsys.readouterr().err
    assert "no NVIDIA GPU visible" in err and f"{build_native.ARCH_ENV}=90" in err


def test_native_build_if_stale_keys_on_architectures(monkeypatch, tmp_path, capsys):
    (tmp_path / build_native.LIB_NAME).write_bytes(b"lib")
    build_native.stamp_path(tmp_path).write_text(build_native._stamp_text(["90"]) + "\n")
    monkeypatch.setenv(build_native.ARCH_ENV, "90")
    monkeypatch.setattr(build_native, "build", lambda *a, **k: pytest.fail("rebuilt a current library"))
    assert build_native.main(["--out-dir", str(tmp_path), "--if-stale"]) == 0
    assert "is current" in capsys.readouterr().err
    built = []
    monkeypatch.setenv(build_native.ARCH_ENV, "86")
    monkeypatch.setattr(build_native, "build", lambda out, archs: built.append(archs))
    assert build_native.main(["--out-dir", str(tmp_path), "--if-stale"]) == 0
    assert built == [["86"]]


# --- another architecture through every adapter ------------------------------------------------------

@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    from openjet_plugin.testing.foreign import write_llama_gguf

    path = tmp_path_factory.mktemp("foreign") / "tiny-llama.gguf"
    write_llama_gguf(path)
    return path


def test_other_architecture_runs_on_llama_cpp(llama_model):
    import openjet_plugin
    from openjet_plugin.errors import BackendUnavailableError

    eng = openjet_plugin.load(llama_model, n_ctx=256)
    try:
        assert eng.backend_name == "llama.cpp"
        assert "'llama' model" in eng.backend_reason and "llama.cpp runs on the" in eng.backend_reason
        r = eng.generate("def f(", max_tokens=6, temperature=0)
        assert len(r.tokens) == 6 or r.finish_reason == "stop"
        assert eng.chat([{"role": "user", "content": "hi"}], max_tokens=4).stats.generated_tokens >= 1
    finally:
        eng.close()
    with pytest.raises(BackendUnavailableError, match="'llama' model"):
        openjet_plugin.load(llama_model, n_ctx=256, backend="native")


def test_other_architecture_through_every_adapter(llama_model):
    from langchain_core.messages import HumanMessage

    from openjet_plugin.adapters._shared import close_shared_engines
    from openjet_plugin.adapters.langchain import ChatOpenJet
    from openjet_plugin.adapters.litellm import OpenJetProvider
    from openjet_plugin.adapters.llama_cpp import Llama

    try:
        chat = ChatOpenJet(model=str(llama_model), max_tokens=4, temperature=0, n_ctx=256)
        msg = chat.invoke([HumanMessage("hi")])
        assert msg.usage_metadata["output_tokens"] >= 1

        import litellm
        provider = OpenJetProvider()
        litellm.custom_provider_map = [{"provider": "openjet", "custom_handler": provider}]
        resp = litellm.completion(model=f"openjet/{llama_model}", max_tokens=4, temperature=0,
                                  messages=[{"role": "user", "content": "hi"}])
        assert resp.usage.completion_tokens >= 1

        llm = Llama(model_path=str(llama_model), n_ctx=256, verbose=False)
        out = llm("def f(", max_tokens=4, temperature=0)
        assert out["usage"]["completion_tokens"] >= 1
        llm.close()
    finally:
        close_shared_engines()


# --- openjet doctor ---------------------------------------------------------------------------------

def _doctor_rows(capsys, argv):
    from openjet_plugin import cli

    rc = cli.main(["doctor", *argv])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        key, _, value = line.partition("  ")
        rows[key.strip()] = value.strip()
    return rc, rows, out


def test_doctor_without_gpu(monkeypatch, capsys, cache_dir):
    monkeypatch.setattr(llama_backend.gpus, "first_gpu", lambda: None)
    rc, rows, out = _doctor_rows(capsys, [])
    assert rc == 0, out
    assert rows["llama.cpp runs here"].startswith("yes: a one-token decode")
    assert rows["backend=auto runs"].startswith("llama.cpp on the CPU"), out
    assert "cpu: llama.cpp uses" in rows


def test_doctor_forced_unsupported_and_supported_verdicts(monkeypatch, capsys, cache_dir):
    from openjet_plugin.backends import select

    monkeypatch.setattr(select, "native_verdict", lambda mf, n_ctx, kv_type="f16", n_slots=1: (False, "forced: sm_75 is too old"))
    rc, rows, out = _doctor_rows(capsys, [])
    assert "forced: sm_75 is too old" in rows["native backend"]
    assert rows["backend=auto runs"].startswith("llama.cpp on the") and "forced: sm_75" in rows["backend=auto runs"]
    monkeypatch.setattr(select, "native_verdict", lambda mf, n_ctx, kv_type="f16", n_slots=1: (True, "native CUDA engine on Test GPU"))
    rc, rows, out = _doctor_rows(capsys, [])
    assert rc == 0 and rows["backend=auto runs"].startswith("native on the GPU"), out


def test_doctor_other_architecture(llama_model, capsys, cache_dir):
    rc, rows, out = _doctor_rows(capsys, ["--model", str(llama_model)])
    assert rc == 0, out
    assert "'llama' model" in rows["native backend"]
    assert rows["backend=auto runs"].startswith("llama.cpp on the")


def test_doctor_says_when_llama_cpp_does_not_run(monkeypatch, capsys, cache_dir):
    monkeypatch.setattr(llama_backend, "check_runs", lambda model: (False, "the one-token decode was killed by SIGILL"))
    rc, rows, out = _doctor_rows(capsys, [])
    assert rc == 1 and rows["llama.cpp runs here"].startswith("NO:") and "SIGILL" in out
    assert rows["backend=auto runs"].startswith("nothing: it would be llama.cpp, which does not run here"), out


def test_fallback_bench_child_measures_the_llama_cpp_backend(tmp_path):
    from openjet_plugin.bench import report

    out = tmp_path / "fallback.jsonl"
    subprocess.run([sys.executable, "-m", "openjet_plugin.bench.fallback", "--model", str(default_model_path()),
                    "--tokens", "4", "--reps", "2", "--out", str(out)], check=True, timeout=300)
    objs = [json.loads(line) for line in out.read_text().splitlines()]
    row = next(o for o in objs if "metric" in o)
    assert row["metric"] == "fallback_decode_tps" and len(row["samples"]) == 2 and min(row["samples"]) > 0
    info = next(o for o in objs if "info" in o)["info"]["fallback"]
    assert info["where"].startswith(("CPU", "GPU")) and isinstance(info["n_gpu_layers"], int)
    r = report.result(row["metric"], "llama.cpp", row["params"], row["samples"])
    assert r["median"] > 0


def test_llama_cpp_loads_with_the_cpp_runtime_global_after_numpy():
    """numpy first (it links libstdc++, loaded RTLD_LOCAL), then llama.cpp: import_llama_cpp puts
    libstdc++ in the global scope before libllama loads, so libllama cannot bind its stream calls
    to libggml-cuda's copies (a CUDA build crashed in llama_model::print_info that way on the H100
    machine). A plain `import llama_cpp` leaves it local; the check tells the two apart."""
    code = """
import ctypes, json, numpy
sym = '_ZNSo9_M_insertIlEERSoT_'          # std::ostream::_M_insert<long>, what print_info called
plain = %s
if plain:
    import llama_cpp
else:
    from openjet_plugin.backends.llama_cpp import import_llama_cpp
    llama_cpp = import_llama_cpp()
print(json.dumps({"global": hasattr(ctypes.CDLL(None), sym), "module": llama_cpp.__name__}))
"""
    seen = {}
    for plain in (True, False):
        out = subprocess.run([sys.executable, "-c", code % plain], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen[plain] = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen[False] == {"global": True, "module": "llama_cpp"}
    assert seen[True]["global"] is False, "a plain import already made libstdc++ global here: the check proves nothing"
