"""Soft retention (radixcache.retention): under `--eviction-policy priority` a retained prefix outlives a flood of
one-off prompts that evicts it under `lru`; after its retention runs out it is evicted like any other; it never
refuses a request for capacity; the cache's integrity check holds throughout; the fronts' bad fields are 400s."""

from __future__ import annotations

import pytest

from radixcache.cache import PrefixCache
from radixcache.retention import Retention

PAGE = 4
SYSTEM = list(range(1000, 1000 + 6 * PAGE))  # a long system prompt: 6 pages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(cache: PrefixCache, tokens: list[int], retention: Retention | None = None) -> int:
    """One request: look up, compute the rest on fresh pages, publish, release; returns the tokens it hit."""
    lease = cache.acquire("req", tokens)
    lease.retention = retention
    hit = lease.cached_tokens
    if lease.copy_from is not None:
        cache.copied(lease)
    cache.allocate(lease, -(-len(tokens) // PAGE) - len(lease.pages))
    cache.publish(lease, tokens)
    cache.release(lease, tokens)
    cache.check()
    return hit


def one_off(i: int) -> list[int]:
    return [50_000 + i * 100 + j for j in range(3 * PAGE)]


def trace(policy: str, clock: Clock, *, flood: int = 12, seconds: float = 60.0) -> tuple[int, PrefixCache]:
    """The system prompt once (retained), then `flood` one-off prompts on a 16-page pool, then the system prompt
    again: returns its tokens hit at the end."""
    cache = PrefixCache(16, PAGE, clock=clock, eviction_policy=policy)
    run(cache, SYSTEM, Retention(priority=10, seconds=seconds))
    for i in range(flood):
        clock.now += 1.0
        run(cache, one_off(i))
    return run(cache, SYSTEM), cache


def test_priority_keeps_a_retained_prefix_that_lru_evicts():
    lru_hit, lru = trace("lru", Clock())
    priority_hit, cache = trace("priority", Clock())
    assert lru_hit == 0  # the flood pushed it out
    assert priority_hit == len(SYSTEM)
    # the same pressure, another victim: lru also had to evict room to compute the system prompt again
    assert cache.stats().evicted_pages == lru.stats().evicted_pages - len(SYSTEM) // PAGE
    cache.check(idle=True)


def test_expired_retention_is_evicted_like_any_other():
    # 12 one-off prompts take 12 s on the clock: a 5 s retention has run out long before the prompt comes back.
    hit, cache = trace("priority", Clock(), seconds=5.0)
    assert hit == 0
    cache.check(idle=True)


def test_expiry_orders_by_last_use_again():
    clock = Clock()
    cache = PrefixCache(8, PAGE, clock=clock, eviction_policy="priority")
    kept, plain = list(range(PAGE * 2)), list(range(500, 500 + PAGE * 2))
    run(cache, kept, Retention(priority=5, seconds=10.0))
    clock.now = 1.0
    run(cache, plain)  # used after `kept`
    cache.evict(2)
    assert cache.match_length(kept) == len(kept) and cache.match_length(plain) == 0
    run(cache, plain)
    clock.now = 20.0  # `kept` expired: now the least recently used, it goes first
    cache.evict(2)
    assert cache.match_length(kept) == 0 and cache.match_length(plain) == len(plain)
    cache.check(idle=True)


def test_lower_priority_goes_first():
    clock = Clock()
    cache = PrefixCache(8, PAGE, clock=clock, eviction_policy="priority")
    high, low = list(range(PAGE * 2)), list(range(500, 500 + PAGE * 2))
    run(cache, high, Retention(priority=9, seconds=100.0))
    run(cache, low, Retention(priority=2, seconds=100.0))  # more recently used, but lower
    cache.evict(2)
    assert cache.match_length(high) == len(high) and cache.match_length(low) == 0
    cache.check(idle=True)


def test_a_split_keeps_the_retention_on_both_parts():
    clock = Clock()
    cache = PrefixCache(8, PAGE, clock=clock, eviction_policy="priority")
    kept = list(range(4 * PAGE))
    run(cache, kept, Retention(priority=5, seconds=100.0))
    run(cache, kept[: 2 * PAGE] + list(range(700, 700 + 2 * PAGE)))  # unretained: splits `kept` after 2 pages
    assert cache.evict(4) == 4  # its own 2 pages, then the lower half of `kept` (nothing else is left)
    assert cache.match_length(kept) == 2 * PAGE
    plain = list(range(900, 900 + 2 * PAGE))  # used after the upper half, but not retained: it goes first
    run(cache, plain)
    cache.evict(2)
    assert cache.match_length(kept) == 2 * PAGE and cache.match_length(plain) == 0
    cache.check(idle=True)


def test_retained_pages_stay_within_the_pin_budget():
    clock = Clock()
    cache = PrefixCache(12, PAGE, clock=clock, eviction_policy="priority", max_pinned_pages=6)
    first, second = list(range(4 * PAGE)), list(range(300, 300 + 4 * PAGE))
    run(cache, first, Retention(priority=5, seconds=10.0))
    run(cache, second, Retention(priority=5, seconds=10.0))  # 2 of its 4 pages fit the budget: the prefix
    assert cache.tree.retained_pages == 6
    run(cache, list(range(600, 600 + 6 * PAGE)))  # evicts 2: the unretained end of `second`
    assert cache.match_length(first) == len(first) and cache.match_length(second) == 2 * PAGE
    clock.now = 11.0  # the stamps ran out: they count no more, and a new request may be retained
    run(cache, second, Retention(priority=5, seconds=10.0))
    assert cache.tree.retained_pages == 4
    cache.check(idle=True)


def test_retention_never_refuses_for_capacity():
    clock = Clock()
    cache = PrefixCache(8, PAGE, clock=clock, eviction_policy="priority")
    for i in range(2):  # the whole pool retained, for a long time
        run(cache, [i * 1000 + j for j in range(4 * PAGE)], Retention(priority=100, seconds=3600.0))
    assert cache.available_pages() == 8
    big = list(range(90_000, 90_000 + 8 * PAGE))  # needs every page: the retained ones are evicted for it
    assert run(cache, big) == 0
    assert cache.match_length(big) == len(big)
    cache.check(idle=True)


def test_lru_policy_ignores_retention():
    clock = Clock()
    cache = PrefixCache(8, PAGE, clock=clock)
    kept, plain = list(range(PAGE * 2)), list(range(500, 500 + PAGE * 2))
    run(cache, kept, Retention(priority=100, seconds=100.0))
    run(cache, plain)
    cache.evict(2)
    assert cache.match_length(kept) == 0 and cache.match_length(plain) == len(plain)


@pytest.mark.parametrize(
    ("priority", "seconds"), [(0, 1.0), (101, 1.0), (True, 1.0), (1, 0.0), (1, -1.0), (1, 86_401.0)]
)
def test_retention_bounds(priority, seconds):
    with pytest.raises(ValueError, match="retention"):
        Retention(priority=priority, seconds=seconds)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction policy"):
        PrefixCache(8, PAGE, eviction_policy="lfu")


# ---- the fronts: every API carries the two fields to the engine's Request, and refuses bad ones by name ----------
@pytest.fixture(scope="module")
def worker():
    from fake_engine import FakeEngine
    from worker_harness import ThreadedWorker

    with ThreadedWorker(FakeEngine(step_s=0.001, num_pages=64, page_size=4), http_port=0) as w:
        w.root = f"http://127.0.0.1:{w.server.http_port}"
        yield w


USER = {"role": "user", "content": "hi"}
HTTP = [  # (path, the body without the retention fields)
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": [USER], "max_tokens": 2}),
]
BAD = [  # (retention fields, the field named)
    ({"priority": 101, "retention_seconds": 5}, "priority"),
    ({"priority": -1, "retention_seconds": 5}, "priority"),
    ({"priority": 3, "retention_seconds": 0}, "retention_seconds"),
    ({"priority": 3, "retention_seconds": 1e9}, "retention_seconds"),
    ({"priority": 3}, "retention_seconds"),
    ({"retention_seconds": 5}, "priority"),
]


def post(worker, path: str, body: dict):
    import httpx

    return httpx.post(worker.root + path, json={"model": "fake"} | body, timeout=30)


@pytest.mark.parametrize(("path", "body"), HTTP, ids=[p for p, _ in HTTP])
def test_http_fronts_carry_retention_to_the_request(worker, path, body):
    r = post(worker, path, body | {"priority": 7, "retention_seconds": 30})
    assert r.status_code == 200, r.text
    assert worker.engine.submitted[-1].retention == Retention(7, 30.0)
    assert post(worker, path, body).status_code == 200
    assert worker.engine.submitted[-1].retention is None
    post(worker, path, body | {"priority": 0, "retention_seconds": 30})  # priority 0: nothing to keep
    assert worker.engine.submitted[-1].retention is None


@pytest.mark.parametrize(("path", "body"), HTTP, ids=[p for p, _ in HTTP])
@pytest.mark.parametrize(("fields", "name"), BAD, ids=[f"{n}:{sorted(f.items())}" for f, n in BAD])
def test_http_fronts_refuse_bad_retention_naming_the_field(worker, path, body, fields, name):
    before = len(worker.engine.submitted)
    r = post(worker, path, body | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if path == "/v1/messages":  # Anthropic's error names the field in its message
        assert error["message"].startswith(name), error
    else:
        assert error["param"] == name, error
    assert len(worker.engine.submitted) == before  # refused before anything reached the engine


def test_grpc_carries_and_refuses_retention(worker):
    import grpc

    from radixcache.v1 import radixcache_pb2 as pb
    from radixcache.v1 import radixcache_pb2_grpc as pb_grpc

    with grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.RadixCacheStub(channel)
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2, priority=9, retention_seconds=60), timeout=30))
        assert worker.engine.submitted[-1].retention == Retention(9, 60.0)
        for fields, name in BAD:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2, **fields), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert dict(e.value.trailing_metadata() or ()).get("radixcache-field") == name


