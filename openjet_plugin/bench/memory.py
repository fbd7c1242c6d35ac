"""What serving a model really takes, beside what `openjet info` / `doctor` plan for it (issue 29:
the accounting within 10% of the measured peak).

One measurement runs in a fresh child process (`python -m openjet_plugin.bench.memory`), so
nothing the caller allocated before pollutes it: the child imports everything first, reads its
baseline, loads the engine with `slots` slots of `n_ctx` positions, fills every slot's context
with a prompt of its own (the slots' requests at once, as a server runs them), decodes, and
prints one JSON line:

- `host_bytes`: resident memory growth, peak (VmHWM, reset at the baseline through
  /proc/self/clear_refs) minus the baseline (VmRSS). On the CPU this is what the engine takes:
  weights (mmap'd pages count once read), KV cache, recurrent state, compute buffers.
- `device_bytes` (a GPU present): device memory growth, the least free memory seen
  (cudaMemGetInfo, read every few milliseconds while the engine loads and runs) below the free
  memory after the CUDA context was made. On the GPU this is what the engine takes.
- `planned_bytes`: `cli.serving_memory` for the same model, backend, n_ctx, slots and KV type.

The prefix cache is off in the measurement (prefix_cache_bytes=0): its budget is host memory
beside the plan, reported on its own line, and filled only as prompts recur.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemoryMeasurement:
    backend: str
    slots: int
    n_ctx: int
    planned_bytes: int
    host_bytes: int
    device_bytes: int | None          # None: no GPU (or no way to read its memory) in the child

    @property
    def measured_bytes(self) -> int:
        """What the engine took where it runs: device memory on a GPU, else host memory."""
        return self.device_bytes if self.device_bytes is not None else self.host_bytes

    @property
    def ratio(self) -> float:
        """planned / measured: 1.0 is exact; the issue's target is within 0.9..1.1."""
        return self.planned_bytes / self.measured_bytes


