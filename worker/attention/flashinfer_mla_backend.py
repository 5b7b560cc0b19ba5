"""FlashInfer's MLA kernels over latent pages (DeepSeek V2 / V3; CUDA only). flashinfer is imported inside the class,
never at module import, so this module loads on machines without CUDA or flashinfer.

What it computes is AttentionOptions.latent's attention (worker/model/mla.py): one shared latent per position, key
[c | k_pe] and value c, queries [q_nope @ W_UK | q_pe] of every head. FlashInfer's BatchMLAPagedAttentionWrapper
takes exactly that apart: run(q_nope [T, H, R], q_pe [T, H, P], ckv_cache [pages, page_size, R], kpe_cache [pages,
page_size, P]) -> [T, H, R] = softmax(sm_scale * (q_nope . c + q_pe . k_pe)) @ c. The pool's latent pages are
token-contiguous (KVLayer.latent_tokens(): [pages, page_size, D], D = R + P), so ckv and kpe are the two column
ranges of that one view, as SGLang passes k_buffer[..., :512] and k_buffer[..., 512:]: the kernels take each
cache's page and token strides from the tensor (batch_mla_run.cu: ckv_stride_page, ckv_stride_n) and assume a unit
last stride, which a column slice keeps; q_nope / q_pe are column slices of the model's query likewise. R = 512 and
P = 64 put kpe 1024 bytes into each 1152-byte token row (16-bit), so every row stays 16-byte aligned for the
kernels' vector loads.

Per step, begin_step plans the one wrapper for the batch (MLA models have no sliding layers; prefill, decode and
mixed batches alike): qo_indptr from the new tokens per sequence, kv_indptr / kv_indices the block tables, kv_len_arr
the sequence lengths after the step, causal=True (queries aligned to the end of their sequence, as FlashInfer's
causal mask is), sm_scale the model's attention scale (AttentionOptions.scale: MLA's, with yarn's mscale),
q_data_type the model dtype, kv_data_type the pages' (below). forward writes the new latents into the pages
(KVLayer.write, as the torch backend does), then runs the planned kernel. The output is the [T, H, R] FlashInfer returns: the first R dimensions
are the contract (AttentionOptions.latent).

KV precision: latent pages in the model's 16-bit dtype, or fp8_e4m3 (`kv_dtype="fp8_e4m3"`, a bf16 model on an SM90
GPU: FlashInfer's fp8 MLA path): plan() is given kv_data_type float8_e4m3fn, the new latents are written divided by
the layer's scale (KVLayer.write, radixcache.kv_codec), and run() gets ckv_scale and kpe_scale, both the layer's one
latent scale (an fp8 latent pool's V scale is its K scale), which FlashInfer multiplies the stored values by.

Where it runs: flashinfer_mla_unsupported_reason (base.py): kv_lora_rank 512 with a rope dim of 64, float16 /
bfloat16, pages in the model's dtype (or fp8_e4m3 as above), a CUDA device, flashinfer importable. Any head count:
the kernels pack query rows x heads into tiles of 64 (scheduler.cuh, MLAPlan); FlashInfer's own tests use 16.

Pitfalls handled, as in flashinfer_backend.py:
- plan() takes causal, sm_scale and both dtypes with no defaults: all passed explicitly (causal by keyword).
- plan() copies its host-side (kv_len, indptr) metadata to the device through one pinned staging buffer per wrapper,
  asynchronously; planning again before that copy ran would overwrite it. The wrapper waits on an event recorded
  after its previous plan before planning again.
- plan() reads qo_indptr, kv_indptr and kv_len_arr on the host: they are built there from the layout's host lists
  (a device tensor would cost a device->host copy per step); kv_indices stays on the device.
- run() checks the dtypes against the plan (the launcher reinterprets storage by the planned types): the pages must
  be in the planned dtype, which forward checks with a clear error first.
- no CUDA graphs: a plain wrapper (use_cuda_graph=False).
"""

from __future__ import annotations

import itertools
import math

import torch

