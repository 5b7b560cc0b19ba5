"""Radix tree over token pages: match, insert with dedup, split, leaf-first LRU eviction, pins with TTL.

Key format: a token sequence is encoded once as `bytes`, 4 bytes per token, big-endian (`encode`). A page is a slice of
4 x page_size bytes, so a child lookup is one dict lookup on the first page's bytes, an edge comparison is one
`bytes.startswith` (memcmp), and bytes order equals token order (used to find the best partial page by bisection).
Edges are compressed: a node holds a run of pages (`key`, `pages`) with no branching inside. Every page is whole
(page_size tokens) except possibly the last page of a leaf: a partial tail holding 1..page_size-1 valid tokens,
stored when a finished sequence ends mid-page (`insert(..., partial=True)`). Readers only ever copy a tail's first
slots (a match reports it as the partial page), never read it as a whole page, so the tree may replace it: an insert
that covers the same position with a whole page or a longer tail puts its own page there and hands the old one back
in `InsertResult.replaced`; one that is covered by what is cached (a whole page or a tail at least as long) stores
nothing (dedup). Sibling keys are prefix-free: no child's first page is a prefix of another's.

Each namespace has its own root, so a prefix cached for one namespace is a miss for every other.

Ownership: the tree only records which page ids hold which tokens. It never allocates or frees; `insert` returns
the pages it newly stores and `evict`/`flush` return the pages it dropped, and the caller adjusts refcounts.

Protection: a node is protected while its subtree holds a lock (`lock`, counted up to the root) or a pin
(`pin_ref`). Only unprotected leaves are evictable. They are listed by (access tick, id), updated incrementally
whenever a node's leaf/lock/pin status or access time changes: touched leaves move to the end of an OrderedDict in
O(1); leaves that become evictable with an older tick go into a SortedList in O(log n); eviction takes the smaller
head. So one evicted node costs O(log n) however large the tree is, and nothing is ever rebuilt.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from sortedcontainers import SortedList

TOKEN_BYTES = 4
_ID_BITS = 40  # evictable order key = access tick << 40 | node id: one int compare instead of a tuple compare
RECENT = -1  # Node.ev_key of a leaf listed in the recent (OrderedDict) part
assert array("I").itemsize == TOKEN_BYTES, "this platform's C unsigned int is not 4 bytes"


def encode(tokens: Sequence[int]) -> bytes:
    """Token ids -> key bytes (4 bytes per token, big-endian). A bytes object is read as token ids, one per byte."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        tokens = list(tokens)  # array() would take raw bytes as machine words
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tobytes()


def decode(key: bytes) -> list[int]:
    arr = array("I", key)
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tolist()


