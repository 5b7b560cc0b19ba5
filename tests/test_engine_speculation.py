"""Speculation in the engine: the same output with it on and off (greedy, seeded sampling, n > 1, penalties,
logprobs, constraints, stop strings, max_tokens, preemption), drafts from the request's own namespace only, no
rejected token in the tree, every page back after a cancel.

Drafts need something to draft from: a tiny random model rarely repeats itself, so each test first runs a wave of
requests, then a second wave that retries them (the same prompt: the tree holds the first answer) or continues them.
"""

from __future__ import annotations

import json
import random

import pytest
from engine_fixtures import SLIDING, tiny_model

from radixcache.keys import decode
from radixcache.worker.cli import default_model_path
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Constraint, FinishReason, Request, RequestOutput, SamplingParams
from radixcache.worker.engine.tenant_counts import COUNTERS
from radixcache.worker.model.loader import load_checkpoint

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class Outputs:
    """on_output target keyed by (request id, sample index)."""

    def __init__(self) -> None:
        self.by: dict[tuple[str, int], list[RequestOutput]] = {}

    def __call__(self, out: RequestOutput) -> None:
        self.by.setdefault((out.request_id, out.index), []).append(out)

    def tokens(self) -> dict[tuple[str, int], list[int]]:
        return {k: [t for o in v for t in o.token_ids] for k, v in self.by.items()}

    def last(self, rid: str, index: int = 0) -> RequestOutput:
        return self.by[(rid, index)][-1]

    def text(self, rid: str) -> str:
        return "".join(o.text for o in self.by[(rid, 0)])


def engine_with(model, speculate: int, **kw) -> Engine:
    kw.setdefault("kv_pages", 512)
    kw.setdefault("page_size", 4)
    return Engine(model, EngineConfig(speculate=speculate, **kw))


def run_waves(engine: Engine, waves: list[list[Request]], sink: Outputs | None = None) -> Outputs:
    """Each wave submitted at once and run to the end before the next; the cache must be clean afterwards."""
    sink = sink or Outputs()
    for wave in waves:
        for r in wave:
            engine.submit(r, sink)
        engine.run_until_idle()
    engine.cache.check(idle=True)
    assert engine.cache.stats().pages_in_use == 0
    return sink


def prompts(n: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(range(1, 290), length) for _ in range(n)]  # no token twice: nothing to draft inside a prompt


def second_wave(ps: list[list[int]], params: SamplingParams, first: Outputs) -> list[Request]:
    """Batched: each prompt retried (the tree holds its answer) and continued by the first 3 tokens of its answer."""
    wave = [Request(f"b{i}", p, params) for i, p in enumerate(ps)]
    wave += [Request(f"c{i}", p + first.tokens()[(f"a{i}", 0)][:3], params) for i, p in enumerate(ps)]
    return wave


def both_ways(model, waves_of, **cfg) -> tuple[Outputs, Outputs, Engine]:
    """The same waves with speculation off and on; (off, on, the engine that speculated). The engine's
    `steps_off` is the other engine's step count."""
    results = []
    for speculate in (0, 8):
        engine = engine_with(model, speculate, **cfg)
        sink = Outputs()
        for wave in waves_of(sink):
            run_waves(engine, [wave], sink)
        results.append((sink, engine))
    (off, off_engine), (on, engine) = results
    engine.steps_off = off_engine.stats().steps
    return off, on, engine


def two_waves(ps: list[list[int]], params: SamplingParams, also: SamplingParams | None = None):
    """Wave 1, then (with `also`) each prompt sampled with it as s{i}, then second_wave with params."""

    def waves_of(sink: Outputs):
        yield [Request(f"a{i}", p, params) for i, p in enumerate(ps)]
        if also is not None:
            yield [Request(f"s{i}", p, also) for i, p in enumerate(ps)]
        yield second_wave(ps, params, sink)

    return waves_of


