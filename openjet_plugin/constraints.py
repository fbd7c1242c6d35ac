"""Constrained decoding: a request's output held to a JSON Schema, a grammar or a regex (llguidance).

`Constraint` says what the output must match; the engine compiles it against the model's
vocabulary (`ConstraintCompiler`, once per engine, then cached per constraint) and runs one
`GrammarState` per request. Before each token the state's mask sets every token the grammar does
not allow to -inf in the logits; the sampled token is then fed to it. With speculation the same
state masks each draft and each verified position, and rolls back the drafts the target rejects.

llguidance (https://github.com/guidance-ai/llguidance) does the grammar work: JSON Schema, Lark,
GBNF (converted to Lark by llguidance), regex; it computes a token mask from a trie of the
vocabulary's byte strings (a few hundred microseconds a token on a 248K vocabulary with the mask
applied: `openjet bench`'s constraint_mask_us). Its tokenizer is built here from the GGUF's own
vocabulary (tokenizer.py), never from a hub tokenizer.

Reasoning: when the prompt leaves a `<think>` block open (thinking on), the reply's reasoning is
free and the constraint starts after the model writes `</think>`.

Forced tool calls (`Constraint.tool_call`) are written as Lark in the form the chat template asks
for (parsing.tool_call_format): Qwen3.5's XML blocks or the JSON object of Qwen2.5/3, exactly as
parsing.format_tool_call renders them, so parsing.parse_tool_calls reads them back.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from .parsing import THINK_CLOSE, THINK_OPEN

KINDS = ("json_schema", "json_object", "lark", "gbnf", "regex", "tool_call")

# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): llguidance's default lets the model put
# any whitespace between tokens, and a sampled small model then fills max_tokens with blanks. A
# schema's own "x-guidance" options still win.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ImportError(f"constrained decoding needs llguidance (pip install llguidance): {exc}") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a reply must match. Make one with the constructors below (or `from_dict`)."""

    kind: str
    text: str = ""                       # schema JSON, grammar or pattern
    tools: tuple[tuple[str, str], ...] = ()   # tool_call: (name, parameters schema as JSON text)
    name: str | None = None              # tool_call: the function that must be called (None: any)

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """Output: one JSON value valid for `schema` (a dict, or its JSON text)."""
        return cls("json_schema", _schema_text(schema, "constraint: json_schema schema"))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Output: any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object", '{"type": "object"}')

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """Output: a sentence of an llguidance Lark grammar (its `start` rule)."""
        return cls("lark", _text(grammar, "constraint: lark grammar"))

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        """Output: a sentence of a llama.cpp GBNF grammar (its `root` rule)."""
        return cls("gbnf", _text(grammar, "constraint: gbnf grammar"))

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Output: a full match of `pattern` (Rust regex syntax)."""
        return cls("regex", _text(pattern, "constraint: regex pattern"))

    @classmethod
    def tool_call(cls, tools: Sequence[dict], name: str | None = None) -> "Constraint":
        """Output: one <tool_call> block calling `name` (None: any one of `tools`) with arguments
        valid for its parameters schema. `tools`: OpenAI form ({"type": "function", "function":
        {...}}) or plain {"name", "parameters"}. The block's form comes from the chat template."""
        if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence) or not tools:
            raise ValueError("constraint: tool_call needs a non-empty list of tools")
        entries: list[tuple[str, str]] = []
        for i, tool in enumerate(tools):
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"constraint: tools[{i}] has no function name")
            params = fn.get("parameters")
            if params is None:
                params = {"type": "object", "properties": {}}
            entries.append((fn["name"], _schema_text(params, f"constraint: tools[{i}] parameters")))
        names = [n for n, _ in entries]
        if name is not None and name not in names:
            raise ValueError(f"constraint: tool {name!r} is not among the tools ({', '.join(names)})")
        return cls("tool_call", tools=tuple(entries), name=name)

    @classmethod
    def from_dict(cls, d: dict) -> "Constraint":
        """The plain-dict form adapters pass: {"type": KIND, ...} (see KINDS and /docs)."""
        if isinstance(d, Constraint):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"constraint must be a Constraint or a dict with a 'type', got {type(d).__name__}")
        kind = d.get("type")
        try:
            if kind == "json_schema":
                return cls.json_schema(d["schema"])
            if kind == "json_object":
                return cls.json_object()
            if kind in ("lark", "gbnf"):
                return getattr(cls, kind)(d["grammar"])
            if kind == "regex":
                return cls.regex(d["pattern"])
            if kind == "tool_call":
                return cls.tool_call(d["tools"], d.get("name"))
        except KeyError as exc:
            raise ValueError(f"constraint: type {kind!r} needs the key {exc.args[0]!r}") from None
        raise ValueError(f"constraint: unknown type {kind!r}; expected one of {', '.join(KINDS)}")


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _schema_text(schema: object, what: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{what} must be a JSON Schema object, got {type(schema).__name__}")
    return json.dumps(schema)


# --- tool calls in the template's form --------------------------------------------------------------

def _lark_str(s: str) -> str:
    return json.dumps(s)


def _lark_regex(pattern: str) -> str:
    """`pattern` inside /.../: an unescaped slash escaped."""
    out, escaped = [], False
    for ch in pattern:
        if ch == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)


