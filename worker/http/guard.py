"""Limits on what an HTTP client may hold of the worker before its request is read: the bounds uvicorn lacks.

Measured (bench/http_hostile.py, RELIABILITY.md): with uvicorn's httptools protocol a request head has no size limit
(8 connections sending one endless header: +260 MB RSS, each value re-concatenated per read, health stalled 5 s),
and uvicorn has no time limit on reading a head nor on a connection that never sends a byte (200 slowloris and 200
idle connections all stayed open); `limit_concurrency` answers 503 only once a request's head is complete, and h11's
`h11_max_incomplete_event_size` bounds the size alone. `GuardedHttpProtocol` is uvicorn's httptools protocol with:

- max_head_bytes: request line + headers of one request, counted as they arrive, before the parser buffers more
  than one socket read past the limit: 431, connection closed;
- max_headers: header lines per request: 431;
- head_timeout_s: a connection's first request head, and each later one from its first byte, must be complete
  within this: 408 (or a silent close when nothing at all was sent). Between requests uvicorn's keep-alive timeout
  (`timeout_keep_alive`) closes idle connections;
- max_connections: open connections; one more is answered 503 and closed at once.

Bodies are bounded by the app (413 above the body limit) and held, slow or not, by at most max_connections.
Every refusal is one small response in OpenAI's error shape, then the connection closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from radixcache.worker.http.errors import APIError
from radixcache.worker.http.openai.errors import error_body

log = logging.getLogger("radixcache.http")
LINGER_S = 1.0  # after a refusal, the connection stays open (not read) this long, so the client can read the answer


@dataclass(frozen=True)
class HttpLimits:
    max_head_bytes: int = 64 << 10
    max_headers: int = 100
    head_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 512


def protocol_for(limits: HttpLimits) -> type[asyncio.Protocol]:
    """The protocol class uvicorn's Config(http=...) takes, bound to `limits`."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


class GuardedHttpProtocol(HttpToolsProtocol):
    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request head (from the connection's start or a message's end)
        self._head_bytes = 0
        self._header_count = 0
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None

    # --- connection -------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"too many open connections (at most {self.limits.max_connections})")
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)  # may count the start of a body read with the head: one read at most
        super().data_received(data)
        if self._refused or self.transport.is_closing():
            return
        if self._header_count > self.limits.max_headers:
            self._refuse(431, f"the request has more than {self.limits.max_headers} headers")
        elif self._in_head and self._head_bytes > self.limits.max_head_bytes:
            self._refuse(431, f"the request line and headers exceed {self.limits.max_head_bytes} bytes")

    # --- parser callbacks (a request over a limit never reaches the app: data_received refuses it) -------------
    def _over(self) -> bool:
        return self._refused or self._header_count > self.limits.max_headers

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0
        if self._head_timer is None:  # a later request on a kept-alive connection: its head starts now
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if not self._over():
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        if not self._over():
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._over():
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._over():
            super().on_message_complete()
        self._in_head, self._head_bytes = True, 0

    # --- helpers ----------------------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self._head_bytes == 0:  # nothing sent: an idle connection, nobody to answer
            self.transport.close()
        else:
            self._refuse(408, f"the request head did not arrive within {self.limits.head_timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` in OpenAI's error shape and close (the app never sees the request). The timer slot then
        holds the lingering close."""
        self._refused = True
        self._disarm_head_timer()
        log.debug("HTTP %s from %s: %s", status, self.client, message)
        body = json.dumps(error_body(APIError(status, message))).encode()
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, reason[status], len(body)) + body)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # Lingering close: closing with the client's bytes still unread sends a reset, which can destroy the answer
        # before the client reads it. Send the answer and a FIN, stop reading (TCP flow control then stops a
        # flooding client at no cost here), and close LINGER_S later.
        self.transport.write_eof()
        self.transport.pause_reading()
        self._head_timer = self.loop.call_later(LINGER_S, self.transport.close)
        self.connections.discard(self)  # a refused connection holds no slot of max_connections while it lingers
        self.parser = None  # nor what the parser buffered of its head (it reads nothing more)
