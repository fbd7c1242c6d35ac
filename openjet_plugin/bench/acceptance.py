"""Real MTP acceptance on the trained default model: the `accepted_per_cycle` rows of `openjet bench`
(issue 11), run by the child process (bench/ours.py).

Prompts are held-out Python files of the running interpreter's standard library (files the
default model was not trained on): `n` prompts of `length` tokens, each starting at a line with a
def after the first third of its file. The held-out rule is training/data.py's (sha256 of the path
relative to the stdlib root), repeated here because training/ is not installed with the package;
tests/test_bench.py checks that both pick the same files.

For each (temperature, D): the Engine API on the native backend with draft depth D and a fixed
depth policy generates `tokens` tokens per prompt (temperature 0: greedy; 0.7: top-k 40, top-p
0.95, the engine's min-p 0.05; seed = prompt index). One sample = one prompt's generated tokens /
cycles. Details: the pooled tokens per cycle, acceptance per draft slot, and for greedy the number
of prompts whose output differs from the same engine without speculation (which must be 0).

For each (temperature, B) of `trees`: the same prompts through draft trees of budget B
(`speculative_native.native_tree_decoder` on a native backend without its own drafting, the draft
vocabulary the engine would use), rows `tree_accepted_per_cycle`; details add the accepted drafts
that were not their parent's first child (side branches).
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
import time

HELDOUT_PER_MILLE = 50                  # training/data.py: 5% of files are held out
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}
SAMPLING = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "little")
    return h % 1000 < HELDOUT_PER_MILLE


def heldout_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The held-out .py files of the stdlib, sorted by relative path (training.data.heldout_files)."""
    root = root or stdlib_root()
    rel = sorted(f.relative_to(root).as_posix() for f in root.rglob("*.py")
                 if not (_SKIP_DIRS & set(f.relative_to(root).parts)))
    return [root / p for p in rel if is_heldout(p)]


