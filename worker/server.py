"""The worker's gRPC server: lifecycle, health, reflection, TLS, limits, metrics and graceful shutdown, plus the
OpenAI-compatible HTTP front (--http-port) over the same engine, in the same event loop.

Life of a worker: bind the ports (health NOT_SERVING, HTTP /health 503) -> load and warm up the engine -> SERVING ->
on stop(): NOT_SERVING, refuse new RPCs and HTTP requests, let in-flight streams (gRPC and HTTP) finish within the
grace period while the engine drains, abort what is left, close.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc
from radixcache.worker.engine.api import ModelFacts
from radixcache.worker.front.auth import Authenticator
from radixcache.worker.front.core import FrontCore
from radixcache.worker.front.generated import GeneratedTokens
from radixcache.worker.grpc.decode_guard import UndecodableRequestInterceptor
from radixcache.worker.grpc.reflection import enable_reflection
from radixcache.worker.grpc.servicer import RadixCacheServicer
from radixcache.worker.metrics import WorkerMetrics

log = logging.getLogger("radixcache.serve")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RadixCache"].full_name
MiB = 1 << 20


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    auth_tokens: dict[str, str] | None = None  # token -> tenant; None: no auth, every caller is tenant ""
    admin_tokens: set[str] | None = None  # of auth_tokens, those that may subscribe to cache events
    kv_events_endpoint: str | None = None  # ZMQ endpoint publishing cache events in vLLM's format
    kv_events_format: str = "vllm"  # or "vllm-legacy" (worker.kv_events_vllm)
    kv_events_curve: Any = None  # kv_events_zmq.CurveKeys: subscribers authenticate with ZMQ CURVE
    kv_events_insecure: bool = False  # with auth_tokens, TCP without CURVE is allowed: the network is trusted
    metrics_port: int | None = None  # None: no metrics endpoint; 0: a free port
    metrics_host: str | None = None  # the metrics' bind address (None: host); the port has no auth: operator-only
    grace_period: float = 30.0  # seconds in-flight streams get to finish on shutdown
    # The largest gRPC message, either way. gRPC's own default: it holds a 128k-token prompt several times over, and
    # a bigger one costs the event loop grpc's copy of it (a bare grpc.aio server: ~100 ms for 15 MiB on 2 cores),
    # while one over the limit is refused by gRPC's core without reaching Python.
    max_message_bytes: int = 4 * MiB
    max_body_bytes: int = 16 * MiB  # the largest HTTP request body (parsed in slices: json_body)
    max_concurrent_rpcs: int = 1024  # beyond it gRPC answers RESOURCE_EXHAUSTED
    http_port: int | None = None  # the OpenAI-compatible HTTP API on this port (0: a free one); None: no HTTP
    http_max_connections: int = 512  # open HTTP connections at most; one more is answered 503
    http_head_timeout_s: float = 10.0  # an HTTP request's line and headers must arrive within this (else 408)
    http_allowed_hosts: tuple[str, ...] | None = None  # Host names HTTP answers (None: by the bind address)
    # Agents' state (issue 28): the memory of generated token ids (worker/front/generated.py; 0: off) and the Responses
    # API's stored responses per tenant (worker/http/openai/response_store.py; 0 responses: store nothing).
    remember_generated_bytes: int = 64 * MiB
    responses_max: int = 1000
    responses_max_bytes: int = 64 * MiB
    responses_ttl_s: float = 3600.0
    responses_pin_ttl_s: float = 600.0


def freeze_startup_objects() -> None:
    """Put what start-up made (model, tokenizer, libraries: ~300k objects) out of the cyclic GC's reach, once, before
    serving. Otherwise each full collection scans them all with the GIL held: 0.2-0.7 s in which neither front
    answers anyone (measured in a worker during make soak's HTTP phase, which allocates enough to trigger them);
    they live as long as the process anyway. Later objects are collected as before."""
    gc.collect()
    gc.freeze()


def grpc_server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A long prefill sends nothing for a while: keep pinging idle connections, and accept clients' keepalive
        # pings (every >= 10 s, even with no call in flight) instead of answering them with GOAWAY too_many_pings.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),  # a second worker on the same port must fail to bind, not share it
    ]


class WorkerServer:
    """One gRPC server in front of one engine. Use from the asyncio loop that will run it."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        # The metrics read the core's engine lazily (once attached), so they can be made first and handed to it.
        self.metrics = WorkerMetrics(
            lambda: self.core.engine.stats() if self.core.engine else None, lambda: self.core.facts.model_name
        )
        # Both fronts (gRPC and HTTP) share this core: one engine, one Authenticator, one drain.
        memory = GeneratedTokens(max_bytes=options.remember_generated_bytes)
        self.core = FrontCore(Authenticator(options.auth_tokens, options.admin_tokens or ()), self.metrics, memory)
        self.servicer = RadixCacheServicer(self.core)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_port: int | None = None
        self.http: Any = None  # openai.http_server.HttpServer, with --http-port
        self.http_port: int | None = None
        self.kv_events: Any = None  # kv_events_zmq.ZmqKvEventPublisher, with kv_events_endpoint (.endpoint: as bound)
        self._server: grpc.aio.Server | None = None
        self._stopped = False

    async def start(self) -> int:
        """Bind and start serving (health NOT_SERVING until attach()); returns the bound port."""
        o = self.options
        if o.kv_events_endpoint:  # refused before any port is bound
            from radixcache.worker.events.zmq_publisher import check_security

            check_security(o.kv_events_endpoint, auth=o.auth_tokens is not None, curve=o.kv_events_curve,
                           insecure=o.kv_events_insecure)  # fmt: skip
        server = grpc.aio.server(
            options=grpc_server_options(o.max_message_bytes),
            maximum_concurrent_rpcs=o.max_concurrent_rpcs,
            interceptors=[UndecodableRequestInterceptor(before_parse=self.servicer.refusal_before_parse)],
        )
        pb_grpc.add_RadixCacheServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{o.host}:{o.port}"
        if bool(o.tls_cert) != bool(o.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if o.tls_cert and o.tls_key:
            with open(o.tls_key, "rb") as k, open(o.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        await server.start()
        self._server = server
        if o.http_port is not None:
            from radixcache.worker.http.guard import HttpLimits  # fastapi/uvicorn: only when asked for
            from radixcache.worker.http.openai.response_store import ResponseStore
            from radixcache.worker.http.server import HttpServer

            limits = HttpLimits(max_connections=o.http_max_connections, head_timeout_s=o.http_head_timeout_s)
            store = ResponseStore(
                max_responses=o.responses_max, max_bytes=o.responses_max_bytes, ttl_s=o.responses_ttl_s,
                pin_ttl_s=o.responses_pin_ttl_s,
            )  # fmt: skip
            self.http = HttpServer(
                self.core,
                o.host,
                o.http_port,
                max_body_bytes=o.max_body_bytes,
                limits=limits,
                store=store,
                allowed_host_names=o.http_allowed_hosts,
            )
            self.http_port = await self.http.start()
        if o.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(o.metrics_port, o.metrics_host or o.host)
        return self.port

    async def attach(self, engine: Any, facts: ModelFacts) -> None:
        """Serve `engine` (already started and warmed up): health turns SERVING."""
        await self._start_events(engine)
        self.core.attach(engine, facts)
        self.metrics.attached()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def _start_events(self, engine: Any) -> None:
        """Cache events for engines that have a cache (the real one; not every test double)."""
        if not hasattr(engine, "cache") or not hasattr(engine, "call"):
            if self.options.kv_events_endpoint:
                raise ValueError("--kv-events-endpoint: this engine reports no cache events")
            return
        from radixcache.worker.events.hub import CacheEventHub

        hub = CacheEventHub(engine)
        await hub.start()
        self.core.events = hub
        if self.options.kv_events_endpoint:
            from radixcache.worker.events.zmq_publisher import ZmqKvEventPublisher

            o = self.options
            publisher = ZmqKvEventPublisher(
                o.kv_events_endpoint, hub.page_size, layout=o.kv_events_format, curve=o.kv_events_curve
            )
            hub.add_publisher(publisher)
            self.kv_events = publisher

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then close. Idempotent.

        Health turns NOT_SERVING and new Generate calls get UNAVAILABLE at once, but the port stays open while the
        engine finishes the requests it runs (up to `grace` seconds, then it aborts the rest): load balancers can
        still read NOT_SERVING, and in-flight streams receive their last messages. Then the server closes.
        """
        if self._stopped:
            return
        self._stopped = True
        grace = self.options.grace_period if grace is None else grace
        deadline = time.monotonic() + grace
        await self.health.enter_graceful_shutdown()
        self.core.draining = True
        if self.core.events is not None:  # subscribers' streams end now, not at the end of the grace period
            await self.core.events.close()
        engine = self.core.engine
        if engine is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: engine.shutdown(drain=True, timeout=grace))
        left = max(1.0, deadline - time.monotonic())
        # Every engine request has ended; the handlers only have their last messages left to write.
        if self.http is not None:
            await self.http.stop(left)
        if self._server is not None:
            await self._server.stop(left)
        self.metrics.stop_http()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


async def run_worker(
    options: ServerOptions,
    load_engine: Callable[[], tuple[Any, ModelFacts]],
    *,
    on_listening: Callable[[str, int], None] | None = None,
    stop_event: asyncio.Event | None = None,
) -> int:
    """Run a worker until SIGTERM/SIGINT (or stop_event): bind, load the engine in a thread, serve, drain, exit 0.

    load_engine builds, starts and warms up the engine (it runs in a worker thread, while health says NOT_SERVING
    and every RPC answers UNAVAILABLE). on_listening(host, port) is called once the worker is ready: health says
    SERVING and every RPC is served (the CLI prints "listening on HOST:PORT" then, so a script can wait for it).
    """
    loop = asyncio.get_running_loop()
    stop = stop_event or asyncio.Event()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    server = WorkerServer(options)
    try:
        port = await server.start()
        log.info("bound %s:%d; loading the model (health NOT_SERVING until ready)", options.host, port)
        loading = loop.run_in_executor(None, load_engine)
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            engine, info = loading.result()
            freeze_startup_objects()
            await server.attach(engine, info)
            if on_listening is not None:
                on_listening(options.host, port)
            if server.metrics_port is not None:
                host = options.metrics_host or options.host
                print(f"metrics on http://{host}:{server.metrics_port}/metrics", flush=True)
            if server.http_port is not None:
                print(f"openai api on http://{options.host}:{server.http_port}/v1", flush=True)
            if server.kv_events is not None:
                print(f"cache events on {server.kv_events.endpoint}", flush=True)
            await stopping
        else:  # stopped while loading: the load must finish before its engine can be shut down
            stopping.cancel()
            engine, info = await loading
            server.core.engine = engine
        await server.stop()
    finally:
        await server.stop(0)
        for sig in installed:
            loop.remove_signal_handler(sig)
    return 0


def describe(
    engine: Any,
    *,
    model_name: str = "",
    model_path: str = "",
    backend: str = "",
    dtype: str = "",
    device: str = "",
    cache_enabled: bool = True,
) -> ModelFacts:
    """The model facts of an engine (sent as ModelInfo); what the engine knows about itself wins over the arguments."""
    cfg = engine.model_config
    eos = getattr(engine.tokenizer, "eos_token_ids", None) or getattr(cfg, "eos_token_ids", ())
    model = getattr(engine, "model", None)
    if model is not None:
        dtype = str(next(model.parameters()).dtype)
    config = getattr(engine, "config", None)
    kinds = tuple(getattr(cfg, "layer_kinds", None) or ())
    pool = getattr(engine, "pool", None)
    check = getattr(engine, "row_check", None)
    return ModelFacts(
        model_name=model_name,
        model_path=model_path,
        architecture=str(getattr(cfg, "architecture", "")),
        vocab_size=int(cfg.vocab_size),
        context_length=int(engine.context_length),
        page_size=int(engine.page_size),
        kv_pages=int(engine.num_pages),
        kv_bytes=int(engine.kv_bytes),
        backend=str(getattr(getattr(engine, "backend", None), "name", "") or backend),
        dtype=dtype.removeprefix("torch."),
        device=str(getattr(engine, "device", "") or device),
        cache_enabled=bool(getattr(config, "cache_enabled", cache_enabled)),
        eos_token_ids=tuple(sorted(int(t) for t in eos)),
        max_pinned_pages=int(getattr(engine, "max_pinned_pages", 0) or 0),
        speculate=int(getattr(config, "speculate", 0) or 0) if getattr(check, "exact", True) else 0,
        layer_kinds=kinds,
        sliding_window=int(getattr(cfg, "sliding_window", None) or 0) if "sliding" in kinds else 0,
        kv_dtype=str(getattr(engine, "kv_dtype", "") or ""),
        kv_bytes_per_token=int(getattr(engine, "kv_bytes_per_token", 0) or 0),
        kv_demote=str(getattr(pool, "demote_dtype", "") or ""),
        kv_demoted_pages=int(getattr(pool, "demoted_pages", 0) or 0),
        rows_exact=bool(getattr(check, "exact", True)),
        row_check=str(getattr(check, "detail", "")),
    )
