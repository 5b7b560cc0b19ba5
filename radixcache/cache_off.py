"""CacheOff: the cache turned off (--no-cache), behind the same interface as PrefixCache (radixcache.cache_base).

The engine runs the same kernels over the same leases and pages; nothing is looked up, shared or kept. `acquire`
serves nothing (its lookup still counts the queried tokens, so the hit rate reads 0), `publish` keeps nothing,
`release` frees every page, pins hold nothing, and nothing is ever reported to an event sink. Window parts (a model
with sliding layers paged apart) work as with the cache on: a sequence holds the parts of its last window only.
The baseline every "cache on == cache off" test compares against.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from radixcache.cache_base import BaseCache, CacheFullError, Tokens
from radixcache.cache_check import check_cache_off
from radixcache.cache_stats import CacheStats, lease_figures, window_figures
from radixcache.explain import Explanation, off_explanation
from radixcache.lease import Lease, Lookup
from radixcache.miss_reasons import CACHE_OFF, CACHE_OFF_MISS

if TYPE_CHECKING:
    from radixcache.events import EventSink, PageRecord
    from radixcache.tier import TierRecord


class CacheOff(BaseCache):
    """A page allocator with leases: see the module docstring. One thread only."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        max_pinned_pages: int | None = None,
        window: int = 0,
        window_slots: int = 0,
    ) -> None:
        super().__init__(
            num_pages, page_size, max_pinned_pages=max_pinned_pages, window=window, window_slots=window_slots
        )

    # ---- the request path: leases over private pages -------------------------------------------------------
    def acquire(
        self, owner: str, tokens: Tokens, namespace: str = "", max_cached: int | None = None, *, count: bool = True
    ) -> Lease:
        """A lease holding nothing yet (nothing is served from a cache that is off)."""
        lease = self._open(owner, namespace)
        lease._lookup = Lookup(len(tokens))
        lease.miss = CACHE_OFF_MISS
        if count:
            self.count_lookup(lease)
        return lease

    def copied(self, lease: Lease) -> None:
        """Nothing to copy: a lease of this cache never has a copy source."""
        self._live(lease)

    def extend(self, lease: Lease, tokens: Tokens) -> int:
        """Nobody publishes: nothing to adopt."""
        self._live(lease)
        return 0

    def publish(self, lease: Lease, tokens: Tokens) -> int:
        """Keeps nothing (the lease must hold the pages of `tokens`, as with the cache on); returns 0."""
        self._pages_for(lease, tokens, tail=False)
        return 0

    def release(self, lease: Lease, tokens: Tokens | None = None) -> None:
        """Free every page the lease holds (and its window parts). Idempotent."""
        if lease.released:
            return
        try:
            if tokens is not None:
                self._pages_for(lease, tokens, tail=True)
        finally:
            self._close(lease)

    def _make_room(self, n: int, short: int) -> None:
        raise CacheFullError(
            f"the KV cache needs {n} pages but has {n - short} free (of {self.num_pages}; the rest are private to "
            f"{len(self._leases)} running requests, and the cache is off: nothing is evictable)"
        )

    # ---- admission, admin: nothing cached ------------------------------------------------------------------
    def available_pages(self) -> int:
        return self.allocator.num_free

    def match_length(self, tokens: Tokens, namespace: str = "") -> int:
        return 0

    def explain(self, tokens: Tokens, namespace: str = "") -> Explanation:
        return off_explanation(tokens, self.page_size, CACHE_OFF)

    def pin(self, tokens: Tokens, namespace: str = "", ttl: float | None = None, *, keep_unpinned: int = 0) -> int:
        return 0

    def pinned_pages(self, tokens: Tokens | None = None, namespace: str = "") -> int:
        return 0

    def unpin(self, tokens: Tokens, namespace: str = "") -> int:
        return 0

    def flush(self, namespace: str | None = None) -> int:
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    def stats(self, namespace: str | None = None) -> CacheStats:
        """The pool's and the leases' figures; every figure of what a cache keeps reads 0."""
        return CacheStats(
            pages_total=self.num_pages,
            pages_free=self.allocator.num_free,
            pages_cached=0,
            pages_evictable=0,
            pages_pinned=0,
            extended_pages=0,
            published_pages=0,
            evicted_pages=0,
            flushed_pages=0,
            evictable_leaves=0,
            namespaces=0,
            max_pinned_pages=self.max_pinned_pages,
            **lease_figures(self._leases.values(), self.counts, namespace) | window_figures(self.window),
        )

    def check(self, *, idle: bool = False) -> None:
        """Assert every page is held by the leases that list it, and the window parts' invariants; with `idle`, any
        live lease is a leak and is named."""
        check_cache_off(self.allocator, self.windows, self._leases.values(), idle=idle)

    # ---- events: nothing is stored, so nothing is reported -------------------------------------------------
    def set_event_sink(self, sink: EventSink | None) -> None:
        pass

    def add_observer(self, observer: EventSink) -> None:
        pass

    def remove_observer(self, observer: EventSink) -> None:
        pass

    def page_records(self) -> Iterator[PageRecord]:
        return iter(())

    def window_pages(self) -> list[int]:
        return []

    def tier_records(self) -> list[TierRecord]:
        return []
