"""One submitted request's outputs as an async iterator on the front's event loop: what every front shares.

The engine calls `on_output` from its own thread; this hands each output to the loop (call_soon_threadsafe) and
never blocks there. Whoever opens a stream closes it (`async with`, or `close()` in a finally): closing a stream
whose samples have not all finished aborts the request, which frees its pages in the engine's next step. That is
how a cancelled gRPC call, a disconnected HTTP client or a deadline all end the same way.

Works with anything that has the engine's submit(request, on_output) / abort(request_id) (the Engine, a test
double, a cluster ingress).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from radixcache.worker.engine.request import FinishReason, Request, RequestOutput


class StreamClosed(Exception):
    """next() on a stream that was closed meanwhile (e.g. its client went away)."""


def engine_request_id(tenant: str, request_id: str) -> str:
    """The engine's id of a caller's request: unique per (tenant, request id), and names the tenant in leak reports
    (tenant names never contain "/")."""
    return f"{tenant}/{request_id}" if tenant else request_id


class EngineStream:
    """Submit `request` and iterate its outputs: every sample's, in engine order, until each of the n samples has
    sent its last output (finish_reason set; FinishReason.ERROR included, which the front turns into its error).

    `open()` raises what engine.submit raises (ValueError, RequestTooLargeError, DuplicateRequestError,
    RuntimeError while draining), before anything is allocated. `metrics` (WorkerMetrics) records every output.
    `generated[i]` holds sample i's token ids so far; `on_finished(index, ids, finish_reason)` is called (on the
    loop) as each sample's last output is read.
    """

    def __init__(
        self,
        engine: Any,
        request: Request,
        metrics: Any = None,
        on_finished: Callable[[int, list[int], FinishReason], None] | None = None,
    ) -> None:
        self.engine = engine
        self.request = request
        self.metrics = metrics
        self.on_finished = on_finished
        self.generated: list[list[int]] = [[] for _ in range(request.sampling.n)]
        self.prompt_text = ""  # the rendered prompt, where the front core tokenized one
        self._unfinished = request.sampling.n
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()  # None: closed
        self._started: set[int] = set()  # samples that sent an output (metrics count the prompt once per request)
        self._submitted = False

    def open(self) -> EngineStream:
        """Submit the request (call it on the loop that will iterate)."""
        self._loop = asyncio.get_running_loop()
        self.engine.submit(self.request, self._on_output)
        self._submitted = True
        return self

    def _on_output(self, out: RequestOutput) -> None:  # engine thread
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    @property
    def finished(self) -> bool:
        """Every sample has sent its last output."""
        return self._unfinished == 0

    async def next(self, timeout: float | None = None) -> RequestOutput:
        """The next output of any sample; asyncio.TimeoutError after `timeout` seconds without one; StreamClosed
        if close() was called meanwhile."""
        out = await (asyncio.wait_for(self._queue.get(), timeout) if timeout is not None else self._queue.get())
        if out is None:
            raise StreamClosed
        self.generated[out.index] += out.token_ids
        if out.finish_reason is not None:
            self._unfinished -= 1
            if self.on_finished is not None:
                self.on_finished(out.index, self.generated[out.index], out.finish_reason)
        if self.metrics is not None:
            self.metrics.observe(out, first=not self._started)
        self._started.add(out.index)
        return out

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.next()

    def close(self) -> None:
        """Abort the request unless every sample has finished, and wake a reader waiting in next() (StreamClosed).
        Idempotent; safe if open() raised. Call it on the stream's loop."""
        if self._submitted and not self.finished:
            self._unfinished = 0
            self.engine.abort(self.request.request_id)
            self._queue.put_nowait(None)

    async def __aenter__(self) -> EngineStream:
        return self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()
