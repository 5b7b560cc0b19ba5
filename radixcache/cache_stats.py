"""The cache's figures: CacheStats (what `stats()` returns), CacheCounters (what a cache counts since start), and
the pieces a stats() call assembles from the parts it reads (the tree, the leases, the tiers, the window slots).

Whole cache or one namespace: a namespace's view holds its cached (demoted included) and pinned pages, its leases,
the pages they read, its lookups and its evicted pages, beside the pool's capacity; the counters kept only for the
whole cache (published, extended, flushed, the tiers', demotion's) read 0 there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixcache.lease import Lease, Lookup
from radixcache.tier import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_STORE

if TYPE_CHECKING:
    from radixcache.tier import CacheTier
    from radixcache.tree import RadixTree
    from radixcache.window_parts import WindowParts

TIER_DISK_FIGURES = ("queued_pages", "dropped_pages", "corrupt_pages", "write_errors")
TIER_STORE_FIGURES = (
    "pages",
    "queued_pages",
    "written_pages",
    "skipped_pages",
    "dropped_pages",
    "corrupt_pages",
    "unavailable_errors",
)


@dataclass
class CacheStats:
    pages_total: int
    pages_free: int
    pages_cached: int  # stored in the tree
    pages_evictable: int  # cached pages that eviction could drop now (not locked by a lease, not pinned)
    pages_pinned: int
    pages_in_use: int  # distinct pages held by live leases (shared or private)
    queried_tokens: int  # prompt tokens looked up by acquire
    hit_tokens: int  # of those, served from the cache (whole pages + partial-page copies)
    copied_tokens: int  # hit tokens served by copying the first slots of a partially matching page
    extended_pages: int  # pages adopted in flight by extend (published by another request meanwhile)
    published_pages: int  # pages newly stored in the tree by publish (and release, partial tails included)
    evicted_pages: int  # dropped to make room (allocate) or by evict()
    flushed_pages: int  # dropped by flush()
    live_leases: int
    evictable_leaves: int
    namespaces: int
    pages_partial: int = 0  # cached pages holding a partial tail (the last, unfinished page of a released sequence)
    max_pinned_pages: int = 0  # the pin budget: pins never hold more pages than this
    # The tiers below memory (radixcache.tiering; all 0 without one). spilled: evicted pages handed to a tier;
    # spill_dropped: evicted pages a tier's full write queue refused; loaded: pages brought back into the pool.
    spilled_pages: int = 0
    spill_dropped_pages: int = 0
    host_loaded_pages: int = 0
    disk_loaded_pages: int = 0
    # Each tier's own figures (radixcache.tier.TierStats), by medium: host memory, then the disk store.
    host_pages: int = 0
    host_bytes: int = 0
    host_capacity_bytes: int = 0
    host_evicted_pages: int = 0
    disk_pages: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0
    disk_queued_pages: int = 0
    disk_dropped_pages: int = 0
    disk_evicted_pages: int = 0
    disk_corrupt_pages: int = 0
    disk_write_errors: int = 0
    disk_ready: int = 0  # 1 once the disk store is open and its index rebuilt (a fleet sums its replicas)
    # The fleet's shared store (radixcache.remote_tier; all 0 without --kv-remote): loaded back into the pool;
    # pages known to be there; queued; written by this worker; not written because the fleet had them; dropped
    # (queue full, store unavailable); corrupt objects removed; failed or overdue calls; 1 while it answers.
    store_loaded_pages: int = 0
    store_pages: int = 0
    store_queued_pages: int = 0
    store_written_pages: int = 0
    store_skipped_pages: int = 0
    store_dropped_pages: int = 0
    store_corrupt_pages: int = 0
    store_unavailable_errors: int = 0
    store_ready: int = 0
    pages_demoted: int = 0  # cached pages held demoted now (not counted in pages_total / pages_free / pages_cached)
    demoted_pages: int = 0  # pages demoted instead of evicted, since start
    promoted_pages: int = 0  # demoted pages brought back by a hit, since start
    # Window parts (a model with sliding layers; all 0 otherwise): the sliding layers' slots, how many are free, how
    # many only the tree keeps (idle, given back first when slots run short) and how many were given back so.
    window_slots_total: int = 0
    window_slots_free: int = 0
    window_parts_idle: int = 0
    window_parts_dropped: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class CacheCounters:
    """What a cache counts since start, for the whole cache and (lookups, evictions) per namespace."""

    lookups: Lookup = field(default_factory=Lookup)
    lookups_by_namespace: dict[str, Lookup] = field(default_factory=dict)
    evicted_from: dict[str, int] = field(default_factory=dict)  # namespace -> its pages evicted
    extended: int = 0
    published: int = 0
    evicted: int = 0
    flushed: int = 0
    demoted: int = 0  # pages demoted instead of evicted (radixcache.demotion)
    promoted: int = 0  # demoted pages brought back by a hit

    def count_lookup(self, namespace: str, lookup: Lookup) -> None:
        total = self.lookups  # (added field by field: this runs once per admitted request)
        total.queried += lookup.queried
        total.hit += lookup.hit
        total.copied += lookup.copied
        if lookup.queried:
            mine = self.lookups_by_namespace.get(namespace)
            if mine is None:
                self.lookups_by_namespace[namespace] = Lookup(lookup.queried, lookup.hit, lookup.copied)
            else:
                mine.add(lookup)


def lease_figures(leases: Iterable[Lease], counts: CacheCounters, namespace: str | None) -> dict[str, Any]:
    """The leases' and lookups' figures: of every lease, or (namespace given) of that namespace's."""
    if namespace is None:
        mine, lookup = list(leases), counts.lookups
    else:
        mine = [lease for lease in leases if lease.namespace == namespace]
        lookup = counts.lookups_by_namespace.get(namespace, Lookup())
    return {
        "pages_in_use": len({page for lease in mine for page in lease.pages}),
        "live_leases": len(mine),
        "queried_tokens": lookup.queried,
        "hit_tokens": lookup.hit,
        "copied_tokens": lookup.copied,
    }


