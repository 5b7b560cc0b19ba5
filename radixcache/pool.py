"""KV pool: the tensors that hold every cached key and value, addressed by page.

Layout: one tensor [layers, pages, 2, page_size, kv_heads, head_dim]. For one layer, `pool.layer(i)` is
[pages, 2, page_size, kv_heads, head_dim], FlashInfer's NHD paged layout with K at index 0 and V at 1. Which page
belongs to whom is decided by `radixcache.cache`; this module only owns the storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'float16' / torch.float32 -> torch.dtype, with an error naming the accepted spellings."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str | torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    element = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    return 2 * layers * kv_heads * head_dim * element


@dataclass(frozen=True)
class KVShape:
    """The model-side shape of one token's KV entry."""

    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


class KVPool:
    """Paged KV storage for one model shape on one device.

    Contract: the pool never decides ownership. Page ids come from `PrefixCache`/`PageAllocator`; the pool only
    stores values and copies slots between pages (the copy-on-write step of a hit that ends inside a page).
    """

    def __init__(
        self,
        shape: KVShape,
        *,
        page_size: int,
        num_pages: int,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.shape = shape
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.kv = torch.zeros(
            (shape.layers, num_pages, 2, page_size, shape.kv_heads, shape.head_dim),
            dtype=self.dtype,
            device=self.device,
        )

    @classmethod
    def from_budget(
        cls,
        shape: KVShape,
        *,
        page_size: int,
        budget_bytes: int,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """As many whole pages as fit in `budget_bytes` (seed formula x page_size per page)."""
        per_page = cls.bytes_per_page(shape, page_size, dtype)
        num_pages = budget_bytes // per_page
        if num_pages < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no page of {per_page} bytes")
        return cls(shape, page_size=page_size, num_pages=num_pages, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_page(shape: KVShape, page_size: int, dtype: str | torch.dtype) -> int:
        return page_size * kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, dtype)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, index: int) -> torch.Tensor:
        """[pages, 2, page_size, kv_heads, head_dim] view of one layer (NHD, K then V)."""
        return self.kv[index]

    def copy_prefix(self, src_page: int, dst_page: int, num_slots: int) -> None:
        """Copy the first `num_slots` token slots of `src_page` into `dst_page`, in every layer, K and V."""
        if not 0 < num_slots <= self.page_size:
            raise ValueError(f"num_slots must be in 1..{self.page_size}, got {num_slots}")
        self.kv[:, dst_page, :, :num_slots] = self.kv[:, src_page, :, :num_slots]
