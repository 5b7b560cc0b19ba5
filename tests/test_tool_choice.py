"""Tool use as every front maps it (worker/front/tool_calls.py, worker/http/openai/requests.py): OpenAI's tool_choice shapes
(allowed_tools, parallel_tool_calls false), the grammar each choice compiles to, a call cut by max_tokens, and
OpenAI's strict-schema rule. The frameworks' own request bodies are in tests/fixtures/ (issue 28's defects)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.front.tool_calls import CLOSE, ToolCallParser, ToolChoice, ToolSpec, partial_call
from radixcache.worker.front.validation import InvalidArgument, check_strict_schema
from radixcache.worker.http.errors import APIError
from radixcache.worker.http.openai.protocol import ChatCompletionRequest
from radixcache.worker.http.openai.requests import parse_chat
from radixcache.worker.http.openai.responses import ChatResponder

FIXTURES = Path(__file__).parent / "fixtures"
SPECS = [ToolSpec("get_weather", parameters={"type": "object"}), ToolSpec("get_time", parameters={"type": "object"})]


def fixture(name: str) -> dict:
    body = json.loads((FIXTURES / name).read_text())
    body.pop("_source")
    return body


def parsed(body: dict):
    return parse_chat(ChatCompletionRequest.model_validate(body))


def output(text: str, finish: FinishReason | None) -> RequestOutput:
    return RequestOutput("r", [1], text, prompt_tokens=3, cached_tokens=0, completion_tokens=1, finish_reason=finish)


# -- the frameworks' bodies ------------------------------------------------------------------------------------------
def test_langchain_structured_output_forces_one_call_of_its_schema():
    p = parsed(fixture("langchain_with_structured_output_function_calling.json"))  # was 400: parallel_tool_calls
    assert p.tool_choice == ToolChoice("required", ("Joke",), parallel=False)
    kind, grammar = p.constraint
    assert kind == "ebnf" and grammar.startswith("start: call\n") and '"const": "Joke"' in grammar
    assert p.constraint_param == "tool_choice"


def test_llamaindex_auto_without_parallel_calls_stops_after_the_first_call():
    p = parsed(fixture("llamaindex_chat_with_tools.json"))  # was 400
    assert p.constraint == (None, "") and p.parse_tools
    assert CLOSE in p.sampling.stop  # the engine stops at the end of the first block
    # The generation stops on that stop string (the text ends before it): the open block is the one call.
    responder = ChatResponder(
        request_id="x", model="m", n=1, token_text=str, parse_tools=True, closes_at_stop=True, logprobs=False
    )
    responder.add(output('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', None))
    responder.add(output("", FinishReason.STOP_STRING))
    choice = responder.response().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    parallel = parsed(fixture("llamaindex_chat_with_tools.json") | {"parallel_tool_calls": True})
    assert CLOSE not in parallel.sampling.stop


def test_pydantic_ai_allowed_tools_limit_the_call_to_those_named():
    p = parsed(fixture("pydantic_ai_allowed_tools.json"))  # was 400: tool_choice
    assert p.tool_choice == ToolChoice("required", ("get_time",))
    grammar = p.constraint[1]
    assert '"const": "get_time"' in grammar and "get_weather" not in grammar
    tools = [t["function"]["name"] for t in p.prompt.tools]
    assert tools == ["get_weather", "get_time"]  # every tool is still in the prompt (its cache stays)
    auto = fixture("pydantic_ai_allowed_tools.json")
    auto["tool_choice"]["allowed_tools"]["mode"] = "auto"
    kind, grammar = parsed(auto).constraint
    assert kind == "ebnf" and grammar.startswith("start: TEXT | call\n") and "get_weather" not in grammar
    # The Responses API's flat shape is understood too.
    flat = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    assert parsed(fixture("pydantic_ai_allowed_tools.json") | {"tool_choice": flat}).tool_choice.allowed == (
        "get_time",
    )


@pytest.mark.parametrize(
    ("choice", "named"),
    [
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}, "nope"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}, "allowed_tools"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "allows no tool"),
        ({"type": "web_search"}, "tool_choice must be"),
        ("always", "always"),
    ],
)  # fmt: skip
def test_bad_tool_choices_get_400_naming_tool_choice(choice, named):
    with pytest.raises(APIError) as e:
        parsed(fixture("pydantic_ai_allowed_tools.json") | {"tool_choice": choice})
    assert e.value.status == 400 and e.value.param == "tool_choice" and named in e.value.message


def test_a_strict_schema_is_held_to_openais_rule():
    with pytest.raises(APIError) as e:
        parsed(fixture("strict_json_schema_without_additional_properties.json"))  # was accepted
    assert e.value.param == "response_format"
    assert e.value.message == (
        "Invalid schema for response_format 'calendar_event': In context=(), 'additionalProperties' is required to "
        "be supplied and to be false."
    )
    body = fixture("strict_json_schema_without_additional_properties.json")
    body["response_format"]["json_schema"]["strict"] = False
    assert parsed(body).constraint[0] == "json_schema"  # not strict: as sent


def test_strict_schema_rule_walks_nested_objects():
    ok = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"],
                             "additionalProperties": False},
                       "c": {"type": "array", "items": {"$ref": "#/$defs/d"}}},
        "required": ["a", "c"],
        "additionalProperties": False,
        "$defs": {"d": {"type": "object", "properties": {}, "additionalProperties": False}},
    }  # fmt: skip
    check_strict_schema(ok, "x")
    missing = json.loads(json.dumps(ok))
    missing["properties"]["a"]["required"] = []
    with pytest.raises(InvalidArgument, match=r"context=\('properties', 'a'\), 'required' .* Missing 'b'"):
        check_strict_schema(missing, "x")
    loose = json.loads(json.dumps(ok))
    del loose["$defs"]["d"]["additionalProperties"]
    with pytest.raises(InvalidArgument, match=r"context=\('\$defs', 'd'\), 'additionalProperties'"):
        check_strict_schema(loose, "x")


def test_a_strict_function_is_checked_too():
    body = fixture("pydantic_ai_allowed_tools.json")
    del body["tools"][1]["function"]["parameters"]["additionalProperties"]
    with pytest.raises(APIError) as e:
        parsed(body)
    assert e.value.param == "tools[1].function.parameters" and "function 'get_time'" in e.value.message


# -- a call cut by max_tokens ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "name", "arguments"),
    [
        ('\n{"name": "get_weather", "arguments": {"city": "Par', "get_weather", '{"city": "Par'),
        ('\n{"name": "get_weather", "argu', "get_weather", ""),
        ('\n{"name": "get_wea', "get_wea", ""),
        ("\n{", "", ""),
        ('\n{"name": "f", "arguments": {"a": 1}}\n</tool', "f", '{"a": 1}'),  # complete, cut in the closing tag
    ],
)
def test_a_call_cut_short_is_the_call_as_far_as_it_got(body, name, arguments):
    call = partial_call(body)
    assert (call.name, call.arguments) == (name, arguments)


def test_a_forced_call_cut_by_max_tokens_is_returned_not_its_markup():
    responder = ChatResponder(request_id="x", model="m", n=1, token_text=str, parse_tools=True, logprobs=False)
    chunks = responder.add(output('<tool_call>\n{"name": "get_weather", "arguments": {"ci', None))
    assert chunks == []  # nothing shown while the block is open
    chunks = responder.add(output('ty": "Pa', FinishReason.LENGTH))
    choice = responder.response().choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None  # before: the raw markup
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Pa')
    streamed = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in streamed] == [("get_weather", '{"city": "Pa')]
    # A generation that merely ends (a stop token) with a block open keeps it as text, as before.
    parser = ToolCallParser()
    parser.push("<tool_call>{")
    assert parser.finish().text == "<tool_call>{" and parser.calls == []


def test_tool_choice_constraints():
    assert ToolChoice("auto").constraint(SPECS) == (None, "")
    assert ToolChoice("none", ("get_time",)).constraint(SPECS) == (None, "")
    assert ToolChoice("auto", ("get_time", "get_weather")).constraint(SPECS) == (None, "")  # all of them: free
    assert ToolChoice("required").check([]) == "requires tools"
    assert ToolChoice("auto", ("x",)).check(SPECS) == "names the function 'x', which is not among tools"
    assert ToolChoice("auto", parallel=False).stop() == (CLOSE,)
    assert ToolChoice("required", parallel=False).stop() == ()  # the grammar writes exactly one call
