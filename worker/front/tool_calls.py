"""Tool use, for every front (OpenAI chat and responses, Anthropic messages): tool definitions, what a request allows
(tool choice), the grammar that forces a call, and the tool calls in generated text.

Calls are written in the Hermes / Qwen2.5 convention the chat templates of those models teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is a JSON object with a string "name" (and "arguments": an object, or a JSON string of one;
absent means {}) is a tool call. Anything else stays text, as generated: a malformed block, and a block the
generation never closed, unless the caller says the generation was cut there (`finish(truncated=True)`: the call as
far as it got, never the markup). Text outside the blocks is the message's content.

`ToolCallParser` does the same incrementally over streamed deltas: it holds back text that may be the start of a
`<tool_call>` tag, and the body of an open block until it closes, so a tool call is never shown as text and then
again as a call.

Fronts map their wire's tool definitions to `ToolSpec`s and their tool choice to a `ToolChoice`; `ToolChoice.
constraint` gives the structured-output constraint (kind, text) that enforces it, or none.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixcache.worker.engine.request import MAX_SCHEMA_DEPTH

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolSpec:
    """One function a request offers, in no wire's shape. parameters: its JSON schema (None: any object)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool = False

    def template_form(self) -> dict[str, Any]:
        """As chat templates and Hugging Face's apply_chat_template take a tool (OpenAI chat's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


def template_tools(specs: Sequence[ToolSpec]) -> list[dict[str, Any]] | None:
    """The `tools` variable of a chat template (None without tools: the template renders no tools block)."""
    return [s.template_form() for s in specs] or None


@dataclass(frozen=True)
class ToolChoice:
    """How a request may call its tools: mode "auto" (text or calls), "none" (text only: calls stay text),
    "required" (exactly one call); `allowed` limits the calls to these names (None: any tool), while every tool is
    still rendered into the prompt (so the prompt, and its cache, stays the same from step to step); `parallel`
    False: at most one call (with "auto" the generation stops after the first complete one)."""

    mode: str = "auto"
    allowed: tuple[str, ...] | None = None
    parallel: bool = True

    def check(self, specs: Sequence[ToolSpec]) -> str | None:
        """What is wrong with this choice for these tools, as a sentence (None: nothing)."""
        if self.mode not in TOOL_CHOICE_MODES:
            return f"the mode must be one of {', '.join(TOOL_CHOICE_MODES)}; got {self.mode!r}"
        if self.mode != "none" and (self.mode == "required" or self.allowed is not None) and not specs:
            return "requires tools"
        names = {s.name for s in specs}
        for name in self.allowed or ():
            if name not in names:
                return f"names the function {name!r}, which is not among tools"
        if self.allowed is not None and not self.allowed:
            return "allows no tool"
        return None

    def parses(self, specs: Sequence[ToolSpec]) -> bool:
        """Generated <tool_call> blocks become tool calls."""
        return bool(specs) and self.mode != "none"

    def constraint(self, specs: Sequence[ToolSpec]) -> tuple[str | None, str]:
        """The constraint that enforces this choice: (kind, text) as validation.constraint takes it, or (None, "")
        when the model may write anything ("auto" over every tool, "none")."""
        if self.mode == "none" or not specs:
            return None, ""
        allowed = [s for s in specs if self.allowed is None or s.name in self.allowed]
        if self.mode == "required":
            return "ebnf", tool_call_grammar(allowed, text_allowed=False)
        if len(allowed) < len(specs):
            return "ebnf", tool_call_grammar(allowed, text_allowed=True)
        return None, ""

    def stop(self) -> tuple[str, ...]:
        """Stop strings that enforce parallel=False under "auto" (a grammar already forces one call otherwise)."""
        return (CLOSE,) if not self.parallel and self.mode == "auto" else ()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized (what OpenAI's function.arguments carries); partial if cut short
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def parse_call(body: str) -> ToolCall | None:
    """The call a block's body describes, or None if it is not a valid call."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: a generated block nested deeper than json.loads goes
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


_PARTIAL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')


def partial_call(body: str) -> ToolCall:
    """The call an unclosed block's body (cut by max_tokens) describes as far as it got: the name (as much of it
    as was written) and the arguments' JSON text so far ("" before they began). A body that is already a complete
    call (cut before the closing tag) is that call."""
    body = body[: len(body) - _partial_tag_at_end(body, CLOSE)]
    whole = parse_call(body)
    if whole is not None:
        return whole
    match = _PARTIAL_NAME.match(body)
    if match is None:
        return ToolCall("", "")
    try:
        name = json.loads(f'"{match.group(1)}"')
    except ValueError:  # cut inside an escape
        name = match.group(1)
    rest = body[match.end() :] if match.group(2) else ""
    arguments = _ARGUMENTS_KEY.match(rest)
    return ToolCall(name, rest[arguments.end() :] if arguments else "")


