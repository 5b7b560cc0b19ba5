"""A page leaves and enters a KVPool whole (PageData): the disk tier's unit. Round trips are bit-exact; a page of
another precision or shape is refused before anything is written; a corrupt buffer is a ValueError, never a crash."""

from __future__ import annotations

import pytest
import torch

from radixcache.page_data import PageData
from radixcache.pool import KVPool, KVShape

SHAPE = KVShape(layers=3, kv_heads=2, head_dim=8)


def filled_pool(dtype: str = "fp32", page_size: int = 4, num_pages: int = 5, seed: int = 0) -> KVPool:
    pool = KVPool(SHAPE, page_size=page_size, num_pages=num_pages, dtype=dtype)
    torch.manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    return pool


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_page_round_trips_through_bytes_into_another_pool(dtype: str) -> None:
    src, dst = filled_pool(dtype), filled_pool(dtype, seed=1)
    before = dst.kv.clone()
    page = src.read_page(3)
    assert page.kv_dtype == src.kv_dtype == dtype
    assert page.nbytes == src.bytes_per_token * src.page_size
    back = PageData.from_bytes(page.to_bytes())
    assert back.equal(page) and back.kv_dtype == dtype
    dst.write_page(1, back)
    assert torch.equal(dst.kv[:, 1], src.kv[:, 3])  # every layer, K and V, every slot
    others = [p for p in range(dst.num_pages) if p != 1]
    assert torch.equal(dst.kv[:, others], before[:, others])


def test_read_page_is_a_copy_not_a_view() -> None:
    pool = filled_pool()
    page = pool.read_page(0)
    pool.kv[:, 0] = 7.0
    assert not bool((page.kv == 7.0).any())


def test_write_page_refuses_another_precision_or_shape_and_writes_nothing() -> None:
    pool = filled_pool("fp32")
    before = pool.kv.clone()
    for data, error in (
        (filled_pool("bf16").read_page(0), "a bf16 page cannot be written into a fp32 KV page"),
        (filled_pool("fp32", page_size=8).read_page(0), "does not fit this pool's pages"),
        (PageData("fp32", torch.zeros(3, 2, 4, 2, 8), torch.ones(3, 2, 4, 2)), "has no scales"),
    ):
        with pytest.raises(ValueError, match=error):
            pool.write_page(0, data)
    for page in (-1, pool.num_pages):
        with pytest.raises(ValueError, match="outside the pool"):
            pool.write_page(page, pool.read_page(0))
        with pytest.raises(ValueError, match="outside the pool"):
            pool.read_page(page)
    assert torch.equal(pool.kv, before)


def test_corrupt_buffers_are_value_errors() -> None:
    good = filled_pool().read_page(2).to_bytes()
    head_end = 12 + int.from_bytes(good[8:12], "big")
    for bad, error in (
        (b"", "magic"),
        (b"XXXXXXXX" + good[8:], "magic"),
        (good[:-1], "truncated"),
        (good + b"\0", "bytes after its tensors"),
        (good[:8] + (10**6).to_bytes(4, "big") + good[12:], "does not fit"),
        (good[:12] + b"{" * (head_end - 12) + good[head_end:], "unreadable"),
        (good.replace(b'"version":1', b'"version":9'), "version 9"),
        (good.replace(b'"float32"', b'"float64"'), "bad tensor entry"),
    ):
        with pytest.raises(ValueError, match=error):
            PageData.from_bytes(bad)
