"""A tiny GGUF of another architecture (llama: attention + SwiGLU, F32 random weights) with the
project's own tokenizer and chat template: the model the native engine declines and llama.cpp
runs, to test the fallback through every adapter (`write_llama_gguf`)."""

from __future__ import annotations

import os

import numpy as np

from .synth import add_tokenizer


def write_llama_gguf(path: str | os.PathLike[str], *, n_vocab: int = 4352, n_embd: int = 64,
                     n_layer: int = 2, n_head: int = 4, n_ff: int = 128, n_ctx_train: int = 4096,
                     seed: int = 0) -> None:
    import gguf

    g = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_name("openjet-test-llama")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(0)
    add_tokenizer(w, n_vocab)

    def mat(rows: int, cols: int) -> np.ndarray:     # numpy shape (rows, cols) = ggml ne (cols, rows)
        return (g.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", mat(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
