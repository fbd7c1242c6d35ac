"""The agreement rows of `openjet bench` (openjet_plugin/bench/agreement.py, issue 25).

- The comparison on constructed logits: an exact KL, the top-1 and near-tie counts, chunking that
  changes nothing, and broken variants it catches (rows off by one position, a scaled softmax,
  NaN rows).
- native/tools/llama_logits' streaming (-o -) and --depth modes, compiled against
  llama-cpp-python's own CPU libllama when llama.cpp's headers are here ($OPENJET_LLAMA_SRC,
  /opt/llama-src or the .carry sdist; otherwise those tests skip saying so): the streamed rows after
  a prefill equal the rows of a full run.
- The child on the CPU: the numpy reference in our engine's place against llama.cpp (llama_logits,
  and llama.cpp's Python API) on the embedded default model, at depth 0 and after a prefill; a
  reference whose prefill skips tokens is caught.
- The runner's group and rows, and the report's section with the thresholds and pass / fail.
- GPU (marked gpu): the native engine against llama.cpp on the default model, its prefill through
  oj_prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from openjet_plugin.bench import agreement, peer, report, runner

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "openjet_plugin" / "data" / "default.gguf"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gpu_scripts import llama_logits_bin  # noqa: E402,F401 - a fixture, used by name


# --- the comparison --------------------------------------------------------------------------------

def _kl_by_hand(llama: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(p || q) per row with p, q the softmaxes, written out another way than log_softmax."""
    p = np.exp(llama - llama.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(ours - ours.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    return (p * np.log(p / q)).sum(-1)


def test_kl_of_a_known_pair_and_shift_invariance():
    # llama.cpp uniform over two tokens, ours 1:3: KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3)
    res = agreement.compare(np.array([[0.0, 0.0]]), np.array([[0.0, np.log(3.0)]]), near_tie=0.05)
    assert res["kl_mean"] == pytest.approx(0.5 * np.log(4 / 3), rel=1e-12)
    # llama.cpp breaks its tie towards token 0, ours prefers 1: a disagreement, and a near-tie
    assert res["top1"] == 0.0 and res["near_tie_disagreements"] == 1
    rng = np.random.default_rng(0)
    llama = rng.normal(size=(9, 300))
    res = agreement.compare(llama, llama + 7.5)          # a constant per row changes no softmax
    assert res["top1"] == 1.0 and abs(res["kl_mean"]) < 1e-12 and res["kl_max"] < 1e-12


def test_streamed_chunks_give_the_figures_of_the_whole():
    rng = np.random.default_rng(1)
    llama = rng.normal(size=(50, 400)).astype(np.float32)
    ours = (llama + rng.normal(scale=0.05, size=llama.shape)).astype(np.float32)
    whole = agreement.compare(llama, ours, chunk=50)
    kl = _kl_by_hand(llama.astype(np.float64), ours.astype(np.float64))
    assert whole["kl_mean"] == pytest.approx(kl.mean(), rel=1e-9)
    assert whole["kl_max"] == pytest.approx(kl.max(), rel=1e-9)
    assert whole["kl_p99"] == pytest.approx(np.quantile(kl, 0.99), rel=1e-9)
    assert whole["top1"] == pytest.approx(np.mean(llama.argmax(-1) == ours.argmax(-1)))
    for chunk in (1, 7, 64):
        c = agreement.Comparison()
        for a in range(0, 50, chunk):
            c.add(llama[a:a + chunk], ours[a:a + chunk])
        part = c.result()
        for k in ("positions", "top1", "disagreements", "near_tie_disagreements"):
            assert part[k] == whole[k], k
        for k in ("kl_mean", "kl_p99", "kl_max", "rel_l2", "max_abs_diff"):
            assert part[k] == pytest.approx(whole[k], rel=1e-12), k
        assert [d["position"] for d in part["disagreement_detail"]] == \
            [d["position"] for d in whole["disagreement_detail"]]


def test_near_ties_and_real_disagreements_are_told_apart():
    rng = np.random.default_rng(0)
    llama = rng.normal(size=(6, 50)).astype(np.float32)
    ours = llama.copy()
    top = llama.argmax(-1)
    # position 0: llama.cpp has its top two 0.01 apart, ours puts the runner-up 0.5 above: a near-tie
    # by llama.cpp's logits (whose choice it is), however sure ours is
    second = int(np.argsort(llama[0])[-2])
    llama[0, second] = llama[0, top[0]] - 0.01
    ours[0] = llama[0]
    ours[0, second] = llama[0, top[0]] + 0.5
    # position 3: ours prefers a token llama.cpp ranks far lower
    low = int(np.argmin(llama[3]))
    ours[3, low] = llama[3].max() + 5.0
    res = agreement.compare(llama, ours, near_tie=0.05, chunk=4)     # the two fall in different chunks
    assert res["disagreements"] == 2 and res["top1"] == pytest.approx(4 / 6)
    assert res["near_tie_disagreements"] == 1 and res["near_tie_fraction"] == 0.5
    assert res["top1_excluding_near_ties"] == pytest.approx(5 / 6)
    d = {x["position"]: x for x in res["disagreement_detail"]}
    assert set(d) == {0, 3}
    assert d[0]["llama_gap"] == pytest.approx(0.01, abs=1e-5) and d[3]["llama_gap"] > 1.0
    assert d[0]["ours_gap"] == pytest.approx(0.5, abs=1e-5)
    assert res["kl_max"] == pytest.approx(d[3]["kl"]) and res["kl_max"] > 0.1


def test_broken_variants_fail_the_bar():
    """What a broken engine looks like to the comparison: each fails agreement.verdict."""
    rng = np.random.default_rng(2)
    llama = (3.0 * rng.normal(size=(2048, 64))).astype(np.float32)
    close = llama + rng.normal(scale=1e-3, size=llama.shape).astype(np.float32)
    good = agreement.compare(llama, close)
    assert agreement.verdict(good["top1"], good["kl_mean"], good["positions"]) == (True, "")
    # rows one position off (a teacher-forcing misalignment): top-1 collapses
    shifted = agreement.compare(llama[1:], close[:-1])
    ok, why = agreement.verdict(shifted["top1"], shifted["kl_mean"], shifted["positions"])
    assert not ok and "top-1" in why and shifted["top1"] < 0.2
    # a softmax 10% too sharp keeps every argmax but not the distribution
    sharp = agreement.compare(llama, 1.1 * llama)
    ok, why = agreement.verdict(sharp["top1"], sharp["kl_mean"], sharp["positions"])
    assert sharp["top1"] == 1.0 and not ok and why.startswith("mean KL")
    # too few positions never pass
    assert agreement.verdict(1.0, 0.0, 1999) == (False, "1999 positions < 2000")
    bad = close.copy()
    bad[5, 7] = np.nan
    res = agreement.compare(llama, bad)
    assert not res["finite"] and res["nonfinite_rows_ours"] == 1 and res["nonfinite_rows_llama"] == 0
    with pytest.raises(agreement.AgreementError, match="shapes differ"):
        agreement.compare(llama, close[:5])
    c = agreement.Comparison()
    c.add(llama[:2], close[:2])
    with pytest.raises(agreement.AgreementError, match="a chunk of 63 logits"):
        c.add(llama[:2, :63], close[:2, :63])
    with pytest.raises(agreement.AgreementError, match="no positions"):
        agreement.Comparison().result()


def test_verdict_at_the_thresholds():
    assert agreement.verdict(0.99, 1e-3, 2000)[0]
    assert not agreement.verdict(0.9899, 1e-3, 2000)[0]
    assert not agreement.verdict(0.99, 1.01e-3, 2000)[0]


# --- llama_logits: stream and depth ----------------------------------------------------------------

# llama_logits_bin: test_gpu_scripts' fixture (llama_logits compiled against llama-cpp-python's libllama)


def test_llama_logits_streams_the_rows_after_a_prefill(llama_logits_bin, tmp_path):
    tokens = np.random.default_rng(3).integers(0, 4096, 90).astype("<i4")
    tokens.tofile(tmp_path / "t.i32")
    base = [str(llama_logits_bin), "-m", str(DEFAULT_MODEL), "-t", str(tmp_path / "t.i32"), "-b", "8", "--threads", "2"]
    r = subprocess.run(base + ["-o", str(tmp_path / "all.f32")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    full = np.fromfile(tmp_path / "all.f32", dtype="<f4").reshape(90, 4096)
    # 61 tokens prefilled in batches of 16 (a ragged last one), 29 rows streamed (a ragged last batch)
    r = subprocess.run(base + ["-o", "-", "--depth", "61", "--prefill-batch", "16"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    magic, rows, n_vocab, depth = np.frombuffer(r.stdout[:16], dtype="<i4").tolist()
    assert (magic, rows, n_vocab, depth) == (agreement.STREAM_MAGIC, 29, 4096, 61)
    streamed = np.frombuffer(r.stdout[16:], dtype="<f4").reshape(29, 4096)
    np.testing.assert_allclose(streamed, full[61:], rtol=0, atol=1e-5 * np.abs(full).max())
    info = json.loads(r.stderr.decode().strip().splitlines()[-1])
    assert (info["depth"], info["n_rows"], info["prefill_batch"]) == (61, 29, 16) and info["prefill_s"] > 0
    r = subprocess.run(base + ["-o", "-", "--depth", "90"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "--depth 90 leaves no position" in r.stderr and r.stdout == ""


# --- the child on the CPU --------------------------------------------------------------------------

def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(params=["llama_logits", "llama_python"])
def llama_args(request):
    if request.param == "llama_logits":
        return ["--llama-logits", str(request.getfixturevalue("llama_logits_bin"))]
    if not _have_llama_cpp():
        pytest.skip("llama-cpp-python is not importable")
    return ["--llama-python"]


def test_child_reference_against_llama_cpp_on_the_default_model(llama_args, tmp_path):
    out = tmp_path / "r.jsonl"
    rc = agreement.main(["--model", str(DEFAULT_MODEL), "--label", "default", "--rows", "0:96,160:64",
                         "--engine", "reference", "--tokens", "stdlib", "--chunk", "40", "--threads", "2",
                         "--workdir", str(tmp_path / "w"), "--out", str(out), *llama_args])
    assert rc == 0
    recs = _records(out)
    results = {(r["metric"], r["params"]["depth"]): r for r in recs if "metric" in r}
    # the reference in our engine's place makes the floor rows, not the engine's
    assert set(results) == {(m, d) for m in agreement.REFERENCE_METRICS for d in (0, 160)}, recs
    details = {}
    for r in recs:
        details.update(r.get("info", {}).get(report.DETAILS_KEY, {}))
    for depth, positions in ((0, 96), (160, 64)):
        params = agreement.row_params("default", depth, positions)
        top1 = results[("reference_agreement_top1", depth)]
        assert top1["params"] == params and top1["unit"] == "fraction" and len(top1["samples"]) == 1
        # the float64 reference against llama.cpp's CPU roundings (Q8_0 activations): close, not equal
        assert top1["samples"][0] >= 0.95
        kl = results[("reference_agreement_kl", depth)]["samples"][0]
        assert 0 < kl < 3e-3
        d = details[report.row_key("reference_agreement_top1", "openjet", params)]
        k = details[report.row_key("reference_agreement_kl", "openjet", params)]
        assert d["positions"] == positions and d["n_vocab"] == 4096 and d["finite"]
        assert d["ours"]["engine"] == "numpy reference" and "held-out stdlib" in d["tokens"]
        assert k["kl_mean"] == kl and k["kl_max"] >= k["kl_p99"] >= 0
    assert not any("skip" in r or "error" in r for r in recs)


def test_child_catches_a_prefill_that_skips_tokens(monkeypatch, tmp_path):
    """Our side's state after the prefill must be the prefix's: one that leaves out tokens (here
    the last 16 of 160) disagrees with llama.cpp's, and the row shows it."""
    if not _have_llama_cpp():
        pytest.skip("llama-cpp-python is not importable")
    start = agreement.ReferenceSide.start
    monkeypatch.setattr(agreement.ReferenceSide, "start", lambda self, prefix: start(self, prefix[:-16]))
    out = tmp_path / "r.jsonl"
    rc = agreement.main(["--model", str(DEFAULT_MODEL), "--label", "default", "--rows", "160:64",
                         "--engine", "reference", "--tokens", "stdlib", "--llama-python", "--threads", "2",
                         "--out", str(out)])
    assert rc == 0
    res = {r["metric"]: r["samples"][0] for r in _records(out) if "metric" in r}
    assert res["reference_agreement_kl"] > 1e-2 or res["reference_agreement_top1"] < 0.9, res
    assert not agreement.verdict(res["reference_agreement_top1"], res["reference_agreement_kl"], 2048)[0]


def test_child_failures_become_skips_with_their_reason(tmp_path):
    out = tmp_path / "r.jsonl"
    # a llama_logits that cannot load the model: both rows skipped with why, the child goes on
    fake = tmp_path / "llama_logits"
    fake.write_text("#!/bin/sh\necho 'llama_logits: llama.cpp could not load the model' >&2\nexit 3\n")
    fake.chmod(0o755)
    rc = agreement.main(["--model", str(DEFAULT_MODEL), "--label", "default", "--rows", "0:8",
                         "--engine", "reference", "--llama-logits", str(fake), "--workdir", str(tmp_path / "w"),
                         "--out", str(out)])
    assert rc == 0
    skips = [r for r in _records(out) if "skip" in r]
    assert {s["skip"]["metric"] for s in skips} == set(agreement.REFERENCE_METRICS)
    assert all("llama_logits ended after 0 of 16 bytes" in s["reason"] and "exit 3" in s["reason"] for s in skips)
    with pytest.raises(SystemExit):
        agreement.main(["--model", str(tmp_path / "none.gguf"), "--label", "x", "--rows", "0:8",
                        "--llama-python", "--out", str(out)])
    with pytest.raises(SystemExit):
        agreement.main(["--model", str(DEFAULT_MODEL), "--label", "x", "--rows", "0:0", "--llama-python",
                        "--out", str(out)])


# --- runner and report -----------------------------------------------------------------------------

def test_the_runner_plans_and_groups_the_rows():
    full, quick = runner.Settings(), runner.Settings.quick_run()
    assert ("q27b", 30720, 2048) in full.agreement and all(p >= 2000 for _, _, p in full.agreement)
    assert {lb for lb, _, _ in full.agreement} == {"q27b", "default"}
    # the default model's context is 4,096: its deep row ends at its last position
    assert max(d + p for lb, d, p in full.agreement + quick.agreement if lb == "default") == 4096
    assert all(p < 2000 for _, _, p in quick.agreement)
    planned, _ = runner.plan(full)
    rows = [r for r in planned if r[0] in agreement.METRICS]
    assert len(rows) == 2 * len(full.agreement) and rows == runner.agreement_rows(full)
    # the floor rows: the default model's rows again, the numpy reference in our engine's place
    floor = [r for r in planned if r[0] in agreement.REFERENCE_METRICS]
    assert floor == runner.reference_agreement_rows(full)
    assert [(r[2]["depth"], r[2]["positions"]) for r in floor[::2]] == [(d, p) for lb, d, p in full.agreement
                                                                         if lb == "default"]
    assert all(r[2]["model"] == "default" for r in floor)
    rows = rows + floor
    run = runner.Run(settings=full, store=None, model=Path("m.gguf"), cache=Path("."), deadline=None,
                     session="s", arch="90")
    g = {name: (need, rows_) for name, need, rows_, _ in runner.groups(run)}
    assert g["agreement"][1] == rows and g["agreement"][0] > 0
    assert runner.selected("agreement", ("agreement",))
    run.no_peer = True
    assert "agreement" not in {name for name, *_ in runner.groups(run)}


def test_the_group_runs_a_child_per_model_for_the_rows_missing(monkeypatch, tmp_path):
    """group_agreement: llama_logits compiled against the peer's libllama, then one child per model
    (the bench model with random ids, the default model with text) for the rows not yet stored."""
    from openjet_plugin.bench.store import Store

    s = runner.Settings.quick_run()
    store = Store(tmp_path / "run", {"x": 1})
    done = agreement.row_params("default", 0, 256)
    for m in agreement.METRICS:
        store.add(m, "openjet", done, report.METRICS[m][0], [0.5], "earlier")
    pb = peer.PeerBuild(tmp_path / "llama.cpp-x")
    run = runner.Run(settings=s, store=store, model=tmp_path / "q27b.gguf", cache=tmp_path, deadline=None,
                     session="s", arch="90", peer_build=pb)
    compiled, children = [], []
    monkeypatch.setattr(runner, "_peer_binary", lambda r: pb.binary)
    monkeypatch.setattr(runner.peer, "llama_include_dirs", lambda src: [src / "include"])
    monkeypatch.setattr(runner.peer, "compile_llama_logits",
                        lambda src, out, inc, lib: compiled.append((src, out, lib)) or out)
    monkeypatch.setattr(runner, "_run_child", lambda r, tag, cmd, rows: children.append((tag, cmd, rows)) or set())
    runner.group_agreement(run)
    assert compiled == [(agreement.LLAMA_LOGITS_SRC, pb.root / "llama_logits", pb.lib_dir)]
    (tag_q, cmd_q, rows_q), (tag_d, cmd_d, rows_d), (tag_r, cmd_r, rows_r) = children
    arg = lambda cmd, flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert tag_q == "agreement-q27b" and arg(cmd_q, "--model") == str(tmp_path / "q27b.gguf")
    assert arg(cmd_q, "--rows") == "4096:256" and arg(cmd_q, "--tokens") == "random"
    assert arg(cmd_d, "--model") == str(runner.accept_model()) and arg(cmd_d, "--tokens") == "stdlib"
    assert arg(cmd_d, "--rows") == "3840:256"          # depth 0 is stored already
    assert all("--require-gpu" in c and arg(c, "--llama-logits") == str(pb.root / "llama_logits")
               for c in (cmd_q, cmd_d))
    assert rows_d == [(m, "openjet", agreement.row_params("default", 3840, 256)) for m in agreement.METRICS]
    assert len(rows_q) == 2 and tag_d == "agreement-default"
    assert arg(cmd_q, "--engine") == arg(cmd_d, "--engine") == "native"
    # then the floor: the numpy reference against the same llama.cpp on the default model's rows
    # (none stored yet: both), never on the bench model
    assert tag_r == "agreement-default-reference" and arg(cmd_r, "--engine") == "reference"
    assert arg(cmd_r, "--model") == str(runner.accept_model()) and arg(cmd_r, "--rows") == "0:256,3840:256"
    assert "--require-gpu" in cmd_r and arg(cmd_r, "--tokens") == "stdlib"
    assert rows_r == [(m, "openjet", agreement.row_params("default", d, 256))
                      for d in (0, 3840) for m in agreement.REFERENCE_METRICS]
    # with every row stored, no child at all
    for r in rows_q + rows_d + rows_r:
        store.add(r[0], r[1], r[2], report.METRICS[r[0]][0], [0.5], "earlier")
    children.clear()
    runner.group_agreement(run)
    assert children == []


def _report(results: list[dict], not_measured: list[dict], details: dict) -> dict:
    rep = {"manifest": {"not_measured": not_measured, "pending": [], "info": {report.DETAILS_KEY: details}},
           "results": results}
    report.validate_report(rep)
    return rep


def test_the_report_section_gives_thresholds_and_pass_or_fail():
    rows = [("q27b", 30720, 2048, 0.995, 4e-4), ("default", 0, 2048, 0.97, 2e-3)]
    results, details = [], {}
    for label, d, p, top1, kl in rows:
        params = agreement.row_params(label, d, p)
        results += [report.result("agreement_top1", "openjet", params, [top1]),
                    report.result("agreement_kl", "openjet", params, [kl])]
        details[report.row_key("agreement_top1", "openjet", params)] = {
            "positions": p, "disagreements": 10, "near_tie_disagreements": 7, "tokens": "random ids, seed 0"}
        details[report.row_key("agreement_kl", "openjet", params)] = {"kl_mean": kl, "kl_p99": 3e-3, "kl_max": 0.02,
                                                                       "rel_l2": 1e-2}
    gone = agreement.row_params("default", 2048, 2048)
    not_measured = [{"metric": m, "engine": "openjet", "params": gone, "reason": "agreement failed: boom"}
                    for m in agreement.METRICS]
    plain = report.markdown(_report(results, not_measured, details))
    assert "numpy reference" not in plain   # no floor rows, no floor text
    # the floor rows: the numpy reference at default 0 measured, at default 2,048 not
    floor = agreement.row_params("default", 0, 2048)
    results += [report.result("reference_agreement_top1", "openjet", floor, [0.975]),
                report.result("reference_agreement_kl", "openjet", floor, [1.9e-3])]
    details[report.row_key("reference_agreement_top1", "openjet", floor)] = {
        "positions": 2048, "disagreements": 51, "near_tie_disagreements": 40, "tokens": "stdlib"}
    not_measured += [{"metric": m, "engine": "openjet", "params": gone, "reason": "agreement failed: boom"}
                     for m in agreement.REFERENCE_METRICS]
    md = report.markdown(_report(results, not_measured, details))
    section = md.split("## Agreement with llama.cpp")[1]
    assert "top-1 >= 0.99" in section and "mean KL <= 0.001" in section and ">= 2,000 positions" in section
    assert "numpy reference" in section and "no activation rounding" in section
    lines = [ln for ln in section.splitlines() if ln.startswith("| q27b") or ln.startswith("| default")]
    assert lines[0].startswith("| default | 0 | 2,048 | 0.9700 | 2.00e-03 | 3.00e-03 | 2.00e-02 | 10 (7) ")
    assert lines[0].endswith("| fail: top-1 0.9700 < 0.99; mean KL 2.00e-03 > 0.001 |")
    # the floor under its row, no pass / fail of its own: where an exact computation lands
    assert lines[1].startswith("| default, numpy reference | 0 | 2,048 | 0.9750 | 1.90e-03 |") and "51 (40)" in lines[1]
    assert lines[1].endswith("| the floor: top-1 0.9750 < 0.99; mean KL 1.90e-03 > 0.001 |")
    assert lines[2].startswith("| default | 2,048 | 2,048 | not measured (1)") and "fail (not measured)" in lines[2]
    assert lines[3].startswith("| default, numpy reference | 2,048 | 2,048 | not measured (1)")
    assert "fail" not in lines[3]
    assert lines[4].startswith("| q27b | 30,720 | 2,048 | 0.9950 | 4.00e-04 |") and lines[4].endswith("| **pass** |")
    assert len(lines) == 5   # no floor row for the q27b: none planned or measured
    # the rows live in their section, not in the main table
    main_table = md.split("\n## ")[0]
    assert "agreement_top1" not in main_table and "agreement_kl" not in main_table


# --- GPU: the native engine ------------------------------------------------------------------------

def _device_llama(tmp_path: Path) -> list[str]:
    """llama.cpp on the GPU machine: llama-cpp-python where it is installed, else llama_logits
    compiled against a finished peer build in the bench cache (scripts/gpu.sh bench / session)."""
    if _have_llama_cpp():
        return ["--llama-python"]
    cache = Path(os.environ.get("OPENJET_CACHE_DIR", REPO / "build" / "cache")) / "bench"
    for root in sorted(cache.glob("llama.cpp-*")):
        pb = peer.PeerBuild(root)
        if pb.ready() and (pb.lib_dir / "libllama.so").exists():
            binary = peer.compile_llama_logits(agreement.LLAMA_LOGITS_SRC, tmp_path / "llama_logits",
                                               peer.llama_include_dirs(pb.llama_src), pb.lib_dir)
            return ["--llama-logits", str(binary)]
    pytest.skip(f"no llama.cpp here: llama-cpp-python is not importable and no finished peer build under {cache}")


@pytest.mark.gpu
def test_native_engine_against_llama_cpp_on_the_default_model(tmp_path):
    """The child as the bench runs it, on the default model: our engine prefilled through
    oj_prefill to depth 3,840, then 256 positions teacher-forced against llama.cpp's."""
    from test_native_gpu import _native_or_skip

    _native_or_skip()
    out = tmp_path / "r.jsonl"
    rc = agreement.main(["--model", str(DEFAULT_MODEL), "--label", "default", "--rows", "0:256,3840:256",
                         "--engine", "native", "--tokens", "stdlib", "--out", str(out), *_device_llama(tmp_path)])
    assert rc == 0
    recs = _records(out)
    assert not any("skip" in r or "error" in r for r in recs), recs
    details = {}
    for r in recs:
        details.update(r.get("info", {}).get(report.DETAILS_KEY, {}))
    for depth in (0, 3840):
        params = agreement.row_params("default", depth, 256)
        d = details[report.row_key("agreement_top1", "openjet", params)]
        k = details[report.row_key("agreement_kl", "openjet", params)]
        assert d["ours"]["engine"] == "native" and d["finite"]
        assert d["ours"]["prefilled_by_oj_prefill"] == depth
        # against llama.cpp's CPU build (other roundings than its CUDA build, which the bench rows
        # compare with): the bound of the reference's CPU test, not issue 25's bar
        assert d["top1"] >= 0.95 and k["kl_mean"] < 3e-3, (d, k)
