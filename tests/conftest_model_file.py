"""A small, configurable qwen35 GGUF writer for the loader's tests.

It writes exactly what `tensors.all_tensors(config)` and `ModelConfig.gguf_metadata()` describe,
with random F32 weights and a made-up vocabulary, and lets a test break one thing at a time
(drop a key, change a value, drop or replace a tensor). The real generator with a trained
tokenizer and llama.cpp quantisation is `openjet_plugin.testing.synth`; this one exists so the
loader's tests depend on nothing but gguf's own writer and need no more than milliseconds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Mapping

import gguf
import numpy as np
import pytest

from openjet_plugin.config import ARCH, PRESETS, ModelConfig
from openjet_plugin.tensors import all_tensors

# Narrow dimensions with every structural feature of the real model: 3 DeltaNet + 1 attention
# layer, GQA, more value heads than key heads, an MTP block. ffn_down's rows (n_ff = 256) fit one
# K-quant super-block, so a test can store it as Q2_K.
MICRO = dataclasses.replace(
    PRESETS["tiny"], n_vocab=320, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, head_dim=16,
    n_rot=8, rope_sections=(2, 1, 1, 0), ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4,
    n_ctx_train=1024,
)

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

# Tensor overrides: name -> (raw array, gguf type or None for F32/F16 by dtype)
TensorOverride = tuple[np.ndarray, "gguf.GGMLQuantizationType | None"]


def _add_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Plain values get the types llama.cpp's converter uses; (GGUFValueType, v) forces one."""
    if key == "general.alignment":
        # the writer must also pad the data to it, not just record the key
        w.add_custom_alignment(int(value[1] if isinstance(value, tuple) else value))
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], gguf.GGUFValueType):
        vtype, v = value
        w.add_key_value(key, v, vtype,
                        sub_type=gguf.GGUFValueType.INT32 if vtype == gguf.GGUFValueType.ARRAY else None)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY)
    else:
        raise TypeError(f"cannot write {key}={value!r}")


def write_test_gguf(
    path: str | Path,
    config: ModelConfig = MICRO,
    *,
    arch: str = ARCH,
    drop_keys: Iterable[str] = (),
    set_keys: Mapping[str, Any] | None = None,
    n_tokens: int | None = None,
    drop_tensors: Iterable[str] = (),
    replace_tensors: Mapping[str, TensorOverride] | None = None,
    extra_tensors: Mapping[str, TensorOverride] | None = None,
    seed: int = 0,
) -> Path:
    """Write a qwen35 GGUF for `config` (F32 weights) with the requested defects; return its path."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("loader-test")
    meta: dict[str, Any] = {k.replace(ARCH, arch, 1): v for k, v in config.gguf_metadata().items()}
    n_tok = config.n_vocab if n_tokens is None else n_tokens
    tokens = [f"<tok{i}>" for i in range(n_tok)]
    meta.update({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * n_tok,
        "tokenizer.ggml.merges": ["a b", "ab c"],
        "tokenizer.ggml.eos_token_id": n_tok - 1,
        "tokenizer.ggml.bos_token_id": n_tok - 2,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    })
    meta.update(set_keys or {})
    for key in drop_keys:
        meta.pop(key, None)
    if "general.architecture" in set(drop_keys):
        w.kv_data[0].pop("general.architecture")   # the writer adds it on construction
    for key, value in meta.items():
        _add_value(w, key, value)

    dropped = set(drop_tensors)
    replaced = dict(replace_tensors or {})
    for spec in all_tensors(config):
        if spec.name in dropped:
            continue
        if spec.name in replaced:
            data, qtype = replaced.pop(spec.name)
            w.add_tensor(spec.name, data, raw_dtype=qtype)
            continue
        shape = tuple(reversed(spec.ne))
        w.add_tensor(spec.name, rng.standard_normal(shape, dtype=np.float32) * 0.05)
    for name, (data, qtype) in list(replaced.items()) + list((extra_tensors or {}).items()):
        w.add_tensor(name, data, raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory) -> Path:
    """A valid MICRO-shaped qwen35 GGUF with an MTP block (shared; never modify it)."""
    return write_test_gguf(tmp_path_factory.mktemp("micro") / "micro.gguf")
