"""Cluster routing benchmark (not a test): two tiny replicas on Ray Serve, four routers, four traces, one run.

Routers, each on a fresh deployment (empty caches, a new app) of the same application, in this order:
- exact: ours (CacheAwareRouter: the replicas' cache events + prompts in flight, load in tokens);
- ray_prefix: Ray Serve LLM's PrefixCacheAffinityRouter (a tree of routed prompt text; bench/ray_prefix_router.py
  hands it one character per token id), at its defaults;
- p2c: Ray Serve's default (power of two choices);
- round_robin.

Traces (token ids of `--random-model`'s character vocabulary; each replica: one CPU, one torch thread, page 16):
- present: 4 groups of 1,024-token system prompts x N questions (each round visits every group, shuffled), pools of
  two groups' prefixes; then 4 three-round chats; then 20 prompts that share nothing (the spread over replicas).
- eviction: 16 groups of 1,024-token prefixes (1,024 pages: ~2.9x the fleet's 352), Zipf popularity (s=1).
- two_tenant: 3 groups, the same token ids sent by two tenants (namespaces never share pages), pools of three
  prefixes: the fleet holds all six copies, one replica half of them.
- flush_restart: 4 groups x 9 rounds; after round 3 a FlushCache, after round 6 one replica is killed and the
  rest waits until Serve's replacement serves.

Reported per trace and router: hit rate as a share of the theoretical maximum (bench/common.max_reusable per tenant:
infinite cache, arrival order), TTFT p50/p90, failed requests; the present trace adds the largest share of the
unique prompts one replica got. Also our router's decision time in process. Last line: one JSON object.

--store (issue 37): each trace and router is measured a second time (as "<router>+store") with both replicas on a
fleet store of their own (cluster/store_processes.LocalStore: a Mooncake master and a 1 GiB store service on
loopback, started empty for that deployment and stopped after it): the same replicas and pools, so the same fleet
memory on the device. Where the eviction trace ran with our router both ways, the JSON adds
store_eviction_hit_rate {"store", "no_store"}.

    python bench/cluster_bench.py [--rounds 6] [--traces present,eviction,two_tenant,flush_restart] [--store] [--smoke]

--smoke (tests/test_bench_smoke.py): the present trace at one round (2 chats of 2 rounds, 4 unique prompts), our
router and Ray's prefix router, 2 tokens per request (the same keys per trace and router; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SMOKE_HELP, free_port, max_reusable, percentile  # noqa: E402

ROUTERS = {
    "exact": "radixcache.cluster.router:CacheAwareRouter",
    "ray_prefix": "ray_prefix_router:TokenPrefixCacheAffinityRouter",
    "p2c": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "round_robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
}
PAGE = 16
PREFIX = 1024  # tokens of a group's shared prefix (64 pages)
QUESTION = 32
TOKENS = {"tok-a": "tenant-a", "tok-b": "tenant-b"}
LOW_ID, HIGH_ID = 3, 194  # --random-model's vocabulary: ids 0-2 are <s>, </s>, <unk>


@dataclass
class Job:
    name: str
    prompt: list[int]
    max_tokens: int
    token: str = "tok-a"  # the tenant's bearer token


@dataclass
class Result:
    job: Job
    ttft: float | None
    tokens: list[int]
    cached: int
    error: str | None = None


@dataclass
class Trace:
    pages: int  # KV pages per replica
    steps: list[Callable[[Run], None]]  # run in order against one deployment


@dataclass
class Run:
    target: str
    output: int
    results: list[Result] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW_ID, HIGH_ID) for _ in range(n)]


# --- sending -----------------------------------------------------------------------------------------------------
def send(target: str, jobs: list[Job], concurrency: int = 4) -> list[Result]:
    from radixcache.client import Client

    local = threading.local()

    def one(job: Job) -> Result:
        clients = local.__dict__.setdefault("clients", {})
        client = clients.get(job.token) or clients.setdefault(job.token, Client(target, token=job.token))
        start = time.perf_counter()
        ttft, out, cached = None, [], 0
        try:
            for chunk in client.generate(token_ids=job.prompt, max_tokens=job.max_tokens, ignore_eos=True):
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - start
                out += chunk.token_ids
                cached = chunk.cached_tokens
        except Exception as e:  # noqa: BLE001 - counted, the run goes on
            return Result(job, None, out, 0, f"{type(e).__name__}: {e}")
        return Result(job, ttft, out, cached)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, jobs))


def group_rounds(rng: random.Random, prefixes: list[list[int]], rounds: int, output: int, token: str = "tok-a"):
    """Every prefix once per round (with a new question), in a shuffled order each round."""
    jobs = []
    for r in range(rounds):
        order = list(range(len(prefixes)))
        rng.shuffle(order)
        jobs += [Job(f"g{g}-r{r}", prefixes[g] + tokens(rng, QUESTION), output, token) for g in order]
    return jobs


def jobs_step(jobs: list[Job]) -> Callable[[Run], None]:
    return lambda run: run.results.extend(send(run.target, jobs))


def chats_step(clients: int, rounds: int, seed: int = 5) -> Callable[[Run], None]:
    def step(run: Run) -> None:
        rng = random.Random(seed)
        prompts = [tokens(rng, 256 + 32) for _ in range(clients)]
        for r in range(rounds):
            jobs = [Job(f"chat{c}-r{r}", prompts[c], run.output) for c in range(clients)]
            results = send(run.target, jobs, concurrency=clients)
            run.results += results
            prompts = [res.job.prompt + res.tokens + tokens(rng, 32) for res in results]

    return step


def spread_step(n: int = 20) -> Callable[[Run], None]:
    """Prompts that share nothing: the largest share of them that one replica computed (not scored)."""

    def step(run: Run) -> None:
        before = queried(run.target)
        rng = random.Random(11)
        send(run.target, [Job(f"uniq{i}", tokens(rng, 128), 4) for i in range(n)], concurrency=2)
        after = queried(run.target)
        spread = [after[k] - before.get(k, 0) for k in after]
        run.extra["unique_max_share"] = max(spread) / sum(spread) if sum(spread) else float("nan")

    return step


def queried(target: str) -> dict[str, float]:
    from radixcache.client import Client

    with Client(target, token="tok-a") as c:
        return {r["replica_id"]: r["queried_tokens"] for r in c.stats()["replicas"]}


def flush_step(run: Run) -> None:
    from radixcache.client import Client

    with Client(run.target, token="tok-a") as c:
        run.extra["flushed_pages"] = c.flush()


def restart_step(run: Run) -> None:
    """Kill one replica; wait until Serve's replacement answers (both replicas in the stats, the victim gone)."""
    import ray

    from radixcache.client import Client

    with Client(run.target, token="tok-a") as c:
        victim = c.stats()["replicas"][0]["replica_id"]
        killed = time.perf_counter()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        deadline = killed + 180
        while time.perf_counter() < deadline:
            try:
                live = {r["replica_id"] for r in c.stats()["replicas"]}
                if victim not in live and len(live) == 2:
                    break
            except Exception:  # noqa: BLE001 - the ingress may time out on the dead replica meanwhile
                pass
            time.sleep(0.5)
        run.extra["restart_s"] = round(time.perf_counter() - killed, 1)


