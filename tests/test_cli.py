"""The `openjet` command: generate (with the embedded default model), chat, info, doctor, and the
delegated subcommands; user errors are one line and an exit code, never a traceback."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from openjet_plugin import cli, defaults


@pytest.fixture(scope="module")
def model(synth_path):
    return synth_path("tiny", "Q8_0")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("openjet-cache")


def openjet(*args, cache_dir=None, stdin: str | None = None, timeout=240):
    env = dict(os.environ, OPENJET_THREADS="1")
    if cache_dir is not None:
        env["OPENJET_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "openjet_plugin.cli", *map(str, args)], input=stdin,
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_generate_with_nothing_but_a_prompt_uses_the_embedded_default(cache_dir):
    """The acceptance command: no model, no backend, nothing but the prompt."""
    r = openjet("generate", "def fibonacci(n):", "--max-tokens", "32", cache_dir=cache_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text on stdout"
    assert "tok/s" in r.stderr and "prompt" in r.stderr             # the final stats line
    assert "Traceback" not in r.stderr
    if defaults.SHIPPED_DEFAULT.is_file():
        assert f"model {defaults.SHIPPED_DEFAULT}," in r.stderr
        return
    assert "generating the default model" in r.stderr               # first run in this cache
    assert "llama_model_quantize" not in r.stderr                   # quantiser chatter stays hidden
    assert [p.name for p in cache_dir.iterdir() if p.suffix == ".gguf"]
    # the second run reuses the file
    r2 = openjet("generate", "def fibonacci(n):", "--max-tokens", "8", "--temperature", "0", cache_dir=cache_dir)
    assert r2.returncode == 0 and "generating the default model" not in r2.stderr


def test_backend_choices_on_this_machine(model, cache_dir):
    greedy = ("--max-tokens", "12", "--temperature", "0")
    a = openjet("generate", "Hello", "-m", model, "--backend", "llama.cpp", *greedy)
    assert a.returncode == 0, a.stderr
    assert "backend llama.cpp (llama.cpp requested" in a.stderr
    b = openjet("generate", "Hello", "-m", model, "--backend", "auto", *greedy)
    assert b.returncode == 0, b.stderr
    if "backend native" not in b.stderr:               # a GPU-less machine: auto says why not native
        assert "backend llama.cpp (native backend unavailable:" in b.stderr
        assert b.stdout == a.stdout
        c = openjet("generate", "Hello", "-m", model, "--backend", "native", *greedy)
        assert c.returncode == 1
        assert "openjet: error: backend='native' is not available:" in c.stderr
        assert "Traceback" not in c.stderr and c.stdout == ""


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--min-p", "3"], "min_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--repeat-penalty", "0"], "repeat_penalty"),
    (["--n-ctx", "5"], "n_ctx"),
    (["--draft-depth", "9"], "draft_depth"),
])
def test_bad_parameters_are_one_line_errors(model, capsys, args, needle):
    rc = cli.main(["generate", "x", "-m", str(model), *args])
    err = capsys.readouterr().err
    assert rc == 1 and f"openjet: error: {needle}" in err and "Traceback" not in err


def test_bad_model_paths(tmp_path, capsys):
    assert cli.main(["generate", "x", "-m", str(tmp_path / "missing.gguf")]) == 1
    assert "missing.gguf" in capsys.readouterr().err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 64)
    assert cli.main(["generate", "x", "-m", str(junk)]) == 1
    assert "junk.gguf" in capsys.readouterr().err
    assert cli.main(["info", str(tmp_path / "missing.gguf")]) == 1
    assert "missing.gguf" in capsys.readouterr().err
    assert cli.main(["info", str(junk)]) == 1               # described, with a failing verdict
    assert "NOT USABLE" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["generate"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        cli.main(["generate", "x", "--backend", "vulkan"])
    assert ei.value.code == 2
    assert cli.main([]) == 2


def test_info_prints_the_description(model, capsys):
    assert cli.main(["info", str(model)]) == 0
    out = capsys.readouterr().out
    assert "qwen35" in out and "verdict: OK" in out and "Q8_0" in out


def test_doctor_says_which_backend_auto_picks_and_why(model, capsys):
    assert cli.main(["doctor", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    for row in ("python", "platform", "GPU", "CUDA toolkit", "cpu: llama.cpp uses", "llama.cpp runs here",
                "native backend", "backend=auto runs"):
        assert row in out
    runs = [line for line in out.splitlines() if line.startswith("backend=auto runs")][0]
    assert "llama.cpp on the " in runs or "native on the GPU (" in runs


def _per_slot_formula(c, n_ctx: int, value_bytes: float) -> tuple[int, int]:
    """llama.cpp's memory of one sequence, written out: (KV cache, recurrent state)."""
    kv = len(c.attention_layers()) * 2 * (c.n_head_kv * c.head_dim) * n_ctx * value_bytes
    conv = c.ssm_conv_dim * (c.ssm_conv_kernel - 1)
    state = c.ssm_dt_rank * c.ssm_d_state * c.ssm_d_state
    return int(kv), len(c.deltanet_layers()) * (conv + state) * 4


