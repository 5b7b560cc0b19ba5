"""The attention backend interface and its registry.

One engine step = one BatchLayout. The model calls `backend.begin_step(layout)` once, then
`backend.forward(layer, q, k, v, kv_layer, layout)` per layer. Every backend computes the same thing:

    write the new K/V rows into the pool at (layout.write_pages, layout.write_slots), at its precision, then
    s = cap(scale * q[t] . K_seq^T), cap(x) = soft_cap * tanh(x / soft_cap) when soft_cap is set, else x
    out[t] = softmax(s) V_seq over the positions layer `layer` of t's sequence sees (worker/attention/window.py:
    0..positions[t] for a global layer, the last W of them for a sliding one),

with query head h reading KV head h // (H // KVH) (grouped-query attention); scale, soft_cap and each layer's
window come from the backend's AttentionOptions. Backends differ only in speed.
"""

from __future__ import annotations

import importlib
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixcache.pool import KVLayer
from radixcache.worker.attention.layout import BatchLayout


@dataclass(frozen=True)
class AttentionOptions:
    """What a model's attention computes beyond scaled causal softmax; a backend is created for one model's options.

    scale:    the scores' scale; None: 1/sqrt(head_dim).
    soft_cap: scores (after scaling) become soft_cap * tanh(scores / soft_cap) before the mask (Gemma 2); None: not.
    windows:  () when every layer is global, else one entry per layer: None (global: every earlier position) or W
              (sliding: the last W positions, its own included). All-None is stored as (), so options that spell out
              the global layers equal those that do not.
    latent:   the pages are latent pages (multi-head latent attention, radixcache/pool.py; the pool's layers have
              KVLayer.latent): forward's k and v are the two halves of each new token's latent [T, 1, D / 2],
              which the layer stores token-contiguous, and every position's key and value is its whole latent [D]
              (read back by token row, KVLayer.gather_latents; latent_tokens() is [pages, page_size, D]); q is
              [T, H, D]. The output is [T, H, R] or [T, H, D]: only its first R = kv_lora_rank dimensions
              (softmax(s) @ c) are what a latent backend must return, and all worker/model/mla.py reads (the torch
              backend returns all D, FlashInfer's MLA kernels R). The torch backend runs it everywhere, the
              flashinfer_mla backend on CUDA where flashinfer_mla_unsupported_reason allows.
    latent_dims: with latent, (R, P) = (kv_lora_rank, qk_rope_head_dim), D = R + P: where the latent splits into c
              and k_pe (FlashInfer's MLA kernels take them apart); None: not told (then only torch runs it).
    """

    scale: float | None = None
    soft_cap: float | None = None
    windows: tuple[int | None, ...] = ()
    latent: bool = False
    latent_dims: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("scale", "soft_cap"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"attention {name} must be a finite number > 0, got {value}")
        windows = tuple(self.windows)
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"attention windows must be >= 1 token, got {windows}")
        object.__setattr__(self, "windows", windows if any(w is not None for w in windows) else ())
        if self.latent_dims is not None:
            if not self.latent:
                raise ValueError("attention latent_dims are for latent pages (latent=True)")
            rank, rope = self.latent_dims
            if rank < 1 or rope < 0:
                raise ValueError(
                    f"attention latent_dims must be (kv_lora_rank >= 1, rope dim >= 0), got {self.latent_dims}"
                )
            object.__setattr__(self, "latent_dims", (int(rank), int(rope)))

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s window (None: global)."""
        return self.windows[layer] if self.windows else None

    @property
    def distinct_windows(self) -> tuple[int | None, ...]:
        """Every window some layer has, global (None) first: a backend plans once per entry each step."""
        sliding = tuple(sorted({w for w in self.windows if w is not None}))
        return (None, *sliding) if None in self.windows or not self.windows else sliding


class AttentionBackend(ABC):
    """Paged causal attention over prefix + new tokens.

    Contract:
    - begin_step(layout) is called once per step before any forward with that layout; a backend may plan
      there (FlashInfer) or precompute gather indices (torch). It must not read the KV pool.
    - forward(layer_idx, q[T,H,D], k[T,KVH,D], v[T,KVH,D], kv_layer, layout) writes k/v into kv_layer at the
      layout's write positions, encoded at its precision, then returns attention output [T,H,D] in q's dtype
      (causal within each sequence; a global layer sees its whole cached prefix, a sliding layer its window).
      kv_layer is a radixcache.pool.KVLayer (values [pages, 2, page, KVH, stored_dim], scales, codec:
      KVPool.kv_layer(i)) or a bare full-precision [pages, 2, page, KVH, D] tensor; a backend reads every position
      back from it, the step's own tokens too, at its precision.
    - A sliding layer never reads a page of a sequence's block table before `window.skipped_pages` (the pages no
      query of the step can see): those may hold anything (NaN included), so a cache may give them back.
    - With window paging (layout.window_kv_indices set: the pool keeps the sliding layers apart, radixcache.pool),
      a sliding layer's kv_layer is addressed by window slots: it writes and reads through `layout.windowed()`.
    - With latent pages (AttentionOptions.latent), q is [T, H, R + P], k / v the latent's halves, and forward returns
      [T, H, R] or more: its first R dimensions are the contract (see AttentionOptions).
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
        attention: AttentionOptions | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.attention = attention or AttentionOptions()
        self.kv_dtype_name = kv_dtype  # the KV precision the engine's pool pages are in (None: not told)

    @abstractmethod
    def begin_step(self, layout: BatchLayout) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor | KVLayer,
        layout: BatchLayout,
    ) -> torch.Tensor: ...

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor | KVLayer, layout: BatchLayout) -> None:
        """Store the step's new K/V rows at (write_pages, write_slots) of one layer, encoded at its precision."""
        KVLayer.of(kv_layer).write(layout.write_pages, layout.write_slots, k, v)


