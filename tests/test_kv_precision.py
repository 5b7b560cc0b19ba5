"""KV pages in 8 and 4 bits (radixcache.kv_codec, radixcache.pool): every precision's round-trip error is bounded,
its bytes depend only on the vector they encode, a page carries its scales wherever it goes, and the torch backend
attends over a quantized pool exactly as over the same values dequantized."""

from __future__ import annotations

import random

import pytest
import torch

from radixcache.kv_codec import CODECS, FP8_MAX, codec_of, hadamard
from radixcache.kv_dtypes import KV_DTYPES, QUANTIZED_KV_DTYPES
from radixcache.page_data import PageData
from radixcache.pool import KVPool, KVShape, kv_bytes_per_token
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
from radixcache.worker.attention.base import AttentionOptions


def vectors(rows: int = 64, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, some with an outlier channel (as real keys have), one all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    x[::5, 7] *= 30.0
    x[min(3, rows - 1)] = 0.0
    return x


# --- round trips ---------------------------------------------------------------------------------------------------
def test_integer_codes_are_within_half_a_step_and_use_their_whole_range() -> None:
    x = vectors()
    for name, levels in (("int8", 127), ("int4", 7)):
        c = CODECS[name]
        values, scales = c.encode(x)
        assert values.dtype == c.storage and values.shape[-1] == x.shape[-1] // c.pack
        assert scales is not None and scales.dtype == torch.float16 and scales.shape == x.shape[:-1]
        step = scales.float()[:, None]
        back = c.decode(values, scales, torch.float32)
        assert bool(((back - x).abs() <= 0.5 * step + 1e-6 * x.abs()).all()), name
        assert torch.equal(back[3], torch.zeros(x.shape[-1]))  # a zero vector stays zero (no 0/0)
        q = torch.round(back[scales != 0] / step[scales != 0])
        assert int(q.abs().amax(dim=-1).min()) >= levels - 1, name  # each row spans (nearly) the full grid
        assert int(q.abs().max()) <= levels


def test_int4_packs_two_values_a_byte_low_half_in_the_low_nibble() -> None:
    c = CODECS["int4"]
    x = torch.tensor([[7.0, -7.0, 0.0, 1.0, 3.0, -2.0, 7.0, 0.0]])  # scale 1: the codes are the values
    values, scales = c.encode(x)
    assert float(scales) == 1.0 and values.shape == (1, 4) and values.dtype == torch.uint8
    low, high = (values & 15).int() - 8, (values >> 4).int() - 8
    assert low.tolist() == [[7, -7, 0, 1]] and high.tolist() == [[3, -2, 7, 0]]
    assert torch.equal(c.decode(values, scales, torch.float32), x)


def test_fp8_is_relative_and_saturates_at_its_scaled_range() -> None:
    c = CODECS["fp8_e4m3"]
    x = torch.tensor([[0.1, -1.5, 3.3, 300.0, 1000.0, -5000.0, 0.02, 2.0**-8]])
    for scale in (1.0, 4.0):
        values, scales = c.encode(x, scale)
        assert scales is None and values.dtype == torch.float8_e4m3fn
        back = c.decode(values, None, torch.float32, scale)
        inside = x.abs() <= FP8_MAX * scale
        rel = ((back - x).abs() / x.abs())[inside & (x.abs() >= 2**-6 * scale)]
        assert float(rel.max()) <= 2**-4  # 3 mantissa bits: half a step is 1/16 of the value
        assert bool((back[~inside].abs() == FP8_MAX * scale).all())  # saturated, never inf or NaN


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_half_precisions_round_to_nearest(name: str) -> None:
    c, x = CODECS[name], vectors() / 1000
    values, scales = c.encode(x)
    assert scales is None and torch.equal(c.decode(values, None, torch.float32), x.to(c.storage).float())


@pytest.mark.parametrize("name", QUANTIZED_KV_DTYPES)
def test_a_tokens_bytes_never_depend_on_the_others_in_its_batch(name: str) -> None:
    """Deterministic per token: what a hit reads equals what a recompute writes, whatever else was computed."""
    c, x = CODECS[name], vectors()
    values, scales = c.encode(hadamard(x) if c.rotate_keys else x)
    rng = random.Random(0)
    for row in rng.sample(range(x.shape[0]), 8):
        others = vectors(rng.randrange(1, 9), seed=row + 1)
        batch = torch.cat((others, x[row : row + 1], others))
        v, s = c.encode(hadamard(batch) if c.rotate_keys else batch)
        mid = others.shape[0]
        assert torch.equal(v[mid].view(torch.uint8), values[row].view(torch.uint8)), (name, row)
        assert s is None or torch.equal(s[mid], scales[row])  # type: ignore[index]


def test_hadamard_is_an_orthonormal_involution_that_keeps_dot_products() -> None:
    for dim in (64, 128, 96, 80):  # powers of two, and blocks of 32 / 16 for the others
        x, y = vectors(8, dim), vectors(8, dim, seed=1)
        hx, hy = hadamard(x), hadamard(y)
        torch.testing.assert_close(hadamard(hx), x, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close((hx * hy).sum(-1), (x * y).sum(-1), rtol=1e-5, atol=1e-3)


def test_the_rotation_cuts_int4_error_on_keys_with_an_outlier_channel() -> None:
    """Why int4 rotates keys: a channel 30x the others sets every per-token scale, rounding the rest to 0."""
    c = CODECS["int4"]
    g = torch.Generator().manual_seed(3)
    k = torch.randn(512, 64, generator=g)
    k[:, 5] *= 30.0
    plain = c.decode(*c.encode(k), torch.float32)
    rotated = hadamard(c.decode(*c.encode(hadamard(k)), torch.float32))
    err_plain = float((plain - k).norm() / k.norm())
    err_rotated = float((rotated - k).norm() / k.norm())
    assert err_rotated < 0.6 * err_plain, (err_plain, err_rotated)


def test_bytes_per_token_include_scales_and_meet_the_targets() -> None:
    for layers, kvh, dim in ((4, 2, 64), (12, 4, 64), (32, 8, 128)):
        fp16 = kv_bytes_per_token(layers, kvh, dim, "fp16")
        per = {n: kv_bytes_per_token(layers, kvh, dim, n) for n in KV_DTYPES}
        assert per["fp32"] == 2 * fp16 and per["bf16"] == fp16 == 2 * layers * kvh * dim * 2
        assert per["int8"] == 2 * layers * kvh * (dim + 2) and per["int8"] <= 0.52 * fp16
        assert per["int4"] == 2 * layers * kvh * (dim // 2 + 2) and per["int4"] <= 0.3 * fp16
        assert per["fp8_e4m3"] == fp16 // 2


# --- pages carry their scales --------------------------------------------------------------------------------------
SHAPE = KVShape(layers=2, kv_heads=2, head_dim=16)


def quantized_pool(name: str, num_pages: int = 6, page_size: int = 4, seed: int = 0) -> KVPool:
    scales = torch.tensor([[0.5, 2.0], [1.0, 3.0]]) if name == "fp8_e4m3" else None
    pool = KVPool(SHAPE, page_size=page_size, num_pages=num_pages, dtype=name, kv_scales=scales)
    g = torch.Generator().manual_seed(seed)
    for i in range(SHAPE.layers):
        rows = torch.arange(num_pages * 2 * page_size)
        k, v = torch.randn(2, rows.numel() // 2, SHAPE.kv_heads, SHAPE.head_dim, generator=g) * 3
        k_rows = rows.view(num_pages, 2, page_size)[:, 0].flatten()
        pool.kv_layer(i).write_rows(torch.cat((k_rows, k_rows + page_size)), k, v)
    return pool


@pytest.mark.parametrize("name", QUANTIZED_KV_DTYPES)
def test_a_quantized_page_round_trips_with_its_scales(name: str) -> None:
    src, dst = quantized_pool(name), quantized_pool(name, seed=1)
    page = src.read_page(4)
    assert page.kv_dtype == name and page.nbytes >= src.bytes_per_token * src.page_size
    back = PageData.from_bytes(page.to_bytes())
    assert back.equal(page)
    dst.write_page(2, back)
    assert dst.read_page(2).equal(src.read_page(4))
    for layer in range(SHAPE.layers):  # what attention reads back is the same too
        for which in (0, 1):  # block 2p is page p's K, 2p + 1 its V
            want = src.kv_layer(layer).gather_heads(torch.tensor([8 + which]), which, 1, torch.float32)
            got = dst.kv_layer(layer).gather_heads(torch.tensor([4 + which]), which, 1, torch.float32)
            assert torch.equal(got, want)


def test_write_page_refuses_other_precisions_missing_scales_and_other_fp8_scales() -> None:
    int8, int4, fp8 = quantized_pool("int8"), quantized_pool("int4"), quantized_pool("fp8_e4m3")
    before = int8.read_page(0)
    page = int8.read_page(1)
    for pool, data, error in (
        (int4, page, "a int8 page cannot be written into a int4 KV page"),
        (int8, PageData("int8", page.kv, None), "needs fp16 scales"),
        (int8, PageData("int8", page.kv, page.scales.float()), "needs fp16 scales"),  # type: ignore[union-attr]
        (fp8, PageData("fp8_e4m3", fp8.read_page(0).kv, torch.ones(2, 2)), "other per-layer scales"),
        (int8, quantized_pool("int8", page_size=8).read_page(0), "does not fit"),
    ):
        with pytest.raises(ValueError, match=error):
            pool.write_page(0, data)
    assert int8.read_page(0).equal(before)


@pytest.mark.parametrize("name", QUANTIZED_KV_DTYPES)
def test_copy_prefix_copies_slots_and_their_scales(name: str) -> None:
    pool = quantized_pool(name)
    src, dst, k = pool.read_page(1), pool.read_page(5), 3
    pool.copy_prefix(1, 5, k)
    got = pool.read_page(5)
    assert torch.equal(got.kv[:, :, :k].view(torch.uint8), src.kv[:, :, :k].view(torch.uint8))
    assert torch.equal(got.kv[:, :, k:].view(torch.uint8), dst.kv[:, :, k:].view(torch.uint8))
    if src.scales is not None and name != "fp8_e4m3":
        assert torch.equal(got.scales[:, :, :k], src.scales[:, :, :k])  # type: ignore[index]
        assert torch.equal(got.scales[:, :, k:], dst.scales[:, :, k:])  # type: ignore[index]


def test_a_pool_sized_by_memory_holds_more_pages_at_lower_precision() -> None:
    shape, budget = KVShape(4, 2, 64), 8 << 20
    pages = {n: KVPool.from_budget(shape, page_size=16, budget_bytes=budget, dtype=n).num_pages for n in KV_DTYPES}
    assert pages["fp16"] == pages["bf16"] == 2 * pages["fp32"]
    assert pages["int8"] >= 1.9 * pages["fp16"] and pages["int4"] >= 3.7 * pages["fp16"]
    for n in KV_DTYPES:  # the tensors really are that small: scales included, nothing beyond the budget
        pool = KVPool.from_budget(shape, page_size=16, budget_bytes=budget, dtype=n)
        assert pool.nbytes == pool.num_pages * pool.page_size * pool.bytes_per_token <= budget
        assert pool.kv_dtype == codec_of(n).name


# --- attention over quantized pages -------------------------------------------------------------------------------
SLIDING_CAPPED = AttentionOptions(soft_cap=5.0, windows=(None, 9))  # Gemma 2's kind: a sliding layer, capped scores


@pytest.mark.parametrize("name", QUANTIZED_KV_DTYPES)
@pytest.mark.parametrize(("page_size", "options"), [(1, None), (16, None), (4, SLIDING_CAPPED)])
def test_torch_backend_attends_over_quantized_pages_as_over_their_values(
    name: str, page_size: int, options: AttentionOptions | None
) -> None:
    """Decode, prefill (with and without a cached prefix) and mixed steps over a quantized pool equal the same steps
    over a full-precision pool holding the dequantized values, the step's own new tokens included: every position is
    read back from the pool at its precision, and for int4 the queries turn with the keys. Sliding windows and soft
    caps (the tiled decode path applies both itself) too."""
    rng = random.Random(page_size)
    kvh, heads, dim, layers, num_pages = 2, 4, 64, 2, 120
    shape = KVShape(layers, kvh, dim)
    pool = KVPool(shape, page_size=page_size, num_pages=num_pages, dtype=name)
    ref = KVPool(shape, page_size=page_size, num_pages=num_pages, dtype="fp32")
    backend, reference = (create_backend("torch", attention=options) for _ in range(2))
    codec = codec_of(name)
    free = list(range(num_pages))
    rng.shuffle(free)
    seqs: list[list[int]] = []
    lengths: list[int] = []
    for kinds in ("pp", "dd", "pd", "ddp"):
        slices = []
        decoding = rng.sample(range(len(seqs)), kinds.count("d")) if seqs else []
        for kind in kinds:
            if kind == "d" and seqs:
                b = decoding.pop()
                if len(seqs[b]) * page_size <= lengths[b]:
                    seqs[b].append(free.pop())
                slices.append(SequenceSlice(seqs[b], lengths[b], 1))
                lengths[b] += 1
            else:
                new = rng.randint(2, 30)
                seqs.append([free.pop() for _ in range(-(-new // page_size))])
                lengths.append(new)
                slices.append(SequenceSlice(seqs[-1], 0, new))
        layout = BatchLayout.build(slices, page_size)
        for layer in range(layers):
            q = torch.randn(layout.num_tokens, heads, dim)
            k, v = torch.randn(2, layout.num_tokens, kvh, dim) * 2
            got = backend.forward(layer, q, k, v, pool.kv_layer(layer), layout)
            # The reference writes what the quantized pool stores, dequantized (keys un-rotated for int4).
            kq = codec.decode(*codec.encode(hadamard(k) if codec.rotate_keys else k), torch.float32)
            kq = hadamard(kq) if codec.rotate_keys else kq
            vq = codec.decode(*codec.encode(v), torch.float32)
            want = reference.forward(layer, q, kq, vq, ref.kv_layer(layer), layout)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
