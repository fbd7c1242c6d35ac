"""Generated models whose MTP head is right at a chosen rate (`mtp_accuracy`, issue 28).

Without the option a generated model's MTP head drafts the main model's next choice at ~99% of the
positions, at every draft slot; with `mtp_accuracy=r` it does so after a share r of the real tokens
(synth.py, "MTP accuracy"). Measured here with the numpy reference, greedy, on the model's own
continuation of a real-text prompt: the first draft (teacher-forced: the main model's hidden state
and token), chains of drafts fed the true tokens and the head's own hidden state, and speculative
cycles whose chained drafts are fed the head's own drafts (what both engines do). The main model
must not change: only the MTP block's tensors differ, and llama.cpp decodes the same tokens.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import pytest

from openjet_plugin.config import PRESETS
from openjet_plugin.testing.llama_ref import tokenize
from openjet_plugin.testing.reference import ReferenceModel
from openjet_plugin.testing.synth import (
    MTP_ACCURACY_KEY, mtp_ffn_names, mtp_switch, successor_of, synth_main, synth_model,
)
from test_reference import real_text

RATES = (0.5, 0.75, 0.9)
N_PROMPT, N_GEN = 16, 300      # greedy positions measured (after a real-text prompt)
DEPTH = 3                      # chained drafts
RATE_TOL = 0.1                 # |measured per-slot acceptance - rate| over N_GEN positions
# Measured (tiny F32, seed 0, 300 positions): the main model follows its successor map at ~98.7%
# of them, so the acceptance is ~r * 0.987 plus the sampling of which tokens the continuation
# visits (+-0.02-0.03 at 300 distinct tokens).


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """tiny F32 without the option and at each rate (the same main model)."""
    d = tmp_path_factory.mktemp("mtp-accuracy")
    files = {None: synth_model(d / "tiny-F32.gguf", "tiny", "F32")}
    for r in RATES:
        files[r] = synth_model(d / f"tiny-F32-mtp{r}.gguf", "tiny", "F32", mtp_accuracy=r)
    return files


@pytest.fixture(scope="module")
def greedy(tiny_files):
    """The main model's greedy continuation of a real-text prompt: tokens and hidden states."""
    path = tiny_files[None]
    ref = ReferenceModel(path)
    prompt = tokenize(path, real_text())[:N_PROMPT]
    seq, hidden = greedy_sequence(ref, prompt, N_GEN)
    return seq, hidden, ref.config


def greedy_sequence(ref: ReferenceModel, prompt, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`prompt` and n greedy tokens after it; hidden `[len, n_embd]` (row t: after token t)."""
    tok = int(ref.logits(prompt)[-1].argmax())
    out = list(prompt)
    for _ in range(n):
        out.append(tok)
        tok = int(ref.step(tok).argmax())
    return np.array(out), ref.hidden.copy()


def teacher_chains(ref: ReferenceModel, seq, hidden, depth: int, start: int) -> np.ndarray:
    """Boolean `[n, depth]`: for each t >= start, whether the k-th chained draft from position t
    (the head's own hidden state fed back, the true tokens as its input) is the sequence's token.
    The MTP cache holds, as llama.cpp's draft context does, (token p, hidden p-1) at position p up to
    the chain's first step; the chain's own rows are dropped before the next t."""
    ref.mtp_reset()
    zero = np.zeros(ref.config.n_embd)
    rows, filled = [], 0
    for t in range(start, len(seq) - depth - 1):
        for p in range(filled, t + 2):
            logits, hm = ref.mtp_logits(hidden[p - 1] if p else zero, int(seq[p]), pos=p)
        filled = t + 2
        right = []
        for k in range(depth):
            if k:
                logits, hm = ref.mtp_logits(hm, int(seq[t + 1 + k]), pos=t + 1 + k)
            right.append(int(logits.argmax()) == int(seq[t + 2 + k]))
        rows.append(right)
    return np.array(rows)


def speculative_cycles(ref: ReferenceModel, seq, hidden, depth: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy speculative decoding along `seq` (the main model's own greedy tokens): each cycle
    drafts `depth` tokens, each fed the previous draft and the head's own hidden state, keeps the
    leading drafts equal to the sequence and the main model's token after them.
    Returns (proposed, accepted) per draft slot, as SpeculativeStats counts them."""
    ref.mtp_reset()
    zero = np.zeros(ref.config.n_embd)
    proposed, accepted = np.zeros(depth, int), np.zeros(depth, int)
    t, filled = start, 0
    while t + 1 + depth < len(seq):
        for p in range(filled, t + 2):
            logits, hm = ref.mtp_logits(hidden[p - 1] if p else zero, int(seq[p]), pos=p)
        filled = t + 2
        drafts: list[int] = []
        for k in range(depth):
            if k:
                logits, hm = ref.mtp_logits(hm, drafts[-1], pos=t + 1 + k)
            drafts.append(int(logits.argmax()))
        n_ok = 0
        while n_ok < depth and drafts[n_ok] == int(seq[t + 2 + n_ok]):
            n_ok += 1
        proposed += 1
        accepted[:n_ok] += 1
        t += n_ok + 1
    return proposed, accepted


def _tensors(path):
    import gguf

    reader = gguf.GGUFReader(os.fspath(path))
    return reader, {t.name: t for t in reader.tensors}


def _differing_tensors(a, b) -> list[str]:
    (_, ta), (_, tb) = _tensors(a), _tensors(b)
    assert list(ta) == list(tb)
    assert all(ta[n].tensor_type == tb[n].tensor_type for n in ta)
    return sorted(n for n in ta if not np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data)))


