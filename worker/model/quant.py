"""Opt-in low-precision weights: int8 with one scale per output channel.

`quantize_int8(model)` swaps every projection (q/k/v, o, gate/up, down and the LM head) for an `Int8Linear`.
Embeddings, norms, the residual stream, attention and the KV cache keep the model's dtype; only the products with
the weight matrices change. Two kernels, chosen once per process by `int8_kernel()`:

- "fbgemm" (x86 CPUs with VNNI): torch's int8 x int8 dynamic-quantized product. Each activation row is scaled to
  max |x| = 1 and quantized to 8 bits on a grid that does not depend on the other rows (see `_per_row_grid_product`), so a
  sequence's result never depends on what it is batched with. A batch-1 decode step of the ~125M model took
  13.2-13.9 ms against 18.2-19.9 ms with the weight-only kernel below (one thread, AVX-512 EPYC, same run).
- "weight-only" (anywhere else): activation rows cast to bfloat16 into torch's int8 weight-only kernel
  (aten._weight_int8pack_mm), scales in bfloat16 as that kernel wants (with float32 activations it takes a path
  ~7x slower).

Greedy exactness with transformers is promised for full-precision weights only; the quality cost of both kernels is
measured by tests/test_int8_weights.py (held-out loss of the default model, bound +1% bits per byte).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
from torch import nn

from radixcache.worker.model.llama import replace_linears
from radixcache.worker.model.row_tiles import by_row_tiles

WEIGHT_FORMATS = ("full", "int8")
INT8_KERNELS = ("fbgemm", "weight-only")
# Rows of every CPU int8 product (worker/model/row_tiles.py: a row's result never depends on its step).
INT8_ROW_TILE = 16


@functools.cache
def int8_kernel() -> str:
    """ "fbgemm" where torch's x86 quantized engine runs with VNNI, else "weight-only".

    Without VNNI, fbgemm sums pairs of 8-bit products in 16 bits with saturation unless activations are cut to 7
    bits; the weight-only kernel is the safer choice there."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm") or not hasattr(torch.ops.quantized, "linear_dynamic"):
        return "weight-only"  # (torch has deprecated its quantized tensors; a build without them lands here)
    return "fbgemm" if _cpu_has_vnni() else "weight-only"


def _cpu_has_vnni() -> bool:
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        ).split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale [out] of `scale_dtype`): symmetric per output row, |q| <= 127, q * scale within half
    a step of the weight. The scale is rounded to its dtype before quantizing, so that holds for the scale the kernel
    actually uses."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def _guard_rows(in_features: int) -> torch.Tensor:
    """[2, in_features] float32: a row starting with 1 and one starting with -1, zeros elsewhere (see
    `_per_row_grid_product`)."""
    guard = torch.zeros(2, in_features)
    guard[0, 0], guard[1, 0] = 1.0, -1.0
    return guard


def _per_row_grid_product(rows: torch.Tensor, packed: object, guard: torch.Tensor) -> torch.Tensor:
    """fbgemm's dynamic int8 product of float32 `rows` [n, in], each row on its own batch-independent grid.

    fbgemm quantizes its whole input on one grid spanning the input's min and max, so a row's rounding would depend
    on the other rows of the step. Each row is divided by its own max |x| (so it lies in [-1, 1]) and two guard rows
    holding 1 and -1 go first: the grid is then always [-1, 1] in 255 steps, whatever else is in the batch.
    The outputs are multiplied back by each row's max |x|."""
    row_max = rows.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
    grid = torch.cat((guard, rows / row_max))
    return torch.ops.quantized.linear_dynamic(grid, packed, False)[guard.shape[0] :] * row_max


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias with q int8 [out, in], one scale per output row (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None) -> None:
        super().__init__()
        self.kernel = kernel or (int8_kernel() if weight.device.type == "cpu" else "weight-only")
        if self.kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(INT8_KERNELS)}, got {self.kernel!r}")
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        if self.kernel == "fbgemm":
            q, scale = quantize_rows(weight, torch.float32)
            zero = torch.zeros(q.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # the deprecation of quantized tensors: int8_kernel() checks for them
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            # Only the packed form is kept (an int8 copy beside it would double the weights' memory).
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            self._guard = _guard_rows(self.in_features)
        else:
            q, scale = quantize_rows(weight, torch.bfloat16)
            self.register_buffer("qweight", q)
            self.register_buffer("scale", scale)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [out, in], scale [out]) as the kernel uses them."""
        if self.kernel == "fbgemm":
            qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
            return qweight.int_repr(), qweight.q_per_channel_scales().float()
        return self.qweight, self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.device.type == "cpu":
            y = by_row_tiles(rows, self._product, INT8_ROW_TILE)
        else:
            y = self._product(rows)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fbgemm":
            return _per_row_grid_product(rows.float(), self._packed, self._guard)
        return torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, {self.kernel}"


def quantize_int8(model: nn.Module, kernel: str | None = None) -> int:
    """Replace every nn.Linear of `model` by an Int8Linear built from its weights (in place). Returns how many.

    A tied LM head gets its own int8 copy; the embedding table it shares stays in full precision."""
    return replace_linears(model, lambda linear: Int8Linear(linear.weight, linear.bias, kernel))
