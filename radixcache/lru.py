"""The evictable leaves of a RadixTree in least-recently-used order, kept up to date incrementally.

Order: (access tick, node id), packed into one int (tick << ID_BITS | id) so that ordering is one int compare. A touch
always gives the newest tick, so touched and new leaves go to the end of `recent` (an OrderedDict id -> node, in
ascending order: O(1) move). A leaf that becomes evictable with an older tick (unlocked, unpinned, last child
evicted) goes into `ordered` (a SortedList of keys, O(log n)), with `by_key` mapping each key to its node. The LRU
leaf is the older of the two heads, so one eviction costs O(log n) however many leaves there are, and nothing is
ever rebuilt. Which nodes are evictable is the tree's decision; this class only keeps the order.

A node records where it is listed in `node.ev_key`: None (not listed), RECENT, RETAINED, or its key in `ordered`.

Retention (the `priority` eviction policy: built with a clock): a leaf whose retention is still running
(radixcache.retention: `keep_priority` > 0 and the clock before `kept_until`) is listed apart, in `retained`, a
SortedList of (priority, access tick, id), beside `expiry`, a SortedList of (kept_until, id). Eviction takes the
plain LRU order first and the retained leaves only when it is empty, lowest priority then least recently used
first. `expire()` (once per eviction) moves every leaf whose retention ran out into the plain order at the place its
tick gives it: O(log n) per leaf that expires, never a rescan. Without a clock (`lru`) nothing is ever retained.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from radixcache.node import Node

ID_BITS = 40
RECENT = -1  # Node.ev_key of a leaf listed in `recent`
RETAINED = -2  # Node.ev_key of a leaf listed in `retained` (its retention still runs)


def order_key(node: Node) -> int:
    return (node.access << ID_BITS) | node.id


class LeafLRU:
    """Listed leaves, least recently used first. See the module docstring."""

    __slots__ = ("recent", "ordered", "by_key", "clock", "retained", "expiry", "held")

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.recent: OrderedDict[int, Node] = OrderedDict()
        self.ordered = SortedList()
        self.by_key: dict[int, Node] = {}
        self.clock = clock  # None: retention is ignored (the `lru` policy)
        self.retained = SortedList()  # (priority, access tick, id) of leaves whose retention still runs
        self.expiry = SortedList()  # (kept_until, id) of the same leaves
        self.held: dict[int, tuple[Node, tuple[int, int, int], tuple[float, int]]] = {}  # id -> node, its two keys

    def __len__(self) -> int:
        return len(self.recent) + len(self.ordered) + len(self.held)

    def add(self, node: Node) -> None:
        """List `node` (not listed yet): among the retained leaves while its retention runs, else at the place its
        current access tick gives it."""
        if node.keep_priority and self.clock is not None and self.clock() < node.kept_until:
            node.ev_key = RETAINED
            rkey, ekey = (node.keep_priority, node.access, node.id), (node.kept_until, node.id)
            self.retained.add(rkey)
            self.expiry.add(ekey)
            self.held[node.id] = (node, rkey, ekey)
            return
        key = (node.access << ID_BITS) | node.id
        recent, ordered = self.recent, self.ordered
        if recent:
            tail = recent[next(reversed(recent))]
            newest = (tail.access << ID_BITS) | tail.id
        if (not recent or key > newest) and (not ordered or key > ordered[-1]):
            node.ev_key = RECENT
            recent[node.id] = node
        else:
            node.ev_key = key
            ordered.add(key)
            self.by_key[key] = node

    def remove(self, node: Node) -> None:
        if node.ev_key == RECENT:
            del self.recent[node.id]
        elif node.ev_key == RETAINED:  # by the keys it was listed under (its tick may have moved since)
            _, rkey, ekey = self.held.pop(node.id)
            self.retained.remove(rkey)
            self.expiry.remove(ekey)
        else:
            key = node.ev_key
            assert key is not None, f"node {node.id} is not listed"
            self.ordered.remove(key)
            del self.by_key[key]
        node.ev_key = None

    def touch(self, node: Node) -> None:
        """A listed leaf just got the newest access tick: move it to the end of the order."""
        if node.ev_key == RECENT:
            self.recent.move_to_end(node.id)
        elif node.ev_key == RETAINED:  # listed under its old tick: list it again (expired meanwhile: in the LRU)
            self.remove(node)
            self.add(node)
        else:
            self.remove(node)
            node.ev_key = RECENT
            self.recent[node.id] = node

    def expire(self) -> None:
        """Move every retained leaf whose retention ran out into the plain LRU order (at its tick's place)."""
        expiry = self.expiry
        if expiry and self.clock is not None:
            now = self.clock()
            while expiry and expiry[0][0] <= now:
                node = self.held[expiry[0][1]][0]
                self.remove(node)
                self.add(node)

    def first_retained(self) -> Node | None:
        """The retained leaf eviction takes next (lowest priority, then least recently used), or None."""
        return self.held[self.retained[0][2]][0] if self.retained else None

    def listed(self, node: Node) -> bool:
        """Whether `node` is listed where its ev_key says, under its current access tick."""
        if node.ev_key == RECENT:
            return self.recent.get(node.id) is node
        if node.ev_key == RETAINED:
            held = self.held.get(node.id)
            return held is not None and held[0] is node and held[1] == (node.keep_priority, node.access, node.id)
        return node.ev_key == order_key(node) and self.by_key.get(node.ev_key) is node

    def check(self) -> None:
        recent = [order_key(n) for n in self.recent.values()]
        assert all(a < b for a, b in itertools.pairwise(recent)), "the recent evictable leaves are out of order"
        assert list(self.ordered) == sorted(self.by_key), "the sorted evictable leaves disagree"
        held = self.held.values()
        assert list(self.retained) == sorted(r for _, r, _ in held), "the retained leaves disagree"
        assert list(self.expiry) == sorted(e for _, _, e in held), "the retained leaves' expiries disagree"
        assert self.clock is not None or not held, "a leaf is retained under the lru policy"
