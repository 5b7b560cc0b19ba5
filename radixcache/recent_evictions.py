"""RecentEvictions: a bounded memory of where the tree recently evicted a page, so a lookup that stops there can say
"evicted" instead of "never cached" (radixcache.miss_reasons) without a tier lookup or a second tree walk.

An entry is (the id of the node a lookup reaches just before the evicted page, that page's key bytes): the node that
stays (a trimmed leaf, or the parent of a dropped one) ends where the evicted page began, and node ids are never
reused, so an entry can only match a lookup that stops at exactly that place with exactly those tokens next. It is a
hint: the oldest entries are forgotten first (at most `capacity`), and a flush records nothing (flushed is not
evicted).
"""

from __future__ import annotations

from collections import OrderedDict

# Entries kept: about 100 bytes each at 16-token pages, so well under a megabyte.
DEFAULT_CAPACITY = 4096


class RecentEvictions:
    """At most `capacity` (anchor node id, page key) pairs, oldest forgotten first. Membership is read-only."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[tuple[int, bytes], None] = OrderedDict()

    def add(self, anchor: int, page_key: bytes) -> None:
        """The page `page_key`, the next one after node `anchor`, was evicted."""
        entry = (anchor, page_key)
        self._seen[entry] = None
        self._seen.move_to_end(entry)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def __contains__(self, entry: tuple[int, bytes]) -> bool:
        return entry in self._seen

    def __len__(self) -> int:
        return len(self._seen)
