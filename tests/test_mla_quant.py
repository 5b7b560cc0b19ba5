"""Latent (MLA) pages at a quantized --kv-dtype (int8, fp8_e4m3): a token's latent is stored at that precision as two
half-rows, int8's each with its own scale, fp8's with the layer's one scale for the whole latent (radixcache/pool.py,
latent pages), and read back dequantized by the torch backend.
The cache never changes an answer at a given kv dtype: cold, warm, other page sizes, pages brought back from the
host and disk tiers and pages handed down by demotion all give the greedy tokens of a recompute at that dtype."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_fixtures import build_checkpoint

from radixcache.kv_codec import codec_of
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams
from radixcache.worker.model import load_checkpoint

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
QUANTIZED = ("int8", "fp8_e4m3")
PAGE = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v3")
    build_checkpoint(folder, "DeepseekV3ForCausalLM", seed=3)
    return load_checkpoint(folder)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(range(2, 320), length) for _ in range(n)]


def run(engine: Engine, prompt: list[int], rid: str):
    outs = []
    engine.submit(Request(rid, prompt, GREEDY), outs.append)
    engine.run_until_idle()
    return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens


def recompute(loaded, prompt: list[int], kv_dtype: str) -> list[int]:
    off = Engine(loaded, EngineConfig(page_size=PAGE, kv_pages=64, kv_dtype=kv_dtype, cache_enabled=False))
    return run(off, prompt, "off")[0]


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_cold_warm_and_every_page_size_give_the_recomputed_tokens(loaded, kv_dtype):
    prompt = prompts(1, 22, seed=5)[0]
    want = recompute(loaded, prompt, kv_dtype)
    for page_size in (1, 7, 16):
        engine = Engine(loaded, EngineConfig(page_size=page_size, kv_pages=128, kv_dtype=kv_dtype))
        cold, _ = run(engine, prompt, "cold")
        warm, cached = run(engine, prompt, "warm")
        assert cold == warm == want, page_size
        assert cached >= 22 - page_size  # the warm run read the cold run's quantized pages
        engine.cache.check(idle=True)
    # the pages are stored quantized (so the figures above compare quantized reads, not full precision ones)
    assert engine.pool.kv_layer(0).values.dtype == codec_of(kv_dtype).storage


def tiered(loaded, folder: Path, kv_dtype: str, **kw) -> Engine:
    config = EngineConfig(
        page_size=PAGE, kv_pages=kw.pop("kv_pages", 40), kv_dtype=kv_dtype, kv_disk_dir=str(folder),
        kv_disk_bytes=64 << 20, kv_host_bytes=kw.pop("host", None), **kw,
    )  # fmt: skip
    engine = Engine(loaded, config)
    engine.start_tiers()
    assert engine.wait_tier_ready(60), engine.tiers and engine.tiers.error
    return engine


def settle(engine: Engine) -> None:
    disk = engine.cache.tier.disk
    engine.cache.tier.pump(budget_s=60.0)
    for _ in range(2000):
        if not disk.queued():
            break
        disk._stop.wait(0.005)
    engine.cache.tier.pump()


@pytest.mark.parametrize("host", [None, 1 << 20], ids=["disk", "host_then_disk"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_a_quantized_latent_page_back_from_a_tier_gives_the_recomputed_tokens(loaded, tmp_path, kv_dtype, host):
    engine = tiered(loaded, tmp_path, kv_dtype, host=host)
    prompt = prompts(1, 40, seed=15)[0]
    first, _ = run(engine, prompt, "first")
    for i, filler in enumerate(prompts(4, 36, seed=99)):
        run(engine, filler, f"filler-{i}")
    engine.cache.evict(engine.num_pages)
    settle(engine)
    assert engine.cache.match_length(prompt) == 0  # nothing of it left in memory
    again, cached = run(engine, prompt, "again")
    stats = engine.stats()
    assert cached >= 36 and stats.disk_hit_tokens + stats.host_hit_tokens >= 36
    assert again == first == recompute(loaded, prompt, kv_dtype)
    link = engine.cache.tier
    on_disk = [r.key for r in link.tier_records() if r.medium == "DISK"]
    assert on_disk and {link.disk.get(key).kv_dtype for key in on_disk} == {kv_dtype}
    engine.cache.check(idle=True)
    engine.shutdown()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_demoted_latent_pages_hand_exact_pages_down_that_another_worker_serves(loaded, tmp_path, kv_dtype):
    engine = tiered(loaded, tmp_path, kv_dtype, kv_pages=40, kv_demote="int4", kv_disk_write="evict")
    prompt = prompts(1, 40, seed=16)[0]
    first, _ = run(engine, prompt, "first")
    for i, filler in enumerate(prompts(2, 36, seed=17)):  # the prompt's pages are demoted to make room
        run(engine, filler, f"filler-{i}")
    settle(engine)
    stats = engine.stats().cache
    assert stats.demoted_pages >= 8 and stats.disk_pages >= 8
    engine.cache.check(idle=True)
    engine.shutdown()
    plain = tiered(loaded, tmp_path, kv_dtype)
    got, cached = run(plain, prompt, "plain")
    assert cached >= 36 and plain.stats().disk_hit_tokens >= 36
    assert got == first == recompute(loaded, prompt, kv_dtype)
    plain.shutdown()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_kv_memory_buys_pages_at_the_bytes_the_pool_allocates(loaded, kv_dtype, capsys):
    """Per token and layer: the latent's R + P values at the dtype's element size, plus int8's two fp16 scales (one
    per half): the figure `radixcache memory` prints, and what the pool's tensors hold."""
    from radixcache.memory import main as memory_main

    mc = loaded.config
    width = mc.kv_lora_rank + mc.qk_rope_head_dim
    per_token = mc.num_layers * (width + (4 if kv_dtype == "int8" else 0))  # 1-byte values
    budget = 300_000
    engine = Engine(loaded, EngineConfig(page_size=7, kv_memory_bytes=budget, kv_dtype=kv_dtype, speculate=0))
    assert engine.kv_bytes_per_token == per_token
    assert engine.num_pages == budget // (7 * per_token)
    layers = [engine.pool.kv_layer(i) for i in range(mc.num_layers)]
    held = sum(x.values.nbytes + (0 if x.scales is None else x.scales.nbytes) for x in layers)
    assert held == engine.kv_bytes == engine.num_pages * 7 * per_token
    args = ["memory", "--layers", str(mc.num_layers), "--kv-lora-rank", str(mc.kv_lora_rank)]
    args += ["--rope-dim", str(mc.qk_rope_head_dim), "--kv-dtype", kv_dtype]
    assert memory_main(args) == 0
    assert f"KV bytes per token: {per_token} " in capsys.readouterr().out


