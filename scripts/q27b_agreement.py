"""Teacher-forced agreement of our native engine with llama.cpp (CUDA) on the q27b model (issue 5).

Acceptance: top-1 agreement >= 99% over >= 256 positions. Both engines see the same tokens
(seeded random ids, or a tokenised text file), 8 positions per call, every position's full
logits row kept:
  - llama.cpp: native/tools/llama_logits.cpp, built against the libllama of the peer's CUDA build
    (openjet_plugin.bench.peer; all layers on the GPU, flash attention on, f16 KV);
  - ours: the native backend (`NativeBackend.eval_all_logits`), or with `--engine reference` the
    numpy reference (for a CPU run of this script on a small model).
Reported: top-1 agreement, KL(llama.cpp || ours) mean / p99 / max, how many disagreements are
near-ties (llama.cpp's own logit of its choice minus its logit of ours < --near-tie), the relative
L2 difference of the logits, and the load and eval time of both. JSON to --out, one line printed.

    python scripts/q27b_agreement.py [--model q27b.gguf] [--positions 256] [--out agreement.json]

The model defaults to the bench's generated q27b (build/cache/bench/q27b-Q4_K_M-seed0.gguf, or
/tmp/q27b.gguf from scripts/native_q27b.py), generated once when neither exists. The llama.cpp
build (~5 minutes on 16 cores) is started in the background unless it is ready or running
(scripts/gpu.sh agreement starts it first); our engine runs while it builds.

Exit status: 0 measured and top-1 >= --min-top1; 2 measured and below it (or non-finite logits);
3 out of time before llama.cpp was built (run again: the build resumes); 1 any other failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LLAMA_LOGITS_SRC = REPO / "native" / "tools" / "llama_logits.cpp"
EXIT_BELOW, EXIT_OUT_OF_TIME = 2, 3
# what is left to do after llama.cpp is built: compile llama_logits, load 16.8 GB, 256 positions
AFTER_BUILD_S = 120


class AgreementError(RuntimeError):
    """A step failed; the message says which and why."""


_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# --- comparison ------------------------------------------------------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(llama: np.ndarray, ours: np.ndarray, near_tie: float, chunk: int = 32) -> dict:
    """Agreement of `ours` with `llama` ([n_pos, n_vocab] logits each), computed in float64.

    A disagreement is a near-tie when llama.cpp itself ranks our choice within `near_tie` logits
    of its own (its logit of its argmax minus its logit of our argmax): rounding differences
    between two correct engines flip exactly those.
    """
    if llama.shape != ours.shape or llama.ndim != 2:
        raise AgreementError(f"logits shapes differ or are not [positions, vocab]: llama.cpp "
                             f"{llama.shape}, ours {ours.shape}")
    n = llama.shape[0]
    finite_l = np.isfinite(llama).all(axis=-1)
    finite_o = np.isfinite(ours).all(axis=-1)
    top_l, top_o = llama.argmax(-1), ours.argmax(-1)
    kl = np.empty(n)
    sq_diff = sq_ref = 0.0
    max_abs = 0.0
    for a in range(0, n, chunk):
        lp, lq = log_softmax(llama[a:a + chunk]), log_softmax(ours[a:a + chunk])
        kl[a:a + chunk] = (np.exp(lp) * (lp - lq)).sum(-1)
        d = ours[a:a + chunk].astype(np.float64) - llama[a:a + chunk]
        sq_diff += float(np.square(d).sum())
        sq_ref += float(np.square(llama[a:a + chunk].astype(np.float64)).sum())
        max_abs = max(max_abs, float(np.abs(d).max()))
    rows = np.arange(n)
    dis = rows[top_l != top_o]
    gap_llama = llama[dis, top_l[dis]].astype(np.float64) - llama[dis, top_o[dis]]
    gap_ours = ours[dis, top_o[dis]].astype(np.float64) - ours[dis, top_l[dis]]
    top2 = np.partition(llama, -2, axis=-1)[:, -2:].astype(np.float64)
    margin = top2[:, 1] - top2[:, 0]           # llama.cpp's own top-1 minus top-2, every position
    n_near = int((gap_llama < near_tie).sum())
    return {
        "positions": int(n),
        "n_vocab": int(llama.shape[1]),
        "finite": bool(finite_l.all() and finite_o.all()),
        "nonfinite_rows_llama": int((~finite_l).sum()),
        "nonfinite_rows_ours": int((~finite_o).sum()),
        "top1": float(np.mean(top_l == top_o)),
        "disagreements": int(dis.size),
        "near_tie": near_tie,
        "near_tie_disagreements": n_near,
        "near_tie_fraction": float(n_near / dis.size) if dis.size else None,
        "top1_excluding_near_ties": float((n - dis.size + n_near) / n),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "rel_l2": float(np.sqrt(sq_diff / sq_ref)) if sq_ref > 0 else None,
        "max_abs_diff": max_abs,
        "llama_top2_margin_median": float(np.median(margin)),
        "llama_top2_margin_min": float(margin.min()),
        "disagreement_detail": [
            {"position": int(p), "llama_top1": int(top_l[p]), "ours_top1": int(top_o[p]),
             "llama_gap": float(g), "ours_gap": float(h), "kl": float(kl[p])}
            for p, g, h in list(zip(dis, gap_llama, gap_ours))[:16]],
    }


# --- inputs ----------------------------------------------------------------------------------------

def default_model(cache: Path) -> Path:
    """The bench's generated q27b, else scripts/native_q27b.py's, else generated into the cache."""
    for p in (cache / "q27b-Q4_K_M-seed0.gguf", Path("/tmp/q27b.gguf")):
        if p.is_file():
            return p
    from openjet_plugin.bench.runner import default_model as generate

    return generate(cache, log)


def make_tokens(model: Path, n_vocab: int, positions: int, seed: int, text: Path | None) -> tuple[list[int], str]:
    if text is None:
        rng = np.random.default_rng(seed)
        return rng.integers(0, n_vocab, positions).tolist(), f"random ids, seed {seed}"
    from openjet_plugin.tokenizer import Tokenizer

    if not text.is_file():
        raise AgreementError(f"--text {text}: file not found")
    ids = Tokenizer.from_gguf(model).encode(text.read_bytes(), add_special=False, parse_special=False)
    if len(ids) < positions:
        raise AgreementError(f"--text {text} gives {len(ids)} tokens with {model.name}'s tokenizer; "
                             f"--positions asks for {positions}")
    return [int(t) for t in ids[:positions]], f"{text.name} tokenised, first {positions}"


# --- the two engines -------------------------------------------------------------------------------

def ours_logits(engine: str, model: Path, tokens: list[int], batch: int, n_ctx: int) -> tuple[np.ndarray, dict]:
    from openjet_plugin.model_file import open_model

    mf = open_model(model)
    try:
        if engine == "reference":
            from openjet_plugin.testing.reference import ReferenceModel

            t0 = time.perf_counter()
            ref = ReferenceModel(model)
            load_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = np.asarray(ref.logits(tokens), dtype=np.float32)
            return out, {"engine": "numpy reference", "load_s": round(load_s, 2),
                         "eval_s": round(time.perf_counter() - t0, 3)}
        from openjet_plugin import _native
        from openjet_plugin.backends.native import NativeBackend

        t0 = time.perf_counter()
        be = NativeBackend(mf, n_ctx=n_ctx)
        load_s = time.perf_counter() - t0
        try:
            be.eval_all_logits(tokens[:batch], positions_per_call=batch)   # warm-up: first launches
            be.reset()
            t0 = time.perf_counter()
            out = be.eval_all_logits(tokens, positions_per_call=batch)
            eval_s = time.perf_counter() - t0
            mem = be.memory()
        finally:
            be.close()
        return out, {"engine": "native", "library": str(_native.load().path), "load_s": round(load_s, 2),
                     "eval_s": round(eval_s, 3), "positions_per_s": round(len(tokens) / eval_s, 1),
                     "device_memory": mem}
    finally:
        mf.close()


def gpu_arch() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise AgreementError(f"nvidia-smi failed ({e}); pass --archs") from None
    arch = r.stdout.strip().replace(".", "")
    if r.returncode != 0 or not arch.isdigit():
        raise AgreementError(f"nvidia-smi gave no compute capability ({r.stderr.strip()[:200]}); pass --archs")
    return arch


def llama_logits_binary(args, deadline: float) -> tuple[Path, dict]:
    """The llama_logits tool: --llama-logits, else compiled against the peer's CUDA build,
    waiting for that build (started here unless ready or running) until `deadline`."""
    from openjet_plugin.bench import peer

    if args.llama_logits:
        b = Path(args.llama_logits)
        if not (b.is_file() and os.access(b, os.X_OK)):
            raise AgreementError(f"--llama-logits {b}: not an executable file")
        return b, {"binary": str(b)}
    sdist = peer.find_sdist(REPO, args.sdist)
    archs = args.archs or gpu_arch()
    pb = peer.build_dir(args.cache, sdist, archs)
    proc = None
    if not pb.ready() and not peer.build_running(pb):
        log(f"starting the llama.cpp CUDA build (sm_{archs}) in {pb.root}")
        proc = peer.start_background_build(sdist, pb, archs, os.cpu_count() or 4)
    if not pb.ready():
        log(f"waiting for the llama.cpp build ({pb.log})")
    peer.wait_for_build(pb, deadline, proc)   # TimeoutError: out of time, run again
    src = Path(args.llama_logits_src)
    binary = peer.compile_llama_logits(src, pb.root / "llama_logits", peer.llama_include_dirs(pb.llama_src),
                                       pb.lib_dir)
    return binary, {"binary": str(binary), "build": str(pb.root), "archs": archs, **peer.sdist_version(sdist)}


def run_llama(binary: Path, model: Path, tokens: list[int], batch: int, n_ctx: int, workdir: Path,
              require_gpu: bool, timeout: float) -> tuple[np.ndarray, dict]:
    tok_file, out_file = workdir / "tokens.i32", workdir / "llama_logits.f32"
    np.asarray(tokens, dtype="<i4").tofile(tok_file)
    out_file.unlink(missing_ok=True)
    cmd = [str(binary), "-m", str(model), "-t", str(tok_file), "-o", str(out_file), "-b", str(batch),
           "-c", str(n_ctx), "-ngl", "999", "-fa", "1", "--threads", str(min(8, os.cpu_count() or 4))]
    if require_gpu:
        cmd.append("--require-gpu")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AgreementError(f"llama_logits ran past {timeout:.0f} s: {' '.join(cmd)}") from None
    wall = time.perf_counter() - t0
    (workdir / "llama_logits.stderr").write_text(r.stderr)
    if r.returncode != 0:
        raise AgreementError(f"llama_logits exited {r.returncode}: {' '.join(cmd)}\n{r.stderr.strip()[-1500:]}")
    try:
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise AgreementError(f"llama_logits printed no JSON summary line: {r.stdout[-300:]!r}") from None
    n_pos, n_vocab = int(info["n_pos"]), int(info["n_vocab"])
    want = n_pos * n_vocab * 4
    got = out_file.stat().st_size if out_file.is_file() else -1
    if n_pos != len(tokens) or got != want:
        raise AgreementError(f"{out_file}: {got} bytes for {n_pos} positions x {n_vocab} vocab "
                             f"(expected {want} bytes, {len(tokens)} positions)")
    logits = np.fromfile(out_file, dtype="<f4").reshape(n_pos, n_vocab)
    info.update(wall_s=round(wall, 2), positions_per_s=round(n_pos / info["decode_s"], 1) if info["decode_s"] else None)
    return logits, info


# --- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    cache_default = Path(os.environ.get("OPENJET_CACHE_DIR", REPO / "build" / "cache")) / "bench"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="GGUF (default: the generated q27b, see above)")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="positions per call, both engines (1..8)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    ap.add_argument("--text", type=Path, help="tokenise this file instead of random ids")
    ap.add_argument("--engine", choices=("native", "reference"), default="native")
    ap.add_argument("--llama-logits", help="a built llama_logits (default: built from the peer sdist)")
    ap.add_argument("--llama-logits-src", default=str(LLAMA_LOGITS_SRC), help=argparse.SUPPRESS)
    ap.add_argument("--allow-cpu-llama", action="store_true",
                    help="accept a libllama without GPU offload (CPU tests of this script)")
    ap.add_argument("--sdist", help="llama-cpp-python sdist (default: .carry/)")
    ap.add_argument("--cache", type=Path, default=cache_default, help=f"default {cache_default}")
    ap.add_argument("--archs", help="CUDA architecture of the llama.cpp build (default: the GPU's)")
    ap.add_argument("--budget-s", type=float, default=540, help="give up (exit 3) after this long")
    ap.add_argument("--near-tie", type=float, default=0.05, help="logit gap of a near-tie disagreement")
    ap.add_argument("--min-top1", type=float, default=0.99)
    ap.add_argument("--min-positions", type=int, default=256, help="fewer positions never pass")
    ap.add_argument("--out", type=Path, help="JSON report")
    args = ap.parse_args(argv)
    if args.positions < 1 or not 1 <= args.batch <= 8:
        ap.error("--positions must be >= 1 and --batch 1..8")
    deadline = time.time() + args.budget_s
    res: dict = {"positions": args.positions, "batch": args.batch, "kv": "f16", "flash_attn": True,
                 "timing": "load: model onto the device; eval: all positions incl. copying every logits row "
                           "to the host (ours after one warm-up call, llama.cpp's includes its first call)"}
    try:
        model = args.model or default_model(args.cache)
        if not model.is_file():
            raise AgreementError(f"--model {model}: file not found")
        from openjet_plugin.model_file import open_model

        mf = open_model(model)
        try:
            n_vocab = mf.config.n_vocab
        finally:
            mf.close()
        res["model"] = {"path": str(model), "bytes": model.stat().st_size}
        tokens, how = make_tokens(model, n_vocab, args.positions, args.seed, args.text)
        res["tokens"] = how
        n_ctx = -(-args.positions // 256) * 256
        workdir = args.cache / "agreement"
        workdir.mkdir(parents=True, exist_ok=True)

        log(f"ours ({args.engine}) on {model.name}: {args.positions} positions, {args.batch} per call")
        ours, res["ours"] = ours_logits(args.engine, model, tokens, args.batch, n_ctx)
        log(f"ours: load {res['ours']['load_s']} s, eval {res['ours']['eval_s']} s")

        try:
            binary, res["llama_cpp"] = llama_logits_binary(args, deadline - AFTER_BUILD_S)
        except TimeoutError as e:
            print(f"q27b agreement: out of time ({e}); run the same command again, the llama.cpp build "
                  f"resumes where it stopped", flush=True)
            return EXIT_OUT_OF_TIME
        log(f"llama.cpp logits with {binary}")
        left = max(30.0, deadline - time.time())
        theirs, info = run_llama(binary, model, tokens, args.batch, n_ctx, workdir,
                                 require_gpu=not args.allow_cpu_llama, timeout=left)
        res["llama_cpp"].update(info)
        log(f"llama.cpp: load {info['load_s']:.1f} s, decode {info['decode_s']:.2f} s")
        if theirs.shape[1] != ours.shape[1]:
            raise AgreementError(f"vocabulary sizes differ: llama.cpp {theirs.shape[1]}, ours {ours.shape[1]}")
        res.update(compare(theirs, ours, args.near_tie))
    except Exception as e:   # noqa: BLE001 - every failure ends as one clear line and exit 1
        from openjet_plugin.bench.peer import PeerError
        from openjet_plugin.errors import OpenJetError

        known = isinstance(e, (AgreementError, PeerError, OpenJetError, OSError, ValueError))
        print(f"q27b agreement: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if not known:
            raise
        return 1
    res["pass"] = bool(res["finite"] and res["positions"] >= args.min_positions and res["top1"] >= args.min_top1)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    o, ll = res["ours"], res["llama_cpp"]
    nt = (f", {res['near_tie_disagreements']} near-ties < {args.near_tie}" if res["disagreements"] else "")
    print(f"q27b agreement: top-1 {res['top1']:.4f} over {res['positions']} positions "
          f"({res['disagreements']} disagreements{nt}); KL(llama.cpp || ours) mean {res['kl_mean']:.2e}, "
          f"max {res['kl_max']:.2e}; rel L2 {res['rel_l2'] or 0:.2e}; "
          f"llama.cpp load {ll['load_s']:.1f} s, eval {ll['decode_s']:.2f} s; "
          f"ours ({o['engine']}) load {o['load_s']} s, eval {o['eval_s']} s -> "
          f"{'PASS' if res['pass'] else 'FAIL'} (top-1 >= {args.min_top1}, >= {args.min_positions} positions)",
          flush=True)
    return 0 if res["pass"] else EXIT_BELOW


if __name__ == "__main__":
    sys.exit(main())
