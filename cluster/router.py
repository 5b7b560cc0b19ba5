"""CacheAwareRouter: Ray Serve's pluggable request router, choosing the replica that holds the longest prefix.

Ray Serve calls `choose_replicas` for every request sent through a handle to the EngineReplica deployment. For a
Generate (a `Request` as first argument) it hashes the prompt's whole pages with the same chained page hash the
replicas' cache events carry, asks its PrefixIndex how many leading pages each candidate holds in the request's
namespace, and lets `policy.choose` weigh that against load. Other calls go to the least loaded replica.

The index is fed by a background task long-polling the cluster's EventHub; it runs on the router's own event loop,
so a routing decision is local work only (no remote call).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import defaultdict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from radixcache.cluster.index import PrefixIndex
from radixcache.cluster.policy import Candidate, RoutingThresholds, choose
from radixcache.events import page_hashes
from radixcache.worker.request import Request

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
    ) -> None:
        self.page_size = page_size
        self.kv_dtype = kv_dtype  # the replicas' KV precision: quantized pages have their own hashes
        self.thresholds = RoutingThresholds(balance_abs, balance_rel, min_match_pages)
        self.index = PrefixIndex(inflight_ttl_s=inflight_ttl_s)
        self.hub_name, self.hub_namespace = hub_name, hub_namespace
        self._load: dict[str, int] = defaultdict(int)  # requests this router sent and not seen finish
        self._load_lock = threading.Lock()  # done callbacks run on Ray's threads
        self._sync_task: asyncio.Task | None = None
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
        if not isinstance(request, Request):
            return [[self._least_loaded(candidate_replicas)]]
        start = time.perf_counter()
        replica = self.route(request, candidate_replicas)
        if len(self.decision_seconds) < 100_000:
            self.decision_seconds.append(time.perf_counter() - start)
        return [[replica]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        key = replica_id.to_full_id_str()
        with self._load_lock:
            self._load[key] += 1

        def done(_: Any) -> None:
            with self._load_lock:
                self._load[key] = max(0, self._load[key] - 1)

        result.add_done_callback(done)
        request = pending_request.args[0] if pending_request.args else None
        if isinstance(request, Request):
            self.index.routed(key, request.namespace, self._hashes(request))

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
        with self._load_lock:
            scored = [
                Candidate(
                    key, self._load[key], self.index.match(key, request.namespace, hashes), self.index.held_pages(key)
                )
                for key in by_key
            ]
        return by_key[choose(scored, self.thresholds, self._rng).replica]

    def _hashes(self, request: Request) -> list[int]:
        """The prompt's page hashes as the replicas' cache events name them (page size, namespace, KV dtype)."""
        return page_hashes(request.prompt_ids, self.page_size, request.namespace, kv_dtype=self.kv_dtype)

    def _least_loaded(self, candidates: list[RunningReplica]) -> RunningReplica:
        with self._load_lock:
            least = min(self._load[r.replica_id.to_full_id_str()] for r in candidates)
            pool = [r for r in candidates if self._load[r.replica_id.to_full_id_str()] == least]
        return self._rng.choice(pool)

    def _forget(self, key: str) -> None:
        self.index.forget(key)
        with self._load_lock:
            self._load.pop(key, None)
        hub = self._hub()
        if hub is not None:
            hub.forget.remote(key)

    # -- the event feed ------------------------------------------------------------------------------------------
    def _hub(self) -> Any:
        if self.hub_name is None:
            return None
        import ray

        try:
            return ray.get_actor(self.hub_name, namespace=self.hub_namespace)
        except ValueError:
            return None

    def _ensure_sync(self) -> None:
        if self._sync_task is None and self.hub_name is not None:
            self._sync_task = asyncio.get_running_loop().create_task(self._sync())

    async def _sync(self) -> None:
        cursor = 0
        while True:
            hub = self._hub()
            if hub is None:
                await asyncio.sleep(0.5)
                continue
            try:
                cursor, reset, batches = await hub.poll.remote(cursor, 1.0)
            except Exception as e:  # the hub restarting: start over with a snapshot
                log.warning("cache-event feed interrupted (%s); resubscribing", e)
                cursor = 0
                await asyncio.sleep(0.5)
                continue
            if reset:
                for key in self.index.replicas():
                    self.index.cleared(key)
            for replica, events in batches:
                self.index.apply(replica, events)
