"""Half-precision CPU GEMMs see a bounded set of row counts (issue 10, defect 9: oneDNN keeps a kernel per shape, so
one shape per step size grew RSS by ~380 MB over the first 1,000 requests of the bf16 default model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixcache.worker.model import llama
from radixcache.worker.model.llama import Linear, bucket_rows


def test_bucket_rows_covers_every_size_with_few_shapes():
    sizes = [bucket_rows(n) for n in range(1, 2049)]
    assert all(b >= n for n, b in zip(range(1, 2049), sizes, strict=True))
    assert all(b <= 2 * n for n, b in zip(range(1, 65), sizes, strict=False))
    assert all(b <= 1.5 * n for n, b in zip(range(65, 2049), sizes[64:], strict=True))
    assert len(set(sizes)) <= 60


def test_bf16_linear_runs_few_shapes_and_gives_the_rows_it_would_alone(monkeypatch):
    torch.manual_seed(0)
    layer = Linear(64, 96).to(torch.bfloat16)
    seen: set[int] = set()
    real = F.linear

    def spy(x, weight, bias=None):
        seen.add(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(llama.nn.functional, "linear", spy)
    x = torch.randn(300, 64, dtype=torch.bfloat16)
    for rows in range(1, 301, 3):
        out = layer(x[:rows])
        assert out.shape == (rows, 96)
        if rows in (1, 7, 100, 298):
            monkeypatch.setattr(llama.nn.functional, "linear", real)
            exact = torch.nn.Linear.forward(layer, x[:rows])
            monkeypatch.setattr(llama.nn.functional, "linear", spy)
            torch.testing.assert_close(out, exact)
    assert len(seen) <= 20, sorted(seen)


def test_fp32_linear_is_left_alone():
    layer = Linear(8, 8)
    x = torch.randn(5, 8)
    assert torch.equal(layer(x), torch.nn.Linear.forward(layer, x))