@pytest.mark.parametrize("slots,n_ctx,kv_type", [(None, 4096, "f16"), (2, 1024, "f16"), (7, 512, "q8_0")])
def test_serving_memory_on_llama_cpp_is_the_formula(model, slots, n_ctx, kv_type):
    from openjet_plugin.backends.llama_cpp import MAX_CHECKPOINTS, compute_memory
    from openjet_plugin.model_file import open_model
    from openjet_plugin.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES

    with open_model(model) as mf:
        plan = cli.serving_memory(mf, "llama.cpp", n_ctx, slots, kv_type, on_gpu=False)
        weights = sum(t.n_bytes for t in mf.tensors.values())
        kv, state = _per_slot_formula(mf.config, n_ctx, {"f16": 2, "q8_0": 34 / 32}[kv_type])
        # a quantised KV cache runs with flash attention (backends/llama_cpp.py)
        buffers = compute_memory(mf.config, n_ctx, flash_attn=kv_type != "f16", on_gpu=False,
                                 n_tensors=len(mf.tensors))
    want_slots = 4 if slots is None else slots                     # serve's default on llama.cpp
    assert plan.slots == want_slots and plan.n_ctx == n_ctx
    # on the CPU the recurrent checkpoints (host copies of the state) are in the same memory
    assert plan.per_slot == {"kv_cache": kv, "recurrent_state": state, "checkpoints": MAX_CHECKPOINTS * state}
    assert plan.once == {"weights": weights, "buffers": buffers} and plan.host_per_slot == {}
    assert plan.total == weights + buffers + want_slots * (kv + (1 + MAX_CHECKPOINTS) * state)
    assert plan.prefix_cache == DEFAULT_PREFIX_CACHE_BYTES          # several slots: the engine's default
    assert weights <= os.path.getsize(model) < weights + (1 << 20)      # the tensors are the file
    rows = dict(plan.rows())
    assert rows["serving"] == f"{want_slots} slots x {n_ctx} context on llama.cpp"
    assert rows["memory"].endswith(" per slot") and f"once + {want_slots} x (KV cache " in rows["memory"]
    assert rows["prefix cache"].startswith("up to 2.0 GiB of host memory")


def test_serving_memory_on_a_gpu_puts_checkpoints_in_host_memory(model):
    from openjet_plugin.backends.llama_cpp import MAX_CHECKPOINTS, compute_memory
    from openjet_plugin.model_file import _human_bytes, open_model

    with open_model(model) as mf:
        plan = cli.serving_memory(mf, "llama.cpp", 2048, 2, on_gpu=True, prefix_cache_bytes=0)
        kv, state = _per_slot_formula(mf.config, 2048, 2)
        buffers = compute_memory(mf.config, 2048, flash_attn=True, on_gpu=True)     # flash attention on a GPU
    assert plan.per_slot == {"kv_cache": kv, "recurrent_state": state}
    assert plan.host_per_slot == {"checkpoints": MAX_CHECKPOINTS * state}
    assert plan.once["buffers"] == buffers and plan.prefix_cache == 0
    rows = dict(plan.rows())
    assert rows["host memory"] == (f"{_human_bytes(2 * MAX_CHECKPOINTS * state)} = 2 x (recurrent checkpoints "
                                   f"{_human_bytes(MAX_CHECKPOINTS * state)}) per slot")
    assert rows["prefix cache"].startswith("none (--prefix-cache-mb N")


