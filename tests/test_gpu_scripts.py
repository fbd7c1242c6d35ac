"""The CPU-testable parts of the GPU-machine scripts.

- scripts/sanitize_summary.py (the table of compute-sanitizer logs) on canned sanitizer and pytest
  output; scripts/sanitize_deadline.py (the pytest plugin that stops starting tests when a tool's
  time budget is spent); scripts/gpu.sh sanitize end to end with a stand-in compute-sanitizer.
- native/tools/llama_logits.cpp compiled against llama-cpp-python's own libllama (CPU) through
  openjet_plugin.bench.peer.compile_llama_logits: its logits equal llama-cpp-python's, and every
  failure exits with its documented code and message.
  (Its streaming and --depth modes, and the agreement rows built on it, are
  tests/test_bench_agreement.py's.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from openjet_plugin.bench import peer

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod          # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


summary = _load_script("sanitize_summary")


# --- sanitizer summary -----------------------------------------------------------------------------

MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
.......                                                                  [100%]
7 passed, 14 deselected in 81.20s (0:01:21)
========= LEAK SUMMARY: 0 bytes leaked in 0 allocations
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at rmsnorm_kernel(const float *, float *, int)+0x2d0 in elementwise.cu:41
=========     by thread (256,0,0) in block (0,0,0)
=========     Address 0x7f0000000400 is out of bounds
========= Invalid __global__ read of size 4 bytes
=========     at rmsnorm_kernel(const float *, float *, int)+0x2d0 in elementwise.cu:41
FAILED tests/test_native_gpu.py::test_teacher_forced_matches_reference[tiny-F32] - AssertionError: x
1 failed, 6 passed, 14 deselected in 90.00s (0:01:30)
========= LEAK SUMMARY: 1024 bytes leaked in 1 allocation
========= ERROR SUMMARY: 3 errors
"""


def test_memcheck_clean_log():
    row = summary.summarize("memcheck", MEMCHECK_CLEAN, rc=0, wall_s=81.2)
    s, t = row.sanitizer, row.tests
    assert (s.errors, s.processes, s.leaked_bytes, s.records) == (0, 1, 0, 0)
    assert (t.passed, t.failed, t.deselected, t.finished) == (7, 0, 14, True)
    assert row.verdict == "clean" and row.clean


def test_memcheck_errors_leaks_and_failed_test():
    row = summary.summarize("memcheck", MEMCHECK_ERRORS, rc=1, wall_s=90)
    assert row.sanitizer.errors == 3 and row.sanitizer.leaked_bytes == 1024 and row.sanitizer.records == 2
    assert row.tests.failed == 1 and row.tests.passed == 6
    assert row.tests.failed_tests == ["tests/test_native_gpu.py::test_teacher_forced_matches_reference[tiny-F32]"]
    assert row.verdict == "3 errors" and not row.clean


def test_error_summaries_of_several_processes_are_summed():
    text = "========= ERROR SUMMARY: 0 errors\n3 passed in 1.00s\n========= ERROR SUMMARY: 1 error\n"
    s = summary.parse_sanitizer(text)
    assert (s.processes, s.errors) == (2, 1)


def test_racecheck_summary_with_and_without_error_summary():
    only_race = ("========= Error: Race reported between Write access at k in a.cu:3\n"
                 "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n")
    s = summary.parse_sanitizer(only_race)
    assert (s.errors, s.hazard_errors, s.hazard_warnings, s.processes) == (1, 1, 2, 1)
    both = ("========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)\n"
            "========= ERROR SUMMARY: 0 errors\n")
    s = summary.parse_sanitizer(both)
    assert (s.errors, s.hazard_warnings) == (0, 2)


def test_unfinished_run_is_never_clean():
    text = ("========= COMPUTE-SANITIZER\n========= Invalid __shared__ write of size 4 bytes\n"
            "========= Uninitialized __global__ memory read of size 4 bytes\n")
    row = summary.summarize("initcheck", text, rc=124, wall_s=300)
    assert row.sanitizer.errors is None and row.sanitizer.records == 2
    assert row.verdict == "unfinished (>= 2 errors)" and not row.clean
    assert summary.summarize("synccheck", "skipped, 10 s left\n", rc=None).verdict == "not run"


