"""Anthropic's Messages API through the official `anthropic` client against a real worker (in process: the embedded
default model, the tools-aware template of agent_fixtures.py): messages.create, messages.stream and count_tokens
agree; cache_control breakpoints pin their prefix for their TTL and a follow-up reads it after eviction; past the pin
budget the request is served unpinned; a tool_use / tool_result round trip reuses the model's own tokens; Claude
Code's request bodies (tests/fixtures/claude_code_*.json) are served."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from agent_fixtures import ADD, MODEL, fixture, tools_worker

TOKENS = {"key-alice": "alice"}
SYSTEM = "You answer questions about Python in one line, and you never use more words than you need. " * 3
TOOL = {"name": "add", "description": ADD["function"]["description"], "input_schema": ADD["function"]["parameters"]}


@pytest.fixture(scope="module")
def served():
    # 48 pages of 16 tokens (a few requests evict one another), pins up to half of them.
    with tools_worker(kv_pages=48, auth_tokens=TOKENS) as (engine, worker, base):
        root = base[: -len("/v1")]
        with anthropic.Anthropic(base_url=root, api_key="key-alice", max_retries=0) as client:
            yield client, root, engine, worker


@pytest.fixture
def pins(served, monkeypatch):
    """Every pin the front core sets: (tokens, ttl_s); the cache starts empty."""
    _, _, engine, worker = served
    engine.flush_cache()
    core, recorded = worker.server.core, []
    pin = core.pin

    async def recording(tenant, prompt, ttl_s):
        pinned = await pin(tenant, prompt, ttl_s)
        recorded.append((pinned[0], ttl_s))
        return pinned

    monkeypatch.setattr(core, "pin", recording)
    yield recorded
    engine.flush_cache()


def total(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_create_stream_and_count_tokens_agree(served, pins):
    client, root, engine, _ = served
    body = {"model": MODEL, "max_tokens": 24, "system": SYSTEM, "messages": [{"role": "user", "content": "What is a list?"}]}  # fmt: skip
    whole = client.messages.create(**body)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    assert whole.usage.output_tokens >= 1 and whole.usage.cache_creation_input_tokens == 0  # no breakpoint
    with client.messages.stream(**body) as stream:
        deltas = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert deltas == streamed.content[0].text == whole.content[0].text  # greedy: the same reply
    assert streamed.usage.cache_read_input_tokens > 0 and total(streamed.usage) == total(whole.usage)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=body["messages"])
    assert counted.input_tokens == total(whole.usage)
    # The raw event sequence (the client skips ping).
    with httpx.stream("POST", root + "/v1/messages", json=body | {"stream": True}, headers={"x-api-key": "key-alice"}) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        names = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    # A stop sequence ends the reply and is named.
    cut = client.messages.create(**body | {"stop_sequences": [whole.content[0].text.split()[1]]})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == whole.content[0].text.split()[1]
    assert engine.stats().cache.live_leases == 0 and not pins


def test_cache_control_pins_the_prefix_for_its_ttl_and_the_follow_up_reads_it(served, pins):
    client, _, engine, _ = served
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=[{"role": "user", "content": "What is a list?"}])  # fmt: skip
    ((pinned, ttl),) = pins
    assert ttl == 3600 and pinned >= 64 and pinned % 16 == 0  # the system prompt's whole pages
    assert engine.stats().cache.pages_pinned == pinned // 16
    usage = first.usage
    assert usage.cache_creation_input_tokens == usage.cache_creation.ephemeral_1h_input_tokens == pinned
    assert usage.cache_read_input_tokens < 16 and total(usage) > pinned  # the question and the rest: input
    for i in range(8):  # other work, larger than the pool once the pins are set aside: it evicts everything else
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": f"{i} " + "the cache keeps keys and values " * 16}])  # fmt: skip
    assert engine.stats().cache.evicted_pages > 0
    follow = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=[{"role": "user", "content": "And a tuple?"}])  # fmt: skip
    assert follow.usage.cache_read_input_tokens >= pinned  # read from the pinned prefix
    assert follow.usage.cache_creation_input_tokens == 0 and pins[-1] == (pinned, 3600)  # renewed, not written
    assert engine.stats().cache.live_leases == 0


def test_a_breakpoint_past_the_pin_budget_is_served_unpinned(served, pins, monkeypatch):
    client, _, engine, _ = served
    monkeypatch.setattr(engine.cache, "max_pinned_pages", 1)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    reply = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert reply.content and reply.usage.cache_creation_input_tokens == 0 and not pins  # refused, logged
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == total(reply.usage)
    assert engine.stats().cache.pages_pinned == 0


def test_a_tool_use_round_trip_reuses_the_models_own_tokens(served, pins):
    client, _, engine, _ = served
    messages = [{"role": "user", "content": "Add the numbers, one call at a time."}]
    first = client.messages.create(model=MODEL, max_tokens=64, tools=[TOOL], tool_choice={"type": "any"}, messages=messages)  # fmt: skip
    (call,) = first.content
    assert first.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "add"
    assert set(call.input) == {"a", "b"} and call.id.startswith("toolu_")
    with client.messages.stream(model=MODEL, max_tokens=64, tools=[TOOL], tool_choice={"type": "any"}, messages=messages) as stream:  # fmt: skip
        (streamed,) = stream.get_final_message().content  # the client assembles input_json_delta into the input
    assert (streamed.type, streamed.name, streamed.input) == ("tool_use", "add", call.input)
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": str(call.input["a"])}]},
    ]
    second = client.messages.create(model=MODEL, max_tokens=24, tools=[TOOL], tool_choice={"type": "none"}, messages=messages)  # fmt: skip
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    # Everything the first turn computed (its prompt and every generated token but the last) is read back.
    reusable = total(first.usage) + first.usage.output_tokens - 1
    assert second.usage.cache_read_input_tokens == reusable
    assert engine.stats().cache.live_leases == 0


def test_claude_codes_bodies_are_served(served, pins):
    _, root, engine, _ = served
    headers = {"x-api-key": "key-alice", "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    first = fixture("claude_code_first_turn.json")
    # As sent (max_tokens 32000): the overflow in Anthropic's own words, which clients match.
    r = httpx.post(root + "/v1/messages", json=first, headers=headers)
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith("input length and `max_tokens` exceed context limit: ")
    assert error["message"].endswith(" + 32000 > 512, decrease input length or `max_tokens` and try again")
    for name in ("claude_code_first_turn.json", "claude_code_tool_turn.json"):
        pins.clear()
        engine.flush_cache()  # the first body pins 22 of the 24 pages this small pool lets pins hold
        body = fixture(name) | {"max_tokens": 16}
        with httpx.stream("POST", root + "/v1/messages", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: ")]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        usage = events[-2]["usage"]
        marked = sum(1 for _ in json.dumps(body).split('"cache_control"')[1:])
        assert len(pins) == marked  # every breakpoint pinned (each a prefix of the prompt)
        assert usage["cache_creation_input_tokens"] == max(p for p, _ in pins) - usage["cache_read_input_tokens"]
    assert engine.stats().cache.live_leases == 0


def test_max_tokens_zero_computes_the_prompt_into_the_cache(served, pins):
    client, _, _, _ = served
    body = {"model": MODEL, "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "What is a set?"}]}  # fmt: skip
    warm = client.messages.create(max_tokens=0, **body)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.usage.output_tokens == 0
    assert warm.usage.cache_creation_input_tokens > 0
    reply = client.messages.create(max_tokens=8, **body)
    assert reply.content and reply.usage.cache_read_input_tokens >= warm.usage.cache_creation_input_tokens
