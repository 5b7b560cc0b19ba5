"""The RadixCache gRPC service: protobuf in and out, over the front core (worker/front/core.py), which authenticates,
validates, tokenizes off the loop and submits, exactly as for every other front.

Refusals: a front-core Refusal ends the call with its status (STATUS) and message, and, where the refusal has a
field, the trailing metadata `radixcache-field` naming it by this API's names (GenerateRequest's fields: a FieldPath
renamed with FIELD_NAMES), e.g. `messages.messages[2].role`, `token_ids.ids[3]`, `stop_token_ids[0]`, `input` (the
prompt as a whole), `json_schema`. A prompt refused from its wire bytes before it is parsed gets the same.

Threading: RPC handlers run on the asyncio loop; the engine hands outputs to the loop through EngineStream.
Cancellation: a Generate handler writes its messages itself, so a cancelled or disconnected client raises
CancelledError inside it at an await; a deadline is watched by the handler itself (time_remaining ->
DEADLINE_EXCEEDED). Either way closing its EngineStream aborts the engine request, which frees the request's pages
in the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from radixcache.explain import Explanation
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc
from radixcache.worker.engine.api import ModelFacts
from radixcache.worker.engine.field_errors import FieldPath
from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.front.core import FrontCore, Refusal, RefusalKind
from radixcache.worker.front.validation import MAX_CHAT_MESSAGES
from radixcache.worker.grpc.pb_inputs import constraint_values, prompt_input, sampling_values
from radixcache.worker.grpc.wire_prompt import prompt_size
from radixcache.worker.metrics import flatten_stats

FINISH_REASONS = {
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_STRING: pb.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
}

# The prompt RPCs (full method name -> request type): a big request's prompt size is checked before it is parsed.
_SERVICE = pb.DESCRIPTOR.services_by_name["RadixCache"].full_name
PROMPT_REQUESTS = {
    f"/{_SERVICE}/{name}": request_type
    for name, request_type in (
        ("Generate", pb.GenerateRequest), ("Tokenize", pb.TokenizeRequest), ("PinPrefix", pb.PinPrefixRequest),
        ("UnpinPrefix", pb.UnpinPrefixRequest), ("ExplainPrefix", pb.ExplainPrefixRequest),
    )
}  # fmt: skip

# A refusal's gRPC status.
STATUS = {
    RefusalKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalKind.CONTEXT_OVERFLOW: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    RefusalKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    RefusalKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    RefusalKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    RefusalKind.PIN_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalKind.NO_CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
FIELD_METADATA = "radixcache-field"  # the trailing metadata that names a refused field
# validation's field names (its heads) where the proto's differ: the prompt as a whole is the `input` oneof, and chat
# messages sit in ChatMessages.messages.
FIELD_NAMES: dict[str, tuple[str, ...]] = {"prompt": ("input",), "messages": ("messages", "messages")}


def field_name(field: FieldPath) -> str:
    """A refused field by the proto's names (FIELD_NAMES)."""
    head = FIELD_NAMES.get(field.head)
    return str(field.with_head(*head) if head is not None else field)


def refusal_status(refusal: Refusal) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """A refusal as (status, details, trailing metadata), the arguments of ServicerContext.abort."""
    trailing = () if refusal.field is None else ((FIELD_METADATA, field_name(refusal.field)),)
    return STATUS[refusal.kind], refusal.message, trailing


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
    if out.finish_reason is not None:  # why the cache served no more: on the last message only
        resp.cache_miss_reason, resp.cache_match_end = out.cache_miss_reason, out.cache_match_end
    for lp in out.logprobs:
        resp.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        )
    return resp


def explanation_message(e: Explanation) -> pb.ExplainPrefixResponse:
    """radixcache.explain's Explanation as the ExplainPrefixResponse message."""
    return pb.ExplainPrefixResponse(
        prompt_tokens=e.prompt_tokens,
        page_size=e.page_size,
        cacheable_tokens=e.cacheable,
        cached_tokens=e.cached_tokens,
        cache_miss_reason=e.reason,
        cache_match_end=e.match_end,
        pages=[pb.ExplainedPage(index=p.index, tokens=p.tokens, served=p.served, state=p.state) for p in e.pages],
    )


def model_info(facts: ModelFacts) -> pb.ModelInfo:
    """The ModelInfo message of the model facts (same field names)."""
    fields = pb.ModelInfo.DESCRIPTOR.fields_by_name
    return pb.ModelInfo(**{k: v for k, v in facts.to_dict().items() if k in fields})


