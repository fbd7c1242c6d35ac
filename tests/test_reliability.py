"""Reliability and security (issue 10) on the CPU (llama.cpp backend): an untrusted chat template,
bad input at the engine's boundary, context overflow, cancellation (a closed stream, Ctrl-C in the
CLI, a client hanging up on `openjet serve`), concurrency (threads on one engine; a load test
through the server), out-of-GPU-memory refusal (with a faked free-memory figure), a server that
only listens on the loopback interface, and commands that never overwrite a user's file.

The model-file fuzzer and its corpus are in test_fuzz_regression.py.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin.chat_template import ChatTemplateError
from openjet_plugin.errors import BackendUnavailableError, ContextOverflowError, OpenJetError

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n\nclass Config:",
           "for i in range(10):"]
MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def model(synth_path):
    return synth_path("tiny", "Q8_0")


@pytest.fixture(scope="module")
def engine(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1)
    yield eng
    eng.close()


def fresh_greedy(model, prompt, n: int, n_ctx: int = 256) -> list[int]:
    """What a brand-new engine generates: the reference every 'still usable' check compares with."""
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=n_ctx, n_threads=1) as eng:
        return eng.generate(prompt, max_tokens=n, temperature=0).tokens


# --- 1. an untrusted chat template ---------------------------------------------------------------

def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """Copy a GGUF with its `tokenizer.chat_template` replaced (the tensor data is re-aligned)."""
    from openjet_plugin.fuzz import parse_layout

    data = src.read_bytes()
    lay = parse_layout(data)
    key = b"tokenizer.chat_template"
    for start, end in lay.kv_entries:
        n = struct.unpack_from("<Q", data, start)[0]
        if data[start + 8:start + 8 + n] == key:
            break
    else:
        raise AssertionError(f"{src} has no chat template")
    value = template.encode("utf-8")
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value
    infos_end = lay.tensor_entries[-1][1]             # tensor offsets are relative to the data start
    head = data[:start] + entry + data[end:infos_end]
    head += bytes(-len(head) % 32)                     # the data section starts 32-byte aligned
    dst.write_bytes(head + data[lay.data_start:])
    return dst


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('touch /tmp/openjet-pwned').read() }}",
    "{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}",
])
def test_a_template_reaching_for_python_internals_fails_through_engine_chat(model, tmp_path, template):
    evil = with_chat_template(model, tmp_path / "evil.gguf", template)
    with openjet_plugin.load(evil, backend="llama.cpp", n_ctx=128, n_threads=1) as eng:
        assert eng.chat_template == template            # the loader accepted the file as such
        with pytest.raises(ChatTemplateError, match="sandbox forbids"):
            eng.chat(MESSAGES, max_tokens=2)
        with pytest.raises(ChatTemplateError):
            eng.render_chat(MESSAGES)
        # the engine is untouched and still works for plain prompts
        assert eng.generate(PROMPTS[0], max_tokens=4, temperature=0).tokens == fresh_greedy(model, PROMPTS[0], 4)
    assert not os.path.exists("/tmp/openjet-pwned")


def test_an_endless_template_loop_is_bounded(model, tmp_path):
    """The sandbox caps range(): a template cannot spin for ever or build a huge prompt."""
    evil = with_chat_template(model, tmp_path / "loop.gguf",
                              "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}")
    with openjet_plugin.load(evil, backend="llama.cpp", n_ctx=128, n_threads=1) as eng:
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match="range"):
            eng.render_chat(MESSAGES)
        assert time.monotonic() - t0 < 5


def test_a_benign_replacement_template_is_used(model, tmp_path):
    """The helper above really swaps the template (so the refusals are the sandbox's doing)."""
    ok = with_chat_template(model, tmp_path / "ok.gguf",
                            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                            "{% endfor %}<|im_start|>assistant\n")
    with openjet_plugin.load(ok, backend="llama.cpp", n_ctx=128, n_threads=1) as eng:
        assert eng.render_chat(MESSAGES) == \
            "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant"
        assert eng.chat(MESSAGES, max_tokens=3, temperature=0).stats.generated_tokens >= 1


# --- 2. the engine's boundary ----------------------------------------------------------------------

def test_token_ids_outside_the_vocabulary_are_refused(engine, model):
    n = engine.n_vocab
    for bad in (-1, n, n + 1000, 2**31, -(2**63)):
        with pytest.raises(ValueError, match=f"token id {bad}.*outside the vocabulary"):
            engine.detokenize([5, bad])
        with pytest.raises(ValueError, match=f"token id {bad}"):
            engine.generate([5, bad], max_tokens=2)
        with pytest.raises(ValueError, match=f"token id {bad}"):
            list(engine.generate([bad], max_tokens=2, stream=True))
    for junk in ([1.5], ["a"], [None], [True], "abc"):
        with pytest.raises(ValueError, match="token"):
            engine.detokenize(junk)
    with pytest.raises(ValueError, match=f"logit_bias names token id {n}"):
        engine.generate(PROMPTS[0], max_tokens=2, logit_bias={n: 1.0})
    # the engine is unharmed: numpy ids work and the output is a fresh engine's
    assert engine.detokenize(np.array([100, 200], dtype=np.int64)) == engine.detokenize([100, 200])
    assert engine.generate(PROMPTS[1], max_tokens=8, temperature=0).tokens == fresh_greedy(model, PROMPTS[1], 8)


def test_more_positions_than_the_context(engine, model):
    n_ctx = engine.n_ctx
    too_long = [100 + i % 500 for i in range(n_ctx + 1)]
    with pytest.raises(ContextOverflowError) as ei:
        engine.generate(too_long, max_tokens=1)
    assert ei.value.n_ctx == n_ctx and str(n_ctx + 1) in str(ei.value)
    with pytest.raises(ContextOverflowError, match="no room"):
        engine.generate(too_long[:n_ctx], max_tokens=None)
    assert engine.generate(PROMPTS[2], max_tokens=6, temperature=0).tokens == fresh_greedy(model, PROMPTS[2], 6)


def test_every_call_after_close_is_a_clear_error(model):
    eng = openjet_plugin.load(model, backend="llama.cpp", n_ctx=64, n_threads=1)
    stream = eng.generate(PROMPTS[0], max_tokens=5, stream=True)     # not started: holds nothing
    eng.close()
    for call in (lambda: eng.tokenize("x"), lambda: eng.detokenize([1]),
                 lambda: eng.generate("x", max_tokens=1), lambda: eng.chat(MESSAGES, max_tokens=1),
                 lambda: list(eng.generate("x", max_tokens=1, stream=True)), lambda: next(stream)):
        with pytest.raises(OpenJetError, match="closed"):
            call()
    eng.close()      # twice is fine
    assert eng._backend._llm is None      # the llama.cpp context was freed, not leaked


# --- 3. context overflow ---------------------------------------------------------------------------

def test_overflow_names_both_lengths_and_leaves_the_engine_usable(model):
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=48, n_threads=1) as eng:
        first = eng.generate(PROMPTS[0], max_tokens=6, temperature=0)    # some state to keep
        long_prompt = " ".join(["word"] * 80)
        n_prompt = len(eng.tokenize(long_prompt, add_special=True))
        assert n_prompt > 48
        with pytest.raises(ContextOverflowError) as ei:
            eng.generate(long_prompt, max_tokens=4)
        msg = str(ei.value)
        assert f"{n_prompt} tokens" in msg and "n_ctx=48" in msg
        assert (ei.value.n_tokens, ei.value.n_ctx) == (n_prompt + 4, 48)
        n3 = len(eng.tokenize(PROMPTS[2], add_special=True))
        with pytest.raises(ContextOverflowError, match=f"prompt of {n3} tokens plus max_tokens=47"):
            eng.generate(PROMPTS[2], max_tokens=47)
        with pytest.raises(ContextOverflowError):
            eng.chat([{"role": "user", "content": long_prompt}], max_tokens=4)
        # usable, and reusing the state it kept
        again = eng.generate(PROMPTS[0], max_tokens=6, temperature=0)
        assert again.tokens == first.tokens == fresh_greedy(model, PROMPTS[0], 6, n_ctx=48)
        assert again.stats.cached_prompt_tokens > 0


