"""CacheAwareRouter: Ray Serve's pluggable request router, choosing the replica where a Generate's first token comes
soonest: the one holding the longest prefix of its prompt, unless load elsewhere makes recomputing it cheaper.

Ray Serve calls `choose_replicas` for every request sent through a handle to the EngineReplica deployment. For a
Generate (a `Request` as first argument) its Decider (cluster.decide) hashes the prompt's whole pages with the same
chained page hash the replicas' cache events carry, asks its PrefixIndex how many leading pages each candidate holds
in the request's namespace (in the device, then in a tier below it: host memory or disk, scored lower), its hints
where it sent the prompt's pages before, its LoadView each candidate's load in tokens, and lets the Policy weigh
them. Other calls go to the replica with the fewest requests.

The index and the load view (a FleetView) are fed by a background task long-polling the cluster's EventHub; it
runs on the router's own event loop, so a routing decision is local work only (no remote call). Hub restarts: see
cluster.view.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from radixcache.cluster.decide import Decider
from radixcache.cluster.fleet_events import ReplicaTarget
from radixcache.cluster.hints import CAPACITY
from radixcache.cluster.policy import DEFAULT_TIE_SHARE, LoadWeights, Policy, RoutingThresholds
from radixcache.cluster.view import FleetView
from radixcache.worker.engine.request import Request

log = logging.getLogger("radixcache.cluster")


class CacheAwareRouter(RequestRouter):
    def initialize_state(
        self,
        *,
        page_size: int,
        kv_dtype: str | None = None,
        hub_name: str | None = None,
        hub_namespace: str | None = None,
        balance_abs: int = 8,
        balance_rel: float = 1.5,
        min_match_pages: int = 1,
        tie_share: float = DEFAULT_TIE_SHARE,
        inflight_ttl_s: float = 30.0,
        hint_pages: int = CAPACITY,
        queued_weight: float | None = None,
        requests_weight: float | None = None,
        kv_weight: float | None = None,
        evict_weight: float | None = None,
        tier_weight: float | None = None,
        hint_weight: float | None = None,
        store_weight: float | None = None,
    ) -> None:
        defaults = LoadWeights()
        self.page_size = page_size
        self.kv_dtype = kv_dtype  # the replicas' KV precision: quantized pages have their own hashes
        self.thresholds = RoutingThresholds(balance_abs, balance_rel, min_match_pages, tie_share)
        self.weights = LoadWeights(
            defaults.queued if queued_weight is None else queued_weight,
            defaults.requests if requests_weight is None else requests_weight,
            defaults.kv if kv_weight is None else kv_weight,
            defaults.evict if evict_weight is None else evict_weight,
            defaults.tier if tier_weight is None else tier_weight,
            defaults.hint if hint_weight is None else hint_weight,
            defaults.store if store_weight is None else store_weight,
        )
        self.view = FleetView(inflight_ttl_s=inflight_ttl_s, hint_pages=hint_pages)
        self.index, self.loads, self.reuse = self.view.index, self.view.loads, self.view.reuse
        self.hub_name, self.hub_namespace = hub_name, hub_namespace
        self._sync_task: asyncio.Task | None = None
        self.policy = Policy(self.thresholds, self.weights)
        self.decider = Decider(self.view, self.policy, page_size, kv_dtype)
        self._rng = random.Random()
        self.decision_seconds: list[float] = []  # bounded sample, for the benchmark

    # -- Ray Serve's interface ---------------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._ensure_sync()
        if pending_request is None:
            return [candidate_replicas]
        # When the chosen replica cannot take the request (full, or dead and not yet noticed), Serve asks again:
        # back off between attempts instead of spinning the router's loop.
        pending_request.routing_context.should_backoff = True
        request = pending_request.args[0] if pending_request.args else None
        if isinstance(request, ReplicaTarget):  # a call for one replica (its cache events)
            named = [r for r in candidate_replicas if r.replica_id.to_full_id_str() == request.replica_id]
            return [named or [self._least_loaded(candidate_replicas)]]
        if not isinstance(request, Request):
            return [[self._least_loaded(candidate_replicas)]]
        start = time.perf_counter()
        replica = self.route(request, candidate_replicas)
        if len(self.decision_seconds) < 100_000:
            self.decision_seconds.append(time.perf_counter() - start)
        return [[replica]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        key = replica_id.to_full_id_str()
        request = pending_request.args[0] if pending_request.args else None
        sent = self.decider.routed(key, request) if isinstance(request, Request) else self.loads.routed(key, 0)
        result.add_done_callback(lambda _: self.loads.finished(key, sent))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.to_full_id_str() for r in self._replica_id_set}
        super().update_replicas(replicas)
        for gone in before - {r.replica_id.to_full_id_str() for r in replicas}:
            self._forget(gone)

    # -- the decision --------------------------------------------------------------------------------------------
    def route(self, request: Request, candidates: list[RunningReplica]) -> RunningReplica:
        by_key = {r.replica_id.to_full_id_str(): r for r in candidates}
        return by_key[self.decider.choose(request, list(by_key))]

    def _least_loaded(self, candidates: list[RunningReplica]) -> RunningReplica:
        counts = [self.loads.requests(r.replica_id.to_full_id_str()) for r in candidates]
        least = min(counts)
        return self._rng.choice([r for r, n in zip(candidates, counts, strict=True) if n == least])

    def _forget(self, key: str) -> None:
        self.decider.forget(key)

    def _ensure_sync(self) -> None:
        if self._sync_task is None and self.hub_name is not None:
            from radixcache.cluster.hub import get_or_create_hub

            connect = functools.partial(get_or_create_hub, self.hub_name, self.hub_namespace)
            self._sync_task = asyncio.get_running_loop().create_task(self.view.run(connect))
