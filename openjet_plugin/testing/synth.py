"""Generated qwen35 GGUFs: the test models of this project (no real checkpoint can be fetched here).

A generated file is what llama.cpp's converter would write for a Qwen3.5-style checkpoint of the
chosen `ModelConfig`: the same metadata keys, tensor names and shapes (`tensors.all_tensors`), the
converter's weight conventions (RMSNorm weights stored as 1+w, `ssm_a = -exp(A_log)`, the
conv kernel as ne=(kernel, channels)), a real byte-level BPE tokenizer and a Qwen3 chat template.
Weights are random, scaled so that activations stay O(1) through every layer and the logits
depend strongly on the input, with a confident top token at most positions as a real model has
(see "Confidence structure" below).

Two ways to a quantised file:
- small presets: write F32, then llama.cpp's own quantiser (`llama_model_quantize`), so the type
  mix is exactly llama.cpp's recipe;
- q27b (the 27B's shapes; an F32 intermediate would be ~100 GB): quantised blocks written
  directly, tensor by tensor, with the types `q4_k_m_type_map` says llama.cpp would choose: random
  blocks, except the few tensors that carry the confidence structure, quantised from float row
  chunks by `quantize_rows` (see "The direct writer's confidence structure").
Both take `mtp_accuracy`: an MTP head that drafts the main model's next choice after a chosen share
of the tokens instead of nearly all (see "MTP accuracy"), and `mtp_runner_up`: where that head is
wrong, the right token its second choice after a chosen share of those tokens (see "MTP runner-up").
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..config import ARCH, PRESETS, ModelConfig
from ..tensors import TensorSpec, all_tensors
from . import bpe

CHAT_TEMPLATE_FILE = bpe.DATA_DIR / "chat_template.jinja"

QUANTS = ("F32", "F16", "Q8_0", "Q6_K", "Q4_K_M")
# llama.cpp's llama_ftype values (also written as general.file_type)
FTYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18}
# presets whose F32 intermediate would not fit a disk: only the direct Q4_K_M writer serves them
DIRECT_ONLY = {"q27b"}

# Weight scales. Matrices are N(0, gain^2 / fan_in), so each projection keeps the RMS of its
# input times `gain`; the residual stream starts at RMS 1 (embedding) and grows slowly.
EMBED_STD = 1.0
# Output projections of the residual branches (attn_output, ssm_out, ffn_down, also in the MTP
# block) get RESIDUAL_GAIN / sqrt(2 * n_layer), as GPT-2 initialises them: the branches of all
# layers together then add about as much as the embedding, so the logits still depend strongly on
# the context, but each layer moves the stream only a little. With gain 1 every branch was as
# large as the stream and the ~1-2% rounding llama.cpp's CPU applies to each product's input
# (heavy-tailed SwiGLU / gated-norm activations in 8-bit blocks) went straight into the stream,
# layer after layer: llama.cpp on a quantised file then disagreed with exact math on 14% of
# the top tokens of `small`.
RESIDUAL_GAIN = 0.7
RESIDUAL_OUTPUTS = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")
# ffn_down gets a further FFN_DOWN_GAIN: the FFN mixes no positions (the context reaches the stream
# through DeltaNet and attention), and its input silu(gate)*up is the most heavy-tailed of all,
# so it is rounded worst by llama.cpp's 8-bit blocks (about 1.5%).
FFN_DOWN_GAIN = 0.3
# The direct writer's output head (q27b, synth_uniform): N(0, LOGIT_GAIN^2 / n_embd) rows, logits
# of std about 4.
LOGIT_GAIN = 4.0
ALPHA_GAIN = 0.5      # ssm_alpha: keeps softplus(alpha x + dt_bias) moderate so decays stay in (0, 1)
NORM_SPREAD = 0.1     # norm weights (stored 1+w) in [0.9, 1.1]
# Output rows of the UNUSED [PADn] tokens that pad the 27B's vocabulary (244K of 248K rows) get
# this fraction of the scale, as untrained rows of a real head are near zero: otherwise their
# sheer number would put ~98% of the probability mass on tokens that detokenize to nothing.
PAD_ROW_SCALE = 0.1


# Confidence structure of the generated F32 (and llama.cpp-quantised) files. With a plain random
# head the logits are ~4096 Gaussian draws: the top two are typically 0.7 nats apart, 8% of
# positions are within 0.1, and llama.cpp's 8-bit rounding of activations (~0.03 nats per logit)
# flipped 1.5-3% of the top tokens. A real model is confident at most positions. So the residual
# stream has two halves:
# - the token half (first n_embd/2 dims) carries the token embedding (+-1; zero in the other half)
#   and nothing else: no branch writes there;
# - the context half is where every residual branch (DeltaNet, attention, FFN, also in the MTP
#   block) writes: the position's context.
# The head reads the token half through a "successor" map: row successor_of[x] is x's embedding
# times SUCCESSOR_GAIN / (n_embd/2), so after token x that token leads by several nats (its logit
# is the full overlap of two aligned +-1 vectors, which rounding noise, spread over all
# directions, barely moves).
# It reads the context half through a random N(0, CONTEXT_LOGIT_GAIN^2/(n_embd/2)) part: the rest
# of the distribution (and how sure the model is) depends strongly on the context.
# The MTP block's eh_proj copies the token half of its token's embedding, so the draft head
# favours successor_of[next token]: the main model's own next prediction, as a trained MTP would.
# Measured on tiny and small, seeds 0-3, 300 positions of real text: the successor is the top
# token at 95-99.7% of positions (the context outbids it at the rest); the median top-1 vs top-2
# gap is 3.5-4.5 nats (a random head: 0.7) with at most 1.7% of positions under 0.1 nats (was
# 6-13%); the mean top probability is ~0.6; llama.cpp on the quantised files agrees with exact
# math on >= 99.3% of the top tokens (was 97.0-99.7%) at mean KL <= 4.2e-4.
# A larger CONTEXT_LOGIT_GAIN lets the context win more tops, but those are the near-ties that
# llama.cpp's rounding flips, and the rounding of the context half costs more KL; a larger
# SUCCESSOR_GAIN leaves the context too little say (the same last token after two contexts).
SUCCESSOR_GAIN = 8.0
CONTEXT_LOGIT_GAIN = 4.5
# eh_proj's context rows: small enough that the MTP head picks the main model's next top token at
# 98-99.7% of positions of tiny and small (at 0.5 only ~65%: the mixed-in context outweighs the
# token half)
MTP_CONTEXT_GAIN = 0.3
# With `mtp_accuracy` (a draft head right at a chosen rate, see "MTP accuracy" below): eh_proj's
# token half is this many times the embedding's, so that the context half of the draft head's input
# weighs this much less and decides only the tokens right at the switch's threshold.
MTP_SWITCH_TOKEN_GAIN = 16.0


def token_dims(config: ModelConfig) -> int:
    """Width of the token half of the residual stream (the first dims; the rest is the context half)."""
    return config.n_embd // 2


# --- which tensors a generated file holds -------------------------------------------------------

def synth_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every required tensor plus the untied `output.weight` and the MTP `shared_head_norm`
    (the 27B has both); the MTP block reuses token_embd/output as the real checkpoint does."""
    keep_optional = ("output.weight", "nextn.shared_head_norm.weight")
    return [s for s in all_tensors(config) if s.required or s.name.endswith(keep_optional)]


def _rng(seed: int, name: str) -> np.random.Generator:
    # one stream per tensor, keyed by its name: values do not depend on the writing order
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))


def residual_gain(config: ModelConfig) -> float:
    """Gain of the residual branches' output projections for a model of `config`'s depth."""
    return RESIDUAL_GAIN / float(np.sqrt(2 * config.n_layer))


def _matrix_std(spec: TensorSpec, config: ModelConfig) -> float:
    name, n_in = spec.name, spec.ne[0]
    if name == "token_embd.weight":
        return EMBED_STD
    if name == "output.weight":
        gain = LOGIT_GAIN
    elif name.endswith("ssm_alpha.weight"):
        gain = ALPHA_GAIN
    elif name.endswith(RESIDUAL_OUTPUTS):
        gain = residual_gain(config) * (FFN_DOWN_GAIN if name.endswith("ffn_down.weight") else 1.0)
    else:
        gain = 1.0
    return gain / np.sqrt(n_in)


def tensor_values(spec: TensorSpec, seed: int, config: ModelConfig,
                  mtp_accuracy: float | None = None, mtp_runner_up: float | None = None) -> np.ndarray:
    """float32 values of one tensor, as numpy `[ne1, ne0]` (or `[ne0]` for a vector).
    `mtp_accuracy` changes only the MTP block's eh_proj and FFN (see "MTP accuracy"),
    `mtp_runner_up` only its FFN (see "MTP runner-up")."""
    name = spec.name
    g = _rng(seed, name)
    if len(spec.ne) == 1:
        n = spec.ne[0]
        if name.endswith("ssm_a"):
            # A = exp(A_log) in [1, 16] as Qwen initialises it; the converter stores -exp(A_log)
            return (-np.exp(g.uniform(0.0, np.log(16.0), n))).astype(np.float32)
        if name.endswith("ssm_dt.bias"):
            # dt in [1e-3, 1e-1] through softplus: the bias is softplus^-1(dt) (Mamba's init)
            dt = np.exp(g.uniform(np.log(1e-3), np.log(1e-1), n))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        if name.endswith("norm.weight"):
            return (1.0 + g.uniform(-NORM_SPREAD, NORM_SPREAD, n)).astype(np.float32)
        raise ValueError(f"tensor {name!r}: no rule for generating a vector of this name")
    n_in, n_rows = spec.ne
    if name == "token_embd.weight":
        # +-EMBED_STD with random signs: the stream (and so the head's input) is mostly the
        # embedding, and llama.cpp rounds the head's input in 8-bit blocks scaled by their largest
        # value, which costs a +-1 vector 2-3x less precision than a Gaussian one
        signs = g.integers(0, 2, (n_rows, n_in), dtype=np.int8) * 2 - 1
        values = signs.astype(np.float32) * np.float32(EMBED_STD)
        values[:, token_dims(config):] = 0.0       # the context half starts empty
        return values
    if name.endswith("ssm_conv1d.weight"):
        # depthwise causal conv: one kernel of n_in taps per channel, fan-in = taps
        return (g.standard_normal((n_rows, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in)))
    if name == "output.weight":
        return _output_head(spec, seed, config, g)
    values = g.standard_normal((n_rows, n_in), dtype=np.float32) * np.float32(_matrix_std(spec, config))
    if name.endswith(RESIDUAL_OUTPUTS):
        values[:token_dims(config)] = 0.0          # branches write the context half only
    elif name.endswith("nextn.eh_proj.weight"):
        # input = [enorm(token embedding), hnorm(h)]: the token half of the output is the token half
        # of the embedding and the context half a mix of both, about as large as the main stream's
        # context half (at full size it would outweigh the token half in the shared head)
        t = token_dims(config)
        values[:t] = 0.0
        values[np.arange(t), np.arange(t)] = 1.0 if mtp_accuracy is None else MTP_SWITCH_TOKEN_GAIN
        values[t:] *= np.float32(MTP_CONTEXT_GAIN)
    if mtp_accuracy is not None and name in mtp_ffn_names(config):
        decoy = None if mtp_runner_up is None else mtp_decoy(seed, config, mtp_accuracy, mtp_runner_up)
        _put_switch(values, name, mtp_switch(seed, config, mtp_accuracy), decoy)
    return values


