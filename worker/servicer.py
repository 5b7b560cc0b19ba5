"""The RadixCache gRPC service: authentication, validation, and the bridge from the engine thread to the stream.

Threading: RPC handlers run on the asyncio loop; the engine calls `on_output` from its own thread, which only hands
the output to the loop (call_soon_threadsafe) and never blocks. Calls that the engine runs on its thread and waits
for (flush, pin, unpin, stats), and tokenizing / chat templating, are awaited through a worker thread so the loop
keeps serving streams; the cheap size checks (validation) run before them, so an oversized prompt is refused in
milliseconds.

Cancellation: a Generate handler is a coroutine that writes its messages itself, so a cancelled or disconnected
client raises CancelledError inside it at an await; a deadline is watched by the handler itself (time_remaining ->
DEADLINE_EXCEEDED). Either way closing its EngineStream aborts the engine request, which frees the request's pages
in the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, NoReturn

import grpc

from radixcache.cache import PinBudgetError
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc
from radixcache.worker.auth import Authenticator
from radixcache.worker.engine import DuplicateRequestError, RequestTooLargeError
from radixcache.worker.engine_stream import EngineStream, engine_request_id
from radixcache.worker.metrics import WorkerMetrics, flatten_stats
from radixcache.worker.pb_inputs import constraint_values, prompt_input, sampling_values
from radixcache.worker.request import Constraint, ErrorKind, FinishReason, Request, RequestOutput, SamplingParams
from radixcache.worker.structured import ConstraintError
from radixcache.worker.validation import (
    InvalidArgument,
    ModelLimits,
    PromptInput,
    check_prompt_input,
    check_request_id,
    check_ttl,
    constraint,
    sampling_params,
    tokenize_off_loop,
)

FINISH_REASONS = {
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
}


# How a request that ended with FinishReason.ERROR ends its call.
ERROR_STATUS = {
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.NO_CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    None: grpc.StatusCode.INTERNAL,
}


def to_response(request_id: str, out: RequestOutput) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        request_id=request_id,
        token_ids=out.token_ids,
        text=out.text,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        completion_tokens=out.completion_tokens,
        finish_reason=FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED),  # type: ignore[arg-type]
        index=out.index,
        draft_tokens=out.draft_tokens,
        accepted_draft_tokens=out.accepted_draft_tokens,
    )
    for lp in out.logprobs:
        resp.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        )
    return resp


class RadixCacheServicer(pb_grpc.RadixCacheServicer):
    """Serves one engine. `engine` stays None (UNAVAILABLE) until the worker has loaded and warmed it up."""

    def __init__(self, auth: Authenticator, metrics: WorkerMetrics | None = None) -> None:
        self.auth = auth
        self.metrics = metrics
        self.engine: Any = None
        self.model_info = pb.ModelInfo()
        self.limits = ModelLimits(vocab_size=0, context_length=0)
        self.draining = False
        # (tenant, client request id) -> engine request id, for the caller's running requests
        self._active: dict[tuple[str, str], str] = {}
        self.events: Any = None  # the engine's CacheEventHub (radixcache.worker.cache_events), once attached

    def attach(self, engine: Any, model_info: pb.ModelInfo) -> None:
        self.model_info = model_info
        self.limits = ModelLimits.of(
            engine.tokenizer, vocab_size=model_info.vocab_size, context_length=model_info.context_length
        )
        self.engine = engine

    # -- helpers -------------------------------------------------------------------------------------------------
    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        tenant = self.auth.tenant(context.invocation_metadata())
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        return tenant  # type: ignore[return-value]

    async def _ready(self, context: grpc.aio.ServicerContext) -> Any:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self.engine

    async def _invalid(self, context: grpc.aio.ServicerContext, e: Exception) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise AssertionError("unreachable")  # context.abort raises

    async def _prompt(self, prompt: PromptInput, *, fit: bool = True) -> tuple[list[int], str]:
        """Tokenized in a worker thread (the size checks come first there); fit: leave room in the context."""
        return await tokenize_off_loop(prompt, self.engine.tokenizer, self.limits, fit=fit)

    async def _submit(self, stream: EngineStream, context: grpc.aio.ServicerContext) -> None:
        """stream.open() (engine.submit), with its synchronous refusals turned into the status codes the proto
        promises."""
        try:
            stream.open()
        except RequestTooLargeError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except DuplicateRequestError as e:  # e.g. retried with the same id before the cancelled run wound down
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except ValueError as e:
            await self._invalid(context, e)
        except RuntimeError as e:  # the engine is draining or stopped
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the worker is not accepting requests: {e}")

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- Generate ------------------------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        tenant = await self._tenant(context)
        engine = await self._ready(context)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            check_request_id(request_id)
            text_or_ids, values = prompt_input(request), sampling_values(request)
            check_prompt_input(text_or_ids, engine.tokenizer, self.limits)  # refused before tokenizing: bad sizes
            sampling_params(values, prompt_tokens=None, limits=self.limits)  # and bad sampling values
            wanted = constraint(*constraint_values(request))
            prompt, _ = await self._prompt(text_or_ids)
            sampling = sampling_params(values, prompt_tokens=len(prompt), limits=self.limits)
            if wanted is not None:  # compiled (and cached) in a worker thread: the event loop keeps serving
                await self._in_thread(engine.compile_constraint, wanted)
        except (InvalidArgument, ConstraintError) as e:
            await self._invalid(context, e)
        key = (tenant, request_id)
        if key in self._active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running")
        await self._stream(engine, context, key, prompt, sampling, wanted)

    async def _stream(
        self,
        engine: Any,
        context: grpc.aio.ServicerContext,
        key: tuple[str, str],
        prompt: list[int],
        sampling: SamplingParams,
        wanted: Constraint | None = None,
    ) -> None:
        tenant, request_id = key
        engine_id = engine_request_id(tenant, request_id)
        request = Request(engine_id, prompt, sampling, namespace=tenant, constraint=wanted)
        stream = EngineStream(engine, request, self.metrics)
        await self._submit(stream, context)
        self._active[key] = engine_id
        try:
            while not stream.finished:
                try:
                    out = await stream.next(context.time_remaining())
                except asyncio.TimeoutError:
                    await self._deadline_exceeded(context)
                    return
                if out.finish_reason is FinishReason.ERROR:
                    await context.abort(ERROR_STATUS[out.error_kind], f"request {request_id!r} failed: {out.error}")
                await context.write(to_response(request_id, out))
        finally:
            self._active.pop(key, None)
            stream.close()

    @staticmethod
    async def _deadline_exceeded(context: grpc.aio.ServicerContext) -> None:
        """End the call with DEADLINE_EXCEEDED (raises AbortError), or return if gRPC already ended it at the same
        deadline: the client has that status, and sending a second one fails and logged a traceback per call."""
        if context.done():
            return
        try:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        except grpc.aio.AbortError:
            raise
        except Exception:  # noqa: BLE001 (the call ended between the check and the send: nobody left to tell)
            return

    # -- unary RPCs ----------------------------------------------------------------------------------------------
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self._tenant(context)
        await self._ready(context)
        try:
            ids, text = await self._prompt(prompt_input(request), fit=False)
        except InvalidArgument as e:
            await self._invalid(context, e)
        return pb.TokenizeResponse(token_ids=ids, prompt=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._tenant(context)
        await self._ready(context)
        return self.model_info

    async def GetCacheStats(self, request: pb.GetCacheStatsRequest, context: grpc.aio.ServicerContext) -> pb.CacheStats:
        await self._tenant(context)
        engine = await self._ready(context)
        return self.cache_stats_message(await self._in_thread(engine.stats))

    @staticmethod
    def cache_stats_message(stats: Any) -> pb.CacheStats:
        """engine.stats() as the CacheStats message."""
        s = flatten_stats(stats)
        fields = pb.CacheStats.DESCRIPTOR.fields_by_name
        return pb.CacheStats(**{k: (v if k == "hit_rate" else int(v)) for k, v in s.items() if k in fields})

    async def FlushCache(
        self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushCacheResponse:
        tenant = await self._tenant(context)
        engine = await self._ready(context)
        # Only the caller's own namespace: one tenant cannot empty another's cache.
        return pb.FlushCacheResponse(pages_flushed=int(await self._in_thread(engine.flush_cache, tenant)))

    async def PinPrefix(self, request: pb.PinPrefixRequest, context: grpc.aio.ServicerContext) -> pb.PinPrefixResponse:
        tenant = await self._tenant(context)
        engine = await self._ready(context)
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        try:
            check_ttl(ttl)
            ids, _ = await self._prompt(prompt_input(request))
        except InvalidArgument as e:
            await self._invalid(context, e)
        whole = len(ids) // self.model_info.page_size * self.model_info.page_size
        try:
            pinned = int(await self._in_thread(engine.pin, ids, tenant, ttl))
            if pinned < whole:  # not cached (yet): compute it with a one-token generation, then pin what it published
                await self._warm(engine, tenant, ids, context)
                pinned = int(await self._in_thread(engine.pin, ids, tenant, ttl))
        except PinBudgetError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return pb.PinPrefixResponse(pinned_tokens=pinned, prompt_tokens=len(ids))

    async def _warm(self, engine: Any, tenant: str, ids: list[int], context: grpc.aio.ServicerContext) -> None:
        engine_id = engine_request_id(tenant, "pin-" + uuid.uuid4().hex)
        stream = EngineStream(engine, Request(engine_id, ids, SamplingParams(max_tokens=1), namespace=tenant))
        await self._submit(stream, context)
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ERROR:
                    await context.abort(ERROR_STATUS[out.error_kind], f"computing the prefix failed: {out.error}")
        finally:
            stream.close()

    async def UnpinPrefix(
        self, request: pb.UnpinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnpinPrefixResponse:
        tenant = await self._tenant(context)
        engine = await self._ready(context)
        try:
            ids, _ = await self._prompt(prompt_input(request))
        except InvalidArgument as e:
            await self._invalid(context, e)
        return pb.UnpinPrefixResponse(unpinned_tokens=int(await self._in_thread(engine.unpin, ids, tenant)))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        tenant = await self._tenant(context)
        engine = await self._ready(context)
        engine_id = self._active.get((tenant, request.request_id))  # only the caller's own requests
        return pb.AbortResponse(aborted=bool(engine_id is not None and engine.abort(engine_id)))

    # -- cache events --------------------------------------------------------------------------------------------
    async def SubscribeCacheEvents(
        self, request: pb.SubscribeCacheEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await self._tenant(context)
        if not self.auth.is_admin(context.invocation_metadata()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "cache events need a token marked admin")
        await self._ready(context)
        hub = self.events
        if hub is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker's engine reports no cache events")
        from radixcache.worker.events_proto import batch_to_proto

        async with contextlib.aclosing(hub.subscribe()) as batches:
            async for batch in batches:
                for message in batch_to_proto(batch, hub.page_size):
                    await context.write(message)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