from radixcache.pool import KVLayer
from radixcache.worker.attention.base import (
    AttentionBackend,
    AttentionOptions,
    BackendUnavailableError,
    flashinfer_mla_unsupported_reason,
)
from radixcache.worker.attention.layout import BatchLayout

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace for the MLA wrapper


class FlashInferMLABackend(AttentionBackend):
    name = "flashinfer_mla"

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
            device, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
            attention=attention, kv_dtype=kv_dtype,
        )  # fmt: skip
        reason = flashinfer_mla_unsupported_reason(
            self.device, num_heads=num_heads, dtype=dtype, kv_dtype=kv_dtype, attention=self.attention
        )
        if reason is not None:
            raise BackendUnavailableError(f"the flashinfer_mla backend cannot run here: {reason}; use backend 'torch'")
        import flashinfer  # imports: flashinfer_mla_unsupported_reason just imported it

        assert self.attention.latent_dims is not None  # (the reason above says so otherwise)
        self.rank, self.rope = self.attention.latent_dims
        self.fp8 = kv_dtype == "fp8_e4m3"
        self.kv_dtype = torch.float8_e4m3fn if self.fp8 else dtype
        # the torch backend's default for a latent model told no scale: 1 / sqrt(R + P), q's width
        self.sm_scale = self.attention.scale or 1.0 / math.sqrt(self.rank + self.rope)
        # Zeroed as the other backend's workspaces are (fresh device memory holds anything).
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # backend "auto": FA3's MLA kernels on Hopper (sm90a), FA2's elsewhere.
        self._wrapper = flashinfer.BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=False, backend="auto")
        self._planned: torch.cuda.Event | None = None
        self._layout: BatchLayout | None = None

    def begin_step(self, layout: BatchLayout) -> None:
        ps = layout.page_size
        pages = [-(-n // ps) for n in layout.seq_lens]
        qo_indptr = torch.tensor([0, *itertools.accumulate(layout.num_new)], dtype=torch.int32)
        kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
        kv_len_arr = torch.tensor(layout.seq_lens, dtype=torch.int32)
        if self._planned is not None:  # the previous plan's staged copy must have run before the buffer is reused
            self._planned.synchronize()
        self._wrapper.plan(
            qo_indptr, kv_indptr, layout.kv_indices, kv_len_arr, self.num_heads, self.rank, self.rope, ps,
            causal=True, sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
        )  # fmt: skip
        # On the stream plan() queued its copies on: the backend device's current stream (a bare record() would use
        # the current device's, another GPU's with --device cuda:1).
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._planned = event
        self._layout = layout

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
            raise RuntimeError("flashinfer_mla backend: begin_step(layout) must be called before forward with it")
        layer = KVLayer.of(kv_layer)
        if layer.values.dtype != self.kv_dtype:
            raise RuntimeError(f"flashinfer_mla backend planned {self.kv_dtype} latent pages, got {layer.values.dtype}")
        rank = self.rank
        if q.shape[-1] != rank + self.rope:
            raise ValueError(f"flashinfer_mla backend: q is [T, H, {q.shape[-1]}], the latent is {rank} + {self.rope}")
        self.write_kv(k, v, layer, layout)
        tokens = layer.latent_tokens()  # [pages, page_size, R + P], a view of the layer's pages (fp8: as stored)
        q = q.contiguous()
        out = torch.empty(q.shape[0], q.shape[1], rank, dtype=q.dtype, device=q.device)
        q_nope, q_pe, ckv, kpe = q[..., :rank], q[..., rank:], tokens[..., :rank], tokens[..., rank:]
        if self.fp8:  # one scale for the whole latent: c's and k_pe's are the same (the pool's V scale is its K's)
            if layer.k_scale != layer.v_scale:
                raise RuntimeError(
                    "flashinfer_mla backend: fp8 latent pages keep one scale a layer (k_scale == v_scale)"
                )
            return self._wrapper.run(q_nope, q_pe, ckv, kpe, out=out, ckv_scale=layer.k_scale, kpe_scale=layer.k_scale)
        return self._wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
