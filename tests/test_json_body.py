"""worker/http/json_body.py: the same value as json.loads for any JSON, the body shape's limits enforced while
parsing (naming the field), and long bodies parsed in slices that yield to the event loop."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache.worker.http import json_body
from radixcache.worker.http.json_body import ArrayRule, BodyError, BodyShape, parse_body

ANY = BodyShape(max_depth=10_000, max_items=10**9)
SHAPE = BodyShape(
    max_depth=8,
    max_items=200,
    rules={("messages",): ArrayRule(3, "messages"), ("messages", "*", "content"): ArrayRule(2, "content parts")},
)


def same(a, b) -> bool:
    """Equal as JSON values (NaN included), told apart by every character: a surrogate pair is not one character."""
    return json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def slow_parse(text: str, shape: BodyShape = ANY, *, slices: list[int] | None = None, tiny: bool = False):
    """The sliced parser alone (never json.loads), counting its yields in `slices`. tiny: slices of 7 characters
    and 3 values, so that every string and container crosses slice boundaries."""
    sizes = {"slice_chars": 7, "slice_items": 3} if tiny else {}
    steps = json_body._Parser(text, shape, **sizes).parse()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if slices is not None:
            slices.append(1)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(value=JSON_VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]))
def test_the_value_is_what_json_loads_gives(value, ascii_only, indent):
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert same(slow_parse(text, tiny=True), json.loads(text))


@settings(max_examples=600, deadline=None)
@given(text=st.text(alphabet='{}[]",:0123456789.eE-+ \\\ntrufalsNIyu0dD8\x01', max_size=24))
def test_what_json_loads_refuses_is_refused(text):
    try:
        expected = json.dumps(json.loads(text), ensure_ascii=False)
    except (ValueError, RecursionError):
        expected = None
    try:
        got = json.dumps(slow_parse(text, tiny=True), ensure_ascii=False)
    except BodyError:
        got = None
    assert got == expected, text


@pytest.mark.parametrize(
    "text",
    [
        '"\\ud83d\\ude00 split \\ud83d\\ude00"',  # a surrogate pair across a slice boundary is one character again
        '"abcdef\\u00e9\\ud800 lone"',
        "[NaN, -Infinity, Infinity, 1e400, -0, 0.5, 12345678901234567890123]",
        '{"a": 1, "a": 2}',
        " \n\t[ ] ",
    ],
)
def test_edge_cases_match_json_loads(text):
    assert same(slow_parse(text, tiny=True), json.loads(text))


def test_an_array_past_its_rule_is_refused_naming_the_field():
    body = {"messages": [{"role": "user", "content": [{"text": "a"}, {"text": "b"}]}] * 3}
    assert slow_parse(json.dumps(body), SHAPE) == body
    with pytest.raises(BodyError) as e:
        slow_parse(json.dumps(body | {"messages": body["messages"] * 2}), SHAPE)
    assert e.value.param == "messages" and str(e.value) == "messages must hold at most 3 messages, got more"
    deeper = {"messages": [{"content": []}, {"content": [1, 2, 3]}]}
    with pytest.raises(BodyError) as e:
        slow_parse(json.dumps(deeper), SHAPE)
    assert e.value.param == "messages[1].content" and "at most 2 content parts" in str(e.value)
    # other paths are not limited by the rules: only by max_items
    assert slow_parse(json.dumps({"other": [[1] * 20]}), SHAPE) == {"other": [[1] * 20]}


def test_depth_and_item_budgets():
    assert slow_parse("[" * 8 + "]" * 8, SHAPE) == json.loads("[" * 8 + "]" * 8)
    with pytest.raises(BodyError, match="more than 8 deep") as e:
        slow_parse("[" * 100_000 + "]" * 100_000, SHAPE)
    assert e.value.param is None
    with pytest.raises(BodyError, match="more than 200 JSON values and keys"):
        slow_parse(json.dumps({"k": list(range(300))}), SHAPE)
    with pytest.raises(BodyError, match="more than 200 JSON values and keys"):  # keys count too
        slow_parse(json.dumps({str(i): 0 for i in range(150)}), SHAPE)


def test_the_work_before_a_refusal_is_bounded_by_the_limits_not_the_body():
    huge = "[" + ",".join(['{"role":"u"}'] * 1_000_000) + "]"
    slices: list[int] = []
    with pytest.raises(BodyError, match="messages must hold at most 3"):
        slow_parse('{"messages": ' + huge + "}", SHAPE, slices=slices)
    assert len(slices) <= 1  # refused within the first slice of 512 values


def test_many_values_are_parsed_in_slices():
    slices: list[int] = []
    assert slow_parse(json.dumps([{"a": [1, 2]}] * 4000), slices=slices) == [{"a": [1, 2]}] * 4000
    assert len(slices) >= 4000 * 5 // json_body.SLICE_ITEMS - 1  # 5 values and keys each


def test_long_strings_and_whitespace_are_parsed_in_slices():
    text = "x\\n\u00e9\U0001f600" * 100_000  # escapes, non-ASCII and astral characters
    raw = json.dumps({"content": text}, ensure_ascii=False) + " " * 300_000
    slices: list[int] = []
    assert slow_parse(raw, slices=slices) == {"content": text}
    assert len(slices) >= (len(raw) // json_body.SLICE_CHARS) - 1


def test_parse_body_decodes_utf8_and_answers_both_ways():
    small = json.dumps({"messages": [{"content": "h\u00e9"}]}).encode()
    assert asyncio.run(parse_body(small, SHAPE)) == {"messages": [{"content": "h\u00e9"}]}  # json.loads' path
    large = json.dumps({"messages": [{"content": "h\u00e9" * 200_000}]}, ensure_ascii=False).encode()
    assert asyncio.run(parse_body(large, SHAPE)) == {"messages": [{"content": "h\u00e9" * 200_000}]}
    for raw in (b'{"a": "\xff"}', b'{"a": "' + b"x" * 400_000 + b'\xc3"}'):
        with pytest.raises(BodyError, match="not valid UTF-8"):
            asyncio.run(parse_body(raw, SHAPE))
    with pytest.raises(BodyError, match="not valid JSON"):
        asyncio.run(parse_body(b"{not json", SHAPE))


def test_a_large_body_breaking_a_limit_early_is_refused_by_its_first_mib():
    messages = b'{"messages": [' + b",".join([b'{"role":"u"}'] * 200_000)
    # the body's end is not even JSON (nor UTF-8): the first MiB decides
    with pytest.raises(BodyError, match="messages must hold at most 3 messages") as e:
        asyncio.run(parse_body([messages[:70_000], messages[70_000:], b"\xff garbage"], SHAPE))
    assert e.value.limit and e.value.param == "messages"
    # a prefix that ends mid-string is no error of the body's; a limit broken past the first MiB still is
    text = "x" * (json_body.PREFIX_BYTES + 10)
    shape = BodyShape(max_depth=8, max_items=10, rules=SHAPE.rules)
    raw = json.dumps({"content": text}).encode()
    pieces = [raw[i : i + 65536] for i in range(0, len(raw), 65536)]  # as it arrives: the first MiB ends mid-string
    assert asyncio.run(parse_body(pieces, shape)) == {"content": text}
    late = json.dumps({"content": text, "messages": [1, 2, 3, 4]}).encode()
    with pytest.raises(BodyError, match="messages must hold at most 3"):
        asyncio.run(parse_body([late[i : i + 65536] for i in range(0, len(late), 65536)], shape))


def test_a_string_longer_than_any_field_allows_is_refused_while_parsed_naming_it():
    """A 15 MiB prompt used to be parsed whole (~240 slices) before validation refused it: HTTP health waited
    behind those slices (100-300 ms). Characters are counted decoded, so escapes do not count twice."""
    shape = BodyShape(max_depth=8, max_items=100, rules=SHAPE.rules, max_string_chars=1000)
    # 2,000 source characters (escaped backslashes), 1,000 decoded: at the limit
    at_limit = {"messages": [{"role": "user", "content": "\\n" * 500}]}
    assert slow_parse(json.dumps(at_limit), shape) == at_limit
    assert slow_parse(json.dumps({"m": "\u00e9" * 1000}), shape) == {"m": "\u00e9" * 1000}
    for body, param in (({"messages": [{"role": "user", "content": "x" * 1001}]}, "messages[0].content"),
                        ({"messages": [{"content": [{"text": "y" * 5000}]}]}, "messages[0].content[0].text"),
                        ({"k" * 1001: 1}, None)):  # fmt: skip
        with pytest.raises(BodyError, match="more than 1000 characters") as e:
            slow_parse(json.dumps(body), shape)
        assert e.value.limit and e.value.param == param
    slices: list[int] = []
    huge = json.dumps({"messages": [{"content": "x" * (15 << 20)}]})
    with pytest.raises(BodyError, match="more than 1000 characters"):
        slow_parse(huge, shape, slices=slices)
    assert len(slices) <= 2  # refused in its first slice of characters, not after 240