# ---- the real engine: Request.retention reaches the cache's publish through the scheduler's lease ----------------
def engine_trace(policy: str) -> tuple[int, list[int], object]:
    """The system prompt (retained), a flood of one-off prompts on a 24-page pool, the system prompt again: its
    cached tokens and its greedy tokens."""
    from engine_fixtures import tiny_model

    from radixcache.worker.engine.engine import Engine, EngineConfig
    from radixcache.worker.engine.request import Request, SamplingParams

    engine = Engine(tiny_model(), EngineConfig(page_size=PAGE, kv_pages=24, eviction_policy=policy))
    outputs: dict[str, list] = {}

    def request(rid: str, prompt: list[int], retention: Retention | None = None) -> None:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        engine.submit(
            Request(rid, prompt, params, retention=retention), lambda o: outputs.setdefault(rid, []).append(o)
        )
        engine.run_until_idle()

    system = [3 + (i * 7) % 250 for i in range(8 * PAGE)]
    request("system", system, Retention(priority=50, seconds=600.0))
    for i in range(10):
        request(f"one-off-{i}", [3 + (i * 31 + j * 13) % 250 for j in range(4 * PAGE)])
    request("again", system)
    engine.cache.check(idle=True)
    return outputs["again"][-1].cached_tokens, [t for o in outputs["again"] for t in o.token_ids], engine


def test_the_engine_keeps_a_retained_prompt_under_priority_only():
    lru_hit, lru_tokens, _ = engine_trace("lru")
    priority_hit, priority_tokens, _ = engine_trace("priority")
    assert lru_hit == 0
    assert priority_hit == 8 * PAGE - 1  # all but the last token, which a prompt always computes
    assert priority_tokens == lru_tokens  # the cache never changes an answer
