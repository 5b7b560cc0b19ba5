"""A request body's JSON, parsed without stalling the event loop, and refused as soon as its shape breaks a limit.

    shape = BodyShape(max_depth=..., max_items=..., rules={("messages",): ArrayRule(1024, "messages"), ...})
    data = await parse_body(raw, shape)      # what json.loads gives, or BodyError (400, naming the field)

Why not json.loads, on the loop or in a thread: it holds the GIL for the whole parse (a thread does not let the
loop run), and what it costs grows with what the body holds, not with what a request may hold. 16 MB of
{"role": "u"} are 1.25M dicts (and then 1.25M pydantic models) before any count is checked; one 16 MB string is a
single 30-100 ms call; 1,000 nested arrays raise RecursionError. So:

- a small body (at most FAST_BYTES) with few structural characters (a C-speed count of "{", "[" and ",", which
  over-counts: those inside strings count too) cannot cost much and cannot nest deeper than the limit: json.loads;
- a body over PREFIX_BYTES has its first MiB parsed first, for the limits only: a hostile body breaks its limit
  early (1,025 messages are 13 KB), and is then refused without being decoded or copied whole;
- any other body is parsed here, in slices: at most SLICE_ITEMS values, or SLICE_CHARS characters of one string,
  between two yields to the loop, so no slice holds the GIL for more than about a millisecond. It stops at the
  first limit broken: nesting deeper than `max_depth`, more than `max_items` values and keys in all, an array at a
  limited path (messages, tools, stop, ...) longer than its rule allows, a string longer than `max_string_chars`
  (a 15 MiB prompt is refused after that many characters, not parsed whole). A hostile body is therefore refused
  after work bounded by the limits, not by its size, and the parsed value of an accepted one is bounded too, so what
  comes after (pydantic, validation) is cheap. Sizes in bytes (a schema's) are validation's to check, on the value.

Measured (2-core development machine, CPU time per slice, tests/test_json_body.py's bodies at full size): 16 MB of
{"role":"u"} refused after 6.5 ms in all (1,025 messages parsed), 300k tools after 3 ms, 100,000 nested arrays
after 0.3 ms; a 15 MiB prompt parsed in ~250 slices of at most 2-10 ms each (the longest: joining the 15 MiB string
at the end, one memcpy), where json.loads takes the whole 20-100 ms in one call. Parsing 16 MB in slices costs
~0.3 s of CPU against json.loads' 0.1 s: that is the price of answering health meanwhile.

The result equals json.loads' for every body both accept (NaN and Infinity included; duplicate keys: the last
wins); the body must be UTF-8 (RFC 8259). Paths name object keys, with "*" for any array element:
("messages", "*", "content") is every message's content.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import re
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from json.decoder import scanstring
from typing import Any

FAST_BYTES = 256 << 10  # bodies up to this size may go to json.loads at once ...
FAST_STRUCTURE = 2048  # ... when they hold at most this many "," (and no more "{" and "[" than max_depth)
SLICE_ITEMS = 512  # values and keys parsed between two yields to the loop (~0.5 ms)
SLICE_CHARS = 1 << 16  # characters of a string (or of whitespace) decoded between two yields
DECODE_SLICE_BYTES = 1 << 20  # bytes of UTF-8 decoded between two yields
PREFIX_BYTES = 1 << 20  # a large body's limits are checked on its first MiB before it is decoded whole
MAX_NUMBER_CHARS = 4400  # Python refuses to convert an int of more than 4,300 digits anyway

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")
# Characters of a string up to its closing quote: no quote, backslash or control character, but whole escapes.
_PIECE = re.compile(r'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*')
_CONSTANTS = (("true", True), ("false", False), ("null", None), ("NaN", math.nan), ("Infinity", math.inf),
              ("-Infinity", -math.inf))  # fmt: skip


class BodyError(ValueError):
    """The body is not JSON, or breaks a limit; `param` is the request field it names (None: the body)."""

    def __init__(self, message: str, param: str | None = None, *, limit: bool = False) -> None:
        super().__init__(message)
        self.message, self.param = message, param
        self.limit = limit  # a limit broken (not a JSON error)


@dataclass(frozen=True)
class ArrayRule:
    """The array at a path holds at most `most` elements (`noun`: what they are, for the message)."""

    most: int
    noun: str


@dataclass(frozen=True)
class BodyShape:
    max_depth: int  # objects and arrays nested in one another, the body itself included
    max_items: int  # values (scalars, strings, objects, arrays) and object keys in all
    rules: Mapping[tuple[str, ...], ArrayRule] = field(default_factory=dict)
    # A string (key or value) of more characters than this is refused as soon as its parse passes it (None: any).
    max_string_chars: int | None = None


async def parse_body(body: bytes | bytearray | Sequence[bytes], shape: BodyShape) -> Any:
    """The body's JSON value (see the module docstring); BodyError if it is not UTF-8 JSON or breaks `shape`.

    `body`: the bytes, or the pieces it arrived in (joined here only as far as needed: a body refused by its first
    PREFIX_BYTES is never copied whole)."""
    chunks = [body] if isinstance(body, (bytes, bytearray)) else list(body)
    size = sum(len(c) for c in chunks)
    if size <= FAST_BYTES:
        raw = b"".join(chunks)
        if _cheap(raw, shape):
            text = _decode(raw)
            try:
                return json.loads(text)
            except ValueError as e:
                raise BodyError(f"the request body is not valid JSON: {e}") from None
    if size > PREFIX_BYTES:
        await _check_prefix(chunks, shape)
    text = await _decode_in_slices(chunks)
    return await _run(_Parser(text, shape))


async def _run(parser: _Parser) -> Any:
    steps = parser.parse()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)  # let the loop serve others between two slices


async def _check_prefix(chunks: list[bytes | bytearray], shape: BodyShape) -> None:
    """Raise the limit the body's first PREFIX_BYTES break, if they break one. A hostile body breaks its limit
    early (1,025 messages are 13 KB), and a limit broken by a prefix is broken by the body (the checks read only
    what came before); the prefix's JSON errors (it ends mid-value) are not the body's and are ignored."""
    head, taken = [], 0
    for chunk in chunks:
        head.append(chunk)
        taken += len(chunk)
        if taken >= PREFIX_BYTES:
            break
    text = await _decode_in_slices(head, final=False)
    try:
        await _run(_Parser(text, shape))
    except BodyError as e:
        if e.limit:
            raise


def _cheap(raw: bytes | bytearray, shape: BodyShape) -> bool:
    return raw.count(b"{") + raw.count(b"[") <= shape.max_depth and raw.count(b",") <= min(
        FAST_STRUCTURE, shape.max_items // 2
    )


def _decode(raw: bytes | bytearray) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the request body is not valid UTF-8: {e.reason} at byte {e.start}") from None


async def _decode_in_slices(chunks: list[bytes | bytearray], *, final: bool = True) -> str:
    """The chunks' UTF-8 text, decoded DECODE_SLICE_BYTES at a time (final=False: a character cut at the end is
    left out)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces, offset = [], 0
    try:
        for chunk in chunks:
            for start in range(0, len(chunk), DECODE_SLICE_BYTES):
                pieces.append(decoder.decode(chunk[start : start + DECODE_SLICE_BYTES]))
                await asyncio.sleep(0)
            offset += len(chunk)
        if final:
            pieces.append(decoder.decode(b"", final=True))  # refuses a body ending mid-character
    except UnicodeDecodeError as e:
        raise BodyError(f"the request body is not valid UTF-8: {e.reason} near byte {offset}") from None
    text = "".join(pieces)  # one copy of the whole body (milliseconds for 16 MB): nothing else in this slice
    await asyncio.sleep(0)
    return text


