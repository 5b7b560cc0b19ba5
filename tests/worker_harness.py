"""Runs a WorkerServer in this process, on its own event-loop thread, on a free loopback port (for server tests)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from radixcache.v1 import radixcache_pb2 as pb
from radixcache.worker.server import ServerOptions, WorkerServer, describe

# One small call of each RadixCache RPC but SubscribeCacheEvents: (stub, metadata) -> the answer (raises RpcError).
RPC_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "Generate": lambda s, md: list(s.Generate(pb.GenerateRequest(text="hi", max_tokens=1), metadata=md, timeout=30)),
    "Tokenize": lambda s, md: s.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md, timeout=30),
    "GetModelInfo": lambda s, md: s.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30),
    "GetCacheStats": lambda s, md: s.GetCacheStats(pb.GetCacheStatsRequest(), metadata=md, timeout=30),
    "FlushCache": lambda s, md: s.FlushCache(pb.FlushCacheRequest(), metadata=md, timeout=30),
    "PinPrefix": lambda s, md: s.PinPrefix(pb.PinPrefixRequest(text="hi"), metadata=md, timeout=30),
    "UnpinPrefix": lambda s, md: s.UnpinPrefix(pb.UnpinPrefixRequest(text="hi"), metadata=md, timeout=30),
    "ExplainPrefix": lambda s, md: s.ExplainPrefix(pb.ExplainPrefixRequest(text="hi"), metadata=md, timeout=30),
    "Abort": lambda s, md: s.Abort(pb.AbortRequest(request_id="nothing"), metadata=md, timeout=30),
}


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll `predicate` until it holds or `timeout` passes (a bound for a broken build, not a speed requirement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class ThreadedWorker:
    """start() binds 127.0.0.1:<free port> and serves `engine`; stop() always tears everything down."""

    def __init__(self, engine: Any, **options: Any) -> None:
        self.engine = engine
        self.options = ServerOptions(host="127.0.0.1", port=0, **options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-worker-loop", daemon=True)
        self.server: WorkerServer | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, *, attach: bool = True) -> ThreadedWorker:
        self.thread.start()

        async def make() -> WorkerServer:
            return WorkerServer(self.options)

        self.server = self.run(make())
        self.port = self.run(self.server.start())
        if attach:
            self.attach()
        return self

    def attach(self) -> None:
        assert self.server is not None
        self.engine.start()
        self.run(self.server.attach(self.engine, describe(self.engine, model_name="fake", backend="fake")))

    def stop(self, grace: float = 0.0) -> None:
        try:
            if self.server is not None:
                self.run(self.server.stop(grace), timeout=grace + 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def __enter__(self) -> ThreadedWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
