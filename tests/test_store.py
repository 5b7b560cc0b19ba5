"""radixcache.store.DiskStore: each promise of its docstring, on bytes payloads in tmp_path."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from radixcache import store as store_mod
from radixcache.events import page_hashes
from radixcache.keys import encode
from radixcache.store import BYTES, Codec, DiskStore, namespace_dir
from radixcache.tier import PageKey

PAGE = 4


def chain(tokens: list[int], namespace: str = "") -> list[PageKey]:
    """The keys of the whole pages of `tokens`, as the cache names them."""
    hashes = page_hashes(tokens, PAGE, namespace)
    keys, parent = [], 0
    for i, h in enumerate(hashes):
        keys.append(PageKey(namespace, h, parent, encode(tokens[i * PAGE : (i + 1) * PAGE])))
        parent = h
    return keys


def payload(key: PageKey, size: int = 1000) -> bytes:
    return random.Random(key.page_hash).randbytes(size)


def open_store(folder: Path, capacity: int = 1 << 20, **kw) -> DiskStore:
    store = DiskStore(folder, capacity, **kw).start()
    assert store.wait_ready(10)
    return store


def flushed(store: DiskStore, timeout: float = 10.0) -> None:
    """Wait until every queued page is written."""
    deadline = time.monotonic() + timeout
    while store.queued():
        assert time.monotonic() < deadline, "the writer did not drain"
        time.sleep(0.005)


def files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.kv"))


def test_round_trip_queued_then_written(tmp_path: Path) -> None:
    release = threading.Event()

    def slow(data: bytes) -> bytes:
        release.wait(10)
        return data

    store = open_store(tmp_path, codec=Codec(encode=slow, decode=bytes))
    keys = chain(list(range(12)))
    for k in keys:
        assert store.put(k, payload(k))
    for k in keys:  # queued: readable at once, from memory
        assert store.contains(k)
        assert store.get(k) == payload(k)
    assert store.stats().queued_pages == 3
    release.set()
    flushed(store)
    assert len(files(tmp_path)) == 3
    for k in keys:
        assert store.get(k) == payload(k)
    s = store.stats()
    assert (s.pages, s.written_pages, s.read_hits, s.corrupt_pages) == (3, 3, 6, 0)
    store.close()


def test_full_queue_drops_the_page_and_counts_it(tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()

    def slow(data: bytes) -> bytes:
        started.set()
        release.wait(10)
        return data

    store = open_store(tmp_path, queue_pages=2, codec=Codec(encode=slow, decode=bytes))
    keys = chain(list(range(40)))
    results = [store.put(keys[0], payload(keys[0]))]
    assert started.wait(10)
    results += [store.put(k, payload(k)) for k in keys[1:]]
    # the writer holds one page, the queue two more: the rest are refused at once, never waited for
    assert results[:3] == [True] * 3 and not any(results[3:])
    assert store.stats().dropped_pages == len(keys) - 3
    assert not store.contains(keys[-1]) and store.get(keys[-1]) is None
    release.set()
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "misnamed"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    store = open_store(tmp_path)
    a, b = chain(list(range(8)))
    store.put(a, payload(a))
    store.put(b, payload(b))
    flushed(store)
    path_a, path_b = (Path(store._path(k.namespace, k.page_hash)) for k in (a, b))
    raw = path_a.read_bytes()
    if damage == "flip":
        path_a.write_bytes(raw[:200] + bytes([raw[200] ^ 1]) + raw[201:])
    elif damage == "truncate":
        path_a.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        path_a.write_bytes(b"")
    else:  # b's whole, valid file under a's name: its contents do not hash to the name
        path_a.write_bytes(path_b.read_bytes())
    assert store.get(a) is None
    assert not path_a.exists()
    assert store.stats().corrupt_pages == 1
    assert not store.contains(a)
    assert store.get(b) == payload(b)
    store.close()


def test_a_page_of_another_prefix_under_the_same_hash_is_a_miss(tmp_path: Path) -> None:
    """A hash collision: the file is whole and names itself correctly, but holds other tokens than asked for."""
    store = open_store(tmp_path)
    (k,) = chain([5, 6, 7, 8])
    store.put(k, payload(k))
    flushed(store)
    other = PageKey(k.namespace, k.page_hash, k.parent_hash, encode([5, 6, 7, 9]))
    assert store.get(other) is None
    assert store.get(PageKey(k.namespace, k.page_hash, 12345, k.tokens)) is None
    assert store.stats().corrupt_pages == 0 and store.get(k) == payload(k)  # left alone: it is someone's page
    store.close()


def test_tenants_never_read_each_other(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    tokens = list(range(8))
    (a1, a2), (b1, _) = chain(tokens, "alice"), chain(tokens, "bob")
    for k in (a1, a2):
        store.put(k, payload(k))
    flushed(store)
    assert a1.page_hash != b1.page_hash
    assert not store.contains(b1) and store.get(b1) is None
    # even asked under alice's hash, bob's namespace finds nothing: the folder and the header both name the tenant
    assert store.get(PageKey("bob", a1.page_hash, 0, a1.tokens)) is None
    assert {p.parent.name for p in files(tmp_path)} == {namespace_dir("alice")}
    store.close()


def test_the_size_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    keys = chain(list(range(24)))  # 6 pages
    probe = DiskStore(tmp_path / "probe", 1 << 20)
    one = sum(len(p) for p in store_mod.encode_file(keys[0], payload(keys[0])))
    del probe
    store = open_store(tmp_path / "s", capacity=3 * one + one // 2)
    for k in keys[:3]:
        store.put(k, payload(k))
    flushed(store)
    assert store.get(keys[0]) is not None  # keys[0] is now the most recently used
    for k in keys[3:]:
        store.put(k, payload(k))
        flushed(store)
        assert sum(p.stat().st_size for p in files(tmp_path / "s")) <= store.capacity_bytes
        store.check()
    s = store.stats()
    assert s.pages == 3 and s.bytes <= store.capacity_bytes and s.evicted_pages == 3
    assert [k for k in keys if store.contains(k)] == keys[3:]  # keys[0] went last of the first three
    store.close()


def test_a_restart_finds_what_the_last_run_left(tmp_path: Path) -> None:
    first = open_store(tmp_path)
    keys = chain(list(range(16)))
    for k in keys:
        first.put(k, payload(k))
    first.close(timeout=10)
    ns = tmp_path / namespace_dir("")
    (ns / ".0000.1.2.tmp").write_bytes(b"a torn write")
    os.utime(ns / ".0000.1.2.tmp", (0, 0))  # older than any live writer's
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (ns / f".0001.{store_mod._HOST}.{dead.stdout.strip()}.0.tmp").write_bytes(b"killed mid-write")
    (ns / ".0002.another-host.1.0.tmp").write_bytes(b"maybe a live writer elsewhere")
    again = open_store(tmp_path)
    assert again.stats().pages == 4 and {k.page_hash for k in again.records()} == {k.page_hash for k in keys}
    assert all(again.get(k) == payload(k) for k in keys)
    assert [p.name for p in tmp_path.rglob("*.tmp")] == [".0002.another-host.1.0.tmp"]
    changes = again.take_changes()
    assert sum(c.stored for c in changes) == 4
    again.close()


def test_two_workers_share_one_folder(tmp_path: Path) -> None:
    a, b, c = open_store(tmp_path), open_store(tmp_path), open_store(tmp_path)  # each scanned an empty folder
    keys = chain(list(range(12)))
    for k in keys:
        a.put(k, payload(k))
    flushed(a)
    assert not any(b.contains(k) for k in keys)  # b's index does not know them (contains makes no system call)
    assert all(b.find(k) for k in keys)  # one stat each finds them
    assert all(b.get(k) == payload(k) for k in keys)
    assert b.stats().pages == 3 and all(b.contains(k) for k in keys)  # learned by reading
    c.put(keys[0], b"c's own copy")  # c computed the same page itself: a's file is learned, not written again
    flushed(c)
    assert c.contains(keys[0]) and c.stats().written_pages == 0 and c.get(keys[0]) == payload(keys[0])
    a.flush("")  # a flush by one is a flush for all
    assert all(b.get(k) is None for k in keys) and not any(b.find(k) for k in keys)
    c.close()
    a.close()
    b.close()


def test_flush_clears_one_namespace_queued_and_written(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    mine, theirs = chain(list(range(8)), "t1"), chain(list(range(8)), "t2")
    for k in mine + theirs:
        store.put(k, payload(k))
    flushed(store)
    assert store.flush("t1") == 2
    assert not any(store.contains(k) for k in mine) and all(store.get(k) is None for k in mine)
    assert all(store.get(k) == payload(k) for k in theirs)
    store.check()
    store.close()


def test_flush_undoes_a_write_it_overtook(tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()

    def slow(data: bytes) -> bytes:
        started.set()
        release.wait(10)
        return data

    store = open_store(tmp_path, codec=Codec(encode=slow, decode=bytes))
    k, queued = chain([1, 2, 3, 4, 5, 6, 7, 8], "t")
    store.put(k, payload(k))
    assert started.wait(10)  # the writer has the page in hand
    store.put(queued, payload(queued))
    store.flush("t")
    assert store.get(queued) is None and store.get(k) is None  # nothing queued is served after the flush either
    release.set()
    time.sleep(0.2)
    flushed(store)
    assert store.get(k) is None and store.get(queued) is None and not files(tmp_path)
    store.close()


WRITER = textwrap.dedent(
    """
    import random, sys
    from radixcache.store import DiskStore
    sys.path.insert(0, sys.argv[2])
    from test_store import chain, payload
    store = DiskStore(sys.argv[1], 1 << 30, queue_pages=64).start()
    rng = random.Random(int(sys.argv[3]))
    print("ready", flush=True)
    while True:
        tokens = [rng.randrange(1000) for _ in range(16)]
        for k in chain(tokens, "ns"):
            store.put_wait(k, payload(k, 200_000), 10)
    """
)


def test_sigkill_while_writing_never_serves_a_wrong_page(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(folder), str(Path(__file__).parent), str(round_)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.3 + 0.1 * round_)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # What a kill can leave: whole files and temporary ones. Damage one file by hand too, as a disk could.
    written = files(folder)
    assert written, "nothing was written before the kills"
    raw = written[0].read_bytes()
    written[0].write_bytes(raw[:-7])
    store = open_store(folder, capacity=1 << 30)
    served = wrong = 0
    for key in list(store.records()):
        got = store.get(key)
        if got is not None:
            served += 1
            wrong += got != payload(key, 200_000)
    assert wrong == 0 and served >= len(written) - 1
    assert store.stats().corrupt_pages >= 1  # the damaged one was found (by the scan or the read) and removed
    assert not written[0].exists()
    store.close()


def test_close_writes_what_is_queued(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20, codec=BYTES).start()
    keys = chain(list(range(40)))
    for k in keys:
        assert store.put(k, payload(k))
    store.close(timeout=10)
    assert len(files(tmp_path)) == len(keys)


def test_a_whole_file_whose_payload_does_not_parse_is_a_miss(tmp_path: Path) -> None:
    def strict(data: memoryview) -> bytes:
        if bytes(data[:4]) == b"BAD!":
            raise ValueError("not a page this build reads")
        return bytes(data)

    store = open_store(tmp_path, codec=Codec(encode=lambda d: d, decode=strict))
    good, bad = chain(list(range(8)))
    store.put(good, payload(good))
    store.put(bad, b"BAD!" + payload(bad))
    flushed(store)
    assert store.get(bad) is None and store.stats().corrupt_pages == 1 and not store.contains(bad)
    assert store.get(good) == payload(good)
    store.check()
    store.close()
