"""The numpy reference forward pass against llama.cpp, and its own incremental and MTP paths.

The reference is the oracle every other numerical test leans on, so it is held to llama.cpp on
generated qwen35 models in each quantisation, teacher-forced over real text. The agreement table
is printed in pytest's terminal summary (shown with or without `-s`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from openjet_plugin.testing.llama_ref import agreement, llama_logits, tokenize
from openjet_plugin.testing.reference import ReferenceModel

synth = pytest.importorskip("openjet_plugin.testing.synth")

N_POSITIONS = 300          # teacher-forced positions compared with llama.cpp (>= 256)
QUANTS = ("F32", "Q8_0", "Q6_K", "Q4_K_M")
KL_LIMIT = {"F32": 1e-5, "Q8_0": 1e-3, "Q6_K": 1e-3, "Q4_K_M": 1e-3}
TOP1_MIN = 0.99

PROSE = (
    "The lighthouse keeper wrote in his log every evening: the direction of the wind, the colour "
    "of the sea, and the ships that passed before the light was lit. Most nights nothing happened, "
    "and he said so plainly, because a record of quiet nights is what makes a stormy one stand out. "
    "Years later his daughter read the logs and found that he had also written down, in the margins, "
    "the names of the birds that rested on the gallery rail, and which of them came back each spring."
)


# --- fixtures -------------------------------------------------------------------------------

class _AgreementTable:
    """A pytest plugin object that prints the collected agreement rows in the terminal summary."""

    def __init__(self):
        self.rows: list[tuple] = []

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        tr = terminalreporter
        tr.write_sep("=", "reference vs llama.cpp (teacher-forced, KL(llama.cpp || reference))")
        tr.write_line(f"{'preset':<8}{'quant':<9}{'positions':>10}{'top1':>9}{'mean KL':>12}{'max KL':>12}")
        for preset, quant, n, top1, kl_mean, kl_max in sorted(self.rows):
            tr.write_line(f"{preset:<8}{quant:<9}{n:>10}{top1:>9.4f}{kl_mean:>12.3e}{kl_max:>12.3e}")


@pytest.fixture(scope="session")
def agreement_table(request):
    table = _AgreementTable()
    request.config.pluginmanager.register(table, "openjet_reference_agreement_table")
    return table


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    """model_path(preset, quant) -> Path of a generated qwen35 GGUF, made once per session."""
    root = tmp_path_factory.mktemp("reference_models")
    made: dict[tuple[str, str], Path] = {}

    def get(preset: str, quant: str) -> Path:
        key = (preset, quant)
        if key not in made:
            made[key] = Path(synth.synth_model(root / f"{preset}-{quant}.gguf", preset=preset,
                                               quant=quant, seed=0))
        return made[key]

    return get


def real_text() -> str:
    """A chunk of a Python stdlib source file followed by English prose."""
    source = Path(textwrap.__file__).read_text(encoding="utf-8")
    return source[:2500] + "\n\n" + PROSE


@pytest.fixture(scope="session")
def text_tokens(model_path):
    """llama.cpp's tokenisation of the real text (all generated presets share one tokenizer)."""
    toks = tokenize(model_path("tiny", "F32"), real_text())
    assert len(toks) >= N_POSITIONS, f"text gives only {len(toks)} tokens"
    return toks[:N_POSITIONS]


# --- agreement with llama.cpp -----------------------------------------------------------------

def _check_agreement(model_path, text_tokens, agreement_table, preset, quant):
    path = model_path(preset, quant)
    ref = ReferenceModel(path).logits(text_tokens)
    ll = llama_logits(path, text_tokens, n_ctx=512)
    a = agreement(ref, ll)
    agreement_table.rows.append((preset, quant, a["positions"], a["top1"], a["kl_mean"], a["kl_max"]))
    assert a["positions"] >= 256
    assert a["top1"] >= TOP1_MIN, f"{preset} {quant}: top-1 agreement {a}"
    assert a["kl_mean"] <= KL_LIMIT[quant], f"{preset} {quant}: mean KL {a}"


@pytest.mark.parametrize("quant", QUANTS)
def test_agreement_tiny(model_path, text_tokens, agreement_table, quant):
    _check_agreement(model_path, text_tokens, agreement_table, "tiny", quant)


@pytest.mark.slow
@pytest.mark.parametrize("quant", QUANTS)
def test_agreement_small(model_path, text_tokens, agreement_table, quant):
    _check_agreement(model_path, text_tokens, agreement_table, "small", quant)


# --- the reference's own paths ------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["F32", "Q4_K_M"])
def test_step_equals_teacher_forced(model_path, text_tokens, quant):
    ref = ReferenceModel(model_path("tiny", quant))
    tokens = text_tokens[:48]
    full = ref.logits(tokens)
    full_state = ref.state()
    full_hidden = ref.hidden.copy()

    ref.reset()
    stepped = np.stack([ref.step(t) for t in tokens])
    scale = np.max(np.abs(full))
    assert np.max(np.abs(stepped - full)) / scale <= 1e-5
    np.testing.assert_allclose(ref.hidden, full_hidden, rtol=0, atol=1e-9 * np.max(np.abs(full_hidden)))
    step_state = ref.state()
    assert step_state.keys() == full_state.keys()
    for name, value in full_state.items():
        assert step_state[name].shape == value.shape, name
        np.testing.assert_allclose(step_state[name], value, rtol=1e-9, atol=1e-12, err_msg=name)

    # a second batch after a first (two ubatches) lands on the same logits too
    ref.reset()
    first = ref.forward(tokens[:20])
    second = ref.forward(tokens[20:])
    assert np.max(np.abs(np.concatenate([first, second]) - full)) / scale <= 1e-5


