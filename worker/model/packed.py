"""float32 projections on the CPU through oneDNN, with each weight stored once in oneDNN's blocked layout.

Why: torch's default float32 product on the CPU (MKL) repacks the weight on every call when more than one row is
multiplied, so a decode step of 4-16 sequences read the weights about twice: on an AVX-512 EPYC, one thread, the
~125M model's projections took 49 ms at 4 rows and 73 ms at 16 rows against 21 ms at one row. With the weight packed
once at load time, oneDNN's kernel reads it once per call: 21 ms at 4 rows, 38 ms at 16 (the model's 49 shapes).
A decode step (bench/decode_floor.py): b4 61 -> 29 ms, b16 107 -> 65-73 ms, b1 unchanged.
Rows are multiplied a fixed number at a time (worker/model/row_tiles.py: a row's result never depends on its
step); oneDNN's blocked kernel costs the same at 16 rows as at one for these weights (the plain layout it picks for
a single row is ~20% slower than the blocked one handed 4). The results are the same float32 products in another
summation order (parity with transformers stays within test_model_parity's 1e-4).
"""

from __future__ import annotations

import torch
from torch import nn

from radixcache.worker.model.llama import replace_linears
from radixcache.worker.model.row_tiles import by_row_tiles, row_tile

PACK_ROWS_HINT = 16  # the row count the layout is chosen for: any of 2-64 gives the same blocked layout


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where PackedLinear can run: float32 on a CPU with torch's oneDNN (mkldnn) build."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x @ W.T + b for 2-D float32 x on the CPU, W held only in oneDNN's blocked layout (`packed`).

    The dense weight is not kept (that would double the model's memory); `dense_weight()` rebuilds it exactly."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), PACK_ROWS_HINT)
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return by_row_tiles(x, self._product, row_tile(torch.float32))

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @torch.no_grad()
    def dense_weight(self) -> torch.Tensor:
        """W [out, in], exactly: the product with the identity adds only zeros to each weight."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        y = torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "")
        return y.t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN blocked float32"


def pack_linears(model: nn.Module, skip: nn.Module | None = None) -> int:
    """Replace every nn.Linear of `model` (except `skip`) by a PackedLinear of its weights, in place; the dense
    weights are freed. Returns how many."""
    return replace_linears(model, lambda linear: PackedLinear(linear.weight, linear.bias), skip)
