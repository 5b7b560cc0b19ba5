"""Ingress: the `radixcache.v1.RadixCache` contract behind Ray Serve's gRPC proxy, and the OpenAI-compatible HTTP
API behind its HTTP proxy, for a whole fleet.

Both fronts run exactly as on one worker, over one front core (worker/front/core.py) whose engine is a FleetEngine: Ray
Serve's gRPC proxy calls a method of this deployment named after the RPC, with the request message and a
RayServegRPCContext, and the single worker's RadixCacheServicer serves it, writing its messages and aborting
through `ServeCallContext`, which carries them to the proxy; the OpenAI app is served through Serve's HTTP proxy
over the same core. So the Client, the CLI and OpenAI clients work against a cluster as against one worker, apart
from the address.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from radixcache.v1 import radixcache_pb2 as pb


class CallAborted(Exception):
    """The servicer ended the call with a status (already set on the Ray Serve context)."""


class ServeCallContext:
    """The part of grpc.aio.ServicerContext that RadixCacheServicer uses, over Ray Serve's gRPC context."""

    def __init__(self, serve_context: Any, writes: asyncio.Queue | None = None) -> None:
        self.serve_context = serve_context
        self.writes = writes

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self.serve_context.invocation_metadata())

    def time_remaining(self) -> float | None:
        return None  # the proxy enforces the client's deadline by cancelling the call, which aborts the request

    async def write(self, message: Any) -> None:
        assert self.writes is not None, "write() on a unary call"
        await self.writes.put(message)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.serve_context.set_code(code)
        self.serve_context.set_details(details)
        if trailing_metadata:  # the refused field (worker/grpc/servicer.py's refusal_status)
            self.serve_context.set_trailing_metadata(list(trailing_metadata))
        raise CallAborted(details)


_END = object()


class Ingress:
    """The deployment class (wrapped with serve.ingress() and serve.deployment by the app): the gRPC methods below,
    and the OpenAI-compatible HTTP API (worker.openai's app over the same servicer) through Serve's HTTP proxy."""

    async def __init__(
        self, replicas: Any, auth_tokens: dict[str, str] | None, admin_tokens: frozenset[str] = frozenset()
    ) -> None:
        from radixcache.cluster.fleet import FleetEngine, remote_apart
        from radixcache.cluster.fleet_events import FleetEvents, ReplicaTarget
        from radixcache.worker.front.auth import Authenticator
        from radixcache.worker.front.core import FrontCore
        from radixcache.worker.grpc.servicer import RadixCacheServicer

        facts = await replicas.model_facts.remote()
        tokenizer = await replicas.tokenizer.remote()
        self.fleet = FleetEngine(replicas, tokenizer, facts, asyncio.get_running_loop())
        self.core = FrontCore(Authenticator(auth_tokens, admin_tokens))
        self.core.attach(self.fleet, facts)
        self.servicer = RadixCacheServicer(self.core)
        stream = replicas.options(stream=True).cache_events
        self.cache_events = FleetEvents(self.fleet.replica_ids, lambda rid: remote_apart(stream, ReplicaTarget(rid)))

    def __serve_build_asgi_app__(self) -> Any:
        from radixcache.worker.http.app import create_app

        return create_app(self.core)

    async def _unary(self, method: str, request: Any, grpc_context: Any) -> Any:
        try:
            return await getattr(self.servicer, method)(request, ServeCallContext(grpc_context))
        except CallAborted as e:
            raise RuntimeError(str(e)) from None  # Ray Serve answers with the status set on grpc_context

    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any) -> AsyncIterator[pb.GenerateResponse]:
        writes: asyncio.Queue = asyncio.Queue()
        call = asyncio.ensure_future(self.servicer.Generate(request, ServeCallContext(grpc_context, writes)))
        call.add_done_callback(lambda _: writes.put_nowait(_END))
        try:
            while (message := await writes.get()) is not _END:
                yield message
            try:
                call.result()
            except CallAborted as e:
                raise RuntimeError(str(e)) from None
        finally:
            if not call.done():  # the client went away: the servicer's finally aborts the request on its replica
                call.cancel()

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: Any) -> pb.TokenizeResponse:
        return await self._unary("Tokenize", request, grpc_context)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context: Any) -> pb.ModelInfo:
        return await self._unary("GetModelInfo", request, grpc_context)

    async def GetCacheStats(self, request: pb.GetCacheStatsRequest, grpc_context: Any) -> pb.CacheStats:
        from radixcache.worker.grpc.servicer import cache_stats_message

        total = await self._unary("GetCacheStats", request, grpc_context)  # authenticated: it raised otherwise
        view = self.core.stats_view(grpc_context.invocation_metadata())  # a tenant sees its own figures
        for replica, stats in await asyncio.to_thread(self.fleet.per_replica_stats, view):
            total.replicas.add(replica_id=replica, stats=cache_stats_message(stats))
        return total

    async def FlushCache(self, request: pb.FlushCacheRequest, grpc_context: Any) -> pb.FlushCacheResponse:
        return await self._unary("FlushCache", request, grpc_context)

    async def PinPrefix(self, request: pb.PinPrefixRequest, grpc_context: Any) -> pb.PinPrefixResponse:
        return await self._unary("PinPrefix", request, grpc_context)

    async def UnpinPrefix(self, request: pb.UnpinPrefixRequest, grpc_context: Any) -> pb.UnpinPrefixResponse:
        return await self._unary("UnpinPrefix", request, grpc_context)

    async def ExplainPrefix(self, request: pb.ExplainPrefixRequest, grpc_context: Any) -> pb.ExplainPrefixResponse:
        """As on one worker, from the replica that would serve the most of the prompt (FleetEngine.explain)."""
        return await self._unary("ExplainPrefix", request, grpc_context)

    async def Abort(self, request: pb.AbortRequest, grpc_context: Any) -> pb.AbortResponse:
        """As on one worker; a request this ingress replica does not relay may stream through another one (Serve's
        proxies spread calls over the ingress replicas): then every engine replica is asked."""
        from radixcache.worker.front.core import engine_request_id

        response = await self._unary("Abort", request, grpc_context)
        if not response.aborted:
            tenant = self.core.tenant(grpc_context.invocation_metadata())  # _unary has checked the token
            response.aborted = await self.fleet.abort_anywhere(engine_request_id(tenant, request.request_id))
        return response

    async def SubscribeCacheEvents(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        """Every replica's cache events, each batch tagged with its replica_id (cluster.fleet_events); an admin
        token is required, as on one worker."""
        from radixcache.worker.front.core import Refusal
        from radixcache.worker.grpc.servicer import STATUS

        metadata = grpc_context.invocation_metadata()
        try:
            self.core.tenant(metadata)
            self.core.require_admin(metadata, "cache events")
        except Refusal as r:
            grpc_context.set_code(STATUS[r.kind])
            grpc_context.set_details(r.message)
            raise RuntimeError(r.message) from None  # Ray Serve answers with the status set on grpc_context
        async with contextlib.aclosing(self.cache_events.subscribe()) as batches:
            async for message in batches:
                yield message