def test_state_shapes_and_float32(model_path, text_tokens):
    path = model_path("tiny", "F32")
    ref = ReferenceModel(path)
    c = ref.config
    tokens = text_tokens[:16]
    l64 = ref.logits(tokens)
    st = ref.state()
    for il in c.deltanet_layers():
        assert st[f"blk.{il}.conv"].shape == (c.ssm_conv_dim, c.ssm_conv_kernel - 1)
        assert st[f"blk.{il}.ssm"].shape == (c.ssm_dt_rank, c.ssm_d_state, c.ssm_d_state)
        assert np.any(st[f"blk.{il}.ssm"] != 0)
    for il in c.attention_layers():
        assert st[f"blk.{il}.k"].shape == (len(tokens), c.n_head_kv, c.head_dim)
        assert st[f"blk.{il}.v"].shape == (len(tokens), c.n_head_kv, c.head_dim)
    # the conv state is the last kernel-1 conv inputs: after a reset and one token it holds
    # zeros then that token's projection
    ref.reset()
    ref.step(tokens[0])
    conv = ref.state()[f"blk.{c.deltanet_layers()[0]}.conv"]
    assert np.all(conv[:, :-1] == 0) and np.any(conv[:, -1] != 0)

    l32 = ReferenceModel(path, dtype=np.float32).logits(tokens)
    assert l32.dtype == np.float32
    assert np.max(np.abs(l32 - l64)) / np.max(np.abs(l64)) < 1e-4


def test_bad_input_is_named(model_path, tmp_path):
    ref = ReferenceModel(model_path("tiny", "F32"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ref.logits([1, ref.n_vocab])
    with pytest.raises(ValueError, match="h must have"):
        ref.mtp_logits(np.zeros(3), 1)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        ReferenceModel(tmp_path / "missing.gguf")


# --- MTP -------------------------------------------------------------------------------------

def test_mtp_logits_depend_on_both_inputs(model_path, text_tokens):
    ref = ReferenceModel(model_path("tiny", "Q4_K_M"))
    tokens = text_tokens[:24]
    ref.logits(tokens)
    h = ref.hidden[-2]
    base, h_mtp = ref.mtp_logits(h, tokens[-1], pos=len(tokens) - 1)
    assert base.shape == (ref.n_vocab,) and h_mtp.shape == (ref.config.n_embd,)
    assert np.all(np.isfinite(base)) and np.all(np.isfinite(h_mtp))

    other_h, _ = ref.mtp_logits(ref.hidden[-5], tokens[-1], pos=len(tokens) - 1)
    other_tok, _ = ref.mtp_logits(h, (tokens[-1] + 1) % ref.n_vocab, pos=len(tokens) - 1)
    again, _ = ref.mtp_logits(h, tokens[-1], pos=len(tokens) - 1)
    assert np.max(np.abs(other_h - base)) > 1e-3
    assert np.max(np.abs(other_tok - base)) > 1e-3
    # rewriting the same position replaces its cache row rather than adding one
    np.testing.assert_array_equal(again, base)
    assert len(ref.state()["mtp.pos"]) == 1


def test_mtp_prefill_and_chained_drafts(model_path, text_tokens):
    ref = ReferenceModel(model_path("tiny", "F32"))
    tokens = text_tokens[:32]
    ref.logits(tokens)
    pre = ref.mtp_prefill()
    assert pre.shape == (len(tokens), ref.n_vocab)
    np.testing.assert_array_equal(ref.state()["mtp.pos"], np.arange(len(tokens)))

    # draft 3 tokens past the end, chaining the MTP block's own hidden state
    n = len(tokens)
    next_tok = int(np.argmax(ref.logits(tokens)[-1]))   # what the main model predicts at n
    ref.mtp_reset()
    ref.mtp_prefill()
    h = ref.hidden[-1]
    tok = next_tok
    drafts, hs = [], []
    for i in range(3):
        logits, h = ref.mtp_logits(h, tok, pos=n + i)
        tok = int(np.argmax(logits))
        drafts.append(tok)
        hs.append(h)
    np.testing.assert_array_equal(ref.state()["mtp.pos"], np.arange(n + 3))
    assert not np.allclose(hs[0], hs[1])

    # roll back to the first draft position and redo: identical drafts (cache rows replaced)
    logits0, h0 = ref.mtp_logits(ref.hidden[-1], next_tok, pos=n)
    assert int(np.argmax(logits0)) == drafts[0]
    np.testing.assert_array_equal(h0, hs[0])
    np.testing.assert_array_equal(ref.state()["mtp.pos"], np.arange(n + 1))

    # the draft at n depends on the MTP cache of earlier positions (its own attention)
    ref.mtp_reset()
    alone, _ = ref.mtp_logits(ref.hidden[-1], next_tok, pos=n)
    assert np.max(np.abs(alone - logits0)) > 1e-3
