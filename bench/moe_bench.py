"""What latent (MLA) pages and mixture-of-experts layers buy and cost, measured side by side in one run:

    .venv/bin/python bench/moe_bench.py [--smoke]

1. KV bytes per token (bf16) of a DeepSeek-V2-Lite-shaped and a DeepSeek-V3-shaped config: latent pages (the pool
   the worker builds, checked against `radixcache memory`'s formula) against their heads' K/V expanded (what
   transformers caches) and against a GQA model of similar size (Qwen3-30B-A3B for V2-Lite, Qwen3-235B-A22B for V3);
2. decode step at batch 8 x 4,096-token contexts, a small MLA model (random weights, 4 layers, 16 heads,
   kv_lora_rank 512, rope 64, dense MLPs), one thread: the model's own step (absorbed projections over latent pages)
   against the same model whose attention is transformers' expanded form: per-head K/V materialised from the same
   latents for the cached tokens (held as transformers' cache holds them), the new token's K/V up-projected, SDPA.
   The two steps' logits are checked to agree (1e-3) so the baseline computes the same thing;
3. decode step of a small Qwen3-MoE-shaped model (32 experts, top 4, moe_intermediate 256) at batch 1 and 8 over
   256-token contexts against a dense Qwen3 of the same active parameters (intermediate 4 x 256).
Timings are per-thread CPU time, A and B interleaved (ABAB), the median of --repeats pairs, as ratios.

Prints a table; the LAST line is one JSON object (see BENCHMARKS.md, "MoE and MLA"). --smoke (tests/test_bench_smoke.py)
runs every part at a few tokens, one repetition (the same keys; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import MIN_TOKEN_ID  # noqa: E402

from radixcache.pool import KVPool, KVShape, kv_bytes_per_token  # noqa: E402
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend  # noqa: E402
from radixcache.worker.model.config import ModelConfig  # noqa: E402
from radixcache.worker.model.llama import attention_options  # noqa: E402
from radixcache.worker.model.loader import random_model  # noqa: E402
from radixcache.worker.model.mla import LatentAttention, mla_rotate  # noqa: E402

clock = time.thread_time  # CPU time of this thread: robust to the other sessions' time slices
VOCAB = 1024


def hf(arch: str, **fields: object) -> dict:
    import transformers

    cls = {
        "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
        "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    return {**cls(**fields).to_dict(), "architectures": [arch]}


# --- 1. bytes ---------------------------------------------------------------------------------------------------
V2_LITE = dict(num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
               num_experts_per_tok=6)  # fmt: skip
V3 = dict(num_hidden_layers=61, num_attention_heads=128)  # transformers' DeepseekV3Config defaults otherwise
GQA = {"v2_lite": ("Qwen3-30B-A3B", 48, 4, 128), "v3": ("Qwen3-235B-A22B", 94, 4, 128)}


def sizes() -> dict[str, dict[str, float]]:
    out = {}
    for name, (arch, fields) in {
        "v2_lite": ("DeepseekV2ForCausalLM", V2_LITE),
        "v3": ("DeepseekV3ForCausalLM", V3),
    }.items():
        mc = ModelConfig.from_hf_config(hf(arch, **fields))
        kv_heads, half = mc.kv_cache_dims
        shape = KVShape(mc.num_layers, kv_heads, half)
        pool = KVPool(shape, page_size=16, num_pages=1, dtype=torch.bfloat16, latent=True)
        latent = pool.bytes_per_token
        assert latent == mc.num_layers * (mc.kv_lora_rank + mc.qk_rope_head_dim) * 2, "pool and calculator differ"
        qk = mc.qk_nope_head_dim + mc.qk_rope_head_dim
        expanded = mc.num_layers * mc.num_heads * (qk + mc.v_head_dim) * 2  # per-head K and V, bf16
        gqa_name, layers, heads, dim = GQA[name]
        gqa = kv_bytes_per_token(layers, heads, dim, "bf16")
        out[name] = {"latent": latent, "expanded": expanded, "gqa": gqa, "gqa_model": gqa_name,
                     "vs_expanded": latent / expanded, "vs_gqa": latent / gqa}  # fmt: skip
    return out


# --- 2. absorbed vs expanded decode -----------------------------------------------------------------------------
class ExpandedAttention(torch.nn.Module):
    """transformers' MLA decode over an expanded cache: k_h = [W_UK_h c | k_pe], v_h = W_UV_h c held per head for
    the cached tokens ([B, H, ctx, .]); the new token's are up-projected and appended (a new tensor, as
    DynamicCache's cat does), then SDPA. Same weights and RoPE as `inner` (the model's LatentAttention)."""

    def __init__(self, inner: LatentAttention, keys: torch.Tensor, values: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.inner, self.keys, self.values, self.scale = inner, keys, values, scale

    def forward(self, x, cos, sin, layout, kv_layer, backend):  # noqa: ANN001, ANN201 (the decoder layer's call)
        a = self.inner
        t = x.shape[0]
        q = a.q_b_proj.forward(a.q_a_layernorm.forward(a.q_a_proj.forward(x))) if a.q_lora else a.q_proj.forward(x)
        q_nope, q_pe = q.view(t, a.heads, a.nope + a.rope).split([a.nope, a.rope], dim=-1)
        compressed = a.kv_a_proj_with_mqa.forward(x)
        c = a.kv_a_layernorm.forward(compressed[:, : a.rank].contiguous())
        rotated = mla_rotate(torch.cat((q_pe, compressed[:, None, a.rank :]), dim=1), cos, sin, a.rope_layout)
        q_pe, k_pe = rotated.split([a.heads, 1], dim=1)
        kv = torch.nn.functional.linear(c, a.kv_b_proj.weight).view(t, a.heads, a.nope + a.v_dim)
        k = torch.cat((kv[..., : a.nope], k_pe.expand(t, a.heads, a.rope)), dim=-1)
        keys = torch.cat((self.keys, k[:, :, None]), dim=2)  # [B, H, ctx, qk]
        values = torch.cat((self.values, kv[:, :, None, a.nope :]), dim=2)
        query = torch.cat((q_nope, q_pe), dim=-1)[:, :, None]  # [B, H, 1, qk]
        o = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=self.scale)
        return a.o_proj.forward(o.reshape(t, a.heads * a.v_dim))


MLA_SMALL = dict(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                 num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=4, max_position_embeddings=8192,
                 n_routed_experts=4, num_experts_per_tok=2)  # fmt: skip


def interleaved(a, b, repeats: int) -> tuple[float, float]:  # noqa: ANN001 (two callables)
    """Median CPU ms of a() and b(), run a, b, a, b, ... after one warm call each."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            start = clock()
            fn()
            times.append(clock() - start)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def decode_absorbed_vs_expanded(batch: int, context: int, repeats: int) -> dict[str, float]:
    loaded = random_model(ModelConfig.from_hf_config(hf("DeepseekV2ForCausalLM", **MLA_SMALL)), seed=0)
    mc, model = loaded.config, loaded.model
    ps = 16
    per_seq = -(-context // ps)
    kv_heads, half = mc.kv_cache_dims
    pool = KVPool(KVShape(mc.num_layers, kv_heads, half), page_size=ps, num_pages=batch * per_seq, latent=True)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(pool.num_pages * 2 * ps).view(pool.num_pages, 2, ps)[:, 0].flatten()
    rows = torch.cat((slots, slots + ps))
    cached = context - 1
    layers = model.model.layers
    expanded = []
    for i in range(mc.num_layers):  # the latents every cached slot holds, and the same expanded per head
        latent = torch.randn(slots.numel(), 1, 2 * half, generator=g)
        pool.kv_layer(i).write_rows(rows, latent[..., :half], latent[..., half:])
        attn = layers[i].self_attn
        lat = latent.view(batch, per_seq * ps, 2 * half)[:, :cached]
        c, k_pe = lat[..., : attn.rank], lat[..., attn.rank :]
        kv = torch.nn.functional.linear(c, attn.kv_b_proj.weight).view(batch, cached, attn.heads, -1)
        k = torch.cat((kv[..., : attn.nope], k_pe[:, :, None].expand(-1, -1, attn.heads, -1)), dim=-1)
        expanded.append((k.transpose(1, 2).contiguous(), kv[..., attn.nope :].transpose(1, 2).contiguous()))
    slices = [SequenceSlice(list(range(b * per_seq, (b + 1) * per_seq)), cached, 1) for b in range(batch)]
    layout = BatchLayout.build(slices, ps)
    ids = torch.randint(MIN_TOKEN_ID, VOCAB, (batch,), generator=g)
    backend = create_backend("torch", attention=attention_options(mc))
    absorbed_attn = [layer.self_attn for layer in layers]
    expanded_attn = [
        ExpandedAttention(a, k, v, mc.attention_scale) for a, (k, v) in zip(absorbed_attn, expanded, strict=True)
    ]

    def step(attns: list[torch.nn.Module]) -> torch.Tensor:
        for layer, attn in zip(layers, attns, strict=True):
            layer.self_attn = attn
        return model(ids, layout, pool, backend)

    with torch.inference_mode():
        agree = (step(absorbed_attn) - step(expanded_attn)).abs().max().item()
        assert agree < 1e-3, f"the expanded baseline computes something else: logits differ by {agree}"
        absorbed_ms, expanded_ms = interleaved(lambda: step(absorbed_attn), lambda: step(expanded_attn), repeats)
    step(absorbed_attn)
    return {"absorbed_ms": absorbed_ms, "expanded_ms": expanded_ms, "max_logit_diff": agree,
            "absorbed_vs_expanded": absorbed_ms / expanded_ms}  # fmt: skip


# --- 3. MoE vs dense of the same active parameters -------------------------------------------------------------
QWEN_COMMON = dict(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)  # fmt: skip
MOE = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
           intermediate_size=1024, mlp_only_layers=[])  # fmt: skip


