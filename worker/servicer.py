"""The RadixCache gRPC service: authentication, validation, and the bridge from the engine thread to the stream.

Threading: RPC handlers run on the asyncio loop; the engine calls `on_output` from its own thread, which only hands
the output to the loop (call_soon_threadsafe) and never blocks. Calls that the engine runs on its thread and waits
for (flush, pin, unpin, stats) are awaited through a worker thread so the loop keeps serving streams.

Cancellation: a Generate handler is a coroutine that writes its messages itself, so a cancelled or disconnected
client raises CancelledError inside it at an await; a deadline is watched by the handler itself (time_remaining ->
DEADLINE_EXCEEDED). Either way its `finally` aborts the engine request, which frees the request's pages in the
engine's next step.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, NoReturn

import grpc

from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc
from radixcache.worker.auth import Authenticator
from radixcache.worker.engine import DuplicateRequestError, RequestTooLargeError
from radixcache.worker.metrics import WorkerMetrics, flatten_stats
from radixcache.worker.request import Constraint, ErrorKind, FinishReason, Request, RequestOutput, SamplingParams
from radixcache.worker.structured import ConstraintError
from radixcache.worker.validation import (
    InvalidArgument,
    check_prompt_length,
    check_request_id,
    constraint,
    render_prompt,
    sampling_params,
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
        self.draining = False
        # (tenant, client request id) -> engine request id, for the caller's running requests
        self._active: dict[tuple[str, str], str] = {}

    def attach(self, engine: Any, model_info: pb.ModelInfo) -> None:
        self.model_info = model_info
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

    def _prompt(self, message: Any) -> tuple[list[int], str]:
        ids, text = render_prompt(message, self.engine.tokenizer, self.model_info.vocab_size)
        check_prompt_length(len(ids), self.model_info.context_length)
        return ids, text

    @staticmethod
    def _engine_id(tenant: str, request_id: str) -> str:
        # Tenant names never contain "/", so this is unique per (tenant, request id) and names the tenant in leaks.
        return f"{tenant}/{request_id}" if tenant else request_id

    async def _submit(self, engine: Any, request: Request, on_output: Any, context: grpc.aio.ServicerContext) -> None:
        """engine.submit, with its synchronous refusals turned into the status codes the proto promises."""
        try:
            engine.submit(request, on_output)
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
            prompt, _ = self._prompt(request)
            sampling = sampling_params(
                request,
                prompt_tokens=len(prompt),
                context_length=self.model_info.context_length,
                vocab_size=self.model_info.vocab_size,
            )
            wanted = constraint(request)
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
        engine_id = self._engine_id(tenant, request_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        request = Request(engine_id, prompt, sampling, namespace=tenant, constraint=wanted)
        await self._submit(engine, request, on_output, context)
        self._active[key] = engine_id
        finished = False
        first = True
        try:
            while True:
                remaining = context.time_remaining()
                try:
                    out = await asyncio.wait_for(queue.get(), remaining) if remaining is not None else await queue.get()
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                if out.finish_reason is not None:
                    finished = True
                if self.metrics is not None:
                    self.metrics.observe(out, first=first)
                first = False
                if out.finish_reason is FinishReason.ERROR:
                    await context.abort(ERROR_STATUS[out.error_kind], f"request {request_id!r} failed: {out.error}")
                await context.write(to_response(request_id, out))
                if finished:
                    return
        finally:
            self._active.pop(key, None)
            if not finished:
                engine.abort(engine_id)

    # -- unary RPCs ----------------------------------------------------------------------------------------------
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self._tenant(context)
        await self._ready(context)
        try:
            ids, text = render_prompt(request, self.engine.tokenizer, self.model_info.vocab_size)
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
        s = flatten_stats(await self._in_thread(engine.stats))
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
        try:
            ids, _ = self._prompt(request)
            if request.HasField("ttl_seconds") and not request.ttl_seconds > 0:
                raise InvalidArgument(f"ttl_seconds must be > 0 (or unset: no expiry), got {request.ttl_seconds}")
        except InvalidArgument as e:
            await self._invalid(context, e)
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        whole = len(ids) // self.model_info.page_size * self.model_info.page_size
        pinned = int(await self._in_thread(engine.pin, ids, tenant, ttl))
        if pinned < whole:  # not cached (yet): compute it with a one-token generation, then pin what it published
            await self._warm(engine, tenant, ids, context)
            pinned = int(await self._in_thread(engine.pin, ids, tenant, ttl))
        return pb.PinPrefixResponse(pinned_tokens=pinned, prompt_tokens=len(ids))

    async def _warm(self, engine: Any, tenant: str, ids: list[int], context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = loop.create_future()

        def on_output(out: RequestOutput) -> None:  # engine thread
            if out.finish_reason is not None:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        engine_id = self._engine_id(tenant, "pin-" + uuid.uuid4().hex)
        request = Request(engine_id, ids, SamplingParams(max_tokens=1), namespace=tenant)
        await self._submit(engine, request, on_output, context)
        try:
            out = await done
        finally:
            if not done.done():
                engine.abort(engine_id)
        if out.finish_reason is FinishReason.ERROR:
            await context.abort(ERROR_STATUS[out.error_kind], f"computing the prefix failed: {out.error}")

    async def UnpinPrefix(
        self, request: pb.UnpinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnpinPrefixResponse:
        tenant = await self._tenant(context)
        engine = await self._ready(context)
        try:
            ids, _ = self._prompt(request)
        except InvalidArgument as e:
            await self._invalid(context, e)
        return pb.UnpinPrefixResponse(unpinned_tokens=int(await self._in_thread(engine.unpin, ids, tenant)))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        tenant = await self._tenant(context)
        engine = await self._ready(context)
        engine_id = self._active.get((tenant, request.request_id))  # only the caller's own requests
        return pb.AbortResponse(aborted=bool(engine_id is not None and engine.abort(engine_id)))