def test_serving_memory_prefix_cache_budget(model):
    from openjet_plugin.model_file import open_model

    with open_model(model) as mf:
        assert cli.serving_memory(mf, "llama.cpp", 512, 1, on_gpu=False).prefix_cache == 0   # one slot: none
        assert cli.serving_memory(mf, "llama.cpp", 512, 1, prefix_cache_bytes=5 << 20, on_gpu=False).prefix_cache == 5 << 20
        assert cli.serving_memory(mf, "llama.cpp", 512, 4, prefix_cache_bytes=0, on_gpu=False).prefix_cache == 0
        # the native engine copies no sequence state: no prefix cache whatever is asked
        native = cli.serving_memory(mf, "native", 512, 1, prefix_cache_bytes=5 << 20)
        assert native.prefix_cache == 0 and "native engine" in dict(native.rows())["prefix cache"]
        for bad in (-1, 1.5, True, "64"):
            with pytest.raises(ValueError, match="prefix_cache_bytes"):
                cli.serving_memory(mf, "llama.cpp", 512, 2, prefix_cache_bytes=bad)


def test_serving_memory_on_native_is_its_estimate_for_the_slots(model):
    """The native engine of 4 sequences: each slot its KV cache, recurrent state and checkpoint
    slots; the plan's total is the engine's own estimate for n_seq 4 (issue 29)."""
    from openjet_plugin.backends.native import N_CHECKPOINTS, estimate_device_bytes
    from openjet_plugin.model_file import open_model

    with open_model(model) as mf:
        plan = cli.serving_memory(mf, "native", 2048, 4)
        one, est = estimate_device_bytes(mf, 2048), estimate_device_bytes(mf, 2048, n_seq=4)
    _, state = _per_slot_formula(mf.config, 2048, 2)
    assert plan.slots == 4 and dict(plan.rows())["serving"] == "4 slots x 2048 context on native"
    assert plan.per_slot == {"kv_cache": one["kv_cache"], "recurrent_state": one["recurrent_state"],
                             "checkpoints": one["checkpoints"]}
    # a checkpoint slot: the recurrent state and the hidden at n_past
    assert one["checkpoints"] == N_CHECKPOINTS * (state + mf.config.n_embd * 4)
    assert plan.total == est["total"] == est["weights"] + est["activations"] + est["prefill"] + 4 * sum(plan.per_slot.values())


def test_info_reports_native_slots_before_loading(model, capsys, monkeypatch):
    from openjet_plugin.backends import select
    from openjet_plugin.backends.native import estimate_device_bytes
    from openjet_plugin.model_file import _human_bytes, open_model

    asked = []

    def verdict(mf, n_ctx, kv_type="f16", n_slots=1):
        asked.append(n_slots)
        return True, "test: native"
    monkeypatch.setattr(select, "native_verdict", verdict)
    with open_model(model) as mf:
        total = estimate_device_bytes(mf, 2048, n_seq=3)["total"]
    assert cli.main(["info", str(model), "--slots", "3", "--n-ctx", "2048"]) == 0
    out = capsys.readouterr().out
    assert "serving: 3 slots x 2048 context on native" in out and f"memory: {_human_bytes(total)} = weights " in out
    assert cli.main(["info", str(model), "--n-ctx", "2048"]) == 0
    assert "serving: 4 slots x 2048 context on native" in capsys.readouterr().out
    assert asked == [3, None]                  # the verdict is asked for the slots it will serve


