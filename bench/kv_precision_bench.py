"""What 8- and 4-bit KV pages buy and cost, measured side by side in one run:

    .venv/bin/python bench/kv_precision_bench.py [--quick] [--smoke]

1. bytes per token (scales included) of every --kv-dtype for the ~125M bench model, and pages in a 512 MiB pool;
2. quality on the embedded default model's held-out text (tests/test_default_model.py's windows): bits per byte
   against full-precision pages, and the mean KL divergence of the next-token distribution, over every position;
3. decode step time at batch 8 with 4,096-token contexts, the ~125M model (random weights), one thread: one
   forward of 8 decode rows over a filled pool (the model's own step: weights, attention gathers, sampling not
   included), the fastest of --repeats, per KV dtype, next to full precision (the model's fp32);
4. --kv-demote: a workload of shared prefixes needing ~3x the pool (24 prefixes of 512 tokens, uniform random
   reuse, each request prefix + 16 own tokens, 4 generated), in-process engine over the same memory with plain LRU
   at full precision, at int8, and with --kv-demote int4: hit rate (cached / prompt tokens after a warm-up pass
   over every prefix), TTFT p50 / p90, pages demoted and promoted.

Prints a table; the LAST line is one JSON object (see BENCHMARKS.md, "KV precision"). Not in `make test`; its
--smoke is (tests/test_bench_smoke.py): one held-out window, the two-layer smoke model for 3. and 4. at a few
tokens, one repetition (the same keys; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from common import LLAMA_125M, LLAMA_SMOKE, MIN_TOKEN_ID, SMOKE_HELP, VOCAB, percentile  # noqa: E402

from radixcache.kv_dtypes import KV_DTYPES, QUANTIZED_KV_DTYPES  # noqa: E402
from radixcache.pool import KVPool, KVShape, kv_bytes_per_token  # noqa: E402
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend  # noqa: E402
from radixcache.worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixcache.worker.engine.engine import Engine, EngineConfig  # noqa: E402
from radixcache.worker.engine.request import Request, SamplingParams  # noqa: E402
from radixcache.worker.model.config import ModelConfig  # noqa: E402
from radixcache.worker.model.loader import random_model  # noqa: E402

CONFIG_125M = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **LLAMA_125M})
CONFIG_SMOKE = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **LLAMA_SMOKE})
clock = time.thread_time  # CPU time of this thread: robust to the other sessions' time slices


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# --- 1. bytes ---------------------------------------------------------------------------------------------------
def sizes() -> dict[str, dict[str, float]]:
    c = CONFIG_125M
    per = {n: kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, n) for n in KV_DTYPES}
    pages = {n: KVPool.bytes_per_page(KVShape(c.num_layers, c.num_kv_heads, c.head_dim), 16, n) for n in KV_DTYPES}
    return {
        "bytes_per_token": per,
        "bytes_per_token_vs_fp16": {n: per[n] / per["fp16"] for n in KV_DTYPES},
        "pages_in_512mib": {n: (512 << 20) // pages[n] for n in KV_DTYPES},
    }


# --- 2. quality -------------------------------------------------------------------------------------------------
def quality(windows: int, smoke: bool = False) -> dict[str, dict[str, float]]:
    """Bits per byte and KL against fp32 pages on the held-out documents (--smoke: on README.md's text, which needs
    no pass over the standard library to build)."""
    import importlib.util

    import test_default_model as tdm
    from tokenizers import Tokenizer

    from radixcache.worker.model.loader import load_checkpoint

    spec = importlib.util.spec_from_file_location("train_default_model", tdm.SCRIPT)
    script = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(script)  # type: ignore[union-attr]
    tok = Tokenizer.from_file(str(tdm.MODEL_DIR / "tokenizer.json"))
    if smoke:
        val = [("README.md", (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8"))]
    else:
        _, val = script.split_documents(script.build_documents())
    ids = script.validation_token_stream(tok, val)[: windows * tdm.SEQ_LEN]
    byte_lengths = script.token_byte_lengths(tok)
    chunks = tdm._windows(ids)
    loaded = load_checkpoint(tdm.MODEL_DIR, dtype="float32")
    from test_kv_quality import heldout_logits

    out: dict[str, dict[str, float]] = {"bpb": {}, "bpb_delta": {}, "kl": {}}
    full_logp = None
    for name in ("fp32", *QUANTIZED_KV_DTYPES):
        logits = heldout_logits(loaded, chunks, name)
        bpb = tdm._loss_from_logits(list(zip(chunks, logits.split(tdm.SEQ_LEN), strict=True)), byte_lengths)
        logp = torch.cat([w[:-1] for w in logits.split(tdm.SEQ_LEN)]).log_softmax(-1)
        out["bpb"][name] = bpb["bits_per_byte"]
        if full_logp is None:
            full_logp = logp
            continue
        out["bpb_delta"][name] = bpb["bits_per_byte"] / out["bpb"]["fp32"] - 1
        out["kl"][name] = float((full_logp.exp() * (full_logp - logp)).sum(-1).mean())
    out["positions"] = {"count": float(full_logp.shape[0])}  # type: ignore[union-attr]
    return out


# --- 3. decode step ---------------------------------------------------------------------------------------------
class TiledTorchBackend(TorchAttentionBackend):
    """The torch backend with its tiled decode path for full-precision pages too (not what the engine runs): to tell
    what the tiling buys from what reading fewer bytes buys."""

    tile_full_precision = True


def decode_ms(
    model: torch.nn.Module,
    kv_dtype: str,
    batch: int,
    context: int,
    repeats: int,
    *,
    tiled: bool = False,
    c: ModelConfig = CONFIG_125M,
) -> float:
    ps = 16
    per_seq = context // ps
    pool = KVPool(KVShape(c.num_layers, c.num_kv_heads, c.head_dim), page_size=ps, num_pages=batch * per_seq,
                  dtype=kv_dtype)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    k_rows = torch.arange(pool.num_pages * 2 * ps).view(pool.num_pages, 2, ps)[:, 0].flatten()
    rows = torch.cat((k_rows, k_rows + ps))
    for layer in range(c.num_layers):  # every slot written through the codec, as a real prefill would
        k, v = torch.randn(2, k_rows.numel(), c.num_kv_heads, c.head_dim, generator=g)
        pool.kv_layer(layer).write_rows(rows, k, v)
    slices = [SequenceSlice(list(range(b * per_seq, (b + 1) * per_seq)), context - 1, 1) for b in range(batch)]
    layout = BatchLayout.build(slices, ps)
    ids = torch.randint(MIN_TOKEN_ID, VOCAB, (batch,), generator=g)
    backend = TiledTorchBackend() if tiled else create_backend("torch")
    best = float("inf")
    with torch.inference_mode():
        model(ids, layout, pool, backend)  # warm
        for _ in range(repeats):
            start = clock()
            model(ids, layout, pool, backend)
            best = min(best, clock() - start)
    return best * 1e3


# --- 4. demotion workload ---------------------------------------------------------------------------------------
def workload(prefixes: int, prefix_len: int, requests: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    shared = [[rng.randrange(MIN_TOKEN_ID, VOCAB) for _ in range(prefix_len)] for _ in range(prefixes)]

    def request(p: int) -> list[int]:
        return shared[p] + [rng.randrange(MIN_TOKEN_ID, VOCAB) for _ in range(16)]

    warm = [request(p) for p in range(prefixes)]
    return warm, [request(rng.randrange(prefixes)) for _ in range(requests)]


def serve(loaded, config: EngineConfig, warm: list[list[int]], measured: list[list[int]]) -> dict[str, float]:  # noqa: ANN001
    engine = Engine(loaded, config)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ttft: list[float] = []

    def on_output(out) -> None:  # noqa: ANN001
        if out.time_to_first_token is not None:
            ttft.append(out.time_to_first_token)

    with torch.inference_mode():
        for i, prompt in enumerate(warm):
            engine.submit(Request(f"w{i}", prompt, params), lambda out: None)
            engine.run_until_idle()
        before = engine.stats()
        start = time.monotonic()
        for i, prompt in enumerate(measured):  # one at a time: TTFT is the prefill (and promotion) of a request
            engine.submit(Request(f"m{i}", prompt, params), on_output)
            engine.run_until_idle()
        wall = time.monotonic() - start
    after = engine.stats()
    engine.cache.check(idle=True)
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    return {
        "hit_rate": cached / prompt,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p90_ms": 1e3 * percentile(ttft, 90),
        "wall_s": wall,
        "main_pages": engine.pool.num_pages,
        "demoted_pages_capacity": engine.pool.demoted_pages,
        "pages_demoted": after.cache.demoted_pages - before.cache.demoted_pages,
        "pages_promoted": after.cache.promoted_pages - before.cache.promoted_pages,
        "pages_evicted": after.cache.evicted_pages - before.cache.evicted_pages,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: checks the script, not the figures")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    model_config = CONFIG_SMOKE if args.smoke else CONFIG_125M  # sections 3 and 4
    torch.set_num_threads(1)
    result: dict = {"load_before": load(), "smoke": args.smoke}
    print(result["load_before"], flush=True)

    result.update(sizes())
    print("bytes per token (125M model), x fp16, pages of 16 in 512 MiB:")
    for n in KV_DTYPES:
        print(f"  {n:<9} {result['bytes_per_token'][n]:>6} B  {result['bytes_per_token_vs_fp16'][n]:.3f}x  "
              f"{result['pages_in_512mib'][n]:>6} pages")  # fmt: skip

    q = quality(1 if args.smoke else 2 if args.quick else 8, smoke=args.smoke)
    result.update(q)
    print(f"held-out quality, embedded model, {int(q['positions']['count'])} positions:")
    for n in QUANTIZED_KV_DTYPES:
        print(f"  {n:<9} bits/byte {q['bpb'][n]:.4f} vs fp32 {q['bpb']['fp32']:.4f} ({q['bpb_delta'][n]:+.3%}), "
              f"mean KL {q['kl'][n]:.5f} nats")  # fmt: skip

    model = random_model(model_config, seed=0).model
    batch, context = (2, 64) if args.smoke else (2, 512) if args.quick else (8, 4096)
    dtypes = ("fp32", "int8", "int4", "fp8_e4m3", "bf16")
    ms = {n: decode_ms(model, n, batch, context, args.repeats, c=model_config) for n in dtypes}
    ms["fp32_tiled"] = decode_ms(model, "fp32", batch, context, args.repeats, tiled=True, c=model_config)
    result["decode_ms"] = ms
    result["decode_b8_4k_vs_full"] = {n: ms[n] / ms["fp32"] for n in ("int8", "int4", "fp8_e4m3", "bf16", "fp32_tiled")}
    print(f"decode step, b{batch} x {context}, one thread (CPU ms, best of {args.repeats}):")
    for n, v in ms.items():
        print(f"  {n:<9} {v:8.1f} ms  {v / ms['fp32']:.2f}x of fp32")

    prefixes, prefix_len, requests = (6, 64, 6) if args.smoke else (6, 64, 12) if args.quick else (24, 512, 120)
    warm, measured = workload(prefixes, prefix_len, requests)
    loaded = random_model(model_config, seed=0)
    # The pool holds a third of the prefixes at full precision (fp32): 1/3 x 24 x (512 + 16 + 4) tokens.
    budget = (prefixes * (prefix_len + 32) // 3) * kv_bytes_per_token(
        model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, "fp32"
    )
    base = {"page_size": 16, "kv_memory_bytes": budget, "max_step_tokens": 1024}
    runs = {
        "lru_fp32": EngineConfig(**base),
        "lru_int8": EngineConfig(**base, kv_dtype="int8"),
        "demote_int4": EngineConfig(**base, kv_demote="int4"),
        "int8_demote_int4": EngineConfig(**base, kv_dtype="int8", kv_demote="int4"),
    }
    result["workload"] = {"prefixes": prefixes, "prefix_tokens": prefix_len, "requests": requests,
                          "kv_memory_bytes": budget}  # fmt: skip
    print(f"demotion workload: {prefixes} prefixes x {prefix_len} tokens (~3x the pool), {requests} requests:")
    for name, config in runs.items():
        r = serve(loaded, config, warm, measured)
        result["workload"][name] = r
        print(f"  {name:<17} hit {r['hit_rate']:.1%}  TTFT p50 {r['ttft_p50_ms']:7.0f} ms  p90 "
              f"{r['ttft_p90_ms']:7.0f} ms  pages {r['main_pages']}+{r['demoted_pages_capacity']}  demoted "
              f"{r['pages_demoted']} promoted {r['pages_promoted']} evicted {r['pages_evicted']}", flush=True)  # fmt: skip
    w = result["workload"]
    result["demote_hit_rate_vs_lru"] = w["demote_int4"]["hit_rate"] / w["lru_fp32"]["hit_rate"]
    result["load_after"] = load()
    print(result["load_after"])
    compact = {k: v for k, v in result.items() if k != "bpb"}
    print(json.dumps(compact, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
