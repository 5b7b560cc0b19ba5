"""The Messages API's mapping without a worker: bodies -> chat messages, tools, tool choice, breakpoints (each error
names the field), and engine outputs -> content blocks and the streamed events."""

from __future__ import annotations

import json

import pytest

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.front.core import Refusal, RefusalKind
from radixcache.worker.front.tool_calls import CLOSE
from radixcache.worker.front.validation import PROMPT, ContextOverflow, FieldPath, InvalidArgument
from radixcache.worker.http.anthropic.errors import error_body, overflow_message, refusal_error
from radixcache.worker.http.anthropic.output import MessagesResponder
from radixcache.worker.http.anthropic.protocol import CacheCreation, MessagesRequest
from radixcache.worker.http.anthropic.requests import parse_messages
from radixcache.worker.http.errors import APIError

TOOL = {
    "name": "add",
    "description": "Add",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
}


def parse(**fields):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]} | fields
    return parse_messages(MessagesRequest.model_validate(body))


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        parse(**fields)
    assert e.value.status == 400
    return e.value


def test_a_conversation_becomes_the_chat_messages_templates_render():
    parsed = parse(
        system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use tools."}],
        tools=[TOOL],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "add 1"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "...", "signature": "s"},
                {"type": "text", "text": "Adding."},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "1"}]},
                {"type": "text", "text": "again"},
            ]},
        ],
    )  # fmt: skip
    assert parsed.prompt.messages == [
        {"role": "system", "content": "You are terse.\n\nUse tools."},
        {"role": "user", "content": "<reminder>\n\nadd 1"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "1"},
        {"role": "user", "content": "again"},
    ]  # fmt: skip
    assert parsed.prompt.tools == [
        {"type": "function", "function": {"name": "add", "description": "Add", "parameters": TOOL["input_schema"]}}
    ]
    assert parsed.tool_choice.mode == "auto" and parsed.constraint == (None, "") and not parsed.breakpoints