def _mtp_tensor_names(config) -> list[str]:
    return sorted([*mtp_ffn_names(config), f"blk.{config.mtp_layer}.nextn.eh_proj.weight"])


# --- the file -----------------------------------------------------------------------------------

def test_only_the_mtp_blocks_tensors_change(tiny_files):
    """Same tensors, same types; only eh_proj and the MTP FFN hold other values; the rate is in the
    metadata (and no key is written without the option)."""
    cfg = PRESETS["tiny"]
    for r in RATES:
        assert _differing_tensors(tiny_files[None], tiny_files[r]) == _mtp_tensor_names(cfg)
        reader, _ = _tensors(tiny_files[r])
        assert reader.fields[MTP_ACCURACY_KEY].contents() == pytest.approx(r)
    reader, _ = _tensors(tiny_files[None])
    assert MTP_ACCURACY_KEY not in reader.fields


def test_the_switch_picks_exactly_the_share_of_tokens():
    """round(r * n_real) real tokens are right, for float rows and for the direct writer's Q4_K
    rows (whose rounding each token's critical threshold includes)."""
    cfg = PRESETS["tiny"]
    n_real = cfg.n_vocab
    for gate_type in (None, "Q4_K"):
        for r in (*RATES, 0.01, 1.0):
            sw = mtp_switch(0, cfg, r, gate_type)
            assert sw.right().sum() == round(r * n_real) == sw.n_right, (gate_type, r)
    # the rounding of Q4_K rows (the + and - rows round differently) moves each token's threshold
    # away from |p| a little
    rounded = mtp_switch(0, cfg, 0.75, "Q4_K")
    assert np.median(np.abs(rounded.critical - np.abs(rounded.p))) < 0.05


def test_bad_values_are_named(tmp_path):
    for bad in (0.0, -0.5, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="mtp_accuracy"):
            synth_model(tmp_path / "x.gguf", "tiny", mtp_accuracy=bad)
    no_mtp = dataclasses.replace(PRESETS["tiny"], n_layer_nextn=0)
    with pytest.raises(ValueError, match="MTP block"):
        synth_model(tmp_path / "x.gguf", config=no_mtp, mtp_accuracy=0.5)
    narrow_ffn = dataclasses.replace(PRESETS["tiny"], n_ff=128)
    with pytest.raises(ValueError, match="n_ff"):
        synth_model(tmp_path / "x.gguf", config=narrow_ffn, mtp_accuracy=0.5)
    assert not (tmp_path / "x.gguf").exists()