def test_int4_latent_pages_are_refused_naming_the_field(loaded):
    with pytest.raises(ValueError, match=r"kv_dtype \(--kv-dtype\) int4"):
        Engine(loaded, EngineConfig(page_size=4, kv_pages=32, kv_dtype="int4"))


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_attention_reads_each_latent_half_dequantized_with_its_own_scales(loaded, kv_dtype):
    """The torch backend's latent attention over quantized pages equals causal attention, by hand, over the
    latents as the codec stores them (each half encoded and decoded alone: int8's halves with their own scales, not
    mixed up; fp8's with the layer's one latent scale, its K scale, whatever V scale the pool was given)."""
    from radixcache.pool import KVPool, KVShape
    from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
    from radixcache.worker.model.llama import attention_options

    mc = loaded.config
    kv_heads, half = mc.kv_cache_dims
    options = attention_options(mc)
    scales = torch.tensor([[0.5, 4.0]] * mc.num_layers)  # fp8's K and V scales apart (int8 has none)
    shape = KVShape(mc.num_layers, kv_heads, half)
    pool = KVPool(shape, page_size=PAGE, num_pages=8, dtype=kv_dtype, kv_scales=scales, latent=True)
    if kv_dtype == "fp8_e4m3":  # both halves of a latent may share a block: one scale, K's
        assert (pool.kv_layer(0).k_scale, pool.kv_layer(0).v_scale) == (0.5, 0.5)
    backend = create_backend("torch", num_heads=mc.num_heads, num_kv_heads=kv_heads, head_dim=half,
                             dtype=torch.float32, attention=options)  # fmt: skip
    torch.manual_seed(0)
    n, heads = 11, mc.num_heads
    first = torch.randn(n, 1, half)
    second = torch.randn(n, 1, half) * 8  # the halves at different scales: one shared scale would lose the first
    q = torch.randn(n, heads, 2 * half)
    layout = BatchLayout.build([SequenceSlice(list(range(3)), 0, n)], PAGE)
    with torch.inference_mode():
        got = backend.forward(0, q, first, second, pool.kv_layer(0), layout)
    codec, layer = codec_of(kv_dtype), pool.kv_layer(0)
    stored = [
        codec.decode(*codec.encode(x, s), torch.float32, s)
        for x, s in ((first, layer.k_scale), (second, layer.k_scale))
    ]
    latent = torch.cat(stored, -1)[:, 0]  # [n, D]
    scores = torch.einsum("thd,sd->hts", q, latent) * (options.scale or (2 * half) ** -0.5)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hts,sd->thd", scores.softmax(-1), latent)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_a_hit_on_demoted_latent_pages_brings_them_back_into_the_pools_precision(loaded, kv_dtype):
    """Without a tier, demoted (int4) latent pages are promoted into kv_dtype pages before attention reads them
    (attention never reads int4 latent pages, which it refuses)."""
    engine = Engine(loaded, EngineConfig(page_size=PAGE, kv_pages=40, kv_dtype=kv_dtype, kv_demote="int4"))
    prompt = prompts(1, 40, seed=16)[0]
    first, _ = run(engine, prompt, "first")
    for i, filler in enumerate(prompts(2, 36, seed=17)):
        run(engine, filler, f"filler-{i}")
    assert engine.stats().cache.demoted_pages >= 8
    again, cached = run(engine, prompt, "again")
    stats = engine.stats().cache
    assert cached >= 36 and stats.promoted_pages >= 8 and len(again) == len(first)
    engine.cache.check(idle=True)