def test_info_and_doctor_report_slots_context_and_memory(model, capsys, monkeypatch):
    from openjet_plugin.backends import select
    from openjet_plugin.backends.llama_cpp import MAX_CHECKPOINTS, compute_memory
    from openjet_plugin.model_file import _human_bytes, open_model

    # the backend auto picks decides the numbers: make it llama.cpp on the CPU on any machine
    monkeypatch.setattr(select, "native_verdict", lambda *a, **k: (False, "test: no native"))
    monkeypatch.setattr(cli, "_llama_cpp_on_gpu", lambda: False)
    with open_model(model) as mf:
        c, weights, n_tensors = mf.config, sum(t.n_bytes for t in mf.tensors.values()), len(mf.tensors)
    kv, state = _per_slot_formula(c, 2048, 2)
    buffers = compute_memory(c, 2048, flash_attn=False, on_gpu=False, n_tensors=n_tensors)
    total = _human_bytes(weights + buffers + 3 * (kv + (1 + MAX_CHECKPOINTS) * state))

    assert cli.main(["info", str(model), "--slots", "3", "--n-ctx", "2048"]) == 0
    out = capsys.readouterr().out
    assert "serving: 3 slots x 2048 context on llama.cpp" in out
    assert (f"memory: {total} = weights {_human_bytes(weights)} + working buffers {_human_bytes(buffers)} once "
            f"+ 3 x (KV cache {_human_bytes(kv)} + recurrent state {_human_bytes(state)} + recurrent checkpoints "
            f"{_human_bytes(MAX_CHECKPOINTS * state)}) per slot") in out
    # the prefix cache is host memory, on its own line: the engine's default with several slots
    assert ("prefix cache: up to 2.0 GiB of host memory (copies of recurring prompt prefixes; "
            "--prefix-cache-mb 0 turns it off)") in out

    assert cli.main(["doctor", "--model", str(model), "--slots", "3", "--n-ctx", "2048",
                     "--prefix-cache-mb", "512"]) == 0
    rows = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in capsys.readouterr().out.splitlines()}
    assert rows["serving"] == "3 slots x 2048 context on llama.cpp"
    assert rows["memory"].startswith(f"{total} = weights ")
    assert rows["prefix cache"].startswith("up to 512.0 MiB of host memory")

    assert cli.main(["info", str(model), "--prefix-cache-mb", "0"]) == 0     # serve's default: 4 slots x 4096
    out = capsys.readouterr().out
    assert "serving: 4 slots x 4096 context on llama.cpp" in out
    assert "prefix cache: none (--prefix-cache-mb N keeps up to N MiB of host memory for one)" in out


@pytest.mark.parametrize("bad", ["-1", "lots", "1.5"])
@pytest.mark.parametrize("command", ["info", "doctor"])
def test_info_and_doctor_refuse_a_bad_prefix_cache_budget(model, capsys, command, bad):
    argv = [command, str(model)] if command == "info" else [command, "--model", str(model)]
    assert cli.main(argv + [f"--prefix-cache-mb={bad}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("openjet: error: --prefix-cache-mb must be an integer >= 0") and repr(bad) in err


def test_chat_reads_lines_until_exit(model):
    r = openjet("chat", "-m", model, "--max-tokens", "6", "--temperature", "0",
                stdin="Hello there\nAnd again\n/exit\nnot read\n")
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if "tok/s" in line]
    assert len(stats) == 2                   # two turns answered, the line after /exit ignored
    assert len(r.stdout.splitlines()) >= 2


def test_synth_is_delegated(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert cli.main(["synth", str(out), "--preset", "tiny", "--quant", "F32"]) == 0
    assert out.is_file() and cli.main(["info", str(out)]) == 0


def test_bench_is_delegated_and_refuses_without_a_gpu(capsys, monkeypatch, tmp_path):
    """`openjet bench` reaches openjet_plugin.bench; on a machine with no nvidia-smi it says so and
    exits non-zero (tests/test_bench.py covers the benchmark itself)."""
    monkeypatch.setenv("PATH", str(tmp_path))          # no nvidia-smi, nvcc or anything else
    code = cli.main(["bench", "--quick"])
    assert code != 0
    assert "nvidia-smi" in capsys.readouterr().err


def test_serve_is_delegated(capsys, monkeypatch):
    seen = []
    if importlib.util.find_spec("openjet_plugin.serve") is None:
        assert cli.main(["serve", "--port", "1"]) == 2
        assert "not available" in capsys.readouterr().err
        return
    import openjet_plugin.serve as serve

    monkeypatch.setattr(serve, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["serve", "--port", "1"]) == 0 and seen == [["--port", "1"]]
