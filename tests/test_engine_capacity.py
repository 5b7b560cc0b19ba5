"""Capacity promises of the engine: an admitted request never fails for lack of pages mid-stream (it is preempted
and resumed, or refused before its first token), pins stay inside their budget, and hit-rate counters count each
admission's lookup once."""

from __future__ import annotations

import random

import pytest
from engine_fixtures import tiny_model
from test_engine import Collector, run_alone

from radixcache.cache import PinBudgetError
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import FinishReason, Request, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def run_one(engine: Engine, sink: Collector, rid: str, tokens: list[int], max_tokens: int) -> RequestOutput:
    """Submit one greedy request (EOS ignored), run the engine until idle, return the request's last output."""
    engine.submit(Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), sink)
    engine.run_until_idle()
    return sink.last(rid)


def test_a_request_sized_to_the_pool_finishes_after_a_partial_page_hit(model):
    # 32 pages of 16 = 512 tokens. The cached 511-token prompt ends mid-page; the 400-token prompt's hit ends inside
    # page 25, so its first computed page is a private copy of a cached one. Both must not be counted against it.
    engine = Engine(model, EngineConfig(page_size=16, kv_pages=32, max_step_tokens=512))
    sink = Collector()
    long = prompt(511, 1)
    assert run_one(engine, sink, "long", long, 1).finish_reason is FinishReason.LENGTH
    last = run_one(engine, sink, "sized", long[:400], 112)
    assert last.finish_reason is FinishReason.LENGTH, last.error
    assert last.completion_tokens == 112 and last.cached_tokens == 399
    params = SamplingParams(max_tokens=112, ignore_eos=True)
    assert sink.tokens("sized") == run_alone(model, long[:400], params, page_size=16)
    engine.cache.check(idle=True)
    assert engine.cache.stats().pages_in_use == 0


def test_a_lone_request_never_holds_a_page_twice(model):
    # The same situation at every hit length: the lease never holds more pages than its tokens need.
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=16, max_step_tokens=64))
    sink = Collector()
    base = prompt(63, 2)
    run_one(engine, sink, "base", base, 1)
    for n in range(2, 63, 10):
        last = run_one(engine, sink, f"cut{n}", base[:n], 64 - n)
        assert last.finish_reason is FinishReason.LENGTH, (n, last.error)
        engine.cache.check(idle=True)


def test_pins_stay_inside_their_budget(model):
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=32, max_step_tokens=64, max_pinned=0.25))
    assert engine.max_pinned_pages == 8
    sink = Collector()
    system = prompt(60, 3)  # 15 pages: more than the budget of 8
    engine.submit(Request("warm", system, SamplingParams(max_tokens=1)), sink)
    engine.run_until_idle()
    with pytest.raises(PinBudgetError, match=r"pin budget \(--max-pinned\) is 8 of the 32"):
        engine.pin(system)
    assert engine.cache.stats().pages_pinned == 0, "a refused pin pins nothing"
    assert engine.pin(system[:32]) == 32  # 8 pages: exactly the budget
    assert engine.pin(system[:32], ttl_s=60) == 32, "re-pinning costs nothing"
    with pytest.raises(PinBudgetError):
        engine.pin(system[:36])
    engine.cache.check()


def test_pins_never_take_pages_a_running_request_was_promised(model):
    # Pins arriving during a long stream used to take the pages it would decode into; it then died mid-stream.
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=32, max_step_tokens=64, max_pinned=1.0))
    sink = Collector()
    others = [prompt(40, 10 + i) for i in range(3)]
    for i, other in enumerate(others):
        engine.submit(Request(f"warm{i}", other, SamplingParams(max_tokens=1)), sink)
    engine.run_until_idle()
    stream = prompt(20, 4)
    engine.submit(Request("stream", stream, SamplingParams(max_tokens=80, ignore_eos=True)), sink)  # 25 pages
    for _ in range(3):
        engine.step()
    refused = 0
    for other in others:  # 10 pages each: the first fits beside the stream's 25, the others would not
        try:
            engine.pin(other)
        except PinBudgetError as e:
            assert "promised" in str(e)
            refused += 1
    assert refused == 2
    engine.run_until_idle()
    last = sink.last("stream")
    assert last.finish_reason is FinishReason.LENGTH and last.completion_tokens == 80, last.error
    engine.cache.check(idle=True)


def test_a_request_that_cannot_fit_beside_the_pins_is_refused_before_its_first_token(model):
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=20, max_pinned=1.0))
    sink = Collector()
    pinned = list(range(1, 61))
    engine.submit(Request("pinned", pinned, SamplingParams(max_tokens=1)), sink)
    engine.run_until_idle()
    assert engine.pin(pinned) == 60  # 15 of the 20 pages
    engine.submit(Request("too-big", list(range(100, 130)), SamplingParams(max_tokens=10)), sink)
    engine.run_until_idle()
    (last,) = sink.outputs["too-big"]
    assert last.finish_reason is FinishReason.ERROR and last.completion_tokens == 0
    assert "15 of the 20 pages are pinned" in last.error
    # A request reading the pinned prefix itself is not blocked by it.
    engine.submit(Request("reads-pins", pinned + [7, 8], SamplingParams(max_tokens=10, ignore_eos=True)), sink)
    engine.run_until_idle()
    assert sink.last("reads-pins").finish_reason is FinishReason.LENGTH
    engine.cache.check(idle=True)


def test_each_admission_counts_its_lookup_once(model):
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=24, max_step_tokens=32))
    engine.start()
    try:
        assert engine.stats().cache.queried_tokens == 0, "the warm-up is not a lookup"
    finally:
        engine.shutdown()
    # Under pressure: requests wait (their admission is tried every step) and are preempted and re-admitted.
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=24, max_step_tokens=32))
    sink = Collector()
    prompts = [prompt(30, 20 + i) for i in range(6)]
    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True)), sink)
    admissions = []
    real_start = engine.scheduler._start

    def start(seq, lease):
        admissions.append(len(seq.tokens))
        real_start(seq, lease)

    engine.scheduler._start = start
    engine.run_until_idle()
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.waiting == 0
    assert stats.cache.queried_tokens == sum(admissions)
    assert stats.cache.hit_tokens <= stats.cache.queried_tokens
