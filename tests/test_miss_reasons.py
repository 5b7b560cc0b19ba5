"""Why a prompt missed (radixcache.miss_reasons): each reason caused by what causes it, in the cache, through the
engine and each front (gRPC's last message, OpenAI's prompt_tokens_details, Anthropic's usage), counted in /metrics;
`radixcache explain` (the ExplainPrefix RPC) page by page, read-only, and only ever in the caller's own namespace."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import redirect_stdout

import grpc
import httpx
import pytest
from engine_fixtures import EOS, byte_tokenizer, tiny_model
from prometheus_client.parser import text_string_to_metric_families
from worker_harness import ThreadedWorker

from radixcache.cache import PrefixCache
from radixcache.cache_off import CacheOff
from radixcache.client import Client
from radixcache.client import cli as client_cli
from radixcache.host_tier import HostTier
from radixcache.miss_reasons import (
    CACHE_OFF,
    DIVERGED,
    EVICTED,
    EVICTED_TO_HOST,
    HIT_FULL,
    NO_ROOM,
    NO_SHARED_PREFIX,
    PATH_END,
    PROMPT_END,
    SHORTER_THAN_PAGE,
    WINDOW_PREFIX_RULE,
)
from radixcache.recent_evictions import RecentEvictions
from radixcache.tier import TierChain
from radixcache.tiering import TierLink
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.model.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)

PS = 4


def stored(cache: PrefixCache, tokens: list[int], namespace: str = "") -> None:
    """What a finished request leaves in the tree: its tokens' whole pages and its partial tail."""
    lease = cache.acquire("writer", tokens, namespace)
    cache.allocate(lease, -(-len(tokens) // cache.page_size) - len(lease.pages))
    cache.release(lease, tokens)


def lookup(cache: PrefixCache | CacheOff, prompt: list[int], namespace: str = "") -> tuple[int, str, str]:
    """(cached tokens, reason, match end) of an admission-like lookup (all but the last token), lease let go."""
    lease = cache.acquire("reader", prompt, namespace, max_cached=len(prompt) - 1)
    try:
        assert lease.miss is not None
        return lease.cached_tokens, lease.miss.reason, lease.miss.match_end
    finally:
        cache.release(lease)


# ---- the cache: every reason, from what causes it ---------------------------------------------------------------
def test_a_repeat_hits_full_and_a_first_sight_shares_nothing():
    cache = PrefixCache(32, PS)
    prompt = list(range(1, 14))
    assert lookup(cache, prompt) == (0, NO_SHARED_PREFIX, PATH_END)  # an empty namespace: nothing to diverge from
    stored(cache, prompt)
    assert lookup(cache, prompt) == (12, HIT_FULL, PROMPT_END)
    cache.check(idle=True)


def test_a_divergence_names_its_token_inside_a_page_and_at_a_page_boundary():
    cache = PrefixCache(32, PS)
    stored(cache, list(range(1, 17)))
    # diverges at token 10, inside the third page: the partial page's 2 tokens are copied
    assert lookup(cache, list(range(1, 11)) + [99] * 6) == (10, NO_SHARED_PREFIX, DIVERGED)
    # diverges at token 8, a page boundary: the tree goes on with other tokens there
    assert lookup(cache, list(range(1, 9)) + [99] * 8) == (8, NO_SHARED_PREFIX, DIVERGED)
    # shares nothing at all with what is cached
    assert lookup(cache, [99] * 16) == (0, NO_SHARED_PREFIX, DIVERGED)
    cache.check(idle=True)


def test_a_prompt_or_a_rest_under_one_page_is_shorter_than_page():
    cache = PrefixCache(32, PS)
    assert lookup(cache, [5, 6, 7]) == (0, SHORTER_THAN_PAGE, PATH_END)
    assert lookup(cache, [5]) == (0, SHORTER_THAN_PAGE, PROMPT_END)  # nothing to look up: the last is computed
    # a running request published its whole pages only: what is left after them is under a page
    lease = cache.acquire("running", list(range(1, 9)))
    cache.allocate(lease, 2)
    cache.publish(lease, list(range(1, 9)))
    assert lookup(cache, list(range(1, 12))) == (8, SHORTER_THAN_PAGE, PATH_END)
    cache.release(lease)
    cache.check(idle=True)


def test_an_evicted_next_page_is_named_evicted_and_a_flushed_one_is_not():
    cache = PrefixCache(32, PS)
    prompt = list(range(1, 18))
    stored(cache, prompt)
    cache.evict(2)  # the tail goes first, then the fourth page
    assert lookup(cache, prompt) == (12, EVICTED, PATH_END)
    cache.evict(100)
    assert lookup(cache, prompt) == (0, EVICTED, PATH_END)
    other = [50 + t for t in prompt]
    stored(cache, other)
    cache.flush()
    assert lookup(cache, other)[1] == NO_SHARED_PREFIX  # a flush forgets on purpose: nothing says "evicted"
    cache.check(idle=True)


def test_evicted_pages_handed_to_the_host_tier_are_named_evicted_to_host():
    class Pool:  # the tier reads the evicted pages' bytes from the pool
        num_pages = 16

        def read_page(self, page: int) -> bytes:
            return bytes(16)

        def write_page(self, page: int, data: bytes) -> None:
            pass

    link = TierLink(Pool(), PS, tiers=TierChain([HostTier(64 * 16)]))
    cache = PrefixCache(16, PS, tier=link)
    prompt = list(range(1, 14))
    stored(cache, prompt)
    cache.evict(100)
    assert link.counts.spilled_pages == 3  # the three whole pages went to the host tier (the tail does not)
    assert lookup(cache, prompt) == (0, EVICTED_TO_HOST, PATH_END)


def test_a_hit_cut_by_a_sliding_windows_prefix_rule_says_so():
    # a window of 4 tokens, 8 window slots
    cache = PrefixCache(64, PS, window=4, window_slots=8)
    prompt = list(range(1, 25))
    lease = cache.acquire("a", prompt)
    for upto in range(1, 25):
        need = -(-upto // PS) - len(lease.pages)
        if need > 0:
            cache.allocate(lease, need)
        cache.publish(lease, prompt[:upto])
        cache.slide(lease, upto)
    cache.release(lease, prompt)
    # a request that needs every window slot: the tree's idle window parts are given back to it
    other = cache.acquire("b", [200] * 32)
    cache.allocate(other, 8)
    cache.release(other)
    # a prompt that continues the first 13 tokens and then diverges would read the window of tokens 10..12,
    # whose pages have no window part left
    served, reason, end = lookup(cache, prompt[:13] + [99] * 4)
    assert (reason, end) == (WINDOW_PREFIX_RULE, DIVERGED) and served < 13
    cache.check(idle=True)


def test_a_partial_page_without_room_for_its_copy_is_no_room():
    cache = PrefixCache(3, PS)
    prompt = list(range(1, 11))  # two whole pages and a tail of two
    stored(cache, prompt)
    # every page is on the path the lookup locks: no page is free or evictable for the partial page's copy
    assert lookup(cache, prompt + [77]) == (8, NO_ROOM, PROMPT_END)
    cache.check(idle=True)


def test_the_cache_off_says_cache_off():
    cache = CacheOff(8, PS, window=0, window_slots=0)
    assert lookup(cache, list(range(1, 14)))[1:] == (CACHE_OFF, "")
    assert cache.explain(list(range(1, 14))).reason == CACHE_OFF


def test_another_namespace_holding_the_prompt_is_never_a_reason():
    cache = PrefixCache(32, PS)
    prompt = list(range(1, 14))
    stored(cache, prompt, "alice")
    assert lookup(cache, prompt, "bob") == lookup(cache, [200 + t for t in prompt], "bob")  # the same answer as
    # for a prompt nobody ever sent: bob learns nothing about alice


def test_the_memory_of_evictions_is_bounded():
    seen = RecentEvictions(capacity=3)
    for i in range(10):
        seen.add(i, b"page")
    assert len(seen) == 3 and (9, b"page") in seen and (6, b"page") not in seen


# ---- explain: page by page, read-only ---------------------------------------------------------------------------
def test_explain_walks_a_crafted_tree_page_by_page():
    cache = PrefixCache(32, PS)
    stored(cache, list(range(1, 17)))
    e = cache.explain(list(range(1, 11)) + [99] * 6)
    assert (e.prompt_tokens, e.cacheable, e.cached_tokens, e.reason, e.match_end) == (
        16, 15, 10, NO_SHARED_PREFIX, DIVERGED,
    )  # fmt: skip
    assert [(p.index, p.tokens, p.served, p.state) for p in e.pages] == [
        (0, 4, 4, "hit"), (1, 4, 4, "hit"), (2, 4, 2, "partial"),
    ]  # fmt: skip
    full = cache.explain(list(range(1, 17)))
    assert [p.state for p in full.pages] == ["hit"] * 4 and full.pages[-1].tokens == 3 and full.reason == HIT_FULL


def test_explain_changes_nothing_not_even_the_lru_order():
    cache = PrefixCache(32, PS)
    old, new = list(range(1, 9)), list(range(101, 109))
    stored(cache, old)
    stored(cache, new)  # `old` is now the least recently used leaf
    before = cache.stats()
    for _ in range(3):
        cache.explain(old + [1])
    assert cache.stats() == before and cache.leases() == []
    cache.evict(1)  # evicts the least recently used: still `old`, which explain never touched
    assert lookup(cache, new + [1])[0] == 8 and lookup(cache, old + [1])[0] < 8
    cache.check(idle=True)


# ---- through the engine and the fronts ----------------------------------------------------------------------------
TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
ALICE = {"Authorization": "Bearer tok-alice"}


CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def worker() -> Iterator[ThreadedWorker]:
    loaded = tiny_model()
    loaded.tokenizer = Tokenizer(byte_tokenizer()._tok, eos_token=EOS, chat_template=CHAT_TEMPLATE)  # for Messages
    engine = Engine(loaded, EngineConfig(page_size=PS, kv_pages=64, max_step_tokens=64))
    with ThreadedWorker(engine, http_port=0, metrics_port=0, auth_tokens=TOKENS) as w:
        yield w


@pytest.fixture
def alice(worker: ThreadedWorker) -> Iterator[Client]:
    with Client(worker.target, token="tok-alice") as c:
        yield c


_fresh = iter(range(10**6))


def fresh(n: int) -> list[int]:
    salt = next(_fresh)
    return [3 + (i * 7 + salt * 31) % 250 for i in range(n)]


def reasons_counted(worker: ThreadedWorker) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{worker.server.metrics_port}/metrics", timeout=10).text
    return {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "radixcache_cache_lookups_total"
    }


def test_grpc_reports_each_reason_on_the_last_message_and_metrics_count_it(worker, alice):
    prompt = fresh(14)
    before = reasons_counted(worker)
    first = alice.generate_text(token_ids=prompt, max_tokens=1)
    again = alice.generate_text(token_ids=prompt, max_tokens=1)
    short = alice.generate_text(token_ids=fresh(3), max_tokens=1)
    assert (first.cache_miss_reason, first.cache_match_end, first.cached_tokens) == (NO_SHARED_PREFIX, PATH_END, 0)
    assert (again.cache_miss_reason, again.cache_match_end, again.cached_tokens) == (HIT_FULL, PROMPT_END, 13)
    assert short.cache_miss_reason == SHORTER_THAN_PAGE
    worker.engine.call(lambda: worker.engine.cache.evict(10**6))
    evicted = alice.generate_text(token_ids=prompt, max_tokens=1)
    assert (evicted.cache_miss_reason, evicted.cached_tokens) == (EVICTED, 0)
    after = reasons_counted(worker)
    moved = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    assert moved == {NO_SHARED_PREFIX: 1, HIT_FULL: 1, SHORTER_THAN_PAGE: 1, EVICTED: 1} | {
        r: 0 for r in moved if r not in (NO_SHARED_PREFIX, HIT_FULL, SHORTER_THAN_PAGE, EVICTED)
    }


def http(worker: ThreadedWorker, path: str, body: dict, headers: dict) -> dict:
    r = httpx.post(f"http://127.0.0.1:{worker.server.http_port}{path}", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_and_anthropic_usage_say_why(worker):
    body = {"model": "fake", "prompt": "pages of sixteen tokens are shared", "max_tokens": 1, "temperature": 0}
    first = http(worker, "/v1/completions", body, ALICE)["usage"]["prompt_tokens_details"]
    again = http(worker, "/v1/completions", body, ALICE)["usage"]["prompt_tokens_details"]
    assert first["cache_miss_reason"] == NO_SHARED_PREFIX and first["cached_tokens"] == 0
    assert (again["cache_miss_reason"], again["cache_match_end"]) == (HIT_FULL, PROMPT_END)
    assert again["cached_tokens"] > 0
    messages = {
        "model": "fake",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "a radix tree maps token prefixes to pages and evicts"}],
    }
    headers = {"x-api-key": "tok-alice", "anthropic-version": "2023-06-01"}
    first = http(worker, "/v1/messages", messages, headers)["usage"]
    again = http(worker, "/v1/messages", messages, headers)["usage"]
    assert first["cache_miss_reason"] == NO_SHARED_PREFIX
    assert (again["cache_miss_reason"], again["cache_match_end"]) == (HIT_FULL, PROMPT_END)
    assert again["cache_read_input_tokens"] > 0


def test_cache_off_reaches_the_response():
    engine = Engine(tiny_model(), EngineConfig(page_size=PS, kv_pages=64, max_step_tokens=64, cache_enabled=False))
    with ThreadedWorker(engine) as w, Client(w.target) as c:
        prompt = fresh(9)
        c.generate_text(token_ids=prompt, max_tokens=1)
        assert c.generate_text(token_ids=prompt, max_tokens=1).cache_miss_reason == CACHE_OFF


def test_explain_over_the_wire_is_the_callers_namespace_only(worker, alice):
    prompt = fresh(14)
    alice.generate_text(token_ids=prompt, max_tokens=1)
    mine = alice.explain(token_ids=prompt)
    assert (mine.cached_tokens, mine.cache_miss_reason) == (13, HIT_FULL)
    assert [p.state for p in mine.pages] == ["hit"] * 4
    with Client(worker.target, token="tok-bob") as bob:
        theirs = bob.explain(token_ids=prompt)
    assert (theirs.cached_tokens, theirs.cache_miss_reason) == (0, NO_SHARED_PREFIX)
    assert [p.state for p in theirs.pages] == ["miss"]
    with Client(worker.target, token="nope") as stranger, pytest.raises(grpc.RpcError) as e:
        stranger.explain(token_ids=prompt)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_explain_over_the_wire_leaves_the_cache_as_it_was(worker, alice):
    prompt = fresh(14)
    alice.generate_text(token_ids=prompt, max_tokens=1)
    engine = worker.engine
    before = engine.stats("alice")

    def lru_order() -> list:  # the evictable leaves by (last access, id): what the next eviction picks
        return engine.call(lambda: list(engine.cache.tree._lru.ordered) + list(engine.cache.tree._lru.recent))

    lru = lru_order()
    for _ in range(3):
        alice.explain(token_ids=prompt)
    assert engine.stats("alice") == before
    assert lru_order() == lru


def test_the_explain_command_prints_the_pages_and_the_reason(worker, alice):
    prompt = fresh(14)
    alice.generate_text(token_ids=prompt, max_tokens=1)
    tokens = ",".join(map(str, prompt[:10] + [1, 1, 1, 1]))
    out = io.StringIO()
    with redirect_stdout(out):
        code = client_cli.main(["explain", "--target", worker.target, "--token", "tok-alice", "--tokens", tokens])
    lines = out.getvalue().splitlines()
    assert code == 0
    assert [line.split()[4] for line in lines[1:4]] == ["hit", "hit", "partial"]
    assert lines[-1] == "cached_tokens=10: stopped at token 10, no_shared_prefix, match diverged"
    assert client_cli.main(["explain", "--target", worker.target, "--tokens", "1,x"]) == 2  # names --tokens
