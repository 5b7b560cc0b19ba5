"""LeaseWindows: what the request path asks of the sliding layers' window parts (radixcache.window_parts).

Every step of a lease that touches pages has a window side: a hit may only be served where the window after it is
held, a lease holds the parts of its pages from `first_needed(position)` on and lets the older ones go as it grows,
fresh pages get parts, the tree keeps idle parts of what it stores. The caches (radixcache.cache, cache_off) call
the same methods whatever the model: `NoWindows` when no layer's values are paged apart (a page is whole: every
call is a no-op), `WindowHolds` over a WindowParts when they are. The rule itself is in docs/MODULES.md ("The
prefix rule of sliding-window layers").

A lease's parts: those of `lease.pages[lease._wfirst:]`, and of its copy source `lease._src` while it holds one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import TYPE_CHECKING

from radixcache.keys import TOKEN_BYTES
from radixcache.window_parts import WindowParts

if TYPE_CHECKING:
    from radixcache.events import EventSink
    from radixcache.lease import Lease
    from radixcache.node import Match
    from radixcache.tree import RadixTree


class LeaseWindows(ABC):
    """The window side of each step of the request path (see the module docstring)."""

    parts: WindowParts | None  # the slots themselves (None: pages are whole)

    # ---- lookups ---------------------------------------------------------------------------------------------
    @abstractmethod
    def servable(self, m: Match) -> int:
        """Tokens of match `m` a continuation can read: all of them, or fewer where a window part is missing."""

    @abstractmethod
    def readable(self, tree: RadixTree, m: Match, key: bytes, namespace: str) -> Match:
        """`m`, or the match of its servable prefix (matched again without touching the LRU)."""

    @abstractmethod
    def hold_match(self, lease: Lease, m: Match) -> None:
        """The lease now reads match `m`: hold the parts of its pages that the next query's window reads."""

    @abstractmethod
    def keep_whole(self, lease: Lease, m: Match) -> bool:
        """acquire's partial hit fell through (no page for the copy): let go of the partial page's part and hold
        what a continuation after m's whole pages reads. False (the lease holds no part of m then) when those parts
        are missing: the caller gives up the hit."""

    @abstractmethod
    def adopt(self, lease: Lease, pages: list[int], held: int) -> bool:
        """extend: the lease would adopt pages[held:] (`pages` the tree's for its tokens). Move its holds to the
        window after them, or False (nothing changed) when their parts are gone."""

    @abstractmethod
    def slide(self, lease: Lease, position: int) -> None:
        """The lease's next query is at `position`: let go of the parts no query of it reads again."""

    # ---- pages -----------------------------------------------------------------------------------------------
    @abstractmethod
    def shortage(self, n: int) -> str | None:
        """Why `n` fresh pages cannot all get window parts now (the error's text), or None when they can."""

    @abstractmethod
    def attach(self, pages: list[int]) -> None:
        """Fresh parts for freshly allocated `pages` (after `shortage` said they fit), held by the allocating lease."""

    @abstractmethod
    def swap(self, lease: Lease, i: int, tree_page: int) -> bool:
        """publish would swap lease.pages[i] for the tree's `tree_page` (the same tokens): move the hold, or False
        (nothing changed: the lease keeps its own page) when the tree's page has lost its part."""

    @abstractmethod
    def let_go(self, page: int) -> None:
        """One lease fewer reads `page`'s part (a copy source, once copied)."""

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """The lease ends: let go of every part it holds of its pages."""

    @abstractmethod
    def stored(self, pages: list[int]) -> None:
        """The tree now stores `pages`: it keeps their parts idle once no lease holds them."""

    @abstractmethod
    def unstored(self, pages: list[int]) -> None:
        """The tree no longer stores `pages`: their idle parts go."""

    # ---- admin -----------------------------------------------------------------------------------------------
    @abstractmethod
    def slots(self, pages: list[int]) -> list[int]:
        """The window slot of each page (-1: none); [] when pages are whole."""

    @abstractmethod
    def tree_pages(self) -> list[int]:
        """The tree pages that still have their part (for a snapshot)."""

    @abstractmethod
    def report_to(self, sink: EventSink | None) -> None:
        """Tell `sink` (its `window_removed`, where it has one) of tree pages that lose their part."""

    @abstractmethod
    def check(self, leases: Collection[Lease], tree_pages: set[int]) -> None:
        """Assert the parts' invariants against what the leases hold and what the tree stores."""


class NoWindows(LeaseWindows):
    """Pages are whole (no layer slides, or the pool keeps every layer in the page): nothing to hold."""

    parts = None

    def servable(self, m: Match) -> int:
        return m.tokens

    def readable(self, tree: RadixTree, m: Match, key: bytes, namespace: str) -> Match:
        return m

    def hold_match(self, lease: Lease, m: Match) -> None:
        pass

    def keep_whole(self, lease: Lease, m: Match) -> bool:
        return True

    def adopt(self, lease: Lease, pages: list[int], held: int) -> bool:
        return True

    def slide(self, lease: Lease, position: int) -> None:
        pass

    def shortage(self, n: int) -> str | None:
        return None

    def attach(self, pages: list[int]) -> None:
        pass

    def swap(self, lease: Lease, i: int, tree_page: int) -> bool:
        return True

    def let_go(self, page: int) -> None:
        pass

    def release(self, lease: Lease) -> None:
        pass

    def stored(self, pages: list[int]) -> None:
        pass

    def unstored(self, pages: list[int]) -> None:
        pass

    def slots(self, pages: list[int]) -> list[int]:
        return []

    def tree_pages(self) -> list[int]:
        return []

    def report_to(self, sink: EventSink | None) -> None:
        pass

    def check(self, leases: Collection[Lease], tree_pages: set[int]) -> None:
        pass


