"""FleetEngine: the engine interface (submit / abort / stats / flush_cache / pin / unpin) over N Ray Serve replicas.

The gRPC servicer of a single worker runs unchanged on top of it (DESIGN.md, "Fronts, engine, hosts"): it validates,
tokenizes and streams exactly as on one worker, while each call here goes through a DeploymentHandle whose
CacheAwareRouter picks the replica. Everything runs on the ingress replica's asyncio loop, except the calls the
servicer makes from a worker thread (stats, flush, pin, unpin), which hop onto that loop.

Faults: a replica that dies mid-stream ends the request with ErrorKind.UNAVAILABLE; one that dies before streaming
anything is retried once on another replica (nothing was sent to the client, so the retry is invisible).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from radixcache.cluster.replica import NotTheTarget
from radixcache.worker.engine import EngineStats, validate_request
from radixcache.worker.request import ErrorKind, FinishReason, Request, RequestOutput, SamplingParams

log = logging.getLogger("radixcache.cluster")

RETRIES_BEFORE_FIRST_OUTPUT = 1


class FleetEngine:
    def __init__(self, handle: Any, hub: Any, tokenizer: Any, model_info: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = handle  # DeploymentHandle of EngineReplica (with the CacheAwareRouter)
        self.hub = hub  # the EventHub actor: which replicas are alive
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.page_size = int(model_info.page_size)
        self.num_pages = int(model_info.kv_pages)
        self.vocab_size = int(model_info.vocab_size)
        self.context_length = int(model_info.context_length)
        self.loop = loop
        self._running: dict[str, tuple[asyncio.Task, list[str]]] = {}  # request id -> (relay task, [replica id])

    # -- the engine interface, called on the loop ---------------------------------------------------------------
    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None:
        """Raises like Engine.submit (ValueError, RequestTooLargeError, DuplicateRequestError) before routing."""
        from radixcache.worker.engine import DuplicateRequestError

        validate_request(request, self.vocab_size, self.context_length, self.page_size, self.num_pages)
        if request.request_id in self._running:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already running; ids must be unique")
        where: list[str] = []
        task = self.loop.create_task(self._relay(request, on_output, where))
        self._running[request.request_id] = (task, where)
        task.add_done_callback(lambda _: self._running.pop(request.request_id, None))

    def abort(self, request_id: str) -> bool:
        entry = self._running.get(request_id)
        if entry is None:
            return False
        _, where = entry
        if where:  # the replica ends it with FINISH_REASON_ABORTED, as one worker would
            self.handle.abort.remote(request_id, target=where[0])
        else:  # not routed yet
            entry[0].cancel()
        return True

    async def _relay(self, request: Request, on_output: Callable[[RequestOutput], None], where: list[str]) -> None:
        sent_any = False
        attempts = 0
        while True:
            stream = self.handle.options(stream=True).generate.remote(request)
            try:
                async for replica, out in stream:
                    if not where:
                        where.append(replica)
                    sent_any = True
                    on_output(out)
                return
            except asyncio.CancelledError:
                stream.cancel()
                on_output(_final(request, FinishReason.ABORTED))
                raise
            except Exception as e:  # the replica died (or failed) under the request
                if not sent_any and attempts < RETRIES_BEFORE_FIRST_OUTPUT:
                    attempts += 1
                    where.clear()
                    log.warning("request %s: replica failed before any output (%s); retrying", request.request_id, e)
                    continue
                on_output(_final(request, FinishReason.ERROR, f"the replica serving it failed: {e}"))
                return

    # -- fleet-wide calls, made from a worker thread ------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._on_loop(self._stats())

    def flush_cache(self, namespace: str | None = None) -> int:
        return sum(self._on_loop(self._each("flush_cache", namespace or "")))

    def pin(self, token_ids: list[int], namespace: str = "", ttl_s: float | None = None) -> int:
        """Pins on every replica, computing the prefix first where it is not cached; the least any replica pinned."""
        return min(self._on_loop(self._pin_everywhere(token_ids, namespace, ttl_s)), default=0)

    def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        return max(self._on_loop(self._each("unpin", token_ids, namespace)), default=0)

    def per_replica_stats(self) -> list[tuple[str, EngineStats]]:
        return self._on_loop(self._per_replica_stats())

    # -- helpers ------------------------------------------------------------------------------------------------
    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _replicas(self) -> list[str]:
        return await self.hub.replicas.remote()

    async def _each(self, method: str, *args: Any) -> list[Any]:
        """Call `method` once on every live replica; a replica that died meanwhile is skipped."""
        replicas = await self._replicas()
        calls = [getattr(self.handle, method).remote(*args, target=r) for r in replicas]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return [r for r in results if not isinstance(r, (NotTheTarget, BaseException))]

    async def _per_replica_stats(self) -> list[tuple[str, EngineStats]]:
        replicas = await self._replicas()
        results = await asyncio.gather(*[self.handle.stats.remote(target=r) for r in replicas], return_exceptions=True)
        return [(r, s) for r, s in zip(replicas, results, strict=True) if isinstance(s, EngineStats)]

    async def _stats(self) -> EngineStats:
        return sum_stats([s for _, s in await self._per_replica_stats()])

    async def _pin_everywhere(self, token_ids: list[int], namespace: str, ttl_s: float | None) -> list[int]:
        whole = len(token_ids) // self.page_size * self.page_size

        async def one(replica: str) -> int | None:
            pinned = await self.handle.pin.remote(token_ids, namespace, ttl_s, target=replica)
            if isinstance(pinned, NotTheTarget):
                return None
            if pinned < whole:  # not cached there yet: compute it with a one-token generation, then pin
                warm_id = f"pin-{uuid.uuid4().hex}"
                warm = Request(warm_id, token_ids, SamplingParams(max_tokens=1), namespace=namespace)
                async for _ in self.handle.options(stream=True).generate.remote(warm, target=replica):
                    pass
                pinned = await self.handle.pin.remote(token_ids, namespace, ttl_s, target=replica)
            return None if isinstance(pinned, NotTheTarget) else pinned

        results = await asyncio.gather(*[one(r) for r in await self._replicas()], return_exceptions=True)
        return [r for r in results if isinstance(r, int)]


def _final(request: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        token_ids=[],
        text="",
        prompt_tokens=len(request.prompt_ids),
        cached_tokens=0,
        completion_tokens=0,
        finish_reason=reason,
        error=error,
        error_kind=ErrorKind.UNAVAILABLE if reason is FinishReason.ERROR else None,
    )


def sum_stats(parts: list[EngineStats]) -> EngineStats:
    """The fleet's counters: every replica's added up (the cache's too)."""
    from dataclasses import fields

    from radixcache.cache import CacheStats

    def add(cls: Any, items: list[Any]) -> Any:
        values = {}
        for f in fields(cls):
            vals = [getattr(i, f.name) for i in items]
            values[f.name] = add(CacheStats, vals) if f.name == "cache" else sum(vals)
        return cls(**values)

    return add(EngineStats, parts)
