"""A fleet's cache events as one stream: SubscribeCacheEvents at the cluster's ingress, for external indexers.

Each replica serves its own stream (`EngineReplica.cache_events`: its CacheEventHub's SNAPSHOT, then EVENTS, RESET
when its reader fell behind, exactly as one worker's SubscribeCacheEvents), every message tagged with its
`replica_id`. `FleetEvents.subscribe()` opens one such stream per live replica and interleaves them as they come:
sequence numbers and snapshots are per replica (an indexer keeps one view per replica_id). It looks for new replicas
every `rescan_s`; when a replica's stream ends (the replica died or was stopped), it sends a RESET tagged with that
replica, which an indexer takes as "forget what it held" (a replica that comes back starts with a snapshot).

Bounded: the merged queue holds `queue_messages` messages; a replica whose messages cannot be queued in time (the
subscriber reads too slowly) is cut and resubscribed, which gives that replica a RESET and a fresh snapshot, as one
worker does for a slow reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from radixcache.v1 import radixcache_pb2 as pb

log = logging.getLogger("radixcache.cluster")

RESCAN_S = 2.0
QUEUE_MESSAGES = 1024
PUT_TIMEOUT_S = 5.0  # a replica's message waits this long for room in the queue before its stream starts over


@dataclass(frozen=True)
class ReplicaTarget:
    """The first argument of a call meant for one replica (its cache events): the CacheAwareRouter sends it there
    (or, when that replica is gone, anywhere: the replica then refuses it)."""

    replica_id: str


def replica_reset(replica_id: str) -> pb.CacheEventBatch:
    """What a subscriber gets when a replica's stream ends: forget what that replica held."""
    return pb.CacheEventBatch(kind=pb.CACHE_EVENT_BATCH_KIND_RESET, replica_id=replica_id, timestamp=time.time())


class FleetEvents:
    """`replicas()`: the live replicas' ids; `open_stream(replica_id)`: that replica's serialized CacheEventBatch
    messages (already tagged with its id)."""

    def __init__(
        self,
        replicas: Callable[[], Awaitable[list[str]]],
        open_stream: Callable[[str], AsyncIterator[bytes]],
        *,
        rescan_s: float = RESCAN_S,
        queue_messages: int = QUEUE_MESSAGES,
        put_timeout_s: float = PUT_TIMEOUT_S,
    ) -> None:
        self.replicas = replicas
        self.open_stream = open_stream
        self.rescan_s = rescan_s
        self.queue_messages = queue_messages
        self.put_timeout_s = put_timeout_s

    async def subscribe(self) -> AsyncIterator[pb.CacheEventBatch]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[pb.CacheEventBatch] = asyncio.Queue(self.queue_messages)
        pumps: dict[str, asyncio.Task] = {}

        async def put(message: pb.CacheEventBatch, timeout_s: float | None) -> bool:
            """Queue it; False if there was no room for timeout_s. (Polls: a cancelled wait_for around
            queue.put can swallow the cancellation on Python 3.11, and the pump would then never end.)"""
            deadline = None if timeout_s is None else loop.time() + timeout_s
            while queue.full():
                if deadline is not None and loop.time() > deadline:
                    return False
                await asyncio.sleep(0.01)
            queue.put_nowait(message)
            return True

        async def pump(replica: str) -> None:
            try:
                try:
                    while True:
                        async with contextlib.aclosing(self.open_stream(replica)) as stream:
                            async for raw in stream:
                                if not await put(pb.CacheEventBatch.FromString(raw), self.put_timeout_s):
                                    break
                            else:
                                break  # the replica ended its stream: it is shutting down
                        log.warning("cache events of %s: the subscriber reads too slowly; resubscribing", replica)
                        await put(replica_reset(replica), None)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the replica died: its subscriber forgets it
                    log.info("cache events of %s ended: %s", replica, e)
                await put(replica_reset(replica), None)
            finally:  # only now: until then a closing subscription cancels it with the others
                pumps.pop(replica, None)

        async def rescan() -> None:
            while True:
                try:
                    live = await self.replicas()
                except Exception as e:  # noqa: BLE001 - try again next time
                    log.warning("could not list the replicas: %s", e)
                    live = []
                for replica in live:
                    if replica not in pumps:
                        pumps[replica] = loop.create_task(pump(replica))
                await asyncio.sleep(self.rescan_s)

        scanner = loop.create_task(rescan())
        try:
            while True:
                yield await queue.get()
        finally:
            tasks = [scanner, *pumps.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
