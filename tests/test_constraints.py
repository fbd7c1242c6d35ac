"""Constrained decoding (constraints.py, issue 26) on the CPU.

- The embedded default model on llama.cpp, sampled at temperature 1.0: with a JSON-schema
  constraint every reply validates (jsonschema), without it most do not; a forced tool call
  always parses into a call whose arguments validate, in the template's JSON form and in Qwen's
  XML form; regex, GBNF and Lark constraints hold; reasoning is free until </think>; bad
  constraints are refused by name with llguidance's message.
- GrammarState over a toy vocabulary: masks, consumption, the think gate and rollback.
- NativeSpeculator's host path over a toy backend with a grammar: greedy constrained output is
  exactly plain masked greedy decoding, drafts rejected or not; the fused path is not taken.
"""

from __future__ import annotations

import json
import re
import zlib

import jsonschema
import numpy as np
import pytest

from openjet_plugin.constraints import Constraint, ConstraintCompiler, GrammarState
from openjet_plugin.engine import load
from openjet_plugin.parsing import parse_tool_calls
from openjet_plugin.sampling import SamplingParams
from openjet_plugin.speculative_native import NativeSpeculator
from openjet_plugin.tokenizer import Tokenizer

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def engine():
    eng = load(backend="llama.cpp", n_ctx=512)
    yield eng
    eng.close()


def _ask(engine, content, **kw):
    return engine.chat([{"role": "user", "content": content}], temperature=1.0, top_k=0, top_p=1.0,
                       min_p=0.0, **kw)


# --- the default model ---------------------------------------------------------------------------

def test_json_schema_constraint_makes_every_sampled_reply_valid(engine):
    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    c = Constraint.json_schema(PERSON)
    constrained = [_ask(engine, "A person as JSON.", constraint=c, max_tokens=40, seed=s) for s in range(100)]
    for r in constrained:
        assert r.finish_reason == "stop" and valid(r.text), r.text
    assert len({r.text for r in constrained}) > 10          # sampled, not one forced string
    free = [_ask(engine, "A person as JSON.", max_tokens=40, seed=s).text for s in range(30)]
    assert sum(valid(t) for t in free) < 15, free


def test_forced_tool_call_always_validates_json_form(engine):
    assert engine.tool_call_format == "json"                # the default model's template
    schema = WEATHER[0]["function"]["parameters"]
    for s in range(20):
        r = _ask(engine, "Weather?", tools=WEATHER, constraint=Constraint.tool_call(WEATHER, "get_weather"),
                 max_tokens=80, seed=s)
        content, calls, invalid = parse_tool_calls(r.text, WEATHER)
        assert r.finish_reason == "stop" and not invalid and len(calls) == 1, r.text
        assert calls[0]["name"] == "get_weather" and content == ""
        jsonschema.validate(calls[0]["arguments"], schema)
        assert set(calls[0]["arguments"]) <= set(schema["properties"])


def test_forced_tool_call_in_qwen_xml_form(engine):
    tok = Tokenizer.from_gguf(engine.model_path)
    xml = ConstraintCompiler.from_tokenizer(tok, engine.eog_tokens, engine.n_vocab, "qwen_xml")
    saved, engine._constraints = engine._constraints, xml
    try:
        names = set()
        for s in range(12):
            name = "get_weather" if s % 3 else None          # None: any tool (tool_choice "required")
            r = _ask(engine, "Weather?", tools=WEATHER, constraint=Constraint.tool_call(WEATHER, name),
                     max_tokens=80, seed=s)
            assert r.text.startswith("<tool_call>\n<function=") and r.text.endswith("</function>\n</tool_call>")
            content, calls, invalid = parse_tool_calls(r.text, WEATHER)
            assert r.finish_reason == "stop" and not invalid and len(calls) == 1, r.text
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}[calls[0]["name"]]
            jsonschema.validate(calls[0]["arguments"], schema)
            if name:
                assert calls[0]["name"] == name
            names.add(calls[0]["name"])
    finally:
        engine._constraints = saved


@pytest.mark.parametrize("constraint,pattern", [
    (Constraint.regex(r"(yes|no), [0-9]{1,3}"), r"(yes|no), [0-9]{1,3}"),
    (Constraint.gbnf('root ::= "color: " ("red" | "green" | "blue")'), r"color: (red|green|blue)"),
    (Constraint.lark('start: "n=" NUM\nNUM: /[1-9][0-9]?/'), r"n=[1-9][0-9]?"),
    ({"type": "regex", "pattern": "[a-c]{2}"}, r"[a-c]{2}"),
])
def test_grammars_hold(engine, constraint, pattern):
    for s in range(5):
        r = engine.generate("Answer:", constraint=constraint, temperature=1.0, max_tokens=20, seed=s)
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text


