"""Every CPU projection multiplies a fixed number of rows at a time, so a row's result never depends on its batch.

Why: the CPU GEMM libraries torch calls pick a kernel, and with it the order a row's dot products are summed in,
from the problem's shape. Measured on one Intel Xeon with AMX (tests/test_row_tiles.py checks the promise on
whatever CPU runs it):
- bf16 (oneDNN): up to 32 rows run one kernel; from 33 rows AMX tiles take over and sum in another order, so a few
  rows of a step of 33-127 tokens (K >= 640) differ in their last bit from the same rows computed alone;
- float32 through MKL (a tied lm_head): 1-10 rows, 11-15 rows and >= 16 rows are three orders here, where on an
  AVX2 EPYC 1, 2-3 and >= 4 were;
- bf16 on AVX-512 without bf16 instructions, two threads: rows differ at scattered row counts (the threads' split).
A product of a fixed row count is one kernel with one split whatever the step, so the only promise left to a
kernel is that a row's place inside its tile does not change it (tested). That is what makes a decode, a batch
member, a speculation draft and a prefill row of the same token the same bits, and greedy output identical with
the cache and speculation on and off. It also bounds oneDNN's per-shape kernel cache (one shape per weight): an
unbounded set of step sizes grew RSS by ~380 MB over the first 1,000 requests before rows were rounded.

The padded rows are zeros and are sliced off. Longer inputs run as consecutive tiles, each a product of its own:
a tile re-reads the weights, the price of exactness (BENCHMARKS.md, "The cost of exact rows"). CUDA is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows of every CPU product, by the dtype of its input: the largest count that stays on the small-batch kernel of
# the CPUs measured (bf16: 32 on AMX), and for float32 the fewest rows at which oneDNN's packed kernel runs at its
# single-row speed (1-4 rows cost the same: worker/model/packed.py).
ROW_TILES: dict[torch.dtype, int] = {torch.float32: 16, torch.bfloat16: 32, torch.float16: 32}


def row_tile(dtype: torch.dtype) -> int:
    """The fixed row count of a CPU product whose input has `dtype` (16 for a dtype not in ROW_TILES)."""
    return ROW_TILES.get(dtype, 16)


def zero_padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """2-D x with zero rows appended up to `rows`."""
    padded = x.new_zeros(rows, x.shape[1])
    padded[: x.shape[0]] = x
    return padded


def by_row_tiles(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], tile: int) -> torch.Tensor:
    """product(x) for 2-D x, computed `tile` rows at a time: every call of `product` gets exactly `tile` rows.

    `product` must map [tile, K] to [tile, N] row by row (a projection). Returns [rows, N]."""
    rows = x.shape[0]
    if rows == tile:
        return product(x)
    if rows < tile:
        return product(zero_padded(x, tile))[:rows]
    whole = rows - rows % tile
    parts = [product(x[start : start + tile]) for start in range(0, whole, tile)]
    if whole < rows:
        parts.append(product(zero_padded(x[whole:], tile))[: rows - whole])
    return torch.cat(parts)
