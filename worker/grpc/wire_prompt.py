"""A prompt's size read off a gRPC request's wire bytes, before the request is parsed (for validation's
`check_prompt_size`): a 15 MiB text that cannot fit the context is refused without parsing it and decoding its
UTF-8, which hold the GIL for 5-25 ms per request and so stall every other call on the event loop.

Only the protobuf wire format is read here (tags, lengths); what is valid is decided in validation. The answer is
what the parser would keep: the last `input` oneof member on the wire wins, a repeated text keeps its last value,
a repeated `messages` field merges (its entries add up). Whatever this reader does not follow (groups, a truncated
message, more than MAX_FIELDS fields) answers kind None, and the request is parsed and checked as usual.
"""

from __future__ import annotations

from typing import Any

from radixcache.worker.front.validation import PromptSize

MAX_FIELDS = 64  # top-level fields read before giving up (a request with a long stop list is parsed as usual)
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class _Unreadable(Exception):
    """Wire bytes this reader does not follow; the parser will judge them."""


def _varint(raw: bytes | memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(raw) or shift > 63:
            raise _Unreadable
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(raw: bytes | memoryview, start: int, end: int, limit: int):
    """(field number, value start, value end) of each length-delimited field in raw[start:end], at most `limit`
    fields in all (others are skipped over); _Unreadable past the limit or on what cannot be skipped."""
    i, seen = start, 0
    while i < end:
        seen += 1
        if seen > limit:
            raise _Unreadable
        tag, i = _varint(raw, i)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _LEN:
            length, i = _varint(raw, i)
            if i + length > end:
                raise _Unreadable
            yield number, i, i + length
            i += length
        elif wire_type == _VARINT:
            _, i = _varint(raw, i)
        elif wire_type == _I64:
            i += 8
        elif wire_type == _I32:
            i += 4
        else:  # groups (3, 4) and invalid types
            raise _Unreadable
    if i != end:
        raise _Unreadable


def prompt_size(raw: bytes, descriptor: Any, *, most_messages: int) -> PromptSize:
    """The size of the `input` oneof (text | token_ids | messages) of a serialized request of `descriptor` (a
    GenerateRequest, TokenizeRequest or (Un)PinPrefixRequest). Chat messages are counted up to `most_messages` + 1
    (enough to refuse too many without reading a million)."""
    input_fields = {f.number: f.name for f in descriptor.oneofs_by_name["input"].fields}
    messages_field = descriptor.fields_by_name["messages"].message_type
    entry_number = messages_field.fields_by_name["messages"].number
    content_number = messages_field.fields_by_name["messages"].message_type.fields_by_name["content"].number
    view = memoryview(raw)
    kind, text_bytes, count, content = None, 0, 0, 0
    try:
        for number, start, end in _fields(view, 0, len(view), MAX_FIELDS):
            name = input_fields.get(number)
            if name is None:
                continue
            if name != kind:  # another oneof member clears the one before
                kind, text_bytes, count, content = name, 0, 0, 0
            if name == "text":
                text_bytes = end - start
            elif name == "messages" and count <= most_messages:
                more, size = _chat_size(view, start, end, most_messages + 1 - count, entry_number, content_number)
                count, content = count + more, content + size
    except _Unreadable:
        return PromptSize(None)
    if kind == "text":
        return PromptSize("text", text_bytes=text_bytes)
    if kind == "messages":
        return PromptSize("messages", messages=count, content_bytes=content)
    return PromptSize(None)


def _chat_size(view: memoryview, start: int, end: int, room: int, entry_number: int, content_number: int):
    """(entries, content bytes) of a ChatMessages value, counting at most `room` entries (then it stops: the
    count is what matters)."""
    count = content = 0
    i = start
    while i < end and count < room:
        tag, i = _varint(view, i)
        if tag & 7 != _LEN:
            raise _Unreadable  # ChatMessages holds only its repeated entries
        length, i = _varint(view, i)
        if i + length > end:
            raise _Unreadable
        if tag >> 3 == entry_number:
            count += 1
            last = 0  # a repeated content keeps its last value
            for f, s, e in _fields(view, i, i + length, MAX_FIELDS):
                if f == content_number:
                    last = e - s
            content += last
        i += length
    return count, content
