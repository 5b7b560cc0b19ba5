"""What window paging buys a sliding-window model, measured side by side in one run:

    .venv/bin/python bench/window_bench.py [--tokens 16384] [--quick] [--smoke]

A tiny Gemma-3-shaped decoder (random weights, fp32): 6 layers, 5 sliding (window 512, as the smallest Gemma 3) to
1 global, 1 KV head of 64, the Gemma switches on. In-process engines, one thread, torch backend:

1. bytes: one sequence of --tokens prompt tokens plus 32 generated; the KV bytes its lease holds at its end (pages
   for the global layer, window slots for the sliding ones) with window paging vs every layer kept in the page
   (`--kv-window-paging off`). `window_bytes_ratio` = on / off (target <= 0.3 at 16k).
2. decode: ms per decode step of that sequence at its full context (the median of the generated tokens' steps,
   the three engines stepped in turn), window paging on vs off vs the same model with every layer global (what a
   cache that treats every layer as global reads). `decode_16k_vs_global` = on / all global; `decode_16k_vs_off` = on / off.
3. hits: a shared-prefix workload whose prefixes are longer than the window (4 prefixes of 3x the window, each sent
   6 times with its own 32-token question, in 6 rounds of the 4 prefixes in turn, one request at a time), over one
   memory budget (what an all-global pool needs for 3 such requests: LRU without window paging evicts each prefix
   just before its turn): hit rate (cached / prompt tokens) with window paging on and off, and the idle window
   parts given back to make room.

Plain decode: speculation is off in every engine (EngineConfig(speculate=0); the JSON says "speculate": 0), so each
step emits one token of the sequence: with it on, the random weights' repetitions are drafted and accepted, the
sequence ends before its steps are timed, and a step's time is no longer one token's.

Prints a table; the LAST line is one JSON object (BENCHMARKS.md, "Sliding windows"). --smoke (tests/
test_bench_smoke.py): a 64-token window, 256 tokens, 2 rounds of the hits workload.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch
from common import SMOKE_HELP  # noqa: E402

from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams
from radixcache.worker.model.config import ModelConfig
from radixcache.worker.model.loader import random_model

WINDOW = 512
PAGE = 16
GEMMA3_SHAPED = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4, num_kv_heads=1, head_dim=64,
    architecture="Gemma3ForCausalLM", max_position_embeddings=32768, sliding_window=WINDOW,
    layer_kinds=("sliding",) * 5 + ("global",), hidden_act="gelu_pytorch_tanh", qk_norm=True, norm_plus_one=True,
    sandwich_norms=True, embedding_scale=16.0, query_pre_attn_scalar=64.0, rope_theta=1e6, rope_local_theta=1e4,
)  # fmt: skip


def model(all_global: bool = False, window: int = WINDOW):  # noqa: ANN201
    fields = dict(GEMMA3_SHAPED, sliding_window=window)
    if all_global:
        fields |= {"layer_kinds": ("global",) * 6, "sliding_window": None}
    return random_model(ModelConfig(**fields), seed=0, std=0.05)


def lease_bytes(engine: Engine) -> int:
    """KV bytes the one live lease holds: its pages (the main arena) and the window slots its window reads."""
    (lease,) = engine.cache.leases()
    pool = engine.pool
    page = pool.main.nbytes // pool.num_pages
    held = len(set(lease.pages)) * page
    if pool.window is not None:
        slots = {s for s in engine.cache.window_slots(lease.pages[lease._wfirst :]) if s >= 0}
        held += len(slots) * (pool.window.nbytes // pool.window_slots)
    return held


def long_sequences(runs: dict[str, tuple[object, str]], tokens: int, generate: int) -> dict[str, dict]:
    """One engine per run (name -> (model, kv_window_paging)), each with the same prompt of `tokens`: prefill them
    all, then decode `generate` tokens taking a step of each in turn (so the machine's noise falls on all alike).
    Per run: KV bytes the sequence holds at its end, and the median ms per decode step."""
    pages = -(-(tokens + generate) // PAGE) + 8
    prompt = [random.Random(1).randrange(8, 1000) for _ in range(tokens)]
    engines = {}
    for name, (loaded, paging) in runs.items():
        engine = Engine(loaded, EngineConfig(page_size=PAGE, kv_pages=pages, max_running=4, kv_window_paging=paging,
                                             max_step_tokens=1024, cache_enabled=False, backend="torch",
                                             speculate=0))  # fmt: skip
        engine.submit(Request("long", prompt, SamplingParams(max_tokens=generate, ignore_eos=True)), lambda out: None)
        while not any(s.num_computed >= s.num_prompt for s in engine.scheduler.running):
            engine.step()  # the prefill
        engines[name] = engine
    steps: dict[str, list[float]] = {name: [] for name in runs}
    held: dict[str, int] = {}
    for _ in range(generate - 1):
        for name, engine in engines.items():
            held[name] = lease_bytes(engine)
            start = time.perf_counter()
            engine.step()
            steps[name].append(time.perf_counter() - start)
    return {name: {"bytes": held[name], "decode_ms": 1000 * statistics.median(steps[name][1:])} for name in runs}


def shared_prefixes(loaded, budget: int, paging: str, window: int = WINDOW, rounds: int = 6) -> dict:
    rng = random.Random(2)
    prefixes = [[rng.randrange(8, 1000) for _ in range(3 * window)] for _ in range(4)]
    prompts = [p + [rng.randrange(8, 1000) for _ in range(32)] for _ in range(rounds) for p in prefixes]
    engine = Engine(loaded, EngineConfig(page_size=PAGE, kv_memory_bytes=budget, max_running=4,
                                         kv_window_paging=paging, max_step_tokens=512, backend="torch",
                                         speculate=0))  # fmt: skip
    cached = {}
    for start in range(0, len(prompts), len(prefixes)):  # a round: each prefix once, one after another
        for i in range(start, start + len(prefixes)):
            engine.submit(Request(f"q{i}", prompts[i], SamplingParams(max_tokens=4, ignore_eos=True)),
                          lambda out: cached.__setitem__(out.request_id, out.cached_tokens))  # fmt: skip
            engine.run_until_idle()
    stats = engine.cache.stats()
    return {
        "hit_rate": sum(cached.values()) / sum(len(p) for p in prompts),
        "pages": engine.pool.num_pages,
        "dropped": stats.window_parts_dropped,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="context of the long sequence (default 16384)")
    p.add_argument("--generate", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="a 4k context: a smoke run")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    tokens = 4096 if args.quick else args.tokens
    window, rounds = WINDOW, 6
    if args.smoke:
        window, rounds, tokens, args.generate = 64, 2, 256, 6
    torch.set_num_threads(1)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# window bench: Gemma-3-shaped tiny model, window {window}, page {PAGE}, {tokens} tokens; load: {load}")
    print("# plain decode: speculation off (speculate=0) in every engine")
    gemma, flat = model(window=window), model(all_global=True)
    with torch.inference_mode():
        runs = long_sequences({"on": (gemma, "auto"), "off": (gemma, "off"), "global": (flat, "off")}, tokens,
                              args.generate)  # fmt: skip
        on, off, glob = runs["on"], runs["off"], runs["global"]
        per_request = (3 * window + 36) * 6 * 2 * 64 * 4  # tokens x layers x K/V x head_dim x fp32
        budget = 3 * per_request
        hits_on = shared_prefixes(gemma, budget, "auto", window, rounds)
        hits_off = shared_prefixes(gemma, budget, "off", window, rounds)
    print(f"{'':28} {'window paging':>14} {'paging off':>12} {'all global':>12}")
    print(f"{'KV bytes of one sequence':28} {on['bytes']:>14,} {off['bytes']:>12,} {glob['bytes']:>12,}")
    print(f"{'decode ms per step':28} {on['decode_ms']:>14.2f} {off['decode_ms']:>12.2f} {glob['decode_ms']:>12.2f}")
    print(f"{'shared prefixes: hit rate':28} {hits_on['hit_rate']:>14.3f} {hits_off['hit_rate']:>12.3f}")
    print(f"{'  pages in the same memory':28} {hits_on['pages']:>14,} {hits_off['pages']:>12,}")
    print(f"{'  idle windows given back':28} {hits_on['dropped']:>14,}")
    result = {
        "tokens": tokens,
        "window": window,
        "speculate": 0,
        "smoke": args.smoke,
        "window_bytes_ratio": round(on["bytes"] / off["bytes"], 4),
        "decode_16k_vs_global": round(on["decode_ms"] / glob["decode_ms"], 3),
        "decode_16k_vs_off": round(on["decode_ms"] / off["decode_ms"], 3),
        "decode_ms": {
            "on": round(on["decode_ms"], 2),
            "off": round(off["decode_ms"], 2),
            "all_global": round(glob["decode_ms"], 2),
        },  # fmt: skip
        "hit_rate_on": round(hits_on["hit_rate"], 4),
        "hit_rate_off": round(hits_off["hit_rate"], 4),
        "pages_same_memory": {"on": hits_on["pages"], "off": hits_off["pages"]},
        "idle_windows_dropped": hits_on["dropped"],
        "load": load,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