SAMPLED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, seed=3)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3"])
def test_greedy_output_is_the_same_with_speculation_on_and_off_at_every_kv_precision(model, kv_dtype):
    # A draft token attends to the drafts before it in the same step: it must read them back from the quantized pool
    # as a decode of one token at a time would, or the two disagree.
    waves = two_waves(prompts(4, seed=5), GREEDY, SAMPLED)
    off, on, engine = both_ways(model, waves, page_size=4, kv_dtype=kv_dtype)
    assert on.tokens() == off.tokens()
    stats = engine.stats()
    assert stats.kv_dtype == kv_dtype and 0 < stats.accepted_draft_tokens < stats.draft_tokens


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_greedy_output_is_the_same_with_speculation_on_and_off(model, page_size):
    # Each prompt is also sampled before the retries: the tree's newest answers are then ones the retries agree with
    # only in part, so some drafts are rejected.
    off, on, engine = both_ways(model, two_waves(prompts(4, seed=page_size), GREEDY, SAMPLED), page_size=page_size)
    assert on.tokens() == off.tokens()
    stats = engine.stats()
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens and stats.steps < 0.8 * engine.steps_off
    # per request, in every output and the last: what the engine counts
    assert sum(o[-1].accepted_draft_tokens for o in on.by.values()) == stats.accepted_draft_tokens
    assert sum(o[-1].draft_tokens for o in on.by.values()) == stats.draft_tokens


def test_a_sliding_window_models_greedy_output_is_the_same_with_speculation_on_and_off():
    """Verification chunks through a sliding layer (window 8: a draft of 8 reaches past the window of its first
    row) and a global one, answers several windows long."""
    sliding = tiny_model(**SLIDING)
    off, on, engine = both_ways(sliding, two_waves(prompts(3, seed=4), GREEDY, SAMPLED), page_size=4)
    assert on.tokens() == off.tokens()
    assert 0 < engine.stats().accepted_draft_tokens < engine.stats().draft_tokens


@pytest.fixture(scope="module")
def embedded():
    return load_checkpoint(default_model_path())


def test_the_embedded_models_greedy_output_is_the_same_with_speculation_on_and_off(embedded):
    """The trained model as shipped (bf16), at an odd page size (the tiny model covers 1, 7 and 16; spec_bench checks
    the embedded model's agentic trace at 16)."""
    tok = embedded.tokenizer
    ps = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in ("What does os.path.join do?", "How do I sort a list of tuples by the second item?")
    ]
    off, on, engine = both_ways(embedded, two_waves(ps, SamplingParams(max_tokens=16, ignore_eos=True)), page_size=7)
    assert on.tokens() == off.tokens()
    assert engine.stats().accepted_draft_tokens > 0


def test_the_embedded_models_bf16_output_is_the_same_with_speculation_on_and_off_under_batching(embedded):
    """The chaos workload's prompts (make soak's), batched in three waves of up to 16, greedy, 96 tokens, in bf16:
    before attention was row-exact 4 of 40 outputs differed with --speculate 8 (first at tokens 8 and 68), none in
    fp32. A draft's logits come from a row of a multi-token verify chunk, a plain step's from a one-row decode, the
    batches and the prefill chunks differ between the two runs; in bf16 a last-bit difference in any of them flips a
    rounding now and then (tests/test_model_rows.py pins each case)."""
    from chaos import Workload

    workload = Workload.build(0, vocab=embedded.config.vocab_size, page_size=16, max_tokens=96)
    rng = random.Random(1)
    ps = list(workload.references) + [workload.prompt(rng) for _ in range(30)]
    greedy = SamplingParams(max_tokens=96, ignore_eos=True)

    def waves_of(sink: Outputs):
        for w, wave in enumerate([ps[:8], ps[:16], ps[:4] * 2 + ps[16:24]]):
            yield [Request(f"w{w}-{i}", list(p), greedy, namespace="bob") for i, p in enumerate(wave)]

    off, on, _ = both_ways(embedded, waves_of, page_size=16, kv_pages=256, max_step_tokens=128)
    assert on.tokens() == off.tokens()


