"""FleetEngine: the engine interface (worker/engine/api.py's EngineLike) over N Ray Serve replicas.

The front core of a single worker (worker/front/core.py) runs unchanged on top of it, as it runs over an Engine: it
validates, tokenizes, compiles constraints and streams exactly as on one worker, while each call here goes through a
DeploymentHandle. Generate is routed by the handle's CacheAwareRouter to one replica; the fleet-wide calls (stats,
flush, pin, unpin, abort) are broadcast to every replica (Serve's `handle.broadcast`), each answering for itself.
Everything runs on the ingress replica's asyncio loop, except the calls the servicer makes from a worker thread, which
hop onto that loop.

Faults: a replica that dies mid-stream ends the request with ErrorKind.UNAVAILABLE; one that dies before streaming
anything is retried once on another replica (nothing was sent to the client, so the retry is invisible).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import Callable
from typing import Any

from radixcache.explain import Explanation
from radixcache.worker.engine.api import DuplicateRequestError, EngineStats, ModelFacts
from radixcache.worker.engine.checks import check_engine_request
from radixcache.worker.engine.request import Constraint, ErrorKind, FinishReason, Request, RequestOutput
from radixcache.worker.engine.structured import GrammarCache

log = logging.getLogger("radixcache.cluster")

RETRIES_BEFORE_FIRST_OUTPUT = 1
BROADCAST_TIMEOUT_S = 60.0  # a fleet-wide call does without a replica that does not answer by then


class FleetEngine:
    def __init__(self, handle: Any, tokenizer: Any, facts: ModelFacts, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = handle  # DeploymentHandle of EngineReplica (with the CacheAwareRouter)
        self.tokenizer = tokenizer
        self.facts = facts
        self.page_size = int(facts.page_size)
        self.num_pages = int(facts.kv_pages)
        self.vocab_size = int(facts.vocab_size)
        self.context_length = int(facts.context_length)
        self.loop = loop
        # Constraints compile here (the ingress holds the tokenizer) so that a bad schema is refused before routing;
        # each replica compiles again on its own thread (its GrammarCache) when the request arrives.
        self.grammars = GrammarCache(tokenizer, self.vocab_size, set(facts.eos_token_ids))
        self._relays: dict[str, asyncio.Task] = {}  # request id -> the task relaying its stream
        self._aborts: set[asyncio.Task] = set()  # abort broadcasts in flight (referenced until done)

    # -- the engine interface, called on the loop ---------------------------------------------------------------
    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None:
        """Raises like Engine.submit (ValueError, RequestTooLargeError, DuplicateRequestError) before routing."""
        check_engine_request(request, self)
        if request.request_id in self._relays:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already running; ids must be unique")
        # Serve's router tells concurrent requests apart by their internal request id, which a call's sub-requests
        # inherit: give each relay its own, or two streams of one call (n samples) could wait on each other.
        context = contextvars.copy_context()
        context.run(_new_serve_request_id)
        task = self.loop.create_task(self._relay(request, on_output), context=context)
        self._relays[request.request_id] = task
        task.add_done_callback(lambda _: self._relays.pop(request.request_id, None))

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compile (and cache) the constraint as a replica would: ConstraintError (a ValueError) before routing."""
        self.grammars.compile(constraint)

    def abort(self, request_id: str) -> bool:
        if request_id not in self._relays:
            return False
        # The replica running it ends it with FINISH_REASON_ABORTED, as one worker would; the others answer False.
        # (A broadcast is only sent once its results are awaited.)
        task = self.loop.create_task(self._abort_async(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        return True

    async def abort_anywhere(self, request_id: str) -> bool:
        """Abort a request this ingress does not relay (with several ingress replicas, another one may): every
        engine replica is asked; True if one ended it."""
        return any(await self._broadcast_async("abort", request_id))

    async def _abort_async(self, request_id: str) -> None:
        answers = await self._broadcast_async("abort", request_id)
        relay = self._relays.get(request_id)
        if relay is not None and not any(answers):
            # No replica ended it (one did not answer, or none had it yet) but it still streams: cancelling the relay
            # cancels its Serve stream, and the replica's generate() aborts the request when its stream closes.
            log.warning("abort of %s: no replica ended it; cancelling its stream", request_id)
            relay.cancel()

    async def _relay(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None:
        unfinished = set(range(request.sampling.n))  # samples whose last output has not come yet
        attempts = 0
        while True:
            stream = self.handle.options(stream=True).generate.remote(request)
            sent_any = False
            try:
                async for _replica, out in stream:
                    sent_any = True
                    if out.finish_reason is not None:
                        unfinished.discard(out.index)
                    on_output(out)
                return
            except asyncio.CancelledError:
                stream.cancel()
                for index in sorted(unfinished):
                    on_output(_final(request, index, FinishReason.ABORTED))
                raise
            except Exception as e:  # the replica died (or failed) under the request
                if not sent_any and attempts < RETRIES_BEFORE_FIRST_OUTPUT:
                    attempts += 1
                    log.warning("request %s: replica failed before any output (%s); retrying", request.request_id, e)
                    continue
                for index in sorted(unfinished):  # every front waits for each sample's last output
                    on_output(_final(request, index, FinishReason.ERROR, f"the replica serving it failed: {e}"))
                return

    # -- fleet-wide calls, made from a worker thread ------------------------------------------------------------
    def stats(self, namespace: str | None = None) -> EngineStats:
        """Every replica's figures added up (one tenant's, with a namespace: see Engine.stats)."""
        return sum_stats([s for _, s in self.per_replica_stats(namespace)])

    async def replica_ids(self) -> list[str]:
        """The replicas that answer now."""
        return sorted(await self._broadcast_async("whoami"))

    def per_replica_stats(self, namespace: str | None = None) -> list[tuple[str, EngineStats]]:
        return sorted(self._broadcast("stats", namespace))

    def flush_cache(self, namespace: str | None = None) -> int:
        return sum(self._broadcast("flush_cache", namespace or ""))

    def pin(self, token_ids: list[int], namespace: str = "", ttl_s: float | None = None) -> int:
        """Pins on every replica (each computing the prefix first where it is not cached); the least any pinned."""
        return min(self._broadcast("pin", token_ids, namespace, ttl_s), default=0)

    def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        return max(self._broadcast("unpin", token_ids, namespace), default=0)

    def explain(self, token_ids: list[int], namespace: str = "") -> Explanation:
        """The replica that would serve the most of the prompt (what a cache-aware route can reach); RuntimeError
        when no replica answers."""
        answers = self._broadcast("explain", token_ids, namespace)
        if not answers:
            raise RuntimeError("no replica answered the explain call")
        return max(answers, key=lambda e: e.cached_tokens)

    def _broadcast(self, method: str, *args: Any) -> list[Any]:
        """_broadcast_async from a worker thread (the servicer's stats, flush, pin and unpin)."""
        return asyncio.run_coroutine_threadsafe(self._broadcast_async(method, *args), self.loop).result()

    async def _broadcast_async(self, method: str, *args: Any) -> list[Any]:
        """Every live replica's answer; a replica that failed or did not answer in time is left out (logged)."""
        response = self.handle.broadcast(method, *args)
        results = await response.results_async(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.warning("%s: a replica did not answer: %s", method, r)
        return [r for r in results if not isinstance(r, BaseException)]


def remote_apart(method: Any, *args: Any) -> Any:
    """`method.remote(*args)` as a request of its own for Serve's router: Serve matches the replica it chose to a
    pending request by internal request id, which calls made in one request's context share (two such calls in
    flight at once could be swapped, or one never served)."""
    context = contextvars.copy_context()
    context.run(_new_serve_request_id)
    return context.run(method.remote, *args)


def _new_serve_request_id() -> None:
    from ray.serve import context

    context._set_request_context(_internal_request_id=uuid.uuid4().hex)


def _final(request: Request, index: int, reason: FinishReason, error: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        index=index,
        token_ids=[],
        text="",
        prompt_tokens=len(request.prompt_ids),
        cached_tokens=0,
        completion_tokens=0,
        finish_reason=reason,
        error=error,
        error_kind=ErrorKind.UNAVAILABLE if reason is FinishReason.ERROR else None,
    )


# Facts of a replica's configuration, not counters: the fleet reports the value they share ("mixed" / 0 otherwise).
_SHARED_FACTS = ("kv_dtype", "kv_bytes_per_token")


def sum_stats(parts: list[EngineStats]) -> EngineStats:
    """The fleet's counters: every replica's added up (the cache's too); facts such as the KV dtype as shared."""
    from dataclasses import fields

    from radixcache.cache import CacheStats

    def add(cls: Any, items: list[Any]) -> Any:
        values = {}
        for f in fields(cls):
            vals = [getattr(i, f.name) for i in items]
            if f.name == "cache":
                values[f.name] = add(CacheStats, vals)
            elif f.name in _SHARED_FACTS:
                distinct = set(vals)
                if len(distinct) == 1:
                    values[f.name] = distinct.pop()
                else:  # none (no replica: the default) or several
                    values[f.name] = f.default if not distinct else "mixed" if f.type == "str" else 0
            else:
                values[f.name] = sum(vals)
        return cls(**values)

    return add(EngineStats, parts)
