"""The disk tier on the ~125M bench model, one thread per worker: what it saves and what it costs, side by side.

    python bench/tier_bench.py [--quick] [--smoke]

Phases (each against workers started here on loopback, sequential requests unless said otherwise):
1. re-hit: a 1,024-token prefix asked cold (TTFT = its prefill), pushed out of a 1,536-token pool by three other
   prompts (so it is on disk only), asked again (TTFT = load + the few tokens after it). disk_rehit_ttft_speedup =
   cold / re-hit, the median of `reps` prefixes.
2. oversubscribed shared prefixes: `groups` system prompts of 1,024 tokens (4x the pool), each asked `rounds` times
   round-robin with a new 32-token question: hit rate and TTFT p50/p90 with and without the tier.
3. unique prompts (nothing is ever asked twice): 512-token prompts sent round robin to three workers, tier off, on
   (the default write-through) and on (evict-only): unique_overhead = median request time on / off; the workers'
   CPU time over the phase (every thread: engine, writer) on / off beside it.
4. warm restart: 4 prompts of 512 tokens asked twice (the second time's cached_tokens is "before"), then the worker
   stopped by SIGTERM (or SIGKILL) and started again on the same folder: the same prompts' cached_tokens as a share
   of before. ready_delay_s: "listening on" with the tier (over a populated folder) minus without, median of pairs.
5. crashes: 20 SIGKILLs of a worker under a request loop that spills all the time (a 768-token pool, a 32 MiB disk
   bound), then a worker on that folder answers the loop's prompts (compared with a worker without tier: a wrong
   answer counts as a corrupt page served) and the store is read back page by page in this process (every file
   that is not a whole page must be caught: deleted, never served). Files on disk against the bound.
6. in process (the model loaded once): what the tier adds to Engine(...) + start() over a populated folder (the
   synchronous part of a start; the digest and the scan run after it), pairs alternating with no tier; then the
   spill cost per decode step: an in-process engine decoding 8 sequences through a full pool (every page boundary
   evicts, every completed page is written through): the time the tier spends on the engine thread (naming pages,
   copying them out, queueing them, events) per decode step (p50 / p99 / max), and decode step times with the tier
   and without. Wall time and the engine thread's CPU time (the wall time includes being preempted on a busy
   machine).

The last line printed is one JSON object (also written to bench/results/tier_bench.json). Not part of `make test`;
its --smoke is (tests/test_bench_smoke.py): every phase once on the two-layer smoke checkpoint, with one repetition
of each, one kill and 24 decoded tokens (the same keys; the figures mean nothing; written under results/smoke/).
Phase 6 decodes with speculation off (speculate=0: one token per sequence per step, what "per decode step" means).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS,
    SMOKE_HELP,
    Worker,
    bench_checkpoint,
    percentile,
    random_tokens,
    smoke_out,
    write_json,
)

PAGE = 16
POOL = ("--page-size", str(PAGE), "--kv-pages", "96", "--max-step-tokens", "512")  # 1,536 tokens


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def ask(c, prompt: list[int], max_tokens: int = 1) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached_tokens, tokens) of one request."""
    start = time.perf_counter()
    first, cached, tokens = None, 0, []
    for chunk in c.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        cached = chunk.cached_tokens
        tokens += chunk.token_ids
    return first if first is not None else time.perf_counter() - start, cached, tokens


def settle(c, timeout: float = 120.0) -> dict:
    """Stats once the disk tier is open and its writes have landed (the page count holds still for 0.3 s)."""
    deadline = time.monotonic() + timeout
    last, still = None, 0
    while time.monotonic() < deadline:
        s = c.stats()
        still = still + 1 if s["disk_ready"] and s["disk_pages"] == last else 0
        if still >= 3:
            return s
        last = s["disk_pages"]
        time.sleep(0.1)
    return s


def tier_args(folder: Path, *extra: str) -> tuple[str, ...]:
    return ("--kv-disk", str(folder), "--kv-disk-size", "4GiB", *extra)