def test_json_object_and_streaming(engine):
    kw = dict(constraint={"type": "json_object"}, max_tokens=100, seed=7)
    whole = _ask(engine, "JSON please", **kw)
    chunks = list(_ask(engine, "JSON please", stream=True, **kw))
    assert "".join(c.text for c in chunks) == whole.text
    assert isinstance(json.loads(whole.text), dict)


def test_reasoning_is_free_until_think_closes(engine):
    close = engine.tokenize("</think>")
    assert len(close) == 1
    prompt = engine.render_chat([{"role": "user", "content": "yes or no?"}]) + "<think>\n"
    c = Constraint.regex("(yes|no)")
    # reasoning: the constraint does not bind (an unconstrained model writes no "yes"/"no" here)
    r = engine.generate(prompt, constraint=c, temperature=0, max_tokens=12)
    assert r.finish_reason == "length" and not re.fullmatch("(yes|no)", r.text)
    # </think> forced by a bias on its token: the constraint starts right after it
    r = engine.generate(prompt, constraint=c, temperature=0, max_tokens=12, logit_bias={close[0]: 100.0})
    assert r.text in ("</think>yes", "</think>no") and r.finish_reason == "stop", r.text


@pytest.mark.parametrize("constraint,words", [
    ({"type": "json_schema", "schema": {"type": "nonsense"}}, ["invalid JSON schema", "nonsense"]),
    ({"type": "json_schema", "schema": "{not json"}, ["json_schema schema", "not valid JSON"]),
    ({"type": "gbnf", "grammar": "root ::= missing"}, ["invalid GBNF grammar", "missing"]),
    ({"type": "lark", "grammar": "start: undefined_rule"}, ["invalid Lark grammar", "undefined_rule"]),
    ({"type": "regex", "pattern": "(("}, ["invalid regex", "unclosed group"]),
    ({"type": "xml"}, ["unknown type 'xml'", "json_schema"]),
    ({"type": "regex"}, ["needs the key 'pattern'"]),
    ({"type": "tool_call", "tools": WEATHER, "name": "nope"}, ["'nope'", "get_weather"]),
    ({"type": "tool_call", "tools": []}, ["non-empty list of tools"]),
    ("json", ["constraint must be"]),
])
def test_bad_constraints_are_refused_by_name(engine, constraint, words):
    with pytest.raises(ValueError) as exc:
        engine.generate("x", constraint=constraint, max_tokens=4, stream=True)   # at the call
    msg = str(exc.value)
    assert msg.startswith("constraint"), msg
    for w in words:
        assert w in msg, msg


# --- GrammarState over a toy vocabulary ------------------------------------------------------------

TOY_PIECES = ([c.encode() for c in '{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz']
              + [b'{"', b'": ', b'true', b'false', b'</think>', b'yes', b'no'])
TOY_EOS = len(TOY_PIECES)
TOY_VOCAB = TOY_PIECES + [b"<|im_end|>"]


def _toy_encode(text: bytes) -> list[int]:
    out, i = [], 0
    while i < len(text):
        best = max((j for j, p in enumerate(TOY_PIECES) if text.startswith(p, i)),
                   key=lambda j: len(TOY_PIECES[j]))
        out.append(best)
        i += len(TOY_PIECES[best])
    return out


def toy_compiler() -> ConstraintCompiler:
    return ConstraintCompiler(TOY_VOCAB, [TOY_EOS], [TOY_EOS], len(TOY_VOCAB), _toy_encode)


