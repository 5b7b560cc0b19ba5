"""Every host implements the typed engine interface (worker/engine/api.py), and the front core works over each.

The same scenario runs through the front core over the single worker's Engine and over the cluster's FleetEngine
(its Serve handle replaced by an in-process one over a real EngineReplica, so no Ray cluster is needed): a host
that misses a method, or answers one differently, fails here rather than in front of a user. The cluster's own
end-to-end constraint tests (Ray Serve) are in test_cluster_e2e.py.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from engine_fixtures import tiny_model

from radixcache.cluster.fleet import FleetEngine
from radixcache.cluster.lifecycle import Drain, HealthCheck
from radixcache.cluster.replica import EngineReplica
from radixcache.worker.engine.api import ENGINE_FACTS, ENGINE_METHODS, EngineLike, EngineStats
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import FinishReason
from radixcache.worker.front.core import FrontCore, Refusal, RefusalKind, engine_request_id
from radixcache.worker.front.validation import FieldPath, PromptInput, SamplingValues
from radixcache.worker.server import describe

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}  # fmt: skip


class _Stream:
    """What `handle.options(stream=True).generate.remote(request)` returns: an async iterator with cancel()."""

    def __init__(self, outputs: AsyncIterator[Any]) -> None:
        self._outputs = outputs

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        return await self._outputs.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self._outputs.aclose())  # type: ignore[attr-defined]


class _Broadcast:
    def __init__(self, calls: list[Any]) -> None:
        self._calls = calls

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
        return await asyncio.gather(*self._calls, return_exceptions=return_exceptions)


class InProcessHandle:
    """The part of a Serve DeploymentHandle that FleetEngine uses, over EngineReplica objects in this process."""

    def __init__(self, replicas: list[EngineReplica]) -> None:
        self.replicas = replicas

    def options(self, stream: bool = False) -> InProcessHandle:
        return self

    @property
    def generate(self) -> Any:
        replica = self.replicas[0]
        return type("Remote", (), {"remote": staticmethod(lambda request: _Stream(replica.generate(request)))})

    def broadcast(self, method: str, *args: Any) -> _Broadcast:
        return _Broadcast([getattr(r, method)(*args) for r in self.replicas])


class InProcessReplica(EngineReplica):
    """EngineReplica's methods over a given engine (its __init__ builds one from CLI flags inside Serve)."""

    def __init__(self, engine: Engine) -> None:  # noqa: D107 (not EngineReplica's async __init__)
        self.engine, self.replica_id, self.events = engine, "replica-0", None
        self.facts = describe(engine, model_name="tiny")
        self.drain, self.health = Drain(engine.abort, grace_s=30.0), HealthCheck()

    def __del__(self) -> None:  # the engine is the test fixture's: it outlives this replica
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=256, max_step_tokens=64))
    engine.start()
    yield engine
    engine.shutdown(drain=False)


def host(name: str, engine: Engine, loop: asyncio.AbstractEventLoop) -> EngineLike:
    if name == "engine":
        return engine
    replica = InProcessReplica(engine)
    return FleetEngine(InProcessHandle([replica]), engine.tokenizer, replica.facts, loop)


