"""Hostile HTTP clients, bounded, for the HTTP front's tests and `bench/http_hostile.py`: header floods, slowloris
connections, idle connections, connection floods, with the worker's health probed meanwhile.

Every attack runs on its own asyncio loop in a thread (`Attack.run_in_thread`), so the caller can probe health at
the same time. Health is probed both ways a load balancer would: HTTP GET /health on a fresh connection and
grpc.health.v1 Check. Everything is bounded by count, bytes and seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from client_priority import lower_this_threads_priority
from grpc_health.v1 import health_pb2, health_pb2_grpc

KiB, MiB = 1 << 10, 1 << 20


def _probe_loop(host, http_port, grpc_target, every_s, http, pid, stop, ready, results) -> None:
    """HealthProbe's child process: probes until `stop`, then sends (http_ms, grpc_ms, peak_rss_mb) back."""
    http_ms: list[float] = []
    grpc_ms: list[float] = []
    peak = 0.0
    with grpc.insecure_channel(grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        ready.set()
        while not stop.is_set():
            if http:
                http_ms.append(http_health_ms(host, http_port))
            t0 = time.perf_counter()
            with contextlib.suppress(grpc.RpcError):
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            grpc_ms.append((time.perf_counter() - t0) * 1000)
            if pid is not None:
                peak = max(peak, rss_mb(pid))
            stop.wait(every_s)
    results.send((http_ms, grpc_ms, peak))


def rss_mb(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # the process is gone
        return float("nan")
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class FloodResult:
    connections: int
    sent_bytes: list[int] = field(default_factory=list)  # header bytes each connection got in before it ended
    answers: list[str] = field(default_factory=list)  # the status line the server answered ("" if none)


async def header_flood(host: str, port: int, *, connections: int, mib_each: float, seconds: float) -> FloodResult:
    """`connections` clients each sending one endless header value (no end of headers) in 64 KiB writes, up to
    mib_each MiB or `seconds`, until the server answers or closes."""
    chunk = b"a" * (64 * KiB)
    result = FloodResult(connections)
    deadline = time.monotonic() + seconds

    async def one() -> tuple[int, str]:
        reader, writer = await asyncio.open_connection(host, port)
        sent, answer = 0, ""
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Flood: ")
            while sent < mib_each * MiB and time.monotonic() < deadline:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), max(0.01, deadline - time.monotonic()))
                sent += len(chunk)
                if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]  # answered: stop
                    break
            with contextlib.suppress(asyncio.TimeoutError):
                answer = (await asyncio.wait_for(reader.readline(), 2.0)).decode(errors="replace").strip()
        except (ConnectionError, asyncio.TimeoutError, OSError):
            with contextlib.suppress(Exception):
                answer = (await asyncio.wait_for(reader.readline(), 0.5)).decode(errors="replace").strip()
        finally:
            writer.close()
        return sent, answer

    for sent, answer in await asyncio.gather(*(one() for _ in range(connections))):
        result.sent_bytes.append(sent)
        result.answers.append(answer)
    return result


