"""scripts/persistent_profile.py, the per-phase summary of OJ_PERSISTENT_PROFILE files (written by
native/persistent.cu, one JSON line per launch): sums per label, averages per position count, rates
and floors; a file that is not a profile is refused naming the file and the line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import persistent_profile as pp  # noqa: E402


def _launch(n: int, phases: list, drafts: int | None = None) -> str:
    r = {"n": n, "pos0": 0, "grid": 132, "phases": phases}
    if drafts is not None:
        r["drafts"] = drafts
    return json.dumps(r) + "\n"


def test_sums_per_label_and_averages_per_position_count(tmp_path):
    f = tmp_path / "p.jsonl"
    # two launches at 1 position: ffn.down twice per launch (2 layers), 1 GB each in 1 ms
    one = [["ffn.down", 1_000_000, 1_000_000_000], ["ffn.norm_prep", 5_000, 0], ["ffn.down", 1_000_000, 1_000_000_000]]
    # a verify's launch without the drafts key (files written before oj_cycle), one with -1, and an
    # oj_cycle launch at 5 positions drafting 4: three programs
    cyc = [["ffn.down", 4_000_000, 1_000_000_000], ["draft.head.matvec", 1_000_000, 0]]
    f.write_text(_launch(1, one) + _launch(1, one, -1) + _launch(5, [["ffn.down", 3_000_000, 1_000_000_000]])
                 + _launch(5, cyc, 4))
    s = pp.summarise(pp.read_profile(str(f)), bandwidth_gbs=4000.0)
    assert set(s) == {(1, -1), (5, -1), (5, 4)}
    assert s[1, -1]["launches"] == 2 and s[5, -1]["launches"] == 1 and s[5, 4]["launches"] == 1
    down = next(r for r in s[1, -1]["rows"] if r["label"] == "ffn.down")
    assert down["phases"] == 2 and down["ms"] == pytest.approx(2.0) and down["gb"] == pytest.approx(2.0)
    assert down["gbs"] == pytest.approx(1000.0) and down["floor_ms"] == pytest.approx(0.5)
    assert s[1, -1]["ms"] == pytest.approx(2.005) and s[1, -1]["floor_ms"] == pytest.approx(0.5)
    assert s[5, -1]["rows"][0]["gbs"] == pytest.approx(1000.0 / 3)
    assert s[5, 4]["ms"] == pytest.approx(5.0) and s[5, 4]["rows"][0]["label"] == "ffn.down"


@pytest.mark.parametrize("content, what", [
    ("not json\n", "p.jsonl:1: not a persistent-kernel profile line"),
    (_launch(1, [["x", 1, 0]]) + json.dumps({"n": 1}) + "\n", "p.jsonl:2: not a persistent-kernel profile line"),
    (json.dumps({"n": 1, "phases": [["x", -5, 0]]}) + "\n", "p.jsonl:1:"),
    ("\n", "no launches"),
    (json.dumps({"n": 5, "drafts": "4", "phases": [["x", 1, 0]]}) + "\n", "p.jsonl:1: not a persistent-kernel profile line"),
])
def test_a_file_that_is_not_a_profile_is_refused(tmp_path, content, what):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "persistent_profile.py"), str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and what in r.stderr and "Traceback" not in r.stderr


def test_a_missing_file_is_named(tmp_path):
    f = tmp_path / "none.jsonl"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "persistent_profile.py"), str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and str(f) in r.stderr and "Traceback" not in r.stderr