def test_a_seeded_sampled_request_gives_the_same_tokens_and_logprobs_on_and_off(model):
    ps = prompts(2, seed=3)
    params = [
        SamplingParams(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.7, seed=11, n=2, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(max_tokens=24, temperature=0.7, seed=99, ignore_eos=True, presence_penalty=0.4),
    ]

    def waves_of(sink: Outputs):
        yield [Request(f"a{i}", p, params[0]) for i, p in enumerate(ps)]
        # retried with the same seed (drafts accepted), with another one (drafts rejected), with penalties and n=2
        yield [Request(f"{tag}{i}", p, sp) for i, p in enumerate(ps) for tag, sp in zip("bcd", params, strict=True)]

    off, on, engine = both_ways(model, waves_of)
    assert on.tokens() == off.tokens()
    for key, outs in on.by.items():
        mine = [lp for o in outs for lp in o.logprobs]
        theirs = [lp for o in off.by[key] for lp in o.logprobs]
        assert [lp.token_id for lp in mine] == [lp.token_id for lp in theirs]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(mine, theirs, strict=True))
        assert [[t for t, _ in lp.top] for lp in mine] == [[t for t, _ in lp.top] for lp in theirs]
    stats = engine.stats()
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens  # both paths ran: accepted and rejected drafts
    assert on.last("c0", 1).accepted_draft_tokens >= 0 and on.last("b0").accepted_draft_tokens > 0


def cached_paths(engine: Engine) -> list[tuple[str, list[int]]]:
    """(namespace, tokens from the root to the end of the page) of every page in the tree, tails included."""
    return [(ns, decode(key)) for ns, key, _ in engine.cache.tree.items()]


def test_the_tree_holds_only_tokens_that_were_emitted(model):
    ps = prompts(3, seed=5)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True)
    engine = engine_with(model, 8, page_size=4)
    sink = run_waves(
        engine,
        [
            [Request(f"a{i}", p, params, namespace=f"t{i % 2}") for i, p in enumerate(ps)],
            [
                Request(
                    f"{tag}{i}",
                    p,
                    SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True),
                    namespace=f"t{i % 2}",
                )
                for i, p in enumerate(ps)
                for tag, s in (("b", 1), ("c", 2), ("d", 3))
            ],  # fmt: skip
        ],
    )
    stats = engine.stats()
    assert stats.accepted_draft_tokens < stats.draft_tokens  # drafts were rejected: their K/V was written
    emitted = {(f"t{int(rid[1:]) % 2}", tuple(ps[int(rid[1:])] + toks)) for (rid, _), toks in sink.tokens().items()}
    paths = cached_paths(engine)
    assert any(len(t) > len(ps[0]) for _, t in paths)  # generated tokens are cached, not only prompts
    for ns, tokens in paths:
        assert any(n == ns and list(full[: len(tokens)]) == tokens for n, full in emitted), (ns, tokens)
    # and what the tree holds is what recomputing gives: a cached path continued greedily equals cache off
    ns, longest = max(paths, key=lambda p: len(p[1]))
    hit = run_waves(engine, [[Request("hit", longest, GREEDY, namespace=ns)]])
    cold = run_waves(engine_with(model, 0, cache_enabled=False), [[Request("hit", longest, GREEDY)]])
    assert hit.last("hit").cached_tokens > 0 and hit.tokens() == cold.tokens()


