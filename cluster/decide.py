"""Decider: the cache-aware router's decision for one Generate, apart from Ray (CacheAwareRouter is its Serve glue).

`choose(request, replicas)` hashes the prompt's whole pages with the chained page hash the replicas' cache events
carry (page size, namespace, KV dtype), builds one policy Candidate per replica from the FleetView (leading pages in
the device or in flight, then in a tier below; what the hints say was sent there; load in tokens; what a full pool
would evict) and lets the Policy pick. `routed(replica, request)` records that the request went there: its pages in
flight in the index, in the reuse mirror and in the hints, its uncached tokens in the load view (hand the returned
`Sent` to `LoadView.finished` when its stream ends). Not thread-safe apart from the LoadView: use from the router's
loop.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from radixcache.cluster.load import Sent
from radixcache.cluster.policy import Candidate, Policy
from radixcache.cluster.view import FleetView
from radixcache.events import page_hashes
from radixcache.worker.engine.request import Request


class Decider:
    def __init__(self, view: FleetView, policy: Policy, page_size: int, kv_dtype: str | None = None) -> None:
        self.view = view
        self.policy = policy
        self.page_size = page_size
        self.kv_dtype = kv_dtype  # the replicas' KV precision: quantized pages have their own hashes

    def choose(self, request: Request, replicas: Sequence[Hashable]) -> Hashable:
        """The replica (one of `replicas`, which must not be empty) the request goes to."""
        hashes = self.hashes(request)
        prompt = len(request.prompt_ids)
        home, hinted = self.view.hints.home(request.namespace, hashes)
        scored = [self._candidate(r, request.namespace, hashes, prompt, hinted if r == home else 0) for r in replicas]
        chosen = self.policy.pick(
            scored, prompt, self.page_size, namespace=request.namespace, cache_key=request.cache_key
        )
        return chosen.replica

    def routed(self, replica: Hashable, request: Request) -> Sent:
        """The request was sent to `replica`."""
        hashes = self.hashes(request)
        index = self.view.index
        device, below = index.match_split(replica, request.namespace, hashes)
        uncached = max(0, len(request.prompt_ids) - (device + below) * self.page_size)  # loads are not prefill
        index.routed(replica, request.namespace, hashes)
        self.view.reuse.routed(replica, request.namespace, hashes)
        self.view.hints.routed(replica, request.namespace, hashes)
        return self.view.loads.routed(replica, uncached)

    def forget(self, replica: Hashable) -> None:
        """The replica is gone (died, scaled away)."""
        self.view.forget(replica)
        self.policy.forget(replica)

    def hashes(self, request: Request) -> list[int]:
        """The prompt's page hashes as the replicas' cache events name them (page size, namespace, KV dtype)."""
        return page_hashes(request.prompt_ids, self.page_size, request.namespace, kv_dtype=self.kv_dtype)

    def _candidate(self, key: Hashable, namespace: str, hashes: list[int], prompt: int, hinted: int) -> Candidate:
        index, loads = self.view.index, self.view.loads
        total = loads.pages_total(key)
        free = None if total is None else max(0, total - index.held_pages(key)) * self.page_size
        victims: list[int] = []
        if free is not None and free < prompt:  # the prompt might not fit without evicting: what would go
            victims = self.view.reuse.victim_uses(key, -(-(prompt - free) // self.page_size), index.holds)
        device, below = index.match_split(key, namespace, hashes)
        return Candidate(
            key,
            requests=loads.requests(key),
            matched_pages=device,
            tier_pages=below,
            queued_tokens=loads.queued_tokens(key),
            kv_busy=loads.kv_busy(key),
            free_tokens=free,
            victim_uses=tuple(victims),
            hinted_pages=hinted,
        )