class WindowHolds(LeaseWindows):
    """The sliding layers' values live in window slots (`parts`), held as the module docstring says."""

    parts: WindowParts  # always the slots here

    def __init__(self, parts: WindowParts) -> None:
        self.parts = parts
        self.page_size = parts.page_size

    # ---- lookups ---------------------------------------------------------------------------------------------
    def servable(self, m: Match) -> int:
        return self.parts.hit_limit(m.read_pages(), m.tokens)

    def readable(self, tree: RadixTree, m: Match, key: bytes, namespace: str) -> Match:
        usable = self.servable(m)
        if usable == m.tokens:
            return m
        return tree.match(key[: usable * TOKEN_BYTES], namespace, touch=False)

    def hold_match(self, lease: Lease, m: Match) -> None:
        w = self.parts
        lease._wfirst = w.first_needed(m.tokens)
        for page in m.read_pages()[lease._wfirst :]:
            w.hold(page)

    def keep_whole(self, lease: Lease, m: Match) -> bool:
        w = self.parts
        w.let_go(m.partial_page)
        whole = len(m.pages) * self.page_size
        first = w.first_needed(whole)  # the window after the whole pages may start a page earlier
        if w.hit_limit(m.pages, whole) == whole:
            for page in m.pages[first : lease._wfirst]:
                w.hold(page)
            lease._wfirst = min(first, lease._wfirst)
            return True
        for page in m.pages[lease._wfirst :]:
            w.let_go(page)
        lease._wfirst = 0
        return False

    def adopt(self, lease: Lease, pages: list[int], held: int) -> bool:
        w = self.parts
        first = max(lease._wfirst, w.first_needed(len(pages) * self.page_size))
        if not w.has_parts(pages[max(first, held) :]):
            return False  # their parts went (idle, then given back): the caller computes them instead
        for page in lease.pages[lease._wfirst : min(first, held)]:
            w.let_go(page)
        for page in pages[max(first, held) :]:
            w.hold(page)
        lease._wfirst = first
        return True

    def slide(self, lease: Lease, position: int) -> None:
        w = self.parts
        first = min(w.first_needed(position), len(lease.pages))
        for page in lease.pages[lease._wfirst : first]:
            w.let_go(page)
        lease._wfirst = max(lease._wfirst, first)

    # ---- pages -----------------------------------------------------------------------------------------------
    def shortage(self, n: int) -> str | None:
        w = self.parts
        if n <= w.available():
            return None
        return (
            f"the KV cache needs {n} window slots for its sliding layers but has {w.num_free} free and "
            f"{w.idle_parts} idle (of {w.slots.num_pages}); the rest are read by running requests' windows"
        )

    def attach(self, pages: list[int]) -> None:
        self.parts.make_room(len(pages))
        self.parts.attach(pages)

    def swap(self, lease: Lease, i: int, tree_page: int) -> bool:
        return i < lease._wfirst or self.parts.swap(lease.pages[i], tree_page)

    def let_go(self, page: int) -> None:
        self.parts.let_go(page)

    def release(self, lease: Lease) -> None:
        let_go = self.parts.let_go
        for page in lease.pages[lease._wfirst :]:
            let_go(page)

    def stored(self, pages: list[int]) -> None:
        self.parts.stored(pages)

    def unstored(self, pages: list[int]) -> None:
        self.parts.unstored(pages)

    # ---- admin -----------------------------------------------------------------------------------------------
    def slots(self, pages: list[int]) -> list[int]:
        slot = self.parts.slot
        return [slot[p] for p in pages]

    def tree_pages(self) -> list[int]:
        slot = self.parts.slot
        return [p for p in self.parts.tree_pages() if slot[p] >= 0]

    def report_to(self, sink: EventSink | None) -> None:
        self.parts.on_dropped = getattr(sink, "window_removed", None)

    def check(self, leases: Collection[Lease], tree_pages: set[int]) -> None:
        holds: dict[int, int] = {}
        for lease in leases:
            for page in lease.pages[lease._wfirst :] + ([lease._src] if lease._src is not None else []):
                holds[page] = holds.get(page, 0) + 1
        self.parts.check(holds, tree_pages)


def lease_windows(num_pages: int, page_size: int, window: int, window_slots: int) -> LeaseWindows:
    """The window side for a pool of `num_pages` pages: WindowHolds over `window_slots` slots when a layer's window
    of `window` tokens is paged apart (window > 0), else NoWindows."""
    if not window:
        return NoWindows()
    if window_slots < 1:
        raise ValueError(f"window parts need window slots, got {window_slots}")
    return WindowHolds(WindowParts(num_pages, window_slots, window=window, page_size=page_size))
