"""--kv-demote in the cache: cold unpinned leaves are rewritten into demoted pages instead of being evicted, only
demoted pages are evicted, a hit on a demoted prefix brings it back (the pages it then reads hold its tokens), pinned
pages are never demoted, no lease ever holds a demoted page, and every page of both kinds is accounted for."""

from __future__ import annotations

import random

import pytest
import torch

from radixcache.cache import CacheFullError, PrefixCache
from radixcache.keys import encode
from radixcache.kv_codec import CODECS, hadamard
from radixcache.pool import KVPool, KVShape

PS = 2


class Contents:
    """A stand-in pool that remembers which tokens each page holds, so a test can see that what a lease reads after
    demotions and promotions is still its own prefix."""

    def __init__(self) -> None:
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.moves = 0

    def transcode(self, src: list[int], dst: list[int]) -> None:
        for s, d in zip(src, dst, strict=True):
            self.tokens[d] = self.tokens[s]
        self.moves += len(src)


def make(num_pages: int = 8, demoted: int = 8) -> tuple[PrefixCache, Contents]:
    contents = Contents()
    return PrefixCache(num_pages, PS, demoted_pages=demoted, transcode=contents.transcode), contents


def serve(cache: PrefixCache, contents: Contents, owner: str, tokens: list[int], *, idle: bool = True) -> int:
    """One request computed whole and released: returns the tokens it hit. Checks the pages it read."""
    lease = cache.acquire(owner, tokens)
    for i, page in enumerate(lease.pages[: lease.cached_tokens // PS]):
        assert page < cache.num_pages, "a lease reads a demoted page"
        assert contents.tokens[page] == tuple(tokens[i * PS : (i + 1) * PS]), f"page {page} holds other tokens"
    if lease.copy_from is not None:
        src, dst = lease.copy_from.src, lease.copy_from.dst
        contents.tokens[dst] = contents.tokens[src]
        cache.copied(lease)
    cache.allocate(lease, max(0, -(-len(tokens) // PS) - len(lease.pages)))
    for i, page in enumerate(lease.pages):  # "compute" every page the lease owns
        if i * PS >= lease.cached_tokens - lease.cached_tokens % PS:
            contents.tokens[page] = tuple(tokens[i * PS : (i + 1) * PS])
    hit = lease.cached_tokens
    cache.release(lease, tokens)
    cache.check(idle=idle)
    return hit


def prompt(i: int, pages: int = 3) -> list[int]:
    return [100 * i + t for t in range(pages * PS)]


def test_cold_leaves_are_demoted_instead_of_evicted_and_a_hit_brings_them_back() -> None:
    cache, contents = make()
    for i in range(4):  # 12 pages of prefixes in an 8-page pool
        serve(cache, contents, f"r{i}", prompt(i))
    stats = cache.stats()
    # whole leaves, least recently used first: the two oldest prefixes, nothing lost (6 + 6 pages, 2 left free)
    assert stats.evicted_pages == 0 and stats.pages_demoted == stats.demoted_pages == 6
    assert (stats.pages_cached, stats.pages_free) == (6, 2)
    first = [page for _, key, page in cache.tree.items() if key.startswith(encode(prompt(0)[:PS]))]
    assert len(first) == 3 and min(first) >= cache.num_pages
    assert serve(cache, contents, "again", prompt(0)) == 6  # the oldest prefix, demoted, is a whole hit
    stats = cache.stats()
    assert stats.promoted_pages > 0 and contents.moves == stats.demoted_pages + stats.promoted_pages


def test_only_demoted_pages_are_evicted() -> None:
    cache, contents = make(num_pages=6, demoted=4)
    for i in range(6):
        serve(cache, contents, f"r{i}", prompt(i, pages=2))
    stats = cache.stats()
    # 12 pages of prefixes: 6 at full precision, 4 demoted, 2 evicted, and those were demoted ones (the oldest)
    assert (stats.pages_cached, stats.pages_demoted, stats.evicted_pages) == (6, 4, 2)
    assert serve(cache, contents, "oldest", prompt(0, pages=2)) == 0
    assert serve(cache, contents, "newest", prompt(5, pages=2)) == 4


def test_pinned_pages_are_never_demoted() -> None:
    cache, contents = make(num_pages=8, demoted=16)
    serve(cache, contents, "pinned", prompt(0))
    assert cache.pin(prompt(0)) == 6
    for i in range(1, 8):
        serve(cache, contents, f"r{i}", prompt(i))
    pinned = [page for node in cache.tree.nodes() if node.pin_until is not None for page in node.pages]
    assert len(pinned) == 3 and max(pinned) < cache.num_pages
    assert cache.stats().pages_demoted > 0


def test_a_leaf_larger_than_the_demoted_room_is_evicted_like_plain_lru() -> None:
    cache, contents = make(num_pages=6, demoted=2)
    serve(cache, contents, "a", prompt(0))
    assert cache.pin(prompt(0)) == 6
    serve(cache, contents, "b", prompt(1))  # 6 of 6 full pages in use
    lease = cache.acquire("c", prompt(2))
    cache.allocate(lease, 3)  # "b" (3 pages) does not fit the 2 demoted pages: evicted, whole
    assert cache.stats().pages_demoted == 0 and cache.stats().evicted_pages == 3
    with pytest.raises(CacheFullError):
        cache.allocate(lease, 1)  # what is left is pinned or leased
    cache.release(lease)
    cache.check(idle=True)


def test_a_publish_over_a_demoted_page_keeps_its_own_copy_and_a_demoted_tail_can_be_covered() -> None:
    cache, contents = make(num_pages=10, demoted=8)
    tokens = prompt(0) + [7, 8]
    lease = cache.acquire("long", tokens)  # nothing cached yet: it computes all 4 pages itself
    cache.allocate(lease, 4)
    for i, page in enumerate(lease.pages):
        contents.tokens[page] = tuple(tokens[i * PS : (i + 1) * PS])
    serve(cache, contents, "short", tokens[:5], idle=False)  # 2 whole pages and a partial tail, released
    for i in range(1, 5):  # pressure: "short" (the coldest leaf) is demoted while "long" still runs
        serve(cache, contents, f"r{i}", prompt(i, pages=1), idle=False)
    short = [page for _, key, page in cache.tree.items() if key.startswith(encode(tokens[:PS]))]
    assert len(short) == 3 and min(short) >= cache.num_pages
    cache.publish(lease, tokens)  # meets 2 demoted whole pages and covers the demoted tail with a whole page
    assert max(lease.pages) < cache.num_pages  # it keeps reading its own copies, never a demoted page
    cache.check()
    cache.release(lease, tokens)
    cache.check(idle=True)
    assert serve(cache, contents, "again", tokens) == 8  # the demoted pages come back, holding these tokens


def test_a_random_workload_keeps_every_page_accounted_for() -> None:
    """Hundreds of requests, pins, unpins and flushes over shared prefixes in a pool a fraction of their size."""
    rng = random.Random(5)
    cache, contents = make(num_pages=24, demoted=20)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(2, 14))] for _ in range(12)]
    hits = 0
    for i in range(400):
        roll = rng.random()
        tokens = rng.choice(prefixes)[: rng.randrange(1, 14)] + [rng.randrange(1000) for _ in range(rng.randrange(3))]
        if roll < 0.05:
            try:
                cache.pin(rng.choice(prefixes), ttl=None)
            except Exception:  # the pin budget: a refusal is fine here
                pass
        elif roll < 0.1:
            cache.unpin(rng.choice(prefixes))
        elif roll < 0.12:
            cache.flush()
        else:
            try:
                hits += serve(cache, contents, f"r{i}", tokens)
            except CacheFullError:
                cache.flush()
        cache.check(idle=True)
    stats = cache.stats()
    assert hits > 0 and stats.demoted_pages > 0 and stats.promoted_pages > 0, stats


def test_transcode_demotes_to_int4_and_back_keeping_what_int4_keeps() -> None:
    shape = KVShape(layers=2, kv_heads=2, head_dim=16)
    pool = KVPool(shape, page_size=4, num_pages=4, dtype="fp32", demoted_pages=3, demote_dtype="int4")
    pool.kv.copy_(torch.randn(pool.kv.shape))
    original = pool.read_page(1)
    pool.transcode([1], [5])
    demoted = pool.read_page(5)
    assert demoted.kv_dtype == "int4" and demoted.kv.dtype == torch.uint8 and pool.page_kv_dtype(5) == "int4"
    assert demoted.nbytes * 3 < original.nbytes  # 0.27x of fp16 per token: 0.13x of fp32
    pool.transcode([5], [2])
    back = pool.read_page(2).kv
    codec = CODECS["int4"]
    k, v = original.kv[:, 0], original.kv[:, 1]
    want_k = hadamard(codec.decode(*codec.encode(hadamard(k)), torch.float32))
    want_v = codec.decode(*codec.encode(v), torch.float32)
    torch.testing.assert_close(back[:, 0], want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(back[:, 1], want_v, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="span both arenas"):
        pool.transcode([1, 5], [2, 3])
    with pytest.raises(ValueError, match="saves no memory"):
        KVPool(shape, page_size=4, num_pages=4, dtype="int4", demoted_pages=2, demote_dtype="int4")


def full_node(cache: PrefixCache):  # noqa: ANN201
    return next(n for n in cache.tree.nodes() if n.pages and not n.demoted)


def demoted_cache() -> tuple[PrefixCache, Contents, list]:
    cache, contents = make(num_pages=6, demoted=6)
    for i in range(5):  # 10 pages of prefixes in 6: the two oldest are demoted
        serve(cache, contents, f"r{i}", prompt(i, pages=2))
    lease = cache.acquire("reader", prompt(4, pages=2))  # a live lease on full-precision pages
    demoted = [n for n in cache.tree.nodes() if n.demoted]
    assert demoted and lease.pages
    cache.check()
    return cache, contents, demoted


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda c, d: setattr(c.tree, "demoted_pages", c.tree.demoted_pages + 1), "demoted page counters"),
        (lambda c, d: setattr(d[0], "demoted", False), "full-precision children"),
        (lambda c, d: c.tree._dlru.remove(d[-1]), "evictable node .* is not listed"),
        (lambda c, d: (c.tree._dlru.remove(d[-1]), c.tree._lru.add(d[-1])), r"\(or in the wrong LRU\)"),
        (lambda c, d: c.leases()[0].pages.append(d[0].pages[0]), "holds a demoted page"),
        (lambda c, d: c.demoted.incref(d[0].pages), "refcount 2 but 1 holders"),
        (lambda c, d: full_node(c).pages.__setitem__(0, c.demoted.free_pages()[0]), r"\(not demoted\) stores page"),
    ],
)
def test_the_checks_name_broken_demotion_invariants(corrupt, message: str) -> None:  # noqa: ANN001
    cache, _, demoted = demoted_cache()
    corrupt(cache, demoted)
    with pytest.raises(AssertionError, match=message):
        cache.check()