def _output_head(spec: TensorSpec, seed: int, config: ModelConfig, g: np.random.Generator) -> np.ndarray:
    """output.weight `[n_vocab, n_embd]`: successor rows on the token half, random on the context half."""
    n_in, n_rows = spec.ne
    t = token_dims(config)
    values = np.zeros((n_rows, n_in), dtype=np.float32)
    values[:, t:] = g.standard_normal((n_rows, n_in - t), dtype=np.float32) * np.float32(
        CONTEXT_LOGIT_GAIN / np.sqrt(n_in - t))
    n_real = min(_n_real_tokens(), n_rows)
    succ = successor_of(seed, config)
    emb = tensor_values(next(s for s in synth_specs(config) if s.name == "token_embd.weight"), seed, config)
    # rmsnorm makes the token half of the head's input about +-sqrt(2) per dim: the successor's
    # logit is then about sqrt(2) * SUCCESSOR_GAIN, any other token's token-half part
    # N(0, 2 * SUCCESSOR_GAIN^2 / t)
    values[succ, :t] += emb[: len(succ), :t] * np.float32(SUCCESSOR_GAIN / t)
    values[n_real:] *= np.float32(PAD_ROW_SCALE)
    return values


def successor_of(seed: int, config: ModelConfig) -> np.ndarray:
    """`successor_of[x]`: the token a generated model (seed, config) favours right after token x,
    for each real token x (a random permutation of them)."""
    n_real = min(_n_real_tokens(), config.n_vocab)
    return _rng(seed, "output.weight/successor").permutation(n_real)


def _n_real_tokens() -> int:
    """Rows of the vocabulary that are real tokens (the rest are UNUSED padding)."""
    doc = bpe.load_shipped()
    return len(doc["tokens"]) + len(doc["special_tokens"])


# --- MTP accuracy: a draft head right at a chosen rate ------------------------------------------
# The structure above makes the MTP head draft successor_of[x] after token x, the main model's own
# next choice, at 98-99.7% of positions at every draft slot: no trained MTP head is that good
# (Qwen3.8-27B's: ~0.91 on code, ~0.49 on prose, teacher-forced). `mtp_accuracy=r` makes the draft
# head right after a fraction r of the real tokens and wrong after the others, with values of the
# MTP block's eh_proj and FFN only: the same tensors and types, the main model's bytes unchanged.
# - A seeded direction a over the token half (not its last dim, the direct writer's bias dim)
#   scores every token: p(x) = <a, sign of x's embedding>, about N(0, 1) over the vocabulary.
#   theta is set between the n_right-th and the next smallest |p| of the real tokens,
#   n_right = round(r * n_real): exactly n_right of them have |p(x)| < theta, the "right" tokens.
# - The MTP block's FFN multiplies the token half of its residual stream by
#   h(p) = 1 - phi(p / theta) / phi(1), phi(z) = silu(z) + silu(-z) = z tanh(z / 2): h > 0 for the
#   right tokens, 0 at |p| = theta, below -2 from |p| = 2 theta on. SwiGLU computes it without
#   biases, with two units per token dim k: gate +z and -z (z = p / theta, read from the token half
#   of the FFN's input), up = dim k, down = -1 / phi(1) into dim k.
# - h > 0: the head's input still points at x's embedding, so it drafts successor_of[x] (right where
#   the main model follows its successor map); h < 0: it points away from it, and the draft is some
#   other token, with little confidence (never the main model's successor choice).
# z reads the FFN's input after its RMSNorm, whose scale kappa depends on the whole stream; the
# token half is nearly all of it (eh_proj's token half is MTP_SWITCH_TOKEN_GAIN times the
# embedding's: eh_proj's context rows and the MTP attention add ~0.02% of the energy), so kappa is
# computed from the weights (`_mtp_kappa`; measured on tiny: within 1e-5). The same gain lets the
# head's context half outbid its token half only where |h| is small: measured, tokens within 1-3%
# of theta (with 4x less gain: 6%) that the switch counts right draft wrong. llama.cpp's own
# quantiser rounds the F32 path's gate rows later, which moves each token's threshold a little
# (mostly < 10%) but not the share; the direct writer's rounding is counted in (`mtp_switch`).
# Chained drafts: eh_proj copies the token, never h, into the token half, so the draft after token y
# is right iff y is a right token, whatever h (main hidden state or the head's own output) comes
# with it. A draft at slot k is made after the previous draft, which is the main model's token when
# the slot is reached at all (drafts 1..k-1 accepted); on a greedy continuation (a walk through
# ever new tokens of the successor map) each slot's acceptance is then r times the share of positions
# at which the main model follows its successor map (~0.97-0.99).
MTP_ACCURACY_KEY = "openjet.synth.mtp_accuracy"


@dataclass(frozen=True)
class MtpSwitch:
    """The float rows of the MTP FFN's switch units for one (seed, config, accuracy) (see above).

    Units u and n_dims + u (u < n_dims) serve token dim u: gate rows `gate_plus` and `gate_minus`
    (= -gate_plus, up to the file's rounding), up rows `up[u]` at column u, and `down` at row u of
    both their columns."""
    accuracy: float
    n_right: int            # real tokens whose drafts stay right
    theta: float            # the threshold on p; a token is right iff its `critical` is below it
    p: np.ndarray           # [n_real] p(x) of the real tokens, as the file's + gate row computes it
    critical: np.ndarray    # [n_real] the theta above which x is right (|p| with exact rows)
    gate_plus: np.ndarray   # [n_embd] gate rows (token half only), theta applied
    gate_minus: np.ndarray
    up: np.ndarray          # [n_dims] up weight of unit u (and of its twin) on token dim u
    down: float             # -1/phi(1), or 0 when every token is right
    p_minus: np.ndarray | None = None   # [n_real] the - gate row's value (-p up to the file's rounding)

    @property
    def n_dims(self) -> int:
        return len(self.up)

    def right(self) -> np.ndarray:
        """Boolean `[n_real]`: the tokens after which the draft head stays right."""
        return self.critical < self.theta


def mtp_accuracy_of(path: str | os.PathLike[str]) -> float | None:
    """The `mtp_accuracy` a generated file was made with (its MTP_ACCURACY_KEY), or None: made
    without it, or not a generated file."""
    from ..tokenizer import read_gguf_metadata

    value = read_gguf_metadata(path, prefix=MTP_ACCURACY_KEY).get(MTP_ACCURACY_KEY)
    return None if value is None else round(float(value), 6)


def _phi(z: float) -> float:
    return float(z * np.tanh(z / 2.0))


def mtp_ffn_names(config: ModelConfig) -> tuple[str, str, str]:
    """The MTP block's FFN tensors, which carry the switch."""
    p = f"blk.{config.mtp_layer}."
    return p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight"


def _spec(config: ModelConfig, name: str) -> TensorSpec:
    return next(s for s in synth_specs(config) if s.name == name)


def check_mtp_accuracy(config: ModelConfig, accuracy: float | None) -> None:
    """ValueError naming what is wrong with `accuracy` for `config` (None: the option is off)."""
    if accuracy is None:
        return
    if isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)) or not 0.0 < accuracy <= 1.0:
        raise ValueError(f"mtp_accuracy must be a number in (0, 1], got {accuracy!r}")
    if config.mtp_layer is None:
        raise ValueError("mtp_accuracy needs an MTP block; this config has nextn_predict_layers = 0")
    if 2 * (token_dims(config) - 1) > config.n_ff:
        raise ValueError(f"mtp_accuracy needs 2 * (n_embd/2 - 1) = {2 * (token_dims(config) - 1)} MTP FFN "
                         f"units; n_ff is {config.n_ff}")
    n_right = round(accuracy * min(_n_real_tokens(), config.n_vocab))
    if n_right < 1:
        raise ValueError(f"mtp_accuracy {accuracy} leaves no token right")


def _mtp_kappa(config: ModelConfig, token_half: np.ndarray, seed: int) -> float:
    """Expected scale of the MTP FFN's input RMSNorm: sqrt(n_embd) / |residual|, the residual being
    eh_proj's token half `token_half` (per dim, fixed) plus its context half, whose expected energy
    is (n_embd - t) * var(context rows) * |[enorm(e), hnorm(h)]|^2 (hnorm(h): its weights' energy).
    The MTP attention's part is left out: at MTP_SWITCH_TOKEN_GAIN, ~1e-5 of the energy."""
    il, n, t = config.mtp_layer, config.n_embd, token_dims(config)
    w_e = tensor_values(_spec(config, f"blk.{il}.nextn.enorm.weight"), seed, config).astype(np.float64)
    w_h = tensor_values(_spec(config, f"blk.{il}.nextn.hnorm.weight"), seed, config).astype(np.float64)
    cat = (n / t) * np.sum(w_e[:t] ** 2) + np.sum(w_h ** 2)
    context = (n - t) * MTP_CONTEXT_GAIN ** 2 / (2 * n) * cat
    return float(np.sqrt(n / (np.sum(token_half.astype(np.float64) ** 2) + context)))


