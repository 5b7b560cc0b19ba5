"""EngineReplica: one radixcache Engine per Ray Serve replica, built exactly as `radixcache serve` builds it.

The ingress reaches it through a DeploymentHandle: `generate` goes through the handle's router (CacheAwareRouter),
which picks the replica; fleet-wide calls (stats, flush, pin, unpin, abort) go to every replica with Serve's
`handle.broadcast`, and each replica answers for itself. Serve calls `check_health` every health_check_period_s
(cluster.lifecycle.HealthCheck); when the replica is being stopped it drains (cluster.lifecycle.Drain): its streams
get `grace_s` to finish, then what is left ends with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from radixcache.cluster.lifecycle import Drain, HealthCheck
from radixcache.worker.engine.request import Request, RequestOutput, SamplingParams
from radixcache.worker.engine.stream import EngineStream

log = logging.getLogger("radixcache.cluster")

DEFAULT_GRACE_S = 30.0
HEALTH_CALL_TIMEOUT_S = 20.0  # the engine thread takes a call between two steps: longer means it hangs in one


class EngineReplica:
    """The deployment class (wrapped with serve.deployment by the app)."""

    async def __init__(
        self,
        serve_argv: list[str],
        hub_name: str | None = None,
        hub_namespace: str | None = None,
        threads: int = 1,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        import torch

        from radixcache.worker.cli import build_engine, parser

        torch.set_num_threads(threads)
        args = parser().parse_args(serve_argv)
        self.engine, self.facts = await asyncio.to_thread(build_engine, args)
        self.kv_events_endpoint = args.kv_events_endpoint
        self.replica_id = _own_replica_id()
        self.health = HealthCheck()
        self.drain = Drain(self.engine.abort, grace_s=grace_s)
        self.events = self.link = None
        if hub_name is not None:
            await self._publish_events(hub_name, hub_namespace or "")

    async def _publish_events(self, hub_name: str, hub_namespace: str) -> None:
        """Register with the cluster's EventHub, then feed it this replica's cache events (snapshot first) and load,
        registering again whenever the hub is new (events_feed.HubLink)."""
        from radixcache.cluster.events_feed import HubLink, RayHubPublisher
        from radixcache.cluster.hub import get_or_create_hub
        from radixcache.worker.events.hub import CacheEventHub

        self.events = CacheEventHub(self.engine)
        self.link = HubLink(
            self.replica_id,
            connect=lambda: get_or_create_hub(hub_name, hub_namespace),
            load=lambda: asyncio.to_thread(self.engine.load),
            resync=self.events.resync_publishers,
            on_drain=self.drain.start,
        )
        await self.link.register()
        await self.events.start()
        self.events.add_publisher(RayHubPublisher(self.link))
        if self.kv_events_endpoint:
            self.events.add_publisher(_zmq_publisher(self.kv_events_endpoint, self.engine.page_size))
        self.link.start()

    # -- serving -----------------------------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Streams (replica id, output) until every sample has finished; cancelling the stream aborts the request."""
        stream = EngineStream(self.engine, request).open()
        self.drain.opened(request.request_id)
        try:
            async for out in stream:
                yield self.replica_id, self.drain.settle(out)
        finally:
            stream.close()
            self.drain.closed(request.request_id)

    async def cache_events(self, target: Any) -> AsyncIterator[bytes]:
        """This replica's SubscribeCacheEvents stream (snapshot, events, reset when read too slowly), each message a
        serialized CacheEventBatch tagged with its replica_id; `target` (a fleet_events.ReplicaTarget) must name this
        replica."""
        if target.replica_id != self.replica_id:
            raise LookupError(f"the cache events of {target.replica_id} were asked of {self.replica_id}")
        if self.events is None:
            raise RuntimeError("this replica publishes no cache events")
        from radixcache.worker.events.proto import batch_to_proto

        async with contextlib.aclosing(self.events.subscribe()) as batches:
            async for batch in batches:
                for message in batch_to_proto(batch, self.engine.page_size):
                    message.replica_id = self.replica_id
                    yield message.SerializeToString()

    async def check_health(self) -> None:
        """Serve's health check: raises when the engine thread is gone, hangs in a step, or has stopped stepping
        with requests queued (Serve then replaces this replica)."""
        load = await asyncio.wait_for(asyncio.to_thread(self.engine.load), HEALTH_CALL_TIMEOUT_S)
        self.health.check(self.engine.alive, load)

    # -- fleet-wide calls (the ingress broadcasts them to every replica) ---------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Aborts the request if this replica runs it."""
        if request_id in self.drain.live:
            self.drain.aborted_by_client.add(request_id)
        return self.engine.abort(request_id)

    async def stats(self, namespace: str | None = None) -> tuple[str, Any]:
        return self.replica_id, await asyncio.to_thread(self.engine.stats, namespace)

    async def flush_cache(self, namespace: str) -> int:
        return await asyncio.to_thread(self.engine.flush_cache, namespace)

    async def pin(self, token_ids: list[int], namespace: str, ttl_s: float | None) -> int:
        """Pins the prefix here, computing it first (a one-token generation) where it is not cached yet."""
        whole = len(token_ids) // self.engine.page_size * self.engine.page_size
        pinned = await asyncio.to_thread(self.engine.pin, token_ids, namespace, ttl_s)
        if pinned < whole:
            warm = Request(f"pin-{uuid.uuid4().hex}", token_ids, SamplingParams(max_tokens=1), namespace=namespace)
            async for _ in self.generate(warm):
                pass
            pinned = await asyncio.to_thread(self.engine.pin, token_ids, namespace, ttl_s)
        return pinned

    async def unpin(self, token_ids: list[int], namespace: str) -> int:
        return await asyncio.to_thread(self.engine.unpin, token_ids, namespace)

    async def explain(self, token_ids: list[int], namespace: str) -> Any:
        """This replica's page-by-page view of the prompt (radixcache.explain.Explanation); changes nothing."""
        return await asyncio.to_thread(self.engine.explain, token_ids, namespace)

    async def tokenizer(self) -> Any:
        """The replica's tokenizer (pickled to the ingress, which tokenizes before routing)."""
        return self.engine.tokenizer

    async def model_facts(self) -> Any:
        """The replica's ModelFacts (worker/engine/api.py), pickled to the ingress."""
        return self.facts

    async def whoami(self) -> str:
        return self.replica_id


def _zmq_publisher(endpoint: str, page_size: int) -> Any:
    """This replica's ZMQ feed in vLLM's format (serve_argv's --kv-events-endpoint), by vLLM's data-parallel rule:
    the port offset by the replica's rank on its node (replicas sharing a node never collide), every batch tagged
    with its rank in the deployment as data_parallel_rank (an indexer tells the fleet's replicas apart)."""
    from ray import serve

    from radixcache.worker.events.zmq_publisher import ZmqKvEventPublisher, rank_endpoint

    rank = serve.get_replica_context().rank
    return ZmqKvEventPublisher(rank_endpoint(endpoint, rank.local_rank), page_size, data_parallel_rank=rank.rank)


def _own_replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.to_full_id_str()
