"""CacheEventHub: one engine's cache events, handed to many readers without blocking the engine or buffering freely.

Threads: the engine thread only records (an `EventLog` attached to `engine.cache`, appending page ids); the log asks
this hub's asyncio loop to drain it (one call_soon_threadsafe per batch of records), and the loop turns the records
into hashed events and fans each batch out:
- to subscribers (`subscribe()`), each with its own bounded queue: a subscriber whose queue is full is dropped to a
  RESET, then gets a fresh snapshot (it never holds the hub or the engine back);
- to publishers (`add_publisher`, e.g. the ZMQ publisher of vLLM's format), called synchronously and never blocking.

Snapshots are consistent with the stream by construction: the engine thread writes the snapshot into the same record
stream (`EventLog.snapshot`, run through `engine.call`), so a snapshot comes after exactly the events it includes.
Nobody listening: records are discarded as they come, and hashing costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from radixcache.event_log import LOST, EventLog, Snapshot
from radixcache.events import MLA_KIND, CacheEvent, PagesStored

log = logging.getLogger("radixcache.events")

SNAPSHOT, EVENTS, RESET = "snapshot", "events", "reset"


@dataclass(frozen=True)
class EventBatch:
    """What a subscriber receives. SNAPSHOT: every cached page (replace what you knew); `sequence` is that of the last
    EVENTS batch it includes. EVENTS: apply in order; `sequence` is one more than the previous EVENTS batch's.
    RESET: you fell behind; forget what you knew, a SNAPSHOT follows."""

    kind: str
    sequence: int
    events: list[CacheEvent]
    timestamp: float


class Publisher(Protocol):
    """A reader that sees every batch as it is drained (on the hub's loop; must not block)."""

    def reset(self, snapshot: list[PagesStored]) -> None:
        """Everything the cache holds now: sent when the publisher is added, and after events were lost."""

    def publish(self, events: list[CacheEvent], timestamp: float) -> None:
        """One batch of live events, in order."""

    def close(self) -> None: ...


def _tier_records(cache: Any) -> list:
    """What the cache's tiers below memory hold (pages on the host or on disk), for a snapshot."""
    records = getattr(cache, "tier_records", None)
    return records() if records is not None else []


def _window_pages(cache: Any) -> list[int]:
    """The tree pages that still have their window part (window paging), for a snapshot."""
    pages = getattr(cache, "window_pages", None)
    return pages() if pages is not None else []


class _Subscription:
    __slots__ = ("queue", "token", "active")

    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[EventBatch | None] = asyncio.Queue(maxsize)
        self.token: object = None  # the snapshot this subscription waits for
        self.active = False  # has its snapshot: takes live batches

    def offer(self, batch: EventBatch) -> None:
        if not self.active:
            return
        try:
            self.queue.put_nowait(batch)
        except asyncio.QueueFull:
            self.fall_behind()

    def fall_behind(self) -> None:
        """Drop what is queued for it and tell it to start over (it asks for a new snapshot when it reads this)."""
        self.active, self.token = False, None
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(EventBatch(RESET, 0, [], time.time()))


class CacheEventHub:
    """Cache events of one engine (anything with `cache`, `page_size` and `call(fn)`), served on one asyncio loop.

    queue_batches: how many batches a subscriber may have unread before it is reset. max_pending: records the engine
    may leave undrained before the log drops them (then every reader starts over from a snapshot).
    """

    def __init__(self, engine: Any, *, queue_batches: int = 256, max_pending: int = 100_000) -> None:
        if queue_batches < 1:
            raise ValueError(f"queue_batches must be >= 1, got {queue_batches}")
        self.engine = engine
        self.page_size = int(engine.page_size)
        # Part of every page hash (radixcache.events): quantized pages are named apart from full-precision ones.
        self.kv_dtype: str | None = getattr(engine, "kv_dtype", None)
        self.queue_batches = queue_batches
        self.max_pending = max_pending
        self.sequence = 0  # of the last EVENTS batch
        self._log: EventLog | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subs: set[_Subscription] = set()
        self._publishers: list[Publisher] = []
        self._publisher_token = object()
        self._tasks: set[asyncio.Task] = set()  # snapshot requests in flight (kept referenced until done)
        self._closed = False

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Attach the log to the engine's cache (on the engine thread, with a snapshot: the cache may hold pages)."""
        loop = self._loop = asyncio.get_running_loop()

        def pending() -> None:  # engine thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads any more
                loop.call_soon_threadsafe(self._drain)

        cache = self.engine.cache
        window = cache.window.window if getattr(cache, "window", None) is not None else None
        latent = getattr(getattr(self.engine, "model_config", None), "is_mla", False)
        event_log = self._log = EventLog(
            self.page_size, on_pending=pending, max_pending=self.max_pending, kv_dtype=self.kv_dtype, window=window,
            spec_kind=MLA_KIND if latent else None,
        )  # fmt: skip

        def attach() -> None:
            cache.set_event_sink(event_log)
            event_log.snapshot(cache.page_records(), self._publisher_token, _tier_records(cache), _window_pages(cache))

        await self._on_engine(attach)

    async def close(self) -> None:
        """Detach from the cache; subscribers' iterators end, publishers are closed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._log is not None:
            with contextlib.suppress(Exception):  # the engine may be gone already: then nothing records anyway
                await self._on_engine(lambda: self.engine.cache.set_event_sink(None))
        for sub in self._subs:
            sub.active = False
            while not sub.queue.empty():
                sub.queue.get_nowait()
            sub.queue.put_nowait(None)
        for publisher in self._publishers:
            publisher.close()
        self._publishers.clear()

    def add_publisher(self, publisher: Publisher) -> None:
        """Publish every batch to `publisher`, starting with a full reset once the next snapshot is drained."""
        self._publishers.append(publisher)
        self._request(self._publisher_token)

    async def resync_publishers(self) -> None:
        """Send every publisher the whole cache again (a reset), e.g. for readers that joined late."""
        await self._take_snapshot(self._publisher_token)

    # ---- subscribers ----------------------------------------------------------------------------------------
    async def subscribe(self) -> AsyncIterator[EventBatch]:
        """SNAPSHOT, then EVENTS batches; RESET (then SNAPSHOT again) if it reads too slowly. Ends when the hub
        closes. Iterate it promptly: its queue holds `queue_batches` batches."""
        if self._closed or self._log is None:
            raise RuntimeError("the cache event hub is not running")
        sub = _Subscription(self.queue_batches)
        self._subs.add(sub)
        try:
            while True:
                sub.token = token = object()
                await self._take_snapshot(token)
                while True:
                    batch = await sub.queue.get()
                    if batch is None:
                        return
                    yield batch
                    if batch.kind == RESET:
                        break
        finally:
            self._subs.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    # ---- the loop's side ------------------------------------------------------------------------------------
    async def _on_engine(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.call, fn)

    async def _take_snapshot(self, token: object) -> None:
        """Put a snapshot for `token` into the record stream, on the engine thread (between two of its steps)."""
        cache = self.engine.cache
        await self._on_engine(
            lambda: self._log.snapshot(cache.page_records(), token, _tier_records(cache), _window_pages(cache))
        )

    def _request(self, token: object) -> None:
        loop = self._loop
        if loop is None:
            return
        task = loop.create_task(self._take_snapshot(token))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("could not take a cache snapshot: %s", task.exception())

    def _drain(self) -> None:
        event_log = self._log
        if event_log is None or self._closed:
            return
        if not self._subs and not self._publishers:
            event_log.discard()
            return
        batch: list[CacheEvent] = []
        for item in event_log.drain():
            if isinstance(item, Snapshot):
                self._close_batch(batch)
                batch = []
                self._snapshot(item)
            elif item == LOST:
                self._close_batch(batch)
                batch = []
                log.warning("cache events dropped (over %d records undrained); readers start over", self.max_pending)
                for sub in self._subs:
                    sub.fall_behind()
                if self._publishers:
                    self._request(self._publisher_token)
            else:
                batch.append(item)
        self._close_batch(batch)

    def _close_batch(self, events: list[CacheEvent]) -> None:
        if not events:
            return
        self.sequence += 1
        now = time.time()
        batch = EventBatch(EVENTS, self.sequence, events, now)
        for sub in list(self._subs):
            sub.offer(batch)
        for publisher in self._publishers:
            try:
                publisher.publish(events, now)
            except Exception:
                log.exception("a cache event publisher failed")

    def _snapshot(self, snap: Snapshot) -> None:
        if snap.token is self._publisher_token:
            for publisher in self._publishers:
                try:
                    publisher.reset(snap.events)
                except Exception:
                    log.exception("a cache event publisher failed")
            return
        for sub in self._subs:
            if sub.token is snap.token:
                sub.active = True
                sub.queue.put_nowait(EventBatch(SNAPSHOT, self.sequence, snap.events, time.time()))
