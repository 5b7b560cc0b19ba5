"""Lease: one running sequence's hold on the cache, and the records it carries (PageCopy, Lookup, its CacheMiss).

The caches (radixcache.cache.PrefixCache, radixcache.cache_off.CacheOff) create, change and end leases; the engine
reads them. The private fields are the caches' bookkeeping (radixcache.cache_check reads them to name a leak).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixcache.miss_reasons import CacheMiss
    from radixcache.node import Node


@dataclass(frozen=True, slots=True)
class PageCopy:
    """A hit that ends `tokens` tokens into a cached page: the engine copies the first `tokens` slots of page `src`
    into the lease's own page `dst` (its last page) before its next call on the lease, then calls `copied`."""

    src: int
    dst: int
    tokens: int


@dataclass(slots=True)
class Lookup:
    """Prompt tokens one lookup (or many, summed) queried, served from the cache, and served by a partial copy."""

    queried: int = 0
    hit: int = 0
    copied: int = 0

    def add(self, other: Lookup) -> None:
        self.queried += other.queried
        self.hit += other.hit
        self.copied += other.copied


@dataclass(eq=False)
class Lease:
    """One running sequence's hold on the cache. Compare by identity; treat the fields as read-only.

    pages: the block table in token order: shared (tree) pages first, then private pages (allocated by this lease;
    freed at release unless published). copy_from: the partial-page copy the engine owes before its next call on
    this lease (then `copied` lets the lease stop holding its source page), or None. miss: why its lookup served
    `cached_tokens` and no more (radixcache.miss_reasons), set by acquire.
    """

    owner: str
    namespace: str
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    copy_from: PageCopy | None = None
    released: bool = False
    miss: CacheMiss | None = None
    _id: int = field(default=0, repr=False)
    _node: Node | None = field(default=None, repr=False)  # the node this lease locks
    _cover: int = field(default=0, repr=False)  # leading pages of `pages` that must stay under the lock
    _src: int | None = field(default=None, repr=False)  # copy source, held until copied (or publish/extend/release)
    _lookup: Lookup | None = field(default=None, repr=False)  # its lookup, until counted in the statistics
    _wfirst: int = field(default=0, repr=False)  # window parts: the lease holds those of pages[_wfirst:] (and _src's)
