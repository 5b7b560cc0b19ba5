"""Soft retention: a request asks the prefix it computed to be kept, with a priority, for a while.

`Retention(priority, seconds)` travels with a lease (the engine sets `lease.retention`) to every publish, which
stamps each node on the published path with `priority` and `kept_until = now + seconds` on the tree's clock. Under
the `priority` eviction policy the tree evicts, when an allocation is short, the unprotected leaves of lowest
effective priority first, least recently used first among equals. Under `lru` (the default) retention is ignored.

Decay: a node's effective priority is its `priority` while the clock reads less than `kept_until`, then 0 (like a
leaf nobody asked to keep), so after `seconds` it is evicted like any other in LRU order. A step, not a slope:
deterministic, testable with an injected clock, and keyed so that expiry never needs a rescan
(radixcache.lru moves an expired leaf back into the plain LRU order lazily, O(log n) each).

Retention never refuses anything: it only orders what is evictable. Pins (radixcache.tree, with the pin budget)
stay the one way to make pages un-evictable. A node stamped twice keeps the higher effective priority (and, at the
same priority, the later expiry).

Bound: retention shares the pin budget's number. The pages under a running stamp (`RadixTree.retained_pages`, all
tenants together, as pinned pages are counted) never exceed the cache's `max_pinned_pages` (--max-pinned): a publish
stamps its path from the root down while it fits and leaves the rest in plain LRU order (nothing is refused;
restamping what is already retained costs nothing). So one tenant that retains everything at the top priority keeps
at most what it could have pinned, and the other tenants' pages compete for the rest in LRU order as they would beside
pins, only never starved of capacity: retained pages are still evicted once nothing else is left. Within the budget
there is no per-tenant share (as with pins); fronts bound both fields (worker/front/validation.py).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PRIORITY = 100  # the highest priority a request may ask for
MAX_RETENTION_SECONDS = 86_400.0  # a day: a retained prefix decays to priority 0 by then at the latest
EVICTION_POLICIES = ("lru", "priority")


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep what this request computed at `priority` (1..MAX_PRIORITY) for `seconds` (> 0, at most a day)."""

    priority: int
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"retention priority must be an integer, got {self.priority!r}")
        if not 1 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"retention priority must be in 1..{MAX_PRIORITY}, got {self.priority}")
        if not 0 < self.seconds <= MAX_RETENTION_SECONDS:
            raise ValueError(f"retention seconds must be in (0, {MAX_RETENTION_SECONDS:g}], got {self.seconds}")


def check_policy(policy: str) -> str:
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
    return policy
