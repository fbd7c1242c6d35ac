"""Train a qwen35 model (trunk + one MTP block) on the stdlib corpus; reproducible from a seed.

    python -m training.train --preset default --time-budget 450 --run-dir /tmp/run-mtp

Loss = main next-token CE + mtp_lambda * mean over k=1..mtp_steps of the MTP CE of step k, where
step 1 reads the trunk's final hidden h_t (after output_norm) and the embedding of token t+1 and
predicts token t+2, and step k > 1 reads the previous step's normed output instead of h_t (the
chained drafting llama.cpp does) and the embedding of token t+k, predicting token t+k+1.

Reproducibility: parameters are initialised, and batches drawn, from generators seeded by --seed
only (the MTP settings do not change the trunk's initial weights or the batch order, so runs with
and without MTP are a clean ablation). With a time budget and no --steps, the step count is fixed
after timing the first steps and written to the log; `--steps N` reruns exactly that schedule.

Outputs in --run-dir: log.json (config, losses, held-out metrics), weights-NN.pt (fp16 matrices,
fp32 vectors, each file <= 15 MiB) and, with --ckpt-every, ckpt.pt (full state for --resume).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from .data import Corpus, build_corpus, unigram_perplexity
from .light_import import model_config
from .qwen35_torch import Qwen35, count_parameters

SHARD_BYTES = 15 * 1024 * 1024
WINDOW_EXTRA = 4        # every run draws windows of seq_len + 4 tokens, whatever its MTP depth


# --------------------------------------------------------------------------------------------
# weights files
# --------------------------------------------------------------------------------------------

def save_weights(model: torch.nn.Module, run_dir: pathlib.Path, prefix: str = "weights") -> list[str]:
    """State dict in shards of <= 15 MiB: matrices as fp16 (checked for overflow), vectors as fp32."""
    shards, cur, size = [], {}, 0
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if t.dim() >= 2 and t.numel() >= 4096:
            if t.abs().max().item() >= 65504:
                raise ValueError(f"parameter {name} overflows fp16 (max |w| = {t.abs().max().item()})")
            t = t.half()
        else:
            t = t.float()
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t.contiguous()
        size += nbytes
    shards.append(cur)
    names = []
    for i, shard in enumerate(shards):
        p = run_dir / f"{prefix}-{i:02d}.pt"
        torch.save(shard, p)
        names.append(p.name)
    return names


def load_weights(paths, model: torch.nn.Module) -> None:
    """Load shards written by save_weights (a list of files, or a run dir's weights-*.pt)."""
    state = {}
    for p in paths:
        state.update(torch.load(p, map_location="cpu", weights_only=True))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"weights {', '.join(map(str, paths))}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"weights: tensor {k} has shape {tuple(v.shape)}, the model wants {tuple(own[k].shape)}")
    model.load_state_dict({k: v.float() for k, v in state.items()})


def weight_files(run_dir: str | pathlib.Path, prefix: str = "weights") -> list[pathlib.Path]:
    files = sorted(pathlib.Path(run_dir).glob(f"{prefix}-*.pt"))
    if not files:
        raise FileNotFoundError(f"{run_dir}: no {prefix}-NN.pt files")
    return files


# --------------------------------------------------------------------------------------------
# losses and evaluation
# --------------------------------------------------------------------------------------------

def forward_losses(model: Qwen35, window: torch.Tensor, seq_len: int, mtp_steps: int, trunk_grad: float):
    """window [B, seq_len + WINDOW_EXTRA] -> (main CE, [MTP CE per step], main logits, [MTP logits])."""
    x = window[:, :seq_len]
    logits, h = model(x)
    main = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:seq_len + 1].flatten())
    if not mtp_steps:
        return main, [], logits, []
    mtp_logits = model.mtp_chain(h, window[:, 0], [window[:, k:seq_len + k] for k in range(1, mtp_steps + 1)],
                                 trunk_grad)
    mtp_losses = [F.cross_entropy(lk.float().flatten(0, 1), window[:, k + 1:seq_len + k + 1].flatten())
                  for k, lk in enumerate(mtp_logits, start=1)]
    return main, mtp_losses, logits, mtp_logits