# ---- 1 -------------------------------------------------------------------------------------------------------
def rehit(ckpt: Path, tmp: Path, rng: random.Random, reps: int) -> dict:
    from radixcache.client import Client

    cold, warm, cached = [], [], []
    with Worker(ckpt, *POOL, *tier_args(tmp / "rehit"), threads=1, name="rehit") as w, Client(w.target) as c:
        settle(c)
        ask(c, random_tokens(rng, 64))  # the first request of a process pays for lazy set-up: not measured
        for _ in range(reps):
            prefix = random_tokens(rng, 1024)
            t, _, _ = ask(c, prefix + random_tokens(rng, 8))
            cold.append(t)
            for _ in range(3):
                ask(c, random_tokens(rng, 1024))
            before = settle(c)["disk_hit_tokens"]
            t, got, _ = ask(c, prefix + random_tokens(rng, 8))
            warm.append(t)
            cached.append((got, c.stats()["disk_hit_tokens"] - before))
    return {
        "cold_ttft_s": [round(x, 3) for x in cold],
        "rehit_ttft_s": [round(x, 3) for x in warm],
        "rehit_cached_and_from_disk": cached,
        "speedup": round(statistics.median(a / b for a, b in zip(cold, warm, strict=True)), 1),
    }


# ---- 2 -------------------------------------------------------------------------------------------------------
def oversub(ckpt: Path, tmp: Path, groups: int, rounds: int) -> dict:
    from radixcache.client import Client

    rng = random.Random(7)
    systems = [random_tokens(rng, 1024) for _ in range(groups)]
    jobs = [systems[g] + random_tokens(rng, 32) for _ in range(rounds) for g in range(groups)]
    out = {}
    for label, extra in (("no_tier", ()), ("tier", tier_args(tmp / "oversub"))):
        with Worker(ckpt, *POOL, *extra, threads=1, name=f"oversub-{label}") as w, Client(w.target) as c:
            if extra:
                settle(c)
            ask(c, random_tokens(rng, 64))
            ttft, hit = [], 0
            for prompt in jobs:
                t, cached, _ = ask(c, prompt, max_tokens=4)
                ttft.append(t)
                hit += cached
            prompt_tokens = sum(len(p) for p in jobs)
            out[label] = {
                "hit_rate": round(hit / prompt_tokens, 3),
                "ttft_p50_s": round(percentile(ttft, 50), 3),
                "ttft_p90_s": round(percentile(ttft, 90), 3),
                "total_s": round(sum(ttft), 1),
            }
    return out


# ---- 3 -------------------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def unique(ckpt: Path, tmp: Path, requests: int) -> dict:
    """Per request, round robin over the configs (the machine's noise falls on each alike); the ratio of median
    request times, and of the worker processes' CPU time over the whole phase (every thread: engine, writer)."""
    from radixcache.client import Client

    rng = random.Random(11)
    evict = tier_args(tmp / "u-evict", "--kv-disk-write", "evict")
    configs = {"off": (), "through": tier_args(tmp / "u-through"), "evict": evict}
    times: dict[str, list[float]] = {k: [] for k in configs}
    workers = {k: Worker(ckpt, *POOL, *v, threads=1, name=f"unique-{k}").start() for k, v in configs.items()}
    try:
        clients = {k: Client(w.target) for k, w in workers.items()}
        for k, c in clients.items():
            if configs[k]:
                settle(c)
            ask(c, random_tokens(rng, 64))
        cpu0 = {k: cpu_seconds(w.proc.pid) for k, w in workers.items()}
        for _ in range(requests):
            for k, c in clients.items():
                prompt = random_tokens(rng, 512)
                start = time.perf_counter()
                ask(c, prompt, max_tokens=8)
                times[k].append(time.perf_counter() - start)
        for k, c in clients.items():
            if configs[k]:
                settle(c)  # the writes of the last requests are part of the cost
        cpu = {k: cpu_seconds(w.proc.pid) - cpu0[k] for k, w in workers.items()}
        stats = {k: clients[k].stats() for k in configs if configs[k]}
        for c in clients.values():
            c.close()
    finally:
        for w in workers.values():
            w.stop()
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "median_request_s": {k: round(v, 3) for k, v in median.items()},
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "overhead_through": round(median["through"] / median["off"], 3),
        "overhead_evict": round(median["evict"] / median["off"], 3),
        "cpu_overhead_through": round(cpu["through"] / cpu["off"], 3),
        "cpu_overhead_evict": round(cpu["evict"] / cpu["off"], 3),
        "spilled_pages": {k: s["spilled_pages"] for k, s in stats.items()},
        "spill_dropped_pages": {k: s["spill_dropped_pages"] for k, s in stats.items()},
    }