_PARAM_END = "\n</parameter>\n"
# a verbatim value ends at the first "\n</parameter>\n": the terminator belongs to the lexeme, so
# the lexer knows where the value stops (a lexeme followed by a literal would be matched greedily)
_NOT_AFTER_END = r"~/(?s:.*\n<\/parameter>\n.+)/"


def _string_value_rule(schema: dict) -> str:
    """Lark for a string parameter written verbatim (Qwen XML), its terminator included."""
    if "enum" in schema or "const" in schema:
        vals = schema.get("enum", [schema.get("const")])
        return " | ".join(_lark_str(f"{v}{_PARAM_END}") for v in vals if isinstance(v, str))
    if isinstance(schema.get("pattern"), str):
        body = schema["pattern"]
        body = body[1:] if body.startswith("^") else body
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
        body = f"(?:{_lark_regex(body)})"
    else:
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if isinstance(lo, int) or isinstance(hi, int):
            body = f"(?s:.{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}})"
        else:
            body = "(?s:.*)"
    return f"/{body}\\n<\\/parameter>\\n/ & {_NOT_AFTER_END}"


def _is_string_only(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    vals = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return "type" not in schema and isinstance(vals, list) and vals and all(isinstance(v, str) for v in vals)


_DEFS = ("$defs", "definitions")     # where JSON Schema (pydantic too) keeps shared definitions


def _xml_call_rules(i: int, name: str, params: dict) -> list[str]:
    """Rules for one call in Qwen3.5's XML form: parameters in the schema's order, the required
    ones always, the others optional; strings verbatim, other values as JSON (parsing.py reads
    them back the same way)."""
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in _DEFS if k in params}
    parts, rules = [], []
    for j, (key, sub) in enumerate(props.items()):
        rule = f"c{i}_p{j}"
        head = _lark_str(f"<parameter={key}>\n")
        if _is_string_only(sub):
            term = f"C{i}_V{j}"
            rules.append(f"{term}: {_string_value_rule(sub)}")
            rules.append(f"{rule}: {head} {term}")
        else:
            sub = dict(sub) if isinstance(sub, dict) else {}
            sub.setdefault("x-guidance", JSON_OPTIONS)
            for k, v in defs.items():          # "#/$defs/..." resolves from each value's schema
                sub.setdefault(k, v)
            rules.append(f"{rule}: {head} %json {json.dumps(sub)} "
                         f"{_lark_str(_PARAM_END)}")
        parts.append(rule if key in required else f"{rule}?")
    body = " ".join(parts)
    rules.insert(0, f"call{i}: {_lark_str(f'<tool_call>{chr(10)}<function={name}>{chr(10)}')} {body} "
                    f"{_lark_str('</function>' + chr(10) + '</tool_call>')}")
    return rules