# --- 4. cancellation ---------------------------------------------------------------------------------

def test_a_closed_stream_leaves_the_cache_equal_to_what_was_emitted(model):
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1) as eng:
        prompt = eng.tokenize(PROMPTS[0], add_special=True)
        stream = eng.generate(prompt, max_tokens=60, temperature=0, stream=True)
        emitted: list[int] = []
        for _ in range(4):
            emitted += next(stream).tokens
        stream.close()
        assert eng._tokens == (prompt + emitted)[:len(eng._tokens)]
        # the emitted tokens are a fresh engine's, and continuing from them reuses the state
        full = fresh_greedy(model, prompt, 60)
        assert emitted == full[:len(emitted)]
        cont = eng.generate(prompt + emitted, max_tokens=10, temperature=0)
        assert cont.stats.cached_prompt_tokens == len(prompt) + len(emitted) - 1   # only the unevaluated last
        assert cont.tokens == fresh_greedy(model, prompt + emitted, 10)
        # and a different request after another abandoned stream is a fresh engine's too
        s2 = eng.generate(PROMPTS[3], max_tokens=40, temperature=0, stream=True)
        next(s2)
        del s2                                     # dropped without close(): the generator is finalised
        assert eng.generate(PROMPTS[1], max_tokens=10, temperature=0).tokens == fresh_greedy(model, PROMPTS[1], 10)


