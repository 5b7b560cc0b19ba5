"""EventHub: one Ray actor per cluster app that gathers every replica's cache events for the routers.

Replicas publish batches of neutral events (see `radixcache.cluster.events_feed`); routers long-poll `poll(cursor)`
and apply what they get to their own PrefixIndex, so the routing decision itself never waits on a remote call. The
hub keeps each live replica's full state too: a router that starts late, or falls more than `max_log` batches
behind, gets a snapshot (reset=True) instead of the log.

It also knows which replicas are alive (they register on start; routers report deaths), which is how the ingress
reaches every replica for FlushCache, PinPrefix and GetCacheStats.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from radixcache.cluster.index import PrefixIndex

# One event: ("stored", namespace, [hash, ...]) | ("removed", namespace, [hash, ...]) | ("cleared", namespace)
# | ("reset",) (the replica's state starts over: a fresh snapshot follows as "stored" events).
Event = tuple[Any, ...]


class EventHub:
    """The actor class (wrapped with ray.remote by the app). All methods run on the actor's event loop."""

    def __init__(self, max_log: int = 10_000) -> None:
        self.states = PrefixIndex()  # what each live replica's events say it holds
        self.log: deque[tuple[int, str, list[Event]]] = deque(maxlen=max_log)
        self.cursor = 0  # sequence number of the newest batch
        self.live: set[str] = set()  # Serve replica ids (full id strings, as routers see them)
        self._changed = asyncio.Event()

    async def register(self, replica: str) -> None:
        self.live.add(replica)
        await self.publish(replica, [("reset",)])

    async def forget(self, replica: str) -> None:
        """The replica died or was scaled away: drop its state; routers learn it through a "reset" with no stores."""
        if replica in self.live:
            self.live.discard(replica)
            self.states.forget(replica)
            self._append(replica, [("reset",)])

    async def publish(self, replica: str, events: list[Event]) -> None:
        if replica not in self.live:  # a late batch from a replica already forgotten
            return
        self.states.apply(replica, events)
        self._append(replica, events)

    def _append(self, replica: str, events: list[Event]) -> None:
        self.cursor += 1
        self.log.append((self.cursor, replica, events))
        self._changed.set()
        self._changed = asyncio.Event()

    async def replicas(self) -> list[str]:
        return sorted(self.live)

    async def cached_hashes(self, replica: str, namespace: str) -> set[int]:
        """What `replica`'s events say it holds in `namespace` (for tests and debugging)."""
        return self.states.cached_hashes(replica, namespace)

    async def poll(self, cursor: int, timeout_s: float = 1.0) -> tuple[int, bool, list[tuple[str, list[Event]]]]:
        """(new cursor, reset, [(replica, events), ...]) after `cursor`; waits up to timeout_s for something new.

        reset=True: the caller was too far behind (or new): drop everything, the batches are a full snapshot.
        """
        if cursor == self.cursor:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                return self.cursor, False, []
        oldest = self.log[0][0] if self.log else self.cursor + 1
        if cursor == 0 or cursor + 1 < oldest or cursor > self.cursor:
            return self.cursor, True, self.states.snapshot()
        return self.cursor, False, [(replica, events) for seq, replica, events in self.log if seq > cursor]


def get_or_create_hub(name: str, namespace: str) -> Any:
    """The cluster's EventHub actor, created by whichever replica or ingress asks first; it outlives them."""
    import ray

    actor_class = ray.remote(num_cpus=0, max_restarts=-1)(EventHub)
    return actor_class.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached").remote()
