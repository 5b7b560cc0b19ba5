"""The cluster's routing pieces without Ray: the prefix index, the policy, the event hub's log and snapshots."""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers import FakeClock

from radixcache.cluster.hub import EventHub
from radixcache.cluster.index import PrefixIndex
from radixcache.cluster.policy import Candidate, RoutingThresholds, choose, imbalanced


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


def test_policy_prefers_the_longest_match_unless_load_is_imbalanced():
    t = RoutingThresholds(balance_abs=4, balance_rel=2.0, min_match_pages=2)
    rng = random.Random(0)
    cached = Candidate("a", load=3, matched_pages=10)
    idle = Candidate("b", load=0, matched_pages=0)
    assert choose([cached, idle], t, rng).replica == "a"  # 3 - 0 is within balance_abs
    busy = Candidate("a", load=9, matched_pages=10)
    assert imbalanced([9, 0], t)
    assert choose([busy, idle], t, rng).replica == "b"
    assert not imbalanced([9, 5], t)  # 9 is less than 2x 5: still balanced
    assert choose([busy, Candidate("b", 5, 0)], t, rng).replica == "a"
    short = Candidate("a", load=1, matched_pages=1)  # below min_match_pages: load decides
    assert choose([short, idle], t, rng).replica == "b"
    tie = [Candidate("a", 2, 4), Candidate("b", 1, 4)]
    assert choose(tie, t, rng).replica == "b"  # equal matches: the less loaded
    fuller = [Candidate("a", 0, 0, held_pages=300), Candidate("b", 0, 0, held_pages=100)]
    assert choose(fuller, t, rng).replica == "b"  # a new prefix goes where memory is freest


def test_policy_spreads_prompts_that_share_nothing():
    t = RoutingThresholds()
    rng = random.Random(1)
    counts = {"a": 0, "b": 0}
    for _ in range(200):
        counts[choose([Candidate("a", 0, 0), Candidate("b", 0, 0)], t, rng).replica] += 1
    assert max(counts.values()) <= 120


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="balance_rel"):
        RoutingThresholds(balance_rel=0.5)
    with pytest.raises(ValueError, match="min_match_pages"):
        RoutingThresholds(min_match_pages=0)
    with pytest.raises(ValueError, match="no candidate"):
        choose([], RoutingThresholds())


def test_hub_log_snapshot_and_forget():
    async def scenario() -> None:
        hub = EventHub(max_log=3)
        await hub.register("r1")
        await hub.register("r2")
        await hub.publish("r1", [("stored", "", [1, 2])])
        cursor, reset, batches = await hub.poll(0, 0.01)  # a new router: a snapshot
        assert reset and dict(batches)["r1"] == [("reset",), ("stored", "", [1, 2])]
        await hub.publish("r2", [("stored", "", [5])])
        cursor2, reset, batches = await hub.poll(cursor, 0.01)
        assert not reset and batches == [("r2", [("stored", "", [5])])] and cursor2 == cursor + 1
        assert await hub.poll(cursor2, 0.01) == (cursor2, False, [])  # nothing new: waits, then empty
        for i in range(5):  # the log keeps 3 batches: a router that far behind gets a snapshot
            await hub.publish("r1", [("stored", "", [10 + i])])
        _, reset, batches = await hub.poll(cursor2, 0.01)
        assert reset and dict(batches)["r2"] == [("reset",), ("stored", "", [5])]
        await hub.forget("r2")
        assert await hub.replicas() == ["r1"]
        await hub.publish("r2", [("stored", "", [6])])  # a late batch from the dead replica is dropped
        _, reset, batches = await hub.poll(0, 0.01)
        assert "r2" not in dict(batches)

    asyncio.run(scenario())