def measure(model: str | os.PathLike[str], *, backend: str, n_ctx: int, slots: int, kv_type: str = "f16",
            n_threads: int | None = None, timeout: float | None = 900.0, env: dict[str, str] | None = None,
            log_path: str | os.PathLike[str] | None = None) -> MemoryMeasurement:
    """Run one measurement in a fresh child process (see the module's docstring). env: the
    child's environment (the bench points llama-cpp-python at its CUDA libllama there);
    log_path: where the child's stderr is appended (default: kept for the error message only)."""
    cmd = [sys.executable, "-m", "openjet_plugin.bench.memory", "--model", os.fspath(model),
           "--backend", backend, "--n-ctx", str(n_ctx), "--slots", str(slots), "--kv-type", kv_type]
    if n_threads is not None:
        cmd += ["--threads", str(n_threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if log_path is not None:
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n{out.stderr}{out.stdout}")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        raise RuntimeError(f"memory measurement failed (exit {out.returncode}): {tail[0][:300]}")
    return MemoryMeasurement(**json.loads(lines[-1]))


# --- the child ---------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class _DeviceFree:
    """The least free device memory seen (cudaMemGetInfo through torch, which makes the primary
    context llama.cpp's CUDA backend and ours share), read every few ms on a thread."""

    def __init__(self):
        import torch

        self._get = torch.cuda.mem_get_info
        self.baseline = self._get()[0]      # after the context exists: its own memory is not counted
        self.least = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            self.least = min(self.least, self._get()[0])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.least = min(self.least, self._get()[0])
        return self.baseline - self.least


def _device_free() -> _DeviceFree | None:
    try:
        import torch
    except ImportError:
        return None
    return _DeviceFree() if torch.cuda.is_available() else None


def _fill(eng, slots: int, n_ctx: int, turns: int = 3) -> None:
    """Every slot's context filled: a conversation each (the slots' requests at once, as a server
    runs them) of `turns` requests, the last one's prompt n_ctx - 2 tokens, each decoding one
    token. Each request leaves a recurrent checkpoint: with turns = MAX_CHECKPOINTS (3) a slot
    holds as many as it ever does. The last request's new tokens end in a whole chunk of n_batch
    (512) positions at the end of the context: llama.cpp's largest graph, the one its compute
    buffer is sized for (the attention scores of a chunk against the whole context)."""
    base = eng.tokenize("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    full = n_ctx - 2
    n_chunk = min(512, n_ctx)
    # the last request evaluates prompt[lengths[-2]:-1] in chunks of n_chunk from its start,
    # then the last token: lengths[-2] is chosen so that the last chunk is whole
    before_last = full - 1 - max(1, (full - 3) // n_chunk) * n_chunk
    lengths = [max(1, before_last * t // (turns - 1)) for t in range(1, turns)] + [full] if turns > 1 else [full]
    prompts = []
    for s in range(slots):
        head = eng.tokenize(f"# conversation {s}\n")      # a prefix of its own: no slot reuses another's
        body = (base * (n_ctx // len(base) + 1))[: full - len(head)]
        prompts.append(head + body)
    errors: list[BaseException] = []
    start = threading.Barrier(slots)

    def run(prompt):
        try:
            start.wait()
            for n in lengths:
                eng.generate(prompt[:n], max_tokens=1, temperature=0)
        except BaseException as exc:      # noqa: BLE001 - re-raised below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _child(args) -> int:
    import openjet_plugin
    from openjet_plugin.cli import serving_memory
    from openjet_plugin.model_file import open_model

    # what load() imports, imported before the baseline: modules are the interpreter's, not the engine's
    import openjet_plugin.backends.select  # noqa: F401
    import openjet_plugin.chat_template  # noqa: F401
    import openjet_plugin.engine  # noqa: F401
    if args.backend == "llama.cpp":
        import openjet_plugin.backends.llama_cpp  # noqa: F401
    with open_model(args.model) as mf:
        plan = serving_memory(mf, args.backend, args.n_ctx, args.slots, args.kv_type, prefix_cache_bytes=0)
    # A first engine on a short context, closed again, takes what a process pays once whatever
    # the engine: the threads llama.cpp and the slots start and their allocator arenas, the
    # interpreter's caches (about 30 MiB on the CPU, none of it the model's or the slots').
    # Its own buffers are given back when it closes (llama.cpp unmaps them, glibc returns large
    # blocks at once).
    with openjet_plugin.load(args.model, backend=args.backend, n_ctx=64, n_slots=args.slots, kv_type=args.kv_type,
                             n_threads=args.threads, prefix_cache_bytes=0) as warm:
        _fill(warm, warm.n_slots, warm.n_ctx, turns=1)
    del warm
    gc.collect()
    device = _device_free()
    base_kib = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")      # VmHWM starts again from the current RSS
    eng = openjet_plugin.load(args.model, backend=args.backend, n_ctx=args.n_ctx, n_slots=args.slots,
                              kv_type=args.kv_type, n_threads=args.threads, prefix_cache_bytes=0)
    try:
        if eng.n_slots != plan.slots:
            raise RuntimeError(f"the engine runs {eng.n_slots} slots, the plan {plan.slots}")
        _fill(eng, eng.n_slots, eng.n_ctx)
        host = (_status_kib("VmHWM") - base_kib) * 1024
        dev = device.stop() if device is not None else None
    finally:
        eng.close()
    print(json.dumps({"backend": eng.backend_name, "slots": plan.slots, "n_ctx": args.n_ctx,
                      "planned_bytes": plan.total, "host_bytes": host, "device_bytes": dev}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", required=True, choices=("native", "llama.cpp"))
    ap.add_argument("--n-ctx", type=int, required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--kv-type", default="f16", choices=("f16", "q8_0"))
    ap.add_argument("--threads", type=int, default=None)
    return _child(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