# ---- 4 -------------------------------------------------------------------------------------------------------
def timed_start(worker: Worker) -> float:
    start = time.perf_counter()
    worker.start()
    return time.perf_counter() - start


def restart(ckpt: Path, tmp: Path, pairs: int = 3) -> dict:
    from radixcache.client import Client

    rng = random.Random(13)
    work = [random_tokens(rng, 512) for _ in range(4)]
    pool = ("--page-size", str(PAGE), "--kv-pages", "160", "--max-step-tokens", "512")
    share, detail = {}, {}
    for how, sig in (("sigterm", signal.SIGTERM), ("sigkill", signal.SIGKILL)):
        folder = tmp / f"restart-{how}"
        with Worker(ckpt, *pool, *tier_args(folder), threads=1, name=f"restart-{how}") as w, Client(w.target) as c:
            settle(c)
            for p in work:
                ask(c, p)
            before = sum(ask(c, p)[1] for p in work)
            os.killpg(w.proc.pid, sig)  # SIGTERM: drain + save within the grace period; SIGKILL: nothing
            w.proc.wait(60)
            w.proc = None
        with Worker(ckpt, *pool, *tier_args(folder), threads=1, name=f"again-{how}") as w, Client(w.target) as c:
            settle(c)
            after = sum(ask(c, p)[1] for p in work)
        share[how] = round(after / before, 4)
        detail[how] = {"cached_before": before, "cached_after": after}
    delays = []
    for _ in range(pairs):  # alternating pairs: a worker without the tier, then one over the populated folder
        started = []
        for extra in ((), tier_args(tmp / "restart-sigterm")):
            worker = Worker(ckpt, *pool, *extra, threads=1, name="ready")
            started.append(timed_start(worker))
            worker.stop()
        delays.append(round(started[1] - started[0], 3))
    return {"share": share, "detail": detail, "ready_delay_s": round(statistics.median(delays), 3), "delays": delays}


# ---- 5 -------------------------------------------------------------------------------------------------------
def crashes(ckpt: Path, tmp: Path, kills: int) -> dict:
    from radixcache.client import Client
    from radixcache.page_data import PageData
    from radixcache.store import DiskStore
    from radixcache.worker.engine.tiers import PAGE_CODEC

    rng = random.Random(17)
    work = [random_tokens(rng, 256) for _ in range(5)]  # 80 pages: over the pool (48), within the disk bound (85)
    pool = ("--page-size", str(PAGE), "--kv-pages", "48", "--max-step-tokens", "256")
    bound = 32 << 20
    folder = tmp / "crashes"
    args = (*pool, "--kv-disk", str(folder), "--kv-disk-size", str(bound))
    with Worker(ckpt, *pool, threads=1, name="reference") as w, Client(w.target) as c:
        reference = [ask(c, p, max_tokens=2)[2] for p in work]
    wrong_during = 0
    for k in range(kills):
        w = Worker(ckpt, *args, threads=1, name=f"kill-{k}").start()
        with Client(w.target) as c:
            settle(c)  # the disk tier is open (the kill comes while it spills, not before it started)
        stop = threading.Event()
        answers: list[tuple[int, list[int]]] = []

        def loop(target: str = w.target, stop: threading.Event = stop, answers: list = answers) -> None:
            try:
                with Client(target) as c:
                    i = 0
                    while not stop.is_set():
                        answers.append((i % len(work), ask(c, work[i % len(work)], max_tokens=2)[2]))
                        i += 1
            except Exception:  # the kill
                return

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(rng.uniform(1.0, 3.0))
        os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait(30)
        w.proc = None
        stop.set()
        thread.join(30)
        wrong_during += sum(tokens != reference[i] for i, tokens in answers)
    with Worker(ckpt, *args, threads=1, name="after-kills") as w, Client(w.target) as c:
        settle(c)
        wrong_after = sum(ask(c, p, max_tokens=2)[2] != reference[i] for i, p in enumerate(work))
        served_from_disk = c.stats()["disk_hit_tokens"]
    (store_folder,) = [p for p in folder.iterdir() if p.is_dir()]
    files_bytes = sum(p.stat().st_size for p in store_folder.rglob("*") if p.is_file())
    store = DiskStore(store_folder, bound, codec=PAGE_CODEC).start()
    store.wait_ready(120)
    read = unreadable = 0
    for key in list(store.records()):
        page = store.get(key)
        if page is not None:
            read += 1
            unreadable += not isinstance(page, PageData)
    s = store.stats()
    store.close()
    return {
        "kills": kills,
        "corrupt_served": wrong_during + wrong_after + unreadable,
        "wrong_answers_during": wrong_during,
        "wrong_answers_after": wrong_after,
        "disk_hit_tokens_after": served_from_disk,
        "pages_read_back": read,
        "corrupt_files_caught": s.corrupt_pages,
        "tmp_files_left": len(list(store_folder.rglob("*.tmp"))),
        "store_bytes": files_bytes,
        "store_bound_bytes": bound,
    }


