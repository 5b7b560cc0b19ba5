"""KV precision in the engine and on the wire: at every --kv-dtype the cache never changes an answer (greedy output
with the cache on equals the cache off: batched, at page sizes 1 / 7 / 16, through hits ending inside a page and
under preemption), quantized pages are named by their own page hashes, and ModelInfo / stats say what the pages are."""

from __future__ import annotations

import random

import pytest
import torch
from engine_fixtures import tiny_model
from test_engine import Collector
from worker_harness import ThreadedWorker

from radixcache.client import Client
from radixcache.events import page_hashes
from radixcache.keys import encode
from radixcache.kv_dtypes import KV_DTYPES, QUANTIZED_KV_DTYPES
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts over two shared prefixes whose lengths end mid-page for every page size tested."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 300) for _ in range(length)] for length in (23, 37)]
    return [prefixes[i % 2] + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 12))] for i in range(n)]


def run(model, kv_dtype: str, page_size: int, cache: bool, batch: list[list[int]], **config) -> tuple[list, Engine]:  # noqa: ANN001
    """Two waves of staggered arrivals (prefills, decodes and in-flight hits share steps; the second wave also hits
    the first's finished sequences, ending inside their pages); the tokens of each request."""
    config.setdefault("kv_pages", 256)
    engine = Engine(
        model,
        EngineConfig(page_size=page_size, kv_dtype=kv_dtype, cache_enabled=cache, max_step_tokens=64, **config),
    )
    sink = Collector()
    half = len(batch) // 2
    for wave in (range(half), range(half, len(batch))):
        for i in wave:
            engine.submit(Request(f"r{i}", batch[i], PARAMS), sink)
            if i % 2:
                engine.step()
        engine.run_until_idle()
    engine.cache.check(idle=True)
    return [sink.tokens(f"r{i}") for i in range(len(batch))], engine


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_greedy_output_is_the_same_with_the_cache_on_and_off(model, kv_dtype: str) -> None:  # noqa: ANN001
    batch = prompts(6)
    for page_size in (1, 7, 16):
        on, engine = run(model, kv_dtype, page_size, True, batch)
        off, _ = run(model, kv_dtype, page_size, False, batch)
        assert on == off, page_size
        stats = engine.stats()
        assert stats.kv_dtype == kv_dtype == engine.pool.kv_dtype
        assert stats.cached_tokens > 0  # the hits happened: whole pages, and at 7 and 16 tokens copied slots too
        assert stats.cache.copied_tokens > 0 or page_size == 1


@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES)
def test_greedy_output_is_the_same_under_preemption(model, kv_dtype: str) -> None:  # noqa: ANN001
    batch = prompts(8, seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    largest = max(-(-(len(p) + params.max_tokens) // 4) for p in batch)
    outputs = []
    for cache in (True, False):
        engine = Engine(
            model, EngineConfig(page_size=4, kv_pages=largest + 4, kv_dtype=kv_dtype, cache_enabled=cache)
        )  # every request fits alone, not all of them together: decodes grow into pages others hold
        sink = Collector()
        for i, prompt in enumerate(batch):
            engine.submit(Request(f"p{i}", prompt, params), sink)
        engine.run_until_idle()
        engine.cache.check(idle=True)
        assert engine.stats().preemptions > 0
        outputs.append([sink.tokens(f"p{i}") for i in range(len(batch))])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES)
def test_a_hit_ending_inside_a_quantized_page_copies_its_slots_and_scales(model, kv_dtype: str) -> None:  # noqa: ANN001
    rng = random.Random(3)
    first = [rng.randrange(1, 300) for _ in range(45)]
    second = first[:37] + [rng.randrange(1, 300) for _ in range(9)]
    engine = Engine(model, EngineConfig(page_size=16, kv_pages=64, kv_dtype=kv_dtype))
    sink = Collector()
    engine.submit(Request("first", first, PARAMS), sink)
    engine.run_until_idle()
    source = engine.pool.read_page(engine.cache.tree.match(encode(first[:37])).partial_page)
    engine.submit(Request("second", second, PARAMS), sink)
    engine.step()  # admits "second" and copies the first 5 slots of the partly matching page into its own page
    [lease] = [s.lease for s in engine.scheduler.running if s.request.request_id == "second"]
    copy = engine.pool.read_page(lease.pages[2])
    assert torch.equal(copy.kv[:, :, :5].view(torch.uint8), source.kv[:, :, :5].view(torch.uint8))
    if source.scales is not None and source.scales.dim() > 2:  # per-token scales (int8, int4) travel with the slots
        assert torch.equal(copy.scales[:, :, :5], source.scales[:, :, :5])  # type: ignore[index]
    engine.run_until_idle()
    assert sink.last("second").cached_tokens == 37  # 2 whole pages + 5 copied slots
    alone, _ = run(model, kv_dtype, 16, False, [second])
    assert sink.tokens("second") == alone[0]


def test_model_info_stats_and_cache_events_say_the_kv_dtype(model) -> None:  # noqa: ANN001
    """GetModelInfo / GetCacheStats report the precision and bytes per token; the event stream names the int8 pages
    by int8 page hashes (which a router computes with page_hashes(..., kv_dtype=...)), never the fp32 ones."""
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=64, kv_dtype="int8"))
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 2)
    with ThreadedWorker(engine) as worker, Client(worker.target) as client:
        info = client.model_info()
        assert (info["kv_dtype"], info["kv_bytes_per_token"]) == ("int8", per_token)
        assert info["kv_bytes"] == info["kv_pages"] * 4 * per_token
        ids = client.tokenize("the cache keeps keys and values of every token")
        list(client.generate(token_ids=ids, max_tokens=2, temperature=0.0))
        stats = client.stats()
        assert (stats["kv_dtype"], stats["kv_bytes_per_token"]) == ("int8", per_token)
        snapshot = next(iter(client.cache_events()))
        assert snapshot.kv_dtype == "int8" and snapshot.page_size == 4
        held = {h for e in snapshot.events for h in e.stored.page_hashes}
        expected = page_hashes(ids, 4, kv_dtype="int8")
        assert len(expected) >= 3 and set(expected) <= held
        assert not held & set(page_hashes(ids, 4))


