"""The fleet's shared KV store (radixcache.remote_tier, `serve --kv-remote`).

Unit part: the tier's logic over an in-memory ObjectStore (keys, once per fleet, the page check, faults), and the
Mooncake client's deadlines. End-to-end part (e2e): a real `mooncake_master` and `mooncake_store_service` on free
loopback ports, started once for the module, with real engines as the workers: a page one worker computed is loaded
by another with the output of a recompute; another tenant or fingerprint reads nothing; a corrupted object is a
miss; the master killed mid-run fails no request. The store client is never faked there.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from hashlib import blake2b
from pathlib import Path

import pytest

from radixcache.cluster.store_processes import LocalStore
from radixcache.events import hash_key_pages, namespace_prefix
from radixcache.keys import encode
from radixcache.object_store import StoreAddress, StoreUnavailable, parse_store_url
from radixcache.remote_tier import RemoteTier
from radixcache.store import encode_file
from radixcache.tier import PageKey

PAGE = 4


# ---- unit: the tier's logic over a fake store -------------------------------------------------------------------
class FakeStore:
    """An ObjectStore in memory. `down`: every call raises StoreUnavailable (a dead master)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False
        self.puts = 0
        self.batches: list[int] = []  # the size of each get_many call
        self.put_batches: list[int] = []  # the size of each put_many call
        self.gate = threading.Event()  # cleared: the writer waits in exists_many (a slow store)
        self.gate.set()
        self.asked = threading.Event()  # set by each exists_many call
        self.lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("down")

    def connect(self, timeout: float) -> None:
        self._check()

    def get(self, key: str, timeout: float) -> bytes | None:
        self._check()
        return self.objects.get(key)

    def get_many(self, keys: list[str], timeout: float) -> list[bytes | None]:
        self._check()
        self.batches.append(len(keys))
        return [self.objects.get(key) for key in keys]

    def put(self, key: str, data: bytes, timeout: float) -> None:
        self._check()
        with self.lock:
            self.puts += 1
            self.objects.setdefault(key, data)  # as Mooncake: an existing object keeps its value

    def exists(self, key: str, timeout: float) -> bool:
        self._check()
        return key in self.objects

    def exists_many(self, keys: list[str], timeout: float) -> list[bool]:
        self.asked.set()
        self.gate.wait(10)
        return [self.exists(key, timeout) for key in keys]

    def put_many(self, keys: list[str], datas: list[bytes], timeout: float) -> None:
        self._check()
        self.put_batches.append(len(keys))
        for key, data in zip(keys, datas, strict=True):
            self.put(key, data, timeout)

    def remove(self, key: str, timeout: float) -> None:
        self._check()
        self.objects.pop(key, None)

    def remove_prefix(self, prefix: str, timeout: float) -> None:
        self._check()
        for key in [k for k in self.objects if k.startswith(prefix)]:
            del self.objects[key]

    def close(self) -> None:
        pass


def page_keys(tokens: list[int], namespace: str = "", kv_dtype: str | None = None) -> list[PageKey]:
    raw = encode(tokens)
    bpp = PAGE * 4
    hashes = hash_key_pages(raw, bpp, namespace_prefix(namespace, kv_dtype), 0)
    parents = [0, *hashes[:-1]]
    return [
        PageKey(namespace, h, p, raw[i * bpp : (i + 1) * bpp])
        for i, (h, p) in enumerate(zip(hashes, parents, strict=True))
    ]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def tier_on(store: FakeStore, fingerprint: str = "kv-a", **kw) -> RemoteTier:
    tier = RemoteTier(store, fingerprint, **kw).start()
    wait_for(lambda: tier.available)
    return tier


def written(tier: RemoteTier) -> None:
    wait_for(lambda: tier.stats().queued_pages == 0)


