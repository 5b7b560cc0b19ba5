"""Structured outputs in the engine: every constrained output parses and validates, for the shipped default model
and a random one; the same requests unconstrained do not (so the constraint is what makes them valid). Constraints
leave unconstrained batch-mates untouched, survive preemption, end requests with a stop reason, never sample a
padding id, and bad schemas / regexes / grammars are refused before anything is allocated."""

from __future__ import annotations

import json
import logging
import re
import threading

import grpc
import jsonschema
import pytest
from engine_fixtures import byte_tokenizer, tiny_model
from helpers import tiny_config
from test_engine import Collector, assert_clean, make_engine, run_requests
from worker_harness import ThreadedWorker

from radixcache.client import Client
from radixcache.client.client import generate_request
from radixcache.worker.cli import default_model_path
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Constraint, ErrorKind, FinishReason, Request, SamplingParams
from radixcache.worker.engine.structured import ConstraintError, GrammarCache
from radixcache.worker.grpc.pb_inputs import constraint_values
from radixcache.worker.model.loader import load_checkpoint, random_model
from radixcache.worker.model.packed import PackedLinear

REQUESTS = 20  # per schema / regex / grammar, sampled with different seeds
FREE = 5  # the same prompt unconstrained, per schema / regex / grammar: none of them validates

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "id"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 4},
        },
        "required": ["color", "sizes"],
        "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 8},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["title", "score"],
        "additionalProperties": False,
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
}

REGEX = r"(yes|no), [a-z]{3,10}\."
GBNF = 'root ::= "(" num (op num)? (op num)? ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"\n'
GBNF_SENTENCE = re.compile(r"\([1-9][0-9]?([+*][1-9][0-9]?){0,2}\)")
LARK = 'start: "[" item ("," item)? ("," item)? "]"\nitem: "ab" | "c"\n'
LARK_SENTENCE = re.compile(r"\[(ab|c)(,(ab|c)){0,2}\]")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def default():
    return load_checkpoint(default_model_path())


def chat_prompt(loaded) -> list[int]:
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}])
    return tok.encode(text, add_special_tokens=False)


run = run_requests  # every request submitted, then the engine run until idle: the Collector


def texts(sink: Collector, ids: list[str]) -> list[str]:
    return ["".join(o.text for o in sink.outputs[i]) for i in ids]


def sampled(prompt, constraint, n=REQUESTS, max_tokens=64, tag="c") -> list[Request]:
    return [
        Request(
            f"{tag}{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i), constraint=constraint
        )
        for i in range(n)
    ]


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("model_name", ["tiny", "default"])
def test_every_sampled_output_validates_against_its_schema(model_name, request):
    loaded = request.getfixturevalue(model_name)
    engine = make_engine(loaded, page_size=16)
    prompt = chat_prompt(loaded) if model_name == "default" else loaded.tokenizer.encode("the cache keeps")
    batch: list[Request] = []
    for name, schema in SCHEMAS.items():
        batch += sampled(prompt, Constraint("json_schema", json.dumps(schema)), tag=f"{name}-")
        batch += sampled(prompt, None, n=FREE, tag=f"free-{name}-", max_tokens=24)
    sink = run(engine, batch)
    for name, schema in SCHEMAS.items():
        ids = [f"{name}-{i}" for i in range(REQUESTS)]
        for rid, text in zip(ids, texts(sink, ids), strict=True):
            assert validates(text, schema), f"{rid}: {text!r} does not validate against {name}"
            last = sink.last(rid)
            # The grammar ended it: a stop reason well before max_tokens, not a cut-off at the length limit.
            assert last.finish_reason is FinishReason.STOP_TOKEN and last.completion_tokens < 64, (rid, text)
        free = texts(sink, [f"free-{name}-{i}" for i in range(FREE)])
        assert not any(validates(t, schema) for t in free), f"unconstrained output validated against {name}"
    assert len({t for name in SCHEMAS for t in texts(sink, [f"{name}-{i}" for i in range(REQUESTS)])}) > 20
    assert engine.grammars.misses == len(SCHEMAS)  # 20 requests per schema, one compile each
    assert_clean(engine)


