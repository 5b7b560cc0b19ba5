"""Page allocator: a free list plus one reference count per page.

A page is either free (refcount 0, on the free list) or held (refcount >= 1, off the free list). The allocator does
not know who the holders are; `radixcache.cache` keeps the rule "refcount = number of holders" (the tree node that
stores the page, plus one per lease that reads it) and `PrefixCache.check()` verifies it.
"""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocator:
    """Hands out page ids first..first+num_pages-1 (first: 0 unless the ids follow another allocator's).

    Contract: `alloc` returns pages with refcount 1 owned by the caller; every `incref` must be matched by exactly one
    `decref`; a page returns to the free list when its count reaches 0. Misuse (decref of a free page, incref of a
    free page, asking for more pages than are free) raises instead of corrupting the counts.
    """

    def __init__(self, num_pages: int, *, first: int = 0) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.first = first
        # Indexed by page id (the first `first` entries unused): no offset arithmetic on the hot path.
        self._refcounts = [0] * (first + num_pages)
        # Reversed so that a fresh allocator hands out 0, 1, 2, ... (pops from the end): easier to read in tests.
        self._free = list(range(first + num_pages - 1, first - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """`n` free pages, each with refcount 1. Raises MemoryError (nothing taken) if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise MemoryError(f"{n} pages requested, {len(self._free)} free of {self.num_pages}")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        refcounts = self._refcounts
        for page in pages:
            refcounts[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more holder for each page (a page listed twice gains two). Every page must already be held."""
        refcounts = self._refcounts
        for page in pages:
            if refcounts[page] < 1:
                raise ValueError(f"incref of page {page}, which is free")
            refcounts[page] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """One holder fewer for each page; returns the pages that became free (and are back on the free list)."""
        refcounts = self._refcounts
        freed: list[int] = []
        for page in pages:
            count = refcounts[page]
            if count < 1:
                raise ValueError(f"decref of page {page}, which is already free (double release?)")
            refcounts[page] = count - 1
            if count == 1:
                freed.append(page)
        self._free.extend(freed)
        return freed

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def free_pages(self) -> list[int]:
        """A copy of the free list (for checks and tests)."""
        return list(self._free)

    def check(self) -> None:
        """Asserts: free pages have refcount 0 and appear once; held pages have refcount >= 1; free + held = total."""
        free = self._free
        seen = set(free)
        assert len(seen) == len(free), "a page is on the free list twice"
        for page in free:
            assert self._refcounts[page] == 0, f"page {page} is on the free list with refcount {self._refcounts[page]}"
        assert all(self.first <= page < self.first + self.num_pages for page in free), "a foreign page is free"
        assert not any(self._refcounts[: self.first]), "a page below this allocator's range is held"
        held = sum(1 for count in self._refcounts if count > 0)
        assert all(count >= 0 for count in self._refcounts), "a negative refcount"
        assert held + len(free) == self.num_pages, (
            f"free ({len(free)}) + held ({held}) != total ({self.num_pages}): a page is neither free nor referenced"
        )
