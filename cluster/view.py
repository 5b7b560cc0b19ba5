"""FleetView: a router's picture of the fleet (what each replica caches, how loaded it is) and the feed that keeps
it current from the cluster's EventHub, across restarts of the hub.

The feed long-polls `EventHub.poll(cursor, epoch)` on the router's event loop and folds each answer in (`apply`):
cache events into the PrefixIndex, the ReuseTracker and the RoutedHints, load reports into the LoadView. A snapshot from the same hub incarnation (the
router fell behind) replaces everything. A snapshot from a new incarnation (the hub restarted empty) replaces only
the replicas it names; the others keep what the router knew, since their caches did not go anywhere, until they
register with the new hub (their reset + snapshot arrives within about a report period) or `stale_s` passed.
Not thread-safe apart from the LoadView: use from the router's loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

from radixcache.cluster.hints import CAPACITY, RoutedHints
from radixcache.cluster.hub import Poll
from radixcache.cluster.index import PrefixIndex
from radixcache.cluster.load import BUSY_REPORT_PERIOD_S, LoadView
from radixcache.cluster.reuse import ReuseTracker
from radixcache.worker.engine.api import EngineLoad

log = logging.getLogger("radixcache.cluster")

STALE_S = 10.0  # after a hub restart, how long a replica's old view is kept while it has not registered again


class FleetView:
    def __init__(
        self,
        *,
        inflight_ttl_s: float = 30.0,
        stale_s: float = STALE_S,
        hint_pages: int = CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = PrefixIndex(inflight_ttl_s=inflight_ttl_s, clock=clock)
        self.loads = LoadView(clock=clock)
        self.reuse = ReuseTracker()
        self.hints = RoutedHints(hint_pages)  # kept through hub restarts and resets: what this router sent
        self.stale_s = stale_s
        self.clock = clock
        self.epoch: str | None = None  # of the hub incarnation the view follows
        self.hub_restarts = 0  # new incarnations seen after the first
        self._unconfirmed: dict[Hashable, float] = {}  # replica -> when its pre-restart view is dropped
        self.hub: Any = None  # the EventHub's actor handle, looked up (or created) by `run`

    def forget(self, replica: Hashable) -> None:
        """The replica is gone (died, scaled away): nothing routes by it any more; the hub is told too."""
        self.index.forget(replica)
        self.loads.forget(replica)
        self.reuse.forget(replica)
        self.hints.forget(replica)
        self._unconfirmed.pop(replica, None)
        if self.hub is not None:
            self.hub.forget.remote(replica)

    def apply(self, poll: Poll) -> None:
        """Fold one answer of EventHub.poll in."""
        now = self.clock()
        if poll.reset:
            named = {replica for replica, _ in poll.batches}
            if poll.epoch == self.epoch:  # the same hub, and we fell behind: its snapshot is the whole truth
                for replica in self.index.replicas():
                    if replica not in named:
                        self.index.cleared(replica)
                        self.reuse.forget(replica)
            else:
                if self.epoch is not None:
                    self.hub_restarts += 1
                    log.warning("the event hub restarted; waiting for replicas to register again")
                for replica in self.index.replicas():
                    if replica not in named:
                        self._unconfirmed.setdefault(replica, now + self.stale_s)
            self.epoch = poll.epoch
        for replica, events in poll.batches:
            self._unconfirmed.pop(replica, None)
            self.index.apply(replica, events)
            self.reuse.apply(replica, events)
            self.hints.apply(replica, events)
        for replica, deadline in list(self._unconfirmed.items()):
            if deadline <= now:
                log.warning("replica %s did not register with the new event hub; dropping its view", replica)
                del self._unconfirmed[replica]
                self.index.cleared(replica)
                self.reuse.forget(replica)
        for replica, load in poll.loads.items():
            self.loads.reported(replica, EngineLoad(**load) if isinstance(load, dict) else load)

    @property
    def unconfirmed(self) -> list[Hashable]:
        """Replicas whose view predates the hub's restart (they have not registered again yet)."""
        return list(self._unconfirmed)

    async def run(self, connect: Callable[[], Any], retry_s: float = 0.2) -> None:
        """Poll the hub (`connect()` returns its handle: get_or_create_hub) forever, resubscribing when it fails."""
        cursor = 0
        while True:
            try:
                if self.hub is None:
                    self.hub = await asyncio.to_thread(connect)
                poll = await self.hub.poll.remote(cursor, self.epoch, BUSY_REPORT_PERIOD_S)  # a busy replica's reports
            except Exception as e:  # noqa: BLE001 - the hub died or restarts: look it up again, resync from it
                log.warning("cache-event feed interrupted (%s); resubscribing", e)
                self.hub = None
                await asyncio.sleep(retry_s)
                continue
            self.apply(poll)
            cursor = poll.cursor
