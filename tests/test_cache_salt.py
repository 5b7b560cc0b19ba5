"""Cache salts (issue 39, radixcache.salt): a salted prompt shares no page with a differently salted or unsalted one
of the same tenant past its shared span, which every salt and none share, rounded down to a page. Proved by what the
cache serves (lookup hits), by the events' page hashes, by the router's keys, and by greedy answers (cache on ==
off), through the engine and the fronts."""

from __future__ import annotations

import pytest
from engine_fixtures import byte_tokenizer, tiny_model
from fake_engine import FakeEngine
from helpers import tree_index
from worker_harness import ThreadedWorker

from radixcache.cache import CacheFullError, PrefixCache
from radixcache.cluster.decide import Decider
from radixcache.cluster.events_feed import hub_events
from radixcache.cluster.hub import Poll
from radixcache.cluster.policy import Policy
from radixcache.cluster.view import FleetView
from radixcache.event_log import EventLog
from radixcache.events import PageIndex, PagesStored, page_hashes
from radixcache.salt import CacheSalt, salted_page_hashes
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams
from radixcache.worker.front.validation import CheckedPrompt, PromptInput, system_span

PS = 4
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENS = list(range(1, 30))  # 29 tokens: 7 whole pages; a lookup reads all but the last token (28 at most)