def test_grammar_state_masks_consumes_and_rolls_back():
    g = toy_compiler().state(Constraint.regex("(yes|no)!?"), thinking=True)
    assert g.allowed() is None                         # reasoning: everything goes
    for t in _toy_encode(b"ab c"):
        g.consume(t)
    assert g.thinking
    g.consume(TOY_PIECES.index(b"</think>"))
    allowed = g.allowed()
    assert not g.thinking and allowed is not None
    assert {TOY_VOCAB[i] for i in np.flatnonzero(allowed)} == {b"y", b"n", b"yes", b"no"}
    masked = g.mask_logits(np.zeros(len(TOY_VOCAB), dtype=np.float32))
    assert np.isneginf(masked[~allowed]).all() and (masked[allowed] == 0).all()
    g.consume(TOY_PIECES.index(b"yes"))
    assert not g.try_consume(TOY_PIECES.index(b"a"))   # refused, nothing changes
    assert g.allowed()[TOY_EOS] and not g.finished     # "yes" may end, or take "!"
    g.rollback(2)                                      # "yes" and </think>: reasoning again
    assert g.thinking and g.allowed() is None
    g.consume(TOY_PIECES.index(b"</think>"))
    assert g.try_consume(TOY_PIECES.index(b"no"))
    with pytest.raises(RuntimeError, match="does not continue the grammar"):
        g.consume(TOY_PIECES.index(b"z"))


def test_prefetched_masks_are_the_masks():
    comp = toy_compiler()
    c = Constraint.json_schema(SMALL)
    a, b = comp.state(c), comp.state(c)
    text = _toy_encode(b'{"a": 42, "b": true}')
    for t in text:
        b.prefetch()
        np.testing.assert_array_equal(b.allowed(), a.allowed())
        b.prefetch()                            # in flight while the grammar moves on: discarded
        a.consume(t)
        b.consume(t)
    b.prefetch()
    b.rollback(3)
    a.rollback(3)
    np.testing.assert_array_equal(b.allowed(), a.allowed())
    b.prefetch()
    assert not b.finished and b.try_consume(text[-3])


def test_text_after_think_in_the_same_token_starts_the_grammar():
    pieces = TOY_VOCAB + [b"</think>no"]
    c = ConstraintCompiler(pieces, [TOY_EOS], [TOY_EOS], len(pieces), _toy_encode)
    g = c.state(Constraint.regex("(yes|no)"), thinking=True)
    g.consume(len(pieces) - 1)
    assert not g.thinking and g.allowed()[TOY_EOS] and g.finished
    g.rollback(1)
    assert g.thinking


# --- constrained speculation over a toy backend -----------------------------------------------------

V = len(TOY_VOCAB)


def _row(hist: list[int], salt: int = 0) -> np.ndarray:
    """The toy model's logits after `hist`: a fixed pseudo-random function of the history."""
    seed = zlib.crc32(np.asarray(hist, dtype=np.int32).tobytes()) ^ salt
    x = np.random.default_rng(seed).normal(size=V).astype(np.float32)
    x[TOY_EOS] -= 3.0                       # a reply long enough to speculate on
    if not salt and len(hist) % 7 == 0:
        x[TOY_PIECES.index(b"</think>")] += 6.0   # reasoning ends now and then
    return x


class ToyTarget:
    """NativeBackend's speculative surface over `_row`: drafts from a noisier copy of the
    target, so some are rejected."""

    name = "toy"

    def __init__(self, n_ctx: int = 256):
        self.n_ctx, self.n_vocab, self.draft_depth = n_ctx, V, 3
        self.supports_speculative, self.supports_cycle = True, True
        self._draft_vocab_len = 0
        self.hist: list[int] = []
        self._verify: list[int] = []
        self._chain: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.hist)

    def verify(self, tokens):
        self._verify = [int(t) for t in tokens]

    def logits(self, i):
        return _row(self.hist + self._verify[:i + 1])

    def argmax(self):
        return [int(np.argmax(self.logits(i))) for i in range(len(self._verify))]

    def commit(self, n):
        self.hist += self._verify[:n]

    def _flush_mtp(self):
        pass

    def _draft(self):
        return int(np.argmax(self.draft_logits(-1)))

    def draft_first(self, token):
        self._chain = self.hist + [int(token)]
        return self._draft()

    def draft_next(self, token, pos):
        assert pos == len(self._chain)
        self._chain.append(int(token))
        return self._draft()

    def draft_logits(self, index):
        return _row(self._chain) + 0.8 * _row(self._chain, salt=99)

    def cycle(self, tokens, n_draft):
        raise AssertionError("a constrained request took the fused path")


def _plain_masked_greedy(grammar: GrammarState, prompt: list[int], n: int) -> list[int]:
    hist, out = list(prompt), []
    while len(out) < n:
        tok = int(np.argmax(grammar.mask_logits(_row(hist))))
        out.append(tok)
        if tok == TOY_EOS:
            break
        grammar.consume(tok)
        hist.append(tok)
    return out