# name -> "module:Class", so a backend's heavy imports (flashinfer) happen only when it is created.
_REGISTRY: dict[str, str] = {
    "torch": "radixcache.worker.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "radixcache.worker.attention.flashinfer_backend:FlashInferAttentionBackend",
    # FlashInfer's MLA kernels over latent pages: what 'flashinfer' and 'auto' resolve to for an MLA model
    "flashinfer_mla": "radixcache.worker.attention.flashinfer_mla_backend:FlashInferMLABackend",
}


def register_backend(name: str, target: str | Callable[..., AttentionBackend]) -> None:
    """Register a backend under `name`: a "module:Class" path or a factory callable."""
    _REGISTRY[name] = target  # type: ignore[assignment]


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
# KV precisions FlashInfer's paged kernels read: the model's own 16-bit dtype, or fp8 e4m3 with per-layer scales
# (run()'s k_scale / v_scale). int8 / int4 pages have no FlashInfer kernel: the torch backend dequantizes them.
FLASHINFER_KV_DTYPES = ("bf16", "fp16", "fp8_e4m3")
# The head_dims FlashInfer 0.6.1's prefill kernels (which also run mixed prefill+decode batches) exist for. On Hopper
# they are FA3 kernels, instantiated for 64, 128 and 256 only. Elsewhere FA2 runs, whose loads work in 64-wide
# blocks: other sizes fault or return wrong values without an error (flashinfer-ai/flashinfer#4299), and a fault
# poisons the CUDA context, so a bad size must be refused up front, not caught after a failed warm-up. Decode
# compiles for more sizes, so a decode-only warm-up would pass and every prefill then fail.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


class BackendUnavailableError(ValueError):
    """An explicitly requested backend cannot run this model on this device; the message says why."""


# The latent split FlashInfer's MLA kernels are instantiated and tested for: kv_lora_rank 512, a rope dim of 64
# (DeepSeek V2 / V3, Kimi K2). The kernels are templates over both dims, but FlashInfer tests 512 / 64 only, and its fp8 path
# asserts 512; another split would be a JIT build nobody has run.
FLASHINFER_MLA_DIMS = (512, 64)


def _cuda_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"it needs a CUDA device, and the model is on {device}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def _import_reason(attribute: str | None = None) -> str | None:
    try:
        module = importlib.import_module("flashinfer")
    except Exception as exc:  # an ImportError, or a broken install raising anything at import
        return f"flashinfer does not import ({type(exc).__name__}: {exc}); `pip install flashinfer-python`"
    if attribute is not None and not hasattr(module, attribute):
        return f"the installed flashinfer has no {attribute}"
    return None