@lru_cache(maxsize=8)
def mtp_switch(seed: int, config: ModelConfig, accuracy: float, gate_type: str | None = None) -> MtpSwitch:
    """The switch of a generated model (seed, config) with `mtp_accuracy=accuracy`. `gate_type`: the
    GGML type its gate row is written in (the direct writer's), whose rounding p(x) then includes;
    None: float values (the F32 path; llama.cpp's quantiser rounds them later, a little)."""
    check_mtp_accuracy(config, accuracy)
    il, t, n = config.mtp_layer, token_dims(config), config.n_embd
    n_dims = t - 1
    n_real = min(_n_real_tokens(), config.n_vocab)
    if gate_type is None:
        emb = tensor_values(_spec(config, "token_embd.weight"), seed, config)
        signs = np.sign(emb[:n_real, :n_dims]).astype(np.float64)
    else:
        signs = _embedding_signs(seed, config, 0, n_real)[:, :n_dims].astype(np.float64)
    # the residual's token half after eh_proj: enorm(e) (e: +-EMBED_STD on the token half, zero
    # elsewhere, so its RMS is EMBED_STD * sqrt(t/n)) times the token gain
    w_e = tensor_values(_spec(config, f"blk.{il}.nextn.enorm.weight"), seed, config).astype(np.float64)
    token_half = MTP_SWITCH_TOKEN_GAIN * np.sqrt(n / t) * w_e[:t]
    kappa = _mtp_kappa(config, token_half, seed)
    w_post = tensor_values(_spec(config, f"blk.{il}.post_attention_norm.weight"), seed, config).astype(np.float64)
    # the FFN input's token dim k is kappa * w_post[k] * token_half[k] * sign_k: these rows read
    # sum_k a_k sign_k = p(x) (gate, before the 1/theta) and token_half[k] * sign_k (up)
    a = _rng(seed, "mtp_accuracy/direction").standard_normal(n_dims)
    a /= np.linalg.norm(a)
    read = kappa * w_post[:n_dims] * token_half[:n_dims]
    rows = np.zeros((2, n), dtype=np.float32)
    rows[0, :n_dims] = a / read
    rows[1] = -rows[0]
    if gate_type is not None:
        # the two rows as the file will hold them (an asymmetric type such as Q4_K rounds -v and v
        # differently): each token's critical theta from both
        import gguf

        rows = gguf.quants.dequantize(quantize_rows(rows, gate_type), gguf.GGMLQuantizationType[gate_type])
        rows = rows.reshape(2, n).astype(np.float32)
    z = signs @ (rows[:, :n_dims].astype(np.float64) * read).T          # [n_real, 2] at theta = 1
    critical = _critical_theta(z[:, 0], z[:, 1])
    n_right = round(accuracy * n_real)
    if n_right >= n_real:
        theta, down, rows = float("inf"), 0.0, np.zeros_like(rows)
    else:
        c = np.sort(critical)
        theta = float(0.5 * (c[n_right - 1] + c[n_right]))
        rows, down = (rows / np.float32(theta)).astype(np.float32), -1.0 / _phi(1.0)
    up = (1.0 / (kappa * w_post[:n_dims])).astype(np.float32)
    return MtpSwitch(float(accuracy), n_right, theta, z[:, 0], critical, rows[0], rows[1], up, down, z[:, 1])


def _critical_theta(z_plus: np.ndarray, z_minus: np.ndarray) -> np.ndarray:
    """Per token, the theta at which h = 1 - (silu(z+/theta) + silu(z-/theta)) / phi(1) crosses 0
    (z-: the second unit's gate, -z+ up to rounding): |z+| when z- = -z+; by bisection otherwise
    (0 where h stays positive)."""
    if np.array_equal(z_minus, -z_plus):
        return np.abs(z_plus)

    def h(theta):
        sp, sm = z_plus / theta, z_minus / theta
        with np.errstate(over="ignore"):
            return 1.0 - (sp / (1 + np.exp(-sp)) + sm / (1 + np.exp(-sm))) / _phi(1.0)

    scale = np.maximum(np.abs(z_plus), np.abs(z_minus))
    lo, hi = scale * 1e-3 + 1e-12, scale * 10.0 + 1e-12           # h(lo) < 0 < h(hi) where it crosses
    crosses = h(lo) < 0
    for _ in range(60):
        mid = np.sqrt(lo * hi)
        neg = h(mid) < 0
        lo, hi = np.where(neg, mid, lo), np.where(neg, hi, mid)
    return np.where(crosses, np.sqrt(lo * hi), 0.0)


def _put_switch(values: np.ndarray, name: str, sw: MtpSwitch, decoy: "MtpDecoy | None" = None) -> None:
    """Write the switch units (and the decoy's two units, `mtp_runner_up`) into the float values of
    one MTP FFN tensor (F32 path)."""
    m = sw.n_dims
    k = np.arange(m)
    down = sw.down if decoy is None else decoy.switch_down
    if name.endswith("ffn_gate.weight"):
        values[:m] = sw.gate_plus
        values[m:2 * m] = sw.gate_minus
    elif name.endswith("ffn_up.weight"):
        values[:2 * m] = 0.0
        values[k, k] = sw.up
        values[m + k, k] = sw.up
    elif name.endswith("ffn_down.weight"):
        values[:, :2 * m] = 0.0
        values[k, k] = down
        values[k, m + k] = down
    else:
        raise ValueError(f"tensor {name!r} carries no part of the MTP switch")
    if decoy is not None and decoy.strength > 0:
        units = slice(2 * m, 2 * m + 2)
        if name.endswith("ffn_down.weight"):
            values[:, units] = decoy.down_cols
        else:
            values[units] = decoy.gate_rows if name.endswith("ffn_gate.weight") else decoy.up_rows


# --- MTP runner-up: where the draft head is wrong, the right token second -------------------------
# Where the switch above makes the draft head wrong, its draft is some other token with little
# confidence and the right token (successor_of[x]) is ranked last: a draft tree's second branch
# never wins there. A trained MTP head is not like that: where its top-1 misses, the right token is
# very often its second or third choice (EAGLE's top-k recall is far above its top-1).
# `mtp_runner_up=q` (with `mtp_accuracy`) makes the right token the head's second choice after a
# share q of the wrong tokens, and its first choice a decoy: one fixed real token D (the successor
# of a seeded right token), the same after every wrong token. Only the MTP FFN changes (the right
# tokens and their share stay the switch's):
# - two more FFN units (after the switch's 2 * n_dims) add a constant vector to the token half of
#   the residual: gate and up both read c times token dim 0 of the FFN's input (+ for one unit, -
#   for its twin), and silu(z) z + silu(-z) (-z) = z^2 exactly, for any z: the input's dim 0 is
#   +-v0 (v0 = kappa * w_post[0] * token_half[0], the same for every token), so both units together
#   give the constant (c v0)^2, and their down column writes it as delta * token_half[k] * d_k into
#   token dim k, d = the signs of D's predecessor's embedding (the head row of D);
# - the switch's down becomes -(1 - delta) / phi(1): the token half after the FFN is then
#   token_half[k] * (h s_k + delta d_k) with h = 1 - (1 - delta) phi(p / theta) / phi(1).
# With s the token's signs, the logit of successor_of[x] minus that of D is
# (h - delta) * sum_k w_k (1 - s_k d_k) (w_k > 0: token_half times the shared head norm), so the
# right tokens (h > delta iff phi(p / theta) < phi(1) iff |p| < theta) are the switch's, whatever
# delta; after a wrong token D leads, and the successor is second iff it still beats every other
# row, whose logits are linear in delta too. So each wrong token is a runner-up for delta in an
# interval known from the weights (`_runner_up_interval`), and delta is set, as theta is, where
# exactly n_runner = round(q * n_wrong) of the intervals hold it (in the widest such gap: the
# context half, the MTP attention and llama.cpp's rounding move logits by ~0.1 nats, which flips
# only tokens whose interval ends within a few % of delta). The head's last token dim (the direct
# writer's bias dim; never switched) is counted in exactly. Chained drafts: as for the switch, the
# class of a draft depends only on its input token (eh_proj copies the token, and the decoy vector
# is constant), so the draft after token y has the right token second iff y is a runner-up token.
# q = 0 adds nothing (delta = 0: the MTP FFN's values are those of mtp_accuracy alone).
# Measured on tiny, seed 0, with the numpy reference (one run each):
# - teacher-forced first draft on tiny's greedy continuation of a real-text prompt (300 positions,
#   F32, as tests/test_synth_runner_up.py measures): top-1 / top-2 / right token second of the misses
#     accuracy 0.6:  q none 0.572 / 0.572 / 0.00, q 0.5 0.582 / 0.773 / 0.46, q 0.8 0.582 / 0.913 / 0.79,
#                    q 0.9 0.582 / 0.953 / 0.89
#     accuracy 0.75: q none 0.702 / 0.702 / 0.00, q 0.5 0.716 / 0.870 / 0.54, q 0.8 0.719 / 0.946 / 0.81,
#                    q 0.9 0.722 / 0.980 / 0.93; the direct writer's Q4_K_M at q 0.8: top-1 0.766, 0.73
# - greedy tokens per cycle, tiny Q8_0, 4 held-out stdlib prompts x 64 tokens (test_speculative's
#   heldout_prompts), tree = reference_decoder(model, tree=TreePolicy(8)) against chains D = 1..7
#   (DepthPolicy(D, adaptive=False)); the best chain was D = 7 (verify budget 8) every time:
#     accuracy 0.6:  q none 2.29 vs 2.29 (1.00x), q 0.5 2.56 vs 2.29 (1.12x), q 0.8 2.72 vs 2.29 (1.19x)
#     accuracy 0.75: q none 3.24 vs 3.20 (1.01x), q 0.5 3.56 vs 3.37 (1.06x), q 0.8 3.46 vs 3.37 (1.03x)
#     the trained default model: 3.61 vs 3.05 (1.18x)
#   Where each draft is right independently (top-1 a, the right token second at (1 - a) q), the best
#   tree of 7 drafts (best-first on path probabilities) gives 1.12x / 1.22x / 1.31x the best chain at
#   a = 0.6 and q = 0.5 / 0.8 / 1, 1.00x / 1.02x / 1.04x at a = 0.75: the measured rows are at that
#   bound; at budget 16 it is 1.29x / 1.50x (a = 0.6) and 1.09x / 1.17x (a = 0.75).
MTP_RUNNER_UP_KEY = "openjet.synth.mtp_runner_up"