def test_an_exception_inside_a_consumer_loop_releases_the_engine(engine, model):
    with pytest.raises(RuntimeError, match="consumer"):
        for i, _chunk in enumerate(engine.generate(PROMPTS[0], max_tokens=40, temperature=0, stream=True)):
            if i == 2:
                raise RuntimeError("consumer failed")
    assert engine.generate(PROMPTS[3], max_tokens=8, temperature=0).tokens == fresh_greedy(model, PROMPTS[3], 8)


def test_an_interrupt_right_after_a_backend_step_leaves_the_engine_correct(model):
    """Ctrl-C can land after llama.cpp evaluated a token but before the engine recorded it; the
    next request must still be exactly a fresh engine's."""
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1) as eng:
        original = eng._backend.eval
        calls = {"n": 0}

        def eval_then_interrupt(tokens):
            out = original(tokens)
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt
            return out

        eng._backend.eval = eval_then_interrupt
        with pytest.raises(KeyboardInterrupt):
            eng.generate(PROMPTS[0], max_tokens=30, temperature=0.7, seed=3)
        eng._backend.eval = original
        assert eng._backend.n_past >= len(eng._tokens)
        for p in (PROMPTS[0], PROMPTS[1]):
            assert eng.generate(p, max_tokens=10, temperature=0).tokens == fresh_greedy(model, p, 10)


