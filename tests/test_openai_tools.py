"""Tool calls end to end through the official `openai` client: the tools reach the chat template, and a reply in the
Hermes convention comes back as message.tool_calls with finish_reason "tool_calls", whole or streamed.

The engine is the FakeEngine (tests/fake_engine.py) behind the real HTTP server: its template renders the tools, and
it answers a prompt that carries tools with a call of the first one, deterministically, as a tool-trained model
would. The parser's edge cases (split deltas, malformed JSON) are in test_openai_tool_calls.py.
"""

from __future__ import annotations

import json

import openai
import pytest
from fake_engine import FakeEngine
from worker_harness import ThreadedWorker

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(step_s=0.001)
    with ThreadedWorker(engine, http_port=0) as worker:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{worker.server.http_port}/v1", api_key="none")
        yield engine, client


def test_a_generated_tool_call_becomes_tool_calls(served):
    engine, client = served
    reply = client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    prompt = bytes(i - 3 for i in engine.submitted[-1].prompt_ids if i >= 3).decode()
    assert '"name": "get_weather"' in prompt  # the template saw the tools
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_calls_arrive_as_tool_call_deltas(served):
    _, client = served
    chunks = list(
        client.chat.completions.create(model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text  # never shown as text first
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_leaves_the_text_alone(served):
    _, client = served
    reply = client.chat.completions.create(
        model="fake", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content.startswith('<tool_call>{"name": "get_weather"')
    assert reply.choices[0].finish_reason == "stop"


def test_a_conversation_with_tool_calls_and_results_is_accepted(served):
    engine, client = served
    history = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    reply = client.chat.completions.create(model="fake", messages=history, max_tokens=5)
    assert reply.choices[0].message.content == "abcde"
    prompt = bytes(i - 3 for i in engine.submitted[-1].prompt_ids if i >= 3).decode()
    assert "<tool>18 C and sunny</s>" in prompt


def test_tools_and_tool_history_reach_the_template_as_hugging_face_passes_them():
    """With a Qwen2.5-like template: `tools` is the template variable, tool-call arguments arrive as objects."""
    from engine_fixtures import byte_tokenizer

    from radixcache.worker.front.validation import ModelLimits, PromptInput, render_prompt
    from radixcache.worker.http.openai.protocol import ChatMessageIn
    from radixcache.worker.http.openai.requests import chat_messages
    from radixcache.worker.model.tokenizer import Tokenizer

    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}</s>{% endfor %}<assistant>"
    )
    base = byte_tokenizer()
    tokenizer = Tokenizer(base._tok, eos_token="<|eos|>", chat_template=template)
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    messages = chat_messages([ChatMessageIn.model_validate(m) for m in history])
    limits = ModelLimits.of(tokenizer, vocab_size=tokenizer.vocab_size, context_length=4096)
    ids, text = render_prompt(PromptInput(messages=messages, tools=TOOLS), tokenizer, limits)
    assert text.startswith('<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '<assistant><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call></s>' in text
    assert "<tool>18 C</s>" in text and tokenizer.decode(ids) == text
    _, plain = render_prompt(PromptInput(messages=messages), tokenizer, limits)
    assert "<tools>" not in plain
