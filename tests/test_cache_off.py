"""The cache turned off (--no-cache, radixcache.cache_off.CacheOff), behind the prefix cache's interface.

What a user relies on: a worker started with --no-cache runs the same engine over the same calls (a call the
engine makes on the cache that the cache-off class lacks, or takes other arguments for, fails here, not in a
request), serves nothing from a cache, refuses a full pool cleanly, and its check() still names a leak.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest

from radixcache.cache import CacheFullError, PrefixCache
from radixcache.cache_base import BaseCache
from radixcache.cache_off import CacheOff
from radixcache.lease import Lease


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_the_cache_off_takes_every_call_the_prefix_cache_takes_with_the_same_parameters() -> None:
    on, off = public_methods(PrefixCache), public_methods(CacheOff)
    assert set(on) <= set(off), f"CacheOff lacks {sorted(set(on) - set(off))}"
    for name, signature in on.items():
        assert list(off[name].parameters.values()) == list(signature.parameters.values()), name
    assert issubclass(CacheOff, BaseCache) and issubclass(PrefixCache, BaseCache)
    for attribute in ("num_pages", "page_size", "max_pinned_pages", "tier", "window"):
        assert hasattr(CacheOff(8, 2), attribute) and hasattr(PrefixCache(8, 2), attribute), attribute


def test_the_cache_off_serves_nothing_twice_and_reports_nothing() -> None:
    cache = CacheOff(8, 2, max_pinned_pages=4)
    recorded: list[object] = []

    class Sink:
        def stored(self, *args: object) -> None:
            recorded.append(args)

        removed = cleared = stored

    cache.set_event_sink(Sink())  # type: ignore[arg-type]
    for owner in ("a", "b"):  # the same prompt twice: the second is no hit either
        lease = cache.acquire(owner, [1, 2, 3, 4, 5])
        assert lease.cached_tokens == 0 and lease.pages == [] and lease.copy_from is None
        cache.allocate(lease, 3)
        assert cache.publish(lease, [1, 2, 3, 4]) == 0
        cache.release(lease, [1, 2, 3, 4, 5])
    assert recorded == [] and list(cache.page_records()) == [] and cache.window_pages() == []
    s = cache.stats()
    assert (s.queried_tokens, s.hit_tokens, s.hit_rate, s.pages_free, s.max_pinned_pages) == (10, 0, 0.0, 8, 4)
    assert cache.stats("t").queried_tokens == 0 and cache.flush() == 0 and cache.evict(8) == 0
    cache.check(idle=True)


def test_the_cache_off_refuses_a_full_pool_changing_nothing() -> None:
    cache = CacheOff(4, 2)
    a = cache.acquire("a", list(range(6)))
    cache.allocate(a, 3)
    b = cache.acquire("b", list(range(6)))
    with pytest.raises(CacheFullError, match="needs 2 pages but has 1 free"):
        cache.allocate(b, 2)
    assert b.pages == [] and cache.available_pages() == 1
    cache.check()
    with pytest.raises(ValueError, match="need 4 pages; the lease holds 3"):
        cache.release(a, list(range(7)))  # more tokens than pages: refused, yet the lease is ended
    assert a.released and cache.allocate(b, 2) and cache.available_pages() == 2
    cache.release(b)
    cache.check(idle=True)


def leased() -> tuple[CacheOff, Lease]:
    cache = CacheOff(8, 2)
    lease = cache.acquire("reader", [1, 2, 3])
    cache.allocate(lease, 2)
    cache.check()
    return cache, lease


CORRUPTIONS: dict[str, tuple[Callable[[CacheOff, Lease], object], str]] = {
    "a private page leaked": (lambda c, lease: c.allocator.alloc(1), r"refcount 1 but 0 holders .*leaked page"),
    "a lost reference": (
        lambda c, lease: c.allocator.decref(lease.pages[:1]),
        r"refcount 0 but 1 holders \(not the tree; leases: \['reader'\]\); a holder lost its reference",
    ),
    "a lease without owner": (lambda c, lease: setattr(lease, "owner", ""), "a live lease has no owner"),
    "a released lease still registered": (lambda c, lease: setattr(lease, "released", True), "is released but still"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_the_cache_off_check_names_each_broken_invariant(case: str) -> None:
    cache, lease = leased()
    corrupt, message = CORRUPTIONS[case]
    corrupt(cache, lease)
    with pytest.raises(AssertionError, match=message):
        cache.check()


def test_the_cache_off_check_names_the_owner_of_a_lease_left_while_idle() -> None:
    cache, _ = leased()
    with pytest.raises(AssertionError, match=r"1 leases leaked while idle, owned by \['reader'\]"):
        cache.check(idle=True)
