"""Tool calls in generated text, in the Hermes / Qwen2.5 convention the chat templates of those models teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is a JSON object with a string "name" (and "arguments": an object, or a JSON string of one;
absent means {}) is a tool call. Anything else stays text, as generated: a malformed block, and a block the
generation never closed (e.g. cut by max_tokens). Text outside the blocks is the message's content.

`ToolCallParser` does the same incrementally over streamed deltas: it holds back text that may be the start of a
`<tool_call>` tag, and the body of an open block until it closes, so a tool call is never shown as text and then
again as a call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixcache.worker.validation import MAX_SCHEMA_DEPTH

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized (what OpenAI's function.arguments carries)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def parse_call(body: str) -> ToolCall | None:
    """The call a block's body describes, or None if it is not a valid call."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_open_at_end(text: str) -> int:
    """Length of the longest tail of text that is a proper prefix of OPEN (held back: it may become a tag)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


@dataclass
class Parsed:
    """What a chunk of generated text holds: text to show and the tool calls completed, in order."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Incremental: push(delta) -> Parsed of what is certain so far; finish() -> the rest (an unclosed block as
    text). Concatenating every Parsed.text gives the content; the calls, in order, are the tool calls."""

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
                keep = _partial_open_at_end(self._buffer)
                out.text += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            out.text += self._buffer[:start]
            self._buffer = self._buffer[start:]
        self.calls += out.calls
        return out

    def finish(self) -> Parsed:
        """The end of the generation: whatever is held back is text (an unclosed block, a partial tag)."""
        rest, self._buffer = self._buffer, ""
        return Parsed(text=rest)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole generation. The content keeps every character that is not a valid call's
    block; callers strip it when calls were found (the blocks were usually surrounded by newlines)."""
    parser = ToolCallParser()
    first, last = parser.push(text), parser.finish()
    return first.text + last.text, parser.calls


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None = None) -> str:
    """A Lark grammar (for a Constraint of kind "ebnf") whose sentences are exactly one tool-call block calling one
    of `tools` ([{"type": "function", "function": {"name", "parameters"}}]), or only `name`, with arguments valid
    against that function's parameters schema: what tool_choice "required" / a named function forces."""
    from radixcache.worker.structured import JSON_LAYOUT

    functions = [f for f in (t["function"] for t in tools) if name is None or f["name"] == name]
    calls = []
    for i, f in enumerate(functions):
        # The parameters move from a document's root to .../properties/arguments: their "#/..." refs (pydantic's
        # "#/$defs/Model", a recursive "#") are rebased to keep pointing into them.
        at = ("" if len(functions) == 1 else f"/anyOf/{i}") + "/properties/arguments"
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": rebase_refs(f.get("parameters") or {"type": "object"}, at),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": JSON_LAYOUT}
    return f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}\n"


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
