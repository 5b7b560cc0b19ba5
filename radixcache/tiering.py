"""TierLink: the prefix cache's link to the tiers below the device pool (host memory, disk, the fleet's store).

Everything here runs on the cache's thread (the engine's) except the loader thread, which only reads tiers.
- Names: the link is the tree's event sink (forwarding everything to the cache's own sink), so it sees every run of
  whole pages the tree stores and names each by its chained page hash (radixcache.events: the hash the cache events
  use, tenant included), its parent's hash and its tokens: a `PageKey`.
- Spill: pages that eviction drops are copied out of the pool (`pool.read_page`, a PageData with its precision's
  scales) and put into the first tier, unless it holds them already (the host tier pushes what it cannot keep down
  to the disk, which skips what it has). Flushed pages are never spilled. With `write_through`, every whole page the
  tree stores (computed) is also copied out for the disk in the step after (`pump`'s time budget grows with what that
  step computed, so a decode step pays ~0.5 ms at most and a prefill's pages go out with the next step; all at once
  when the engine is idle), so a crash loses only what was not written yet; eviction then finds most pages written already.
  The fleet's store (radixcache.remote_tier, `add_remote`) is always written through, within the same budget. None of this makes a
  system call on the cache's thread: the tiers' `contains` is memory only.
- Load: `start_load` looks past the whole pages a prompt hits in memory for the pages that follow in the tiers. If
  there are any, it locks what memory holds (a lease, so nothing it continues is evicted meanwhile) and hands the
  keys to the loader thread, which reads and checks them (`TierChain.get_run`: the store's in runs of 32 pages a
  call) in order up to the first miss. `finish_loads` (each step) allocates fresh pages for what arrived, writes them
  (`pool.write_page`) and publishes them in the tree, then lets the lease go: the request's own lookup then hits them
  like any cached page. A load the pool cannot take whole yet waits (LOAD_ROOM_WAIT_S at most) while running
  requests or other loads hold the pages it needs; otherwise what does not fit is computed. A request whose load is
  in flight waits; the batch does not.
- Demotion (--kv-demote, radixcache.demotion): the tiers hold exact pages only, at the pool's own precision (what a
  recompute gives), so a load writes a page into the pool as it is and another worker sharing the folder never
  reads a lossy page. When the cache demotes a node (`relocated` into the demoted ids), its full-precision pages are
  handed to the tiers first, unless they hold them already (write-through usually did): demotion is an eviction
  from the full-precision pool. A demoted page, and a page promoted back from one (its values are what the
  demotion kept), or one a hit copied slots of such a page into, is never spilled, written through or saved. A load that the cache cannot line up with what memory
  holds (a demoted page on the path that could not be brought back) is not started: those pages are computed.
- Events: what the tiers start and stop holding becomes PagesStored / PagesRemoved with the tier's medium ("CPU",
  "DISK") in the cache's event stream (`pump`, each step); `tier_records` lists it for snapshots.
- Save and restore (warm restart): `save` writes what memory holds to the disk (pinned pages first, then the most
  recently used) and the pins, with their remaining TTL, to a manifest; `restore_pins` loads those first at the next
  start and pins them again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixcache.cache_base import CacheFullError
from radixcache.events import hash_key_pages, namespace_prefix
from radixcache.host_tier import HostTier
from radixcache.keys import TOKEN_BYTES, decode, encode
from radixcache.tier import MEDIUM_HOST, LoadedPage, PageKey, TierChain, TierRecord

if TYPE_CHECKING:
    from radixcache.cache import PrefixCache
    from radixcache.events import EventSink
    from radixcache.lease import Lease
    from radixcache.remote_tier import RemoteTier
    from radixcache.store import DiskStore

log = logging.getLogger("radixcache.tiering")

PINS_FILE = "pins.json"
# Write-through copies per engine step: a base, plus an allowance per token the previous step computed (a prefill's
# pages then go out with the step after it, at a cost below 1% of computing them; a decode step gets ~0.5 ms). A
# 125M model's 16-token page costs ~0.1 ms to copy on the CPU.
STEP_WRITE_BUDGET_S = 0.0005
WRITE_BUDGET_PER_TOKEN_S = 0.00001
IDLE_WRITE_BUDGET_S = 0.02  # per pump while the engine has nothing to step
# A load that arrived while running requests hold the pages it needs waits this long for them to give pages back
# before what does not fit is dropped (and computed instead).
LOAD_ROOM_WAIT_S = 2.0
_STOP = object()


@dataclass(eq=False)
class LoadJob:
    """Pages of one prompt on their way from the tiers into the pool. The engine reads `finished` and the counts."""

    namespace: str
    tokens: list[int]  # the prompt's tokens through the last page to load
    start: int  # whole pages memory held when the load started (locked by `lease`)
    keys: list[PageKey]
    lease: Lease | None
    waiters: int = 1
    payloads: list[LoadedPage] = field(default_factory=list)  # filled by the loader
    done: threading.Event = field(default_factory=threading.Event)  # the loader is through
    cancelled: bool = False  # nobody waits for it any more (its lease is already released)
    stale: bool = False  # its namespace was flushed meanwhile: what it read must not come back
    finished: bool = False  # finish_loads has handled it
    loaded: dict[str, int] = field(default_factory=dict)  # medium -> pages written into the pool
    arrived: float = 0.0  # when the loader was through (TierLink's clock)

    def wanted(self) -> bool:
        """Someone still waits for what it reads, and it may still come back (no flush overtook it)."""
        return not (self.cancelled or self.stale)


@dataclass(slots=True)
class PendingPin:
    """A pin the last shutdown saved (its manifest `entry`), waiting for its pages' load (`job`; None: none ran)."""

    entry: dict
    job: LoadJob | None


