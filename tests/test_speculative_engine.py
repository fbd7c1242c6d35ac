"""The engine's speculative path (engine.py + speculative_native.py) on the CPU.

`RefNative` gives the numpy reference the native backend's speculative surface (verify/commit,
draft_first/draft_next, draft vocabulary, checkpoints), with the native backend's rules: the
current token is not in the state; commit keeps a prefix of the last verify; the MTP row of a
committed position p is made from (x_p, h_{p-1}). So the engine's cycle loop, its conversation
reuse through checkpoints and its stop/length handling are checked here, and the GPU tests
(tests/test_native_spec_gpu.py) check the native engine under the same loop.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import openjet_plugin
from openjet_plugin.engine import Engine
from openjet_plugin.speculative import ForcedAcceptanceDrafts
from openjet_plugin.testing.reference import ReferenceModel
from openjet_plugin.tokenizer import Tokenizer

DEFAULT_GGUF = Path(openjet_plugin.__file__).resolve().parent / "data" / "default.gguf"


class RefNative:
    """The reference model behind the native backend's interface (one conversation)."""

    name = "native"

    def __init__(self, path: Path, n_ctx: int, draft_depth: int):
        self.m = ReferenceModel(path)
        self.m.mtp_reset()
        self.tok = Tokenizer.from_gguf(path)
        self.n_ctx, self.n_vocab = n_ctx, self.m.n_vocab
        self.draft_depth = draft_depth
        self.supports_speculative = draft_depth > 0
        self._draft_vocab_len = 0
        self._ids = None
        self._last_logits: np.ndarray | None = None
        self._verify: tuple | None = None
        self._mtp_h = None
        self._draft = None
        self._checkpoints: list[tuple[int, tuple]] = []
        self.verify_calls = 0

    # backend protocol
    def tokenize(self, text, add_special, parse_special):
        return list(self.tok.encode(bytes(text), add_special=add_special, parse_special=parse_special))

    def detokenize(self, tokens):
        return self.tok.decode_bytes(tokens, special=True)

    @property
    def n_past(self) -> int:
        return self.m.n_past

    def _snapshot(self):
        m = self.m
        return (m.n_past, list(m.tokens), m.hidden.copy(), {k: v.copy() for k, v in m._conv.items()},
                {k: v.copy() for k, v in m._ssm.items()})

    def _restore(self, snap) -> None:
        m = self.m
        n, m.tokens, m.hidden, m._conv, m._ssm = snap[0], list(snap[1]), snap[2].copy(), \
            {k: v.copy() for k, v in snap[3].items()}, {k: v.copy() for k, v in snap[4].items()}
        m.n_past = n
        for kv in m._kv.values():
            kv.remove_from(n)
        m._mtp_kv.remove_from(n)

    def eval(self, tokens):
        if self.n_past + len(tokens) > self.n_ctx:
            raise ValueError("context full")
        self._verify = None
        self._last_logits = self.m.forward(list(tokens))
        return self._last_logits[-1].astype(np.float32)

    def eval_argmax(self, tokens):
        return int(np.argmax(self.eval(tokens)))

    def rollback(self, n_keep):
        return n_keep == self.n_past

    def reset(self):
        self.m.reset()
        self.m.mtp_reset()
        self._checkpoints = []

    def close(self):
        pass

    def save_checkpoint(self):
        self._checkpoints = [c for c in self._checkpoints if c[0] != self.n_past][-1:] + [(self.n_past, self._snapshot())]

    def restore_checkpoint(self, n_max):
        keep = [c for c in self._checkpoints if c[0] <= n_max]
        if not keep:
            self.reset()
            return 0
        n, snap = max(keep, key=lambda c: c[0])
        self._restore(snap)
        self._checkpoints = keep
        return n

    # speculative surface
    def verify(self, tokens):
        self.verify_calls += 1
        self._verify = (self._snapshot(), list(tokens))
        self._last_logits = self.m.forward(list(tokens))

    def commit(self, n):
        snap, toks = self._verify
        self._verify = None
        if n < len(toks):
            self._restore(snap)
            self.m.forward(toks[:n])

    def argmax(self):
        return [int(i) for i in np.argmax(self._last_logits, axis=-1)]

    def logits(self, i):
        return self._last_logits[i].astype(np.float32)

    def _mtp(self, pos, token, h):
        logits, self._mtp_h = self.m.mtp_logits(h, int(token), pos=pos)
        self._draft = logits if self._ids is None else logits[self._ids]
        return int(np.argmax(logits)) if self._ids is None else int(self._ids[int(np.argmax(self._draft))])

    def draft_first(self, token):
        m = self.m
        start = int(m._mtp_kv.pos.max()) + 1 if len(m._mtp_kv.pos) else 0
        for p in range(start, m.n_past):                      # rows owed for committed positions
            self._mtp(p, m.tokens[p], m.hidden[p - 1] if p else np.zeros(m.config.n_embd))
        pos = m.n_past
        return self._mtp(pos, token, m.hidden[pos - 1] if pos else np.zeros(m.config.n_embd))

    def draft_next(self, token, pos):
        return self._mtp(pos, token, self._mtp_h)

    def draft_logits(self, index):
        return self._draft.astype(np.float32)

    def set_draft_vocab(self, ids):
        self._ids = None if ids is None else np.asarray(ids)
        self._draft_vocab_len = 0 if ids is None else len(ids)

    def _flush_mtp(self):
        pass