def cache_stats_message(stats: Any) -> pb.CacheStats:
    """engine.stats() as the CacheStats message."""
    s = flatten_stats(stats)
    fields = pb.CacheStats.DESCRIPTOR.fields_by_name
    message = pb.CacheStats(**{k: (v if k == "hit_rate" else int(v)) for k, v in s.items() if k in fields})
    message.kv_dtype = str(getattr(stats, "kv_dtype", "") or "")  # a string: not among flatten_stats' numbers
    return message


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def refusals_as_status(handler: Handler) -> Handler:
    """A front-core Refusal raised in the handler ends the call with its gRPC status, message and field
    (refusal_status)."""

    @functools.wraps(handler)
    async def wrapped(self: RadixCacheServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except Refusal as r:
            await context.abort(*refusal_status(r))

    return wrapped  # type: ignore[return-value]


class RadixCacheServicer(pb_grpc.RadixCacheServicer):
    """Serves the core's engine. Until the core is attached (the model is loading) every RPC answers UNAVAILABLE."""

    def __init__(self, core: FrontCore) -> None:
        self.core = core

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        return self.core.tenant(context.invocation_metadata())

    def refusal_before_parse(
        self, method: str, raw: bytes, context: grpc.aio.ServicerContext
    ) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None:
        """decode_guard's hook for big requests: a prompt RPC's caller is authenticated and its prompt's size
        checked from the wire bytes, so a prompt too big to fit is refused without being parsed (see wire_prompt),
        with the status, message and field the parsed request would get (refusal_status). None: parse the request
        and handle it as usual (which checks everything in full)."""
        request_type = PROMPT_REQUESTS.get(method)
        if request_type is None or self.core.engine is None:
            return None
        try:
            self._tenant(context)
            self.core.check_prompt_size(prompt_size(raw, request_type.DESCRIPTOR, most_messages=MAX_CHAT_MESSAGES))
        except Refusal as r:
            return refusal_status(r)
        return None

    # -- Generate ------------------------------------------------------------------------------------------------
    @refusals_as_status
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        tenant = self._tenant(context)
        self.core.ready()
        request_id = request.request_id or uuid.uuid4().hex
        stream = await self.core.admit(
            tenant, request_id, prompt_input(request), sampling_values(request), constraint_values(request),
            cache_key=request.cache_key,
        )  # fmt: skip
        try:
            while not stream.finished:
                try:
                    out = await stream.next(context.time_remaining())
                except asyncio.TimeoutError:
                    await self._deadline_exceeded(context)
                    return
                if out.finish_reason is FinishReason.ERROR:
                    raise Refusal.of_failure(out.error_kind, f"request {request_id!r} failed: {out.error}")
                await context.write(to_response(request_id, out))
        finally:
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
    @refusals_as_status
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self._tenant(context)
        ids, text = await self.core.tokenize(prompt_input(request))
        return pb.TokenizeResponse(token_ids=ids, prompt=text)

    @refusals_as_status
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        self._tenant(context)
        self.core.ready()
        return model_info(self.core.facts)

    @refusals_as_status
    async def GetCacheStats(self, request: pb.GetCacheStatsRequest, context: grpc.aio.ServicerContext) -> pb.CacheStats:
        self._tenant(context)
        view = self.core.stats_view(context.invocation_metadata())  # a tenant sees its own figures
        return cache_stats_message(await self.core.stats(view))

    @refusals_as_status
    async def FlushCache(
        self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushCacheResponse:
        return pb.FlushCacheResponse(pages_flushed=await self.core.flush(self._tenant(context)))

    @refusals_as_status
    async def PinPrefix(self, request: pb.PinPrefixRequest, context: grpc.aio.ServicerContext) -> pb.PinPrefixResponse:
        tenant = self._tenant(context)
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        self.core.ready()
        pinned, prompt_tokens = await self.core.pin(tenant, prompt_input(request), ttl)
        return pb.PinPrefixResponse(pinned_tokens=pinned, prompt_tokens=prompt_tokens)

    @refusals_as_status
    async def UnpinPrefix(
        self, request: pb.UnpinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnpinPrefixResponse:
        tenant = self._tenant(context)
        return pb.UnpinPrefixResponse(unpinned_tokens=await self.core.unpin(tenant, prompt_input(request)))

    @refusals_as_status
    async def ExplainPrefix(
        self, request: pb.ExplainPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainPrefixResponse:
        tenant = self._tenant(context)  # the caller's own namespace, never another's
        return explanation_message(await self.core.explain(tenant, prompt_input(request)))

    @refusals_as_status
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self.core.abort(self._tenant(context), request.request_id))

    # -- cache events --------------------------------------------------------------------------------------------
    @refusals_as_status
    async def SubscribeCacheEvents(
        self, request: pb.SubscribeCacheEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self._tenant(context)
        self.core.require_admin(context.invocation_metadata(), "cache events")
        self.core.ready()
        hub = self.core.events
        if hub is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker's engine reports no cache events")
        from radixcache.worker.events.proto import batch_to_proto

        async with contextlib.aclosing(hub.subscribe()) as batches:
            async for batch in batches:
                for message in batch_to_proto(batch, hub.page_size, hub.kv_dtype):
                    await context.write(message)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
