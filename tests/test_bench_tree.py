"""`openjet bench`'s spec_tree_tps rows (issue 28): draft trees from the MTP head against chains with
the same verify budget.

On the CPU: the row's numbers come from a real tree decoder run (the numpy reference's, through the
same `tree_phase` / `measure_tree_row` the GPU child runs with the native engine's decoder) on a tiny
generated model whose MTP head is right after 75% of the tokens and ranks the right token second
after 80% of the others; rows that cannot run (no MTP block, no native tree decoder in the build, a
backend that is not the native engine) are skipped with their reason; the report's table compares a
stored tree row with the best and the fastest chain of at most its budget.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from openjet_plugin.bench import ours, report, runner, spec
from test_bench import tiny_model, toy_native  # noqa: F401 - fixtures: the toy native engine
from openjet_plugin.speculative import reference_decoder
from openjet_plugin.speculative_tree import TreePolicy
from openjet_plugin.testing.reference import ReferenceModel
from openjet_plugin.testing.synth import synth_model

N_TOKENS, REPS = 24, 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = synth_model(tmp_path_factory.mktemp("tree-bench") / "tiny-mtp75-ru80.gguf", "tiny", "F32",
                       mtp_accuracy=0.75, mtp_runner_up=0.8)
    return ReferenceModel(path)


@pytest.fixture(scope="module")
def point(model):
    """A start point as bench/spec.py makes one: the history (the current token last) and the plain
    greedy continuation of the current token."""
    history = [int(t) for t in np.random.default_rng(28).integers(0, 4096, size=12)]
    model.reset()
    model.forward(history[:-1])
    logits = model.step(history[-1])
    cont = []
    for _ in range(N_TOKENS):
        cont.append(int(np.argmax(logits)))
        logits = model.step(cont[-1])
    return spec.StartPoint(len(history) - 1, history, cont, plain_tps=100.0)


def _run_tree_phase(tmp_path, be, point, factory=None, params=None, name="o"):
    out_path = tmp_path / f"{name}.jsonl"
    out = ours.Emitter(out_path)
    params = params or ours.tree_params(8, "q", point.depth)
    args = SimpleNamespace(spec_tokens=N_TOKENS, reps=REPS, model="tiny-mtp75-ru80.gguf")
    ours.tree_phase(be, args, out, [("spec_tree_tps", params)], point, None, None, lambda: float("inf"), factory)
    out.f.close()
    lines = [json.loads(x) for x in out_path.read_text().splitlines()]
    return params, lines


def test_tree_items_parse_and_name_bad_items():
    assert ours._tree_items("8, 16:calibrated@0", 8192) == [(8, "q", 8192), (16, "calibrated", 0)]
    with pytest.raises(ValueError, match="BUDGET"):
        ours._tree_items("eight", 0)
    with pytest.raises(ValueError, match="shape 'bushy'"):
        ours._tree_items("8:bushy", 0)
    rows = ours.spec_rows([], [(7, 0)], 0, [(8, "q", 0)])
    assert rows == [("spec_mtp_tps", {"drafts": 7, "depth": 0}),
                    ("spec_tree_tps", {"budget": 8, "depth": 0, "shape": "q"})]


def test_a_tree_row_comes_from_a_real_decoder_run(tmp_path, model, point):
    """tree_phase with the reference's tree decoder: one result with REPS positive samples and
    details that are the decoder's own stats (the same greedy run made again gives the same tokens
    per cycle), the output equal to plain decoding, the tree within its budget."""
    be = SimpleNamespace(has_mtp=True)
    params, lines = _run_tree_phase(tmp_path, be, point,
                                    lambda be, b, shape, vocab: spec.reference_tree_factory(model, b, shape, vocab))
    res = [x for x in lines if "metric" in x]
    assert [x["metric"] for x in res] == ["spec_tree_tps"] and res[0]["params"] == params
    assert len(res[0]["samples"]) == REPS and all(x > 0 for x in res[0]["samples"])
    details = next(x["info"][ours.DETAILS_KEY] for x in lines if "info" in x)
    d = details[report.row_key("spec_tree_tps", "openjet", params)]
    again = reference_decoder(model, tree=TreePolicy(8)).generate(point.history, spec.greedy_params(),
                                                                  max_tokens=N_TOKENS)
    assert again.tokens == point.continuation
    assert d["tokens_per_cycle"] == round(again.stats.tokens_per_cycle, 4)
    assert d["cycles"] == REPS * again.stats.cycles
    assert d["runs_differing_from_plain"] == 0 and d["first_difference"] == -1
    assert 1 < d["positions_per_cycle"] <= 8 and len(d["acceptance_at"]) == 7
    assert d["tokens_per_cycle"] > 1.5          # a head right after 75% of the tokens: well above 1
    assert "draft trees" in d["drafts_from"] and "best-first" in d["drafts_from"]
    print(f"tiny mtp 0.75 / runner-up 0.8, tree B=8: {d['tokens_per_cycle']} tokens/cycle, "
          f"{d['side_accepts_per_cycle']} side accepts/cycle")


def test_rows_that_cannot_run_are_skipped_with_the_reason(tmp_path, point, monkeypatch):
    # not the native engine: the default factory says so (no crash, no result)
    _, lines = _run_tree_phase(tmp_path, SimpleNamespace(has_mtp=True), point)
    assert [x for x in lines if "metric" in x] == []
    (skip,) = [x for x in lines if "skip" in x]
    assert skip["skip"]["metric"] == "spec_tree_tps" and "not the native engine" in skip["reason"]

    # the native engine, but a build without the tree decoder
    from openjet_plugin import speculative_native
    from openjet_plugin.backends import native

    class FakeNative:
        has_mtp = True
    monkeypatch.setattr(native, "NativeBackend", FakeNative)
    monkeypatch.delattr(speculative_native, "native_tree_decoder", raising=False)
    _, lines = _run_tree_phase(tmp_path, FakeNative(), point, name="no-decoder")
    (skip,) = [x for x in lines if "skip" in x]
    assert "no native tree decoder" in skip["reason"] and "native_tree_decoder" in skip["reason"]

    # with it, the native factory hands the engine, the budget and the vocabulary over
    seen = []
    monkeypatch.setattr(speculative_native, "native_tree_decoder",
                        lambda be, budget, vocab=None: seen.append((be, budget, vocab)) or "decoder", raising=False)
    be = FakeNative()
    assert spec.native_tree_factory(be, 8, "q", None)(0) == "decoder" and seen == [(be, 8, None)]

    # no MTP block: nothing drafts
    _, lines = _run_tree_phase(tmp_path, SimpleNamespace(has_mtp=False), point, name="no-mtp")
    (skip,) = [x for x in lines if "skip" in x]
    assert "has no MTP block" in skip["reason"]


def _tree_report(model_info: dict) -> dict:
    rows, details = [], {}
    depth = 8192
    tpc = {1: 1.7, 2: 2.2, 3: 2.6, 4: 2.8, 7: 3.1}
    tps = {1: 150.0, 2: 180.0, 3: 200.0, 4: 210.0, 7: 190.0}
    for D in tpc:
        p = {"drafts": D, "depth": depth}
        rows.append(report.result("spec_mtp_tps", "openjet", p, [tps[D]] * 6))
        details[report.row_key("spec_mtp_tps", "openjet", p)] = {"tokens_per_cycle": tpc[D], "drafts_proposed": 10,
                                                                 "drafts_accepted": 5}
    p = {"budget": 8, "depth": depth, "shape": "q"}
    rows.append(report.result("spec_tree_tps", "openjet", p, [252.0] * 6))
    details[report.row_key("spec_tree_tps", "openjet", p)] = {
        "tokens_per_cycle": 3.72, "positions_per_cycle": 7.9, "side_accepts_per_cycle": 0.4,
        "runs_differing_from_plain": 0, "reps": 6, "drafts_proposed": 10, "drafts_accepted": 5}
    man = {"info": {report.DETAILS_KEY: details}, "model": model_info,
           "not_measured": [{"metric": "spec_tree_tps", "engine": "openjet",
                             "params": {"budget": 8, "depth": 0, "shape": "q"},
                             "reason": "this build has no native tree decoder"}]}
    return {"manifest": man, "results": rows}


def test_report_table_compares_the_tree_with_the_best_and_fastest_chain_of_its_budget():
    rep = _tree_report({"mtp_accuracy": 0.75, "mtp_runner_up": 0.8})
    report.validate_report(rep)
    md = report.markdown(rep)
    section = md[md.index("## Draft trees against chains with the same verify budget"):]
    assert "right after 75% of the tokens (--mtp-accuracy 0.75)" in section
    assert "right token second after 80% of those tokens (--mtp-runner-up 0.8)" in section
    lines = [x for x in section.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| depth | B | shape | tree tokens/s | tree tokens/cycle")
    assert lines[1].startswith("| 0 | 8 | q | not measured (")
    # best by tokens per cycle: D = 7 (3.1, ratio 3.72 / 3.1 = 1.20); fastest: D = 4 (210, 252 / 210 = 1.20)
    assert lines[2] == ("| 8192 | 8 | q | 252.0 [252.0, 252.0] | 3.72 | 7.90 | 0.400 | D = 7: 3.10 | 1.20× "
                        "| D = 4: 210.0 | 1.20× | yes |")
    assert "this build has no native tree decoder" in md
    assert "## MTP speculation, openjet against llama.cpp" not in md     # no peer rows: no spec-vs-spec table
    md = report.markdown(_tree_report({"mtp_accuracy": 0.6}))
    assert "second choice is no better (no --mtp-runner-up)" in md
    md = report.markdown(_tree_report({}))
    assert "(--model, or --mtp-accuracy none)" in md


def test_runner_plans_tree_rows_and_names_the_runner_up_model(tmp_path):
    s = runner.Settings.quick_run()
    planned, _ = runner.plan(s)
    trees = sorted(r[2]["depth"] for r in planned if r[0] == "spec_tree_tps")
    assert trees == sorted(s.depths)
    ours_d7 = [r for r in planned if r[0] == "spec_mtp_tps" and r[1] == "openjet" and r[2]["drafts"] == 7]
    assert len(ours_d7) == len(s.depths)
    assert not [r for r in planned if r[0] == "spec_mtp_tps" and r[1] == "llama.cpp" and r[2]["drafts"] == 7]
    args = runner.parser().parse_args(["--mtp-accuracy", "0.75", "--mtp-runner-up", "0.8"])
    assert args.mtp_runner_up == 0.8


def test_the_child_runs_tree_rows_last_and_records_each(tmp_path, tiny_model, toy_native):
    """ours.main with --spec-tree on the real NativeBackend over the toy engine (tests/test_bench.py):
    the chain and decode rows at both depths are measured as before (the tree decoder's reset comes
    after every checkpoint's last use), and every tree row is a result or a skip with its reason
    (whether this build and the toy engine have tree verification), never a crash."""
    from test_bench import _child_lines

    out = tmp_path / "o.jsonl"
    assert ours.main(["--model", str(tiny_model), "--out", str(out), "--verify", "", "--decode-depths", "0,96",
                      "--decode-tokens", "4", "--spec-mtp", "1@0,2@96", "--spec-tree", "8@0,4:calibrated@96",
                      "--spec-tokens", "12", "--reps", "2"]) == 0
    res, skips, lines = _child_lines(out)
    key = lambda m, p: report.row_key(m, "openjet", p)  # noqa: E731
    assert not [x for x in lines if "error" in x]
    assert {key("decode_tps", {"depth": 0}), key("decode_tps", {"depth": 96}),
            key("spec_mtp_tps", {"drafts": 1, "depth": 0}), key("spec_mtp_tps", {"drafts": 2, "depth": 96})} <= set(res)
    trees = [key("spec_tree_tps", {"budget": 8, "depth": 0, "shape": "q"}),
             key("spec_tree_tps", {"budget": 4, "depth": 96, "shape": "calibrated"})]
    for k in trees:
        assert (k in res) != (k in skips), k
        if k in skips:
            assert skips[k], k
            print(f"{k}: skipped: {skips[k]}")
    assert set(res) | set(skips) == {key("decode_tps", {"depth": 0}), key("decode_tps", {"depth": 96}),
                                     key("spec_mtp_tps", {"drafts": 1, "depth": 0}),
                                     key("spec_mtp_tps", {"drafts": 2, "depth": 96}), *trees}