def serve(cache: PrefixCache, owner: str, salt: CacheSalt | None = None, tokens: list[int] = TOKENS) -> int:
    """One request as the scheduler runs it (lookup of all but the last token, compute, release with its tokens):
    the tokens the cache served it. The cache's invariants hold after each."""
    assert cache.match_length(tokens[:-1], "t", salt=salt) == (
        hit := (lease := cache.acquire(owner, tokens, "t", max_cached=len(tokens) - 1, salt=salt)).cached_tokens
    )
    if lease.copy_from is not None:
        cache.copied(lease)
    cache.allocate(lease, -(-len(tokens) // PS) - len(lease.pages))
    cache.release(lease, tokens)
    cache.check(idle=True)
    return hit


def test_different_salts_never_share_a_page_and_the_same_salt_shares() -> None:
    cache = PrefixCache(64, PS)
    assert serve(cache, "plain") == 0
    assert serve(cache, "a1", CacheSalt("a")) == 0  # the unsalted prompt's pages are not a salted one's
    assert serve(cache, "b1", CacheSalt("b")) == 0
    assert serve(cache, "a2", CacheSalt("a")) == 28  # the same salt shares all of it
    assert serve(cache, "plain2") == 28  # the unsalted one still has its own
    fresh = PrefixCache(64, PS)
    assert serve(fresh, "a1", CacheSalt("a")) == 0
    assert serve(fresh, "plain") == 0  # a salted prompt's pages are not the unsalted one's either
    assert serve(fresh, "other-tenant-salt", CacheSalt("a\x00")) == 0
    assert fresh.stats("t").hit_tokens == 0 and fresh.stats("t").queried_tokens == 3 * len(TOKENS)


@pytest.mark.parametrize(("shared", "span"), [(10, 8), (8, 8), (3, 0), (100, 28)])
def test_a_salt_region_shares_exactly_its_page_aligned_span(shared: int, span: int) -> None:
    cache = PrefixCache(64, PS)
    assert serve(cache, "plain") == 0
    assert serve(cache, "a1", CacheSalt("a", shared)) == span  # the unsalted pages serve the shared span only
    assert serve(cache, "b1", CacheSalt("b", shared)) == span
    assert serve(cache, "a2", CacheSalt("a", shared)) == 28
    fresh = PrefixCache(64, PS)
    assert serve(fresh, "a1", CacheSalt("a", shared)) == 0
    assert serve(fresh, "b1", CacheSalt("b", shared)) == span  # what the first salt computed of the span is shared
    assert serve(fresh, "plain") == span
    other = TOKENS[:span] + [t + 100 for t in TOKENS[span:]]
    if span < 28:  # another continuation of the same span with the same salt shares the span, not the rest
        assert serve(fresh, "a-other", CacheSalt("a", shared), other) == span


def test_a_salted_continuation_hangs_on_its_exact_span() -> None:
    cache = PrefixCache(64, PS)
    assert serve(cache, "a1", CacheSalt("a", 8)) == 0
    moved = [99] + TOKENS[1:]  # another shared span, the same salt and the same tokens after it
    assert serve(cache, "a2", CacheSalt("a", 8), moved) == 0


def test_flushing_a_tenant_flushes_its_salted_pages() -> None:
    cache = PrefixCache(64, PS)
    serve(cache, "a1", CacheSalt("a", 8))
    assert cache.flush("t") == 8  # 2 shared pages, 5 salted pages and the salted tail
    assert serve(cache, "a2", CacheSalt("a", 8)) == 0


def stored_pages(events: list) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in events:
        if isinstance(e, PagesStored):
            out.setdefault(e.namespace, []).extend(e.page_hashes)
    return out


def test_events_hash_salted_pages_apart_and_the_shared_span_as_unsalted() -> None:
    cache = PrefixCache(64, PS)
    log = EventLog(PS, strict=True)
    cache.set_event_sink(log)
    serve(cache, "a1", CacheSalt("a", 10))
    serve(cache, "b1", CacheSalt("b", 10))
    serve(cache, "plain")
    events = log.drain()
    stored = stored_pages(events)
    plain = page_hashes(TOKENS, PS, "t")
    salted_a = salted_page_hashes(TOKENS, PS, "t", CacheSalt("a", 10))
    salted_b = salted_page_hashes(TOKENS, PS, "t", CacheSalt("b", 10))
    assert salted_a[:2] == salted_b[:2] == plain[:2]  # the shared span: the unsalted hashes
    assert not set(salted_a[2:]) & set(salted_b[2:]) and not set(salted_a[2:]) & set(plain)
    assert stored["t"] == plain[:2] + plain[2:]  # the span once, then the unsalted prompt's own pages
    salted = [ns for ns in stored if ns != "t"]
    assert len(salted) == 2 and all(ns.startswith("t#salt:") for ns in salted)
    assert sorted(stored[ns] for ns in salted) == sorted([salted_a[2:], salted_b[2:]])  # the router's keys
    index = PageIndex()
    for e in events:
        index.apply(e)
    assert index.as_dict() == tree_index(cache.tree)  # the replay is exact


def test_the_router_routes_a_salted_prompt_by_its_salted_keys() -> None:
    cache = PrefixCache(64, PS)
    log = EventLog(PS, strict=True)
    cache.set_event_sink(log)
    serve(cache, "a1", CacheSalt("a", 8))
    view = FleetView()
    view.apply(Poll("epoch", 1, False, [("x", hub_events(log.drain()))], {}))
    decider = Decider(view, Policy(), PS)
    same = Request("r1", TOKENS, namespace="t", cache_salt=CacheSalt("a", 8))
    other = Request("r2", TOKENS, namespace="t", cache_salt=CacheSalt("b", 8))
    plain = Request("r3", TOKENS, namespace="t")
    assert decider.hashes(same) == salted_page_hashes(TOKENS, PS, "t", CacheSalt("a", 8))
    matched = {r.request_id: view.index.match("x", "t", decider.hashes(r)) for r in (same, other, plain)}
    assert matched == {"r1": 7, "r2": 2, "r3": 2}  # the salted pages count only for their own salt
    assert decider.choose(same, ["y", "x"]) == "x"


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def greedy(model, prompts: list[tuple[list[int], CacheSalt | None]], *, cache: bool) -> list[list[int]]:
    engine = Engine(model, EngineConfig(kv_pages=128, page_size=PS, cache_enabled=cache))
    outs: dict[str, list[int]] = {}
    for i, (prompt, salt) in enumerate(prompts):  # one after another: each finds what the ones before cached
        engine.submit(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True), namespace="t", cache_salt=salt),
            lambda out: outs.setdefault(out.request_id, []).extend(out.token_ids),
        )
        engine.run_until_idle()
    engine.cache.check(idle=True)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def test_greedy_answers_are_the_same_with_the_cache_on_and_off_salted_or_not(model) -> None:
    system = [7, 3, 9, 12, 40, 41, 42, 43, 44, 45]
    prompts = [
        (system + [50, 51, 52], CacheSalt("a", 10)),
        (system + [50, 51, 52], CacheSalt("b", 10)),
        (system + [50, 51, 52], None),
        (system + [50, 51, 52, 53], CacheSalt("a", 10)),
        (system + [60], CacheSalt("a")),
        (system[8:] + [50, 51, 52, 53], None),  # the salted part's tokens at position 0: other K/V, never a hit
    ]
    assert greedy(model, prompts, cache=True) == greedy(model, prompts, cache=False)


