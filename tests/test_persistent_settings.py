"""The persistent kernel's switches (native/persistent_settings.h, read at engine creation) on the
CPU: native/tools/persistent_settings_check.cu, compiled here with nvcc, prints what the environment
gives. Checked: the defaults; every accepted value; a bad value of each switch refused (exit 2) with
the variable and the value in the message; a profile file appended to, never overwritten, and one
that cannot be opened refused naming the path. The GPU side: tests/test_native_persistent_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cuda_tools import build_host_tool

REPO = Path(__file__).resolve().parent.parent
SWITCHES = ("OJ_PERSISTENT", "OJ_PERSISTENT_STAGES", "OJ_PERSISTENT_SPLIT", "OJ_PERSISTENT_PREFETCH",
            "OJ_PERSISTENT_PROFILE")


@pytest.fixture(scope="module")
def exe(tmp_path_factory) -> Path:
    return build_host_tool(tmp_path_factory.mktemp("pss") / "pss", ["native/tools/persistent_settings_check.cu"],
                           "the settings check")


def _run(exe: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    return subprocess.run([str(exe)], capture_output=True, text=True, env={**base, **env}, timeout=60)


def test_defaults(exe):
    r = _run(exe)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"mode": 0, "stages": 2, "split_model": False, "prefetch": False, "profile": ""}


@pytest.mark.parametrize("env, key, want", [
    ({"OJ_PERSISTENT": "0"}, "mode", 0), ({"OJ_PERSISTENT": "1"}, "mode", 1), ({"OJ_PERSISTENT": "require"}, "mode", 2),
    ({"OJ_PERSISTENT_STAGES": "2"}, "stages", 2), ({"OJ_PERSISTENT_STAGES": "3"}, "stages", 3),
    ({"OJ_PERSISTENT_SPLIT": "pick"}, "split_model", False), ({"OJ_PERSISTENT_SPLIT": "model"}, "split_model", True),
    ({"OJ_PERSISTENT_PREFETCH": "0"}, "prefetch", False), ({"OJ_PERSISTENT_PREFETCH": "1"}, "prefetch", True),
])
def test_accepted_values(exe, env, key, want):
    r = _run(exe, **env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[key] == want


@pytest.mark.parametrize("name, bad, expect", [
    ("OJ_PERSISTENT", "yes", "0, 1 or require"), ("OJ_PERSISTENT", "", "0, 1 or require"),
    ("OJ_PERSISTENT_STAGES", "4", "2 or 3"), ("OJ_PERSISTENT_SPLIT", "auto", "pick or model"),
    ("OJ_PERSISTENT_PREFETCH", "on", "0 or 1"),
])
def test_a_bad_value_is_refused_by_name(exe, name, bad, expect):
    r = _run(exe, **{name: bad})
    assert r.returncode == 2 and not r.stdout
    assert f"{name} must be {expect}, not '{bad}'" in r.stderr


def test_the_profile_file_is_appended_to_and_a_bad_path_refused(exe, tmp_path):
    f = tmp_path / "profile.jsonl"
    f.write_text("kept\n")
    r = _run(exe, OJ_PERSISTENT_PROFILE=str(f))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["profile"] == str(f)
    assert f.read_text() == "kept\n"                      # opened for appending: nothing lost
    bad = tmp_path / "missing" / "profile.jsonl"
    r = _run(exe, OJ_PERSISTENT_PROFILE=str(bad))
    assert r.returncode == 2
    assert f"OJ_PERSISTENT_PROFILE: cannot append to '{bad}'" in r.stderr
    r = _run(exe, OJ_PERSISTENT_PROFILE="")
    assert r.returncode == 2 and "(empty path)" in r.stderr