async def many_headers(host: str, port: int, *, count: int) -> str:
    """One request with `count` small headers; the status line of the answer ("" if the server just closed)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(count)) + b"\r\n"
        writer.write(head)
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), 10)).decode(errors="replace").strip()
    except (ConnectionError, OSError):
        return ""
    finally:
        writer.close()


@dataclass
class HeldResult:
    opened: int
    open_at_end: int  # connections the server had not closed when the attack ended
    closed_after_s: list[float] = field(default_factory=list)  # when the server closed each one that it closed


async def hold_connections(
    host: str, port: int, *, connections: int, seconds: float, trickle_every_s: float | None
) -> HeldResult:
    """`connections` clients that open a connection and then either send nothing (trickle_every_s None: idle) or
    a request head one header line per trickle_every_s seconds, never ending it (slowloris); for `seconds`."""
    start = time.monotonic()
    closed: list[float] = []
    opened = 0

    async def one() -> bool:
        nonlocal opened
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            return False
        opened += 1
        try:
            if trickle_every_s is not None:
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            i = 0
            while time.monotonic() - start < seconds:
                wait = trickle_every_s if trickle_every_s is not None else 0.5
                with contextlib.suppress(asyncio.TimeoutError):
                    if await asyncio.wait_for(reader.read(1024), wait) == b"":  # the server closed it
                        closed.append(time.monotonic() - start)
                        return False
                if trickle_every_s is not None:
                    writer.write(b"X-Slow-%d: v\r\n" % i)
                    await writer.drain()
                    i += 1
            return True
        except (ConnectionError, OSError):
            closed.append(time.monotonic() - start)
            return False
        finally:
            writer.close()

    still_open = sum(await asyncio.gather(*(one() for _ in range(connections))))
    return HeldResult(opened, still_open, sorted(closed))


class Attack:
    """Attack rounds on a fresh event loop in a daemon thread at an attacker's priority (client_priority): `make()`
    returns one round's coroutine; rounds repeat until `at_least_s` have passed (one round when 0). start(), then
    result(): the last round's result (re-raises its error); `rounds` counts them, `outputs` holds every round's
    result."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, Any]], *, at_least_s: float = 0.0) -> None:
        self._make, self._at_least_s = make, at_least_s
        self._out: Any = None
        self._error: BaseException | None = None
        self.rounds = 0
        self.outputs: list[Any] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        lower_this_threads_priority()

        async def rounds() -> Any:
            start, out = time.monotonic(), None
            while self.rounds == 0 or time.monotonic() - start < self._at_least_s:
                out = await self._make()
                self.outputs.append(out)
                self.rounds += 1
            return out

        try:
            self._out = asyncio.run(rounds())
        except BaseException as e:  # handed to result()
            self._error = e

    def start(self) -> Attack:
        self._thread.start()
        return self

    def result(self, timeout: float = 120.0) -> Any:
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self._out


def http_health_ms(host: str, port: int, timeout: float = 5.0) -> float:
    """GET /health on a fresh connection: ms until the whole answer arrived (timeout: the whole wait)."""
    import socket

    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while s.recv(4096):
                pass
    except OSError:
        pass
    return (time.perf_counter() - t0) * 1000


@dataclass
class HealthProbe:
    """Probes both healths every `every_s` from a child process while an attack runs; `stop()` -> self with the
    figures. http=False: gRPC health only (while every HTTP connection slot is meant to be taken).

    A process of its own, not a thread beside the attackers: their loops hold this process's GIL for milliseconds at
    a time (writing 64 KiB header chunks, sending 16 MB bodies), and a probe thread waiting for it measured the
    attackers instead of the worker (186 ms in the same run where the worker's own loop had no slow callback)."""

    host: str
    http_port: int
    grpc_target: str
    every_s: float = 0.05
    http: bool = True
    http_ms: list[float] = field(default_factory=list)
    grpc_ms: list[float] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    pid: int | None = None

    def __post_init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process that holds gRPC's threads
        self._stop = context.Event()
        self._results, child_end = context.Pipe(duplex=False)
        self._ready = context.Event()
        args = (self.host, self.http_port, self.grpc_target, self.every_s, self.http, self.pid)
        self._process = context.Process(
            target=_probe_loop, args=(*args, self._stop, self._ready, child_end), daemon=True
        )

    def start(self) -> HealthProbe:
        self._process.start()
        self._ready.wait(60)  # probing: the attack may begin
        return self

    def stop(self) -> HealthProbe:
        self._stop.set()
        if self._results.poll(30):
            self.http_ms, self.grpc_ms, self.peak_rss_mb = self._results.recv()
        self._process.join(10)
        return self

    def summary(self) -> dict[str, float]:
        def stats(xs: list[float]) -> tuple[float, float]:
            return (statistics.median(xs), max(xs)) if xs else (float("nan"), float("nan"))

        (hp50, hmax), (gp50, gmax) = stats(self.http_ms), stats(self.grpc_ms)
        return {
            "probes": len(self.grpc_ms),
            "http_health_p50_ms": round(hp50, 1),
            "http_health_max_ms": round(hmax, 1),
            "grpc_health_p50_ms": round(gp50, 1),
            "grpc_health_max_ms": round(gmax, 1),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
        }
