"""The peer: llama.cpp's own `llama-bench`, built with CUDA from the pinned llama-cpp-python sdist.

Both engines run the same GGUF. llama.cpp is built once per machine (cached under the bench cache
folder, keyed by the sdist version and the CUDA architectures), in the background while other
measurements run, and only the `llama-bench` and `llama` (libllama, for native/tools/llama_logits.cpp)
targets.

What each llama-bench invocation measures (tools/llama-bench/llama-bench.cpp):
- `-n 128 -d M`: 128 single-token decode steps appended at depth M; the depth is prefilled once,
  its state saved and restored before every repetition, so every repetition starts at exactly M.
  One sample = 128 tokens / (time of the 128 steps, each followed by a synchronize).
- `-p N -n 0 -d M`: N new tokens appended at depth M in batches of -b, ubatches of -ub.
  One sample = N / time.
- verification-cost equivalent: `-p P -n 0 -d 1024` for P = 1..D+1 with -b, -ub >= P, so the P
  positions go through one llama_decode of one ubatch — the same graph llama.cpp's own speculative
  decoding runs to verify a draft of P - 1 tokens plus the sampled one. (llama-bench asks for the
  logits of the last position only, where verification needs all P; the output head's weights are
  read once either way, so the difference is P - 1 extra columns of one matrix product.)
  llama-batched-bench is not used: it times P parallel sequences, not P positions of one.
Each invocation does one warm-up run per test (llama-bench's default) before the timed repetitions,
and reports every repetition's time in `samples_ns` (its JSON output), which we keep as raw samples.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

PINNED_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{PINNED_VERSION}.tar.gz"
SLIM_NAME = f"llama_cpp_python-{PINNED_VERSION}-slim.tar.gz"
# where the carried sdist is looked for, relative to the repository root (.carry/ is git-ignored)
CARRY_DIR = ".carry"

# Parts of the sdist the llama-bench and llama-server build never reads (documentation, model
# vocabularies, tests, the web UI's sources and the GPU backends we do not build): dropped when
# repacking for the GPU machine.
_SLIM_DROP_DIRS = (
    "docs", "examples", "tests", "docker",                        # llama-cpp-python's own
    "vendor/llama.cpp/docs", "vendor/llama.cpp/models", "vendor/llama.cpp/tests",
    "vendor/llama.cpp/examples", "vendor/llama.cpp/benches", "vendor/llama.cpp/media",
    "vendor/llama.cpp/tools/ui", "vendor/llama.cpp/pocs", "vendor/llama.cpp/.github",
    "vendor/llama.cpp/gguf-py", "vendor/llama.cpp/app", "vendor/llama.cpp/.git",
) + tuple(f"vendor/llama.cpp/ggml/src/ggml-{b}" for b in (
    "sycl", "vulkan", "opencl", "hexagon", "metal", "et", "webgpu", "openvino", "cann", "virtgpu",
    "zdnn", "zendnn", "musa", "hip"))

# ... except what configuring llama-server reads from tools/ui (LLAMA_BUILD_SERVER adds the folder;
# with no UI built or downloaded, these make an empty asset table: scripts/ui-assets.cmake)
_SLIM_KEEP_FILES = tuple(f"vendor/llama.cpp/tools/ui/{f}" for f in (
    "CMakeLists.txt", "sources.cmake", "ui.cpp.in", "ui.h.in"))

# the sdist's own git data: only the commit ids are kept
_LLAMA_HEAD = ".git/modules/vendor/llama.cpp/HEAD"
_KEEP_GIT_FILES = (".git/HEAD", _LLAMA_HEAD)

# One configuration; the cache key includes it, so changing it rebuilds. The server is configured
# for its speculative decoding (peer_spec.py): no web UI, and no download of a prebuilt one (the
# GPU machine reaches no network; tools/ui's CMake files alone make an empty asset table).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# `--archs cpu`: the same build without CUDA, for testing the machinery on a machine without a GPU
CPU_ARCHS = "cpu"


def cmake_options(archs: str) -> list[str]:
    """CMAKE_OPTIONS for these CUDA architectures (or CPU_ARCHS: GGML_CUDA off)."""
    if archs == CPU_ARCHS:
        return [o if o != "-DGGML_CUDA=ON" else "-DGGML_CUDA=OFF" for o in CMAKE_OPTIONS]
    return [*CMAKE_OPTIONS, f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]


# llama-bench, and libllama (with the ggml libraries, shared: llama.cpp's default) for the tools
# that call llama.cpp's C API, e.g. native/tools/llama_logits.cpp (compile_llama_logits).
# llama-bench links libllama anyway; naming `llama` keeps that true should the bench stop needing it.
BUILD_TARGETS = ("llama-bench", "llama")
# llama-server, for llama.cpp's own MTP speculative decoding (peer_spec.py). Built in a second step
# after BUILD_TARGETS: should it fail, llama-bench's rows still run and the spec rows say why.
SERVER_TARGET = "llama-server"


def build_targets(llama_src: Path) -> list[str]:
    """BUILD_TARGETS that the source tree defines (`llama` lives in src/CMakeLists.txt)."""
    cm = llama_src / "src" / "CMakeLists.txt"
    has_lib = cm.is_file() and re.search(r"add_library\(\s*llama\b", cm.read_text(errors="replace"))
    return [t for t in BUILD_TARGETS if t != "llama" or has_lib]


class PeerError(RuntimeError):
    """The peer could not be found, built or run; the message says which step and why."""


# --- the source ------------------------------------------------------------------------------------

def find_sdist(repo_root: Path, explicit: str | os.PathLike[str] | None = None) -> Path:
    """The sdist tarball (slim or full) or an unpacked sdist folder: `explicit`, else
    $OPENJET_LLAMA_SDIST, else `<repo>/.carry/`, else pip's download folder /tmp/sd."""
    candidates: list[Path] = []
    if explicit:
        candidates.append(Path(explicit))
    elif os.environ.get("OPENJET_LLAMA_SDIST"):
        candidates.append(Path(os.environ["OPENJET_LLAMA_SDIST"]))
    else:
        for d in (repo_root / CARRY_DIR, Path("/tmp/sd")):
            candidates += [d / SLIM_NAME, d / SDIST_NAME]
    for c in candidates:
        if c.is_file() or (c.is_dir() and (c / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file()):
            return c
    raise PeerError(
        "the llama-cpp-python sdist was not found (looked at " + ", ".join(str(c) for c in candidates)
        + "); make it with `python -m openjet_plugin.bench.peer pack --out .carry/` on a machine "
        "with pip access, or pass --sdist PATH")


def sdist_version(sdist: Path) -> dict:
    """Version facts from the sdist: llama-cpp-python's version and the vendored ggml version."""
    def read(member_suffix: str) -> str | None:
        if sdist.is_dir():
            p = sdist / member_suffix
            return p.read_text(errors="replace") if p.is_file() else None
        with tarfile.open(sdist) as tf:
            for m in tf.getmembers():
                if m.name.split("/", 1)[-1] == member_suffix:
                    f = tf.extractfile(m)
                    return f.read().decode(errors="replace") if f else None
        return None

    info: dict = {"sdist": sdist.name}
    pkg = read("PKG-INFO") or ""
    m = re.search(r"^Version:\s*(\S+)", pkg, re.M)
    info["llama_cpp_python"] = m.group(1) if m else "unavailable (no PKG-INFO)"
    ggml = read("vendor/llama.cpp/ggml/CMakeLists.txt") or ""
    parts = [re.search(rf"set\(GGML_VERSION_{k}\s+(\d+)\)", ggml) for k in ("MAJOR", "MINOR", "PATCH")]
    info["ggml"] = ".".join(p.group(1) for p in parts) if all(parts) else "unavailable"
    head = (read(_LLAMA_HEAD) or "").strip()
    info["llama_cpp_commit"] = head if re.fullmatch(r"[0-9a-f]{40}", head) else "unavailable"
    return info


def pack_slim(full_sdist: Path, out: Path) -> Path:
    """Repack the sdist without what the llama-bench build never reads (76 MB -> a few MB)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(full_sdist) as src, tarfile.open(tmp, "w:gz", compresslevel=9) as dst:
        for m in src.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if rel not in _SLIM_KEEP_FILES and any(rel == d or rel.startswith(d + "/") for d in _SLIM_DROP_DIRS):
                if not (m.isdir() and any(k.startswith(rel + "/") for k in _SLIM_KEEP_FILES)):
                    continue
            # the git data (38 MB) goes; the vendored llama.cpp's commit id stays (sdist_version)
            if (rel == ".git" or rel.startswith(".git/")) and rel not in _KEEP_GIT_FILES:
                if not (m.isdir() and any(k.startswith(rel + "/") for k in _KEEP_GIT_FILES)):
                    continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    os.replace(tmp, out)
    return out


def download_sdist(dest: Path) -> Path:
    """pip download of the pinned sdist (needs a package index)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={PINNED_VERSION}", "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not (dest / SDIST_NAME).is_file():
        raise PeerError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()[-500:]}")
    return dest / SDIST_NAME


