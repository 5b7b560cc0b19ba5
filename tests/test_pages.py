import pytest

from radixcache.pages import PageAllocator


def test_alloc_hands_out_distinct_pages_with_refcount_one() -> None:
    alloc = PageAllocator(8)
    pages = alloc.alloc(3)
    assert pages == [0, 1, 2]
    assert all(alloc.refcount(p) == 1 for p in pages)
    assert alloc.num_free == 5 and alloc.num_held == 3
    assert sorted(alloc.free_pages()) == [3, 4, 5, 6, 7]
    more = alloc.alloc(5)
    assert set(pages).isdisjoint(more)
    assert alloc.num_free == 0
    alloc.check()


def test_alloc_more_than_free_raises_and_takes_nothing() -> None:
    alloc = PageAllocator(4)
    alloc.alloc(3)
    with pytest.raises(MemoryError, match="2 pages requested, 1 free of 4"):
        alloc.alloc(2)
    assert alloc.num_free == 1
    assert alloc.alloc(0) == []
    with pytest.raises(ValueError):
        alloc.alloc(-1)
    alloc.check()


def test_decref_frees_only_at_zero_and_reuses_pages() -> None:
    alloc = PageAllocator(4)
    a, b = alloc.alloc(2)
    alloc.incref([a, a])
    assert alloc.refcount(a) == 3
    assert alloc.decref([a, b]) == [b]
    assert alloc.decref([a]) == []
    assert alloc.decref([a]) == [a]
    assert alloc.num_free == 4
    alloc.check()
    again = alloc.alloc(4)
    assert sorted(again) == [0, 1, 2, 3]


def test_misuse_raises() -> None:
    alloc = PageAllocator(2)
    (page,) = alloc.alloc(1)
    alloc.decref([page])
    with pytest.raises(ValueError, match="already free"):
        alloc.decref([page])
    with pytest.raises(ValueError, match="free"):
        alloc.incref([page])
    with pytest.raises(ValueError):
        PageAllocator(0)
    alloc.check()


def test_check_catches_corruption() -> None:
    alloc = PageAllocator(3)
    alloc.alloc(1)
    alloc._refcounts[0] = 0  # a held page that lost its count: neither free nor referenced
    with pytest.raises(AssertionError, match="neither free nor referenced"):
        alloc.check()