# --- the traces --------------------------------------------------------------------------------------------------
def present(a: argparse.Namespace) -> Trace:
    rng = random.Random(0)
    prefixes = [tokens(rng, PREFIX) for _ in range(4)]
    chats, spread = (chats_step(2, 2), spread_step(4)) if a.smoke else (chats_step(4, 3), spread_step())
    steps = [jobs_step(group_rounds(rng, prefixes, a.rounds, a.output)), chats, spread]
    return Trace(pages=2 * PREFIX // PAGE + 48, steps=steps)


def eviction(a: argparse.Namespace) -> Trace:
    rng = random.Random(1)
    prefixes = [tokens(rng, PREFIX) for _ in range(16)]
    weights = [1 / (rank + 1) for rank in range(16)]
    picks = rng.choices(range(16), weights, k=16 * a.rounds)
    jobs = [Job(f"z{g}-{i}", prefixes[g] + tokens(rng, QUESTION), a.output) for i, g in enumerate(picks)]
    return Trace(pages=2 * PREFIX // PAGE + 48, steps=[jobs_step(jobs)])


def two_tenant(a: argparse.Namespace) -> Trace:
    rng = random.Random(2)
    prefixes = [tokens(rng, PREFIX) for _ in range(3)]
    jobs = []
    for r in range(a.rounds):
        order = [(g, t) for g in range(3) for t in TOKENS]
        rng.shuffle(order)
        question = {g: tokens(rng, QUESTION) for g in range(3)}  # the same text from both tenants
        jobs += [Job(f"g{g}-{t}-r{r}", prefixes[g] + question[g], a.output, t) for g, t in order]
    return Trace(pages=3 * PREFIX // PAGE + 48, steps=[jobs_step(jobs)])


def flush_restart(a: argparse.Namespace) -> Trace:
    rng = random.Random(3)
    prefixes = [tokens(rng, PREFIX) for _ in range(4)]
    thirds = [group_rounds(rng, prefixes, 3, a.output) for _ in range(3)]
    steps = [jobs_step(thirds[0]), flush_step, jobs_step(thirds[1]), restart_step, jobs_step(thirds[2])]
    return Trace(pages=2 * PREFIX // PAGE + 48, steps=steps)


TRACES = {"present": present, "eviction": eviction, "two_tenant": two_tenant, "flush_restart": flush_restart}


# --- one deployment ----------------------------------------------------------------------------------------------
def measure(trace_name: str, router: str, a: argparse.Namespace, port: int, store: bool = False) -> dict:
    """One fresh deployment of two replicas routed by `router` through `trace_name`; with `store`, both replicas
    join a store started empty for it (stopped after)."""
    import ray
    from ray import serve

    from radixcache.cluster.app import ClusterOptions, build_app
    from radixcache.cluster.store_processes import LocalStore

    trace = TRACES[trace_name](a)
    fleet_store = LocalStore().start() if store else None
    options = ClusterOptions(
        serve_argv=[
            "--random-model",
            "--page-size",
            str(PAGE),
            "--kv-pages",
            str(trace.pages),
            *(fleet_store.worker_args() if fleet_store else ()),
        ],
        replicas=2,
        router_class=ROUTERS[router],
        auth_tokens=TOKENS,
        app_name=f"rcb-{trace_name.replace('_', '-')}-{router.replace('_', '-')}{'-store' if store else ''}",
    )
    serve.run(build_app(options), name=options.app_name)
    run = Run(f"127.0.0.1:{port}", a.output)
    start = time.perf_counter()
    try:
        for step in trace.steps:
            step(run)
    finally:
        wall = time.perf_counter() - start
        serve.delete(options.app_name)
        if fleet_store is not None:
            fleet_store.stop()
        for name, namespace in (
            (options.hub_name, options.hub_namespace),
            ("LlmPrefixTreeActor", f"serve::{options.app_name}::EngineReplica"),
        ):
            try:
                ray.kill(ray.get_actor(name, namespace=namespace))
            except ValueError:
                pass
    return score(run, wall)


def score(run: Run, wall: float) -> dict:
    ok = [r for r in run.results if r.error is None]
    reachable = served = 0
    for token in TOKENS:  # tenants never share pages: each one's maximum on its own
        mine = [r for r in ok if r.job.token == token]
        prompts = [r.job.prompt for r in mine]
        reachable += sum(max_reusable(prompts, [r.job.prompt + r.tokens[:-1] for r in mine]))
        served += sum(r.cached for r in mine)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {
        "hit_rate_of_max": served / reachable if reachable else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p90_ms": percentile(ttfts, 90) * 1e3,
        "requests": len(run.results),
        "failed": len(run.results) - len(ok),
        "errors": sorted({r.error for r in run.results if r.error is not None})[:3],  # what failed, in its words
        "wall_s": wall,
        **run.extra,
    }


def decision_time_ms(samples: int = 2000) -> float:
    """Our router's decision for a 1,024-token prompt: hash its pages, match against two replicas, choose."""
    from radixcache.cluster.index import PrefixIndex
    from radixcache.cluster.policy import Candidate, choose
    from radixcache.events import page_hashes

    rng = random.Random(0)
    index = PrefixIndex()
    prompts = [tokens(rng, 1024) for _ in range(64)]
    for i, p in enumerate(prompts):
        index.stored(f"r{i % 2}", "", page_hashes(p, PAGE))
    times = []
    for i in range(samples):
        prompt = prompts[i % len(prompts)][:1000] + [i % 190 + 3]
        start = time.perf_counter()
        hashes = page_hashes(prompt, PAGE)
        candidates = [Candidate(r, 0, index.match(r, "", hashes), 0, 0.0, 1000) for r in ("r0", "r1")]
        choose(candidates, len(prompt), PAGE, rng=rng)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds of the group traces (eviction: 16 x this requests)")
    p.add_argument("--output", type=int, default=8, help="tokens generated per request")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument("--store", action="store_true", help="also measure each run with the replicas on a fleet store")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = p.parse_args()
    if a.smoke:
        a.rounds, a.output, a.routers, a.traces = 1, 2, "exact,ray_prefix", "present"

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from radixcache.cluster.app import grpc_options

    load_before = load_average()
    port = free_port()
    ray.init(num_cpus=3, include_dashboard=False, namespace="radixcache", log_to_driver=False)
    serve.start(grpc_options=grpc_options(port), http_options=HTTPOptions(host="127.0.0.1", port=free_port()))
    table: dict[str, dict[str, dict]] = {}
    try:
        for trace in a.traces.split(","):
            for router in a.routers.split(","):
                for store in (False, True) if a.store else (False,):
                    name = f"{router}+store" if store else router
                    table.setdefault(trace, {})[name] = r = measure(trace, router, a, port, store)
                    print(trace, name, json.dumps(r), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    decision = decision_time_ms(20 if a.smoke else 2000)
    load_after = load_average()
    print("\n| trace | router | hit rate of max | TTFT p50 ms | TTFT p90 ms | failed |")
    print("|---|---|---|---|---|---|")
    for trace, rows in table.items():
        for router, r in rows.items():
            print(
                f"| {trace} | {router} | {r['hit_rate_of_max']:.3f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} "
                f"| {r['failed']}/{r['requests']} |"
            )
    print(
        f"\nrouting decision (ours, 1,024-token prompt): p50 {decision:.3f} ms; load average {load_before} -> {load_after}"
    )
    summary = {
        trace: {
            router: {k: round(r[k], 4) for k in ("hit_rate_of_max", "ttft_p50_ms", "ttft_p90_ms")}
            | {k: r[k] for k in ("failed", "errors", "unique_max_share", "restart_s") if k in r and r[k] != []}
            for router, r in rows.items()
        }
        for trace, rows in table.items()
    }
    if {"exact", "exact+store"} <= set(table.get("eviction", {})):
        summary["store_eviction_hit_rate"] = {
            "store": round(table["eviction"]["exact+store"]["hit_rate_of_max"], 4),
            "no_store": round(table["eviction"]["exact"]["hit_rate_of_max"], 4),
        }
    summary["decision_ms_p50"] = round(decision, 4)
    summary["load_average"] = [load_before, load_after]
    summary["smoke"] = a.smoke
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
