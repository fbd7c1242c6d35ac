"""Replay the fuzz corpus (tests/fuzz_corpus): every minimised crasher and hand-made edge case must
now end in a documented loader error (or load), within the per-case time limit, in a worker that
survives. The fuzzer itself (python -m openjet_plugin.fuzz) is run briefly to prove it works."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from openjet_plugin import fuzz

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
CASE_LIMIT_S = 10.0


def test_corpus_is_present_and_small():
    files = fuzz.corpus_files(CORPUS)
    assert len(files) >= len(fuzz.edge_cases()), "the hand-made edge cases belong in the corpus"
    for p in files:
        assert p.stat().st_size < 256 << 10, f"{p.name} is too large for a corpus file"


def test_corpus_replays_with_documented_errors_only():
    t0 = time.monotonic()
    results = fuzz.replay(CORPUS, case_timeout=CASE_LIMIT_S)
    elapsed = time.monotonic() - t0
    failures = [f"{p.name}: {o.status} {o.signature}\n{o.detail}" for p, o in results if o.finding]
    assert not failures, "\n\n".join(failures)
    assert len(results) == len(fuzz.corpus_files(CORPUS))
    # bounded: the whole corpus in well under a second per case
    assert elapsed < 2.0 * len(results) + 20, f"replay took {elapsed:.1f} s"


def test_every_case_reaches_the_loader():
    """Each corpus file is rejected (or loaded) by open_model itself, not by something earlier."""
    results = fuzz.replay(CORPUS, case_timeout=CASE_LIMIT_S)
    for p, o in results:
        assert o.signature.startswith("open_model:"), f"{p.name}: {o.signature}"


def test_runner_reports_undocumented_errors_hangs_and_crashes(tmp_path, monkeypatch):
    """The fuzzer's own failure detection: an escaping exception, a hang and a dead worker each
    come back as a finding (checked through worker functions that misbehave on purpose)."""
    case = tmp_path / "x.gguf"
    case.write_bytes(b"GGUF")
    with fuzz.Runner(timeout=2.0) as runner:
        ok = runner.run(case)
        assert ok.status == "ok" and ok.signature.startswith("open_model:TruncatedFileError")
        # a missing file is a documented error too
        missing = runner.run(tmp_path / "absent.gguf")
        assert missing.status == "ok" and "open_model:FileNotFoundError" in missing.signature
    # a worker that hangs or dies: run a Runner whose worker target misbehaves
    monkeypatch.setattr(fuzz, "_worker_main", _misbehaving_worker)
    with fuzz.Runner(timeout=1.0) as runner:
        assert runner.run("hang").status == "hang"
        assert runner.run("crash").status == "crash"
        bad = runner.run("raise")
        assert bad.status == "bad" and "KeyError" in bad.signature
        assert runner.restarts == 2


def _misbehaving_worker(conn):
    conn.send("ready")
    while True:
        path = conn.recv()
        if path is None:
            return
        if path == "hang":
            time.sleep(60)
        elif path == "crash":
            import os
            os._exit(139)
        else:
            conn.send(("bad", "open_model|KeyError|x.py:1", "KeyError"))


def test_layout_and_mutations_are_deterministic(tmp_path):
    (seed,) = [p for p in fuzz.make_seeds(tmp_path, include_tiny=False) if "F16" in p.name]
    data = seed.read_bytes()
    lay = fuzz.parse_layout(data)
    assert 0 < lay.tensor_info_start < lay.data_start < len(data)
    assert len(lay.tensor_entries) == 71 and lay.kv_entries
    a = fuzz.Mutator(random.Random(7)).mutate(data, lay)
    b = fuzz.Mutator(random.Random(7)).mutate(data, lay)
    assert a == b and a[0] != data


def test_minimise_keeps_the_failure(tmp_path, monkeypatch):
    """Minimising a finding gives a smaller file with the same signature."""
    data = fuzz.edge_cases()["edge-huge-kv-count"] + bytes(200)
    with fuzz.Runner(timeout=5.0) as runner:
        probe = tmp_path / "p.gguf"
        probe.write_bytes(data)
        sig = runner.run(probe).signature
        small = fuzz.minimise(data, sig, runner, tmp_path, budget_s=20)
        probe.write_bytes(small)
        assert runner.run(probe).signature == sig
    assert len(small) < len(data)


@pytest.mark.slow
def test_fuzz_command_runs(tmp_path):
    """A short fuzz run over the micro seeds: executes cases and finds nothing."""
    st = fuzz.fuzz(20, tmp_path / "corpus", seed=123, workdir=tmp_path / "seeds", include_tiny=False,
                   log=lambda *_: None)
    assert st.executions > 50
    assert not st.findings, st.findings
    assert sum(v for k, v in st.outcomes.items() if k == "open_model:ok") > 0   # some cases load


@pytest.mark.parametrize("key,value", [
    ("tokenizer.ggml.tokens", 5),
    ("tokenizer.ggml.tokens", [1, 2]),
    ("tokenizer.ggml.merges", 1.5),
    ("tokenizer.ggml.merges", [1, 2]),
    ("tokenizer.ggml.token_type", ["a"]),
    ("tokenizer.ggml.eos_token_id", "a"),
    ("tokenizer.ggml.eos_token_id", []),
    ("tokenizer.ggml.bos_token_id", 1.0),
])
def test_tokenizer_metadata_of_the_wrong_type_names_the_key(key, value):
    """Type confusion the fuzzer found (retyped metadata values): each is an InvalidMetadataError
    naming the key, not a TypeError/ValueError from inside the tokenizer."""
    from openjet_plugin.errors import InvalidMetadataError
    from openjet_plugin.tokenizer import Tokenizer

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
            "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.token_type": [1, 1, 1],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 2}
    Tokenizer.from_metadata(dict(meta), source="m.gguf")          # the untouched one is fine
    meta[key] = value
    with pytest.raises(InvalidMetadataError, match=key.replace(".", r"\.")) as ei:
        Tokenizer.from_metadata(meta, source="m.gguf")
    assert "m.gguf" in str(ei.value)
