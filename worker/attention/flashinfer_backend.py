"""FlashInfer paged attention (CUDA only). flashinfer is imported inside the class, never at module import,
so this module loads on machines without CUDA or flashinfer.

Per step: begin_step plans one wrapper per distinct window of the model's layers (decode wrappers when every
sequence adds one token, else prefill wrappers, which also handle mixed prefill + decode batches); forward writes
the new K/V into the pages with a torch index_put at (write_pages, write_slots) and runs the kernel planned for its
layer's window on the layer's NHD paged tensor [pages, 2, page_size, KVH, D]. A sliding layer's plan passes
window_left = W - 1 and starts each block table at the first page the window needs (worker/attention/window.py):
the kernel aligns queries to the end of the (shorter) K/V, so positions stay exact. The model's scale and soft cap
go to plan() as sm_scale and logits_soft_cap.

KV precision: pages in the model's 16-bit dtype, or fp8_e4m3 (`kv_dtype="fp8_e4m3"`): plan() is given
kv_data_type float8_e4m3fn, the new K/V are written divided by the layer's scales (radixcache.kv_codec) and run()
gets k_scale / v_scale, which FlashInfer folds into sm_scale and the output. The fp8 prefill wrapper is built with
backend "fa2": FA3's fp8 kernels (Hopper's default) expect fp8 queries too, and queries stay 16-bit here.

Documented pitfalls handled here:
- prefill plan() defaults to causal=False and q_data_type float16: both are always passed explicitly.
- plan() stages its metadata in a pinned host buffer and copies it to the device asynchronously; planning the
  same wrapper again before that copy ran would overwrite it. Prefill and decode use separate wrappers, and a
  wrapper waits on an event recorded after its previous plan before planning again.
- run() inside CUDA-graph capture needs wrappers built with use_cuda_graph=True: this backend does not capture
  graphs, so it builds plain wrappers.
"""

from __future__ import annotations

import itertools
import math

import torch

from radixcache.pool import KVLayer
from radixcache.worker.attention import window as win
from radixcache.worker.attention.base import (
    AttentionBackend,
    AttentionOptions,
    BackendUnavailableError,
    flashinfer_unsupported_reason,
)
from radixcache.worker.attention.layout import BatchLayout

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        device: str | torch.device = "cuda",
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        kv_dtype: str | None = None,
        attention: AttentionOptions | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        super().__init__(
            device, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, attention=attention
        )
        reason = flashinfer_unsupported_reason(
            self.device, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
            kv_dtype=kv_dtype,
        )  # fmt: skip
        if reason is not None:
            raise BackendUnavailableError(f"the flashinfer backend cannot run here: {reason}; use backend 'torch'")
        import flashinfer  # imports: flashinfer_unsupported_reason just imported it

        self.fp8 = kv_dtype == "fp8_e4m3"
        self.kv_dtype = torch.float8_e4m3fn if self.fp8 else dtype
        self.sm_scale = self.attention.scale or 1.0 / math.sqrt(head_dim)
        group = num_heads // num_kv_heads
        # One workspace per wrapper kind, shared by that kind's wrappers of every window: their kernels run one
        # after another on one stream (vLLM shares one across all its wrappers). Zeroed: the decode wrapper
        # documents that its float workspace "must be initialized to 0 for its first use". Separate wrappers per
        # window and kind: their plans never share a pinned staging buffer.
        prefill_space = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        decode_space = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill: dict[int | None, object] = {}
        self._decode: dict[int | None, object] = {}
        for window in self.attention.distinct_windows:
            self._prefill[window] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                prefill_space, "NHD", backend="fa2" if self.fp8 else "auto"
            )
            self._decode[window] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                decode_space,
                "NHD",
                # The CUDA-core decode kernels are specialised for group sizes 1, 2, 3, 4, 8; tensor cores take any.
                use_tensor_cores=group not in (1, 2, 3, 4, 8),
            )
        self._planned: dict[tuple[str, int | None], torch.cuda.Event] = {}
        self._layout: BatchLayout | None = None
        self._use_decode = False

    def _wait_previous_plan(self, which: tuple[str, int | None]) -> None:
        event = self._planned.get(which)
        if event is not None:
            event.synchronize()

    def _mark_planned(self, which: tuple[str, int | None]) -> None:
        # On the stream plan() queued its copies on: the backend device's current stream. A bare record() would use
        # the current device's stream, which with --device cuda:1 is another GPU's and guards nothing.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._planned[which] = event

    def begin_step(self, layout: BatchLayout) -> None:
        self._use_decode = layout.is_decode
        for window in self.attention.distinct_windows:
            self._plan_window(layout if window is None else layout.windowed(), window)
        self._layout = layout

    def _plan_window(self, layout: BatchLayout, window: int | None) -> None:
        """Plan the step's wrapper for the layers of `window`: each block table from its first needed page on."""
        ps = layout.page_size
        skip = win.skipped_pages(layout, window)
        # Host-side indptr / last_page_len from the layout's host lists: plan() reads them on the host, and
        # passing device tensors would force a device->host copy (a sync) per step.
        pages = [-(-n // ps) for n in layout.seq_lens]
        kept = [p - s for p, s in zip(pages, skip, strict=True)]
        kv_indptr = torch.tensor([0, *itertools.accumulate(kept)], dtype=torch.int32)
        last_len = torch.tensor(
            [n - (p - 1) * ps for n, p in zip(layout.seq_lens, pages, strict=True)], dtype=torch.int32
        )
        kv_indices = layout.kv_indices
        if any(skip):  # drop each sequence's leading pages the window never reaches
            starts = [0, *itertools.accumulate(pages)]
            keep = [i for b, s in enumerate(skip) for i in range(starts[b] + s, starts[b + 1])]
            kv_indices = kv_indices[torch.tensor(keep, dtype=torch.int64, device=kv_indices.device)]
        common = dict(
            pos_encoding_mode="NONE",
            window_left=-1 if window is None else window - 1,
            logits_soft_cap=self.attention.soft_cap,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
        )
        geometry = (self.num_heads, self.num_kv_heads, self.head_dim, ps)
        which = ("decode" if self._use_decode else "prefill", window)
        self._wait_previous_plan(which)
        if self._use_decode:
            self._decode[window].plan(kv_indptr, kv_indices, last_len, *geometry, **common)
        else:
            qo_indptr = torch.tensor([0, *torch.tensor(layout.num_new).cumsum(0).tolist()], dtype=torch.int32)
            self._prefill[window].plan(qo_indptr, kv_indptr, kv_indices, last_len, *geometry, causal=True, **common)
        self._mark_planned(which)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor | KVLayer,
        layout: BatchLayout,
    ) -> torch.Tensor:
        if self._layout is not layout:
            raise RuntimeError("flashinfer backend: begin_step(layout) must be called before forward with it")
        layer = KVLayer.of(kv_layer)
        if layer.values.dtype != self.kv_dtype:
            raise RuntimeError(f"flashinfer backend planned {self.kv_dtype} KV pages, got {layer.values.dtype}")
        window = self.attention.window(layer_idx)
        self.write_kv(k, v, layer, layout if window is None else layout.windowed())  # (window slots, if paged so)
        wrapper = (self._decode if self._use_decode else self._prefill)[window]
        if self.fp8:
            return wrapper.run(q.contiguous(), layer.values, k_scale=layer.k_scale, v_scale=layer.v_scale)
        return wrapper.run(q.contiguous(), layer.values)
