"""PrefixCache: the facade the engine uses. match -> lease -> allocate -> publish -> release; stats; check().

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

Demotion (opt-in, `demoted_pages` > 0 with a `transcode` callback, the engine's --kv-demote): page ids num_pages..
num_pages+demoted_pages-1 hold demoted copies (int4). When an allocation is short of pages, the least recently used
unlocked, unpinned leaf is rewritten into demoted pages instead of being evicted (its full-precision pages become
free), and only demoted leaves are evicted, to make room for newer demotions. Nothing ever reads a demoted page: a
lookup whose match runs through demoted nodes first brings them back (`transcode` into fresh pages, which may
demote other cold leaves); what cannot be brought back is not served (the match stops before it). So a hit on a
demoted prefix reads the values its demotion kept (the answer may differ from a recompute: that is what the flag
trades), no lease ever holds a demoted page, and a publish that meets a demoted page keeps its own copy. With a tier
below memory (radixcache.tiering), a demotion first hands the node's full-precision pages down; demoted pages, and
pages promoted back from them, never go down (the tiers hold exact pages only).

Window parts (a model with sliding-window layers, `window` > 0): a page's sliding layers live in a window slot
(radixcache.window_parts) that the page keeps only while a window needs it. A lease holds the parts of its pages
from `first_needed(position)` on (`slide` lets the older ones go as the sequence grows); the tree keeps idle parts of
the pages it stores until slots run short. The prefix rule: a hit of h tokens needs the full part of every page
before h and the window part of every page holding one of positions h-W+1..h-1 (what the first new query's window
reads); `acquire` cuts a match to the longest prefix that has both (docs/MODULES.md). Window parts and demotion or
tiers below memory do not combine yet (refused at construction).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixcache.keys import TOKEN_BYTES, encode
from radixcache.node import Match, Node
from radixcache.pages import PageAllocator
from radixcache.tier import MEDIUM_DISK, MEDIUM_HOST
from radixcache.tree import RadixTree
from radixcache.tree_check import check_tree
from radixcache.window_parts import WindowParts

if TYPE_CHECKING:
    from radixcache.events import EventSink
    from radixcache.tier import CacheTier, PageKey

Tokens = Sequence[int]
TIER_DISK_FIGURES = ("queued_pages", "dropped_pages", "corrupt_pages", "write_errors")


class CacheFullError(RuntimeError):
    """An allocation is impossible even after evicting everything evictable. Nothing was changed."""


class PinBudgetError(RuntimeError):
    """A pin would exceed the pin budget, or take pages that running requests were promised. Nothing was pinned."""


@dataclass(eq=False)
class Lease:
    """One running sequence's hold on the cache. Compare by identity; treat the fields as read-only.

    pages: the block table in token order: shared (tree) pages first, then private pages (allocated by this lease;
    freed at release unless published). copy_from: (src_page, dst_page, k) when the hit ends k tokens into a cached
    page: the engine copies the first k slots of src into dst (== pages[-1]) before its next call on this lease, and
    then calls `PrefixCache.copied` so the lease stops holding src.
    """

    owner: str
    namespace: str
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    copy_from: tuple[int, int, int] | None = None
    released: bool = False
    _id: int = field(default=0, repr=False)
    _node: Node | None = field(default=None, repr=False)  # the node this lease locks
    _cover: int = field(default=0, repr=False)  # leading pages of `pages` that must stay under the lock
    _src: int | None = field(default=None, repr=False)  # copy source, held until copied (or publish/extend/release)
    _lookup: tuple[int, int, int] = field(default=(0, 0, 0), repr=False)  # (queried, hit, copied) not yet counted
    _wfirst: int = field(default=0, repr=False)  # window parts: the lease holds those of pages[_wfirst:] (and _src's)


@dataclass
class CacheStats:
    pages_total: int
    pages_free: int
    pages_cached: int  # stored in the tree
    pages_evictable: int  # cached pages that eviction could drop now (not locked by a lease, not pinned)
    pages_pinned: int
    pages_in_use: int  # distinct pages held by live leases (shared or private)
    queried_tokens: int  # prompt tokens looked up by acquire
    hit_tokens: int  # of those, served from the cache (whole pages + partial-page copies)
    copied_tokens: int  # hit tokens served by copying the first slots of a partially matching page
    extended_pages: int  # pages adopted in flight by extend (published by another request meanwhile)
    published_pages: int  # pages newly stored in the tree by publish (and release, partial tails included)
    evicted_pages: int  # dropped to make room (allocate) or by evict()
    flushed_pages: int  # dropped by flush()
    live_leases: int
    evictable_leaves: int
    namespaces: int
    pages_partial: int = 0  # cached pages holding a partial tail (the last, unfinished page of a released sequence)
    max_pinned_pages: int = 0  # the pin budget: pins never hold more pages than this
    # The tiers below memory (radixcache.tiering; all 0 without one). spilled: evicted pages handed to a tier;
    # spill_dropped: evicted pages a tier's full write queue refused; loaded: pages brought back into the pool.
    spilled_pages: int = 0
    spill_dropped_pages: int = 0
    host_loaded_pages: int = 0
    disk_loaded_pages: int = 0
    # Each tier's own figures (radixcache.tier.TierStats), by medium: host memory, then the disk store.
    host_pages: int = 0
    host_bytes: int = 0
    host_capacity_bytes: int = 0
    host_evicted_pages: int = 0
    disk_pages: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    disk_queued_pages: int = 0
    disk_dropped_pages: int = 0
    disk_evicted_pages: int = 0
    disk_corrupt_pages: int = 0
    disk_write_errors: int = 0
    disk_ready: int = 0  # 1 once the disk store is open and its index rebuilt (a fleet sums its replicas)
    pages_demoted: int = 0  # cached pages held demoted now (not counted in pages_total / pages_free / pages_cached)
    demoted_pages: int = 0  # pages demoted instead of evicted, since start
    promoted_pages: int = 0  # demoted pages brought back by a hit, since start
    # Window parts (a model with sliding layers; all 0 otherwise): the sliding layers' slots, how many are free, how
    # many only the tree keeps (idle, given back first when slots run short) and how many were given back so.
    window_slots_total: int = 0
    window_slots_free: int = 0
    window_parts_idle: int = 0
    window_parts_dropped: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Prefix-sharing KV page cache. Page ids match a KVPool with the same num_pages and page_size.

    Not thread-safe: one engine thread owns it. With `enabled=False` it is a plain page allocator with the same API
    (acquire matches nothing, publish stores nothing, release frees), so the engine runs the same kernels either way.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        max_pinned_pages: int | None = None,
        tier: CacheTier | None = None,
        demoted_pages: int = 0,
        transcode: Callable[[list[int], list[int]], None] | None = None,
        window: int = 0,
        window_slots: int = 0,
    ) -> None:
        self.num_pages, self.page_size, self.enabled = num_pages, page_size, enabled
        # Pins never hold more than this (None: the whole pool), so they cannot starve the requests that run.
        self.max_pinned_pages = num_pages if max_pinned_pages is None else max(0, min(max_pinned_pages, num_pages))
        self.allocator = PageAllocator(num_pages)
        # Demotion: demoted page ids follow the full-precision ones; transcode(src, dst) copies pages between them.
        if demoted_pages and transcode is None:
            raise ValueError("demoted pages need a transcode callback to fill them")
        self.demoted = PageAllocator(demoted_pages, first=num_pages) if demoted_pages else None
        self._transcode = transcode
        self._demotions = self._promotions = 0
        self.tree = RadixTree(page_size, clock=clock)
        # Window parts: the sliding layers' slots (window: their W; 0 when no layer slides or the pool keeps every
        # layer in the page itself).
        self.window: WindowParts | None = None
        if window:
            if demoted_pages or tier is not None:
                raise ValueError("window parts (sliding layers paged apart) do not combine with demotion or tiers yet")
            if window_slots < 1:
                raise ValueError(f"window parts need window slots, got {window_slots}")
            self.window = WindowParts(num_pages, window_slots, window=window, page_size=page_size)
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._queried = self._hit = self._copied = self._extended = self._published = 0
        self._evicted = self._flushed = 0
        # The tiers below memory: evicted pages spill there, lookups continue there (radixcache.tiering).
        self.tier = tier
        if tier is not None:
            tier.attach(self)
        self._lookups: dict[str, list[int]] = {}  # namespace -> [queried, hit, copied] tokens
        self._evicted_from: dict[str, int] = {}  # namespace -> its pages evicted

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
        if not owner:
            raise ValueError("a lease needs an owner (the request id), so that a leak can name it")
        lease = Lease(owner, namespace, _id=next(self._lease_ids))
        self._leases[lease._id] = lease
        lease._lookup = (len(tokens), 0, 0)
        if not self.enabled:
            if count:
                self.count_lookup(lease)
            return lease
        limit = len(tokens) if max_cached is None else max(0, min(max_cached, len(tokens)))
        key = encode(tokens if limit == len(tokens) else tokens[:limit])
        m = self.tree.match(key, namespace)
        if self.demoted is not None and self._reads_demoted(m):
            m = self._promote(m, key, namespace)
        w = self.window
        if w is not None and (usable := w.hit_limit(self._match_pages(m), m.tokens)) < m.tokens:
            m = self.tree.match(key[: usable * TOKEN_BYTES], namespace, touch=False)  # what the window can continue
        lease.pages, lease._cover = m.pages, len(m.pages)
        self.allocator.incref(m.pages)
        cached = len(m.pages) * self.page_size
        if w is not None:  # hold the window parts read before anything may make room by giving idle ones back
            lease._wfirst = w.first_needed(m.tokens)
            for page in self._match_pages(m)[lease._wfirst :]:
                w.hold(page)
        tree, node, used = self.tree, m.node, m.node_pages
        if m.partial_tokens:
            # Lock exactly the pages read (cut the edges there): the rest of a long edge stays evictable.
            if m.partial_node is node:
                node = tree.cut(node, used + 1)
                self._lock(lease, node)
            else:
                self._lock(lease, tree.cut(m.partial_node, 1))
            try:
                (dst,) = self._alloc(1)
            except CacheFullError:
                self._lock(lease, self._upper(lease._node, len(lease._node.pages) - 1))
                if w is not None:
                    self._window_without_partial(lease, m)
                    cached = len(lease.pages) * self.page_size
            else:
                self.allocator.incref([m.partial_page])
                lease._src, lease.copy_from = m.partial_page, (m.partial_page, dst, m.partial_tokens)
                if self.tier is not None:
                    self.tier.copying(m.partial_page, dst)
                lease.pages.append(dst)
                cached += m.partial_tokens
        elif node is not None:
            self._lock(lease, tree.cut(node, used))
        lease.cached_tokens = cached
        lease._lookup = (len(tokens), cached, m.partial_tokens if lease.copy_from else 0)
        if count:
            self.count_lookup(lease)
        return lease

    def _window_without_partial(self, lease: Lease, m: Match) -> None:
        """acquire's partial hit fell through (no page for the copy): the lease continues after m's whole pages,
        whose window starts a page earlier, perhaps; without the parts that needs, it gives up the hit."""
        w = self.window
        assert w is not None
        w.let_go(m.partial_page)
        whole = len(m.pages) * self.page_size
        first = w.first_needed(whole)
        if w.hit_limit(m.pages, whole) == whole:
            for page in m.pages[first : lease._wfirst]:
                w.hold(page)
            lease._wfirst = min(first, lease._wfirst)
            return
        for page in m.pages[lease._wfirst :]:
            w.let_go(page)
        self._lock(lease, None)
        self.allocator.decref(lease.pages)
        lease.pages, lease._cover, lease._wfirst = [], 0, 0

    def count_lookup(self, lease: Lease) -> None:
        """Add the lookup of a lease acquired with count=False to the statistics (queried, hit and copied tokens).
        Counts once: a second call does nothing."""
        queried, hit, copied = lease._lookup
        self._queried += queried
        self._hit += hit
        self._copied += copied
        if queried:
            mine = self._lookups.setdefault(lease.namespace, [0, 0, 0])
            mine[0] += queried
            mine[1] += hit
            mine[2] += copied
        lease._lookup = (0, 0, 0)

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
        if not self.enabled or len(tokens) < (held + 1) * self.page_size:
            return 0
        m = self.tree.match(encode(tokens), lease.namespace)
        if len(m.pages) <= held:
            return 0
        new = m.pages[held:]
        if self.demoted is not None and max(new) >= self.num_pages:
            return 0  # demoted meanwhile (its request finished, then it went cold): compute them instead
        w = self.window
        if w is not None:
            first = max(lease._wfirst, w.first_needed(len(m.pages) * self.page_size))
            if not w.has_parts(m.pages[max(first, held) :]):
                return 0  # their window parts went (idle, then given back): compute them instead
            for page in lease.pages[lease._wfirst : min(first, held)]:
                w.let_go(page)
            for page in m.pages[max(first, held) :]:
                w.hold(page)
            lease._wfirst = first
        self.allocator.incref(new)
        lease.pages += new
        self._drop_src(lease)
        self._lock(lease, self.tree.cut(m.node, m.node_pages))
        lease._cover = len(lease.pages)
        self._extended += len(new)
        return len(new) * self.page_size

    def allocate(self, lease: Lease, n: int) -> list[int]:
        """n more private pages (refcount 1, held by the lease) appended to lease.pages. Evicts LRU unlocked,
        unpinned leaves when the free list is short; raises CacheFullError, changing nothing, if that cannot help."""
        self._live(lease)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        pages = self._alloc(n)
        lease.pages += pages
        return pages

    def slide(self, lease: Lease, position: int) -> None:
        """The lease's next query is at `position` (its computed tokens): let go of the window parts its sliding
        layers will never read again (pages wholly before position - W + 1). No-op without window parts."""
        w = self.window
        if w is None:
            return
        self._live(lease)
        first = min(w.first_needed(position), len(lease.pages))
        for page in lease.pages[lease._wfirst : first]:
            w.let_go(page)
        lease._wfirst = max(lease._wfirst, first)

    def window_slots(self, pages: list[int]) -> list[int]:
        """The window slot of each page (-1: none); [] without window parts."""
        if self.window is None:
            return []
        slot = self.window.slot
        return [slot[p] for p in pages]

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
            if self.window is not None:
                for page in lease.pages[lease._wfirst :]:
                    self.window.let_go(page)
            self.allocator.decref(lease.pages)
            lease.pages, lease.released = [], True
            del self._leases[lease._id]

    # ---- admission, admin ------------------------------------------------------------------------------------
    def available_pages(self) -> int:
        """Pages an allocation could get now: free + evictable (or demotable) full-precision pages."""
        return self.allocator.num_free + self.tree.evictable_pages - self.tree.evictable_demoted_pages

    def match_length(self, tokens: Tokens, namespace: str = "") -> int:
        """Tokens `acquire` would serve from the cache (whole pages + partial page, partial tails included).
        Read-only: not even LRU."""
        if not self.enabled:
            return 0
        m = self.tree.match(encode(tokens), namespace, touch=False)
        return m.tokens if self.window is None else self.window.hit_limit(self._match_pages(m), m.tokens)

    def pin(self, tokens: Tokens, namespace: str = "", ttl: float | None = None, *, keep_unpinned: int = 0) -> int:
        """Pin the cached whole-page prefix of `tokens` (for `ttl` seconds, or until unpin). Returns tokens pinned.

        Raises PinBudgetError, pinning nothing, if the pages it would newly pin take the pinned total past
        `max_pinned_pages`, or past num_pages - `keep_unpinned` (pages the caller promised to running requests).
        Re-pinning what is already pinned (e.g. to extend a TTL) costs nothing and always succeeds."""
        if not self.enabled:
            return 0
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds (or None for no expiry), got {ttl}")
        key = encode(tokens)
        self.tree.expire()
        _, new = self.tree.pinned_on_path(key, namespace)
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
        if tokens is None or not self.enabled:
            return total
        return total - self.tree.pinned_on_path(encode(tokens), namespace)[0]

    def unpin(self, tokens: Tokens, namespace: str = "") -> int:
        """Unpin the cached whole-page prefix of `tokens`. Returns the tokens that were pinned."""
        return self.tree.unpin(encode(tokens), namespace) if self.enabled else 0

    def flush(self, namespace: str | None = None) -> int:
        """Drop every pin and every cached page no lease reads, in `namespace` or (None) in all of them; returns
        pages freed. Live leases stay correct: the paths they lock stay cached until they release."""
        freed = self.tree.flush(namespace)
        if self.tier is not None:  # flushed means gone: never spilled, and gone from the tiers too
            self.tier.discard()
            self.tier.flush(namespace)
        self._drop_tree_refs(freed)
        self._flushed += len(freed)
        return len(freed)

    def evict(self, num_pages: int) -> int:
        """Evict up to `num_pages` pages from LRU unlocked, unpinned (full-precision) leaves; returns pages freed."""
        freed = self.tree.evict(num_pages, self._evicted_from)
        if self.tier is not None:
            self.tier.spill(freed)  # before the pages are free: their data is still in the pool
        self._drop_tree_refs(freed)
        self._evicted += len(freed)
        return len(freed)

    def stats(self, namespace: str | None = None) -> CacheStats:
        """The whole cache's figures, or (namespace given) one tenant's view: that namespace's cached (demoted
        included) and pinned pages, leases, pages they read, lookups and evicted pages, beside the pool's capacity (pages_total,
        pages_free, pages_evictable, max_pinned_pages); the counters kept only for the whole cache read 0."""
        tree = self.tree
        # first: it expires due pins, which the pinned counts below must reflect
        evictable = tree.evictable_pages - tree.evictable_demoted_pages
        if namespace is None:
            leases = list(self._leases.values())
            queried, hit, copied = self._queried, self._hit, self._copied
            own = {
                "pages_pinned": tree.pinned_pages,
                "extended_pages": self._extended,
                "published_pages": self._published,
                "evicted_pages": self._evicted,
                "flushed_pages": self._flushed,
                "evictable_leaves": tree.evictable_leaves,
                "namespaces": len(tree.namespaces()),
                "pages_partial": tree.partial_pages,
                "pages_cached": tree.cached_pages - tree.demoted_pages,
                "pages_demoted": tree.demoted_pages,
                "demoted_pages": self._demotions,
                "promoted_pages": self._promotions,
            }
        else:
            leases = [lease for lease in self._leases.values() if lease.namespace == namespace]
            queried, hit, copied = self._lookups.get(namespace, (0, 0, 0))
            own = {
                "pages_cached": tree.namespace_cached.get(namespace, 0),
                "pages_pinned": tree.namespace_pinned.get(namespace, 0),
                "evicted_pages": self._evicted_from.get(namespace, 0),
                "namespaces": int(namespace in tree.namespace_cached),
            }
        return CacheStats(
            pages_total=self.num_pages,
            pages_free=self.allocator.num_free,
            pages_evictable=evictable,
            max_pinned_pages=self.max_pinned_pages,
            pages_in_use=len({page for lease in leases for page in lease.pages}),
            live_leases=len(leases),
            queried_tokens=queried,
            hit_tokens=hit,
            copied_tokens=copied,
            **{"extended_pages": 0, "published_pages": 0, "flushed_pages": 0, "evictable_leaves": 0}
            | own
            | (self._tier_stats() if namespace is None else {})  # the tiers' figures are the whole worker's
            | self._window_stats(),
        )

    def _window_stats(self) -> dict:
        w = self.window
        if w is None:
            return {}
        return {
            "window_slots_total": w.slots.num_pages,
            "window_slots_free": w.num_free,
            "window_parts_idle": w.idle_parts,
            "window_parts_dropped": w.dropped,
        }

    def _tier_stats(self) -> dict:
        if self.tier is None:
            return {}
        counts = self.tier.counts
        out = {
            "spilled_pages": counts.spilled_pages,
            "spill_dropped_pages": counts.spill_dropped_pages,
            "host_loaded_pages": counts.loaded_pages.get(MEDIUM_HOST, 0),
            "disk_loaded_pages": counts.loaded_pages.get(MEDIUM_DISK, 0),
        }
        for t in self.tier.tiers.stats():
            prefix = {MEDIUM_HOST: "host_", MEDIUM_DISK: "disk_"}[t.medium]
            out |= {prefix + name: getattr(t, name) for name in ("pages", "bytes", "capacity_bytes", "evicted_pages")}
            if t.medium == MEDIUM_DISK:
                out |= {f"disk_{name}": getattr(t, name) for name in TIER_DISK_FIGURES}
                out["disk_ready"] = int(t.ready)
        return out

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report the pages the tree stores and drops to `sink` (see radixcache.event_log), or stop (None). Call it
        on the cache's thread; with a tree that already holds pages, follow it with a snapshot. With a tier, the
        tier link stays the tree's sink and forwards (adding what the tiers hold, to sinks that take it)."""
        if self.tier is not None:
            self.tier.sink = sink
        else:
            self.tree.set_event_sink(sink)
        if self.window is not None:  # the window group's events (radixcache.event_log)
            self.window.on_dropped = getattr(sink, "window_removed", None)

    def window_pages(self) -> list[int]:
        """The tree pages that still have their window part (window paging; [] without), for a snapshot."""
        if self.window is None:
            return []
        slot = self.window.slot
        return [p for p in self.window.tree_pages() if slot[p] >= 0]

    def tier_records(self) -> list[tuple[str, PageKey]]:
        """(medium, key) of each page a tier below memory holds, as the events told it so far (snapshots)."""
        return self.tier.tier_records() if self.tier is not None else []

    def add_observer(self, observer: EventSink) -> None:
        """A second listener to the tree's page records (`RadixTree.add_observer`), beside the event sink."""
        self.tree.add_observer(observer)

    def remove_observer(self, observer: EventSink) -> None:
        self.tree.remove_observer(observer)

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def check(self, *, idle: bool = False) -> None:
        """Assert every invariant of the cache; raise AssertionError naming the broken one (and the owner of any
        lease involved). With `idle=True` (no request running), any live lease is a leak and is named."""
        self.allocator.check()
        if self.demoted is not None:
            self.demoted.check()
        check_tree(self.tree)
        total = self.num_pages + (self.demoted.num_pages if self.demoted is not None else 0)
        expected = [0] * total
        in_tree: dict[int, Node] = {}
        for node in self.tree.nodes():
            for page in node.pages:
                expected[page] += 1
                in_tree[page] = node
                assert (page >= self.num_pages) == node.demoted, (
                    f"node {node.id} ({'' if node.demoted else 'not '}demoted) stores page {page}"
                )
        locks: dict[int, int] = {}
        readers: dict[int, list[str]] = {}
        for lease in self._leases.values():
            who = f"lease of {lease.owner!r}"
            assert lease.owner, "a live lease has no owner"
            assert not lease.released, f"{who} is released but still registered"
            held = lease.pages + ([lease._src] if lease._src is not None else [])
            assert not held or max(held) < self.num_pages, f"{who} holds a demoted page"
            for page in held:
                expected[page] += 1
                readers.setdefault(page, []).append(lease.owner)
                node = in_tree.get(page)
                assert node is None or node.lock > 0, f"{who} reads page {page} in unlocked node {node.id}"
            node = lease._node
            if node is not None:
                assert not node.evicted, f"{who} locks evicted node {node.id}"
                locks[node.id] = locks.get(node.id, 0) + 1
                while node.parent is not None:
                    node = node.parent
                root = self.tree._roots.get(lease.namespace)
                assert node is root, f"{who} (namespace {lease.namespace!r}) locks a node of another namespace"
        for node in self.tree.nodes():
            assert node.own_locks == locks.get(node.id, 0), f"node {node.id}: {node.own_locks} locks recorded, " + (
                f"{locks.get(node.id, 0)} leases hold one"
            )
        for page, want in enumerate(expected):
            got = self._allocator_of(page).refcount(page)
            if got != want:
                tree = "the tree" if page in in_tree else "not the tree"
                raise AssertionError(
                    f"page {page}: refcount {got} but {want} holders ({tree}; leases: {readers.get(page, [])}); "
                    + ("leaked page" if got > want else "a holder lost its reference")
                )
        if self.window is not None:
            holds: dict[int, int] = {}
            for lease in self._leases.values():
                for page in lease.pages[lease._wfirst :] + ([lease._src] if lease._src is not None else []):
                    holds[page] = holds.get(page, 0) + 1
            self.window.check(holds, set(in_tree))
        if idle and self._leases:
            owners = sorted({lease.owner for lease in self._leases.values()})
            raise AssertionError(f"{len(self._leases)} leases leaked while idle, owned by {owners}")
        if self.tier is not None:
            self.tier.check()

    # ---- internals -------------------------------------------------------------------------------------------
    def _live(self, lease: Lease) -> None:
        if lease.released or self._leases.get(lease._id) is not lease:
            raise ValueError(f"the lease of {lease.owner!r} is released or belongs to another cache")

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

    def _publish(self, lease: Lease, tokens: Tokens, *, tail: bool) -> int:
        self._live(lease)
        ps = self.page_size
        n = -(-len(tokens) // ps) if tail else len(tokens) // ps
        if n > len(lease.pages):
            raise ValueError(f"{len(tokens)} computed tokens need {n} pages; the lease holds {len(lease.pages)}")
        if not self.enabled or n == 0:
            return 0
        self._drop_src(lease)
        key = encode(tokens)
        if not tail:
            key = key[: n * ps * TOKEN_BYTES]
        result = self.tree.insert(key, lease.pages[:n], lease.namespace, partial=tail)
        self.allocator.incref(result.new_pages)
        if self.window is not None:
            self.window.stored(result.new_pages)
        self._drop_tree_refs(result.replaced)
        if not tail:  # pages the tree already held: read the tree's, free our copies (never hold a page twice)
            for i, cached in result.cached_instead():
                if cached >= self.num_pages:
                    continue  # a demoted copy is never read: keep computing with our own page
                if self.window is not None and i >= lease._wfirst and not self.window.swap(lease.pages[i], cached):
                    continue  # the tree's copy lost its window part: keep reading our own page's
                self.allocator.incref([cached])
                self.allocator.decref([lease.pages[i]])
                lease.pages[i] = cached
        # The lock only matters while the lease runs; release unlocks right after a tail publish.
        if not tail and n >= lease._cover:  # never move the lock up above pages the lease already reads
            self._lock(lease, result.node)
            lease._cover = n
        self._published += len(result.new_pages)
        return len(result.new_pages)

    def _upper(self, node: Node, j: int) -> Node | None:
        """The node ending after the first j pages of `node`'s edge (cut there), or for j == 0 its parent; None
        for the root, which is never locked."""
        if j > 0:
            return self.tree.cut(node, j)
        parent = node.parent
        return parent if parent is not None and parent.parent is not None else None

    def _drop_src(self, lease: Lease) -> None:
        if lease._src is not None:
            if self.window is not None:
                self.window.let_go(lease._src)
            self.allocator.decref([lease._src])
            lease._src = None

    def _alloc(self, n: int) -> list[int]:
        w = self.window
        if w is not None and n > w.available():
            raise CacheFullError(
                f"the KV cache needs {n} window slots for its sliding layers but has {w.num_free} free and "
                f"{w.idle_parts} idle (of {w.slots.num_pages}); the rest are read by running requests' windows"
            )
        free = self.allocator.num_free
        if n > free:
            evictable = self.tree.evictable_pages - self.tree.evictable_demoted_pages
            if n > free + evictable:
                held = self.tree.cached_pages - self.tree.demoted_pages - evictable
                raise CacheFullError(
                    f"the KV cache needs {n} pages but has {free} free and {evictable} evictable "
                    f"(of {self.num_pages}; {held} cached pages are locked by {len(self._leases)} live leases or "
                    f"pinned, the rest are private to running requests)"
                )
            short = n - free - (self._demote(n - free) if self.demoted is not None else 0)
            if short > 0:  # (with demotion: the full-precision nodes' demoted subtrees go with them)
                freed = self.tree.evict(short, self._evicted_from)
                if self.tier is not None:
                    self.tier.spill(freed)  # before the pages are free: their data is still in the pool
                self._drop_tree_refs(freed)
                self._evicted += len(freed)
        pages = self.allocator.alloc(n)
        if w is not None:
            w.make_room(n)
            w.attach(pages)
        return pages

    # ---- demotion ------------------------------------------------------------------------------------------
    def _allocator_of(self, page: int) -> PageAllocator:
        return self.allocator if page < self.num_pages or self.demoted is None else self.demoted

    def _drop_tree_refs(self, pages: list[int]) -> None:
        """Drop the tree's reference on pages it no longer stores, full-precision or demoted."""
        if self.window is not None:
            self.window.unstored(pages)
        if self.demoted is None:
            self.allocator.decref(pages)
            return
        self.allocator.decref([p for p in pages if p < self.num_pages])
        self.demoted.decref([p for p in pages if p >= self.num_pages])

    def _demote(self, need: int) -> int:
        """Free at least `need` full-precision pages, if it can, by rewriting the least recently used full-precision
        nodes without full-precision children, whole, into demoted pages; returns the pages freed. Stops at a node
        larger than the demoted pages free or evictable (the caller then evicts it, its demoted subtree with it)."""
        assert self.demoted is not None and self._transcode is not None
        done = 0
        while done < need and (node := self.tree.lru_leaf()) is not None:
            k = len(node.pages)
            if k > self.demoted.num_free + self.tree.evictable_demoted_pages:
                break
            self._demoted_room(k)
            dst = self.demoted.alloc(k)
            self._transcode(node.pages, dst)
            self.allocator.decref(self.tree.set_pages(node, dst, demoted=True))  # no lease holds them: now free
            self._demotions += k
            done += k
        return done

    def _demoted_room(self, k: int) -> None:
        """Make k demoted pages free (k <= free + evictable demoted), evicting the least recently used demoted
        leaves."""
        assert self.demoted is not None
        free = self.demoted.num_free
        if k > free:
            freed = self.tree.evict(k - free, demoted=True)
            if self.tier is not None:
                self.tier.spill(freed)  # (demoted pages never go down: the tier took their full precision)
            self.demoted.decref(freed)
            self._evicted += len(freed)

    @staticmethod
    def _match_pages(m: Match) -> list[int]:
        """A match's pages in token order, the partial one last."""
        return m.pages + [m.partial_page] if m.partial_tokens else m.pages

    def _reads_demoted(self, m: Match) -> bool:
        return bool(m.pages and max(m.pages) >= self.num_pages) or (
            m.partial_tokens and m.partial_page >= self.num_pages
        )

    def _promote(self, m: Match, key: bytes, namespace: str) -> Match:
        """Bring the demoted nodes on m's path back to full precision (root first) and match again; if pages run
        out first, the match stops before its first page still demoted."""
        assert self.demoted is not None and self._transcode is not None
        guard = m.partial_node or m.node
        assert guard is not None
        path = []
        node: Node | None = guard
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        self.tree.lock(guard)  # the path must survive the demotions and evictions that make room for it
        try:
            for node in reversed(path):
                if not node.demoted:
                    continue
                try:
                    dst = self._alloc(len(node.pages))
                except CacheFullError:
                    break
                self._transcode(node.pages, dst)
                self.demoted.decref(self.tree.set_pages(node, dst, demoted=False))
                self._promotions += len(dst)
        finally:
            self.tree.unlock(guard)
        m = self.tree.match(key, namespace, touch=False)
        if self._reads_demoted(m):
            whole = next((i for i, p in enumerate(m.pages) if p >= self.num_pages), len(m.pages))
            m = self.tree.match(key[: whole * self.page_size * TOKEN_BYTES], namespace, touch=False)
        return m
