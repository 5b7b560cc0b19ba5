"""RemoteTier: pages in the fleet's shared store (Mooncake Store), below host memory and disk (`serve --kv-remote`).

A page computed by any worker of one fingerprint is loaded by any other. Object key:
`radixcache/<fingerprint>/ns-<BLAKE2b-64 of the namespace>/<16 hex: the page hash>`: the fingerprint (worker/engine/
fingerprint.py: weights, config, precision, page size, tokenizer) and the chained page hash (tenant and KV dtype
included, radixcache.events) make the name the same in every process, machine and restart, and different for
anything that changes K/V. The object holds the disk store's self-checking page bytes (radixcache.store's
encode_file / decode_file: a length, the page's namespace, tokens and parent hash, a CRC-32), checked on every read:
an object failing the check is removed and counted corrupt, a page of another prefix under the hash is a miss;
nothing unchecked is served. The store itself is inside the operator's trust boundary: the namespace in every key
keeps tenants apart, not the store's access control.

Threads: `put` only queues (bounded; full: dropped, counted); one writer thread joins the store, then writes each
page once per fleet (`exists` first: a page another worker wrote is not written again), what is queued together
in one exists_many and one put_many (up to WRITE_BATCH_PAGES). `get` / `get_many` (a run of pages in one call) run
on the caller's thread (the tier loader, never the engine's). `contains` is memory only: queued, or known to be in
the store (written or read by this worker; a bounded LRU of names, the pages this tier reports in events and
snapshots).
`find` (an admission's lookup, on the engine thread) makes no call at all: while the store is reachable it answers
"maybe" and the loader's `get` finds out, so the request waits for the round trip and the batch never does.

Faults: every call has a deadline (`timeout_s`). A call that fails or overruns marks the store unavailable
(counted): for `retry_s` nothing is asked of it (finds say no, puts are dropped, gets miss) and the worker serves
from its own tiers; then the writer probes it and, once it answers, the tier is back. A master restart empties the
store: what this worker thought was there is then a miss, and is written again when computed again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

from radixcache.object_store import ObjectStore, StoreUnavailable
from radixcache.store import BYTES, Codec, CorruptPage, decode_file, encode_file, namespace_dir
from radixcache.tier import MEDIUM_STORE, PageKey, TierChange, TierStats

log = logging.getLogger("radixcache.remote_tier")

KEY_ROOT = "radixcache"
PROBE_KEY = "radixcache/probe"
WRITE_BATCH_PAGES = 32  # queued pages the writer sends in one exists_many + put_many
_STOP = object()
_WAKE = object()


class RemoteTier:
    """A PageTier over an ObjectStore; see the module docstring. `start()` starts the writer (which joins the
    store); until it has, the tier is unavailable."""

    medium = MEDIUM_STORE

    def __init__(
        self,
        store: ObjectStore,
        fingerprint: str,
        *,
        codec: Codec = BYTES,
        kv_dtype: str | None = None,
        timeout_s: float = 1.0,
        connect_timeout_s: float = 30.0,
        retry_s: float = 5.0,
        queue_pages: int = 256,
        known_pages: int = 1 << 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if queue_pages < 1 or known_pages < 1:
            raise ValueError(f"queue_pages and known_pages must be >= 1, got {queue_pages}, {known_pages}")
        self.store = store
        self.fingerprint = fingerprint
        self.codec = codec
        self.kv_dtype = kv_dtype
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self.known_pages = known_pages
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], tuple[PageKey, Any]] = {}  # queued, readable until written
        self._known: OrderedDict[tuple[str, int], PageKey] = OrderedDict()  # in the store as far as we know
        self._queue: queue.Queue = queue.Queue(queue_pages)
        self._flushes: deque[str] = deque()  # key prefixes to remove from the store (writer thread)
        self._gen: dict[str, int] = {}  # per namespace: bumped by flush, so a write it overtook is not made
        self._gen_all = 0
        self._changes: deque[TierChange] = deque()
        self._stats = TierStats(MEDIUM_STORE, ready=False)
        self._connected = False
        self._joining = False  # start() until the first join answered (joined, or failed)
        self._down_until: float | None = None  # unavailable until then (None: up, once connected)
        self._closed = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> RemoteTier:
        self._joining = True
        self._thread = threading.Thread(target=self._write_loop, name="radixcache-store-writer", daemon=True)
        self._thread.start()
        return self

    @property
    def joining(self) -> bool:
        """Started and its first join has not answered yet (a worker that is warm from its first request waits
        for this; bounded by connect_timeout_s)."""
        return self._joining

    @property
    def available(self) -> bool:
        """Connected, and no call has failed since the last one that answered. After a failure the tier stays
        unavailable until the writer's probe answers: a back-off that merely lapsed proves nothing (a restarted
        master may not have taken this client back yet), and every write made on that guess would be dropped."""
        return self._connected and self._down_until is None

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued for at most `timeout` seconds (the rest is lost), then disconnect. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self._queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:
                if deadline is not None and time.monotonic() >= deadline:
                    self._drop_queued()
        if self._thread is not None:
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.store.close()

    # ---- the page API -----------------------------------------------------------------------------------------
    def object_key(self, namespace: str, page_hash: int) -> str:
        return f"{KEY_ROOT}/{self.fingerprint}/{namespace_dir(namespace)}/{page_hash:016x}"

    def put(self, key: PageKey, payload: Any) -> bool:
        """Queue the page for the store (readable at once); True too when it is known there already. False
        (dropped, counted) when the store is unavailable or the queue is full."""
        name = key.name
        with self._lock:
            if name in self._known or name in self._pending:
                return True
            if self._closed or not self.available:
                self._stats.dropped_pages += 1
                return False
            self._pending[name] = (key, payload)
        try:
            self._queue.put_nowait((key, self._gens(key.namespace)))
        except queue.Full:
            with self._lock:
                self._pending.pop(name, None)
                self._stats.dropped_pages += 1
            return False
        return True

    def contains(self, key: PageKey) -> bool:
        """Queued, or known to be in the store (memory only)."""
        with self._lock:
            return key.name in self._pending or key.name in self._known

    def find(self, key: PageKey) -> bool:
        """`contains`, or "maybe" while the store is reachable (no call: the loader's `get` asks). Past a
        back-off it answers no and has the writer probe at once, so demand brings the tier back soon."""
        if self.contains(key):
            return True
        if self.available:
            return True
        down = self._down_until
        if self._connected and down is not None and self.clock() >= down:
            try:
                self._queue.put_nowait(_WAKE)
            except queue.Full:
                pass  # the writer is busy and probes before its next page
        return False

    def get(self, key: PageKey) -> Any | None:
        """The page's payload, checked (see the module docstring), or None (a miss, or the store unavailable)."""
        return self.get_many([key])[0]

    def get_many(self, keys: list[PageKey]) -> list[Any | None]:
        """`get` of each key up to the first it cannot give, None from there on (a prompt's pages are only of use
        up to its first missing one: those after it are neither checked nor counted). Those not queued here are
        fetched from the store in one call (the loader asks for a run of pages: one round trip, not one per page)."""
        out: list[Any | None] = [None] * len(keys)
        queued: dict[int, Any] = {}  # index -> the payload still queued here for writing
        end = len(keys)  # the run ends before a page queued under its name for another prefix
        for i, key in enumerate(keys):
            with self._lock:
                pending = self._pending.get(key.name)
            if pending is not None and pending[0] != key:
                end = i
                break
            if pending is not None:
                queued[i] = pending[1]
        fetch = {i: self.object_key(keys[i].namespace, keys[i].page_hash) for i in range(end) if i not in queued}
        raws: dict[int, bytes | None] = {}
        if fetch and self.available:
            try:
                raws = dict(zip(fetch, self.store.get_many(list(fetch.values()), self.timeout_s), strict=True))
                self._up()
            except StoreUnavailable as e:
                self._down(e)
        for i, key in enumerate(keys[:end]):  # in order, up to the first page it cannot give
            if i in queued:
                out[i] = self._hit(key, queued[i], learn=False)
            elif i in raws:
                out[i] = self._checked(key, fetch[i], raws[i])
            if out[i] is None:
                return out
        if end < len(keys):
            self._miss()
        return out

    def _checked(self, key: PageKey, object_key: str, raw: bytes | None) -> Any | None:
        """What the store answered for `key`, checked: its payload, or None (a miss; a corrupt object removed)."""
        name = key.name
        if raw is None:
            self._forget(name)
            self._miss()
            return None
        try:
            held, payload = decode_file(raw, key.page_hash, self.kv_dtype)
            if held != key:  # a whole page of another prefix under the same hash: a collision, not corruption
                self._miss()
                return None
            page = self.codec.decode(payload)
        except (CorruptPage, ValueError) as e:  # CorruptPage is a ValueError; so is a payload this build cannot read
            log.warning("corrupt page object %s (%s): removed, treated as a miss", object_key, e)
            self._remove_corrupt(name, object_key)
            self._miss()
            return None
        return self._hit(key, page, learn=True)

    def flush(self, namespace: str | None = None) -> int:
        """Drop `namespace`'s pages (None: every namespace's of this fingerprint) from the store, for the whole
        fleet (in the background, on the writer thread). Returns the pages this tier knew of."""
        with self._lock:
            if namespace is None:
                self._gen_all += 1
                names = list(self._known) + list(self._pending)
                prefix = f"{KEY_ROOT}/{self.fingerprint}/"
            else:
                self._gen[namespace] = self._gen.get(namespace, 0) + 1
                names = [n for n in (*self._known, *self._pending) if n[0] == namespace]
                prefix = f"{KEY_ROOT}/{self.fingerprint}/{namespace_dir(namespace)}/"
            for name in names:
                self._pending.pop(name, None)
                if self._known.pop(name, None) is not None:
                    self._changes.append(TierChange(MEDIUM_STORE, False, *name))
            self._flushes.append(prefix)
        try:
            self._queue.put_nowait(_WAKE)
        except queue.Full:
            pass  # the writer is busy and will see the flush before its next page
        return len(names)

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.pages, s.queued_pages = len(self._known), len(self._pending)
        s.ready = self.available
        return s

    def take_changes(self) -> list[TierChange]:
        out = []
        while self._changes:
            out.append(self._changes.popleft())
        return out

    def records(self) -> Iterator[PageKey]:
        with self._lock:
            return iter(list(self._known.values()))

    def check(self) -> None:
        with self._lock:
            assert len(self._known) <= self.known_pages, f"store tier: {len(self._known)} pages known, over its bound"
            both = self._pending.keys() & self._known.keys()
            assert not both, f"store tier: {len(both)} pages both queued and known, e.g. {next(iter(both))}"
            for name, key in self._known.items():
                assert key.name == name, f"store tier: page {name} filed under another name"

    # ---- internals ------------------------------------------------------------------------------------------
    def _gens(self, namespace: str) -> tuple[int, int]:
        return (self._gen_all, self._gen.get(namespace, 0))

    def _hit(self, key: PageKey, page: Any, *, learn: bool) -> Any:
        with self._lock:
            self._stats.read_hits += 1
            if learn:
                self._learn(key)
        return page

    def _miss(self) -> None:
        with self._lock:
            self._stats.read_misses += 1

    def _learn(self, key: PageKey) -> None:
        """Remember that the store holds `key` (lock held), within known_pages."""
        name = key.name
        if name in self._known:
            self._known.move_to_end(name)
            return
        self._known[name] = key
        self._changes.append(TierChange(MEDIUM_STORE, True, key.namespace, key.page_hash, key))
        while len(self._known) > self.known_pages:
            old, _ = self._known.popitem(last=False)
            self._changes.append(TierChange(MEDIUM_STORE, False, *old))

    def _forget(self, name: tuple[str, int]) -> None:
        with self._lock:
            if self._known.pop(name, None) is not None:
                self._changes.append(TierChange(MEDIUM_STORE, False, *name))

    def _remove_corrupt(self, name: tuple[str, int], object_key: str) -> None:
        self._forget(name)
        with self._lock:
            self._stats.corrupt_pages += 1
        try:
            self.store.remove(object_key, self.timeout_s)
        except StoreUnavailable as e:
            self._down(e)

    def _down(self, error: Exception) -> None:
        with self._lock:
            self._stats.unavailable_errors += 1
            was_up = self._down_until is None
            self._down_until = self.clock() + self.retry_s
        if was_up:
            log.warning("the KV store is unavailable (%s): serving from this worker's own tiers", error)

    def _up(self) -> None:
        if self._down_until is not None:
            with self._lock:
                self._down_until = None
            log.info("the KV store answers again")

    def _drop_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                with self._lock:
                    self._pending.pop(item[0].name, None)
                    self._stats.dropped_pages += 1

    def _join(self) -> bool:
        try:
            return self._connect()
        finally:
            self._joining = False

    def _connect(self) -> bool:
        try:
            self.store.connect(self.connect_timeout_s)
        except StoreUnavailable as e:
            self._down(e)
            return False
        except Exception as e:  # a client that cannot even load: this worker runs without the store
            log.exception("the KV store client could not start")
            self._down(e)
            return False
        self._connected = True
        self._up()
        log.info("joined the KV store (fingerprint %s)", self.fingerprint)
        return True

    def _write_loop(self) -> None:
        while not self._closed and not self._join():
            time.sleep(self.retry_s)
        while True:
            down = self._down_until
            wait = self.retry_s if down is None else min(self.retry_s, max(0.01, down - self.clock()))
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = _WAKE
            if item is _STOP:
                return
            self._run_flushes()
            down = self._down_until
            if down is not None and self._connected and self.clock() >= down:
                self._probe()  # the back-off is over: ask once; only an answer brings the tier back
            if isinstance(item, tuple):
                batch, stop = [item], False
                while len(batch) < WRITE_BATCH_PAGES:  # what else is queued now goes in the same calls
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is _STOP:
                        stop = True
                        break
                    if isinstance(more, tuple):
                        batch.append(more)
                self._write(batch)
                if stop:
                    return

    def _probe(self) -> None:
        try:
            self.store.exists(PROBE_KEY, self.timeout_s)
        except StoreUnavailable as e:
            self._down(e)
        else:
            self._up()

    def _run_flushes(self) -> None:
        while self._flushes:
            prefix = self._flushes[0]
            try:
                self.store.remove_prefix(prefix, self.timeout_s)
            except StoreUnavailable as e:
                self._down(e)
                return  # kept: tried again with the next item
            self._flushes.popleft()

    def _write(self, items: list[tuple[PageKey, tuple[int, int]]]) -> None:
        """Write queued pages once per fleet: one `exists_many` for the lot, one `put_many` for those the store lacks
        (a page another worker wrote is skipped). Pages flushed or superseded while queued are left out; a page
        flushed while it was written is removed again."""
        live: list[tuple[PageKey, tuple[int, int], Any]] = []
        for key, gens in items:
            with self._lock:
                pending = self._pending.get(key.name)
            if pending is not None and pending[0] is key and gens == self._gens(key.namespace):
                live.append((key, gens, pending[1]))
        if not live:
            return
        object_keys = [self.object_key(key.namespace, key.page_hash) for key, _, _ in live]
        done = [False] * len(live)
        skipped = [False] * len(live)
        try:
            if not self.available:
                raise StoreUnavailable("unavailable")
            there = self.store.exists_many(object_keys, self.timeout_s)
            new_keys, datas = [], []
            for j, ((key, _, payload), held) in enumerate(zip(live, there, strict=True)):
                if held:
                    done[j] = skipped[j] = True  # once per fleet: another worker wrote it
                    continue
                try:
                    datas.append(b"".join(encode_file(key, self.codec.encode(payload))))
                except Exception:  # never let one page take the writer (or its batch) down
                    log.exception("encoding page %016x for the store failed", key.page_hash)
                    with self._lock:
                        self._stats.write_errors += 1
                    continue
                new_keys.append(j)
            if new_keys:
                self.store.put_many([object_keys[j] for j in new_keys], datas, self.timeout_s)
            for j in new_keys:
                done[j] = True
            self._up()
        except StoreUnavailable as e:
            if self.available:
                self._down(e)
        undo = []
        with self._lock:
            for j, (key, gens, _) in enumerate(live):
                self._pending.pop(key.name, None)
                overtaken = gens != self._gens(key.namespace)
                if not done[j]:
                    self._stats.dropped_pages += 1
                elif overtaken:
                    if not skipped[j]:
                        undo.append(object_keys[j])  # flushed while we wrote: undo
                else:
                    if skipped[j]:
                        self._stats.skipped_pages += 1
                    else:
                        self._stats.written_pages += 1
                    self._learn(key)
        for object_key in undo:
            try:
                self.store.remove(object_key, self.timeout_s)
            except StoreUnavailable as e:
                self._down(e)
                break
