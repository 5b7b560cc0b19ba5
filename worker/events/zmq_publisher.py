"""Cache events published on a ZMQ PUB socket in vLLM's KV-event wire format (`serve --kv-events-endpoint`).

So KV-aware routers that index vLLM (llm-d's KV-cache indexer, NVIDIA Dynamo's ZMQ relay) index radixcache workers
the same way. Each message is multipart [topic, sequence, payload]: the topic (default empty), the message's
sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher; a gap means messages were dropped), and a
msgpack EventBatch in one of worker.kv_events_vllm's layouts (default: current vLLM's). A (re)started publisher
first sends AllBlocksCleared and then the whole cache as BlockStored, and does so again whenever events were lost.
There is no replay socket.

Endpoints. vLLM's rule: a wildcard host (tcp://*:5557, tcp://[::]:5557), ipc:// and inproc:// are bound; any other
endpoint (tcp://router:5557) is connected to, for a subscriber that binds. So by that rule TCP binds every interface
or none; a "bind+" prefix binds the endpoint as written (bind+tcp://127.0.0.1:5557: loopback only), and "connect+"
connects whatever the host. Several publishers of one deployment (a cluster's replicas; vLLM's data-parallel ranks)
follow vLLM's rule too: rank r publishes on the endpoint's port + r (`rank_endpoint`; ipc:// and inproc:// get the
suffix "_dp<r>") and tags its batches with data_parallel_rank r.

Security. The events carry every tenant's token ids. With --auth-tokens, `check_security` refuses an endpoint that
is not local (ipc://, inproc://) unless subscribers authenticate with ZMQ CURVE (`CurveKeys`: this worker's secret
key file and a directory of the subscribers' public key files, the formats zmq.auth.create_certificates writes) or
--kv-events-insecure says the network is trusted. With CURVE a subscriber whose key is not in the directory gets
nothing (its handshake is refused), and the traffic is encrypted.

pyzmq and msgpack are the `events` extra, imported here only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixcache.events import CacheEvent, PagesStored
from radixcache.worker.events.vllm_format import CLEARED, FORMAT_CURRENT, FORMATS, event_batch, vllm_event

SNAPSHOT_EVENTS_PER_MESSAGE = 512
LOCAL_TRANSPORTS = ("ipc://", "inproc://")  # not reachable from the network (ipc: the socket file's permissions)


def _modules() -> tuple[Any, Any]:
    try:
        import msgpack
        import zmq
    except ImportError as e:
        raise RuntimeError(
            f"--kv-events-endpoint needs pyzmq and msgpack ({e}); install them with: pip install 'radixcache[events]'"
        ) from None
    return zmq, msgpack


def check_available() -> None:
    """RuntimeError naming the extra to install when pyzmq or msgpack is missing."""
    _modules()


def parse_endpoint(text: str) -> tuple[str, bool]:
    """(ZMQ endpoint, whether the publisher binds it): "bind+" / "connect+" say so, else vLLM's rule."""
    for prefix, bind in (("bind+", True), ("connect+", False)):
        if text.startswith(prefix):
            return text[len(prefix) :], bind
    return text, "*" in text or "::" in text or text.startswith(LOCAL_TRANSPORTS)


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (else it connects)."""
    return parse_endpoint(endpoint)[1]


@dataclass(frozen=True)
class CurveKeys:
    """ZMQ CURVE for the event socket: `secret_key` is this worker's key file (public and secret key), `clients` a
    directory whose *.key files are the public keys of the subscribers allowed in."""

    secret_key: Path
    clients: Path


def check_security(endpoint: str, *, auth: bool, curve: CurveKeys | None, insecure: bool) -> None:
    """ValueError naming the flags, when the event stream would reach the network unauthenticated with auth on."""
    address, _ = parse_endpoint(endpoint)
    if auth and curve is None and not insecure and not address.startswith(LOCAL_TRANSPORTS):
        raise ValueError(
            f"--kv-events-endpoint {endpoint}: the cache events hold every tenant's token ids, and --auth-tokens is "
            "set: over the network, authenticate subscribers with --kv-events-curve-secret and "
            "--kv-events-curve-clients (ZMQ CURVE), or pass --kv-events-insecure if the network is trusted "
            "(or publish on an ipc:// endpoint)"
        )


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank `rank` (vLLM's rule): tcp port + rank; ipc/inproc "_dp<rank>" appended."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if rank == 0:
        return endpoint
    prefix = next((p for p in ("bind+", "connect+") if endpoint.startswith(p)), "")
    if prefix:  # the prefix says bind or connect; the rank offsets what follows it
        return prefix + rank_endpoint(endpoint.removeprefix(prefix), rank)
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    host, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"--kv-events-endpoint {endpoint!r}: a tcp:// endpoint needs a port to offset by rank")
    if int(port) + rank > 65535:
        raise ValueError(f"--kv-events-endpoint {endpoint!r}: port {port} + rank {rank} is beyond 65535")
    return f"{host}:{int(port) + rank}"


class ZmqKvEventPublisher:
    """A cache event hub Publisher (radixcache.worker.events.hub) writing vLLM's format. Never blocks: at the
    socket's high-water mark a message is dropped (its sequence number is still used, so readers see the gap)."""

    def __init__(
        self,
        endpoint: str,
        page_size: int,
        *,
        topic: str = "",
        hwm: int = 100_000,
        layout: str = FORMAT_CURRENT,
        curve: CurveKeys | None = None,
        data_parallel_rank: int = 0,
    ) -> None:
        zmq, msgpack = _modules()
        self._zmq, self._pack = zmq, msgpack.Packer(use_bin_type=True).pack
        self.endpoint, bind = parse_endpoint(endpoint)
        self.page_size = page_size
        self.data_parallel_rank = data_parallel_rank
        self.layout = layout
        if layout not in FORMATS:
            raise ValueError(f"--kv-events-format {layout!r}: expected one of {', '.join(FORMATS)}")
        self.topic = topic.encode("utf-8")
        self.sequence = 0  # of the next message
        self.dropped = 0
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if curve is not None:
                self._require_curve(curve)
            if bind:
                self._sock.bind(self.endpoint)
                self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, for tcp://host:*
            else:
                self._sock.connect(self.endpoint)
        except (zmq.ZMQError, OSError, ValueError) as e:
            self.close()
            raise OSError(f"--kv-events-endpoint {endpoint}: {e}") from None

    def _require_curve(self, curve: CurveKeys) -> None:
        """Make the socket a CURVE server that admits only the public keys in curve.clients (a ZAP handler thread)."""
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        if not self._zmq.has("curve"):
            raise ValueError("this libzmq was built without CURVE support")
        public, secret = zmq.auth.load_certificate(str(curve.secret_key))
        if not secret:
            raise ValueError(f"--kv-events-curve-secret {curve.secret_key} holds no secret key (a .key_secret file)")
        if not curve.clients.is_dir() or not zmq.auth.load_certificates(str(curve.clients)):
            raise ValueError(f"--kv-events-curve-clients {curve.clients}: expected a directory of public *.key files")
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(curve.clients))
        self._sock.curve_secretkey, self._sock.curve_publickey = secret, public
        self._sock.curve_server = True

    def reset(self, snapshot: list[PagesStored]) -> None:
        now = time.time()
        self._send(CLEARED[self.layout], now)
        events = [vllm_event(e, self.page_size, self.layout) for e in snapshot]
        for i in range(0, len(events), SNAPSHOT_EVENTS_PER_MESSAGE):
            self._send(events[i : i + SNAPSHOT_EVENTS_PER_MESSAGE], now)

    def publish(self, events: list[CacheEvent], timestamp: float) -> None:
        out = [v for e in events if (v := vllm_event(e, self.page_size, self.layout)) is not None]
        if out:
            self._send(out, timestamp)

    def _send(self, events: list, timestamp: float) -> None:
        payload = self._pack(event_batch(timestamp, events, self.data_parallel_rank))
        seq = self.sequence.to_bytes(8, "big")
        self.sequence += 1
        try:
            self._sock.send_multipart([self.topic, seq, payload], flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
