"""Install llama-cpp-python built for this host: `python -m openjet_plugin.setup_llama`.

llama-cpp-python ships as a source distribution, and its default build (`GGML_NATIVE`: the
compiler's -march=native) uses every instruction set the processor *advertises*. On a VM that
advertises AMX without running it, the first decode dies with SIGILL. So the build options come
from instruction sets this host was seen to execute (cpu_features.py), never from -march=native,
and llama.cpp gets CUDA where a CUDA toolkit and a GPU are both present (for the local GPU's
architecture only), so the fallback backend runs on the GPU there.

The wheel is built once per configuration into `.cache/llama-cpp-python/<key>/` beside the
checkout, without pip's cache: pip keys its cache by the source archive alone, so a wheel cached
from another configuration (say, -march=native) would silently come back. The installed
configuration is recorded in the environment (`<prefix>/openjet-llama-cpp.json`); a matching one
does nothing.

`CMAKE_ARGS` from the environment (llama-cpp-python's documented knob) are appended last, so a
user's own choice wins and is part of the key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from . import cpu_features
from .build_native import find_nvcc, heartbeat, local_gpu_archs

VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
WHEEL_ROOT = ROOT / ".cache" / "llama-cpp-python"
RECORD = Path(sys.prefix) / "openjet-llama-cpp.json"
# Only the library the package loads: the multimodal (mtmd) library and llama.cpp's programs are
# not used by this project and take most of the build time on a small machine.
BASE_ARGS = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]


def build_config() -> dict:
    """What the build will be: CPU options, CUDA or not, and why."""
    verdicts = cpu_features.host_verdicts()
    cpu = [n for n, v in verdicts.items() if v.usable and n in cpu_features.BUILD_FEATURES]
    args = BASE_ARGS + cpu_features.ggml_cmake_args(verdicts)
    nvcc, archs = find_nvcc(), local_gpu_archs()
    if nvcc and archs:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}",
                 f"-DCMAKE_CUDA_COMPILER={nvcc}"]
        gpu = f"CUDA for sm_{', sm_'.join(archs)} ({nvcc})"
    else:
        gpu = "CPU only (" + ("no GPU visible" if nvcc else "no CUDA toolkit (nvcc)") + ")"
    user = shlex.split(os.environ.get("CMAKE_ARGS", ""))
    args += user
    key = hashlib.sha256(" ".join([VERSION, *args]).encode()).hexdigest()[:12]
    return {"version": VERSION, "cmake_args": args, "key": key, "cpu": cpu, "gpu": gpu,
            "user_cmake_args": user}


def installed_record() -> dict | None:
    try:
        return json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return None


def _installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def _run_logged(cmd: list[str], env: dict, log: Path, what: str) -> int:
    """Run cmd with its output in `log`, showing progress every 30 s."""
    with heartbeat(what), log.open("w") as fh:
        return subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode


def ensure(force: bool = False) -> int:
    cfg = build_config()
    rec = installed_record()
    if not force and rec and rec.get("key") == cfg["key"] and _installed_version() == VERSION:
        print(f"openjet setup: llama-cpp-python {VERSION} ({cfg['gpu']}) is installed", flush=True)
        return 0
    wheel_dir = WHEEL_ROOT / cfg["key"]
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    print(f"openjet setup: llama-cpp-python {VERSION}: {cfg['gpu']}; CPU: {', '.join(cfg['cpu']) or 'baseline x86-64'}",
          flush=True)
    if not wheels or force:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CMAKE_ARGS": " ".join(cfg["cmake_args"]),
               "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))}
        log = wheel_dir / "build.log"
        print(f"  building it from source (a few minutes; {'CUDA builds take longer' if 'CUDA' in cfg['gpu'] else 'once per configuration'})",
              flush=True)
        rc = _run_logged([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q",
                                 "-w", str(wheel_dir), f"llama-cpp-python=={VERSION}"], env, log, "llama-cpp-python build")
        if rc != 0:
            tail = log.read_text(errors="replace").splitlines()[-30:]
            print("\n".join(tail), file=sys.stderr)
            print(f"openjet setup: building llama-cpp-python failed (full log: {log})", file=sys.stderr)
            return 1
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
        if not wheels:
            print(f"openjet setup: pip reported success but left no wheel in {wheel_dir}", file=sys.stderr)
            return 1
    rc = subprocess.run([sys.executable, "-m", "pip", "install", "-qq", "--no-deps", "--force-reinstall",
                         str(wheels[-1])]).returncode
    if rc != 0:
        return rc
    RECORD.write_text(json.dumps(cfg, indent=1))
    print(f"openjet setup: installed {wheels[-1].name} ({cfg['key']})", flush=True)
    return 0


def install_package(spec: str) -> int:
    """`pip install -e spec` with its output in a log (shown only if it fails) and progress lines."""
    log = ROOT / ".cache" / "pip-install.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"openjet setup: installing {spec} and its dependencies (a few minutes the first time)", flush=True)
    rc = _run_logged([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-e", spec],
                     dict(os.environ), log, "pip install")
    if rc != 0:
        print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
        print(f"openjet setup: pip install failed (full log: {log})", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even when a matching wheel exists")
    ap.add_argument("--show", action="store_true", help="print the configuration and exit")
    ap.add_argument("--package", metavar="SPEC",
                    help="then pip install -e SPEC (e.g. '.[test]'), which finds llama-cpp-python installed")
    args = ap.parse_args(argv)
    if args.show:
        print(json.dumps(build_config(), indent=1))
        return 0
    rc = ensure(force=args.force)
    if rc == 0 and args.package:
        rc = install_package(args.package)
    return rc


if __name__ == "__main__":
    sys.exit(main())
