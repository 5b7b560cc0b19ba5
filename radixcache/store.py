"""DiskStore: pages below memory, one file each under a folder named by the model's fingerprint.

Layout: `<folder>/ns-<16 hex: BLAKE2b-64 of the namespace>/<16 hex: the page hash>.kv`. `folder` is
`DIR/<fingerprint>` (worker/engine/fingerprint.py): every worker of one fingerprint may share it, and nothing outside it is
ever read. One file per page:

    magic "RCKVPG01" | page hash u64 | parent hash u64 (0: none) | namespace length u32 | tokens length u32 |
    payload length u64 | namespace (UTF-8) | tokens (4 B each, big-endian) | payload | CRC-32 of all before, u32

(little-endian integers). A read checks, in order: the length, the magic, the CRC, that the file's own
(parent, namespace, tokens) hash to its name (at the store's kv_dtype, as the cache events hash them), and that
they are the ones asked for. A file failing any check but the last is deleted and counted corrupt; a whole file of
another prefix (a hash collision) is left alone; both are misses. Nothing unchecked is ever returned.

Crash consistency: a page is written to a temporary file in its namespace folder (`.<hash>.<host>.<pid>.<n>.tmp`),
fsynced, then renamed onto its name, so a name always holds a whole file (or the previous one). SIGKILL at any moment
leaves at most one temporary file per writer (removed by the next scan: at once when its process is gone from this
host, else once older than TMP_MAX_AGE_S) and loses the pages still queued. Power loss may also lose renames not yet on disk: those pages are then misses.

Threads: `put` only queues (a bounded queue; a full queue refuses the page, counted as dropped, and the caller drops
it instead of waiting); a queued page stays readable from memory until it is written. One writer thread writes;
`start` rebuilds the index of what earlier runs (or other workers) left in a background scan; `get` runs on the
caller's thread (a loader thread, never the engine's). One in-process lock guards the index, held for dict updates
only, never across I/O. `contains` never touches the file system (the engine thread calls it for every page it
spills); `find` adds one stat for a page the index does not know (an admission's lookup). Workers sharing the folder
take no lock at all: a name is replaced atomically, a page one worker wrote is found by another's `find` and `get`
(and not written again: the writer learns a file that is already there), and a file deleted under a worker's feet
is a miss. Pages one worker has not seen are learned by `get`, by the writer and by the periodic rescan.

Bounded: the files this store knows stay within `capacity_bytes`, evicting its least recently used (by `get` or
`put`; a hit also touches the file's mtime, so other workers and the next start see the same order). A rescan learns
other workers' files, so a shared folder converges on one bound.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import shutil
import socket
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any

from radixcache.events import hash_key_pages, namespace_prefix
from radixcache.tier import MEDIUM_DISK, PageKey, TierChange, TierStats

log = logging.getLogger("radixcache.store")

MAGIC = b"RCKVPG01"
HEADER = struct.Struct("<8sQQIIQ")  # magic, page hash, parent hash, namespace bytes, token bytes, payload bytes
CRC = struct.Struct("<I")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
TRASH_PREFIX = ".trash-"
TMP_MAX_AGE_S = 600.0  # a temporary file this old belongs to no live writer (a write takes milliseconds)
_STOP = object()
_HOST = "".join(c for c in socket.gethostname() if c.isalnum() or c == "-")[:32] or "host"


class CorruptPage(ValueError):
    """A file that is not a whole, self-consistent page (torn, truncated, overwritten, misnamed)."""


@dataclass(frozen=True)
class Codec:
    """How payloads become bytes (on the writer thread) and back (on the reader's)."""

    encode: Callable[[Any], bytes | bytearray | memoryview]
    decode: Callable[[memoryview], Any]


BYTES = Codec(encode=lambda payload: payload, decode=bytes)


def namespace_dir(namespace: str) -> str:
    return "ns-" + blake2b(namespace.encode("utf-8"), digest_size=8).hexdigest()


def encode_file(key: PageKey, payload: bytes | bytearray | memoryview) -> list[bytes | bytearray | memoryview]:
    """The parts of one page file, in order (written with one writev)."""
    ns = key.namespace.encode("utf-8")
    head = HEADER.pack(MAGIC, key.page_hash, key.parent_hash, len(ns), len(key.tokens), len(payload)) + ns + key.tokens
    crc = zlib.crc32(payload, zlib.crc32(head))
    return [head, payload, CRC.pack(crc)]


def decode_file(raw: bytes | memoryview, page_hash: int, kv_dtype: str | None = None) -> tuple[PageKey, memoryview]:
    """(the key the file says it holds, its payload) of a whole file named `page_hash`, whose pages are hashed at
    `kv_dtype` (radixcache.events: a quantized precision is part of the hash); CorruptPage otherwise."""
    view = memoryview(raw)
    if len(view) < HEADER.size + CRC.size:
        raise CorruptPage(f"truncated: {len(view)} bytes")
    magic, h, parent, ns_len, tok_len, pay_len = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptPage("not a page file (bad magic)")
    body = HEADER.size + ns_len + tok_len
    if len(view) != body + pay_len + CRC.size:
        raise CorruptPage(f"{len(view)} bytes, the header says {body + pay_len + CRC.size}")
    (crc,) = CRC.unpack_from(view, body + pay_len)
    if zlib.crc32(view[: body + pay_len]) != crc:
        raise CorruptPage("checksum mismatch")
    ns = bytes(view[HEADER.size : HEADER.size + ns_len]).decode("utf-8", errors="replace")
    tokens = bytes(view[HEADER.size + ns_len : body])
    if (
        h != page_hash
        or not tokens
        or hash_key_pages(tokens, len(tokens), namespace_prefix(ns, kv_dtype), parent) != [h]
    ):
        raise CorruptPage("its contents do not hash to its name")
    return PageKey(ns, h, parent, tokens), view[body : body + pay_len]


def read_header(path: str, page_hash: int, size: int) -> PageKey:
    """The key a file holds, from its header alone (the scan: the CRC is checked on read). CorruptPage if the
    header is not one of a whole page of `size` bytes named `page_hash`."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise CorruptPage("truncated header")
        magic, h, parent, ns_len, tok_len, pay_len = HEADER.unpack(head)
        if magic != MAGIC or h != page_hash or size != HEADER.size + ns_len + tok_len + pay_len + CRC.size:
            raise CorruptPage("bad header")
        rest = f.read(ns_len + tok_len)
    if len(rest) != ns_len + tok_len:
        raise CorruptPage("truncated header")
    return PageKey(rest[:ns_len].decode("utf-8", errors="replace"), h, parent, rest[ns_len:])


@dataclass(slots=True)
class _Entry:
    key: PageKey
    size: int


class DiskStore:
    """A bounded, crash-consistent, shareable page store in one folder. See the module docstring."""

    medium = MEDIUM_DISK

    def __init__(
        self,
        folder: str | Path,
        capacity_bytes: int,
        *,
        codec: Codec = BYTES,
        queue_pages: int = 256,
        fsync: bool = True,
        rescan_s: float = 60.0,
        kv_dtype: str | None = None,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if queue_pages < 1:
            raise ValueError(f"queue_pages must be >= 1, got {queue_pages}")
        self.folder = Path(folder)
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.fsync = fsync
        self.rescan_s = rescan_s
        self.kv_dtype = kv_dtype  # the pages' precision, part of their hashes (the folder holds one precision)
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0  # of the files in the index, plus writes reserved
        self._pending: dict[tuple[str, int], tuple[PageKey, Any]] = {}  # queued, readable until written
        self._queue: queue.Queue = queue.Queue(queue_pages)
        self._gen: dict[str, int] = {}  # per namespace: bumped by flush, so a write it overtook is undone
        self._gen_all = 0
        self._changes: deque[TierChange] = deque()
        self._tmp_ids = itertools.count()
        self._stats = TierStats(MEDIUM_DISK, capacity_bytes=capacity_bytes, ready=False)
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._deadline: float | None = None  # set by close(timeout): the writer drops what it cannot write by then

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> DiskStore:
        """Create the folder, start the writer, and rebuild the index in the background (then rescan every
        rescan_s). Pages written before the scan finishes are readable at once; files already there are found by
        `contains` and `get` meanwhile too (one stat each)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for target, name in ((self._write_loop, "radixcache-disk-writer"), (self._scan_loop, "radixcache-disk-scan")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the start-up scan has finished (the index holds every file that was there)."""
        return self._ready.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued (for at most `timeout` seconds; the rest is lost), then stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = self._deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # the sentinel must get in even when the queue is full: wait for room until the deadline
            try:
                self._queue.put(_STOP, timeout=0.05)
                break
            except queue.Full:
                if deadline is not None and time.monotonic() >= deadline:
                    self._drop_queued()
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # ---- the page API -----------------------------------------------------------------------------------------
    def put(self, key: PageKey, payload: Any) -> bool:
        """Queue `payload` to be written as `key`'s page; readable at once. False (dropped, counted) when the queue
        is full, the store is closed, or the page could never fit. A page already held or queued: True, no write."""
        return self._enqueue(key, payload, block=False)

    def put_wait(self, key: PageKey, payload: Any, timeout: float) -> bool:
        """`put` that waits up to `timeout` seconds for room in the queue (shutdown: saving what memory holds)."""
        return self._enqueue(key, payload, block=True, timeout=timeout)

    def contains(self, key: PageKey) -> bool:
        """Whether the page is queued or indexed (memory only: no system call)."""
        name = key.name
        with self._lock:
            return name in self._pending or name in self._index

    def find(self, key: PageKey) -> bool:
        """`contains`, or a file of that name exists (one stat: another worker's page, or an earlier run's not yet
        scanned). Whether `get(key)` will probably find the page."""
        return self.contains(key) or os.path.exists(self._path(key.namespace, key.page_hash))

    def get(self, key: PageKey) -> Any | None:
        """The page's payload, checked (see the module docstring), or None. Marks it most recently used."""
        name = key.name
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None:
            if pending[0] != key:
                self._miss()
                return None
            with self._lock:
                self._stats.read_hits += 1
            return pending[1]
        path = self._path(key.namespace, key.page_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            self._forget(name)
            self._miss()
            return None
        except OSError as e:
            log.warning("reading %s failed: %s", path, e)
            self._miss()
            return None
        try:
            held, payload = decode_file(raw, key.page_hash, self.kv_dtype)
        except CorruptPage as e:
            log.warning("corrupt page file %s (%s): deleted, treated as a miss", path, e)
            self._delete(name, path, corrupt=True)
            self._miss()
            return None
        if held != key:  # a whole page of another prefix under the same hash: a collision, not corruption
            self._miss()
            return None
        victims = []
        with self._lock:
            self._stats.read_hits += 1
            entry = self._index.get(name)
            if entry is None and name not in self._pending:  # another worker's: it counts towards our bound now
                self._learn(_Entry(held, len(raw)), front=False)
                victims = self._make_room(0)
            elif entry is not None:
                self._index.move_to_end(name)
        self._unlink(victims)
        with contextlib.suppress(OSError):
            os.utime(path)  # the shared LRU order: other workers and the next start read mtimes
        try:
            return self.codec.decode(payload)
        except ValueError as e:  # whole and checksummed, yet not a payload this build reads: never served
            log.warning("page file %s holds no readable page (%s): deleted, treated as a miss", path, e)
            self._delete(name, path, corrupt=True)
            self._miss()
            return None

    def flush(self, namespace: str | None = None) -> int:
        """Drop every page of `namespace` (None: of all namespaces), queued or written, by every worker sharing the
        folder. Returns the pages this store knew of. The files go in the background."""
        with self._lock:
            if namespace is None:
                self._gen_all += 1
                names = list(self._index)
                dropped = [n for n in self._pending]
            else:
                self._gen[namespace] = self._gen.get(namespace, 0) + 1
                names = [n for n in self._index if n[0] == namespace]
                dropped = [n for n in self._pending if n[0] == namespace]
            for name in dropped:
                del self._pending[name]
            for name in names:
                entry = self._index.pop(name)
                self._bytes -= entry.size
                self._changes.append(TierChange(MEDIUM_DISK, False, *name))
        dirs = [namespace_dir(namespace)] if namespace is not None else self._namespace_dirs()
        trash = []
        for d in dirs:
            target = self.folder / f"{TRASH_PREFIX}{os.getpid()}-{next(self._tmp_ids)}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.folder / d, target)
                trash.append(target)
        if trash:
            threading.Thread(target=_remove_all, args=(trash,), name="radixcache-disk-flush", daemon=True).start()
        return len(names) + len(dropped)

    def stats(self) -> TierStats:
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.pages, s.bytes, s.queued_pages = len(self._index), self._bytes, len(self._pending)
        s.ready = self._ready.is_set()
        return s

    def take_changes(self) -> list[TierChange]:
        """What the store started (a write landed, a file was learned) and stopped (evicted, deleted, flushed)
        holding since the last call, in order."""
        out = []
        changes = self._changes
        while changes:
            out.append(changes.popleft())
        return out

    def records(self) -> Iterator[PageKey]:
        """The keys of every page in the index (a copy, least recently used first)."""
        with self._lock:
            keys = [entry.key for entry in self._index.values()]
        return iter(keys)

    def check(self) -> None:
        """Assert the store's invariants: what it counts is what it holds, within its bound, and no page is both
        queued and written."""
        with self._lock:
            total = sum(entry.size for entry in self._index.values())
            assert total <= self._bytes <= self.capacity_bytes, (
                f"disk store: {total} bytes indexed, {self._bytes} counted (with writes in progress), bound "
                f"{self.capacity_bytes}"
            )
            both = self._pending.keys() & self._index.keys()
            assert not both, f"disk store: {len(both)} pages are both queued and written, e.g. {next(iter(both))}"
            for name, entry in self._index.items():
                assert entry.key.name == name, f"disk store: page {name} filed under another name"

    def queued(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._pending)

    def rescan(self) -> int:
        """Learn the files in the folder the index does not know (another worker's, or an earlier run's), remove
        stale temporary files and flushed folders, then enforce the bound. Returns the pages learned."""
        found: list[_Entry] = []
        mtimes: dict[tuple[str, int], float] = {}
        now = time.time()
        with self._lock:
            gens = (self._gen_all, dict(self._gen))
            before = set(self._index)
        try:
            tops = list(os.scandir(self.folder))
        except FileNotFoundError:
            return 0
        for top in tops:
            if top.name.startswith(TRASH_PREFIX):
                _remove_all([Path(top.path)])
            elif top.name.startswith("ns-") and top.is_dir():
                self._scan_dir(top.path, now, found, mtimes)
        found.sort(key=lambda e: mtimes[e.key.name], reverse=True)  # newest first: each goes to the front
        learned = 0
        with self._lock:
            for entry in found:
                ns = entry.key.namespace
                if (self._gen_all, self._gen.get(ns, 0)) != (gens[0], gens[1].get(ns, 0)):
                    continue  # flushed while we scanned
                if entry.key.name not in self._index and entry.key.name not in self._pending:
                    self._learn(entry, front=True)
                    learned += 1
            for name in before - mtimes.keys():  # indexed before the scan, gone now: deleted by another worker
                gone = self._index.pop(name, None)
                if gone is not None:
                    self._bytes -= gone.size
                    self._changes.append(TierChange(MEDIUM_DISK, False, *name))
            victims = self._make_room(0)
        self._unlink(victims)
        return learned

    # ---- internals ------------------------------------------------------------------------------------------
    def _path(self, namespace: str, page_hash: int) -> str:
        return os.path.join(self.folder, namespace_dir(namespace), f"{page_hash:016x}{SUFFIX}")

    def _namespace_dirs(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return [e.name for e in os.scandir(self.folder) if e.name.startswith("ns-")]
        return []

    def _enqueue(self, key: PageKey, payload: Any, *, block: bool, timeout: float = 0.0) -> bool:
        name = key.name
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)  # evicted from memory again: recently used
                return True
            if name in self._pending:
                return True
            if self._closed:
                self._stats.dropped_pages += 1
                return False
            self._pending[name] = (key, payload)
        try:
            self._queue.put((key, self._gens(key.namespace)), block=block, timeout=timeout if block else None)
        except queue.Full:
            with self._lock:
                if self._pending.get(name, (None,))[0] is key:
                    del self._pending[name]
                self._stats.dropped_pages += 1
            return False
        return True

    def _gens(self, namespace: str) -> tuple[int, int]:
        return (self._gen_all, self._gen.get(namespace, 0))

    def _miss(self) -> None:
        with self._lock:
            self._stats.read_misses += 1

    def _learn(self, entry: _Entry, *, front: bool) -> None:
        """Index a file (lock held)."""
        name = entry.key.name
        self._index[name] = entry
        if front:
            self._index.move_to_end(name, last=False)
        self._bytes += entry.size
        self._changes.append(TierChange(MEDIUM_DISK, True, entry.key.namespace, entry.key.page_hash, entry.key))

    def _forget(self, name: tuple[str, int]) -> _Entry | None:
        with self._lock:
            entry = self._index.pop(name, None)
            if entry is not None:
                self._bytes -= entry.size
                self._changes.append(TierChange(MEDIUM_DISK, False, *name))
        return entry

    def _delete(self, name: tuple[str, int], path: str, *, corrupt: bool = False) -> None:
        self._forget(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if corrupt:
            with self._lock:
                self._stats.corrupt_pages += 1

    def _make_room(self, size: int) -> list[tuple[tuple[str, int], int]]:
        """Reserve `size` bytes, evicting LRU entries as needed (lock held); returns the victims to unlink."""
        victims = []
        while self._bytes + size > self.capacity_bytes and self._index:
            name, entry = self._index.popitem(last=False)
            self._bytes -= entry.size
            self._stats.evicted_pages += 1
            self._changes.append(TierChange(MEDIUM_DISK, False, *name))
            victims.append((name, entry.size))
        self._bytes += size
        return victims

    def _unlink(self, victims: list[tuple[tuple[str, int], int]]) -> None:
        for (ns, h), _ in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(ns, h))

    def _drop_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                with self._lock:
                    self._pending.pop(item[0].name, None)
                    self._stats.dropped_pages += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            key, gens = item
            if self._deadline is not None and time.monotonic() >= self._deadline:
                with self._lock:  # closing, and out of time: what is left is lost
                    self._pending.pop(key.name, None)
                    self._stats.dropped_pages += 1
                continue
            try:
                self._write(key, gens)
            except Exception:  # never let one page take the writer down
                log.exception("writing page %016x failed", key.page_hash)
                with self._lock:
                    self._pending.pop(key.name, None)
                    self._stats.write_errors += 1

    def _write(self, key: PageKey, gens: tuple[int, int]) -> None:
        name = key.name
        with self._lock:
            pending = self._pending.get(name)
        if pending is None or pending[0] is not key or gens != self._gens(key.namespace):
            return  # flushed (or superseded) while queued
        parts = encode_file(key, self.codec.encode(pending[1]))
        size = sum(len(p) for p in parts)
        folder = os.path.join(self.folder, namespace_dir(key.namespace))
        final = os.path.join(folder, f"{key.page_hash:016x}{SUFFIX}")
        if self._learn_existing(key, final, gens):
            return
        with self._lock:
            if size > self.capacity_bytes:
                self._pending.pop(name, None)
                self._stats.dropped_pages += 1
                return
            victims = self._make_room(size)
        self._unlink(victims)
        tmp = os.path.join(folder, f".{key.page_hash:016x}.{_HOST}.{os.getpid()}.{next(self._tmp_ids)}{TMP_SUFFIX}")
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                written = os.writev(fd, parts)
                if written != size:
                    raise OSError(f"short write: {written} of {size} bytes")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._bytes -= size
                self._pending.pop(name, None)
                flushed = gens != self._gens(key.namespace)  # its folder went to the trash under us: not an error
                self._stats.write_errors += not flushed
            if not flushed:
                log.warning("could not write page %016x to %s: %s", key.page_hash, folder, e)
            return
        with self._lock:
            self._pending.pop(name, None)
            if gens != self._gens(key.namespace):  # flushed while we wrote: undo
                self._bytes -= size
                undo = True
            else:
                undo = False
                old = self._index.get(name)
                if old is not None:  # learned from another worker's file meanwhile: ours replaced it
                    self._bytes -= old.size
                self._index[name] = _Entry(key, size)
                self._stats.written_pages += 1
                self._changes.append(TierChange(MEDIUM_DISK, True, key.namespace, key.page_hash, key))
        if undo:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)

    def _learn_existing(self, key: PageKey, final: str, gens: tuple[int, int]) -> bool:
        """The page's file is there already, whole as far as its header tells (another worker wrote it, or an
        earlier run): index it instead of writing it again. False when there is none (or only a damaged one)."""
        try:
            size = os.stat(final).st_size
            if read_header(final, key.page_hash, size) != key:
                return False
        except (OSError, ValueError):
            return False
        victims = []
        with self._lock:
            self._pending.pop(key.name, None)
            if gens == self._gens(key.namespace) and key.name not in self._index:
                self._learn(_Entry(key, size), front=False)
                victims = self._make_room(0)
        self._unlink(victims)
        with contextlib.suppress(OSError):
            os.utime(final)
        return True

    def _scan_dir(self, path: str, now: float, found: list[_Entry], mtimes: dict) -> None:
        try:
            files = list(os.scandir(path))
        except FileNotFoundError:
            return
        for f in files:
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            if f.name.endswith(TMP_SUFFIX):
                if now - st.st_mtime > TMP_MAX_AGE_S or _writer_is_gone(f.name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.path)
                continue
            if not f.name.endswith(SUFFIX):
                continue
            try:
                page_hash = int(f.name[: -len(SUFFIX)], 16)
                key = read_header(f.path, page_hash, st.st_size)
            except (ValueError, OSError):  # CorruptPage is a ValueError
                log.warning("removing %s: not a whole page file", f.path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f.path)
                with self._lock:
                    self._stats.corrupt_pages += 1
                continue
            if namespace_dir(key.namespace) != os.path.basename(path):
                continue  # a page of another namespace's folder: never served from here (the read checks it too)
            found.append(_Entry(key, st.st_size))
            mtimes[key.name] = st.st_mtime

    def _scan_loop(self) -> None:
        try:
            self.rescan()
        except Exception:
            log.exception("the disk store's start-up scan failed; its index starts empty")
        finally:
            self._ready.set()
        while not self._stop.wait(self.rescan_s):
            try:
                self.rescan()
            except Exception:
                log.exception("the disk store's rescan failed")


def _writer_is_gone(tmp_name: str) -> bool:
    """A temporary file named by a process of this host that no longer runs (it was killed mid-write)."""
    parts = tmp_name.split(".")  # "", hash, host, pid, n, "tmp"
    if len(parts) != 6 or parts[2] != _HOST or not parts[3].isdigit():
        return False
    try:
        os.kill(int(parts[3]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