# --- the build --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PeerBuild:
    root: Path             # <cache>/llama.cpp-<version>-sm<archs>-<key>
    @property
    def binary(self) -> Path:
        return self.root / "build" / "bin" / "llama-bench"

    @property
    def ok_marker(self) -> Path:
        return self.root / "BUILD_OK"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    @property
    def lock(self) -> Path:
        return self.root.with_name(self.root.name + ".lock")

    @property
    def lib_dir(self) -> Path:
        """Where the build puts libllama.so and the libggml*.so it needs (llama.cpp's bin/)."""
        return self.root / "build" / "bin"

    @property
    def llama_src(self) -> Path:
        return self.root / "src" / "vendor" / "llama.cpp"

    def ready(self) -> bool:
        return self.ok_marker.is_file() and self.binary.is_file()

    @property
    def server_binary(self) -> Path:
        return self.root / "build" / "bin" / SERVER_TARGET

    @property
    def server_failed_marker(self) -> Path:
        """Written (with the first error) when the build of llama-server failed; BUILD_OK still is."""
        return self.root / "SERVER_FAILED"

    def server_problem(self) -> str | None:
        """None when llama-server is built; else why not (call after ready())."""
        if self.server_binary.is_file():
            return None
        if self.server_failed_marker.is_file():
            return f"llama-server failed to build: {self.server_failed_marker.read_text().strip()}; see {self.log}"
        return f"llama-server is not in the build at {self.root}"