def _partial_tag_at_end(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of `tag` (held back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class Parsed:
    """What a chunk of generated text holds: text to show and the tool calls completed, in order."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Incremental: push(delta) -> Parsed of what is certain so far; finish() -> the rest. Concatenating every
    Parsed.text gives the content; the calls, in order, are the tool calls."""

    def __init__(self) -> None:
        self._buffer = ""  # held back: a possible tag start, or an open block (starting with OPEN)
        self.calls: list[ToolCall] = []

    def push(self, delta: str) -> Parsed:
        out = Parsed()
        self._buffer += delta
        while self._buffer:
            if self._buffer.startswith(OPEN):
                end = self._buffer.find(CLOSE, len(OPEN))
                if end < 0:
                    break  # the block is still open
                block = self._buffer[: end + len(CLOSE)]
                self._buffer = self._buffer[end + len(CLOSE) :]
                call = parse_call(block[len(OPEN) : -len(CLOSE)])
                if call is None:
                    out.text += block  # malformed: it stays text
                else:
                    out.calls.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial_tag_at_end(self._buffer, OPEN)
                out.text += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            out.text += self._buffer[:start]
            self._buffer = self._buffer[start:]
        self.calls += out.calls
        return out

    def finish(self, *, truncated: bool = False, closed: bool = False) -> Parsed:
        """The end of the generation. What is held back is text (a partial tag, an unclosed block), except:
        truncated (cut by max_tokens): an open block is the call as far as it got (`partial_call`); closed (it
        stopped at the CLOSE stop string of ToolChoice.stop): an open block is closed first."""
        rest, self._buffer = self._buffer, ""
        if rest.startswith(OPEN) and closed:
            out = self.push(rest + CLOSE)
            return Parsed(out.text + self.finish().text, out.calls)
        if rest.startswith(OPEN) and truncated:
            call = partial_call(rest[len(OPEN) :])
            self.calls.append(call)
            return Parsed(calls=[call])
        return Parsed(text=rest)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole generation. The content keeps every character that is not a valid call's
    block; callers strip it when calls were found (the blocks were usually surrounded by newlines)."""
    parser = ToolCallParser()
    first, last = parser.push(text), parser.finish()
    return first.text + last.text, parser.calls


def tool_call_grammar(specs: Sequence[ToolSpec], *, text_allowed: bool = False) -> str:
    """A Lark grammar (for a Constraint of kind "ebnf") whose sentences are exactly one tool-call block calling one
    of `specs`, with arguments valid against that function's parameters schema (tool_choice "required" / a named
    function); text_allowed: or else a text that holds no <tool_call> block at all ("auto" limited to `specs`)."""
    from radixcache.worker.engine.structured import JSON_LAYOUT

    calls = [
        {
            "type": "object",
            # The parameters move from a document's root to .../properties/arguments: their "#/..." refs (pydantic's
            # "#/$defs/Model", a recursive "#") are rebased to keep pointing into them.
            "properties": {
                "name": {"const": s.name},
                "arguments": rebase_refs(
                    dict(s.parameters or {"type": "object"}),
                    ("" if len(specs) == 1 else f"/anyOf/{i}") + "/properties/arguments",
                ),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, s in enumerate(specs)
    ]
    schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": JSON_LAYOUT}
    grammar = f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}\n"
    if not text_allowed:
        return "start: call\n" + grammar
    # A text lexeme that can never hold the opening tag; a call can only start the reply (no lexeme boundary
    # inside free text, which llguidance's greedy lexer could not find).
    text = f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(OPEN)}(?s:.*)/\n"
    return "start: TEXT | call\n" + text + grammar


# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is a value to match, left as it is.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def rebase_refs(schema: Any, at: str, depth: int = 0) -> Any:
    """A copy of `schema` with every local reference ("#" or "#/pointer") moved under the JSON pointer `at` (where
    the schema now sits inside a bigger document); other references (anchors, URLs) are left as they are.

    Below MAX_SCHEMA_DEPTH levels the rest is kept as it is, with no recursion: such a schema is past what
    llguidance reads (128 levels) and is refused when it compiles."""
    if depth > MAX_SCHEMA_DEPTH or not isinstance(schema, (dict, list)):
        return schema
    if isinstance(schema, list):
        return [rebase_refs(item, at, depth + 1) for item in schema]
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebase_refs(value, at, depth + 1)
    return out