@pytest.mark.parametrize("model_name", ["tiny", "default"])
def test_regex_and_grammars_hold_for_every_sampled_output(model_name, request):
    loaded = request.getfixturevalue(model_name)
    engine = make_engine(loaded, page_size=16)
    prompt = loaded.tokenizer.encode("<|bos|>The value is" if model_name == "default" else "pages of")
    cases = {
        "regex": (Constraint("regex", REGEX), re.compile(REGEX)),
        "gbnf": (Constraint("ebnf", GBNF), GBNF_SENTENCE),
        "lark": (Constraint("ebnf", LARK), LARK_SENTENCE),
    }
    batch: list[Request] = []
    for name, (constraint, _) in cases.items():
        batch += sampled(prompt, constraint, tag=f"{name}-", max_tokens=32)
    batch += sampled(prompt, None, n=FREE, tag="free-", max_tokens=16)
    sink = run(engine, batch)
    for name, (_, sentence) in cases.items():
        for i, text in enumerate(texts(sink, [f"{name}-{i}" for i in range(REQUESTS)])):
            assert sentence.fullmatch(text), f"{name}-{i}: {text!r}"
            assert sink.last(f"{name}-{i}").finish_reason is FinishReason.STOP_TOKEN
    free = texts(sink, [f"free-{i}" for i in range(FREE)])
    assert not any(s.fullmatch(t) for t in free for _, s in cases.values())
    assert eval(texts(sink, ["gbnf-0"])[0]) >= 1  # a real arithmetic expression  # noqa: S307
    assert_clean(engine)


def test_json_object_gives_one_json_object(default):
    engine = make_engine(default, page_size=16)
    sink = run(engine, sampled(chat_prompt(default), Constraint("json_object"), n=6, max_tokens=60))
    finished = 0
    for i, text in enumerate(texts(sink, [f"c{i}" for i in range(6)])):
        if sink.last(f"c{i}").finish_reason is FinishReason.STOP_TOKEN:
            assert isinstance(json.loads(text), dict), text
            finished += 1
        else:  # any object may be longer than max_tokens: cut off, but still an object's start
            assert text.startswith("{") and sink.last(f"c{i}").finish_reason is FinishReason.LENGTH, text
    assert finished >= 1


def test_unconstrained_requests_give_the_same_tokens_beside_constrained_ones(tiny):
    prompts = [tiny.tokenizer.encode(t) for t in ("the cache", "a radix tree maps", "pages of sixteen", "every step")]
    free = [
        Request(f"u{i}", p, SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 0.8, seed=i))
        for i, p in enumerate(prompts)
    ]
    alone = run(make_engine(tiny, page_size=4), free)
    schema = Constraint("json_schema", json.dumps(SCHEMAS["enum_and_array"]))
    mixed_batch = (
        [Request(r.request_id, r.prompt_ids, r.sampling) for r in free]
        + sampled(prompts[0], schema, n=4)
        + sampled(prompts[1], Constraint("regex", REGEX), n=4, tag="r")
    )
    mixed = run(make_engine(tiny, page_size=4), mixed_batch)
    for r in free:
        assert mixed.tokens(r.request_id) == alone.tokens(r.request_id), r.request_id
    assert all(validates(t, SCHEMAS["enum_and_array"]) for t in texts(mixed, [f"c{i}" for i in range(4)]))