def build_dir(cache: Path, sdist: Path, archs: str) -> PeerBuild:
    key = hashlib.sha256(" ".join((*CMAKE_OPTIONS, SERVER_TARGET, archs, sdist.name)).encode()).hexdigest()[:10]
    return PeerBuild(cache / f"llama.cpp-{PINNED_VERSION}-sm{archs.replace(';', '_')}-{key}")


def build(sdist: Path, pb: PeerBuild, archs: str, jobs: int) -> Path:
    """Unpack, configure and build llama-bench and libllama, then llama-server (its failure is
    recorded in pb.server_failed_marker, not raised); holds pb.lock while building. Idempotent."""
    pb.root.mkdir(parents=True, exist_ok=True)
    with open(pb.lock, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if pb.ready():
            return pb.binary
        src = pb.root / "src"
        if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            shutil.rmtree(src, ignore_errors=True)
            if sdist.is_dir():
                shutil.copytree(sdist, src)
            else:
                tmp = pb.root / "unpack"
                shutil.rmtree(tmp, ignore_errors=True)
                with tarfile.open(sdist) as tf:
                    tf.extractall(tmp, filter="data") if sys.version_info >= (3, 12) else tf.extractall(tmp)
                (top,) = [p for p in tmp.iterdir() if p.is_dir()]
                top.rename(src)
                shutil.rmtree(tmp, ignore_errors=True)
        llama = src / "vendor" / "llama.cpp"
        bdir = pb.root / "build"
        # a source without the server's folders (a slim sdist packed before they were kept) still
        # builds llama-bench: the server is configured off and its absence recorded
        server_failure = server_source_problem(llama)
        configure = ["cmake", "-S", str(llama), "-B", str(bdir), *(
            o if not (server_failure and o == "-DLLAMA_BUILD_SERVER=ON") else "-DLLAMA_BUILD_SERVER=OFF"
            for o in cmake_options(archs))]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        compile_ = ["cmake", "--build", str(bdir), "--target", *build_targets(llama), "-j", str(jobs)]
        # llama.cpp stamps its build with `git rev-parse HEAD` run in its source folder; the slim
        # sdist has no git data, so stop git from walking up into whatever repository holds the
        # cache (it would report that repository's commit as llama.cpp's)
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(pb.root))
        t0 = time.time()
        with open(pb.log, "w") as log:
            for step, cmd in (("configure", configure), ("build", compile_)):
                log.write(f"$ {' '.join(cmd)}\n")
                log.flush()
                r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                if r.returncode != 0:
                    raise PeerError(f"llama.cpp {step} failed (exit {r.returncode}); see {pb.log}")
            log.write(f"built in {time.time() - t0:.0f} s\n")
            if not pb.binary.is_file():
                raise PeerError(f"the build finished but {pb.binary} is missing; see {pb.log}")
            if not server_failure:
                server = ["cmake", "--build", str(bdir), "--target", SERVER_TARGET, "-j", str(jobs)]
                log.write(f"$ {' '.join(server)}\n")
                log.flush()
                start = log.tell()
                r = subprocess.run(server, stdout=log, stderr=subprocess.STDOUT, env=env)
                log.write(f"{SERVER_TARGET}: exit {r.returncode}, {time.time() - t0:.0f} s in all\n")
                if r.returncode != 0 or not pb.server_binary.is_file():
                    log.flush()
                    server_failure = f"exit {r.returncode}: {_first_error(pb.log, start)}"
        pb.server_failed_marker.unlink(missing_ok=True)
        if server_failure:
            pb.server_failed_marker.write_text(server_failure + "\n")
        pb.ok_marker.write_text(f"{time.time() - t0:.0f}\n")
        return pb.binary


