"""Runs the OpenAI app with uvicorn on the worker's own event loop, beside grpc.aio (imported only with --http-port).

The worker owns signals and shutdown order (server.run_worker): uvicorn installs no signal handlers here, and
stop() is called after the engine has drained, so in-flight streams have sent their last chunk by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn

from radixcache.worker.http.app import create_app
from radixcache.worker.http.front import DEFAULT_MAX_BODY_BYTES
from radixcache.worker.http.guard import HttpLimits, protocol_for
from radixcache.worker.http.host_check import allowed_hosts


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the worker handles SIGTERM/SIGINT itself (drain first)
        yield


class HttpServer:
    """start() binds host:port (0: a free port) and serves in a task; stop() closes it, waiting for open responses
    up to `grace` seconds. `limits`: what a client may hold before its request is read (http_guard)."""

    def __init__(
        self,
        core: Any,
        host: str,
        port: int,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        limits: HttpLimits | None = None,
        allowed_host_names: Sequence[str] | None = None,
        store: Any = None,
    ) -> None:
        # The Host names answered: by the bind address, or as --http-allowed-hosts says (host_check).
        hosts = allowed_hosts(host, allowed_host_names)
        self.app = create_app(core, max_body_bytes=max_body_bytes, allowed_hosts=hosts, store=store)
        self.host, self.port = host, port
        self.limits = limits or HttpLimits()
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio disables Nagle (TCP_NODELAY) only on sockets that say they are TCP, and
        # with Nagle on, each small SSE chunk waits for the client's delayed ACK (~40 ms per token).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"could not bind the HTTP port {self.host}:{self.port}: {e}") from e
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
            access_log=False,
            http=protocol_for(self.limits),  # uvicorn's httptools protocol with the bounds it lacks (http_guard)
            ws="none",  # no WebSocket routes: an Upgrade is not switched to another protocol
            timeout_keep_alive=self.limits.keep_alive_s,  # type: ignore[arg-type]  # call_later takes a float
        )
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: raise its error
                self._task.result()
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """Close the port and end open connections (waiting up to `grace` s for responses in progress). Idempotent."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(0.1, grace)
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._server = self._task = None