def _json_call_rules(i: int, name: str, params: dict) -> list[str]:
    args = {k: v for k, v in params.items() if k not in _DEFS}
    call = {"type": "object", "properties": {"name": {"const": name}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
            # definitions at the root, where the parameters' "#/$defs/..." references look
            **{k: params[k] for k in _DEFS if k in params}}
    return [f"call{i}: {_lark_str('<tool_call>' + chr(10))} %json {json.dumps(call)} "
            f"{_lark_str(chr(10) + '</tool_call>')}"]


def tool_call_lark(constraint: Constraint, fmt: str) -> str:
    """The Lark grammar of a tool_call constraint in `fmt` ("qwen_xml" or "json")."""
    rules: list[str] = []
    starts: list[str] = []
    for i, (name, params_text) in enumerate(constraint.tools):
        if constraint.name is not None and name != constraint.name:
            continue
        params = json.loads(params_text)
        if not isinstance(params, dict):
            params = {}
        # a forced call names only the tool's own parameters (OpenAI's strict function calling)
        params.setdefault("additionalProperties", False)
        rules += (_xml_call_rules if fmt == "qwen_xml" else _json_call_rules)(i, name, params)
        starts.append(f"call{i}")
    return "\n".join([f"start: {' | '.join(starts)}"] + rules) + "\n"


# --- compiling against the model's vocabulary ---------------------------------------------------------

class ConstraintCompiler:
    """A model's vocabulary as llguidance sees it, and the grammars compiled against it.

    `token_bytes[i]`: token i's bytes; control tokens (end of turn, ...) carry llguidance's 0xFF
    prefix so that no text grammar can produce them and only `eog_tokens` end a reply.
    """

    def __init__(self, token_bytes: Sequence[bytes], special: Iterable[int], eog_tokens: Iterable[int],
                 n_vocab: int, encode, tool_call_format: str = "json"):
        llg = _llguidance()
        eog = sorted(int(t) for t in eog_tokens)
        if not eog:
            raise ValueError("constrained decoding needs an end-of-generation token in the vocabulary")
        specials = set(int(t) for t in special)

        class _Vocab:                # llguidance.TokenizerWrapper's input
            eos_token_id = eog[0]
            bos_token_id = None
            tokens = [(b"\xff" + b) if i in specials else b for i, b in enumerate(token_bytes)]
            special_token_ids = sorted(specials)

            def __call__(self, text: bytes) -> list[int]:
                return encode(text)

        self.llg = llg
        self.n_vocab = int(n_vocab)
        self.eog_tokens = frozenset(eog)
        self.tool_call_format = tool_call_format
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=self.n_vocab, eos_token=eog)
        self._grammars: dict[Constraint, str] = {}

    @classmethod
    def from_tokenizer(cls, tok, eog_tokens: Iterable[int], n_vocab: int, tool_call_format: str = "json"):
        """From tokenizer.Tokenizer (the GGUF's vocabulary). USER_DEFINED tokens (<think>,
        <tool_call>, ...) stay text: the reply's parsers read them as text."""
        from .tokenizer import TOKEN_CONTROL, TOKEN_UNKNOWN

        special = {i for i, ty in enumerate(tok.token_types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)}
        pieces = [tok.tokens[i].encode("utf-8") if i in special else tok.token_to_piece(i)
                  for i in range(tok.n_vocab)]
        pieces += [b""] * (int(n_vocab) - len(pieces))
        return cls(pieces, special, eog_tokens, n_vocab,
                   lambda b: tok.encode(b, add_special=False, parse_special=False), tool_call_format)

    def grammar(self, constraint: Constraint) -> str:
        """llguidance's grammar of `constraint`, checked; ValueError naming the problem."""
        g = self._grammars.get(constraint)
        if g is not None:
            return g
        llg, k = self.llg, constraint.kind
        what = {"json_schema": "JSON schema", "json_object": "JSON schema", "lark": "Lark grammar",
                "gbnf": "GBNF grammar", "regex": "regex", "tool_call": "tool call grammar"}[k]
        try:
            if k in ("json_schema", "json_object"):
                g = llg.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_OPTIONS)
            elif k == "tool_call":
                g = llg.LLMatcher.grammar_from_lark(tool_call_lark(constraint, self.tool_call_format))
            else:
                g = llg.grammar_from(k, constraint.text)
        except ValueError as exc:
            raise ValueError(f"constraint: invalid {what}: {exc}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(g, self.tokenizer)
        if is_error:
            raise ValueError(f"constraint: invalid {what}: {messages[0].strip()}")
        self._grammars[constraint] = g
        return g

    def state(self, constraint: Constraint, thinking: bool = False) -> "GrammarState":
        return GrammarState(self, self.grammar(constraint), thinking)


_POOL = None
_POOL_LOCK = threading.Lock()


def _mask_pool():
    """Worker threads for prefetched masks (one request uses one at a time)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="openjet-mask")
        return _POOL


def prompt_opens_think(prompt_text: str) -> bool:
    """True when the prompt ends inside a <think> block (the model reasons first)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class GrammarState:
    """One request's position in its grammar.

    consume(token) after each emitted token; mask_logits(logits) before each draw; rollback(n)
    forgets the last n consumed tokens (rejected drafts). While `thinking`, tokens pass freely
    until the reply's text contains </think>; the bytes after it go to the grammar.
    """

    def __init__(self, compiler: ConstraintCompiler, grammar: str, thinking: bool = False):
        self.c = compiler
        self.matcher = compiler.llg.LLMatcher(compiler.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"constraint: {self.matcher.get_error()}")
        self.thinking = thinking
        self._reasoning = bytearray()          # reply bytes while thinking
        # per consumed token: (tokens the matcher took, reasoning bytes it added, it closed </think>)
        self._log: list[tuple[int, int, bool]] = []
        self._mask_bits = np.empty((compiler.n_vocab + 31) // 32, dtype=np.uint32)
        self._pending = None                   # a prefetch() in flight (concurrent.futures.Future)

    @property
    def active(self) -> bool:
        """The grammar decides the next token (reasoning is over or there was none)."""
        return not self.thinking

    def prefetch(self) -> None:
        """Start computing the next mask on a worker thread (llguidance releases the GIL), so
        that it runs while the model evaluates the token just consumed; allowed() collects it.
        Anything else that touches the grammar waits for it first."""
        if not self.thinking and self._pending is None:
            self._pending = _mask_pool().submit(self._compute_mask)

    def _compute_mask(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self._mask_bits.ctypes.data, self._mask_bits.nbytes)

    def _settle(self) -> bool:
        """Wait for a prefetched mask; True if there was one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        pending.result()
        return True

    def allowed(self) -> np.ndarray | None:
        """bool[n_vocab] of the tokens allowed next; None while reasoning (all are)."""
        if self.thinking:
            return None
        if not self._settle():
            self._compute_mask()
        if self.matcher.is_error():
            raise RuntimeError(f"constraint: grammar state failed: {self.matcher.get_error()}")
        bits = np.unpackbits(self._mask_bits.view(np.uint8), bitorder="little")
        return bits[:self.c.n_vocab].view(bool)

    def mask_logits(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        """logits with every token the grammar forbids at -inf (a new float32 array; `logits`
        itself while reasoning)."""
        if allowed is None:
            allowed = self.allowed()
            if allowed is None:
                return logits
        x = np.ascontiguousarray(logits, dtype=np.float32)
        n = min(len(x), len(allowed))
        # min(x, +inf) = x where allowed, min(x, -inf) = -inf elsewhere: four branch-free passes.
        # A boolean select costs ~5x more on a scattered mask (a JSON string bars every token with
        # a newline or a quote) in mispredicted branches.
        out = np.full(len(x), -np.inf, dtype=np.float32)
        lim = out[:n]
        np.copyto(lim, allowed[:n].view(np.uint8), casting="unsafe")
        lim -= 0.5
        lim *= np.inf
        np.minimum(x[:n], lim, out=lim)
        return out

    def consume(self, token: int) -> None:
        self._settle()
        token = int(token)
        if not self.thinking:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constraint: token {token} does not continue the grammar "
                                   f"({self.matcher.get_error()})")
            self._log.append((1, 0, False))
            return
        piece = self.c.tokenizer.decode_bytes([token])
        before = len(self._reasoning)
        text = bytes(self._reasoning[max(0, before - len(THINK_CLOSE) + 1):]) + piece
        at = text.find(THINK_CLOSE.encode())
        taken = 0
        if at >= 0:
            # the rest of the token that closed the reasoning starts the constrained reply
            tail = text[at + len(THINK_CLOSE):]
            if tail:
                ids = self.c.tokenizer.tokenize_bytes(tail)
                taken = self.matcher.try_consume_tokens(ids)
                if taken != len(ids):
                    self.matcher.rollback(taken)
                    raise RuntimeError(f"constraint: the text after </think> ({tail!r}) does not "
                                       f"start the grammar")
            self.thinking = False
        self._reasoning += piece
        self._log.append((taken, len(piece), at >= 0))

    def try_consume(self, token: int) -> bool:
        """consume(token) if the grammar allows it (True), else nothing changes (False): a draft
        the grammar forbids ends the drafts."""
        self._settle()
        if not self.thinking:
            if self.matcher.try_consume_tokens([int(token)]) != 1:
                return False
            self._log.append((1, 0, False))
            return True
        try:
            self.consume(token)
        except RuntimeError:
            return False
        return True

    @property
    def n_consumed(self) -> int:
        return len(self._log)

    def rollback(self, n: int) -> None:
        """Forget the last n consumed tokens."""
        self._settle()
        if not 0 <= n <= len(self._log):
            raise ValueError(f"rollback of {n} tokens, but {len(self._log)} were consumed")
        for _ in range(n):
            taken, added, closed = self._log.pop()
            if taken and not self.matcher.rollback(taken):
                raise RuntimeError(f"constraint: grammar rollback failed ({self.matcher.get_error()})")
            if closed:
                self.thinking = True
            if added:
                del self._reasoning[len(self._reasoning) - added:]

    @property
    def finished(self) -> bool:
        """The grammar allows nothing but the end of the reply."""
        self._settle()
        return not self.thinking and self.matcher.is_stopped()
