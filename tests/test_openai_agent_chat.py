"""Issue 28's chat-completion defects end to end: the frameworks' own request bodies (tests/fixtures/) against a real
worker (in process: the embedded default model, a tools-aware chat template in the Hermes / Qwen2.5 convention), and
the 5-turn tool loop whose history reuses everything the worker generated."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from agent_fixtures import ADD, MODEL, fixture, tools_worker

from radixcache.worker.front.generated import GeneratedTokens


@pytest.fixture(scope="module")
def served():
    with tools_worker() as (engine, worker, base):
        with openai.OpenAI(base_url=base, api_key="none", max_retries=0) as client:
            yield client, base, engine, worker


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/chat/completions", json=body, timeout=120)


def test_the_frameworks_tool_bodies_are_served(served):
    _, base, engine, _ = served
    # LangChain's with_structured_output(method="function_calling"): parallel_tool_calls false (was a 400).
    r = post(base, fixture("langchain_with_structured_output_function_calling.json") | {"max_tokens": 40})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "Joke" and choice["message"]["content"] is None
    # LlamaIndex's chat_with_tools: auto, parallel_tool_calls false (was a 400).
    r = post(base, fixture("llamaindex_chat_with_tools.json"))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["message"].get("tool_calls") or []) <= 1
    # pydantic-ai's allowed_tools: only get_time may be called (was a 400).
    r = post(base, fixture("pydantic_ai_allowed_tools.json"))
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"])["zone"] in (
        "UTC",
        "CET",
    )
    body = fixture("pydantic_ai_allowed_tools.json")
    body["tool_choice"]["allowed_tools"]["mode"] = "auto"
    r = post(base, body | {"max_completion_tokens": 12})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "<tool_call>" not in (message["content"] or "")
    assert all(c["function"]["name"] == "get_time" for c in message.get("tool_calls") or [])
    # A strict schema without additionalProperties: false is refused as OpenAI refuses it (was accepted).
    r = post(base, fixture("strict_json_schema_without_additional_properties.json"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "'additionalProperties' is required to be supplied and to be false" in r.json()["error"]["message"]
    assert engine.stats().cache.live_leases == 0


def test_a_forced_call_cut_by_max_tokens_comes_back_as_a_call(served):
    client, _, _, _ = served
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "add"}], tools=[ADD], tool_choice="required", max_tokens=24
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None  # before: the raw <tool_call> markup
    (call,) = choice.message.tool_calls
    print("cut call:", call.function)
    assert call.function.name == "add" and call.function.arguments.startswith('{"a": ')
    assert not call.function.arguments.endswith("}}")


def test_context_overflow_is_recognised_by_the_frameworks(served):
    client, base, _, _ = served
    long = [{"role": "user", "content": "the cache keeps keys " * 200}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    # LangChain looks for the code in the error body (str(e) of the openai 1.x/2.x clients it runs on), LiteLLM for
    # OpenAI's sentence, pydantic-ai for the code.
    assert e.value.body["code"] == "context_length_exceeded"
    assert "This model's maximum context length is 512 tokens." in e.value.message
    r = post(base, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "max_tokens" and "maximum context length" in r.json()["error"]["message"]


def test_prompt_cache_key_reaches_the_request_and_24h_retention_pins_it(served, monkeypatch):
    client, base, engine, _ = served
    submitted = []
    submit = engine.submit
    monkeypatch.setattr(
        engine, "submit", lambda request, on_output: (submitted.append(request), submit(request, on_output))
    )
    messages = [{"role": "user", "content": "Keep me for a day, please: the cache keeps keys and values."}]
    before = engine.stats().cache.pages_pinned
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, prompt_cache_key="conversation-7",
        extra_body={"prompt_cache_retention": "24h"},
    )  # fmt: skip
    assert submitted[-1].cache_key == "conversation-7"  # for the cluster's router
    expected = before + (reply.usage.prompt_tokens + 3) // 16  # the prompt and the reply's computed tokens
    deadline = time.monotonic() + 10
    while engine.stats().cache.pages_pinned < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().cache.pages_pinned == expected
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 40}], max_tokens=2)
    time.sleep(0.2)
    assert plain.usage.prompt_tokens > 16 and engine.stats().cache.pages_pinned == expected  # in_memory: no pin
    r = post(base, {"model": MODEL, "messages": messages, "prompt_cache_retention": "forever"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"
    r = post(base, {"model": MODEL, "messages": messages, "prompt_cache_key": "k" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", r.text
    raw = json.dumps({"model": MODEL, "messages": messages, "prompt_cache_key": "\ud800"})  # a lone surrogate
    r = httpx.post(base + "/chat/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", r.text
    engine.flush_cache()


def tool_loop(client: openai.OpenAI, turns: int = 5) -> list[tuple[int, int, int]]:
    """A tool loop as agent frameworks run it: each turn sends the whole history back (the assistant's own tool
    call, then the tool's result). Returns (prompt, cached, reusable) tokens per turn from the second on, where
    reusable = what the turn before computed (its prompt and reply but the last, never computed, token)."""
    messages = [{"role": "user", "content": "Add the numbers, one call at a time."}]
    figures, previous = [], None
    for turn in range(turns):
        last = turn == turns - 1
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[ADD], tool_choice="none" if last else "required", max_tokens=64
        )
        usage = reply.usage
        if previous is not None:
            figures.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, previous))
        previous = usage.prompt_tokens + usage.completion_tokens - 1
        if last:
            break
        call = reply.choices[0].message.tool_calls[0]
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": str(turn + 1)},
        ]
    return figures


def test_a_tool_loop_reuses_everything_the_worker_generated(served):
    client, _, engine, worker = served
    shares = {}
    for memory in (GeneratedTokens(), GeneratedTokens(max_bytes=0)):
        worker.server.core.memory = memory
        engine.flush_cache()
        figures = tool_loop(client)
        shares[memory.enabled] = sum(c for _, c, _ in figures) / sum(r for _, _, r in figures)
        print(f"tool loop, memory {'on' if memory.enabled else 'off'}: (prompt, cached, reusable) per turn {figures}")
    worker.server.core.memory = GeneratedTokens()
    assert shares[True] >= 0.99, shares
    # Without the memory the constrained calls' tokens ("default value" as the model split it) are re-tokenized
    # otherwise and computed again: the defect this fixes.
    assert shares[False] < shares[True], shares
