"""worker.validation on plain values (what every front calls), the engine's own rules (worker/engine/checks.py),
and the tokenizer's bytes-per-token bound. Every refusal names its field (InvalidArgument.field)."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from radixcache.worker.cli import char_tokenizer
from radixcache.worker.default_model import __file__ as default_model_file
from radixcache.worker.engine.checks import FieldPath, check_engine_request, check_prompt_length
from radixcache.worker.engine.request import Constraint, Request, SamplingParams
from radixcache.worker.front.validation import (
    DEFAULT_MAX_TOKENS,
    MAX_SCHEMA_BYTES,
    MAX_TOOL_ARGUMENTS_BYTES,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    InvalidArgument,
    ModelLimits,
    PromptInput,
    SamplingValues,
    check_prompt_ids,
    check_prompt_input,
    check_request_id,
    check_ttl,
    constraint,
    fit_max_tokens,
    render_off_loop,
    render_prompt,
    sampling_params,
    tool_call_arguments,
)
from radixcache.worker.model.tokenizer import Tokenizer, bytes_per_token_bound

DEFAULT_TOKENIZER = Tokenizer.from_dir(default_model_file.rsplit("/", 1)[0])
LIMITS = ModelLimits.of(DEFAULT_TOKENIZER, vocab_size=DEFAULT_TOKENIZER.vocab_size, context_length=512)


def invalid(match: str):
    return pytest.raises(InvalidArgument, match=match)


def field_of(call, *args, **kwargs) -> str | None:
    """The field (as its path reads) of the InvalidArgument that call(*args, **kwargs) raises."""
    with pytest.raises(InvalidArgument) as e:
        call(*args, **kwargs)
    return None if e.value.field is None else str(e.value.field)


def test_a_text_that_cannot_fit_is_refused_in_milliseconds_before_tokenizing():
    class Untouchable:
        max_bytes_per_token = LIMITS.max_bytes_per_token

        def encode(self, *a, **k):
            raise AssertionError("tokenized an oversized text")

        apply_chat_template = encode

    huge = "hello world " * (15 * 2**20 // 12)  # 15 MiB
    with invalid(r"the context allows at most 511 prompt tokens"):
        render_prompt(PromptInput(text=huge), Untouchable(), LIMITS)
    with invalid(r"messages hold at least \d+ bytes of content"):
        render_prompt(PromptInput(messages=[{"role": "user", "content": huge}]), Untouchable(), LIMITS)
    with invalid("messages must hold at most 511 messages"):
        check_prompt_input(PromptInput(messages=[{"role": "user", "content": ""}] * 100_000), Untouchable(), LIMITS)
    with invalid("the prompt has 4000000 tokens; the context allows at most 511"):  # no loop over the ids
        check_prompt_input(PromptInput(token_ids=[5] * 4_000_000), Untouchable(), LIMITS)


def test_prompt_shapes_and_unicode():
    tok = DEFAULT_TOKENIZER
    with invalid("no input"):
        check_prompt_input(PromptInput(), tok, LIMITS)
    with invalid("set exactly one of text, token_ids or messages; got text and token_ids"):
        check_prompt_input(PromptInput(text="a", token_ids=[1]), tok, LIMITS)
    with invalid(r"text is not valid Unicode: surrogates not allowed at character 2"):
        check_prompt_input(PromptInput(text="ab\ud800"), tok, LIMITS)
    with invalid(r"messages\[1\].content is not valid Unicode"):
        check_prompt_input(
            PromptInput(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "\udfff"}]), tok, LIMITS
        )
    with invalid(r"messages\[0\].content must be a string, got list"):
        check_prompt_input(PromptInput(messages=[{"role": "user", "content": ["parts"]}]), tok, LIMITS)
    with invalid(r"text: this worker's model has no tokenizer"):
        check_prompt_input(PromptInput(text="a"), None, LIMITS)
    assert check_prompt_input(PromptInput(token_ids=[1, 2, 3]), None, LIMITS).at_least_tokens == 3
    ids, text = render_prompt(PromptInput(text="hello"), tok, LIMITS)
    assert text == "hello" and ids == tok.encode("hello")
    ids, rendered = render_prompt(PromptInput(messages=[{"role": "user", "content": "hi"}]), tok, LIMITS)
    assert "hi" in rendered and ids == tok.encode(rendered, add_special_tokens=False)


def test_sampling_values_nonfinite_and_bounds():
    def params(**values):
        return sampling_params(SamplingValues(**values), LIMITS)

    assert params().max_tokens == 16 and params(temperature=0.5, seed=-1).seed == -1
    for name, value in [("temperature", math.inf), ("temperature", math.nan), ("top_p", math.nan),
                        ("top_p", math.inf), ("min_p", math.nan), ("min_p", -math.inf)]:  # fmt: skip
        with invalid(f"{name} must be"):
            params(**{name: value})
    with invalid(r"temperature must be >= 0 and finite, got inf"):
        params(temperature=math.inf)
    with invalid(r"seed must be in \["):
        params(seed=2**70)
    with invalid(r"stop\[1\] is not valid Unicode"):
        params(stop=["ok", "\ud800"])
    with invalid("stop_token_ids allows at most 256 ids"):
        params(stop_token_ids=[1] * 10_000)
    with invalid("a sampling value has the wrong type"):
        params(temperature="hot")
    early = params(max_tokens=600, top_k=3, stop_token_ids=[1, 99999])
    assert early.top_k == 3  # before tokenizing: the rules of the values alone (the room and the ids: at submit)
    with invalid("max_tokens must be >= 1"):
        params(max_tokens=0)
    with invalid(r"ttl_seconds must be > 0 and finite"):
        check_ttl(math.inf)
    check_ttl(None)
    check_ttl(0.5)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(min_size=1, max_size=400))
def test_the_bytes_per_token_bound_holds_for_any_text(text):
    for tok in (DEFAULT_TOKENIZER, char_tokenizer()):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) >= math.ceil(len(text.encode("utf-8", "surrogatepass")) / tok.max_bytes_per_token)


def test_bytes_per_token_bound_by_tokenizer_kind():
    assert DEFAULT_TOKENIZER.max_bytes_per_token == max(len(t.encode()) for t in DEFAULT_TOKENIZER._tok.get_vocab())
    dropping = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    assert bytes_per_token_bound(dropping) is None  # a run of unknown characters is one <unk>
    words = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert bytes_per_token_bound(words) is None
    spaces = HFTokenizer(models.BPE(byte_fallback=True))
    spaces.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace: any number of bytes, no token
    assert bytes_per_token_bound(spaces) is None
    nfkc = HFTokenizer(models.BPE(byte_fallback=True))
    nfkc.normalizer = normalizers.NFKC()  # U+1D400 (4 bytes) -> "A"
    assert bytes_per_token_bound(nfkc) == 16


def test_size_bounds_are_exact() -> None:
    """A prompt exactly at a bound is accepted and one past it refused: text bytes, chat content, message count."""
    limits = ModelLimits(vocab_size=100, context_length=11, max_bytes_per_token=2)  # 10 prompt tokens, 20 bytes
    tok = DEFAULT_TOKENIZER
    assert check_prompt_input(PromptInput(text="a" * 19), tok, limits).at_least_tokens == 10  # ceil(19 / 2) at least
    assert check_prompt_input(PromptInput(text="é" * 10), tok, limits).at_least_tokens == 10  # 20 bytes
    with invalid("text has at least 21 bytes, so at least 11 tokens"):
        check_prompt_input(PromptInput(text="a" * 21), tok, limits)
    chat = [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10}]
    assert check_prompt_input(PromptInput(messages=chat), tok, limits).at_least_tokens == 1  # 20 bytes of content
    with invalid("messages hold at least 21 bytes of content"):
        check_prompt_input(PromptInput(messages=chat + [{"role": "user", "content": "c"}]), tok, limits)
    many = [{"role": "user", "content": ""}] * 10  # at most one message per prompt token
    assert check_prompt_input(PromptInput(messages=many), tok, limits).messages == many
    with invalid("messages must hold at most 10 messages, got 11"):
        check_prompt_input(PromptInput(messages=many + many[:1]), tok, limits)
    unbounded = ModelLimits.of(object(), vocab_size=100, context_length=11)  # a tokenizer with no bytes bound
    assert unbounded.max_bytes_per_token is None and unbounded.max_prompt_bytes is None
    assert check_prompt_input(PromptInput(text="a" * 1000), tok, unbounded).at_least_tokens == 1  # checked at submit


def test_a_pin_ttl_of_zero_and_a_request_id_that_is_not_unicode_are_named() -> None:
    with invalid("ttl_seconds must be > 0 and finite"):
        check_ttl(0)
    check_ttl(0.001)
    with invalid("request_id is not valid Unicode"):
        check_request_id("abc\ud800")


def test_a_constraint_is_passed_on_as_given_and_a_bad_one_is_named() -> None:
    assert constraint(None) is None
    assert constraint("json_object") == Constraint("json_object", "")
    assert constraint("regex", "[a-z]+") == Constraint("regex", "[a-z]+")
    assert constraint("json_schema", '{"type": "object"}') == Constraint("json_schema", '{"type": "object"}')
    with invalid("regex must not be empty"):
        constraint("regex")
    with invalid("json_schema is not valid JSON"):
        constraint("json_schema", "{")
    with invalid("json_schema must be a JSON object, got a JSON list"):
        constraint("json_schema", "[1]")


class RecordingTokenizer:
    """One token per character; records how it was called (what the chat template got). Like Hugging Face's, its
    template adds no generation prompt unless asked."""

    def __init__(self, template_error: Exception | None = None) -> None:
        self.calls: list[tuple] = []
        self.template_error = template_error

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(("encode", text, add_special_tokens))
        return [ord(c) % 50 for c in text]

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = False, **variables: object) -> str:
        self.calls.append(("template", add_generation_prompt, variables))
        if self.template_error is not None:
            raise self.template_error
        return "|".join(m["content"] for m in messages) + ("<g>" if add_generation_prompt else "")


class EncodesToNothing(RecordingTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return []


SMALL = ModelLimits(vocab_size=100, context_length=11)  # 10 prompt tokens at most; no bytes-per-token bound


def test_chat_is_rendered_with_its_tools_and_the_generation_prompt() -> None:
    tok = RecordingTokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = [{"role": "user", "content": "hi"}]
    ids, text = render_prompt(PromptInput(messages=chat, tools=tools), tok, SMALL)
    assert text == "hi<g>" and ids == [ord(c) % 50 for c in text]
    assert tok.calls == [("template", True, {"tools": tools}), ("encode", "hi<g>", False)]  # no second BOS
    tok.calls.clear()
    render_prompt(PromptInput(messages=chat), tok, SMALL)
    assert tok.calls[0] == ("template", True, {})
    assert render_prompt(PromptInput(token_ids=[1, 2]), None, SMALL) == ([1, 2], "")
    with invalid("messages: the model's chat template cannot render them: no chat template"):
        render_prompt(PromptInput(messages=chat), RecordingTokenizer(ValueError("no chat template")), SMALL)


class Geometry:
    """An engine's facts for check_engine_request: SMALL's vocabulary and context, a pool of 4 pages of 4 tokens."""

    vocab_size, context_length, page_size, num_pages = SMALL.vocab_size, SMALL.context_length, 4, 4


def submitted(ids: list[int], **sampling: object) -> None:
    check_engine_request(Request("r", ids, SamplingParams(**sampling)), Geometry())  # type: ignore[arg-type]


def test_the_prompt_length_and_max_tokens_bounds_are_exact() -> None:
    tok = RecordingTokenizer()
    assert render_prompt(PromptInput(text="a"), tok, SMALL)[0] == [ord("a") % 50]  # one token is a prompt
    submitted([1], max_tokens=1)
    submitted([1] * 10, max_tokens=1)  # the longest that fits
    with invalid(r"the prompt has 11 tokens; the context allows at most 10 \(context length 11"):
        submitted([1] * 11, max_tokens=1)
    with invalid("^the prompt encodes to no tokens$"):
        check_prompt_length(len(render_prompt(PromptInput(text="a"), EncodesToNothing(), SMALL)[0]), 11)
    submitted([1, 2], max_tokens=9)  # all the room
    with invalid(r"max_tokens must be in \[1, 9\]: the prompt has 2 tokens"):
        submitted([1, 2], max_tokens=10)
    with invalid(r"^stop_token_ids\[1\] = 100 is outside the vocabulary \[0, 100\)$"):
        submitted([1], max_tokens=1, stop_token_ids=(5, 100))
    # an unset max_tokens: before tokenizing it assumes the shortest prompt (one token), then fits the prompt
    early = sampling_params(SamplingValues(), SMALL)
    assert early.max_tokens == min(10, DEFAULT_MAX_TOKENS)
    assert fit_max_tokens(early, SamplingValues(), 2, SMALL).max_tokens == min(9, DEFAULT_MAX_TOKENS)
    assert fit_max_tokens(early, SamplingValues(), 2, SMALL, up_to=8).max_tokens == 6  # as long as it can be
    assert fit_max_tokens(early, SamplingValues(), 11, SMALL).max_tokens == 1  # the prompt is refused at submit
    given = sampling_params(SamplingValues(max_tokens=600), SMALL)
    assert fit_max_tokens(given, SamplingValues(max_tokens=600), 2, SMALL) is given  # its room: the engine's rule


def test_tokenizing_off_the_loop_and_the_rules_of_prompts_never_submitted() -> None:
    tok, long = RecordingTokenizer(), PromptInput(text="a" * 11)
    ids, _ = asyncio.run(render_off_loop(check_prompt_input(long, tok, SMALL), tok))
    assert len(ids) == 11  # Tokenize reports any length
    with invalid("the prompt has 11 tokens"):
        check_prompt_ids(check_prompt_input(long, tok, SMALL), ids, SMALL, fit=True)
    outside = check_prompt_input(PromptInput(token_ids=[1, 100]), None, SMALL)
    with invalid(r"^token_ids.ids\[1\] = 100 is outside the vocabulary"):
        check_prompt_ids(outside, [1, 100], SMALL, fit=False)
    with invalid("the prompt has 11 tokens"):
        check_prompt_input(PromptInput(token_ids=[1] * 11), None, SMALL)  # counted before the ids are copied


def test_a_schema_nested_too_deeply_is_named() -> None:
    with invalid("^json_schema is nested too deeply$"):
        constraint("json_schema", "[" * 50000)


def test_token_ids_span_the_whole_vocabulary_and_the_first_one_outside_is_named() -> None:
    submitted([0, 99], max_tokens=1)  # 0 and vocab_size - 1 are tokens
    with invalid(r"^token_ids.ids\[1\] = 100 is outside the vocabulary \[0, 100\)$"):
        submitted([0, 100], max_tokens=1)
    with invalid(r"^token_ids.ids\[2\] = -1 is outside"):
        submitted([0, 5, -1], max_tokens=1)


def tool(name: str = "f", parameters: object = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def test_tools_and_tool_calls_are_counted_sized_and_their_text_checked() -> None:
    chat = [{"role": "user", "content": "hi"}]
    check_prompt_input(PromptInput(messages=chat, tools=[tool()] * MAX_TOOLS), DEFAULT_TOKENIZER, LIMITS)
    with invalid(f"tools must hold at most {MAX_TOOLS} tools, got {MAX_TOOLS + 1}"):
        check_prompt_input(PromptInput(messages=chat, tools=[tool()] * (MAX_TOOLS + 1)), DEFAULT_TOKENIZER, LIMITS)
    big = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    with invalid(r"tools\[1\].function.parameters must have at most 65536 bytes as JSON"):
        check_prompt_input(PromptInput(messages=chat, tools=[tool(), tool(parameters=big)]), DEFAULT_TOKENIZER, LIMITS)
    with invalid(r"tools\[0\].function.name is not valid Unicode"):
        check_prompt_input(PromptInput(messages=chat, tools=[tool("f\ud800")]), DEFAULT_TOKENIZER, LIMITS)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    check_prompt_input(PromptInput(messages=[*chat, turn]), DEFAULT_TOKENIZER, LIMITS)
    with invalid(rf"messages\[1\].tool_calls must hold at most {MAX_TOOL_CALLS} tool calls"):
        many = turn | {"tool_calls": [call] * (MAX_TOOL_CALLS + 1)}
        check_prompt_input(PromptInput(messages=[*chat, many]), DEFAULT_TOKENIZER, LIMITS)
    lone = {"function": {"name": "f", "arguments": {"city": "\udc00"}}}
    with invalid(r"messages\[1\].tool_calls\[0\].function.arguments is not valid Unicode"):
        check_prompt_input(PromptInput(messages=[*chat, turn | {"tool_calls": [lone]}]), DEFAULT_TOKENIZER, LIMITS)
    with invalid(r"messages\[1\].tool_call_id is not valid Unicode"):
        check_prompt_input(PromptInput(messages=[*chat, {"role": "tool", "content": "", "tool_call_id": "\ud800"}]),
                           DEFAULT_TOKENIZER, LIMITS)  # fmt: skip


def test_tool_call_arguments_are_sized_before_they_are_parsed() -> None:
    args = FieldPath.of("args")
    assert tool_call_arguments('{"a": [1]}', args) == {"a": [1]}
    assert tool_call_arguments("not json", args) == "not json"
    deep = "[" * 30_000 + "]" * 30_000
    assert tool_call_arguments(deep, args) == deep  # too deep for json.loads: kept as text
    with invalid(f"args must have at most {MAX_TOOL_ARGUMENTS_BYTES} bytes as JSON"):
        tool_call_arguments("[" + "1," * MAX_TOOL_ARGUMENTS_BYTES + "1]", args)


def test_each_refusal_names_the_field_where_its_rule_decides() -> None:
    """InvalidArgument.field, the path fronts rename for their API (never read from the message)."""
    tok = DEFAULT_TOKENIZER

    def prompt(**kinds: object) -> None:
        check_prompt_input(PromptInput(**kinds), tok, LIMITS)  # type: ignore[arg-type]

    def values(**given: object) -> None:
        sampling_params(SamplingValues(**given), LIMITS)  # type: ignore[arg-type]

    user = {"role": "user", "content": "hi"}
    cases = [
        (lambda: prompt(), "prompt"),
        (lambda: prompt(text="a", token_ids=[1]), "prompt"),
        (lambda: prompt(text=""), "text"),
        (lambda: prompt(text="x" * 10**6), "text"),
        (lambda: prompt(token_ids=[]), "token_ids.ids"),
        (lambda: prompt(token_ids=[1] * 600), "prompt"),
        (lambda: prompt(messages=[]), "messages"),
        (lambda: prompt(messages=[user, {"role": "robot", "content": ""}]), "messages[1].role"),
        (lambda: prompt(messages=[{"role": "user", "content": "\ud800"}]), "messages[0].content"),
        (lambda: prompt(messages=[{"role": "user", "content": "x" * 10**6}]), "messages"),
        (lambda: prompt(messages=[user, user | {"name": "\ud800"}]), "messages[1].name"),
        (lambda: prompt(messages=[user], tools=[tool(), tool("\ud800")]), "tools[1].function.name"),
        (lambda: check_request_id("r" * 200), "request_id"),
        (lambda: check_ttl(-1), "ttl_seconds"),
        (lambda: values(temperature=-1), "temperature"),
        (lambda: values(temperature="hot"), "temperature"),
        (lambda: values(top_k=0, stop=("",)), "top_k"),  # the first of SamplingParams' rules refused
        (lambda: values(stop=("",)), "stop"),
        (lambda: values(stop=("ok", "\ud800")), "stop[1]"),
        (lambda: values(n=99), "n"),
        (lambda: values(max_tokens=0), "max_tokens"),
        (lambda: constraint("json_schema", "{"), "json_schema"),
        (lambda: constraint("regex", ""), "regex"),
        (lambda: constraint("xml", "x"), "constraint"),
        (lambda: submitted([1, 100], max_tokens=1), "token_ids.ids[1]"),
        (lambda: submitted([1], max_tokens=1, stop_token_ids=(1, 2, 300)), "stop_token_ids[2]"),
        (lambda: submitted([1, 2], max_tokens=10), "max_tokens"),
        (lambda: submitted([1] * 11, max_tokens=1), "prompt"),
    ]
    assert [field_of(call) for call, _ in cases] == [field for _, field in cases]


def test_a_message_that_begins_with_its_field_can_be_worded_with_another_name() -> None:
    with pytest.raises(InvalidArgument) as e:
        sampling_params(SamplingValues(stop=("ok", "\ud800")), LIMITS)
    assert str(e.value).startswith("stop[1] is not valid Unicode")
    assert e.value.worded("stop_sequences[1]") == "stop_sequences" + str(e.value)[len("stop") :]
    with pytest.raises(InvalidArgument) as e:
        sampling_params(SamplingValues(n=99), LIMITS)  # SamplingParams' own words: kept as they are
    assert e.value.worded("anything") == str(e.value) == "n must be in [1, 16], got 99"


def test_sampling_params_made_in_process_name_the_refused_field_themselves() -> None:
    """SamplingParams, made by any caller (no front in between), refuses with InvalidArgument and its field: the first
    of its rules, in the fields' order, that the values break; a value of the wrong type is named too."""
    cases = [
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"temperature": math.nan}, "temperature", "temperature must be >= 0 and finite, got nan"),
        ({"temperature": "hot"}, "temperature", "a sampling value has the wrong type: "),
        ({"top_k": 0, "stop": ("",)}, "top_k", "top_k must be -1 (off) or >= 1, got 0"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1], got 1.5"),
        ({"seed": 2**64}, "seed", "seed must be in ["),
        ({"stop_token_ids": (1,) * 257}, "stop_token_ids", "stop_token_ids allows at most 256 ids, got 257"),
        ({"stop": ("x",) * 17}, "stop", "stop allows at most 16 strings, got 17"),
        ({"stop": ("ok", "")}, "stop", "each stop string must have 1..256 characters, got 0"),
        ({"top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20], got 21"),
        ({"n": 17}, "n", "n must be in [1, 16], got 17"),
        ({"n": "two"}, "n", "a sampling value has the wrong type: "),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": math.nan}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got nan"),
    ]
    for values, field, says in cases:
        with pytest.raises(InvalidArgument) as e:
            SamplingParams(**values)
        assert (str(e.value.field), str(e.value).startswith(says)) == (field, True), (values, str(e.value))
    SamplingParams(top_k=-1, seed=2**64 - 1, stop=("x" * 256,) * 16, n=16, presence_penalty=-2.0)  # the bounds
