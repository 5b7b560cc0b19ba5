"""The engine end to end in-process: batching never changes an answer, pressure never leaks, sharing happens."""

from __future__ import annotations

import collections
import dataclasses
import random
import threading

import pytest
from engine_fixtures import SLIDING, tiny_model

from radixcache.worker.engine.engine import Engine, EngineConfig, RequestTooLargeError
from radixcache.worker.engine.request import FinishReason, Request, RequestOutput, SamplingParams


class Collector:
    """on_output target: every output per request, in order."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.done = threading.Event()
        self.expected = 0

    def __call__(self, out: RequestOutput) -> None:
        self.outputs.setdefault(out.request_id, []).append(out)
        if out.finished and sum(o[-1].finished for o in self.outputs.values()) == self.expected:
            self.done.set()

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.token_ids]

    def last(self, rid: str) -> RequestOutput:
        return self.outputs[rid][-1]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_engine(model, **kw) -> Engine:
    kw.setdefault("kv_pages", 512)
    return Engine(model, EngineConfig(**kw))


def assert_clean(engine: Engine) -> None:
    engine.cache.check()
    stats = engine.cache.stats()
    assert stats.live_leases == 0
    assert stats.pages_in_use == 0


def run_alone(model, prompt: list[int], params: SamplingParams, page_size: int = 4) -> list[int]:
    engine = make_engine(model, page_size=page_size, cache_enabled=False)
    sink = Collector()
    engine.submit(Request("alone", prompt, params), sink)
    engine.run_until_idle()
    return sink.tokens("alone")


def run_requests(engine: Engine, requests: list[Request]) -> Collector:
    sink = Collector()
    for r in requests:
        engine.submit(r, sink)
    engine.run_until_idle()
    return sink


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a few prefixes (like system prompts), with suffixes of different lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 300) for _ in range(rng.randrange(20, 70))] for _ in range(3)]
    return [prefixes[i % 3] + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 40))] for i in range(n)]


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_mixed_batch_matches_each_request_alone_with_cache_off(model):
    prompts = workload(16)
    engine = make_engine(model, page_size=4, max_step_tokens=96)
    sink = Collector()
    # Requests arrive at different steps, so prefills, decodes and hits mix.
    for i, prompt in enumerate(prompts):
        engine.submit(Request(f"r{i}", prompt, GREEDY), sink)
        if i % 3 == 2:
            engine.step()
    engine.run_until_idle()
    for i, prompt in enumerate(prompts):
        assert sink.tokens(f"r{i}") == run_alone(model, prompt, GREEDY), f"request r{i} changed in the batch"
        assert sink.last(f"r{i}").finish_reason is FinishReason.LENGTH
    assert sum(sink.last(f"r{i}").cached_tokens for i in range(16)) > 0
    assert_clean(engine)


def test_memory_pressure_preempts_and_still_gives_identical_answers(model):
    prompts = workload(12, seed=1)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    page = 4
    need = sum(-(-(len(p) + params.max_tokens) // page) for p in prompts)
    engine = make_engine(model, page_size=page, kv_pages=need // 4, max_step_tokens=256)
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(Request(f"p{i}", prompt, params), sink)
    engine.run_until_idle()
    assert engine.stats().preemptions > 0
    for i, prompt in enumerate(prompts):
        assert sink.tokens(f"p{i}") == run_alone(model, prompt, params, page_size=page)
    assert_clean(engine)


def test_a_sliding_window_model_answers_as_with_the_cache_off_under_pressure():
    """Prompts that share prefixes several windows long (window 8), hits, preemptions: every answer equals the
    request run alone with the cache off. The window does not cap the context."""
    model = tiny_model(**SLIDING)
    prompts = workload(6, seed=2)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    need = sum(-(-(len(p) + params.max_tokens) // 4) for p in prompts)
    engine = make_engine(model, page_size=4, kv_pages=need // 3, max_step_tokens=64)
    assert engine.context_length == 4096
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(Request(f"s{i}", prompt, params), sink)
        engine.step()
    engine.run_until_idle()
    assert engine.stats().preemptions > 0 and sum(sink.last(f"s{i}").cached_tokens for i in range(6)) > 8
    for i, prompt in enumerate(prompts):
        assert sink.tokens(f"s{i}") == run_alone(model, prompt, params), f"request s{i} changed"
    assert_clean(engine)


def test_second_of_two_concurrent_requests_computes_only_its_suffix(model):
    rng = random.Random(7)
    prefix = [rng.randrange(1, 300) for _ in range(512)]
    engine = make_engine(model, page_size=16, max_step_tokens=1024)
    sink = Collector()
    engine.submit(Request("a", prefix + [5, 6, 7], GREEDY), sink)
    engine.submit(Request("b", prefix + [8, 9], GREEDY), sink)
    engine.run_until_idle()
    assert sink.last("a").cached_tokens == 0
    assert sink.last("b").cached_tokens == 512
    assert engine.stats().inflight_shared_tokens == 512
    assert_clean(engine)


def test_hit_ending_inside_a_page_gives_the_same_tokens(model):
    rng = random.Random(3)
    first = [rng.randrange(1, 300) for _ in range(45)]
    second = first[:37] + [rng.randrange(1, 300) for _ in range(9)]
    engine = make_engine(model, page_size=16)
    sink = Collector()
    engine.submit(Request("first", first, GREEDY), sink)
    engine.run_until_idle()
    engine.submit(Request("second", second, GREEDY), sink)
    engine.run_until_idle()
    assert sink.last("second").cached_tokens == 37  # token-exact: 2 whole pages + 5 slots copied
    assert sink.tokens("second") == run_alone(model, second, GREEDY, page_size=16)
    assert_clean(engine)


def test_seeded_sampling_is_reproducible_whatever_the_batch(model):
    params = SamplingParams(
        max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=1234, ignore_eos=True
    )
    prompt = workload(1, seed=5)[0]
    alone = run_alone(model, prompt, params)
    engine = make_engine(model, page_size=4)
    sink = Collector()
    for i, other in enumerate(workload(6, seed=9)):
        engine.submit(Request(f"noise{i}", other, SamplingParams(max_tokens=30, temperature=1.0)), sink)
    engine.step()
    engine.submit(Request("seeded", prompt, params), sink)
    engine.run_until_idle()
    assert sink.tokens("seeded") == alone
    unseeded = SamplingParams(max_tokens=20, temperature=0.9, seed=4321, ignore_eos=True)
    assert run_alone(model, prompt, unseeded) != alone


def test_stop_conditions(model):
    prompt = workload(1, seed=11)[0]
    free_run = run_alone(model, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine = make_engine(model, page_size=4)
    sink = Collector()
    stop_id = free_run[5]
    engine.submit(Request("len", prompt, SamplingParams(max_tokens=7, ignore_eos=True)), sink)
    engine.submit(
        Request("tok", prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_id,))), sink
    )
    engine.run_until_idle()
    assert sink.tokens("len") == free_run[:7] and sink.last("len").finish_reason is FinishReason.LENGTH
    cut = free_run.index(stop_id) + 1
    assert sink.tokens("tok") == free_run[:cut] and sink.last("tok").finish_reason is FinishReason.STOP_TOKEN

    tokenizer = model.tokenizer
    full_text = tokenizer.decode(free_run)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    engine.submit(Request("str", prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,))), sink)
    engine.run_until_idle()
    text = "".join(o.text for o in sink.outputs["str"])
    assert sink.last("str").finish_reason is FinishReason.STOP_STRING
    assert text == full_text[: full_text.index(stop)]
    assert stop not in text
    assert_clean(engine)


def test_eos_stops_unless_ignored(model):
    prompt = workload(1, seed=13)[0]
    free_run = run_alone(model, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    # A model whose config names the 4th generated token as its EOS.
    eos = free_run[3]
    with_eos = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,)))
    engine = make_engine(with_eos, page_size=4)
    sink = Collector()
    engine.submit(Request("eos", prompt, SamplingParams(max_tokens=12)), sink)
    engine.submit(Request("ignored", prompt, SamplingParams(max_tokens=12, ignore_eos=True)), sink)
    engine.run_until_idle()
    assert sink.tokens("eos") == free_run[: free_run.index(eos) + 1]
    assert sink.last("eos").finish_reason is FinishReason.STOP_TOKEN
    assert sink.tokens("ignored") == free_run
    assert sink.last("ignored").finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_frees_everything(model, when):
    engine = make_engine(model, page_size=4, max_step_tokens=32)
    sink = Collector()
    prompt = workload(1, seed=17)[0] * 3
    engine.submit(Request("x", prompt, SamplingParams(max_tokens=50, ignore_eos=True)), sink)
    if when == "mid_prefill":
        engine.step()
        assert engine.scheduler.running and engine.scheduler.running[0].prefilling
    elif when == "mid_decode":
        while not sink.outputs.get("x"):
            engine.step()
    assert engine.abort("x")
    engine.run_until_idle()
    assert sink.last("x").finish_reason is FinishReason.ABORTED
    assert sum(o.finished for o in sink.outputs["x"]) == 1
    assert not engine.abort("x")
    assert_clean(engine)


def test_rejections_happen_before_anything_is_allocated(model):
    engine = make_engine(model, page_size=4, kv_pages=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(Request("v", [1, 2, 100_000], GREEDY), Collector())
    with pytest.raises(ValueError, match="max_tokens must be in"):
        engine.submit(Request("c", [1, 2], SamplingParams(max_tokens=5000)), Collector())
    with pytest.raises(RequestTooLargeError, match="KV pages"):
        engine.submit(Request("big", [1] * 40, SamplingParams(max_tokens=10)), Collector())
    engine.submit(Request("dup", [1, 2], GREEDY), Collector())
    with pytest.raises(ValueError, match="already running"):
        engine.submit(Request("dup", [1, 2], GREEDY), Collector())
    engine.run_until_idle()
    assert_clean(engine)


def test_a_failing_request_does_not_disturb_its_batch_mates(model, monkeypatch):
    import radixcache.worker.engine.step as engine_module

    real = engine_module.sample_row

    def flaky(logits, params, generator):
        if params.seed == 666:
            raise RuntimeError("boom")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample_row", flaky)
    prompt = workload(1, seed=19)[0]
    engine = make_engine(model, page_size=4)
    sink = Collector()
    engine.submit(Request("bad", prompt, SamplingParams(max_tokens=8, seed=666, ignore_eos=True)), sink)
    engine.submit(Request("good", prompt, GREEDY), sink)
    engine.run_until_idle()
    assert sink.last("bad").finish_reason is FinishReason.ERROR and sink.last("bad").error
    monkeypatch.setattr(engine_module, "sample_row", real)
    assert sink.tokens("good") == run_alone(model, prompt, GREEDY)
    assert_clean(engine)


def test_threaded_engine_streams_and_drains_on_shutdown(model):
    engine = make_engine(model, page_size=4)
    engine.start()
    sink = Collector()
    sink.expected = 4
    try:
        for i, prompt in enumerate(workload(4, seed=23)):
            engine.submit(Request(f"t{i}", prompt, GREEDY), sink)
        assert sink.done.wait(60)
        stats = engine.stats()
        assert stats.running == 0 and stats.finished_requests == 4
        assert stats.cache.live_leases == 0
    finally:
        engine.shutdown(drain=True, timeout=10)
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit(Request("late", [1, 2], GREEDY), sink)


def test_next_turn_hits_the_whole_previous_turn(model):
    engine = make_engine(model, page_size=16)
    sink = Collector()
    first = workload(1, seed=29)[0]
    engine.submit(Request("turn1", first, GREEDY), sink)
    engine.run_until_idle()
    history = first + sink.tokens("turn1")
    engine.submit(Request("turn2", history + [7, 8, 9], GREEDY), sink)
    engine.run_until_idle()
    # All of turn 1 is reused, its last partial page too; only its last sampled token (never computed) is not.
    assert sink.last("turn2").cached_tokens == len(history) - 1
    assert sink.tokens("turn2") == run_alone(model, history + [7, 8, 9], GREEDY, page_size=16)
    assert_clean(engine)


def test_a_request_that_cannot_fit_even_alone_fails_clearly(model):
    engine = make_engine(model, page_size=4, kv_pages=20, max_pinned=1.0)
    sink = Collector()
    pinned_prompt = list(range(1, 61))
    engine.submit(Request("pinned", pinned_prompt, SamplingParams(max_tokens=1)), sink)
    engine.run_until_idle()
    assert engine.pin(pinned_prompt) == 60  # 15 of the 20 pages can no longer be evicted
    engine.submit(Request("too-big", list(range(100, 130)), SamplingParams(max_tokens=10)), sink)
    engine.run_until_idle()
    last = sink.last("too-big")
    assert last.finish_reason is FinishReason.ERROR
    assert "cannot hold this request" in last.error
    assert engine.unpin(pinned_prompt) == 60
    engine.submit(Request("fits-now", list(range(100, 130)), SamplingParams(max_tokens=10)), sink)
    engine.run_until_idle()
    assert sink.last("fits-now").finish_reason is FinishReason.LENGTH
    assert_clean(engine)


def test_an_engine_bug_fails_the_requests_in_flight_and_the_engine_keeps_serving(model, monkeypatch):
    engine = make_engine(model, page_size=4)
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def broken_once():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler bug")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", broken_once)
    engine.start()
    try:
        first = Collector()
        first.expected = 1
        engine.submit(Request("victim", workload(1, seed=31)[0], GREEDY), first)
        assert first.done.wait(30)
        assert first.last("victim").finish_reason is FinishReason.ERROR
        after = Collector()
        after.expected = 1
        engine.submit(Request("after", workload(1, seed=37)[0], GREEDY), after)
        assert after.done.wait(30)
        assert after.last("after").finish_reason is FinishReason.LENGTH
        assert engine.stats().cache.live_leases == 0
    finally:
        engine.shutdown(drain=False)
    engine.cache.check()


def test_shutdown_right_after_submit_answers_every_request(model):
    engine = make_engine(model, page_size=4)
    engine.start()
    sink = Collector()
    sink.expected = 6
    for i, prompt in enumerate(workload(6, seed=41)):
        engine.submit(Request(f"s{i}", prompt, GREEDY), sink)
    engine.shutdown(drain=False)
    assert sink.done.is_set()  # every request got its one final output before shutdown returned
    for i in range(6):
        assert sum(o.finished for o in sink.outputs[f"s{i}"]) == 1
    assert engine.cache.stats().live_leases == 0
    engine.cache.check()


def test_a_failing_call_on_the_engine_thread_does_not_stop_it(model, monkeypatch):
    engine = make_engine(model, page_size=4)
    engine.start()
    try:
        sink = Collector()
        sink.expected = 1
        monkeypatch.setattr(engine, "_abort", lambda request_id: 1 / 0)
        engine.submit(Request("slow", workload(1, seed=43)[0], SamplingParams(max_tokens=200, ignore_eos=True)), sink)
        assert engine.abort("slow")  # the abort task raises inside the engine thread
        assert sink.done.wait(60)  # the engine kept going: the request ran to its end
        assert sink.last("slow").finish_reason is FinishReason.LENGTH
    finally:
        engine.shutdown(drain=False)
    engine.cache.check()


def test_a_failure_between_lease_and_compute_leaks_nothing(model, monkeypatch):
    engine = make_engine(model, page_size=4)
    prompt = workload(1, seed=47)[0]
    sink = Collector()
    engine.submit(Request("first", prompt[:10], SamplingParams(max_tokens=3)), sink)
    engine.run_until_idle()  # leaves a partial tail, so the next request's hit is copied

    def broken_copy(*args):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(engine.pool, "copy_prefix", broken_copy)
    engine.submit(Request("second", prompt[:10] + [50, 51], GREEDY), sink)
    engine.run_until_idle()
    assert sink.last("second").finish_reason is FinishReason.ERROR
    assert_clean(engine)


def test_load_counts_the_prefill_still_queued_and_the_pages_held(model):
    """What a cluster router weighs (Engine.load): tokens left to prefill, pages running requests hold."""
    engine = make_engine(model, page_size=4, kv_pages=64, max_step_tokens=16)
    idle = engine.load()
    assert (idle.running, idle.waiting, idle.queued_prefill_tokens, idle.pages_busy) == (0, 0, 0, 0)
    assert idle.pages_total == 64 and not engine.alive  # not started: no engine thread
    sink = Collector()
    engine.submit(Request("a", list(range(1, 41)), GREEDY), sink)  # 40 prompt tokens
    engine.submit(Request("b", list(range(50, 60)), GREEDY), sink)  # 10
    engine.step()  # takes both in; 16 tokens of prefill this step
    mid = engine.load()
    assert mid.running + mid.waiting == 2 and mid.steps == 1
    assert mid.queued_prefill_tokens == 39 + 9 - 16  # a prompt's last token is computed by its first decode
    assert mid.pages_busy == 4  # the 16 tokens computed, in pages of 4
    engine.run_until_idle()
    done = engine.load()
    assert (done.running, done.waiting, done.queued_prefill_tokens, done.pages_busy) == (0, 0, 0, 0)
    # A waiting request counts what it will compute: not the prefix a running prefill is making for it, nor the
    # cached one (bench/cluster_bench.py: counted whole, they sent conversations away from the replica holding them).
    engine.submit(Request("c", list(range(100, 140)), GREEDY), sink)
    engine.step()  # 16 of c's 40 computed
    engine.submit(Request("d", list(range(100, 140)) + [7] * 8, GREEDY), sink)
    engine.step()  # 32 of c's; d waits for the rest of its prefix
    behind = engine.load()
    assert (behind.running, behind.waiting, behind.queued_prefill_tokens) == (1, 1, (39 - 32) + (47 - 40))
    engine.run_until_idle()
    one = make_engine(model, page_size=4, kv_pages=64, max_step_tokens=16, max_running=1)
    one.submit(Request("a", list(range(1, 41)), GREEDY), sink)
    one.run_until_idle()
    one.submit(Request("f", list(range(60, 100)), GREEDY), sink)
    one.step()  # f runs (16 of 40), alone
    one.submit(Request("e", list(range(1, 41)) + [9] * 6, GREEDY), sink)
    one.step()  # e waits for a place: a's 40 tokens are cached for it
    queued = one.load()
    assert (queued.running, queued.waiting, queued.queued_prefill_tokens) == (1, 1, (39 - 32) + (45 - 40))
    one.run_until_idle()
    assert_clean(one)
    engine.start()
    try:
        assert engine.alive
    finally:
        engine.shutdown(drain=True, timeout=10)
    assert not engine.alive


def test_a_tenants_stats_show_its_own_figures_and_the_pools_capacity(model):
    # alice repeats a prompt (hits), pins it, and is squeezed out by bob's long prompts (evictions); bob never
    # repeats. Each tenant's view holds exactly its own traffic and pages; the worker's view is their sum.
    engine = make_engine(model, kv_pages=24, page_size=4)
    alice_prompt = list(range(3, 43))
    run_requests(engine, [Request("a1", alice_prompt, SamplingParams(max_tokens=2), namespace="alice")])
    run_requests(engine, [Request("a2", alice_prompt, SamplingParams(max_tokens=2), namespace="alice")])
    engine.pin(alice_prompt[:8], "alice")
    bob = [Request(f"b{i}", [(i * 37 + j) % 250 + 3 for j in range(60)], SamplingParams(max_tokens=3), namespace="bob")
           for i in range(3)]  # fmt: skip
    run_requests(engine, bob)
    everyone, alice, bob_view = engine.stats(), engine.stats("alice"), engine.stats("bob")
    nobody = engine.stats("carol")
    assert (alice.prompt_tokens, bob_view.prompt_tokens) == (80, 180) and alice.cached_tokens >= 36
    assert bob_view.cached_tokens == 0 and alice.generated_tokens == 4 and bob_view.generated_tokens == 9
    assert (alice.finished_requests, bob_view.finished_requests, nobody.finished_requests) == (2, 3, 0)
    assert alice.cache.queried_tokens == 80 and bob_view.cache.queried_tokens == 180
    assert alice.cache.hit_tokens == alice.cached_tokens and bob_view.cache.hit_tokens == 0
    assert alice.cache.pages_pinned == 2 and bob_view.cache.pages_pinned == 0
    held = engine.call(lambda: collections.Counter(ns for ns, _, _ in engine.cache.tree.items()))
    assert alice.cache.pages_cached == held.get("alice", 0) and bob_view.cache.pages_cached == held["bob"]
    assert alice.cache.evicted_pages > 0 and bob_view.cache.evicted_pages + alice.cache.evicted_pages == (
        everyone.cache.evicted_pages
    )
    for field in ("prompt_tokens", "cached_tokens", "generated_tokens", "finished_requests"):
        assert getattr(everyone, field) == getattr(alice, field) + getattr(bob_view, field), field
    for view in (alice, bob_view, nobody):  # the pool's capacity is everyone's
        assert (view.cache.pages_total, view.cache.pages_free) == (24, everyone.cache.pages_free)
    assert nobody.cache.pages_cached == nobody.cache.queried_tokens == nobody.cache.live_leases == 0
    assert_clean(engine)