def test_drafts_never_cross_namespaces(model):
    (p,) = prompts(1, seed=8)
    engine = engine_with(model, 8)
    sink = run_waves(
        engine,
        [
            [Request("a1", p, GREEDY, namespace="a")],
            [Request("b", p, GREEDY, namespace="b")],  # the same prompt, another tenant: nothing of a's to draft
            [Request("a2", p, GREEDY, namespace="a")],
        ],
    )
    alone = run_waves(engine_with(model, 8), [[Request("b", p, GREEDY, namespace="b")]])  # a fresh worker
    assert sink.last("a2").accepted_draft_tokens > 0
    assert sink.last("b").draft_tokens == alone.last("b").draft_tokens  # only what its own tokens give
    assert sink.tokens()[("b", 0)] == sink.tokens()[("a1", 0)] == sink.tokens()[("a2", 0)]


def test_a_stop_string_or_max_tokens_inside_an_accepted_run_ends_the_request_there(model):
    (p,) = prompts(1, seed=13)
    engine = engine_with(model, 8)
    first = run_waves(engine, [[Request("free", p, SamplingParams(max_tokens=30, ignore_eos=True))]])
    full = first.text("free")
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = full.index(stop)
    sink = run_waves(
        engine,
        [
            [
                Request("str", p, SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,))),
                Request("len", p, SamplingParams(max_tokens=11, ignore_eos=True)),
            ]
        ],
    )
    assert sink.text("str") == full[:cut] and sink.last("str").finish_reason is FinishReason.STOP_STRING
    assert sink.last("str").accepted_draft_tokens > 0 and len(sink.by[("str", 0)][-1].token_ids) > 1
    assert sink.tokens()[("len", 0)] == first.tokens()[("free", 0)][:11]
    assert sink.last("len").finish_reason is FinishReason.LENGTH and sink.last("len").completion_tokens == 11
    assert sink.last("len").accepted_draft_tokens > 0


def test_a_constrained_request_is_only_drafted_what_its_grammar_allows(model):
    p = model.tokenizer.encode("the cache keeps keys")

    def schema(key: str) -> Constraint:
        properties = {"color": {"enum": ["red", "green", "blue"]}, key: {"type": "integer", "maximum": 99}}
        body = {"type": "object", "properties": properties, "required": ["color", key], "additionalProperties": False}
        return Constraint("json_schema", json.dumps(body))

    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5)
    engine = engine_with(model, 8)
    cuts = []  # (what the drafter found, what the grammar let through) for constrained sequences
    propose, inner = engine.scheduler.propose, engine.speculator.drafter.propose
    found: dict[int, list[int]] = {}

    def spy_inner(seq, limit):
        found[id(seq)] = inner(seq, limit)
        return found[id(seq)]

    def spy(seq, limit):
        draft = propose(seq, limit)
        if seq.matcher is not None and id(seq) in found:
            cuts.append((found.pop(id(seq)), list(draft)))
            assert seq.matcher.accepts_prefix(draft) == len(draft), "a draft the grammar refuses"
        return draft

    engine.speculator.drafter.propose, engine.scheduler.propose = spy_inner, spy
    waves = [
        [Request("json", p, params, constraint=schema("n"))],
        [
            Request("again", p, params, constraint=schema("n")),  # retried: its answer is in the tree
            # the same masks until the key's name, which the tree's answer has wrong: its drafts are cut there
            Request("other", p, params, constraint=schema("m")),
        ],
    ]
    sink = run_waves(engine, waves)
    off = run_waves(engine_with(model, 0), waves)
    assert sink.tokens() == off.tokens()
    assert sink.last("again").accepted_draft_tokens > 0
    assert json.loads(sink.text("again"))["color"] in ("red", "green", "blue")
    assert set(json.loads(sink.text("other"))) == {"color", "m"}
    assert any(len(f) < len(d) for d, f in cuts)  # something the drafter found was cut by the grammar


