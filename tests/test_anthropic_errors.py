"""The Messages API's errors in Anthropic's shape, in-process over the FakeEngine: each status the official client
knows (400 naming the field, 401, 404, 413, 500, 503) and an error event mid-stream; the OpenAI routes of the same app
keep OpenAI's shape. And the two auth headers name the same tenant."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from fake_engine import FAILS_AFTER_ONE_TOKEN, NO_CAPACITY, FakeEngine
from worker_harness import ThreadedWorker

TOKENS = {"key-alice": "alice", "key-bob": "bob"}
BODY = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def worker():
    with ThreadedWorker(FakeEngine(step_s=0.001), http_port=0, auth_tokens=TOKENS, max_body_bytes=64 << 10) as w:
        w.root = f"http://127.0.0.1:{w.server.http_port}"
        yield w


def post(worker, body: dict, path: str = "/v1/messages", key: str | None = "key-alice") -> httpx.Response:
    return httpx.post(worker.root + path, json=body, headers={"x-api-key": key} if key else {}, timeout=30)


def error_of(r: httpx.Response) -> tuple[int, str, str]:
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return r.status_code, body["error"]["type"], body["error"]["message"]


def test_each_error_has_anthropics_shape(worker):
    assert error_of(post(worker, {k: v for k, v in BODY.items() if k != "max_tokens"})) == (
        400, "invalid_request_error", "max_tokens: Field required",
    )  # fmt: skip
    status, kind, message = error_of(post(worker, BODY | {"temperature": -1}))
    assert (status, kind) == (400, "invalid_request_error") and message.startswith("temperature must be >= 0")
    status, kind, message = error_of(post(worker, BODY | {"stop_sequences": ["x" * 300]}))
    assert (status, kind) == (400, "invalid_request_error") and "stop" in message
    assert error_of(post(worker, BODY, key="nope"))[:2] == (401, "authentication_error")
    assert error_of(post(worker, BODY, key=None))[:2] == (401, "authentication_error")
    status, kind, message = error_of(post(worker, BODY | {"model": "claude-sonnet-4-5"}))
    assert (status, kind) == (404, "not_found_error") and "'claude-sonnet-4-5'" in message
    assert error_of(post(worker, BODY, path="/v1/messages/batches"))[:2] == (404, "not_found_error")
    big = BODY | {"messages": [{"role": "user", "content": "x" * (70 << 10)}]}
    assert error_of(post(worker, big))[:2] == (413, "request_too_large")
    failing = BODY | {"messages": [{"role": "user", "content": FAILS_AFTER_ONE_TOKEN}]}
    assert error_of(post(worker, failing))[:2] == (500, "api_error")
    full = BODY | {"messages": [{"role": "user", "content": NO_CAPACITY}]}
    assert error_of(post(worker, full))[:2] == (503, "overloaded_error")
    status, kind, message = error_of(post(worker, BODY | {"max_tokens": 600}))
    assert (status, kind) == (400, "invalid_request_error")
    assert message.startswith("input length and `max_tokens` exceed context limit: ") and "+ 600 > 512" in message
    # The OpenAI routes of the same app keep OpenAI's shape.
    r = httpx.post(worker.root + "/v1/chat/completions", json={"model": "fake"}, headers={"authorization": "Bearer key-alice"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_the_official_client_raises_its_own_exceptions(worker):
    client = anthropic.Anthropic(base_url=worker.root, api_key="key-alice", max_retries=0)
    cases = [
        ({"tools": [{"name": "t", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "u"}},
         anthropic.BadRequestError),
        ({"model": "other"}, anthropic.NotFoundError),
        ({"messages": [{"role": "user", "content": "y" * (70 << 10)}]}, anthropic.RequestTooLargeError),
        ({"messages": [{"role": "user", "content": FAILS_AFTER_ONE_TOKEN}]}, anthropic.InternalServerError),
        ({"messages": [{"role": "user", "content": NO_CAPACITY}]}, anthropic.ServiceUnavailableError),
    ]  # fmt: skip
    for fields, error in cases:
        with pytest.raises(error) as e:
            client.messages.create(**(BODY | fields))
        assert e.value.body["type"] == "error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=worker.root, api_key="nope", max_retries=0).messages.create(**BODY)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice names the function 'u'"):
        client.messages.count_tokens(model="fake", messages=BODY["messages"], tools=cases[0][0]["tools"],
                                     tool_choice={"type": "tool", "name": "u"})  # fmt: skip


def test_a_failure_mid_stream_ends_it_with_an_error_event(worker):
    client = anthropic.Anthropic(base_url=worker.root, api_key="key-alice", max_retries=0)
    body = BODY | {"messages": [{"role": "user", "content": FAILS_AFTER_ONE_TOKEN}]}
    with httpx.stream("POST", worker.root + "/v1/messages", json=body | {"stream": True},
                      headers={"x-api-key": "key-alice"}) as r:  # fmt: skip
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert events[-1] == "event: error" and "event: message_stop" not in events  # after the 200: an error event
    with pytest.raises(anthropic.APIStatusError, match="injected failure") as e:  # the status was 200 already
        with client.messages.stream(**body) as stream:
            for _ in stream:
                pass
    assert e.value.body["error"]["type"] == "api_error"


def test_x_api_key_and_bearer_name_the_same_tenant(worker):
    engine: FakeEngine = worker.engine
    body = BODY | {"messages": [{"role": "user", "content": "the same tenant either way, please"}]}
    first = post(worker, body).json()
    assert first["usage"]["cache_read_input_tokens"] == 0
    bearer = httpx.post(worker.root + "/v1/messages", json=body, headers={"authorization": "Bearer key-alice"})
    assert bearer.json()["usage"]["cache_read_input_tokens"] > 0  # alice's cache: the same namespace
    assert post(worker, body, key="key-bob").json()["usage"]["cache_read_input_tokens"] == 0  # bob's own
    assert len(engine._seen["alice"]) >= 2 and engine._seen["bob"]  # the namespaces the engine was given