def test_tool_choice_maps_to_the_front_cores_choice():
    assert parse(tools=[TOOL], tool_choice={"type": "any"}).constraint[0] == "ebnf"  # exactly one call, forced
    named = parse(tools=[TOOL], tool_choice={"type": "tool", "name": "add"})
    assert named.tool_choice.mode == "required" and named.tool_choice.allowed == ("add",)
    assert parse(tools=[TOOL], tool_choice={"type": "none"}).tool_choice.parses([]) is False
    one = parse(tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True}, stop_sequences=["X"])
    assert one.sampling.stop == ("X", CLOSE) and one.stop_sequences == ("X",)  # stops after the first call
    assert refused(tools=[TOOL], tool_choice={"type": "tool", "name": "mul"}).param == "tool_choice"
    assert refused(tool_choice={"type": "any"}).message == "tool_choice requires tools"
    assert refused(tools=[TOOL], tool_choice={"type": "some"}).param == "tool_choice.type"
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    formatted = parse(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert formatted.constraint == ("json_schema", json.dumps(schema))


def test_breakpoints_cut_the_conversation_right_after_the_marked_block():
    ephemeral = {"type": "ephemeral"}
    parsed = parse(
        system=[{"type": "text", "text": "S1", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"type": "text", "text": "S2"}],
        tools=[TOOL | {"cache_control": ephemeral}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": ephemeral},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "c"},
        ],
        cache_control=ephemeral,  # the top level: the last block of the last message
    )  # fmt: skip
    where = {b.where: b for b in parsed.breakpoints}
    assert list(where) == ["tools[0]", "system[0]", "messages[0].content[0]", "messages[2].content[0]"]
    opening = {"role": "user", "content": ""}  # where the first message's content begins
    assert where["tools[0]"].prompt.messages == [{"role": "system", "content": "S1\n\nS2"}, opening]
    assert where["system[0]"].ttl == "1h" and where["system[0]"].ttl_s == 3600
    assert where["system[0]"].prompt.messages == [{"role": "system", "content": "S1"}, opening]
    assert where["messages[0].content[0]"].prompt.messages[1:] == [{"role": "user", "content": "a"}]
    assert where["messages[2].content[0]"].prompt.messages == parsed.prompt.messages
    assert all(b.prompt.tools == parsed.prompt.tools for b in parsed.breakpoints)
    assert where["tools[0]"].ttl_s == 300
    many = [{"type": "text", "text": str(i), "cache_control": ephemeral} for i in range(5)]
    assert refused(system=many).message.startswith("A maximum of 4 blocks with cache_control may be provided.")
    bad = refused(system=[{"type": "text", "text": "S", "cache_control": {"type": "ephemeral", "ttl": "1d"}}])
    assert bad.param == "system[0].cache_control.ttl"
    assert refused(cache_control={"type": "persistent"}).param == "cache_control"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]},
         "messages[1]"),
        ({"messages": []}, "messages"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"container": "c"}, "container"),
        ({"thinking": {"type": "always"}}, "thinking.type"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_refused_naming_the_field(fields, param):
    error = refused(**fields)
    assert error.param == param and error.message.startswith(param.split("[")[0])


def test_max_tokens_zero_computes_the_prompt_and_shows_nothing():
    parsed = parse(max_tokens=0)
    assert parsed.prewarm and parsed.sampling.max_tokens == 1
    responder = responder_for(prewarm=True)
    events = responder.add(output("x", finish=FinishReason.LENGTH, completion=1))
    assert [e["type"] for e in events] == ["message_start", "ping"]
    assert responder.response().content == [] and responder.response().stop_reason == "max_tokens"
    assert responder.response().usage.output_tokens == 0


def output(text: str, finish: FinishReason | None = None, completion: int = 1) -> RequestOutput:
    return RequestOutput("r", [5], text, prompt_tokens=100, cached_tokens=40, completion_tokens=completion,
                         finish_reason=finish)  # fmt: skip


def responder_for(generated: str = "", **options) -> MessagesResponder:
    defaults = {"message_id": "msg_1", "model": "m", "parse_tools": True, "closes_at_stop": False,
                "stop_sequences": (), "prewarm": False, "generated_text": lambda: generated}  # fmt: skip
    return MessagesResponder(**(defaults | options))


def test_text_and_a_call_stream_as_blocks_that_add_up_to_the_message():
    responder = responder_for()
    outputs = [
        output("Let me add"), output(" that.\n<tool_call>\n"),
        output('{"name": "add", "arguments": {"a": 1}}\n</tool_call>', FinishReason.STOP_TOKEN, completion=9),
    ]  # fmt: skip
    events = [e for out in outputs for e in responder.add(out)]
    responder.finish(CacheCreation(ephemeral_5m_input_tokens=32))
    events += responder.last_events()
    assert [e["type"] for e in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["cache_read_input_tokens"] == 40
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0)
    message = responder.response()
    assert text == message.content[0].text == "Let me add that."  # the whitespace before the call is not content
    assert events[6]["content_block"] == {"type": "tool_use", "id": message.content[1].id, "name": "add", "input": {}}
    assert json.loads(events[7]["delta"]["partial_json"]) == message.content[1].input == {"a": 1}
    assert message.stop_reason == "tool_use" and events[-2]["delta"]["stop_reason"] == "tool_use"
    # 100 prompt tokens: 40 read from the cache, 32 written under a breakpoint, 28 other input.
    assert events[-2]["usage"] == {"input_tokens": 28, "cache_creation_input_tokens": 32,
                                   "cache_read_input_tokens": 40, "output_tokens": 9}  # fmt: skip
    assert message.usage.cache_creation.ephemeral_5m_input_tokens == 32


def test_a_call_cut_by_max_tokens_keeps_what_parses_and_stop_sequences_are_named():
    responder = responder_for()
    responder.add(output('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x', FinishReason.LENGTH))
    (call,) = responder.response().content
    assert call.name == "add" and call.input == {"a": 1} and responder.response().stop_reason == "max_tokens"
    responder = responder_for("Hello STOP, then END", stop_sequences=("END", "STOP"), parse_tools=False)
    responder.add(output("Hello ", FinishReason.STOP_STRING))  # the one right after the text, not any that occurs
    assert (responder.response().stop_reason, responder.response().stop_sequence) == ("stop_sequence", "STOP")


def test_refusals_read_as_anthropic_errors():
    overflow = ContextOverflow("the prompt has 600 tokens", 512, PROMPT, prompt_tokens=600)
    r = refusal_error(Refusal.of_invalid(overflow))
    assert (r.status, r.message) == (400, "prompt is too long: 600 tokens > 511 maximum")
    room = ContextOverflow("max_tokens", 512, FieldPath.of("max_tokens"), prompt_tokens=100, max_tokens=32000)
    assert overflow_message(room) == (
        "input length and `max_tokens` exceed context limit: 100 + 32000 > 512, decrease input length or "
        "`max_tokens` and try again"
    )
    empty = InvalidArgument.at(FieldPath.of("stop", 0), " is empty")
    assert refusal_error(Refusal.of_invalid(empty)).message == "stop_sequences[0] is empty"
    expected = {
        RefusalKind.UNAUTHENTICATED: (401, "authentication_error"),
        RefusalKind.PERMISSION_DENIED: (403, "permission_error"),
        RefusalKind.TOO_LARGE: (413, "request_too_large"),
        RefusalKind.PIN_BUDGET: (429, "rate_limit_error"),
        RefusalKind.INTERNAL: (500, "api_error"),
        RefusalKind.UNAVAILABLE: (503, "overloaded_error"),
        RefusalKind.NO_CAPACITY: (503, "overloaded_error"),
    }
    for kind, (status, kind_name) in expected.items():
        error = refusal_error(Refusal(kind, "m"))
        assert error.status == status and error_body(error.status, "m") == {
            "type": "error", "error": {"type": kind_name, "message": "m"},
        }  # fmt: skip
