"""The HTTP front under hostile bodies (issue 22), in small form: each of tests/hostile_bodies.py's requests (a huge
`n`, bodies of a million messages or tools, JSON nested 100,000 deep, bodies not said to be JSON, a foreign Host,
lone surrogates in the tool-use fields, ...) gets its answer. One worker process for the module, killed by a
watchdog if its memory grows past a bound; each test checks that health (gRPC and HTTP) kept answering meanwhile,
that a real request is still served and that no lease was left behind (`assert_unharmed`).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hostile_bodies import HUGE_N, JSON, check_answer, hostile_requests
from worker_process import WorkerProcess

from radixcache.client import Client

MODEL = "random-seed0"
HEALTH_P50_MS = 100.0  # health answers within this while hostile bodies arrive (the median probe)
HEALTH_MAX_MS = 1000.0  # and no probe stalls (a 2-core machine shared with other jobs: the median is the promise)
RSS_GROWTH_MB = 600.0  # the watchdog kills the worker past this (16 MB bodies are buffered whole, a few at once)


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess("--kv-pages", "64", "--http-port", "0", max_rss_growth_mb=RSS_GROWTH_MB) as w:
        line = w.lines.get(timeout=30)
        assert line.startswith("openai api on "), line
        w.http_url = line.split()[-1].removesuffix("/v1")
        yield w


class HealthProbe:
    """Probes gRPC health and HTTP GET /health (a fresh connection each) every 20 ms from a thread."""

    def __init__(self, worker) -> None:
        self.worker, self.grpc_ms, self.http_ms = worker, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.worker.target) as channel, httpx.Client(timeout=10) as http:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                with contextlib.suppress(grpc.RpcError):
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                t1 = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    http.get(self.worker.http_url + "/health", headers={"Connection": "close"})
                t2 = time.perf_counter()
                self.grpc_ms.append((t1 - t0) * 1000)
                self.http_ms.append((t2 - t1) * 1000)
                time.sleep(0.02)

    def _probed(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.http_ms) < count and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        self._probed(1)
        return self

    def __exit__(self, *exc: object) -> None:
        self._probed(len(self.http_ms) + 2)  # one probe begun after the test's requests, at least
        self._stop.set()
        self._thread.join(30)

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {"probes": len(self.grpc_ms)}
        for front, ms in (("grpc", self.grpc_ms), ("http", self.http_ms)):
            out[f"{front}_p50_ms"] = round(statistics.median(ms), 1)
            out[f"{front}_max_ms"] = round(max(ms), 1)
        return out


def assert_unharmed(worker, health: HealthProbe) -> None:
    """Health answered meanwhile, memory bounded, a real request still served, no lease left."""
    summary = health.summary()
    assert not worker.killed_for_memory, worker.killed_for_memory
    assert summary["probes"] >= 2, summary
    for front in ("grpc", "http"):
        assert summary[f"{front}_p50_ms"] < HEALTH_P50_MS, summary
        assert summary[f"{front}_max_ms"] < HEALTH_MAX_MS, summary
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    r = httpx.post(worker.http_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    with Client(worker.target) as c:
        assert c.stats()["live_leases"] == 0


def post(worker, path: str, body: bytes | dict, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(worker.http_url + path, content=content, headers=headers or JSON, timeout=timeout)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


HOSTILE = {h.name: h for h in hostile_requests(MODEL) if h.status != 200}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_request_gets_its_answer_at_once_without_a_stall(worker, name):
    hostile = HOSTILE[name]
    with HealthProbe(worker) as health:
        started = time.monotonic()
        r = httpx.request(hostile.method, worker.http_url + hostile.path, content=hostile.body or None,
                          headers=hostile.headers, timeout=60)  # fmt: skip
        assert check_answer(hostile, r) is None
        assert time.monotonic() - started < 5.0
        time.sleep(0.1)  # a few probes after the answer too
    assert_unharmed(worker, health)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_huge_n_is_refused_naming_n_streaming_or_not(worker, path):
    body = {"model": MODEL, "max_tokens": 2, "n": HUGE_N}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    with HealthProbe(worker) as health:
        for stream in (False, True):
            started = time.monotonic()
            error = error_of(post(worker, path, body | {"stream": stream}), 400)
            assert error["param"] == "n" and "n must be in [1, 16]" in error["message"], error
            assert time.monotonic() - started < 2.0
    assert_unharmed(worker, health)


def test_json_nested_too_deep_is_named_in_one_short_log_line(worker):
    log_before = worker.log()
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"model": "m", "messages": ' + b"[" * 1200 + b"]" * 1200 + b"}"):
        error = error_of(post(worker, "/v1/chat/completions", raw), 400)
        assert error["param"] is None and "nests objects and arrays more than 128 deep" in error["message"]
    logged = worker.log()[len(log_before) :]
    assert "Traceback" not in logged and len(logged.splitlines()) <= 1 and len(logged) < 400, logged


def test_loopback_names_and_json_with_parameters_are_served(worker):
    port = worker.http_url.rsplit(":", 1)[1]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", "app.localhost", f"[::1]:{port}"):
        r = post(worker, "/v1/completions", body, headers=JSON | {"Host": host})
        assert r.status_code == 200, (host, r.text)
    for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io"):
        error = error_of(httpx.get(worker.http_url + "/v1/models", headers={"Host": host}), 400)
        assert error["code"] == "invalid_host" and "--http-allowed-hosts" in error["message"], error
    r = post(worker, "/v1/completions", body, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text
    error = error_of(post(worker, "/v1/completions", body, headers={"Content-Type": "text/plain"}), 415)
    assert "application/json" in error["message"] and error["code"] == "unsupported_media_type"
    assert "GET /v1/chat/completions" in error_of(httpx.get(worker.http_url + "/v1/chat/completions"), 405)["message"]
