"""CacheAwareRouter: Ray Serve's pluggable request router, choosing the replica where a Generate's first token comes
soonest: the one holding the longest prefix of its prompt, unless load elsewhere makes recomputing it cheaper.

Ray Serve calls `choose_replicas` for every request sent through a handle to the EngineReplica deployment. For a
Generate (a `Request` as first argument) it hashes the prompt's whole pages with the same chained page hash the
replicas' cache events carry, asks its PrefixIndex how many leading pages each candidate holds in the request's
namespace (in the device, then in a tier below it: host memory or disk, scored lower), asks its LoadView for each
candidate's load in tokens, and lets `policy.choose` weigh the two. Other calls go to the replica with the fewest
requests.

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

from radixcache.cluster.fleet_events import ReplicaTarget
from radixcache.cluster.policy import Candidate, LoadWeights, Policy, RoutingThresholds
from radixcache.cluster.view import FleetView
from radixcache.events import page_hashes
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
        inflight_ttl_s: float = 30.0,
        queued_weight: float | None = None,
        requests_weight: float | None = None,
        kv_weight: float | None = None,
        evict_weight: float | None = None,
        tier_weight: float | None = None,
    ) -> None:
        defaults = LoadWeights()
        self.page_size = page_size
        self.kv_dtype = kv_dtype  # the replicas' KV precision: quantized pages have their own hashes
        self.thresholds = RoutingThresholds(balance_abs, balance_rel, min_match_pages)
        self.weights = LoadWeights(
            defaults.queued if queued_weight is None else queued_weight,
            defaults.requests if requests_weight is None else requests_weight,
            defaults.kv if kv_weight is None else kv_weight,
            defaults.evict if evict_weight is None else evict_weight,
            defaults.tier if tier_weight is None else tier_weight,
        )
        self.view = FleetView(inflight_ttl_s=inflight_ttl_s)
        self.index, self.loads, self.reuse = self.view.index, self.view.loads, self.view.reuse
        self.hub_name, self.hub_namespace = hub_name, hub_namespace
        self._sync_task: asyncio.Task | None = None
        self.policy = Policy(self.thresholds, self.weights)
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
        uncached = 0
        if isinstance(request, Request):
            hashes = self._hashes(request)
            device, below = self.index.match_split(key, request.namespace, hashes)
            uncached = max(0, len(request.prompt_ids) - (device + below) * self.page_size)  # loads are not prefill
            self.index.routed(key, request.namespace, hashes)
            self.reuse.routed(key, request.namespace, hashes)
        sent = self.loads.routed(key, uncached)
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
        hashes = self._hashes(request)
        by_key = {r.replica_id.to_full_id_str(): r for r in candidates}
        prompt = len(request.prompt_ids)
        scored = [self._candidate(key, request.namespace, hashes, prompt) for key in by_key]
        chosen = self.policy.pick(
            scored, prompt, self.page_size, namespace=request.namespace, cache_key=request.cache_key
        )
        return by_key[chosen.replica]

    def _candidate(self, key: str, namespace: str, hashes: list[int], prompt: int) -> Candidate:
        total = self.loads.pages_total(key)
        free = None if total is None else max(0, total - self.index.held_pages(key)) * self.page_size
        victims: list[int] = []
        if free is not None and free < prompt:  # the prompt might not fit without evicting: what would go
            victims = self.reuse.victim_uses(key, -(-(prompt - free) // self.page_size), self.index.holds)
        device, below = self.index.match_split(key, namespace, hashes)
        return Candidate(
            key,
            requests=self.loads.requests(key),
            matched_pages=device,
            tier_pages=below,
            queued_tokens=self.loads.queued_tokens(key),
            kv_busy=self.loads.kv_busy(key),
            free_tokens=free,
            victim_uses=tuple(victims),
        )

    def _hashes(self, request: Request) -> list[int]:
        """The prompt's page hashes as the replicas' cache events name them (page size, namespace, KV dtype)."""
        return page_hashes(request.prompt_ids, self.page_size, request.namespace, kv_dtype=self.kv_dtype)

    def _least_loaded(self, candidates: list[RunningReplica]) -> RunningReplica:
        counts = [self.loads.requests(r.replica_id.to_full_id_str()) for r in candidates]
        least = min(counts)
        return self._rng.choice([r for r, n in zip(candidates, counts, strict=True) if n == least])

    def _forget(self, key: str) -> None:
        self.view.forget(key)

    def _ensure_sync(self) -> None:
        if self._sync_task is None and self.hub_name is not None:
            from radixcache.cluster.hub import get_or_create_hub

            connect = functools.partial(get_or_create_hub, self.hub_name, self.hub_namespace)
            self._sync_task = asyncio.get_running_loop().create_task(self.view.run(connect))