@dataclass(frozen=True)
class MtpDecoy:
    """The decoy of one (seed, config, accuracy, runner_up) (see "MTP runner-up"): which token it is,
    its strength delta, which wrong tokens then rank the right token second, and the float weights
    of its two FFN units (unit 2 * n_dims and its twin)."""
    runner_up: float
    decoy: int               # the token the head drafts after a wrong token (D)
    strength: float          # delta (0: no decoy)
    n_runner: int            # wrong tokens after which the right token is second (ideal logits)
    lo: np.ndarray           # [n_real] delta interval in which token x is a runner-up (empty for
    hi: np.ndarray           #   right tokens: lo = hi = nan)
    switch_down: float       # the switch units' down weight, -(1 - delta) / phi(1)
    gate_rows: np.ndarray    # [2, n_embd]
    up_rows: np.ndarray      # [2, n_embd]
    down_cols: np.ndarray    # [n_embd, 2]

    def runner(self) -> np.ndarray:
        """Boolean `[n_real]`: the tokens after which the head drafts D and ranks the right token second."""
        with np.errstate(invalid="ignore"):
            return (self.lo < self.strength) & (self.strength < self.hi)


def mtp_runner_up_of(path: str | os.PathLike[str]) -> float | None:
    """The `mtp_runner_up` a generated file was made with (its MTP_RUNNER_UP_KEY), or None."""
    from ..tokenizer import read_gguf_metadata

    value = read_gguf_metadata(path, prefix=MTP_RUNNER_UP_KEY).get(MTP_RUNNER_UP_KEY)
    return None if value is None else round(float(value), 6)


