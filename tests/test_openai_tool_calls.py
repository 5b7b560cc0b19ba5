"""The Hermes / Qwen2.5 tool-call parser on its own: complete blocks, blocks split across deltas, malformed ones."""

from __future__ import annotations

import json
import random

import pytest

from radixcache.worker.front.tool_calls import ToolCallParser, parse_tool_calls, rebase_refs

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def streamed(text: str, cuts: list[int]) -> tuple[str, list]:
    parser = ToolCallParser()
    pieces, shown = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)], ""
    for piece in pieces:
        shown += parser.push(piece).text
    shown += parser.finish().text
    return shown, parser.calls


def test_a_complete_call_becomes_a_tool_call():
    content, calls = parse_tool_calls("Let me check.\n" + CALL)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert calls[0].id.startswith("call_")


def test_several_calls_and_string_arguments():
    second = '<tool_call>{"name": "time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    third = '<tool_call>{"name": "noargs"}</tool_call>'
    content, calls = parse_tool_calls(CALL + "\n" + second + third)
    assert content == "\n"
    assert [c.name for c in calls] == ["get_weather", "time", "noargs"]
    assert json.loads(calls[1].arguments) == {"tz": "UTC"}
    assert calls[2].arguments == "{}"
    assert len({c.id for c in calls}) == 3


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # JSON cut short
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["f", {}]</tool_call>',  # not an object
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # never closed (e.g. max_tokens)
    ],
)
def test_malformed_or_unclosed_blocks_stay_text(block):
    text = "before " + block
    assert parse_tool_calls(text) == (text, [])
    for cut in range(1, len(text)):  # and the same when streamed, cut anywhere
        assert streamed(text, [cut]) == (text, [])


def test_split_across_deltas_anywhere_gives_the_same_result():
    text = "Sure: <tool_ca" + "ll is not a tag> " + CALL + " done <tool_call"
    whole = parse_tool_calls(text)
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        shown, calls = streamed(text, cuts)
        assert shown == whole[0]
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]


def test_streaming_never_shows_a_tag_before_knowing_it_is_text():
    parser = ToolCallParser()
    assert parser.push("Hi <tool").text == "Hi "
    assert parser.push('_call>{"name": "f", "argu').text == ""
    step = parser.push('ments": {}}</tool_call> ok')
    assert step.text == " ok" and [c.name for c in step.calls] == ["f"]
    assert parser.push(" <to").text == " "
    assert parser.finish().text == "<to"  # the end: a partial tag is text after all


def test_rebase_refs_moves_local_refs_under_the_new_place_and_leaves_data_and_other_refs():
    params = {
        "$defs": {"Node": {"properties": {"next": {"$ref": "#/$defs/Node"}}}},
        "properties": {
            "root": {"$ref": "#"},
            "node": {"$ref": "#/$defs/Node"},
            "anchor": {"$ref": "#point"},
            "remote": {"$ref": "https://example.com/s.json"},
            "literal": {"const": {"$ref": "#/$defs/Node"}, "enum": [{"$ref": "#"}], "default": {"$ref": "#/x"}},
        },
    }
    out = rebase_refs(params, "/anyOf/1/properties/arguments")
    props = out["properties"]
    assert out["$defs"]["Node"]["properties"]["next"]["$ref"] == "#/anyOf/1/properties/arguments/$defs/Node"
    assert props["root"]["$ref"] == "#/anyOf/1/properties/arguments"
    assert props["node"]["$ref"] == "#/anyOf/1/properties/arguments/$defs/Node"
    assert props["anchor"] == params["properties"]["anchor"] and props["remote"] == params["properties"]["remote"]
    assert props["literal"] == params["properties"]["literal"]  # values to match, not references
    assert params["properties"]["root"] == {"$ref": "#"}  # a copy: the request's tools are untouched
    deep: dict = {"$ref": "#"}
    for _ in range(5000):  # past any schema llguidance reads: kept as is, without recursing 5000 deep
        deep = {"items": deep}
    assert rebase_refs(deep, "/x")["items"]["items"]["items"] is not None


def test_a_generated_block_nested_too_deeply_stays_text():
    deep = "[" * 5000 + "]" * 5000
    for body in (deep, json.dumps({"name": "f", "arguments": deep})):
        text = f"before <tool_call>{body}</tool_call> after"
        assert parse_tool_calls(text) == (text, [])