def tree_figures(tree: RadixTree, counts: CacheCounters, namespace: str | None) -> dict[str, Any]:
    """What the tree holds and what the cache did to it: the whole tree's, or one namespace's part of it."""
    if namespace is not None:
        return {
            "pages_cached": tree.namespace_cached.get(namespace, 0),
            "pages_pinned": tree.namespace_pinned.get(namespace, 0),
            "evicted_pages": counts.evicted_from.get(namespace, 0),
            "namespaces": int(namespace in tree.namespace_cached),
            "extended_pages": 0,
            "published_pages": 0,
            "flushed_pages": 0,
            "evictable_leaves": 0,
        }
    return {
        "pages_pinned": tree.pinned_pages,
        "extended_pages": counts.extended,
        "published_pages": counts.published,
        "evicted_pages": counts.evicted,
        "flushed_pages": counts.flushed,
        "evictable_leaves": tree.evictable_leaves,
        "namespaces": len(tree.namespaces()),
        "pages_partial": tree.partial_pages,
        "pages_cached": tree.cached_pages - tree.demoted_pages,
        "pages_demoted": tree.demoted_pages,
        "demoted_pages": counts.demoted,
        "promoted_pages": counts.promoted,
    }


def tier_figures(tier: CacheTier | None) -> dict[str, Any]:
    """The tiers' figures (the whole worker's, never a namespace's): the link's counts, then each tier's own."""
    if tier is None:
        return {}
    counts = tier.counts
    out = {
        "spilled_pages": counts.spilled_pages,
        "spill_dropped_pages": counts.spill_dropped_pages,
        "host_loaded_pages": counts.loaded_pages.get(MEDIUM_HOST, 0),
        "disk_loaded_pages": counts.loaded_pages.get(MEDIUM_DISK, 0),
    }
    out["store_loaded_pages"] = counts.loaded_pages.get(MEDIUM_STORE, 0)
    for t in tier.tiers.stats():
        if t.medium == MEDIUM_STORE:
            out |= {f"store_{name}": getattr(t, name) for name in TIER_STORE_FIGURES}
            out["store_ready"] = int(t.ready)
            continue
        prefix = {MEDIUM_HOST: "host_", MEDIUM_DISK: "disk_"}[t.medium]
        out |= {prefix + name: getattr(t, name) for name in ("pages", "bytes", "capacity_bytes", "evicted_pages")}
        if t.medium == MEDIUM_DISK:
            out |= {f"disk_{name}": getattr(t, name) for name in TIER_DISK_FIGURES}
            out["disk_ready"] = int(t.ready)
    return out


def window_figures(window: WindowParts | None) -> dict[str, Any]:
    """The window slots' figures (window paging; none without)."""
    if window is None:
        return {}
    return {
        "window_slots_total": window.slots.num_pages,
        "window_slots_free": window.num_free,
        "window_parts_idle": window.idle_parts,
        "window_parts_dropped": window.dropped,
    }
