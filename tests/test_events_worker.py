"""Cache events (issue 11), worker level: the engine's events replay to its tree; SubscribeCacheEvents (snapshot, live
batches, a reset for a slow reader, admin tokens only); vLLM's ZMQ format; two workers agree on page hashes; the
`radixcache events` command."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time

import grpc
import msgpack
import pytest
import zmq
from engine_fixtures import tiny_model
from helpers import tree_index
from test_engine import Collector
from test_events import Replayer
from worker_harness import ThreadedWorker
from worker_process import WorkerProcess

from radixcache.client import Client
from radixcache.event_log import EventLog
from radixcache.events import PageIndex, page_hashes
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.worker.cache_events import EVENTS, RESET, SNAPSHOT
from radixcache.worker.engine import Engine, EngineConfig
from radixcache.worker.events_proto import event_from_proto
from radixcache.worker.request import Request, SamplingParams

ADMIN, TENANT = "adm-token", "alice-token"
TOKENS = {ADMIN: "ops", TENANT: "alice"}


def test_engine_workload_replays_to_the_tree() -> None:
    """>= 500 random operations on an engine whose pool is too small: evictions, preemptions, aborts, pins with
    TTL, flushes, partial tails; the events drained at checkpoints always replay to exactly the tree's pages."""
    model = tiny_model()
    rng = random.Random(11)
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=24, max_step_tokens=48, max_running=8))
    log = EventLog(4, strict=True)
    engine.cache.set_event_sink(log)
    replay = Replayer(4)
    prefixes = [[rng.randrange(3, 290) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    sink = Collector()
    namespaces = ["", "tenant-b"]
    submitted = tails = 0
    for i in range(520):  # one operation each; a step every other one (steps are what costs time)
        roll = rng.random()
        if roll < 0.25 and submitted < 60:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 30)] + [rng.randrange(3, 290) for _ in range(3)]
            params = SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True)
            engine.submit(Request(f"r{submitted}", prompt, params, namespace=rng.choice(namespaces)), sink)
            submitted += 1
        elif roll < 0.3 and submitted:
            engine.abort(f"r{rng.randrange(submitted)}")
        elif roll < 0.35:
            engine.pin(rng.choice(prefixes), rng.choice(namespaces), ttl_s=rng.choice([None, 0.01]))
        elif roll < 0.38:
            engine.unpin(rng.choice(prefixes), rng.choice(namespaces))
        elif roll < 0.4:
            engine.flush_cache(rng.choice([None, *namespaces]))
        elif i % 2:
            engine.step()
        if i % 20 == 19:
            replay.feed(log.drain())
            assert replay.index.as_dict() == tree_index(engine.cache.tree)
            tails = max(tails, engine.cache.stats().pages_partial)
    engine.run_until_idle()
    replay.feed(log.drain())
    assert replay.index.as_dict() == tree_index(engine.cache.tree)
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.cache.evicted_pages > 0 and tails > 0, (stats, tails)
    assert replay.events > 100


