"""The Responses API through the official `openai` client against a real worker (in process: the embedded default
model, the tools-aware template of test_openai_agent_chat.py): create, stream (the official event sequence and the
client's own stream accumulator), retrieve, delete, previous_response_id chains that continue from the stored
tokens exactly, pins that keep a stored response's pages through eviction, tenants, and 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from agent_fixtures import ADD, MODEL, tools_worker

TOKENS = {"key-alice": "alice", "key-bob": "bob"}
INSTRUCTIONS = "You answer questions about Python in one line."
FUNCTION = {"type": "function"} | {k: v for k, v in ADD["function"].items()}  # the Responses API's flat shape


@pytest.fixture(scope="module")
def served():
    # 48 pages of 16 tokens: a few requests of the 512-token context evict one another.
    with tools_worker(kv_pages=48, auth_tokens=TOKENS) as (engine, worker, base):
        engine.worker = worker
        submitted = []
        submit = engine.submit
        engine.submit = lambda request, on_output: (submitted.append(request), submit(request, on_output))[1]
        with openai.OpenAI(base_url=base, api_key="key-alice", max_retries=0) as alice:
            yield alice, base, engine, submitted


def test_create_retrieve_delete(served):
    client, _, engine, _ = served
    r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="What is a list?", max_output_tokens=24)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.model == MODEL
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 10 and r.usage.output_tokens >= 1
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.instructions == INSTRUCTIONS and r.store is True
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert engine.stats().cache.live_leases == 0


def test_streaming_follows_the_official_event_sequence(served):
    client, _, _, _ = served
    events = list(client.responses.create(model=MODEL, input="What is a dict?", max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", kinds[-1],
    ]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    # The client's own accumulator checks every identity and index as it goes.
    with client.responses.stream(model=MODEL, input="Say: yes", max_output_tokens=200) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        response = stream.get_final_response()
    assert deltas == response.output_text and response.status == "completed"


def test_previous_response_id_continues_from_the_stored_tokens(served, monkeypatch):
    client, _, engine, submitted = served
    store = engine.worker.server.http.app.state.store
    encoded: list[str] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: (encoded.append(text), encode(text, **kw))[1])
    questions = ["What is a list?", "And a tuple?", "And a set?", "Which is fastest?"]
    previous, before = None, []
    for question in questions:
        encoded.clear()
        r = client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input=question, max_output_tokens=16,
            previous_response_id=previous.id if previous else None,
        )  # fmt: skip
        request = submitted[-1]
        if previous is not None:
            # The prompt begins with every token of the previous turn, exactly (not re-tokenized; a final stop
            # token the template writes otherwise is the one that may differ) ...
            assert request.prompt_ids[: len(before) - 1] == before[:-1]
            # ... and everything that turn computed is served from the cache.
            assert r.usage.input_tokens_details.cached_tokens == len(before) - 1
            assert r.previous_response_id == previous.id
            # The history was never tokenized again: only the new turn's text was.
            assert encoded and not any(questions[0] in text for text in encoded), encoded
        before = list(store.get("alice", r.id).token_ids)  # the previous prompt and every token it generated
        assert before[: len(request.prompt_ids)] == list(request.prompt_ids)
        previous = r
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"


def test_stored_pages_stay_pinned_through_eviction(served):
    client, base, engine, _ = served
    first = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input="What is a generator?", max_output_tokens=16
    )
    for i in range(6):  # other work, larger than the pool once pins are set aside: it evicts everything unpinned
        client.responses.create(
            model=MODEL, input=f"{i} " + "the cache keeps keys and values " * 12, max_output_tokens=4, store=False
        )
    assert engine.stats().cache.evicted_pages > 0
    follow = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input="Show one.", previous_response_id=first.id, max_output_tokens=4
    )
    computed = first.usage.input_tokens + first.usage.output_tokens - 1
    assert follow.usage.input_tokens_details.cached_tokens >= computed // 16 * 16  # its whole pages, pinned


def test_function_calls_and_their_outputs(served):
    client, _, _, _ = served
    r = client.responses.create(
        model=MODEL, input="Add two numbers.", tools=[FUNCTION], tool_choice="required", max_output_tokens=64
    )
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["function"]["parameters"])
    assert r.output_text == ""
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[FUNCTION], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3"}],
    )  # fmt: skip
    assert follow.usage.input_tokens_details.cached_tokens == r.usage.input_tokens + r.usage.output_tokens - 1
    # Streamed: the function-call argument events, and the client's accumulator agrees.
    with client.responses.stream(
        model=MODEL, input="Add two numbers.", tools=[FUNCTION], tool_choice={"type": "function", "name": "add"},
        max_output_tokens=64,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert [i.arguments for i in final.output if i.type == "function_call"] == [done.arguments]


def test_text_format_json_schema(served):
    client, _, _, _ = served
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model=MODEL, input="A number.", max_output_tokens=20,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_tenant_never_reads_or_continues_another_tenants_responses(served):
    client, base, _, _ = served
    r = client.responses.create(model=MODEL, input="mine", max_output_tokens=2)
    with openai.OpenAI(base_url=base, api_key="key-bob", max_retries=0) as bob:
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(r.id)
        with pytest.raises(openai.BadRequestError):
            bob.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert client.responses.retrieve(r.id).id == r.id


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": ""}, "input"),
        ({"input": "x" * 4000}, "input"),
    ],
)
def test_bad_requests_get_400_naming_the_field(served, fields, param):
    _, base, _, _ = served
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4} | fields
    r = httpx.post(base + "/responses", json=body, headers={"Authorization": "Bearer key-alice"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_the_text_is_what_was_generated_but_the_whitespace_around_calls():
    from radixcache.worker.engine.request import FinishReason, RequestOutput
    from radixcache.worker.http.openai.responses_output import ResponsesResponder

    def run(*pieces: str, finish: FinishReason = FinishReason.LENGTH) -> ResponsesResponder:
        responder = ResponsesResponder(response_id="r", model="m", echo={}, parse_tools=True, closes_at_stop=False)
        events = responder.first_events()
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            out = RequestOutput("r", [1], piece, 3, 0, k + 1, finish_reason=finish if last else None)
            events += responder.add(out)
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == responder.response().output_text
        return responder

    # Cut mid-sentence after a space: the space is part of the text (a follow-up renders these very tokens).
    assert run(" Hello", " there ").response().output_text == " Hello there "
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    with_call = run("Let me check.\n", call, "\n\n", finish=FinishReason.STOP_TOKEN).response()
    assert [item.type for item in with_call.output] == ["message", "function_call"]
    assert with_call.output_text == "Let me check." and with_call.status == "completed"
    assert [item.type for item in run("\n" + call, finish=FinishReason.STOP_TOKEN).response().output] == [
        "function_call"
    ]
