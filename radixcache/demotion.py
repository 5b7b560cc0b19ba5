"""Demotion (--kv-demote): cold cached pages are rewritten into smaller demoted copies instead of being evicted.

Page ids num_pages..num_pages+demoted_pages-1 hold demoted copies (int4; `transcode(src, dst)` fills them, e.g.
radixcache.pool.KVPool.transcode). When an allocation is short of pages, the least recently used unlocked, unpinned
full-precision node without full-precision children is rewritten, whole, into demoted pages (its full-precision pages
become free), and only demoted leaves are evicted, to make room for newer demotions; a node larger than the demoted
pages free or evictable is evicted instead, its demoted subtree with it.

Nothing ever reads a demoted page: a lookup whose match runs through demoted nodes first brings them back
(`transcode` into fresh pages, which may demote other cold leaves); what cannot be brought back is not served (the
match stops before it). So a hit on a demoted prefix reads the values its demotion kept (the answer may differ from
a recompute: that is what the flag trades), no lease ever holds a demoted page, and a publish that meets a demoted
page keeps its own copy. With a tier below memory (radixcache.tiering), a demotion first hands the node's
full-precision pages down (`RadixTree.set_pages` tells the link); demoted pages, and pages promoted back from them,
never go down (the tiers hold exact pages only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixcache.cache_base import CacheFullError
from radixcache.eviction import Eviction
from radixcache.keys import TOKEN_BYTES
from radixcache.pages import PageAllocator

if TYPE_CHECKING:
    from radixcache.cache_stats import CacheCounters
    from radixcache.lease_windows import LeaseWindows
    from radixcache.node import Match, Node
    from radixcache.tier import PagesBelow
    from radixcache.tree import RadixTree


class Demotion(Eviction):
    """Room by demotion first, then eviction (see the module docstring). `alloc(n)`: the cache's own allocation of
    n fresh full-precision pages (making room as any allocation does), for what a hit brings back."""

    demoted: PageAllocator  # always the demoted copies' ids here

    def __init__(
        self,
        tree: RadixTree,
        allocator: PageAllocator,
        windows: LeaseWindows,
        counts: CacheCounters,
        below: PagesBelow | None,
        *,
        demoted_pages: int,
        transcode: Callable[[list[int], list[int]], None] | None,
        alloc: Callable[[int], list[int]],
    ) -> None:
        if transcode is None:
            raise ValueError("demoted pages need a transcode callback to fill them")
        super().__init__(tree, allocator, windows, counts, below)
        self.demoted = PageAllocator(demoted_pages, first=allocator.num_pages)
        self._transcode = transcode
        self._alloc = alloc
        self._first_demoted = allocator.num_pages  # ids from here on are demoted copies

    @property
    def total_pages(self) -> int:
        return self.allocator.num_pages + self.demoted.num_pages

    # ---- lookups ---------------------------------------------------------------------------------------------
    def readable(self, m: Match, key: bytes, namespace: str) -> Match:
        """`m`, with the demoted nodes on its path brought back first; where pages run out, cut before the first
        page still demoted."""
        return self._promote(m, key, namespace) if self._reads_demoted(m) else m

    def _reads_demoted(self, m: Match) -> bool:
        first = self._first_demoted
        return bool(m.pages and max(m.pages) >= first) or (m.partial_tokens > 0 and m.partial_page >= first)

    def _promote(self, m: Match, key: bytes, namespace: str) -> Match:
        guard = m.partial_node or m.node
        assert guard is not None
        path = []
        node: Node | None = guard
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        self.tree.lock(guard)  # the path must survive the demotions and evictions that make room for it
        try:
            for node in reversed(path):  # root first
                if not node.demoted:
                    continue
                try:
                    dst = self._alloc(len(node.pages))
                except CacheFullError:
                    break
                self._transcode(node.pages, dst)
                self.demoted.decref(self.tree.set_pages(node, dst, demoted=False))
                self.counts.promoted += len(dst)
        finally:
            self.tree.unlock(guard)
        m = self.tree.match(key, namespace, touch=False)
        if self._reads_demoted(m):
            whole = next((i for i, p in enumerate(m.pages) if p >= self._first_demoted), len(m.pages))
            m = self.tree.match(key[: whole * self.tree.page_size * TOKEN_BYTES], namespace, touch=False)
        return m

    # ---- room ------------------------------------------------------------------------------------------------
    def free_up(self, short: int) -> None:
        """Demote cold nodes for `short` pages; evict what that leaves short (the full-precision nodes' demoted
        subtrees go with them)."""
        short -= self._demote(short)
        if short > 0:
            self.evict(short)

    def _demote(self, need: int) -> int:
        """Free at least `need` full-precision pages, if it can, by rewriting the least recently used full-precision
        nodes without full-precision children, whole, into demoted pages; returns the pages freed. Stops at a node
        larger than the demoted pages free or evictable (the caller then evicts it, its demoted subtree with it)."""
        done = 0
        while done < need and (node := self.tree.lru_leaf()) is not None:
            k = len(node.pages)
            if k > self.demoted.num_free + self.tree.evictable_demoted_pages:
                break
            self._demoted_room(k)
            dst = self.demoted.alloc(k)
            self._transcode(node.pages, dst)
            self.allocator.decref(self.tree.set_pages(node, dst, demoted=True))  # no lease holds them: now free
            self.counts.demoted += k
            done += k
        return done

    def _demoted_room(self, k: int) -> None:
        """Make k demoted pages free (k <= free + evictable demoted), evicting the least recently used demoted
        leaves."""
        free = self.demoted.num_free
        if k > free:
            freed = self.tree.evict(k - free, demoted=True)
            self.below.spill(freed)  # (demoted pages never go down: the tier took their full precision)
            self.demoted.decref(freed)
            self.counts.evicted += len(freed)

    # ---- the tree's pages --------------------------------------------------------------------------------------
    def unstored(self, pages: list[int]) -> None:
        first = self._first_demoted
        self.windows.unstored(pages)
        self.allocator.decref([p for p in pages if p < first])
        self.demoted.decref([p for p in pages if p >= first])

    def allocator_of(self, page: int) -> PageAllocator:
        return self.allocator if page < self._first_demoted else self.demoted

    def check(self) -> None:
        self.demoted.check()
