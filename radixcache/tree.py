"""Radix tree over token pages: match, insert with dedup, split, leaf-first LRU eviction, pins with TTL.

Keys are bytes in the format of `radixcache.keys` (4 bytes per token, big-endian; a page is a slice). Edges are
compressed: a node holds a run of pages (`key`, `pages`) with no branching inside. Every page is whole (page_size
tokens) except possibly the last page of a leaf: a partial tail holding 1..page_size-1 valid tokens, stored when a
finished sequence ends mid-page (`insert(..., partial=True)`). Readers only ever copy a tail's first slots (a match
reports it as the partial page), never read it as a whole page, so the tree may replace it: an insert that covers the
same position with a whole page or a longer tail puts its own page there and hands the old one back in
`InsertResult.replaced`; one that is covered by what is cached (a whole page or a tail at least as long) stores nothing
(dedup). Sibling keys are prefix-free: no child's first page is a prefix of another's.

Each namespace has its own root, so a prefix cached for one namespace is a miss for every other.

Ownership: the tree only records which page ids hold which tokens. It never allocates or frees; `insert` returns
the pages it newly stores and `evict`/`flush` return the pages it dropped, and the caller adjusts refcounts.

Events: with an event sink (`set_event_sink`, see `radixcache.events.EventSink`), the tree also reports, by page
id, every run of pages it starts storing (`stored`, with the page it continues and its key), the whole pages it
drops (`removed`: eviction, flush; a partial tail is never reported, stored or removed) and a namespace a flush left
empty (`cleared`). Without a sink the only cost is one None check where pages enter or leave. Observers
(`add_observer`) receive the same records after the event sink: a second hook for the tree's own process (the
speculation index), so setting or clearing the event sink (the cache-event hub's slot) never touches them. An
observer also hears a partial tail leave (`removed([tail page])`: evicted, flushed, or replaced, before what
replaces it is stored), so what it learnt from `stored` (whose key may end in a tail) it can forget exactly.

Protection: a node is protected while its subtree holds a lock (`lock`, counted up to the root) or a pin
(`pin_ref`). Only unprotected leaves are evictable; `radixcache.lru.LeafLRU` keeps them in LRU order incrementally
whenever a node's leaf/lock/pin status or access time changes, so one evicted node costs O(log n) however large the
tree is, and nothing is ever rebuilt. The integrity check lives in `radixcache.tree_check`.

Demotion (the cache's --kv-demote): `set_pages(node, pages, demoted=True)` swaps a node's pages for demoted copies
(the caller made them). The two classes have an LRU each: the full-precision one lists the unprotected nodes
without full-precision children (a node whose children are all demoted is next in line for demotion: its subtree
is cold), the demoted one the unprotected demoted leaves. `lru_leaf(demoted=...)` and `evict(n, demoted=...)` pick
from one class, so the cache demotes the least recently used full-precision node and evicts only demoted leaves;
evicting a full-precision node drops its demoted subtree with it. Without demotion the first LRU is exactly the
evictable leaves. A node's pages are always all demoted or all not: new pages never join a demoted node (a demoted
partial tail that an insert covers is split off and stops being demoted).
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from radixcache.events import FanOut
from radixcache.keys import TOKEN_BYTES
from radixcache.keys import common_prefix as _common
from radixcache.lru import ID_BITS, RECENT, LeafLRU
from radixcache.node import InsertResult, Match, Node, PathPins, PinRecord
from radixcache.recent_evictions import RecentEvictions

if TYPE_CHECKING:
    from radixcache.events import EventSink, PageRecord


class RadixTree:
    """Compressed radix tree keyed by (namespace, token pages). See the module docstring for the contract."""

    def __init__(self, page_size: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.bpp = page_size * TOKEN_BYTES  # bytes per page of key
        self.clock = clock
        self._roots: dict[str, Node] = {}
        self._ids = itertools.count()
        self.recent_evictions = RecentEvictions()  # where eviction dropped a page (radixcache.miss_reasons)
        self._tick = 0  # logical LRU clock: deterministic, and never ties two touches
        self._lru = LeafLRU()  # the evictable leaves, least recently used first
        self._dlru = LeafLRU()  # the evictable demoted leaves, likewise
        self._expiry = SortedList()  # (pin_until, node id) of pins with a TTL
        self._pinned: dict[int, Node] = {}
        self.cached_pages = 0
        self.protected_pages = 0  # pages in nodes whose subtree is locked or pinned
        self.pinned_pages = 0
        self.partial_pages = 0  # cached pages that hold a partial tail
        # Per namespace (a tenant's view of the cache), kept with the totals above: cached and pinned pages.
        self.namespace_cached: dict[str, int] = {}
        self.namespace_pinned: dict[str, int] = {}
        self.demoted_pages = 0  # cached pages in demoted nodes
        self.protected_demoted_pages = 0  # of those, in nodes whose subtree is locked or pinned
        self._events: EventSink | None = None  # the event sink's slot (set_event_sink)
        self._observers: tuple[EventSink, ...] = ()
        self._sink: EventSink | None = None  # what the hot path calls: None, the one sink, or a FanOut of them

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        """Pages that evicting every evictable leaf, repeatedly, would drop (after expiring due pins)."""
        if self._expiry:
            self.expire()
        return self.cached_pages - self.protected_pages

    @property
    def evictable_demoted_pages(self) -> int:
        """Of evictable_pages, those in demoted nodes."""
        if self._expiry:
            self.expire()
        return self.demoted_pages - self.protected_demoted_pages

    @property
    def evictable_leaves(self) -> int:
        return len(self._lru) + len(self._dlru)

    def _lru_of(self, node: Node) -> LeafLRU:
        return self._dlru if node.demoted else self._lru

    def namespaces(self) -> list[str]:
        return list(self._roots)

    @staticmethod
    def _count(table: dict[str, int], namespace: str, delta: int) -> None:
        left = table.get(namespace, 0) + delta
        if left:
            table[namespace] = left
        else:  # a namespace with nothing left takes no room
            table.pop(namespace, None)

    def match(self, key: bytes, namespace: str = "", *, touch: bool = True) -> Match:
        """Longest cached prefix of `key`: whole pages, then the best partial page (token-exact, page_size > 1).

        Never changes the structure. With `touch`, marks the matched path as most recently used.
        """
        ps, bpp, end = self.page_size, self.bpp, len(key)
        pages: list[int] = []
        cur = self._roots.get(namespace)
        if cur is None:
            return Match(pages, None, 0, None, -1, 0, ps)
        root, off, used = cur, 0, -1
        pnode: Node | None = None
        ppage, k = -1, 0
        if touch:
            self._tick += 1
        tick = self._tick
        children = cur.children
        while True:
            if end - off < bpp or (child := children.get(key[off : off + bpp])) is None:
                if bpp > TOKEN_BYTES and off < end and cur.sorted_keys:
                    pnode, k = self._best_child(cur, key[off : off + bpp])
                    if pnode is not None:
                        ppage = pnode.pages[0]
                break
            if touch:
                child.access = tick
                if child.ev_key is not None and child.children:  # listed above demoted children only
                    self._lru.touch(child)
            edge = child.key
            if key.startswith(edge, off):
                cur = child
                if child.tail:  # a partial tail ends the path; found by a whole first page, so it has one before it
                    used = len(child.pages) - 1
                    pages += child.pages[:used]
                    pnode, ppage, k = child, child.pages[used], child.tail
                    break
                pages += child.pages
                off += len(edge)
                children = child.children
                continue
            common = _common(key[off : off + len(edge)], edge)
            used = j = common // bpp
            pages += child.pages[:j]
            cur = child
            k = (common - j * bpp) // TOKEN_BYTES
            if k:
                pnode, ppage = child, child.pages[j]
            break
        node = cur if cur is not root else None
        low = pnode or node
        if touch and low is not None:
            low.access = tick
            if low.ev_key is not None:  # only the lowest node on a path can be a leaf
                lru = self._dlru if low.demoted else self._lru
                if low.ev_key == RECENT:
                    lru.recent.move_to_end(low.id)
                else:
                    lru.touch(low)
        used = 0 if node is None else len(node.pages) if used < 0 else used
        return Match(pages, node, used, pnode, ppage, k, ps)

    def _neighbours(self, node: Node, sk: list[bytes], rem: bytes) -> int:
        """Index of `rem`'s place in `sk` (node.sorted_keys), after dropping the stale entries right next to it."""
        children = node.children
        i = bisect_left(sk, rem)
        while i < len(sk) and sk[i] not in children:
            del sk[i]
        while i > 0 and sk[i - 1] not in children:
            del sk[i - 1]
            i -= 1
        return i

    def _best_child(self, node: Node, rem: bytes) -> tuple[Node | None, int]:
        # In bytes order the longest common prefix with `rem` is a neighbour of rem's insertion point.
        sk = node.sorted_keys
        assert sk is not None, "called only where the node keeps sorted keys"
        i = self._neighbours(node, sk, rem)
        best, best_key = 0, None
        for cand in sk[max(i - 1, 0) : i + 1]:
            tokens = _common(rem, cand) // TOKEN_BYTES
            if tokens > best:
                best, best_key = tokens, cand
        if best_key is None:
            return None, 0
        return node.children[best_key], min(best, self.page_size - 1)

    # ---- insert / split --------------------------------------------------------------------------------------
    def insert(self, key: bytes, pages: list[int], namespace: str = "", *, partial: bool = False) -> InsertResult:
        """Store `pages` (one per whole page of `key`, in order) under `namespace`; already cached pages win.

        With `partial`, `key` may end inside its last page: `pages[-1]` then holds that partial tail (only its first
        len(key) % page_size tokens are valid) and is stored as the last page of a leaf, unless the tree already
        covers those tokens. Whole pages (and longer tails) replace a shorter cached tail: see `replaced`.
        """
        bpp, n = self.bpp, len(pages)
        end = n * bpp
        if len(key) < end:
            if not partial or len(key) <= end - bpp:
                raise ValueError(f"{n} pages need {n * self.page_size} tokens, the key has {len(key) // TOKEN_BYTES}")
            end = len(key)
        elif len(key) > end:
            key = key[:end]
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = Node(b"", [], None, next(self._ids), 0)
            node.namespace = namespace
        self._tick += 1
        tick = self._tick
        node.access = tick
        off = 0
        segments: list[tuple[int, list[int]]] = []
        new_pages: list[int] = []
        replaced: list[int] = []
        while off < end:
            child = node.children.get(key[off : off + bpp])
            if child is None:
                if bpp > TOKEN_BYTES and (node.partial_children or end - off < bpp) and node.sorted_keys:
                    node, new_pages = self._place(
                        node, key[off:end], pages, off // bpp, tick, segments, replaced, namespace
                    )
                else:  # the common case, kept free of the partial-tail checks
                    node = self._attach(key[off:end], pages[off // bpp :], node, tick, namespace)
                    new_pages = node.pages
                break
            edge = child.key
            start = off // bpp
            child.access = tick
            if child.ev_key is not None:
                self._lru_of(child).touch(child)
            if key.startswith(edge, off):
                node = child
                if child.tail:  # the key runs through a cached partial tail: replace it if the key goes further
                    keep = len(child.pages) - 1
                    if off + len(edge) < end:
                        segments.append((start, child.pages[:keep]))
                        new_pages = pages[start + keep :]
                        replaced.append(self._regrow(child, key[off + keep * bpp : end], new_pages, tick, namespace))
                    else:
                        segments.append((start, child.pages))
                    break
                segments.append((start, child.pages))
                off += len(edge)
                continue
            common = _common(key[off : off + len(edge)], edge)
            if common == end - off and end % bpp:  # a partial key that ends inside this edge: already covered
                segments.append((start, child.pages[: -(-common // bpp)]))
                node = child
                break
            j = common // bpp
            node = self._split(child, j)  # the returned node ends exactly where the key does or diverges
            segments.append((start, node.pages))
            off += j * bpp
            if off == end:  # the key ended inside the edge: nothing new
                break
        return InsertResult(node if n else None, new_pages, pages, segments, replaced)

    def _place(
        self,
        parent: Node,
        key: bytes,
        pages: list[int],
        start: int,
        tick: int,
        segments: list,
        replaced: list[int],
        namespace: str,
    ) -> tuple[Node, list[int]]:
        """Store `key` (from page `start` of the insert, so pages[start:]) below `parent`, no child of which starts
        with key's first page, where partial tails may be involved (the key is one, or `parent` has some). A sibling
        covering a partial `key` wins (nothing stored); a partial sibling that key's first page continues is
        replaced. Returns the node reached and the pages stored."""
        bpp = self.bpp
        rem = key[:bpp]
        sk = parent.sorted_keys
        assert sk is not None, "called only where the parent keeps sorted keys"
        i = self._neighbours(parent, sk, rem)
        # Sibling keys are prefix-free, so a sibling starting with rem is the first key at or after rem's place, and
        # a sibling that is a prefix of rem is the key right before it.
        if len(rem) < bpp and i < len(sk) and sk[i].startswith(rem):
            above = parent.children[sk[i]]
            segments.append((start, above.pages[:1]))
            return above, []
        if i > 0 and len(sk[i - 1]) < len(rem) and rem.startswith(sk[i - 1]):
            below = parent.children[sk[i - 1]]
            replaced.append(self._regrow(below, key, pages[start:], tick, namespace))
            return below, pages[start:]
        node = self._attach(key, pages[start:], parent, tick, namespace)
        return node, node.pages

    def _regrow(self, node: Node, key: bytes, pages: list[int], tick: int, namespace: str) -> int:
        """Put `pages` for `key` in place of leaf `node`'s partial tail page (key starts at that page and continues
        its tokens), in place, so that locks on `node` stay valid. Returns the page the tree no longer stores.
        A demoted node's whole pages stay behind in a node of their own: `node` keeps only the tail, then the new
        pages, and is no longer demoted."""
        bpp, keep = self.bpp, len(node.pages) - 1
        if node.demoted:
            if keep:
                self._split(node, keep)  # `node` keeps the lower part: the tail page alone
                keep = 0
            self._set_demoted(node, False)
        parent = node.parent
        assert parent is not None, "a leaf with a tail is never a root"
        old = node.pages[keep]
        self._tail_left(old)
        if self._sink is not None:  # the tail was never reported; what covers it is new
            after = node.pages[keep - 1] if keep else parent.pages[-1] if parent.pages else None
            self._sink.stored(namespace, after, pages, key)
        node.key = node.key[: keep * bpp] + key
        node.pages = node.pages[:keep] + pages
        grown = len(pages) - 1
        self.cached_pages += grown
        self._count(self.namespace_cached, namespace, grown)
        if node.lock or node.pin_ref:
            self.protected_pages += grown
        tail = len(key) % bpp // TOKEN_BYTES
        if not tail:  # the old tail is gone; a longer one would take its place in the count
            self.partial_pages -= 1
        node.tail = tail
        if keep == 0:  # its first page changed: re-key it in the parent
            first = node.first
            del parent.children[first]
            sk = parent.sorted_keys
            assert sk is not None, "a parent of a partial tail keeps sorted keys"
            i = bisect_left(sk, first)
            if i < len(sk) and sk[i] == first:
                del sk[i]
            parent.partial_children -= 1
            node.first = first = node.key[:bpp]
            parent.children[first] = node
            parent.partial_children += len(first) < bpp
            i = bisect_left(sk, first)
            if i == len(sk) or sk[i] != first:
                sk.insert(i, first)
        node.access = tick
        if node.ev_key is not None:
            self._lru_of(node).touch(node)
        return old

    def _attach(self, key: bytes, pages: list[int], parent: Node, tick: int, namespace: str) -> Node:
        node = Node(key, pages, parent, next(self._ids), tick)
        if self._sink is not None:
            self._sink.stored(namespace, parent.pages[-1] if parent.pages else None, pages, key)
        node.first = first = key[: self.bpp]
        parent.children[first] = node
        parent.full_children += 1
        if len(key) % self.bpp:
            node.tail = len(key) % self.bpp // TOKEN_BYTES
            self.partial_pages += 1
            parent.partial_children += len(first) < self.bpp
        if self.bpp > TOKEN_BYTES:
            sk = parent.sorted_keys
            if sk is None:
                parent.sorted_keys = [first]
            else:
                i = bisect_left(sk, first)
                if i == len(sk) or sk[i] != first:  # equal: a stale entry of an evicted child, current again
                    sk.insert(i, first)
        self.cached_pages += len(pages)
        self._count(self.namespace_cached, namespace, len(pages))
        if parent.ev_key is not None:
            self._refresh(parent)
        node.ev_key = RECENT  # listed inline (insert hot path): the newest tick goes last in `recent`
        self._lru.recent[node.id] = node
        return node

    def cut(self, node: Node, j: int) -> Node:
        """The node holding the first j pages of `node`'s edge and ending there: `node` itself when j covers it,
        else a new upper part split off. Locks then protect exactly that prefix, not the rest of the edge."""
        return node if j >= len(node.pages) else self._split(node, j)

    def _split(self, node: Node, j: int) -> Node:
        """Cut `node` after its first j pages; returns the new upper node. `node` keeps the lower part (and so its
        locks, which cover the whole path), the upper inherits the subtree counts and the pin."""
        bpp, cut = self.bpp, j * self.bpp
        parent = node.parent
        assert parent is not None, "a root is never split"
        upper = Node(node.key[:cut], node.pages[:j], parent, next(self._ids), node.access)
        upper.lock, upper.pin_ref, upper.demoted = node.lock, node.pin_ref, node.demoted
        upper.first = node.first
        parent.children[upper.first] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[j:], upper
        node.first = first = node.key[:bpp]
        upper.children[first] = node
        upper.full_children = 0 if node.demoted else 1
        upper.partial_children = len(first) < bpp  # the lower part kept the tail, if any
        if bpp > TOKEN_BYTES:
            upper.sorted_keys = [first]
        if node.pin_until is not None:  # the pages moved up were pinned too: the pinned page count is unchanged
            upper.pin_until = node.pin_until
            self._pinned[upper.id] = upper
            if upper.pin_until != math.inf:
                self._expiry.add((upper.pin_until, upper.id))
            self._adjust(upper, 0, 1)
        return upper

    # ---- protection ------------------------------------------------------------------------------------------
    def _refresh(self, node: Node) -> None:
        """List or unlist `node` as evictable after its leaf/lock/pin status changed."""
        # Full-precision nodes: listed once no child is full precision (then only demoted ones, if any, hang below).
        below = node.children if node.demoted else node.full_children
        if not below and node.lock == 0 and node.pin_ref == 0 and node.parent is not None:
            if node.ev_key is None:
                self._lru_of(node).add(node)
        elif node.ev_key is not None:
            self._lru_of(node).remove(node)

    def _adjust(self, node: Node | None, dlock: int, dpin: int) -> None:
        while node is not None:
            was = node.lock > 0 or node.pin_ref > 0
            node.lock += dlock
            node.pin_ref += dpin
            now = node.lock > 0 or node.pin_ref > 0
            if was != now:
                self.protected_pages += len(node.pages) if now else -len(node.pages)
                if node.demoted:
                    self.protected_demoted_pages += len(node.pages) if now else -len(node.pages)
                self._refresh(node)
            node = node.parent

    def lock(self, node: Node) -> None:
        """One more lease reads the path from the root to `node`: none of it can be evicted until `unlock`."""
        node.own_locks += 1
        self._adjust(node, 1, 0)

    def unlock(self, node: Node) -> None:
        if node.own_locks < 1:
            raise ValueError(f"unlock of node {node.id}, which holds no lock")
        node.own_locks -= 1
        self._adjust(node, -1, 0)

    def _path(self, key: bytes, namespace: str) -> list[Node]:
        """Nodes covering the cached whole-page prefix of `key`, split so that the last one ends exactly there."""
        bpp = self.bpp
        end = len(key) - len(key) % bpp
        node, off, path = self._roots.get(namespace), 0, []
        while node is not None and off < end:
            child = node.children.get(key[off : off + bpp])
            if child is None:
                break
            j = _common(key[off:end], child.key) // bpp
            if j < len(child.pages):
                child = self._split(child, j)
            path.append(child)
            off += j * bpp
            node = child
        return path

    def _set_pin(self, node: Node, until: float | None) -> None:
        old = node.pin_until
        if old == until:
            return
        if old is not None and old != math.inf:
            self._expiry.remove((old, node.id))
        node.pin_until = until
        if until is not None and until != math.inf:
            self._expiry.add((until, node.id))
        if old is None:
            self._pinned[node.id] = node
            self.pinned_pages += len(node.pages)
            self._count(self.namespace_pinned, node.namespace, len(node.pages))
            self._adjust(node, 0, 1)
        elif until is None:
            del self._pinned[node.id]
            self.pinned_pages -= len(node.pages)
            self._count(self.namespace_pinned, node.namespace, -len(node.pages))
            self._adjust(node, 0, -1)

    def pin(self, key: bytes, namespace: str = "", ttl: float | None = None) -> int:
        """Pin the cached whole-page prefix of `key` (never evicted until unpinned or `ttl` seconds pass on the
        clock). Pinning again keeps the later expiry. Returns the number of tokens pinned."""
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds (or None for no expiry), got {ttl}")
        self.expire()
        until = math.inf if ttl is None else self.clock() + ttl
        path = self._path(key, namespace)
        for node in path:
            self._set_pin(node, until if node.pin_until is None else max(node.pin_until, until))
        return sum(len(node.pages) for node in path) * self.page_size

    def pinned_on_path(self, key: bytes, namespace: str = "") -> PathPins:
        """Pinned and unpinned pages of the cached whole-page prefix of `key`: what `pin(key)` would pin anew is
        `unpinned`. Read-only (no split, no LRU touch); expired pins count as unpinned only after `expire()`."""
        bpp = self.bpp
        end = len(key) - len(key) % bpp
        node, off, pinned, unpinned = self._roots.get(namespace), 0, 0, 0
        while node is not None and off < end:
            child = node.children.get(key[off : off + bpp])
            if child is None:
                break
            j = _common(key[off:end], child.key) // bpp
            if child.pin_until is None:
                unpinned += j
            else:
                pinned += j
            if j < len(child.pages):
                break
            off += j * bpp
            node = child
        return PathPins(pinned, unpinned)

    def unpin(self, key: bytes, namespace: str = "") -> int:
        """Unpin the cached whole-page prefix of `key`; returns the number of tokens that were pinned."""
        self.expire()
        unpinned = 0
        for node in self._path(key, namespace):
            if node.pin_until is not None:
                unpinned += len(node.pages)
                self._set_pin(node, None)
        return unpinned * self.page_size

    def expire(self) -> int:
        """Drop every pin whose TTL has passed; returns how many nodes were unpinned."""
        expiry, count = self._expiry, 0
        if expiry:
            now = self.clock()
            while expiry and expiry[0][0] <= now:
                self._set_pin(self._pinned[expiry[0][1]], None)
                count += 1
        return count

    # ---- eviction ------------------------------------------------------------------------------------------
    def evict(
        self, num_pages: int, dropped: dict[str, int] | None = None, *, demoted: bool = False, remember: bool = True
    ) -> list[int]:
        """Drop up to `num_pages` pages from least recently used unprotected leaves (the tail of a leaf first when
        only part of it is needed): full-precision leaves, or with `demoted` only demoted ones. Returns the dropped
        page ids; the caller releases the tree's reference. `dropped`, when given, is added the pages dropped per
        namespace. `remember`: note where pages went in `recent_evictions` (a flush does not: flushed is not
        evicted)."""
        if self._expiry:
            self.expire()
        bpp, need, freed, lru = self.bpp, num_pages, [], self._dlru if demoted else self._lru
        recent, ordered = lru.recent, lru.ordered
        while need > 0 and (recent or ordered):
            # The least recently used listed leaf, looked up inline: this loop is the eviction hot path.
            if not recent:
                node = lru.by_key[ordered[0]]
            else:
                node = recent[next(iter(recent))]
                if ordered and ordered[0] < (node.access << ID_BITS) | node.id:
                    node = lru.by_key[ordered[0]]
            if remember:
                self._remember_eviction(node)
            if node.children:  # a full-precision node above demoted leaves only: they go with it
                gone = self._drop_subtree(node)
                freed += gone
                need -= len(node.pages)
                if dropped is not None:
                    dropped[node.namespace] = dropped.get(node.namespace, 0) + len(gone)
                continue
            n = len(node.pages)
            if n > need:  # only part of this leaf is needed: cut its end (the tail page goes first)
                if node.tail:
                    self.partial_pages -= 1
                keep = n - need
                if remember and n - keep > (1 if node.tail else 0):  # a whole page goes (a tail is no page)
                    self.recent_evictions.add(node.id, node.key[keep * bpp : (keep + 1) * bpp])
                freed += node.pages[keep:]
                if self._sink is not None:
                    self._sink.removed(node.pages[keep : n - 1] if node.tail else node.pages[keep:])
                if node.tail:
                    self._tail_left(node.pages[-1])
                node.pages, node.key, node.tail = node.pages[:keep], node.key[: keep * bpp], 0
                self.cached_pages -= need
                self._count(self.namespace_cached, node.namespace, -need)
                if dropped is not None:
                    dropped[node.namespace] = dropped.get(node.namespace, 0) + need
                if demoted:
                    self.demoted_pages -= need
                break
            freed += self._drop_leaf(node)
            need -= n
            if dropped is not None:
                dropped[node.namespace] = dropped.get(node.namespace, 0) + n
        return freed

    def _remember_eviction(self, node: Node) -> None:
        """`node` is about to be evicted whole: remember its first page as evicted after its parent (unless it is
        only a partial tail, shorter than a page: a tail is never read as a whole page)."""
        page = node.key[: self.bpp]
        if node.parent is not None and len(page) == self.bpp:
            self.recent_evictions.add(node.parent.id, page)

    def root(self, namespace: str) -> Node | None:
        """The namespace's root (no pages), or None when it never held anything."""
        return self._roots.get(namespace)

    def evicted_after(self, node: Node | None, namespace: str, page_key: bytes) -> bool:
        """The page `page_key` that would follow `node` (None: the namespace's root) was recently evicted from there
        (RecentEvictions: a bounded hint). Read-only."""
        anchor = node if node is not None else self._roots.get(namespace)
        return anchor is not None and (anchor.id, page_key) in self.recent_evictions

    def _drop_subtree(self, node: Node) -> list[int]:
        """Drop a listed node and the (unprotected, demoted) subtree below it, children first: every page of it."""
        freed: list[int] = []
        stack, order = [node], []
        while stack:
            top = stack.pop()
            order.append(top)
            stack.extend(top.children.values())
        for below in reversed(order[1:]):
            if not below.children:  # the reversed preorder meets every child before its parent
                freed += self._drop_leaf(below)
        return freed + self._drop_leaf(node)

    def _drop_leaf(self, node: Node) -> list[int]:
        """Remove an evictable (listed) leaf with all its pages; its parent may become an evictable leaf."""
        assert not node.children, f"node {node.id} has children: not a leaf"
        self._lru_of(node).remove(node)
        node.evicted = True
        if self._sink is not None:
            self._sink.removed(node.pages[:-1] if node.tail else node.pages)
        if node.tail:
            self.partial_pages -= 1
            self._tail_left(node.pages[-1])
        self.cached_pages -= len(node.pages)
        self._count(self.namespace_cached, node.namespace, -len(node.pages))
        if node.demoted:
            self.demoted_pages -= len(node.pages)
        parent = node.parent
        assert parent is not None, "a root is never listed"
        del parent.children[node.first]
        parent.full_children -= not node.demoted
        if len(node.first) < self.bpp:
            parent.partial_children -= 1
        sk = parent.sorted_keys
        if not parent.children:
            parent.sorted_keys = None
            self._refresh(parent)
        else:
            if not node.demoted and not parent.full_children:
                self._refresh(parent)  # only demoted children left: next in line for demotion
            if sk is not None and len(sk) > 2 * len(parent.children) + 8:
                parent.sorted_keys = sorted(parent.children)
        return node.pages

    def flush(self, namespace: str | None = None) -> list[int]:
        """Drop the pins, then every node no lease locks: in one namespace, or in all of them (None). Locked paths
        stay (their leases still read them). Returns the dropped page ids."""
        if namespace is None:
            for node in list(self._pinned.values()):
                self._set_pin(node, None)
            holding = [ns for ns, root in self._roots.items() if root.children]
            freed: list[int] = []
            while dropped := self.evict(self.cached_pages, remember=False) + self.evict(
                self.cached_pages, demoted=True, remember=False
            ):
                freed += dropped  # each class's evictions may leave leaves of the other class behind
            if self._sink is not None:
                for ns in holding:
                    if not self._roots[ns].children:
                        self._sink.cleared(ns)
            return freed
        root = self._roots.get(namespace)
        if root is None:
            return []
        held = bool(root.children)
        for node in list(self._pinned.values()):
            top = node
            while top.parent is not None:
                top = top.parent
            if top is root:
                self._set_pin(node, None)
        preorder, stack = [], [root]
        while stack:
            node = stack.pop()
            preorder.append(node)
            stack.extend(node.children.values())
        freed = []
        for node in reversed(preorder):  # children before parents, so emptied parents go too
            if node.ev_key is not None:
                freed += self._drop_leaf(node)
        if self._sink is not None and held and not root.children:
            self._sink.cleared(namespace)
        return freed

    # ---- demotion ------------------------------------------------------------------------------------------
    def lru_leaf(self, *, demoted: bool = False) -> Node | None:
        """The least recently used evictable leaf of one class (full precision, or demoted), or None. Read-only."""
        if self._expiry:
            self.expire()
        lru = self._dlru if demoted else self._lru
        node = lru.recent[next(iter(lru.recent))] if lru.recent else None
        if lru.ordered and (node is None or lru.ordered[0] < (node.access << ID_BITS) | node.id):
            node = lru.by_key[lru.ordered[0]]
        return node

    def set_pages(self, node: Node, pages: list[int], *, demoted: bool) -> list[int]:
        """Let `node` store `pages` instead of its own (as many; the same tokens, copied by the caller, demoted or
        brought back to full precision) and mark it demoted or not. Returns the pages it no longer stores (the
        caller drops the tree's reference). The sink learns the move (`relocated`); no page is stored or removed."""
        old = node.pages
        if len(pages) != len(old):
            raise ValueError(f"node {node.id} holds {len(old)} pages, not {len(pages)}")
        node.pages = list(pages)
        self._set_demoted(node, demoted)
        if self._sink is not None:
            self._sink.relocated(old, node.pages)
        return old

    def _set_demoted(self, node: Node, demoted: bool) -> None:
        if node.demoted == demoted:
            return
        if node.ev_key is not None:  # listed in its old class's LRU
            self._lru_of(node).remove(node)
        sign = 1 if demoted else -1
        self.demoted_pages += sign * len(node.pages)
        if node.lock or node.pin_ref:
            self.protected_demoted_pages += sign * len(node.pages)
        node.demoted = demoted
        self._refresh(node)  # the rule differs between the classes
        parent = node.parent
        assert parent is not None, "a root holds no pages to demote"
        parent.full_children -= sign
        if parent.parent is not None:
            self._refresh(parent)

    # ---- events --------------------------------------------------------------------------------------------
    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report stored/removed/cleared pages to `sink` from now on (None: stop). A sink attached to a tree that
        already holds pages learns them from `page_records` (a snapshot), not from events. Observers are kept."""
        self._events = sink
        self._rewire()

    def add_observer(self, observer: EventSink) -> None:
        """Report the same records to `observer` too, after the event sink, until `remove_observer`. Like the event
        sink it learns what the tree already holds from `page_records`. Adding one twice adds it once."""
        if observer not in self._observers:
            self._observers += (observer,)
            self._rewire()

    def remove_observer(self, observer: EventSink) -> None:
        self._observers = tuple(o for o in self._observers if o is not observer)
        self._rewire()

    def _tail_left(self, page: int) -> None:
        """A partial tail page leaves the tree: only observers hear it (events never name tails)."""
        for observer in self._observers:
            observer.removed([page])

    def _rewire(self) -> None:
        sinks = ((self._events,) if self._events is not None else ()) + self._observers
        self._sink = None if not sinks else sinks[0] if len(sinks) == 1 else FanOut(sinks)

    def page_records(self) -> Iterator[PageRecord]:
        """(namespace, the page continued or None, pages, key) for every node, parents before children: what a
        sink's `stored` would have received to build the tree as it is now."""
        for namespace, root in self._roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                parent = node.parent
                assert parent is not None, "every node below a root has a parent"
                yield namespace, parent.pages[-1] if parent.pages else None, node.pages, node.key
                stack.extend(node.children.values())

    def pins(self) -> Iterator[PinRecord]:
        """Every pinned node's record: pinning each key again until then rebuilds the pins."""
        roots = {id(root): ns for ns, root in self._roots.items()}
        for node in list(self._pinned.values()):
            parts, top = [], node
            while top.parent is not None:
                parts.append(top.key)
                top = top.parent
            until = node.pin_until
            assert until is not None, f"node {node.id} is listed as pinned without a pin"
            yield PinRecord(roots[id(top)], b"".join(reversed(parts)), until)

    # ---- introspection -------------------------------------------------------------------------------------
    def items(self) -> Iterator[tuple[str, bytes, int]]:
        """(namespace, key of the path up to the end of the page, page) for every cached page."""
        bpp = self.bpp
        for namespace, root in self._roots.items():
            stack = [(root, b"")]
            while stack:
                node, prefix = stack.pop()
                for i, page in enumerate(node.pages):
                    yield namespace, prefix + node.key[: (i + 1) * bpp], page
                stack.extend((child, prefix + node.key) for child in node.children.values())

    def nodes(self) -> Iterator[Node]:
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())