def _common(a: bytes, b: bytes) -> int:
    """Length in bytes of the common prefix of a and b."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    if a == b:
        return n
    x = int.from_bytes(a, "big") ^ int.from_bytes(b, "big")
    return n - 1 - (x.bit_length() - 1) // 8


class Node:
    __slots__ = ("key", "first", "pages", "parent", "children", "sorted_keys", "access", "lock", "own_locks")
    __slots__ += ("pin_until", "pin_ref", "ev_key", "id", "evicted", "tail", "partial_children")

    def __init__(self, key: bytes, pages: list[int], parent: Node | None, node_id: int, access: int) -> None:
        self.key = key  # the edge: whole pages of tokens, encoded
        self.first = key  # the very object keying this node in parent.children (its hash is cached)
        self.pages = pages  # page ids, one per page of `key`; replaced, never mutated in place
        self.parent = parent
        self.children: dict[bytes, Node] = {}  # first page bytes -> child
        # Sorted children keys, page_size > 1 only (partial hits). Eviction leaves stale entries behind (cheaper than
        # a bisect per evicted node); lookups skip and drop them, and the list is rebuilt when half of it is stale.
        self.sorted_keys: list[bytes] | None = None
        self.access = access
        self.lock = 0  # leases locking this node or a descendant
        self.own_locks = 0  # leases whose deepest node is this one
        self.pin_until: float | None = None  # None: not pinned; math.inf: pinned without TTL
        self.pin_ref = 0  # pinned nodes in this subtree, itself included
        self.ev_key: int | None = None  # None: not evictable; RECENT; else its key in the sorted part
        self.id = node_id
        self.evicted = False
        self.tail = 0  # valid tokens in the last page when it is a partial tail (then a leaf), else 0
        self.partial_children = 0  # children whose only page is a partial tail (their `first` is shorter than a page)


class Match:
    """Result of `RadixTree.match`: `pages` whole cached pages in token order; `node` the deepest node they reach
    (None when nothing matched), of which the first `node_pages` pages are on the path (fewer than all when the match
    ends inside an edge); optionally a partial page: `partial_page` holds the next `partial_tokens` tokens
    (1..page_size-1) in its first slots and lives in `partial_node` (`node` itself, or a child of it where
    it is the first page). A partial tail the key runs through is reported that way, never as a whole page."""

    __slots__ = ("pages", "node", "node_pages", "partial_node", "partial_page", "partial_tokens", "page_size")

    def __init__(self, pages: list[int], node: Node | None, used: int, pnode: Node | None, ppage: int, k: int, ps: int):
        self.pages, self.node, self.node_pages, self.partial_node = pages, node, used, pnode
        self.partial_page, self.partial_tokens, self.page_size = ppage, k, ps

    @property
    def tokens(self) -> int:
        return len(self.pages) * self.page_size + self.partial_tokens


class InsertResult:
    """Result of `RadixTree.insert`: `node` holds the last inserted page (None for an empty insert); `new_pages`
    are the caller's pages the tree now stores (the caller adds the tree's reference); `existing` counts leading
    pages already cached; `duplicates` lists the caller's pages that sit where the tree already holds another page
    (the tree's page wins; the caller may free its copy); `replaced` lists tree pages that held a partial tail the
    insert covered with a whole page or a longer tail (the tree no longer stores them: the caller drops the tree's
    reference)."""

    __slots__ = ("node", "new_pages", "existing", "replaced", "_given", "_segments")

    def __init__(
        self, node: Node | None, new_pages: list[int], given: list[int], segments: list, replaced: list[int]
    ) -> None:
        self.node, self.new_pages, self._given, self._segments = node, new_pages, given, segments
        self.existing = len(given) - len(new_pages)
        self.replaced = replaced

    @property
    def duplicates(self) -> list[int]:
        # Computed on demand: most callers only need new_pages, and this is O(existing pages).
        given = self._given
        return [
            p
            for start, cached in self._segments
            for p, q in zip(given[start : start + len(cached)], cached, strict=True)
            if p != q
        ]


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
        self._tick = 0  # logical LRU clock: deterministic, and never ties two touches
        # The evictable leaves in LRU order of (access tick, id). A touch always gives the newest tick, so touched and
        # new leaves go to the end of `_ev_recent` (id -> node, in ascending order; O(1) move); a leaf that becomes
        # evictable with an older tick (unlocked, unpinned, last child evicted) goes into `_ev_sorted` (O(log n)).
        # The LRU leaf is the older of the two heads.
        self._ev_recent: OrderedDict[int, Node] = OrderedDict()
        self._ev_sorted = SortedList()
        self._ev_sorted_nodes: dict[int, Node] = {}
        self._expiry = SortedList()  # (pin_until, node id) of pins with a TTL
        self._pinned: dict[int, Node] = {}
        self.cached_pages = 0
        self.protected_pages = 0  # pages in nodes whose subtree is locked or pinned
        self.pinned_pages = 0
        self.partial_pages = 0  # cached pages that hold a partial tail
        self.evicted_pages = 0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        """Pages that evicting every evictable leaf, repeatedly, would drop (after expiring due pins)."""
        if self._expiry:
            self.expire()
        return self.cached_pages - self.protected_pages

    @property
    def evictable_leaves(self) -> int:
        return len(self._ev_recent) + len(self._ev_sorted)

    def namespaces(self) -> list[str]:
        return list(self._roots)

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
                if low.ev_key == RECENT:
                    self._ev_recent.move_to_end(low.id)
                else:
                    self._touch(low)
        used = 0 if node is None else len(node.pages) if used < 0 else used
        return Match(pages, node, used, pnode, ppage, k, ps)

    def _neighbours(self, node: Node, rem: bytes) -> int:
        """Index of `rem`'s place in node.sorted_keys, after dropping the stale entries right next to it."""
        sk, children = node.sorted_keys, node.children
        i = bisect_left(sk, rem)
        while i < len(sk) and sk[i] not in children:
            del sk[i]
        while i > 0 and sk[i - 1] not in children:
            del sk[i - 1]
            i -= 1
        return i

    def _best_child(self, node: Node, rem: bytes) -> tuple[Node | None, int]:
        # In bytes order the longest common prefix with `rem` is a neighbour of rem's insertion point.
        i = self._neighbours(node, rem)
        best, best_key = 0, None
        for cand in node.sorted_keys[max(i - 1, 0) : i + 1]:
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
        self._tick += 1
        tick = self._tick
        node.access = tick
        off, segments, new_pages, replaced = 0, [], [], []
        while off < end:
            child = node.children.get(key[off : off + bpp])
            if child is None:
                node, new_pages = self._place(node, key[off:end], pages, off // bpp, tick, segments, replaced)
                break
            edge = child.key
            start = off // bpp
            child.access = tick
            if child.ev_key is not None:
                self._touch(child)
            if key.startswith(edge, off):
                node = child
                if child.tail:  # the key runs through a cached partial tail: replace it if the key goes further
                    keep = len(child.pages) - 1
                    if off + len(edge) < end:
                        segments.append((start, child.pages[:keep]))
                        new_pages = pages[start + keep :]
                        replaced.append(self._regrow(child, key[off + keep * bpp : end], new_pages, tick))
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
        self, parent: Node, key: bytes, pages: list[int], start: int, tick: int, segments: list, replaced: list[int]
    ) -> tuple[Node, list[int]]:
        """Store `key` (from page `start` of the insert, so pages[start:]) below `parent`, no child of which starts
        with key's first page. Deals with partial tails among the children: a sibling covering a partial `key` wins
        (nothing stored); a partial sibling that key's first page continues is replaced. Returns the node reached
        and the pages stored."""
        bpp = self.bpp
        if bpp > TOKEN_BYTES and (parent.partial_children or len(key) < bpp) and parent.sorted_keys:
            rem = key[:bpp]
            i = self._neighbours(parent, rem)
            sk = parent.sorted_keys
            # Sibling keys are prefix-free, so a sibling starting with rem is the first key at or after rem's place,
            # and a sibling that is a prefix of rem is the key right before it.
            if len(rem) < bpp and i < len(sk) and sk[i].startswith(rem):
                above = parent.children[sk[i]]
                segments.append((start, above.pages[:1]))
                return above, []
            if i > 0 and len(sk[i - 1]) < len(rem) and rem.startswith(sk[i - 1]):
                below = parent.children[sk[i - 1]]
                replaced.append(self._regrow(below, key, pages[start:], tick))
                return below, pages[start:]
        node = self._attach(key, pages[start:], parent, tick)
        return node, node.pages

    def _regrow(self, node: Node, key: bytes, pages: list[int], tick: int) -> int:
        """Put `pages` for `key` in place of leaf `node`'s partial tail page (key starts at that page and continues
        its tokens), in place, so that locks on `node` stay valid. Returns the page the tree no longer stores."""
        bpp, keep = self.bpp, len(node.pages) - 1
        old = node.pages[keep]
        node.key = node.key[: keep * bpp] + key
        node.pages = node.pages[:keep] + pages
        grown = len(pages) - 1
        self.cached_pages += grown
        if node.lock or node.pin_ref:
            self.protected_pages += grown
        tail = len(key) % bpp // TOKEN_BYTES
        if not tail:  # the old tail is gone; a longer one would take its place in the count
            self.partial_pages -= 1
        node.tail = tail
        if keep == 0:  # its first page changed: re-key it in the parent
            parent, first = node.parent, node.first
            del parent.children[first]
            sk = parent.sorted_keys
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
            self._touch(node)
        return old

    def _attach(self, key: bytes, pages: list[int], parent: Node, tick: int) -> Node:
        node = Node(key, pages, parent, next(self._ids), tick)
        node.first = first = key[: self.bpp]
        parent.children[first] = node
        node.tail = tail = len(key) % self.bpp // TOKEN_BYTES
        if tail:
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
        if parent.ev_key is not None:
            self._refresh(parent)
        node.ev_key = RECENT  # the newest tick: listed last
        self._ev_recent[node.id] = node
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
        upper = Node(node.key[:cut], node.pages[:j], parent, next(self._ids), node.access)
        upper.lock, upper.pin_ref = node.lock, node.pin_ref
        upper.first = node.first
        parent.children[upper.first] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[j:], upper
        node.first = first = node.key[:bpp]
        upper.children[first] = node
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
        listed = node.ev_key is not None
        if not node.children and node.lock == 0 and node.pin_ref == 0 and node.parent is not None:
            if listed:
                return
            key = (node.access << _ID_BITS) | node.id
            recent, ordered = self._ev_recent, self._ev_sorted
            if recent:
                tail = recent[next(reversed(recent))]
                newest = (tail.access << _ID_BITS) | tail.id
            if (not recent or key > newest) and (not ordered or key > ordered[-1]):
                node.ev_key = RECENT
                recent[node.id] = node
            else:
                node.ev_key = key
                ordered.add(key)
                self._ev_sorted_nodes[key] = node
        elif listed:
            self._unlist(node)

    def _unlist(self, node: Node) -> None:
        if node.ev_key == RECENT:
            del self._ev_recent[node.id]
        else:
            self._ev_sorted.remove(node.ev_key)
            del self._ev_sorted_nodes[node.ev_key]
        node.ev_key = None

    def _touch(self, node: Node) -> None:
        """A listed leaf just got the newest access tick: move it to the end of the LRU order."""
        if node.ev_key == RECENT:
            self._ev_recent.move_to_end(node.id)
        else:
            self._unlist(node)
            node.ev_key = RECENT
            self._ev_recent[node.id] = node

    def _adjust(self, node: Node | None, dlock: int, dpin: int) -> None:
        while node is not None:
            was = node.lock > 0 or node.pin_ref > 0
            node.lock += dlock
            node.pin_ref += dpin
            now = node.lock > 0 or node.pin_ref > 0
            if was != now:
                self.protected_pages += len(node.pages) if now else -len(node.pages)
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
            self._adjust(node, 0, 1)
        elif until is None:
            del self._pinned[node.id]
            self.pinned_pages -= len(node.pages)
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
    def evict(self, num_pages: int) -> list[int]:
        """Drop up to `num_pages` pages from least recently used unprotected leaves (the tail of a leaf first when
        only part of it is needed). Returns the dropped page ids; the caller releases the tree's reference."""
        if self._expiry:
            self.expire()
        bpp, need, freed = self.bpp, num_pages, []
        recent, ordered = self._ev_recent, self._ev_sorted
        while need > 0 and (recent or ordered):
            node = recent[next(iter(recent))] if recent else None
            if ordered and (node is None or ordered[0] < (node.access << _ID_BITS) | node.id):
                node = self._ev_sorted_nodes[ordered[0]]
            n = len(node.pages)
            if node.tail:
                self.partial_pages -= 1  # whichever way it goes below, the tail page goes first
            if n > need:
                keep = n - need
                freed += node.pages[keep:]
                node.pages, node.key, node.tail = node.pages[:keep], node.key[: keep * bpp], 0
                self.cached_pages -= need
                break
            self._unlist(node)
            node.evicted = True
            freed += node.pages
            need -= n
            self.cached_pages -= n
            parent = node.parent
            del parent.children[node.first]
            if len(node.first) < bpp:
                parent.partial_children -= 1
            sk = parent.sorted_keys
            if not parent.children:
                parent.sorted_keys = None
                self._refresh(parent)
            elif sk is not None and len(sk) > 2 * len(parent.children) + 8:
                parent.sorted_keys = sorted(parent.children)
        self.evicted_pages += len(freed)
        return freed

    def flush(self) -> list[int]:
        """Drop every pin, then every node no lease locks. Locked paths stay (their leases still read them)."""
        for node in list(self._pinned.values()):
            self._set_pin(node, None)
        return self.evict(self.cached_pages)

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

    def check(self) -> None:
        """Asserts the tree's structural invariants: parent/child links, edge lengths, subtree lock and pin counts,
        the evictable list (exactly the unprotected leaves, keyed by current access), page counters, no page held
        twice, no evicted node reachable; partial tails only as the last page of an unpinned leaf, sibling keys
        prefix-free."""
        bpp, seen = self.bpp, set()
        cached = protected = pinned = leaves = partial = 0
        for namespace, root in self._roots.items():
            assert root.parent is None and not root.pages and not root.key, f"root of {namespace!r} is malformed"
            stack = [root]
            while stack:
                node = stack.pop()
                assert not node.evicted, f"evicted node {node.id} is reachable in namespace {namespace!r}"
                assert node is root or (
                    node.pages and (len(node.pages) - 1) * bpp < len(node.key) <= len(node.pages) * bpp
                ), f"bad edge {node.id}"
                tail = len(node.key) % bpp // TOKEN_BYTES
                assert node.tail == tail and len(node.key) % TOKEN_BYTES == 0, f"node {node.id}: tail {node.tail}"
                assert not tail or not node.children, f"node {node.id} has a partial tail and children"
                assert not tail or node.pin_until is None, f"node {node.id}: a partial tail is pinned"
                partial += tail > 0
                firsts = sorted(node.children)
                assert not any(b.startswith(a) for a, b in itertools.pairwise(firsts)), f"node {node.id}: keys nest"
                short = sum(len(first) < bpp for first in firsts)
                assert node.partial_children == short, f"node {node.id}: {node.partial_children} partial children"
                locks, pins = node.own_locks, node.pin_until is not None
                for first, child in node.children.items():
                    assert child.parent is node and child.key[:bpp] == first is child.first, f"bad link {child.id}"
                    locks += child.lock
                    pins += child.pin_ref
                    stack.append(child)
                sk = node.sorted_keys
                if bpp > TOKEN_BYTES and node.children:
                    assert sk is not None and all(a < b for a, b in itertools.pairwise(sk)), f"node {node.id} keys"
                    assert set(node.children) <= set(sk), f"sorted keys of node {node.id} miss a child"
                    assert len(sk) <= 2 * len(node.children) + 8, f"node {node.id}: too many stale sorted keys"
                else:
                    assert sk is None, f"node {node.id} has sorted keys but no children"
                assert node.lock == locks, f"node {node.id}: lock {node.lock}, locks below {locks}"
                assert node.pin_ref == pins, f"node {node.id}: pin_ref {node.pin_ref}, pins below {pins}"
                for page in node.pages:
                    assert page not in seen, f"page {page} is stored twice in the tree"
                    seen.add(page)
                cached += len(node.pages)
                protected += len(node.pages) if node.lock or node.pin_ref else 0
                pinned += len(node.pages) if node.pin_until is not None else 0
                evictable = node is not root and not node.children and not node.lock and not node.pin_ref
                leaves += evictable
                if node.ev_key == RECENT:
                    assert evictable and self._ev_recent.get(node.id) is node, f"node {node.id} wrongly listed"
                elif node.ev_key is not None:
                    assert node.ev_key == (node.access << _ID_BITS) | node.id, f"node {node.id} listed at a stale key"
                    assert evictable and self._ev_sorted_nodes.get(node.ev_key) is node, f"node {node.id} listed"
                else:
                    assert not evictable, f"evictable node {node.id} is not listed"
        recent = [(n.access << _ID_BITS) | n.id for n in self._ev_recent.values()]
        assert all(a < b for a, b in itertools.pairwise(recent)), "the recent evictable leaves are out of order"
        assert list(self._ev_sorted) == sorted(self._ev_sorted_nodes), "the sorted evictable leaves disagree"
        assert leaves == self.evictable_leaves, "the evictable list holds unreachable nodes"
        counters = (self.cached_pages, self.protected_pages, self.pinned_pages, self.partial_pages)
        assert (cached, protected, pinned, partial) == counters, (
            f"counters (cached, protected, pinned, partial) {counters} != recomputed {(cached, protected, pinned, partial)}"
        )
        finite = sorted((n.pin_until, n.id) for n in self._pinned.values() if n.pin_until != math.inf)
        assert list(self._expiry) == finite, "pin expiry list out of sync"
