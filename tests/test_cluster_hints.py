"""Affinity that outlives the cache events: the router's hints of where it sent each page (cluster/hints.py), how the
policy weighs them, and the whole decision (cluster/decide.py over a FleetView fed as the hub feeds it) through a
flush, an eviction and a replica's restart. Pure Python, no Ray."""

from __future__ import annotations

import random

import pytest
from helpers import FakeClock

from radixcache.cluster.decide import Decider
from radixcache.cluster.hints import RoutedHints
from radixcache.cluster.hub import Poll
from radixcache.cluster.policy import Candidate, LoadWeights, Policy, RoutingThresholds, cheapest
from radixcache.cluster.view import FleetView
from radixcache.worker.engine.api import EngineLoad
from radixcache.worker.engine.request import Request

PAGE = 16
PREFIX = 64 * PAGE  # a group's 1,024-token system prompt, as in bench/cluster_bench.py
QUESTION = 32


def test_a_hint_names_the_replica_last_sent_the_longest_leading_run_of_the_prompts_pages():
    hints = RoutedHints()
    assert hints.home("", [1, 2, 3]) == (None, 0)
    hints.routed("x", "", [1, 2, 3])
    hints.routed("y", "", [1, 2])  # a shorter prompt sharing the first pages went elsewhere since
    assert hints.home("", [1, 2, 3, 4]) == ("x", 3)  # x was sent the longest prefix of it
    assert hints.home("", [1, 2, 9]) == ("y", 2)
    assert hints.home("", [9, 2, 3]) == (None, 0)  # a run starts at the first page
    assert hints.home("t", [1, 2, 3]) == (None, 0)  # another tenant's hints never count
    with pytest.raises(ValueError, match="capacity"):
        RoutedHints(0)


def test_hints_survive_a_flush_and_a_reset_but_not_an_eviction_or_the_replica():
    hints = RoutedHints()
    hints.routed("x", "", [1, 2, 3])
    hints.routed("y", "", [7, 8])
    hints.apply("x", [("removed", "", [1, 2, 3]), ("cleared", "")])  # a flush: its removals, then the namespace
    hints.apply("x", [("reset",), ("stored", "", [5])])  # the engine started over (a snapshot follows)
    assert hints.home("", [1, 2, 3]) == ("x", 3)
    hints.apply("x", [("removed", "", [3], "DISK")])  # a tier dropping its copy says nothing of the device
    assert hints.home("", [1, 2, 3]) == ("x", 3)
    hints.apply("x", [("removed", "", [2, 3])])  # evicted: x's LRU judged them the least worth keeping
    assert hints.home("", [1, 2, 3]) == ("x", 1)
    hints.apply("x", [("removed", "", [7])])  # a page whose hint names another replica keeps it
    hints.apply("x", [("removed", "t", [8]), ("cleared", "t")])  # a flush of another namespace is no eviction here
    assert hints.home("", [7, 8]) == ("y", 2)
    hints.apply("y", [("removed", "", [8]), ("cleared", "t")])
    assert hints.home("", [7, 8]) == ("y", 1)
    hints.forget("y")  # the replica is gone: nothing sends its pages to it, nor to whoever replaces it
    assert hints.home("", [7, 8]) == (None, 0) and len(hints) == 1


def test_the_hint_table_is_bounded_and_forgets_the_least_recently_routed_pages_first():
    hints = RoutedHints(capacity=100)
    rng = random.Random(0)
    prompts = [[rng.getrandbits(63) for _ in range(8)] for _ in range(1000)]
    for i, p in enumerate(prompts):
        hints.routed(f"r{i % 3}", "", p)
        assert len(hints) <= 100
    assert len(hints) == 100
    assert hints.home("", prompts[-1]) == ("r0", 8) and hints.home("", prompts[-12]) == ("r1", 8)
    assert hints.home("", prompts[-13]) == (None, 0)  # 12 prompts of 8 pages fill 96 of the 100; older ones are gone
    hints.routed("r1", "", prompts[-13][:2])  # routed again: remembered again, the oldest page goes
    assert hints.home("", prompts[-13]) == ("r1", 2) and len(hints) == 100
    view = FleetView(hint_pages=10)  # the router's cap reaches its table
    view.hints.routed("a", "", list(range(50)))
    assert len(view.hints) == 10


