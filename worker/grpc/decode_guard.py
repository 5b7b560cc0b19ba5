"""Requests whose bytes do not decode (corrupt wire format, invalid UTF-8 in a string field) end with
INVALID_ARGUMENT and a short message, and the log gets one rate-limited warning line instead of a traceback per call.

Without this, grpc.aio logs "Exception deserializing message!" with a traceback, calls the handler with None and
answers UNKNOWN. The interceptor swaps each unary-request method's deserializer for one that returns an
`Undecodable` marker instead of raising, and answers the marker before the handler runs. Streaming-request methods
(only server reflection has one) are left as they are.

It also keeps big requests' parsing off the event loop: grpc.aio deserializes on the loop, and parsing a 15 MiB
request takes 3-15 ms (more under memory pressure), during which no other call (health included) is served. A
request of OFF_LOOP_BYTES or more is handed to the handler wrapper as raw bytes and parsed in a worker thread;
smaller ones are parsed in place, where a thread hop would cost more than the parse. Before a big request is
parsed, `before_parse` may refuse it from its bytes alone (the servicer refuses a prompt too big to fit the
context that way: parsing it, even in a thread, holds the GIL and so stalls the loop too).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from radixcache.worker.front.refusal_log import RateLimitedWarning

log = logging.getLogger("radixcache.serve")

OFF_LOOP_BYTES = 64 * 1024  # requests at least this big are parsed in a worker thread (see the module docstring)


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request that failed to decode; `reason` is the decoder's short message."""

    reason: str


@dataclass(frozen=True)
class _RawRequest:
    """A request too big to parse on the loop, as it arrived; the handler wrapper parses it in a worker thread."""

    raw: bytes


def _short_reason(error: Exception) -> str:
    # protobuf: "Error parsing message with type 'radixcache.v1.GenerateRequest': Wire format was corrupt"
    return str(error).rsplit(": ", 1)[-1][:200] or type(error).__name__


# (method, a big request's bytes, its context) -> (status, message, trailing metadata) to refuse it with (the
# arguments of context.abort), or None to parse it.
Refused = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]
BeforeParse = Callable[[str, bytes, grpc.aio.ServicerContext], "Refused | None"]


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers undecodable unary requests with INVALID_ARGUMENT (see the module docstring). One per server."""

    def __init__(self, warning: RateLimitedWarning | None = None, before_parse: BeforeParse | None = None) -> None:
        self.warning = warning or RateLimitedWarning(log)
        self.before_parse = before_parse
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # method -> (orig, new)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._guarded[method] = (handler, self._guard(method, handler))
        return cached[1]

    def _guard(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer

        def safe_deserialize(raw: bytes) -> Any:
            try:
                return deserialize(raw)
            except Exception as e:  # DecodeError, or anything a custom deserializer raises on bad bytes
                return Undecodable(_short_reason(e))

        def keep_big_raw(raw: bytes) -> Any:
            """grpc.aio's deserializer, on the loop: parses small requests, passes big ones on as bytes."""
            return _RawRequest(raw) if len(raw) >= OFF_LOOP_BYTES else safe_deserialize(raw)

        async def decoded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not isinstance(request, _RawRequest):
                return request
            refusal = self.before_parse(method, request.raw, context) if self.before_parse else None
            if refusal is not None:
                await context.abort(*refusal)
            return await asyncio.get_running_loop().run_in_executor(None, safe_deserialize, request.raw)

        async def refuse(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
            self.warning.warn(f"undecodable request to {method}: {request.reason}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request cannot be decoded: {request.reason}")

        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous handler: grpc.aio runs those elsewhere; not ours to wrap

        if handler.response_streaming:

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> None:
                request = await decoded(request, context)
                if isinstance(request, Undecodable):
                    return await refuse(request, context)
                result = behavior(request, context)
                if inspect.isasyncgen(result):  # handlers may yield their responses or write them
                    async for response in result:
                        await context.write(response)
                else:
                    await result

            return handler._replace(request_deserializer=keep_big_raw, unary_stream=unary_stream)

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request = await decoded(request, context)
            if isinstance(request, Undecodable):
                return await refuse(request, context)
            return await behavior(request, context)

        return handler._replace(request_deserializer=keep_big_raw, unary_unary=unary_unary)