def test_pytest_counts_and_budget_skips():
    text = textwrap.dedent("""\
        SKIPPED [2] tests/test_native_gpu.py:170: the sanitizer's time budget for this tool is spent ($X)
        SKIPPED [1] tests/test_native_gpu.py:60: no CUDA GPU
        ERROR tests/test_native_gpu.py::test_native_status_and_memory - RuntimeError
        1 failed, 3 passed, 3 skipped, 1 error, 14 deselected, 2 warnings in 12.5s
        """)
    t = summary.parse_pytest(text)
    assert (t.passed, t.failed, t.errors, t.skipped, t.deselected, t.budget_skipped) == (3, 1, 1, 3, 14, 2)
    assert t.failed_tests == ["tests/test_native_gpu.py::test_native_status_and_memory"]
    assert not summary.parse_pytest("Traceback ...\nKilled\n").finished


def test_summary_cli_table_and_exit_status(tmp_path, capsys):
    (tmp_path / "m.log").write_text(MEMCHECK_CLEAN)
    (tmp_path / "r.log").write_text("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
                                    "========= ERROR SUMMARY: 0 errors\n5 passed, 2 skipped in 3.0s\n")
    md, js = tmp_path / "s.md", tmp_path / "s.json"
    rc = summary.main(["--run", "memcheck", str(tmp_path / "m.log"), "0", "81",
                       "--run", "racecheck", str(tmp_path / "r.log"), "0", "-", "--markdown", str(md),
                       "--json", str(js), "--command", "compute-sanitizer ..."])
    assert rc == 0
    table = md.read_text()
    assert table == capsys.readouterr().out
    assert "| memcheck | 7 (7 / 0) | 0 (0) | 0 | - | 0 | 1 | 81 | 0 | clean |" in table
    assert "| racecheck | 5 (5 / 0) | 2 (0) | 0 | 0 / 0 | - | 1 | - | 0 | clean |" in table
    assert [r["verdict"] for r in json.loads(js.read_text())] == ["clean", "clean"]
    (tmp_path / "e.log").write_text(MEMCHECK_ERRORS)
    assert summary.main(["--run", "memcheck", str(tmp_path / "e.log"), "1", "90"]) == 1
    with pytest.raises(SystemExit):
        summary.main(["--run", "memcheck", str(tmp_path / "e.log"), "one", "90"])
    assert "RC must be an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        summary.main(["--run", "memcheck", str(tmp_path / "missing.log"), "0", "1"])
    assert "missing.log not found" in capsys.readouterr().err


# --- the deadline plugin and gpu.sh sanitize -------------------------------------------------------

