"""EventHub: one Ray actor per cluster app that gathers every replica's cache events and load for the routers.

Replicas publish batches of neutral events (see `radixcache.cluster.events_feed`) and report their load (every
BUSY_REPORT_PERIOD_S while busy, REPORT_PERIOD_S idle: cluster.load); routers long-poll `poll(cursor, epoch)` and
apply what they get to their own PrefixIndex and LoadView, so the routing decision itself never waits on a remote
call. The hub keeps each live replica's full state too: a router that starts late, or falls more than `max_log`
batches behind, gets a snapshot (reset=True) instead of the log.

Restarts. Each incarnation of the hub draws a new `epoch`: when Ray restarts it (or it is created anew after it
died) it starts empty, with another epoch. Replicas tag what they publish with the epoch they registered in; a batch
of another epoch is dropped. Their periodic `report` answers whether they are registered in this incarnation; when
not (or the call fails), the replica registers again and resends a full snapshot (events_feed.HubLink). A router
polling with an old epoch gets this incarnation's snapshot and epoch, and keeps what it knew of a replica until
that replica's own reset arrives (router.CacheAwareRouter).

It also knows which replicas are alive (they register on start; routers report deaths). It holds plain data only
(load reports are dicts): unpickling an engine type would import torch into the hub, which blocks its event loop
for seconds on a busy node, every time Ray starts it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from typing import Any, NamedTuple

from radixcache.cluster.index import PrefixIndex

# One event: ("stored", namespace, [hash, ...]) | ("removed", namespace, [hash, ...]) | ("cleared", namespace)
# | ("reset",) (the replica's state starts over: a fresh snapshot follows as "stored" events). A stored / removed
# page of a tier below the device adds its medium: ("stored", namespace, [hash, ...], "DISK") (cluster.index).
Event = tuple[Any, ...]


# What `report` answers a replica.
REPORT_OK = "ok"
REPORT_REGISTER = "register"  # this incarnation does not know you: register again and resend your snapshot
REPORT_DRAIN = "drain"  # the routers retired you (Serve stopped routing to you): you are being stopped
RETIRED_KEPT = 10_000  # retired replica ids remembered (ids are never reused)


class Poll(NamedTuple):
    epoch: str  # this hub's incarnation
    cursor: int  # pass it to the next poll
    reset: bool  # the batches are a full snapshot: replace what you knew (of the replicas they name)
    batches: list[tuple[str, list[Event]]]  # (replica, events), in order
    loads: dict[str, Any]  # replica -> its newest load report (EngineLoad's fields, as a dict)


class EventHub:
    """The actor class (wrapped with ray.remote by the app). All methods run on the actor's event loop."""

    def __init__(self, max_log: int = 10_000) -> None:
        self.epoch = uuid.uuid4().hex
        self.states = PrefixIndex()  # what each live replica's events say it holds
        self.log: deque[tuple[int, str, list[Event]]] = deque(maxlen=max_log)
        self.cursor = 0  # sequence number of the newest batch
        self.live: set[str] = set()  # Serve replica ids (full id strings, as routers see them)
        self.loads: dict[str, Any] = {}  # replica -> its newest load report
        self.retired: dict[str, None] = {}  # replicas the routers forgot, oldest first
        self._changed = asyncio.Event()

    async def register(self, replica: str) -> str:
        """The replica (re)starts its feed: its state is empty until its snapshot follows. Returns the epoch."""
        self.retired.pop(replica, None)
        self.live.add(replica)
        self.states.cleared(replica)
        self._append(replica, [("reset",)])
        return self.epoch

    async def forget(self, replica: str) -> None:
        """The replica died or is being stopped (Serve took it out of the routers' candidates): drop its state;
        routers learn it through a "reset" with no stores, and the replica, if it still runs, from `report`."""
        self.retired[replica] = None
        while len(self.retired) > RETIRED_KEPT:
            del self.retired[next(iter(self.retired))]
        if replica in self.live:
            self.live.discard(replica)
            self.states.forget(replica)
            self.loads.pop(replica, None)
            self._append(replica, [("reset",)])

    async def publish(self, replica: str, epoch: str, events: list[Event]) -> None:
        if epoch != self.epoch or replica not in self.live:  # from before a restart, or from a forgotten replica
            return
        self.states.apply(replica, events)
        self._append(replica, events)

    async def report(self, replica: str, epoch: str, load: Any) -> str:
        """A replica's periodic load report. Answers REPORT_OK, REPORT_REGISTER (this incarnation does not know it:
        register again and resend the snapshot) or REPORT_DRAIN (it was retired: it is being stopped)."""
        if replica in self.retired:
            return REPORT_DRAIN
        if epoch != self.epoch or replica not in self.live:
            return REPORT_REGISTER
        self.loads[replica] = load
        return REPORT_OK

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

    async def poll(self, cursor: int, epoch: str | None = None, timeout_s: float = 0.5) -> Poll:
        """What came after `cursor`; waits up to timeout_s for a new batch (loads come with every answer).

        reset=True: the caller is new, too far behind, or knew another incarnation (`epoch`): the batches are a full
        snapshot, one ("reset",) + stores per live replica.
        """
        if epoch == self.epoch and cursor == self.cursor:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                return Poll(self.epoch, self.cursor, False, [], dict(self.loads))
        oldest = self.log[0][0] if self.log else self.cursor + 1
        if epoch != self.epoch or cursor + 1 < oldest or cursor > self.cursor:
            return Poll(self.epoch, self.cursor, True, self.states.snapshot(), dict(self.loads))
        batches = [(replica, events) for seq, replica, events in self.log if seq > cursor]
        return Poll(self.epoch, self.cursor, False, batches, dict(self.loads))


def get_or_create_hub(name: str, namespace: str) -> Any:
    """The cluster's EventHub actor, created by whichever replica or router asks first; it outlives them. Ray restarts
    it when it dies (empty, with a new epoch); if it cannot, the next caller creates another."""
    import ray

    actor_class = ray.remote(num_cpus=0, max_restarts=-1)(EventHub)
    return actor_class.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached").remote()
