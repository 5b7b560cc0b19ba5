"""Window parts: the sliding layers' K/V of each page, kept only while some window needs it.

A model with sliding-window layers (Mistral, Gemma 2/3) splits every page in two (radixcache.pool): its full part
(the global layers, addressed by the page id) and its window part (the sliding layers, in a slot of the pool's
window arena). A query at position q of a sliding layer of window W reads positions q-W+1..q only, so a page whose
tokens all lie before that needs no window part: the full part stays (every global layer reads it), the window part
goes back. This module decides which pages have a window part and which slot holds it; it never touches tensors.

Holders of a window part: each live lease whose window still covers the page (`hold` / `let_go`), and the tree, for
pages it stores, while nobody else needs them ("idle" parts: cached for a later hit that continues there). Idle
parts are given back least recently used first when slots run short (`make_room`), before any full page is evicted,
and whenever the tree drops the page. A part no lease holds and the tree does not store is freed at once.

Invariants (`check`): a page has a slot iff a lease holds its part or it is idle; idle pages are stored in the tree;
slots are distinct and every used slot belongs to one page.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from radixcache.pages import PageAllocator


def first_needed_page(position: int, window: int, page_size: int) -> int:
    """The first page a query at `position` of a sliding layer of `window` reads (worker/attention/window.py's
    first_visible): pages before it may lose their window parts."""
    return max(0, position - window + 1) // page_size


class WindowParts:
    """Window slots for the pages 0..num_pages-1 of a pool (see the module docstring).

    `on_dropped(pages)`: told of tree pages that lost their window part, or were stored without one, while their
    full part stays cached (the window group's events: radixcache.event_log)."""

    def __init__(
        self,
        num_pages: int,
        num_slots: int,
        *,
        window: int,
        page_size: int,
        on_dropped: Callable[[list[int]], None] | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.window, self.page_size = window, page_size
        self.slots = PageAllocator(num_slots)
        self.slot = [-1] * num_pages  # page -> its window slot, -1: none
        self._holds = [0] * num_pages  # page -> leases holding its part
        self._idle: OrderedDict[int, None] = OrderedDict()  # parts only the tree keeps, least recently used first
        self._in_tree: set[int] = set()
        self.on_dropped = on_dropped
        self.dropped = 0  # idle parts given back to make room, since start

    # ---- what a lease needs --------------------------------------------------------------------------------
    def first_needed(self, position: int) -> int:
        return first_needed_page(position, self.window, self.page_size)

    def hit_limit(self, pages: list[int], tokens: int) -> int:
        """The longest prefix (<= tokens) of a match over `pages` (whole pages, then the partial one) whose window a
        continuation can read: every page holding one of the last W - 1 positions before it has a window part.
        Cut at a page boundary below a page that lacks one (and try again there)."""
        ps = self.page_size
        while tokens > 0:
            first, last = self.first_needed(tokens), (tokens - 1) // ps
            missing = [i for i in range(first, last + 1) if self.slot[pages[i]] < 0]
            if not missing:
                return tokens
            tokens = missing[-1] * ps
        return 0

    def has_parts(self, pages: Iterable[int]) -> bool:
        return all(self.slot[p] >= 0 for p in pages)

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    @property
    def idle_parts(self) -> int:
        return len(self._idle)

    def available(self) -> int:
        """Slots an attach could get now: free + idle."""
        return self.slots.num_free + len(self._idle)

    # ---- holders -------------------------------------------------------------------------------------------
    def attach(self, pages: list[int]) -> None:
        """Fresh window parts for `pages` (just allocated, none has one), each held once by the allocating lease.
        Call make_room(len(pages)) first."""
        for page, slot in zip(pages, self.slots.alloc(len(pages)), strict=True):
            assert self.slot[page] < 0, f"page {page} already has a window part"
            self.slot[page], self._holds[page] = slot, 1

    def make_room(self, n: int) -> bool:
        """Make `n` slots free, giving back idle parts least recently used first; False (nothing given back) when
        even all of them would not do."""
        short = n - self.slots.num_free
        if short <= 0:
            return True
        if short > len(self._idle):
            return False
        dropped = []
        for _ in range(short):
            page, _ = self._idle.popitem(last=False)
            self._free(page)
            dropped.append(page)
        self.dropped += len(dropped)
        if self.on_dropped is not None:
            self.on_dropped(dropped)
        return True

    def hold(self, page: int) -> None:
        """One more lease reads `page`'s part (which it must have)."""
        assert self.slot[page] >= 0, f"page {page} has no window part to hold"
        self._holds[page] += 1
        self._idle.pop(page, None)

    def let_go(self, page: int) -> None:
        """One lease fewer reads `page`'s part: the tree keeps it idle, or it is freed."""
        holds = self._holds[page] - 1
        assert holds >= 0, f"page {page}: its window part was let go more often than held"
        self._holds[page] = holds
        if holds == 0:
            if page in self._in_tree:
                self._idle[page] = None
            else:
                self._free(page)

    def swap(self, src: int, dst: int) -> bool:
        """A lease would swap its page `src` for the tree's `dst` (same tokens): its hold moves to dst's part. False
        (nothing changed: the lease keeps reading src) when dst has none, so a tree page never gains a part after it
        was stored (what the window group's events rely on)."""
        if self.slot[dst] < 0:
            return False
        self.hold(dst)
        self.let_go(src)
        return True

    # ---- the tree ------------------------------------------------------------------------------------------
    def stored(self, pages: list[int]) -> None:
        """The tree now stores `pages` (whole pages and perhaps a partial tail). Those without a part (a sequence's
        pages its window had left) are reported dropped at once: a store reports the window group as held."""
        self._in_tree.update(pages)
        lacking = [p for p in pages if self.slot[p] < 0]
        if lacking and self.on_dropped is not None:
            self.on_dropped(lacking)

    def tree_pages(self) -> set[int]:
        return set(self._in_tree)

    def unstored(self, pages: Iterable[int]) -> None:
        """The tree no longer stores `pages`: their idle parts go."""
        for page in pages:
            self._in_tree.discard(page)
            if page in self._idle:
                del self._idle[page]
                self._free(page)

    def _free(self, page: int) -> None:
        self.slots.decref([self.slot[page]])
        self.slot[page] = -1

    # ---- checks --------------------------------------------------------------------------------------------
    def check(self, holds: dict[int, int], tree_pages: set[int]) -> None:
        """Assert the invariants, given each page's lease holds as the leases count them and the tree's pages."""
        self.slots.check()
        assert self._in_tree == tree_pages, (
            f"window parts think the tree stores {sorted(self._in_tree ^ tree_pages)[:8]} differently"
        )
        used = [s for s in self.slot if s >= 0]
        assert len(set(used)) == len(used), "two pages share a window slot"
        assert len(used) == self.slots.num_held, f"{len(used)} pages have window slots, {self.slots.num_held} held"
        for page, slot in enumerate(self.slot):
            want = holds.get(page, 0)
            assert self._holds[page] == want, f"page {page}: {self._holds[page]} window holds, leases hold {want}"
            idle = page in self._idle
            assert not idle or page in tree_pages, f"page {page}'s window part is idle but not in the tree"
            assert not idle or want == 0, f"page {page}'s window part is idle and held"
            assert (slot >= 0) == (want > 0 or idle), (
                f"page {page}: window slot {slot} with {want} holds ({'idle' if idle else 'not idle'})"
            )