def _speculative(grammar: GrammarState, prompt: list[int], n: int, params: SamplingParams, seed: int = 0):
    b = ToyTarget()
    b.hist = list(prompt[:-1])
    spec = NativeSpeculator(b, 3)
    spec.begin(prompt)
    rng = np.random.default_rng(seed)
    out, tok, hist = [], prompt[-1], list(prompt)
    while len(out) < n and TOY_EOS not in out:
        em, depth, acc = spec.cycle(tok, hist, params, rng, n - len(out), grammar=grammar)
        out += em
        hist += em
        tok = em[-1]
    return out[:out.index(TOY_EOS) + 1] if TOY_EOS in out else out, spec.stats


SMALL = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"type": "boolean"}},
         "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("prompt", [[3], [5, 9, 1], [40, 2, 2, 7, 30]])
@pytest.mark.parametrize("thinking", [False, True])
def test_greedy_constrained_speculation_equals_plain_masked_greedy(prompt, thinking):
    comp = toy_compiler()
    c = Constraint.json_schema(SMALL)
    want = _plain_masked_greedy(comp.state(c, thinking), prompt, 40)
    got, stats = _speculative(comp.state(c, thinking), prompt, 40, SamplingParams(temperature=0))
    assert got == want
    assert stats.drafts_proposed > stats.drafts_accepted > 0    # rejections happened and rolled back
    text = b"".join(TOY_VOCAB[t] for t in want[:-1])
    if thinking:
        text = text.split(b"</think>", 1)[1]
    assert want[-1] == TOY_EOS
    jsonschema.validate(json.loads(text), SMALL)


def test_sampled_constrained_speculation_stays_in_the_grammar():
    comp = toy_compiler()
    c = Constraint.json_schema(SMALL)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for seed in range(10):
        out, _ = _speculative(comp.state(c), [1, 2], 60, params, seed)
        assert out[-1] == TOY_EOS
        jsonschema.validate(json.loads(b"".join(TOY_VOCAB[t] for t in out[:-1])), SMALL)


# --- the engine's speculative loop on the native bookkeeping (a fake library) -------------------------

def _fake_native_engine(template, depth: int):
    import test_native_bookkeeping  # noqa: F401  (the fake library's module, installed by the caller)
    from openjet_plugin.backends import native
    from openjet_plugin.engine import Engine
    from openjet_plugin.model_file import open_model

    mf = open_model(template.model_path)
    be = native.NativeBackend(mf, n_ctx=512, draft_depth=depth)
    return Engine(be, model_path=template.model_path, config=template.config, metadata=template.metadata,
                  chat_template_source=template.chat_template, eog_tokens=template.eog_tokens,
                  token_eos=template.token_eos, backend_reason="fake native library", model_file=mf)


@pytest.fixture()
def fake_native(monkeypatch):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_native_bookkeeping as nb
    return nb.install_fake(monkeypatch, nb.FakeLib)


