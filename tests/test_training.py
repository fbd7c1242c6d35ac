"""The training code (training/): the torch qwen35 equals llama.cpp's graph, MTP chain included;
the chunked delta rule equals the recurrent one; data split, training, weights files, run choice."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (training/ needs it: pip install torch)")

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from openjet_plugin.config import PRESETS, ModelConfig  # noqa: E402
from training import data, report  # noqa: E402
from training.qwen35_torch import (Qwen35, gated_delta_rule_chunked, gated_delta_rule_recurrent,  # noqa: E402
                                   l2_norm)
from training.train import load_weights, main as train_main, save_weights, weight_files  # noqa: E402

MICRO = ModelConfig(n_vocab=4096, n_embd=64, n_layer=4, n_ff=128, n_head=4, n_head_kv=2, head_dim=16,
                    n_rot=8, rope_sections=(2, 1, 1, 0), rope_freq_base=1e4, rms_eps=1e-6,
                    ssm_conv_kernel=4, ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4, n_ctx_train=512)


def randomize(model: Qwen35, seed: int = 0) -> Qwen35:
    """Weights large enough that logits depend strongly on the input (std ~4), so that a wrong
    head mapping, rotation or norm would change the argmax; the trained init is too quiet for that."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
            elif name == "tok_embd.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif name == "output.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 4 / math.sqrt(cfg.n_embd))
            elif "ssm_alpha" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 / math.sqrt(p.shape[1]))
            elif p.dim() == 2 and "conv" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """The tiny preset with random weights, in torch and as an F32 GGUF written by training.export."""
    from training.export import export

    torch.manual_seed(0)
    model = randomize(Qwen35(PRESETS["tiny"]).eval())
    path = export(model, tmp_path_factory.mktemp("training") / "tiny-f32.gguf", quant="F32", max_mb=None)
    return model, path


# --- the delta rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("T,chunk", [(150, 32), (64, 64), (5, 64)])
def test_chunked_delta_rule_equals_recurrent(T, chunk):
    g = torch.Generator().manual_seed(T)
    B, H, D = 2, 3, 16
    q = l2_norm(torch.randn(B, H, T, D, generator=g), 1e-6) / 4
    k = l2_norm(torch.randn(B, H, T, D, generator=g), 1e-6)
    v = torch.randn(B, H, T, D, generator=g)
    decay = -3 * torch.rand(B, H, T, generator=g)        # strong and weak decays
    beta = torch.rand(B, H, T, generator=g)
    s0 = torch.randn(B, H, D, D, generator=g)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, decay, beta, state=s0.clone())
    o, s = gated_delta_rule_chunked(q, k, v, decay, beta, chunk=chunk, state=s0.clone())
    assert torch.allclose(o, o_ref, atol=2e-5, rtol=1e-4), (o - o_ref).abs().max()
    assert torch.allclose(s, s_ref, atol=2e-5, rtol=1e-4), (s - s_ref).abs().max()


def test_model_chunked_and_recurrent_forms_agree():
    torch.manual_seed(1)
    m = randomize(Qwen35(MICRO))
    tokens = torch.randint(0, 4000, (2, 70))
    with torch.no_grad():
        a, _ = m(tokens)
        b, _ = m(tokens, recurrent_form=True)
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()


# --- equal to llama.cpp ------------------------------------------------------------------------------

