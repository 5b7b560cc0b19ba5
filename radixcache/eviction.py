"""Eviction: where a PrefixCache finds room when the free list is short, and where the pages its tree drops go.

The least recently used unlocked, unpinned leaves are evicted (radixcache.tree), their pages handed to the tier
below memory first (while their data is still in the pool; radixcache.tiering), then their window parts and the
tree's reference let go. A flush drops pages without handing them down, and empties the tiers of what it flushed.

The request path calls the same methods whatever is configured: this class when pages are only ever evicted,
radixcache.demotion.Demotion when cold pages are demoted first (--kv-demote). Nothing below memory is NoTier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixcache.tier import NoTier

if TYPE_CHECKING:
    from radixcache.cache_stats import CacheCounters
    from radixcache.lease_windows import LeaseWindows
    from radixcache.node import Match
    from radixcache.pages import PageAllocator
    from radixcache.tier import PagesBelow
    from radixcache.tree import RadixTree


class Eviction:
    """Room by eviction, over a cache's tree, its allocator and its window side; evictions are counted in
    `counts` (the whole cache's and per namespace)."""

    demoted: PageAllocator | None = None  # the demoted copies' ids (Demotion only)

    def __init__(
        self,
        tree: RadixTree,
        allocator: PageAllocator,
        windows: LeaseWindows,
        counts: CacheCounters,
        below: PagesBelow | None = None,
    ) -> None:
        self.tree, self.allocator, self.windows, self.counts = tree, allocator, windows, counts
        self.below: PagesBelow = below if below is not None else NoTier()

    @property
    def total_pages(self) -> int:
        """How many page ids there are: the pool's (and, with demotion, the demoted copies' after them)."""
        return self.allocator.num_pages

    def readable(self, m: Match, key: bytes, namespace: str) -> Match:
        """What a lookup may serve of match `m` (of `key`): all of it."""
        return m

    def free_up(self, short: int) -> None:
        """Make `short` more pages free (the caller checked that evicting can)."""
        self.evict(short)

    def evict(self, num_pages: int) -> int:
        """Evict up to `num_pages` pages from LRU unlocked, unpinned (full-precision) leaves; returns pages freed."""
        freed = self.tree.evict(num_pages, self.counts.evicted_from)
        self.below.spill(freed)  # before the pages are free: their data is still in the pool
        self.unstored(freed)
        self.counts.evicted += len(freed)
        return len(freed)

    def flushed(self, freed: list[int], namespace: str | None) -> None:
        """A flush dropped `freed`: gone, never spilled, and gone from the tiers too."""
        self.below.discard()
        self.below.flush(namespace)
        self.unstored(freed)
        self.counts.flushed += len(freed)

    def unstored(self, pages: list[int]) -> None:
        """Drop the tree's reference on pages it no longer stores (and their idle window parts)."""
        self.windows.unstored(pages)
        self.allocator.decref(pages)

    def copying(self, src: int, dst: int) -> None:
        """A hit copies the first slots of tree page `src` into a lease's page `dst`."""
        self.below.copying(src, dst)

    def allocator_of(self, page: int) -> PageAllocator:
        return self.allocator

    def check(self) -> None:
        """Assert what this side keeps apart from the tree and the pool's allocator (nothing, here)."""