def moe_vs_dense(batches: tuple[int, ...], context: int, repeats: int) -> dict[str, dict[str, float]]:
    moe = random_model(ModelConfig.from_hf_config(hf("Qwen3MoeForCausalLM", **QWEN_COMMON, **MOE)), seed=0)
    dense_config = ModelConfig.from_hf_config(hf("Qwen3ForCausalLM", **QWEN_COMMON, intermediate_size=4 * 256))
    dense = random_model(dense_config, seed=0)
    ps = 16
    per_seq = -(-context // ps)
    backends = [create_backend("torch", attention=attention_options(m.config)) for m in (moe, dense)]
    out = {}
    for batch in batches:
        pools = [KVPool(KVShape(m.config.num_layers, *m.config.kv_cache_dims), page_size=ps, num_pages=batch * per_seq)
                 for m in (moe, dense)]  # fmt: skip
        slices = [SequenceSlice(list(range(b * per_seq, (b + 1) * per_seq)), context - 1, 1) for b in range(batch)]
        layout = BatchLayout.build(slices, ps)
        ids = torch.randint(MIN_TOKEN_ID, VOCAB, (batch,), generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            moe_ms, dense_ms = interleaved(
                lambda ids=ids, layout=layout, pools=pools: moe.model(ids, layout, pools[0], backends[0]),
                lambda ids=ids, layout=layout, pools=pools: dense.model(ids, layout, pools[1], backends[1]),
                repeats,
            )  # fmt: skip
        out[f"b{batch}"] = {"moe_ms": moe_ms, "dense_ms": dense_ms, "moe_vs_dense": moe_ms / dense_ms}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few tokens, one repetition: checks the script only")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 1 if args.smoke else args.repeats
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    bytes_ = sizes()
    decode = decode_absorbed_vs_expanded(2 if args.smoke else 8, 64 if args.smoke else 4096, repeats)
    moe = moe_vs_dense((1, 8), 32 if args.smoke else 256, repeats)
    print(f"load: {load}; torch threads 1")
    print(f"{'KV bytes per token (bf16)':<34}{'latent':>10}{'expanded':>12}{'GQA':>10}  vs expanded  vs GQA")
    for name, s in bytes_.items():
        print(f"{name + ' (GQA: ' + s['gqa_model'] + ')':<34}{s['latent']:>10}{s['expanded']:>12}{s['gqa']:>10}"
              f"  {s['vs_expanded']:>10.4f}  {s['vs_gqa']:>6.3f}")  # fmt: skip
    print(f"decode b{2 if args.smoke else 8}: absorbed {decode['absorbed_ms']:.1f} ms, expanded {decode['expanded_ms']:.1f} ms"
          f" ({decode['absorbed_vs_expanded']:.3f}x; logits agree to {decode['max_logit_diff']:.1e})")  # fmt: skip
    for b, m in moe.items():
        print(
            f"MoE step {b}: {m['moe_ms']:.2f} ms vs dense same active {m['dense_ms']:.2f} ms ({m['moe_vs_dense']:.3f}x)"
        )
    result = {
        "mla_bytes_per_token_vs_expanded": {n: s["vs_expanded"] for n, s in bytes_.items()},
        "mla_bytes_per_token_vs_gqa": {n: s["vs_gqa"] for n, s in bytes_.items()},
        "mla_decode_absorbed_vs_expanded": decode["absorbed_vs_expanded"],
        "moe_step_vs_dense_active": {b: m["moe_vs_dense"] for b, m in moe.items()},
        "bytes": bytes_, "decode": decode, "moe": moe, "smoke": args.smoke,
    }  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
