import pytest
import torch

from radixcache.pages import PageAllocator
from radixcache.pool import KVPool, KVShape


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


def test_allocator_and_pool_bounds() -> None:
    assert PageAllocator(1).alloc(1) == [0]
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        PageAllocator(0)
    with pytest.raises(ValueError, match="negative"):
        PageAllocator(2).alloc(-1)
    shape = KVShape(layers=2, kv_heads=2, head_dim=4)
    for field in ("layers", "kv_heads", "head_dim"):
        with pytest.raises(ValueError, match=f"{field} must be >= 1"):
            KVShape(**{**vars(shape), field: 0})
    per_page = KVPool.bytes_per_page(shape, 4, "fp16")
    assert per_page == 4 * 2 * 2 * 2 * 4 * 2  # tokens x (K and V) x layers x heads x dims x bytes
    pool = KVPool.from_budget(shape, page_size=4, budget_bytes=3 * per_page + per_page // 2, dtype="fp16")
    assert (pool.num_pages, pool.page_size, pool.dtype, pool.nbytes, pool.device.type) == (
        3,
        4,
        torch.float16,
        3 * per_page,
        "cpu",
    )
    assert KVPool.from_budget(shape, page_size=4, budget_bytes=per_page, dtype="fp16").num_pages == 1
    # the device it was asked for (meta: shapes only, so this runs without an accelerator)
    assert (
        KVPool.from_budget(shape, page_size=4, budget_bytes=per_page, dtype="fp16", device="meta").kv.device.type
        == "meta"
    )
    with pytest.raises(ValueError, match="holds no page"):
        KVPool.from_budget(shape, page_size=4, budget_bytes=per_page - 1, dtype="fp16")
    assert pool.shape == shape and pool.layer(1).shape == (3, 2, 4, 2, 4)
    for bad, error in (
        ({"page_size": 0}, "page_size must be >= 1, got 0"),
        ({"num_pages": 0}, "num_pages must be >= 1"),
    ):
        with pytest.raises(ValueError, match=error):
            KVPool(shape, **{"page_size": 4, "num_pages": 2, **bad})
    for slots in (0, 5):
        with pytest.raises(ValueError, match="num_slots must be in 1..4"):
            pool.copy_prefix(0, 1, slots)
    with pytest.raises(ValueError, match="unknown dtype 'fp7'; use one of"):
        KVPool.bytes_per_page(shape, 4, "fp7")