def test_cli_option(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert synth_main([str(out), "--preset", "tiny", "--mtp-accuracy", "0.6"]) == 0
    assert "mtp_accuracy=0.6" in capsys.readouterr().out
    reader, _ = _tensors(out)
    assert reader.fields[MTP_ACCURACY_KEY].contents() == pytest.approx(0.6)
    assert synth_main([str(tmp_path / "bad.gguf"), "--mtp-accuracy", "2"]) == 2


# --- the acceptance it gives -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def chains(tiny_files, greedy):
    """Per rate: the first-slot outcome by position and the teacher-forced chains."""
    seq, hidden, _ = greedy
    out = {}
    for r in (*RATES, None):
        ref = ReferenceModel(tiny_files[r])
        out[r] = teacher_chains(ref, seq, hidden, DEPTH, N_PROMPT)
    return out


@pytest.mark.parametrize("rate", RATES)
def test_first_draft_is_right_at_the_chosen_rate(chains, greedy, rate):
    seq, _, cfg = greedy
    first = chains[rate][:, 0]
    print(f"\nmtp_accuracy {rate}: first-draft acceptance {first.mean():.3f} over {len(first)} positions")
    assert abs(first.mean() - rate) <= RATE_TOL, first.mean()


@pytest.mark.parametrize("rate", RATES)
def test_right_exactly_after_the_right_tokens(chains, greedy, rate):
    """Where the main model follows its successor map, the first draft is right iff the token it is
    drafted after is one of the switch's right tokens (only tokens at the threshold, where the
    context has a say, may differ): the rate comes from the switch, not from chance."""
    seq, _, cfg = greedy
    first = chains[rate][:, 0]
    x = seq[N_PROMPT + 1:N_PROMPT + 1 + len(first)]        # the token each first draft follows
    follows = seq[N_PROMPT + 2:N_PROMPT + 2 + len(first)] == successor_of(0, cfg)[x]
    right = mtp_switch(0, cfg, rate).right()[x]
    agree = np.mean(first[follows] == right[follows])
    print(f"\nmtp_accuracy {rate}: main follows its successor at {follows.mean():.3f}; the draft agrees with "
          f"the switch at {agree:.3f}; right tokens among those visited {right.mean():.3f}")
    assert follows.mean() > 0.9
    assert agree >= 0.97, agree
    assert not first[~follows].any() or first[~follows].mean() < 0.5


@pytest.mark.parametrize("rate", RATES)
def test_every_chained_slot_keeps_the_rate(chains, rate):
    """A chained draft is made after the previous (true) token with the head's own hidden state:
    each slot is right at the same rate as the first."""
    per_slot = chains[rate].mean(axis=0)
    print(f"\nmtp_accuracy {rate}: per-slot acceptance (true tokens, own hidden state) {per_slot.round(3).tolist()}")
    assert np.all(np.abs(per_slot - rate) <= RATE_TOL), per_slot
    assert np.ptp(per_slot) <= 0.03, per_slot


def test_without_the_option_the_head_is_nearly_always_right(chains):
    per_slot = chains[None].mean(axis=0)
    assert per_slot.min() >= 0.95, per_slot


@pytest.mark.parametrize("rate", RATES)
def test_speculative_cycles_accept_at_the_rate_per_slot(tiny_files, greedy, rate):
    """Cycles as both engines run them (drafts fed the previous draft): acceptance at slot k given
    slots < k accepted is the rate at every slot (counted where >= 40 cycles reached the slot)."""
    seq, hidden, _ = greedy
    proposed, accepted = speculative_cycles(ReferenceModel(tiny_files[rate]), seq, hidden, DEPTH, N_PROMPT)
    reached = np.concatenate([proposed[:1], accepted[:-1]])
    conditional = accepted / np.maximum(reached, 1)
    print(f"\nmtp_accuracy {rate}: {proposed[0]} cycles, D={DEPTH}: accepted at slot {accepted.tolist()}, "
          f"per slot given the earlier {conditional.round(3).tolist()}, "
          f"tokens/cycle {1 + accepted.sum() / proposed[0]:.2f}")
    for k in range(DEPTH):
        if reached[k] >= 40:
            assert abs(conditional[k] - rate) <= 0.15, (k, conditional)
    assert abs(conditional[0] - rate) <= RATE_TOL


# --- the main model is unchanged, also in llama.cpp ------------------------------------------------

def test_llama_cpp_decodes_the_same_tokens(tmp_path):
    """The quantised files (llama.cpp's own quantiser) differ only in the MTP block, and llama.cpp's
    greedy decoding of the main model gives the same tokens with the option as without."""
    import llama_cpp

    plain = synth_model(tmp_path / "plain.gguf", "tiny", "Q4_K_M")
    switched = synth_model(tmp_path / "switched.gguf", "tiny", "Q4_K_M", mtp_accuracy=0.5)
    assert _differing_tensors(plain, switched) == _mtp_tensor_names(PRESETS["tiny"])
    prompt = tokenize(plain, real_text())[:N_PROMPT]
    outs = []
    for path in (plain, switched):
        llm = llama_cpp.Llama(os.fspath(path), n_ctx=512, verbose=False, seed=0)
        try:
            toks = []
            for tok in llm.generate(prompt, temp=0.0, top_k=1):
                toks.append(int(tok))
                if len(toks) == 160:
                    break
        finally:
            llm.close()
        outs.append(toks)
    assert outs[0] == outs[1]


def test_direct_writer_rate(tmp_path):
    """The direct writer (q27b's): its Q4_K switch rows give the rate too, on a file whose other
    tensors are those of the plain direct file."""
    plain = synth_model(tmp_path / "plain.gguf", "tiny", "Q4_K_M", direct=True)
    path = synth_model(tmp_path / "direct.gguf", "tiny", "Q4_K_M", direct=True, mtp_accuracy=0.75)
    cfg = PRESETS["tiny"]
    assert _differing_tensors(plain, path) == _mtp_tensor_names(cfg)
    ref = ReferenceModel(path, dtype=np.float32)
    seq, hidden = greedy_sequence(ref, tokenize(path, real_text())[:N_PROMPT], N_GEN)
    first = teacher_chains(ref, seq, hidden, 1, N_PROMPT)[:, 0]
    x = seq[N_PROMPT + 1:N_PROMPT + 1 + len(first)]
    follows = seq[N_PROMPT + 2:N_PROMPT + 2 + len(first)] == successor_of(0, cfg)[x]
    right = mtp_switch(0, cfg, 0.75, "Q4_K").right()[x]
    print(f"\ndirect Q4_K_M, mtp_accuracy 0.75: first-draft acceptance {first.mean():.3f}, "
          f"agreement with the switch {np.mean(first[follows] == right[follows]):.3f}")
    assert np.mean(first[follows] == right[follows]) >= 0.97
    assert abs(first.mean() - 0.75) <= RATE_TOL


# --- llama.cpp's own MTP drafting (llama-server, CPU; skipped where none is built) -----------------

def _llama_server() -> pathlib.Path | None:
    env = os.environ.get("OPENJET_LLAMA_SERVER")
    if env:
        return pathlib.Path(env)
    root = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "bench-cpu"
    found = sorted(root.glob("llama.cpp-*/build/bin/llama-server"))
    return found[-1] if found else None


def _server_acceptance(server: pathlib.Path, model, prompt: list[int], n_predict: int, drafts: int) -> dict:
    import json
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([os.fspath(server), "-m", os.fspath(model), "--port", str(port), "-c", "1024",
                             "-t", "2", "-np", "1", "--spec-type", "draft-mtp", "--spec-draft-n-max", str(drafts)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"llama-server exited with {proc.returncode}")
                time.sleep(0.25)
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=600))["timings"]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(_llama_server() is None, reason="no llama-server build (set OPENJET_LLAMA_SERVER)")
def test_llama_cpp_mtp_drafting_sees_the_rate(tiny_files, greedy):
    """llama.cpp's own MTP drafting (--spec-type draft-mtp, one draft per cycle) on the same file and
    prompt accepts at the rate, and as the reference's cycles do on the same continuation (the
    server's first draft follows the prompt's last hidden state and the token sampled from it)."""
    seq, hidden, _ = greedy
    t = _server_acceptance(_llama_server(), tiny_files[0.75], seq[:N_PROMPT].tolist(), N_GEN, 1)
    got = t["draft_n_accepted"] / t["draft_n"]
    proposed, accepted = speculative_cycles(ReferenceModel(tiny_files[0.75]), seq, hidden, 1, N_PROMPT - 1)
    ours = accepted[0] / proposed[0]
    print(f"\nllama.cpp draft-mtp, mtp_accuracy 0.75: {t['draft_n_accepted']}/{t['draft_n']} = {got:.3f}; "
          f"reference cycles on the same continuation: {accepted[0]}/{proposed[0]} = {ours:.3f}")
    assert abs(got - 0.75) <= RATE_TOL
    assert abs(got - ours) <= 0.03