def check_mtp_runner_up(config: ModelConfig, accuracy: float | None, runner_up: float | None) -> None:
    """ValueError naming what is wrong with `runner_up` (None: the option is off) beside `accuracy`."""
    if runner_up is None:
        return
    if isinstance(runner_up, bool) or not isinstance(runner_up, (int, float)) or not 0.0 <= runner_up < 1.0:
        # at 1 even the wrong tokens nearest the threshold would need the decoy, whose strength then
        # goes to the right draft's own (delta -> 1): the right tokens' lead over the decoy, (h - delta),
        # vanishes and the context half flips them (measured: top-1 0.49 instead of 0.72 at accuracy 0.75)
        raise ValueError(f"mtp_runner_up must be a number in [0, 1), got {runner_up!r}")
    if accuracy is None:
        raise ValueError("mtp_runner_up needs mtp_accuracy: it shapes the drafts the accuracy switch makes wrong")
    check_mtp_accuracy(config, accuracy)
    if round(accuracy * min(_n_real_tokens(), config.n_vocab)) >= min(_n_real_tokens(), config.n_vocab):
        raise ValueError(f"mtp_runner_up needs mtp_accuracy < 1 (at {accuracy} no draft is wrong)")
    if 2 * token_dims(config) > config.n_ff:
        raise ValueError(f"mtp_runner_up needs 2 * (n_embd/2 - 1) + 2 = {2 * token_dims(config)} MTP FFN "
                         f"units; n_ff is {config.n_ff}")


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def _runner_up_interval(alpha: np.ndarray, beta: np.ndarray, own: np.ndarray, decoy_col: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Per row i (a wrong token, its successor's head row in column own[i]) of logits
    alpha + delta * beta `[rows, n_real]`: the open interval of delta in (0, 1) in which the decoy's
    column leads and own[i] beats every other column -> (lo, hi), lo >= hi where there is none."""
    r = np.arange(len(own))
    a = alpha[r, own][:, None] - alpha          # own minus each column: must stay > 0
    b = beta[r, own][:, None] - beta
    a[r, own] = 1.0                             # own and the decoy: not among "the others"
    b[r, own] = 0.0
    a[:, decoy_col] = -(a[:, decoy_col])        # the decoy must beat own instead
    b[:, decoy_col] = -(b[:, decoy_col])
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = -a / b
    lo = np.max(np.where(b > 0, bound, 0.0), axis=1)
    hi = np.min(np.where(b < 0, bound, 1.0), axis=1)
    never = np.any((b == 0) & (a <= 0), axis=1)
    lo[never], hi[never] = 1.0, 0.0
    return np.clip(lo, 0.0, 1.0), np.clip(hi, 0.0, 1.0)


def _strength_for(lo: np.ndarray, hi: np.ndarray, n_runner: int) -> float:
    """The delta in the widest gap between interval ends at which exactly n_runner of the intervals
    (lo, hi) hold it (else, failing that, the nearest count)."""
    if n_runner == 0:
        return 0.0
    keep = lo < hi
    lo, hi = np.sort(lo[keep]), np.sort(hi[keep])
    ends = np.unique(np.clip(np.concatenate([lo, hi, [0.0, 1.0]]), 0.0, 1.0))
    mids = 0.5 * (ends[:-1] + ends[1:])
    count = np.searchsorted(lo, mids, side="left") - np.searchsorted(hi, mids, side="right")
    width = np.diff(ends)
    miss = np.abs(count - n_runner)
    best = np.lexsort((-width, miss))[0]        # the exact count first, then the widest gap
    return float(mids[best])


@lru_cache(maxsize=8)
def mtp_decoy(seed: int, config: ModelConfig, accuracy: float, runner_up: float,
              gate_type: str | None = None) -> MtpDecoy:
    """The decoy of a generated model (seed, config) with `mtp_accuracy=accuracy` and
    `mtp_runner_up=runner_up` (see "MTP runner-up"); `gate_type` as for `mtp_switch`."""
    check_mtp_runner_up(config, accuracy, runner_up)
    sw = mtp_switch(seed, config, accuracy, gate_type)
    il, t, n, m = config.mtp_layer, token_dims(config), config.n_embd, sw.n_dims
    n_real = min(_n_real_tokens(), config.n_vocab)
    if gate_type is None:
        signs = np.sign(tensor_values(_spec(config, "token_embd.weight"), seed, config)[:n_real, :t])
    else:
        signs = _embedding_signs(seed, config, 0, n_real)
    signs = signs.astype(np.float64)
    w_e = tensor_values(_spec(config, f"blk.{il}.nextn.enorm.weight"), seed, config).astype(np.float64)
    token_half = MTP_SWITCH_TOKEN_GAIN * np.sqrt(n / t) * w_e[:t]
    w_head = tensor_values(_spec(config, f"blk.{il}.nextn.shared_head_norm.weight"), seed, config)[:t]
    right = sw.right()
    succ = successor_of(seed, config)
    pred_of_decoy = int(_rng(seed, "mtp_runner_up/decoy").choice(np.flatnonzero(right)))
    decoy = int(succ[pred_of_decoy])
    # u(x) = phi(p / theta) / phi(1) as the file's two gate rows compute it
    z_minus = -sw.p if sw.p_minus is None else sw.p_minus
    u = (_silu(sw.p / sw.theta) + _silu(z_minus / sw.theta)) / _phi(1.0)
    wrong = np.flatnonzero(~right)
    n_runner = int(round(runner_up * len(wrong)))
    # token half after the FFN: token_half * (s * h + delta * d) on the switched dims (h = 1 - (1 -
    # delta) u), token_half * (s + delta * d) on the last; the head's token-half logit of
    # successor_of[j] is its dot with w_head * signs[j]: alpha + delta * beta
    d = signs[pred_of_decoy]
    s_w, u_w = signs[wrong], u[wrong][:, None]
    switched = np.arange(t) < m
    r0 = token_half * s_w * np.where(switched, 1.0 - u_w, 1.0)
    r1 = token_half * (np.where(switched, s_w * u_w, 0.0) + d)
    alpha = (r0 * w_head) @ signs.T
    beta = (r1 * w_head) @ signs.T
    lo_w, hi_w = _runner_up_interval(alpha, beta, wrong, pred_of_decoy)
    strength = _strength_for(lo_w, hi_w, n_runner)
    lo, hi = np.full(n_real, np.nan), np.full(n_real, np.nan)
    lo[wrong], hi[wrong] = lo_w, hi_w
    n_got = int(np.sum((lo_w < strength) & (strength < hi_w)))
    # the two units: gate = up = +-c * (FFN input dim 0); their product (c v0)^2 = P is chosen so
    # that the down entries are about as large as the switch's (one block scale serves both)
    switch_down = -(1.0 - strength) / _phi(1.0)
    gate_rows = np.zeros((2, n), dtype=np.float32)
    down_cols = np.zeros((n, 2), dtype=np.float32)
    if strength > 0:
        kappa = _mtp_kappa(config, token_half, seed)
        w_post = tensor_values(_spec(config, f"blk.{il}.post_attention_norm.weight"), seed, config)
        v0 = kappa * float(w_post[0]) * token_half[0]
        power = strength * float(np.mean(token_half)) / abs(switch_down)
        c = np.sqrt(power) / v0
        gate_rows[0, 0], gate_rows[1, 0] = c, -c
        down_cols[:t, :] = (strength * token_half * d / power)[:, None]
    return MtpDecoy(float(runner_up), decoy, strength, n_got, lo, hi, float(switch_down),
                    gate_rows, gate_rows.copy(), down_cols)


# --- llama.cpp's Q4_K_M recipe ------------------------------------------------------------------

def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama-quant.cpp: the first and last eighth of the layers, and every third one between
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def q4_k_m_type_map(config: ModelConfig) -> dict[str, str]:
    """Tensor name -> GGML type name that llama.cpp's quantiser picks for Q4_K_M (src/llama-quant.cpp).

    - vectors and the conv kernel are never quantised: F32;
    - output.weight (untied): Q6_K; token_embd: the default Q4_K;
    - attn_v and the DeltaNet attn_qkv count as one "attention V" family, numbered in tensor
      order (by layer, MTP block last); ffn_down is numbered by layer over all blocks; both get
      Q6_K where use_more_bits(i, n) holds, otherwise Q4_K;
    - every other matrix: Q4_K.
    (llama.cpp would fall back to Q5_0/Q8_0 for widths not divisible by 256; the presets avoid that.)
    """
    specs = synth_specs(config)
    n_wv = sum(1 for s in specs if s.name.endswith(("attn_v.weight", "attn_qkv.weight")))
    n_down = config.block_count
    types: dict[str, str] = {}
    i_wv = 0
    # llama.cpp walks tensors sorted by (layer, name); each block has one V-like tensor
    for spec in sorted(specs, key=lambda s: (-1 if s.layer is None else s.layer, s.name)):
        name = spec.name
        if spec.kind != "matrix" or len(spec.ne) < 2:
            t = "F32"
        elif name == "output.weight":
            t = "Q6_K"
        elif name.endswith(("attn_v.weight", "attn_qkv.weight")):
            t = "Q6_K" if _use_more_bits(i_wv, n_wv) else "Q4_K"
            i_wv += 1
        elif name.endswith("ffn_down.weight"):
            t = "Q6_K" if _use_more_bits(spec.layer, n_down) else "Q4_K"
        else:
            t = "Q4_K"
        if t != "F32" and spec.ne[0] % 256:
            raise ValueError(f"tensor {name!r}: width {spec.ne[0]} is not a multiple of 256, "
                             f"llama.cpp would not use {t} for it")
        types[name] = t
    return {s.name: types[s.name] for s in specs}


# --- random quantised blocks (direct writer) ------------------------------------------------------

# type -> (values per block, bytes per block), as ggml-common.h lays them out
_BLOCK_BYTES = {"Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
                "F16": (1, 2), "BF16": (1, 2), "F32": (1, 4)}


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def random_blocks(ggml_type: str, n_rows: int, n_cols: int, std: float, g: np.random.Generator) -> np.ndarray:
    """Valid random blocks of `ggml_type` (uint8 `[n_rows, row_bytes]`) whose values have mean ~0
    and standard deviation ~`std`: finite fp16 scales, full-range quants."""
    per, nbytes = _BLOCK_BYTES[ggml_type]
    if n_cols % per:
        raise ValueError(f"{ggml_type}: row width {n_cols} is not a multiple of its block size {per}")
    nb = n_rows * (n_cols // per)
    if ggml_type == "F32":
        return (g.standard_normal((n_rows, n_cols), dtype=np.float32) * np.float32(std)).view(np.uint8)
    if ggml_type == "F16":
        return _f16_bytes(g.standard_normal((n_rows, n_cols), dtype=np.float32) * np.float32(std)).reshape(n_rows, -1)
    if ggml_type == "BF16":
        # bfloat16 = the upper half of a float32 (truncated)
        f32 = g.standard_normal((n_rows, n_cols), dtype=np.float32) * np.float32(std)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_rows, -1)
    out = np.empty((nb, nbytes), dtype=np.uint8)
    if ggml_type == "Q8_0":
        # x = d * q, q uniform in [-127, 127]
        out[:, 0:2] = _f16_bytes(np.full(nb, std / _uniform_rms(-127, 127), dtype=np.float32))
        out[:, 2:] = g.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    elif ggml_type == "Q4_K":
        # x = d*sc*q - dmin*m with q in 0..15 (mean 7.5); with m = sc and dmin = 7.5 d
        # every 32-group is centred: x = d*sc*(q - 7.5)
        sc = g.integers(24, 64, (nb, 8), dtype=np.uint8)
        d = np.float32(std / (_uniform_rms(0, 15, centre=7.5) * _uniform_rms(24, 63)))
        out[:, 0:2] = _f16_bytes(np.full(nb, d, dtype=np.float32))
        out[:, 2:4] = _f16_bytes(np.full(nb, 7.5 * d, dtype=np.float32))
        out[:, 4:16] = _pack_k4_scales(sc, sc)
        out[:, 16:] = g.integers(0, 256, (nb, 128), dtype=np.uint8)
    elif ggml_type == "Q5_K":
        # as Q4_K with a fifth bit (qh) per quant: q in 0..31, centred by dmin = 15.5 d
        sc = g.integers(24, 64, (nb, 8), dtype=np.uint8)
        d = np.float32(std / (_uniform_rms(0, 31, centre=15.5) * _uniform_rms(24, 63)))
        out[:, 0:2] = _f16_bytes(np.full(nb, d, dtype=np.float32))
        out[:, 2:4] = _f16_bytes(np.full(nb, 15.5 * d, dtype=np.float32))
        out[:, 4:16] = _pack_k4_scales(sc, sc)
        out[:, 16:] = g.integers(0, 256, (nb, 160), dtype=np.uint8)
    elif ggml_type == "Q6_K":
        # x = d * scale * (q - 32) with q in 0..63 int8 scales in [16, 127]
        out[:, 0:192] = g.integers(0, 256, (nb, 192), dtype=np.uint8)
        out[:, 192:208] = g.integers(16, 128, (nb, 16), dtype=np.int8).view(np.uint8)
        d = std / (_uniform_rms(0, 63, centre=32) * _uniform_rms(16, 127))
        out[:, 208:210] = _f16_bytes(np.full(nb, d, dtype=np.float32))
    else:
        raise ValueError(f"no random block generator for type {ggml_type}")
    return out.reshape(n_rows, -1)


def _uniform_rms(lo: int, hi: int, centre: float = 0.0) -> float:
    """RMS of (k - centre) for k uniform on the integers lo..hi."""
    k = np.arange(lo, hi + 1, dtype=np.float64) - centre
    return float(np.sqrt(np.mean(k * k)))


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack eight 6-bit scales and mins into Q4_K/Q5_K's 12 bytes (inverse of get_scale_min_k4)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


# --- float values to blocks (the few structured tensors of the direct writer) ------------------------

def quantize_rows(values: np.ndarray, ggml_type: str) -> np.ndarray:
    """float32 `[n_rows, n_cols]` -> blocks of `ggml_type` (uint8 `[n_rows, row_bytes]`).

    Plain absmax / min-max rounding, no search for the best scales as llama.cpp's quantiser does:
    the direct writer uses it only for the few tensors that carry the confidence structure, whose
    values (+-1 embeddings, one-hot rows, zero halves) such rounding keeps exact or nearly so.
    gguf.quants quantises Q8_0 but none of the K-quants, so Q4_K and Q6_K are done here.
    """
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim != 2:
        raise ValueError(f"quantize_rows: values must be [rows, cols], got shape {values.shape}")
    n_rows, n_cols = values.shape
    if ggml_type not in _BLOCK_BYTES:
        raise ValueError(f"quantize_rows: unknown type {ggml_type!r}; one of {', '.join(_BLOCK_BYTES)}")
    per, _ = _BLOCK_BYTES[ggml_type]
    if n_cols % per:
        raise ValueError(f"{ggml_type}: row width {n_cols} is not a multiple of its block size {per}")
    if ggml_type == "F32":
        return values.view(np.uint8).reshape(n_rows, -1)
    if ggml_type == "F16":
        return _f16_bytes(values).reshape(n_rows, -1)
    if ggml_type == "BF16":
        rounded = (values.view(np.uint32) + np.uint32(0x7FFF) + ((values.view(np.uint32) >> 16) & 1)) >> 16
        return rounded.astype(np.uint16).view(np.uint8).reshape(n_rows, -1)
    if ggml_type == "Q8_0":
        import gguf
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    blocks = values.reshape(-1, 256)
    if ggml_type == "Q4_K":
        out = _quantize_q4_k(blocks)
    elif ggml_type == "Q6_K":
        out = _quantize_q6_k(blocks)
    else:
        raise ValueError(f"quantize_rows: no quantiser for {ggml_type}")
    return out.reshape(n_rows, -1)


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b > 0)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] -> Q4_K blocks: x = d*sc*q - dmin*m per group of 32, q in 0..15, sc and m 6-bit."""
    nb = blocks.shape[0]
    g = blocks.reshape(nb, 8, 32)
    lo = np.minimum(g.min(axis=-1), 0.0)
    step = (np.maximum(g.max(axis=-1), 0.0) - lo) / 15.0           # [nb, 8]
    d = _f16_round(step.max(axis=-1) / 63.0)                     # [nb]
    dmin = _f16_round(-lo.min(axis=-1) / 63.0)
    sc = np.clip(np.rint(_safe_div(step, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    q = np.rint(_safe_div(g + (dmin[:, None] * m)[..., None], (d[:, None] * sc)[..., None]))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(nb, 4, 2, 32)
    out = np.empty((nb, 144), dtype=np.uint8)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(dmin)
    out[:, 4:16] = _pack_k4_scales(sc, m)
    # 64 values per 32 bytes: low nibbles the first 32-group, high nibbles the second
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return out


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[nb, 256] -> Q6_K blocks: x = d*sc*(q - 32) per group of 16, q in 0..63, sc int8."""
    nb = blocks.shape[0]
    g = blocks.reshape(nb, 16, 16)
    step = np.abs(g).max(axis=-1) / 31.0                         # [nb, 16]
    d = _f16_round(step.max(axis=-1) / 127.0)
    sc = np.clip(np.rint(_safe_div(step, d[:, None])), 0, 127).astype(np.int8)
    q = np.rint(_safe_div(g, (d[:, None] * sc)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    # per 128 values: ql[l] = q[l] | q[l+64] << 4, ql[l+32] = q[l+32] | q[l+96] << 4,
    # qh[l] = the top two bits of q[l], q[l+32], q[l+64], q[l+96] (ggml-common.h's block_q6_K)
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out = np.empty((nb, 210), dtype=np.uint8)
    out[:, 0:128] = ql.reshape(nb, 128)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = _f16_bytes(d)
    return out


# --- GGUF writing ----------------------------------------------------------------------------------

def add_tokenizer(w, n_vocab: int) -> None:
    """The project's BPE tokenizer (padded to n_vocab tokens) and chat template, into GGUFWriter w."""
    vocab = bpe.vocab_arrays(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(bpe.PRE_TOKENIZER)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.eos_id)
    w.add_bos_token_id(vocab.bos_id)
    w.add_pad_token_id(vocab.bos_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"))


def _add_metadata(w, config: ModelConfig, name: str, file_type: int,
                  extra_metadata: Mapping[str, object] | None) -> None:
    import gguf

    w.add_name(name)
    w.add_type("model")
    w.add_file_type(file_type)
    for key, value in config.gguf_metadata().items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, (list, tuple)):
            w.add_array(key, list(value))
        else:
            raise TypeError(f"metadata key {key!r}: cannot write a value of type {type(value).__name__}")
    add_tokenizer(w, config.n_vocab)
    # provenance and the like (llama.cpp ignores keys it does not know)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint64(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            raise TypeError(f"metadata key {key!r}: cannot write a value of type {type(value).__name__}")
    if file_type not in (0, 1, 32):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _f32_layout(config: ModelConfig, arrays: Mapping[str, np.ndarray]) -> list[tuple[TensorSpec, str]]:
    """The (spec, "F32") list for `arrays`, in tensors.py's order; an unknown or misshapen tensor
    is an error naming it."""
    specs = {s.name: s for s in all_tensors(config)}
    unknown = sorted(set(arrays) - set(specs))
    if unknown:
        raise ValueError(f"tensors not in tensors.py's qwen35 layout: {unknown}")
    layout = []
    for name, spec in specs.items():
        if name not in arrays:
            continue
        shape = tuple(reversed(spec.ne))
        if tuple(np.shape(arrays[name])) != shape:
            raise ValueError(f"tensor {name}: shape {np.shape(arrays[name])}, tensors.py wants {shape} "
                             f"(ne={spec.ne})")
        layout.append((spec, "F32"))
    return layout


def write_gguf(path: str | os.PathLike[str], config: ModelConfig,
               tensors: Mapping[str, np.ndarray] | Sequence[tuple[TensorSpec, str]],
               data: Iterable[np.ndarray] | None = None, *, name: str, file_type: int = 0,
               extra_metadata: Mapping[str, object] | None = None) -> pathlib.Path:
    """Write a qwen35 GGUF of given weights with this project's metadata, tokenizer and chat template.

    Two forms:
    - `tensors` a mapping name -> float array in GGUF numpy order (reversed ne), `data` None: each
      is written as F32, in tensors.py's order; names and shapes are checked against it;
    - `tensors` a sequence of (TensorSpec, GGML type name) and `data` an iterable of the same
      tensors' contents in that order (float32 values for F32, raw blocks `[rows, row_bytes]` for
      the rest): streamed, header first, one tensor in memory at a time.
    `name` is general.name; `file_type` general.file_type (llama_ftype); `extra_metadata` more
    keys (bool, int as uint64, float as float32, str). Writes `path` in place; returns it.
    """
    import gguf

    if data is None:
        if not isinstance(tensors, Mapping):
            raise TypeError("write_gguf: without `data`, `tensors` must map tensor names to arrays")
        arrays = tensors
        layout = _f32_layout(config, arrays)
        data = (np.ascontiguousarray(arrays[spec.name], dtype=np.float32) for spec, _ in layout)
    else:
        layout = list(tensors)
    path = pathlib.Path(path)
    w = gguf.GGUFWriter(os.fspath(path), ARCH)
    try:
        _add_metadata(w, config, name, file_type, extra_metadata)
        for spec, t in layout:
            if t not in _BLOCK_BYTES:
                raise ValueError(f"tensor {spec.name!r}: type {t!r} is not one of {', '.join(_BLOCK_BYTES)}")
            qtype = gguf.GGMLQuantizationType[t]
            per, nbytes = _BLOCK_BYTES[t]
            n_rows = int(np.prod(spec.ne[1:])) if len(spec.ne) > 1 else 1
            size = n_rows * (spec.ne[0] // per) * nbytes
            shape = tuple(reversed(spec.ne))
            if t == "F32":
                w.add_tensor_info(spec.name, shape, np.dtype(np.float32), size)
            elif t == "F16":
                w.add_tensor_info(spec.name, shape, np.dtype(np.float16), size)
            elif t == "BF16":
                w.add_tensor_info(spec.name, (*shape[:-1], shape[-1] * 2), np.dtype(np.uint8), size, raw_dtype=qtype)
            else:
                byte_shape = (*shape[:-1], shape[-1] // per * nbytes)
                w.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), size, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        n_written = 0
        for (spec, t), arr in zip(layout, data):
            per, nbytes = _BLOCK_BYTES[t]
            want = (int(np.prod(spec.ne)) // per) * nbytes
            if arr.nbytes != want:
                raise ValueError(f"tensor {spec.name!r}: {arr.nbytes} bytes of data, {t} with ne={spec.ne} "
                                 f"needs {want}")
            w.write_tensor_data(arr)
            n_written += 1
        if n_written != len(layout):
            raise ValueError(f"write_gguf: data ended after {n_written} of {len(layout)} tensors")
    finally:
        w.close()
    return path


def _synth_metadata(preset: str | None, seed: int, mtp_accuracy: float | None = None,
                    mtp_runner_up: float | None = None) -> dict[str, object]:
    # provenance, read by tests; the MTP accuracy and runner-up share also by the bench, to label its rows
    meta: dict[str, object] = {"openjet.synth.preset": preset or "custom", "openjet.synth.seed": seed}
    if mtp_accuracy is not None:
        meta[MTP_ACCURACY_KEY] = float(mtp_accuracy)
    if mtp_runner_up is not None:
        meta[MTP_RUNNER_UP_KEY] = float(mtp_runner_up)
    return meta


def _write_synth(path: pathlib.Path, config: ModelConfig, tensors: list[tuple[TensorSpec, str]],
                 data: Iterator[np.ndarray], *, file_type: int, preset: str | None, seed: int,
                 mtp_accuracy: float | None = None, mtp_runner_up: float | None = None) -> None:
    write_gguf(path, config, tensors, data, name=f"openjet-synth-{preset or 'custom'}", file_type=file_type,
               extra_metadata=_synth_metadata(preset, seed, mtp_accuracy, mtp_runner_up))


def rewrite_chat_template(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                          template: str | None = None) -> pathlib.Path:
    """Copy GGUF `src` to `dst` with `tokenizer.chat_template` set to `template` (default: the
    shipped chat_template.jinja); every other key and every tensor's bytes stay as they are."""
    import gguf

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst}: rewrite_chat_template writes a new file; give another path than {src}")
    template = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8") if template is None else template
    reader = gguf.GGUFReader(os.fspath(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(os.fspath(dst), arch)
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key == gguf.Keys.Tokenizer.CHAT_TEMPLATE:
                w.add_chat_template(template)
            elif field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, field.contents(), gguf.GGUFValueType.ARRAY, field.types[-1])
            else:
                w.add_key_value(key, field.contents(), field.types[0])
        if gguf.Keys.Tokenizer.CHAT_TEMPLATE not in reader.fields:
            w.add_chat_template(template)
        for t in reader.tensors:
            raw = np.asarray(t.data)
            shape = tuple(int(n) for n in reversed(t.shape))
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                w.add_tensor_info(t.name, shape, raw.dtype, t.n_bytes)
            else:
                w.add_tensor_info(t.name, raw.shape, np.dtype(np.uint8), t.n_bytes, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in reader.tensors:
            w.write_tensor_data(np.asarray(t.data))
    finally:
        w.close()
    return dst


def _f32_tensors(specs: list[TensorSpec], seed: int, config: ModelConfig,
                 mtp_accuracy: float | None = None, mtp_runner_up: float | None = None) -> Iterator[np.ndarray]:
    for spec in specs:
        yield tensor_values(spec, seed, config, mtp_accuracy, mtp_runner_up)


def _random_tensors(specs: list[TensorSpec], types: dict[str, str], seed: int,
                    config: ModelConfig) -> Iterator[np.ndarray]:
    """Random blocks for each tensor in turn (synth_uniform: every matrix of one type, no
    confidence structure): one tensor in memory at a time."""
    for spec in specs:
        t = types[spec.name]
        if t == "F32":
            yield tensor_values(spec, seed, config)
            continue
        n_rows = spec.ne[1]
        std = float(_matrix_std(spec, config))
        n_real = _n_real_tokens() if spec.name == "output.weight" else n_rows
        out = _random_rows(spec, t, 0, min(n_real, n_rows), std, seed)
        if n_real < n_rows:
            out = np.concatenate([out, _random_rows(spec, t, n_real, n_rows, std * PAD_ROW_SCALE, seed)])
        yield out


def _random_rows(spec: TensorSpec, ggml_type: str, r0: int, r1: int, std: float, seed: int) -> np.ndarray:
    """Random blocks for rows [r0, r1) of `spec`, in chunks of ~64 MB that each draw from their own
    stream (keyed by the tensor's name and the chunk's first row)."""
    n_cols = spec.ne[0]
    per, nbytes = _BLOCK_BYTES[ggml_type]
    chunk = max(1, (64 << 20) // (n_cols // per * nbytes))
    out = np.empty((r1 - r0, n_cols // per * nbytes), dtype=np.uint8)
    for c0 in range(r0, r1, chunk):
        c1 = min(c0 + chunk, r1)
        out[c0 - r0:c1 - r0] = random_blocks(ggml_type, c1 - c0, n_cols, std, _rng(seed, f"{spec.name}@{c0}"))
    return out


# The direct writer's confidence structure: the same as the F32 path's (see "Confidence structure"
# at the top), built without a float copy of the model. Only token_embd, output, the MTP block's
# eh_proj and the residual branches' outputs carry it; they are quantised from float row chunks
# (`quantize_rows`) where they are not zero, except for the big plain parts (the branch outputs'
# context rows, the padding rows of the head), which stay random blocks. Every other matrix is
# random blocks as before. The values are drawn from other streams than the F32 path's: the same
# seed gives a model of the same kind, not the same model (`successor_of` holds for both).
EMBED_CHUNK_ROWS = 8192     # token_embd signs: one stream per this many rows (any row range can be redrawn)
# The 27B's vocabulary is 244K UNUSED padding rows and 4K real tokens. A padding row reads little
# of the stream (PAD_ROW_SCALE), so its logit is about 0, and 244K of them outweighed the real
# tokens' successor (e^11, the successor's logit): 70% of the probability went to tokens that
# detokenize to nothing (measured with llama.cpp on q27b). A real head's unused rows lose to its
# real tokens by far more than e^12. So one dim of the token half, the bias dim, is +1 in every
# embedding row (a constant of the stream, as no branch writes there), and the padding rows read it
# with this weight: their logits are about -10, a common offset that leaves the real tokens'
# distribution as it was.
PAD_BIAS_WEIGHT = -8.0


def _structured_tensors(specs: list[TensorSpec], types: dict[str, str], seed: int,
                        config: ModelConfig, mtp_accuracy: float | None = None,
                        mtp_runner_up: float | None = None) -> Iterator[np.ndarray]:
    """The direct writer's tensors in turn, with the confidence structure: one tensor in memory at a
    time (at most ~1 GB, the 27B's Q6_K output head)."""
    t_half = token_dims(config)
    switch_names = mtp_ffn_names(config) if mtp_accuracy is not None else ()
    for spec in specs:
        t = types[spec.name]
        name = spec.name
        if t == "F32":
            yield tensor_values(spec, seed, config)
            continue
        n_rows, n_cols = spec.ne[1], spec.ne[0]
        std = float(_matrix_std(spec, config))
        if name in switch_names:
            sw = mtp_switch(seed, config, mtp_accuracy, types[switch_names[0]])
            decoy = (None if mtp_runner_up is None else
                     mtp_decoy(seed, config, mtp_accuracy, mtp_runner_up, types[switch_names[0]]))
            yield _direct_switch_tensor(spec, t, seed, config, sw, std, decoy)
        elif name == "token_embd.weight":
            yield _direct_embedding(spec, t, seed, config)
        elif name == "output.weight":
            yield _direct_output_head(spec, t, seed, config)
        elif name.endswith(RESIDUAL_OUTPUTS):
            # branches write the context half only: the token-half rows are zero blocks
            yield np.concatenate([_zero_rows(t, t_half, n_cols), _random_rows(spec, t, t_half, n_rows, std, seed)])
        elif name.endswith("nextn.eh_proj.weight"):
            # token-half rows copy the token half of enorm(embedding) (the first n_embd inputs)
            eye = np.zeros((t_half, n_cols), dtype=np.float32)
            eye[np.arange(t_half), np.arange(t_half)] = 1.0 if mtp_accuracy is None else MTP_SWITCH_TOKEN_GAIN
            context = _random_rows(spec, t, t_half, n_rows, std * MTP_CONTEXT_GAIN, seed)
            yield np.concatenate([quantize_rows(eye, t), context])
        else:
            yield _random_rows(spec, t, 0, n_rows, std, seed)


def _direct_switch_tensor(spec: TensorSpec, ggml_type: str, seed: int, config: ModelConfig, sw: MtpSwitch,
                          std: float, decoy: MtpDecoy | None = None) -> np.ndarray:
    """One of the MTP FFN's tensors with the switch units (`mtp_accuracy`) and the decoy's two
    (`mtp_runner_up`): their rows (gate, up) or columns (down) quantised from floats, the other
    units random blocks as without them."""
    m, name = sw.n_dims, spec.name
    n_rows, n_cols = spec.ne[1], spec.ne[0]
    k = np.arange(m)
    n_units = 2 * m + (2 if decoy is not None and decoy.strength > 0 else 0)
    down = sw.down if decoy is None else decoy.switch_down
    # the other units' rows as without the decoy (the same draws, its two rows dropped)
    rest = _random_rows(spec, ggml_type, 2 * m, n_rows, std, seed)[n_units - 2 * m:]
    if name.endswith("ffn_gate.weight"):
        head = quantize_rows(np.stack([sw.gate_plus, sw.gate_minus]), ggml_type)
        parts = [np.repeat(head[:1], m, axis=0), np.repeat(head[1:], m, axis=0)]
        if n_units > 2 * m:
            parts.append(quantize_rows(decoy.gate_rows, ggml_type))
        return np.concatenate([*parts, rest])
    if name.endswith("ffn_up.weight"):
        head = np.zeros((n_units, n_cols), dtype=np.float32)
        head[k, k] = sw.up
        head[m + k, k] = sw.up
        if n_units > 2 * m:
            head[2 * m:] = decoy.up_rows
        return np.concatenate([quantize_rows(head, ggml_type), rest])
    if name.endswith("ffn_down.weight"):
        # token-half rows: the switch's two entries each (and the decoy's); context rows: random
        # blocks, those over the switch units' columns zeroed (whole blocks: a few random units
        # beside them go silent too)
        t_half = token_dims(config)
        token_rows = np.zeros((t_half, n_cols), dtype=np.float32)
        token_rows[k, k] = down
        token_rows[k, m + k] = down
        if n_units > 2 * m:
            token_rows[:, 2 * m:n_units] = decoy.down_cols[:t_half]
        context = _random_rows(spec, ggml_type, t_half, n_rows, std, seed)
        per, nbytes = _BLOCK_BYTES[ggml_type]
        context[:, :-(-n_units // per) * nbytes] = 0
        return np.concatenate([quantize_rows(token_rows, ggml_type), context])
    raise ValueError(f"tensor {name!r} carries no part of the MTP switch")


def _zero_rows(ggml_type: str, n_rows: int, n_cols: int) -> np.ndarray:
    # all-zero bytes decode to 0.0 in every type (a zero scale for the block types)
    per, nbytes = _BLOCK_BYTES[ggml_type]
    return np.zeros((n_rows, n_cols // per * nbytes), dtype=np.uint8)


def _two_halves(ggml_type: str, t_half: int, token_half: np.ndarray,
                context_std: float, g: np.random.Generator | None) -> np.ndarray:
    """Blocks of rows `[token_half | context half]`: `token_half` (float `[rows, t_half]`) quantised,
    the context half N(0, context_std^2) drawn from `g`, or zero when `g` is None. Where the halves
    are whole blocks (the 27B's are) the context half is drawn as random blocks directly and only the
    token half is quantised; otherwise the whole rows go through floats."""
    per, nbytes = _BLOCK_BYTES[ggml_type]
    rows, n_cols = token_half.shape[0], 2 * t_half
    if t_half % per == 0:
        split = t_half // per * nbytes
        out = np.zeros((rows, n_cols // per * nbytes), dtype=np.uint8)
        out[:, :split] = quantize_rows(token_half, ggml_type)
        if g is not None:
            out[:, split:] = random_blocks(ggml_type, rows, n_cols - t_half, context_std, g)
        return out
    full = np.zeros((rows, n_cols), dtype=np.float32)
    full[:, :t_half] = token_half
    if g is not None:
        full[:, t_half:] = g.standard_normal((rows, n_cols - t_half), dtype=np.float32) * np.float32(context_std)
    return quantize_rows(full, ggml_type)


def _embedding_signs(seed: int, config: ModelConfig, r0: int, r1: int) -> np.ndarray:
    """+-1 (int8 `[r1 - r0, n_embd/2]`): the token half of the direct writer's embedding rows [r0, r1),
    random signs except the bias dim, +1 in every row."""
    t_half = token_dims(config)
    first = r0 // EMBED_CHUNK_ROWS * EMBED_CHUNK_ROWS
    parts = []
    for c0 in range(first, r1, EMBED_CHUNK_ROWS):
        c1 = min(c0 + EMBED_CHUNK_ROWS, config.n_vocab)
        g = _rng(seed, f"token_embd.weight@{c0}")
        parts.append(g.integers(0, 2, (c1 - c0, t_half), dtype=np.int8) * 2 - 1)
    signs = np.concatenate(parts)[r0 - first:r1 - first]
    signs[:, bias_dim(config)] = 1
    return signs


def bias_dim(config: ModelConfig) -> int:
    """The direct writer's constant dimension: the last of the token half, +1 in every embedding row
    (no branch writes the token half, so it stays constant in the stream)."""
    return token_dims(config) - 1


def _direct_embedding(spec: TensorSpec, ggml_type: str, seed: int, config: ModelConfig) -> np.ndarray:
    """token_embd: +-EMBED_STD on the token half, zero on the context half, as the F32 path's."""
    n_rows, n_cols = spec.ne[1], spec.ne[0]
    per, nbytes = _BLOCK_BYTES[ggml_type]
    out = np.empty((n_rows, n_cols // per * nbytes), dtype=np.uint8)
    for r0 in range(0, n_rows, EMBED_CHUNK_ROWS):
        r1 = min(r0 + EMBED_CHUNK_ROWS, n_rows)
        signs = _embedding_signs(seed, config, r0, r1).astype(np.float32) * np.float32(EMBED_STD)
        out[r0:r1] = _two_halves(ggml_type, token_dims(config), signs, 0.0, None)
    return out


def _direct_output_head(spec: TensorSpec, ggml_type: str, seed: int, config: ModelConfig) -> np.ndarray:
    """output.weight as the F32 path's `_output_head`: the real tokens' rows (at most a few
    thousand) in float, then quantised; the padding rows random context-half blocks (PAD_ROW_SCALE)
    and PAD_BIAS_WEIGHT on the bias dim."""
    n_rows, n_cols = spec.ne[1], spec.ne[0]
    t_half = token_dims(config)
    n_real = min(_n_real_tokens(), n_rows)
    context_std = CONTEXT_LOGIT_GAIN / np.sqrt(n_cols - t_half)
    g = _rng(seed, "output.weight@0")
    succ = successor_of(seed, config)
    real_token_half = np.zeros((n_real, t_half), dtype=np.float32)
    real_token_half[succ] = _embedding_signs(seed, config, 0, len(succ)) * np.float32(EMBED_STD * SUCCESSOR_GAIN / t_half)
    per, nbytes = _BLOCK_BYTES[ggml_type]
    out = np.empty((n_rows, n_cols // per * nbytes), dtype=np.uint8)
    out[:n_real] = _two_halves(ggml_type, t_half, real_token_half, context_std, g)
    chunk = max(1, (16 << 20) // n_cols)
    for r0 in range(n_real, n_rows, chunk):
        r1 = min(r0 + chunk, n_rows)
        pad_token_half = np.zeros((r1 - r0, t_half), dtype=np.float32)
        pad_token_half[:, bias_dim(config)] = PAD_BIAS_WEIGHT
        out[r0:r1] = _two_halves(ggml_type, t_half, pad_token_half, context_std * PAD_ROW_SCALE,
                                 _rng(seed, f"output.weight@{r0}"))
    return out


def _resolve(preset: str | None, config: ModelConfig | None) -> ModelConfig:
    if config is not None:
        return config
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[preset]


def synth_model(out_path: str | os.PathLike[str], preset: str = "tiny", quant: str = "F32", seed: int = 0,
                force: bool = False, config: ModelConfig | None = None, direct: bool | None = None,
                mtp_accuracy: float | None = None, mtp_runner_up: float | None = None) -> pathlib.Path:
    """Write a generated qwen35 GGUF to `out_path` and return its path.

    preset: a key of `config.PRESETS` (ignored when `config` is given); quant: one of QUANTS;
    direct: write random quantised blocks with `q4_k_m_type_map` instead of running llama.cpp's
    quantiser (only for Q4_K_M; the default, None, means "only for q27b");
    mtp_accuracy: the share of real tokens after which the MTP head drafts the main model's
    successor choice (see "MTP accuracy"; recorded as `openjet.synth.mtp_accuracy`); None: the
    head follows the successor map everywhere, as before (the file is byte for byte the same);
    mtp_runner_up (needs mtp_accuracy < 1): among the tokens after which the head is wrong, the
    share after which it ranks the right token second, behind one fixed decoy token (see "MTP
    runner-up"; recorded as `openjet.synth.mtp_runner_up`); None: the right token is never second.
    The file appears atomically (temporary file in the same folder, then os.replace); an existing
    file is refused unless `force`.
    """
    out = pathlib.Path(out_path)
    cfg = _resolve(preset, config)
    name = preset if config is None else None
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r} is not one of {', '.join(QUANTS)}")
    if direct is None:
        direct = name in DIRECT_ONLY
    if name in DIRECT_ONLY and (quant != "Q4_K_M" or not direct):
        raise ValueError(f"preset {name!r} is generated only as Q4_K_M by the direct writer "
                         f"(its F32 intermediate would not fit on disk); got quant={quant!r}")
    if direct and quant != "Q4_K_M":
        raise ValueError(f"the direct writer makes Q4_K_M files only; got quant={quant!r}")
    check_mtp_accuracy(cfg, mtp_accuracy)
    check_mtp_runner_up(cfg, mtp_accuracy, mtp_runner_up)
    if out.exists() and not force:
        raise FileExistsError(f"{out}: file exists; pass force=True (--force) to overwrite it")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent}: output folder does not exist")

    specs = synth_specs(cfg)
    acc = {"mtp_accuracy": mtp_accuracy, "mtp_runner_up": mtp_runner_up}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp_f32 = out.with_name(f".{out.name}.{os.getpid()}.f32.tmp")
    try:
        if direct:
            types = q4_k_m_type_map(cfg)
            _write_synth(tmp, cfg, [(s, types[s.name]) for s in specs],
                         _structured_tensors(specs, types, seed, cfg, **acc),
                         file_type=FTYPES["Q4_K_M"], preset=name, seed=seed, **acc)
        elif quant == "F32":
            _write_synth(tmp, cfg, [(s, "F32") for s in specs], _f32_tensors(specs, seed, cfg, **acc),
                        file_type=FTYPES["F32"], preset=name, seed=seed, **acc)
        else:
            _write_synth(tmp_f32, cfg, [(s, "F32") for s in specs], _f32_tensors(specs, seed, cfg, **acc),
                        file_type=FTYPES["F32"], preset=name, seed=seed, **acc)
            llama_quantize(tmp_f32, tmp, quant)
        os.replace(tmp, out)
    finally:
        for p in (tmp, tmp_f32):
            if p.exists():
                p.unlink()
    return out


# general.file_type for a file whose matrices are all one type (llama_ftype: *_S variants for K types)
_UNIFORM_FTYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "BF16": 32}


def synth_uniform(out_path: str | os.PathLike[str], matrix_type: str, preset: str = "tiny", seed: int = 0,
                  force: bool = False, config: ModelConfig | None = None) -> pathlib.Path:
    """A model whose every matrix is random `matrix_type` blocks (vectors stay F32), written
    directly: one file per supported type, e.g. to test each kernel against llama.cpp."""
    if matrix_type not in _UNIFORM_FTYPES:
        raise ValueError(f"matrix_type {matrix_type!r} is not one of {', '.join(_UNIFORM_FTYPES)}")
    out = pathlib.Path(out_path)
    cfg = _resolve(preset, config)
    if out.exists() and not force:
        raise FileExistsError(f"{out}: file exists; pass force=True (--force) to overwrite it")
    specs = synth_specs(cfg)
    types = {s.name: (matrix_type if s.kind == "matrix" else "F32") for s in specs}
    for s in specs:
        if s.ne[0] % _BLOCK_BYTES[types[s.name]][0]:
            raise ValueError(f"tensor {s.name!r}: width {s.ne[0]} is not a multiple of the {matrix_type} block")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write_synth(tmp, cfg, [(s, types[s.name]) for s in specs], _random_tensors(specs, types, seed, cfg),
                    file_type=_UNIFORM_FTYPES[matrix_type], preset=preset if config is None else None, seed=seed)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def synth_vocab_only(out_path: str | os.PathLike[str], preset: str = "tiny", force: bool = False,
                     config: ModelConfig | None = None) -> pathlib.Path:
    """A GGUF with the metadata and tokenizer of a preset but no tensors: enough for
    `llama_cpp.Llama(path, vocab_only=True)` and `Tokenizer.from_gguf`, e.g. for the 27B's padded
    248,320-token vocabulary without its 16.8 GB of weights."""
    out = pathlib.Path(out_path)
    cfg = _resolve(preset, config)
    if out.exists() and not force:
        raise FileExistsError(f"{out}: file exists; pass force=True (--force) to overwrite it")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _write_synth(tmp, cfg, [], iter(()), file_type=FTYPES["F32"], preset=preset if config is None else None,
                    seed=0)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def llama_quantize(src: pathlib.Path, dst: pathlib.Path, quant: str, nthread: int | None = None) -> None:
    """Quantise `src` to `dst` with llama.cpp's own quantiser (the real recipe for `quant`)."""
    from ..backends.llama_cpp import import_llama_cpp

    llama_cpp = import_llama_cpp()

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = nthread or os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(os.fspath(src).encode(), os.fspath(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp failed to quantise {src} to {quant} (return code {rc})")


def synth_main(argv: list[str] | None = None) -> int:
    """`openjet synth OUT.gguf --preset tiny --quant Q8_0 --seed 0 [--force]`."""
    ap = argparse.ArgumentParser(prog="openjet synth", description="Generate a random-weight qwen35 GGUF test model.")
    ap.add_argument("out", type=pathlib.Path, help="output .gguf path")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--quant", default=None, choices=QUANTS,
                    help="tensor types (default: Q4_K_M for q27b, F32 otherwise)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="overwrite an existing file")
    ap.add_argument("--direct", action="store_true",
                    help="write random Q4_K_M blocks directly instead of quantising an F32 file")
    ap.add_argument("--mtp-accuracy", type=float, default=None, metavar="R",
                    help="make the MTP head draft the main model's next choice after a share R of the "
                         "tokens (e.g. 0.75; default: after nearly every token)")
    ap.add_argument("--mtp-runner-up", type=float, default=None, metavar="Q",
                    help="with --mtp-accuracy: after a share Q of the tokens where the MTP head is wrong, "
                         "rank the right token second (e.g. 0.6; default: never)")
    args = ap.parse_args(argv)
    quant = args.quant or ("Q4_K_M" if args.preset in DIRECT_ONLY else "F32")
    try:
        path = synth_model(args.out, preset=args.preset, quant=quant, seed=args.seed, force=args.force,
                           direct=True if args.direct else None, mtp_accuracy=args.mtp_accuracy,
                           mtp_runner_up=args.mtp_runner_up)
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"openjet synth: error: {exc}", file=sys.stderr)
        return 2
    acc = "" if args.mtp_accuracy is None else f" mtp_accuracy={args.mtp_accuracy}"
    acc += "" if args.mtp_runner_up is None else f" mtp_runner_up={args.mtp_runner_up}"
    print(f"{path}: {args.preset} {quant} seed={args.seed}{acc} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0
