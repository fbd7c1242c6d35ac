"""Generated models are confident as real models are, and their logits still follow the context.

llama.cpp rounds every activation to 8 bits (~0.03 nats per logit): on near-ties between the top
two logits that flips the argmax. A random head put 8% of positions within 0.1 nats; synth's
successor head (see synth.py, "Confidence structure") gives a clear top token at most positions,
while the context half of the stream still decides the rest of the distribution, and at some
positions the top token too.
"""

from __future__ import annotations

import numpy as np
import pytest

from openjet_plugin.testing.llama_ref import tokenize
from openjet_plugin.testing.reference import ReferenceModel, softmax
from openjet_plugin.config import PRESETS
from openjet_plugin.testing.synth import SUCCESSOR_GAIN, bias_dim, successor_of, synth_model, token_dims
from test_reference import N_POSITIONS, real_text


@pytest.fixture(scope="module")
def text_tokens(synth_path):
    return tokenize(synth_path("tiny", "F32"), real_text())[:N_POSITIONS]


@pytest.fixture(scope="module")
def tiny_run(synth_path, text_tokens):
    ref = ReferenceModel(synth_path("tiny", "F32"))
    logits = ref.logits(text_tokens)
    return ref, np.asarray(text_tokens), logits


def _top_gaps(logits: np.ndarray) -> np.ndarray:
    s = np.sort(logits, axis=1)
    return s[:, -1] - s[:, -2]


def test_clear_top_token_at_most_positions(tiny_run):
    _, tokens, logits = tiny_run
    assert len(tokens) == N_POSITIONS
    gaps = _top_gaps(logits)
    quantiles = np.quantile(gaps, [0.05, 0.5]).round(3).tolist()
    print(f"\ntiny F32 top1-top2 gap: q05/median {quantiles} nats, "
          f"<0.1: {np.mean(gaps < 0.1):.3f}, <0.5: {np.mean(gaps < 0.5):.3f}")
    assert np.median(gaps) > 2.0, quantiles                  # a random head: ~0.7
    assert np.mean(gaps < 0.1) <= 0.02                       # a random head: 8%
    p = softmax(logits)
    assert 0.3 < p.max(axis=1).mean() < 0.9                  # confident, not one-hot


def test_context_still_decides(tiny_run):
    ref, tokens, logits = tiny_run
    top = logits.argmax(axis=1)
    succ = successor_of(0, ref.config)[tokens]
    by_successor = np.mean(top == succ)
    assert 0.8 <= by_successor < 1.0, by_successor           # some tops come from the context
    # the same token at two positions with different contexts: different distributions
    p = softmax(logits)
    tvs = []
    for tok in np.unique(tokens):
        where = np.nonzero(tokens == tok)[0]
        tvs += [0.5 * np.abs(p[i] - p[j]).sum() for i, j in zip(where[:-1], where[1:])]
    assert len(tvs) >= 50
    assert np.mean(tvs) > 0.2, np.mean(tvs)


def test_mtp_drafts_the_main_models_next_choice(synth_path, text_tokens):
    """The MTP head favours the successor of the token it is given, as the main model does at the
    next position: drafts that a trained model's MTP would mostly get accepted."""
    ref = ReferenceModel(synth_path("tiny", "F32"))
    tokens = np.asarray(text_tokens[:64])
    main = ref.logits(tokens)
    pre = ref.mtp_prefill()                 # row p: (token p, hidden p-1) -> predicts token p+1
    agree = np.mean(pre.argmax(axis=1)[1:] == main.argmax(axis=1)[1:])
    assert agree >= 0.8, agree
    assert np.median(_top_gaps(pre)) > 2.0


# --- the direct writer (q27b; the direct=True models of the GPU tests) -----------------------------
# It writes quantised blocks straight to the file, with the same structure built from a few float
# row chunks (synth.py, "The direct writer's confidence structure").

@pytest.fixture(scope="module")
def direct_small(tmp_path_factory):
    return synth_model(tmp_path_factory.mktemp("direct") / "small-direct.gguf", "small", "Q4_K_M", direct=True)


@pytest.fixture(scope="module")
def direct_run(direct_small):
    ref = ReferenceModel(direct_small, dtype=np.float32)
    tokens = np.asarray(tokenize(direct_small, real_text())[:N_POSITIONS])
    return ref, tokens, ref.logits(tokens).astype(np.float64)


