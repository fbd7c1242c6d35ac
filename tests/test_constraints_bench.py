"""`openjet bench`'s constraint_mask_us row (bench/constraint.py) on the CPU: the stand-in
vocabulary, the measurement over a JSON-schema reply, the JSON lines, and the row in the plan."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from openjet_plugin.bench import constraint, report, runner


def test_standin_vocabulary_is_distinct_and_ends_with_a_control_token():
    pieces, eos = constraint.standin_vocabulary(6000)
    assert len(pieces) == 6000 and eos == 5999 and pieces[eos] == b"<|im_end|>"
    assert len(set(pieces)) == 6000 and all(pieces[:-1])


def test_measure_walks_the_reply_through_the_grammar():
    comp, encode, source = constraint.compiler_for(None, 6000)
    assert source == "stand-in" and comp.n_vocab == 6000
    samples = constraint.measure(comp, encode, reps=2)
    assert len(samples) == 2 and all(0 < s < 1e6 for s in samples)


def test_a_reply_outside_the_grammar_fails_the_measurement(monkeypatch):
    comp, encode, _ = constraint.compiler_for(None, 6000)
    monkeypatch.setattr(constraint, "REPLY", {"city": 3})
    with pytest.raises(RuntimeError, match="refused token"):
        constraint.measure(comp, encode, reps=1)


def test_main_writes_the_row_and_its_info(tmp_path):
    out = tmp_path / "c.jsonl"
    assert constraint.main(["--n-vocab", "6000", "--reps", "2", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    row, info = lines
    assert row["metric"] == "constraint_mask_us" and len(row["samples"]) == 2
    assert row["params"] == {"n_vocab": 6000, "grammar": "json_schema"}
    assert info["info"]["constraint"]["vocabulary"] == "stand-in"
    unit, required, higher = report.METRICS["constraint_mask_us"]
    assert unit == "µs" and set(required) == set(row["params"]) and not higher


def test_a_padded_vocabulary_falls_back_to_the_standin(tmp_path):
    from openjet_plugin.defaults import default_model_path
    from openjet_plugin.testing.synth import synth_vocab_only

    padded = synth_vocab_only(tmp_path / "q27b-vocab.gguf", preset="q27b")   # 4K real + 244K UNUSED
    comp, _, source = constraint.compiler_for(str(padded), 6000)
    assert source == f"stand-in ({padded} is mostly padding)" and comp.n_vocab == 6000
    real = default_model_path()                                             # 4K real tokens
    comp, _, source = constraint.compiler_for(str(real), 6000)
    assert source == str(real) and comp.n_vocab == 6000 > 4096


def test_the_row_is_planned_and_measured_by_a_group():
    rows, _ = runner.plan(runner.Settings())
    assert runner.CONSTRAINT_ROW in rows
    assert runner.CONSTRAINT_ROW[2]["n_vocab"] == constraint.Q27B_VOCAB
    run = SimpleNamespace(settings=runner.Settings(), no_ours=False, no_peer=True)
    groups = [g for g in runner.groups(run) if runner.CONSTRAINT_ROW in g[2]]
    assert [(name, fn) for name, _, _, fn in groups] == [("openjet constraint", runner.group_constraint)]
