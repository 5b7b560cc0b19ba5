"""--kv-demote with a tier below the pool (radixcache.tiering): the tiers hold exact pages only. A demotion hands the
node's full-precision pages down first (it is an eviction from the full-precision pages); a demoted page, or one
promoted back from it, never goes down (its values are what int4 kept); a load that cannot line up with what memory
holds is not started; every page stays named by the hash its path gives."""

from __future__ import annotations

import random

from test_cache_demotion import PS, Contents, prompt, serve

from radixcache.cache import PrefixCache
from radixcache.events import page_hashes
from radixcache.host_tier import HostTier
from radixcache.keys import decode, encode
from radixcache.tier import PageKey, TierChain
from radixcache.tiering import TierLink

EXACT, LOSSY = b"exact:", b"lossy:"


class _Marked(dict):
    """Page -> tokens; a page written by a computation (test_cache_demotion.serve) is exact again."""

    def __init__(self, lossy: set[int]) -> None:
        super().__init__()
        self.lossy = lossy

    def __setitem__(self, page: int, tokens: tuple[int, ...]) -> None:
        super().__setitem__(page, tokens)
        self.lossy.discard(page)


class LossyPool(Contents):
    """test_cache_demotion's stand-in pool (pages hold their tokens), whose pages are lossy once transcoded (a
    demotion or a promotion) until computed again; read_page marks which, so a test sees what went down to a tier."""

    def __init__(self, num_pages: int) -> None:
        super().__init__()
        self.num_pages = num_pages
        self.lossy: set[int] = set()
        self.tokens = _Marked(self.lossy)

    def transcode(self, src: list[int], dst: list[int]) -> None:
        super().transcode(src, dst)
        self.lossy.update(dst)

    def read_page(self, page: int) -> bytes:
        return (LOSSY if page in self.lossy else EXACT) + encode(self.tokens[page])

    def write_page(self, page: int, data: bytes) -> None:
        self.tokens[page] = tuple(decode(data[len(EXACT) :]))
        if data.startswith(LOSSY):
            self.lossy.add(page)


def make(num_pages: int = 4, demoted: int = 8, host_pages: int = 64) -> tuple[PrefixCache, LossyPool, HostTier]:
    pool = LossyPool(num_pages)
    host = HostTier(host_pages * (len(EXACT) + PS * 4))
    link = TierLink(pool, PS, tiers=TierChain([host]))
    cache = PrefixCache(num_pages, PS, demoted_pages=demoted, transcode=pool.transcode, tier=link)
    return cache, pool, host


def held_exactly(host: HostTier) -> None:
    """Everything the tier holds is an exact page of its key's own tokens."""
    for key, payload in host.items():
        assert payload == EXACT + key.tokens, f"the tier holds {payload!r} for {key.tokens!r}"


def test_a_demotion_hands_the_full_precision_pages_down_first() -> None:
    cache, pool, host = make()
    serve(cache, pool, "a", prompt(0))
    assert not host.items()  # nothing evicted or demoted yet
    serve(cache, pool, "b", prompt(1))  # 3 pages, 1 free: prompt 0's node is demoted
    assert cache.stats().pages_demoted == 3
    assert sorted(k.page_hash for k, _ in host.items()) == sorted(page_hashes(prompt(0), PS))
    held_exactly(host)


def test_nothing_lossy_ever_goes_down_under_demotions_promotions_and_evictions() -> None:
    cache, pool, host = make(num_pages=4, demoted=6, host_pages=3)  # a small host tier: it keeps turning over
    rng = random.Random(3)
    hits = 0
    for step in range(300):
        hits += serve(cache, pool, f"r{step}", prompt(rng.randrange(8), pages=rng.randrange(1, 4)))
        held_exactly(host)
    stats = cache.stats()
    assert stats.promoted_pages > 0 and stats.demoted_pages > 0 and stats.spilled_pages > 0 and hits > 0


def test_a_load_behind_a_demoted_page_that_cannot_come_back_is_not_started() -> None:
    cache, pool, host = make(num_pages=6, demoted=8)
    long = prompt(0, pages=4)
    serve(cache, pool, "long", long)
    cache.evict(2)  # its last two pages go to the host tier; the first two stay in memory
    assert len(host.items()) == 2
    busy = cache.acquire("busy", prompt(1, pages=5))
    cache.allocate(busy, 5)  # 4 free: the first two pages of `long` are demoted to make room
    other = cache.acquire("other", prompt(2, pages=1))
    cache.allocate(other, 1)  # the pool is full and nothing is evictable: no demoted page can come back
    assert cache.stats().pages_demoted == 2
    link = cache.tier
    assert link.start_load("probe", long, "", len(long)) is None  # its pages would not follow the two in memory
    cache.release(busy)
    cache.release(other)
    cache.check(idle=True)  # the load's lease is gone too
    assert serve(cache, pool, "again", long) >= 2 * PS  # the demoted pages come back now; every page is its own


def test_pages_are_named_by_their_path_through_demotions() -> None:
    cache, pool, _ = make()
    serve(cache, pool, "a", prompt(0))
    serve(cache, pool, "b", prompt(1))  # demotes prompt 0
    serve(cache, pool, "c", prompt(0))  # promotes it again (demoting prompt 1)
    names = {key.page_hash for key in cache.tier._names.values()}
    assert names == set(page_hashes(prompt(0), PS)) | set(page_hashes(prompt(1), PS))
    assert all(isinstance(k, PageKey) for k in cache.tier._names.values())
    cache.check(idle=True)  # the link's own check: each page named once, by the hash its path gives


def test_a_page_promoted_back_from_its_demoted_copy_is_not_spilled() -> None:
    cache, pool, host = make()
    serve(cache, pool, "a", prompt(0))
    serve(cache, pool, "b", prompt(1))  # demotes prompt 0 (its exact pages go to the tier)
    host.flush()  # the tier lets them go (its own LRU would, in time)
    assert serve(cache, pool, "c", prompt(0)) >= 2 * PS  # promoted back: int4's values in full-precision pages
    cache.evict(cache.num_pages)
    held_exactly(host)
    assert not {k.page_hash for k, _ in host.items()} & set(page_hashes(prompt(0), PS))
    cache.check(idle=True)


def test_a_page_whose_first_slots_were_copied_from_a_promoted_page_is_not_spilled() -> None:
    cache, pool, host = make()
    serve(cache, pool, "a", prompt(0))
    serve(cache, pool, "b", prompt(1))  # demotes prompt 0
    host.flush()
    diverging = prompt(0)[: 2 * PS + 1] + [999]  # ends one slot into prompt 0's last page
    assert serve(cache, pool, "c", diverging) == 2 * PS + 1  # promoted, then that slot copied from a lossy page
    cache.evict(cache.num_pages)
    assert page_hashes(diverging, PS)[2] not in {k.page_hash for k, _ in host.items()}
    cache.check(idle=True)