def test_preemption_in_the_middle_of_drafts_keeps_the_answers_and_frees_every_page(model):
    ps = prompts(4, length=16, seed=21)
    need = sum(-(-(len(p) + 3 + GREEDY.max_tokens) // 4) for p in ps) * 2  # the second wave's 8 requests
    off, on, engine = both_ways(model, two_waves(ps, GREEDY), kv_pages=need // 3, max_step_tokens=64)
    assert on.tokens() == off.tokens()
    assert engine.stats().preemptions > 0 and engine.stats().accepted_draft_tokens > 0


def test_a_request_cancelled_after_an_accepted_run_leaves_nothing_behind(model):
    (p,) = prompts(1, seed=30)
    engine = engine_with(model, 8, page_size=4)
    run_waves(engine, [[Request("first", p, SamplingParams(max_tokens=40, ignore_eos=True))]])
    seen: list[RequestOutput] = []
    held = []

    def on_output(out: RequestOutput) -> None:
        seen.append(out)
        if len(out.token_ids) > 1 and not out.finished:  # an accepted draft run: cancel right there
            seq = engine._requests[out.request_id].first
            held.append(len(seq.lease.pages) * 4 - seq.num_computed)
            engine.abort(out.request_id)

    engine.submit(Request("retry", p, SamplingParams(max_tokens=40, ignore_eos=True)), on_output)
    engine.run_until_idle()
    assert seen[-1].finish_reason is FinishReason.ABORTED and held
    engine.cache.check(idle=True)
    assert engine.cache.stats().pages_in_use == 0


def test_a_request_that_opts_out_is_never_drafted(model):
    (p,) = prompts(1, seed=40)
    engine = engine_with(model, 8)
    sink = run_waves(
        engine,
        [
            [Request("first", p, GREEDY)],
            [Request("out", p, SamplingParams(max_tokens=24, ignore_eos=True, speculate=False))],
            [Request("in", p, GREEDY)],
        ],
    )
    assert sink.last("out").draft_tokens == 0 and sink.last("in").accepted_draft_tokens > 0
    assert sink.tokens()[("out", 0)] == sink.tokens()[("in", 0)] == sink.tokens()[("first", 0)]


def test_speculation_must_be_a_sane_number_of_tokens():
    with pytest.raises(ValueError, match="speculate must be in"):
        EngineConfig(speculate=-1)
    with pytest.raises(ValueError, match="speculate must be in"):
        EngineConfig(speculate=1000)


def test_every_counter_of_the_workers_stats_is_the_sum_of_its_tenants(model):
    """Two tenants under pressure with speculation on: each counter (admissions, hits, preemptions, tokens, drafts)
    is kept once, under its tenant; the worker's figure is the sum, and a tenant never sees another's."""
    ps = prompts(4, length=16, seed=21)
    need = sum(-(-(len(p) + 3 + GREEDY.max_tokens) // 4) for p in ps) * 2
    engine = engine_with(model, 8, kv_pages=need // 3, max_step_tokens=64)

    def wave(tag: str, tokens: Outputs | None = None) -> list[Request]:
        out = []
        for i, p in enumerate(ps):
            tenant = "alice" if i % 2 else "bob"
            out.append(Request(f"{tag}{i}", p, GREEDY, namespace=tenant))
            if tokens is not None:
                out.append(Request(f"{tag}c{i}", p + tokens.tokens()[(f"a{i}", 0)][:3], GREEDY, namespace=tenant))
        return out

    sink = run_waves(engine, [wave("a")])
    run_waves(engine, [wave("b", sink)], sink)
    everyone, alice, bob, nobody = (engine.stats(ns) for ns in (None, "alice", "bob", "carol"))
    for name in COUNTERS:
        assert getattr(everyone, name) == getattr(alice, name) + getattr(bob, name), name
        assert getattr(nobody, name) == 0, name
    for view in (alice, bob):  # each tenant drafted, was preempted and was served hits of its own
        assert view.accepted_draft_tokens > 0 and view.draft_steps > 0 and view.cached_tokens > 0, view
        assert view.finished_requests == 6 and view.generated_tokens == 6 * GREEDY.max_tokens
    assert everyone.preemptions > 0
    assert sum(o[-1].accepted_draft_tokens for o in sink.by.values()) == everyone.accepted_draft_tokens