@pytest.fixture(scope="module")
def llama_engine():
    eng = openjet_plugin.load(backend="llama.cpp", n_ctx=512)
    yield eng
    eng.close()


def _engine(template: Engine, depth: int) -> tuple[Engine, RefNative]:
    be = RefNative(DEFAULT_GGUF, n_ctx=512, draft_depth=depth)
    eng = Engine(be, model_path=template.model_path, config=template.config, metadata=template.metadata,
                 chat_template_source=template.chat_template, eog_tokens=template.eog_tokens,
                 token_eos=template.token_eos, backend_reason="reference behind the native interface")
    return eng, be


PROMPTS = ["def parse_args(argv):\n    parser = argparse.", "class Stack:\n    def __init__(self):\n        self.",
           "import os\n\ndef walk(path):\n    for"]


@pytest.fixture(scope="module")
def plain(llama_engine):
    eng, _ = _engine(llama_engine, 0)
    assert eng._speculator is None
    return [eng.generate(p, max_tokens=24, temperature=0) for p in PROMPTS]


@pytest.mark.parametrize("depth", [1, 4])
def test_greedy_speculative_engine_equals_plain(llama_engine, plain, depth):
    eng, be = _engine(llama_engine, depth)
    assert eng._speculator is not None and eng.supports_speculative
    for p, want in zip(PROMPTS, plain):
        got = eng.generate(p, max_tokens=24, temperature=0)
        assert got.tokens == want.tokens and got.text == want.text and got.finish_reason == want.finish_reason
        s = got.stats
        assert s.cycles >= 1 and s.drafts_proposed >= s.drafts_accepted >= 0
        # the state holds exactly what the engine says it holds
        assert be.m.tokens == eng._tokens
    # the trained MTP head's drafts are accepted: fewer verify passes than tokens
    assert be.verify_calls < sum(len(w.tokens) for w in plain)


def test_forced_acceptance_through_the_engine(llama_engine, plain):
    eng, be = _engine(llama_engine, 4)
    eng._speculator.policy.adaptive = False
    for rate in (0.0, 1.0):
        for p, want in zip(PROMPTS, plain):
            toks = eng.tokenize(p)
            eng._speculator.oracle = ForcedAcceptanceDrafts(toks + want.tokens + [0] * 8, eng.n_vocab, rate=rate)
            got = eng.generate(p, max_tokens=24, temperature=0)
            assert got.tokens == want.tokens
            if rate == 0.0:
                assert got.stats.drafts_accepted == 0
            elif want.finish_reason == "length":
                assert got.stats.drafts_accepted == got.stats.drafts_proposed


def test_conversation_reuse_resumes_from_a_checkpoint(llama_engine, plain):
    eng, be = _engine(llama_engine, 4)
    first = eng.generate(PROMPTS[0], max_tokens=16, temperature=0)
    follow = PROMPTS[0] + first.text + "\n\ndef main():"
    again = eng.generate(follow, max_tokens=16, temperature=0)
    fresh, _ = _engine(llama_engine, 4)
    want = fresh.generate(follow, max_tokens=16, temperature=0)
    assert again.tokens == want.tokens
    assert again.stats.cached_prompt_tokens > 0
    same = eng.generate(follow, max_tokens=16, temperature=0)
    assert same.tokens == want.tokens
    assert same.stats.cached_prompt_tokens == len(eng.tokenize(follow)) - 1


def test_stop_string_and_max_tokens_under_speculation(llama_engine, plain):
    eng, _ = _engine(llama_engine, 4)
    want = plain[1]
    stop = want.text[5:9]
    got = eng.generate(PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert got.finish_reason == "stop" and got.text == want.text[:want.text.find(stop)]
    for n in (1, 2, 5):
        got = eng.generate(PROMPTS[1], max_tokens=n, temperature=0)
        assert got.tokens == want.tokens[:n] and got.finish_reason == "length"


def test_sampled_speculation_is_reproducible_and_in_the_target_support(llama_engine):
    eng, _ = _engine(llama_engine, 3)
    a = eng.generate(PROMPTS[2], max_tokens=20, temperature=0.7, top_k=40, seed=11)
    b = eng.generate(PROMPTS[2], max_tokens=20, temperature=0.7, top_k=40, seed=11)
    assert a.tokens == b.tokens and a.stats.cycles >= 1
    ref = ReferenceModel(DEFAULT_GGUF)
    prompt = eng.tokenize(PROMPTS[2])
    logits = ref.logits(prompt + a.tokens)
    for i, t in enumerate(a.tokens):
        row = logits[len(prompt) - 1 + i]
        assert t in np.argsort(-row)[:40], f"token {i} is outside the target's top-40"
