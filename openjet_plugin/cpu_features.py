"""Which x86-64 instruction sets this host really runs, decided once per host by executing them.

`/proc/cpuinfo` says what the processor advertises, not what the machine lets a process run: a VM
can advertise AMX (`amx_tile`) while its hypervisor never enabled the tile state, and the first
`tilezero` then dies with SIGILL — in llama.cpp's AMX buffer type, taking the caller down with it.
So every feature llama.cpp may use is probed by executing one of its instructions in a child
process (`python -m openjet_plugin.cpu_features --probe NAME`); a child killed by a signal means
"not usable here" and nothing else is harmed.

The verdicts are cached per host (CPU model, advertised flags, kernel release) in
`~/.cache/openjet/cpu-<key>.json` (`OPENJET_CACHE_DIR` moves it), so the probes run once.
`OPENJET_CPU_UNUSABLE=amx,avx512` forces features off (tests, or a host that misbehaves later).

Used by: setup (`openjet_plugin.setup_llama`: which instruction sets the llama.cpp build may use),
the llama.cpp backend (no AMX buffers where AMX faults) and `openjet doctor` (shows the decision).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# feature -> (the cpuinfo flags that advertise it, machine code of a function that executes it)
# Each function is `void f(void *scratch)` (System V: scratch in rdi, 64-byte aligned, 1 KiB).
_VZEROUPPER_RET = bytes.fromhex("c5f877c3")
PROBES: dict[str, tuple[tuple[str, ...], bytes]] = {
    # vpaddd ymm0, ymm0, ymm0
    "avx2": (("avx2",), bytes.fromhex("c5fdfec0") + _VZEROUPPER_RET),
    # pdep eax, eax, eax
    "bmi2": (("bmi2",), bytes.fromhex("c4e27bf5c0c3")),
    # vfmadd231ps ymm0, ymm0, ymm0
    "fma": (("fma",), bytes.fromhex("c4e27db8c0") + _VZEROUPPER_RET),
    # vcvtph2ps ymm0, xmm0
    "f16c": (("f16c",), bytes.fromhex("c4e27d13c0") + _VZEROUPPER_RET),
    # vpaddd zmm0, zmm0, zmm0
    "avx512": (("avx512f", "avx512bw", "avx512dq", "avx512vl"), bytes.fromhex("62f17d48fec0") + _VZEROUPPER_RET),
    # vpdpbusd zmm0, zmm0, zmm0
    "avx512_vnni": (("avx512_vnni",), bytes.fromhex("62f27d4850c0") + _VZEROUPPER_RET),
    # vpermb zmm0, zmm0, zmm0
    "avx512_vbmi": (("avx512vbmi",), bytes.fromhex("62f27d488dc0") + _VZEROUPPER_RET),
    # vdpbf16ps zmm0, zmm0, zmm0
    "avx512_bf16": (("avx512_bf16",), bytes.fromhex("62f27e4852c0") + _VZEROUPPER_RET),
    # ldtilecfg [rdi]; tilezero tmm0; tdpbssd tmm0, tmm1, tmm2; tilerelease; ret — after the
    # child asked the kernel for the tile state (arch_prctl, in _run_probe)
    "amx": (("amx_tile", "amx_int8", "amx_bf16"),
            bytes.fromhex("c4e27849" "07" "c4e27b49c0" "c4e26b5ec1" "c4e27849c0" "c3")),
}
# What the names above mean to llama.cpp's build (ggml/CMakeLists.txt options).
GGML_OPTIONS = {
    "avx2": ("GGML_AVX", "GGML_AVX2"),
    "bmi2": ("GGML_BMI2",),
    "fma": ("GGML_FMA",),
    "f16c": ("GGML_F16C",),
    "avx512": ("GGML_AVX512",),
    "avx512_vnni": ("GGML_AVX512_VNNI",),
    "avx512_vbmi": ("GGML_AVX512_VBMI",),
    "avx512_bf16": ("GGML_AVX512_BF16",),
    "amx": ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"),
}
FORCE_ENV = "OPENJET_CPU_UNUSABLE"
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


@dataclass(frozen=True)
class FeatureVerdict:
    name: str
    advertised: bool      # every flag in /proc/cpuinfo
    usable: bool          # advertised and its instruction ran in a child process
    why: str

    def line(self) -> str:
        return f"{self.name}: {'usable' if self.usable else 'off'} ({self.why})"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cache_dir() -> Path:
    env = os.environ.get("OPENJET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "openjet"


def host_key() -> str:
    """What the verdicts depend on: the processor, what it advertises, the kernel."""
    text = "\n".join([_cpu_model(), " ".join(sorted(cpu_flags())), platform.release(), platform.machine()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run_probe(name: str, code: bytes) -> None:
    """In the child: execute `code` (PROBES[name]'s). Returns only if the instruction ran."""
    libc = ctypes.CDLL(None, use_errno=True)
    if name == "amx":
        # Linux grants the tile data state per process on request; without it tilezero faults
        # even on a machine that runs AMX (llama.cpp asks the same way)
        rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        if rc != 0:
            raise SystemExit(f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused: errno {ctypes.get_errno()}")
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    scratch = (ctypes.c_uint8 * 1088)()
    base = (ctypes.addressof(scratch) + 63) & ~63
    if name == "amx":
        # the tile configuration: palette 1; tmm0..2 16 rows of 64 bytes
        cfg = (ctypes.c_uint8 * 64).from_address(base)
        cfg[0] = 1
        for t in range(3):
            ctypes.c_uint16.from_address(base + 16 + 2 * t).value = 64
            cfg[48 + t] = 16
    func = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
    func(base)


def probe(name: str, code: bytes | None = None, timeout: float = 30.0) -> tuple[bool, str]:
    """(True, why) when PROBES[name]'s instruction (or `code`) runs in a child process, else
    (False, why not)."""
    code = PROBES[name][1] if code is None else code
    try:
        p = subprocess.run([sys.executable, "-m", "openjet_plugin.cpu_features", "--probe", name, code.hex()],
                           capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONFAULTHANDLER": ""})
    except subprocess.TimeoutExpired:
        return False, f"the probe did not finish in {timeout:.0f} s"
    except OSError as exc:
        return False, f"the probe could not start: {exc}"
    if p.returncode == 0:
        return True, "its instruction ran in a probe process"
    if p.returncode < 0:
        import signal
        try:
            sig = signal.Signals(-p.returncode).name
        except ValueError:
            sig = f"signal {-p.returncode}"
        return False, f"advertised, but its instruction killed a probe process ({sig})"
    last = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
    return False, f"advertised, but the probe failed: {last}"


def _forced_off() -> set[str]:
    return {x.strip().lower() for x in os.environ.get(FORCE_ENV, "").split(",") if x.strip()}


def host_verdicts(refresh: bool = False) -> dict[str, FeatureVerdict]:
    """Every feature's verdict on this host: from the cache, else probed (and cached)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {n: FeatureVerdict(n, False, False, f"not an x86-64 host ({platform.machine()})") for n in PROBES}
    flags = cpu_flags()
    path = _cache_dir() / f"cpu-{host_key()}.json"
    cached: dict = {}
    if not refresh:
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    out: dict[str, FeatureVerdict] = {}
    for name, (needs, _) in PROBES.items():
        advertised = all(f in flags for f in needs)
        if not advertised:
            missing = [f for f in needs if f not in flags]
            out[name] = FeatureVerdict(name, False, False, f"not advertised ({', '.join(missing)} missing)")
            continue
        entry = cached.get(name)
        if isinstance(entry, dict) and isinstance(entry.get("usable"), bool) and isinstance(entry.get("why"), str):
            out[name] = FeatureVerdict(name, True, entry["usable"], entry["why"] + " (cached)")
        else:
            ok, why = probe(name)
            out[name] = FeatureVerdict(name, True, ok, why)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({n: {"usable": v.usable, "why": v.why.removesuffix(" (cached)")}
                                   for n, v in out.items() if v.advertised}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass        # an unwritable cache only means probing again next time
    for name in _forced_off() & set(out):
        v = out[name]
        out[name] = FeatureVerdict(name, v.advertised, False, f"forced off by {FORCE_ENV}")
    return out


def usable(name: str) -> bool:
    return host_verdicts()[name].usable


def amx_faults() -> bool:
    """True where AMX is advertised but does not run: llama.cpp must not use its AMX buffers."""
    v = host_verdicts()["amx"]
    return v.advertised and not v.usable


# The instruction sets the llama.cpp build may use, each only where this host runs it. AVX-512 and
# AMX kernels are left out even where they run: llama.cpp's results move with them (the default
# model's teacher-forced top-1 against the float64 reference fell from >= 0.99 with the AVX2 build
# to 0.987 over 300 positions with AVX-512/VNNI/BF16 on, tests/test_reference.py), and the suite
# validates the fallback's numbers on the AVX2 build. AMX still matters at run time: a wheel built
# elsewhere may carry it (amx_faults, the backend's guard).
BUILD_FEATURES = ("avx2", "bmi2", "fma", "f16c")


def ggml_cmake_args(verdicts: dict[str, FeatureVerdict] | None = None) -> list[str]:
    """llama.cpp build options: BUILD_FEATURES where this host runs them, everything else off
    (no -march=native: the compiler's view of "native" is the advertised set, which is what
    faults)."""
    verdicts = verdicts if verdicts is not None else host_verdicts()
    args = ["-DGGML_NATIVE=OFF"]
    for name, options in GGML_OPTIONS.items():
        v = verdicts.get(name)
        on = bool(v and v.usable) and name in BUILD_FEATURES
        args += [f"-D{o}={'ON' if on else 'OFF'}" for o in options]
    return args


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--probe":
        _run_probe(argv[1], bytes.fromhex(argv[2]))
        return 0
    refresh = "--refresh" in argv
    print("\n".join(v.line() for v in host_verdicts(refresh=refresh).values()))
    print("llama.cpp build options: " + " ".join(ggml_cmake_args()))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
