"""DeepSeek V2 / V3 (multi-head latent attention over latent pages) against transformers on tiny random checkpoints
saved with transformers: V2 with q_lora_rank set and None (V2-Lite's one q_proj, group-limited greedy routing), V3
(sigmoid router with e_score_correction_bias, expert groups, a dense first layer, yarn RoPE whose mscale_all_dim
changes the softmax scale).

- the config fields as transformers reads them, and the refusals naming the field;
- the engine's greedy tokens equal transformers' with the cache cold and warm (whole-page and mid-page hits),
  page sizes 1 / 7 / 16, batched, chunked prefill, speculation on and off;
- float32 logits within 1e-4 of transformers' for a cold prefill, a hit ending mid-page continued in chunks;
- a token's logits are the same bits alone, batched and in a verify chunk (float32 and bfloat16);
- a latent page holds kv_lora_rank + qk_rope_head_dim values per token and layer, and nothing per head;
- int4 latent pages are refused at start-up, and FlashInfer's MLA kernels (512 / 64 only) for these fixtures.
(tests/test_model_parity.py runs its hit / chunk / mixed-batch / preemption cases on the V2 and V3 fixtures too.)"""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import build_checkpoint, hf_config, hf_greedy
from row_ways import assert_same_bits_alone_batched_and_verified

from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
from radixcache.worker.attention.base import BackendUnavailableError, resolve_backend_name
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams
from radixcache.worker.model import ModelConfig, load_checkpoint
from radixcache.worker.model.llama import attention_options

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
VARIANTS = {"v2": (V2, {}), "v2_lite": (V2, {"q_lora_rank": None}), "v3": (V3, {})}
MAX_NEW = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(VARIANTS))
def served(request, tmp_path_factory):
    """(the checkpoint loaded, transformers' model, 3 prompts, transformers' greedy answers: a<i> to each prompt,
    c<i> to each prompt continued by the first 3 tokens of its answer)."""
    arch, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(folder, arch, seed=3, **overrides)
    hf.config._attn_implementation = "eager"
    rng = random.Random(11)
    prompts = [rng.sample(range(2, 320), 20) for _ in range(3)]
    want = {}
    for i, p in enumerate(prompts):
        want[f"a{i}"], _ = hf_greedy(hf, p, MAX_NEW)
        want[f"c{i}"], _ = hf_greedy(hf, p + want[f"a{i}"][:3], MAX_NEW)
    return load_checkpoint(folder), hf, prompts, want


def test_config_reads_deepseek_fields_as_transformers_does():
    v3 = hf_config(V3)
    config = ModelConfig.from_hf_config(v3.to_dict())
    assert config.is_mla and (config.kv_lora_rank, config.q_lora_rank) == (32, 24)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (16, 8, 12)
    assert config.mlp_kinds == ("dense", "moe", "moe")  # first_k_dense_replace = 1
    assert (config.moe_router, config.moe_n_group, config.moe_topk_group) == ("deepseek_v3", 4, 2)
    assert config.routed_scaling_factor == 1.5 and config.shared_expert_intermediate_size == 32
    assert config.mla_rope_layout == "pairs_split" and config.kv_cache_dims == (1, 20)
    v2_lite = ModelConfig.from_hf_config(hf_config(V2, q_lora_rank=None).to_dict())
    assert v2_lite.q_lora_rank is None and v2_lite.mla_rope_layout == "pairs"
    assert v2_lite.moe_router == "deepseek_v2" and v2_lite.moe_group_limited
    halves = ModelConfig.from_hf_config({**v3.to_dict(), "rope_interleave": False})
    assert halves.mla_rope_layout == "halves"


@pytest.mark.parametrize("arch", [V2, V3])
def test_the_softmax_scale_is_transformers(arch):
    import transformers

    cfg = hf_config(arch)
    theirs = getattr(transformers, arch)(cfg).model.layers[0].self_attn.scaling
    ours = ModelConfig.from_hf_config(cfg.to_dict()).attention_scale
    assert ours == pytest.approx(theirs, rel=1e-12)
    if arch == V3:  # yarn with mscale_all_dim: not the plain 1/sqrt(qk_head_dim)
        assert abs(ours - 24**-0.5) > 1e-3


