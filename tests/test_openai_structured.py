"""Structured outputs through the OpenAI API (official client, in-process worker, real engine, default model):
response_format json_schema / json_object, tool_choice required / named, and 400s naming the parameter."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_structured import ANY_OF_40_X_40, ENDLESS_RECURSION
from worker_harness import ThreadedWorker

from radixcache.worker.cli import default_model_path
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.model.loader import load_checkpoint

MODEL = "fake"  # the name ThreadedWorker describes the engine with
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served():
    engine = Engine(load_checkpoint(default_model_path()), EngineConfig(kv_pages=256, page_size=16))
    worker = ThreadedWorker(engine, http_port=0).start()
    base = f"http://127.0.0.1:{worker.server.http_port}/v1"
    try:
        with openai.OpenAI(base_url=base, api_key="none", max_retries=0) as client:
            yield client, base, engine
    finally:
        worker.stop()
        engine.shutdown(drain=False)


def test_response_format_json_schema_and_json_object(served):
    client, _, engine = served
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            temperature=0.8,
            seed=seed,
            max_tokens=48,
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        max_tokens=48,
        stream=True,
    )
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), PERSON)
    done = client.completions.create(
        model=MODEL, prompt="<|bos|>A JSON object:", extra_body={"response_format": {"type": "json_object"}}, max_tokens=40, seed=4,
        temperature=0.7,
    )  # fmt: skip
    assert done.choices[0].text.startswith("{")
    assert engine.stats().cache.live_leases == 0


def test_tool_choice_named_and_required_force_a_valid_tool_call(served):
    client, _, _ = served
    named = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    for seed in range(3):
        required = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0,
            seed=seed,
        )  # fmt: skip
        (call,) = required.choices[0].message.tool_calls
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


class Address(BaseModel):
    city: str = Field(pattern="^[A-Z][a-z]{1,10}$")
    zip: str = Field(pattern="^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(pattern="^[A-Za-z]{1,10}$")
    home: Address
    work: Address | None = None


class Tree(BaseModel):
    label: str = Field(pattern="^[a-z]{1,4}$")
    children: list[Tree] = Field(default_factory=list, max_length=2)


@pytest.mark.parametrize("model", [Person, Tree], ids=["nested", "recursive"])
def test_forced_tool_call_with_pydantic_models_refs(served, model):
    # pydantic puts nested models under "$defs" and points at them with "#/$defs/..." ("#/$defs/Tree" from inside
    # Tree itself): the tool-call grammar nests the parameters, so those refs must still resolve (they gave 400
    # "Pointer '/$defs/Address' does not exist").
    client, _, engine = served
    schema = model.model_json_schema()
    assert "$defs" in schema
    tools = [{"type": "function", "function": {"name": "save", "parameters": schema}}, TOOLS[1]]
    for choice in ({"type": "function", "function": {"name": "save"}}, "required"):
        reply = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=160
        )
        (call,) = reply.choices[0].message.tool_calls
        if call.function.name == "save":
            model.model_validate_json(call.function.arguments)
            jsonschema.validate(json.loads(call.function.arguments), schema)
    assert engine.stats().cache.live_leases == 0


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format", "objekt"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 3, "maximum": 1}}}], "tool_choice": "required"},
            "tool_choice",
            "unsatisfiable",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": ENDLESS_RECURSION}}}, "response_format", "too complex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": ANY_OF_40_X_40}}}, "response_format", "too complex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"x-guidance": {"lenient": True}}}}}, "response_format", "x-guidance"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ENDLESS_RECURSION}}], "tool_choice": "required"}, "tool_choice", "too complex"),
    ],
)  # fmt: skip
def test_bad_constraints_get_400_naming_the_parameter(served, fields, param, named):
    client, base, engine = served
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | fields
    r = httpx.post(base + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and named in error["message"], error
    assert len(error["message"]) < 400  # never the grammar
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].message.content
    assert engine.stats().running == 0
