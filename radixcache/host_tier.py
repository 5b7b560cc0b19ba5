"""HostTier: pages in host memory between the device pool and the disk (`serve --kv-host-memory SIZE`).

Holds payloads (radixcache.page_data.PageData on the worker) by PageKey, within `capacity_bytes` (a payload's size
is its `nbytes`, or len() for bytes), least recently used first out. A page pushed out goes down to `lower` (the disk
store: queued there, dropped if its queue is full) instead of being lost. With `pin` (CUDA), payload tensors are
copied into page-locked memory (torch's caching host allocator), so loading a page back is one DMA.

Thread-safe (one lock, held for dict updates only): the engine thread puts, a loader thread gets. A read hands out
the tier's own payload; callers copy it into the pool and never modify it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any

from radixcache.tier import MEDIUM_HOST, PageKey, PageTier, TierChange, TierStats


def payload_bytes(payload: Any) -> int:
    nbytes = getattr(payload, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(payload)


def pinned(payload: Any) -> Any:
    """A PageData whose tensors live in page-locked host memory (CUDA builds); anything else as it is."""
    kv = getattr(payload, "kv", None)
    if kv is None:
        return payload
    scales = payload.scales
    return type(payload)(payload.kv_dtype, kv.pin_memory(), None if scales is None else scales.pin_memory())


class HostTier:
    """A bounded LRU of pages in host memory; see the module docstring."""

    medium = MEDIUM_HOST

    def __init__(self, capacity_bytes: int, *, lower: PageTier | None = None, pin: bool = False) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.lower = lower
        self.pin = pin
        self._lock = threading.Lock()
        self._pages: OrderedDict[tuple[str, int], tuple[PageKey, Any, int]] = OrderedDict()
        self._bytes = 0
        self._changes: deque[TierChange] = deque()
        self._stats = TierStats(MEDIUM_HOST, capacity_bytes=capacity_bytes)

    def put(self, key: PageKey, payload: Any) -> bool:
        size = payload_bytes(payload)
        if size > self.capacity_bytes:
            with self._lock:
                self._stats.dropped_pages += 1
            return self.lower.put(key, payload) if self.lower is not None else False
        if self.pin:
            payload = pinned(payload)
        with self._lock:
            if key.name in self._pages:
                self._pages.move_to_end(key.name)
                return True
            self._pages[key.name] = (key, payload, size)
            self._bytes += size
            self._stats.written_pages += 1
            self._changes.append(TierChange(MEDIUM_HOST, True, key.namespace, key.page_hash, key))
            victims = []
            while self._bytes > self.capacity_bytes:
                name, victim = self._pages.popitem(last=False)
                self._bytes -= victim[2]
                self._stats.evicted_pages += 1
                self._changes.append(TierChange(MEDIUM_HOST, False, *name))
                victims.append(victim)
        for victim_key, victim_payload, _ in victims:  # outside the lock: the disk's put may take a moment
            if self.lower is not None and not self.lower.contains(victim_key):
                self.lower.put(victim_key, victim_payload)
        return True

    def contains(self, key: PageKey) -> bool:
        with self._lock:
            return key.name in self._pages

    find = contains  # nothing below memory to look at

    def get(self, key: PageKey) -> Any | None:
        with self._lock:
            held = self._pages.get(key.name)
            if held is None or held[0] != key:
                self._stats.read_misses += 1
                return None
            self._pages.move_to_end(key.name)
            self._stats.read_hits += 1
            return held[1]

    def flush(self, namespace: str | None = None) -> int:
        with self._lock:
            names = [n for n in self._pages if namespace is None or n[0] == namespace]
            for name in names:
                self._bytes -= self._pages.pop(name)[2]
                self._changes.append(TierChange(MEDIUM_HOST, False, *name))
        return len(names)

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.pages, s.bytes = len(self._pages), self._bytes
        return s

    def take_changes(self) -> list[TierChange]:
        out = []
        while self._changes:
            out.append(self._changes.popleft())
        return out

    def records(self) -> Iterator[PageKey]:
        with self._lock:
            return iter([held[0] for held in self._pages.values()])

    def items(self) -> list[tuple[PageKey, Any]]:
        """(key, payload) of every page, most recently used first (what a shutdown saves to disk first)."""
        with self._lock:
            return [(held[0], held[1]) for held in reversed(self._pages.values())]

    def check(self) -> None:
        with self._lock:
            total = sum(size for _, _, size in self._pages.values())
            assert total == self._bytes, f"host tier: {self._bytes} bytes counted, {total} held"
            assert total <= self.capacity_bytes, f"host tier holds {total} bytes, over its {self.capacity_bytes}"
            for name, (key, _, _) in self._pages.items():
                assert key.name == name, f"host tier: page {name} filed under another name"

    def close(self, timeout: float | None = None) -> None:
        pass
