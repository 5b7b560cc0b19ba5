"""The evictable leaves of a RadixTree in least-recently-used order, kept up to date incrementally.

Order: (access tick, node id), packed into one int (tick << ID_BITS | id) so that ordering is one int compare. A touch
always gives the newest tick, so touched and new leaves go to the end of `recent` (an OrderedDict id -> node, in
ascending order: O(1) move). A leaf that becomes evictable with an older tick (unlocked, unpinned, last child
evicted) goes into `ordered` (a SortedList of keys, O(log n)), with `by_key` mapping each key to its node. The LRU
leaf is the older of the two heads, so one eviction costs O(log n) however many leaves there are, and nothing is
ever rebuilt. Which nodes are evictable is the tree's decision; this class only keeps the order.

A node records where it is listed in `node.ev_key`: None (not listed), RECENT, or its key in `ordered`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from radixcache.node import Node

ID_BITS = 40
RECENT = -1  # Node.ev_key of a leaf listed in `recent`


def order_key(node: Node) -> int:
    return (node.access << ID_BITS) | node.id


class LeafLRU:
    """Listed leaves, least recently used first. See the module docstring."""

    __slots__ = ("recent", "ordered", "by_key")

    def __init__(self) -> None:
        self.recent: OrderedDict[int, Node] = OrderedDict()
        self.ordered = SortedList()
        self.by_key: dict[int, Node] = {}

    def __len__(self) -> int:
        return len(self.recent) + len(self.ordered)

    def add(self, node: Node) -> None:
        """List `node` (not listed yet) at the place its current access tick gives it."""
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
        else:
            self.remove(node)
            node.ev_key = RECENT
            self.recent[node.id] = node

    def listed(self, node: Node) -> bool:
        """Whether `node` is listed where its ev_key says, under its current access tick."""
        if node.ev_key == RECENT:
            return self.recent.get(node.id) is node
        return node.ev_key == order_key(node) and self.by_key.get(node.ev_key) is node

    def check(self) -> None:
        recent = [order_key(n) for n in self.recent.values()]
        assert all(a < b for a, b in itertools.pairwise(recent)), "the recent evictable leaves are out of order"
        assert list(self.ordered) == sorted(self.by_key), "the sorted evictable leaves disagree"
