"""Generated qwen35 GGUFs: metadata, tensors, llama.cpp loading, weight scales, determinism, safety."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np
import pytest

from openjet_plugin.config import PRESETS, ModelConfig
from openjet_plugin.tensors import all_tensors
from openjet_plugin.testing import bpe
from openjet_plugin.testing.synth import (
    CHAT_TEMPLATE_FILE, FFN_DOWN_GAIN, QUANTS, quantize_rows, random_blocks, residual_gain, rewrite_chat_template, synth_main, synth_model,
    synth_specs, synth_uniform, tensor_values, token_dims, write_gguf,
)

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

TINY = PRESETS["tiny"]
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The history of the printing press begins in the fifteenth century, when movable type",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _field(reader, key):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def tiny_f32(synth_path) -> Path:
    return synth_path("tiny", "F32")


@pytest.fixture(scope="module")
def tiny_llm(synth_path):
    llm = llama_cpp.Llama(str(synth_path("tiny", "Q8_0")), n_ctx=512, logits_all=True, verbose=False,
                          n_threads=2, n_batch=512)
    yield llm
    llm.close()


# --- metadata and tensors ---------------------------------------------------------------------------

def test_metadata_equals_the_config(tiny_f32):
    r = gguf.GGUFReader(tiny_f32)
    assert _field(r, "general.architecture") == "qwen35"
    assert _field(r, "general.name") == "openjet-synth-tiny"
    for key, want in TINY.gguf_metadata().items():
        got = _field(r, key)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-6), key
        elif isinstance(want, (list, tuple)):
            assert list(got) == list(want), key
        else:
            assert got == want, key
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    back = ModelConfig.from_gguf_metadata(lambda k: _field(r, k), n_vocab).to_dict()
    for key, want in TINY.to_dict().items():   # floats went through float32, as llama.cpp stores them
        assert back[key] == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key


def test_tokenizer_and_template_metadata(tiny_f32):
    r = gguf.GGUFReader(tiny_f32)
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "qwen35"
    tokens = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in r.fields["tokenizer.ggml.tokens"].data]
    assert len(tokens) == TINY.n_vocab == 4096
    assert tokens[_field(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[_field(r, "tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert tokens[_field(r, "tokenizer.ggml.padding_token_id")] == "<|endoftext|>"
    assert _field(r, "tokenizer.ggml.add_bos_token") is False
    types = _field(r, "tokenizer.ggml.token_type")
    for text, ty in bpe.SPECIAL_TOKENS:
        assert types[tokens.index(text)] == ty, text
    assert _field(r, "tokenizer.chat_template") == CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")


def test_every_tensor_present_with_its_shape(tiny_f32):
    r = gguf.GGUFReader(tiny_f32)
    got = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in r.tensors}
    specs = synth_specs(TINY)
    assert list(got) == [s.name for s in specs]
    required = {s.name for s in all_tensors(TINY) if s.required}
    assert required <= set(got)
    assert "output.weight" in got and f"blk.{TINY.n_layer}.nextn.shared_head_norm.weight" in got
    assert f"blk.{TINY.n_layer}.nextn.embed_tokens.weight" not in got
    for s in specs:
        assert got[s.name] == (s.ne, "F32"), s.name
    assert got["blk.0.ssm_conv1d.weight"][0] == (TINY.ssm_conv_kernel, TINY.ssm_conv_dim)


def test_weights_follow_the_converters_conventions(tiny_f32):
    r = gguf.GGUFReader(tiny_f32)
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    norms = [n for n in t if n.endswith("norm.weight")]
    assert len(norms) > 10
    for n in norms:   # stored as 1 + w
        assert 0.85 < t[n].min() and t[n].max() < 1.15, n
    for il in TINY.deltanet_layers():
        a = t[f"blk.{il}.ssm_a"]
        assert (a < 0).all() and (a >= -16.0).all()          # -exp(A_log), A in [1, 16]
        dt = np.log1p(np.exp(t[f"blk.{il}.ssm_dt.bias"]))       # softplus(bias) = initial dt
        assert (dt > 5e-4).all() and (dt < 0.2).all()
        assert t[f"blk.{il}.ssm_conv1d.weight"].shape == (TINY.ssm_conv_dim, TINY.ssm_conv_kernel)
    emb = t["token_embd.weight"]
    half = token_dims(TINY)
    assert emb.shape == (TINY.n_vocab, TINY.n_embd)
    assert set(np.unique(emb[:, :half])) == {-1.0, 1.0}   # +-1: cheap for llama.cpp's 8-bit rounding
    assert not emb[:, half:].any()                        # the context half starts empty
    w = t["blk.0.ffn_up.weight"]
    assert w.std() == pytest.approx(1 / np.sqrt(TINY.n_embd), rel=0.05)
    # residual branches' output projections: GPT-2's 1/sqrt(2 n_layer), relative to the gain 1 above
    assert residual_gain(TINY) < 0.5
    for name, n_in, gain in (("blk.0.ffn_down.weight", TINY.n_ff, FFN_DOWN_GAIN),
                             ("blk.0.ssm_out.weight", TINY.ssm_d_inner, 1.0),
                             (f"blk.{TINY.attention_layers()[0]}.attn_output.weight", TINY.n_head * TINY.head_dim, 1.0)):
        assert t[name][half:].std() == pytest.approx(gain * residual_gain(TINY) / np.sqrt(n_in), rel=0.05), name
        assert not t[name][:half].any(), name             # no branch writes the token half


# --- llama.cpp runs them ----------------------------------------------------------------------------

@pytest.mark.parametrize("quant", QUANTS)
def test_llama_cpp_loads_every_quant_and_generates(synth_path, quant):
    path = synth_path("tiny", quant)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    matrix_types = {types[s.name] for s in synth_specs(TINY) if s.kind == "matrix"}
    vector_types = {types[s.name] for s in synth_specs(TINY) if s.kind == "vector"}
    assert vector_types == {"F32"}
    expected = {"F32": {"F32"}, "F16": {"F16"}, "Q8_0": {"Q8_0"}, "Q6_K": {"Q6_K"}, "Q4_K_M": {"Q4_K", "Q6_K"}}
    assert matrix_types == expected[quant]
    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    try:
        ids = llm.tokenize(PROMPTS[0].encode(), add_bos=False, special=True)
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)])
        assert np.isfinite(logits).all()
        assert 1.0 < logits.std(axis=1).mean() < 20.0
        out = llm.create_completion(PROMPTS[1], max_tokens=6, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        llm.close()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _logits(llm, text: str) -> np.ndarray:
    llm.reset()
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], dtype=np.float64)


def test_logits_vary_strongly_with_the_input(tiny_llm):
    for prompt in PROMPTS:
        p = _softmax(_logits(tiny_llm, prompt))
        tv = [0.5 * np.abs(p[i] - p[j]).sum() for i, j in itertools.combinations(range(len(p)), 2)]
        assert np.mean(tv) > 0.6, "next-token distributions barely change from position to position"
        top1 = p.argmax(axis=1)
        changes = np.mean(top1[1:] != top1[:-1])
        assert changes > 0.7
        assert p.max(axis=1).mean() < 0.95   # not collapsed onto one token
    # the same last token after different contexts: the layers, not just the embedding, decide
    a = _softmax(_logits(tiny_llm, "import numpy as np\nfor i in range(10): the lazy")[-1])
    b = _softmax(_logits(tiny_llm, "The quick brown fox jumps over the lazy")[-1])
    assert 0.5 * np.abs(a - b).sum() > 0.3


@pytest.mark.slow
def test_activations_stay_finite_through_64_layers(synth_path):
    """q27b-narrow has the 27B's depth: logits stay O(1..10) and input-dependent after 65 blocks."""
    llm = llama_cpp.Llama(str(synth_path("q27b-narrow", "Q8_0")), n_ctx=256, logits_all=True,
                          verbose=False, n_threads=2)
    try:
        lg = _logits(llm, PROMPTS[0])
        assert np.isfinite(lg).all()
        assert 1.0 < lg.std(axis=1).mean() < 20.0
        p = _softmax(lg)
        assert np.mean(p.argmax(1)[1:] != p.argmax(1)[:-1]) > 0.5
    finally:
        llm.close()


