"""A stand-in for flashinfer-python 0.6.x and a CUDA device, so the flashinfer backend's logic runs on the CPU.

FakeFlashInfer is a module to put in sys.modules["flashinfer"]. Its paged prefill and decode wrappers take the
constructor, plan() and run() parameters of 0.6.x under the same names, in the same order and with the same defaults
(written from 0.6.1; tests/test_flashinfer_api.py checks them against the installed release the Makefile pins), so a
misspelt keyword is a TypeError, as it would be there. They record every call, and check what the real kernels
assume: int32 index arrays, NHD paged K/V of the planned geometry and dtype, q in the planned dtype. run() then computes what FlashInfer documents, in float32 torch: each sequence's
K/V gathered through kv_indptr / kv_indices / last_page_len, query head h reading KV head h // group, scores
scaled by sm_scale and, with logits_soft_cap, capped to cap * tanh(x / cap), for a causal prefill the mask aligned
bottom-right (query i of n sees KV positions up to kv_len - n + i; a decode query is the last position), and with
window_left >= 0 only the window_left positions before that one besides it. So a test checks the arguments and what
they mean, not only that a call happened.

Its BatchMLAPagedAttentionWrapper (0.6.x's MLA wrapper, same checks of its signatures) computes MLA attention in
float32 from the ckv / kpe caches it is given (strided views of one latent row are fine, as the kernels take the
page and token strides; a last dimension that is not unit-strided is refused), with the plan's kv_len_arr, causal
mask and sm_scale.

With hopper=True, prefill plan() refuses a head_dim outside 64/128/256 as the FA3 module's compile does, while
decode accepts it: the failure a decode-only warm-up cannot see.

FakeCudaTorch is what the backend module sees as `torch` in those tests: real torch, except that tensors asked for
on a CUDA device are made on the CPU (torch.empty filled with garbage bytes, as fresh device memory may hold) and
torch.cuda has streams and events that record which device's stream they were used on.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

FA3_HEAD_DIMS = (64, 128, 256)


@dataclass
class Plan:
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    last_page_len: list[int]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    sm_scale: float | None
    q_data_type: torch.dtype
    kv_data_type: torch.dtype
    window_left: int = -1
    logits_soft_cap: float | None = None


def _int32_list(name: str, t: torch.Tensor) -> list[int]:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32, f"{name} must be an int32 tensor, got {t!r}"
    return [int(x) for x in t.cpu().tolist()]


def _dtype(value: Any, *, kv: bool = False) -> torch.dtype:
    dtype = getattr(torch, value) if isinstance(value, str) else value
    allowed = (torch.float16, torch.bfloat16, torch.float8_e4m3fn) if kv else (torch.float16, torch.bfloat16)
    assert dtype in allowed, f"flashinfer attention runs 16-bit q and 16-bit or fp8 e4m3 kv, got {value}"
    return dtype


class _Wrapper:
    kind = "?"

    def __init__(self, lib: FakeFlashInfer, float_workspace_buffer: torch.Tensor, kv_layout: str) -> None:
        assert kv_layout in ("NHD", "HND"), kv_layout
        assert float_workspace_buffer.dtype == torch.uint8, "the float workspace is a uint8 buffer"
        self.lib = lib
        self.workspace = float_workspace_buffer
        self.kv_layout = kv_layout
        self.plan_info: Plan | None = None
        lib.wrappers.append(self)

    def _plan(self, plan: Plan, pos_encoding_mode: str) -> None:
        assert pos_encoding_mode == "NONE", "the model applies RoPE itself"
        assert plan.num_qo_heads % plan.num_kv_heads == 0
        batch = len(plan.last_page_len)
        assert len(plan.qo_indptr) == len(plan.kv_indptr) == batch + 1 and plan.kv_indptr[-1] == len(plan.kv_indices)
        assert all(1 <= n <= plan.page_size for n in plan.last_page_len), plan.last_page_len
        assert isinstance(plan.window_left, int) and plan.window_left >= -1, plan.window_left
        assert plan.logits_soft_cap is None or plan.logits_soft_cap > 0, plan.logits_soft_cap
        self.plan_info = plan
        self.lib.calls.append((self.kind, "plan", plan))

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor,
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = self.plan_info
        assert plan is not None, "run() before plan()"
        self.lib.calls.append((self.kind, "run", q.shape))
        assert self.kv_layout == "NHD" and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2
        _, _, page_size, kv_heads, dim = paged_kv_cache.shape
        assert (page_size, kv_heads, dim) == (plan.page_size, plan.num_kv_heads, plan.head_dim), paged_kv_cache.shape
        assert paged_kv_cache.dtype == plan.kv_data_type, (paged_kv_cache.dtype, plan.kv_data_type)
        assert q.dtype == plan.q_data_type and tuple(q.shape) == (plan.qo_indptr[-1], plan.num_qo_heads, dim)
        assert window_left is None, "the window is planned (plan() picks the kernel by it), not passed to run()"
        group = plan.num_qo_heads // kv_heads
        scale = plan.sm_scale if plan.sm_scale is not None else 1.0 / math.sqrt(dim)
        # As documented: k_scale multiplies sm_scale, v_scale the output (fp8 KV's calibration scales).
        scale *= 1.0 if k_scale is None else k_scale
        result = torch.empty(q.shape, dtype=torch.float32)
        for b in range(len(plan.last_page_len)):
            pages = plan.kv_indices[plan.kv_indptr[b] : plan.kv_indptr[b + 1]]
            kv_len = (len(pages) - 1) * page_size + plan.last_page_len[b]
            keys = paged_kv_cache[pages, 0].reshape(-1, kv_heads, dim)[:kv_len].float()
            values = paged_kv_cache[pages, 1].reshape(-1, kv_heads, dim)[:kv_len].float()
            rows = slice(plan.qo_indptr[b], plan.qo_indptr[b + 1])
            qb = q[rows].float()  # [n, H, D]
            n = qb.shape[0]
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            scores = torch.einsum("nhd,lhd->hnl", qb, keys) * scale
            if plan.logits_soft_cap is not None:
                scores = plan.logits_soft_cap * torch.tanh(scores / plan.logits_soft_cap)
            last = (kv_len - n + torch.arange(n))[:, None] if plan.causal else torch.full((n, 1), kv_len - 1)
            kv_pos = torch.arange(kv_len)[None, :]
            visible = kv_pos <= last if plan.causal else torch.ones(n, kv_len, dtype=torch.bool)
            if plan.window_left >= 0:
                visible = visible & (kv_pos >= last - plan.window_left)
            scores = scores.masked_fill(~visible, float("-inf"))
            result[rows] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
        if v_scale is not None:
            result *= v_scale
        if out is None:
            return result.to(q.dtype)
        out.copy_(result)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    kind = "prefill"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
    ) -> None:
        assert not use_cuda_graph, "CUDA-graph wrappers need fixed-size index buffers"
        assert backend in ("auto", "fa2", "fa3", "trtllm-gen", "cudnn"), backend
        self.backend = backend
        super().__init__(_lib_of(self), float_workspace_buffer, kv_layout)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
    ) -> None:
        if self.lib.hopper and head_dim_qk not in FA3_HEAD_DIMS:
            raise RuntimeError(f"FA3 prefill module: static_assert HEAD_DIM in (64, 128, 256), got {head_dim_qk}")
        q_dtype = _dtype(q_data_type)
        plan = Plan(
            _int32_list("qo_indptr", qo_indptr),
            _int32_list("paged_kv_indptr", paged_kv_indptr),
            _int32_list("paged_kv_indices", paged_kv_indices),
            _int32_list("paged_kv_last_page_len", paged_kv_last_page_len),
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            causal,
            sm_scale,
            q_dtype,
            _dtype(kv_data_type, kv=True) if kv_data_type is not None else q_dtype,
            window_left,
            logits_soft_cap,
        )
        self._plan(plan, pos_encoding_mode)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    kind = "decode"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
    ) -> None:
        assert not use_cuda_graph, "CUDA-graph wrappers need fixed-size index buffers"
        self.use_tensor_cores = use_tensor_cores
        super().__init__(_lib_of(self), float_workspace_buffer, kv_layout)

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,  # 0.6.x deprecates the rest positionally (0.6.18.post1: plan(..., page_size, *deprecated, **kwargs))
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype | None = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
    ) -> None:
        if not self.use_tensor_cores:  # the CUDA-core decode kernels exist for these group sizes only
            assert num_qo_heads // num_kv_heads in (1, 2, 3, 4, 8), "use tensor cores for this group size"
        last = _int32_list("last_page_len", last_page_len)
        q_dtype = _dtype(q_data_type)
        plan = Plan(
            list(range(len(last) + 1)),  # one query row per sequence
            _int32_list("indptr", indptr),
            _int32_list("indices", indices),
            last,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            False,
            sm_scale,
            q_dtype,
            _dtype(kv_data_type, kv=True) if kv_data_type is not None else q_dtype,
            window_left,
            logits_soft_cap,
        )
        self._plan(plan, pos_encoding_mode)


@dataclass
class MLAPlan:
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_len: list[int]
    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int
    page_size: int
    causal: bool
    sm_scale: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype


def _unit_last_stride(name: str, t: torch.Tensor) -> None:
    # The kernels take a tensor's leading strides (batch_mla_run.cu: q_nope_stride_n / _h, ckv_stride_page / _n)
    # and read its last dimension as contiguous: a column slice of a wider row is fine, a transposed one is not.
    assert t.stride(-1) == 1, f"{name} must have a unit last stride, got strides {t.stride()}"


class BatchMLAPagedAttentionWrapper:
    """0.6.x's MLA wrapper (flashinfer/mla/_core.py): plan() then run(q_nope, q_pe, ckv_cache, kpe_cache) ->
    softmax(sm_scale * (q_nope . ckv + q_pe . kpe)) @ ckv per head, over each sequence's first kv_len_arr[b]
    positions of its pages, causal aligned bottom-right (query i of n sees positions up to kv_len - n + i)."""

    kind = "mla"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_len_arr: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        assert not use_cuda_graph, "CUDA-graph wrappers need fixed-size index buffers"
        assert backend in ("auto", "fa2", "fa3"), f"{backend}: 'cutlass' runs another input layout"
        self.lib = _lib_of(self)
        self.workspace = float_workspace_buffer
        self.backend = backend
        self.plan_info: MLAPlan | None = None
        self.lib.wrappers.append(self)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        assert kv_data_type in (torch.float16, torch.bfloat16, torch.float8_e4m3fn), kv_data_type  # plan()'s allowlist
        assert q_data_type in (torch.float16, torch.bfloat16), q_data_type
        if kv_data_type == torch.float8_e4m3fn:  # plan()'s fp8 conditions (flashinfer/mla/_core.py)
            if not self.lib.hopper:
                raise ValueError("FP8 kv_data_type for MLA requires an SM90 (Hopper) device")
            assert q_data_type == torch.bfloat16, "FP8 kv_data_type for MLA only supports q_data_type=torch.bfloat16"
            assert (head_dim_ckv, head_dim_kpe) in ((512, 0), (512, 64)), (head_dim_ckv, head_dim_kpe)
        assert isinstance(causal, bool) and isinstance(sm_scale, float) and sm_scale > 0, (causal, sm_scale)
        plan = MLAPlan(
            _int32_list("qo_indptr", qo_indptr),
            _int32_list("kv_indptr", kv_indptr),
            _int32_list("kv_indices", kv_indices),
            _int32_list("kv_len_arr", kv_len_arr),
            num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
        )  # fmt: skip
        batch = len(plan.kv_len)
        assert len(plan.qo_indptr) == len(plan.kv_indptr) == batch + 1 and plan.kv_indptr[-1] <= len(plan.kv_indices)
        for b in range(batch):
            pages = plan.kv_indptr[b + 1] - plan.kv_indptr[b]
            assert (pages - 1) * page_size < plan.kv_len[b] <= pages * page_size, (b, pages, plan.kv_len[b])
            if causal:  # FlashInfer: "qo_len > kv_len not supported for causal attention"
                assert plan.qo_indptr[b + 1] - plan.qo_indptr[b] <= plan.kv_len[b]
        self.plan_info = plan
        self.lib.calls.append((self.kind, "plan", plan))

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        profiler_buffer: torch.Tensor | None = None,
        kv_len: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        return_lse_base_on_e: bool = False,
        o_scale: float | None = None,
        *,
        ckv_scale: float | None = None,
        ckv_scale_arr: torch.Tensor | None = None,
        kpe_scale: float | None = None,
    ) -> torch.Tensor:
        plan = self.plan_info
        assert plan is not None, "run() before plan()"
        self.lib.calls.append((self.kind, "run", (q_nope.shape, ckv_cache.stride(), kpe_cache.stride())))
        assert kv_len is None and page_table is None and o_scale is None, "the cutlass backend's arguments"
        fp8 = plan.kv_data_type == torch.float8_e4m3fn
        if fp8:  # as run() requires: one of ckv_scale / ckv_scale_arr, and kpe_scale, finite and > 0
            assert ckv_scale_arr is None, "this backend passes one ckv_scale"
            assert ckv_scale is not None and kpe_scale is not None, "fp8 kv needs ckv_scale and kpe_scale"
            assert math.isfinite(ckv_scale) and ckv_scale > 0 and math.isfinite(kpe_scale) and kpe_scale > 0
        else:
            assert ckv_scale is None and ckv_scale_arr is None and kpe_scale is None, "fp8 scales with 16-bit pages"
        ckv_mul, kpe_mul = (float(ckv_scale), float(kpe_scale)) if fp8 else (1.0, 1.0)
        rank, rope, ps = plan.head_dim_ckv, plan.head_dim_kpe, plan.page_size
        tokens = plan.qo_indptr[-1]
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):  # run() raises on a dtype the plan did not take
            assert t.dtype == plan.q_data_type, f"{name}.dtype={t.dtype} does not match the planned q_data_type"
        for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            assert t.dtype == plan.kv_data_type, f"{name}.dtype={t.dtype} does not match the planned kv_data_type"
        assert tuple(q_nope.shape) == (tokens, plan.num_heads, rank), (q_nope.shape, plan)
        assert tuple(q_pe.shape) == (tokens, plan.num_heads, rope), (q_pe.shape, plan)
        assert ckv_cache.dim() == 3 and tuple(ckv_cache.shape[1:]) == (ps, rank), ckv_cache.shape
        assert kpe_cache.dim() == 3 and tuple(kpe_cache.shape[1:]) == (ps, rope), kpe_cache.shape
        assert ckv_cache.shape[0] == kpe_cache.shape[0]
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            _unit_last_stride(name, t)
        result = torch.empty(tokens, plan.num_heads, rank, dtype=torch.float32)
        for b in range(len(plan.kv_len)):
            pages = plan.kv_indices[plan.kv_indptr[b] : plan.kv_indptr[b + 1]]
            n_kv = plan.kv_len[b]
            ckv = ckv_cache[pages].reshape(-1, rank)[:n_kv].float() * ckv_mul  # [L, R], dequantized: stored * scale
            kpe = kpe_cache[pages].reshape(-1, rope)[:n_kv].float() * kpe_mul  # [L, P]
            rows = slice(plan.qo_indptr[b], plan.qo_indptr[b + 1])
            qn, qp = q_nope[rows].float(), q_pe[rows].float()  # [n, H, R], [n, H, P]
            n = qn.shape[0]
            scores = (torch.einsum("nhr,lr->hnl", qn, ckv) + torch.einsum("nhp,lp->hnl", qp, kpe)) * plan.sm_scale
            if plan.causal:
                last = (n_kv - n + torch.arange(n))[:, None]
                scores = scores.masked_fill(torch.arange(n_kv)[None, :] > last, float("-inf"))
            result[rows] = torch.einsum("hnl,lr->nhr", scores.softmax(-1), ckv)
        if out is None:
            return result.to(q_nope.dtype)
        assert tuple(out.shape) == tuple(q_nope.shape) and out.dtype == q_nope.dtype, (out.shape, out.dtype)
        out.copy_(result)
        return out


def _lib_of(wrapper: object) -> FakeFlashInfer:
    return type(wrapper).lib  # type: ignore[attr-defined]


class FakeFlashInfer(types.ModuleType):
    """sys.modules["flashinfer"] for a test: wrappers bound to this instance, calls and wrappers recorded."""

    def __init__(self, *, hopper: bool = True) -> None:
        super().__init__("flashinfer")
        self.__version__ = "0.6.18.post1+fake"
        self.hopper = hopper
        self.calls: list[tuple[str, str, Any]] = []
        self.wrappers: list[_Wrapper] = []
        # Subclasses bound to this instance, so wrappers find their recorder without a module-level global.
        self.BatchPrefillWithPagedKVCacheWrapper = type(
            "BatchPrefillWithPagedKVCacheWrapper", (BatchPrefillWithPagedKVCacheWrapper,), {"lib": self}
        )
        self.BatchDecodeWithPagedKVCacheWrapper = type(
            "BatchDecodeWithPagedKVCacheWrapper", (BatchDecodeWithPagedKVCacheWrapper,), {"lib": self}
        )
        self.BatchMLAPagedAttentionWrapper = type(
            "BatchMLAPagedAttentionWrapper", (BatchMLAPagedAttentionWrapper,), {"lib": self}
        )


# --- a CUDA device, faked -------------------------------------------------------------------------------------
@dataclass
class FakeStream:
    device: torch.device


@dataclass
class FakeEvent:
    log: list[tuple[str, Any]]
    recorded_on: list[FakeStream | None] = field(default_factory=list)

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_on.append(stream)
        self.log.append(("record", stream))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self))


class FakeCudaTorch:
    """Real torch for everything but device allocations and torch.cuda (see the module docstring)."""

    GARBAGE = 0xA5

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []
        self.log: list[tuple[str, Any]] = []
        fake = self

        class _Cuda:
            Event = staticmethod(fake._event)

            @staticmethod
            def current_stream(device: Any = None) -> FakeStream:
                return FakeStream(torch.device(device) if device is not None else torch.device("cuda"))

            @staticmethod
            def is_available() -> bool:
                return True

        self.cuda = _Cuda

    def _event(self, *args: Any, **kwargs: Any) -> FakeEvent:
        event = FakeEvent(self.log)
        self.events.append(event)
        return event

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = torch.empty(*size, **kwargs)
        t.view(torch.uint8).fill_(self.GARBAGE)  # what fresh device memory may hold
        return t

    def zeros(self, *size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, **kwargs)


def install_fake_cuda(monkeypatch: Any, *, hopper: bool = True) -> types.SimpleNamespace:
    """A CUDA machine with flashinfer installed, as far as the backends can tell (undone by `monkeypatch`):
    torch.cuda.is_available() is True, torch.cuda.get_device_capability() says SM90 with hopper (else SM80), `import
    flashinfer` gives a FakeFlashInfer, and the flashinfer backend modules see FakeCudaTorch as torch. Returns (lib,
    torch) to inspect the calls."""
    import radixcache.worker.attention.flashinfer_backend as fb
    import radixcache.worker.attention.flashinfer_mla_backend as fmla

    lib = FakeFlashInfer(hopper=hopper)
    fake_torch = FakeCudaTorch()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0) if hopper else (8, 0))
    monkeypatch.setitem(sys.modules, "flashinfer", lib)
    monkeypatch.setattr(fb, "torch", fake_torch)
    monkeypatch.setattr(fmla, "torch", fake_torch)
    return types.SimpleNamespace(lib=lib, torch=fake_torch)