def test_keys_name_fingerprint_namespace_and_page_hash_the_same_in_every_process() -> None:
    key = page_keys([5, 6, 7, 8], "alice")[0]
    tier = RemoteTier(FakeStore(), "kv-0123")
    ns = blake2b(b"alice", digest_size=8).hexdigest()
    assert tier.object_key(key.namespace, key.page_hash) == f"radixcache/kv-0123/ns-{ns}/{key.page_hash:016x}"
    code = (
        "from radixcache.events import hash_key_pages, namespace_prefix; from radixcache.keys import encode;"
        "from radixcache.remote_tier import RemoteTier;"
        "h = hash_key_pages(encode([5, 6, 7, 8]), 16, namespace_prefix('alice', None), 0)[0];"
        "print(RemoteTier(None, 'kv-0123').object_key('alice', h))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "12345"}, capture_output=True, text=True
    )
    assert other.stdout.strip() == tier.object_key(key.namespace, key.page_hash), other.stderr


def test_a_page_is_written_once_per_fleet_and_read_back_checked() -> None:
    store = FakeStore()
    a, b = tier_on(store), tier_on(store)
    keys = page_keys(list(range(10, 18)))
    for key in keys:
        assert a.put(key, b"payload-" + key.tokens)
    written(a)
    assert a.stats().written_pages == 2 and store.puts == 2
    for key in keys:  # b computed the same pages: the fleet has them, nothing is written again
        b.put(key, b"payload-" + key.tokens)
    written(b)
    assert store.puts == 2 and b.stats().skipped_pages == 2 and b.stats().written_pages == 0
    fresh = tier_on(store)
    assert [fresh.get(key) for key in keys] == [b"payload-" + key.tokens for key in keys]
    assert fresh.stats().read_hits == 2
    for tier in (a, b, fresh):
        tier.check()
        tier.close(1)


def test_another_tenant_or_fingerprint_reads_nothing() -> None:
    store = FakeStore()
    writer = tier_on(store, "kv-a")
    alice = page_keys([1, 2, 3, 4], "alice")[0]
    writer.put(alice, b"alice's")
    written(writer)
    bob = page_keys([1, 2, 3, 4], "bob")[0]
    assert bob.page_hash != alice.page_hash
    assert writer.get(bob) is None
    assert tier_on(store, "kv-b").get(alice) is None  # another model's pages are other keys
    assert tier_on(store, "kv-a").get(alice) == b"alice's"


def test_a_corrupted_or_misplaced_object_is_a_miss_counted_and_removed() -> None:
    store = FakeStore()
    writer = tier_on(store)
    first, second = page_keys(list(range(20, 28)))
    writer.put(first, b"x" * 64)
    writer.put(second, b"y" * 64)
    written(writer)
    name = writer.object_key(first.namespace, first.page_hash)
    raw = bytearray(store.objects[name])
    raw[-10] ^= 0xFF  # a flipped bit in the payload: the checksum fails
    store.objects[name] = bytes(raw)
    reader = tier_on(store)
    assert reader.get(first) is None
    assert reader.stats().corrupt_pages == 1 and name not in store.objects
    # a whole, checked page of another prefix stored under `second`'s name is a miss, never served
    other = page_keys(list(range(30, 38)))[1]
    store.objects[writer.object_key(second.namespace, second.page_hash)] = b"".join(encode_file(other, b"z" * 64))
    assert reader.get(second) is None and reader.stats().corrupt_pages == 2
    assert reader.stats().read_hits == 0


