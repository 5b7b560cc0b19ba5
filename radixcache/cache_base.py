"""BaseCache: what the engine calls on its KV page cache, and the errors it raises.

Two implementations: radixcache.cache.PrefixCache (prefix sharing: a radix tree of token pages, eviction,
demotion, tiers below memory) and radixcache.cache_off.CacheOff (--no-cache: the same leases over the same pages,
nothing looked up or kept). The engine runs the same kernels over either. Both are used by one thread only.

What the two share lives here: the live leases (each has an owner, so a leak names its culprit), the lookup
counters, allocation (the window side first, then room for the pages, then the pages and their window parts) and
the window side of every lease (radixcache.lease_windows).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from radixcache.cache_stats import CacheCounters, CacheStats
from radixcache.lease import Lease
from radixcache.lease_windows import lease_windows
from radixcache.pages import PageAllocator

if TYPE_CHECKING:
    from radixcache.events import EventSink, PageRecord
    from radixcache.explain import Explanation
    from radixcache.tier import CacheTier, TierRecord
    from radixcache.window_parts import WindowParts

Tokens = Sequence[int]


class CacheFullError(RuntimeError):
    """An allocation is impossible even after evicting everything evictable. Nothing was changed."""


class PinBudgetError(RuntimeError):
    """A pin would exceed the pin budget, or take pages that running requests were promised. Nothing was pinned."""


class BaseCache(ABC):
    """A KV page cache over `num_pages` pages of `page_size` tokens (page ids match a KVPool of that size).

    The request path: acquire -> (copied) -> allocate / extend -> publish ... -> slide -> release. `window` > 0: the
    pool pages the sliding layers' values apart, in `window_slots` slots (radixcache.lease_windows). The pin budget,
    `max_pinned_pages` (None: the whole pool), is the most pages pins may hold.
    """

    tier: CacheTier | None = None  # the tiers below memory (radixcache.tiering), where there are any

    def __init__(
        self, num_pages: int, page_size: int, *, max_pinned_pages: int | None, window: int, window_slots: int
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        # Pins never hold more than this (None: the whole pool), so they cannot starve the requests that run.
        self.max_pinned_pages = num_pages if max_pinned_pages is None else max(0, min(max_pinned_pages, num_pages))
        self.allocator = PageAllocator(num_pages)
        self.windows = lease_windows(num_pages, page_size, window, window_slots)
        self.counts = CacheCounters()
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)

    @property
    def window(self) -> WindowParts | None:
        """The window slots (window paging), or None."""
        return self.windows.parts

    # ---- leases ----------------------------------------------------------------------------------------------
    def _open(self, owner: str, namespace: str) -> Lease:
        """A new live lease (its acquire sets what it holds and its lookup)."""
        if not owner:
            raise ValueError("a lease needs an owner (the request id), so that a leak can name it")
        lease = Lease(owner, namespace, _id=next(self._lease_ids))
        self._leases[lease._id] = lease
        return lease

    def _live(self, lease: Lease) -> None:
        if lease.released or self._leases.get(lease._id) is not lease:
            raise ValueError(f"the lease of {lease.owner!r} is released or belongs to another cache")

    def _close(self, lease: Lease) -> None:
        """Let go of everything the lease still holds and forget it."""
        self.windows.release(lease)
        self.allocator.decref(lease.pages)
        lease.pages, lease.released = [], True
        del self._leases[lease._id]

    def _pages_for(self, lease: Lease, tokens: Tokens, *, tail: bool) -> int:
        """The lease's pages that `tokens` fill: whole ones, and with `tail` the partial last one. ValueError when the
        lease holds fewer."""
        self._live(lease)
        ps = self.page_size
        n = -(-len(tokens) // ps) if tail else len(tokens) // ps
        if n > len(lease.pages):
            raise ValueError(f"{len(tokens)} computed tokens need {n} pages; the lease holds {len(lease.pages)}")
        return n

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def count_lookup(self, lease: Lease) -> None:
        """Add the lookup of a lease acquired with count=False to the statistics (queried, hit and copied tokens).
        Counts once: a second call does nothing."""
        lookup = lease._lookup
        if lookup is not None:
            self.counts.count_lookup(lease.namespace, lookup)
            lease._lookup = None

    def allocate(self, lease: Lease, n: int) -> list[int]:
        """n more private pages (refcount 1, held by the lease) appended to lease.pages. Makes room when the free list
        is short (PrefixCache: evicts LRU unlocked, unpinned leaves); raises CacheFullError, changing nothing, if that
        cannot help."""
        self._live(lease)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        pages = self._alloc(n)
        lease.pages += pages
        return pages

    def _alloc(self, n: int) -> list[int]:
        why = self.windows.shortage(n)
        if why is not None:
            raise CacheFullError(why)
        short = n - self.allocator.num_free
        if short > 0:
            self._make_room(n, short)
        pages = self.allocator.alloc(n)
        self.windows.attach(pages)
        return pages

    @abstractmethod
    def _make_room(self, n: int, short: int) -> None:
        """Free `short` more pages for an allocation of `n`, or raise CacheFullError changing nothing."""

    def slide(self, lease: Lease, position: int) -> None:
        """The lease's next query is at `position` (its computed tokens): let go of the window parts its sliding
        layers will never read again (pages wholly before position - W + 1). No-op without window parts."""
        self._live(lease)
        self.windows.slide(lease, position)

    def window_slots(self, pages: list[int]) -> list[int]:
        """The window slot of each page (-1: none); [] without window parts."""
        return self.windows.slots(pages)

    # ---- what each cache does its own way ---------------------------------------------------------------------
    @abstractmethod
    def acquire(
        self, owner: str, tokens: Tokens, namespace: str = "", max_cached: int | None = None, *, count: bool = True
    ) -> Lease:
        """A lease for a sequence of `tokens`, holding what the cache serves of them (at most `max_cached`). With
        `count=False` its lookup waits for `count_lookup` before it enters the statistics."""

    @abstractmethod
    def copied(self, lease: Lease) -> None:
        """The engine has done `lease.copy_from`: the lease stops holding the source page."""

    @abstractmethod
    def extend(self, lease: Lease, tokens: Tokens) -> int:
        """Adopt pages of `tokens` others published meanwhile; returns the tokens gained."""

    @abstractmethod
    def publish(self, lease: Lease, tokens: Tokens) -> int:
        """Offer the whole pages of the lease's computed `tokens` for sharing; returns the pages newly kept."""

    @abstractmethod
    def release(self, lease: Lease, tokens: Tokens | None = None) -> None:
        """End the lease (publishing `tokens` first, partial last page included). Idempotent."""

    @abstractmethod
    def available_pages(self) -> int:
        """Pages an allocation could get now."""

    @abstractmethod
    def match_length(self, tokens: Tokens, namespace: str = "") -> int:
        """Tokens `acquire` would serve from the cache. Read-only."""

    @abstractmethod
    def explain(self, tokens: Tokens, namespace: str = "") -> Explanation:
        """What an admission of prompt `tokens` would be served, page by page, and why it would stop there
        (radixcache.explain). Read-only."""

    @abstractmethod
    def pin(self, tokens: Tokens, namespace: str = "", ttl: float | None = None, *, keep_unpinned: int = 0) -> int:
        """Keep the cached prefix of `tokens` (for `ttl` seconds); returns the tokens pinned."""

    @abstractmethod
    def pinned_pages(self, tokens: Tokens | None = None, namespace: str = "") -> int:
        """Pages pinned now (with `tokens`: those on other paths than its prefix's)."""

    @abstractmethod
    def unpin(self, tokens: Tokens, namespace: str = "") -> int:
        """Unpin the cached prefix of `tokens`; returns the tokens that were pinned."""

    @abstractmethod
    def flush(self, namespace: str | None = None) -> int:
        """Drop what is cached (in one namespace, or all) that no lease reads; returns pages freed."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Evict up to `num_pages` cached pages; returns pages freed."""

    @abstractmethod
    def stats(self, namespace: str | None = None) -> CacheStats:
        """The whole cache's figures, or one namespace's view (radixcache.cache_stats)."""

    @abstractmethod
    def check(self, *, idle: bool = False) -> None:
        """Assert every invariant (radixcache.cache_check); with `idle`, any live lease is a leak and is named."""

    @abstractmethod
    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report the pages the cache stores and drops to `sink` (None: stop)."""

    @abstractmethod
    def add_observer(self, observer: EventSink) -> None:
        """A second listener to the same page records, beside the event sink."""

    @abstractmethod
    def remove_observer(self, observer: EventSink) -> None: ...

    @abstractmethod
    def page_records(self) -> Iterator[PageRecord]:
        """What the cache stores now, as the event sink would have heard it (a snapshot)."""

    @abstractmethod
    def window_pages(self) -> list[int]:
        """The stored pages that still have their window part (a snapshot's window group)."""

    @abstractmethod
    def tier_records(self) -> list[TierRecord]:
        """What the tiers below memory hold, as their events told it so far (a snapshot's tier part)."""