def test_the_engine_serves_a_salt_only_its_own_pages(model) -> None:
    engine = Engine(model, EngineConfig(kv_pages=128, page_size=PS))
    cached: dict[str, int] = {}

    def run(rid: str, salt: CacheSalt | None) -> None:
        def sink(out) -> None:
            cached[rid] = out.cached_tokens

        engine.submit(Request(rid, TOKENS, SamplingParams(max_tokens=2), namespace="t", cache_salt=salt), sink)
        engine.run_until_idle()

    run("a1", CacheSalt("a", 8))
    run("b1", CacheSalt("b", 8))
    run("a2", CacheSalt("a", 8))
    run("plain", None)
    assert cached == {"a1": 0, "b1": 8, "a2": 28, "plain": 8}
    engine.cache.check(idle=True)


def test_the_system_span_is_what_the_system_messages_render_to_in_the_prompt() -> None:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "hello"},
    ]
    checked = CheckedPrompt(PromptInput(messages=messages), "messages", 1, messages)
    whole = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    alone = tokenizer.encode(tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False))
    span = system_span(checked, tokenizer, whole)
    common = next((i for i, (a, b) in enumerate(zip(alone, whole, strict=False)) if a != b), len(alone))
    assert span == common > 0  # all the system messages render to, where the whole prompt renders the same
    assert "You are terse." in tokenizer.decode(whole[:span]) and "hello" not in tokenizer.decode(whole[:span])
    no_system = CheckedPrompt(PromptInput(messages=messages[2:]), "messages", 1, messages[2:])
    assert system_span(no_system, tokenizer, whole) == 0


@pytest.fixture(scope="module")
def worker():
    with ThreadedWorker(FakeEngine(step_s=0.001, num_pages=16, page_size=4), http_port=0) as w:
        w.root = f"http://127.0.0.1:{w.server.http_port}"
        yield w


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ],
)
def test_every_http_front_hands_the_salt_to_the_engine(worker, path: str, body: dict) -> None:
    import httpx

    worker.engine.submitted.clear()
    salted = body | {"model": "fake", "cache_salt": "s-1", "cache_salt_shared_tokens": 5}
    r = httpx.post(worker.root + path, json=salted, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.post(worker.root + path, json=body | {"model": "fake"}, timeout=30).status_code == 200
    assert [r.cache_salt for r in worker.engine.submitted] == [CacheSalt("s-1", 5), None]


def test_grpc_hands_the_salt_to_the_engine(worker) -> None:
    import grpc

    from radixcache.client import Client
    from radixcache.v1 import radixcache_pb2 as pb
    from radixcache.v1 import radixcache_pb2_grpc as pb_grpc

    worker.engine.submitted.clear()
    with grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.RadixCacheStub(channel)
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=1, cache_salt="g", cache_salt_shared_tokens=4)))
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=1)))
    with Client(worker.target) as c:  # our client's keywords
        c.generate_text("hi", max_tokens=1, cache_salt="h")
    assert [r.cache_salt for r in worker.engine.submitted] == [CacheSalt("g", 4), None, CacheSalt("h")]


