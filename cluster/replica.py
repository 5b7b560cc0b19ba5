"""EngineReplica: one radixcache Engine per Ray Serve replica, built exactly as `radixcache serve` builds it.

The ingress reaches it through a DeploymentHandle whose router (CacheAwareRouter) picks the replica. Calls that
must reach one particular replica (fleet-wide flush, pin, stats; Abort of a request it runs) carry
`target=<replica id>`; the router honours it, and a replica that receives a call meant for another one (its target
died in between) answers None instead of acting, so nothing is counted or done twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from radixcache.worker.request import Request, RequestOutput

log = logging.getLogger("radixcache.cluster")


class NotTheTarget:
    """Returned by a targeted call that reached the wrong replica."""


class EngineReplica:
    """The deployment class (wrapped with serve.deployment by the app)."""

    def __init__(
        self, serve_argv: list[str], hub_name: str | None = None, hub_namespace: str | None = None, threads: int = 1
    ) -> None:
        import torch

        from radixcache.worker.cli import build_engine, parser

        torch.set_num_threads(threads)

        args = parser().parse_args(serve_argv)
        self.engine, info = build_engine(args)
        self.model_info_bytes = info.SerializeToString()
        self.replica_id = _own_replica_id()
        self._pump = None
        if hub_name is not None:
            from radixcache.cluster.events_feed import EventPump

            self._pump = EventPump(self.engine, self.replica_id, hub_name, hub_namespace)
            self._pump.start()

    def __del__(self) -> None:
        if self._pump is not None:
            self._pump.stop()
        self.engine.shutdown(drain=False)

    def _is_target(self, target: str | None) -> bool:
        return target is None or target == self.replica_id

    # -- serving -----------------------------------------------------------------------------------------------
    async def generate(self, request: Request, target: str | None = None) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Streams (replica id, output) until the request finishes; cancelling the stream aborts the request.

        `target` only steers the router (a pin computing its prefix on every replica); any replica may serve it.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass

        self.engine.submit(request, on_output)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None
                yield self.replica_id, out
        finally:
            if not finished:
                self.engine.abort(request.request_id)

    async def abort(self, request_id: str, target: str | None = None) -> bool | NotTheTarget:
        if not self._is_target(target):
            return NotTheTarget()
        return self.engine.abort(request_id)

    # -- fleet-wide administration (each call targets one replica) ------------------------------------------------
    async def stats(self, target: str | None = None) -> Any:
        if not self._is_target(target):
            return NotTheTarget()
        return await asyncio.to_thread(self.engine.stats)

    async def flush_cache(self, namespace: str, target: str | None = None) -> int | NotTheTarget:
        if not self._is_target(target):
            return NotTheTarget()
        return await asyncio.to_thread(self.engine.flush_cache, namespace)

    async def pin(
        self, token_ids: list[int], namespace: str, ttl_s: float | None, target: str | None = None
    ) -> int | NotTheTarget:
        if not self._is_target(target):
            return NotTheTarget()
        return await asyncio.to_thread(self.engine.pin, token_ids, namespace, ttl_s)

    async def unpin(self, token_ids: list[int], namespace: str, target: str | None = None) -> int | NotTheTarget:
        if not self._is_target(target):
            return NotTheTarget()
        return await asyncio.to_thread(self.engine.unpin, token_ids, namespace)

    async def tokenizer(self) -> Any:
        """The replica's tokenizer (pickled to the ingress, which tokenizes before routing)."""
        return self.engine.tokenizer

    async def model_info(self) -> bytes:
        return self.model_info_bytes

    async def whoami(self) -> str:
        return self.replica_id


def _own_replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.to_full_id_str()
