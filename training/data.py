"""The training corpus: the Python standard library's source files, plus their docstrings as prose.

Every `.py` file under the running interpreter's stdlib (tests included; site-/dist-packages and
caches excluded) is one document, and the docstrings of each file (module, classes, functions,
`inspect.cleandoc`-ed) are one more document of prose. Documents are tokenized with the shipped BPE
vocabulary and each is followed by `<|endoftext|>` (Qwen's document separator).

The held-out split is by file and depends only on the file's path relative to the stdlib root
(sha256 of the path), so a file is held out under every Python version, and its docstrings are
held out with it. Licence of the data: the Python Software Foundation License (the stdlib's
LICENSE.txt), which allows use and redistribution of derived works.

    python -m training.data build --out training/build/corpus.npz
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import pathlib
import sys
import sysconfig
from dataclasses import dataclass
from multiprocessing import Pool

import numpy as np

from .light_import import REPO, openjet_module

HELDOUT_PER_MILLE = 50          # 5% of files
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
SEPARATOR = "<|endoftext|>"


def load_tokenizer():
    """The shipped BPE vocabulary as a Tokenizer (same arrays the GGUF writer puts in the file)."""
    tok_mod = openjet_module("tokenizer")
    doc = json.loads((REPO / "openjet_plugin" / "data" / "bpe_vocab.json").read_text(encoding="utf-8"))
    tokens = list(doc["tokens"])
    types_ = [tok_mod.TOKEN_NORMAL] * len(tokens)
    for st in doc["special_tokens"]:
        tokens.append(st["text"])
        types_.append(int(st["type"]))
    return tok_mod.Tokenizer(tokens, types_, doc["merges"], eos_id=None, pre=doc.get("pre", "qwen35"))


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path | None = None) -> list[str]:
    """Relative posix paths of the stdlib's .py files, sorted."""
    root = root or stdlib_root()
    out = [f.relative_to(root).as_posix() for f in root.rglob("*.py")
           if not (_SKIP_DIRS & set(f.relative_to(root).parts))]
    return sorted(out)


def is_heldout(relpath: str) -> bool:
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "little")
    return h % 1000 < HELDOUT_PER_MILLE


def heldout_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The held-out files of this interpreter's stdlib (for evaluation and speculative benchmarks)."""
    root = root or stdlib_root()
    return [root / p for p in stdlib_files(root) if is_heldout(p)]


def docstrings(source: str) -> str:
    """The file's docstrings joined as prose, or '' when it has none or does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=False)
            if d and d.strip():
                parts.append(inspect.cleandoc(d))
    return "\n\n".join(parts)


_TOK = None


def _encode_file(args: tuple[str, str]) -> tuple[str, list[int], list[int]]:
    global _TOK
    if _TOK is None:
        _TOK = load_tokenizer()
    root, rel = args
    text = (pathlib.Path(root) / rel).read_text(encoding="utf-8", errors="replace")
    sep = _TOK.special_tokens[SEPARATOR]
    code = _TOK.encode(text, parse_special=False) + [sep]
    prose = docstrings(text)
    prose_ids = _TOK.encode(prose, parse_special=False) + [sep] if prose else []
    return rel, code, prose_ids


@dataclass
class Corpus:
    train: np.ndarray        # uint16 token stream
    heldout: np.ndarray      # uint16 token stream
    meta: dict

    def save(self, path: str | pathlib.Path) -> None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, train=self.train, heldout=self.heldout,
                 meta=np.frombuffer(json.dumps(self.meta).encode("utf-8"), dtype=np.uint8))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "Corpus":
        try:
            z = np.load(path)
            return cls(train=z["train"], heldout=z["heldout"],
                       meta=json.loads(bytes(z["meta"]).decode("utf-8")))
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a corpus file written by training/data.py ({e})") from None


def build_corpus(root: pathlib.Path | None = None, workers: int = 1, limit_files: int | None = None) -> Corpus:
    """Tokenize the stdlib. Documents keep the sorted-path order (code, then its docstrings)."""
    root = root or stdlib_root()
    files = stdlib_files(root)
    if limit_files is not None:
        # a deterministic small sample (tests): every k-th file, so both splits stay represented
        step = max(1, len(files) // limit_files)
        files = files[::step][:limit_files]
        if not any(is_heldout(f) for f in files):
            files.append(next(f for f in stdlib_files(root) if is_heldout(f)))
    jobs = [(str(root), rel) for rel in files]
    if workers > 1:
        with Pool(workers) as pool:
            results = pool.map(_encode_file, jobs, chunksize=8)
    else:
        results = [_encode_file(j) for j in jobs]
    train: list[int] = []
    held: list[int] = []
    n_code = {"train": 0, "heldout": 0}
    n_prose = {"train": 0, "heldout": 0}
    held_names = []
    for rel, code, prose in results:
        split = "heldout" if is_heldout(rel) else "train"
        dst = held if split == "heldout" else train
        dst.extend(code)
        dst.extend(prose)
        n_code[split] += len(code)
        n_prose[split] += len(prose)
        if split == "heldout":
            held_names.append(rel)
    tr = np.asarray(train, dtype=np.uint16)
    he = np.asarray(held, dtype=np.uint16)
    meta = {
        "python": sys.version.split()[0],
        "stdlib_root": str(root),
        "n_files": len(files),
        "heldout_files": held_names,
        "tokens": {"train": int(tr.size), "heldout": int(he.size)},
        "code_tokens": n_code,
        "docstring_tokens": n_prose,
        "sha256": hashlib.sha256(tr.tobytes() + he.tobytes()).hexdigest(),
        "licence": "Python Software Foundation License (stdlib LICENSE.txt)",
    }
    return Corpus(tr, he, meta)


def unigram_perplexity(train: np.ndarray, heldout: np.ndarray, n_vocab: int) -> float:
    """Held-out perplexity of the add-one-smoothed unigram distribution of the training tokens."""
    counts = np.bincount(train.astype(np.int64), minlength=n_vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[heldout.astype(np.int64)].mean()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenize the stdlib into an .npz corpus")
    b.add_argument("--out", required=True)
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--limit-files", type=int, default=None)
    h = sub.add_parser("heldout", help="print the held-out files of this interpreter's stdlib")
    h.add_argument("--non-test", action="store_true", help="only files outside test directories")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        c = build_corpus(workers=args.workers, limit_files=args.limit_files)
        c.save(args.out)
        print(json.dumps({k: v for k, v in c.meta.items() if k != "heldout_files"}, indent=1))
    else:
        for f in heldout_files():
            if args.non_test and {"test", "tests", "idle_test"} & set(f.parts):
                continue
            print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
