"""Decider: the cache-aware router's decision for one Generate, apart from Ray (CacheAwareRouter is its Serve glue).

`choose(request, replicas)` hashes the prompt's whole pages with the chained page hash the replicas' cache events
carry (page size, namespace, KV dtype), builds one policy Candidate per replica from the FleetView (leading pages in
the device or in flight, then in a tier below; what the hints say was sent there; load in tokens; what a full pool
would evict) and lets the Policy pick. `routed(replica, request)` records that the request went there: in the reuse
mirror and the hints (hand the returned `Sent` to `LoadView.finished` when its stream ends).

A choice counts at once: Serve asks for the replicas of several requests before the first of them reaches its
replica (and `routed` is called only once the replica has accepted it, a round trip later), so the chosen replica's
in-flight pages and load include the request from `choose` on. Otherwise concurrent requests all see the same
figures: a burst of one new prefix scatters, and a burst of unrelated prompts piles onto whichever replica looks
idlest. Until `routed` the choice is pending: asked again for the same request (its replica refused it, or died),
the pending choice is void; one never routed counts no more after PENDING_S. Not thread-safe apart from the
LoadView: use from the router's loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from radixcache.cluster.load import Sent
from radixcache.cluster.policy import Candidate, Policy
from radixcache.cluster.view import FleetView
from radixcache.events import page_hashes
from radixcache.salt import salted_page_hashes
from radixcache.worker.engine.request import Request

PENDING_S = 10.0  # a choice Serve never routed (the request was cancelled first) counts this long at most


class Decider:
    def __init__(
        self,
        view: FleetView,
        policy: Policy,
        page_size: int,
        kv_dtype: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.view = view
        self.policy = policy
        self.page_size = page_size
        self.kv_dtype = kv_dtype  # the replicas' KV precision: quantized pages have their own hashes
        self.clock = clock
        self._pending: OrderedDict[str, tuple[Hashable, Sent, float]] = OrderedDict()  # request id -> its choice

    def choose(self, request: Request, replicas: Sequence[Hashable]) -> Hashable:
        """The replica (one of `replicas`, which must not be empty) the request goes to; it counts there from now."""
        self._void(request.request_id)
        self._expire()
        hashes = self.hashes(request)
        prompt = len(request.prompt_ids)
        home, hinted = self.view.hints.home(request.namespace, hashes)
        scored = [self._candidate(r, request.namespace, hashes, prompt, hinted if r == home else 0) for r in replicas]
        chosen = self.policy.pick(
            scored, prompt, self.page_size, namespace=request.namespace, cache_key=request.cache_key
        ).replica
        self._pending[request.request_id] = (chosen, self._count(chosen, request, hashes), self.clock())
        return chosen

    def routed(self, replica: Hashable, request: Request) -> Sent:
        """The request was sent to `replica` (and accepted)."""
        hashes = self.hashes(request)
        pending = self._pending.pop(request.request_id, None)
        if pending is not None and pending[0] == replica:
            sent = pending[1]
        else:  # not chosen here, or sent elsewhere than chosen
            if pending is not None:
                self.view.loads.withdrawn(pending[0], pending[1])
            sent = self._count(replica, request, hashes)
        self.view.reuse.routed(replica, request.namespace, hashes)
        self.view.hints.routed(replica, request.namespace, hashes)
        return sent

    def forget(self, replica: Hashable) -> None:
        """The replica is gone (died, scaled away)."""
        self.view.forget(replica)
        self.policy.forget(replica)
        for request_id in [k for k, (r, _, _) in self._pending.items() if r == replica]:
            del self._pending[request_id]

    @property
    def pending(self) -> int:
        """Choices not routed yet."""
        return len(self._pending)

    def _count(self, replica: Hashable, request: Request, hashes: list[int]) -> Sent:
        """The request's pages in flight to `replica`, its uncached tokens in its load."""
        index = self.view.index
        device, below = index.match_split(replica, request.namespace, hashes)
        uncached = max(0, len(request.prompt_ids) - (device + below) * self.page_size)  # loads are not prefill
        index.routed(replica, request.namespace, hashes)
        return self.view.loads.routed(replica, uncached)

    def _void(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.view.loads.withdrawn(pending[0], pending[1])

    def _expire(self) -> None:
        deadline = self.clock() - PENDING_S
        while self._pending:
            request_id, (replica, sent, at) = next(iter(self._pending.items()))
            if at > deadline:
                break
            del self._pending[request_id]
            self.view.loads.withdrawn(replica, sent)

    def hashes(self, request: Request) -> list[int]:
        """The prompt's page hashes as the replicas' cache events name them (page size, namespace, KV dtype, and its
        cache salt: a salted prompt is routed by its salted keys)."""
        if request.cache_salt is not None:
            salt, ps = request.cache_salt, self.page_size
            return salted_page_hashes(request.prompt_ids, ps, request.namespace, salt, kv_dtype=self.kv_dtype)
        return page_hashes(request.prompt_ids, self.page_size, request.namespace, kv_dtype=self.kv_dtype)

    def _candidate(self, key: Hashable, namespace: str, hashes: list[int], prompt: int, hinted: int) -> Candidate:
        index, loads = self.view.index, self.view.loads
        total = loads.pages_total(key)
        free = None if total is None else max(0, total - index.held_pages(key)) * self.page_size
        victims: list[tuple[tuple[str, int], int]] = []
        if free is not None and free < prompt:  # the prompt might not fit without evicting: what would go
            victims = self.view.reuse.victims(key, -(-(prompt - free) // self.page_size), index.holds)
        device, below, from_store = index.match_tiers(key, namespace, hashes)
        return Candidate(
            key,
            requests=loads.requests(key),
            matched_pages=device,
            tier_pages=below,
            store_pages=from_store,
            queued_tokens=loads.queued_tokens(key),
            kv_busy=loads.kv_busy(key),
            free_tokens=free,
            victim_uses=tuple(uses for _, uses in victims),
            victim_media=tuple(index.copy_below(key, *page) for page, _ in victims),
            hinted_pages=hinted,
        )
