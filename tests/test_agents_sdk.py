"""The OpenAI Agents SDK end to end on its default API (Responses) against a real worker (in process: the embedded
default model, the tools-aware template of test_openai_agent_chat.py): a tool loop as the SDK runs it, resending the
whole history, and chained with previous_response_id; and the SDK's own request body (tests/fixtures/)."""

from __future__ import annotations

from typing import Literal

import pytest
from agent_fixtures import MODEL, fixture, tools_worker

from radixcache.worker.http.openai.responses_input import parse_responses
from radixcache.worker.http.openai.responses_protocol import ResponsesRequest

agents = pytest.importorskip("agents")  # the test extra installs openai-agents


def test_the_sdks_body_is_understood():
    body = fixture("agents_sdk_responses.json")
    parsed = parse_responses(ResponsesRequest.model_validate(body))
    assert [m["role"] for m in parsed.messages] == ["user", "assistant", "tool"]
    assert parsed.messages[1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"topic": "list"}}
    assert parsed.messages[2] == {"role": "tool", "tool_call_id": "call_7dd9ab", "content": "a mutable sequence"}
    assert [s.name for s in parsed.specs] == ["lookup"] and parsed.specs[0].strict


@pytest.fixture(scope="module")
def model():
    from openai import AsyncOpenAI

    with tools_worker() as (engine, _, base):
        agents.set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
        yield agents.OpenAIResponsesModel(model=MODEL, openai_client=client), engine


@agents.function_tool
def lookup(topic: Literal["list", "dict"]) -> str:
    """Look a topic up."""
    return {"list": "a mutable sequence", "dict": "a mapping"}[topic]


@pytest.mark.parametrize("chained", [False, True])
def test_an_agent_runs_its_tool_loop(model, chained):
    responses_model, engine = model
    engine.flush_cache()
    agent = agents.Agent(
        name="librarian",
        instructions="You look things up, then answer in one line.",
        tools=[lookup],
        model=responses_model,
        # The toy model calls tools only when told to; the SDK resets tool_choice after the first call.
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=160),
    )
    # A question of its own per run: the other run's reply is pinned in the background after its response, so it may
    # land after this run's flush and would then be hit too.
    question = "What is a list, in chained calls?" if chained else "What is a list?"
    result = agents.Runner.run_sync(agent, question, max_turns=4, auto_previous_response_id=chained)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == 1 and calls[0].raw_item.name == "lookup"
    assert outputs[0].output in ("a mutable sequence", "a mapping")
    assert isinstance(result.final_output, str) and result.final_output
    first, second = result.raw_responses[0].usage, result.raw_responses[1].usage
    # The second call reuses everything the first computed, whether the SDK resent the history (the generated
    # call comes back as a function_call item) or chained it with previous_response_id (the stored tokens).
    assert second.input_tokens_details.cached_tokens == first.input_tokens + first.output_tokens - 1
    assert engine.stats().cache.live_leases == 0
