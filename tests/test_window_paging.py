"""Window paging end to end in the engine: a sliding-window model's sliding layers keep only their window.

What a user relies on: the answers are exactly those of the same model with every layer's values kept in the page
(window paging off), cold or hit, batched, preempted, at page sizes 1/7/16, with prefixes several windows long; a
long sequence holds its last window of sliding values only; the same memory holds more pages; nothing leaks.
"""

from __future__ import annotations

import random

import pytest
from engine_fixtures import SLIDING, tiny_model
from test_engine import Collector, assert_clean

from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams
from radixcache.worker.engine.step import build_pool, window_slots_needed

WINDOW = SLIDING["sliding_window"]  # 8
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma():
    return tiny_model(**SLIDING)


@pytest.fixture(scope="module")
def mistral():
    """Every layer slides (Mistral): a page is then only its window part."""
    return tiny_model(seed=1, layer_kinds=("sliding", "sliding"), sliding_window=WINDOW)


def long_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts sharing prefixes of 3-9 windows, with suffixes of 1-20 tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 300) for _ in range(rng.randrange(3 * WINDOW, 9 * WINDOW))] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 20))] for i in range(n)]


def serve(model, prompts: list[list[int]], params=GREEDY, **config) -> tuple[Collector, Engine]:
    engine = Engine(model, EngineConfig(**config))
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(Request(f"r{i}", prompt, params), sink)
        if i % 2:
            engine.step()  # arrivals at different steps: hits on what the others computed, in-flight sharing
    engine.run_until_idle()
    return sink, engine


def answers(sink: Collector, n: int) -> list[list[int]]:
    return [sink.tokens(f"r{i}") for i in range(n)]


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_greedy_answers_are_those_of_the_model_with_every_layer_in_the_page(gemma, page_size):
    prompts = long_prompts(8, seed=page_size)
    pages = sum(-(-(len(p) + GREEDY.max_tokens) // page_size) for p in prompts) // 5  # pressure: preemptions
    common = dict(page_size=page_size, kv_pages=pages, max_step_tokens=48, max_running=3)
    want, plain = serve(gemma, prompts, kv_window_paging="off", **common)
    got, engine = serve(gemma, prompts, **common)
    assert engine.pool.window is not None and plain.pool.window is None
    assert answers(got, 8) == answers(want, 8)
    assert max(got.last(f"r{i}").cached_tokens for i in range(8)) > WINDOW  # hits longer than the window
    assert engine.stats().preemptions > 0
    assert_clean(engine)


def test_when_window_slots_run_short_the_tree_gives_idle_windows_back_and_answers_stay(gemma):
    prompts = long_prompts(10, seed=11)
    common = dict(page_size=4, kv_pages=400, max_step_tokens=32, max_running=2)
    want, _ = serve(gemma, prompts, kv_window_paging="off", **common)
    got, engine = serve(gemma, prompts, **common)
    assert answers(got, 10) == answers(want, 10)
    stats = engine.cache.stats()
    assert stats.window_slots_total < engine.pool.num_pages and stats.window_parts_dropped > 0
    assert max(got.last(f"r{i}").cached_tokens for i in range(10)) > WINDOW
    assert_clean(engine)


def test_a_model_whose_every_layer_slides_answers_the_same(mistral):
    prompts = long_prompts(6, seed=3)
    want, _ = serve(mistral, prompts, page_size=4, kv_pages=96, kv_window_paging="off", max_running=2)
    got, engine = serve(mistral, prompts, page_size=4, kv_pages=96, max_running=2)
    assert engine.pool.main.nbytes == 0  # the pages are ids; their values all live in window slots
    assert answers(got, 6) == answers(want, 6)
    assert max(got.last(f"r{i}").cached_tokens for i in range(6)) > WINDOW
    assert_clean(engine)


def test_a_long_answer_holds_the_sliding_values_of_its_last_window_only(gemma):
    engine = Engine(gemma, EngineConfig(page_size=4, kv_pages=256, max_running=2, cache_enabled=False))
    sink = Collector()
    prompt = long_prompts(1, seed=5)[0]
    engine.submit(Request("long", prompt, SamplingParams(max_tokens=300, ignore_eos=True)), sink)
    most = 0
    while engine.step():
        s = engine.cache.stats()
        most = max(most, s.window_slots_total - s.window_slots_free)
    # the pages of one window (8 tokens: 2-3 pages of 4) and the page the next token goes to, never the ~100 pages
    # the sequence holds for its global layer
    assert most <= -(-(WINDOW - 1) // 4) + 2
    assert len(sink.tokens("long")) == 300
    alone, _ = serve(gemma, [prompt], SamplingParams(max_tokens=300, ignore_eos=True), page_size=4, kv_pages=256,
                     kv_window_paging="off")  # fmt: skip
    assert sink.tokens("long") == alone.tokens("r0")
    assert_clean(engine)


def test_the_same_memory_holds_more_pages_when_sliding_layers_are_paged_apart(gemma):
    budget = 4 << 20
    paged = build_pool(gemma, EngineConfig(page_size=4, kv_memory_bytes=budget, max_running=4))
    plain = build_pool(gemma, EngineConfig(page_size=4, kv_memory_bytes=budget, kv_window_paging="off"))
    assert paged.nbytes <= budget and plain.nbytes <= budget
    # one global layer of two: pages cost half, once the window slots every running request needs are paid for
    slots = window_slots_needed(EngineConfig(page_size=4, max_running=4), WINDOW)
    assert paged.window_slots == slots
    assert paged.num_pages > 1.8 * plain.num_pages
    assert paged.bytes_by_kind()["sliding"] == slots * plain.bytes_per_page(plain.shape, 4, plain.kv_dtype) // 2


def test_window_paging_on_refuses_what_moves_whole_pages():
    with pytest.raises(ValueError, match="kv_window_paging on"):
        EngineConfig(kv_window_paging="on", kv_demote="int4")
    with pytest.raises(ValueError, match="kv_window_paging on"):
        EngineConfig(kv_window_paging="on", kv_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="kv_window_paging must be one of"):
        EngineConfig(kv_window_paging="yes")


def test_samples_of_one_request_fork_the_prompts_window_and_answer_as_without_paging(gemma):
    """n = 3 seeded samples: samples 1 and 2 start from sample 0's prompt pages (the tree's, and copies of the
    partial last page with its window part); each sample's tokens are those of window paging off."""
    prompts = long_prompts(3, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, n=3, ignore_eos=True)
    want, _ = serve(gemma, prompts, params, page_size=4, kv_pages=200, kv_window_paging="off", max_running=6)
    got, engine = serve(gemma, prompts, params, page_size=4, kv_pages=200, max_running=6)
    assert engine.pool.window is not None
    assert got.outputs.keys() == want.outputs.keys()
    for rid, outs in got.outputs.items():
        for index in range(3):
            mine = [t for o in outs if o.index == index for t in o.token_ids]
            theirs = [t for o in want.outputs[rid] if o.index == index for t in o.token_ids]
            assert mine == theirs and len(mine) == 24, f"{rid} sample {index}"
    assert_clean(engine)