class _Open:
    """An object or array being parsed: its value so far, and the rule of its path."""

    __slots__ = ("value", "is_list", "key", "rule", "closer")

    def __init__(self, value: dict | list, rule: ArrayRule | None) -> None:
        self.value, self.is_list, self.rule = value, isinstance(value, list), rule
        self.key: str = ""  # an object's key whose value is being parsed
        self.closer = "]" if self.is_list else "}"


class _Parser:
    """One body's parse as a generator: it yields between slices and returns the value (see the module docstring)."""

    def __init__(
        self, text: str, shape: BodyShape, *, slice_items: int = SLICE_ITEMS, slice_chars: int = SLICE_CHARS
    ) -> None:
        self.text, self.shape = text, shape
        self.slice_items, self.slice_chars = slice_items, slice_chars
        self.stack: list[_Open] = []
        self.items = 0
        self.next_yield = slice_items
        self.rule_depth = max((len(path) for path in shape.rules), default=-1)

    # -- errors ------------------------------------------------------------------------------------------------
    def _invalid(self, what: str, pos: int) -> BodyError:
        return BodyError(f"the request body is not valid JSON: {what} at character {pos}")

    def _field(self, depth: int) -> str:
        """The request field the first `depth` open containers lead to, e.g. "messages[3].content"."""
        name = ""
        for parent in self.stack[:depth]:
            if parent.is_list:
                name += f"[{len(parent.value)}]"
            else:
                name += f".{parent.key}" if name else parent.key
        return name

    # -- the parse ---------------------------------------------------------------------------------------------
    def parse(self) -> Generator[None, None, Any]:
        text, stack = self.text, self.stack
        end = len(text)
        pos = yield from self._ws(0)
        while True:
            # A value starts at pos.
            if self.items >= self.next_yield:
                self.next_yield += self.slice_items
                yield
            self._count()
            c = text[pos] if pos < end else ""
            if c == "{" or c == "[":
                self._open(c)
                pos = yield from self._ws(pos + 1)
                frame = stack[-1]
                if text.startswith(frame.closer, pos):  # empty
                    value, pos = self._close(pos)
                else:
                    if not frame.is_list:
                        pos = yield from self._key(pos)
                    continue
            elif c == '"':
                value, pos = yield from self._string(pos)
            else:
                value, pos = self._scalar(pos)
            # `value` is complete: put it in its container; close the containers that end here.
            while True:
                if not stack:
                    pos = yield from self._ws(pos)
                    if pos != end:
                        raise self._invalid("extra data", pos)
                    return value
                frame = stack[-1]
                if frame.is_list:
                    rule = frame.rule
                    if rule is not None and len(frame.value) >= rule.most:
                        name = self._field(len(stack) - 1)
                        message = f"{name} must hold at most {rule.most} {rule.noun}, got more"
                        raise BodyError(message, name, limit=True)
                    frame.value.append(value)
                else:
                    frame.value[frame.key] = value
                pos = yield from self._ws(pos)
                c = text[pos] if pos < end else ""
                if c == ",":
                    pos = yield from self._ws(pos + 1)
                    if not frame.is_list:
                        pos = yield from self._key(pos)
                    break  # the next element
                if c == frame.closer:
                    value, pos = self._close(pos)
                    continue
                raise self._invalid(f"expecting ',' or '{frame.closer}'", pos)

    def _count(self) -> None:
        self.items += 1
        if self.items > self.shape.max_items:
            raise BodyError(f"the request body holds more than {self.shape.max_items} JSON values and keys", limit=True)

    def _open(self, c: str) -> None:
        stack = self.stack
        if len(stack) >= self.shape.max_depth:
            raise BodyError(f"the request body nests objects and arrays more than {self.shape.max_depth} deep",
                            limit=True)  # fmt: skip
        rule = None
        if len(stack) <= self.rule_depth:
            path = tuple("*" if parent.is_list else parent.key for parent in stack)
            rule = self.shape.rules.get(path)
        stack.append(_Open({} if c == "{" else [], rule))

    def _close(self, pos: int) -> tuple[Any, int]:
        """The innermost container ends at pos (its closer): its value, and the position after it."""
        return self.stack.pop().value, pos + 1

    def _key(self, pos: int) -> Generator[None, None, int]:
        """An object key and its colon at pos; sets the innermost frame's key; returns where its value starts."""
        if not self.text.startswith('"', pos):
            raise self._invalid("expecting a property name in double quotes", pos)
        self._count()
        key, pos = yield from self._string(pos)
        pos = yield from self._ws(pos)
        if not self.text.startswith(":", pos):
            raise self._invalid("expecting ':' delimiter", pos)
        self.stack[-1].key = key
        return (yield from self._ws(pos + 1))

    def _ws(self, pos: int) -> Generator[None, None, int]:
        """Past the whitespace at pos, slice_chars characters at a time."""
        while True:
            stop = pos + self.slice_chars
            pos = _WS.match(self.text, pos, stop).end()
            if pos < stop:
                return pos
            yield

    def _string(self, pos: int) -> Generator[None, None, tuple[str, int]]:
        """The string whose opening quote is at pos, and the position after its closing quote; long strings are
        decoded slice_chars characters at a time (json's own scanstring decodes each piece, as json.loads would)."""
        text, end = self.text, len(self.text)
        start = pos + 1
        pieces: list[str] = []
        chars, most = 0, self.shape.max_string_chars
        while True:
            window = min(start + self.slice_chars, end)
            stop = _PIECE.match(text, start, window).end()
            closed = stop < end and text[stop] == '"'
            cut = not closed and window < end and (stop == window or (text[stop] == "\\" and window - stop < 6))
            if not closed and not cut:
                if stop >= end:
                    raise self._invalid("unterminated string", pos)
                what = "invalid control character" if text[stop] != "\\" else "invalid \\escape"
                raise self._invalid(what, stop)
            piece = text[start:stop]
            if "\\" in piece:
                piece = scanstring(text, start)[0] if closed else scanstring(f'"{piece}"', 1)[0]
            chars += len(piece)
            if most is not None and chars > most:
                name = self._field(len(self.stack))
                message = f"{name or 'the request body'} is a string of more than {most} characters, longer than any"
                raise BodyError(f"{message} field of a request this model can serve", name or None, limit=True)
            if closed and not pieces:
                return piece, stop + 1
            pieces.append(piece)
            yield
            if closed:
                value = _join(pieces)
                yield  # joining a long string is one copy of it: the slice ends there
                return value, stop + 1
            start = stop

    def _scalar(self, pos: int) -> tuple[Any, int]:
        text = self.text
        number = _NUMBER.match(text, pos, pos + MAX_NUMBER_CHARS)
        if number is not None:
            if number.end() == pos + MAX_NUMBER_CHARS:
                raise self._invalid(f"a number of more than {MAX_NUMBER_CHARS} characters", pos)
            integer, fraction, exponent = number.groups()
            try:
                value = float(integer + (fraction or "") + (exponent or "")) if fraction or exponent else int(integer)
            except ValueError as e:  # more digits than Python converts
                raise self._invalid(str(e), pos) from None
            return value, number.end()
        for word, value in _CONSTANTS:
            if text.startswith(word, pos):
                return value, pos + len(word)
        raise self._invalid("expecting value", pos)


def _join(pieces: list[str]) -> str:
    """Pieces of one string, joined; a surrogate pair whose halves were decoded in two pieces becomes one
    character again, as json.loads makes it."""
    for i in range(len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if a and b and "\ud800" <= a[-1] <= "\udbff" and "\udc00" <= b[0] <= "\udfff":
            pair = chr(0x10000 + ((ord(a[-1]) - 0xD800) << 10) + (ord(b[0]) - 0xDC00))
            pieces[i], pieces[i + 1] = a[:-1], pair + b[1:]
    return "".join(pieces)
