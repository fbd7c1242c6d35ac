"""The one place for tensor names and shapes of a qwen35 GGUF.

Shapes are in GGUF/ggml order (`ne`): ne[0] is the input dimension, the fastest-varying one.
A 2-D weight with ne = (n_in, n_out) is, as a numpy array, `[n_out, n_in]`, so `y = W @ x`.
The writer (testing/synth.py), the validator (model_file.py), the reference and the native
engine's description all walk this list.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]
    required: bool = True
    # "matrix": a projection (quantised in real files); "vector": norms, biases, conv kernel (F32)
    kind: str = "matrix"
    # main layer index or the MTP block index; None for global tensors
    layer: int | None = None
    # which part of the model needs it: "main", "mtp"
    part: str = "main"


def _vec(name: str, n: int, layer: int | None, part: str = "main", required: bool = True) -> TensorSpec:
    return TensorSpec(name, (n,), required, "vector", layer, part)


def _mat(name: str, n_in: int, n_out: int, layer: int | None, part: str = "main",
         required: bool = True) -> TensorSpec:
    return TensorSpec(name, (n_in, n_out), required, "matrix", layer, part)


def _attention_block(c: ModelConfig, il: int, part: str) -> list[TensorSpec]:
    p = f"blk.{il}."
    return [
        _mat(p + "attn_q.weight", c.n_embd, 2 * c.q_dim, il, part),   # query and output gate per head
        _mat(p + "attn_k.weight", c.n_embd, c.kv_dim, il, part),
        _mat(p + "attn_v.weight", c.n_embd, c.kv_dim, il, part),
        _mat(p + "attn_output.weight", c.q_dim, c.n_embd, il, part),
        _vec(p + "attn_q_norm.weight", c.head_dim, il, part),
        _vec(p + "attn_k_norm.weight", c.head_dim, il, part),
    ]


def _ffn_and_norms(c: ModelConfig, il: int, part: str) -> list[TensorSpec]:
    p = f"blk.{il}."
    return [
        _vec(p + "attn_norm.weight", c.n_embd, il, part),
        _vec(p + "post_attention_norm.weight", c.n_embd, il, part),
        _mat(p + "ffn_gate.weight", c.n_embd, c.n_ff, il, part),
        _mat(p + "ffn_up.weight", c.n_embd, c.n_ff, il, part),
        _mat(p + "ffn_down.weight", c.n_ff, c.n_embd, il, part),
    ]


def _deltanet_block(c: ModelConfig, il: int) -> list[TensorSpec]:
    p = f"blk.{il}."
    return [
        _mat(p + "attn_qkv.weight", c.n_embd, c.ssm_conv_dim, il),
        _mat(p + "attn_gate.weight", c.n_embd, c.ssm_value_dim, il),
        TensorSpec(p + "ssm_conv1d.weight", (c.ssm_conv_kernel, c.ssm_conv_dim), True, "vector", il),
        _vec(p + "ssm_dt.bias", c.ssm_dt_rank, il),
        _vec(p + "ssm_a", c.ssm_dt_rank, il),
        _mat(p + "ssm_beta.weight", c.n_embd, c.ssm_dt_rank, il),
        _mat(p + "ssm_alpha.weight", c.n_embd, c.ssm_dt_rank, il),
        _vec(p + "ssm_norm.weight", c.ssm_d_state, il),
        _mat(p + "ssm_out.weight", c.ssm_value_dim, c.n_embd, il),
    ]


def main_tensors(c: ModelConfig) -> list[TensorSpec]:
    specs = [
        _mat("token_embd.weight", c.n_embd, c.n_vocab, None),
        _vec("output_norm.weight", c.n_embd, None),
        # absent means tied to token_embd (llama.cpp's rule); the 27B has its own
        _mat("output.weight", c.n_embd, c.n_vocab, None, required=False),
    ]
    for il in range(c.n_layer):
        specs += _ffn_and_norms(c, il, "main")
        specs += _deltanet_block(c, il) if c.is_recurrent(il) else _attention_block(c, il, "main")
    return specs


def mtp_tensors(c: ModelConfig) -> list[TensorSpec]:
    specs: list[TensorSpec] = []
    for il in range(c.n_layer, c.block_count):
        p = f"blk.{il}."
        specs += _ffn_and_norms(c, il, "mtp")
        specs += _attention_block(c, il, "mtp")
        specs += [
            _mat(p + "nextn.eh_proj.weight", 2 * c.n_embd, c.n_embd, il, "mtp"),
            _vec(p + "nextn.enorm.weight", c.n_embd, il, "mtp"),
            _vec(p + "nextn.hnorm.weight", c.n_embd, il, "mtp"),
            # absent: output_norm / token_embd / output serve instead (llama.cpp's rule)
            _vec(p + "nextn.shared_head_norm.weight", c.n_embd, il, "mtp", required=False),
            _mat(p + "nextn.embed_tokens.weight", c.n_embd, c.n_vocab, il, "mtp", required=False),
            _mat(p + "nextn.shared_head_head.weight", c.n_embd, c.n_vocab, il, "mtp", required=False),
        ]
    return specs


def all_tensors(c: ModelConfig) -> list[TensorSpec]:
    return main_tensors(c) + mtp_tensors(c)
