"""Cache events in vLLM's KV-event wire format, published on a ZMQ PUB socket (`serve --kv-events-endpoint`).

So KV-aware routers that index vLLM (llm-d's KV-cache indexer, NVIDIA Dynamo's ZMQ relay) index radixcache workers
the same way. Each message is multipart [topic, sequence, payload]: the topic (default empty), the message's
sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher; a gap means messages were dropped), and a
msgpack EventBatch in the layout of vLLM's msgspec structs (array_like, tagged union: the tag is the class name):

    EventBatch       = [ts (float, Unix seconds), [event, ...], data_parallel_rank (0)]
    BlockStored      = ["BlockStored", block_hashes, parent_block_hash (None: first page), token_ids, block_size,
                        lora_id (None), medium ("GPU"), lora_name (None)]
    BlockRemoved     = ["BlockRemoved", block_hashes, medium ("GPU")]
    AllBlocksCleared = ["AllBlocksCleared"]

A block is a page (block_size = page size), its hash the page hash of radixcache.events (it includes the namespace,
so tenants never collide in one flat index); "GPU" names the worker's KV pool, whatever its device. A (re)started
publisher first sends AllBlocksCleared and then the whole cache as BlockStored, and does so again whenever events
were lost. NamespaceCleared has no counterpart (its pages' BlockRemoved come first). There is no replay socket.

Endpoint rule (vLLM's): a wildcard host (tcp://*:5557, tcp://[::]:5557), ipc:// and inproc:// are bound; any other
endpoint (tcp://router:5557) is connected to, for a subscriber that binds. pyzmq and msgpack are the `events` extra,
imported here only.
"""

from __future__ import annotations

import time
from typing import Any

from radixcache.events import CacheEvent, NamespaceCleared, PagesRemoved, PagesStored

MEDIUM = "GPU"
SNAPSHOT_EVENTS_PER_MESSAGE = 512


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


def vllm_event(event: CacheEvent, page_size: int) -> list | None:
    """The msgpack-ready array of one event (None: no vLLM counterpart)."""
    if isinstance(event, PagesStored):
        medium = getattr(event, "medium", MEDIUM)
        return ["BlockStored", event.page_hashes, event.parent_hash, event.token_ids, page_size, None, medium, None]
    if isinstance(event, PagesRemoved):
        return ["BlockRemoved", event.page_hashes, getattr(event, "medium", MEDIUM)]
    if isinstance(event, NamespaceCleared):
        return None
    raise TypeError(f"not a cache event: {event!r}")


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (else it connects), by vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKvEventPublisher:
    """A cache event hub Publisher (radixcache.worker.cache_events) writing vLLM's format. Never blocks: at the
    socket's high-water mark a message is dropped (its sequence number is still used, so readers see the gap)."""

    def __init__(self, endpoint: str, page_size: int, *, topic: str = "", hwm: int = 100_000) -> None:
        zmq, msgpack = _modules()
        self._zmq, self._pack = zmq, msgpack.Packer(use_bin_type=True).pack
        self.endpoint = endpoint
        self.page_size = page_size
        self.topic = topic.encode("utf-8")
        self.sequence = 0  # of the next message
        self.dropped = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if binds(endpoint):
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"--kv-events-endpoint {endpoint}: {e}") from None

    def reset(self, snapshot: list[PagesStored]) -> None:
        now = time.time()
        self._send([["AllBlocksCleared"]], now)
        events = [vllm_event(e, self.page_size) for e in snapshot]
        for i in range(0, len(events), SNAPSHOT_EVENTS_PER_MESSAGE):
            self._send(events[i : i + SNAPSHOT_EVENTS_PER_MESSAGE], now)

    def publish(self, events: list[CacheEvent], timestamp: float) -> None:
        out = [v for e in events if (v := vllm_event(e, self.page_size)) is not None]
        if out:
            self._send(out, timestamp)

    def _send(self, events: list, timestamp: float) -> None:
        payload = self._pack([timestamp, events, 0])
        seq = self.sequence.to_bytes(8, "big")
        self.sequence += 1
        try:
            self._sock.send_multipart([self.topic, seq, payload], flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
