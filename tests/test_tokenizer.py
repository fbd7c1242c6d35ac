"""The pure-Python tokenizer gives llama.cpp's token ids, and the shipped BPE vocabulary is sound."""

from __future__ import annotations

import json
import random
import sys
import sysconfig
import unicodedata
from pathlib import Path

import pytest
import regex

from openjet_plugin.errors import InvalidMetadataError, MissingKeyError, NotGGUFError
from openjet_plugin.testing import bpe
from openjet_plugin.tokenizer import Tokenizer, read_gguf_metadata, split_words

llama_cpp = pytest.importorskip("llama_cpp")

CURATED = [
    "def f(x):\n    return x ** 2  # square\n\n\nclass A(object):\n\tpass\r\n",
    "The quick brown fox jumps over the lazy dog. It's, we'll, they're, I'd, I'M, YOU'LL",
    "日本語のテキストと中文混合 한국어 emoji 😀👍🏽 🇫🇷 café naïve résumé Ångström",
    "   leading   and trailing spaces   ",
    "\n\n\n   \n\t\t x",
    "1234567890 3.14159 1e-10 0xFF 1,000,000",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "a<tool_call>b</tool_call><tool_response>x</tool_response><|endoftext|>",
    "<|im_end|><|im_end|><think><think></think>",
    "e\u0301 a\u0300\u0301b \u0301\u0301 x\u0308y",            # combining marks (qwen35 keeps them in words)
    "'s 'S 'll 'LL 're 've 'd 'm 't 'x '",
    "",
    " ",
    "  ",
    "\u00a0\u2003x\u3000y\u2028z\x85w",                         # Unicode White_Space
    "\x1c\x1d\x1e\x1f",                                        # str.isspace() but not White_Space
    "!!! ??? ... ---\n\n",
    "a\r\nb\rc\n\r\nd",
    "    if x:\n        y = {'a': [1, 2, 3]}\n",
    "x" * 300,
    "nul\x00byte \x00\x01\x7f",
]


@pytest.fixture(scope="module")
def model_path(synth_path) -> Path:
    return synth_path("tiny", "Q8_0")


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def llama_vocab(model_path):
    return llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)


def _assigned(cp: int) -> bool:
    # code points newer than Python's Unicode tables may be classified differently by llama.cpp's
    # own (newer) table; stay within what both know
    return unicodedata.category(chr(cp)) != "Cn"


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    ranges = [range(32, 127)] * 6 + [range(0xA0, 0x250), range(0x300, 0x370), range(0x400, 0x500),
                                      range(0x900, 0x980), range(0x3040, 0x30FF), range(0x4E00, 0x4F00),
                                      range(0xAC00, 0xAC80), range(0x1F300, 0x1F650), range(0x2000, 0x2070)]
    pool = [chr(c) for r in ranges for c in r if _assigned(c)]
    pool += [" ", "  ", "   ", "\n", "\r\n", "\t", "'s", "'", "<|im_end|>", "<|im_start|>", "<think>",
             "</tool_call>", "123", "def ", " the", "self.", "\u200d", "\ufeff"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 80))) for _ in range(n)]


def _llama_ids(llm, text: str, special: bool = True) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)


@pytest.mark.parametrize("text", CURATED)
def test_curated_samples_match_llama_cpp(tok, llama_vocab, text):
    assert tok.encode(text) == _llama_ids(llama_vocab, text)
    assert tok.encode(text, parse_special=False) == _llama_ids(llama_vocab, text, special=False)


def test_random_strings_match_llama_cpp(tok, llama_vocab):
    texts = random_texts(seed=1234, n=400)
    mismatches = [t for t in texts if tok.encode(t) != _llama_ids(llama_vocab, t)]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, first: {mismatches[0]!r}"


def test_stdlib_sources_match_llama_cpp(tok, llama_vocab):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    files = random.Random(7).sample(files, 12)
    total = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        ids = tok.encode(text)
        total += len(ids)
        assert ids == _llama_ids(llama_vocab, text), f"{f} tokenizes differently"
    assert total > 10_000


def test_decode_matches_llama_cpp_and_round_trips(tok, llama_vocab):
    for text in CURATED + random_texts(seed=99, n=100):
        ids = tok.encode(text)
        assert tok.decode_bytes(ids) == llama_vocab.detokenize(ids)
        assert tok.decode_bytes(ids, special=True) == llama_vocab.detokenize(ids, special=True)
        assert tok.decode(ids, special=True) == text


def test_special_tokens(tok, llama_vocab):
    for text, ty in bpe.SPECIAL_TOKENS:
        tid = tok.special_tokens[text]
        assert tok.encode(text) == [tid] == _llama_ids(llama_vocab, text)
        assert tok.token_types[tid] == ty
    assert tok.eos_id == tok.special_tokens["<|im_end|>"] == llama_vocab.token_eos()
    assert tok.bos_id == tok.special_tokens["<|endoftext|>"]
    assert not tok.add_bos
    # control tokens are text unless special parsing is on; think/tool markers always parse
    assert len(tok.encode("<|im_end|>", parse_special=False)) > 1
    assert tok.encode("<think>", parse_special=False) == [tok.special_tokens["<think>"]]
    # rendering: control tokens only on request, user-defined ones always
    assert tok.decode([tok.eos_id]) == ""
    assert tok.decode([tok.eos_id], special=True) == "<|im_end|>"
    assert tok.decode([tok.special_tokens["</think>"]]) == "</think>"


def test_add_special_follows_the_file(tok, llama_vocab):
    # Qwen does not add a BOS; llama.cpp with add_bos=True agrees
    assert tok.encode("hi", add_special=True) == llama_vocab.tokenize(b"hi", add_bos=True, special=True)