# ---- the gRPC stream -----------------------------------------------------------------------------------------------
class Follower:
    """Reads SubscribeCacheEvents on a thread and keeps a PageIndex: what a router would do."""

    def __init__(self, target: str, token: str | None) -> None:
        self.client = Client(target, token=token)
        self.index = PageIndex(strict=True)
        self.kinds: list[str] = []
        self.sequences: list[int] = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self._parts: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for m in self.client.cache_events():
                with self.lock:
                    self._apply(m)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e

    def _apply(self, m: pb.CacheEventBatch) -> None:
        kind = {1: SNAPSHOT, 2: EVENTS, 3: RESET}[m.kind]
        if kind == SNAPSHOT:
            self._parts += [event_from_proto(e) for e in m.events]
            if not m.snapshot_complete:
                return
            self.index.load(self._parts)
            self._parts = []
        elif kind == EVENTS:
            assert self.sequences[-1] + 1 == m.sequence, "live batches are numbered consecutively"
            for e in m.events:
                self.index.apply(event_from_proto(e))
        self.kinds.append(kind)
        self.sequences.append(m.sequence)

    def wait_equal(self, engine: Engine, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            expected = engine.call(lambda: tree_index(engine.cache.tree))
            with self.lock:
                got = self.index.as_dict()
            assert self.error is None, self.error
            if got == expected or time.monotonic() > deadline:
                assert got == expected
                return got
            time.sleep(0.05)

    def close(self) -> None:
        self.client.close()
        self.thread.join(5)


def traffic(target: str, token: str, rng: random.Random, n: int, prefixes: list[list[int]]) -> None:
    """n requests from 4 threads, sharing prefixes; a few pins and one flush in between."""
    with Client(target, token=token) as c:

        def run(k: int) -> None:
            for j in range(k, n, 4):
                prompt = prefixes[j % len(prefixes)] + [(j * 7 + i) % 250 + 3 for i in range(j % 5 + 1)]
                list(c.generate(token_ids=prompt, max_tokens=(j % 6) + 1, ignore_eos=True))

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        c.pin(token_ids=prefixes[0], ttl_seconds=0.5)
        for t in threads:
            t.join()
        c.flush()
        for j in range(4):
            list(c.generate(token_ids=prefixes[j % len(prefixes)] + [j + 3], max_tokens=2, ignore_eos=True))


@pytest.fixture(scope="module")
def worker():
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=48, max_step_tokens=64, max_running=6))
    with ThreadedWorker(engine, auth_tokens=TOKENS, admin_tokens={ADMIN}) as w:
        yield w


def test_subscribers_replay_to_the_tree_and_only_admins_may_subscribe(worker) -> None:
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 290) for _ in range(rng.randrange(6, 24))] for _ in range(3)]
    with Client(worker.target, token=TENANT) as c:  # something cached before anyone subscribes
        list(c.generate(token_ids=prefixes[0] + [7, 8, 9], max_tokens=3))
    early = Follower(worker.target, ADMIN)
    try:
        early.wait_equal(worker.engine)
        assert early.kinds == [SNAPSHOT] and early.index.as_dict()  # the late-joiner's snapshot has the pages
        traffic(worker.target, TENANT, rng, 24, prefixes)
        late = Follower(worker.target, ADMIN)  # joins after traffic: the snapshot alone must be exact
        try:
            traffic(worker.target, ADMIN, rng, 12, prefixes)
            final = early.wait_equal(worker.engine)
            late.wait_equal(worker.engine)
        finally:
            late.close()
        assert set(final) == {"alice", "ops"}  # both tenants' pages, in their own namespaces
        assert EVENTS in early.kinds and RESET not in early.kinds
        assert worker.engine.stats().cache.evicted_pages > 0
    finally:
        early.close()
    with Client(worker.target, token=TENANT) as c:
        with pytest.raises(grpc.RpcError) as err:
            next(iter(c.cache_events()))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with Client(worker.target, token="nobody") as c:
        with pytest.raises(grpc.RpcError) as err:
            next(iter(c.cache_events()))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def read_until(run, batches, index: PageIndex, expected: dict) -> list[str]:
    """Apply a hub subscription's batches (read on its loop through `run`) to `index` until it equals `expected`
    after a RESET; returns the kinds read."""
    kinds: list[str] = []
    while index.as_dict() != expected or RESET not in kinds:
        batch = run(asyncio.wait_for(batches.__anext__(), 10))
        kinds.append(batch.kind)
        if batch.kind == SNAPSHOT:
            index.load(batch.events)
        elif batch.kind == EVENTS:
            for e in batch.events:
                index.apply(e)
    return kinds


def test_a_slow_subscriber_gets_a_reset_and_a_fresh_snapshot(worker) -> None:
    hub = worker.server.core.events
    hub.queue_batches = 2  # the next subscription may fall 2 batches behind

    async def open_subscription():
        batches = hub.subscribe()
        return batches, await batches.__anext__()

    batches, first = worker.run(open_subscription())
    hub.queue_batches = 256
    assert first.kind == SNAPSHOT
    index = PageIndex()
    index.load(first.events)
    try:
        rng = random.Random(6)
        prefixes = [[rng.randrange(3, 290) for _ in range(10)] for _ in range(3)]
        traffic(worker.target, TENANT, rng, 12, prefixes)  # many batches while nobody reads this subscription
        expected = worker.engine.call(lambda: tree_index(worker.engine.cache.tree))
        kinds = read_until(worker.run, batches, index, expected)
        assert kinds[:2] == [RESET, SNAPSHOT], kinds  # what was queued is dropped: a reset, then a new snapshot
    finally:
        worker.run(batches.aclose())
    assert hub.subscribers == 0


