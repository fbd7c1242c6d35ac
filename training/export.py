"""Trained torch weights -> a qwen35 GGUF with the project's tokenizer and chat template.

    python -m training.export --weights OUT/mtp-weights-*.pt --preset default --out model.gguf \
        [--quant Q8_0] [--summary OUT/summary.json]

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
    import gguf
    from openjet_plugin.config import ARCH
    from openjet_plugin.testing import bpe, synth

    specs = check_tensors(cfg, arrays)
    w = gguf.GGUFWriter(os.fspath(path), ARCH)
    try:
        w.add_name(name)
        w.add_type("model")
        w.add_file_type(0)
        w.add_license(LICENCE)
        w.add_description(DATA_NOTE)
        for key, value in cfg.gguf_metadata().items():
            if isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            elif isinstance(value, (list, tuple)):
                w.add_array(key, list(value))
            else:
                raise TypeError(f"metadata key {key!r}: cannot write a value of type {type(value).__name__}")
        vocab = bpe.vocab_arrays(cfg.n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(bpe.PRE_TOKENIZER)
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.token_types)
        w.add_token_merges(vocab.merges)
        w.add_eos_token_id(vocab.eos_id)
        w.add_bos_token_id(vocab.bos_id)
        w.add_pad_token_id(vocab.bos_id)
        w.add_add_bos_token(False)
        w.add_chat_template(synth.CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"))
        for key, value in (provenance or {}).items():
            if isinstance(value, float):
                w.add_float32(f"openjet.training.{key}", value)
            elif isinstance(value, int):
                w.add_uint64(f"openjet.training.{key}", value)
            else:
                w.add_string(f"openjet.training.{key}", str(value))
        for s in specs:
            w.add_tensor(s.name, np.ascontiguousarray(arrays[s.name], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


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
    ap.add_argument("--weights", nargs="+", required=True, help="weights-NN.pt shards of one run")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", default="Q8_0")
    ap.add_argument("--summary", default=None, help="summary.json from training.report (provenance keys)")
    ap.add_argument("--max-mb", type=float, default=MAX_MB)
    args = ap.parse_args(argv)

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