@dataclass
class TierLinkStats:
    spilled_pages: int = 0  # pages handed to a tier (evicted, or written through)
    spill_dropped_pages: int = 0  # pages a tier refused (its write queue was full): recomputed if asked again
    loaded_pages: dict[str, int] = field(default_factory=dict)  # medium -> pages loaded back into the pool
    load_jobs: int = 0
    saved_pages: int = 0  # written at shutdown
    restored_pins: int = 0


class TierLink:
    """See the module docstring. `pool`: read_page/write_page; `notify`: called (from the loader thread) when a
    load is ready for finish_loads, to wake an idle engine; `max_load_pages`: the most pages one load brings (default
    the pool: a prompt needs all its pages in the pool to run anyway)."""

    def __init__(
        self,
        pool: Any,
        page_size: int,
        *,
        tiers: TierChain | None = None,
        notify: Callable[[], None] | None = None,
        max_load_pages: int | None = None,
        write_through: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        # part of every page hash (radixcache.events): the names agree with the cache events' hashes
        self.kv_dtype: str | None = getattr(pool, "kv_dtype", None)
        self._exact_ids = int(pool.num_pages)  # ids past it are demoted copies (radixcache.pool)
        self.bpp = page_size * TOKEN_BYTES
        self.tiers = tiers or TierChain()
        self.notify = notify
        self.max_load_pages = max_load_pages or pool.num_pages
        self.write_through = write_through
        # pages stored since, to copy out for the disk (write-through); the tree holds at most num_pages, so older
        # entries past that are stale (a page left out is written when evicted, or at shutdown)
        self._to_write: deque[int] = deque(maxlen=pool.num_pages)
        self.clock = clock
        self.sink: EventSink | None = None  # the cache's own sink (an EventLog), fed through this link
        self.disk: DiskStore | None = None
        self.remote: RemoteTier | None = None
        self.counts = TierLinkStats()
        self._cache: PrefixCache | None = None
        self._names: dict[int, PageKey] = {}  # page id -> its key, for every whole page the tree stores
        self._evicted: dict[int, PageKey] = {}  # removed by the eviction under way, until spill() takes them
        self._lossy: set[int] = set()  # full-precision pages promoted back from demoted copies: never go down
        # pages a lease copied the first slots of a lossy page into (a partial hit): lossy once stored whole. An
        # entry left behind by a page freed unpublished only keeps a later page of that id from spilling (safe).
        self._tainted: set[int] = set()
        self._prefixes: dict[str, bytes] = {}
        self._mirror: dict[tuple[str, str, int], PageKey] = {}  # (medium, ns, hash) the events say a tier holds
        self._jobs: list[LoadJob] = []  # in flight (started, not finished)
        self._done: deque[LoadJob] = deque()
        self._pins: list[PendingPin] = []  # pins to restore once their load is through
        self._pin: Callable[[list[int], str, float | None], int] | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loader = threading.Thread(target=self._load_loop, name="radixcache-tier-loader", daemon=True)
        self._loader.start()

    # ---- wiring ---------------------------------------------------------------------------------------------
    def attach(self, cache: PrefixCache) -> None:
        """Called by PrefixCache: become its tree's event sink."""
        self._cache = cache
        cache.tree.set_event_sink(self)

    def add_disk(self, store: DiskStore) -> None:
        """Put `store` below the tiers there are (the host tier's evictions go to it). Call on the cache's thread."""
        for tier in self.tiers.tiers:
            if isinstance(tier, HostTier) and tier.lower is None:
                tier.lower = store
        tiers = self.tiers.tiers
        tiers.insert(tiers.index(self.remote) if self.remote is not None else len(tiers), store)  # above the store
        self.disk = store
        if self.write_through:  # what the tree stored before the disk opened is written through too
            self._to_write.extend(self._names)

    def add_remote(self, store: RemoteTier) -> None:
        """Put the fleet's shared store below every other tier. Computed pages are always written through to it
        (once per fleet: it skips what the fleet has). Call on the cache's thread."""
        self.tiers.tiers.append(store)
        self.remote = store
        self._to_write.extend(self._names)

    @property
    def active(self) -> bool:
        return bool(self.tiers.tiers)

    # ---- the tree's sink (names pages, forwards) ---------------------------------------------------------
    def stored(self, namespace: str, after: int | None, pages: list[int], key: bytes) -> None:
        bpp = self.bpp
        whole = len(key) // bpp
        if whole:
            parent = 0
            if after is not None:
                known = self._names.get(after)
                parent = known.page_hash if known is not None else -1
            if parent >= 0:
                prefix = self._prefix(namespace)
                hashes = hash_key_pages(key[: whole * bpp], bpp, prefix, parent)
                for i, (page, h) in enumerate(zip(pages, hashes, strict=False)):
                    self._names[page] = PageKey(namespace, h, parent, key[i * bpp : (i + 1) * bpp])
                    parent = h
                    if page in self._tainted:
                        self._tainted.discard(page)
                        self._lossy.add(page)
                if (self.write_through and self.disk is not None) or self.remote is not None:
                    self._to_write.extend(pages[:whole])
        if self.sink is not None:
            self.sink.stored(namespace, after, pages, key)

    def removed(self, pages: list[int]) -> None:
        names, evicted, lossy = self._names, self._evicted, self._lossy
        for page in pages:
            key = names.pop(page, None)
            if key is not None and page not in lossy:  # a lossy page is never spilled
                evicted[page] = key
        if lossy:
            lossy.difference_update(pages)
        if self.sink is not None:
            self.sink.removed(pages)

    def cleared(self, namespace: str) -> None:
        if self.sink is not None:
            self.sink.cleared(namespace)

    def relocated(self, old: list[int], new: list[int]) -> None:
        """The cache demoted pages `old` into `new` (or promoted them back): the names move with them. A demotion
        first hands the full-precision pages (`old` still holds them) to the tiers; a promotion's pages are lossy."""
        names, lossy = self._names, self._lossy
        demotion = bool(new) and new[0] >= self._exact_ids
        tiers = self.tiers
        for src, dst in zip(old, new, strict=True):
            key = names.pop(src, None)
            was_lossy = src in lossy
            lossy.discard(src)
            if key is None:  # a partial tail: never named, never goes down
                continue
            names[dst] = key
            if demotion:
                if tiers.tiers and not was_lossy and not tiers.contains(key):
                    self._count_put(tiers.put(key, self.pool.read_page(src)))
            else:
                lossy.add(dst)
        if self.sink is not None:
            self.sink.relocated(old, new)

    def copying(self, src: int, dst: int) -> None:
        """The cache copies the first slots of page `src` into a lease's page `dst` (a hit ending inside a page):
        slots of a lossy page make `dst` lossy too."""
        if src in self._lossy or src in self._tainted:
            self._tainted.add(dst)
        else:
            self._tainted.discard(dst)

    def _prefix(self, namespace: str) -> bytes:
        prefix = self._prefixes.get(namespace)
        if prefix is None:
            prefix = self._prefixes[namespace] = namespace_prefix(namespace, self.kv_dtype)
        return prefix

    def _exact(self, page: int) -> bool:
        """The page holds what a recompute gives at the pool's precision (not demoted, not promoted back)."""
        return page < self._exact_ids and page not in self._lossy

    # ---- spill ----------------------------------------------------------------------------------------------
    def spill(self, freed: list[int]) -> None:
        """Eviction dropped `freed` (their data still in the pool): hand the whole pages to the first tier."""
        evicted, tiers = self._evicted, self.tiers.tiers
        if tiers:
            first = tiers[0]  # the host tier, when there is one: faster to load from than the disk holding it too
            for page in freed:
                key = evicted.get(page)
                if key is None or page >= self._exact_ids or first.contains(key):  # (lossy ones: not listed)
                    continue
                self._count_put(first.put(key, self.pool.read_page(page)))
        evicted.clear()

    def _count_put(self, accepted: bool) -> None:
        if accepted:
            self.counts.spilled_pages += 1
        else:
            self.counts.spill_dropped_pages += 1

    def discard(self) -> None:
        """A flush dropped pages: nothing of them is spilled."""
        self._evicted.clear()

    def flush(self, namespace: str | None) -> int:
        """Drop `namespace`'s pages (None: every namespace's) from every tier; loads of it bring nothing back."""
        for job in self._jobs:
            if namespace is None or job.namespace == namespace:
                job.stale = True
        return self.tiers.flush(namespace)

    # ---- load -------------------------------------------------------------------------------------------
    def start_load(self, owner: str, tokens: list[int], namespace: str, max_tokens: int) -> LoadJob | None:
        """If the whole pages of tokens[:max_tokens] continue, past what memory holds, into pages a tier holds,
        start loading those (or join a load of them already under way) and return the job; else None."""
        cache = self._cache
        if cache is None or not self.tiers.tiers:
            return None
        bpp, ps = self.bpp, self.page_size
        total = min(len(tokens), max_tokens) // ps
        if total == 0:
            return None
        key = encode(tokens[: total * ps])
        memory = cache.tree.match(key, namespace, touch=False).pages
        held = len(memory)
        if held >= total:
            return None
        parent = 0
        if held:
            known = self._names.get(memory[-1])
            if known is None:
                return None
            parent = known.page_hash
        prefix = self._prefix(namespace)
        keys: list[PageKey] = []
        for i in range(held, min(total, held + self.max_load_pages)):
            page = key[i * bpp : (i + 1) * bpp]
            (h,) = hash_key_pages(page, bpp, prefix, parent)
            k = PageKey(namespace, h, parent, page)
            if not keys:
                for job in self._jobs:  # the same page on its way already: wait for that load
                    if not job.cancelled and not job.stale and job.keys[0].name == k.name:
                        job.waiters += 1
                        return job
            if not self.tiers.find(k):  # one stat at most: the walk stops at the first page no tier has
                break
            keys.append(k)
            parent = h
        if not keys:
            return None
        lease = cache.acquire(f"{owner}:tier-load", tokens, namespace, max_cached=held * ps, count=False)
        if len(lease.pages) != held:  # a demoted page on the way could not be brought back: the keys do not follow
            cache.release(lease)
            return None
        job = LoadJob(namespace, list(tokens[: (held + len(keys)) * ps]), len(lease.pages), keys, lease)
        self._jobs.append(job)
        self.counts.load_jobs += 1
        self._queue.put(job)
        return job

    def cancel(self, job: LoadJob) -> None:
        """One waiter gave up (its request ended). The last one lets the lease go; what arrives is dropped."""
        job.waiters -= 1
        if job.waiters <= 0 and not job.finished and not job.cancelled:
            job.cancelled = True
            if job.lease is not None and self._cache is not None:
                self._cache.release(job.lease)

    def has_completions(self) -> bool:
        return bool(self._done)

    def wait(self, timeout: float) -> bool:
        """Block until a load is ready (or timeout): for callers that drive the engine themselves."""
        deadline = time.monotonic() + timeout
        while not self._done and time.monotonic() < deadline:
            jobs = [job for job in self._jobs if not job.done.is_set()]
            if not jobs:
                break
            jobs[0].done.wait(max(0.0, min(0.01, deadline - time.monotonic())))
        return bool(self._done)

    def finish_loads(self, room_coming: bool = False) -> int:
        """Write the loads that arrived into the pool and the tree (cache's thread). Returns pages loaded. A load
        that does not fit the pool's free and evictable pages brings what fits, the rest is computed; but while
        pages it needs will come back (`room_coming`: requests are running; or other loads hold leases, which they
        let go when they finish) it waits for them, whole, up to LOAD_ROOM_WAIT_S after it arrived. The loads
        that finish free what they held: those waiting are tried again in the same call."""
        pending: list[LoadJob] = []
        while self._done:  # the loader thread appends on the right meanwhile: take what is there now
            pending.append(self._done.popleft())
        total, waiting = 0, pending
        while pending:
            waiting = [job for job in pending if self._waits_for_room(job, room_coming)]
            finished = [job for job in pending if job not in waiting]
            for job in finished:
                total += self._finish(job)
            if not finished:
                break
            pending = waiting
        self._done.extendleft(reversed(waiting))
        if self._pins:
            self._restore_ready_pins()
        return total

    def _waits_for_room(self, job: LoadJob, room_coming: bool) -> bool:
        cache = self._cache
        if not job.wanted() or cache is None or len(job.payloads) <= cache.available_pages():
            return False
        if self.clock() - job.arrived >= LOAD_ROOM_WAIT_S:
            return False
        return room_coming or self.loads_holding(besides=job)

    def loads_holding(self, besides: LoadJob | None = None) -> bool:
        """A load other than `besides` is under way (or waiting for room) and its lease locks the prefix it extends:
        pages it lets go when it finishes, within its tiers' deadlines."""
        return any(
            other is not besides and not other.finished and other.lease is not None and not other.lease.released
            for other in self._jobs
        )

    def _finish(self, job: LoadJob) -> int:
        """Write one arrived load into the pool and the tree (what fits now), release its lease; pages loaded."""
        cache, total = self._cache, 0
        with contextlib.suppress(ValueError):
            self._jobs.remove(job)
        if job.cancelled:
            job.finished = True
            return 0
        payloads, job.payloads = job.payloads, []
        lease = job.lease
        try:
            if payloads and not job.stale and cache is not None and lease is not None:
                del payloads[cache.available_pages() :]  # what fits now; the rest is computed
                try:
                    pages = cache.allocate(lease, len(payloads))
                except CacheFullError:
                    payloads = []
                else:
                    for page, loaded in zip(pages, payloads, strict=True):
                        self.pool.write_page(page, loaded.payload)
                        job.loaded[loaded.medium] = job.loaded.get(loaded.medium, 0) + 1
                    cache.publish(lease, job.tokens[: (job.start + len(payloads)) * self.page_size])
                    total = len(payloads)
        except Exception:
            log.exception("loading %d pages from the tiers failed; they will be computed", len(payloads))
            job.loaded.clear()
        finally:
            if lease is not None and cache is not None:
                cache.release(lease)
            job.finished = True
        for medium, n in job.loaded.items():
            self.counts.loaded_pages[medium] = self.counts.loaded_pages.get(medium, 0) + n
        return total

    def _load_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                for got in self.tiers.get_run(job.keys, job.wanted):
                    job.payloads.append(got)
            except Exception:
                log.exception("reading pages from the tiers failed")
            finally:
                job.arrived = self.clock()
                self._done.append(job)
                job.done.set()
                if self.notify is not None:
                    self.notify()

    # ---- events ---------------------------------------------------------------------------------------------
    def pump(self, budget_s: float = STEP_WRITE_BUDGET_S, room_coming: bool = False) -> None:
        """Finish arrived loads (finish_loads, `room_coming` as there), copy out pages to write through for up to
        `budget_s` seconds (at least one page when > 0), and turn the tiers' changes into cache events (cache's
        thread, each step)."""
        if self._done:
            self.finish_loads(room_coming)
        if self._to_write and budget_s > 0:
            self._write_through(budget_s)
        changes = self.tiers.take_changes()
        if not changes:
            return
        mirror, sink = self._mirror, self.sink
        tier_stored = getattr(sink, "tier_stored", None)
        tier_removed = getattr(sink, "tier_removed", None)
        for c in changes:
            name = (c.medium, c.namespace, c.page_hash)
            if c.stored:
                if name in mirror or c.key is None:
                    continue
                mirror[name] = c.key
                if tier_stored is not None:
                    tier_stored(c.medium, c.key)
            elif mirror.pop(name, None) is not None and tier_removed is not None:
                tier_removed(c.medium, c.namespace, c.page_hash)

    def _write_through(self, budget_s: float) -> None:
        todo = self._to_write
        targets: list[DiskStore | RemoteTier] = [self.disk] if self.write_through and self.disk is not None else []
        if self.remote is not None:
            targets.append(self.remote)
        if not targets:
            todo.clear()
            return
        deadline = time.perf_counter() + budget_s
        while todo:
            page = todo.popleft()
            key = self._names.get(page)  # None: evicted meanwhile (the spill took it), or flushed
            if key is None or not self._exact(page):
                continue
            payload = None
            for target in targets:
                if not target.contains(key):
                    payload = payload if payload is not None else self.pool.read_page(page)
                    self._count_put(target.put(key, payload))
            if payload is not None and time.perf_counter() >= deadline:
                return

    @property
    def unwritten(self) -> int:
        """Pages stored in the tree and still to be copied out for writing through."""
        return len(self._to_write)

    def tier_records(self) -> list[TierRecord]:
        """Every page the event stream says a tier holds (a snapshot's tier part)."""
        return [TierRecord(name[0], key) for name, key in self._mirror.items()]

    # ---- save / restore -------------------------------------------------------------------------------------
    def save(self, deadline: float) -> int:
        """Write to the disk what memory holds and the disk lacks: pinned pages first, then the most recently used,
        then the host tier's, until `deadline` (time.monotonic()); then the pins manifest. Call once nothing runs
        (the engine thread has stopped). Returns the pages queued for writing."""
        disk, cache = self.disk, self._cache
        if disk is None or cache is None:
            return 0
        tree = cache.tree
        order = []
        for node in tree.nodes():
            if node.parent is None:
                continue
            pinned = node.pin_until is not None
            for page in node.pages:
                key = self._names.get(page)
                if key is not None and self._exact(page):
                    order.append((not pinned, -node.access, page, key))
        order.sort(key=lambda item: item[:2])
        queued = 0
        for _, _, page, key in order:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not disk.contains(key) and disk.put_wait(key, self.pool.read_page(page), left):
                queued += 1
        host = self.tiers.by_medium(MEDIUM_HOST)
        for key, payload in host.items() if isinstance(host, HostTier) else ():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not disk.contains(key) and disk.put_wait(key, payload, left):
                queued += 1
        self._write_pins(disk, tree)
        self.counts.saved_pages += queued
        return queued

    def _write_pins(self, disk: DiskStore, tree: Any) -> None:
        now_mono, now_wall = tree.clock(), time.time()
        pins = [
            {
                "namespace": pin.namespace,
                "tokens": decode(pin.key),
                "expires_at": None if pin.until == math.inf else now_wall + (pin.until - now_mono),
            }
            for pin in tree.pins()
        ]
        write_json(disk.folder / PINS_FILE, {"version": 1, "pins": pins})

    def restore_pins(self, pin: Callable[[list[int], str, float | None], int]) -> int:
        """Load the pins the last shutdown saved (from the disk's manifest), before anything else, and pin each
        again with what is left of its TTL through `pin(tokens, namespace, ttl)` once its pages are in memory.
        Cache's thread. Returns the pins found."""
        if self.disk is None:
            return 0
        try:
            manifest = json.loads((self.disk.folder / PINS_FILE).read_text())
            pins = [p for p in manifest["pins"] if isinstance(p, dict)]
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the pins manifest in %s: %s", self.disk.folder, e)
            return 0
        self._pin = pin
        for entry in pins:
            tokens, ns = entry.get("tokens"), entry.get("namespace")
            if not isinstance(tokens, list) or not isinstance(ns, str):
                continue
            job = self.start_load("pin-restore", tokens, ns, len(tokens))
            self._pins.append(PendingPin(entry, job))
        self._restore_ready_pins()
        return len(pins)

    @property
    def restoring(self) -> bool:
        """Saved pins are still on their way into memory."""
        return bool(self._pins)

    def _restore_ready_pins(self) -> None:
        waiting = []
        for pending in self._pins:
            entry, job = pending.entry, pending.job
            if job is not None and not job.finished:
                waiting.append(pending)
                continue
            expires = entry.get("expires_at")
            ttl = None if expires is None else expires - time.time()
            if ttl is not None and ttl <= 0:
                continue
            try:
                if self._pin is not None and self._pin(entry["tokens"], entry["namespace"], ttl):
                    self.counts.restored_pins += 1
            except Exception as e:  # a pin past the budget now: the pages stay cached, unpinned
                log.warning("could not restore a pin of %d tokens: %s", len(entry["tokens"]), e)
        self._pins = waiting

    # ---- checks, stats, shutdown ------------------------------------------------------------------------------
    def check(self) -> None:
        """Every whole page the tree stores is named once, by the hash its path gives; nothing half-evicted is left
        over; every tier's own invariants hold (a page is written or queued, never both; within each bound)."""
        from radixcache.events import records_page_index

        cache = self._cache
        assert cache is not None, "the tier link is not attached to a cache"
        assert not self._evicted, f"{len(self._evicted)} evicted pages were neither spilled nor discarded"
        expected = records_page_index(cache.tree.page_records(), self.page_size, kv_dtype=self.kv_dtype)
        named: dict[str, dict[int, int | None]] = {}
        for key in self._names.values():
            named.setdefault(key.namespace, {})[key.page_hash] = key.parent_hash or None
        whole = sum(len(v) for v in expected.values())
        assert len(self._names) == whole, f"{len(self._names)} pages named, the tree stores {whole} whole pages"
        assert named == expected, "a page's name (hash, parent) differs from what its path in the tree gives"
        assert all(p in self._names and p < self._exact_ids for p in self._lossy), "a lossy page is not a named one"
        for job in self._jobs:
            assert job.lease is None or job.cancelled or not job.lease.released, "a load in flight lost its lease"
        for tier in self.tiers.tiers:
            check = getattr(tier, "check", None)
            if check is not None:
                check()

    def close(self, timeout: float | None = None) -> None:
        """Stop the loader and close the tiers (the disk writes what is queued within `timeout`)."""
        self._queue.put(_STOP)
        self.tiers.close(timeout)


def write_json(path: Any, data: object) -> None:
    """Replace `path` with `data` as JSON atomically (temporary file, fsync, rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