def test_zmq_messages_decode_to_vllm_structures_and_replay_to_the_tree() -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=40, max_step_tokens=64, max_running=6))
    w = ThreadedWorker(engine, kv_events_endpoint=f"tcp://127.0.0.1:{port}").start()  # a concrete host: connects
    try:
        hub = w.server.core.events
        while not sub.poll(200):  # a PUB drops what it sends before the subscription reaches it: resend until seen
            w.run(hub.resync_publishers())
        blocks: dict[int, int | None] = {}
        tags: dict[str, int] = {}
        last_seq = None

        def receive(timeout_ms: int) -> bool:
            nonlocal last_seq
            if not sub.poll(timeout_ms):
                return False
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            seq = int.from_bytes(seq, "big")
            assert last_seq is None or seq == last_seq + 1, "consecutive sequence numbers"
            last_seq = seq
            ts, events, dp_rank = msgpack.unpackb(payload)  # EventBatch, array_like
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank == 0
            for event in events:
                tag = event[0]
                tags[tag] = tags.get(tag, 0) + 1
                if tag == "AllBlocksCleared":
                    assert event == ["AllBlocksCleared"]
                    blocks.clear()
                elif tag == "BlockStored":
                    hashes, parent, token_ids, block_size, lora_id, medium, lora_name = event[1:]
                    assert block_size == 4 and len(token_ids) == 4 * len(hashes) and medium == "GPU"
                    assert lora_id is None and lora_name is None
                    for h in hashes:
                        assert h not in blocks
                        blocks[h] = parent
                        parent = h
                elif tag == "BlockRemoved":
                    hashes, medium = event[1:]
                    assert medium == "GPU"
                    for h in hashes:
                        del blocks[h]
                else:
                    raise AssertionError(f"unknown event {event!r}")
            return True

        rng = random.Random(7)
        prefixes = [[rng.randrange(3, 290) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
        traffic(w.target, "", rng, 16, prefixes)
        deadline = time.monotonic() + 20
        while True:
            received = receive(100)
            expected = engine.call(lambda: tree_index(engine.cache.tree))
            flat = {h: p for held in expected.values() for h, p in held.items()}
            if (flat == blocks and not received) or time.monotonic() > deadline:
                break
        assert blocks == flat and len(flat) > 5
        assert tags["AllBlocksCleared"] >= 1 and tags["BlockStored"] > 5 and tags["BlockRemoved"] > 0, tags
    finally:
        w.stop()
        sub.close()
        ctx.term()


def test_two_workers_report_the_same_page_hashes_and_the_events_command_prints_them() -> None:
    """A real `radixcache serve --random-model` process and an in-process worker with the same model."""
    from radixcache.worker.cli import load_model, parser

    args = parser().parse_args(["--random-model", "--page-size", "4"])
    loaded, _, _ = load_model(args)
    local = Engine(loaded, EngineConfig(page_size=4, kv_pages=64))
    prompt = "Shared prefixes hash alike on every worker."
    with WorkerProcess("--page-size", "4", "--kv-pages", "64") as remote, ThreadedWorker(local) as here:
        for target in (remote.target, here.target):
            with Client(target) as c:
                list(c.generate(prompt, max_tokens=3, temperature=0.0))
        cmd = [sys.executable, "-m", "radixcache", "events", "--target", remote.target, "--snapshot-only", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
        [batch] = [json.loads(line) for line in out.splitlines()]
        assert batch["kind"] == "snapshot" and batch["snapshot_complete"] and batch["page_size"] == 4
        remote_hashes = {h for e in batch["events"] for h in e["page_hashes"]}
        with Client(here.target) as c:
            snapshot = next(iter(c.cache_events()))
            ids = c.tokenize(prompt)
        local_hashes = {h for e in snapshot.events for h in e.stored.page_hashes}
        expected = page_hashes(ids, 4)
        assert len(expected) >= 8 and set(expected) <= remote_hashes and remote_hashes == local_hashes
        text = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=60, check=True).stdout
        assert text.startswith("snapshot seq=") and f"{expected[0]:016x}" in text


def test_tokens_files_mark_admins_and_stay_backward_compatible(tmp_path) -> None:
    from radixcache.worker.auth import Authenticator, load_token_file, load_tokens

    text = tmp_path / "tokens.txt"
    text.write_text("# token tenant [admin]\nt1 alice\nt2 ops admin\n")
    assert load_token_file(text) == ({"t1": "alice", "t2": "ops"}, {"t2"})
    assert load_tokens(text) == {"t1": "alice", "t2": "ops"}
    js = tmp_path / "tokens.json"
    js.write_text(json.dumps({"t1": "alice", "t2": {"tenant": "ops", "admin": True}, "t3": {"tenant": "bob"}}))
    assert load_token_file(js) == ({"t1": "alice", "t2": "ops", "t3": "bob"}, {"t2"})
    for bad in ("t1 alice root\n", "t1 alice admin extra\n"):
        text.write_text(bad)
        with pytest.raises(ValueError, match="admin"):
            load_token_file(text)
    js.write_text(json.dumps({"t1": {"tenant": "ops", "admin": "yes"}}))
    with pytest.raises(ValueError, match="admin"):
        load_token_file(js)
    auth = Authenticator({"t1": "alice", "t2": "ops"}, {"t2"})
    assert auth.is_admin([("authorization", "Bearer t2")]) and auth.tenant([("authorization", "Bearer t2")]) == "ops"
    assert not auth.is_admin([("authorization", "Bearer t1")]) and not auth.is_admin(None)
    assert Authenticator().is_admin(None)  # no auth: every caller may


def test_records_lost_inside_the_worker_reset_every_reader() -> None:
    """When the loop falls max_pending records behind the engine, subscribers get RESET + a snapshot and publishers
    a full reset, and both are exact again afterwards."""
    from radixcache.cache import PrefixCache
    from radixcache.worker.cache_events import CacheEventHub

    class Engine_:  # the engine's part the hub uses; `call` runs on the caller's thread under the engine's lock
        page_size = 2
        cache = PrefixCache(64, 2)
        lock = threading.Lock()

        def call(self, fn):
            with self.lock:
                return fn()

    class Recorder:
        def __init__(self) -> None:
            self.resets: list = []
            self.index = PageIndex()

        def reset(self, snapshot) -> None:
            self.resets.append(len(snapshot))
            self.index.load(snapshot)

        def publish(self, events, timestamp) -> None:
            for e in events:
                self.index.apply(e)

        def close(self) -> None:
            pass

    engine = Engine_()

    def serve(owner: str, tokens: list[int]) -> None:
        with engine.lock:
            lease = engine.cache.acquire(owner, tokens, max_cached=0)
            engine.cache.allocate(lease, -(-len(tokens) // 2))
            engine.cache.release(lease, tokens)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    hub = CacheEventHub(engine, max_pending=5)
    publisher = Recorder()
    try:
        serve("a", [1, 2, 3, 4])
        run(hub.start())

        async def setup():
            hub.add_publisher(publisher)
            batches = hub.subscribe()
            return batches, await batches.__anext__()

        batches, first = run(setup())
        assert first.kind == SNAPSHOT and len(first.events) == 1
        deadline = time.monotonic() + 10
        while not publisher.resets and time.monotonic() < deadline:
            time.sleep(0.02)
        assert publisher.resets == [1]
        blocked = threading.Event()
        loop.call_soon_threadsafe(blocked.wait)  # the loop stalls: nothing is drained meanwhile
        for i in range(10):
            serve(f"b{i}", [9, i, 9, i, 9])
        blocked.set()
        index, expected = PageIndex(), tree_index(engine.cache.tree)
        kinds = read_until(run, batches, index, expected)
        assert kinds[:2] == [RESET, SNAPSHOT], kinds
        deadline = time.monotonic() + 10
        while publisher.index.as_dict() != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert publisher.index.as_dict() == expected and publisher.resets == [1, 11]
        run(batches.aclose())
    finally:
        run(hub.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
