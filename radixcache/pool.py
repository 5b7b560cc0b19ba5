"""KV pool: the tensors that hold every cached key and value, addressed by page.

Layout: one tensor [layers, pages, 2, page_size, kv_heads, head_dim]. For one layer, `pool.layer(i)` is
[pages, 2, page_size, kv_heads, head_dim], FlashInfer's NHD paged layout with K at index 0 and V at 1. Which page
belongs to whom is decided by `radixcache.cache`; this module only owns the storage.

A page moves in and out of the pool whole, as a `radixcache.page_data.PageData` (`read_page` / `write_page`): its
K/V in the pool's storage dtype plus the scales its precision needs, named by `kv_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixcache.page_data import PageData

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


# KV precision names (what --kv-dtype, ModelInfo and a page's identity say) of the full-precision dtypes.
KV_DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_dtype_name(dtype: str | torch.dtype) -> str:
    """torch.float32 / 'float32' / 'fp32' -> 'fp32' (the KV precision's name)."""
    return KV_DTYPE_NAMES[parse_dtype(dtype)]


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
        self.kv_dtype = kv_dtype_name(self.dtype)  # part of a page's identity (event hashes, disk fingerprints)
        self.bytes_per_token = kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, self.dtype)
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

    # ---- whole pages in and out (the disk tier, tests) ------------------------------------------------------
    def read_page(self, page: int) -> PageData:
        """A copy of `page` (every layer, K and V, every slot) on the CPU."""
        self._check_page(page)
        return PageData(self.kv_dtype, self.kv[:, page].to("cpu", copy=True).contiguous())

    def write_page(self, page: int, data: PageData) -> None:
        """Overwrite `page` with `data` (from read_page of a pool of the same precision and shape). ValueError,
        writing nothing, for a page of another kv dtype or shape, or a page id outside the pool."""
        self._check_page(page)
        want = (self.shape.layers, 2, self.page_size, self.shape.kv_heads, self.shape.head_dim)
        if data.kv_dtype != self.kv_dtype:
            raise ValueError(f"a {data.kv_dtype} page cannot be written into a {self.kv_dtype} KV pool")
        if tuple(data.kv.shape) != want or data.kv.dtype != self.dtype:
            raise ValueError(
                f"a page of shape {tuple(data.kv.shape)} ({data.kv.dtype}) does not fit this pool's pages of "
                f"shape {want} ({self.dtype})"
            )
        if data.scales is not None:
            raise ValueError(f"a {self.kv_dtype} page has no scales, and this one has some")
        self.kv[:, page] = data.kv.to(self.device)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside the pool's {self.num_pages} pages")
