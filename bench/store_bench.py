"""The fleet's store (`serve --kv-remote`, Mooncake Store on loopback) on the ~125M bench model, one thread per
worker: what a prefix computed on one replica saves another, what a replica started later finds, what it costs.

    python bench/store_bench.py [--reps N] [--smoke]

Phases (one master and one store service started here; workers are `radixcache serve` subprocesses):
1. cross-replica re-hit: replicas A and B join the store. A 1,024-token prefix + 8 tokens is asked on A (cold: its
   TTFT is the prefill), then, once A's write-through has landed, the same prefix + 8 other tokens on B (its TTFT is
   the store load + the tail). cross_replica_rehit_speedup = cold / re-hit, the median over `reps` prefixes.
2. failover: A is killed (SIGKILL of its process group) once its write-through has landed; a replacement A2 joins
   the same store and each of A's prefixes is asked once on it. failover_cached_share = the cached tokens it
   reports over the whole pages of those prefixes.
3. scale-up: replica C joins after all that; each known prefix asked once on C. scaleup_cached_share = the cached
   tokens it reports over the whole pages of those prefixes.
4. unique prompts (nothing re-hits, run before the failover): 512-token prompts alternated between a store replica
   and one without the store. unique_overhead = median request time with the store / without.
5. faults (last: a restarted master holds nothing): a bounded sequential loop of greedy requests on A2 through
   (c) the objects of prefixes B just wrote corrupted in place (fault_corrupted_objects of them), those prefixes
   then asked; (b) the store service killed (SIGKILL), requests, started again, requests; (a) the master killed
   (SIGKILL), requests, master and service started again on the same ports, requests. fault_failed_requests: the
   requests that raised; fault_wrong_answers: those whose greedy tokens differ from the worker without the store.
6. eviction trace (its own store, first): two replicas whose pools hold 896 tokens each, 20 prefixes of 256 tokens
   (5,120 tokens: ~2.9x the fleet's pools) asked in Zipf order (s=1) with a new 8-token question each, prefix g
   always on replica g % 2 (the affinity a cache-aware router keeps), once with both replicas on the store and once
   on two replicas without it: same fleet memory. store_eviction_hit_rate = cached tokens / the whole-page tokens
   of prefixes asked before (anywhere in the fleet: what an unbounded cache would hit), for each fleet.
Greedy tokens of the re-hits and the failover equal those of a worker without the store (`wrong_answers` counts
those that differ).
The last line printed is one JSON object (also written to bench/results/store_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, SMOKE_HELP, Worker, bench_checkpoint, random_tokens, smoke_out, write_json  # noqa: E402

from radixcache.cluster.store_processes import LocalStore  # noqa: E402

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


def shares_on(c, cref, prefixes: list[list[int]], rng: random.Random) -> tuple[list[float], int]:
    """Each prefix asked once on `c`: (cached tokens / its whole-page tokens, per prefix; greedy answers differing
    from `cref`'s, when given)."""
    shares, wrong = [], 0
    for prefix in prefixes:
        prompt = prefix + random_tokens(rng, 8)
        _, got, tokens = ask(c, prompt)
        shares.append(min(got, len(prefix)) / (len(prefix) // PAGE * PAGE))
        if cref is not None:
            wrong += tokens != ask(cref, prompt)[2]
    return shares, wrong


EVICTION_POOL = ("--page-size", str(PAGE), "--kv-pages", "56", "--max-step-tokens", "512")  # 896 tokens each


def eviction_trace(ckpt: str, rng: random.Random, smoke: bool) -> dict[str, float]:
    """Hit rate of max on the eviction trace, the two replicas on a store of their own and without one."""
    from radixcache.client import Client

    groups, prefix_len, requests = (6, 64, 12) if smoke else (20, 256, 60)
    prefixes = [random_tokens(rng, prefix_len) for _ in range(groups)]
    picks = rng.choices(range(groups), [1 / (rank + 1) for rank in range(groups)], k=requests)
    questions = [random_tokens(rng, 8) for _ in picks]
    out = {}
    with LocalStore() as store:
        for name, extra in (("store", store.worker_args()), ("no_store", ())):
            args = (*EVICTION_POOL, *extra)
            with (
                Worker(ckpt, *args, threads=1, name=f"{name}0") as w0,
                Worker(ckpt, *args, threads=1, name=f"{name}1") as w1,
                Client(w0.target) as c0,
                Client(w1.target) as c1,
            ):
                fleet, seen, served, reachable = (c0, c1), set(), 0, 0
                for g, question in zip(picks, questions, strict=True):
                    _, got, _ = ask(fleet[g % 2], prefixes[g] + question)
                    if g in seen:
                        reachable += prefix_len // PAGE * PAGE
                        served += min(got, prefix_len // PAGE * PAGE)
                    seen.add(g)
                out[name] = round(served / reachable, 3) if reachable else 0.0
    return out


def fault_phases(store: LocalStore, writer, c, cref, rng: random.Random, per_window: int) -> dict:
    """A bounded sequential loop of requests on `c` (a store replica) through three faults: (c) every object of
    prefixes `writer` just wrote corrupted in place (one byte flipped, the object replaced), then those prefixes
    asked; (b) the store service killed, requests, the service started again, requests; (a) the master killed,
    requests, the master and the service started again (same ports), requests. Each request's greedy tokens are
    compared with `cref` (no store); a request that raises counts as failed."""
    tally = {"failed": 0, "wrong": 0, "requests": 0, "corrupted": 0}
    known = [random_tokens(rng, 256) for _ in range(per_window)]

    def window(prompts: list[list[int]]) -> None:
        for prompt in prompts:
            tally["requests"] += 1
            try:
                _, _, tokens = ask(c, prompt)
            except Exception:  # noqa: BLE001 (any failure is what is counted)
                tally["failed"] += 1
                continue
            tally["wrong"] += tokens != ask(cref, prompt)[2]

    def mixed() -> list[list[int]]:  # a known prefix with a new tail, and a prompt never seen
        return [p for k in known for p in (k + random_tokens(rng, 8), random_tokens(rng, 256))]

    before = set(store.all_keys())
    planted = [random_tokens(rng, 256) for _ in range(per_window)]
    for prompt in planted:
        ask(writer, prompt)
    time.sleep(WRITE_LAND_S)
    tally["corrupted"] = corrupt(store, sorted(set(store.all_keys()) - before))
    window([p + random_tokens(rng, 8) for p in planted])
    window(mixed())  # `known` computed (and written through) here
    store.kill_service()
    window(mixed())
    store.start_service()
    window(mixed())
    store.kill_master()
    window(mixed())
    store.start_master()
    store.kill_service()  # a restarted master knows no segment: the service mounts its memory again
    store.start_service()
    window(mixed())
    return tally


def corrupt(store: LocalStore, keys: list[str]) -> int:
    """Flip one byte near the end of each object under `keys` (its payload, not its header); how many were."""
    from radixcache.mooncake_store import MooncakeObjectStore
    from radixcache.object_store import parse_store_url

    vandal = MooncakeObjectStore(parse_store_url(store.url), store.metadata, local_host="127.0.0.1")
    vandal.connect(30)
    done = 0
    try:
        for key in keys:
            raw = vandal.get(key, 5)
            if raw is None:
                continue
            spoiled = bytearray(raw)
            spoiled[-8] ^= 0x55
            vandal.remove(key, 5)  # a put onto an existing key keeps the old value
            vandal.put(key, bytes(spoiled), 5)
            done += 1
    finally:
        vandal.close()
    return done


def main() -> int:
    from radixcache.client import Client

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="prefixes re-hit across replicas (default 3)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    ckpt = bench_checkpoint(args.smoke)
    rng = random.Random(37)
    load_before = uptime()
    eviction = eviction_trace(ckpt, rng, args.smoke)
    with LocalStore() as store:
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
            os.killpg(a.proc.pid, signal.SIGKILL)  # A crashes; what it wrote through stays in the store
            a.proc.wait(10)
            with Worker(ckpt, *joined, threads=1, name="A2") as a2, Client(a2.target) as c2:
                failover, wrong_failover = shares_on(c2, cref, prefixes, rng)
                with Worker(ckpt, *joined, threads=1, name="C") as late, Client(late.target) as cc:
                    shares, _ = shares_on(cc, None, prefixes, rng)
                faults = fault_phases(store, cb, c2, cref, rng, 1 if args.smoke else 3)  # last: it empties the store
    summary = {
        "store_eviction_hit_rate": eviction,
        "cross_replica_rehit_speedup": round(statistics.median(x / y for x, y in zip(cold, warm, strict=True)), 1),
        "scaleup_cached_share": round(statistics.mean(shares), 3),
        "unique_overhead": round(statistics.median(unique_on) / statistics.median(unique_off), 3),
        "failover_cached_share": round(statistics.mean(failover), 3),
        "fault_failed_requests": faults["failed"],
        "fault_wrong_answers": faults["wrong"],
        "wrong_answers": wrong + wrong_failover,
        "fault_requests": faults["requests"],
        "fault_corrupted_objects": faults["corrupted"],
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