@pytest.mark.parametrize("depth", [1, 3])
def test_engine_constrained_speculation_on_the_native_bookkeeping_equals_plain(fake_native, engine, depth):
    import test_native_bookkeeping as nb
    plain, spec = _fake_native_engine(engine, 0), _fake_native_engine(engine, depth)
    try:
        for c, check in [(Constraint.json_schema(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
                         (Constraint.tool_call(WEATHER, "get_weather"),
                          lambda t: jsonschema.validate(parse_tool_calls(t, WEATHER)[1][0]["arguments"],
                                                        WEATHER[0]["function"]["parameters"]))]:
            for q in ("A person as JSON.", "Weather?", "def f(x):"):
                kw = dict(constraint=c, temperature=0, max_tokens=60, tools=WEATHER)
                want = plain.chat([{"role": "user", "content": q}], **kw)
                got = spec.chat([{"role": "user", "content": q}], **kw)
                assert got.tokens == want.tokens and want.finish_reason == "stop", (q, want.text, got.text)
                check(got.text)
                assert got.stats.drafts_proposed > 0
        assert fake_native[-1].hist == spec._tokens
        nb._rows_in_step(fake_native[-1], spec._backend)      # every MTP row from the right hidden
        # sampled: every reply valid
        for seed in range(5):
            r = spec.chat([{"role": "user", "content": "x"}], constraint=Constraint.json_schema(PERSON),
                          temperature=1.0, seed=seed, max_tokens=60)
            jsonschema.validate(json.loads(r.text), PERSON)
    finally:
        plain.close()
        spec.close()


def test_engine_speculative_logprobs_on_the_native_bookkeeping_equal_plain(fake_native, engine):
    plain, spec = _fake_native_engine(engine, 0), _fake_native_engine(engine, 3)
    try:
        for kw in (dict(temperature=0), dict(temperature=0, constraint=Constraint.json_schema(PERSON))):
            want = plain.generate("def f(x):", max_tokens=30, logprobs=True, top_logprobs=4, **kw)
            got = spec.generate("def f(x):", max_tokens=30, logprobs=True, top_logprobs=4, **kw)
            assert got.tokens == want.tokens and got.stats.drafts_accepted > 0
            assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in got.logprobs] == \
                [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in want.logprobs]
    finally:
        plain.close()
        spec.close()


def test_forced_tool_call_with_schema_definitions(engine):
    """pydantic writes nested models as "$ref": "#/$defs/..." at the parameters' root."""
    params = {"type": "object", "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]},
                                          "Place": {"type": "object", "properties": {
                                              "city": {"type": "string", "maxLength": 10},
                                              "unit": {"$ref": "#/$defs/Unit"}},
                                              "required": ["city", "unit"], "additionalProperties": False}},
              "properties": {"where": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}},
              "required": ["where", "unit"]}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": params}}]
    tok = Tokenizer.from_gguf(engine.model_path)
    saved = engine._constraints
    try:
        for fmt in ("json", "qwen_xml"):
            engine._constraints = ConstraintCompiler.from_tokenizer(tok, engine.eog_tokens, engine.n_vocab, fmt)
            for s in range(4):
                r = _ask(engine, "Where?", tools=tools, constraint=Constraint.tool_call(tools, "lookup"),
                         max_tokens=80, seed=s)
                _, calls, invalid = parse_tool_calls(r.text, tools)
                assert not invalid and len(calls) == 1, (fmt, r.text)
                jsonschema.validate(calls[0]["arguments"], params)
    finally:
        engine._constraints = saved


@pytest.mark.parametrize("fmt", ["json", "qwen_xml"])
def test_tool_call_grammar_accepts_exactly_what_the_parser_formats(engine, fmt):
    """The grammar of a forced call and parsing.format_tool_call (what the templates render for
    a past call) agree: every valid call's text is a sentence, an invalid one is not."""
    from openjet_plugin.parsing import format_tool_call

    tok = Tokenizer.from_gguf(engine.model_path)
    comp = ConstraintCompiler.from_tokenizer(tok, engine.eog_tokens, engine.n_vocab, fmt)
    c = Constraint.tool_call(WEATHER, None)

    def accepts(text: str) -> bool:
        g = comp.state(c)
        ids = tok.encode(text, parse_special=False)
        return all(g.try_consume(t) for t in ids) and bool(g.allowed()[min(engine.eog_tokens)])

    good = [("get_weather", {"city": "Paris", "days": 3}),
            ("get_weather", {"city": "Rome\nItaly", "unit": "celsius", "days": 7}),
            ("get_weather", {"city": "", "days": 1}),
            ("ping", {})]
    bad = [("get_weather", {"city": "Paris", "days": 9}),               # above maximum
           ("get_weather", {"days": 3}),                                # city required
           ("get_weather", {"city": "Paris", "days": 3, "x": 1}),       # unknown parameter
           ("get_weather", {"city": "Paris", "unit": "kelvin", "days": 2}),
           ("nope", {})]
    for name, args in good:
        assert accepts(format_tool_call(name, args, fmt)), (name, args)
    for name, args in bad:
        assert not accepts(format_tool_call(name, args, fmt)), (name, args)


def test_qwen35_template_gives_the_xml_form_and_opens_reasoning():
    from importlib.resources import files

    from openjet_plugin import chat_template
    from openjet_plugin.constraints import prompt_opens_think
    from openjet_plugin.parsing import tool_call_format

    src = (files("openjet_plugin") / "data" / "qwen35_chat_template.jinja").read_text()
    assert tool_call_format(src) == "qwen_xml"
    msgs = [{"role": "user", "content": "hi"}]
    assert prompt_opens_think(chat_template.render(src, msgs, tools=WEATHER, enable_thinking=True))
    assert not prompt_opens_think(chat_template.render(src, msgs, tools=WEATHER, enable_thinking=False))
