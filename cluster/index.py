"""The router's view of what each replica caches: exact pages from cache events, plus prompts routed but not stored yet.

Pages are identified by the chained page hashes of radixcache.events, so a request's prompt is looked up by computing
its own hash chain once and walking it per replica. Two sources feed the view:
- events: exactly what the replica's tree holds (stored / removed / cleared, snapshot on (re)subscribe);
- in flight: the pages of prompts this router sent to a replica and has not seen stored yet. Requests sent moments
  apart with the same new prefix must stick together before any event says the prefix is cached. In-flight entries
  expire after `inflight_ttl_s`, and a stored event for the same hash supersedes them.
Only whole pages count: partial tails are not in the event stream.

Where a page lives: a "stored" / "removed" event may name a medium below the device (its 4th element: "CPU" for a
replica's host-memory tier, "DISK" for its disk tier; none, or "GPU", for the pool the model reads). Those pages are
kept apart, per medium: `match_split` counts the leading pages in the device (or in flight), then how many of the
pages right after them a tier below holds (the replica would load those instead of computing them), which the
policy scores below device pages and above nothing. Replicas sharing one disk-tier folder each report the files
they find there, so a page one wrote counts for the others once their store sees it. Pages in the fleet's shared
store ("STORE", `serve --kv-remote`) count for every replica, whichever reported them: any replica can load them.
Everything else (`match`,
`holds`, `held_pages`, what the pool would evict) is about the device alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixcache.salt import owner_namespace
from radixcache.tier import MEDIUM_DEVICE as DEVICE
from radixcache.tier import MEDIUM_STORE as STORE

Replica = Hashable


def event_medium(event: tuple[Any, ...]) -> str:
    """The medium a "stored" / "removed" hub event names (the device when it names none)."""
    return event[3] if len(event) > 3 and event[3] else DEVICE


@dataclass
class _ReplicaView:
    cached: dict[str, set[int]] = field(default_factory=dict)  # namespace -> page hashes its events say it holds
    inflight: dict[tuple[str, int], float] = field(default_factory=dict)  # (namespace, hash) -> expiry time
    routed: int = 0  # prompts routed here (expired in-flight entries are swept every 256)
    below: dict[str, dict[str, set[int]]] = field(default_factory=dict)  # medium -> namespace -> page hashes


class PrefixIndex:
    """Longest cached prefix per replica. Not thread-safe: use from one asyncio loop (the router's)."""

    def __init__(self, *, inflight_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.inflight_ttl_s = inflight_ttl_s
        self.clock = clock
        self._replicas: dict[Replica, _ReplicaView] = {}

    # -- events ----------------------------------------------------------------------------------------------------
    # A salted namespace's pages (radixcache.salt) count as their tenant's: their hashes name the salt already, and a
    # salted prompt's hashes (salted_page_hashes) run from the shared span into them under one namespace.
    def stored(self, replica: Replica, namespace: str, page_hashes: Sequence[int], medium: str = DEVICE) -> None:
        namespace = owner_namespace(namespace)
        view = self._view(replica)
        if medium != DEVICE:
            view.below.setdefault(medium, {}).setdefault(namespace, set()).update(page_hashes)
            return
        view.cached.setdefault(namespace, set()).update(page_hashes)
        for h in page_hashes:
            view.inflight.pop((namespace, h), None)

    def removed(self, replica: Replica, namespace: str, page_hashes: Sequence[int], medium: str = DEVICE) -> None:
        namespace = owner_namespace(namespace)
        view = self._view(replica)
        held = view.cached if medium == DEVICE else view.below.get(medium, {})
        cached = held.get(namespace)
        if cached is not None:
            cached.difference_update(page_hashes)

    def cleared(self, replica: Replica, namespace: str | None = None) -> None:
        """A namespace flushed from the device (its tiers' pages are removed by their own events), or (None)
        everything, every medium: a reset before a fresh snapshot."""
        view = self._view(replica)
        if namespace is None:
            view.cached.clear()
            view.below.clear()
        elif namespace != owner_namespace(namespace):
            return  # a salted namespace emptied: its removals came first, its tenant's other pages stay
        else:
            view.cached.pop(namespace, None)

    def apply(self, replica: Replica, events: Sequence[tuple[Any, ...]]) -> None:
        """Apply one replica's batch of hub events, in order (see radixcache.cluster.hub.Event)."""
        for event in events:
            kind = event[0]
            if kind == "stored":
                self.stored(replica, event[1], event[2], event_medium(event))
            elif kind == "removed":
                self.removed(replica, event[1], event[2], event_medium(event))
            elif kind == "cleared":
                self.cleared(replica, event[1])
            elif kind == "reset":
                self.cleared(replica)
            else:
                raise ValueError(f"unknown cache event {kind!r}")

    def snapshot(self) -> list[tuple[Replica, list[tuple[Any, ...]]]]:
        """Every replica's cached pages as hub events: ("reset",) then one "stored" per namespace (and medium)."""
        out = []
        for replica, view in self._replicas.items():
            events: list[tuple[Any, ...]] = [("reset",)]
            events += [("stored", ns, sorted(h)) for ns, h in view.cached.items() if h]
            for medium, held in view.below.items():
                events += [("stored", ns, sorted(h), medium) for ns, h in held.items() if h]
            out.append((replica, events))
        return out

    def forget(self, replica: Replica) -> None:
        """The replica is gone (died or scaled down): nothing routes by its cache any more."""
        self._replicas.pop(replica, None)

    # -- routing ---------------------------------------------------------------------------------------------------
    def routed(self, replica: Replica, namespace: str, page_hashes: Sequence[int]) -> None:
        """A prompt was sent to `replica`: count its pages as (soon) cached there until events say otherwise."""
        view = self._view(replica)
        now = self.clock()
        expiry = now + self.inflight_ttl_s
        view.routed += 1
        if view.routed % 256 == 0:  # so that held_pages does not count what expired long ago
            view.inflight = {k: t for k, t in view.inflight.items() if t >= now}
        cached = view.cached.get(namespace, ())
        for h in page_hashes:
            if h not in cached:
                view.inflight[(namespace, h)] = expiry

    def match(self, replica: Replica, namespace: str, page_hashes: Sequence[int]) -> int:
        """How many leading pages of the chain `replica` holds in the device (or will hold, in flight)."""
        view = self._replicas.get(replica)
        if view is None:
            return 0
        return self._device_run(view, namespace, page_hashes)

    def match_split(self, replica: Replica, namespace: str, page_hashes: Sequence[int]) -> tuple[int, int]:
        """(leading pages of the chain in the device or in flight, the pages right after those that a tier below
        holds, up to the first that none does): what `replica` would hit, and what it would load."""
        device, below, _ = self.match_tiers(replica, namespace, page_hashes)
        return device, below

    def match_tiers(self, replica: Replica, namespace: str, page_hashes: Sequence[int]) -> tuple[int, int, int]:
        """As match_split, and of the pages it would load, how many only the fleet's store holds (none of
        `replica`'s own tiers): those load over the network, at the store's cost."""
        view = self._replicas.get(replica)
        if view is None:
            return 0, 0, 0
        device = self._device_run(view, namespace, page_hashes)
        if device == len(page_hashes):
            return device, 0, 0
        own = [held[namespace] for medium, held in view.below.items() if medium != STORE and held.get(namespace)]
        store = self._in_store(namespace)
        below = from_store = 0
        for h in page_hashes[device:]:
            if any(h in held for held in own):
                below += 1
            elif any(h in held for held in store):
                below += 1
                from_store += 1
            else:
                break
        return device, below, from_store

    def copy_below(self, replica: Replica, namespace: str, page_hash: int) -> str | None:
        """Where below the device a copy of the page is kept for `replica`: the medium of one of its own tiers, else
        the fleet's store (whichever replica reported it), else None: what losing the page from its pool costs."""
        namespace = owner_namespace(namespace)
        view = self._replicas.get(replica)
        if view is not None:
            for medium, held in view.below.items():
                if medium != STORE and page_hash in held.get(namespace, ()):
                    return medium
        return STORE if any(page_hash in held for held in self._in_store(namespace)) else None

    def _in_store(self, namespace: str) -> list[set[int]]:
        """`namespace`'s pages in the fleet's store, as each replica's events report them (any replica loads them)."""
        out = []
        for view in self._replicas.values():
            held = view.below.get(STORE)
            if held and held.get(namespace):
                out.append(held[namespace])
        return out

    def _device_run(self, view: _ReplicaView, namespace: str, page_hashes: Sequence[int]) -> int:
        cached = view.cached.get(namespace, ())
        now = self.clock()
        n = 0
        for h in page_hashes:
            if h in cached:
                n += 1
                continue
            expiry = view.inflight.get((namespace, h))
            if expiry is None:
                break
            if expiry < now:
                del view.inflight[(namespace, h)]
                break
            n += 1
        return n

    def holds(self, replica: Replica, namespace: str, page_hash: int) -> bool:
        """Whether `replica` caches that page by its events, or was sent it moments ago (in flight)."""
        view = self._replicas.get(replica)
        if view is None:
            return False
        if page_hash in view.cached.get(namespace, ()):
            return True
        expiry = view.inflight.get((namespace, page_hash))
        return expiry is not None and expiry >= self.clock()

    def held_pages(self, replica: Replica) -> int:
        """Pages `replica` holds by its events, plus those in flight (expired ones included until looked up)."""
        view = self._replicas.get(replica)
        return sum(map(len, view.cached.values())) + len(view.inflight) if view else 0

    def cached_hashes(self, replica: Replica, namespace: str, medium: str = DEVICE) -> set[int]:
        """What the events say `replica` holds in `namespace` on `medium` (a copy; for tests and stats)."""
        view = self._replicas.get(replica)
        if view is None:
            return set()
        held = view.cached if medium == DEVICE else view.below.get(medium, {})
        return set(held.get(namespace, ()))

    def replicas(self) -> list[Replica]:
        return list(self._replicas)

    def _view(self, replica: Replica) -> _ReplicaView:
        view = self._replicas.get(replica)
        if view is None:
            view = self._replicas[replica] = _ReplicaView()
        return view
