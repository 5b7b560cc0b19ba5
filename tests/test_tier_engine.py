"""The disk and host tiers under a real engine (tiny model, small pool, tmp_path): evicted pages come back from
disk with the same greedy output as a recompute; fingerprints, tenants, flush, corruption, a shared folder and a
restart are each tested once."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from engine_fixtures import tiny_model

from radixcache.events import PagesRemoved, PagesStored
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, RequestOutput, SamplingParams
from radixcache.worker.model.loader import random_model

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PAGE = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine_on(model, folder: Path | None, *, kv_pages: int = 40, host: int | None = None, **kw) -> Engine:
    config = EngineConfig(
        page_size=kw.pop("page_size", PAGE),
        kv_pages=kv_pages,
        kv_disk_dir=None if folder is None else str(folder),
        kv_disk_bytes=kw.pop("kv_disk_bytes", 64 << 20),
        kv_host_bytes=host,
        **kw,
    )
    engine = Engine(model, config)
    engine.start_tiers()
    assert engine.wait_tier_ready(60), engine.tiers and engine.tiers.error
    return engine


def run(engine: Engine, prompt: list[int], rid: str, namespace: str = "") -> RequestOutput:
    outs: list[RequestOutput] = []
    engine.submit(Request(rid, prompt, GREEDY, namespace=namespace), outs.append)
    engine.run_until_idle()
    tokens = [t for o in outs for t in o.token_ids]
    last = outs[-1]
    last.token_ids = tokens
    return last


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 290) for _ in range(length)] for _ in range(n)]


def evict_everything(engine: Engine, seed: int = 99) -> None:
    """Fill the pool with other prompts until nothing of the earlier ones is left in memory."""
    for i, p in enumerate(prompts(4, 36, seed)):
        run(engine, p, f"filler-{seed}-{i}")
    engine.cache.evict(engine.num_pages)
    engine.cache.tier.pump()


def settle(engine: Engine) -> None:
    """Copy out what is still to be written through, wait until every queued page is written, and turn what landed
    into events."""
    disk = engine.cache.tier.disk
    engine.cache.tier.pump(budget_s=60.0)
    for _ in range(2000):
        if not disk.queued():
            break
        disk._stop.wait(0.005)
    engine.cache.tier.pump()


def test_a_page_evicted_to_disk_comes_back_with_the_recomputed_output(model, tmp_path: Path) -> None:
    engine = engine_on(model, tmp_path)
    prompt = prompts(1, 40)[0]  # 10 pages
    first = run(engine, prompt, "first")
    evict_everything(engine)
    settle(engine)
    assert engine.cache.match_length(prompt) == 0  # nothing left in memory
    again = run(engine, prompt, "again")
    stats = engine.stats()
    assert again.cached_tokens >= 36  # the prompt's whole pages, bar the one whose last token is recomputed
    assert stats.disk_hit_tokens >= 36 and stats.cache.disk_loaded_pages >= 9
    off = Engine(model, EngineConfig(page_size=PAGE, kv_pages=40, cache_enabled=False))
    assert again.token_ids == first.token_ids == run(off, prompt, "off").token_ids
    engine.cache.check(idle=True)
    engine.shutdown()


def test_an_int8_page_evicted_to_disk_comes_back_with_the_recomputed_output(model, tmp_path: Path) -> None:
    from radixcache.event_log import EventLog
    from radixcache.events import page_hashes

    engine = engine_on(model, tmp_path, kv_dtype="int8")
    log = EventLog(PAGE, strict=True, kv_dtype="int8")
    engine.cache.set_event_sink(log)
    prompt = prompts(1, 40, seed=15)[0]
    first = run(engine, prompt, "first")
    evict_everything(engine)
    settle(engine)
    assert engine.cache.match_length(prompt) == 0
    again = run(engine, prompt, "again")
    assert again.cached_tokens >= 36 and engine.stats().disk_hit_tokens >= 36
    off = Engine(model, EngineConfig(page_size=PAGE, kv_pages=40, kv_dtype="int8", cache_enabled=False))
    assert again.token_ids == first.token_ids == run(off, prompt, "off").token_ids
    # on disk as int8 pages with their scales, named by the int8 page hashes a router computes
    link = engine.cache.tier
    on_disk = [record.key for record in link.tier_records() if record.medium == "DISK"]
    assert {link.disk.get(key).kv_dtype for key in on_disk} == {"int8"}
    disk_hashes = {h for e in log.drain() if isinstance(e, PagesStored) and e.medium == "DISK" for h in e.page_hashes}
    assert set(page_hashes(prompt, PAGE, kv_dtype="int8")) <= disk_hashes | {key.page_hash for key in on_disk}
    assert set(page_hashes(prompt, PAGE, kv_dtype="int8")) <= {key.page_hash for key in on_disk}
    engine.cache.check(idle=True)
    engine.shutdown()


def test_with_kv_demote_the_disk_gets_exact_pages_another_worker_serves(model, tmp_path: Path) -> None:
    """--kv-disk-write evict: a prompt reaches the disk only as its full-precision pages, handed down when it is
    demoted (never its int4 copy), so a worker without --kv-demote sharing the folder serves it exactly."""
    engine = engine_on(model, tmp_path, kv_dtype="fp32", kv_demote="int4", kv_disk_write="evict")
    prompt = prompts(1, 40, seed=16)[0]
    first = run(engine, prompt, "first")
    for i, filler in enumerate(prompts(2, 36, seed=17)):  # 20 fp32 pages: the prompt's 12 are demoted
        run(engine, filler, f"filler-{i}")
    settle(engine)
    stats = engine.stats().cache
    assert stats.demoted_pages >= 10 and stats.disk_pages >= 10 and stats.evicted_pages == 0
    engine.cache.check(idle=True)
    engine.shutdown()
    plain = engine_on(model, tmp_path, kv_dtype="fp32")  # same fingerprint: fp32 pages of 4 tokens
    got = run(plain, prompt, "plain")
    off = Engine(model, EngineConfig(page_size=PAGE, kv_pages=40, kv_dtype="fp32", cache_enabled=False))
    assert got.cached_tokens >= 36 and plain.stats().disk_hit_tokens >= 36
    assert got.token_ids == first.token_ids == run(off, prompt, "off").token_ids
    plain.cache.check(idle=True)
    plain.shutdown()


def test_host_tier_then_disk(model, tmp_path: Path) -> None:
    page_bytes = 2 * 2 * PAGE * 2 * 16 * 4  # layers x K/V x page x kv heads x head dim x fp32
    engine = engine_on(model, tmp_path, host=4 * page_bytes)
    prompt = prompts(1, 40, seed=5)[0]
    first = run(engine, prompt, "first")
    evict_everything(engine)
    settle(engine)
    again = run(engine, prompt, "again")
    stats = engine.stats()
    assert again.token_ids == first.token_ids
    assert stats.cache.host_pages <= 4 and stats.cache.host_bytes <= 4 * page_bytes
    assert stats.disk_hit_tokens > 0  # most pages were pushed down to the disk by the host tier's bound
    engine.cache.check(idle=True)
    engine.shutdown()


def test_host_tier_alone(model) -> None:
    engine = engine_on(model, None, host=64 << 20)
    prompt = prompts(1, 40, seed=6)[0]
    first = run(engine, prompt, "first")
    evict_everything(engine)
    again = run(engine, prompt, "again")
    assert again.token_ids == first.token_ids and engine.stats().host_hit_tokens >= 36
    engine.cache.check(idle=True)
    engine.shutdown()


def test_tenants_never_read_each_others_disk_pages_and_flush_clears_one(model, tmp_path: Path) -> None:
    engine = engine_on(model, tmp_path)
    prompt = prompts(1, 40, seed=7)[0]
    run(engine, prompt, "a1", "alice")
    run(engine, prompt, "b1", "bob")
    evict_everything(engine)
    settle(engine)
    # bob's pages are on disk, and alice's; a flush by alice drops hers only
    engine.flush_cache("alice")
    settle(engine)
    alice, bob = run(engine, prompt, "a2", "alice"), run(engine, prompt, "b2", "bob")
    assert alice.cached_tokens == 0
    assert bob.cached_tokens >= 36
    assert engine.stats().disk_hit_tokens == bob.cached_tokens  # only bob's came from the disk
    # a third tenant with the same tokens reads nothing at all
    assert run(engine, prompt, "c1", "carol").cached_tokens == 0
    engine.cache.check(idle=True)
    engine.shutdown()


@pytest.mark.parametrize("change", ["dtype", "page_size", "model"])
def test_another_fingerprint_reads_nothing(model, tmp_path: Path, change: str) -> None:
    prompt = prompts(1, 40, seed=8)[0]
    writer = engine_on(model, tmp_path)
    run(writer, prompt, "w")
    writer.shutdown()  # saves what memory holds
    assert list(tmp_path.rglob("*.kv"))
    if change == "dtype":
        other_model, kw = random_model(model.config, std=0.3, dtype="bfloat16"), {}
        other_model.tokenizer = model.tokenizer
    elif change == "page_size":
        other_model, kw = model, {"page_size": 8}
    else:
        other_model, kw = tiny_model(seed=1), {}
    reader = engine_on(other_model, tmp_path, **kw)
    assert reader.cache.tier.disk.folder != writer.cache.tier.disk.folder
    assert reader.stats().cache.disk_pages == 0  # the writer's pages are in another folder: never read
    assert run(reader, prompt, "r").cached_tokens == 0
    reader.shutdown()
    same = engine_on(model, tmp_path)  # and the same fingerprint does read them
    assert run(same, prompt, "s").cached_tokens >= 36
    same.shutdown()


def test_a_corrupted_or_truncated_page_file_is_recomputed(model, tmp_path: Path) -> None:
    engine = engine_on(model, tmp_path)
    prompt = prompts(1, 40, seed=9)[0]
    first = run(engine, prompt, "first")
    evict_everything(engine)
    settle(engine)
    disk = engine.cache.tier.disk
    ns_files = sorted(disk.folder.rglob("*.kv"), key=lambda p: p.stat().st_mtime)
    for i, path in enumerate(ns_files):  # damage every page on disk: half flipped, half truncated
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2] if i % 2 else raw[:100] + bytes([raw[100] ^ 0xFF]) + raw[101:])
    again = run(engine, prompt, "again")
    assert again.token_ids == first.token_ids
    assert engine.stats().disk_hit_tokens == 0
    assert engine.stats().cache.disk_corrupt_pages >= 1
    engine.cache.check(idle=True)
    engine.shutdown()


def test_two_workers_share_one_folder(model, tmp_path: Path) -> None:
    a, b = engine_on(model, tmp_path), engine_on(model, tmp_path)
    prompt = prompts(1, 40, seed=10)[0]
    first = run(a, prompt, "a")
    evict_everything(a)
    settle(a)
    got = run(b, prompt, "b")  # b never saw this prompt: a's pages on the shared folder serve it
    assert got.cached_tokens >= 36 and got.token_ids == first.token_ids
    a.shutdown()
    b.shutdown()


def test_disk_events_say_where_pages_live(model, tmp_path: Path) -> None:
    from radixcache.event_log import EventLog, Snapshot
    from radixcache.events import PageIndex

    engine = engine_on(model, tmp_path)
    log = EventLog(PAGE, strict=True)
    engine.cache.set_event_sink(log)
    index = PageIndex()
    prompt = prompts(1, 40, seed=11)[0]
    run(engine, prompt, "first")
    evict_everything(engine)
    settle(engine)
    events = log.drain()
    for e in events:
        index.apply(e)
    disk_stored = [e for e in events if isinstance(e, PagesStored) and e.medium == "DISK"]
    assert disk_stored and all(isinstance(e, PagesStored | PagesRemoved) for e in events)
    assert len(index.tier_dict("DISK")[""]) == engine.stats().cache.disk_pages
    # a snapshot taken now says the same
    log.snapshot(engine.cache.tree.page_records(), "t", engine.cache.tier_records())
    (snap,) = [s for s in log.drain() if isinstance(s, Snapshot)]
    fresh = PageIndex()
    fresh.load(snap.events)
    assert fresh.tier_dict("DISK") == index.tier_dict("DISK") and fresh.as_dict() == index.as_dict()
    engine.shutdown()


@pytest.mark.parametrize("policy", ["evict", "through"])
def test_warm_restart_after_shutdown_serves_from_disk_with_pins(model, tmp_path: Path, policy: str) -> None:
    engine = engine_on(model, tmp_path, kv_disk_write=policy)
    pinned, other = prompts(2, 40, seed=12)
    outs = {"p": run(engine, pinned, "p").token_ids, "o": run(engine, other, "o").token_ids}
    assert engine.pin(pinned, "", ttl_s=3600) >= 36
    settle(engine)
    written = engine.stats().cache.disk_pages
    # nothing was evicted: "through" wrote every page as it was computed, "evict" nothing yet (the shutdown will)
    assert written >= 18 if policy == "through" else written == 0
    engine.shutdown()
    again = engine_on(model, tmp_path, kv_disk_write=policy)
    again.run_until_idle()
    assert again.cache.pinned_pages() >= 9  # the pin came back first, loaded from disk, with its TTL
    ttl_left = min(pin.until for pin in again.cache.tree.pins()) - again.cache.tree.clock()
    assert 3000 < ttl_left <= 3600
    for rid, prompt in (("p", pinned), ("o", other)):
        out = run(again, prompt, rid)
        assert out.cached_tokens >= 36 and out.token_ids == outs[rid]
    again.cache.check(idle=True)
    again.shutdown()


def test_a_flush_while_a_load_is_under_way_brings_nothing_back(model, tmp_path: Path) -> None:
    engine = engine_on(model, tmp_path)
    prompt = prompts(1, 40, seed=13)[0]
    run(engine, prompt, "first", "t")
    evict_everything(engine)
    settle(engine)
    link = engine.cache.tier
    job = link.start_load("probe", prompt, "t", len(prompt))
    assert job is not None and len(job.keys) >= 9  # on disk, on its way
    engine.cache.flush("t")  # before the load is written into the pool
    assert link.wait(10)
    link.finish_loads()
    assert job.finished and not job.loaded and job.lease.released
    assert engine.cache.match_length(prompt, "t") == 0 and run(engine, prompt, "again", "t").cached_tokens == 0
    engine.cache.check(idle=True)
    engine.shutdown()


def test_tier_flags_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    from radixcache.worker.cli import check_tier_flags, parser

    def why(*argv: str) -> str | None:
        return check_tier_flags(parser().parse_args(list(argv)))

    assert why("--kv-disk-size", "1GiB") == "--kv-disk-size needs --kv-disk DIR"
    assert "--no-cache" in why("--kv-disk", str(tmp_path), "--no-cache")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert why("--kv-disk", str(blocker / "sub")).startswith(f"--kv-disk {blocker / 'sub'}:")
    assert why("--kv-disk", str(tmp_path / "new"), "--kv-disk-size", "2GiB", "--kv-host-memory", "1GiB") is None
    assert (tmp_path / "new").is_dir()


def test_stats_and_prometheus_split_hits_by_tier(model, tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from radixcache.worker.grpc.servicer import cache_stats_message
    from radixcache.worker.metrics import WorkerMetrics

    engine = engine_on(model, tmp_path)
    prompt = prompts(1, 40, seed=14)[0]
    run(engine, prompt, "first")
    run(engine, prompt, "device")  # hits memory
    evict_everything(engine)
    settle(engine)
    run(engine, prompt, "disk")  # hits disk
    stats = engine.stats()
    device = stats.cache.hit_tokens - stats.disk_hit_tokens
    assert stats.disk_hit_tokens >= 36 and device >= 36
    text = generate_latest(WorkerMetrics(lambda: stats).registry).decode()
    assert f'radixcache_cache_hit_tokens_by_tier_total{{tier="disk"}} {float(stats.disk_hit_tokens)}' in text
    assert f'radixcache_cache_hit_tokens_by_tier_total{{tier="device"}} {float(device)}' in text
    assert f'radixcache_tier_pages{{tier="disk"}} {float(stats.cache.disk_pages)}' in text
    message = cache_stats_message(stats)
    assert message.disk_hit_tokens == stats.disk_hit_tokens and message.disk_ready and message.disk_pages > 0
    engine.shutdown()


def test_a_request_waits_while_loads_under_way_pin_the_pages_it_needs(model, tmp_path: Path) -> None:
    """Nothing is running, but a load from the tiers holds (locks) the prefix it extends: a request that fits the
    pool alone, not beside that lock, waits for the load to finish instead of being refused as too big."""
    from radixcache.worker.engine.request import FinishReason

    engine = engine_on(model, tmp_path)
    extended = prompts(1, 40, seed=21)[0]
    expected = run(engine, extended, "first").token_ids
    settle(engine)
    engine.cache.evict(7)  # its last pages leave memory (they are on disk); its first pages stay
    held = engine.cache.match_length(extended, "")
    assert 0 < held < len(extended) - PAGE
    big = prompts(1, 37 * PAGE, seed=22)[0]  # 37 of the pool's 40 pages (+2 for its output): not beside the lock
    outs: dict[str, list[RequestOutput]] = {"extended": [], "big": []}
    engine.submit(Request("extended", extended, GREEDY), outs["extended"].append)  # first in line: most cached
    engine.submit(Request("big", big, GREEDY), outs["big"].append)
    engine.run_until_idle()
    last = {name: o[-1] for name, o in outs.items()}
    assert last["big"].finish_reason == FinishReason.LENGTH, last["big"].error
    assert [t for o in outs["big"] for t in o.token_ids] == run(engine_on(model, None), big, "alone").token_ids
    assert [t for o in outs["extended"] for t in o.token_ids] == expected
    assert last["extended"].cached_tokens > held  # it was served from its load
    engine.cache.check(idle=True)
    engine.shutdown()


@pytest.mark.parametrize("threaded", [False, True], ids=["stepped", "engine-thread"])
def test_a_load_that_arrives_while_others_hold_the_pool_waits_for_room_instead_of_coming_back_cut(
    model, tmp_path: Path, threaded: bool
) -> None:
    """A prompt's pages come back from disk while a long request holds most of the pool: the load waits (whole) for
    that request to give its pages back, and the prompt is then served every page from the cache, not the few that
    fitted when the load arrived. Stepped by the test, and by the engine's own thread (whose loop also takes in
    arrived loads between steps)."""
    import threading

    engine = engine_on(model, tmp_path)
    prompt = prompts(1, 40, seed=31)[0]
    expected = run(engine, prompt, "first").token_ids
    settle(engine)
    evict_everything(engine)
    assert engine.cache.match_length(prompt, "") == 0
    outs: dict[str, list[RequestOutput]] = {"long": [], "again": []}
    long_prompt = prompts(1, 32 * PAGE, seed=32)[0]  # 32 of the pool's 40 pages, and 6 more as it generates
    done = threading.Event()

    def again_out(out: RequestOutput) -> None:
        outs["again"].append(out)
        if out.finish_reason is not None:
            done.set()

    long = Request("long", long_prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    if threaded:
        engine.start()
        engine.submit(long, outs["long"].append)
        for _ in range(500):  # until the long request is generating
            if outs["long"]:
                break
            time.sleep(0.01)
        engine.submit(Request("again", prompt, GREEDY), again_out)
        assert done.wait(60)
    else:
        engine.submit(long, outs["long"].append)
        for _ in range(3):
            engine.step()  # the long request runs
        engine.submit(Request("again", prompt, GREEDY), again_out)
        engine.run_until_idle()
    again = outs["again"][-1]
    assert [t for o in outs["again"] for t in o.token_ids] == expected
    assert again.cached_tokens == len(prompt) - 1, again.cached_tokens  # all of it (cut at the arrival: 8 tokens)
    if threaded:
        engine.shutdown()  # drains: the long request finishes first
    assert outs["long"][-1].finish_reason is not None and outs["long"][-1].error is None
    if not threaded:
        engine.cache.check(idle=True)
        engine.shutdown()