def flashinfer_mla_unsupported_reason(
    device: str | torch.device,
    *,
    num_heads: int | None = None,
    dtype: torch.dtype | None = None,
    kv_dtype: str | None = None,
    attention: AttentionOptions | None = None,
) -> str | None:
    """Why the flashinfer_mla backend (FlashInfer's BatchMLAPagedAttentionWrapper) cannot run a latent (MLA) model
    of this shape and dtype on `device` with latent pages of `kv_dtype` (None: the model's dtype); None when it can.

    Checks, cheapest first: a CUDA device torch sees, num_heads and a 16-bit model dtype (plan() takes them; any head
    count: the kernels pack query rows x heads into tiles of 64), the latent's split (kv_lora_rank, rope dim) being
    FLASHINFER_MLA_DIMS, pages in the model's own dtype or fp8_e4m3 where FlashInfer's fp8 MLA path runs, and last
    that flashinfer imports with the wrapper.

    Latent pages at int8 / int4 have no FlashInfer kernel (per-token scales; the torch backend dequantizes them).
    fp8_e4m3 latent pages: FlashInfer's MLA plan() takes kv_data_type float8_e4m3fn on an SM90 (Hopper) device with
    bfloat16 queries and 512 / 64 only (flashinfer/mla/_core.py), and run() dequantizes with one per-tensor scale for
    c (ckv_scale) and one for k_pe (kpe_scale): real = stored * scale. An fp8 latent pool keeps one per-layer scale
    for the whole latent (radixcache/pool.py: its V scale is its K scale), so ckv_scale = kpe_scale = k_scale is the
    same dequantization the torch backend's gather_latents does. Elsewhere (fp16 models, other GPUs) they are refused.
    """
    device = torch.device(device)
    reason = _cuda_reason(device)
    if reason is not None:
        return reason
    if num_heads is None:
        return "it needs num_heads to plan, and it is unset"
    if dtype is None:
        return "it needs the model dtype to plan, and it is unset"
    if dtype not in FLASHINFER_DTYPES:
        return f"its MLA kernels run float16/bfloat16, and the model is {str(dtype).removeprefix('torch.')}"
    dims = attention.latent_dims if attention is not None else None
    if dims is None:
        return "it needs the latent's split (kv_lora_rank, rope dim) to plan, and it is unset"
    if dims != FLASHINFER_MLA_DIMS:
        rank, rope = FLASHINFER_MLA_DIMS
        return (
            f"its MLA kernels are built for kv_lora_rank {rank} with a rope dim of {rope}, and the model's are "
            f"{dims[0]} and {dims[1]}"
        )
    model_kv = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    if kv_dtype == "fp8_e4m3":
        if dtype != torch.bfloat16:
            return "its fp8 MLA kernels take bfloat16 queries only, and the model is float16 (KV dtype fp8_e4m3)"
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:
            return (
                f"its fp8 MLA kernels run on SM90 (Hopper) only, and the device is SM{major}{minor} (KV dtype fp8_e4m3)"
            )
    elif kv_dtype is not None and kv_dtype != model_kv:
        why = "its MLA kernels read latent pages in the model's dtype or fp8_e4m3"
        if kv_dtype in ("int8", "int4"):
            why = "it has no MLA kernel for int8/int4 latent pages (the torch backend dequantizes them)"
        return f"{why}, and the KV dtype is {kv_dtype}"
    reason = _import_reason("BatchMLAPagedAttentionWrapper")
    if reason is None and kv_dtype == "fp8_e4m3":  # an older release's run() has no fp8 scales
        wrapper = importlib.import_module("flashinfer").BatchMLAPagedAttentionWrapper
        try:
            params = inspect.signature(wrapper.run).parameters
        except (TypeError, ValueError):  # no signature to read: let the start-up warm-up find out
            return None
        if not {"ckv_scale", "kpe_scale"} <= set(params):
            return "the installed flashinfer's MLA run() takes no ckv_scale / kpe_scale (fp8 latent pages need them)"
    return reason


def flashinfer_unsupported_reason(
    device: str | torch.device,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    kv_dtype: str | None = None,
) -> str | None:
    """Why the flashinfer backend cannot run a model of this geometry and dtype on `device` with KV pages of
    `kv_dtype` (None: the model's dtype); None when it can.

    Checks, cheapest first: a CUDA device that torch sees, the geometry and a 16-bit dtype (plan() needs them), a KV
    precision its kernels read (the model's dtype or fp8_e4m3), a head_dim FlashInfer's prefill kernels exist for,
    and last that flashinfer imports (only ever imported once everything else holds, so a CPU machine or a CPU
    device never touches it).
    """
    device = torch.device(device)
    reason = _cuda_reason(device)
    if reason is not None:
        return reason
    if None in (num_heads, num_kv_heads, head_dim):
        return "it needs num_heads, num_kv_heads and head_dim to plan, and some are unset"
    if dtype is None:
        return "it needs the model dtype to plan, and it is unset"
    if dtype not in FLASHINFER_DTYPES:
        return f"its kernels run float16/bfloat16, and the model is {str(dtype).removeprefix('torch.')}"
    model_kv = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    if kv_dtype is not None and kv_dtype != model_kv and kv_dtype != "fp8_e4m3":
        why = "its kernels read KV pages in the model's dtype or fp8_e4m3"
        if kv_dtype in ("int8", "int4"):
            why = "it has no kernel for int8/int4 KV pages (the torch backend dequantizes them in its gather)"
        return f"{why}, and the KV dtype is {kv_dtype}"
    if num_heads % num_kv_heads:  # type: ignore[operator]
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head_dim {head_dim} has no FlashInfer prefill kernel (it supports {FLASHINFER_HEAD_DIMS})"
    return _import_reason()