def test_direct_writer_clear_top_token_and_context_still_decides(direct_run):
    ref, tokens, logits = direct_run
    assert len(tokens) == N_POSITIONS
    gaps = _top_gaps(logits)
    top = logits.argmax(axis=1)
    by_successor = np.mean(top == successor_of(0, ref.config)[tokens])
    tv = _same_token_tv(tokens, softmax(logits))
    print(f"\nsmall direct Q4_K_M: top1-top2 gap median {np.median(gaps):.2f} nats, <0.1: "
          f"{np.mean(gaps < 0.1):.3f}; successor share {by_successor:.3f}; same-token TV {tv:.2f}")
    assert np.median(gaps) > 2.0                             # random blocks: ~0.8
    assert np.mean(gaps < 0.1) <= 0.02                       # random blocks: 7%
    assert 0.3 < softmax(logits).max(axis=1).mean() < 0.9
    assert 0.8 <= by_successor < 1.0, by_successor
    assert tv > 0.2, tv


def test_direct_writer_mtp_drafts_the_next_choice(direct_run):
    ref, tokens, logits = direct_run
    pre = ref.mtp_prefill()
    agree = np.mean(pre.argmax(axis=1)[1:] == logits.argmax(axis=1)[1:])
    assert agree >= 0.8, agree
    assert np.median(_top_gaps(pre)) > 2.0


def test_direct_writer_structure_in_the_blocks(direct_small):
    """The structure is in the file's quantised blocks, not only in the logits: +-1 embeddings with
    the constant bias dim, zero token-half rows of every branch output, eh_proj's copy of the token
    half, successor rows in the head."""
    ref = ReferenceModel(direct_small, dtype=np.float32)
    cfg, half = ref.config, token_dims(ref.config)
    emb = ref.weight("token_embd.weight")
    np.testing.assert_allclose(np.abs(emb[:, :half]), 1.0, atol=2e-3)
    assert not emb[:, half:].any()
    assert (emb[:, bias_dim(cfg)] > 0).all()
    branch_outputs = [n for n in ref._tensors if n.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight"))]
    assert len(branch_outputs) == 2 * cfg.block_count
    for name in branch_outputs:
        w = ref.weight(name)
        assert not w[:half].any() and w[half:].std() > 0, name
    eh = ref.weight(f"blk.{cfg.n_layer}.nextn.eh_proj.weight")
    np.testing.assert_allclose(eh[:half], np.eye(half, eh.shape[1]), atol=1e-3)
    head = ref.weight("output.weight")
    succ = successor_of(0, cfg)
    overlap = np.einsum("ij,ij->i", head[succ, :half], emb[: len(succ), :half]) * half / SUCCESSOR_GAIN
    np.testing.assert_allclose(overlap, half, rtol=0.02)    # row succ[x] is x's embedding, scaled


def test_direct_writer_llama_cpp_agrees_despite_8_bit_rounding(direct_small, direct_run):
    """What the structure is for: llama.cpp (CPU, 8-bit activations) and exact math pick the same top
    token; random blocks' near-ties cost 1-3% of the positions."""
    from openjet_plugin.testing.llama_ref import agreement, llama_logits

    _, tokens, logits = direct_run
    got = agreement(logits, llama_logits(direct_small, tokens))
    print(f"\nsmall direct Q4_K_M, llama.cpp CPU vs reference: {got}")
    assert got["top1"] >= 0.99 and got["kl_mean"] < 1e-3, got


def test_direct_writer_padding_rows_take_no_mass(tmp_path):
    """A 27B-like padded vocabulary (most rows UNUSED) leaves the real tokens' distribution as it is:
    the padding rows' logits sit ~10 below (the bias dim), so they hold almost no probability."""
    import dataclasses

    tiny = PRESETS["tiny"]
    plain = synth_model(tmp_path / "plain.gguf", "tiny", "Q4_K_M", direct=True)
    padded = synth_model(tmp_path / "padded.gguf", config=dataclasses.replace(tiny, n_vocab=8 * tiny.n_vocab),
                         quant="Q4_K_M", direct=True)
    tokens = tokenize(plain, real_text())[:48]
    a = ReferenceModel(plain, dtype=np.float32).logits(tokens).astype(np.float64)
    b = ReferenceModel(padded, dtype=np.float32).logits(tokens).astype(np.float64)
    p = softmax(b)
    assert p[:, tiny.n_vocab:].sum(axis=1).max() < 0.01
    # the real tokens' rows and everything upstream are the same draws: same distribution over them
    np.testing.assert_allclose(softmax(b[:, :tiny.n_vocab]), softmax(a), atol=1e-4)


def _same_token_tv(tokens: np.ndarray, p: np.ndarray) -> float:
    """Mean total variation between the distributions after the same token in two contexts."""
    tvs = []
    for tok in np.unique(tokens):
        where = np.nonzero(tokens == tok)[0]
        tvs += [0.5 * np.abs(p[i] - p[j]).sum() for i, j in zip(where[:-1], where[1:])]
    assert len(tvs) >= 50
    return float(np.mean(tvs))