# --- the bench's generated model --------------------------------------------------------------------

def test_bench_model_is_cached_per_accuracy(tmp_path, monkeypatch):
    """`openjet bench --mtp-accuracy R`: the generated q27b is made with that rate, cached under its
    own name (the random head's keeps its name); the report's manifest reads the rate from the file.
    Without the options the bench's own head: BENCH_MTP_ACCURACY with BENCH_MTP_RUNNER_UP."""
    from collections import namedtuple

    from openjet_plugin.bench import runner
    from openjet_plugin.testing import synth
    from openjet_plugin.testing.synth import mtp_accuracy_of

    made = []

    def fake_synth_model(out, preset, quant, seed, force, mtp_accuracy=None, mtp_runner_up=None):
        made.append((preset, mtp_accuracy) if mtp_runner_up is None else (preset, mtp_accuracy, mtp_runner_up))
        return synth_model(out, "tiny", "F32", seed=seed, force=force, mtp_accuracy=mtp_accuracy,
                           mtp_runner_up=mtp_runner_up)

    monkeypatch.setattr(synth, "synth_model", fake_synth_model)
    monkeypatch.setattr(runner.shutil, "disk_usage", lambda p: namedtuple("usage", "free")(10 ** 12))
    logs = []
    plain = runner.default_model(tmp_path, logs.append, None, None)
    switched = runner.default_model(tmp_path, logs.append, 0.75, None)
    assert plain.name == "q27b-Q4_K_M-seed0.gguf" and switched.name == "q27b-Q4_K_M-seed0-mtp0.75.gguf"
    assert made == [("q27b", None), ("q27b", 0.75)]
    assert runner.default_model(tmp_path, logs.append, 0.75, None) == switched and len(made) == 2   # cached
    assert mtp_accuracy_of(switched) == 0.75 and mtp_accuracy_of(plain) is None
    bench = runner.default_model(tmp_path, logs.append)          # what ab.sh and the bench read
    assert bench.name == (f"q27b-Q4_K_M-seed0-mtp{runner.BENCH_MTP_ACCURACY:g}"
                          f"-ru{runner.BENCH_MTP_RUNNER_UP:g}.gguf")
    assert made[-1] == ("q27b", runner.BENCH_MTP_ACCURACY, runner.BENCH_MTP_RUNNER_UP)
    assert runner.parser().parse_args(["--mtp-accuracy", "0.5"]).mtp_accuracy == 0.5
    # --mtp-runner-up: its own file too, its share in the metadata
    from openjet_plugin.testing.synth import mtp_runner_up_of
    second = runner.default_model(tmp_path, logs.append, 0.75, 0.8)
    assert second.name == "q27b-Q4_K_M-seed0-mtp0.75-ru0.8.gguf" and made[-1] == ("q27b", 0.75, 0.8)
    assert mtp_runner_up_of(second) == 0.8 and mtp_runner_up_of(switched) is None


