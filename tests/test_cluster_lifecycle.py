"""A replica's health check and drain (cluster.lifecycle), without Ray: fake clocks and an abort that records."""

from __future__ import annotations

import asyncio

import pytest
from helpers import FakeClock

from radixcache.cluster.lifecycle import HANDED_BACK, Drain, HealthCheck
from radixcache.worker.engine.api import EngineLoad
from radixcache.worker.engine.request import ErrorKind, FinishReason, RequestOutput


def load(busy: int, steps: int) -> EngineLoad:
    return EngineLoad(running=busy, waiting=0, queued_prefill_tokens=0, pages_busy=0, pages_total=8, steps=steps)


def test_health_fails_when_the_engine_thread_is_gone_or_stops_stepping_with_work():
    clock = FakeClock()
    health = HealthCheck(stall_s=30, clock=clock)
    health.check(True, load(busy=0, steps=5))
    clock.now = 100.0
    health.check(True, load(busy=0, steps=5))  # idle for long: fine
    health.check(True, load(busy=2, steps=5))
    clock.now = 125.0
    health.check(True, load(busy=2, steps=5))  # 25 s without a step: not yet
    clock.now = 131.0
    with pytest.raises(RuntimeError, match="not stepped for 31 s with 2 requests"):
        health.check(True, load(busy=2, steps=5))
    health.check(True, load(busy=2, steps=6))  # it moved again
    with pytest.raises(RuntimeError, match="engine thread is not running"):
        health.check(False, load(busy=0, steps=6))


def final(rid: str, reason: FinishReason) -> RequestOutput:
    return RequestOutput(rid, [], "", 4, 0, 3, finish_reason=reason)


def test_a_drain_lets_streams_finish_in_the_grace_period_then_hands_back_the_rest():
    async def scenario() -> None:
        aborted: list[str] = []
        drain = Drain(lambda rid: aborted.append(rid) or True, grace_s=0.05)
        for rid in ("quick", "slow", "cancelled"):
            drain.opened(rid)
        drain.aborted_by_client.add("cancelled")
        drain.start()
        drain.closed("quick")  # finished within the grace period: untouched
        await drain.wait()
        assert sorted(aborted) == ["cancelled", "slow"]  # what still ran when the grace period ended
        handed = drain.settle(final("slow", FinishReason.ABORTED))
        assert (handed.finish_reason, handed.error_kind, handed.error) == (
            FinishReason.ERROR,
            ErrorKind.UNAVAILABLE,
            HANDED_BACK,
        )  # the client retries elsewhere: not an abort it asked for
        assert drain.settle(final("cancelled", FinishReason.ABORTED)).finish_reason is FinishReason.ABORTED
        assert drain.settle(final("quick", FinishReason.LENGTH)).finish_reason is FinishReason.LENGTH
        drain.closed("slow")
        drain.closed("cancelled")
        assert not drain.live and not drain.handed_back

    asyncio.run(scenario())


def test_a_drain_with_nothing_running_ends_at_once_and_starts_once():
    async def scenario() -> None:
        drain = Drain(lambda rid: pytest.fail("nothing to abort"), grace_s=60)
        drain.start()
        drain.start()
        await asyncio.wait_for(drain.wait(), 1)

    asyncio.run(scenario())