def _pytest_with_deadline(tmp_path: Path, deadline: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    env = dict(os.environ, OPENJET_TEST_DEADLINE=deadline,
               PYTHONPATH=os.pathsep.join([str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "sanitize_deadline",
                           "-q", "-rs", "-c", os.devnull, str(tmp_path / "test_two.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_deadline_plugin_skips_tests_once_the_budget_is_spent(tmp_path):
    r = _pytest_with_deadline(tmp_path, "1")           # 1970: long past
    assert r.returncode == 0, r.stdout + r.stderr
    t = summary.parse_pytest(r.stdout)
    assert (t.passed, t.skipped, t.budget_skipped) == (0, 2, 2), r.stdout
    r = _pytest_with_deadline(tmp_path, "99999999999")
    assert summary.parse_pytest(r.stdout).passed == 2, r.stdout
    r = _pytest_with_deadline(tmp_path, "soon")
    assert r.returncode != 0 and "OPENJET_TEST_DEADLINE must be a Unix time" in r.stderr + r.stdout


FAKE_SANITIZER = """#!/usr/bin/env bash
# stands in for compute-sanitizer: runs the program, then prints the summaries the real one does
[ "$1" = --version ] && { echo "fake compute-sanitizer"; exit 0; }
tool=memcheck
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    case $1 in --tool) tool=$2; shift 2;; --leak-check|--target-processes|--print-limit|--show-backtrace) shift 2;;
    *) echo "fake sanitizer: unknown option $1"; exit 9;; esac
done
echo "$tool $*" >>"$FAKE_SANITIZER_CALLS"
"$@"; rc=$?
[ "$tool" = racecheck ] && echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 1 warning)"
[ "$tool" = memcheck ] && echo "========= LEAK SUMMARY: 0 bytes leaked in 0 allocations"
n=0; [ "$tool" = initcheck ] && n=2
echo "========= ERROR SUMMARY: $n errors"
exit $rc
"""


def test_gpu_sanitize_script_with_a_stand_in_sanitizer(tmp_path):
    """The shell glue: budget shares, the tool options, the -k selection, the table in $OUT."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("bash or timeout is missing")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "compute-sanitizer").write_text(FAKE_SANITIZER)
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 9.0, 580.00'\n")
    # python3 = this interpreter, except the native build (nvcc, minutes) and pip (no wheels here)
    (bin_ / "python3").write_text(
        "#!/usr/bin/env bash\n"
        "[ \"$1 $2\" = '-m openjet_plugin.build_native' ] && { echo 'native build skipped'; exit 0; }\n"
        f"exec {sys.executable} \"$@\"\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    calls = tmp_path / "calls"
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", OUT=str(out),
               SANITIZE_BUDGET="300", FAKE_SANITIZER_CALLS=str(calls),
               OPENJET_NATIVE_LIB=str(tmp_path / "no-such-lib.so"))   # the GPU tests skip quickly
    r = subprocess.run(["bash", str(SCRIPTS / "gpu.sh"), "sanitize"], capture_output=True, text=True,
                       env=env, timeout=600)
    table = (out / "sanitize.md").read_text()
    assert r.returncode == 1, r.stdout + r.stderr     # initcheck's 2 errors make the run unclean
    for tool in ("memcheck", "racecheck", "synccheck"):
        assert f"| {tool} | 0 (0 / 0) | 7 (0) | 0 |" in table, table
    assert "| initcheck | 0 (0 / 0) | 7 (0) | 2 |" in table and "| 0 / 1 |" in table
    lines = calls.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == ["memcheck", "racecheck", "synccheck", "initcheck"]
    assert all("tests/test_native_gpu.py" in ln and "sanitize_deadline" in ln for ln in lines)
    assert "out_of_memory" not in calls.read_text() and "kernel_fault" not in calls.read_text()


# --- llama_logits against llama-cpp-python's libllama ----------------------------------------------

def _llama_headers(tmp_root: Path) -> Path | None:
    """A llama.cpp source root holding include/llama.h and ggml/include: $OPENJET_LLAMA_SRC,
    /opt/llama-src/vendor/llama.cpp, or the headers of the sdist carried for the GPU machine."""
    for c in (os.environ.get("OPENJET_LLAMA_SRC"), "/opt/llama-src/vendor/llama.cpp"):
        if c and (Path(c) / "include" / "llama.h").is_file():
            return Path(c)
    for name in (peer.SLIM_NAME, peer.SDIST_NAME):
        sd = REPO / peer.CARRY_DIR / name
        if sd.is_file():
            with tarfile.open(sd) as tf:
                members = [m for m in tf.getmembers() if m.isfile() and any(
                    f"/vendor/llama.cpp/{d}/" in m.name for d in ("include", "ggml/include"))]
                tf.extractall(tmp_root, members=members)
            hits = list(tmp_root.glob("*/vendor/llama.cpp/include/llama.h"))
            if hits:
                return hits[0].parent.parent
    return None


@pytest.fixture(scope="module")
def llama_logits_bin(tmp_path_factory):
    try:
        import llama_cpp
    except Exception as e:   # noqa: BLE001 - any import failure means no CPU libllama here
        pytest.skip(f"llama-cpp-python is not importable ({e})")
    if llama_cpp.__version__ != peer.PINNED_VERSION:
        pytest.skip(f"llama-cpp-python {llama_cpp.__version__} is installed; the headers are "
                    f"{peer.PINNED_VERSION}'s")
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")) and not os.environ.get("CXX"):
        pytest.skip("no C++ compiler (g++, c++, clang++ or $CXX)")
    root = tmp_path_factory.mktemp("llama_logits")
    src = _llama_headers(root / "headers")
    if src is None:
        pytest.skip("llama.cpp headers not found ($OPENJET_LLAMA_SRC, /opt/llama-src or the .carry sdist)")
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    out = root / "llama_logits"
    peer.compile_llama_logits(REPO / "native" / "tools" / "llama_logits.cpp", out,
                              peer.llama_include_dirs(src), lib_dir)
    mtime = out.stat().st_mtime_ns
    peer.compile_llama_logits(REPO / "native" / "tools" / "llama_logits.cpp", out,
                              peer.llama_include_dirs(src), lib_dir)
    assert out.stat().st_mtime_ns == mtime, "an up-to-date binary was compiled again"
    return out


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=300)


def test_llama_logits_equal_llama_cpp_python(llama_logits_bin, synth_path, tmp_path):
    from openjet_plugin.testing import llama_ref

    model = synth_path("tiny", "F32")
    tokens = np.random.default_rng(11).integers(0, 4096, 21).astype("<i4")   # 21: a short last batch
    tokens.tofile(tmp_path / "t.i32")
    r = _run(llama_logits_bin, "-m", str(model), "-t", str(tmp_path / "t.i32"), "-o", str(tmp_path / "l.f32"),
             "-b", "8", "--threads", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout)
    assert (info["n_pos"], info["n_vocab"], info["n_batch"], info["flash_attn"]) == (21, 4096, 8, True)
    assert info["gpu_offload"] is False and info["decode_s"] > 0
    got = np.fromfile(tmp_path / "l.f32", dtype="<f4").reshape(21, 4096)
    want = llama_ref.llama_logits(model, tokens.tolist(), flash_attn=True, n_batch=8)
    assert np.isfinite(got).all()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert not (tmp_path / "l.f32.tmp").exists()


def test_llama_logits_failures_exit_with_their_codes(llama_logits_bin, synth_path, tmp_path):
    model = synth_path("tiny", "F32")
    ok_tokens = tmp_path / "ok.i32"
    np.array([1, 2, 3], dtype="<i4").tofile(ok_tokens)
    out = tmp_path / "o.f32"
    r = _run(llama_logits_bin, "-m", str(model), "-t", str(ok_tokens))
    assert r.returncode == 1 and "-m, -t and -o are required" in r.stderr
    r = _run(llama_logits_bin, "-m", str(model), "-t", str(ok_tokens), "-o", str(out), "-b", "0")
    assert r.returncode == 1 and "-b 0 is not an integer in [1," in r.stderr
    (tmp_path / "odd.i32").write_bytes(b"\x01\x00\x00\x00\x02")
    r = _run(llama_logits_bin, "-m", str(model), "-t", str(tmp_path / "odd.i32"), "-o", str(out))
    assert r.returncode == 2 and "odd.i32 has 5 bytes" in r.stderr
    r = _run(llama_logits_bin, "-m", str(tmp_path / "none.gguf"), "-t", str(ok_tokens), "-o", str(out))
    assert r.returncode == 3 and "none.gguf" in r.stderr
    np.array([1, 4096], dtype="<i4").tofile(tmp_path / "big.i32")
    r = _run(llama_logits_bin, "-m", str(model), "-t", str(tmp_path / "big.i32"), "-o", str(out))
    assert r.returncode == 7 and "token 4096 at position 1" in r.stderr
    r = _run(llama_logits_bin, "-m", str(model), "-t", str(ok_tokens), "-o", str(out), "--require-gpu")
    assert r.returncode == 8 and "cannot offload" in r.stderr
    r = _run(llama_logits_bin, "-m", str(model), "-t", str(ok_tokens), "-o", str(tmp_path / "no" / "dir.f32"))
    assert r.returncode == 6 and "dir.f32.tmp" in r.stderr
    assert not out.exists()


def test_compile_llama_logits_reports_the_compiler_and_missing_library(tmp_path):
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler")
    bad = tmp_path / "bad.cpp"
    bad.write_text("int main() { return undefined_name; }\n")
    lib = tmp_path / "lib"
    lib.mkdir()
    with pytest.raises(peer.PeerError, match="libllama.so not found"):
        peer.compile_llama_logits(bad, tmp_path / "x", [], lib)
    (lib / "libllama.so").write_bytes(b"")
    with pytest.raises(peer.PeerError, match=r"(?s)compiling .*bad.cpp failed .*undefined_name"):
        peer.compile_llama_logits(bad, tmp_path / "x", [], lib)
    assert not (tmp_path / "x").exists()


def test_peer_builds_libllama_when_the_tree_defines_it(tmp_path):
    (tmp_path / "src").mkdir()
    assert peer.build_targets(tmp_path) == ["llama-bench"]
    (tmp_path / "src" / "CMakeLists.txt").write_text("add_library(llama\n    ../include/llama.h)\n")
    assert peer.build_targets(tmp_path) == ["llama-bench", "llama"]
    with pytest.raises(peer.PeerError, match="not a llama.cpp source tree"):
        peer.llama_include_dirs(tmp_path)


def test_every_device_script_parses():
    """A syntax error in a scripts/*.sh or scripts/gpu/*.sh costs a device call; `bash -n` finds it here."""
    scripts = sorted((REPO / "scripts").glob("*.sh")) + sorted((REPO / "scripts" / "gpu").glob("*.sh"))
    assert len(scripts) >= 10
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, f"{s.name}: {r.stderr}"


def test_ab_libs_refuses_a_bad_setting_before_building():
    """scripts/ab_libs.sh (an A/B's libraries of several commits) names a malformed setting or an
    unknown commit and exits 2 before any build."""
    for args, said in ((["base=main", "q6"], "expected NAME=COMMIT, got 'q6'"),
                       (["base=HEAD", "x=no-such-commit-0"], "no commit 'no-such-commit-0'")):
        r = subprocess.run(["bash", "scripts/ab_libs.sh", *args], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and said in r.stdout, (args, r.stdout, r.stderr)


def test_gpu_entry_point_lists_its_commands_and_refuses_an_unknown_one(tmp_path):
    """scripts/gpu.sh: every command it names has its script under scripts/gpu/ (and every script
    there but common.sh, which the others source, is a command); an unknown command exits 2 naming
    the ones there are, and so does `common`."""
    text = (SCRIPTS / "gpu.sh").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("commands="))
    commands = set(line.split('"')[1].split())
    scripts = {p.stem for p in (SCRIPTS / "gpu").glob("*.sh")}
    assert commands == scripts - {"common"}
    for name in ("everything", "common"):
        r = subprocess.run(["bash", str(SCRIPTS / "gpu.sh"), name], capture_output=True, text=True,
                           env={**os.environ, "OUT": str(tmp_path)})
        assert r.returncode == 2 and f"unknown command '{name}'" in r.stdout and "check" in r.stdout
    r = subprocess.run(["bash", str(SCRIPTS / "gpu.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "session" in r.stdout


def test_gpu_scripts_take_the_shared_setup_from_common_sh():
    """The carried-wheel install and the native build are spelled once, in scripts/gpu/common.sh
    (copies of them drift: setup.sh's pip flags once differed from the others'); a script that uses
    its functions sources it."""
    common = SCRIPTS / "gpu" / "common.sh"
    functions = {ln.split("(")[0] for ln in common.read_text().splitlines() if ln.endswith("() {")}
    assert "install_carried_wheels" in functions and "build_native_if_stale" in functions
    for p in sorted((SCRIPTS / "gpu").glob("*.sh")):
        if p == common:
            continue
        text = p.read_text()
        assert "pip install" not in text and "openjet_plugin.build_native" not in text, p.name
        if any(f in text for f in functions):
            assert "\n. scripts/gpu/common.sh\n" in text, f"{p.name} calls common.sh's functions without sourcing it"


def test_the_gpu_check_runs_every_gpu_test_file():
    """scripts/gpu/check.sh's default file list is the whole GPU suite: a file marked gpu that the
    list leaves out never runs on the device (the tree tests were missed that way once)."""
    import re

    text = (REPO / "scripts" / "gpu" / "check.sh").read_text()
    listed = set(re.search(r"\$\{PYTEST_FILES:-([^}]*)\}", text).group(1).split())
    # and the files run alone after them (their tests read the whole device's free memory)
    listed |= set(re.search(r"\$\{PYTEST_SERIAL_FILES-([^}]*)\}", text).group(1).split())
    marked = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
              if re.search(r"pytestmark = pytest\.mark\.gpu|@pytest\.mark\.gpu", p.read_text())}
    assert marked, "no GPU test file found: the pattern is stale"
    assert listed == marked, f"check.sh runs {sorted(listed - marked)} extra, misses {sorted(marked - listed)}"


def test_prefill_piece_summary_totals_an_ncu_log_and_names_a_bad_one(tmp_path, capsys):
    """scripts/prefill_piece.py --summary: per-kernel totals of an `ncu --csv --page raw` log (read by
    phase_breakdown: the units row converted, the program's lines skipped), largest first; a file
    without ncu rows is refused with its name; a piece of no positions or a depth inside the first
    oj_eval is refused before any GPU work."""
    mod = _load_script("prefill_piece")
    cols = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum"'
    log = "\n".join(["==PROF== Connected to process 1", "piece of 64 at depth ~4096: 47.00 ms", cols,
                     '"","","usecond","byte","byte"',
                     '"0","void gemm<2, 64>(Args)","1,500","100","0"',
                     '"1","rms_norm_kernel(float const*)","17.5","10","10"',
                     '"2","void gemm<2, 64>(Args)","500","100","0"'])
    p = tmp_path / "ncu.csv"
    p.write_text(log)
    kernels, total = mod.kernel_totals(p)
    assert kernels[0] == ("void gemm<2, 64>", 2, pytest.approx(2.0))
    assert kernels[1] == ("rms_norm_kernel", 1, pytest.approx(0.0175))
    assert total == pytest.approx(2.0175)
    bad = tmp_path / "empty.csv"
    bad.write_text("==PROF== nothing profiled\n")
    with pytest.raises(ValueError, match="empty.csv"):
        mod.kernel_totals(bad)
    assert mod.main(["--summary", str(bad)]) == 1
    for args, why in ((["m.gguf", "--positions", "0"], "--positions must be >= 1"),
                      (["m.gguf", "--depth", "4"], "--depth 4: the first 8 positions")):
        with pytest.raises(SystemExit):
            mod.main(args)
        assert why in capsys.readouterr().err
