"""What nvidia-smi says about the GPU: is there one, its state (clocks, power limit, ...), and the
peak device memory used while a measured process runs. Everything here only reads; nothing
changes a clock, a power limit or any other setting of the card.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading

UNAVAILABLE = "unavailable"

# The card's state, read at the start and at the end of a run (names as `nvidia-smi
# --help-query-gpu` lists them).
STATE_FIELDS = (
    "name", "pci.bus_id", "driver_version", "compute_cap", "memory.total", "memory.used",
    "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.limit",
    "power.default_limit", "power.draw", "temperature.gpu", "pstate", "persistence_mode",
    "clocks_event_reasons.active",
)


def _run(cmd: list[str], timeout: float = 20.0) -> tuple[int, str, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, "", f"{cmd[0]}: not found"
    except (OSError, subprocess.SubprocessError) as exc:
        return 1, "", f"{type(exc).__name__}: {exc}"
    return r.returncode, r.stdout, r.stderr


def smi_path() -> str | None:
    return shutil.which("nvidia-smi")


def gpu_presence(index: int = 0) -> tuple[bool, str]:
    """(True, "GPU 0: NVIDIA H200 (UUID: ...)") or (False, why there is no usable GPU)."""
    smi = smi_path()
    if smi is None:
        return False, "nvidia-smi is not on PATH (no NVIDIA driver on this machine)"
    rc, out, err = _run([smi, "-L"])
    if rc != 0:
        msg = (err or out).strip().splitlines()
        return False, f"nvidia-smi failed (exit {rc}): {msg[0] if msg else 'no message'}"
    gpus = [line.strip() for line in out.splitlines() if line.strip().startswith("GPU ")]
    if not gpus:
        return False, "nvidia-smi lists no GPU"
    if index >= len(gpus):
        return False, f"GPU {index} asked for, but nvidia-smi lists {len(gpus)}"
    return True, gpus[index]


def query(fields: tuple[str, ...] = STATE_FIELDS, index: int = 0) -> dict[str, str]:
    """One value per field, as nvidia-smi prints it; a field this driver does not know, or the
    whole query failing, gives "unavailable: <why>" instead of raising."""
    smi = smi_path()
    if smi is None:
        return {f: f"{UNAVAILABLE}: nvidia-smi not on PATH" for f in fields}
    rc, out, err = _run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader", "-i", str(index)])
    if rc == 0:
        values = [v.strip() for v in out.strip().splitlines()[0].split(",")] if out.strip() else []
        if len(values) == len(fields):
            return dict(zip(fields, values))
    # one unknown field fails the whole query: ask one at a time
    result = {}
    for f in fields:
        rc, out, err = _run([smi, f"--query-gpu={f}", "--format=csv,noheader", "-i", str(index)])
        text = out.strip() if rc == 0 else (err or out).strip()
        result[f] = text if rc == 0 and text else f"{UNAVAILABLE}: {text[:120] or f'exit {rc}'}"
    return result


def cuda_driver_version() -> str:
    """The CUDA version the driver supports, from nvidia-smi's banner."""
    smi = smi_path()
    if smi is None:
        return f"{UNAVAILABLE}: nvidia-smi not on PATH"
    rc, out, err = _run([smi])
    m = re.search(r"CUDA Version:\s*([0-9.]+)", out)
    return m.group(1) if rc == 0 and m else f"{UNAVAILABLE}: {(err or out).strip()[:120] or f'exit {rc}'}"


def memory_used_mib(index: int = 0) -> float | None:
    smi = smi_path()
    if smi is None:
        return None
    rc, out, _ = _run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)])
    try:
        return float(out.strip().splitlines()[0]) if rc == 0 else None
    except (ValueError, IndexError):
        return None


class PeakMemory:
    """Device memory in use, read every `interval_ms` while the block runs.

    `peak_gb` is the largest reading minus the reading before the block (so it is what the
    process started inside the block added: its CUDA context, weights, caches and buffers), in
    GB of 1e9 bytes. Only one measured process runs on the GPU at a time, so the difference is
    that process's. Each reading is one `nvidia-smi --query-gpu=memory.used` call (tens of ms),
    not its `-lms` loop, whose output may sit in a pipe buffer.
    """

    def __init__(self, index: int = 0, interval_ms: int = 100):
        self.index = index
        self.interval_ms = interval_ms
        self.baseline_mib: float | None = None
        self.max_mib: float | None = None
        self.readings = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while True:
            v = memory_used_mib(self.index)
            if v is not None:
                self.readings += 1
                self.max_mib = v if self.max_mib is None else max(self.max_mib, v)
            if self._stop.wait(self.interval_ms / 1000.0):
                return

    def __enter__(self) -> "PeakMemory":
        self.baseline_mib = memory_used_mib(self.index)
        if self.baseline_mib is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def peak_gb(self) -> float | None:
        if self.baseline_mib is None or self.max_mib is None:
            return None
        return max(0.0, self.max_mib - self.baseline_mib) * 2 ** 20 / 1e9