@torch.no_grad()
def evaluate(model: Qwen35, windows: torch.Tensor, seq_len: int, mtp_steps: int, batch: int,
             autocast_dtype) -> dict:
    """Held-out main perplexity, and per MTP step: CE, top-1 accuracy, and agreement of its argmax
    with the main head's argmax for the same target (what greedy drafting needs)."""
    model.eval()
    tot_main, n = 0.0, 0
    k_steps = mtp_steps if model.mtp is not None else 0
    tot_k = np.zeros(k_steps)
    acc_k = np.zeros(k_steps)
    agree_k = np.zeros(k_steps)
    chain = np.zeros(k_steps)       # positions where steps 1..k all agree with the main head
    n_k = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        with torch.autocast(w.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            main, mtp_losses, logits, mtp_logits = forward_losses(model, w, seq_len, k_steps, 1.0)
        cnt = w.shape[0] * seq_len
        tot_main += main.item() * cnt
        n += cnt
        if k_steps:
            main_arg = logits.argmax(-1)                         # predicts token t+1 at position t
            valid = seq_len - k_steps                            # positions whose t+k main argmax exists
            all_ok = torch.ones_like(main_arg[:, :valid], dtype=torch.bool)
            for k in range(1, k_steps + 1):
                arg = mtp_logits[k - 1].argmax(-1)               # predicts token t+k+1 at position t
                tot_k[k - 1] += mtp_losses[k - 1].item() * cnt
                acc_k[k - 1] += (arg == w[:, k + 1:seq_len + k + 1]).float().sum().item()
                ok = arg[:, :valid] == main_arg[:, k:valid + k]
                agree_k[k - 1] += ok.float().sum().item() / valid * seq_len
                all_ok &= ok
                chain[k - 1] += all_ok.float().sum().item() / valid * seq_len
            n_k += cnt
    model.train()
    out = {"main_ce": tot_main / n, "main_ppl": math.exp(tot_main / n), "tokens": n}
    if k_steps:
        out["mtp_ce"] = (tot_k / n_k).tolist()
        out["mtp_top1"] = (acc_k / n_k).tolist()
        out["mtp_agree_main"] = (agree_k / n_k).tolist()
        # teacher-forced estimate of tokens per cycle at depth D: 1 + sum_d P(first d drafts agree)
        out["est_tokens_per_cycle"] = [1.0 + float(np.sum(chain[:d] / n_k)) for d in range(1, k_steps + 1)]
    return out


def heldout_windows(stream: np.ndarray, seq_len: int, max_windows: int | None) -> np.ndarray:
    L = seq_len + WINDOW_EXTRA
    n = (stream.size - L) // seq_len + 1
    if max_windows is not None:
        n = min(n, max_windows)
    idx = np.arange(n)[:, None] * seq_len + np.arange(L)[None, :]
    return stream[idx].astype(np.int64)


# --------------------------------------------------------------------------------------------
# schedule
# --------------------------------------------------------------------------------------------

def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model: Qwen35, lr: float, wd: float, betas, fused: bool):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "ssm_conv1d" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **kw)


# --------------------------------------------------------------------------------------------
# concurrent runs on one GPU
# --------------------------------------------------------------------------------------------

