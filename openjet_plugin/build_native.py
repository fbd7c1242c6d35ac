"""Build the native CUDA engine: `python -m openjet_plugin.build_native`.

Compiles `native/*.cu` with nvcc into `openjet_plugin/native/libopenjet.so` and copies
`native/openjet.h` beside it (the cffi binding reads that copy when the package is installed).

Architectures: the environment variable `OPENJET_CUDA_ARCHS` (e.g. "90" or "86;89;90;120"); by
default the local GPU's compute capability (nvidia-smi). With no GPU visible and no architecture
asked for, the command builds nothing and says how to force it: a library for a GPU this machine
does not have only costs minutes (tests/test_native_build.py compile-checks sm_90 in CI).
Without nvcc this prints why and exits 0, so that installation still succeeds and the engine
falls back to llama.cpp. `--if-stale` keeps a library built from the same sources for the same
architectures.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
NATIVE_SRC = PACKAGE_DIR.parent / "native"
OUT_DIR = PACKAGE_DIR / "native"
LIB_NAME = "libopenjet.so"
DEFAULT_ARCHS = ("86", "89", "90", "120")
ARCH_ENV = "OPENJET_CUDA_ARCHS"


def find_nvcc() -> str | None:
    """nvcc on PATH, else under CUDA_HOME / CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def parse_archs(text: str) -> list[str]:
    """'86;89, 90 sm_120' -> ['86', '89', '90', '120']; raises ValueError naming a bad entry."""
    archs = []
    for item in re.split(r"[;,\s]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(\d{2,3})([af]?)", item)
        if not m:
            raise ValueError(f"{ARCH_ENV}: {item!r} is not a CUDA architecture like 90 or sm_90")
        archs.append(m.group(1) + m.group(2))
    if not archs:
        raise ValueError(f"{ARCH_ENV} is set but names no architecture")
    return archs


