"""PrefixCache: prefix sharing over the KV pages. match -> lease -> allocate -> publish -> release.

Holders and refcounts: a page's refcount is the number of its holders: 1 for the tree node that stores it, plus 1 per
live lease whose `pages` list it (plus 1 for a lease's pending copy source, see `acquire`). Pages return to the free
list when the last holder lets go.

Locks: a lease locks its deepest tree node; the lock counts up to the root, so nothing on the path the lease reads
can be evicted. Pins protect paths the same way until unpinned or expired. Eviction only drops unlocked, unpinned
leaves, least recently used first, and only when an allocation is short of free pages (or on `evict`/`flush`).

Never twice: a lease holds at most one page per page of its tokens. The source of a partial-page copy is let go once
copied (`copied`), and a page the lease computed that the tree already holds (the same tokens, computed by someone
else or copied from it) is swapped for the tree's page at publish, freeing the copy. So a request alone in the
pool needs exactly ceil(tokens / page_size) pages, whatever it hit.

Partial tails: a running sequence still writes into its last page, so `publish` stores whole pages only. `release`
also stores the trailing partial page (the sequence will never write it again) as a partial tail in the tree: the
next turn of a conversation, or a preempted sequence coming back, then reuses every computed token by copying the
tail's first slots (`copy_from`) instead of recomputing them. A tail is only ever read through such a copy, so a
later publish that covers it with a whole page (or a longer tail) replaces it and drops the tree's reference; a
lease still copying from it holds its own reference until its next publish/extend/release.

Two parts beside the tree and the leases, called the same way whatever is configured:
- room (`room`): where an allocation's pages come from when the free list is short, what a lookup may serve, where
  the pages the tree drops go: radixcache.eviction (LRU leaves evicted, handed to the tiers below memory first,
  radixcache.tiering) or radixcache.demotion (--kv-demote: cold leaves demoted first; a hit brings them back).
  Page ids from num_pages on are demoted copies: a lease never reads one.
- the window side (`windows`, radixcache.lease_windows): a model with sliding-window layers paged apart keeps each
  page's sliding layers in a window slot only while some window needs it; a hit is served only where the window after
  it is held (docs/MODULES.md, "The prefix rule of sliding-window layers"). Window parts and demotion or tiers below
  memory do not combine yet (refused at construction).
Statistics: radixcache.cache_stats; the integrity check: radixcache.cache_check. The cache turned off (--no-cache)
is radixcache.cache_off.CacheOff, behind the same interface (radixcache.cache_base.BaseCache).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from radixcache.cache_base import BaseCache, CacheFullError, PinBudgetError, Tokens
from radixcache.cache_check import check_prefix_cache
from radixcache.cache_stats import CacheStats, lease_figures, tier_figures, tree_figures, window_figures
from radixcache.demotion import Demotion
from radixcache.eviction import Eviction
from radixcache.explain import Explanation, explain_prompt
from radixcache.keys import TOKEN_BYTES, encode
from radixcache.lease import Lease, Lookup, PageCopy
from radixcache.miss_reasons import NO_ROOM, WINDOW_PREFIX_RULE, diagnose, match_stop
from radixcache.tree import RadixTree

if TYPE_CHECKING:
    from radixcache.events import EventSink, PageRecord
    from radixcache.node import InsertResult, Match, Node
    from radixcache.tier import CacheTier, TierRecord

# What callers of the cache import from here (defined next to the interface and the lease).
__all__ = ["CacheFullError", "CacheStats", "Lease", "PageCopy", "PinBudgetError", "PrefixCache"]


class PrefixCache(BaseCache):
    """Prefix-sharing KV page cache. Page ids match a KVPool with the same num_pages and page_size.

    Not thread-safe: one engine thread owns it. `tier`: the link to the tiers below memory (radixcache.tiering);
    `demoted_pages` > 0 with `transcode`: demotion (radixcache.demotion); `window` > 0 with `window_slots`: window
    parts (radixcache.lease_windows).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_pinned_pages: int | None = None,
        tier: CacheTier | None = None,
        demoted_pages: int = 0,
        transcode: Callable[[list[int], list[int]], None] | None = None,
        window: int = 0,
        window_slots: int = 0,
    ) -> None:
        if window and (demoted_pages or tier is not None):
            raise ValueError("window parts (sliding layers paged apart) do not combine with demotion or tiers yet")
        super().__init__(
            num_pages, page_size, max_pinned_pages=max_pinned_pages, window=window, window_slots=window_slots
        )
        self.tree = RadixTree(page_size, clock=clock)
        self.room: Eviction
        if demoted_pages:
            self.room = Demotion(
                self.tree,
                self.allocator,
                self.windows,
                self.counts,
                tier,
                demoted_pages=demoted_pages,
                transcode=transcode,
                alloc=self._alloc,
            )
        else:
            self.room = Eviction(self.tree, self.allocator, self.windows, self.counts, tier)
        self.demoted = self.room.demoted  # the demoted copies' allocator (demotion only)
        # The tiers below memory: evicted pages spill there (through `room`), lookups continue there.
        self.tier = tier
        if tier is not None:
            tier.attach(self)

    # ---- the request path ------------------------------------------------------------------------------------
    def acquire(
        self, owner: str, tokens: Tokens, namespace: str = "", max_cached: int | None = None, *, count: bool = True
    ) -> Lease:
        """Match `tokens` (at most `max_cached` of them) and hold what matched.

        Locks the deepest matched node and increfs the shared whole pages, which become `lease.pages`. If the match
        ends k tokens inside a cached page, allocates one private page for the copy (evicting if needed) and sets
        copy_from; the source page stays locked and held until `copied` (or the next publish/extend/release). If that
        page cannot be allocated, the partial hit is dropped instead of failing. Never raises CacheFullError.

        With `count=False` the lookup is left out of the hit statistics until `count_lookup(lease)`: a caller that may
        give the lease back unused (admission declined after all) counts only the lookups it acts on.
        """
        lease = self._open(owner, namespace)
        limit = len(tokens) if max_cached is None else max(0, min(max_cached, len(tokens)))
        key = encode(tokens if limit == len(tokens) else tokens[:limit])
        found = self.tree.match(key, namespace)
        stop = match_stop(self.tree, found, key, namespace, limit)  # before the lease's lock cuts the edges
        readable = self.room.readable(found, key, namespace)
        m = self.windows.readable(self.tree, readable, key, namespace)
        readable_tokens, windowed, whole_read = (
            readable.tokens,
            m.tokens,
            bool(m.pages),
        )  # (m.pages becomes the lease's)
        lease.pages, lease._cover = m.pages, len(m.pages)
        self.allocator.incref(m.pages)
        self.windows.hold_match(lease, m)  # before anything may make room by giving idle window parts back
        if m.partial_tokens:
            self._partial_hit(lease, m)
        elif m.node is not None:
            self._lock(lease, self.tree.cut(m.node, m.node_pages))
        copy = lease.copy_from
        whole = len(lease.pages) if copy is None else len(lease.pages) - 1
        lease.cached_tokens = whole * self.page_size + (copy.tokens if copy is not None else 0)
        lease._lookup = Lookup(len(tokens), lease.cached_tokens, copy.tokens if copy is not None else 0)
        # why it stopped there: a cut below what the tree holds is the window rule's or the room's
        cut = WINDOW_PREFIX_RULE if windowed < readable_tokens else NO_ROOM
        if lease.cached_tokens < windowed and whole_read and not lease.pages:
            cut = WINDOW_PREFIX_RULE  # the partial copy fell through and the whole pages' window was gone
        lease.miss = diagnose(stop, limit, self.page_size, served=lease.cached_tokens, cut=cut, below=self._below())
        if count:
            self.count_lookup(lease)
        return lease

    def _partial_hit(self, lease: Lease, m: Match) -> None:
        """The match ends inside a cached page: lock exactly the pages read (cut the edges there: the rest of a long
        edge stays evictable) and take a private page to copy the matched slots into. Without one, the hit ends
        with the whole pages (or, where their window is gone, is given up)."""
        tree, partial = self.tree, m.partial_node
        assert partial is not None, "a partial hit names the node of its partial page"
        if partial is m.node:
            self._lock(lease, tree.cut(partial, m.node_pages + 1))
        else:
            self._lock(lease, tree.cut(partial, 1))
        try:
            (dst,) = self._alloc(1)
        except CacheFullError:
            locked = lease._node  # the node whose last page is the partial one
            assert locked is not None
            self._lock(lease, self._upper(locked, len(locked.pages) - 1))
            if not self.windows.keep_whole(lease, m):
                self._lock(lease, None)
                self.allocator.decref(lease.pages)
                lease.pages, lease._cover = [], 0
            return
        self.allocator.incref([m.partial_page])
        lease._src, lease.copy_from = m.partial_page, PageCopy(m.partial_page, dst, m.partial_tokens)
        self.room.copying(m.partial_page, dst)
        lease.pages.append(dst)

    def copied(self, lease: Lease) -> None:
        """The engine has copied `lease.copy_from`: the lease no longer needs the source page. Drops its hold and moves
        its lock up to the whole pages it reads, so the source is evictable again (and, if still cached when the
        lease publishes that page, the lease adopts it and frees its copy). No-op without a pending source."""
        self._live(lease)
        if lease._src is None:
            return
        locked = lease._node  # the node whose last page is the source (splits keep the lower part as this node)
        assert locked is not None and locked.pages[-1] == lease._src, "the copy source is not under the lease's lock"
        self._drop_src(lease)
        self._lock(lease, self._upper(locked, len(locked.pages) - 1))

    def extend(self, lease: Lease, tokens: Tokens) -> int:
        """In-flight sharing: adopt the tree's whole pages of `tokens` beyond len(lease.pages) pages (published by
        another request meanwhile). Call it only when every page in lease.pages is fully computed. Increfs and locks
        what it adopts; returns the tokens gained (a multiple of page_size)."""
        self._live(lease)
        held = len(lease.pages)
        if len(tokens) < (held + 1) * self.page_size:
            return 0
        m = self.tree.match(encode(tokens), lease.namespace)
        if len(m.pages) <= held:
            return 0
        new = m.pages[held:]
        if max(new) >= self.num_pages:
            return 0  # demoted meanwhile (its request finished, then it went cold): compute them instead
        if not self.windows.adopt(lease, m.pages, held):
            return 0  # their window parts went (idle, then given back): compute them instead
        self.allocator.incref(new)
        lease.pages += new
        self._drop_src(lease)
        assert m.node is not None, "the match holds pages"
        self._lock(lease, self.tree.cut(m.node, m.node_pages))
        lease._cover = len(lease.pages)
        self.counts.extended += len(new)
        return len(new) * self.page_size

    def publish(self, lease: Lease, tokens: Tokens) -> int:
        """Store the whole pages of `tokens` (the lease's computed tokens, in order) in the tree.

        Pages the tree already holds win (dedup): the lease keeps reading its own copy, freed at release. New pages
        gain the tree's reference; a cached partial tail they cover is replaced (the tree's reference dropped).
        The lock moves to the deepest published node. Returns the number of pages added.
        """
        return self._publish(lease, tokens, tail=False)

    def release(self, lease: Lease, tokens: Tokens | None = None) -> None:
        """Optionally publish `tokens` first (whole pages and the trailing partial page: see the module docstring),
        then unlock and drop the lease's reference on every page it holds (private pages nobody else holds become
        free). Idempotent: releasing twice does nothing."""
        if lease.released:
            return
        try:
            if tokens is not None:
                self._publish(lease, tokens, tail=True)
        finally:
            self._drop_src(lease)
            self._lock(lease, None)
            self._close(lease)

    def _publish(self, lease: Lease, tokens: Tokens, *, tail: bool) -> int:
        n = self._pages_for(lease, tokens, tail=tail)
        if n == 0:
            return 0
        self._drop_src(lease)
        key = encode(tokens)
        if not tail:
            key = key[: n * self.page_size * TOKEN_BYTES]
        result = self.tree.insert(key, lease.pages[:n], lease.namespace, partial=tail)
        self.allocator.incref(result.new_pages)
        self.windows.stored(result.new_pages)
        if result.replaced:
            self.room.unstored(result.replaced)
        if not tail:  # pages the tree already held: read the tree's, free our copies (never hold a page twice)
            self._read_tree_copies(lease, result)
        # The lock only matters while the lease runs; release unlocks right after a tail publish.
        if not tail and n >= lease._cover:  # never move the lock up above pages the lease already reads
            self._lock(lease, result.node)
            lease._cover = n
        self.counts.published += len(result.new_pages)
        return len(result.new_pages)

    def _read_tree_copies(self, lease: Lease, result: InsertResult) -> None:
        for duplicate in result.cached_instead():
            i, cached = duplicate.index, duplicate.tree_page
            if cached >= self.num_pages:
                continue  # a demoted copy is never read: keep computing with our own page
            if not self.windows.swap(lease, i, cached):
                continue  # the tree's copy lost its window part: keep reading our own page's
            self.allocator.incref([cached])
            self.allocator.decref([lease.pages[i]])
            lease.pages[i] = cached

    def _make_room(self, n: int, short: int) -> None:
        evictable = self.tree.evictable_pages - self.tree.evictable_demoted_pages
        if short > evictable:
            held = self.tree.cached_pages - self.tree.demoted_pages - evictable
            raise CacheFullError(
                f"the KV cache needs {n} pages but has {n - short} free and {evictable} evictable "
                f"(of {self.num_pages}; {held} cached pages are locked by {len(self._leases)} live leases or "
                f"pinned, the rest are private to running requests)"
            )
        self.room.free_up(short)

    # ---- admission, admin ------------------------------------------------------------------------------------
    def available_pages(self) -> int:
        """Pages an allocation could get now: free + evictable (or demotable) full-precision pages."""
        return self.allocator.num_free + self.tree.evictable_pages - self.tree.evictable_demoted_pages

    def explain(self, tokens: Tokens, namespace: str = "") -> Explanation:
        """What an admission of prompt `tokens` would be served, page by page, and why it would stop
        (radixcache.explain). Read-only: no LRU touch, no lease, no demoted page brought back."""
        return explain_prompt(self.tree, self.windows, tokens, namespace, self.num_pages, below=self._below())

    def _below(self) -> str:
        """The medium evicted pages are handed to ("" without a tier below memory)."""
        tiers = self.tier.tiers.tiers if self.tier is not None else []
        return tiers[0].medium if tiers else ""

    def match_length(self, tokens: Tokens, namespace: str = "") -> int:
        """Tokens `acquire` would serve from the cache (whole pages + partial page, partial tails included).
        Read-only: not even LRU."""
        return self.windows.servable(self.tree.match(encode(tokens), namespace, touch=False))

    def pin(self, tokens: Tokens, namespace: str = "", ttl: float | None = None, *, keep_unpinned: int = 0) -> int:
        """Pin the cached whole-page prefix of `tokens` (for `ttl` seconds, or until unpin). Returns tokens pinned.

        Raises PinBudgetError, pinning nothing, if the pages it would newly pin take the pinned total past
        `max_pinned_pages`, or past num_pages - `keep_unpinned` (pages the caller promised to running requests).
        Re-pinning what is already pinned (e.g. to extend a TTL) costs nothing and always succeeds."""
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds (or None for no expiry), got {ttl}")
        key = encode(tokens)
        self.tree.expire()
        new = self.tree.pinned_on_path(key, namespace).unpinned
        after = self.tree.pinned_pages + new
        if new and after > self.max_pinned_pages:
            raise PinBudgetError(
                f"pinning {new} more pages would hold {after} pinned pages; the pin budget (--max-pinned) is "
                f"{self.max_pinned_pages} of the {self.num_pages} KV pages ({self.tree.pinned_pages} pinned now)"
            )
        if new and after > self.num_pages - keep_unpinned:
            raise PinBudgetError(
                f"pinning {new} more pages would hold {after} pinned pages, leaving fewer than the {keep_unpinned} "
                f"pages a running request was promised (of {self.num_pages}); retry when it has finished"
            )
        return self.tree.pin(key, namespace, ttl)

    def pinned_pages(self, tokens: Tokens | None = None, namespace: str = "") -> int:
        """Pages pinned now (expired pins dropped first); with `tokens`, only those pinned on a path other than the
        cached whole-page prefix of `tokens` (what a request reading that prefix cannot use)."""
        self.tree.expire()
        total = self.tree.pinned_pages
        if tokens is None:
            return total
        return total - self.tree.pinned_on_path(encode(tokens), namespace).pinned

    def unpin(self, tokens: Tokens, namespace: str = "") -> int:
        """Unpin the cached whole-page prefix of `tokens`. Returns the tokens that were pinned."""
        return self.tree.unpin(encode(tokens), namespace)

    def flush(self, namespace: str | None = None) -> int:
        """Drop every pin and every cached page no lease reads, in `namespace` or (None) in all of them; returns
        pages freed. Live leases stay correct: the paths they lock stay cached until they release."""
        freed = self.tree.flush(namespace)
        self.room.flushed(freed, namespace)
        return len(freed)

    def evict(self, num_pages: int) -> int:
        """Evict up to `num_pages` pages from LRU unlocked, unpinned (full-precision) leaves; returns pages freed."""
        return self.room.evict(num_pages)

    def stats(self, namespace: str | None = None) -> CacheStats:
        """The whole cache's figures, or (namespace given) one tenant's view (radixcache.cache_stats)."""
        tree = self.tree
        # first: it expires due pins, which the pinned counts below must reflect
        evictable = tree.evictable_pages - tree.evictable_demoted_pages
        figures = (
            tree_figures(tree, self.counts, namespace)
            | lease_figures(self._leases.values(), self.counts, namespace)
            | window_figures(self.window)
        )
        if namespace is None:  # the tiers' figures are the whole worker's
            figures |= tier_figures(self.tier)
        return CacheStats(
            pages_total=self.num_pages,
            pages_free=self.allocator.num_free,
            pages_evictable=evictable,
            max_pinned_pages=self.max_pinned_pages,
            **figures,
        )

    def check(self, *, idle: bool = False) -> None:
        """Assert every invariant of the cache (radixcache.cache_check); raise AssertionError naming the broken one
        (and the owner of any lease involved). With `idle=True` (no request running), any live lease is a leak and
        is named."""
        check_prefix_cache(self.tree, self.room, self.windows, self.tier, self._leases.values(), idle=idle)

    # ---- events ----------------------------------------------------------------------------------------------
    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report the pages the tree stores and drops to `sink` (see radixcache.event_log), or stop (None). Call it
        on the cache's thread; with a tree that already holds pages, follow it with a snapshot. With a tier, the
        tier link stays the tree's sink and forwards (adding what the tiers hold, to sinks that take it)."""
        if self.tier is not None:
            self.tier.sink = sink
        else:
            self.tree.set_event_sink(sink)
        self.windows.report_to(sink)  # the window group's events (radixcache.event_log)

    def add_observer(self, observer: EventSink) -> None:
        """A second listener to the tree's page records (`RadixTree.add_observer`), beside the event sink."""
        self.tree.add_observer(observer)

    def remove_observer(self, observer: EventSink) -> None:
        self.tree.remove_observer(observer)

    def page_records(self) -> Iterator[PageRecord]:
        """The tree's pages as records (`RadixTree.page_records`), for a snapshot."""
        return self.tree.page_records()

    def window_pages(self) -> list[int]:
        """The tree pages that still have their window part (window paging; [] without), for a snapshot."""
        return self.windows.tree_pages()

    def tier_records(self) -> list[TierRecord]:
        """What each tier below memory holds, as the events told it so far (snapshots)."""
        return self.tier.tier_records() if self.tier is not None else []

    # ---- internals -------------------------------------------------------------------------------------------
    def _lock(self, lease: Lease, node: Node | None) -> None:
        """Move the lease's lock to `node` (None: no lock). Locks the new node before unlocking the old one."""
        old = lease._node
        if node is old:
            return
        if node is not None:
            self.tree.lock(node)
        if old is not None:
            self.tree.unlock(old)
        lease._node = node

    def _upper(self, node: Node, j: int) -> Node | None:
        """The node ending after the first j pages of `node`'s edge (cut there), or for j == 0 its parent; None
        for the root, which is never locked."""
        if j > 0:
            return self.tree.cut(node, j)
        parent = node.parent
        return parent if parent is not None and parent.parent is not None else None

    def _drop_src(self, lease: Lease) -> None:
        if lease._src is not None:
            self.windows.let_go(lease._src)
            self.allocator.decref([lease._src])
            lease._src = None
