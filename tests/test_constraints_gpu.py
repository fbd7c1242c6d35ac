"""Constrained decoding and logprobs with MTP speculation on the native engine (issue 26).

Needs an NVIDIA GPU and the built library; skips with the reason otherwise.

- Greedy constrained output with speculation (draft depth 1..4: the host path, whose drafts and
  verified positions are masked and whose rejected drafts leave the grammar) is token for token
  the output without speculation, for a JSON schema, a forced tool call, a regex and reasoning
  before a constraint; every constrained reply is valid.
- Sampled constrained replies with speculation are valid every time.
- logprobs with speculation are the target's distribution: the same tokens and values as
  without speculation (to float tolerance).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_native_gpu import _native_or_skip  # noqa: E402

from openjet_plugin.constraints import Constraint  # noqa: E402
from openjet_plugin.parsing import parse_tool_calls  # noqa: E402

pytestmark = pytest.mark.gpu

DEFAULT_GGUF = Path(__file__).resolve().parent.parent / "openjet_plugin" / "data" / "default.gguf"

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}]
QUESTIONS = ["A person as JSON.", "Describe someone.", "def parse(text):", "Weather in Paris?",
             "import os\nimport sys\n", "Tell me about tags."]


@pytest.fixture(scope="module")
def engines():
    _native_or_skip()
    import openjet_plugin

    out = {}
    for depth in (0, 1, 4):
        eng = openjet_plugin.load(model_path=str(DEFAULT_GGUF), backend="native", n_ctx=1024, draft_depth=depth)
        assert eng.backend_name == "native", eng.backend_reason
        assert (eng._speculator is not None) == (depth > 0)
        out[depth] = eng
    yield out
    for eng in out.values():
        eng.close()


def _chat(eng, q, **kw):
    return eng.chat([{"role": "user", "content": q}], **kw)


NEAR_TIE = 2e-2      # logprob gap under which verify's batched rows may order two tokens otherwise


def _same_or_near_tie(eng, prompt: str, a: list[int], b: list[int]) -> None:
    """a == b, or they part where the two tokens are a near-tie in the model's own logits (both
    are allowed there, as the grammar's state is the same, so the mask cannot part them)."""
    if a == b:
        return
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    assert i < min(len(a), len(b)), f"one output is a prefix of the other: {a} {b}"
    tokens = eng.tokenize(prompt, add_special=True) + a[:i]
    lp = eng.generate(tokens, max_tokens=1, temperature=0, logprobs=True, top_logprobs=20).logprobs[0]
    top = {t.token: t.logprob for t in lp.top_logprobs}
    assert a[i] in top and b[i] in top and abs(top[a[i]] - top[b[i]]) < NEAR_TIE, \
        f"outputs part at token {i} ({a[i]} vs {b[i]}) without a near-tie: {top}"


CASES = {
    "json_schema": (dict(constraint=Constraint.json_schema(PERSON)),
                    lambda t: jsonschema.validate(json.loads(t), PERSON)),
    "tool_call": (dict(tools=TOOLS, constraint=Constraint.tool_call(TOOLS, "get_weather")),
                  lambda t: jsonschema.validate(parse_tool_calls(t, TOOLS)[1][0]["arguments"],
                                                TOOLS[0]["function"]["parameters"])),
    "regex": (dict(constraint=Constraint.regex(r"[A-Z][a-z]{2,8}( [a-z]{2,8}){1,4}\.")),
              lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}( [a-z]{2,8}){1,4}\.", t) or pytest.fail(t)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_constrained_output_is_the_same_with_speculation(engines, case):
    kw, check = CASES[case]
    proposed = accepted = 0
    for q in QUESTIONS:
        plain = _chat(engines[0], q, temperature=0, max_tokens=96, **kw)
        assert plain.finish_reason == "stop", plain.text
        check(plain.text)
        prompt = engines[0].render_chat([{"role": "user", "content": q}], tools=kw.get("tools"))
        for depth in (1, 4):
            spec = _chat(engines[depth], q, temperature=0, max_tokens=96, **kw)
            _same_or_near_tie(engines[0], prompt, plain.tokens, spec.tokens)
            check(spec.text)
            proposed += spec.stats.drafts_proposed
            accepted += spec.stats.drafts_accepted
    assert proposed > accepted > 0          # drafts were made, some accepted, some rolled back


def test_reasoning_then_constraint_is_the_same_with_speculation(engines):
    c = Constraint.json_schema(PERSON)
    close = engines[0].tokenize("</think>")
    for q in QUESTIONS[:3]:
        prompt = engines[0].render_chat([{"role": "user", "content": q}]) + "<think>\n"
        outs = []
        for depth in (0, 4):
            # the bias ends the reasoning at once on a model that never learnt to
            r = engines[depth].generate(prompt, constraint=c, temperature=0, max_tokens=96,
                                        logit_bias={close[0]: 30.0} if len(close) == 1 else None)
            outs.append(r.tokens)
        _same_or_near_tie(engines[0], prompt, *outs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_constrained_replies_with_speculation_are_valid(engines, case):
    kw, check = CASES[case]
    for seed in range(12):
        r = _chat(engines[4], QUESTIONS[seed % len(QUESTIONS)], temperature=1.0, seed=seed, max_tokens=96, **kw)
        assert r.finish_reason == "stop", r.text
        check(r.text)


@pytest.mark.parametrize("constrained", [False, True])
def test_logprobs_with_speculation_are_the_targets(engines, constrained):
    kw = dict(constraint=Constraint.json_schema(PERSON)) if constrained else {}
    for q in QUESTIONS[:4]:
        plain = _chat(engines[0], q, temperature=0, max_tokens=48, logprobs=True, top_logprobs=5, **kw)
        spec = _chat(engines[4], q, temperature=0, max_tokens=48, logprobs=True, top_logprobs=5, **kw)
        if spec.tokens != plain.tokens:
            prompt = engines[0].render_chat([{"role": "user", "content": q}])
            _same_or_near_tie(engines[0], prompt, plain.tokens, spec.tokens)
            continue
        assert spec.stats.drafts_accepted > 0
        a = np.array([lp.logprob for lp in plain.logprobs])
        b = np.array([lp.logprob for lp in spec.logprobs])
        np.testing.assert_allclose(b, a, atol=2e-2)
        for x, y in zip(plain.logprobs, spec.logprobs):
            np.testing.assert_allclose([t.logprob for t in y.top_logprobs], [t.logprob for t in x.top_logprobs],
                                       atol=2e-2)


def test_streamed_logprobs_with_speculation(engines):
    kw = dict(temperature=0.8, seed=4, max_tokens=40, logprobs=True, top_logprobs=2)
    whole = _chat(engines[4], QUESTIONS[2], **kw)
    chunks = list(_chat(engines[4], QUESTIONS[2], stream=True, **kw))
    assert [lp.token for c in chunks for lp in c.logprobs] == whole.tokens
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)