def test_an_unavailable_store_is_counted_left_alone_and_rejoined() -> None:
    now = [0.0]
    store = FakeStore()
    tier = tier_on(store, retry_s=5.0, clock=lambda: now[0])
    key = page_keys([9, 9, 9, 9])[0]
    store.down = True
    assert tier.get(key) is None
    assert tier.stats().unavailable_errors == 1 and not tier.stats().ready
    assert not tier.find(key)  # while it backs off, lookups do not even ask
    assert not tier.put(key, b"p") and tier.stats().dropped_pages == 1
    assert tier.get(key) is None and tier.stats().unavailable_errors == 1  # nothing asked during the back-off
    now[0] = 6.0  # past the back-off, the store still down: the lapse alone brings nothing back
    assert not tier.find(key)  # (and asks the writer to probe)
    wait_for(lambda: tier.stats().unavailable_errors == 2)
    assert not tier.available and not tier.put(key, b"p")
    store.down = False
    now[0] = 12.0
    assert not tier.find(key)  # past the second back-off: the probe answers, then the tier is back
    wait_for(lambda: tier.available)
    assert tier.find(key) and tier.put(key, b"p")
    written(tier)
    assert tier.stats().ready and tier.get(key) == b"p"


def test_the_mooncake_client_gives_every_call_a_deadline() -> None:
    from radixcache.mooncake_store import MAX_STUCK, MooncakeObjectStore

    client = MooncakeObjectStore(StoreAddress("mooncake", "127.0.0.1", 1), "http://127.0.0.1:1/metadata")
    release = threading.Event()
    for _ in range(MAX_STUCK):
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer"):
            client._call(release.wait, 0.05)
        assert time.monotonic() - started < 1.0
    with pytest.raises(StoreUnavailable, match="stuck"):  # no more calls queue behind stuck ones
        client._call(lambda: 1, 1.0)
    release.set()
    wait_for(lambda: client._stuck == 0)  # the stuck calls returned: calls go through again
    assert client._call(lambda: 1, 1.0) == 1
    with pytest.raises(StoreUnavailable, match="not connected"):
        client.get("k", 1.0)
    client.close()


def test_store_urls_are_checked() -> None:
    assert parse_store_url("mooncake://10.0.0.1:50051") == StoreAddress("mooncake", "10.0.0.1", 50051)
    for bad in ("10.0.0.1:50051", "redis://h:1", "mooncake://h", "mooncake://h:0", "mooncake://:5"):
        with pytest.raises(ValueError, match="kv_remote"):
            parse_store_url(bad)


def test_without_kv_remote_nothing_imports_mooncake() -> None:
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "from engine_fixtures import tiny_model;"
        "from radixcache.worker.engine.engine import Engine, EngineConfig;"
        "from radixcache.worker.engine.request import Request, SamplingParams;"
        "import radixcache.worker.cli;"
        "e = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=40, kv_host_bytes=1 << 20)); e.start_tiers();"
        "e.submit(Request('r', list(range(3, 30)), SamplingParams(max_tokens=2)), lambda o: None); e.run_until_idle();"
        "print(sorted(m for m in sys.modules if 'mooncake' in m))"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ---- end to end: a real Mooncake master and store service, real engines ---------------------------------------
