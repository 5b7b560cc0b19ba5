"""The torch attention backend against a naive dense reference, on random paged layouts (sliding windows, scale and
soft cap included)."""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend, torch_backend
from radixcache.worker.attention.base import AttentionBackend, AttentionOptions


def dense_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_cached: int,
    *,
    window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """One sequence, float64, explicit mask: q [n, H, D], keys/values [L, KVH, D] for positions 0..L-1. Query i (at
    position num_cached + i) sees keys up to its own position, and with a window only the last `window` of them."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    for h in range(heads):
        kh, vh = keys[:, h // group].double(), values[:, h // group].double()
        scores = q[:, h].double() @ kh.T * (scale if scale is not None else 1 / math.sqrt(dim))
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        for i in range(n):
            pos = num_cached + i
            scores[i, pos + 1 :] = float("-inf")
            if window is not None:
                scores[i, : max(0, pos - window + 1)] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def random_case(rng: random.Random, page_size: int, heads: int, kv_heads: int, dim: int, kinds: str, layers: int = 1):  # noqa: ANN201
    """Random batch: kinds is a string of 'p' (prefill chunk, maybe on a cached prefix) and 'd' (decode). The cached
    prefix is written into every layer of the pool."""
    num_pages = 400
    pool = KVPool(KVShape(layers, kv_heads, dim), page_size=page_size, num_pages=num_pages)
    pool.kv.normal_()  # stale garbage everywhere: only the right slots may be read
    free = list(range(num_pages))
    rng.shuffle(free)  # block tables are scattered, not contiguous
    slices, dense_k, dense_v = [], [], []
    for kind in kinds:
        cached = rng.randint(0, 40) if kind == "p" else rng.randint(1, 60)
        new = rng.randint(2, 30) if kind == "p" else 1
        total = cached + new
        pages = [free.pop() for _ in range(-(-total // page_size) + rng.randint(0, 1))]  # maybe one spare page
        keys, values = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
        for pos in range(cached):  # the cached prefix lives in the pages already
            pool.kv[:, pages[pos // page_size], 0, pos % page_size] = keys[pos]
            pool.kv[:, pages[pos // page_size], 1, pos % page_size] = values[pos]
        slices.append(SequenceSlice(pages, cached, new))
        dense_k.append(keys)
        dense_v.append(values)
    layout = BatchLayout.build(slices, page_size)
    q = torch.randn(layout.num_tokens, heads, dim)
    k = torch.cat([keys[s.num_cached :] for keys, s in zip(dense_k, slices, strict=True)])
    v = torch.cat([vals[s.num_cached :] for vals, s in zip(dense_v, slices, strict=True)])
    return pool, layout, slices, q, k, v, dense_k, dense_v


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kinds", ["p", "d", "dddd", "pdpd", "ddpdp"])
def test_torch_backend_matches_dense_reference(page_size: int, group: int, kinds: str) -> None:
    torch.manual_seed(0)
    rng = random.Random(f"{page_size}-{group}-{kinds}")
    kv_heads, dim = 2, 16
    pool, layout, slices, q, k, v, dense_k, dense_v = random_case(
        rng, page_size, kv_heads * group, kv_heads, dim, kinds
    )
    backend = create_backend("torch")
    backend.begin_step(layout)
    out = backend.forward(0, q, k, v, pool.layer(0), layout)
    assert out.shape == q.shape and out.dtype == q.dtype
    start = 0
    for s, keys, values in zip(slices, dense_k, dense_v, strict=True):
        want = dense_reference(q[start : start + s.num_new], keys, values, s.num_cached)
        torch.testing.assert_close(out[start : start + s.num_new].double(), want, atol=1e-5, rtol=1e-5)
        # The new K/V landed in the pages at their positions.
        for pos in range(s.num_cached, s.total):
            page, slot = s.pages[pos // page_size], pos % page_size
            assert torch.equal(pool.kv[0, page, 0, slot], keys[pos])
            assert torch.equal(pool.kv[0, page, 1, slot], values[pos])
        start += s.num_new


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kinds", ["p", "dddd", "pdpd"])
@pytest.mark.parametrize(("soft_cap", "block_rows"), [(None, None), (2.0, None), (2.0, 3)])
def test_sliding_and_global_layers_match_the_dense_reference_without_reading_outside_the_window(
    page_size: int, kinds: str, soft_cap: float | None, block_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 0 slides over 5 positions, layer 1 is global, both with a scale of 0.3 (and a soft cap, whose explicit
    scores may be formed a few query rows at a time). The pages a sliding layer's window has left hold NaN in layer
    0: the backend must never read them (a cache may give them back), and both layers must attend as the dense
    reference does."""
    if block_rows is not None:  # a budget of 3 query rows' scores per block (4 heads x <= 70 keys)
        monkeypatch.setattr(torch_backend, "SCORE_BLOCK_ELEMENTS", block_rows * 4 * 70)
    torch.manual_seed(0)
    rng = random.Random(f"window-{page_size}-{kinds}")
    window, kv_heads, dim = 5, 2, 16
    pool, layout, slices, q, k, v, dense_k, dense_v = random_case(rng, page_size, 4, kv_heads, dim, kinds, layers=2)
    poisoned = 0
    for s in slices:
        first_seen = max(0, s.num_cached - window + 1)  # the step's first query sees no earlier position
        for page in s.pages[: first_seen // page_size]:
            pool.kv[0, page] = float("nan")
            poisoned += 1
    assert poisoned or (kinds == "p" and page_size > 1)  # (seeded: those draw a prefix shorter than a page)
    options = AttentionOptions(scale=0.3, soft_cap=soft_cap, windows=(window, None))
    backend = create_backend("torch", attention=options)
    backend.begin_step(layout)
    for layer, layer_window in ((0, window), (1, None)):
        out = backend.forward(layer, q, k, v, pool.layer(layer), layout)
        start = 0
        for s, keys, values in zip(slices, dense_k, dense_v, strict=True):
            want = dense_reference(
                q[start : start + s.num_new], keys, values, s.num_cached, window=layer_window, scale=0.3,
                soft_cap=soft_cap,
            )  # fmt: skip
            torch.testing.assert_close(out[start : start + s.num_new].double(), want, atol=1e-5, rtol=1e-5)
            start += s.num_new


def test_attention_options_are_checked_and_normalised() -> None:
    assert AttentionOptions(windows=(None, None)) == AttentionOptions()  # all global is the default
    assert AttentionOptions(windows=(8, None, 8)).distinct_windows == (None, 8)
    assert AttentionOptions(windows=(8, 8)).distinct_windows == (8,)
    assert AttentionOptions().window(3) is None and AttentionOptions(windows=(8, None)).window(0) == 8
    for bad in ({"scale": 0.0}, {"soft_cap": float("inf")}, {"windows": (0, None)}):
        with pytest.raises(ValueError, match="attention"):
            AttentionOptions(**bad)


def test_torch_backend_bfloat16_close_to_float32() -> None:
    torch.manual_seed(0)
    rng = random.Random(1)
    pool, layout, _, q, k, v, _, _ = random_case(rng, 16, 8, 2, 32, "pdd")
    backend = create_backend("torch")
    backend.begin_step(layout)
    ref = backend.forward(0, q, k, v, pool.layer(0), layout)
    pool16 = KVPool(KVShape(1, 2, 32), page_size=16, num_pages=pool.num_pages, dtype=torch.bfloat16)
    pool16.kv.copy_(pool.kv)
    out = backend.forward(0, q.bfloat16(), k.bfloat16(), v.bfloat16(), pool16.layer(0), layout)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_copy_prefix_copies_k_slots_in_every_layer(page_size: int) -> None:
    torch.manual_seed(0)
    pool = KVPool(KVShape(3, 2, 8), page_size=page_size, num_pages=6)
    pool.kv.normal_()
    before = pool.kv.clone()
    k = max(1, page_size - 1)
    pool.copy_prefix(1, 4, k)
    assert torch.equal(pool.kv[:, 4, :, :k], before[:, 1, :, :k])
    assert torch.equal(pool.kv[:, 4, :, k:], before[:, 4, :, k:])  # the rest of the destination is untouched
    others = [p for p in range(6) if p != 4]
    assert torch.equal(pool.kv[:, others], before[:, others])


def test_mid_page_hit_via_copy_prefix_attends_like_a_cold_run() -> None:
    """A sequence whose first 21 tokens come from another's pages (16 shared + 5 copied) equals a cold run."""
    torch.manual_seed(0)
    page_size, kvh, heads, dim, total = 16, 2, 8, 16, 40
    keys, values, q = torch.randn(total, kvh, dim), torch.randn(total, kvh, dim), torch.randn(total, heads, dim)
    backend = create_backend("torch")
    cold = KVPool(KVShape(1, kvh, dim), page_size=page_size, num_pages=8)
    layout = BatchLayout.build([SequenceSlice([0, 1, 2], 0, total)], page_size)
    backend.begin_step(layout)
    want = backend.forward(0, q, keys, values, cold.layer(0), layout)
    # Warm: pages 0, 1 hold the first sequence; the reader shares page 0 and copies 5 slots of page 1 into page 5.
    cold.copy_prefix(1, 5, 5)
    layout = BatchLayout.build([SequenceSlice([0, 5, 6], 21, total - 21)], page_size)
    backend.begin_step(layout)
    got = backend.forward(0, q[21:], keys[21:], values[21:], cold.layer(0), layout)
    torch.testing.assert_close(got, want[21:], atol=1e-6, rtol=1e-6)


def test_create_backend_resolution() -> None:
    assert create_backend("auto").name == "torch"  # no CUDA here (or float32): torch
    assert isinstance(create_backend("torch", "cpu"), AttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("nope")


def test_flashinfer_module_imports_without_flashinfer() -> None:
    import radixcache.worker.attention.flashinfer_backend as fb

    assert fb.FlashInferAttentionBackend.name == "flashinfer"
    if not torch.cuda.is_available():
        assert "flashinfer" not in sys.modules
        with pytest.raises(ValueError, match="CUDA"):
            create_backend("flashinfer", "cpu", num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)


def _rows_as(
    steps: list[list[tuple[int, int, int]]],
    page_size: int,
    kv_dtype: str,
    dtype: torch.dtype,
    window: int | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
) -> dict[tuple[int, int], torch.Tensor]:
    """Run `steps` (each a batch of (sequence, cached, new)) through one torch backend over a fresh pool in which every
    sequence s holds keys[s] / values[s] at its positions (written by the steps themselves for their new tokens), and
    return {(sequence, position): output row} for every query computed, position's query being queries[s, position]."""
    seqs, length, kvh, dim = keys.shape
    heads = queries.shape[2]
    per_seq = -(-length // page_size) + 1
    pool = KVPool(KVShape(1, kvh, dim), page_size=page_size, num_pages=seqs * per_seq, dtype=kv_dtype)
    layer = pool.kv_layer(0)
    for s in range(seqs):  # the prefix every step starts from, written through the codec as a step would
        pages = torch.tensor([s * per_seq + p // page_size for p in range(length)])
        slots = torch.arange(length) % page_size
        layer.write(pages, slots, keys[s].to(dtype), values[s].to(dtype))
    options = AttentionOptions(windows=(window,) if window else ())
    backend = create_backend("torch", num_heads=heads, num_kv_heads=kvh, head_dim=dim, attention=options)
    out = {}
    for step in steps:
        slices = [SequenceSlice(list(range(s * per_seq, (s + 1) * per_seq)), c, n) for s, c, n in step]
        layout = BatchLayout.build(slices, page_size)
        rows = [(s, p) for s, c, n in step for p in range(c, c + n)]
        pick = [s * length + p for s, p in rows]
        q = queries.flatten(0, 1)[pick].to(dtype)
        k, v = keys.flatten(0, 1)[pick].to(dtype), values.flatten(0, 1)[pick].to(dtype)
        got = backend.forward(0, q, k, v, layer, layout)
        out.update({row: got[i] for i, row in enumerate(rows)})
    return out


@pytest.mark.parametrize(
    ("page_size", "kv_dtype", "dtype", "window", "group"),
    [
        (16, "fp32", torch.float32, None, 1),
        (16, "bf16", torch.bfloat16, None, 2),
        (7, "fp32", torch.float32, None, 4),
        (1, "bf16", torch.bfloat16, None, 2),
        (16, "int8", torch.bfloat16, None, 2),
        (4, "fp8_e4m3", torch.float32, None, 1),
        (16, "bf16", torch.bfloat16, 40, 2),
        (7, "fp32", torch.float32, 33, 2),
    ],
)
def test_a_query_row_gets_the_same_bits_however_its_step_is_batched_or_cut(
    page_size: int, kv_dtype: str, dtype: torch.dtype, window: int | None, group: int
) -> None:
    """Greedy output identical with the cache and speculation on and off rests on this: the row of a token is the
    same bits whether it is a decode of its own, one of a batch of decodes next to longer and shorter sequences, a
    draft in a verify chunk (several new tokens), or a row of a prefill chunk cut at another place (long enough to
    be attended to by itself), in a step mixed with others. The lengths cross the inner-product sizes where the CPU's
    matmul sums differently (one row; 193-384 columns)."""
    torch.manual_seed(0)
    seqs, length, kvh, dim = 4, 420, 2, 32
    keys, values = torch.randn(seqs, length, kvh, dim), torch.randn(seqs, length, kvh, dim)
    queries = torch.randn(seqs, length, kvh * group, dim)
    positions = [5, 17, 130, 199, 260, 300, 383, 419]  # the rows compared, of sequence 0
    ways = {
        "decode alone": [[(0, p, 1)] for p in positions],
        "decode in a batch": [[(1, 400, 1), (0, p, 1), (2, 9, 1), (3, p // 2 + 1, 1)] for p in positions],
        "verify chunk": [[(2, 50, 3), (0, p - 8, 9), (1, 300, 1)] for p in positions if p >= 8],
        "verify chunk, other cut": [[(0, p - 2, min(5, length - p + 2))] for p in positions if p >= 2],
        "long chunk": [[(3, 200, 1), (0, max(0, p - 30), min(length, p + 3) - max(0, p - 30))] for p in positions],
        "long chunk from the start": [[(0, 0, 420)]],
    }
    got = {
        way: _rows_as(steps, page_size, kv_dtype, dtype, window, keys, values, queries) for way, steps in ways.items()
    }
    reference = got.pop("decode alone")
    for way, rows in got.items():
        for p in positions:
            if (0, p) in rows:
                assert torch.equal(rows[(0, p)], reference[(0, p)]), f"{way}: position {p} differs from its decode"
