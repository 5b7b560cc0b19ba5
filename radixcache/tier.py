"""What every tier below the device pool shares: how a page is named there, and the interface a tier offers.

A page below memory is named by `PageKey`: its namespace, its chained page hash (radixcache.events: the hash the
cache events use, so it names the page's whole prefix and its tenant), its parent's hash and its tokens. The hash
alone finds the page; the parent and the tokens are stored with it and compared on every read, so a hash collision
or a file that belongs to another prefix is a miss, never a wrong page.

A tier (`PageTier`) holds opaque page payloads (radixcache.pool's PageData on the worker; bytes in tests) by key:
`put` (asynchronous where the tier writes slowly; False when it declined the page), `contains` (what the tier's
memory says: no system call, for the engine thread), `find` (`contains`, or a look at the files: one stat, for an
admission's lookup), `get` (the payload, checked, or None), `flush` (a namespace or everything), `stats`, `take_changes`
(what it started and stopped holding, for cache events) and `close`. Three tiers exist: radixcache.host_tier.HostTier
(host memory, pinned on CUDA), radixcache.store.DiskStore (files) and radixcache.remote_tier.RemoteTier (the
fleet's shared store); `TierChain` puts them in that order.

The cache's side: `CacheTier` is what radixcache.cache calls on its link to the tiers (radixcache.tiering.TierLink);
`NoTier` stands in for it where no tier is configured (`PagesBelow`, the part eviction calls, as no-ops).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

# Pages one get_many call asks a batching tier for (a run of 32 pages of a 125M model is ~38 MB in fp32).
BATCH_PAGES = 32
MEDIUM_DEVICE = "GPU"  # vLLM's name for the pool the model reads, whatever the device
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_STORE = "STORE"  # the fleet's shared store (Mooncake): any replica can load its pages


@dataclass(frozen=True, slots=True)
class PageKey:
    """One whole page of one namespace. tokens: the page's token ids in radixcache.keys format (4 bytes each)."""

    namespace: str
    page_hash: int
    parent_hash: int  # 0: the namespace's first page
    tokens: bytes

    @property
    def name(self) -> tuple[str, int]:
        """What finds the page in a tier (the rest is checked on read)."""
        return (self.namespace, self.page_hash)


@dataclass(frozen=True, slots=True)
class TierChange:
    """A tier started (stored=True) or stopped holding a page; `key` is None-free for stored pages."""

    medium: str
    stored: bool
    namespace: str
    page_hash: int
    key: PageKey | None = None  # set when stored


@dataclass(frozen=True, slots=True)
class TierRecord:
    """A tier holds `key` on `medium` (MEDIUM_HOST, MEDIUM_DISK): one entry of a snapshot's tier part."""

    medium: str
    key: PageKey


@dataclass(frozen=True, slots=True)
class LoadedPage:
    """A page read back from a tier: its payload and the medium it came from."""

    payload: Any
    medium: str


@dataclass
class TierStats:
    medium: str
    pages: int = 0  # pages held (written, for the disk)
    bytes: int = 0
    capacity_bytes: int = 0
    queued_pages: int = 0  # accepted, not written yet (readable)
    written_pages: int = 0  # put and landed
    dropped_pages: int = 0  # put refused: the write queue was full, or the page is larger than the tier
    evicted_pages: int = 0  # dropped by the tier's own LRU to stay within its capacity
    read_hits: int = 0
    read_misses: int = 0  # get found nothing (or only a page of another prefix)
    corrupt_pages: int = 0  # files found torn, truncated or mismatched on read: deleted, never served
    write_errors: int = 0  # I/O errors while writing (the page is dropped)
    skipped_pages: int = 0  # the fleet's store: put, but another worker had written it already (not written again)
    unavailable_errors: int = 0  # the fleet's store: calls that failed or ran past their deadline
    ready: bool = True  # the index of what a previous run left is rebuilt


class PageTier(Protocol):
    medium: str

    def put(self, key: PageKey, payload: Any) -> bool: ...

    def contains(self, key: PageKey) -> bool: ...

    def find(self, key: PageKey) -> bool: ...

    def get(self, key: PageKey) -> Any | None: ...

    def flush(self, namespace: str | None = None) -> int: ...

    def stats(self) -> TierStats: ...

    def take_changes(self) -> list[TierChange]: ...

    def records(self) -> Iterator[PageKey]: ...

    def close(self, timeout: float | None = None) -> None: ...