def mooncake_missing() -> str | None:
    """Why the Mooncake package cannot run here, or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # not installed, or its libibverbs missing (make setup installs both)
        return f"mooncake-transfer-engine-non-cuda cannot import here: {e}"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ.setdefault("GLOG_minloglevel", "2")  # the client's info lines would drown the test output
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    if (why := mooncake_missing()) is not None:
        pytest.skip(why)
    log = open(tmp_path_factory.mktemp("mooncake") / "mooncake.log", "ab")  # noqa: SIM115 (closed below)
    store = LocalStore(64 << 20, log=log)  # the project's own way of starting a master and a store service
    try:
        yield store.start()
    finally:
        store.stop()
        log.close()


@pytest.fixture(scope="module")
def model():
    from engine_fixtures import tiny_model

    return tiny_model()


GREEDY_TOKENS = 8


def worker(model, cluster: LocalStore | None, *, kv_pages: int = 40, **kw):
    """An engine (a worker) on the store; waits until it has joined it."""
    from radixcache.worker.engine.engine import Engine, EngineConfig

    remote = {} if cluster is None else {"kv_remote": cluster.url, "kv_remote_metadata": cluster.metadata}
    engine = Engine(model, EngineConfig(page_size=kw.pop("page_size", PAGE), kv_pages=kv_pages, **remote, **kw))
    engine.start_tiers()
    assert engine.wait_tier_ready(60), engine.tiers and engine.tiers.error
    if cluster is not None:
        wait_for(lambda: engine.cache.tier.remote is not None and engine.cache.tier.remote.available, 60)
    return engine


def run(engine, prompt: list[int], rid: str, namespace: str = ""):
    from radixcache.worker.engine.request import Request, SamplingParams

    outs = []
    greedy = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    engine.submit(Request(rid, prompt, greedy, namespace=namespace), outs.append)
    engine.run_until_idle()
    last = outs[-1]
    last.token_ids = [t for o in outs for t in o.token_ids]
    return last


def settle(engine) -> None:
    """Copy out everything still to be written through, and wait until the store tier has written it."""
    link = engine.cache.tier
    link.pump(budget_s=60.0)
    wait_for(lambda: link.remote.stats().queued_pages == 0, 30)
    link.pump()


def recompute(model, prompt: list[int], **kw) -> list[int]:
    from radixcache.worker.engine.engine import Engine, EngineConfig

    off = Engine(model, EngineConfig(page_size=kw.pop("page_size", PAGE), kv_pages=40, cache_enabled=False, **kw))
    return run(off, prompt, "off").token_ids


def prompt_of(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


e2e = pytest.mark.e2e


@e2e
@pytest.mark.timeout(240)
def test_a_page_one_worker_computed_is_loaded_by_another_with_the_recomputed_output(model, cluster) -> None:
    from prometheus_client import generate_latest

    from radixcache.event_log import EventLog
    from radixcache.events import PagesStored, page_hashes
    from radixcache.worker.grpc.servicer import cache_stats_message
    from radixcache.worker.metrics import WorkerMetrics

    prompt = prompt_of(1)  # 10 pages
    a = worker(model, cluster)
    log = EventLog(PAGE, strict=True)
    a.cache.set_event_sink(log)
    first = run(a, prompt, "a")
    settle(a)
    assert a.stats().cache.store_written_pages >= 9
    in_store = {h for e in log.drain() if isinstance(e, PagesStored) and e.medium == "STORE" for h in e.page_hashes}
    assert set(page_hashes(prompt, PAGE)) <= in_store  # the events name the medium, with the router's hashes
    b = worker(model, cluster, kv_pages=56)  # another worker, another pool
    again = run(b, prompt, "b")
    stats = b.stats()
    assert again.cached_tokens >= 36 and stats.store_hit_tokens >= 36
    assert stats.cache.store_loaded_pages >= 9 and stats.cache.store_ready == 1
    assert again.token_ids == first.token_ids == recompute(model, prompt)
    text = generate_latest(WorkerMetrics(lambda: stats).registry).decode()
    assert f'radixcache_cache_hit_tokens_by_tier_total{{tier="store"}} {float(stats.store_hit_tokens)}' in text
    assert "radixcache_store_ready 1.0" in text
    message = cache_stats_message(stats)  # what GetCacheStats sends
    assert (message.store_hit_tokens, message.store_loaded_pages) == (
        stats.store_hit_tokens,
        stats.cache.store_loaded_pages,
    )
    assert message.store_ready and message.store_pages == stats.cache.store_pages > 0
    settle(b)  # what b computed (the generated tokens' pages) a had written already: once per fleet
    assert b.stats().cache.store_written_pages == 0 and b.stats().cache.store_skipped_pages >= 1
    for engine in (a, b):
        engine.cache.check(idle=True)
        engine.shutdown()


@e2e
@pytest.mark.timeout(240)
def test_a_worker_started_after_another_wrote_is_warm_from_its_first_request(model, cluster) -> None:
    from radixcache.worker.engine.engine import Engine, EngineConfig

    prompt = prompt_of(5)
    a = worker(model, cluster)
    first = run(a, prompt, "a")
    settle(a)
    a.shutdown()
    config = EngineConfig(page_size=PAGE, kv_pages=40, kv_remote=cluster.url, kv_remote_metadata=cluster.metadata)
    late = Engine(model, config)
    late.start_tiers()  # no wait: the first request arrives while the store is still being joined
    again = run(late, prompt, "late")
    assert again.cached_tokens >= 36 and late.stats().store_hit_tokens >= 36
    assert again.token_ids == first.token_ids == recompute(model, prompt)
    late.cache.check(idle=True)
    late.shutdown()


@e2e
@pytest.mark.timeout(240)
def test_another_tenant_or_fingerprint_reads_nothing_from_the_store(model, cluster) -> None:
    prompt = prompt_of(3)
    a = worker(model, cluster)
    run(a, prompt, "a", "alice")
    settle(a)
    a.shutdown()
    bob = worker(model, cluster)
    assert run(bob, prompt, "bob", "bob").cached_tokens == 0
    assert bob.stats().store_hit_tokens == 0
    assert run(bob, prompt, "alice", "alice").cached_tokens >= 36  # the same worker does load alice's for alice
    bob.shutdown()
    other = worker(model, cluster, kv_dtype="int8")  # another fingerprint (the KV precision)
    assert run(other, prompt, "int8", "alice").cached_tokens == 0 and other.stats().store_hit_tokens == 0
    other.shutdown()


@e2e
@pytest.mark.timeout(240)
def test_a_corrupted_object_in_the_store_is_a_miss_and_removed(model, cluster) -> None:
    from radixcache.mooncake_store import MooncakeObjectStore

    prompt = prompt_of(4)
    a = worker(model, cluster)
    first = run(a, prompt, "a")
    settle(a)
    tier = a.cache.tier.remote
    keys = list(tier.records())
    target = tier.object_key(keys[0].namespace, keys[0].page_hash)  # the prompt's first page
    a.shutdown()
    vandal = MooncakeObjectStore(parse_store_url(cluster.url), cluster.metadata, local_host="127.0.0.1")
    vandal.connect(30)
    raw = bytearray(vandal.get(target, 5))
    raw[-8] ^= 0x55
    vandal.remove(target, 5)
    vandal.put(target, bytes(raw), 5)
    b = worker(model, cluster)
    again = run(b, prompt, "b")
    stats = b.stats().cache
    assert stats.store_corrupt_pages == 1 and again.cached_tokens == 0  # the first page is gone: nothing follows
    assert again.token_ids == first.token_ids
    settle(b)  # its write-through lands
    assert vandal.get(target, 5) is not None  # b computed the page again and wrote it back, whole
    vandal.close()
    b.shutdown()


@e2e
@pytest.mark.timeout(300)
def test_the_master_killed_mid_run_fails_no_request_and_the_worker_rejoins(model, cluster) -> None:
    """Last in the module: it restarts the master (which empties the store) and the store service."""
    from radixcache.worker.engine.request import FinishReason

    prompts = [prompt_of(10 + i) for i in range(6)]
    expected = [recompute(model, p) for p in prompts]
    a = worker(model, cluster)
    for i, p in enumerate(prompts[:2]):
        assert run(a, p, f"before-{i}").token_ids == expected[i]
    settle(a)
    cluster.kill_master()
    b = worker(model, None)  # a store-less reference running beside it
    for i, p in enumerate(prompts):  # old prompts (cached) and new ones (to be written): all answered exactly
        got = run(a, p, f"during-{i}")
        assert got.finish_reason == FinishReason.LENGTH, got.finish_reason
        assert got.token_ids == expected[i] == run(b, p, f"ref-{i}").token_ids
    a.cache.tier.pump(budget_s=60.0)
    wait_for(lambda: a.stats().cache.store_unavailable_errors > 0, 30)
    assert a.stats().cache.store_ready == 0
    cluster.start_master()
    cluster.kill_service()  # a restarted master knows no segment: the service mounts its memory again
    cluster.start_service()
    tier = a.cache.tier.remote
    wait_for(lambda: tier.available and tier.stats().ready, 60)
    fresh = prompt_of(30)
    written_before = a.stats().cache.store_written_pages  # before the run: its pages may be written while it runs
    assert run(a, fresh, "after").token_ids == recompute(model, fresh)
    settle(a)
    assert a.stats().cache.store_written_pages > written_before, vars(tier.stats())  # writing again
    a.cache.check(idle=True)
    a.shutdown()
    b.shutdown()


class HeldAbove:
    """A tier above the store (as the host tier is) holding some pages: find and get only."""

    medium = "CPU"

    def __init__(self, held: dict) -> None:
        self.held = held

    def find(self, key: PageKey) -> bool:
        return key.name in self.held

    def get(self, key: PageKey):
        return self.held.get(key.name)


def test_a_run_of_store_pages_loads_in_one_call_and_stops_at_the_first_missing_page() -> None:
    from radixcache.tier import MEDIUM_STORE, TierChain

    store = FakeStore()
    tier = tier_on(store)
    keys = page_keys(list(range(100, 124)))  # 6 pages
    for key in keys:
        tier.put(key, b"page-" + key.tokens)
    written(tier)
    reader = tier_on(store)  # knows nothing: every page comes over the network
    chain = TierChain([reader])
    got = list(chain.get_run(keys))
    assert [p.payload for p in got] == [b"page-" + k.tokens for k in keys] and store.batches == [6]
    assert {p.medium for p in got} == {MEDIUM_STORE}
    store.objects.pop(reader.object_key(keys[3].namespace, keys[3].page_hash))
    store.batches.clear()
    hits, misses = reader.stats().read_hits, reader.stats().read_misses
    assert [p.payload for p in chain.get_run(keys)] == [b"page-" + k.tokens for k in keys[:3]]
    assert store.batches == [6]  # one call; the walk stopped at the page that was gone
    # what came after the missing page was neither checked nor counted: 3 hits and 1 miss, not 5 hits
    assert (reader.stats().read_hits - hits, reader.stats().read_misses - misses) == (3, 1)
    # a page a tier above holds is served there, and splits the store's runs around it
    store.batches.clear()
    above = HeldAbove({keys[1].name: b"from above"})
    chain = TierChain([above, reader])
    got = list(chain.get_run(keys[:3]))
    assert [p.payload for p in got] == [b"page-" + keys[0].tokens, b"from above", b"page-" + keys[2].tokens]
    assert [p.medium for p in got] == [MEDIUM_STORE, "CPU", MEDIUM_STORE] and store.batches == [1, 1]
    store.batches.clear()
    assert list(TierChain([reader]).get_run(keys, lambda: False)) == [] and store.batches == []  # nobody waits
    for t in (tier, reader):
        t.close(1)


def test_pages_queued_together_are_written_in_one_call_each_once_per_fleet() -> None:
    store = FakeStore()
    tier = tier_on(store)
    keys = page_keys(list(range(200, 224)))  # 6 pages
    store.gate.clear()  # the writer takes the first page and waits on the store
    store.asked.clear()
    tier.put(keys[0], b"p0")
    wait_for(store.asked.is_set)
    for key in keys[1:]:
        tier.put(key, b"p" + key.tokens)
    assert all(tier.get(key) is not None for key in keys)  # queued pages are readable at once
    store.gate.set()
    written(tier)
    assert store.put_batches == [1, 5] and tier.stats().written_pages == 6
    other = tier_on(store)  # the fleet has them all: nothing is written again, in one exists_many
    for key in keys:
        other.put(key, b"again")
    written(other)
    assert store.put_batches == [1, 5] and other.stats().skipped_pages == 6
    for t in (tier, other):
        t.check()
        t.close(1)
