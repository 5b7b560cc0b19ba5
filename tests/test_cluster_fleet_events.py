"""A fleet's cache events as one stream (cluster.fleet_events), without Ray: replicas faked as async generators.
Each scenario reads in one task, as the ingress does, under one overall timeout."""

from __future__ import annotations

import asyncio
import contextlib

from radixcache.cluster.fleet_events import FleetEvents
from radixcache.v1 import radixcache_pb2 as pb

SNAPSHOT, EVENTS, RESET = (
    pb.CACHE_EVENT_BATCH_KIND_SNAPSHOT,
    pb.CACHE_EVENT_BATCH_KIND_EVENTS,
    pb.CACHE_EVENT_BATCH_KIND_RESET,
)


def message(replica: str, kind: int, sequence: int) -> bytes:
    return pb.CacheEventBatch(kind=kind, sequence=sequence, replica_id=replica, page_size=16).SerializeToString()


def test_every_replicas_stream_tagged_new_replicas_joined_and_a_dead_one_reset():
    async def scenario() -> None:
        live = ["a", "b"]
        ends = {r: asyncio.Event() for r in "abc"}
        opened: list[str] = []

        async def stream(replica: str):
            opened.append(replica)
            yield message(replica, SNAPSHOT, 0)
            yield message(replica, EVENTS, 1)
            await ends[replica].wait()
            if replica == "b":
                raise RuntimeError("the replica died")

        async def replicas() -> list[str]:
            return list(live)

        fleet = FleetEvents(replicas, stream, rescan_s=0.01)
        got: list[tuple[str, int, int]] = []
        subscription = fleet.subscribe()

        async def read(n: int) -> None:
            for _ in range(n):
                m = await subscription.__anext__()
                got.append((m.replica_id, m.kind, m.sequence))

        await read(4)
        for r in "ab":  # each replica's own order, interleaved
            assert [(k, s) for rid, k, s in got if rid == r] == [(SNAPSHOT, 0), (EVENTS, 1)]
        live.append("c")  # a replica joins: found at the next rescan
        await read(2)
        assert [(k, s) for rid, k, s in got if rid == "c"] == [(SNAPSHOT, 0), (EVENTS, 1)]
        live.remove("b")
        ends["b"].set()  # b dies: its subscriber is told to forget it
        await read(1)
        assert got[-1][:2] == ("b", RESET)
        await subscription.aclose()
        assert sorted(opened) == ["a", "b", "c"]

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_slow_subscriber_gets_a_replica_reset_and_a_fresh_stream_not_an_unbounded_queue():
    async def scenario() -> None:
        opens = 0

        async def stream(replica: str):
            nonlocal opens
            opens += 1
            for i in range(100):
                yield message(replica, EVENTS, i)

        async def replicas() -> list[str]:
            return ["a"]

        fleet = FleetEvents(replicas, stream, rescan_s=0.01, queue_messages=4, put_timeout_s=0.05)
        kinds = []
        async with contextlib.aclosing(fleet.subscribe()) as subscription:
            async for m in subscription:
                kinds.append(m.kind)
                if len(kinds) == 1:
                    await asyncio.sleep(0.3)  # not reading: the queue fills, the replica's stream is cut
                if len(kinds) == 13:
                    break
        assert RESET in kinds and opens >= 2  # told to start over, and resubscribed

    asyncio.run(asyncio.wait_for(scenario(), 20))