def test_kv_demote_keeps_cold_prefixes_that_plain_lru_evicts(model) -> None:  # noqa: ANN001
    """The same memory, prefixes needing ~3x of it: with --kv-demote int4 the oldest prefix comes back from its
    demoted pages (promoted, every page accounted for); with plain LRU it was evicted and is recomputed."""
    from radixcache.worker.server import describe

    rng = random.Random(9)
    batch = [[rng.randrange(1, 300) for _ in range(40)] for _ in range(6)]
    hits = {}
    for demote in (None, "int4"):
        engine = Engine(model, EngineConfig(page_size=4, kv_pages=40, kv_dtype="fp32", kv_demote=demote))
        sink = Collector()
        for i, prompt in enumerate([*batch, batch[0]]):
            engine.submit(Request(f"r{i}", prompt, PARAMS), sink)
            engine.run_until_idle()
            engine.cache.check(idle=True)
        hits[demote] = sink.last(f"r{len(batch)}").cached_tokens
        assert len(sink.tokens(f"r{len(batch)}")) == PARAMS.max_tokens
        stats = engine.cache.stats()
        if demote:
            info = describe(engine)
            assert (info.kv_demote, info.kv_demoted_pages) == ("int4", engine.pool.demoted_pages)
            assert engine.pool.num_pages == 20 and engine.pool.demoted_pages > 100  # fp32 pages are 7.5x int4's
            assert stats.demoted_pages > 0 and stats.promoted_pages >= 9 and stats.evicted_pages == 0
    assert hits[None] == 0 and hits["int4"] == 39  # every prompt token but the one left to compute


def test_bad_kv_precision_settings_are_refused_naming_the_field() -> None:
    import subprocess
    import sys

    for config, error in (
        ({"kv_dtype": "int3"}, "kv_dtype must be one of auto, fp32, bf16, fp16, int8, fp8_e4m3, int4"),
        ({"kv_demote": "fp16"}, "kv_demote must be one of int4, int8"),
        ({"kv_demote": "int4", "cache_enabled": False}, "kv_demote needs the prefix cache"),
        ({"kv_demote": "int4", "kv_dtype": "int4"}, "demoting would save nothing"),
        ({"kv_demote": "int4", "kv_demote_share": 1.0}, "kv_demote_share must be in \\(0, 1\\)"),
    ):
        with pytest.raises(ValueError, match=error):
            EngineConfig(**config)
    proc = subprocess.run(
        [sys.executable, "-m", "radixcache", "serve", "--random-model", "--kv-dtype", "int9", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "--kv-dtype: invalid choice: 'int9'" in proc.stderr