@pytest.mark.parametrize(
    ("arch", "field", "value"),
    [
        (V2, "topk_method", "noaux_tc"),
        (V3, "topk_method", "greedy"),
        (V2, "scoring_func", "sigmoid"),
        (V3, "scoring_func", "softmax"),
        (V3, "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
        (V2, "rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        (V2, "attention_bias", True),
        (V3, "moe_layer_freq", 2),
    ],
)
def test_a_config_it_cannot_serve_exactly_is_refused_naming_the_field(arch, field, value):
    saved = {**hf_config(arch).to_dict(), field: value}
    if field == "rope_scaling":
        saved.pop("rope_parameters", None)
    named = "rope_scaling" if field == "rope_scaling" else field
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_config(saved)


def test_yarn_is_refused_outside_mla():
    llama = hf_config("LlamaForCausalLM").to_dict()
    llama["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    llama.pop("rope_parameters", None)
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config(llama)


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def __call__(self, out) -> None:
        self.tokens.setdefault(out.request_id, []).extend(out.token_ids)


@pytest.mark.parametrize(
    ("page_size", "speculate", "max_step_tokens"), [(1, 0, 2048), (7, 4, 2048), (16, 0, 2048), (7, 0, 9)]
)
def test_the_engine_serves_transformers_greedy_tokens(served, page_size, speculate, max_step_tokens):
    loaded, _, prompts, want = served
    config = EngineConfig(page_size=page_size, kv_pages=256, speculate=speculate, max_step_tokens=max_step_tokens)
    engine = Engine(loaded, config)
    sink = Sink()
    greedy = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    waves = [
        [Request(f"a{i}", p, greedy) for i, p in enumerate(prompts)],  # cold, batched
        [Request(f"b{i}", p, greedy) for i, p in enumerate(prompts)]  # warm: the same prompts (a hit ending mid-page)
        + [Request(f"c{i}", p + want[f"a{i}"][:3], greedy) for i, p in enumerate(prompts)],  # and continued
    ]
    for wave in waves:
        for request in wave:
            engine.submit(request, sink)
        engine.run_until_idle()
    engine.cache.check(idle=True)
    for i in range(3):
        assert sink.tokens[f"a{i}"] == want[f"a{i}"] and sink.tokens[f"b{i}"] == want[f"a{i}"]
        assert sink.tokens[f"c{i}"] == want[f"c{i}"]
    assert engine.stats().cached_tokens >= 6 * (20 - page_size)  # the second wave hit the first's pages


def pool_and_backend(mc: ModelConfig, page_size: int, pages: int, dtype: torch.dtype = torch.float32):
    kv_heads, head_dim = mc.kv_cache_dims
    shape = KVShape(mc.num_layers, kv_heads, head_dim)
    pool = KVPool(shape, page_size=page_size, num_pages=pages, dtype=dtype, latent=True)
    backend = create_backend("torch", num_heads=mc.num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             dtype=dtype, attention=attention_options(mc))  # fmt: skip
    return pool, backend


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_float32_logits_within_1e4_cold_and_from_a_mid_page_hit_in_chunks(served, page_size):
    loaded, hf, prompts, want = served
    mc = loaded.config
    tokens = prompts[0] + want["a0"]
    _, reference = hf_greedy(hf, prompts[0], MAX_NEW)  # [len - 1, vocab]: row i predicts token i + 1
    n = len(tokens) - 1
    pages = -(-n // page_size)
    pool, backend = pool_and_backend(mc, page_size, 2 * pages + 1)
    cold_table, warm_table = list(range(pages)), list(range(pages, 2 * pages))
    with torch.inference_mode():
        cold = loaded.model(torch.tensor(tokens[:n]), BatchLayout.build([SequenceSlice(cold_table, 0, n)], page_size),
                            pool, backend, all_logits=True)  # fmt: skip
        # A hit of 13 tokens (mid-page for 7 and 16): its pages copied, the last one partially, then the rest in
        # chunks of 5 that straddle page boundaries.
        hit = 13
        for p in range(hit // page_size):
            pool.copy_prefix(cold_table[p], warm_table[p], page_size)
        if hit % page_size:
            pool.copy_prefix(cold_table[hit // page_size], warm_table[hit // page_size], hit % page_size)
        warm = []
        for start in range(hit, n, 5):
            end = min(n, start + 5)
            layout = BatchLayout.build([SequenceSlice(warm_table, start, end - start)], page_size)
            warm.append(loaded.model(torch.tensor(tokens[start:end]), layout, pool, backend, all_logits=True))
    torch.testing.assert_close(cold, reference, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(warm), reference[hit:], atol=1e-4, rtol=0)
    assert cold[len(prompts[0]) - 1 :].argmax(-1).tolist() == want["a0"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tokens_logits_are_the_same_bits_alone_batched_and_in_a_verify_chunk(served, dtype, tmp_path):
    """What cache on == off and speculation on == off rest on, with latent pages and absorbed projections."""
    loaded, hf, _, _ = served
    if dtype == "bfloat16":
        hf.save_pretrained(tmp_path, safe_serialization=True)
        (tmp_path / "tokenizer.json").write_text((loaded.path / "tokenizer.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text((loaded.path / "tokenizer_config.json").read_text())
        loaded = load_checkpoint(tmp_path, dtype=dtype)
    mc, page = loaded.config, 8
    assert_same_bits_alone_batched_and_verified(
        loaded, page, lambda: pool_and_backend(mc, page, 15, getattr(torch, dtype))
    )


def test_a_latent_page_holds_one_latent_per_token_and_layer(served):
    loaded, _, prompts, _ = served
    mc = loaded.config
    engine = Engine(loaded, EngineConfig(page_size=4, kv_pages=32, speculate=0))
    latent = mc.kv_lora_rank + mc.qk_rope_head_dim
    assert engine.pool.bytes_per_token == mc.num_layers * latent * 4  # float32, no per-head K/V, no empty half
    sink = Sink()
    engine.submit(Request("r", prompts[0], SamplingParams(max_tokens=2, ignore_eos=True)), sink)
    engine.run_until_idle()
    # What the model wrote for the prompt's first tokens in layer 0 is [c | k_pe], c kv_a_layernorm's output: token
    # (page, slot)'s latent is the page's row `slot` of D contiguous values (radixcache/pool.py, latent pages).
    layer0 = loaded.model.model.layers[0]
    with torch.inference_mode():
        x = layer0.input_layernorm.forward(loaded.model.model.embed_tokens(torch.tensor(prompts[0][:2])))
        c = layer0.self_attn.kv_a_layernorm.forward(
            layer0.self_attn.kv_a_proj_with_mqa.forward(x)[:, : mc.kv_lora_rank]
        )
    tokens = engine.pool.kv_layer(0).latent_tokens()  # [pages, page_size, latent]
    assert tokens.shape[1:] == (4, latent)
    [page] = [p for p in range(tokens.shape[0]) if torch.allclose(tokens[p, 0, : mc.kv_lora_rank], c[0], atol=1e-6)]
    torch.testing.assert_close(tokens[page, 1, : mc.kv_lora_rank], c[1], atol=1e-6, rtol=0)  # the next slot's


def test_int4_latent_pages_and_flashinfer_are_refused_at_start_up(served):
    """int4 cannot hold latent pages; int8 and fp8_e4m3 can (tests/test_mla_quant.py). FlashInfer's MLA kernels
    (the flashinfer_mla backend) read 512 + 64 latents only, not these fixtures' 32 + 8: auto gives torch and an
    explicit flashinfer says why (tests/test_flashinfer_path.py checks every reason with CUDA faked)."""
    loaded = served[0]
    with pytest.raises(ValueError, match="kv_dtype \\(--kv-dtype\\) int4"):
        Engine(loaded, EngineConfig(page_size=4, kv_pages=32, kv_dtype="int4"))
    latent = attention_options(loaded.config)
    assert latent.latent_dims == (loaded.config.kv_lora_rank, loaded.config.qk_rope_head_dim) == (32, 8)
    assert resolve_backend_name("auto", "cuda", attention=latent) == "torch"
    with pytest.raises(BackendUnavailableError, match="latent"):
        resolve_backend_name("flashinfer", "cuda", attention=latent)


def test_kv_memory_sizes_latent_pages_by_their_bytes(served):
    """--kv-memory buys as many latent pages as it holds at layers x (kv_lora_rank + rope) values per token: the
    figure `radixcache memory --kv-lora-rank --rope-dim` prints (tests/test_memory_cli.py)."""
    loaded = served[0]
    mc = loaded.config
    budget = 300_000
    engine = Engine(loaded, EngineConfig(page_size=7, kv_memory_bytes=budget, speculate=0))
    per_page = 7 * mc.num_layers * (mc.kv_lora_rank + mc.qk_rope_head_dim) * 4  # float32
    assert engine.num_pages == budget // per_page
    assert engine.kv_bytes == engine.num_pages * per_page <= budget


def test_cache_events_name_the_latent_pages_group_mla(served):
    """A DeepSeek worker's cache events report group 0 as vLLM reports an MLA model's KV cache group
    (kv_cache_spec_kind "mla_attention"), in the snapshot and in the live events, and so in vLLM's layout."""
    import asyncio

    from radixcache.worker.events.hub import CacheEventHub
    from radixcache.worker.events.vllm_format import vllm_event

    loaded, _, prompts, _ = served
    engine = Engine(loaded, EngineConfig(page_size=4, kv_pages=64, speculate=0))

    def serve(rid: str, prompt: list[int]) -> None:
        engine.submit(Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)), Sink())
        engine.run_until_idle()

    async def scenario() -> list:
        hub = CacheEventHub(engine)
        serve("before", prompts[0])  # in the snapshot
        await hub.start()
        try:
            batches = hub.subscribe()
            snapshot = await batches.__anext__()
            serve("after", prompts[1])  # live events
            live = await asyncio.wait_for(batches.__anext__(), 10)
            await batches.aclose()
        finally:
            await hub.close()
        return [*snapshot.events, *live.events]

    events = asyncio.run(scenario())
    stored = [e for e in events if type(e).__name__ == "PagesStored"]
    assert len(stored) >= 2 and {e.kv_cache_spec_kind for e in stored} == {"mla_attention"}
    assert vllm_event(stored[0], 4)["kv_cache_spec_kind"] == "mla_attention"


# --- latent pages in the pool: token-contiguous (radixcache/pool.py, latent pages) -----------------------------
RANK, ROPE, LATENT_PAGE = 12, 4, 4  # D = 16: two half-rows of 8


def latent_pool(kv_dtype: str, pages: int = 6, **kw) -> KVPool:
    return KVPool(KVShape(2, 1, (RANK + ROPE) // 2), page_size=LATENT_PAGE, num_pages=pages, dtype=kv_dtype,
                  latent=True, **kw)  # fmt: skip


def fill(pool: KVPool, page: int, seed: int) -> torch.Tensor:
    """Random latents [layers, page_size, D] written into every slot of `page` (as a model writes them: the halves
    at K rows and V rows); what the pool holds of them comes back through gather_latents."""
    g = torch.Generator().manual_seed(seed)
    half = (RANK + ROPE) // 2
    pages, slots = torch.full((LATENT_PAGE,), page), torch.arange(LATENT_PAGE)
    for i in range(pool.shape.layers):
        latent = torch.randn(LATENT_PAGE, 1, 2 * half, generator=g) * torch.tensor([1.0] * half + [5.0] * half)
        pool.kv_layer(i).write(pages, slots, latent[..., :half], latent[..., half:])
    return stored(pool, page)


def stored(pool: KVPool, page: int, slots: int = LATENT_PAGE) -> torch.Tensor:
    rows = page * LATENT_PAGE + torch.arange(slots)
    return torch.stack([pool.kv_layer(i).gather_latents(rows, torch.float32) for i in range(pool.shape.layers)])


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
def test_a_tokens_latent_is_one_row_of_the_page_and_ckv_kpe_are_views_flashinfer_reads(kv_dtype):
    """Token (page, slot)'s latent is latent_tokens()[page, slot], D contiguous values; its [..., :R] and [..., R:]
    are views of the pool (no copy) with unit-strided rows of stride D: FlashInfer's ckv_cache and kpe_cache."""
    pool = latent_pool(kv_dtype, kv_scales=torch.tensor([[0.5, 3.0]] * 2))
    g = torch.Generator().manual_seed(1)
    half = (RANK + ROPE) // 2
    pages, slots = torch.tensor([2, 2, 5, 0]), torch.tensor([3, 0, 1, 2])
    latent = torch.randn(4, 1, 2 * half, generator=g)
    layer = pool.kv_layer(1)
    layer.write(pages, slots, latent[..., :half], latent[..., half:])
    tokens = layer.latent_tokens()
    assert tokens.shape == (6, LATENT_PAGE, RANK + ROPE)
    scale = layer.k_scale if kv_dtype == "fp8_e4m3" else 1.0
    want = pool.codec.decode(pool.codec.encode(latent[:, 0], layer.k_scale)[0], None, torch.float32, layer.k_scale)
    torch.testing.assert_close(tokens[pages, slots].float() * scale, want, atol=0, rtol=0)
    ckv, kpe = tokens[..., :RANK], tokens[..., RANK:]
    element = tokens.element_size()
    for view, offset in ((ckv, 0), (kpe, RANK)):
        assert view.stride() == (LATENT_PAGE * (RANK + ROPE), RANK + ROPE, 1)
        assert view.data_ptr() == layer.values.data_ptr() + offset * element  # the pool's bytes, not a copy
    # half-row page * 2 * page_size + 2 * slot + 1 is token (page, slot)'s second half (not a V block's row)
    assert layer.values.view(-1, half)[2 * 2 * LATENT_PAGE + 2 * 3 + 1].data_ptr() == tokens[2, 3, half:].data_ptr()


def test_int8_latents_keep_one_scale_per_half_row_and_come_back_whole():
    pool = latent_pool("int8")
    layer = pool.kv_layer(0)
    half = (RANK + ROPE) // 2
    latent = torch.randn(3, 1, 2 * half) * torch.tensor([1.0] * half + [50.0] * half)
    pages, slots = torch.tensor([1, 1, 4]), torch.tensor([2, 3, 0])
    layer.write(pages, slots, latent[..., :half], latent[..., half:])
    codes, scales = pool.codec.encode(latent[:, 0].view(3, 2, half))  # each half-row its own scale
    assert layer.scales is not None
    torch.testing.assert_close(layer.scales.view(6, LATENT_PAGE, 2)[pages, slots], scales, atol=0, rtol=0)
    got = layer.gather_latents(pages * LATENT_PAGE + slots, torch.float32)
    want = pool.codec.decode(codes, scales, torch.float32).view(3, 2 * half)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="scales"):
        layer.latent_tokens()


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("num_slots", [1, 3])
def test_a_partial_page_copy_moves_whole_latents(kv_dtype, num_slots):
    """copy_prefix(src, dst, k < page_size): the first k latents of src land whole in dst, the rest untouched."""
    pool = latent_pool(kv_dtype)
    src = fill(pool, 1, seed=2)
    before = fill(pool, 4, seed=3)
    pool.copy_prefix(1, 4, num_slots)
    after = stored(pool, 4)
    torch.testing.assert_close(after[:, :num_slots], src[:, :num_slots], atol=0, rtol=0)
    torch.testing.assert_close(after[:, num_slots:], before[:, num_slots:], atol=0, rtol=0)


def test_fp8_latent_pages_use_one_scale_per_layer_and_window_paging_or_int4_are_refused():
    pool = latent_pool("fp8_e4m3", kv_scales=torch.tensor([[0.5, 3.0], [2.0, 0.25]]))
    assert [(pool.kv_layer(i).k_scale, pool.kv_layer(i).v_scale) for i in range(2)] == [(0.5, 0.5), (2.0, 2.0)]
    assert pool.read_page(0).scales is not None and pool.read_page(0).scales[:, 1].tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match="latent pages"):
        latent_pool("bf16", window_layers=(0,), window_slots=2)
    with pytest.raises(ValueError, match="latent pages"):
        latent_pool("int4")
