"""A replica's cache events and load, published to the cluster's EventHub actor, across restarts of the hub.

The replica runs the worker's own CacheEventHub (worker/events/hub.py: the engine thread only records, the
replica's asyncio loop hashes and fans out) and adds `RayHubPublisher` to it: each batch becomes the hub's neutral
tuples (see cluster.hub.Event) and is sent to the EventHub with a fire-and-forget actor call, in order, never blocking
the loop. After lost records the CacheEventHub resets its publishers with a snapshot, which reaches the EventHub as
"reset" + "stored".

`HubLink` keeps the replica registered: every BUSY_REPORT_PERIOD_S while the engine has requests (every
REPORT_PERIOD_S while it has none) it reports the engine's load, and the answer says
whether this incarnation of the hub knows the replica. When it does not (the hub restarted empty), or the hub cannot
be reached (dead: the next lookup creates another), the link registers again and asks the CacheEventHub for a fresh
snapshot, so the new hub gets the replica's whole cache within about one period of coming back. When the answer is
that the routers retired the replica (Serve is stopping it), the link calls `on_drain` once and stops reporting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from radixcache.cluster.hub import REPORT_DRAIN, REPORT_OK
from radixcache.cluster.load import BUSY_REPORT_PERIOD_S, REPORT_PERIOD_S
from radixcache.events import CacheEvent, NamespaceCleared, PagesRemoved, PagesStored
from radixcache.tier import MEDIUM_DEVICE

log = logging.getLogger("radixcache.cluster")


def hub_events(events: list[CacheEvent]) -> list[tuple[Any, ...]]:
    """The hub's tuples (cluster.hub.Event). A page in a tier below the device (medium "CPU" / "DISK") carries its
    medium as a 4th element: the router scores it below a device page (cluster.index, cluster.policy). The window
    group of a window-paged replica (group_idx 1, radixcache.events) is left out: the router indexes the pages the
    global layers hold, and a hit whose window was given back is served shorter (it counts as the replica's)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if getattr(e, "group_idx", 0):
            continue
        medium = getattr(e, "medium", MEDIUM_DEVICE)
        tail = () if medium == MEDIUM_DEVICE else (medium,)
        if isinstance(e, PagesStored):
            out.append(("stored", e.namespace, e.page_hashes, *tail))
        elif isinstance(e, PagesRemoved):
            out.append(("removed", e.namespace, e.page_hashes, *tail))
        elif isinstance(e, NamespaceCleared):
            out.append(("cleared", e.namespace))
    return out


class HubLink:
    """One replica's registration with the EventHub (see the module docstring). `connect(name, namespace)` returns
    the hub's actor handle (cluster.hub.get_or_create_hub); `load()` the engine's EngineLoad; `resync()` makes the
    CacheEventHub send its publishers a snapshot (CacheEventHub.resync_publishers)."""

    def __init__(
        self,
        replica_id: str,
        connect: Callable[[], Any],
        load: Callable[[], Awaitable[Any]],
        resync: Callable[[], Awaitable[None]],
        *,
        on_drain: Callable[[], None] = lambda: None,
        period_s: float = REPORT_PERIOD_S,
        busy_period_s: float = BUSY_REPORT_PERIOD_S,
        timeout_s: float = 5.0,
    ) -> None:
        self.replica_id = replica_id
        self._connect, self._load, self._resync, self._on_drain = connect, load, resync, on_drain
        self.period_s, self.busy_period_s, self.timeout_s = period_s, busy_period_s, timeout_s
        self.busy = False  # whether the last report had requests running or waiting
        self.hub: Any = None
        self.epoch: str | None = None
        self.registrations = 0
        self._task: asyncio.Task | None = None

    async def register(self) -> None:
        """Register with the hub (looking it up, or creating it, first); what is published next carries its epoch."""
        hub = await asyncio.to_thread(self._connect)
        epoch = await asyncio.wait_for(_awaitable(hub.register.remote(self.replica_id)), self.timeout_s)
        self.hub, self.epoch = hub, epoch
        self.registrations += 1

    def start(self) -> None:
        """Report load, and re-register on a new hub, until close() (call after register() and adding the
        publisher)."""
        self._task = asyncio.get_running_loop().create_task(self._keep())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def publish(self, events: list[tuple[Any, ...]]) -> None:
        if self.hub is not None:
            self.hub.publish.remote(self.replica_id, self.epoch, events)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.busy_period_s if self.busy else self.period_s)
            if await self.check() == REPORT_DRAIN:
                return

    async def check(self) -> str | None:
        """One report: the hub's answer (REPORT_OK, REPORT_REGISTER, REPORT_DRAIN; None if unreachable). Registers
        again (and resyncs) when the hub does not know us; calls on_drain when it retired us."""
        try:
            load = await self._load()
            if dataclasses.is_dataclass(load):  # plain data on the wire: the hub never imports the engine (torch)
                load = dataclasses.asdict(load)
            self.busy = bool(load.get("running") or load.get("waiting"))
            answer = await asyncio.wait_for(
                _awaitable(self.hub.report.remote(self.replica_id, self.epoch, load)), self.timeout_s
            )
        except Exception as e:  # noqa: BLE001 - the hub died or hangs: look it up (or create it) again
            log.warning("event hub unreachable (%s); registering again", e)
            answer = None
        if answer == REPORT_OK:
            return answer
        if answer == REPORT_DRAIN:
            self._on_drain()
            return answer
        try:
            await self.register()
            await self._resync()
            log.info("registered with the event hub again (epoch %s); snapshot resent", self.epoch)
        except Exception as e:  # noqa: BLE001 - try again next period
            log.warning("could not register with the event hub (%s); retrying", e)
        return answer


def _awaitable(ref: Any) -> Any:
    """An ObjectRef as an asyncio future (plain awaitables in tests), for asyncio.wait_for."""
    future = getattr(ref, "future", None)
    return asyncio.wrap_future(future()) if future is not None else ref


class RayHubPublisher:
    """A CacheEventHub publisher (worker.cache_events.Publisher) that forwards to the cluster's EventHub actor."""

    def __init__(self, link: HubLink) -> None:
        self.link = link

    def reset(self, snapshot: list[PagesStored]) -> None:
        self.link.publish([("reset",), *hub_events(list(snapshot))])

    def publish(self, events: list[CacheEvent], timestamp: float) -> None:
        batch = hub_events(events)
        if batch:
            self.link.publish(batch)

    def close(self) -> None:
        pass
