"""`openjet`: generate, chat, info, doctor, synth, serve, bench.

User errors (a bad parameter, a missing or broken model file, an unavailable backend) print one
line and exit 1; a usage error exits 2 (argparse's convention). No tracebacks for either.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .errors import OpenJetError

# Subcommands another module implements; argv after the name is handed over unchanged.
DELEGATED = {
    "synth": ("openjet_plugin.testing.synth", "synth_main", "generate a qwen35 test model (GGUF)"),
    "serve": ("openjet_plugin.serve", "main", "serve a model over an OpenAI-compatible HTTP API"),
    "bench": ("openjet_plugin.bench", "main", "benchmark decode and prefill (needs the GPU build)"),
}
USER_ERRORS = (OpenJetError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="GGUF file (default: the embedded default model)")
    p.add_argument("--backend", default="auto", choices=["auto", "llama.cpp", "native"],
                   help="auto: native where supported, else llama.cpp (default: auto)")
    p.add_argument("--n-ctx", type=int, default=4096, help="context window in tokens (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for llama.cpp")
    p.add_argument("--draft-depth", type=int, default=4,
                   help="MTP drafts per speculative cycle on the native backend, 0 = off (default 4)")
    p.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"], help="native KV cache type (default f16)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="positions per batched prefill pass on the native backend, 64..4096; "
                        "0 = off, 8 positions per call (default 2048)")


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    """What the memory estimate assumes: the context and slots of `openjet serve`."""
    p.add_argument("--n-ctx", type=int, default=4096, help="context window in tokens, per slot (default 4096)")
    p.add_argument("--slots", type=int, default=None,
                   help="conversations served at once, as `openjet serve --slots` (default 4; the native "
                        "engine holds up to 8)")
    p.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"], help="KV cache type (default f16)")
    p.add_argument("--prefix-cache-mb", default=None, metavar="MB",
                   help="host memory for the prefix cache, as `openjet serve --prefix-cache-mb` (0: none; "
                        "default: 2048 with several slots on llama.cpp, none with one)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
    p.add_argument("--temperature", "-t", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=40, help="0 disables top-k")
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    ap = argparse.ArgumentParser(prog="openjet", description="qwen35 inference: native CUDA engine "
                                 "with MTP speculative decoding, llama.cpp fallback.")
    ap.add_argument("--version", action="version", version=f"openjet-plugin {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="continue a prompt, streaming the text")
    g.add_argument("prompt", help="prompt text ('-' reads stdin)")
    _add_model_args(g)
    _add_sampling_args(g, max_tokens=256)

    c = sub.add_parser("chat", help="interactive chat with the model's own template (/exit to quit)")
    _add_model_args(c)
    _add_sampling_args(c, max_tokens=512)
    c.add_argument("--system", help="system message")
    c.add_argument("--think", action="store_true", help="enable thinking (reasoning) mode")

    i = sub.add_parser("info", help="hyperparameters, tensor types and validation verdict of a GGUF, "
                                    "and the memory serving it takes")
    i.add_argument("model")
    _add_serving_args(i)

    d = sub.add_parser("doctor", help="what this machine can run, and which backend auto picks")
    d.add_argument("--model", "-m", help="GGUF to check against (default: the embedded default)")
    _add_serving_args(d)

    for name, (_, _, help_) in DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in DELEGATED:
            return _delegate(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help(sys.stderr)
            return 2
        return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info,
                "doctor": cmd_doctor}[args.command](args)
    except USER_ERRORS as exc:
        print(f"openjet: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: the engine's context manager has already ended the stream and closed it
        print("\nopenjet: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:       # `openjet generate ... | head`
        return 0


def _delegate(name: str, rest: list[str]) -> int:
    module, func, _ = DELEGATED[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        if name == "bench":
            print("openjet: the benchmark needs the native GPU build (openjet_plugin.bench is not "
                  "installed); see the README's GPU section", file=sys.stderr)
        else:
            print(f"openjet: '{name}' is not available in this installation ({module} is missing)",
                  file=sys.stderr)
        return 2
    rc = getattr(mod, func)(rest)
    return int(rc or 0)


# --- loading with a progress indicator ---------------------------------------------------------

@contextmanager
def _progress(message: str):
    """A spinner on a terminal, two plain lines otherwise; stderr only, so stdout stays the text."""
    err = sys.stderr
    done = threading.Event()
    t0 = time.perf_counter()
    spinner = None
    if err.isatty():
        def spin():
            frames = "|/-\\"
            k = 0
            while not done.wait(0.1):
                err.write(f"\r{message} {frames[k % 4]} {time.perf_counter() - t0:4.1f}s")
                err.flush()
                k += 1
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
    else:
        print(f"{message} ...", file=err, flush=True)
    outcome = "failed"
    try:
        yield
        outcome = "done"
    finally:
        done.set()
        if spinner is not None:
            spinner.join()
            err.write("\r\033[K")
        print(f"{message}: {outcome} in {time.perf_counter() - t0:.1f} s", file=err, flush=True)


def _load(args):
    from .defaults import default_model_path, generated_default_path, SHIPPED_DEFAULT
    from .engine import load

    model = args.model
    if model is None and not SHIPPED_DEFAULT.is_file() and not generated_default_path().is_file():
        with _progress(f"generating the default model (once) into {generated_default_path().parent}"):
            model = default_model_path()
    with _progress(f"loading {model or 'the default model'}"):
        eng = load(model, backend=args.backend, n_ctx=args.n_ctx, n_threads=args.threads,
                   draft_depth=getattr(args, "draft_depth", 4), kv_type=getattr(args, "kv_type", "f16"),
                   prefill_chunk=getattr(args, "prefill_chunk", None))
    print(f"model {eng.model_path}, backend {eng.backend_name} ({eng.backend_reason})",
          file=sys.stderr, flush=True)
    return eng


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty)


def _stream_out(chunks) -> object:
    """Print chunks as they come; return the last chunk (it carries finish_reason and stats)."""
    last = None
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    return last


# --- commands -------------------------------------------------------------------------------------

def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = _sampling(args)
    from .sampling import SamplingParams
    SamplingParams(**sampling)           # a bad parameter fails before the model loads
    with _load(args) as eng:
        last = _stream_out(eng.generate(prompt, stream=True, **sampling))
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[{last.finish_reason}] {last.stats.summary()}", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    sampling = _sampling(args)
    from .sampling import SamplingParams
    SamplingParams(**sampling)
    tty = sys.stdin.isatty()
    with _load(args) as eng:
        messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        if tty:
            print("type a message; /reset starts over, /exit quits", file=sys.stderr)
        while True:
            if tty:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                messages = messages[:1] if args.system else []
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            parts = []
            last = None
            for chunk in eng.chat(messages, enable_thinking=args.think, stream=True, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                parts.append(chunk.text)
                last = chunk
            sys.stdout.write("\n")
            sys.stdout.flush()
            messages.append({"role": "assistant", "content": "".join(parts)})
            print(f"[{last.finish_reason}] {last.stats.summary()}", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    """Prints the description; exits 1 when the verdict is "not usable", so scripts can check."""
    from .model_file import describe

    cache = _prefix_cache_bytes(args)
    if not os.path.exists(args.model):
        raise FileNotFoundError(f"model file not found: {args.model}")
    text = describe(args.model)
    ok = "verdict: OK" in text
    if ok:
        from .backends.select import choose_backend
        from .model_file import open_model

        with open_model(args.model) as mf:
            backend, _ = choose_backend("auto", mf, args.n_ctx, args.kv_type, args.slots)
            plan = serving_memory(mf, backend, args.n_ctx, args.slots, args.kv_type, cache)
        text += "".join(f"\n{k}: {v}" for k, v in plan.rows())
    print(text)
    return 0 if ok else 1


def cmd_doctor(args) -> int:
    """What this machine runs and why: the instruction sets llama.cpp may use (probed), whether
    llama.cpp really decodes here (in a child process), the GPU, and which backend runs the model,
    where, and why."""
    from . import __version__, cpu_features
    from .backends.llama_cpp import check_runs
    from .backends.select import choose_backend, native_verdict
    from .defaults import default_model_path
    from .errors import WrongArchitectureError
    from .model_file import open_model, read_foreign

    cache = _prefix_cache_bytes(args)
    rows: list[tuple[str, str]] = [
        ("openjet-plugin", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", f"{platform.system()} {platform.release()} {platform.machine()}"),
        ("cpu cores", str(os.cpu_count())),
    ]
    verdicts = cpu_features.host_verdicts()
    rows.append(("cpu: llama.cpp uses", ", ".join(n for n, v in verdicts.items()
                                                 if v.usable and n in cpu_features.BUILD_FEATURES)
                 or "baseline x86-64 only"))
    rows.append(("cpu: also runs", ", ".join(n for n, v in verdicts.items()
                                             if v.usable and n not in cpu_features.BUILD_FEATURES)
                 or "nothing more"))
    for v in verdicts.values():
        if v.advertised and not v.usable:
            rows.append((f"cpu: {v.name} off", v.why))
    if cpu_features.amx_faults():
        rows.append(("cpu: AMX guard", "llama.cpp's extra buffer types (its AMX path) are turned off"))
    try:
        from .backends.llama_cpp import import_llama_cpp
        llama_cpp = import_llama_cpp()
        from .setup_llama import installed_record
        rec = installed_record()
        build = f"built by openjet setup: {rec['gpu']}" if rec else "not built by openjet setup (its own build options)"
        rows.append(("llama-cpp-python", f"{llama_cpp.__version__}, GPU offload "
                     f"{'yes' if llama_cpp.llama_supports_gpu_offload() else 'no'}; {build}"))
    except ImportError as exc:
        rows.append(("llama-cpp-python", f"NOT INSTALLED ({exc})"))
    rows += _gpu_rows()
    rows.append(("CUDA toolkit", _nvcc_version()))

    model = args.model or str(default_model_path())
    ok_run, how = check_runs(model)
    rows.append(("llama.cpp runs here", ("yes: " if ok_run else "NO: ") + how))
    plan = None
    try:
        with open_model(model) as mf:
            ok, why = native_verdict(mf, args.n_ctx, args.kv_type, args.slots)
            rows.append(("native backend", ("usable: " if ok else "not usable: ") + why))
            name, reason = choose_backend("auto", mf, args.n_ctx, args.kv_type, args.slots)
            plan = serving_memory(mf, name, args.n_ctx, args.slots, args.kv_type, cache)
    except WrongArchitectureError as exc:
        arch = read_foreign(model).architecture
        rows.append(("native backend", f"not usable: {Path(model).name} is a {arch!r} model, "
                     f"the native engine runs only {exc.expected!r}"))
        name, reason = "llama.cpp", "another architecture: llama.cpp runs it"
    rows.append(("model checked", model))
    if name == "llama.cpp":
        if ok_run:
            rows.append(("backend=auto runs", f"llama.cpp on the {how.rsplit(' on the ', 1)[-1]} ({reason})"))
        else:
            rows.append(("backend=auto runs", f"nothing: it would be llama.cpp, which does not run here (above) ({reason})"))
    else:
        rows.append(("backend=auto runs", f"native on the GPU ({reason})"))
    if plan is not None:
        rows += plan.rows()
    else:
        from .backends.llama_cpp import DEFAULT_SERVE_SEQUENCES

        slots = args.slots or DEFAULT_SERVE_SEQUENCES
        rows.append(("serving", f"{slots} slot{'s' if slots > 1 else ''} x {args.n_ctx} context on llama.cpp; "
                                f"the memory a slot takes is not known for a {arch!r} model"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if ok_run or name == "native" else 1


# --- memory of N slots, before loading -----------------------------------------------------------

@dataclass(frozen=True)
class ServingMemory:
    """What serving a model takes on a backend, from the estimators each backend keeps: the slots
    it runs (conversations at once) of n_ctx positions each, the memory each slot holds, and the
    memory held once whatever the slots; and beside it, in host memory, the prefix cache's budget."""
    backend: str
    slots: int
    n_ctx: int
    per_slot: dict[str, int]      # kv_cache, recurrent_state
    once: dict[str, int]          # weights + working buffers (the backend's compute buffers)
    note: str = ""                # why slots differs from what was asked
    prefix_cache: int = 0         # host bytes the engine's prefix cache may take (0: none)
    # per slot in host memory beside a GPU (llama.cpp's recurrent checkpoints); on the CPU they
    # are in per_slot
    host_per_slot: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Memory where the backend runs (the GPU's, or the host's on the CPU); not the prefix
        cache, which is filled only as prompts recur and is bounded on its own."""
        return sum(self.once.values()) + self.slots * sum(self.per_slot.values())

    def rows(self) -> list[tuple[str, str]]:
        from .model_file import _human_bytes

        slot = " + ".join(f"{_PURPOSE[k]} {_human_bytes(v)}" for k, v in self.per_slot.items())
        once = " + ".join(f"{_PURPOSE[k]} {_human_bytes(v)}" for k, v in self.once.items())
        if self.prefix_cache:
            cache = (f"up to {_human_bytes(self.prefix_cache)} of host memory (copies of recurring prompt "
                     f"prefixes; --prefix-cache-mb 0 turns it off)")
        elif self.backend == "native":
            cache = "none (the native engine does not copy a sequence's state yet)"
        else:
            cache = "none (--prefix-cache-mb N keeps up to N MiB of host memory for one)"
        rows = [("serving", f"{self.slots} slot{'s' if self.slots > 1 else ''} x {self.n_ctx} context "
                            f"on {self.backend}{self.note}"),
                ("memory", f"{_human_bytes(self.total)} = {once} once + {self.slots} x ({slot}) per slot")]
        if self.host_per_slot:
            host = " + ".join(f"{_PURPOSE[k]} {_human_bytes(v)}" for k, v in self.host_per_slot.items())
            rows.append(("host memory", f"{_human_bytes(self.slots * sum(self.host_per_slot.values()))} = "
                                        f"{self.slots} x ({host}) per slot"))
        return rows + [("prefix cache", cache)]


_PURPOSE = {"kv_cache": "KV cache", "recurrent_state": "recurrent state", "weights": "weights",
            "buffers": "working buffers", "checkpoints": "recurrent checkpoints"}


def _prefix_cache_bytes(args) -> int | None:
    mb = check_prefix_cache_mb(args.prefix_cache_mb)
    return None if mb is None else mb << 20


def check_prefix_cache_mb(value: object, name: str = "--prefix-cache-mb") -> int | None:
    """A prefix-cache budget in MiB as the command line and OPENJET_PREFIX_CACHE_MB give it: None
    (the engine's default) or an integer >= 0 (0: none); ValueError naming `name` otherwise."""
    if value is None:
        return None
    given, mb = value, value
    if isinstance(value, str):
        try:
            mb = int(value.strip())
        except ValueError:
            mb = None
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        raise ValueError(f"{name} must be an integer >= 0 (MiB of host memory; 0: no prefix cache), got {given!r}")
    return mb


def _llama_cpp_on_gpu() -> bool:
    """Whether LlamaCppBackend would run on a GPU here (backends/llama_cpp.py gpu_placement: a GPU
    visible and a llama-cpp-python build that offloads), without loading anything."""
    from . import gpus

    from .backends.llama_cpp import import_llama_cpp

    try:
        llama_cpp = import_llama_cpp()
    except ImportError:
        return False
    real = getattr(llama_cpp, "__openjet_real__", llama_cpp)
    return gpus.first_gpu() is not None and bool(real.llama_supports_gpu_offload())


def serving_memory(model_file, backend: str, n_ctx: int, slots: int | None = None,
                   kv_type: str = "f16", prefix_cache_bytes: int | None = None,
                   on_gpu: bool | None = None) -> ServingMemory:
    """The memory `openjet serve --slots slots` takes for model_file on backend ("native" or
    "llama.cpp"), before loading it. slots None: the default, DEFAULT_SERVE_SEQUENCES (the native
    engine holds 1..8; each slot there is a sequence's KV cache, recurrent state and checkpoint
    slots, and a hidden window in the working buffers). prefix_cache_bytes: as
    load() takes it (None: the engine's default, DEFAULT_PREFIX_CACHE_BYTES with several slots;
    only a backend that copies sequence state, llama.cpp, has one). on_gpu (llama.cpp): where
    its compute buffers are planned for; None: where it would run here."""
    from .prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, check_prefix_cache_bytes

    if slots is not None and slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if n_ctx < 16:
        raise ValueError(f"n_ctx must be an integer >= 16, got {n_ctx}")
    check_prefix_cache_bytes(prefix_cache_bytes)
    from .backends.llama_cpp import DEFAULT_SERVE_SEQUENCES

    n = DEFAULT_SERVE_SEQUENCES if slots is None else slots
    if backend == "native":
        from .backends.native import MAX_SEQUENCES, estimate_device_bytes

        if n > MAX_SEQUENCES:
            raise ValueError(f"the native engine holds at most {MAX_SEQUENCES} slots, {n} asked")
        # the engine's own accounting for n sequences: the per-sequence terms split evenly, the rest
        # (weights, activations with every sequence's hidden window, prefill buffers) held once, so
        # the plan's total is the estimate's
        est = estimate_device_bytes(model_file, n_ctx, kv_type=kv_type, n_seq=n)
        per_slot = {k: est[k] // n for k in ("kv_cache", "recurrent_state", "checkpoints")}
        return ServingMemory("native", n, n_ctx, per_slot,
                             {"weights": est["weights"], "buffers": est["activations"] + est["prefill"]})
    from .backends.llama_cpp import (
        checkpoint_memory,
        compute_memory,
        sequence_memory,
        uses_flash_attention,
    )

    cfg = model_file.config
    weights = sum(int(t.n_bytes) for t in model_file.tensors.values())
    gpu = _llama_cpp_on_gpu() if on_gpu is None else on_gpu
    buffers = compute_memory(cfg, n_ctx, flash_attn=uses_flash_attention(kv_type, gpu), on_gpu=gpu,
                             n_tensors=len(model_file.tensors))
    per_slot = sequence_memory(cfg, n_ctx, kv_type)
    checkpoints = {"checkpoints": checkpoint_memory(cfg)}
    cache = (DEFAULT_PREFIX_CACHE_BYTES if n > 1 else 0) if prefix_cache_bytes is None else prefix_cache_bytes
    return ServingMemory("llama.cpp", n, n_ctx, per_slot if gpu else {**per_slot, **checkpoints},
                         {"weights": weights, "buffers": buffers}, prefix_cache=cache,
                         host_per_slot=checkpoints if gpu else {})


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    return out.stdout.strip() if out.returncode == 0 else f"failed: {out.stderr.strip() or out.returncode}"


def _gpu_rows() -> list[tuple[str, str]]:
    out = _run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total,memory.free",
                "--format=csv,noheader"])
    if out is None:
        return [("GPU", "none found (nvidia-smi not on PATH)")]
    if out.startswith("failed"):
        return [("GPU", f"nvidia-smi {out}")]
    rows = []
    for k, line in enumerate(out.splitlines()):
        f = [x.strip() for x in line.split(",")]
        if len(f) == 5:
            rows.append((f"GPU {k}", f"{f[0]}, sm_{f[1].replace('.', '')}, driver {f[2]}, "
                                     f"{f[4]} free of {f[3]}"))
        else:
            rows.append((f"GPU {k}", line))
    return rows


def _nvcc_version() -> str:
    out = _run(["nvcc", "--version"])
    if out is None:
        return "not found (nvcc not on PATH)"
    for line in out.splitlines():
        if "release" in line:
            return line.strip()
    return out.splitlines()[-1] if out else "unknown"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
