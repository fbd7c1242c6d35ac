"""A stand-in engine that "generates" a fixed reply, for the adapters' deterministic tests.

A random-weight model never writes a tool call or a think block, so the code that turns such
replies into framework objects is tested by feeding crafted text through the real adapters. The
stand-in renders prompts with the real engine (the model's real chat template) and records them;
only `generate` is scripted. Streams come out in small pieces that split the markup mid-tag, the
hardest case for the stream splitter.
"""

from __future__ import annotations

from openjet_plugin.engine import Chunk, GenerationResult, GenerationStats


class ScriptedEngine:
    """`reply`: the text every call returns, or a list of texts returned by successive calls."""

    def __init__(self, real_engine, reply: str | list[str], *, piece: int = 3, finish_reason: str = "stop"):
        self._real = real_engine
        self._replies = list(reply) if isinstance(reply, list) else None
        self.reply = self._replies[0] if self._replies else reply
        self.piece = piece
        self.finish_reason = finish_reason
        self.prompts: list[str] = []
        self.calls: list[dict] = []
        self.backend_name = "scripted"
        self.supports_speculative = False

    def render_chat(self, messages, tools=None, enable_thinking=False, add_generation_prompt=True):
        return self._real.render_chat(messages, tools=tools, enable_thinking=enable_thinking,
                                      add_generation_prompt=add_generation_prompt)

    def tokenize(self, *a, **k):
        return self._real.tokenize(*a, **k)

    def _stats(self, prompt) -> GenerationStats:
        n = len(self._real.tokenize(prompt, add_special=True)) if isinstance(prompt, str) else len(prompt)
        return GenerationStats(prompt_tokens=n, generated_tokens=len(self._tokens()), backend="scripted")

    def _tokens(self) -> list[int]:
        return self._real.tokenize(self.reply, add_special=False, parse_special=True)

    def generate(self, prompt, *, stream=False, **params):
        if self._replies:
            self.reply = self._replies.pop(0)
        self.prompts.append(prompt)
        self.calls.append(params)
        stats = self._stats(prompt)
        if not stream:
            return GenerationResult(self.reply, self._tokens(), self.finish_reason, stats)
        return self._stream(stats)

    def _stream(self, stats):
        text, n = self.reply, len(self._tokens())
        pieces = [text[i:i + self.piece] for i in range(0, len(text), self.piece)] or [""]
        for i, p in enumerate(pieces[:-1]):
            yield Chunk(p, [0] if i < n else [])
        yield Chunk(pieces[-1], [0] * max(0, n - (len(pieces) - 1)), self.finish_reason, stats)
