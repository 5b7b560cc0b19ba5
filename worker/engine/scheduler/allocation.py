"""Admission's allocation phase, and every page the scheduler takes: a prompt's lease, a partial hit's copy, a fork's
pages. Preemption, when pages run out mid-step, is the scheduler's (it decides who steps back).

A prompt is leased only if free + evictable pages cover what it still needs plus a reserve of one page per running
sequence, besides what running prefills were promised (`lease_prompt`). The check is cheap first (no lease, so a
request that keeps waiting does not count as a lookup every step), then exact: the matched pages stop being
evictable once the lease locks them. A hit that ends inside a page is copied into the lease's own page at once
(`copy_hit`), so admission counts the page once. On every failure no lease is left behind.
"""

from __future__ import annotations

from radixcache.cache import CacheFullError, Lease
from radixcache.cache_base import BaseCache
from radixcache.pool import KVPool
from radixcache.worker.engine.sequence import Sequence


class Pages:
    """The scheduler's pages: `cache` holds who has which page, `pool` the K/V the copies move."""

    def __init__(self, cache: BaseCache, pool: KVPool) -> None:
        self.cache = cache
        self.pool = pool
        self.page_size = pool.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def promised_to_prefills(self, running: list[Sequence]) -> int:
        """Pages that running prefills will still ask for: promised to them, not available to newcomers or drafts."""
        return sum(max(0, self.pages_for(len(s.tokens)) - len(s.lease.pages)) for s in running if s.lease)

    def prompt_need(self, seq: Sequence, cached: int) -> int:
        """Pages seq's prompt needs beyond the `cached` tokens the cache holds of it."""
        return self.pages_for(len(seq.tokens)) - cached // self.page_size

    def lease_prompt(self, seq: Sequence, cached: int, promised: int, running: int) -> Lease | None:
        """seq's lease (its hit locked, a partial page copied), if its prompt fits beside `promised` pages and a
        reserve page for each of the `running` sequences; else None, leasing nothing."""
        if self.prompt_need(seq, cached) > self.cache.available_pages() - promised - running:
            return None
        prompt = seq.tokens
        request = seq.request
        lease = self.cache.acquire(
            seq.name, prompt, request.namespace, max_cached=len(prompt) - 1, count=False, salt=request.cache_salt
        )
        lease.retention = request.retention  # every publish of it stamps the request's retention
        self.copy_hit(lease)
        need = self.pages_for(len(prompt)) - len(lease.pages)
        if self.cache.available_pages() - promised - need < running:
            self.cache.release(lease)
            return None
        return lease

    def fork_lease(self, parent: Sequence, child: Sequence) -> Lease | None:
        """A lease of parent's computed prompt for child: the tree's pages where it holds them, private copies of the
        rest (at least the partial last page, which each sample goes on writing). None when no page could be had for
        the copies."""
        assert parent.lease is not None
        prompt = parent.tokens[: parent.num_prompt]
        # not a lookup of its own: the request's was counted with sample 0
        request = parent.request
        lease = self.cache.acquire(
            child.name, prompt, request.namespace, max_cached=len(prompt), count=False, salt=request.cache_salt
        )
        lease.retention = request.retention
        self.copy_hit(lease)
        try:
            self.cache.allocate(lease, self.pages_for(len(prompt)) - len(lease.pages))
        except CacheFullError:
            self.cache.release(lease)
            return None
        for j in range(lease.cached_tokens // self.page_size, self.pages_for(len(prompt))):
            slots = min(self.page_size, len(prompt) - j * self.page_size)
            self.copy_slots(parent.lease.pages[j], lease.pages[j], slots)
        return lease

    def copy_hit(self, lease: Lease) -> None:
        """A hit ending inside a page: copy its slots into the lease's own page, then let go of the source, so that
        admission counts the page once (the lease never holds the same tokens twice). On failure, no lease is left."""
        if lease.copy_from is None:
            return
        try:
            copy = lease.copy_from
            self.copy_slots(copy.src, copy.dst, copy.tokens)
            self.cache.copied(lease)
        except BaseException:
            self.cache.release(lease)
            raise

    def copy_slots(self, src: int, dst: int, k: int) -> None:
        """The first k token slots of page src into page dst, every layer (window parts too, where both have one)."""
        self.pool.copy_prefix(src, dst, k, *(self.cache.window_slots([src, dst]) or (-1, -1)))
