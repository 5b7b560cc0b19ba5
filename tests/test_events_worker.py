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
import vllm_kv_events
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
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams
from radixcache.worker.events.hub import EVENTS, RESET, SNAPSHOT
from radixcache.worker.events.proto import event_from_proto

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


class ZmqReader:
    """A SUB socket reading the worker's vLLM KV events: decodes every message with vLLM's own structs (`decoder`)
    and replays them into `blocks` {hash: parent} (what a vLLM-indexing router would hold)."""

    def __init__(self, sub: zmq.Socket, structs: tuple) -> None:
        self.sub, (self.decoder, self.stored, self.removed, self.cleared) = sub, structs
        self.blocks: dict[int, int | None] = {}
        self.tags: dict[str, int] = {}
        self.last_seq: int | None = None
        self.raw: list = []  # each message's payload as plain msgpack

    def receive(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == b"" and len(seq) == 8
        seq_no = int.from_bytes(seq, "big")
        assert self.last_seq is None or seq_no == self.last_seq + 1, "consecutive sequence numbers"
        self.last_seq = seq_no
        self.raw.append(msgpack.unpackb(payload))
        batch = self.decoder.decode(payload)
        assert abs(batch.ts - time.time()) < 60 and batch.data_parallel_rank == 0
        for event in batch.events:
            name = type(event).__name__
            self.tags[name] = self.tags.get(name, 0) + 1
            if isinstance(event, self.cleared):
                self.blocks.clear()
            elif isinstance(event, self.stored):
                assert event.block_size == 4 and len(event.token_ids) == 4 * len(event.block_hashes)
                assert event.medium == "GPU" and event.lora_id is None and event.lora_name is None
                parent = event.parent_block_hash
                for h in event.block_hashes:
                    assert h not in self.blocks
                    self.blocks[h] = parent
                    parent = h
            else:
                assert isinstance(event, self.removed) and event.medium == "GPU"
                for h in event.block_hashes:
                    del self.blocks[h]
        return True


def replay_until_in_step(w: ThreadedWorker, engine: Engine, reader: ZmqReader) -> dict[int, int | None]:
    """Read until the replayed blocks equal the engine's tree (20 s at most); returns the tree's {hash: parent}."""
    deadline = time.monotonic() + 20
    while True:
        received = reader.receive(100)
        expected = engine.call(lambda: tree_index(engine.cache.tree))
        flat = {h: p for held in expected.values() for h, p in held.items()}
        if (flat == reader.blocks and not received) or time.monotonic() > deadline:
            return flat


@pytest.mark.parametrize("layout", ["vllm", "vllm-legacy"])
def test_zmq_messages_decode_with_vllms_structs_and_replay_to_the_tree(layout) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=40, max_step_tokens=64, max_running=6))
    options = {"kv_events_endpoint": f"tcp://127.0.0.1:{port}", "kv_events_format": layout}  # a host: connects
    w = ThreadedWorker(engine, **options).start()
    reader = ZmqReader(sub, vllm_kv_events.current() if layout == "vllm" else vllm_kv_events.legacy())
    try:
        hub = w.server.core.events
        while not sub.poll(200):  # a PUB drops what it sends before the subscription reaches it: resend until seen
            w.run(hub.resync_publishers())
        rng = random.Random(7)
        prefixes = [[rng.randrange(3, 290) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
        traffic(w.target, "", rng, 16, prefixes)
        flat = replay_until_in_step(w, engine, reader)
        assert reader.blocks == flat and len(flat) > 5
        tags = reader.tags
        assert tags["AllBlocksCleared"] >= 1 and tags["BlockStored"] > 5 and tags["BlockRemoved"] > 0, tags
        events = [e for _, batch, _ in reader.raw for e in batch]
        stored = next(e for e in events if (e["type"] if layout == "vllm" else e[0]) == "BlockStored")
        if layout == "vllm":  # named fields, the storage facts of one full-attention group
            assert all(isinstance(e, dict) for e in events) and {"type": "AllBlocksCleared"} in events
            assert stored["group_idx"] == 0 and stored["kv_cache_spec_kind"] == "full_attention"
            assert "kv_cache_spec_sliding_window" not in stored and "extra_keys" not in stored  # None: omitted
        else:  # exactly the arrays of vLLM before #42892
            assert all(isinstance(e, list) for e in events) and ["AllBlocksCleared"] in events and len(stored) == 8
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
    from radixcache.worker.front.auth import Authenticator, load_token_file, load_tokens

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
    from radixcache.worker.events.hub import CacheEventHub

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


def test_each_rank_publishes_on_its_own_port_and_tags_its_batches() -> None:
    """vLLM's data-parallel rule, which a cluster's replicas follow: rank r on the port + r, data_parallel_rank r."""
    from radixcache.worker.events.zmq_publisher import ZmqKvEventPublisher, rank_endpoint

    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert rank_endpoint("tcp://[::]:5557", 1) == "tcp://[::]:5558"
    assert rank_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert rank_endpoint("bind+tcp://127.0.0.1:5557", 1) == "bind+tcp://127.0.0.1:5558"  # one interface, per rank
    for bad in ("tcp://host", "tcp://*:65535"):
        with pytest.raises(ValueError, match="--kv-events-endpoint"):
            rank_endpoint(bad, 1)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=40000)
    endpoint = rank_endpoint(f"tcp://127.0.0.1:{port - 2}", 2)  # rank 2 of a base 2 below: where we listen
    assert endpoint == f"tcp://127.0.0.1:{port}"
    publisher = ZmqKvEventPublisher(endpoint, 4, data_parallel_rank=2)
    try:
        while not sub.poll(200):  # a PUB drops what it sends before the subscription reaches it
            publisher.reset([])
        _, _, payload = sub.recv_multipart()
        assert msgpack.unpackb(payload)[2] == 2
    finally:
        publisher.close()
        sub.close(linger=0)


def test_endpoint_prefixes_say_bind_or_connect_and_otherwise_vllms_rule_holds() -> None:
    from radixcache.worker.events.zmq_publisher import parse_endpoint

    assert parse_endpoint("bind+tcp://127.0.0.1:5557") == ("tcp://127.0.0.1:5557", True)
    assert parse_endpoint("connect+tcp://*:5557") == ("tcp://*:5557", False)
    assert parse_endpoint("tcp://127.0.0.1:5557") == ("tcp://127.0.0.1:5557", False)  # vLLM's rule: a host connects
    assert parse_endpoint("tcp://*:5557")[1] and parse_endpoint("tcp://[::]:5557")[1]
    assert parse_endpoint("ipc:///tmp/events")[1] and parse_endpoint("inproc://events")[1]


def test_with_auth_tokens_publishing_over_tcp_needs_curve_or_insecure_and_the_refusal_names_the_flags(tmp_path):
    from radixcache.worker.events.zmq_publisher import CurveKeys, check_security
    from radixcache.worker.server import ServerOptions, WorkerServer

    flags = "--kv-events-curve-secret.*--kv-events-curve-clients.*--kv-events-insecure"
    for endpoint in ("tcp://*:5557", "bind+tcp://127.0.0.1:5557", "tcp://router:5557"):
        with pytest.raises(ValueError, match=flags):
            check_security(endpoint, auth=True, curve=None, insecure=False)
        check_security(endpoint, auth=False, curve=None, insecure=False)  # no auth: nothing to protect per tenant
        check_security(endpoint, auth=True, curve=None, insecure=True)
        check_security(endpoint, auth=True, curve=CurveKeys(tmp_path / "k", tmp_path), insecure=False)
    check_security("ipc:///tmp/x", auth=True, curve=None, insecure=False)  # local: the socket file's permissions
    options = ServerOptions(auth_tokens=TOKENS, kv_events_endpoint="tcp://*:0")
    with pytest.raises(ValueError, match=flags):  # before any port is bound
        asyncio.run(WorkerServer(options).start())
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("s3cret alice\n")
    cmd = [sys.executable, "-m", "radixcache", "serve", "--random-model", "--port", "0", "--auth-tokens", str(tokens)]
    done = subprocess.run([*cmd, "--kv-events-endpoint", "tcp://*:0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--kv-events-insecure" in done.stderr and "--kv-events-curve-secret" in done.stderr


def test_with_curve_only_subscribers_holding_an_allowed_key_read_the_events(tmp_path) -> None:
    import zmq.auth

    from radixcache.worker.events.zmq_publisher import CurveKeys

    for name in ("worker", "router", "stranger", "clients"):
        (tmp_path / name).mkdir()
    _, worker_secret = zmq.auth.create_certificates(tmp_path / "worker", "worker")
    router_public, router_secret = zmq.auth.create_certificates(tmp_path / "router", "router")
    _, stranger_secret = zmq.auth.create_certificates(tmp_path / "stranger", "stranger")
    (tmp_path / "clients" / "router.key").write_bytes(open(router_public, "rb").read())  # only the router's key
    server_public, _ = zmq.auth.load_certificate(worker_secret)
    engine = Engine(tiny_model(), EngineConfig(page_size=4, kv_pages=40, max_step_tokens=64, max_running=6))
    curve = CurveKeys(worker_secret, tmp_path / "clients")
    options = {"kv_events_endpoint": "bind+tcp://127.0.0.1:*", "kv_events_curve": curve}
    w = ThreadedWorker(engine, auth_tokens=TOKENS, admin_tokens={ADMIN}, **options).start()
    ctx = zmq.Context()

    def subscriber(secret_file: str | None) -> zmq.Socket:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        if secret_file is not None:
            sub.curve_publickey, sub.curve_secretkey = zmq.auth.load_certificate(secret_file)
            sub.curve_serverkey = server_public
        sub.connect(w.server.kv_events.endpoint)
        return sub

    subs = [subscriber(router_secret), subscriber(None), subscriber(stranger_secret)]
    try:
        assert w.server.kv_events.endpoint.startswith("tcp://127.0.0.1:")  # that interface only
        hub = w.server.core.events
        deadline = time.monotonic() + 20
        while not subs[0].poll(200) and time.monotonic() < deadline:
            w.run(hub.resync_publishers())
        rng = random.Random(3)
        traffic(w.target, TENANT, rng, 12, [[rng.randrange(3, 290) for _ in range(10)] for _ in range(2)])
        reader = ZmqReader(subs[0], vllm_kv_events.current())
        flat = replay_until_in_step(w, engine, reader)
        assert reader.blocks == flat and len(flat) > 3  # the allowed key decodes every event
        w.run(hub.resync_publishers())
        assert not subs[1].poll(500) and not subs[2].poll(0)  # no CURVE, or a key not allowed: nothing at all
    finally:
        w.stop()
        for sub in subs:
            sub.close()
        ctx.term()
