"""Prefill on the bench model: the `prefill_tps` rows ("2,700 tokens appended at depth 1,800",
"12,000 appended at depth 29,500"), and the arithmetic that says how much of the card they use.

Measurement (our engine, run by the child process bench/ours.py): the state is filled to the depth
with random tokens and saved in a checkpoint; each repetition restores it (as llama-bench restores
its saved state before every `-p N -d M` repetition) and appends N random tokens with one
`eval_argmax` call: oj_prefill in passes of prefill_chunk positions, then the copy of the last
position's argmax, which waits for the GPU. One sample = N / elapsed. Like llama.cpp, which runs no
MTP block, the main model alone: the state starts with 8 positions through oj_eval without MTP
rows (bench/ours.py `_main_model_start`), and the engine's prefill makes MTP rows only when the
MTP cache ends at n_past, so the timed appends make none. Depths below 8 are refused for that.

Work per sample (what "fraction of the card's bf16 tensor-core rate" divides by):

    FLOPs = 2 * projection_params * N                          every matrix of the main model, once
                                                               per appended position
          + 2 * n_embd * n_vocab                               the output head, last position only
          + 4 * N * avg_kv * head_dim * n_head * n_attention   causal attention: QK^T and PV over
                                                               avg_kv = depth + (N + 1) / 2 keys

The token embedding is indexed, not multiplied; the Gated DeltaNet recurrence (about 6 * d_state^2
FLOPs per value head and position, under 1% of the projections at the 27B's shapes), norms and
activations are left out. The fraction is tokens/s * FLOPs / N over the card's dense bf16 rate.
"""

from __future__ import annotations

import time

import numpy as np

# Dense (no structured sparsity) bf16 tensor-core rates, TFLOP/s, by a substring of the GPU name.
# H200 SXM: NVIDIA's datasheet gives 1,979 TFLOPS bf16 "with sparsity", i.e. 989 dense (the same
# SM90 tensor cores and clocks as the H100 SXM). Our prefill GEMMs run int8 mma, whose dense rate
# is twice that (1,979 TOPS); the bf16 rate is the yardstick the issue asks for.
H200_BF16_DENSE_TFLOPS = 989.0
DENSE_BF16_TFLOPS = {"H200": H200_BF16_DENSE_TFLOPS}

PREFILL_WARMUP = 1           # untimed repetitions before the timed ones (kernels, allocator)


def projection_params(config) -> int:
    """Weights one appended position multiplies in the main model (no embedding, head or MTP)."""
    c = config
    E, F = c.n_embd, c.n_ff
    ffn = 3 * E * F
    attention = E * 2 * c.q_dim + 2 * E * c.kv_dim + c.q_dim * E          # wq (q and gate), wk, wv, wo
    deltanet = (E * c.ssm_conv_dim + E * c.ssm_value_dim + 2 * E * c.ssm_dt_rank   # qkv, gate, beta, alpha
                + c.ssm_value_dim * E)                                             # ssm_out
    return (c.n_layer * ffn + len(c.attention_layers()) * attention
            + len(c.deltanet_layers()) * deltanet)


def attention_flops(config, new_tokens: int, depth: int) -> float:
    """QK^T and PV of N causal queries over the cache at `depth` plus the pass itself."""
    c = config
    avg_kv = depth + (new_tokens + 1) / 2
    return 4.0 * new_tokens * avg_kv * c.head_dim * c.n_head * len(c.attention_layers())


def prefill_flops(config, new_tokens: int, depth: int) -> float:
    """The FLOPs of appending `new_tokens` at `depth` (module docstring)."""
    if new_tokens < 1 or depth < 0:
        raise ValueError(f"prefill of {new_tokens} tokens at depth {depth}: need new_tokens >= 1, depth >= 0")
    return (2.0 * projection_params(config) * new_tokens + 2.0 * config.n_embd * config.n_vocab
            + attention_flops(config, new_tokens, depth))


def peak_bf16_tflops(gpu_name: str | None) -> float | None:
    """The card's dense bf16 tensor-core rate when we know it (None otherwise)."""
    for key, rate in DENSE_BF16_TFLOPS.items():
        if gpu_name and key.lower() in gpu_name.lower():
            return rate
    return None


def tensor_core_fraction(tokens_per_second: float, flops: float, new_tokens: int, peak_tflops: float) -> float:
    """Achieved FLOP rate over the peak: (tokens/s / N) runs per second times FLOPs per run."""
    return tokens_per_second / new_tokens * flops / (peak_tflops * 1e12)


def parse_rows(text: str) -> list[tuple[int, int]]:
    """'2700:1800,12000:29500' -> [(2700, 1800), (12000, 29500)] (new tokens : depth)."""
    out = []
    for item in (x for x in (text or "").split(",") if x.strip()):
        a, sep, b = item.partition(":")
        try:
            if not sep:
                raise ValueError
            n, d = int(a), int(b)
            if n < 1 or d < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"--prefill: expected NEW_TOKENS:DEPTH items like 2700:1800, got {item!r}") from None
        out.append((n, d))
    return out


def prefill_samples(be, new_tokens: int, reps: int, rng: np.random.Generator, restore) -> list[float]:
    """`reps` timed appends of `new_tokens` random tokens (after PREFILL_WARMUP untimed ones), each
    from the state `restore()` puts back; tokens/s per repetition."""
    samples = []
    for r in range(-PREFILL_WARMUP, reps):
        restore()
        toks = rng.integers(0, be.n_vocab, size=new_tokens).tolist()
        t0 = time.perf_counter()
        be.eval_argmax(toks)                      # oj_prefill passes + the last argmax's copy
        dt = time.perf_counter() - t0
        if r >= 0:
            samples.append(new_tokens / dt)
    return samples
