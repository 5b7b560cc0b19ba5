"""The cluster's routing pieces without Ray: the prefix index, the policy, the load view, the event hub's log and
snapshots, and the feed between replicas, hub and routers across hub restarts (actor handles faked in-process)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from helpers import FakeClock

from radixcache.cluster.decide import Decider
from radixcache.cluster.events_feed import HubLink
from radixcache.cluster.hub import REPORT_DRAIN, REPORT_OK, REPORT_REGISTER, EventHub, Poll
from radixcache.cluster.index import PrefixIndex
from radixcache.cluster.load import LoadView
from radixcache.cluster.policy import (
    Candidate,
    LoadWeights,
    Policy,
    RoutingThresholds,
    cheapest,
    choose,
    cost,
    imbalanced,
    key_home,
)
from radixcache.cluster.reuse import ReuseTracker
from radixcache.cluster.view import FleetView
from radixcache.worker.engine.api import EngineLoad


def test_match_counts_leading_cached_pages_per_namespace():
    index = PrefixIndex()
    index.stored("a", "t1", [1, 2, 3])
    assert index.match("a", "t1", [1, 2, 3, 4]) == 3
    assert index.match("a", "t1", [1, 9, 3]) == 1  # stops at the first page it lacks
    assert index.match("a", "t2", [1, 2, 3]) == 0  # another tenant's cache never counts
    assert index.match("b", "t1", [1, 2, 3]) == 0
    index.removed("a", "t1", [3])
    assert index.match("a", "t1", [1, 2, 3]) == 2
    index.cleared("a", "t1")
    assert index.match("a", "t1", [1, 2, 3]) == 0


def test_inflight_pages_count_until_they_expire_or_events_confirm_them():
    clock = FakeClock()
    index = PrefixIndex(inflight_ttl_s=5.0, clock=clock)
    index.routed("a", "", [1, 2])
    assert index.match("a", "", [1, 2, 3]) == 2  # sent moments ago: stick to it before any event arrives
    assert index.held_pages("a") == 2 and index.held_pages("b") == 0
    index.stored("a", "", [1])  # confirmed: no longer in flight
    clock.now = 10.0
    assert index.match("a", "", [1, 2]) == 1  # page 2 expired without a stored event
    index.removed("a", "", [1])
    assert index.match("a", "", [1]) == 0  # eviction corrects the view


def test_apply_replays_hub_events_and_snapshot_round_trips():
    index = PrefixIndex()
    index.apply("a", [("reset",), ("stored", "", [1, 2]), ("stored", "x", [7]), ("removed", "", [2])])
    index.apply("b", [("stored", "", [1])])
    assert index.cached_hashes("a", "") == {1} and index.cached_hashes("a", "x") == {7}
    copy = PrefixIndex()
    for replica, events in index.snapshot():
        copy.apply(replica, events)
    assert {r: (copy.cached_hashes(r, ""), copy.cached_hashes(r, "x")) for r in "ab"} == {
        "a": ({1}, {7}),
        "b": ({1}, set()),
    }
    index.apply("a", [("reset",)])
    assert index.cached_hashes("a", "") == set() and index.cached_hashes("a", "x") == set()
    with pytest.raises(ValueError, match="unknown cache event"):
        index.apply("a", [("bogus",)])


PAGE = 16


def test_policy_prefers_the_longest_match_unless_load_is_imbalanced():
    t = RoutingThresholds(balance_abs=4, balance_rel=2.0, min_match_pages=2)
    rng = random.Random(0)
    prompt = 10 * PAGE + 5
    cached = Candidate("a", requests=3, matched_pages=10)
    idle = Candidate("b", requests=0, matched_pages=0)
    assert choose([cached, idle], prompt, PAGE, t, rng=rng).replica == "a"  # 3 - 0 is within balance_abs
    busy = Candidate("a", requests=9, matched_pages=10)
    assert imbalanced([9, 0], t)
    assert choose([busy, idle], prompt, PAGE, t, rng=rng).replica == "b"
    assert not imbalanced([9, 5], t)  # 9 is less than 2x 5: still balanced
    assert choose([busy, Candidate("b", 5, 0)], prompt, PAGE, t, rng=rng).replica == "a"
    short = Candidate("a", requests=1, matched_pages=1, queued_tokens=100)  # below min_match_pages: load decides
    assert choose([short, idle], prompt, PAGE, t, rng=rng).replica == "b"
    tie = [Candidate("a", 2, 4, queued_tokens=100), Candidate("b", 1, 4)]
    assert choose(tie, prompt, PAGE, t, rng=rng).replica == "b"  # equal matches: the less loaded
    # Imbalanced, an idle replica whose pool is full of much-used pages still takes the request: what it would
    # evict is a cache consideration, and load alone decides (the CI failure of the saturated-replica e2e test).
    crowded = Candidate("b", requests=0, matched_pages=0, free_tokens=0, victim_uses=(50,) * 11)
    assert choose([busy, crowded], prompt, PAGE, t, rng=rng).replica == "b"


def test_policy_weighs_cached_tokens_against_load_in_tokens():
    w = LoadWeights(queued=1.0, requests=32.0, kv=1.0)  # requests weighs more than its default here
    rng = random.Random(0)
    prompt = 64 * PAGE  # 1,024 tokens, all cached on "a"
    cached = dict(replica="a", requests=0, matched_pages=64)
    # The cached prefix is worth ~1,023 tokens of prefill: a queue shorter than that keeps the request there...
    a = Candidate(**cached, queued_tokens=900)
    assert choose([a, Candidate("b", 0, 0)], prompt, PAGE, w=w, rng=rng).replica == "a"
    # ...a longer one makes recomputing it on the idle replica sooner.
    a = Candidate(**cached, queued_tokens=1100)
    assert choose([a, Candidate("b", 0, 0)], prompt, PAGE, w=w, rng=rng).replica == "b"
    # Running requests count 32 tokens each, below the imbalance rule (counts 0 and 40 would be imbalanced).
    assert cost(Candidate("a", 31, 64), prompt, prompt - 1, w) < cost(Candidate("b", 0, 0), prompt, 0, w)
    assert cost(Candidate("a", 33, 64), prompt, prompt - 1, w) > cost(Candidate("b", 0, 0), prompt, 0, w)
    # No match anywhere: the replica whose KV pool is less busy computes it (its pages need not wait or evict).
    full, free = Candidate("a", 0, 0, kv_busy=0.9), Candidate("b", 0, 0, kv_busy=0.1)
    assert choose([full, free], prompt, PAGE, w=w, rng=rng).replica == "b"
    # ...but a pool busy with the prompt's own cached prefix costs nothing: only uncached tokens need pages.
    assert cost(Candidate("a", 0, 64, kv_busy=0.9), prompt, prompt - 1, w) == pytest.approx(1 + 0.9)
    # A new prefix goes where it fits without pushing cached pages out (a restarted, empty replica takes it).
    fresh, full = Candidate("new", 0, 0, free_tokens=4096), Candidate("old", 0, 0, free_tokens=100)
    assert choose([full, fresh], prompt, PAGE, w=w, rng=rng).replica == "new"
    assert cost(full, prompt, 0, w) == cost(fresh, prompt, 0, w) + (prompt - 100)
    roomy = [Candidate("a", 0, 0, free_tokens=2000), Candidate("b", 0, 0, free_tokens=4000)]
    assert cost(roomy[0], prompt, 0, w) == cost(roomy[1], prompt, 0, w)  # both have room: no preference
    with pytest.raises(ValueError, match="requests"):
        LoadWeights(requests=-1)


def test_policy_spreads_prompts_that_share_nothing():
    policy = Policy()
    counts = {"a": 0, "b": 0, "c": 0}
    for _ in range(20):  # tied candidates take turns: exactly even, however few prompts
        counts[policy.pick([Candidate("b", 0, 0), Candidate("a", 0, 0)], 128, PAGE).replica] += 1
    assert counts == {"a": 10, "b": 10, "c": 0}
    busy = Candidate("b", 1, 0, queued_tokens=64)  # a queue of half the prompt: a real difference, not a turn
    assert policy.pick([Candidate("a", 0, 0), busy], 128, PAGE).replica == "a"
    assert policy.pick([Candidate("a", 0, 0), busy], 128, PAGE).replica == "a"
    rng = random.Random(1)
    for _ in range(200):  # `choose` breaks ties at random
        counts[choose([Candidate("a", 0, 0), Candidate("c", 0, 0)], 128, PAGE, rng=rng).replica] += 1
    assert 80 <= counts["c"] <= 120


def test_a_new_prefix_displaces_the_least_asked_for_cache():
    w = LoadWeights()
    prompt = 4 * PAGE
    hot = Candidate("hot", 0, 0, free_tokens=0, victim_uses=(9, 9, 8, 8))  # would evict pages asked for 8-9 times
    cold = Candidate("cold", 0, 0, free_tokens=0, victim_uses=(1, 1, 1, 0))
    assert choose([hot, cold], prompt, PAGE, w=w).replica == "cold"
    assert cost(cold, prompt, 0, w, PAGE) == prompt + PAGE * 4  # each page at least once: the plain evicted tokens
    assert cost(hot, prompt, 0, w, PAGE) == prompt + PAGE * 34
    roomy = Candidate("roomy", 0, 0, free_tokens=2 * PAGE, victim_uses=(9, 9, 8, 8))  # evicts only 2 pages
    assert cost(roomy, prompt, 0, w, PAGE) == prompt + PAGE * 18
    unnamed = Candidate("x", 0, 0, free_tokens=0, victim_uses=(5,))  # pages the mirror cannot name count once
    assert cost(unnamed, prompt, 0, w, PAGE) == prompt + PAGE * (5 + 3)


def test_the_index_keeps_each_pages_medium_and_counts_tier_pages_after_the_device_run():
    index = PrefixIndex()
    index.apply("a", [("stored", "", [1, 2]), ("stored", "", [3, 4], "DISK"), ("stored", "", [5], "CPU")])
    assert index.match_split("a", "", [1, 2, 3, 4, 5, 6]) == (2, 3)  # device 1-2, then loaded: 3-4 disk, 5 host
    assert index.match("a", "", [1, 2, 3, 4]) == 2 and index.held_pages("a") == 2  # the device alone
    assert index.cached_hashes("a", "", "DISK") == {3, 4} and not index.holds("a", "", 3)
    index.apply("b", [("stored", "", [1, 2], "DISK")])  # only on disk (a restarted replica, a sibling's files)
    assert index.match_split("b", "", [1, 2, 3]) == (0, 2) and index.match_split("b", "x", [1, 2]) == (0, 0)
    index.apply("a", [("removed", "", [4], "DISK")])
    assert index.match_split("a", "", [1, 2, 3, 4, 5]) == (2, 1)  # stops at the first page no tier holds
    index.apply("a", [("stored", "", [4, 5])])  # loaded back into the device
    assert index.match_split("a", "", [1, 2, 3, 4, 5]) == (2, 1)  # (3 is on disk only: the device run stops at it)
    copy = PrefixIndex()
    for replica, events in index.snapshot():
        copy.apply(replica, events)
    assert copy.match_split("a", "", [1, 2, 3, 4, 5]) == (2, 1) and copy.match_split("b", "", [1, 2]) == (0, 2)
    index.cleared("b", "")  # a flush of the device: the tier's pages go by their own removals
    assert index.match_split("b", "", [1, 2]) == (0, 2)
    index.apply("b", [("reset",)])
    assert index.match_split("b", "", [1, 2]) == (0, 0)


def test_pages_in_the_fleets_store_are_loadable_by_every_replica_and_score_below_the_device():
    index = PrefixIndex()
    index.apply("a", [("stored", "", [1, 2, 3, 4]), ("stored", "", [1, 2, 3, 4], "STORE")])
    index.apply("b", [("stored", "", [9])])  # b holds none of it, but can load it from the store
    index.apply("c", [("stored", "", [1], "DISK")])
    assert index.match_split("a", "", [1, 2, 3, 4]) == (4, 0)
    assert index.match_split("b", "", [1, 2, 3, 4, 5]) == (0, 4)  # stops where the store ends
    assert index.match_split("c", "", [1, 2, 3, 4]) == (0, 4)  # its disk's page 1, then the store's 2-4
    assert index.match_split("b", "x", [1, 2]) == (0, 0)  # another tenant's prompt loads nothing
    assert index.cached_hashes("b", "", "STORE") == set()  # reported by a, counted for all
    index.apply("a", [("removed", "", [3], "STORE")])
    assert index.match_split("b", "", [1, 2, 3, 4]) == (0, 2)
    index.forget("a")  # the store outlives a replica, but only what the living report is known
    assert index.match_split("b", "", [1, 2]) == (0, 0)


def test_the_index_tells_the_pages_only_the_store_holds_from_a_replicas_own_tier_pages():
    index = PrefixIndex()
    index.apply("a", [("stored", "", [1, 2, 3, 4], "STORE")])
    index.apply("c", [("stored", "", [1, 2], "DISK")])
    index.apply("b", [("stored", "", [9])])
    assert index.match_tiers("c", "", [1, 2, 3, 4]) == (0, 4, 2)  # pages 1-2 from its own disk, 3-4 from the store
    assert index.match_tiers("b", "", [1, 2, 3, 4]) == (0, 4, 4)  # b holds nothing of its own
    assert index.match_tiers("a", "", [1, 2]) == (0, 2, 2)  # reporting a page in the store is not holding it
    # What a pool losing a page costs: where a copy is kept below the device for that replica.
    assert [index.copy_below("c", "", h) for h in (1, 3, 9)] == ["DISK", "STORE", None]  # its own tier first
    assert index.copy_below("b", "", 3) == "STORE" and index.copy_below("b", "x", 3) is None


def test_a_pool_that_spills_into_the_fleets_store_still_takes_its_turn_with_unrelated_prompts():
    """cluster_bench --store, present trace (router log, 2026-12-04): 19 of the 20 unrelated prompts went to one
    replica. The other's pool was full of pages asked for ~6 times each, so the 4 pages a prompt would push out
    counted 384 tokens, six times the load noise tolerated, though the store kept a copy of every one of them: a
    page kept below the device costs its reload, scored as the tiers' and the store's hits are."""
    w = LoadWeights()
    policy = Policy()
    prompt = 8 * PAGE
    roomy = Candidate("a", 0, 0, free_tokens=2048)
    spilled = Candidate("b", 0, 0, free_tokens=4 * PAGE, victim_uses=(6,) * 4, victim_media=("STORE",) * 4)
    assert cost(spilled, prompt, 0, w, PAGE) == pytest.approx(prompt + PAGE * 24 * w.store)
    picks = [policy.pick([roomy, spilled], prompt, PAGE).replica for _ in range(10)]
    assert picks.count("b") == 5
    nowhere = dataclasses.replace(spilled, victim_media=(None,) * 4)  # no copy anywhere: a recompute each
    assert cost(nowhere, prompt, 0, w, PAGE) == prompt + PAGE * 24
    assert {policy.pick([roomy, nowhere], prompt, PAGE).replica for _ in range(4)} == {"a"}
    disk = dataclasses.replace(spilled, victim_media=("DISK", "DISK", None))  # the last two: no copy known
    assert cost(disk, prompt, 0, w, PAGE) == pytest.approx(prompt + PAGE * (12 * w.tier + 12))
    # The decider names each victim's copy from the events: b's pool of 2 pages is full, page 1 is in the store.
    view = FleetView()
    events = [("stored", "", [1, 2]), ("stored", "", [1], "STORE")]
    view.apply(Poll("epoch", 1, False, [("b", events)], {"b": EngineLoad(0, 0, 0, 0, 2, 0)}))
    built = Decider(view, Policy(), PAGE)._candidate("b", "", [7, 8], 2 * PAGE, 0)
    assert (built.victim_uses, built.victim_media) == ((0, 0), ("STORE", None))


def test_a_prefix_on_a_replicas_own_disk_beats_the_same_prefix_only_in_the_fleets_store():
    w = LoadWeights()
    prompt = 64 * PAGE  # 1,024 tokens
    disk = Candidate("disk", 0, matched_pages=0, tier_pages=64)
    store = Candidate("store", 0, matched_pages=0, tier_pages=64, store_pages=64)
    nothing = Candidate("nothing", 0, 0)
    device = Candidate("device", 0, matched_pages=64)
    ranked = [c.replica for c in sorted([nothing, store, disk, device], key=lambda c: cost(
        c, prompt, c.matched_pages * PAGE, w, PAGE, c.tier_pages * PAGE, 0, c.store_pages * PAGE))]  # fmt: skip
    assert ranked == ["device", "disk", "store", "nothing"]
    assert [c.replica for c in cheapest([store, disk], prompt, PAGE, w=w)] == ["disk"]
    assert [c.replica for c in cheapest([nothing, store], prompt, PAGE, w=w)] == ["store"]
    # the store's tokens cost 1/10.6 of a recompute each (store_bench's cross_replica_rehit_speedup)
    assert cost(store, prompt, 0, w, PAGE, prompt - 1, 0, prompt - 1) == pytest.approx(1 + w.store * (prompt - 1))
    # at equal weights they tie, and load decides between them
    equal = LoadWeights(store=w.tier)
    assert [c.replica for c in cheapest([store, disk], prompt, PAGE, w=equal)] == ["store", "disk"]
    with pytest.raises(ValueError, match="store"):
        LoadWeights(store=-1.0)


def test_a_prefix_on_device_beats_one_on_disk_which_beats_nothing_at_equal_load():
    w = LoadWeights()
    prompt = 64 * PAGE  # 1,024 tokens
    device = Candidate("device", 0, matched_pages=64)
    disk = Candidate("disk", 0, matched_pages=0, tier_pages=64)
    nothing = Candidate("nothing", 0, 0)
    assert [c.replica for c in cheapest([nothing, disk, device], prompt, PAGE, w=w)] == ["device"]
    assert [c.replica for c in cheapest([nothing, disk], prompt, PAGE, w=w)] == ["disk"]
    # the disk's 1,023 tokens cost 1/19.3 of a recompute each (tier_bench's disk_rehit_ttft_speedup)
    assert cost(disk, prompt, 0, w, PAGE, prompt - 1) == pytest.approx(1 + w.tier * (prompt - 1))
    assert 40 < cost(disk, prompt, 0, w, PAGE, prompt - 1) < 60
    # a prefix half in the device and half on disk beats the same half in the device with nothing after it
    half = Candidate("half", 0, 32)
    assert choose([half, Candidate("half+disk", 0, 32, tier_pages=32)], prompt, PAGE, w=w).replica == "half+disk"
    # below a device page, above nothing: a queue of 200 tokens outweighs the loads, one of 1,100 a recompute
    assert choose([Candidate("device", 0, 64, queued_tokens=200), disk], prompt, PAGE, w=w).replica == "disk"
    busy_disk = Candidate("disk", 0, 0, tier_pages=64, queued_tokens=900)
    assert choose([busy_disk, nothing], prompt, PAGE, w=w).replica == "disk"
    assert choose([Candidate("disk", 0, 0, tier_pages=64, queued_tokens=1100), nothing], prompt, PAGE, w=w).replica == (
        "nothing"
    )
    # imbalanced load ignores the tiers as it ignores the device's cache; min_match_pages counts both
    t = RoutingThresholds(balance_abs=4, balance_rel=2.0, min_match_pages=3)
    assert choose([Candidate("disk", 9, 0, tier_pages=64), Candidate("idle", 0, 0)], prompt, PAGE, t).replica == "idle"
    two = Candidate("short", 0, 1, tier_pages=1)
    assert [c.replica for c in cheapest([two, nothing], prompt, PAGE, t)] == ["short", "nothing"]
    assert [c.replica for c in cheapest([Candidate("three", 0, 1, tier_pages=2), nothing], prompt, PAGE, t)] == [
        "three"
    ]
    with pytest.raises(ValueError, match="tier"):
        LoadWeights(tier=-0.5)


def test_tier_pages_reach_the_hub_with_their_medium_and_never_count_as_evictable():
    from radixcache.cluster.events_feed import hub_events
    from radixcache.events import NamespaceCleared, PagesRemoved, PagesStored

    events = [
        PagesStored("", None, [1], list(range(PAGE))),
        PagesStored("", 1, [2], list(range(PAGE)), "DISK"),
        PagesRemoved("", [1]),
        PagesRemoved("", [2], "DISK"),
        NamespaceCleared(""),
    ]
    assert hub_events(events) == [
        ("stored", "", [1]),
        ("stored", "", [2], "DISK"),
        ("removed", "", [1]),
        ("removed", "", [2], "DISK"),
        ("cleared", ""),
    ]
    reuse = ReuseTracker()
    reuse.apply("a", [("stored", "", [1]), ("stored", "", [2, 3], "DISK")])
    assert victim_uses(reuse, "a", 10, lambda *_: True) == [0]  # the pool would evict page 1, never a disk page
    reuse.apply("a", [("removed", "", [1], "DISK")])  # a tier dropping its copy leaves the device's page listed
    assert victim_uses(reuse, "a", 10, lambda *_: True) == [0]


def test_reuse_tracker_mirrors_each_replicas_lru_order_and_counts_uses():
    reuse = ReuseTracker(age_every=4)
    held = {("a", "", h) for h in (1, 2, 3, 4, 5)}

    def holds(replica, namespace, h):
        return (replica, namespace, h) in held

    reuse.apply("a", [("stored", "", [1, 2])])  # computed (a pin, a generated turn): joins the back, never asked for
    reuse.routed("a", "", [3, 4])
    reuse.routed("a", "", [3, 4, 5])
    reuse.routed("a", "", [1])  # asked for again: moves to the back
    assert victim_uses(reuse, "a", 3, holds) == [0, 2, 2]  # pages 2, 3, 4 go first
    held.discard(("a", "", 3))  # the index says it is gone (an event the mirror missed): dropped on the way
    assert victim_uses(reuse, "a", 10, holds) == [0, 2, 1, 1]
    reuse.apply("a", [("removed", "", [2]), ("cleared", "x")])
    assert victim_uses(reuse, "a", 10, holds) == [2, 1, 1]
    reuse.routed("a", "", [5])  # the 4th routed prompt: every count halves
    assert (reuse.uses("", 4), reuse.uses("", 5), reuse.uses("", 1)) == (1, 1, 0)  # 2, 2, 1 halved
    reuse.apply("a", [("reset",)])
    assert victim_uses(reuse, "a", 10, holds) == [] and victim_uses(reuse, "b", 1, holds) == []


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="balance_rel"):
        RoutingThresholds(balance_rel=0.5)
    with pytest.raises(ValueError, match="min_match_pages"):
        RoutingThresholds(min_match_pages=0)
    with pytest.raises(ValueError, match="no candidate"):
        choose([], 16, PAGE)


def victim_uses(reuse: ReuseTracker, replica, pages, holds) -> list[int]:
    """The request counts of the pages `replica` would evict next (ReuseTracker.victims)."""
    return [uses for _, uses in reuse.victims(replica, pages, holds)]


def load(running=0, waiting=0, queued=0, busy=0, total=100) -> EngineLoad:
    return EngineLoad(running, waiting, queued, busy, total, steps=0)


def test_load_view_adds_what_the_router_sent_until_a_report_covers_it():
    clock = FakeClock()
    view = LoadView(report_lag_s=0.2, max_age_s=5.0, clock=clock)
    first, second = view.routed("a", 1000), view.routed("a", 24)
    assert (view.requests("a"), view.queued_tokens("a"), view.kv_busy("a")) == (2, 1024, 0.0)
    clock.now = 0.1
    view.reported("a", load(running=1, queued=1000, busy=25))  # sent 0.1 s ago: maybe not in it yet
    assert view.queued_tokens("a") == 1000 + 1024 and view.kv_busy("a") == 0.25
    clock.now = 0.5
    view.reported("a", load(running=5, queued=300))  # arrived 0.5 s after the sends: includes them
    assert view.queued_tokens("a") == 300
    assert view.requests("a") == 5  # the replica's count (other routers' requests too) when larger than ours
    view.finished("a", first)
    view.finished("a", second)
    view.reported("a", load())
    assert view.requests("a") == 0
    done = view.routed("b", 70)
    view.finished("b", done)
    assert view.queued_tokens("b") == 0  # a request that ended queues nothing, report or not
    view.routed("b", 50)
    clock.now = 10.0  # no report ever came (the hub is down): what was sent ages out
    assert view.queued_tokens("b") == 0 and view.requests("b") == 1
    assert view.pages_total("a") == 100 and view.pages_total("b") is None
    view.forget("b")
    assert view.requests("b") == 0


def test_hub_log_snapshot_and_forget():
    async def scenario() -> None:
        hub = EventHub(max_log=3)
        epoch = await hub.register("r1")
        assert await hub.register("r2") == epoch
        await hub.publish("r1", epoch, [("stored", "", [1, 2])])
        first = await hub.poll(0, None, 0.01)  # a new router: a snapshot
        assert (
            first.reset and first.epoch == epoch and dict(first.batches)["r1"] == [("reset",), ("stored", "", [1, 2])]
        )
        await hub.publish("r2", epoch, [("stored", "", [5])])
        second = await hub.poll(first.cursor, epoch, 0.01)
        assert not second.reset and second.batches == [("r2", [("stored", "", [5])])]
        assert second.cursor == first.cursor + 1
        assert await hub.poll(second.cursor, epoch, 0.01) == Poll(epoch, second.cursor, False, [], {})
        for i in range(5):  # the log keeps 3 batches: a router that far behind gets a snapshot
            await hub.publish("r1", epoch, [("stored", "", [10 + i])])
        behind = await hub.poll(second.cursor, epoch, 0.01)
        assert behind.reset and dict(behind.batches)["r2"] == [("reset",), ("stored", "", [5])]
        assert await hub.report("r1", epoch, load(queued=7)) == REPORT_OK
        assert (await hub.poll(behind.cursor, epoch, 0.01)).loads == {"r1": load(queued=7)}
        await hub.forget("r2")
        assert await hub.replicas() == ["r1"]
        await hub.publish("r2", epoch, [("stored", "", [6])])  # a late batch from the dead replica is dropped
        assert "r2" not in dict((await hub.poll(0, None, 0.01)).batches)
        assert await hub.report("r2", epoch, load()) == REPORT_DRAIN  # ...and, if it still runs, that it is stopped
        assert await hub.register("r2") == epoch and await hub.report("r2", epoch, load()) == REPORT_OK  # came back

    asyncio.run(scenario())


def test_a_new_hub_has_a_new_epoch_and_refuses_the_old_one():
    async def scenario() -> None:
        old, new = EventHub(), EventHub()
        old_epoch = await old.register("r1")
        new_epoch = await new.register("r1")
        assert old_epoch != new_epoch
        await new.publish("r1", old_epoch, [("stored", "", [1])])  # sent before the restart: dropped
        assert await new.cached_hashes("r1", "") == set()
        assert await new.report("r1", old_epoch, load()) == REPORT_REGISTER  # register (and resync) again
        poll = await new.poll(17, old_epoch, 0.01)  # a router that followed the old hub: this one's snapshot
        assert poll.reset and poll.epoch == new_epoch and poll.batches == [("r1", [("reset",)])]

    asyncio.run(scenario())


def test_fleet_view_keeps_a_replica_until_it_registers_with_a_restarted_hub():
    clock = FakeClock()
    view = FleetView(stale_s=10.0, clock=clock)
    view.apply(Poll("e1", 2, True, [("a", [("reset",), ("stored", "", [1, 2])]), ("b", [("stored", "", [3])])], {}))
    assert view.index.match("a", "", [1, 2]) == 2
    view.apply(Poll("e2", 1, True, [("b", [("reset",)])], {}))  # the hub restarted; only b registered so far
    assert view.index.match("a", "", [1, 2]) == 2 and view.unconfirmed == ["a"]  # a's cache did not go anywhere
    assert view.index.cached_hashes("b", "") == set() and view.hub_restarts == 1
    view.apply(Poll("e2", 2, False, [("a", [("reset",), ("stored", "", [1])])], {}))  # a registered and resent
    assert view.index.match("a", "", [1, 2]) == 1 and view.unconfirmed == []
    view.apply(Poll("e3", 0, True, [], {"b": load(queued=5)}))  # another restart: nobody registers in time
    clock.now = 11.0
    view.apply(Poll("e3", 0, False, [], {}))
    assert view.index.cached_hashes("a", "") == set() and view.unconfirmed == []
    assert view.loads.queued_tokens("b") == 5
    view.apply(Poll("e3", 1, False, [("a", [("stored", "", [9])])], {}))
    view.apply(Poll("e3", 9, True, [("b", [("reset",)])], {}))  # same hub, fell behind: a is gone from it
    assert view.index.cached_hashes("a", "") == set()


class FakeActor:
    """An actor handle over an object in this process: `handle.method.remote(...)` schedules the coroutine.
    `kill()` makes every later call fail, as calls to a dead actor do."""

    def __init__(self, target: object) -> None:
        self.target, self.dead = target, False

    def __getattr__(self, name: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                async def call():
                    if actor.dead:
                        raise RuntimeError("actor died")
                    return await getattr(actor.target, name)(*args)

                return asyncio.ensure_future(call())

        return Method


def test_replicas_and_routers_recover_from_a_hub_restart():
    """The replica's link and the router's view, wired through an in-process hub that is killed and replaced (as
    Ray restarts it: same name, empty, new epoch): both find the new one and the router's view of the replica's
    cache is whole again within one report period, with the events in between included."""

    async def scenario() -> None:
        hubs = [FakeActor(EventHub())]
        cache: set[int] = set()  # what the replica's engine holds (its snapshot)
        resyncs = []

        link = HubLink("r1", connect=lambda: hubs[-1], load=lambda: asyncio.sleep(0, load(queued=3)),
                       resync=lambda: asyncio.sleep(0, resyncs.append(1)), period_s=0.01)  # fmt: skip

        def store(*hashes: int) -> None:
            cache.update(hashes)
            link.publish([("stored", "", list(hashes))])

        async def resync() -> None:  # what CacheEventHub.resync_publishers does: a reset + the whole cache
            resyncs.append(1)
            link.publish([("reset",), ("stored", "", sorted(cache))])

        link._resync = resync
        await link.register()
        link.start()
        view = FleetView()
        feed = asyncio.ensure_future(view.run(lambda: hubs[-1], retry_s=0.01))
        store(1, 2)

        async def until(condition, timeout=5.0) -> float:
            start = asyncio.get_running_loop().time()
            while not condition():
                assert asyncio.get_running_loop().time() - start < timeout, "not recovered"
                await asyncio.sleep(0.005)
            return asyncio.get_running_loop().time() - start

        await until(lambda: view.index.cached_hashes("r1", "") == {1, 2})
        hubs[-1].dead = True
        hubs.append(FakeActor(EventHub()))  # restarted: empty, another epoch
        store(3)  # lost with the old hub
        await until(lambda: view.index.cached_hashes("r1", "") == {1, 2, 3})
        assert view.hub_restarts == 1 and resyncs and link.registrations == 2
        assert view.loads.queued_tokens("r1") == 3  # load reports flow again too (as plain dicts)
        assert (await hubs[-1].target.poll(0, None, 0.01)).loads["r1"]["queued_prefill_tokens"] == 3
        store(4)  # and live events after the resync
        await until(lambda: 4 in view.index.cached_hashes("r1", ""))
        assert await link.check() == REPORT_OK  # registered: nothing to do
        drained = []
        link._on_drain = lambda: drained.append(1)
        await hubs[-1].target.forget("r1")  # a router retired it: Serve is stopping this replica
        assert await link.check() == REPORT_DRAIN and drained == [1]
        registrations = link.registrations
        await asyncio.sleep(0.05)
        assert link._task.done() and link.registrations == registrations  # it stops reporting, registers no more
        await link.close()
        feed.cancel()

    asyncio.run(scenario())


def test_a_busy_replica_reports_its_load_more_often_than_an_idle_one():
    """A report half a second old still counted prefills finished long before (they take tens of milliseconds on a
    GPU), and the router sent conversations away from the replica holding them (bench/cluster_bench.py's
    flush_restart): while the engine has requests, the link reports at the busy period."""

    async def reports(engine_load: EngineLoad) -> int:
        hub = FakeActor(EventHub())
        link = HubLink("r1", connect=lambda: hub, load=lambda: asyncio.sleep(0, engine_load),
                       resync=lambda: asyncio.sleep(0), period_s=0.2, busy_period_s=0.01)  # fmt: skip
        await link.register()
        sent = []
        report = hub.target.report

        async def counted(*args):
            sent.append(args)
            return await report(*args)

        hub.target.report = counted
        link.start()
        await asyncio.sleep(0.3)
        await link.close()
        return len(sent)

    busy, waiting, idle = (asyncio.run(reports(x)) for x in (load(running=1), load(waiting=2), load(queued=0)))
    assert busy >= 8 and waiting >= 8, (busy, waiting)  # ~every 10 ms once the first report said busy
    assert idle <= 2, idle  # every 200 ms


def test_a_cache_key_sends_a_tenants_requests_to_one_replica_while_load_is_balanced():
    t = RoutingThresholds(balance_abs=4, balance_rel=2.0)
    replicas = [f"r{i}" for i in range(4)]
    idle = [Candidate(r, requests=1, matched_pages=0) for r in replicas]
    prompt = 4 * PAGE
    homes = {}
    for k in range(200):
        picked = {
            Policy(t).pick(idle, prompt, PAGE, namespace="alice", cache_key=f"conv-{k}").replica for _ in range(3)
        }
        assert len(picked) == 1  # the same replica every time, and from another router (a fresh Policy) too
        homes[k] = picked.pop()
    assert set(homes.values()) == set(replicas)  # keys spread over the fleet...
    assert max(list(homes.values()).count(r) for r in replicas) < 80  # ...roughly evenly (50 each expected)
    # The key wins over a cached prefix elsewhere: the client asked for its requests to stay together.
    cached_elsewhere = [Candidate(r, 1, 4 if r != homes[0] else 0) for r in replicas]
    assert Policy(t).pick(cached_elsewhere, prompt, PAGE, namespace="alice", cache_key="conv-0").replica == homes[0]
    # Keys are per tenant: another tenant's same key has a home of its own (here: somewhere else for some keys).
    assert any(key_home("bob", f"conv-{k}", replicas) != homes[k] for k in range(200))
    # A replica leaving moves only the keys it held.
    fewer = [r for r in replicas if r != "r0"]
    for k, home in homes.items():
        if home != "r0":
            assert key_home("alice", f"conv-{k}", fewer) == home
    # Imbalanced: the key is ignored and load decides.
    loaded = [Candidate(r, 9 if r == homes[0] else 0, 0) for r in replicas]
    assert Policy(t).pick(loaded, prompt, PAGE, namespace="alice", cache_key="conv-0").replica != homes[0]


def test_prompts_that_share_nothing_take_turns_whatever_the_load_noise():
    """bench/cluster_bench.py's present trace sent 65-90% of its 20 unrelated prompts to one replica: the load
    figures, a report period old, always favoured the same one by a few tokens (a request more running there, a few
    percent more of its pool busy, a page less free before evicting). Differences that small are noise: with equal
    hits everywhere the tied replicas take turns, deterministically, and a real difference still decides."""
    rng = random.Random(7)
    prompt = 8 * PAGE  # 128 tokens, as in the trace
    picks = []
    policy, again = Policy(), Policy()
    for _ in range(20):
        noisy = [
            Candidate("a", requests=rng.choice([0, 1]), matched_pages=0, kv_busy=rng.uniform(0.0, 0.05)),
            Candidate(
                "b",
                requests=rng.choice([1, 2]),
                matched_pages=0,
                kv_busy=rng.uniform(0.05, 0.15),
                free_tokens=prompt - PAGE,
                victim_uses=(1,),
            ),
        ]
        assert len({cost(c, prompt, 0, LoadWeights(), PAGE) for c in noisy}) == 2  # never an exact tie
        picks.append(policy.pick(noisy, prompt, PAGE).replica)
        assert again.pick(noisy, prompt, PAGE).replica == picks[-1]  # another router given the same: the same
    assert max(picks.count(r) for r in "ab") / len(picks) <= 0.6
    assert all(x != y for x, y in zip(picks, picks[1:], strict=False))  # strictly in turn
    # Three replicas, one always a little busier: each takes a third.
    policy = Policy()
    three = [Candidate("a", 0, 0), Candidate("b", 1, 0), Candidate("c", 0, 0, kv_busy=0.1)]
    thirds = [policy.pick(three, prompt, PAGE).replica for _ in range(30)]
    assert {r: thirds.count(r) for r in "abc"} == {"a": 10, "b": 10, "c": 10}
    # Concurrent decisions (nothing routed yet, the same figures each time) alternate too.
    assert [Policy().pick(three[:2], prompt, PAGE).replica] == ["a"]
    # A real difference is no noise: a queued prefill as long as the prompt, a pool full of much-used pages.
    policy = Policy()
    queued = Candidate("b", 0, 0, queued_tokens=prompt)
    assert {policy.pick([Candidate("a", 0, 0), queued], prompt, PAGE).replica for _ in range(6)} == {"a"}
    hot = Candidate("b", 0, 0, free_tokens=0, victim_uses=(9,) * 8)
    assert {policy.pick([Candidate("a", 0, 0, free_tokens=0), hot], prompt, PAGE).replica for _ in range(6)} == {"a"}
    # Equal hits that are not zero: the same rule on the tokens left to compute (here 32 of them, so a few are noise).
    shared = [Candidate("a", 0, 64), Candidate("b", 1, 64)]
    assert [policy.pick(shared, 64 * PAGE + 32, PAGE).replica for _ in range(4)] == ["b", "a", "b", "a"]
    # ...a cache advantage is never noise, and under imbalance load alone decides, to the token.
    assert {policy.pick([Candidate("a", 1, 64), Candidate("b", 0, 63)], 64 * PAGE + 32, PAGE).replica
            for _ in range(4)} == {"a"}  # fmt: skip
    t = RoutingThresholds(balance_abs=2, balance_rel=1.5)
    skewed = [Candidate("a", 9, 0), Candidate("b", 0, 0), Candidate("c", 1, 0)]
    assert {Policy(t).pick(skewed, prompt, PAGE).replica for _ in range(4)} == {"b"}
    with pytest.raises(ValueError, match="tie_share"):
        RoutingThresholds(tie_share=1.5)


def test_requests_this_router_saw_end_are_taken_off_the_report_that_counted_them():
    """The present trace's unrelated prompts came right after its chats: the last report still counted the four
    chats running, with 351 tokens queued, and every prompt went to the other replica until the next report."""
    clock = FakeClock()
    view = LoadView(report_lag_s=0.2, clock=clock)
    chats = [view.routed("a", 300) for _ in range(4)]
    clock.now = 0.5
    view.reported("a", load(running=4, queued=351))  # taken while the four ran
    late = view.routed("a", 128)  # sent after it: not in it
    clock.now = 0.6
    for sent in chats:
        view.finished("a", sent)
    assert view.requests("a") == 1 and view.queued_tokens("a") == 128  # what is left: ours, still running
    view.finished("a", late)  # it was never in the report: nothing more comes off
    assert view.requests("a") == 0 and view.queued_tokens("a") == 0
    clock.now = 1.0
    view.reported("a", load(running=2, queued=40))  # other routers' requests: a new report is the truth again
    assert view.requests("a") == 2 and view.queued_tokens("a") == 40
    withdrawn = view.routed("a", 50)  # counted, then never sent
    clock.now = 2.0
    view.withdrawn("a", withdrawn)
    assert view.requests("a") == 2 and view.queued_tokens("a") == 40  # the report's figures stand
