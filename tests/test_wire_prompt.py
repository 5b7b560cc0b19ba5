"""A big gRPC request's prompt size is read off its wire bytes and an oversized prompt refused before the request
is parsed (worker/grpc/wire_prompt.py; a 15 MiB text parsed and decoded held the GIL 5-25 ms per request), with the
error the parsed request would get; what the reader cannot follow is parsed and checked as before."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_harness import ThreadedWorker

from radixcache.client import Client
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.worker.cli import load_model, parser
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.front.validation import (
    InvalidArgument,
    ModelLimits,
    PromptInput,
    PromptSize,
    check_prompt_input,
    check_prompt_size,
)
from radixcache.worker.grpc.wire_prompt import prompt_size

GENERATE = "/radixcache.v1.RadixCache/Generate"

# Fragments of a GenerateRequest's wire bytes; a request is any sequence of them (the parser merges them in order).
fragment = st.one_of(
    st.text(max_size=40).map(lambda t: pb.GenerateRequest(text=t or "x")),
    st.lists(st.tuples(st.sampled_from(["user", "assistant"]), st.text(max_size=20)), max_size=6).map(
        lambda ms: pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c)
                                                                          for r, c in ms]))  # fmt: skip
    ),
    st.lists(st.integers(0, 99), min_size=1, max_size=5).map(lambda ids: pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))),
    st.builds(lambda n, s: pb.GenerateRequest(max_tokens=n, stop=s), st.integers(1, 9), st.lists(st.text(max_size=5), max_size=3)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(fragment, min_size=1, max_size=6), st.integers(0, 8))
def test_the_size_read_off_the_wire_is_the_parsed_requests(fragments, most_messages):
    raw = b"".join(f.SerializeToString() for f in fragments)
    parsed = pb.GenerateRequest.FromString(raw)
    size = prompt_size(raw, pb.GenerateRequest.DESCRIPTOR, most_messages=most_messages)
    kind = parsed.WhichOneof("input")
    if kind == "text":
        assert size == PromptSize("text", text_bytes=len(parsed.text.encode()))
    elif kind == "messages":
        entries = parsed.messages.messages
        if len(entries) > most_messages:  # counted only as far as a refusal needs
            assert size.kind == "messages" and size.messages == most_messages + 1
        else:
            content = sum(len(m.content.encode()) for m in entries)
            assert size == PromptSize("messages", messages=len(entries), content_bytes=content)
    else:
        assert size.kind is None


def test_a_repeated_content_counts_its_last_value():
    entry = (
        pb.ChatMessage(content="a" * 50).SerializeToString()
        + pb.ChatMessage(role="user", content="b").SerializeToString()
    )
    raw = pb.GenerateRequest(
        messages=pb.ChatMessages.FromString(b"\x0a" + bytes([len(entry)]) + entry)
    ).SerializeToString()
    assert pb.GenerateRequest.FromString(raw).messages.messages[0].content == "b"
    assert prompt_size(raw, pb.GenerateRequest.DESCRIPTOR, most_messages=4) == PromptSize(
        "messages", messages=1, content_bytes=1
    )


def test_unreadable_bytes_say_nothing():
    text = pb.GenerateRequest(text="abc").SerializeToString()
    for raw in (text[:-1], b"\x0b\x00", text + b"\x80"):  # truncated, a group, a dangling varint
        assert prompt_size(raw, pb.GenerateRequest.DESCRIPTOR, most_messages=4).kind is None


LIMITS = ModelLimits(vocab_size=100, context_length=64, max_bytes_per_token=2)  # at most 126 bytes of prompt


@pytest.mark.parametrize(
    "prompt",
    [PromptInput(text="é" * 64), PromptInput(messages=[{"role": "user", "content": "ab" * 32}] * 2),
     PromptInput(messages=[{"role": "user", "content": ""}] * 64)],
)  # fmt: skip
def test_a_size_refusal_is_the_full_checks_refusal(prompt):
    with pytest.raises(InvalidArgument) as full:
        check_prompt_input(prompt, tokenizer=object(), limits=LIMITS)
    if prompt.text is not None:
        size = PromptSize("text", text_bytes=len(prompt.text.encode()))
    else:
        content = sum(len(m["content"].encode()) for m in prompt.messages)
        size = PromptSize("messages", messages=len(prompt.messages), content_bytes=content)
    with pytest.raises(InvalidArgument) as early:
        check_prompt_size(size, LIMITS)
    assert type(early.value) is type(full.value) and str(early.value) == str(full.value)


@pytest.fixture(scope="module")
def worker():
    """The --random-model worker (character tokenizer, context 2048): any text of 64 KiB or more cannot fit."""
    loaded, _, _ = load_model(parser().parse_args(["--random-model", "--device", "cpu"]))
    engine = Engine(loaded, EngineConfig(page_size=16, kv_pages=48, max_step_tokens=128, backend="torch"))
    with ThreadedWorker(engine, max_message_bytes=16 << 20) as w:
        yield w


def _call(target: str, raw: bytes) -> grpc.RpcError | None:
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 16 << 20)]) as ch:
        try:
            list(ch.unary_stream(GENERATE)(raw, timeout=30))
        except grpc.RpcError as e:
            return e
    return None


def test_an_oversized_prompt_is_refused_before_its_request_is_parsed(worker):
    """Invalid UTF-8 inside the text: parsing would fail ("cannot be decoded"); the refusal names the size instead,
    so the request was refused from its bytes, unparsed. The same text, valid, gets the same size error."""
    text = b"a" * (1 << 20)
    broken = pb.GenerateRequest(max_tokens=1).SerializeToString() + b"\x12" + _varint(len(text) + 1) + text + b"\xff"
    error = _call(worker.target, broken)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text has at least 1048577 bytes" in error.details(), error.details()
    valid = _call(worker.target, pb.GenerateRequest(text="a" * (1 << 20) + "b", max_tokens=1).SerializeToString())
    assert valid is not None and valid.details() == error.details()


def test_a_big_request_with_a_prompt_that_fits_is_parsed_off_the_loop_and_served(worker):
    """128 KiB of an unknown field (a newer client's) around a short prompt: parsed in a worker thread, served."""
    unknown = b"\xfa\x3f" + _varint(128 << 10) + b"z" * (128 << 10)  # field 1023, length-delimited
    raw = pb.GenerateRequest(text="hello", max_tokens=3, ignore_eos=True).SerializeToString() + unknown
    with grpc.insecure_channel(worker.target) as ch:
        replies = list(ch.unary_stream(GENERATE, response_deserializer=pb.GenerateResponse.FromString)(raw, timeout=30))
    assert sum(len(r.token_ids) for r in replies) == 3
    broken = raw[:-1]  # truncated: undecodable, still answered cleanly
    error = _call(worker.target, broken)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be decoded" in error.details()
    with Client(worker.target) as c:
        assert c.stats()["live_leases"] == 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
