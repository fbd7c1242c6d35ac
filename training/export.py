"""Trained torch weights -> a qwen35 GGUF with the project's tokenizer and chat template.

    python -m training.export --weights OUT/mtp-weights-*.pt --preset default --out model.gguf \
        [--quant Q8_0] [--summary OUT/summary.json]
    python -m training.export --retemplate openjet_plugin/data/default.gguf   # template only

The tensors are checked against `openjet_plugin.tensors.all_tensors` (names and shapes), written
as F32 with the metadata of `ModelConfig.gguf_metadata()` and the shipped BPE vocabulary, then
quantised by llama.cpp's own quantiser (`testing.synth.llama_quantize`). The file must stay under
--max-mb (25 MB: what the package can embed).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

from .light_import import model_config

MAX_MB = 25.0
LICENCE = "MIT"
DATA_NOTE = ("trained on the Python standard library's source and docstrings "
             "(Python Software Foundation License)")


def check_tensors(cfg, arrays: dict[str, np.ndarray]) -> list:
    """The TensorSpecs to write, in tensors.py's order; a missing, extra or misshapen tensor is an error."""
    from openjet_plugin.tensors import all_tensors

    specs = [s for s in all_tensors(cfg) if s.name in arrays or s.required]
    want = {s.name for s in specs}
    missing = sorted(want - set(arrays))
    extra = sorted(set(arrays) - {s.name for s in all_tensors(cfg)})
    if missing or extra:
        raise ValueError(f"exported tensors do not match tensors.py: missing {missing}, unknown {extra}")
    for s in specs:
        shape = tuple(reversed(s.ne))
        if tuple(arrays[s.name].shape) != shape:
            raise ValueError(f"tensor {s.name}: shape {arrays[s.name].shape}, tensors.py wants {shape} (ne={s.ne})")
        if not np.all(np.isfinite(arrays[s.name])):
            raise ValueError(f"tensor {s.name} has non-finite values")
    return specs


def write_f32_gguf(path: pathlib.Path, cfg, arrays: dict[str, np.ndarray], name: str,
                   provenance: dict[str, object] | None = None) -> None:
    """An F32 qwen35 GGUF of `arrays` (GGUF numpy layout) with the shipped tokenizer and template."""
    from openjet_plugin.testing import synth

    specs = check_tensors(cfg, arrays)
    extra: dict[str, object] = {"general.license": LICENCE, "general.description": DATA_NOTE}
    for key, value in (provenance or {}).items():
        extra[f"openjet.training.{key}"] = value if isinstance(value, (int, float)) else str(value)
    synth.write_gguf(path, cfg, {s.name: arrays[s.name] for s in specs}, name=name,
                     file_type=synth.FTYPES["F32"], extra_metadata=extra)


def retemplate(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> pathlib.Path:
    """Give an exported GGUF the current chat_template.jinja (e.g. the embedded default after a
    template fix) without re-exporting: every tensor is copied byte for byte. In place when
    `dst` is None (through a temporary file next to `src`)."""
    from openjet_plugin.testing import synth

    src = pathlib.Path(src)
    out = pathlib.Path(dst) if dst is not None else src
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        synth.rewrite_chat_template(src, tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def export(model, out: str | os.PathLike, quant: str = "Q8_0", name: str = "openjet-default",
           provenance: dict | None = None, max_mb: float | None = MAX_MB) -> pathlib.Path:
    """Write `model` (a training.qwen35_torch.Qwen35) to `out`; quant "F32" skips quantisation."""
    from openjet_plugin.testing import synth

    out = pathlib.Path(out)
    arrays = model.gguf_tensors()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.f32.tmp")
    try:
        write_f32_gguf(tmp, model.cfg, arrays, name, provenance)
        if quant == "F32":
            os.replace(tmp, out)
        else:
            if quant not in synth.FTYPES:
                raise ValueError(f"quant {quant!r} is not one of {', '.join(synth.FTYPES)}")
            synth.llama_quantize(tmp, out, quant)
    finally:
        if tmp.exists():
            tmp.unlink()
    mb = out.stat().st_size / 1e6
    if max_mb is not None and mb > max_mb:
        raise ValueError(f"{out}: {mb:.2f} MB is over the {max_mb} MB limit for the embedded model")
    return out


def main(argv=None) -> int:
    import torch

    from .qwen35_torch import Qwen35
    from .train import load_weights

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", nargs="+", help="weights-NN.pt shards of one run")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--out")
    ap.add_argument("--retemplate", metavar="GGUF", default=None,
                    help="only give GGUF the current chat_template.jinja (tensors unchanged), in place or to --out")
    ap.add_argument("--quant", default="Q8_0")
    ap.add_argument("--summary", default=None, help="summary.json from training.report (provenance keys)")
    ap.add_argument("--max-mb", type=float, default=MAX_MB)
    args = ap.parse_args(argv)
    if args.retemplate:
        path = retemplate(args.retemplate, args.out)
        print(f"{path}: chat template replaced, tensors unchanged")
        return 0
    if not args.weights or not args.out:
        ap.error("--weights and --out are required (unless --retemplate)")

    cfg = model_config(args.preset)
    model = Qwen35(cfg)
    load_weights(args.weights, model)
    prov = {}
    if args.summary:
        s = json.loads(pathlib.Path(args.summary).read_text())
        log = s["runs"][s["shipped"]]
        fe = log["final_eval"]
        prov = {"run": s["shipped"], "seed": int(log["args"]["seed"]), "steps": int(log["steps"]),
                "tokens_seen": int(log["tokens_seen"]), "heldout_ppl": float(fe["main_ppl"]),
                "unigram_ppl": float(log["unigram_ppl"]), "corpus_sha256": log["corpus"]["sha256"],
                "python": log["corpus"]["python"]}
    with torch.no_grad():
        path = export(model, args.out, args.quant, provenance=prov, max_mb=args.max_mb)
    print(f"{path}: {path.stat().st_size / 1e6:.2f} MB ({args.quant})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
