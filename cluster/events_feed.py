"""A replica's cache events, published to the cluster's EventHub actor.

The replica runs the worker's own CacheEventHub (worker/cache_events.py: the engine thread only records, the
replica's asyncio loop hashes and fans out) and adds `RayHubPublisher` to it: each batch becomes the hub's neutral
tuples (see cluster.hub.Event) and is sent to the EventHub with a fire-and-forget actor call, in order, never blocking
the loop. After lost records the CacheEventHub resets its publishers with a snapshot, which reaches the EventHub as
"reset" + "stored".
"""

from __future__ import annotations

from typing import Any

from radixcache.events import CacheEvent, NamespaceCleared, PagesRemoved, PagesStored
from radixcache.tier import MEDIUM_DEVICE


def hub_events(events: list[CacheEvent]) -> list[tuple[Any, ...]]:
    """The hub's tuples of the device's pages. Pages in the tiers below it (medium "CPU" / "DISK") are left out
    until the router scores them (below device pages): counted as device pages they would draw requests wrongly."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if getattr(e, "medium", MEDIUM_DEVICE) != MEDIUM_DEVICE:
            continue
        if isinstance(e, PagesStored):
            out.append(("stored", e.namespace, e.page_hashes))
        elif isinstance(e, PagesRemoved):
            out.append(("removed", e.namespace, e.page_hashes))
        elif isinstance(e, NamespaceCleared):
            out.append(("cleared", e.namespace))
    return out


class RayHubPublisher:
    """A CacheEventHub publisher (worker.cache_events.Publisher) that forwards to the cluster's EventHub actor."""

    def __init__(self, hub: Any, replica_id: str) -> None:
        self.hub = hub
        self.replica_id = replica_id

    def reset(self, snapshot: list[PagesStored]) -> None:
        self.hub.publish.remote(self.replica_id, [("reset",), *hub_events(list(snapshot))])

    def publish(self, events: list[CacheEvent], timestamp: float) -> None:
        batch = hub_events(events)
        if batch:
            self.hub.publish.remote(self.replica_id, batch)

    def close(self) -> None:
        pass
