"""A replica's health check and its drain, apart from Ray.

Health (Serve calls the replica's `check_health` every period): the engine thread must be alive, must answer a
call between two of its steps within the check's timeout, and, while it has requests, must keep stepping; a replica
whose engine has not stepped for `stall_s` with work queued is unhealthy, and Serve replaces it.

Drain (a replica being stopped: scaled down, upgraded, replaced): Serve stops routing to it and waits for its
requests, up to its graceful_shutdown_timeout_s, before killing it. The replica learns it is being stopped from the
event hub (the routers retire it there when Serve takes it out of their candidates) and gives its streams
`grace_s` to finish; what still runs then is ended with FinishReason.ERROR / ErrorKind.UNAVAILABLE ("the replica
was stopped": the tokens sent so far stay sent, the client sees UNAVAILABLE and retries, on another replica),
instead of being cut when Serve kills the actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from radixcache.worker.engine.api import EngineLoad
from radixcache.worker.engine.request import ErrorKind, FinishReason, RequestOutput

log = logging.getLogger("radixcache.cluster")

STALL_S = 30.0
HANDED_BACK = "the replica serving it was stopped (drained); retry"


class HealthCheck:
    """Whether an engine is healthy, from successive loads (EngineLoad: running, waiting, steps)."""

    def __init__(self, *, stall_s: float = STALL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.clock = clock
        self._steps: int | None = None
        self._since = clock()  # when the step count last moved, or the engine last had nothing to do

    def check(self, alive: bool, load: EngineLoad) -> None:
        """Raises RuntimeError saying what is wrong."""
        if not alive:
            raise RuntimeError("the engine thread is not running")
        now = self.clock()
        busy = load.running + load.waiting
        if not busy or load.steps != self._steps:
            self._steps, self._since = load.steps, now
            return
        if now - self._since > self.stall_s:
            raise RuntimeError(f"the engine has not stepped for {now - self._since:.0f} s with {busy} requests")


class Drain:
    """The drain of one replica: `start()` once it is being stopped; `track` / `settle` every stream meanwhile."""

    def __init__(self, abort: Callable[[str], bool], *, grace_s: float) -> None:
        self.abort = abort  # Engine.abort
        self.grace_s = grace_s
        self.live: set[str] = set()  # request ids streaming from this replica
        self.handed_back: set[str] = set()  # those the drain ended
        self.aborted_by_client: set[str] = set()
        self.started = False
        self._empty = asyncio.Event()
        self._task: asyncio.Task | None = None

    def opened(self, request_id: str) -> None:
        self.live.add(request_id)
        self._empty.clear()

    def closed(self, request_id: str) -> None:
        self.live.discard(request_id)
        self.handed_back.discard(request_id)
        self.aborted_by_client.discard(request_id)
        if not self.live:
            self._empty.set()

    def settle(self, out: RequestOutput) -> RequestOutput:
        """An output on its way out: a stream the drain ended (not the client) ends as UNAVAILABLE, not aborted."""
        rid = out.request_id
        if out.finish_reason is FinishReason.ABORTED and rid in self.handed_back and rid not in self.aborted_by_client:
            return dataclasses.replace(
                out, finish_reason=FinishReason.ERROR, error=HANDED_BACK, error_kind=ErrorKind.UNAVAILABLE
            )
        return out

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        log.info("draining: %d streams get %.0f s to finish", len(self.live), self.grace_s)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        if not self.live:
            return
        try:
            await asyncio.wait_for(self._empty.wait(), self.grace_s)
            return
        except asyncio.TimeoutError:
            pass
        log.warning("drain: %d streams still running after %.0f s; handing them back", len(self.live), self.grace_s)
        for rid in sorted(self.live):
            self.handed_back.add(rid)
            self.abort(rid)

    async def wait(self) -> None:
        if self._task is not None:
            await self._task