def test_salted_leases_under_pressure_keep_every_invariant_and_an_exact_event_stream() -> None:
    """Random salted, region-salted and unsalted sequences over a pool small enough to evict, some published
    page by page while others run, some released mid-sequence: check() after every step, and the events replay to
    exactly the tree's pages; every hit is the salt's own or the shared span's."""
    import random

    rng = random.Random(7)
    cache = PrefixCache(40, PS)
    log = EventLog(PS, strict=True)
    cache.set_event_sink(log)
    index = PageIndex()
    bases = [[rng.randrange(1, 50) for _ in range(24)] for _ in range(3)]
    salts = [None, CacheSalt("a"), CacheSalt("b", 9), CacheSalt("a", 9), CacheSalt("c", 100)]
    live: list = []
    for step in range(400):
        if live and (len(live) > 3 or rng.random() < 0.4):
            lease, tokens = live.pop(rng.randrange(len(live)))
            done = tokens[: rng.randrange(len(tokens) // 2, len(tokens) + 1)]
            cache.release(lease, done)
        else:
            salt = rng.choice(salts)
            tokens = rng.choice(bases)[: rng.randrange(6, 25)] + [rng.randrange(1, 50) for _ in range(rng.randrange(3))]
            lease = cache.acquire(f"r{step}", tokens, "t", max_cached=len(tokens) - 1, salt=salt)
            if lease.copy_from is not None:
                cache.copied(lease)
            try:
                cache.allocate(lease, -(-len(tokens) // PS) - len(lease.pages))
            except CacheFullError:
                cache.release(lease)
            else:
                cache.publish(lease, tokens[: rng.randrange(len(tokens) + 1)])
                live.append((lease, tokens))
        cache.check()
        for event in log.drain():
            index.apply(event)
        assert index.as_dict() == tree_index(cache.tree)
    for lease, tokens in live:
        cache.release(lease, tokens)
    cache.check(idle=True)
    stats = cache.stats()
    assert stats.evicted_pages > 50 and stats.hit_tokens > 0, stats  # it ran under pressure, and sharing happened


def test_the_tiers_below_memory_key_salted_pages_by_their_salted_hashes() -> None:
    from test_tier_stateful import TokenPool

    from radixcache.host_tier import HostTier
    from radixcache.tier import TierChain
    from radixcache.tiering import TierLink

    host = HostTier(64 * 16)
    cache = PrefixCache(64, PS, tier=TierLink(TokenPool(64), PS, tiers=TierChain([host])))
    serve(cache, "a1", CacheSalt("a", 8))
    cache.evict(64)  # every whole page spills to the host tier
    held = {(key.namespace, key.page_hash) for key in host.records()}
    hashes = salted_page_hashes(TOKENS, PS, "t", CacheSalt("a", 8))
    salted = next(ns for ns, _ in held if ns != "t")
    assert held == {("t", h) for h in hashes[:2]} | {(salted, h) for h in hashes[2:]}


def test_a_responses_turn_that_shares_its_instructions_keeps_them_when_it_continues(worker) -> None:
    import httpx

    worker.engine.submitted.clear()
    body = {"model": "fake", "instructions": "T", "input": "h", "max_output_tokens": 1, "store": True}
    salt = {"cache_salt": "s", "cache_salt_share_system": True}
    first = httpx.post(worker.root + "/v1/responses", json=body | salt, timeout=30)
    assert first.status_code == 200, first.text
    again = body | salt | {"previous_response_id": first.json()["id"], "input": "m"}
    second = httpx.post(worker.root + "/v1/responses", json=again, timeout=30)
    assert second.status_code == 200, second.text  # not refused as "needs chat messages"
    spans = [r.cache_salt.shared_tokens for r in worker.engine.submitted]
    assert spans[0] == spans[1] > 0  # the same instructions, the same shared span