def test_small_preset_loads_and_generates(synth_path):
    llm = llama_cpp.Llama(str(synth_path("small", "Q8_0")), n_ctx=256, verbose=False, n_threads=2)
    try:
        assert llm.n_vocab() == PRESETS["small"].n_vocab
        out = llm.create_completion(PROMPTS[2], max_tokens=5, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        llm.close()


# --- determinism and file safety ------------------------------------------------------------------

def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_f32):
    again = synth_model(tmp_path / "again.gguf", "tiny", "F32", seed=0)
    assert _sha256(again) == _sha256(tiny_f32)
    other = synth_model(tmp_path / "other.gguf", "tiny", "F32", seed=1)
    a = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tiny_f32).tensors}
    b = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(other).tensors}
    assert a.keys() == b.keys()
    for name in ("token_embd.weight", "blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "output.weight"):
        assert not np.array_equal(a[name], b[name]), name
        assert a[name].std() == pytest.approx(b[name].std(), rel=0.05)   # same scales


def test_quantised_file_is_deterministic(tmp_path, synth_path):
    again = synth_model(tmp_path / "q.gguf", "tiny", "Q4_K_M", seed=0)
    assert _sha256(again) == _sha256(synth_path("tiny", "Q4_K_M"))


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="m.gguf"):
        synth_model(out, "tiny", "F32")
    assert out.read_bytes() == b"precious"
    synth_model(out, "tiny", "Q8_0", force=True)
    assert out.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]    # no temporary files left


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="quant 'Q5_K'"):
        synth_model(tmp_path / "a.gguf", "tiny", "Q5_K")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        synth_model(tmp_path / "a.gguf", "huge")
    with pytest.raises(ValueError, match="q27b"):
        synth_model(tmp_path / "a.gguf", "q27b", "F32")
    with pytest.raises(ValueError, match="direct writer"):
        synth_model(tmp_path / "a.gguf", "tiny", "Q8_0", direct=True)
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        synth_model(tmp_path / "no-such-dir" / "a.gguf", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_custom_config(tmp_path):
    cfg = ModelConfig(**{**TINY.to_dict(), "n_layer": 2, "n_ff": 256, "rope_sections": (3, 3, 2, 0)})
    path = synth_model(tmp_path / "c.gguf", config=cfg, quant="F32")
    r = gguf.GGUFReader(path)
    assert _field(r, "qwen35.block_count") == 3
    assert _field(r, "openjet.synth.preset") == "custom"
    assert len(r.tensors) == len(synth_specs(cfg))


def test_cli_entry(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert synth_main([str(out), "--preset", "tiny", "--quant", "Q8_0", "--seed", "3"]) == 0
    assert "cli.gguf" in capsys.readouterr().out
    assert _field(gguf.GGUFReader(out), "openjet.synth.seed") == 3
    assert synth_main([str(out), "--preset", "tiny"]) == 2
    assert "exists" in capsys.readouterr().err
    assert synth_main([str(out), "--preset", "tiny", "--quant", "F16", "--force"]) == 0
    with pytest.raises(SystemExit):
        synth_main([str(out), "--preset", "nope"])


# --- random quantised blocks ----------------------------------------------------------------------

@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"])
def test_random_blocks_have_the_requested_scale(ggml_type):
    from gguf.quants import dequantize

    g = np.random.default_rng(0)
    blocks = random_blocks(ggml_type, 128, 512, 0.05, g)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    vals = dequantize(blocks, qtype).astype(np.float64)
    assert vals.shape == (128, 512)
    assert np.isfinite(vals).all()
    assert abs(vals.mean()) < 0.005
    assert vals.std() == pytest.approx(0.05, rel=0.05)
    # every 32-value group is centred (Q4_K's mins match its scales)
    assert np.abs(vals.reshape(-1, 32).mean(axis=1)).max() < 0.05


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16"])
def test_uniform_type_models_load_in_llama_cpp(tmp_path, ggml_type):
    path = synth_uniform(tmp_path / f"u-{ggml_type}.gguf", ggml_type, "tiny")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {types[s.name] for s in synth_specs(TINY) if s.kind == "matrix"} == {ggml_type}
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    try:
        lg = _logits(llm, PROMPTS[1])
        assert np.isfinite(lg).all() and 1.0 < lg.std(axis=1).mean() < 20.0
        assert np.mean(lg.argmax(1)[1:] != lg.argmax(1)[:-1]) > 0.5
    finally:
        llm.close()


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_random_blocks_refuse_partial_blocks(ggml_type):
    with pytest.raises(ValueError, match="multiple of its block size"):
        random_blocks(ggml_type, 2, 100, 0.05, np.random.default_rng(0))


# --- float values to blocks (the direct writer's structured tensors) -------------------------------

@pytest.mark.parametrize("ggml_type, rel_rms", [("Q4_K", 0.09), ("Q6_K", 0.025), ("Q8_0", 0.008),
                                                ("F16", 1e-3), ("BF16", 4e-3), ("F32", 0.0)])
def test_quantize_rows_round_trips_through_ggufs_dequantiser(ggml_type, rel_rms):
    from gguf.quants import dequantize

    g = np.random.default_rng(1)
    x = (g.standard_normal((16, 512)) * 0.05).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    back = dequantize(quantize_rows(x, ggml_type), qtype).reshape(x.shape)
    assert np.sqrt(np.mean((back - x) ** 2)) <= rel_rms * x.std()
    # what the structure needs: +-1 rows, one-hot rows and zero halves come back (nearly) exact
    signs = np.where(g.random((4, 512)) < 0.5, -1.0, 1.0).astype(np.float32)
    signs[:, 128:] = 0.0
    one_hot = np.eye(4, 512, k=37, dtype=np.float32) * 3.0
    for values in (signs, one_hot):
        back = dequantize(quantize_rows(values, ggml_type), qtype).reshape(values.shape)
        np.testing.assert_allclose(back, values, atol=2e-3 * np.abs(values).max())
        assert not back[values == 0].any()


def test_quantize_rows_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="multiple of its block size"):
        quantize_rows(np.zeros((2, 100), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="no quantiser for Q5_K"):
        quantize_rows(np.zeros((2, 256), np.float32), "Q5_K")
    with pytest.raises(ValueError, match="unknown type 'Q3_K'"):
        quantize_rows(np.zeros((2, 256), np.float32), "Q3_K")


# --- the chat template written into the files ----------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather <in> a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "tool", "content": "sunny"},
]


def _renderers():
    """The template as our sandbox, a bare SandboxedEnvironment and llama-cpp-python render it."""
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    source = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def plain(**kw):
        env = SandboxedEnvironment()
        env.filters["tojson"] = tojson
        return env.from_string(source).render(**kw)

    def immutable(**kw):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        return env.from_string(source).render(**kw)

    def llama_formatter(add_generation_prompt=True, **kw):
        fmt = Jinja2ChatFormatter(source, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  add_generation_prompt=add_generation_prompt)
        return fmt(**kw).prompt

    return [plain, immutable, llama_formatter]


def _render_all(**kw) -> str:
    outs = [r(**kw) for r in _renderers()]
    assert outs[0] == outs[1] == outs[2], "renderers disagree (whitespace control?)"
    return outs[0]


def test_chat_template_plain_turns_and_thinking_switch():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    base = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert _render_all(messages=msgs, add_generation_prompt=True, enable_thinking=False) == \
        base + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert _render_all(messages=msgs, add_generation_prompt=True, enable_thinking=True) == \
        base + "<|im_start|>assistant\n"
    assert _render_all(messages=msgs, add_generation_prompt=True) == base + "<|im_start|>assistant\n"
    assert _render_all(messages=msgs, add_generation_prompt=False) == base
    history = msgs + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert _render_all(messages=history, add_generation_prompt=False) == (
        base + "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")


def test_chat_template_tools_calls_and_responses():
    text = _render_all(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather", "description": ' \
           '"Current weather <in> a city"' in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' in text
    # the assistant's call after the last user query keeps its reasoning
    assert ('<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    # consecutive tool results share one user turn
    assert ('<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>\n'
            '<tool_response>\nsunny\n</tool_response><|im_end|>\n') in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_drops_old_reasoning():
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nA1"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "A2", "reasoning_content": "new thoughts"}]
    text = _render_all(messages=msgs, add_generation_prompt=False)
    assert "old thoughts" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\nA2<|im_end|>\n" in text


def test_rendered_prompt_tokenizes_with_single_special_tokens(synth_path):
    from openjet_plugin.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(synth_path("tiny", "Q8_0"))
    text = _render_all(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    ids = tok.encode(text)
    for special in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "<think>"):
        assert ids.count(tok.special_tokens[special]) == text.count(special), special
    assert tok.decode(ids, special=True) == text


# --- writing given weights ---------------------------------------------------------------------------

def test_write_gguf_from_given_arrays(tmp_path):
    arrays = {s.name: tensor_values(s, 5, TINY) for s in synth_specs(TINY)}
    out = write_gguf(tmp_path / "given.gguf", TINY, arrays, name="given-weights",
                     extra_metadata={"general.license": "MIT", "openjet.test.steps": 7, "openjet.test.ok": True})
    r = gguf.GGUFReader(out)
    assert _field(r, "general.name") == "given-weights"
    assert _field(r, "general.license") == "MIT"
    assert _field(r, "openjet.test.steps") == 7 and _field(r, "openjet.test.ok") is True
    assert _field(r, "tokenizer.chat_template") == CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    got = {t.name: np.asarray(t.data) for t in r.tensors}
    assert list(got) == [s.name for s in synth_specs(TINY)]
    for name, value in arrays.items():
        np.testing.assert_array_equal(got[name].reshape(value.shape), value, err_msg=name)
    llm = llama_cpp.Llama(str(out), n_ctx=64, verbose=False, n_threads=2)
    llm.close()


def test_write_gguf_names_a_bad_tensor(tmp_path):
    arrays = {s.name: tensor_values(s, 5, TINY) for s in synth_specs(TINY)}
    bad = dict(arrays, **{"blk.0.not_a_tensor": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="blk.0.not_a_tensor"):
        write_gguf(tmp_path / "a.gguf", TINY, bad, name="x")
    bad = dict(arrays, **{"blk.1.ffn_up.weight": np.zeros((3, 4), np.float32)})
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight"):
        write_gguf(tmp_path / "b.gguf", TINY, bad, name="x")


def test_rewrite_chat_template_keeps_every_tensor_byte(tmp_path, synth_path):
    src = synth_path("tiny", "Q4_K_M")
    out = rewrite_chat_template(src, tmp_path / "t.gguf", template="{{ messages }}")
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert _field(b, "tokenizer.chat_template") == "{{ messages }}"
    fa = {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.")}
    fb = {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert fa.keys() == fb.keys()
    assert [k for k in fa if fa[k] != fb[k]] == ["tokenizer.chat_template"]
    assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type) for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert np.asarray(x.data).tobytes() == np.asarray(y.data).tobytes(), x.name
    with pytest.raises(ValueError, match="another path"):
        rewrite_chat_template(out, out)


def test_embedded_default_model_carries_the_shipped_template():
    """The engine reads the chat template from the GGUF: the embedded default must have the current one
    (after a template change: `python -m training.export --retemplate openjet_plugin/data/default.gguf`)."""
    r = gguf.GGUFReader(bpe.DATA_DIR / "default.gguf")
    assert _field(r, "tokenizer.chat_template") == CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