def test_bench_head_options():
    """`--mtp-accuracy` / `--mtp-runner-up` as the bench reads them: the bench's head where neither is
    given, an accuracy alone without a runner-up, 'none' for the random head; refused with --model
    or where they contradict each other, naming the option."""
    from openjet_plugin.bench import runner

    def head(*argv):
        return runner.head_of_args(runner.parser().parse_args(list(argv)))

    assert runner.BENCH_MTP_ACCURACY == 0.75 and 0 < runner.BENCH_MTP_RUNNER_UP < 1
    assert head() == (runner.BENCH_MTP_ACCURACY, runner.BENCH_MTP_RUNNER_UP)
    assert head("--mtp-accuracy", "0.6") == (0.6, None)
    assert head("--mtp-accuracy", "0.6", "--mtp-runner-up", "0.3") == (0.6, 0.3)
    assert head("--mtp-runner-up", "0.3") == (runner.BENCH_MTP_ACCURACY, 0.3)
    assert head("--mtp-accuracy", "none") == (None, None)
    assert head("--mtp-accuracy", "NONE", "--mtp-runner-up", "none") == (None, None)
    assert head("--model", "x.gguf") == (None, None)             # that file's head is its own
    with pytest.raises(ValueError, match="--mtp-runner-up"):
        head("--mtp-accuracy", "none", "--mtp-runner-up", "0.5")
    with pytest.raises(ValueError, match="not to --model"):
        head("--model", "x.gguf", "--mtp-accuracy", "0.75")
    with pytest.raises(SystemExit):
        runner.parser().parse_args(["--mtp-accuracy", "most"])