class TierChain:
    """Tiers in order, fastest first (host memory, then disk, then the fleet's store): `put` goes to the first
    (which pushes what it cannot keep down to the next), `get` and `contains` look in each in turn, `get_run` reads a
    prompt's pages (a tier that also has `get_many(keys)`, the store, in runs of BATCH_PAGES), the rest goes to all."""

    def __init__(self, tiers: list[PageTier] | None = None) -> None:
        self.tiers: list[PageTier] = list(tiers or [])

    def put(self, key: PageKey, payload: Any) -> bool:
        return self.tiers[0].put(key, payload) if self.tiers else False

    def contains(self, key: PageKey) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def find(self, key: PageKey) -> bool:
        return any(tier.find(key) for tier in self.tiers)

    def get(self, key: PageKey) -> LoadedPage | None:
        """The page from the first tier that has it (checked), or None."""
        for tier in self.tiers:
            if tier.find(key):
                payload = tier.get(key)
                if payload is not None:
                    return LoadedPage(payload, tier.medium)
        return None

    def get_run(self, keys: list[PageKey], keep_going: Callable[[], bool] = lambda: True) -> Iterator[LoadedPage]:
        """The pages of `keys` in order, each from the first tier that has it (checked), up to the first page no
        tier gives or until keep_going() turns False. A tier with `get_many` (the fleet's store) is asked for a run of
        up to BATCH_PAGES pages in one call: the consecutive pages no tier above it has."""
        i = 0
        while i < len(keys) and keep_going():
            pages, more = self._pages_at(keys, i)
            yield from pages
            if not more:
                return
            i += len(pages)

    def _pages_at(self, keys: list[PageKey], i: int) -> tuple[list[LoadedPage], bool]:
        """Pages from keys[i] on, from the first tier that gives keys[i]: that one, or a batching tier's run; and
        whether the walk may go on after them (not past a page missing in the middle of a run)."""
        for depth, tier in enumerate(self.tiers):
            if not tier.find(keys[i]):
                continue
            get_many = getattr(tier, "get_many", None)
            if get_many is None:
                payload = tier.get(keys[i])
                if payload is not None:
                    return [LoadedPage(payload, tier.medium)], True
                continue
            run = [keys[i]]
            for later in keys[i + 1 : i + BATCH_PAGES]:
                if any(above.find(later) for above in self.tiers[:depth]):
                    break  # a tier above holds it: that one serves it
                run.append(later)
            pages = []
            for payload in get_many(run):
                if payload is None:
                    break
                pages.append(LoadedPage(payload, tier.medium))
            if pages:
                return pages, len(pages) == len(run)
        return [], False

    def flush(self, namespace: str | None = None) -> int:
        return sum(tier.flush(namespace) for tier in self.tiers)

    def take_changes(self) -> list[TierChange]:
        return [change for tier in self.tiers for change in tier.take_changes()]

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]

    def by_medium(self, medium: str) -> PageTier | None:
        return next((tier for tier in self.tiers if tier.medium == medium), None)

    def close(self, timeout: float | None = None) -> None:
        for tier in self.tiers:
            tier.close(timeout)


class PagesBelow(Protocol):
    """What the cache's eviction (radixcache.eviction) calls on what lies below memory: a TierLink, or NoTier."""

    def spill(self, freed: list[int]) -> None: ...

    def copying(self, src: int, dst: int) -> None: ...

    def discard(self) -> None: ...

    def flush(self, namespace: str | None) -> int: ...


class CacheTier(PagesBelow, Protocol):
    """What radixcache.cache.PrefixCache calls on its link to the tiers (radixcache.tiering.TierLink)."""

    counts: Any
    tiers: TierChain
    sink: Any

    def attach(self, cache: Any) -> None: ...

    def check(self) -> None: ...

    def tier_records(self) -> list[TierRecord]: ...


class NoTier:
    """Nothing below memory: evicted pages are simply freed, a flush reaches nothing (PagesBelow, as no-ops)."""

    def spill(self, freed: list[int]) -> None:
        pass

    def copying(self, src: int, dst: int) -> None:
        pass

    def discard(self) -> None:
        pass

    def flush(self, namespace: str | None) -> int:
        return 0
