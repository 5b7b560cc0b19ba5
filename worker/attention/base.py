"""The attention backend interface and its registry.

One engine step = one BatchLayout. The model calls `backend.begin_step(layout)` once, then
`backend.forward(layer, q, k, v, kv_layer, layout)` per layer. Every backend computes the same thing:

    write the new K/V rows into the pool at (layout.write_pages, layout.write_slots), then
    out[t] = softmax(q[t] . K_seq^T / sqrt(D)) V_seq over positions 0..positions[t] of t's sequence,

with query head h reading KV head h // (H // KVH) (grouped-query attention). Backends differ only in speed.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from radixcache.worker.attention.layout import BatchLayout


class AttentionBackend(ABC):
    """Paged causal attention over prefix + new tokens.

    Contract:
    - begin_step(layout) is called once per step before any forward with that layout; a backend may plan
      there (FlashInfer) or precompute gather indices (torch). It must not read the KV pool.
    - forward(layer_idx, q[T,H,D], k[T,KVH,D], v[T,KVH,D], kv_layer[pages,2,page,KVH,D], layout) writes k/v
      into kv_layer at the layout's write positions, then returns attention output [T,H,D] in q's dtype
      (scale 1/sqrt(D), causal within each sequence, cached prefix fully visible).
    """

    name: str = "abstract"

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype

    @abstractmethod
    def begin_step(self, layout: BatchLayout) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        layout: BatchLayout,
    ) -> torch.Tensor: ...

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, layout: BatchLayout) -> None:
        """Store the step's new K/V rows at (write_pages, write_slots) of one layer."""
        index = (layout.write_pages, layout.write_slots)
        kv_layer[:, 0].index_put_(index, k.to(kv_layer.dtype))
        kv_layer[:, 1].index_put_(index, v.to(kv_layer.dtype))


# name -> "module:Class", so a backend's heavy imports (flashinfer) happen only when it is created.
_REGISTRY: dict[str, str] = {
    "torch": "radixcache.worker.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "radixcache.worker.attention.flashinfer_backend:FlashInferAttentionBackend",
}


def register_backend(name: str, target: str | Callable[..., AttentionBackend]) -> None:
    """Register a backend under `name`: a "module:Class" path or a factory callable."""
    _REGISTRY[name] = target  # type: ignore[assignment]


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def flashinfer_usable() -> bool:
    """True when CUDA is present and flashinfer imports (it is only imported here when CUDA is present)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("flashinfer")
    except Exception:  # an ImportError, or a broken install raising anything at import
        return False
    return True


def resolve_backend_name(name: str) -> str:
    """'auto' -> 'flashinfer' when usable, else 'torch'; other names are checked against the registry."""
    if name == "auto":
        return "flashinfer" if flashinfer_usable() else "torch"
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {available_backends()}")
    return name


def create_backend(name: str = "auto", device: str | torch.device = "cpu", **options: object) -> AttentionBackend:
    """Create a backend by name ("auto" | "torch" | "flashinfer").

    auto = flashinfer when CUDA is available, flashinfer imports and dtype is float16/bfloat16; otherwise torch.
    options: num_heads, num_kv_heads, head_dim, dtype (the flashinfer backend needs them to plan; torch ignores them).
    """
    if name == "auto" and options.get("dtype") not in (None, torch.float16, torch.bfloat16):
        resolved = "torch"  # flashinfer kernels run 16-bit only; float32 models use the torch backend
    else:
        resolved = resolve_backend_name(name)
    target = _REGISTRY[resolved]
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
    else:
        factory = target
    return factory(device, **options)
