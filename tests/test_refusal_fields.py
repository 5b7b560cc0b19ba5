"""Each API names a refused field by its own names, mapped from the field the rule set (a FieldPath), never read off
the message: representative refusals through every front of one worker (FakeEngine; gRPC and HTTP on loopback),
from rules the front decides (worker/front/validation.py) and rules the engine decides at submit
(worker/engine/checks.py). OpenAI: the error's `param`; Anthropic: its message; gRPC: its details and the
`radixcache-field` trailing metadata (a prompt refused off its wire bytes, before it is parsed, included)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from fake_engine import FakeEngine
from worker_harness import ThreadedWorker

from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

USER = {"role": "user", "content": "hi"}
ROBOT = {"role": "robot", "content": "hi"}
X_GUIDANCE = {"type": "json_schema", "schema": {"x-guidance": {"lenient": True}}}


@pytest.fixture(scope="module")
def worker():
    # A KV pool of 64 tokens in a context of 512: a request past the pool is TOO_LARGE, not a context overflow.
    with ThreadedWorker(FakeEngine(step_s=0.001, num_pages=16, page_size=4), http_port=0) as w:
        w.root = f"http://127.0.0.1:{w.server.http_port}"
        yield w


def refused(worker, path: str, body: dict) -> httpx.Response:
    content = json.dumps({"model": "fake"} | body)  # ASCII: a lone surrogate goes as JSON's \\ud800 escape
    r = httpx.post(worker.root + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code in (400, 413), r.text
    return r


OPENAI = [  # (path, body, param, a part of the message)
    ("/v1/chat/completions", {"messages": [USER, ROBOT], "max_tokens": 2}, "messages[1].role", "messages[1].role"),
    ("/v1/chat/completions", {"messages": [USER], "max_completion_tokens": 600}, "max_completion_tokens",
     "max_tokens must be in [1, "),  # the engine's rule (room in the context), at submit
    ("/v1/chat/completions", {"messages": [USER], "prompt_cache_key": "k" * 300}, "prompt_cache_key", "cache_key"),
    ("/v1/chat/completions", {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": X_GUIDANCE}},
     "response_format", "response_format: json_schema: "),
    ("/v1/completions", {"prompt": [5, 300], "max_tokens": 2}, "prompt", "token_ids.ids[1] = 300"),  # at submit
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [999]}, "stop_token_ids",
     "stop_token_ids[0] = 999"),  # at submit
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100}, "prompt", "KV pages"),  # TOO_LARGE (413), at submit
    ("/v1/responses", {"input": [USER | {"content": "\ud800"}]}, "input", "messages[0].content is not valid"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 600}, "max_output_tokens", "max_tokens must be in"),
    ("/v1/chat/completions", {"messages": [USER], "presence_penalty": 3}, "presence_penalty",
     "presence_penalty must be in [-2, 2]"),  # SamplingParams' own rule
    ("/v1/chat/completions", {"messages": [USER], "cache_salt": "s" * 257}, "cache_salt", "at most 256 characters"),
    ("/v1/chat/completions", {"messages": [USER], "cache_salt": 7}, "cache_salt", "must be a non-empty string"),
    ("/v1/chat/completions", {"messages": [USER], "cache_salt": "s", "cache_salt_shared_tokens": -1},
     "cache_salt_shared_tokens", "must be an integer in [0, "),
    ("/v1/completions", {"prompt": "hi", "cache_salt": "s", "cache_salt_share_system": True},
     "cache_salt_share_system", "needs chat messages"),
    ("/v1/completions", {"prompt": "hi", "cache_salt_shared_tokens": 4}, "cache_salt_shared_tokens",
     "needs a cache_salt"),
    ("/v1/responses", {"input": "hi", "cache_salt": ""}, "cache_salt", "must be a non-empty string"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "says"), OPENAI, ids=[f"{p}:{param}" for p, _, param, _ in OPENAI])
def test_openai_param_is_the_refused_field_by_openais_names(worker, path, body, param, says):
    error = refused(worker, path, body).json()["error"]
    assert (error["param"], says in error["message"]) == (param, True), error


ANTHROPIC = [  # (body, the message's beginning)
    ({"stop_sequences": ["ok", "\ud800"]}, "stop_sequences[1] is not valid Unicode"),
    ({"output_config": {"format": X_GUIDANCE}}, 'output_config.format: json_schema: "x-guidance"'),
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"max_tokens": 600}, "input length and `max_tokens` exceed context limit: "),  # the engine's rule, at submit
    ({"max_tokens": 100}, "messages: prompt + max_tokens = "),  # TOO_LARGE (413), at submit
    ({"cache_salt": ["a"]}, "cache_salt must be a non-empty string"),
    ({"cache_salt": "s", "cache_salt_shared_tokens": 2, "cache_salt_share_system": True},
     "cache_salt_shared_tokens and cache_salt_share_system exclude each other"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "begins"), ANTHROPIC, ids=[b for _, b in ANTHROPIC])
def test_anthropic_message_names_the_refused_field_by_anthropics_names(worker, body, begins):
    r = refused(worker, "/v1/messages", {"max_tokens": 4, "messages": [USER]} | body)
    assert r.json()["error"]["message"].startswith(begins), r.json()


def generate(worker, **fields) -> grpc.RpcError:
    request = pb.GenerateRequest(**{k: v for k, v in fields.items() if k not in ("messages", "token_ids")})
    if "token_ids" in fields:
        request.token_ids.ids.extend(fields["token_ids"])
    if "messages" in fields:
        request.messages.messages.extend(pb.ChatMessage(**m) for m in fields["messages"])
    with grpc.insecure_channel(worker.target) as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.RadixCacheStub(channel).Generate(request, timeout=30))
    return e.value


def field_of(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get("radixcache-field")


GRPC = [  # (GenerateRequest fields, status, radixcache-field, a part of the details)
    (dict(messages=[USER, ROBOT]), "INVALID_ARGUMENT", "messages.messages[1].role", "messages[1].role must be"),
    (dict(token_ids=[5, 300]), "INVALID_ARGUMENT", "token_ids.ids[1]", "token_ids.ids[1] = 300"),  # at submit
    (dict(text="hi", stop_token_ids=[7, 999]), "INVALID_ARGUMENT", "stop_token_ids[1]", "stop_token_ids[1] = 999"),
    (dict(text="hi", max_tokens=600), "INVALID_ARGUMENT", "max_tokens", "max_tokens must be in [1, "),
    (dict(text="hi", max_tokens=100), "RESOURCE_EXHAUSTED", "input", "KV pages"),  # TOO_LARGE, at submit
    (dict(text="hi", json_schema="{"), "INVALID_ARGUMENT", "json_schema", "json_schema is not valid JSON"),
    (dict(text="hi", top_k=0), "INVALID_ARGUMENT", "top_k", "top_k must be -1 (off) or >= 1"),
    (dict(), "INVALID_ARGUMENT", "input", "no input"),
    (dict(text="hi", cache_salt="s" * 257), "INVALID_ARGUMENT", "cache_salt", "cache_salt must have at most 256"),
    (dict(text="hi", cache_salt=""), "INVALID_ARGUMENT", "cache_salt", "cache_salt must be a non-empty string"),
    (dict(text="hi", cache_salt="s", cache_salt_shared_tokens=-3), "INVALID_ARGUMENT", "cache_salt_shared_tokens",
     "cache_salt_shared_tokens must be an integer"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "status", "field", "says"), GRPC, ids=[f for _, _, f, _ in GRPC])
def test_grpc_details_and_field_name_the_refused_field_by_the_protos_names(worker, fields, status, field, says):
    error = generate(worker, **fields)
    assert (error.code().name, field_of(error), says in error.details()) == (status, field, True), error.details()


def test_a_prompt_refused_before_it_is_parsed_gets_the_parsed_paths_error_and_field(worker):
    parsed = generate(worker, text="x" * 10_000)  # under 64 KiB: parsed on the loop, then checked
    early = generate(worker, text="x" * 100_000)  # 64 KiB or more: its size is read off the wire bytes first
    for error in (parsed, early):
        assert (error.code(), field_of(error)) == (grpc.StatusCode.INVALID_ARGUMENT, "text"), error.details()
        assert error.details().startswith("text has at least ") and "maximum context length is 512" in error.details()
