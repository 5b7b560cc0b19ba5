"""Requests whose bytes do not decode (corrupt wire format, invalid UTF-8 in a string field) end with
INVALID_ARGUMENT and a short message, and the log gets one rate-limited warning line instead of a traceback per call.

Without this, grpc.aio logs "Exception deserializing message!" with a traceback, calls the handler with None and
answers UNKNOWN. The interceptor swaps each unary-request method's deserializer for one that returns an
`Undecodable` marker instead of raising, and answers the marker before the handler runs. Streaming-request methods
(only server reflection has one) are left as they are.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger("radixcache.serve")


class RateLimitedWarning:
    """At most one warning line per `interval` seconds; the next line says how many were held back meanwhile."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._held_back = 0

    def warn(self, message: str) -> bool:
        """Logs `message` unless a line went out less than `interval` ago; returns whether it logged."""
        with self._lock:
            now = self.clock()
            if self._last is not None and now - self._last < self.interval:
                self._held_back += 1
                return False
            held, self._held_back, self._last = self._held_back, 0, now
        more = f" (and {held} more in the last {self.interval:g} s)" if held else ""
        self.logger.warning("%s%s", message, more)
        return True


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request that failed to decode; `reason` is the decoder's short message."""

    reason: str


def _short_reason(error: Exception) -> str:
    # protobuf: "Error parsing message with type 'radixcache.v1.GenerateRequest': Wire format was corrupt"
    return str(error).rsplit(": ", 1)[-1][:200] or type(error).__name__


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers undecodable unary requests with INVALID_ARGUMENT (see the module docstring). One per server."""

    def __init__(self, warning: RateLimitedWarning | None = None) -> None:
        self.warning = warning or RateLimitedWarning(log)
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

        async def refuse(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
            self.warning.warn(f"undecodable request to {method}: {request.reason}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request cannot be decoded: {request.reason}")

        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous handler: grpc.aio runs those elsewhere; not ours to wrap

        if handler.response_streaming:

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> None:
                if isinstance(request, Undecodable):
                    return await refuse(request, context)
                result = behavior(request, context)
                if inspect.isasyncgen(result):  # handlers may yield their responses or write them
                    async for response in result:
                        await context.write(response)
                else:
                    await result

            return handler._replace(request_deserializer=safe_deserialize, unary_stream=unary_stream)

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                return await refuse(request, context)
            return await behavior(request, context)

        return handler._replace(request_deserializer=safe_deserialize, unary_unary=unary_unary)
