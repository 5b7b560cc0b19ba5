"""Cluster routing benchmark (not a test): two replicas on Ray Serve, three routers, one run.

Workload (SGLang-style generated shared prefix plus multi-turn chats), sent through the cluster's gRPC endpoint:
4 groups of 1,024-token system prompts, each replica's pool sized to hold about two groups' prefixes, requests round
robin over the groups (each round in a shuffled order), then multi-turn conversations; then prompts that share nothing (to check the spread). Each
router gets a fresh deployment (empty caches) of the same app: ours (CacheAwareRouter, exact cache events + prompts
in flight), Ray Serve's default (power of two choices) and round robin.

Reports, per router: hit rate as a share of the theoretical maximum (bench/common.max_reusable), TTFT p50/p90,
output throughput; and the routing decision time of ours (page hashing + index lookups + policy for a 1,024-token
prompt against a populated index, in-process). Last line: one JSON object.

    python bench/cluster_bench.py [--model PATH] [--prompts-per-group 6]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Job,
    ensure_checkpoint,
    free_port,
    gsp_workload,
    max_reusable,
    multiturn_first_round,
    next_round,
    percentile,
    unique_workload,
)

ROUTERS = {
    "exact": "radixcache.cluster.router:CacheAwareRouter",
    "p2c": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "round_robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
}
PAGE = 16


def shuffled_rounds(jobs: list[Job], groups: int = 4, seed: int = 3) -> list[Job]:
    """Every group once per round, in a different order each round: with 4 groups in a fixed cycle, round robin over
    2 replicas would send each group to the same replica every time by accident."""
    rng = random.Random(seed)
    out: list[Job] = []
    for start in range(0, len(jobs), groups):
        round_ = jobs[start : start + groups]
        rng.shuffle(round_)
        out += round_
    return out


def run_jobs(target: str, jobs: list[Job], concurrency: int) -> list[dict]:
    from radixcache.client import Client

    local = threading.local()

    def one(job: Job) -> dict:
        if not hasattr(local, "client"):
            local.client = Client(target)
        start = time.perf_counter()
        ttft, tokens, cached = None, [], 0
        for chunk in local.client.generate(token_ids=job.prompt, max_tokens=job.max_tokens, ignore_eos=True):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - start
            tokens += chunk.token_ids
            cached = chunk.cached_tokens
        return {"job": job, "ttft": ttft, "tokens": tokens, "cached": cached}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, jobs))


def multiturn(target: str, clients: int, rounds: int, output: int) -> list[dict]:
    rng = random.Random(5)
    jobs = multiturn_first_round(clients, system=256, user=32, output=output)
    done: list[dict] = []
    for _ in range(rounds):
        results = run_jobs(target, jobs, concurrency=clients)
        done += results
        jobs = [next_round(r["job"], r["tokens"], 32, rng) for r in results]
    return done


def per_replica_queried(target: str) -> dict[str, float]:
    from radixcache.client import Client

    with Client(target) as c:
        return {r["replica_id"]: r["queried_tokens"] for r in c.stats()["replicas"]}


def measure_router(name: str, args: argparse.Namespace, model: Path, port: int) -> dict:
    from ray import serve

    from radixcache.cluster.app import ClusterOptions, build_app

    pages = 2 * 1024 // PAGE + 48  # two groups' prefixes + room for the running requests
    options = ClusterOptions(
        serve_argv=["--model", str(model), "--page-size", str(PAGE), "--kv-pages", str(pages)],
        replicas=2,
        router_class=ROUTERS[name],
        app_name="rc-bench",
    )
    serve.run(build_app(options), name=options.app_name)
    target = f"127.0.0.1:{port}"
    start = time.perf_counter()
    gsp = shuffled_rounds(
        gsp_workload(groups=4, prompts=args.prompts_per_group, system=1024, question=32, output=args.output)
    )
    results = run_jobs(target, gsp, concurrency=4) + multiturn(target, clients=4, rounds=3, output=args.output)
    wall = time.perf_counter() - start
    before = per_replica_queried(target)
    run_jobs(target, unique_workload(20, prompt=128, output=4), concurrency=2)
    after = per_replica_queried(target)
    serve.delete(options.app_name)

    prompts = [r["job"].prompt for r in results]
    computed = [r["job"].prompt + r["tokens"][:-1] for r in results]
    reachable = sum(max_reusable(prompts, computed))
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    spread = [after[k] - before.get(k, 0) for k in after]
    return {
        "hit_rate_of_max": sum(r["cached"] for r in results) / reachable if reachable else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p90_ms": percentile(ttfts, 90) * 1e3,
        "throughput_tok_s": sum(len(r["tokens"]) for r in results) / wall,
        "unique_max_share": max(spread) / sum(spread) if sum(spread) else float("nan"),
    }


def decision_time_ms(samples: int = 2000) -> float:
    """Our router's decision for a 1,024-token prompt: hash its pages, match against two replicas, choose."""
    from radixcache.cluster.index import PrefixIndex
    from radixcache.cluster.policy import Candidate, RoutingThresholds, choose
    from radixcache.events import page_hashes

    rng = random.Random(0)
    index = PrefixIndex()
    prompts = [[rng.randrange(16, 32000) for _ in range(1024)] for _ in range(64)]
    for i, p in enumerate(prompts):
        index.stored(f"r{i % 2}", "", page_hashes(p, PAGE))
    t = RoutingThresholds()
    times = []
    for i in range(samples):
        prompt = prompts[i % len(prompts)][:1000] + [i]
        start = time.perf_counter()
        hashes = page_hashes(prompt, PAGE)
        choose([Candidate(r, 0, index.match(r, "", hashes)) for r in ("r0", "r1")], t, rng)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: the ~125M benchmark checkpoint)")
    p.add_argument("--prompts-per-group", type=int, default=6)
    p.add_argument("--output", type=int, default=16, help="tokens generated per request")
    p.add_argument("--routers", default="exact,p2c,round_robin")
    args = p.parse_args()
    model = args.model or ensure_checkpoint()

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from radixcache.cluster.app import grpc_options

    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, namespace="radixcache", log_to_driver=False)
    serve.start(grpc_options=grpc_options(port), http_options=HTTPOptions(host="127.0.0.1", port=free_port()))
    table = {}
    try:
        for name in args.routers.split(","):
            table[name] = measure_router(name, args, model, port)
            print(name, json.dumps(table[name]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    decision = decision_time_ms()
    print("\n| router | hit rate of max | TTFT p50 ms | TTFT p90 ms | output tok/s | unique: max share |")
    print("|---|---|---|---|---|---|")
    for name, r in table.items():
        print(
            f"| {name} | {r['hit_rate_of_max']:.3f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} "
            f"| {r['throughput_tok_s']:.1f} | {r['unique_max_share']:.2f} |"
        )
    print(f"\nrouting decision (ours, 1,024-token prompt): p50 {decision:.3f} ms")
    summary = {
        "hit_rate_of_max": {k: round(v["hit_rate_of_max"], 4) for k, v in table.items()},
        "ttft_p50_ms": {k: round(v["ttft_p50_ms"], 1) for k, v in table.items()},
        "ttft_p50_speedup_vs_p2c": round(table["p2c"]["ttft_p50_ms"] / table["exact"]["ttft_p50_ms"], 2)
        if {"p2c", "exact"} <= table.keys()
        else None,
        "decision_ms_p50": round(decision, 4),
        "unique_max_share": round(table["exact"]["unique_max_share"], 3) if "exact" in table else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
