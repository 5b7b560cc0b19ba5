"""EngineReplica: one radixcache Engine per Ray Serve replica, built exactly as `radixcache serve` builds it.

The ingress reaches it through a DeploymentHandle: `generate` goes through the handle's router (CacheAwareRouter),
which picks the replica; fleet-wide calls (stats, flush, pin, unpin, abort) go to every replica with Serve's
`handle.broadcast`, and each replica answers for itself.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from radixcache.worker.engine_stream import EngineStream
from radixcache.worker.request import Request, RequestOutput, SamplingParams

log = logging.getLogger("radixcache.cluster")


class EngineReplica:
    """The deployment class (wrapped with serve.deployment by the app)."""

    async def __init__(
        self, serve_argv: list[str], hub_name: str | None = None, hub_namespace: str | None = None, threads: int = 1
    ) -> None:
        import torch

        from radixcache.worker.cli import build_engine, parser

        torch.set_num_threads(threads)
        args = parser().parse_args(serve_argv)
        self.engine, self.facts = await asyncio.to_thread(build_engine, args)
        self.replica_id = _own_replica_id()
        self.events = None
        if hub_name is not None:
            await self._publish_events(hub_name, hub_namespace or "")

    async def _publish_events(self, hub_name: str, hub_namespace: str) -> None:
        """Register with the cluster's EventHub, then feed it this replica's cache events (snapshot first)."""
        from radixcache.cluster.events_feed import RayHubPublisher
        from radixcache.cluster.hub import get_or_create_hub
        from radixcache.worker.cache_events import CacheEventHub

        hub = get_or_create_hub(hub_name, hub_namespace)
        await hub.register.remote(self.replica_id)
        self.events = CacheEventHub(self.engine)
        await self.events.start()
        self.events.add_publisher(RayHubPublisher(hub, self.replica_id))

    def __del__(self) -> None:
        self.engine.shutdown(drain=False)

    # -- serving -----------------------------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Streams (replica id, output) until every sample has finished; cancelling the stream aborts the request."""
        stream = EngineStream(self.engine, request).open()
        try:
            async for out in stream:
                yield self.replica_id, out
        finally:
            stream.close()

    # -- fleet-wide calls (the ingress broadcasts them to every replica) ---------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Aborts the request if this replica runs it."""
        return self.engine.abort(request_id)

    async def stats(self) -> tuple[str, Any]:
        return self.replica_id, await asyncio.to_thread(self.engine.stats)

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

    async def tokenizer(self) -> Any:
        """The replica's tokenizer (pickled to the ingress, which tokenizes before routing)."""
        return self.engine.tokenizer

    async def model_facts(self) -> Any:
        """The replica's ModelFacts (worker/engine_api.py), pickled to the ingress."""
        return self.facts

    async def whoami(self) -> str:
        return self.replica_id


def _own_replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.to_full_id_str()