def wait_for_peers(folder: pathlib.Path, tag: str, n: int, timeout: float = 300.0) -> None:
    """Start timing only when all n runs are set up, so that each calibrates under the same load."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{tag}.ready").write_text(str(os.getpid()))
    t0 = time.time()
    while len(list(folder.glob("*.ready"))) < n:
        if time.time() - t0 > timeout:
            print(f"[{tag}] barrier: only {len(list(folder.glob('*.ready')))}/{n} runs ready after "
                  f"{timeout:.0f}s; starting anyway", file=sys.stderr, flush=True)
            return
        time.sleep(0.2)


def agree_on_steps(folder: pathlib.Path, tag: str, n: int, mine: int, timeout: float = 120.0) -> int:
    """Each run posts its calibrated step count; all take the smallest (the slowest run's)."""
    tmp = folder / f".{tag}.tmp"
    tmp.write_text(str(mine))
    tmp.rename(folder / f"{tag}.steps")          # atomic: readers never see a half-written file
    t0 = time.time()
    while True:
        posted = [int(p.read_text()) for p in folder.glob("*.steps")]
        if len(posted) >= n or time.time() - t0 > timeout:
            return min(posted)
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train a qwen35 model with an MTP block on the stdlib.")
    ap.add_argument("--preset", default="default", help="a preset of openjet_plugin/config.py")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--corpus", default=None, help="an .npz from `python -m training.data build` (else built now)")
    ap.add_argument("--corpus-workers", type=int, default=4)
    ap.add_argument("--corpus-limit-files", type=int, default=None, help="tokenize only a sample of files (tests)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=None, help="fixed step count (else derived from --time-budget)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds of training (a hard stop too)")
    ap.add_argument("--calib-steps", type=int, default=12, help="steps timed to size the schedule")
    ap.add_argument("--barrier", default=None,
                    help="folder where concurrent runs meet: they start together and all take the smallest "
                         "calibrated step count (an ablation then compares equal steps and tokens)")
    ap.add_argument("--barrier-n", type=int, default=1, help="number of runs meeting at --barrier")
    ap.add_argument("--mtp-lambda", type=float, default=0.3, help="weight of the MTP loss (0: no MTP training)")
    ap.add_argument("--mtp-steps", type=int, default=3, help="chained MTP steps trained (1..4)")
    ap.add_argument("--mtp-trunk-grad", type=float, default=1.0,
                    help="scale of the MTP gradient into trunk/embedding/output (1 joint, 0 frozen)")
    ap.add_argument("--eval-every", type=float, default=90.0, help="seconds between held-out evaluations")
    ap.add_argument("--eval-windows", type=int, default=96, help="held-out windows for periodic evals")
    ap.add_argument("--final-eval-windows", type=int, default=None, help="None: the whole held-out split")
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--ckpt-every", type=float, default=None, help="seconds between full checkpoints")
    ap.add_argument("--resume", default=None, help="a ckpt.pt to continue from")
    ap.add_argument("--init-weights", default=None, help="a run dir whose weights-*.pt start this run")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (eager fallback on error)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if not 1 <= args.mtp_steps <= WINDOW_EXTRA - 1:
        ap.error(f"--mtp-steps must be 1..{WINDOW_EXTRA - 1}")
    if args.steps is None and args.time_budget is None:
        ap.error("give --steps or --time-budget")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = pathlib.Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = torch.bfloat16 if cuda else None

    cfg = model_config(args.preset)
    corpus = Corpus.load(args.corpus) if args.corpus else build_corpus(
        workers=args.corpus_workers, limit_files=args.corpus_limit_files)
    if int(max(corpus.train.max(), corpus.heldout.max())) >= cfg.n_vocab:
        raise ValueError(f"corpus has token ids >= n_vocab={cfg.n_vocab} of preset {args.preset!r}")
    L = args.seq_len + WINDOW_EXTRA
    if corpus.train.size <= L:
        raise ValueError(f"corpus too small: {corpus.train.size} training tokens for windows of {L}")
    train_tokens = torch.from_numpy(corpus.train.astype(np.int32)).to(device)
    eval_w = torch.from_numpy(heldout_windows(corpus.heldout, args.seq_len, args.eval_windows)).to(device)
    final_w = torch.from_numpy(heldout_windows(corpus.heldout, args.seq_len, args.final_eval_windows)).to(device)
    unigram = unigram_perplexity(corpus.train, corpus.heldout, cfg.n_vocab)

    # the trunk's init and the batch order depend on the seed only
    torch.manual_seed(args.seed)
    model = Qwen35(cfg)
    if args.init_weights:
        load_weights(weight_files(args.init_weights), model)
    model.to(device)
    use_mtp = args.mtp_lambda > 0 and model.mtp is not None
    opt = make_optimizer(model, args.lr, args.weight_decay, (0.9, 0.95), fused=cuda)
    data_gen = torch.Generator(device=device)
    data_gen.manual_seed(args.seed + 1)

    step, total_steps = 0, args.steps
    history, evals = [], []
    tokens_seen = 0
    train_seconds = 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        data_gen.set_state(ck["data_gen"])         # generator states are CPU byte tensors on every device
        step, total_steps = ck["step"], args.steps or ck["total_steps"]
        history, evals, tokens_seen = ck["history"], ck["evals"], ck["tokens_seen"]
        train_seconds = ck["train_seconds"]

    fwd = model
    if args.compile:
        fwd = torch.compile(model)

    log = {
        "tag": args.tag, "args": vars(args), "config": cfg.to_dict(), "n_params": count_parameters(model),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "corpus": {k: v for k, v in corpus.meta.items() if k != "heldout_files"},
        "unigram_ppl": unigram,
    }

    def save_ckpt():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "data_gen": data_gen.get_state(),
                    "step": step, "total_steps": total_steps, "history": history, "evals": evals,
                    "tokens_seen": tokens_seen, "train_seconds": train_seconds}, run_dir / "ckpt.pt")

    def run_eval(windows):
        return evaluate(model, windows, args.seq_len, args.mtp_steps if use_mtp else 0, args.eval_batch, amp)

    if args.barrier:
        wait_for_peers(pathlib.Path(args.barrier), args.tag, args.barrier_n)
    t_loop = time.time()
    last_eval = last_ckpt = time.time()
    calib_t0 = None
    stopped_by_time = False
    while total_steps is None or step < total_steps:
        if args.time_budget is not None and train_seconds + (time.time() - t_loop) >= args.time_budget:
            stopped_by_time = True
            break
        if total_steps is None and step == 2:
            if cuda:
                torch.cuda.synchronize()
            calib_t0 = time.time()
        lr = lr_at(step, total_steps or 10 ** 9, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train_tokens.numel() - L, (args.batch,), device=device, generator=data_gen)
        window = train_tokens[starts[:, None] + torch.arange(L, device=device)[None, :]].long()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            try:
                main, mtp_losses, _, _ = forward_losses(fwd, window, args.seq_len,
                                                        args.mtp_steps if use_mtp else 0, args.mtp_trunk_grad)
            except Exception as e:                      # a compile failure must not cost the run
                if fwd is model:
                    raise
                print(f"[{args.tag}] torch.compile failed ({type(e).__name__}: {e}); continuing eagerly",
                      file=sys.stderr)
                log["compile_error"] = f"{type(e).__name__}: {e}"
                fwd = model
                main, mtp_losses, _, _ = forward_losses(fwd, window, args.seq_len,
                                                        args.mtp_steps if use_mtp else 0, args.mtp_trunk_grad)
            loss = main + (args.mtp_lambda * torch.stack(mtp_losses).mean() if mtp_losses else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += args.batch * args.seq_len
        if step % 10 == 0 or step == 1 or step == total_steps:
            history.append({"step": step, "t": round(train_seconds + time.time() - t_loop, 2), "lr": lr,
                            "loss": main.item(), "mtp": [m.item() for m in mtp_losses],
                            "gnorm": float(gnorm)})
            print(f"[{args.tag}] step {step}/{total_steps or '?'} loss {main.item():.4f} "
                  f"mtp {[round(m.item(), 3) for m in mtp_losses]} lr {lr:.2e}", flush=True)
        if total_steps is None and calib_t0 is not None and step == 2 + args.calib_steps:
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.time() - calib_t0) / args.calib_steps
            left = args.time_budget - (train_seconds + time.time() - t_loop)
            # leave room for the periodic evaluations (a few % of the time) and jitter
            total_steps = step + max(1, int(left * 0.90 / per_step))
            if args.barrier:
                total_steps = agree_on_steps(pathlib.Path(args.barrier), args.tag, args.barrier_n, total_steps)
            log["calibration"] = {"seconds_per_step": per_step, "total_steps": total_steps}
            print(f"[{args.tag}] {per_step:.3f} s/step -> {total_steps} steps", flush=True)
        if time.time() - last_eval >= args.eval_every:
            e = run_eval(eval_w)
            e.update(step=step, t=round(train_seconds + time.time() - t_loop, 1))
            evals.append(e)
            print(f"[{args.tag}] eval step {step}: held-out ppl {e['main_ppl']:.3f}", flush=True)
            last_eval = time.time()
        if args.ckpt_every and time.time() - last_ckpt >= args.ckpt_every:
            train_seconds += time.time() - t_loop
            t_loop = time.time()
            save_ckpt()
            last_ckpt = time.time()
    train_seconds += time.time() - t_loop
    t_loop = time.time()

    final = run_eval(final_w)
    log.update({
        "steps": step, "total_steps": total_steps, "stopped_by_time": stopped_by_time,
        "tokens_seen": tokens_seen, "train_seconds": round(train_seconds, 1),
        "final_eval": final, "evals": evals, "history": history, "mtp_trained": use_mtp,
    })
    if args.ckpt_every:
        save_ckpt()
    log["weights"] = save_weights(model, run_dir)
    log["wall_seconds"] = round(time.time() - t_start, 1)
    (run_dir / "log.json").write_text(json.dumps(log, indent=1))
    print(f"[{args.tag}] done: {step} steps, {tokens_seen / 1e6:.1f}M tokens, held-out ppl "
          f"{final['main_ppl']:.3f} (unigram {unigram:.1f})"
          + (f", est. tokens/cycle {['%.2f' % x for x in final['est_tokens_per_cycle']]}"
             if "est_tokens_per_cycle" in final else ""), flush=True)
    return log


if __name__ == "__main__":
    main()