def resolve_backend_name(name: str, device: str | torch.device = "cpu", **options: object) -> str:
    """'auto' -> 'flashinfer' when it can run this model on `device` (see flashinfer_unsupported_reason), else
    'torch'. Other names are checked against the registry; an explicit 'flashinfer' that cannot run raises
    BackendUnavailableError saying why.

    A latent (MLA) model (options' attention has latent set): 'flashinfer' and 'auto' mean FlashInfer's MLA kernels,
    'flashinfer_mla', where flashinfer_mla_unsupported_reason allows; else auto gives 'torch' and an explicit
    'flashinfer' (or 'flashinfer_mla') raises BackendUnavailableError naming the reason. No other backend reads
    latent pages."""
    geometry = {key: options.get(key) for key in ("num_heads", "num_kv_heads", "head_dim", "dtype", "kv_dtype")}
    attention = options.get("attention")
    latent = isinstance(attention, AttentionOptions) and attention.latent
    if latent and name != "torch":
        if name not in ("auto", "flashinfer", "flashinfer_mla"):
            if name not in _REGISTRY:
                raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {available_backends()}")
            raise BackendUnavailableError(
                f"attention backend {name!r} cannot run here: it does not read latent (MLA) pages. Use backend "
                "'torch' or 'flashinfer' (or 'auto', which picks one of them for MLA models)"
            )
        reason = flashinfer_mla_unsupported_reason(
            device, num_heads=geometry["num_heads"], dtype=geometry["dtype"], kv_dtype=geometry["kv_dtype"],
            attention=attention,  # type: ignore[arg-type]
        )  # fmt: skip
        if reason is None:
            return "flashinfer_mla"
        if name == "auto":
            return "torch"
        raise BackendUnavailableError(
            f"attention backend {name!r} cannot run here: FlashInfer's MLA kernels for latent (MLA) pages: {reason}. "
            "Use backend 'torch' (or 'auto', which picks flashinfer only where it can run)"
        )
    if name == "auto":
        return "flashinfer" if flashinfer_unsupported_reason(device, **geometry) is None else "torch"  # type: ignore[arg-type]
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {available_backends()}")
    if name == "flashinfer_mla":
        raise BackendUnavailableError(
            "attention backend 'flashinfer_mla' cannot run here: it reads latent (MLA) pages only, and this model has "
            "none. Use backend 'flashinfer', 'torch' or 'auto'"
        )
    if name == "flashinfer":
        reason = flashinfer_unsupported_reason(device, **geometry)  # type: ignore[arg-type]
        if reason is not None:
            raise BackendUnavailableError(
                f"attention backend 'flashinfer' cannot run here: {reason}. Use backend 'torch' (or 'auto', "
                "which picks flashinfer only where it can run)"
            )
    return name


def create_backend(name: str = "auto", device: str | torch.device = "cpu", **options: object) -> AttentionBackend:
    """Create a backend by name ("auto" | "torch" | "flashinfer").

    auto = flashinfer when it can run this model on `device` (a CUDA device, 16-bit dtype, KV pages in that dtype or
    fp8_e4m3, a head_dim its prefill kernels support, flashinfer importable); otherwise torch. For a latent (MLA)
    model, flashinfer means FlashInfer's MLA kernels (the flashinfer_mla backend: kv_lora_rank 512, rope dim 64,
    pages in the model's 16-bit dtype, or fp8_e4m3 on Hopper for a bf16 model; see resolve_backend_name). An explicit
    "flashinfer" that cannot run raises BackendUnavailableError naming the reason. options: num_heads, num_kv_heads,
    head_dim, dtype, kv_dtype (the KV precision's name; the flashinfer backend needs them to plan; torch ignores
    them) and attention (AttentionOptions: the model's scale, soft cap and per-layer windows; default plain causal
    attention on every layer).
    """
    resolved = resolve_backend_name(name, device, **options)
    target = _REGISTRY[resolved]
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
    else:
        factory = target
    return factory(device, **options)