def test_hints_count_only_where_no_replicas_events_show_the_prompt():
    w = LoadWeights()
    prompt = PREFIX + QUESTION
    hinted, busier = Candidate("x", 0, 0, hinted_pages=64, kv_busy=0.8), Candidate("y", 0, 0)
    assert [c.replica for c in cheapest([hinted, busier], prompt, PAGE, w=w)] == ["x"]  # 845 tokens of load < 1,024
    queue = Candidate("x", 0, 0, hinted_pages=64, queued_tokens=3000)  # a real queue still wins
    assert [c.replica for c in cheapest([queue, busier], prompt, PAGE, w=w)] == ["y"]
    # Where a replica's events (or prompts in flight) show even a short prefix, hints are not consulted: the events
    # are exact, a hint only says where the prompt went.
    assert [c.replica for c in cheapest([hinted, Candidate("y", 0, 2)], prompt, PAGE, w=w)] == ["y"]
    # Under imbalance load alone decides; a hinted run shorter than min_match_pages counts as none.
    t = RoutingThresholds(balance_abs=2, balance_rel=1.5, min_match_pages=4)
    assert [c.replica for c in cheapest([Candidate("x", 9, 0, hinted_pages=64), Candidate("y", 0, 0)], prompt, PAGE,
                                        t, w)] == ["y"]  # fmt: skip
    short = Candidate("x", 0, 0, hinted_pages=3, kv_busy=0.8)
    assert [c.replica for c in cheapest([short, busier], prompt, PAGE, t, w)] == ["y"]
    off = LoadWeights(hint=0.0)
    assert [c.replica for c in cheapest([hinted, busier], prompt, PAGE, w=off)] == ["y"]
    with pytest.raises(ValueError, match="hint"):
        LoadWeights(hint=-1.0)


class Fleet:
    """A Decider over a FleetView fed the way the hub feeds a router: each replica's events (what it cached of
    what it was sent, its flushes and evictions) and load reports, as Poll answers."""

    def __init__(self, replicas: list[str], weights: LoadWeights | None = None) -> None:
        self.view = FleetView()
        self.decider = Decider(self.view, Policy(weights=weights), PAGE)
        self.replicas = replicas
        self.cursor = 0
        rng = random.Random(3)
        self.prefixes = [[rng.randrange(3, 190) for _ in range(PREFIX)] for _ in range(4)]
        self.rng = rng

    def ask(self, group: int) -> Request:
        question = [self.rng.randrange(3, 190) for _ in range(QUESTION)]
        self.cursor += 1
        return Request(f"g{group}-{self.cursor}", self.prefixes[group] + question)

    def feed(self, batches: list[tuple[str, list[tuple]]], loads: dict[str, EngineLoad] | None = None) -> None:
        self.cursor += 1
        self.view.apply(Poll("epoch", self.cursor, False, batches, loads or {}))

    def send(self, requests: list[Request]) -> list[str]:
        """Decide every request first (concurrent requests: Serve asks before any reaches a replica), then route
        them, each replica caching the prompt's pages and answering."""
        chosen = [self.decider.choose(r, self.replicas) for r in requests]
        for replica, request in zip(chosen, requests, strict=True):
            sent = self.decider.routed(replica, request)
            self.view.loads.finished(replica, sent)
            self.feed([(replica, [("stored", "", self.decider.hashes(request))])])
        return chosen

    def flush(self) -> None:
        """FlushCache on every replica: its pages' removals, then the namespace cleared (radixcache.events)."""
        self.feed([(r, [("removed", "", sorted(self.view.index.cached_hashes(r, ""))), ("cleared", "")])
                   for r in self.replicas])  # fmt: skip


def test_after_a_flush_each_conversation_goes_back_to_the_replica_it_was_on():
    """bench/cluster_bench.py's flush_restart trace: after a FlushCache every group was cold everywhere, and the load
    reports (a period old: x still counted as busier) sent all four to y at once; y's pool holds two groups, so they
    thrashed for the rounds that followed. The hints send each back where the fleet had it."""
    fleet = Fleet(["x", "y"])
    home = dict(enumerate(fleet.send([fleet.ask(g) for g in range(4)])))
    assert sorted(home.values()) == ["x", "x", "y", "y"]  # cold prompts take turns
    assert fleet.send([fleet.ask(g) for g in range(4)]) == [home[g] for g in range(4)]  # then hit
    stale = {"x": EngineLoad(3, 0, 0, 80, 100, 0), "y": EngineLoad(0, 0, 0, 10, 100, 0)}
    fleet.flush()
    fleet.feed([], stale)
    assert all(fleet.view.index.match(r, "", fleet.decider.hashes(fleet.ask(0))) == 0 for r in "xy")
    assert fleet.send([fleet.ask(g) for g in range(4)]) == [home[g] for g in range(4)]
    assert fleet.send([fleet.ask(g) for g in range(4)]) == [home[g] for g in range(4)]  # and hit there again


def test_after_a_flush_a_burst_follows_the_hints_past_the_prefill_its_first_request_queued():
    """flush_restart, as the router logged it (2026-12-04): the first two prompts after the flush were both x's
    groups. The first queued a 1,056-token prefill on x; the second, weighed as if its prefix were cached at x,
    still cost more there than computing it on the idle y (a 1,056-token queue against a 1,023-token hint), so it
    went to y, and y, its pool sized for two groups, got three: 1-3 of the next rounds' requests missed in three of
    six runs. The partition comes back whole; a queue two prefills long still sends a prompt elsewhere."""
    fleet = Fleet(["x", "y"])
    home = dict(enumerate(fleet.send([fleet.ask(g) for g in range(4)])))
    on_x = [g for g in range(4) if home[g] == "x"]
    on_y = [g for g in range(4) if home[g] == "y"]
    fleet.flush()
    stale = {"x": EngineLoad(2, 0, 0, 134, 176, 0), "y": EngineLoad(1, 0, 0, 67, 176, 0)}  # the reports the log had
    fleet.feed([], stale)
    burst = on_x + on_y
    assert fleet.send([fleet.ask(g) for g in burst]) == [home[g] for g in burst]
    queued = Candidate("x", 0, 0, hinted_pages=64, queued_tokens=2 * (PREFIX + QUESTION))
    assert [c.replica for c in cheapest([queued, Candidate("y", 0, 0)], PREFIX + QUESTION, PAGE)] == ["y"]