@pytest.mark.parametrize("host_class", [Engine, FleetEngine])
def test_every_host_has_every_method_of_the_interface_with_its_signature(host_class: type) -> None:
    for name in ENGINE_METHODS:
        method = getattr(host_class, name, None)
        assert callable(method), f"{host_class.__name__} has no {name}()"
        want = list(inspect.signature(getattr(EngineLike, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got[: len(want)] == want, f"{host_class.__name__}.{name}{got} differs from EngineLike's {want}"


def test_the_conformance_check_notices_a_missing_method() -> None:
    class Partial:
        def submit(self, request: Any, on_output: Any) -> None: ...

    assert [n for n in ENGINE_METHODS if not callable(getattr(Partial, n, None))] == list(ENGINE_METHODS[1:])


async def scenario(host: EngineLike, facts: Any) -> None:
    """What every front relies on, through the front core."""
    for name in ENGINE_FACTS:
        assert hasattr(host, name), name
    core = FrontCore()
    core.attach(host, facts)
    prompt = PromptInput(text="the cache keeps keys")
    # a structured-output request: compiled, routed, every output valid against its schema
    stream = await core.admit("t", "json-1", prompt, SamplingValues(max_tokens=24), ("json_schema", json.dumps(SCHEMA)))
    text, last = "", None
    try:
        async for out in stream:
            text, last = text + out.text, out
    finally:
        stream.close()
    assert last is not None and last.finish_reason is FinishReason.STOP_TOKEN, last
    assert set(json.loads(text)) == {"n"} and 0 <= json.loads(text)["n"] <= 9
    # a schema that does not compile: refused before anything runs, naming the constraint
    with pytest.raises(Refusal) as bad:
        await core.admit("t", "json-2", prompt, SamplingValues(max_tokens=4), ("json_schema", '{"type": "nope"}'))
    assert bad.value.kind is RefusalKind.INVALID_ARGUMENT and bad.value.field == FieldPath.of("json_schema")
    # refusals at submit
    with pytest.raises(Refusal) as big:
        await core.admit("t", "big", PromptInput(token_ids=[5] * 900), SamplingValues(max_tokens=200))
    assert big.value.kind is RefusalKind.TOO_LARGE
    running = await core.admit("t", "long", prompt, SamplingValues(max_tokens=200, ignore_eos=True))
    try:
        await running.next(30)
        with pytest.raises(Refusal) as dup:
            await core.admit("t", "long", prompt, SamplingValues(max_tokens=2))
        assert dup.value.kind is RefusalKind.ALREADY_EXISTS
        assert not core.abort("other-tenant", "long")  # one tenant never ends another's request
        assert core.abort("t", "long")
        while not running.finished:
            out = await running.next(30)
        assert out.finish_reason is FinishReason.ABORTED
    finally:
        running.close()
    if isinstance(host, FleetEngine):  # a request relayed by another ingress replica: every replica is asked
        other = await core.admit("t", "elsewhere", prompt, SamplingValues(max_tokens=200, ignore_eos=True))
        try:
            await other.next(30)
            host._relays.pop(engine_request_id("t", "elsewhere"))  # as if another ingress replica relayed it
            assert not core.abort("t", "elsewhere")  # this ingress does not know it...
            assert await host.abort_anywhere(engine_request_id("t", "elsewhere"))  # ...a replica ends it
            assert not await host.abort_anywhere(engine_request_id("t", "never-ran"))
            while not other.finished:
                out = await other.next(30)
            assert out.finish_reason is FinishReason.ABORTED
        finally:
            other.close()
    # the fleet-wide calls
    stats = await core.stats()
    assert isinstance(stats, EngineStats) and stats.finished_requests >= 2
    pinned, total = await core.pin("t", prompt, 60.0)
    assert total > 0 and pinned == total // facts.page_size * facts.page_size
    assert await core.unpin("t", prompt) == pinned
    # the page-by-page view: the pinned prompt was computed, so its whole pages are served
    explained = await core.explain("t", prompt)
    assert explained.prompt_tokens == total and explained.cached_tokens >= pinned - facts.page_size
    assert (await core.explain("other-tenant", prompt)).cached_tokens == 0  # another namespace sees nothing of it
    assert await core.flush("t") >= 1


@pytest.mark.parametrize("host_name", ["engine", "fleet"])
def test_the_front_core_serves_the_same_way_over_every_host(engine: Engine, host_name: str) -> None:
    async def run() -> None:
        await scenario(host(host_name, engine, asyncio.get_running_loop()), describe(engine, model_name="tiny"))

    asyncio.run(run())
    engine.call(lambda: engine.cache.check(idle=True))  # nothing leaked, whichever host ran it