def test_trunk_logits_equal_llama_cpp(tiny_export):
    from openjet_plugin.testing.llama_ref import agreement, llama_logits

    model, path = tiny_export
    tokens = torch.randint(0, 4000, (1, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, _ = model(tokens)
    theirs = llama_logits(path, tokens[0].tolist())
    a = agreement(ours[0].numpy(), theirs)
    assert a["top1"] == 1.0, a
    assert a["kl_mean"] < 1e-5 and a["kl_max"] < 1e-4, a


def test_mtp_chain_equals_llama_cpp_drafting(tiny_export):
    """Chained MTP steps in training attend like llama.cpp's draft context: the context holds
    (token p, hidden p-1) for the text (zero hidden at p = 0), then the chain's own entries."""
    from openjet_plugin.testing.llama_ref import LlamaMTP

    model, path = tiny_export
    T, K = 24, 3
    tokens = torch.randint(0, 4000, (1, T + K + 1), generator=torch.Generator().manual_seed(3))
    x = tokens[0].tolist()
    with torch.no_grad():
        _, h = model(tokens[:, :T])
        chain = model.mtp_chain(h, tokens[:, 0], [tokens[:, k:T + k] for k in range(1, K + 1)])
    for t in (0, 9, T - 1):
        with LlamaMTP(path, n_ctx=64, exact=True) as L:
            _, hh = L.eval(x[:T])
            hs = np.concatenate([np.zeros((1, hh.shape[1]), np.float32), hh[:t + 1]])
            lg, hm = L.mtp(x[:t + 2], hs, list(range(t + 2)))          # context + chain step 1
            theirs, h_cur = [lg[-1]], hm[-1]
            for k in range(2, K + 1):
                lg, hm = L.mtp([x[t + k]], h_cur[None], [t + k])
                theirs.append(lg[-1])
                h_cur = hm[-1]
        for k in range(K):
            ours = chain[k][0, t].numpy()
            assert np.abs(ours - theirs[k]).max() < 1e-3, (t, k + 1, np.abs(ours - theirs[k]).max())
            assert ours.argmax() == theirs[k].argmax()


def test_mtp_chain_equals_numpy_reference(tiny_export):
    reference = pytest.importorskip("openjet_plugin.testing.reference")
    model, path = tiny_export
    T, K = 12, 2
    tokens = torch.randint(0, 4000, (1, T + K + 1), generator=torch.Generator().manual_seed(4))
    x = tokens[0].tolist()
    with torch.no_grad():
        logits, h = model(tokens[:, :T])
        chain = model.mtp_chain(h, tokens[:, 0], [tokens[:, k:T + k] for k in range(1, K + 1)])
    ref = reference.ReferenceModel(path)
    assert np.abs(ref.logits(x[:T]) - logits[0].numpy()).max() < 1e-3
    t = T - 1
    ref.mtp_prefill()                                     # context: positions 0..T-1
    lg, hm = ref.mtp_logits(ref.hidden[t], x[t + 1], pos=t + 1)
    assert np.abs(lg - chain[0][0, t].numpy()).max() < 1e-3
    lg, _ = ref.mtp_logits(hm, x[t + 2], pos=t + 2)
    assert np.abs(lg - chain[1][0, t].numpy()).max() < 1e-3


def test_export_checks_tensor_names_and_shapes(tmp_path):
    from training.export import write_f32_gguf

    arrays = Qwen35(MICRO).gguf_tensors()
    bad = dict(arrays)
    bad["blk.0.ssm_a"] = np.zeros(MICRO.ssm_dt_rank + 1, np.float32)
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        write_f32_gguf(tmp_path / "x.gguf", MICRO, bad, "x")
    del bad["blk.0.ssm_a"]
    with pytest.raises(ValueError, match="missing.*blk.0.ssm_a"):
        write_f32_gguf(tmp_path / "x.gguf", MICRO, bad, "x")


# --- data ------------------------------------------------------------------------------------------

def test_heldout_split_is_by_file_and_stable():
    files = data.stdlib_files()
    held = [f for f in files if data.is_heldout(f)]
    assert 0.02 < len(held) / len(files) < 0.09
    # depends on the relative path only (same file held out under every Python version)
    assert data.is_heldout(held[0]) and data.is_heldout(str(held[0]))
    assert [f for f in files if data.is_heldout(f)] == held


def test_corpus_tokens_decode_back_to_the_files(tmp_path):
    c = data.build_corpus(limit_files=6)
    tok = data.load_tokenizer()
    sep = tok.special_tokens[data.SEPARATOR]
    assert c.meta["heldout_files"], "the sample keeps a held-out file"
    first_held = c.meta["heldout_files"][0]
    text = (data.stdlib_root() / first_held).read_text(encoding="utf-8", errors="replace")
    doc = c.heldout[:list(c.heldout).index(sep)]
    assert tok.decode(doc.tolist()) == text
    assert c.train.dtype == np.uint16 and c.train.max() < 4096
    c.save(tmp_path / "c.npz")
    back = data.Corpus.load(tmp_path / "c.npz")
    assert np.array_equal(back.train, c.train) and back.meta == c.meta


def test_unigram_baseline():
    train = np.array([0, 0, 1, 1], np.uint16)
    # add-one counts over 4 symbols: p(0) = 3/8
    assert data.unigram_perplexity(train, np.array([0], np.uint16), 4) == pytest.approx(8 / 3)


# --- training ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.npz"
    data.build_corpus(limit_files=12).save(path)
    return path


def _train(run_dir, corpus, *extra):
    return train_main(["--preset", "tiny", "--corpus", str(corpus), "--run-dir", str(run_dir),
                       "--device", "cpu", "--seq-len", "32", "--batch", "4", "--lr", "3e-3", "--warmup", "2",
                       "--eval-windows", "4", "--final-eval-windows", "4", "--eval-batch", "4",
                       "--eval-every", "1e9", *extra])


@pytest.mark.slow
def test_training_reduces_loss_and_resumes(tmp_path, small_corpus):
    log = _train(tmp_path / "a", small_corpus, "--steps", "12", "--ckpt-every", "1e-9")
    first, last = log["history"][0], log["history"][-1]
    assert last["step"] == 12
    assert last["loss"] < first["loss"] - 0.3, (first, last)
    assert all(m_last < m_first for m_first, m_last in zip(first["mtp"], last["mtp"]))
    fe = log["final_eval"]
    assert fe["main_ppl"] < 4096 and len(fe["est_tokens_per_cycle"]) == 3
    # weights written in shards come back bit-equal (fp16 matrices)
    m = Qwen35(PRESETS["tiny"])
    load_weights(weight_files(tmp_path / "a"), m)
    # resuming a finished run with a longer schedule continues from its step
    log2 = _train(tmp_path / "a", small_corpus, "--steps", "14", "--resume", str(tmp_path / "a" / "ckpt.pt"))
    assert log2["steps"] == 14 and log2["history"][-1]["step"] == 14


def test_weight_shards_roundtrip(tmp_path, monkeypatch):
    import training.train as tr

    monkeypatch.setattr(tr, "SHARD_BYTES", 600_000)     # above the largest tensor (tok_embd, 512 KiB)
    m = randomize(Qwen35(MICRO))
    names = save_weights(m, tmp_path)
    assert len(names) > 1
    assert all((tmp_path / n).stat().st_size <= 600_000 + 50_000 for n in names)
    m2 = Qwen35(MICRO)
    load_weights(weight_files(tmp_path), m2)
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        tol = 1e-3 * a.abs().max().item() if a.dim() >= 2 and a.numel() >= 4096 else 0
        assert (a - b).abs().max().item() <= tol, n
    (tmp_path / names[-1]).unlink()
    with pytest.raises(ValueError, match="missing"):
        load_weights(weight_files(tmp_path), Qwen35(MICRO))


def test_report_ships_the_best_mtp_run_within_the_hurt_limit(tmp_path):
    def log(tag, ppl, est, mtp=True):
        fe = {"main_ppl": ppl}
        if mtp:
            fe["est_tokens_per_cycle"] = [1.5, est]
        return {"tag": tag, "final_eval": fe, "mtp_trained": mtp}

    runs = {"nomtp": log("nomtp", 10.0, 0, mtp=False), "mtp": log("mtp", 10.3, 2.6),
            "mtp-frozen": log("mtp-frozen", 10.1, 2.2)}
    pick, verdict = report.choose(runs)
    assert pick == "mtp-frozen" and not verdict["mtp"]["ok"]          # 3% hurt is over the limit
    runs["mtp"]["final_eval"]["main_ppl"] = 10.15
    assert report.choose(runs)[0] == "mtp"                            # within 2%: more tokens per cycle
    runs["mtp-frozen"]["final_eval"]["main_ppl"] = 10.5
    runs["mtp"]["final_eval"]["main_ppl"] = 10.4
    assert report.choose(runs)[0] == "mtp"                            # none qualifies: the least hurt
