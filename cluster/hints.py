"""RoutedHints: where this router last sent each page of the prompts it routed, kept after the caches lose them.

The cache events say what a replica holds. After a FlushCache, a restart, or an eviction everywhere they say
"nothing", and the next request of a conversation would go wherever load sends it, scattering the prefixes the
fleet had partitioned between its replicas (DESIGN.md, "Routing across replicas": affinity is a hint that outlives a
flush or a restart). So the router also remembers, per (namespace, page hash), the replica it most recently sent a
prompt holding that page to. `home(namespace, hashes)` is the replica named by the last page of the prompt's
longest leading run of remembered pages, and that run's length: the replica that was sent the longest prefix of it
most recently, which will compute and cache it again. The router consults it only when no replica's events (or
in-flight prompts) show the prompt's pages (cluster.policy weighs it).

What the hints keep through and what they do not: a flush ("cleared") and a replica's engine starting over
("reset") leave them, since neither says anything about where a prefix belongs. An eviction (a "removed" event from
the device that no "cleared" follows) drops the hint naming that replica for those pages: the replica's own LRU
judged them the least worth keeping there, and where a prefix evicted everywhere goes next is the eviction term's
call (cluster.reuse), which did better on the bench's eviction trace than Ray's router sticking to where a prompt
went before (BENCHMARKS.md, "Cluster routing").

Memory is bounded: at most `capacity` pages are remembered, the least recently routed forgotten first (one LRU
over every namespace and replica). A replica that is gone is forgotten (`forget`), so its hints send nothing to its
replacement. Not thread-safe: use from the router's loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from radixcache.cluster.index import DEVICE, event_medium

CAPACITY = 65_536  # pages remembered (a million tokens at page size 16), ~15 MiB of Python objects at most

Page = tuple[str, int]  # (namespace, page hash)


class RoutedHints:
    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._home: OrderedDict[Page, Hashable] = OrderedDict()  # least recently routed first

    def routed(self, replica: Hashable, namespace: str, page_hashes: Sequence[int]) -> None:
        """A prompt with these pages was sent to `replica`: each page's hint now names it."""
        home = self._home
        for h in page_hashes:
            page = (namespace, h)
            home[page] = replica
            home.move_to_end(page)
        while len(home) > self.capacity:
            home.popitem(last=False)

    def home(self, namespace: str, page_hashes: Sequence[int]) -> tuple[Hashable | None, int]:
        """(the replica the hints send this prompt to, the leading pages they remember), or (None, 0)."""
        replica, run = None, 0
        for h in page_hashes:
            named = self._home.get((namespace, h))
            if named is None:
                break
            replica, run = named, run + 1
        return replica, run

    def apply(self, replica: Hashable, events: Sequence[tuple[Any, ...]]) -> None:
        """One replica's batch of hub events (cluster.hub.Event), in order: its device evictions drop its hints. A
        flush reaches the hub as its pages' removals and then the namespace's "cleared", in one batch: removals that a
        "cleared" of their namespace follows in the batch are a flush, and keep their hints."""
        evicted: dict[str, list[int]] = {}
        for event in events:
            kind = event[0]
            if kind == "removed" and event_medium(event) == DEVICE:
                evicted.setdefault(event[1], []).extend(event[2])
            elif kind == "cleared":
                evicted.pop(event[1], None)
        home = self._home
        for namespace, hashes in evicted.items():
            for h in hashes:
                page = (namespace, h)
                if home.get(page) == replica:
                    del home[page]

    def forget(self, replica: Hashable) -> None:
        """The replica is gone: its hints are dropped (its pages went with it)."""
        for page in [p for p, r in self._home.items() if r == replica]:
            del self._home[page]

    def __len__(self) -> int:
        return len(self._home)
