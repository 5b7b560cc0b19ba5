"""How long a worker's event loop stalls while huge requests arrive: a health probe's latency under huge prompts.

`measure_loop_stall(target, seconds=..., payload_mib=15)` sends huge Generate / Tokenize / PinPrefix requests (a
text of payload_mib, and a conversation of the same size) back to back from sender threads (in a child process),
while the calling thread checks grpc.health.v1.Health every few milliseconds. Health is served on the same asyncio
loop as every RPC, so its latency is how long the loop could not serve anyone. tests/test_wire_fuzz.py runs a short
one, `make soak` a long one, and `python tests/loop_stall.py HOST:PORT` measures any running worker.

Requests are serialized once and sent as raw bytes, so the client's own work stays out of the measurement.
Requests under the worker's --max-message-mib are parsed (off the loop) and refused by their size; bigger ones are
refused by gRPC's core (RESOURCE_EXHAUSTED) before Python sees them.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import threading
import time
from dataclasses import asdict, dataclass, field

import grpc
from client_priority import lower_this_threads_priority
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixcache.v1 import radixcache_pb2 as pb

SERVICE = "/radixcache.v1.RadixCache/"
MiB = 1 << 20


@dataclass
class StallReport:
    max_loop_stall_ms: float  # the slowest health check while huge requests were arriving
    idle_probe_ms: float  # the median health check before they started
    probes: int
    big_requests: int  # huge requests answered
    statuses: dict[str, int] = field(default_factory=dict)  # their statuses


def huge_requests(payload_mib: float = 15.0) -> list[tuple[str, bytes]]:
    """(method, serialized request) pairs of about `payload_mib` MiB each: text and chat, for each prompt RPC."""
    n = int(payload_mib * MiB)
    text = ("lorem ipsum dolor sit amet " * (n // 27 + 1))[:n]
    chat = pb.ChatMessages()
    for i in range(8):
        chat.messages.add(role="user" if i % 2 == 0 else "assistant", content=text[: n // 8])
    return [
        ("Generate", pb.GenerateRequest(text=text, max_tokens=1).SerializeToString()),
        ("Tokenize", pb.TokenizeRequest(text=text).SerializeToString()),
        ("Generate", pb.GenerateRequest(messages=chat, max_tokens=1).SerializeToString()),
        ("PinPrefix", pb.PinPrefixRequest(text=text).SerializeToString()),
        ("Tokenize", pb.TokenizeRequest(messages=chat).SerializeToString()),
    ]


def _probe_ms(health: health_pb2_grpc.HealthStub, timeout: float) -> float:
    t0 = time.perf_counter()
    try:
        health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        pass  # a timed-out probe counts for its whole wait
    return (time.perf_counter() - t0) * 1000


def measure_loop_stall(
    target: str,
    *,
    seconds: float,
    payload_mib: float = 15.0,
    senders: int = 2,
    probe_every_s: float = 0.005,
    metadata: tuple = (),
) -> StallReport:
    """Sends huge requests for `seconds` from `senders` threads of a child process while probing health from this
    one; see the module docstring. The senders have a process of their own: threads beside the probe would hold its
    GIL and be measured with the worker, and they run nicer (client_priority) so their CPU is not either."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds gRPC's threads
    stop = context.Event()
    ready = context.Event()
    results, child_end = context.Pipe(duplex=False)
    with grpc.insecure_channel(target, options=_OPTIONS) as probe_channel:
        health = health_pb2_grpc.HealthStub(probe_channel)
        idle = sorted(_probe_ms(health, 5.0) for _ in range(20))
        process = context.Process(
            target=_send_huge_requests,
            args=(target, payload_mib, senders, tuple(metadata), stop, ready, child_end),
            daemon=True,
        )
        process.start()
        ready.wait(60)
        worst, probes = 0.0, 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            worst = max(worst, _probe_ms(health, 120.0))  # a stalled loop answers late, not never
            probes += 1
            time.sleep(probe_every_s)
        stop.set()
        statuses = results.recv() if results.poll(180) else {}
        process.join(30)
    return StallReport(
        max_loop_stall_ms=round(worst, 1),
        idle_probe_ms=round(idle[len(idle) // 2], 2),
        probes=probes,
        big_requests=sum(statuses.values()),
        statuses=dict(statuses),
    )


# A local subchannel pool: each channel its own TCP connection (gRPC shares one between channels with the same
# target and options), so the probe is another client, not a call queued behind 15 MiB frames on one socket.
_OPTIONS = [
    ("grpc.max_send_message_length", 64 * MiB),
    ("grpc.max_receive_message_length", 64 * MiB),
    ("grpc.use_local_subchannel_pool", 1),
]


def _send_huge_requests(target, payload_mib, senders, metadata, stop, ready, results) -> None:
    """measure_loop_stall's child process: `senders` threads send huge requests back to back until `stop`, then
    the statuses they got are sent back."""
    lower_this_threads_priority()  # the senders' CPU is not the worker's stall
    requests = huge_requests(payload_mib)
    statuses: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def send(offset: int) -> None:
        with grpc.insecure_channel(target, options=_OPTIONS) as ch:  # its own connection, like another client
            i = offset
            while not stop.is_set():
                method, payload = requests[i % len(requests)]
                i += 1
                try:
                    if method == "Generate":
                        for _ in ch.unary_stream(SERVICE + method)(payload, timeout=60, metadata=metadata):
                            pass
                    else:
                        ch.unary_unary(SERVICE + method)(payload, timeout=60, metadata=metadata)
                    status = "OK"
                except grpc.RpcError as e:
                    status = e.code().name
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(senders)]
    for t in threads:
        t.start()
    ready.set()
    for t in threads:
        t.join(120)
    results.send(dict(statuses))


def main() -> None:
    p = argparse.ArgumentParser(description="Measure a worker's loop stall while huge requests arrive.")
    p.add_argument("target", help="HOST:PORT of a running worker")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--payload-mib", type=float, default=15.0)
    p.add_argument("--senders", type=int, default=2)
    args = p.parse_args()
    report = measure_loop_stall(args.target, seconds=args.seconds, payload_mib=args.payload_mib, senders=args.senders)
    print(json.dumps(asdict(report)))


if __name__ == "__main__":
    main()
