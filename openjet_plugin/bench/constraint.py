"""The cost of constrained decoding per token on the q27b's vocabulary size (CPU only).

One step is what the engine does around each draw of a constrained request (constraints.py):
llguidance's token mask for the next position, the mask applied to a `[n_vocab]` float32 logits
row, and the drawn token fed to the grammar. The workload is a JSON-schema reply (an object with
strings, an integer, an enum array and a nested object) written token by token; each sample is
one new request (a fresh GrammarState, as every request gets) and is its mean step time in µs.
A decode step of the 27B is ~10 ms: the target is under 5 % of it (500 µs).

The vocabulary: `--vocab GGUF` reads the bench's model's (a real Qwen3.5 GGUF, or llama.cpp's
models/ggml-vocab-qwen35.gguf: the 248,320 tokens Qwen3.5 ships). Where that vocabulary is mostly
UNUSED padding (the synthetic q27b: 4K real tokens, which no grammar would time fairly: padding is
never allowed) or no --vocab is given, a stand-in of the same size is built from the default
model's 4K real tokens and pairs of them. The stand-in is the harder case: its tokens come from
Python source, so a JSON string's mask (no newline, no quote) is scattered over the whole
vocabulary.
Writes JSON lines: {"metric", "params", "samples"} and {"info"}.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

Q27B_VOCAB = 248_320
DECODE_STEP_MS = 10.0

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string"}, "country": {"type": "string", "maxLength": 40},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "units": {"type": "array", "items": {"enum": ["celsius", "fahrenheit", "kelvin"]}},
                         "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"},
                                                                     "note": {"type": "string"}},
                                    "required": ["hourly", "note"], "additionalProperties": False}},
          "required": ["city", "country", "days", "units", "detail"], "additionalProperties": False}
REPLY = {"city": "San Francisco", "country": "United States of America", "days": 7,
         "units": ["celsius", "fahrenheit"],
         "detail": {"hourly": True, "note": "Fog in the morning, clearing by noon; wind from the west."}}


def standin_vocabulary(n_vocab: int = Q27B_VOCAB) -> tuple[list[bytes], int]:
    """(token bytes, end-of-generation id): the default model's real tokens, then distinct pairs
    of them in a fixed random order up to n_vocab - 1, then one control token."""
    from openjet_plugin.defaults import default_model_path
    from openjet_plugin.tokenizer import TOKEN_NORMAL, Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    real = [tok.token_to_piece(i) for i in range(tok.n_vocab) if tok.token_types[i] == TOKEN_NORMAL]
    seen = set(real)
    out = list(real)
    g = np.random.default_rng(0)
    while len(out) < n_vocab - 1:
        a, b = g.integers(0, len(real), size=(2, 65536))
        for i, j in zip(a.tolist(), b.tolist()):
            piece = real[i] + real[j]
            if piece not in seen:
                seen.add(piece)
                out.append(piece)
                if len(out) == n_vocab - 1:
                    break
    out.append(b"<|im_end|>")
    return out, len(out) - 1


def _greedy_encoder(pieces: list[bytes], specials: set[int]):
    """Longest match first: enough for llguidance's needs here (it tokenises no prompt)."""
    by_bytes = {p: i for i, p in enumerate(pieces) if p and i not in specials}
    longest = max(len(p) for p in by_bytes)

    def encode(text: bytes) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for n in range(min(longest, len(text) - i), 0, -1):
                t = by_bytes.get(text[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                raise ValueError(f"byte {text[i]:#x} has no token")
        return out
    return encode


def compiler_for(vocab_path: str | None, n_vocab: int = Q27B_VOCAB):
    """(ConstraintCompiler, encode, source): the vocabulary the row is measured on."""
    from openjet_plugin.constraints import ConstraintCompiler

    if vocab_path:
        from openjet_plugin.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer

        tok = Tokenizer.from_gguf(vocab_path)
        if sum(ty == TOKEN_NORMAL for ty in tok.token_types) < tok.n_vocab // 2:
            return compiler_for(None, n_vocab)[:2] + (f"stand-in ({vocab_path} is mostly padding)",)
        eog = [i for i, (t, ty) in enumerate(zip(tok.tokens, tok.token_types))
               if ty == TOKEN_CONTROL and t in ("<|im_end|>", "<|endoftext|>")] or [tok.eos_id]
        comp = ConstraintCompiler.from_tokenizer(tok, eog, max(n_vocab, tok.n_vocab))
        return comp, (lambda b: tok.encode(b, parse_special=False)), vocab_path
    pieces, eos = standin_vocabulary(n_vocab)
    encode = _greedy_encoder(pieces, {eos})
    return ConstraintCompiler(pieces, [eos], [eos], len(pieces), encode), encode, "stand-in"


def measure(comp, encode, reps: int) -> list[float]:
    """Mean µs per constrained step over REPLY, one sample per fresh request."""
    from openjet_plugin.constraints import Constraint

    c = Constraint.json_schema(SCHEMA)
    tokens = encode(json.dumps(REPLY).encode())
    logits = np.random.default_rng(1).normal(size=comp.n_vocab).astype(np.float32)
    samples = []
    for rep in range(reps + 1):                # the first request is the warm-up
        state = comp.state(c)
        t0 = time.perf_counter()
        for t in tokens:
            masked = state.mask_logits(logits, state.allowed())
            if not np.isfinite(masked[t]):
                raise RuntimeError(f"the grammar refused token {t} of the reply")
            state.consume(t)
        dt = time.perf_counter() - t0
        if not state.allowed()[list(comp.eog_tokens)[0]]:
            raise RuntimeError("the reply did not complete the grammar")
        if rep:
            samples.append(dt / len(tokens) * 1e6)
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default=None, help="a GGUF whose vocabulary to use (default: the stand-in)")
    ap.add_argument("--n-vocab", type=int, default=Q27B_VOCAB, help="the stand-in's size")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", default=None, help="append JSON lines here (default: print them)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    comp, encode, source = compiler_for(args.vocab, args.n_vocab)
    setup_s = time.perf_counter() - t0
    samples = measure(comp, encode, args.reps)
    median = float(np.median(samples))
    lines = [{"metric": "constraint_mask_us", "params": {"n_vocab": comp.n_vocab, "grammar": "json_schema"},
              "samples": samples},
             {"info": {"constraint": {"vocabulary": source, "n_vocab": comp.n_vocab,
                                      "tokenizer_setup_s": round(setup_s, 2),
                                      "share_of_10ms_step": round(median / (DECODE_STEP_MS * 1e3), 4)}}}]
    text = "".join(json.dumps(x) + "\n" for x in lines)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
