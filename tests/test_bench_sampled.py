"""bench/sampled.py (issue 28): sampled against greedy requests through the Engine, with and without
speculation, on the real NativeBackend over the toy engine (tests/test_bench.py) and on the
llama.cpp backend with the embedded default model. CPU numbers check the machinery only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openjet_plugin.bench import sampled
from test_bench import tiny_model, toy_native  # noqa: F401 - fixtures: the toy native engine

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = REPO / "openjet_plugin" / "data" / "default.gguf"


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _results(lines: list[dict]) -> dict:
    return {(x["params"]["drafts"], x["params"]["temperature"]): x for x in lines if x.get("metric") == sampled.METRIC}


def _details(lines: list[dict]) -> dict:
    out = {}
    for x in lines:
        for key, d in x.get("info", {}).get("spec_details", {}).items():
            out[key] = d
    return out


def test_every_row_is_measured_on_the_native_backend(tmp_path, tiny_model, toy_native, capsys):
    out = tmp_path / "s.jsonl"
    rc = sampled.main(["--model", str(tiny_model), "--out", str(out), "--backend", "native", "--drafts", "0,2",
                       "--temperatures", "0,0.7", "--tokens", "6", "--reps", "2", "--depth", "8"])
    assert rc == 0
    lines = _lines(out)
    res = _results(lines)
    assert set(res) == {(0, 0.0), (0, 0.7), (2, 0.0), (2, 0.7)}
    for row in res.values():
        assert row["unit"] == "tokens/s" and len(row["samples"]) == 2 and all(s > 0 for s in row["samples"])
        assert row["params"]["depth"] == 8
    details = list(_details(lines).values())
    assert len(details) == 4 and all(d["backend"] == "native" for d in details)
    assert sorted(d["drafts_proposed"] > 0 for d in details) == [False, False, True, True]   # drafts 0 proposes none
    assert all(len(d["tokens_generated"]) == 2 for d in details)
    table = capsys.readouterr().out
    assert "| 8 | 2 | 0.7 |" in table and "× greedy" in table and "1.00×" in table   # greedy against itself
    # each measured row: its samples' range, and with drafts its acceptance per draft
    rows = {tuple(r.split("|")[2:4]): r.split("|") for r in table.splitlines() if r.startswith("| 8 |")}
    assert len(rows) == 4 and all("[" in r[4] and "]" in r[4] for r in rows.values())
    assert all(0 <= float(rows[(" 2 ", t)][6]) <= 1 for t in (" 0 ", " 0.7 "))
    assert all(rows[(" 0 ", t)][6].strip() == "" for t in (" 0 ", " 0.7 "))


def test_the_llama_cpp_backend_measures_too(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    rc = sampled.main(["--model", str(DEFAULT_GGUF), "--out", str(out), "--backend", "llama.cpp", "--drafts", "0",
                       "--tokens", "4", "--reps", "1"])
    assert rc == 0
    res = _results(_lines(out))
    assert set(res) == {(0, 0.0), (0, 0.7)} and all(r["samples"][0] > 0 for r in res.values())
    assert {d["backend"] for d in _details(_lines(out)).values()} == {"llama.cpp"}


def test_a_failed_load_is_each_rows_reason(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    rc = sampled.main(["--model", str(DEFAULT_GGUF), "--out", str(out), "--backend", "nowhere", "--drafts", "0",
                       "--tokens", "4", "--reps", "1"])
    assert rc == 4                                           # measured nothing, said why
    skips = [x for x in _lines(out) if "skip" in x]
    assert len(skips) == 2 and all("load(draft_depth=0) failed" in x["reason"] and "nowhere" in x["reason"]
                                   for x in skips)
    assert "not measured: load(draft_depth=0) failed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1"], "--tokens must be >= 2"),
    (["--temperatures", "hot"], "expected comma-separated numbers"),
    (["--drafts", "-1"], "expected non-negative integers"),
])
def test_bad_arguments_are_named(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        sampled.main(["--model", str(DEFAULT_GGUF), "--out", str(tmp_path / "s.jsonl"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_model_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sampled.main(["--model", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "s.jsonl")])
    assert exc.value.code == 2 and "none.gguf: no such file" in capsys.readouterr().err