def test_without_the_hints_a_flush_scatters_the_groups():
    """The same fleet with the hints weighed at nothing: what the router did before they existed."""
    fleet = Fleet(["x", "y"], LoadWeights(hint=0.0))
    home = fleet.send([fleet.ask(g) for g in range(4)])
    fleet.flush()
    fleet.feed([], {"x": EngineLoad(3, 0, 0, 80, 100, 0), "y": EngineLoad(0, 0, 0, 10, 100, 0)})
    assert fleet.send([fleet.ask(g) for g in range(4)]) != home


def test_an_evicted_prefix_and_a_dead_replicas_prefixes_go_where_the_cost_says():
    fleet = Fleet(["x", "y"])
    home = fleet.send([fleet.ask(g) for g in range(4)])
    on_x = [g for g in range(4) if home[g] == "x"]
    # x evicts one of its groups (no flush follows): its hint goes, and the cold rule decides where it goes next.
    evicted = fleet.decider.hashes(fleet.ask(on_x[0]))
    fleet.feed([("x", [("removed", "", evicted)])])
    assert fleet.view.hints.home("", evicted) == (None, 0)
    # x dies and z replaces it (no report yet); y's pool is full of its two groups: x's other group is no longer
    # sent after x (its hints are gone), and goes where it evicts nothing, the new replica.
    fleet.decider.forget("x")
    fleet.replicas = ["y", "z"]
    held = sum(len(fleet.decider.hashes(fleet.ask(g))) for g in range(4) if home[g] == "y")
    fleet.feed([], {"y": EngineLoad(0, 0, 0, 0, held, 0)})
    assert fleet.view.hints.home("", fleet.decider.hashes(fleet.ask(on_x[1]))) == (None, 0)
    assert fleet.send([fleet.ask(on_x[1])]) == ["z"]
    assert fleet.send([fleet.ask(g) for g in range(4) if home[g] == "y"]) == ["y", "y"]  # y's groups hit there


def test_a_choice_counts_from_the_moment_it_is_made():
    """Serve asks for several requests' replicas before the first reaches its replica: each choice must see the
    ones before it, or a burst of unrelated prompts piles onto whichever replica looks idlest."""
    fleet = Fleet(["x", "y"])
    rng = random.Random(5)
    unrelated = [Request(f"u{i}", [rng.randrange(3, 190) for _ in range(PREFIX)]) for i in range(8)]
    fleet.feed([], {"y": EngineLoad(2, 0, 600, 0, 1000, 0)})  # x looks idle, y busier by more than noise
    chosen = fleet.send(unrelated)
    assert chosen[0] == "x" and max(chosen.count(r) for r in "xy") <= 5, chosen
    clock = FakeClock()
    view = FleetView(clock=clock)
    decider = Decider(view, Policy(), PAGE, clock=clock)
    first = Request("r1", list(range(3, 3 + PREFIX)))
    chosen = decider.choose(first, ["x", "y"])
    assert view.loads.requests(chosen) == 1 and view.index.match(chosen, "", decider.hashes(first)) == 64
    assert decider.choose(first, ["x", "y"]) == chosen and view.loads.requests(chosen) == 1  # asked again: recounted
    other = "y" if chosen == "x" else "x"
    sent = decider.routed(other, first)  # Serve sent it elsewhere: it counts there instead
    assert (view.loads.requests(chosen), view.loads.requests(other), decider.pending) == (0, 1, 0)
    view.loads.finished(other, sent)
    assert decider.choose(Request("r2", [7] * PREFIX), ["x", "y"])  # never routed (cancelled before it was sent)
    assert sum(view.loads.requests(r) for r in "xy") == 1
    clock.advance(11.0)
    decider.choose(Request("r3", [9] * PREFIX), ["x", "y"])
    assert sum(view.loads.requests(r) for r in "xy") == 1 and decider.pending == 1  # r2 no longer counts


def test_a_serve_configs_routing_args_reach_the_policy():
    from radixcache.cluster.app import options_from_args

    options = options_from_args({"hint_weight": 0.5, "tie_share": 0.25, "store_weight": 0.2, "tier_weight": 0.1})
    assert (options.weights.hint, options.weights.store, options.weights.tier) == (0.5, 0.2, 0.1)
    assert options.thresholds.tie_share == 0.25
    with pytest.raises(ValueError, match="unknown application args"):
        options_from_args({"hint_wieght": 0.5})