# ---- 6 -------------------------------------------------------------------------------------------------------
def timed(fn, spent: list[float]):
    """fn, adding its wall time to spent[0] and its CPU time on the calling thread to spent[1]."""

    def wrapper(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += time.thread_time() - cpu

    return wrapper


def ready_delay_in_process(loaded, folder: Path, pairs: int = 5) -> dict:
    """What the tier adds before a worker could say "listening on", the model already loaded: Engine(...) + start()
    with the tier over a populated folder minus without, alternating; the median and every pair."""
    from radixcache.worker.engine.engine import Engine, EngineConfig

    delays = []
    for _ in range(pairs):
        took = []
        for tier in (None, str(folder)):
            start = time.perf_counter()
            engine = Engine(loaded, EngineConfig(page_size=PAGE, kv_pages=160, kv_disk_dir=tier))
            engine.start()
            took.append(time.perf_counter() - start)
            engine.shutdown()
        delays.append(round(took[1] - took[0], 4))
    return {"median": statistics.median(delays), "pairs": delays}


def spill_cost(ckpt: Path, tmp: Path, pairs: int = 5, decode_tokens: int = 96) -> dict:
    import torch

    from radixcache.worker.engine.engine import Engine, EngineConfig
    from radixcache.worker.engine.request import Request, SamplingParams
    from radixcache.worker.model.loader import load_checkpoint

    torch.set_num_threads(1)
    loaded = load_checkpoint(ckpt)
    rng = random.Random(19)
    out: dict = {"ready_delay_s": ready_delay_in_process(loaded, tmp / "restart-sigterm", pairs), "speculate": 0}
    for label, folder in (("no_tier", None), ("tier", tmp / "spill")):
        config = EngineConfig(page_size=PAGE, kv_pages=96, max_step_tokens=512, kv_disk_dir=folder and str(folder),
                              speculate=0)  # fmt: skip
        engine = Engine(loaded, config)
        engine.start_tiers()
        assert engine.wait_tier_ready(120)
        link = engine.cache.tier
        spent = [0.0, 0.0]
        if link is not None:  # time all the tier does on the engine thread: naming, copying, queueing, events
            for name in ("stored", "removed", "spill", "pump"):
                setattr(link, name, timed(getattr(link, name), spent))
        for i in range(6):  # fill the pool with cached pages, so that decoding evicts
            engine.submit(Request(f"fill-{i}", random_tokens(rng, 240), SamplingParams(max_tokens=1)), lambda o: None)
            engine.run_until_idle()
        for i in range(8):
            params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
            engine.submit(Request(f"dec-{i}", random_tokens(rng, 40), params), lambda o: None)
        steps, tier_ms, tier_cpu_ms = [], [], []
        engine.step()  # takes the submissions in, starts the prefills
        while engine.scheduler.has_work():
            decode_only = not engine.scheduler.waiting and all(not s.prefilling for s in engine.scheduler.running)
            spent[0] = spent[1] = 0.0
            start = time.perf_counter()
            engine.step()
            if decode_only:
                steps.append((time.perf_counter() - start) * 1e3)
                tier_ms.append(spent[0] * 1e3)
                tier_cpu_ms.append(spent[1] * 1e3)
        stats = engine.stats()
        engine.shutdown()
        out[label] = {
            "decode_steps": len(steps),
            "step_ms_p50": round(percentile(steps, 50), 2),
            "step_ms_p99": round(percentile(steps, 99), 2),
            "evicted_pages": stats.cache.evicted_pages,
            "spilled_pages": stats.cache.spilled_pages,
        }
        if link is not None:
            out[label] |= {
                "tier_ms_per_step_p50": round(percentile(tier_ms, 50), 3),
                "tier_ms_per_step_p99": round(percentile(tier_ms, 99), 3),
                "tier_ms_per_step_max": round(max(tier_ms), 3),
                "tier_cpu_ms_per_step_p50": round(percentile(tier_cpu_ms, 50), 3),
                "tier_cpu_ms_per_step_p99": round(percentile(tier_cpu_ms, 99), 3),
                "tier_cpu_ms_per_step_max": round(max(tier_cpu_ms), 3),
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not the figures)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the workers' `with` blocks still stop them
    ckpt = bench_checkpoint(args.smoke)
    small = args.quick or args.smoke
    tmp = Path(tempfile.mkdtemp(prefix="tier-bench-"))
    load_before = uptime()
    results: dict = {}
    try:
        rng = random.Random(5)
        results["rehit"] = rehit(ckpt, tmp, rng, reps=1 if small else 3)
        print("rehit", json.dumps(results["rehit"]), flush=True)
        groups, rounds = (2, 2) if args.smoke else (4, 2) if args.quick else (6, 4)
        results["oversub"] = oversub(ckpt, tmp, groups=groups, rounds=rounds)
        print("oversub", json.dumps(results["oversub"]), flush=True)
        results["unique"] = unique(ckpt, tmp, requests=2 if args.smoke else 4 if args.quick else 16)
        print("unique", json.dumps(results["unique"]), flush=True)
        results["restart"] = restart(ckpt, tmp, pairs=1 if args.smoke else 3)
        print("restart", json.dumps(results["restart"]), flush=True)
        results["crashes"] = crashes(ckpt, tmp, kills=1 if args.smoke else 3 if args.quick else 20)
        print("crashes", json.dumps(results["crashes"]), flush=True)
        results["spill_cost"] = spill_cost(ckpt, tmp, *((1, 24) if args.smoke else (5, 96)))
        print("spill_cost", json.dumps(results["spill_cost"]), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "disk_rehit_ttft_speedup": results["rehit"]["speedup"],
        "oversub_hit_rate": {k: v["hit_rate"] for k, v in results["oversub"].items()},
        "oversub_ttft_p50_s": {k: v["ttft_p50_s"] for k, v in results["oversub"].items()},
        "oversub_ttft_p90_s": {k: v["ttft_p90_s"] for k, v in results["oversub"].items()},
        "restart_cached_share": results["restart"]["share"],
        "ready_delay_s": results["restart"]["ready_delay_s"],
        "unique_overhead": results["unique"]["overhead_through"],
        "unique_overhead_evict": results["unique"]["overhead_evict"],
        "unique_cpu_overhead": {
            "through": results["unique"]["cpu_overhead_through"],
            "evict": results["unique"]["cpu_overhead_evict"],
        },
        "corrupt_served": results["crashes"]["corrupt_served"],
        "corrupt_files_caught": results["crashes"]["corrupt_files_caught"],
        "store_bytes_vs_bound": [results["crashes"]["store_bytes"], results["crashes"]["store_bound_bytes"]],
        "tier_ms_per_decode_step_p99": results["spill_cost"]["tier"]["tier_ms_per_step_p99"],
        "tier_cpu_ms_per_decode_step_p99": results["spill_cost"]["tier"]["tier_cpu_ms_per_step_p99"],
        "ready_delay_in_process_s": results["spill_cost"]["ready_delay_s"],
        "decode_step_ms_p99": {k: results["spill_cost"][k]["step_ms_p99"] for k in ("no_tier", "tier")},
        "quick": args.quick,
        "smoke": args.smoke,
        "load_before": load_before,
        "load_after": uptime(),
        "details": results,
    }
    write_json(smoke_out(RESULTS / "tier_bench.json", args.smoke), summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
