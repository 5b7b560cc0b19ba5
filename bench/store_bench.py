"""The fleet's store (`serve --kv-remote`, Mooncake Store on loopback) on the ~125M bench model, one thread per
worker: what a prefix computed on one replica saves another, what a replica started later finds, what it costs.

    python bench/store_bench.py [--reps N] [--smoke]

Phases (one master and one store service started here; workers are `radixcache serve` subprocesses):
1. cross-replica re-hit: replicas A and B join the store. A 1,024-token prefix + 8 tokens is asked on A (cold: its
   TTFT is the prefill), then, once A's write-through has landed, the same prefix + 8 other tokens on B (its TTFT is
   the store load + the tail). cross_replica_rehit_speedup = cold / re-hit, the median over `reps` prefixes.
2. scale-up: replica C joins after all that; each known prefix asked once on C. scaleup_cached_share = the cached
   tokens it reports over the whole pages of those prefixes.
3. unique prompts (nothing re-hits): 512-token prompts alternated between a store replica and one without the store.
   unique_overhead = median request time with the store / without.
Greedy tokens of the re-hits and the scale-up equal those of a worker without the store (`wrong_answers` counts
those that differ). Not measured here (named in issue 37, left for the next round): the eviction trace's hit rate,
failover and the fault figures (the fault behaviour is tested in tests/test_remote_tier.py).
The last line printed is one JSON object (also written to bench/results/store_bench.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, SMOKE_HELP, Worker, bench_checkpoint, random_tokens, smoke_out, write_json  # noqa: E402
from mooncake_local import LocalMooncake  # noqa: E402

PAGE = 16
POOL = ("--page-size", str(PAGE), "--kv-pages", "160", "--max-step-tokens", "512")  # 2,560 tokens
WRITE_LAND_S = 2.0  # A's write-through of 64 pages lands in milliseconds on loopback; this is ample


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def ask(c, prompt: list[int], max_tokens: int = 4) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached_tokens, tokens) of one greedy request."""
    start = time.perf_counter()
    first, cached, tokens = None, 0, []
    for chunk in c.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        cached = chunk.cached_tokens
        tokens += chunk.token_ids
    return first if first is not None else time.perf_counter() - start, cached, tokens


def main() -> int:
    from radixcache.client import Client

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="prefixes re-hit across replicas (default 3)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    ckpt = bench_checkpoint(args.smoke)
    rng = random.Random(37)
    load_before = uptime()
    with LocalMooncake() as store:
        joined = (*POOL, *store.worker_args())
        with (
            Worker(ckpt, *joined, threads=1, name="A") as a,
            Worker(ckpt, *joined, threads=1, name="B") as b,
            Worker(ckpt, *POOL, threads=1, name="ref") as ref,
            Client(a.target) as ca,
            Client(b.target) as cb,
            Client(ref.target) as cref,
        ):
            for c in (ca, cb, cref):
                ask(c, random_tokens(rng, 64))  # a process's first request pays for lazy set-up: not measured
            prefixes, cold, warm, cached, wrong = [], [], [], [], 0
            for _ in range(args.reps):
                prefix = random_tokens(rng, 1024)
                tail = random_tokens(rng, 8)
                t, _, _ = ask(ca, prefix + random_tokens(rng, 8))
                cold.append(t)
                time.sleep(WRITE_LAND_S)
                t, got, tokens = ask(cb, prefix + tail)
                warm.append(t)
                cached.append(got)
                wrong += tokens != ask(cref, prefix + tail)[2]
                prefixes.append(prefix)
            unique_on, unique_off = [], []
            for i in range(2 if args.smoke else 8):
                for c, times in ((ca, unique_on), (cref, unique_off))[:: 1 if i % 2 else -1]:
                    start = time.perf_counter()
                    ask(c, random_tokens(rng, 512))
                    times.append(time.perf_counter() - start)
        with Worker(ckpt, *joined, threads=1, name="C") as late, Client(late.target) as cc:
            shares = []
            for prefix in prefixes:
                _, got, _ = ask(cc, prefix + random_tokens(rng, 8))
                shares.append(min(got, len(prefix)) / (len(prefix) // PAGE * PAGE))
    summary = {
        "cross_replica_rehit_speedup": round(statistics.median(x / y for x, y in zip(cold, warm, strict=True)), 1),
        "scaleup_cached_share": round(statistics.mean(shares), 3),
        "unique_overhead": round(statistics.median(unique_on) / statistics.median(unique_off), 3),
        "wrong_answers": wrong,
        "cold_ttft_s": [round(x, 3) for x in cold],
        "rehit_ttft_s": [round(x, 3) for x in warm],
        "rehit_cached_tokens": cached,
        "unique_s": {"store": [round(x, 3) for x in unique_on], "no_store": [round(x, 3) for x in unique_off]},
        "smoke": args.smoke,
        "load_before": load_before,
        "load_after": uptime(),
    }
    write_json(smoke_out(RESULTS / "store_bench.json", args.smoke), summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
