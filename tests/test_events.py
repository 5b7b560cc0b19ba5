"""Cache events (issue 11), cache level: page hashes are stable and documented, and replaying the events a PrefixCache
reports (snapshot + events) rebuilds exactly the pages its tree holds, after random workloads with evictions,
flushes, pins, preemptions (release mid-sequence) and partial tails."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest
from helpers import FakeClock, tree_index
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from test_cache_stateful import CacheMachine

from radixcache.cache import CacheFullError, PrefixCache
from radixcache.event_log import LOST, EventLog, Snapshot
from radixcache.events import (
    NamespaceCleared,
    PageIndex,
    PagesRemoved,
    PagesStored,
    ReplayError,
    page_hashes,
    records_page_index,
)
from radixcache.keys import encode
from radixcache.tree import RadixTree


def spec_hashes(tokens: list[int], page_size: int, namespace: str) -> list[int]:
    """The README's definition, written out independently of radixcache.events."""
    out, parent = [], 0
    ns = namespace.encode()
    for i in range(len(tokens) // page_size):
        page = b"".join(t.to_bytes(4, "big") for t in tokens[i * page_size : (i + 1) * page_size])
        data = parent.to_bytes(8, "big") + len(ns).to_bytes(4, "big") + ns + page
        h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1 or 1
        out.append(h)
        parent = h
    return out


def test_page_hashes_follow_the_documented_definition() -> None:
    tokens = list(range(1000, 1042))
    assert page_hashes(tokens, 16, "tenant-a") == spec_hashes(tokens, 16, "tenant-a")
    assert len(page_hashes(tokens, 16)) == 2  # the 10 trailing tokens are no page
    assert page_hashes(tokens, 16, "a") != page_hashes(tokens, 16, "b")  # namespaces never share a page
    assert page_hashes(tokens, 16)[1] != page_hashes([0] + tokens[1:], 16)[1]  # a hash names its whole prefix
    assert all(0 < h < 2**63 for h in page_hashes(tokens, 1))  # fits int64 and uint64, never 0 (no parent)
    first, second = page_hashes(tokens[:32], 16, "x")
    assert page_hashes(tokens[16:32], 16, "x", parent=first) == [second]


def test_page_hashes_are_the_same_in_another_process() -> None:
    code = "from radixcache.events import page_hashes; print(page_hashes(list(range(64)), 8, 'ns'))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(page_hashes(list(range(64)), 8, "ns"))


class Replayer:
    """A subscriber: applies what an EventLog drains, checking each stored run's hashes against its token ids."""

    def __init__(self, page_size: int, *, from_start: bool = True) -> None:
        self.page_size = page_size
        self.index = PageIndex(strict=True) if from_start else None
        self.events = 0

    def feed(self, items: list, token: object = None) -> None:
        for item in items:
            assert item != LOST, "the log dropped records"
            if isinstance(item, Snapshot):
                if item.token == token and token is not None:
                    self.index = PageIndex(strict=True)
                    self.index.load(item.events)
                continue
            if self.index is None:
                continue
            if isinstance(item, PagesStored):
                assert len(item.token_ids) == len(item.page_hashes) * self.page_size
                assert page_hashes(item.token_ids, self.page_size, item.namespace, item.parent_hash) == item.page_hashes
            self.index.apply(item)
            self.events += 1


def random_workload(cache: PrefixCache, clock: FakeClock, rng: random.Random, ops: int, checkpoint) -> dict[str, int]:
    """`ops` random cache operations as an engine would issue them; calls checkpoint() every 25. Returns counts."""
    ps = cache.page_size
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(1, 6 * ps))] for _ in range(10)]
    live: list[tuple[object, list[int]]] = []
    done = {"start": 0, "tail": 0, "preempt": 0, "evict": 0, "flush": 0, "pin": 0, "full": 0}
    for i in range(ops):
        op = rng.random()
        if op < 0.3 or not live:
            ns = rng.choice(["", "a", "b"])
            base = rng.choice(prefixes)
            tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(40) for _ in range(rng.randrange(1, 3 * ps))]
            lease = cache.acquire(f"r{i}", tokens, ns, max_cached=len(tokens) - 1)
            try:
                cache.allocate(lease, -(-len(tokens) // ps) - len(lease.pages))
            except CacheFullError:
                cache.release(lease)
                done["full"] += 1
                continue
            live.append((lease, tokens))
            done["start"] += 1
        elif op < 0.45:  # a step: publish the whole pages computed so far (and adopt pages published meanwhile)
            lease, tokens = rng.choice(live)
            cache.extend(lease, tokens[: len(lease.pages) * ps])
            cache.publish(lease, tokens[: rng.randrange(len(tokens) + 1)])
        elif op < 0.6:  # finished: store everything, the partial last page as a tail
            lease, tokens = live.pop(rng.randrange(len(live)))
            cache.release(lease, tokens[: len(tokens) - rng.randrange(2)])
            done["tail"] += 1
        elif op < 0.7:  # preempted or aborted mid-sequence: store what was computed, or nothing
            lease, tokens = live.pop(rng.randrange(len(live)))
            cache.release(lease, tokens[: rng.randrange(len(tokens) + 1)] if rng.random() < 0.7 else None)
            done["preempt"] += 1
        elif op < 0.78:
            ns, base = rng.choice(["", "a", "b"]), rng.choice(prefixes)
            if rng.random() < 0.7:
                cache.pin(base, ns, ttl=rng.choice([None, 1.0, 3.0]))
            else:
                cache.unpin(base, ns)
            done["pin"] += 1
        elif op < 0.86:
            cache.evict(rng.randrange(1, 8))
            done["evict"] += 1
        elif op < 0.9:
            cache.flush(rng.choice(["", "a", "b", None]))
            done["flush"] += 1
        else:
            clock.now += rng.choice([0.5, 1.0, 2.0])  # pins expire
        if i % 25 == 24:
            checkpoint()
    for lease, tokens in live:
        cache.release(lease, tokens)
    checkpoint()
    return done


@pytest.mark.parametrize("page_size", [1, 4])
def test_replay_of_snapshot_and_events_equals_the_tree(page_size: int) -> None:
    clock = FakeClock()
    cache = PrefixCache(40, page_size, clock=clock)
    log = EventLog(page_size, strict=True)
    cache.set_event_sink(log)
    early, late = Replayer(page_size), Replayer(page_size, from_start=False)
    compared = []

    def checkpoint() -> None:
        cache.check()
        if len(compared) == 10:  # a subscriber arriving late starts from a snapshot taken mid-stream
            log.snapshot(cache.tree.page_records(), "late")
        items = log.drain()
        early.feed(items)
        late.feed(items, token="late")
        expected = tree_index(cache.tree)
        assert early.index.as_dict() == expected
        if late.index is not None:
            assert late.index.as_dict() == expected
        compared.append(sum(map(len, expected.values())))

    done = random_workload(cache, clock, random.Random(page_size), 600, checkpoint)
    # The workload did what the test is about, and the cache held pages in several namespaces along the way.
    assert min(done.values()) > 0, done
    assert max(compared) > 15 and late.index is not None and early.events > 100
    cache.flush()
    items = log.drain()
    assert any(isinstance(e, NamespaceCleared) for e in items)
    early.feed(items)
    assert early.index.as_dict() == {} == tree_index(cache.tree)


def test_events_name_what_happened() -> None:
    cache = PrefixCache(16, 4)
    log = EventLog(4, strict=True)
    cache.set_event_sink(log)
    tokens = list(range(10))
    lease = cache.acquire("r1", tokens, "t")
    cache.allocate(lease, 3)
    cache.release(lease, tokens)  # two whole pages and a 2-token tail
    [stored] = log.drain()
    assert stored == PagesStored("t", None, page_hashes(tokens, 4, "t"), tokens[:8])
    longer = tokens + [10, 11, 12]
    lease = cache.acquire("r2", longer, "t", max_cached=12)
    assert lease.copy_from is not None  # it continues the tail
    cache.allocate(lease, 1)
    cache.release(lease, longer)  # its third page covers the tail: a new page, the tail itself was never reported
    [grown] = log.drain()
    assert grown == PagesStored("t", stored.page_hashes[1], page_hashes(longer, 4, "t")[2:], longer[8:12])
    assert cache.evict(1) == 1 and log.drain() == []  # the new 1-token tail goes first: it was never a page
    cache.evict(1)
    assert log.drain() == [PagesRemoved("t", [grown.page_hashes[0]])]
    assert cache.flush("t") == 2
    assert log.drain() == [PagesRemoved("t", stored.page_hashes), NamespaceCleared("t")]
    assert cache.flush("t") == 0 and log.drain() == []  # nothing to clear twice


def test_a_dedup_stores_nothing_and_a_reset_sink_stops_reporting() -> None:
    cache = PrefixCache(16, 2)
    log = EventLog(2, strict=True)
    cache.set_event_sink(log)
    for owner in ("a", "b"):  # the second identical sequence finds everything cached: no event
        lease = cache.acquire(owner, [1, 2, 3, 4], max_cached=0)
        cache.allocate(lease, 2)
        cache.release(lease, [1, 2, 3, 4])
    assert [type(e) for e in log.drain()] == [PagesStored]
    cache.set_event_sink(None)
    cache.flush()
    assert log.drain() == []


def test_a_late_log_is_brought_in_step_by_a_snapshot_and_a_bounded_log_drops_to_lost() -> None:
    cache = PrefixCache(16, 2)
    lease = cache.acquire("a", [1, 2, 3, 4, 5], max_cached=0)
    cache.allocate(lease, 3)
    cache.release(lease, [1, 2, 3, 4, 5])
    log = EventLog(2, strict=True, max_pending=3)
    cache.set_event_sink(log)
    log.snapshot(cache.tree.page_records(), "first")
    [snap] = log.drain()
    index = PageIndex()
    index.load(snap.events)
    assert index.as_dict() == tree_index(cache.tree) and len(index.pages[""]) == 2
    for i in range(5):  # more undrained records than max_pending: the log keeps none of them
        cache.evict(1) if i % 2 else cache.pin([1, 2], "")
        lease = cache.acquire(f"x{i}", [9, i, 9, i], max_cached=0)
        cache.allocate(lease, 2)
        cache.release(lease, [9, i, 9, i])
    assert log.drain() == [LOST]
    cache.evict(1)
    assert log.drain() == []  # out of step: nothing until a snapshot
    log.snapshot(cache.tree.page_records(), "again")
    [snap] = log.drain()
    index.load(snap.events)
    assert index.as_dict() == tree_index(cache.tree)


def test_strict_replay_refuses_events_that_do_not_fit() -> None:
    index = PageIndex()
    with pytest.raises(ReplayError, match="not held"):
        index.apply(PagesRemoved("", [5]))
    index.apply(PagesStored("", None, [7, 8], [1, 2]))
    with pytest.raises(ReplayError, match="twice"):
        index.apply(PagesStored("", 7, [8], [2]))
    with pytest.raises(ReplayError, match="never removed"):
        index.apply(NamespaceCleared(""))


class EventedCacheMachine(CacheMachine):
    """The cache's stateful test, with every step's events replayed and compared with the tree."""

    @invariant()
    def replay_matches_tree(self) -> None:
        if not hasattr(self, "cache"):
            return
        if not hasattr(self, "log"):  # the first check runs before any rule: the tree is still empty
            self.log = EventLog(self.ps, strict=True)
            self.cache.set_event_sink(self.log)
            self.replayer = Replayer(self.ps)
        self.replayer.feed(self.log.drain())
        assert self.replayer.index.as_dict() == tree_index(self.cache.tree)


EventedCacheMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEventedCacheMachine = EventedCacheMachine.TestCase


def test_on_pending_is_called_once_per_drain() -> None:
    calls: list[int] = []
    log = EventLog(2, on_pending=lambda: calls.append(log.pending))
    log.stored("", None, [0], encode([1, 2]))
    log.stored("", 0, [1], encode([3, 4]))
    log.removed([1])
    assert calls == [1]  # the first record schedules a drain; the others join it
    assert len(log.drain()) == 3
    log.cleared("")
    log.removed([0])
    assert calls == [1, 1]  # a record after the drain schedules the next one
    log.discard()
    log.stored("", None, [5], encode([5, 6]))
    assert calls == [1, 1, 1]  # a discard leaves no drain due
    log.removed([0])
    assert log.drain() == []  # and the log out of step: nothing until a snapshot


def test_the_pending_bound_is_exact_on_every_kind_of_record() -> None:
    for extra in (
        lambda log: log.stored("", 1, [2], encode([5, 6])),
        lambda log: log.removed([0]),
        lambda log: log.cleared(""),
    ):
        log = EventLog(2, max_pending=2, strict=True)
        log.stored("", None, [0, 1], encode([1, 2, 3, 4]))
        log.removed([1])
        assert log.pending == 2  # at the bound: kept
        extra(log)
        assert log.pending == 1 and log.drain() == [LOST]  # past it: all dropped


def test_an_event_out_of_step_is_logged_and_the_stream_resumes_at_the_next_snapshot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tree = RadixTree(2)
    tree.insert(encode([1, 2]), [0])
    log = EventLog(2)  # not strict by default: a worker logs and carries on
    log.removed([7])  # a page the log never saw stored
    log.stored("", None, [3], encode([8, 9]))  # ignored: out of step
    log.snapshot(tree.page_records(), "resync")
    with caplog.at_level("ERROR", logger="radixcache.events"):
        out = log.drain()
    assert out[0] == LOST and len(out) == 2 and out[1].token == "resync"
    assert out[1].events == [PagesStored("", None, page_hashes([1, 2], 2), [1, 2])]
    assert "cache events out of step (page 7 unknown); consumers restart from a snapshot" in caplog.text
    log.removed([0])
    assert log.drain() == [PagesRemoved("", page_hashes([1, 2], 2))]  # in step again
    strict = EventLog(2, strict=True)
    strict.removed([7])
    with pytest.raises(KeyError):
        strict.drain()


def test_page_hashes_default_to_the_default_namespace_and_name_a_bad_page_size() -> None:
    assert page_hashes([1, 2, 3, 4], 2) == page_hashes([1, 2, 3, 4], 2, "")
    assert page_hashes([1, 2, 3, 4], 2) != page_hashes([1, 2, 3, 4], 2, "t")
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        page_hashes([1], 0)
    with pytest.raises(ReplayError, match="stored under parent 0x5, which is not held"):
        PageIndex().apply(PagesStored("", 5, [7], [1]))
    with pytest.raises(TypeError, match="not a cache event"):
        PageIndex().apply("stored")


def test_quantized_kv_dtypes_hash_apart_and_full_precision_hashes_are_unchanged() -> None:
    """Full precision (said or not) keeps the documented hashes; every quantized precision gets its own, for every
    page (the tag sits in every page's input, not only the first's), and an EventLog names pages the same way."""
    from radixcache.kv_dtypes import FULL_PRECISION_KV_DTYPES, QUANTIZED_KV_DTYPES

    tokens = list(range(500, 548))
    plain = spec_hashes(tokens, 16, "t")
    for name in (None, *FULL_PRECISION_KV_DTYPES, "float16", "BF16"):
        assert page_hashes(tokens, 16, "t", kv_dtype=name) == plain, name
    seen = set(plain)
    for name in QUANTIZED_KV_DTYPES:
        hashes = page_hashes(tokens, 16, "t", kv_dtype=name)
        assert len(hashes) == 3 and not seen & set(hashes), name
        seen |= set(hashes)
        _, second, third = hashes  # continuing a page of that precision still needs the precision
        assert page_hashes(tokens[32:], 16, "t", parent=second, kv_dtype=name) == [third]
        assert page_hashes(tokens[32:], 16, "t", parent=second) != [third]
        log = EventLog(16, strict=True, kv_dtype=name)
        tree = RadixTree(16)
        tree.set_event_sink(log)
        tree.insert(encode(tokens), [0, 1, 2], "t")
        [stored] = log.drain()
        assert stored.page_hashes == hashes
        parents = dict(zip(hashes, [None, *hashes[:2]], strict=True))
        assert records_page_index(tree.page_records(), 16, kv_dtype=name) == {"t": parents}
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        page_hashes(tokens, 16, kv_dtype="int3")