def server_source_problem(llama_src: Path) -> str | None:
    """Why llama-server cannot be configured from this source, or None."""
    need = [llama_src / "tools" / d / "CMakeLists.txt" for d in ("server", "ui", "cli")]
    gone = [str(p.parent.relative_to(llama_src)) for p in need if not p.is_file()]
    if gone:
        return (f"{', '.join(gone)} not in the llama.cpp source (repack the slim sdist: "
                "python -m openjet_plugin.bench.peer pack)")
    return None


def llama_include_dirs(llama_src: Path) -> list[Path]:
    """The folders llama.h and the ggml headers it includes live in, in a llama.cpp source tree."""
    dirs = [llama_src / "include", llama_src / "ggml" / "include"]
    for d, header in zip(dirs, ("llama.h", "ggml.h")):
        if not (d / header).is_file():
            raise PeerError(f"{d / header} not found: {llama_src} is not a llama.cpp source tree")
    return dirs


def compile_llama_logits(source: Path, out: Path, include_dirs: list[Path], lib_dir: Path,
                         cxx: str | None = None, timeout: float = 300) -> Path:
    """Compile a tool like native/tools/llama_logits.cpp against the shared libllama in `lib_dir`.

    Links libllama and the ggml libraries directly with an RPATH to `lib_dir` (old-style DT_RPATH,
    which also serves libllama's own dependencies), so the binary runs without LD_LIBRARY_PATH.
    Reuses `out` when it is newer than the source and libllama.so. Raises PeerError with the
    compiler's message.
    """
    source, out, lib_dir = Path(source), Path(out), Path(lib_dir)
    if not source.is_file():
        raise PeerError(f"{source}: source file not found")
    lib = lib_dir / "libllama.so"
    if not lib.exists():
        raise PeerError(f"{lib} not found: build llama.cpp's `llama` target first (see {lib_dir.parent})")
    if out.is_file() and out.stat().st_mtime > max(source.stat().st_mtime, lib.stat().st_mtime):
        return out
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise PeerError("no C++ compiler found (g++, c++, clang++ or $CXX)")
    ggml = [f"-l{n}" for n in ("ggml", "ggml-base") if (lib_dir / f"lib{n}.so").exists()]
    cmd = [cxx, "-O2", "-std=c++17", str(source), "-o", str(out) + ".tmp",
           *(f"-I{d}" for d in include_dirs), f"-L{lib_dir}", "-lllama", *ggml,
           "-Wl,--disable-new-dtags", f"-Wl,-rpath,{lib_dir.resolve()}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerError(f"compiling {source} took longer than {timeout:.0f} s: {' '.join(cmd)}") from None
    if r.returncode != 0:
        raise PeerError(f"compiling {source} failed (exit {r.returncode}): {' '.join(cmd)}\n"
                        f"{r.stderr.strip()[-2000:]}")
    os.replace(str(out) + ".tmp", out)
    return out


def start_background_build(sdist: Path, pb: PeerBuild, archs: str, jobs: int) -> subprocess.Popen | None:
    """Start `build` in a child process (lowered priority) unless the binary is already there."""
    if pb.ready() or build_running(pb):
        return None
    pb.root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "openjet_plugin.bench.peer", "build", "--sdist", str(sdist),
           "--cache", str(pb.root.parent), "--archs", archs, "--jobs", str(jobs)]
    out = open(pb.root / "build-driver.log", "w")
    return subprocess.Popen(["nice", "-n", "10", *cmd] if shutil.which("nice") else cmd,
                            stdout=out, stderr=subprocess.STDOUT)


