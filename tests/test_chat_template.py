"""The model's own chat template, rendered in Jinja2's immutable sandbox."""

from __future__ import annotations

import json

import pytest

import openjet_plugin
from openjet_plugin.chat_template import ChatTemplateError, render


@pytest.fixture(scope="module")
def engine(synth_path):
    eng = openjet_plugin.load(synth_path("tiny", "Q8_0"), backend="llama.cpp", n_ctx=512, n_threads=1)
    yield eng
    eng.close()


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>"}]


def test_the_template_comes_from_the_gguf(engine):
    assert engine.chat_template == engine.metadata["tokenizer.chat_template"]


def test_thinking_off_opens_and_closes_an_empty_think_block(engine):
    off = engine.render_chat(MESSAGES, enable_thinking=False)
    on = engine.render_chat(MESSAGES, enable_thinking=True)
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <b>there</b><|im_end|>\n"
    assert on == head + "<|im_start|>assistant\n"
    assert off == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert engine.render_chat(MESSAGES, add_generation_prompt=False) == head


def test_tools_are_rendered_as_json_without_html_escaping(engine):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "temp in <city>",
                                             "parameters": {"type": "object", "properties": {}}}}
    text = engine.render_chat(MESSAGES, tools=[tool])
    assert json.dumps(tool, ensure_ascii=False) in text
    assert "<tools>" in text and "&lt;" not in text


def test_chat_special_tokens_become_single_tokens(engine):
    ids = engine.tokenize(engine.render_chat(MESSAGES))
    assert ids[0] == engine.tokenize("<|im_start|>")[0] and len(engine.tokenize("<|im_start|>")) == 1
    assert engine.tokenize("<|im_end|>")[0] in ids


def test_chat_generates_from_the_rendered_prompt(engine):
    a = engine.chat(MESSAGES, max_tokens=8, temperature=0)
    b = engine.generate(engine.render_chat(MESSAGES), max_tokens=8, temperature=0)
    assert a.tokens == b.tokens and a.text == b.text and len(a.tokens) > 0
    streamed = "".join(c.text for c in engine.chat(MESSAGES, max_tokens=8, temperature=0, stream=True))
    assert streamed == a.text


@pytest.mark.parametrize("template,needle", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    ("{{ messages.__class__.__init__.__globals__ }}", "sandbox"),
    ("{% set x = messages.append({'role': 'x'}) %}", "sandbox"),       # immutable: no mutation
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "sandbox"),
])
def test_template_reaching_for_python_internals_fails_clearly(template, needle):
    with pytest.raises(ChatTemplateError, match=needle):
        render(template, [{"role": "user", "content": "x"}])


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="rejected the messages: roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render(None, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages,needle", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "x"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": "x"}, "oops"], r"messages\[1\] must be a dict"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\]"),
])
def test_bad_messages_are_named(engine, messages, needle):
    with pytest.raises(ValueError, match=needle):
        engine.chat(messages, max_tokens=2)


def test_tools_must_be_a_list(engine):
    with pytest.raises(ValueError, match="tools"):
        engine.chat(MESSAGES, tools={"name": "x"}, max_tokens=2)
