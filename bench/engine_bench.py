"""In-process engine figures for a ~125M Llama (fp32): decode throughput at several concurrencies, and the time to
first token of a 1,024-token prompt cold vs. with its first 1,000 tokens cached.

    python bench/engine_bench.py [--quick] [--smoke]

Plain decode: speculation is off (EngineConfig(speculate=0); the JSON says "speculate": 0), so the decode rows are
one token per sequence per step, not what drafts the random weights' repetitions make acceptable add.
Prints a table; the LAST line is one JSON object. Measured side by side in one run (the machine is shared).
--smoke: the two-layer smoke model, 4 tokens, a 256-token prompt (figures that mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import LLAMA_125M, LLAMA_SMOKE, SMOKE_HELP  # noqa: E402

from radixcache.worker.engine.engine import Engine, EngineConfig  # noqa: E402
from radixcache.worker.engine.request import Request, SamplingParams  # noqa: E402
from radixcache.worker.model.config import ModelConfig  # noqa: E402
from radixcache.worker.model.loader import random_model  # noqa: E402

CONFIG_125M = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **LLAMA_125M})
CONFIG_SMOKE = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **LLAMA_SMOKE})


def run(engine: Engine, requests: list[Request]) -> dict[str, float]:
    """Submit all; step until every request has its first token (prefill), then time the decode steps to the end.

    Returns mean TTFT (seconds), decode wall time and the number of tokens generated while decoding.
    """
    ttft: dict[str, float] = {}

    def on_output(out) -> None:
        if out.time_to_first_token is not None:
            ttft[out.request_id] = out.time_to_first_token

    for r in requests:
        engine.submit(r, on_output)
    while len(ttft) < len(requests):
        engine.step()
    start = time.perf_counter()
    engine.run_until_idle()
    wall = time.perf_counter() - start
    decoded = sum(r.sampling.max_tokens - 1 for r in requests)
    return {"wall": wall, "tokens": decoded, "ttft": sum(ttft.values()) / len(ttft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens per measurement")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    loaded = random_model(CONFIG_SMOKE if args.smoke else CONFIG_125M, seed=0)
    config = EngineConfig(page_size=16, kv_pages=4096, max_step_tokens=1024, max_running=64, speculate=0)
    engine = Engine(loaded, config)
    decode_tokens = 4 if args.smoke else 16 if args.quick else 48
    long_tokens, cached_tokens = (256, 240) if args.smoke else (1024, 1000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(n)]

    rows = []
    throughput = {}
    for batch in (1, 4, 16):
        reqs = [
            Request(f"d{batch}-{i}", prompt(128), SamplingParams(max_tokens=decode_tokens, ignore_eos=True))
            for i in range(batch)
        ]
        result = run(engine, reqs)
        tps = result["tokens"] / result["wall"]
        throughput[batch] = tps
        step_ms = 1000 * result["wall"] / (decode_tokens - 1)
        rows.append((f"decode, {batch} concurrent", f"{tps:8.1f} tok/s", f"{step_ms:8.1f} ms/step"))

    long_prompt = prompt(long_tokens)
    cold = run(engine, [Request("cold", long_prompt, SamplingParams(max_tokens=1, ignore_eos=True))])["ttft"]
    engine.flush_cache()
    seed = Request("seed", long_prompt[:cached_tokens], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.submit(seed, lambda o: None)
    engine.run_until_idle()
    warm = run(engine, [Request("warm", long_prompt, SamplingParams(max_tokens=1, ignore_eos=True))])["ttft"]
    rows.append((f"TTFT {long_tokens} cold", f"{1000 * cold:8.1f} ms", ""))
    rows.append(
        (f"TTFT {long_tokens}, {cached_tokens} cached", f"{1000 * warm:8.1f} ms", f"{cold / warm:6.1f}x faster")
    )
    engine.cache.check()
    for row in rows:
        print(f"{row[0]:<26}{row[1]:>16}  {row[2]}")
    print(
        f"decode rows: 128-token prompts, timed after every prefill finished; plain decode (speculate={config.speculate})"
    )
    print(
        json.dumps(
            {
                "speculate": config.speculate,
                "smoke": args.smoke,
                "decode_tps_b1": round(throughput[1], 2),
                "decode_tps_b4": round(throughput[4], 2),
                "decode_tps_b16": round(throughput[16], 2),
                "ttft_cold_ms": round(1000 * cold, 2),
                "ttft_cached_ms": round(1000 * warm, 2),
                "ttft_speedup": round(cold / warm, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