def _first_error(log: Path, start: int = 0) -> str:
    """The first line of a build log (from byte `start`) that reports an error (what a reader needs first)."""
    if not log.is_file():
        return "no build log"
    with open(log, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if "error" in line.lower() and not line.startswith("$ "):
            detail = " ".join(x.strip() for x in lines[i + 1:i + 4] if x.strip())
            return (line.strip() + " " + detail).strip()[:300]
    return (lines[-1].strip() if lines else "empty build log")[:300]


def build_running(pb: PeerBuild) -> bool:
    """True while another process holds the build lock (e.g. scripts/gpu.sh bench's build)."""
    if not pb.lock.is_file():
        return False
    with open(pb.lock, "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        return False


def wait_for_build(pb: PeerBuild, deadline: float, proc: subprocess.Popen | None = None) -> Path:
    """Block until the build (ours or another process's, which holds pb.lock) is done."""
    while time.time() < deadline:
        if pb.ready():
            return pb.binary
        if proc is not None and proc.poll() is not None and not pb.ready():
            raise PeerError(f"the llama.cpp build failed (exit {proc.returncode}): {_first_error(pb.log)}; "
                            f"see {pb.log}")
        if proc is None and not build_running(pb) and not pb.ready():
            raise PeerError(f"llama-bench is not built at {pb.root} and no build is running: "
                            f"{_first_error(pb.log)}; see {pb.log}")
        time.sleep(1.0)
    raise TimeoutError(f"the llama.cpp build at {pb.root} was not done before the deadline")


# --- running llama-bench ---------------------------------------------------------------------------

# Fields of llama-bench's JSON records (test::get_fields() plus the two sample arrays) that we read.
REQUIRED_FIELDS = ("n_prompt", "n_gen", "n_depth", "n_batch", "n_ubatch", "flash_attn", "type_k",
                   "type_v", "avg_ns", "samples_ns", "samples_ts")


@dataclass(frozen=True)
class PeerTest:
    """One llama-bench test record: which test, and every repetition's time."""
    n_prompt: int
    n_gen: int
    n_depth: int
    n_batch: int
    n_ubatch: int
    samples_ns: tuple[int, ...]
    raw: dict

    @property
    def kind(self) -> str:
        return "pp" if self.n_gen == 0 else "tg" if self.n_prompt == 0 else "pg"

    def tokens_per_second(self) -> list[float]:
        n = self.n_prompt + self.n_gen
        return [1e9 * n / t for t in self.samples_ns]

    def milliseconds(self) -> list[float]:
        return [t / 1e6 for t in self.samples_ns]


def parse_llama_bench_json(text: str, source: str = "llama-bench output") -> list[PeerTest]:
    """Parse `llama-bench -o json` stdout (a JSON array of test objects; see json_printer)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PeerError(f"{source}: not JSON ({exc}); first 200 chars: {text[:200]!r}") from None
    if not isinstance(data, list):
        raise PeerError(f"{source}: expected a JSON array of tests, got {type(data).__name__}")
    tests = []
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise PeerError(f"{source}: test {i} is not an object")
        missing = [f for f in REQUIRED_FIELDS if f not in rec]
        if missing:
            raise PeerError(f"{source}: test {i} lacks field(s) {', '.join(missing)}")
        samples = rec["samples_ns"]
        if not isinstance(samples, list) or not samples or not all(
                isinstance(s, int) and s > 0 for s in samples):
            raise PeerError(f"{source}: test {i} has no positive integer samples_ns ({samples!r})")
        if len(rec["samples_ts"]) != len(samples):
            raise PeerError(f"{source}: test {i}: samples_ts and samples_ns differ in length")
        tests.append(PeerTest(int(rec["n_prompt"]), int(rec["n_gen"]), int(rec["n_depth"]),
                              int(rec["n_batch"]), int(rec["n_ubatch"]), tuple(samples), rec))
    return tests


def bench_command(binary: Path, model: Path, *, n_prompt: list[int] | None = None,
                  n_gen: list[int] | None = None, depths: list[int], reps: int,
                  n_batch: int = 2048, n_ubatch: int = 512) -> list[str]:
    """A llama-bench command line: full offload, flash attention on, f16 KV (its default)."""
    cmd = [str(binary), "-m", str(model), "-o", "json", "-r", str(reps), "-ngl", "999", "-fa", "1",
           "-p", ",".join(str(x) for x in (n_prompt or [0])),
           "-n", ",".join(str(x) for x in (n_gen or [0])),
           "-d", ",".join(str(d) for d in depths), "-b", str(n_batch), "-ub", str(n_ubatch)]
    return cmd


def run_llama_bench(cmd: list[str], timeout: float | None, log_path: Path | None = None) -> list[PeerTest]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"llama-bench ran past the deadline ({timeout:.0f} s): {' '.join(cmd)}") from None
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n--- stderr ---\n{r.stderr[-20000:]}\n--- stdout ---\n{r.stdout}\n")
    if r.returncode != 0:
        raise PeerError(f"llama-bench exited {r.returncode}: {' '.join(cmd)}\n{r.stderr.strip()[-1500:]}")
    return parse_llama_bench_json(r.stdout, f"llama-bench ({' '.join(cmd[3:])})")


# --- CLI: pack / build ------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.bench.peer")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="make the slim sdist to carry to the GPU machine")
    p.add_argument("--sdist", help="the full sdist (default: /tmp/sd/ or pip download)")
    p.add_argument("--out", default=CARRY_DIR, help="output folder (default .carry/)")
    b = sub.add_parser("build", help="build llama-bench with CUDA into the cache")
    b.add_argument("--sdist", required=True)
    b.add_argument("--cache", required=True)
    b.add_argument("--archs", default="90")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            full = Path(args.sdist) if args.sdist else Path("/tmp/sd") / SDIST_NAME
            if not full.is_file():
                full = download_sdist(Path("/tmp/sd"))
            out = pack_slim(full, Path(args.out) / SLIM_NAME)
            print(f"{out} ({out.stat().st_size / 1e6:.1f} MB) from {full}")
        else:
            sdist = Path(args.sdist)
            pb = build_dir(Path(args.cache), sdist, args.archs)
            binary = build(sdist, pb, args.archs, args.jobs)
            print(binary)
    except (PeerError, OSError) as exc:
        print(f"peer: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