def local_gpu_archs() -> list[str]:
    """Compute capabilities of the visible GPUs (nvidia-smi), e.g. ['90']; [] when none."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    archs = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if re.fullmatch(r"\d+\.\d+", line):
            major, minor = line.split(".")
            arch = major + minor
            if arch not in archs:
                archs.append(arch)
    return archs


@contextmanager
def heartbeat(what: str, every: float = 30.0):
    """Print `what` with the elapsed time every `every` seconds while the block runs, and once
    at the end: long set-up steps show they are alive without printing their whole output."""
    start, done = time.monotonic(), threading.Event()

    def tick():
        while not done.wait(every):
            print(f"  ... {what}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    threading.Thread(target=tick, daemon=True).start()
    try:
        yield
    finally:
        done.set()
        print(f"  {what}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def choose_archs() -> tuple[list[str], str]:
    env = os.environ.get(ARCH_ENV)
    if env:
        return parse_archs(env), f"from {ARCH_ENV}"
    local = local_gpu_archs()
    if local:
        return local, "the local GPU's compute capability"
    return list(DEFAULT_ARCHS), "default (no GPU visible)"


def sources() -> list[Path]:
    return sorted(NATIVE_SRC.glob("*.cu"))


def sources_digest() -> str:
    """sha256 over the native sources (names and bytes): what a built library was built from."""
    h = hashlib.sha256()
    for p in sorted(list(NATIVE_SRC.glob("*.cu")) + list(NATIVE_SRC.glob("*.cuh")) + list(NATIVE_SRC.glob("*.h"))):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def stamp_path(out_dir: Path = OUT_DIR) -> Path:
    return out_dir / (LIB_NAME + ".sources")


def _stamp_text(archs: list[str]) -> str:
    return f"{sources_digest()} sm_{','.join(archs)}"


def is_current(out_dir: Path = OUT_DIR, archs: list[str] | None = None) -> bool:
    """True when the library exists and was built from the current sources (for `archs`, when
    given; else for whatever architectures it was built)."""
    stamp = stamp_path(out_dir)
    if not ((out_dir / LIB_NAME).is_file() and stamp.is_file()):
        return False
    text = stamp.read_text().strip()
    return text == _stamp_text(archs) if archs else text.split(" ")[0] == sources_digest()


def nvcc_flags(archs: list[str]) -> list[str]:
    flags = ["-Xcompiler", "-fPIC", "-O3", "-std=c++17", "-lineinfo", "--threads", "0", "-I", str(NATIVE_SRC)]
    for a in archs:
        # cc 9.0 (H100 / H200) gets the arch-specific sm_90a code: gemm_wgmma.cuh's wgmma / TMA
        # kernels exist only there (sm_90a code runs on every cc 9.0 GPU, and nowhere else)
        v = "90a" if a == "90" else a
        flags += ["-gencode", f"arch=compute_{v},code=sm_{v}"]
    # PTX of the newest architecture too, so a newer GPU can still JIT the kernels
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


def compile_commands(nvcc: str, archs: list[str], obj_dir: Path) -> list[tuple[Path, list[str]]]:
    """One `nvcc -c` per source (run side by side: the files take minutes each for four
    architectures), then build() links the objects."""
    return [(obj_dir / (src.stem + ".o"), [nvcc, "-c", *nvcc_flags(archs), "-o", str(obj_dir / (src.stem + ".o")), str(src)])
            for src in sources()]


def link_command(nvcc: str, archs: list[str], objects: list[Path], output: Path) -> list[str]:
    return [nvcc, "-shared", *nvcc_flags(archs), "-o", str(output), *[str(o) for o in objects]]


def build(out_dir: Path = OUT_DIR, archs: list[str] | None = None, verbose: bool = True) -> Path | None:
    """Build the library; return its path, or None (with the reason printed) when nvcc is absent.

    Raises RuntimeError when nvcc is present but compilation fails (broken code must be loud).
    """
    nvcc = find_nvcc()
    if nvcc is None:
        print("openjet build_native: nvcc not found (no CUDA toolkit); skipping the native engine, "
              "the llama.cpp backend will be used", file=sys.stderr)
        return None
    if not sources():
        raise RuntimeError(f"no CUDA sources under {NATIVE_SRC}")
    how = "given"
    if archs is None:
        archs, how = choose_archs()
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / LIB_NAME
    tmp = out_dir / (LIB_NAME + ".tmp")
    obj_dir = out_dir / (LIB_NAME + ".objects")
    shutil.rmtree(obj_dir, ignore_errors=True)
    obj_dir.mkdir(parents=True)
    jobs = compile_commands(nvcc, archs, obj_dir)
    if verbose:
        print(f"openjet build_native: compiling {len(jobs)} CUDA sources for sm_{', sm_'.join(archs)} ({how}); "
              "a few minutes", file=sys.stderr, flush=True)
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with heartbeat("compiling CUDA") if verbose else nullcontext():
        with ThreadPoolExecutor(max_workers=workers) as pool:
            procs = list(pool.map(lambda job: subprocess.run(job[1], capture_output=True, text=True), jobs))
    failed = [(job, p) for job, p in zip(jobs, procs) if p.returncode != 0]
    if not failed:
        link = link_command(nvcc, archs, [o for o, _ in jobs], tmp)
        proc = subprocess.run(link, capture_output=True, text=True)
        if proc.returncode != 0:
            failed = [((tmp, link), proc)]
    if failed:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(obj_dir, ignore_errors=True)
        text = "\n".join(f"{Path(job[1][-1]).name}: exit {p.returncode}\n{p.stdout}\n{p.stderr}" for job, p in failed)
        raise RuntimeError(f"nvcc failed:\n{text}")
    shutil.rmtree(obj_dir, ignore_errors=True)
    os.replace(tmp, output)
    shutil.copyfile(NATIVE_SRC / "openjet.h", out_dir / "openjet.h")
    stamp_path(out_dir).write_text(_stamp_text(archs) + "\n")
    if verbose:
        print(f"openjet build_native: wrote {output}", file=sys.stderr)
    return output


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", help=f"override {ARCH_ENV}, e.g. '90' or '86;89;90;120'")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    ap.add_argument("--if-stale", action="store_true",
                    help="do nothing when the library was already built from the current sources")
    args = ap.parse_args(argv)
    try:
        if args.archs:
            archs = parse_archs(args.archs)
        elif os.environ.get(ARCH_ENV) or local_gpu_archs():
            archs, _ = choose_archs()
        else:
            print("openjet build_native: no NVIDIA GPU visible, so the native CUDA engine is not built "
                  "(the llama.cpp backend runs); to build it anyway: "
                  f"{ARCH_ENV}=90 make native  (or '86;89;90;120')", file=sys.stderr)
            return 0
        if args.if_stale and is_current(args.out_dir, archs):
            print(f"openjet build_native: {args.out_dir / LIB_NAME} is current (sm_{', sm_'.join(archs)})", file=sys.stderr)
            return 0
        build(args.out_dir, archs)
    except (RuntimeError, ValueError) as e:
        print(f"openjet build_native: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
