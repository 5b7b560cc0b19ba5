"""worker/model/packed.py: float32 CPU projections through oneDNN's packed weights give nn.Linear's results, a row's
result never depends on the rows it is batched with, and the loader uses them for float32 models on the CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from radixcache.worker.model.loader import random_model
from radixcache.worker.model.packed import PackedLinear

CONFIG = tiny_config()


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_the_linear_it_was_built_from(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear.weight, linear.bias)
    for rows in (1, 2, 5, 16, 17, 100):  # below, at and above one tile, and between tiles
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.dense_weight(), linear.weight)


def test_a_rows_product_does_not_depend_on_its_batch():
    """The same row alone or among 1-200 others gets the same bits (MKL's products did not: rows 1-3 differed)."""
    torch.manual_seed(1)
    packed = PackedLinear(torch.randn(320, 128), None)
    row = torch.randn(1, 128)
    alone = packed(row)
    for others in (1, 3, 15, 63, 200):
        batch = torch.cat((torch.randn(others, 128), row))
        assert torch.equal(packed(batch)[-1:], alone), others


def test_float32_cpu_models_get_packed_projections_and_others_do_not():
    fp32 = random_model(CONFIG, seed=2).model
    kinds = {type(m).__name__ for m in fp32.modules()}
    assert "PackedLinear" in kinds and "Linear" not in kinds
    bf16 = random_model(CONFIG, seed=2, dtype="bfloat16").model
    assert not any(isinstance(m, PackedLinear) for m in bf16.modules())