def heldout_prompts(tokenizer, n: int, length: int, root: pathlib.Path | None = None) -> list[list[int]]:
    """`n` prompts of `length` tokens from held-out stdlib files outside test directories."""
    files = [f for f in heldout_files(root)
             if not _TEST_DIRS & set(f.parts) and f.stat().st_size > 4000]
    if len(files) < n:
        raise ValueError(f"only {len(files)} held-out stdlib files under {root or stdlib_root()}, "
                         f"{n} prompts wanted")
    out = []
    for f in files[::max(1, len(files) // n)][:n]:
        src = f.read_text(encoding="utf-8", errors="replace")
        third = len(src) // 3
        starts = [i for i in (src.find("\n    def ", third), src.find("\ndef ", third)) if i >= 0]
        start = min(starts) + 1 if starts else third
        toks = tokenizer.encode(src[start:start + 8 * length])[:length]
        if len(toks) != length:
            raise ValueError(f"{f}: only {len(toks)} tokens after offset {start}, {length} wanted")
        out.append([int(t) for t in toks])
    return out


TREE_METRIC = "tree_accepted_per_cycle"


def row_params(drafts: int, temperature: float) -> dict:
    return {"drafts": drafts, "model": "trained default", "temperature": temperature}


def tree_row_params(budget: int, temperature: float) -> dict:
    return {"budget": budget, "model": "trained default", "temperature": temperature}


def tree_decoder(path: pathlib.Path, n_ctx: int, budget: int):
    """(a draft-tree SpeculativeDecoder of budget B on the native engine, its close())."""
    from ..backends.native import NativeBackend
    from ..model_file import open_model
    from ..speculative_native import native_tree_decoder
    from ..speculative_tree import TreePolicy
    from .spec import draft_vocab

    mf = open_model(path)
    be = NativeBackend(mf, n_ctx=n_ctx, draft_depth=0)
    vocab, _ = draft_vocab(str(path), be.n_vocab)

    def close() -> None:
        be.close()
        mf.close()
    return native_tree_decoder(be, TreePolicy(budget), vocab), close


def measure(model_path: str, pairs: list[tuple[float, int]], n_prompts: int, prompt_tokens: int,
            gen_tokens: int, out, time_left, trees: list[tuple[float, int]] = ()) -> None:
    """Every (temperature, drafts) in `pairs` and (temperature, budget) in `trees` becomes a result
    or a skip with its reason on `out` (bench.ours.Emitter)."""
    import openjet_plugin
    from ..backends.native import native_status
    from ..model_file import open_model
    from ..tokenizer import Tokenizer

    def skip(which, reason: str, tree_rows=()) -> None:
        for t, d in which:
            out.skip("accepted_per_cycle", row_params(d, t), reason)
        for t, b in tree_rows:
            out.skip(TREE_METRIC, tree_row_params(b, t), reason)

    trees = list(trees)
    skip_all = lambda reason: skip(pairs, reason, trees)   # noqa: E731 - every row, one reason

    n_ctx = prompt_tokens + gen_tokens + 16
    path = pathlib.Path(model_path)
    if not path.is_file():
        skip_all(f"the trained default model {path} is missing")
        return
    with open_model(path) as mf:
        ok, why = native_status(mf, n_ctx)
        has_mtp = mf.config.mtp_layer is not None
    if not ok:
        skip_all(f"native backend unavailable for {path.name}: {why}")
        return
    if not has_mtp:
        skip_all(f"{path.name} has no MTP block (nextn_predict_layers = 0): nothing drafts")
        return
    prompts = heldout_prompts(Tokenizer.from_gguf(path), n_prompts, prompt_tokens)

    def load(depth: int):
        return openjet_plugin.load(model_path=str(path), backend="native", n_ctx=n_ctx, draft_depth=depth)

    try:
        eng = load(0)
    except Exception as exc:  # noqa: BLE001 - e.g. a tensor the kernels cannot take: its message names it
        skip_all(f"the native engine could not load {path.name}: {type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
        return
    t0 = time.perf_counter()
    try:
        plain = [list(eng.generate(p, max_tokens=gen_tokens, temperature=0).tokens) for p in prompts]
        eog = sorted(int(t) for t in eng.eog_tokens) if trees else []
    finally:
        eng.close()
    per_row = time.perf_counter() - t0
    out.emit({"info": {"accept_prompts": {"model_file": path.name, "prompts": len(prompts),
                                          "prompt_tokens": prompt_tokens, "generated_tokens": gen_tokens,
                                          "source": f"held-out stdlib files under {stdlib_root()}"}}})
    for i, (temp, depth) in enumerate(pairs):
        if per_row * 2 + 10 > time_left():
            skip(pairs[i:], f"out of time: each row takes ~{per_row * 2:.0f} s", trees)
            return
        params = row_params(depth, temp)
        try:
            samples, details = _row(load, prompts, plain, temp, depth, gen_tokens)
        except Exception as exc:  # noqa: BLE001 - one row's failure is recorded and the rest go on
            out.skip("accepted_per_cycle", params, f"{type(exc).__name__}: {exc}")
            continue
        if not samples:
            out.skip("accepted_per_cycle", params, "no prompt ran a speculative cycle")
            continue
        out.result("accepted_per_cycle", params, "tokens/cycle", samples)
        out.details("accepted_per_cycle", params, details)
    for i, (temp, budget) in enumerate(trees):
        if per_row * 3 + 10 > time_left():
            skip((), f"out of time: each row takes ~{per_row * 3:.0f} s", trees[i:])
            return
        params = tree_row_params(budget, temp)
        try:
            samples, details = _tree_row(path, n_ctx, prompts, plain, eog, temp, budget, gen_tokens)
        except Exception as exc:  # noqa: BLE001 - one row's failure is recorded and the rest go on
            out.skip(TREE_METRIC, params, f"{type(exc).__name__}: {exc}")
            continue
        if not samples:
            out.skip(TREE_METRIC, params, "no prompt ran a speculative cycle")
            continue
        out.result(TREE_METRIC, params, "tokens/cycle", samples)
        out.details(TREE_METRIC, params, details)


def _tree_row(path, n_ctx: int, prompts, plain, eog, temp: float, budget: int,
              gen_tokens: int) -> tuple[list[float], dict]:
    import numpy as np

    from ..sampling import SamplingParams

    dec, close = tree_decoder(path, n_ctx, budget)
    try:
        samples, differ, tokens, cycles, side, accepted = [], [], 0, 0, 0, 0
        for k, p in enumerate(prompts):
            params = (SamplingParams(temperature=0.0) if temp == 0.0
                      else SamplingParams(temperature=temp, seed=k, **SAMPLING))
            r = dec.generate(p, params, max_tokens=gen_tokens, stop_tokens=eog, rng=np.random.default_rng(k))
            st = r.stats
            if st.cycles:
                samples.append(st.generated_tokens / st.cycles)
            tokens += st.generated_tokens
            cycles += st.cycles
            side += st.side_accepts
            accepted += st.drafts_accepted
            # the decoder emits the end-of-generation token the engine leaves out of its tokens
            if temp == 0.0 and list(r.tokens[:len(plain[k])]) != plain[k]:
                differ.append(k)
    finally:
        close()
    details = {"tokens_per_cycle": round(tokens / max(cycles, 1), 4), "generated_tokens": tokens, "cycles": cycles,
               "drafts_accepted": accepted, "side_accepts": side, "prompts": len(prompts),
               "sampling": ({"temperature": 0.0} if temp == 0.0 else {"temperature": temp, **SAMPLING})}
    if temp == 0.0:
        details["greedy_prompts_differing_from_plain"] = len(differ)
        details["greedy_differing_prompts"] = differ
    return samples, details


def _row(load, prompts, plain, temp: float, depth: int, gen_tokens: int) -> tuple[list[float], dict]:
    from ..speculative import SpeculativeStats

    eng = load(depth)
    try:
        spec = eng._speculator
        if spec is None:
            raise RuntimeError(f"the engine does not speculate at draft depth {depth} "
                               f"(backend {eng.backend_name}: {eng.backend_reason})")
        spec.policy.adaptive = False            # D drafts every cycle: acceptance per depth
        total = SpeculativeStats(spec.policy.depth)
        samples, differ, tokens, cycles = [], [], 0, 0
        for k, p in enumerate(prompts):
            r = eng.generate(p, max_tokens=gen_tokens, temperature=temp, seed=k, **SAMPLING)
            if r.stats.cycles:
                samples.append(r.stats.generated_tokens / r.stats.cycles)
            tokens += r.stats.generated_tokens
            cycles += r.stats.cycles
            total = total.merge(spec.stats)
            if temp == 0.0 and list(r.tokens) != plain[k]:
                differ.append(k)
    finally:
        eng.close()
    details = {"tokens_per_cycle": round(tokens / max(cycles, 1), 4), "generated_tokens": tokens,
               "cycles": cycles, "acceptance_at": [round(total.acceptance_at(i), 4) for i in range(depth)],
               "drafts_proposed": total.drafts_proposed, "drafts_accepted": total.drafts_accepted,
               "prompts": len(prompts), "sampling": ({"temperature": 0.0} if temp == 0.0
                                                     else {"temperature": temp, **SAMPLING})}
    if temp == 0.0:
        details["greedy_prompts_differing_from_plain"] = len(differ)
        details["greedy_differing_prompts"] = differ
    return samples, details