def test_ctrl_c_in_openjet_generate_exits_130_without_a_traceback(tmp_path):
    env = dict(os.environ, OPENJET_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "openjet_plugin.cli", "generate", "def main():",
                             "-n", "3500", "--n-ctx", "4096", "--temperature", "0.7", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
                            # as from a terminal: a runner started in the background (`cmd &`)
                            # passes SIGINT down ignored, and Python then never raises on it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.read(1)             # the stream has begun
        assert first, proc.stderr.read().decode()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted" in err
    assert "[length]" not in err        # it really stopped mid-stream


# --- 5. concurrency ----------------------------------------------------------------------------------

def test_threads_on_one_engine_are_serialised_and_all_correct(model):
    expected = {p: fresh_greedy(model, p, 12) for p in PROMPTS}
    with openjet_plugin.load(model, backend="llama.cpp", n_ctx=256, n_threads=1) as eng:
        backend = eng._backend
        inside = {"now": 0, "max": 0}
        guard = threading.Lock()
        original = backend.eval

        def watched_eval(tokens):
            with guard:
                inside["now"] += 1
                inside["max"] = max(inside["max"], inside["now"])
            try:
                time.sleep(0.001)             # widen the window an interleaving would need
                return original(tokens)
            finally:
                with guard:
                    inside["now"] -= 1

        backend.eval = watched_eval
        results: dict[tuple[int, int], list[int]] = {}
        errors = []

        def worker(t):
            try:
                for k in range(3):
                    p = PROMPTS[(t + k) % len(PROMPTS)]
                    if (t + k) % 2:
                        toks = [tok for c in eng.generate(p, max_tokens=12, temperature=0, stream=True)
                                for tok in c.tokens]
                    else:
                        toks = eng.generate(p, max_tokens=12, temperature=0).tokens
                    results[(t, k)] = toks
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(results) == 18
        for (t, k), toks in results.items():
            assert toks == expected[PROMPTS[(t + k) % len(PROMPTS)]], (t, k)
        assert inside["max"] == 1, "two threads were inside the backend at once"


# --- 6. out of GPU memory (estimate first; faked free memory) ----------------------------------------

class _FakeDevice:
    """Stands in for the native library's oj_device_info: an sm_90 GPU with `free` bytes free."""

    def __init__(self, free: int, total: int = 80 << 30):
        import cffi

        self.ffi = cffi.FFI()
        self.lib = self
        self.free, self.total = free, total

    def oj_device_info(self, device, major, minor, free, total, name, n):
        major[0], minor[0] = 9, 0
        free[0], total[0] = self.free, self.total
        label = b"Fake H100"
        self.ffi.memmove(name, label + b"\0", len(label) + 1)
        return 0


@pytest.fixture
def native_mod():
    return pytest.importorskip("openjet_plugin.backends.native")


def _fake_gpu(monkeypatch, native_mod, free: int):
    from openjet_plugin import _native

    dev = _FakeDevice(free)
    monkeypatch.setattr(_native, "load", lambda *a, **k: dev)
    return dev


def test_memory_estimate_counts_weights_kv_state_and_buffers(model, native_mod):
    from openjet_plugin.model_file import open_model

    with open_model(model) as mf:
        est = {n: native_mod.estimate_device_bytes(mf, n) for n in (256, 4096)}
        weights = sum(t.n_bytes for t in mf.tensors.values())
        c = mf.config
    small, big = est[256], est[4096]
    assert small["weights"] >= weights
    assert small["total"] == sum(v for k, v in small.items() if k != "total")
    # the KV cache grows linearly with n_ctx (attention layers + MTP, K and V, fp16)
    n_kv_layers = len(c.attention_layers()) + 1
    assert big["kv_cache"] - small["kv_cache"] == n_kv_layers * 2 * c.kv_dim * (4096 - 256) * 2
    assert small["recurrent_state"] > 0 and small["activations"] > 0
    assert big["recurrent_state"] == small["recurrent_state"]     # DeltaNet state: independent of n_ctx


def test_too_little_gpu_memory_is_refused_before_loading(model, native_mod, monkeypatch):
    from openjet_plugin.backends.select import choose_backend
    from openjet_plugin.model_file import open_model

    with open_model(model) as mf:
        assert native_mod.model_problems(mf) == []      # only memory can stand in the way
        need = native_mod.estimate_device_bytes(mf, 4096)["total"] + native_mod._MEMORY_MARGIN
        _fake_gpu(monkeypatch, native_mod, need - 1)
        ok, reason = native_mod.native_status(mf, 4096)
        assert not ok
        assert "free" in reason and "needs about" in reason and "n_ctx 4096" in reason
        name, why = choose_backend("auto", mf, 4096)
        assert name == "llama.cpp" and "needs about" in why
        with pytest.raises(BackendUnavailableError, match="needs about"):
            choose_backend("native", mf, 4096)
        # one byte more and it fits
        _fake_gpu(monkeypatch, native_mod, need)
        ok, reason = native_mod.native_status(mf, 4096)
        assert ok, reason


def test_load_auto_falls_back_with_the_memory_reason(model, native_mod, monkeypatch):
    _fake_gpu(monkeypatch, native_mod, 64 << 20)      # 64 MiB free: the margin alone is 256 MiB
    with openjet_plugin.load(model, backend="auto", n_ctx=128, n_threads=1) as eng:
        assert eng.backend_name == "llama.cpp"
        assert "needs about" in eng.backend_reason and "free" in eng.backend_reason
    with pytest.raises(BackendUnavailableError) as ei:
        openjet_plugin.load(model, backend="native", n_ctx=128)
    msg = str(ei.value)
    assert "GiB free" in msg and "needs about" in msg


# --- 7. a safe server ---------------------------------------------------------------------------------

def test_serve_binds_loopback_by_default():
    from openjet_plugin import serve

    assert serve._parser().parse_args([]).host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10"])
def test_serve_refuses_other_addresses_without_a_key(host, capsys, monkeypatch):
    from openjet_plugin import serve

    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    monkeypatch.delenv("OPENJET_API_KEY", raising=False)
    monkeypatch.setattr(serve, "_run_proxy", lambda *a: pytest.fail("the server started"))
    assert serve.main(["--host", host]) == 2
    err = capsys.readouterr().err
    assert host in err and "loopback" in err


def test_serve_allows_another_address_only_with_an_api_key(capsys, monkeypatch):
    from openjet_plugin import serve

    # serve.main exports the proxy's settings into the environment: keep them inside this test
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    monkeypatch.delenv("OPENJET_API_KEY", raising=False)
    started = []
    monkeypatch.setattr(serve, "_run_proxy", lambda path, host, port, gate: started.append(host))
    assert serve.main(["--host", "0.0.0.0"]) == 2
    assert "api key" in capsys.readouterr().err.lower()
    monkeypatch.setenv("OPENJET_API_KEY", "sk-short-key-123")      # weak: refused off loopback
    assert serve.main(["--host", "0.0.0.0"]) == 2
    assert "weak" in capsys.readouterr().err
    monkeypatch.setenv("OPENJET_API_KEY", "sk-" + "abcdefghijklmnopqrstuvwxyz0123456789")
    assert serve.main(["--host", "0.0.0.0"]) == 0
    assert started == ["0.0.0.0"]


def test_a_client_cannot_name_a_file_as_model(tmp_path, monkeypatch):
    """The proxy's handler (as `openjet serve` configures it) resolves only configured names: a
    path, even to a real GGUF, is refused without being opened (opening the FIFO would block)."""
    from litellm.llms.custom_llm import CustomLLMError

    from openjet_plugin.adapters import litellm as oj_litellm

    monkeypatch.setenv("OPENJET_MODELS", "")
    oj_litellm.configure_proxy_handler()
    handler = oj_litellm.proxy_handler
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for name in (str(fifo), f"openjet/{fifo}", "openjet//etc/passwd", "../../etc/passwd",
                 f"openjet/{REPO / 'openjet_plugin' / 'data' / 'default.gguf'}"):
        t0 = time.monotonic()
        with pytest.raises(CustomLLMError, match="unknown model") as ei:
            handler.engine(name)
        assert ei.value.status_code == 404 and time.monotonic() - t0 < 5


# --- 8. nothing lost ------------------------------------------------------------------------------------

def test_openjet_synth_refuses_to_overwrite_without_force(tmp_path, capsys):
    from openjet_plugin.cli import main

    out = tmp_path / "mine.gguf"
    out.write_bytes(b"the user's precious file")
    assert main(["synth", str(out), "--preset", "tiny"]) != 0
    err = capsys.readouterr().err
    assert "exists" in err and "--force" in err
    assert out.read_bytes() == b"the user's precious file"
    assert not [p for p in tmp_path.iterdir() if p.name != "mine.gguf"], "a temporary file was left behind"
    assert main(["synth", str(out), "--preset", "tiny", "--quant", "F32", "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"


def test_the_default_model_cache_is_written_atomically(tmp_path, monkeypatch):
    """Without a shipped file the default model is generated into the cache by rename: a reader
    never sees a partial file, and a failed generation leaves nothing behind."""
    from openjet_plugin import defaults
    from openjet_plugin.testing import synth

    monkeypatch.setenv("OPENJET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(defaults, "SHIPPED_DEFAULT", tmp_path / "absent.gguf")

    def broken(path, **kw):
        Path(path).write_bytes(b"GGUF half a file")
        raise OSError("disk full")

    monkeypatch.setattr(synth, "synth_model", broken)
    with pytest.raises(OSError, match="disk full"):
        defaults.default_model_path()
    assert not defaults.generated_default_path().exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


# --- through `openjet serve` (a real LiteLLM proxy subprocess): disconnects and load -------------------

def _load_test_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("openjet_load_test", REPO / "scripts" / "load_test.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up while being made
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def load_test():
    return _load_test_module()


@pytest.fixture(scope="module")
def server(load_test, tmp_path_factory):
    openjet_plugin.default_model_path()
    proc, base = load_test.start_server(tmp_path_factory.mktemp("serve") / "server.log", threads="1")
    yield {"proc": proc, "base": base}
    assert load_test.stop_server(proc) == 0


@pytest.fixture(scope="module")
def expected(load_test):
    return load_test.expected_replies(16)


@pytest.mark.slow
def test_a_client_hanging_up_mid_stream_leaves_the_server_correct(server, load_test, expected):
    import httpx

    body = {"model": load_test.MODEL, "messages": load_test.CONVERSATIONS[1], "temperature": 0,
            "max_tokens": 2000, "stream": True}     # ~25 s of generation if it were not cancelled
    headers = {"Authorization": f"Bearer {load_test.API_KEY}"}
    for _ in range(3):
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{server['base']}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                lines = 0
                for line in r.iter_lines():
                    lines += line.startswith("data:")
                    if lines == 3:
                        break              # leaving the block closes the connection mid-stream
    # the next requests (streamed and not) get exactly the engine's answer, promptly
    from openai import OpenAI

    client = OpenAI(base_url=f"{server['base']}/v1", api_key=load_test.API_KEY, max_retries=0, timeout=60)
    for conv in (0, 1):
        text, total, _ = load_test.stream_once(client, conv, 16, timeout=60)
        assert text == expected[conv]
        assert total < 15, "the abandoned generations went on after their clients left"
        r = client.chat.completions.create(model=load_test.MODEL, messages=load_test.CONVERSATIONS[conv],
                                           temperature=0, max_tokens=16)
        assert r.choices[0].message.content == expected[conv]
    assert server["proc"].poll() is None


@pytest.mark.slow
def test_load_8_streaming_clients_x_3_requests(server, load_test, expected):
    t0 = time.monotonic()
    res = load_test.run_load(server["base"], expected, clients=8, requests=3, max_tokens=16,
                             server_pid=server["proc"].pid, timeout=90, log=lambda *_: None)
    print(load_test.summary(res, 8, 3))
    assert not res.failures, res.failures[:3]
    assert not res.wrong, res.wrong[:3]
    assert res.ok == 24 and len(res.latencies) == 24
    assert time.monotonic() - t0 < 100
    assert len(res.rss) == 3 and res.rss[-1] - res.rss[0] < 64 << 20, res.rss
