"""What evicting from a replica would cost: a mirror of its LRU order, and how often each page was asked for.

A replica whose pool is full evicts its least recently used pages to make room. The router sees every prompt it
routes and, through the cache events, every page a replica stores or drops, so it keeps the same order per replica
(the pages of a routed prompt move to the back, stored pages join it, removed ones leave) and counts how many routed
prompts each page was part of (all counts halve every AGE_EVERY prompts, so popularity can move on).
`victims(replica, pages, holds)` gives the `pages` pages the replica would evict next, with those counts: sending
a new prompt there costs the future requests of those pages (at a reload's cost where a tier below keeps a copy:
cluster.policy). With pools full everywhere, a new prefix then goes
where the cache it displaces is asked for least, instead of wherever; in a Zipf-popular workload that keeps the hot
prefixes resident (bench/cluster_bench.py, the eviction trace).

The mirror is approximate (the router does not see generated tokens being read, nor which pages running requests
lock), which is why `holds` (the index: cached or in flight there) filters what it names. Not thread-safe: use from
the router's loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from radixcache.cluster.index import DEVICE, event_medium

AGE_EVERY = 1000  # routed prompts between two halvings of every count

Page = tuple[str, int]  # (namespace, page hash)


class ReuseTracker:
    def __init__(self, *, age_every: int = AGE_EVERY) -> None:
        self.age_every = age_every
        self._order: dict[Hashable, OrderedDict[Page, None]] = {}  # replica -> its pages, least recently used first
        self._uses: dict[Page, int] = {}
        self._routed = 0

    def routed(self, replica: Hashable, namespace: str, page_hashes: Sequence[int]) -> None:
        order = self._order.setdefault(replica, OrderedDict())
        for h in page_hashes:
            page = (namespace, h)
            order[page] = None
            order.move_to_end(page)
            self._uses[page] = self._uses.get(page, 0) + 1
        self._routed += 1
        if self._routed % self.age_every == 0:
            self._age()

    def apply(self, replica: Hashable, events: Sequence[tuple[Any, ...]]) -> None:
        """One replica's batch of hub events (cluster.hub.Event), in order."""
        order = self._order.setdefault(replica, OrderedDict())
        for event in events:
            kind = event[0]
            if kind in ("stored", "removed") and event_medium(event) != DEVICE:
                continue  # a tier's pages: the pool evicts device pages only
            if kind == "stored":
                for h in event[2]:
                    order.setdefault((event[1], h), None)
            elif kind == "removed":
                for h in event[2]:
                    order.pop((event[1], h), None)
            elif kind == "cleared":
                for page in [p for p in order if p[0] == event[1]]:
                    del order[page]
            elif kind == "reset":
                order.clear()

    def forget(self, replica: Hashable) -> None:
        self._order.pop(replica, None)

    def uses(self, namespace: str, page_hash: int) -> int:
        return self._uses.get((namespace, page_hash), 0)

    def victims(
        self, replica: Hashable, pages: int, holds: Callable[[Hashable, str, int], bool]
    ) -> list[tuple[Page, int]]:
        """The (at most) `pages` pages `replica` would evict next, least recently used first, each with its request
        count; pages `holds(replica, namespace, hash)` denies are dropped from the mirror on the way."""
        order = self._order.get(replica)
        out: list[tuple[Page, int]] = []
        if not order:
            return out
        stale = []
        for page in order:
            if len(out) == pages:
                break
            if holds(replica, *page):
                out.append((page, self._uses.get(page, 0)))
            else:
                stale.append(page)
        for page in stale:
            del order[page]
        return out

    def _age(self) -> None:
        self._uses = {page: n // 2 for page, n in self._uses.items() if n > 1}