def test_padded_27b_vocabulary(tmp_path_factory):
    """The q27b vocabulary (248,320 rows, UNUSED [PADn] placeholders) tokenizes as llama.cpp does."""
    from openjet_plugin.config import PRESETS
    from openjet_plugin.testing.synth import synth_vocab_only

    path = synth_vocab_only(tmp_path_factory.mktemp("vocab") / "q27b-vocab.gguf", "q27b")
    tok = Tokenizer.from_gguf(path)
    assert tok.n_vocab == PRESETS["q27b"].n_vocab
    assert tok.tokens[-1] == f"[PAD{tok.n_vocab - 1}]" and tok.token_types[-1] == bpe.TOKEN_UNUSED
    assert "[PAD5000]" not in tok.special_tokens
    assert tok.decode([tok.n_vocab - 1]) == ""
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    assert llm.n_vocab() == tok.n_vocab
    for text in CURATED[:8] + random_texts(seed=5, n=50) + ["[PAD5000] [PAD248319]"]:
        assert tok.encode(text) == _llama_ids(llm, text), repr(text)


def test_reader_and_path_give_the_same_tokenizer(model_path, tok):
    import gguf

    via_reader = Tokenizer.from_gguf(gguf.GGUFReader(model_path))
    assert via_reader.tokens == tok.tokens and via_reader.token_types == tok.token_types
    assert via_reader.eos_id == tok.eos_id and via_reader.pre == tok.pre == "qwen35"
    text = CURATED[0] + CURATED[2]
    assert via_reader.encode(text) == tok.encode(text)


def test_metadata_reader_agrees_with_gguf_package(model_path):
    import gguf

    fast = read_gguf_metadata(model_path)
    reader = gguf.GGUFReader(model_path)
    assert set(fast) == set(reader.fields) - {k for k in reader.fields if k.startswith("GGUF.")}
    for key in ("general.architecture", "qwen35.block_count", "qwen35.rope.dimension_sections",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert fast[key] == reader.fields[key].contents(), key


def test_bad_files_give_clear_errors(tmp_path, model_path):
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello, this is not a model\n" * 3)
    with pytest.raises(NotGGUFError, match="notes.txt"):
        Tokenizer.from_gguf(not_gguf)
    meta = read_gguf_metadata(model_path, prefix="tokenizer.")
    with pytest.raises(InvalidMetadataError, match="tokenizer.ggml.pre"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "llama-bpe"}, source="x.gguf")
    without = {k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(MissingKeyError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata(without, source="x.gguf")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer.from_metadata(meta).decode([10**6])


# --- the pre-tokenizer and the shipped vocabulary -------------------------------------------------

def test_splitter_equals_the_qwen35_regex():
    """Our port of llama.cpp's hand-written qwen35 splitter equals the tokenizer.json expression
    (as the `regex` package runs it) on text of characters both Unicode tables know."""
    pattern = regex.compile(bpe.QWEN35_PATTERN)
    texts = [t.replace("<|im_end|>", "") for t in CURATED + random_texts(seed=3, n=300)]
    for text in texts:
        assert split_words(text) == pattern.findall(text), repr(text)


def test_shipped_vocabulary_is_consistent():
    doc = bpe.load_shipped()
    assert doc["pre"] == bpe.PRE_TOKENIZER and doc["model"] == "gpt2"
    tokens = doc["tokens"]
    assert len(tokens) + len(doc["special_tokens"]) == bpe.VOCAB_SIZE == 4096
    assert len(set(tokens)) == len(tokens)
    assert tokens[:256] == [bpe.BYTE_TO_CHAR[b] for b in range(256)]
    known = set(tokens)
    for m in doc["merges"]:
        a, b = m.split(" ")
        assert a in known and b in known and a + b in known, m
    assert bpe.VOCAB_FILE.stat().st_size < 400_000
    # the vocabulary was learned from Python: common code words are single tokens
    tok_ids = {t: i for i, t in enumerate(tokens)}
    for word in ("Ġself", "Ġreturn", "def", "Ġimport", "Ġthe"):
        assert word in tok_ids, word


def test_bytes_to_unicode_is_gpt2s_map():
    m = bpe.bytes_to_unicode()
    assert len(set(m.values())) == 256
    assert m[ord("A")] == "A" and m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ"


def test_trainer_is_deterministic_and_learns_frequent_pairs():
    texts = ["the cat sat on the mat. " * 20, "def the_function(self):\n    return self.the\n" * 10,
             "Lorem ipsum dolor sit amet, consectetur adipiscing elit" * 3]
    a = bpe.train(bpe.count_words(texts), 256 + 30)
    b = bpe.train(bpe.count_words(list(texts)), 256 + 30)
    assert a.merges == b.merges and a.tokens == b.tokens
    assert len(a.tokens) == 286
    assert a.merges[:2] == [("a", "t"), ("h", "e")]   # the most frequent pairs first
    assert "Ġthe" in a.tokens and "Ġcat" in a.tokens
    with pytest.raises(ValueError, match="corpus too small"):
        bpe.train(bpe.count_words(["ab"]), 300)


@pytest.mark.slow
def test_retraining_reproduces_the_shipped_file():
    doc = bpe.load_shipped()
    if doc["source"]["python"] != sys.version.split()[0]:
        pytest.skip(f"shipped vocabulary was trained on Python {doc['source']['python']}; "
                    f"the stdlib of {sys.version.split()[0]} differs")
    fresh = bpe.train_from_stdlib()
    if fresh["source"]["sha256"] != doc["source"]["sha256"]:
        pytest.skip("this installation's stdlib text differs from the one the vocabulary was trained on")
    assert json.loads(json.dumps(fresh, ensure_ascii=False)) == doc