def test_preemption_mid_constrained_request_keeps_it_valid_and_unchanged(tiny):
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 6, "maxItems": 6}},
        "required": ["items"],
        "additionalProperties": False,
    }
    constraint = Constraint("json_schema", json.dumps(schema))
    prompts = [tiny.tokenizer.encode(t) * 3 for t in ("the cache keeps", "pages are shared", "a radix tree", "evicts")]
    requests = [
        Request(f"g{i}", p, SamplingParams(max_tokens=80), constraint=constraint) for i, p in enumerate(prompts)
    ]
    alone = {}
    for r in requests:
        alone[r.request_id] = run(make_engine(tiny, page_size=4), [r]).tokens(r.request_id)
    need = sum(-(-(len(r.prompt_ids) + 40) // 4) for r in requests)
    engine = make_engine(tiny, page_size=4, kv_pages=need // 2, max_step_tokens=64)
    sink = run(engine, requests)
    assert engine.stats().preemptions > 0
    for r in requests:
        assert sink.tokens(r.request_id) == alone[r.request_id], r.request_id
        assert validates(texts(sink, [r.request_id])[0], schema)
    assert_clean(engine)


def test_stop_strings_and_eos_keep_working_under_a_constraint(tiny):
    engine = make_engine(tiny, page_size=4)
    prompt = tiny.tokenizer.encode("the cache")
    regex = Constraint("regex", r"ab(cd){3}x")
    sink = run(
        engine,
        [
            Request("stop", prompt, SamplingParams(max_tokens=30, stop=("cdcd",)), constraint=regex),
            Request("eos", prompt, SamplingParams(max_tokens=30), constraint=Constraint("regex", "abc")),
            Request("len", prompt, SamplingParams(max_tokens=3), constraint=regex),
            Request(
                "ignore_eos",
                prompt,
                SamplingParams(max_tokens=30, ignore_eos=True),
                constraint=Constraint("regex", "abc"),
            ),
        ],
    )
    # The complete grammar ends the request itself, adding no EOS token, and ignore_eos cannot make it go on.
    eos = set(tiny.config.eos_token_ids)
    assert eos and not eos & set(sink.tokens("eos"))
    assert texts(sink, ["ignore_eos"]) == ["abc"] and sink.last("ignore_eos").finish_reason is FinishReason.STOP_TOKEN
    assert texts(sink, ["stop"]) == ["ab"] and sink.last("stop").finish_reason is FinishReason.STOP_STRING
    assert texts(sink, ["eos"]) == ["abc"] and sink.last("eos").finish_reason is FinishReason.STOP_TOKEN
    assert sink.last("len").finish_reason is FinishReason.LENGTH and texts(sink, ["len"])[0].startswith("ab")
    assert_clean(engine)


def test_padding_rows_of_the_model_vocab_are_never_sampled():
    tokenizer = byte_tokenizer()
    pad = 40  # the model's vocab is larger than the tokenizer's, as checkpoints often round it up
    config = tiny_config(
        vocab_size=tokenizer.vocab_size + pad, hidden_size=64, intermediate_size=128, max_position_embeddings=512
    )
    loaded = random_model(config, seed=3, std=0.3)
    loaded.tokenizer = tokenizer
    head = loaded.model.lm_head.dense_weight()  # make the padding rows the model's favourites
    head[tokenizer.vocab_size :] *= 40
    loaded.model.lm_head = PackedLinear(head, None)
    engine = make_engine(loaded, page_size=4)
    prompt = tokenizer.encode("the cache")
    sink = run(
        engine,
        [
            Request("free", prompt, SamplingParams(max_tokens=8, ignore_eos=True)),
            *sampled(prompt, Constraint("regex", "[a-z ]{4,12}"), n=8, max_tokens=16),
        ],
    )
    assert any(t >= tokenizer.vocab_size for t in sink.tokens("free"))  # unconstrained, it picks them
    for i in range(8):
        assert all(t < tokenizer.vocab_size for t in sink.tokens(f"c{i}"))
        assert re.fullmatch("[a-z ]{4,12}", texts(sink, [f"c{i}"])[0])


# Accepted before the compile-time probe, then failing (500 / INTERNAL) on their first tokens, with the whole grammar
# in the log: an object that must contain itself forever, 40 x 40 nested alternatives, a million forced characters.
ENDLESS_RECURSION = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}, "$ref": "#/$defs/n"}  # fmt: skip
ANY_OF_40_X_40 = {"anyOf": [{"anyOf": [{"maxItems": i + j} for j in range(40)]} for i in range(40)]}
EXPLODING = [
    Constraint("json_schema", json.dumps(ENDLESS_RECURSION)),
    Constraint("json_schema", json.dumps(ANY_OF_40_X_40)),
    Constraint("regex", "(x{1000}){1000}"),
]
BAD = [
    (Constraint("json_schema", '{"type": "objekt"}'), "objekt"),
    (Constraint("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum"),
    (Constraint("json_schema", '{"properties": {"a": {"$ref": "#/defs/nope"}}}'), "/defs/nope"),
    (Constraint("regex", "a(b"), "unclosed group"),
    (Constraint("ebnf", 'root ::= "a" missing'), "missing"),
    (Constraint("ebnf", 'start: "a" | nothing'), "nothing"),
    *((c, "too complex to serve") for c in EXPLODING),
]


@pytest.mark.parametrize("constraint,named", BAD, ids=[c.kind + str(i) for i, (c, _) in enumerate(BAD)])
def test_invalid_constraints_are_refused_before_anything_is_allocated(tiny, constraint, named):
    engine = make_engine(tiny, page_size=4)
    before = engine.cache.stats()
    with pytest.raises(ConstraintError, match=re.escape(named)) as info:
        engine.submit(Request("bad", [1, 2, 3], constraint=constraint), Collector())
    assert str(info.value).startswith(constraint.kind)
    assert len(str(info.value)) < 400  # one line: never the grammar, never the parser's state
    with pytest.raises(ConstraintError, match=re.escape(named)):
        engine.compile_constraint(constraint)
    assert not engine.step()  # nothing was queued
    assert engine.cache.stats() == before
    sink = run(engine, [Request("bad", [1, 2, 3], SamplingParams(max_tokens=2))])  # the id is free, it serves
    assert sink.last("bad").finish_reason is not None


def test_a_grammar_failing_past_the_probe_ends_only_its_request_with_one_short_log_line(tiny, caplog):
    # The probe takes two tokens; this regex forces a million x's only after "aaac", so it compiles, and fails while
    # sampling its fourth token: that request ends with the error, its batch-mate is untouched, nothing leaks.
    engine = make_engine(tiny, page_size=4)
    late = Constraint("regex", "[ab][ab][ab]c(x{1000}){1000}")
    with caplog.at_level(logging.INFO, logger="radixcache.engine"):
        sink = run(engine, [Request("late", [1, 2, 3], SamplingParams(max_tokens=20), constraint=late),
                            Request("other", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))])  # fmt: skip
    failed = sink.last("late")
    assert failed.finish_reason is FinishReason.ERROR and "too many expressions" in failed.error
    assert failed.error_kind is ErrorKind.CONSTRAINT  # the client's grammar, not a fault of ours: 400, not 500
    assert len(sink.tokens("other")) == 8
    (record,) = [r for r in caplog.records if "late" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is None and len(record.getMessage()) < 300
    assert_clean(engine)


def test_a_model_without_tokenizer_refuses_constraints():
    config = tiny_config(num_layers=1, num_heads=2, num_kv_heads=1)
    engine = Engine(random_model(config), EngineConfig(kv_pages=16, page_size=4))
    with pytest.raises(ConstraintError, match="tokenizer"):
        engine.submit(Request("x", [1, 2], constraint=Constraint("regex", "a")), Collector())


def test_grammar_cache_is_bounded_and_compiles_off_the_calling_thread_once(tiny):
    cache = GrammarCache(tiny.tokenizer, tiny.config.vocab_size, set(tiny.config.eos_token_ids), capacity=2)
    regexes = [Constraint("regex", f"a{{{n}}}") for n in range(1, 4)]
    threads = [threading.Thread(target=cache.compile, args=(regexes[0],)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 1
    for c in regexes:
        cache.compile(c)
    assert len(cache) == 2  # the LRU bound: the oldest was dropped
    misses = cache.misses
    cache.compile(regexes[-1])
    assert cache.misses == misses  # cached by its text
    cache.compile(regexes[0])
    assert cache.misses == misses + 1  # evicted, compiled again
    with pytest.raises(ValueError, match="at most"):
        Constraint("regex", "a" * 70_000)


# --- over the wire: the gRPC front with the real engine and the default model ----------------------------------
@pytest.fixture(scope="module")
def wire(default):
    engine = Engine(default, EngineConfig(kv_pages=256, page_size=16))
    with ThreadedWorker(engine) as w, Client(w.target) as client:
        yield client, engine
    engine.shutdown(drain=False)


def test_json_schema_over_grpc(wire):
    client, engine = wire
    schema = SCHEMAS["nested_object"]
    messages = [{"role": "user", "content": "Describe a user as JSON."}]
    for seed in range(3):
        done = client.generate_text(messages=messages, json_schema=schema, max_tokens=64, temperature=0.8, seed=seed)
        jsonschema.validate(json.loads(done.text), schema)
        assert done.finish_reason == "stop_token"
    regex = client.generate_text("<|bos|>Answer:", regex=REGEX, max_tokens=32, temperature=0.8, seed=1)
    assert re.fullmatch(REGEX, regex.text)
    assert engine.stats().cache.live_leases == 0


def test_a_grammar_failing_past_the_probe_is_invalid_argument_over_grpc(wire):
    client, engine = wire
    with pytest.raises(grpc.RpcError) as failed:
        client.generate_text("<|bos|>Answer:", regex="[ab][ab][ab]c(x{1000}){1000}", max_tokens=20)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
    assert "too many expressions" in failed.value.details()
    assert engine.stats().cache.live_leases == 0


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
        ({"json_schema": {"type": "objekt"}}, "objekt"),
        ({"regex": "a(b"}, "regex: "),
        ({"regex": ""}, "regex must not be empty"),
        ({"ebnf": 'root ::= "a" missing'}, "missing"),
        ({"regex": "x" * 70_000}, "at most 65536 characters"),
        ({"json_schema": "[" * 60_000}, "nested too deeply"),
        ({"json_schema": '{"items": ' * 700 + "{}" + "}" * 700}, "json_schema nests more than 64 levels"),
        ({"json_schema": '{"items": ' * 65 + "{}" + "}" * 65}, "json_schema nests more than 64 levels"),
        ({"json_schema": {"type": "object", "x-guidance": {"whitespace_flexible": True}}}, "x-guidance"),
        ({"json_schema": ENDLESS_RECURSION}, "json_schema: the grammar is too complex to serve"),
        ({"json_schema": ANY_OF_40_X_40}, "json_schema: the grammar is too complex to serve"),
        ({"regex": "(x{1000}){1000}"}, "regex: the grammar is too complex to serve"),
        ({"ebnf": "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000}, "ebnf: "),
    ],
)
def test_bad_constraints_are_invalid_argument_and_the_worker_keeps_serving(wire, kwargs, named, caplog):
    client, engine = wire
    with caplog.at_level(logging.INFO), pytest.raises(grpc.RpcError) as e:
        client.generate_text("<|bos|>Hello", max_tokens=4, **kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in e.value.details()
    assert len(e.value.details()) < 400 and sum(len(r.getMessage()) for r in caplog.records) < 400
    assert client.generate_text("<|bos|>Hello", max_tokens=2).completion_tokens == 2
    stats = engine.stats()
    assert stats.cache.live_leases == 0 and stats.running == 0


def test_json_object_false_means_unconstrained(wire):
    client, _ = wire
    request = generate_request("<|bos|>Hello", max_tokens=6, ignore_eos=True)
    request.json_object = False
    assert request.WhichOneof("constraint") == "json_object"
    assert constraint_values(request) == (None, "")
    with pytest.raises(ValueError, match="at most one constraint"):
        generate_request("x", regex="a", ebnf="root ::= x")


def test_every_one_of_n_samples_follows_the_constraint_with_penalties_on_top(tiny):
    engine = make_engine(tiny, page_size=4)
    schema = SCHEMAS["enum_and_array"]
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=5, n=4, presence_penalty=1.5, frequency_penalty=-1.0)
    request = Request(
        "n", tiny.tokenizer.encode("the cache keeps"), params, constraint=Constraint("json_schema", json.dumps(schema))
    )
    sink = Collector()
    engine.submit(request, sink)
    engine.run_until_idle()
    by_sample: dict[int, str] = {}
    for out in sink.outputs["n"]:
        by_sample[out.index] = by_sample.get(out.index, "") + out.text
    assert sorted(by_sample) == [0, 1, 2, 3]
    for text in by_sample.values():
        assert validates(text, schema), text
    assert len(set(by_sample.values())) > 1  # each sample walked its own grammar
    assert_clean(engine)
