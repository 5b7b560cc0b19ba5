"""`make soak`: the long versions of the chaos and wire-fuzz tests against one real worker, plus memory and loop stall.

    python scripts/soak.py [--requests 2000] [--fuzz 5000] [--stall-seconds 20] [--http-seconds 30] [--random-model]

One `radixcache serve` process (the default bf16 model unless --random-model; 48 pages of 16, small enough that
requests are preempted; two tenants; the OpenAI HTTP API on a free port), then, in order:
1. greedy reference answers on the idle worker, and a warm-up of chaos requests (kernels and caches fill up);
2. RSS of the worker, then >= 2,000 chaos requests (tests/chaos.py: cancels, deadlines, Abort, pins with TTLs,
   flushes), then RSS again: `rss_growth_mb` is that difference (growth after warm-up);
3. the HTTP phase, for --http-seconds: every hostile request of tests/hostile_bodies.py (a huge n, 16 MB bodies of a
   million messages / tools / parts / stop strings, JSON nested 100,000 deep, a 15 MiB prompt, wrong content types,
   a foreign Host, lone surrogates, ...) from two threads, round-robin, each checked against the answer it must
   get, while header floods and slowloris / idle connections (tests/http_hostile.py) run at the same time and
   both healths (gRPC and HTTP GET /health) are probed every 50 ms; first the same probe on the idle worker;
4. >= 5,000 fuzzed calls (tests/wire_fuzz.py), then the longest health-probe latency while huge requests arrive
   (tests/loop_stall.py): 3.5 MiB ones (the largest the default 4 MiB message limit lets through to be parsed and
   refused), then 15 MiB ones (refused by gRPC's core), half of --stall-seconds each;
5. once idle: leases, pages and the worker's log.
Bounded: fixed counts, each phase with a time limit. The LAST line printed is one JSON object:
{"requests", "cancelled", "leaked_leases", "unknown_or_internal", "rss_growth_mb", "max_loop_stall_ms",
"http_requests", "http_5xx", "max_health_stall_ms" (the slowest health probe of either front, in the HTTP phase and
the loop-stall phase), ...}. Exit status 1 when a promise was broken (a leak, UNKNOWN/INTERNAL, a broken stream, an
HTTP answer other than the expected one, a 5xx, a health probe of 100 ms or more).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from chaos import Workload, reference_tokens, run_chaos, wait_idle  # noqa: E402
from hostile_bodies import hostile_requests, send_all  # noqa: E402
from http_hostile import Attack, HealthProbe, header_flood, hold_connections, rss_mb  # noqa: E402
from loop_stall import measure_loop_stall  # noqa: E402
from wire_fuzz import run_wire_fuzz  # noqa: E402
from worker_process import WorkerProcess  # noqa: E402

from radixcache.client import Client  # noqa: E402

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
ADMIN = "tok-ops"  # the whole worker's stats (leases, pages, preemptions); a tenant's show its own
ALICE = (("authorization", "Bearer tok-alice"),)


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


def http_phase(worker: WorkerProcess, http_port: int, model: str, seconds: float) -> dict:
    """Hostile bodies, header floods and slow clients at once against the worker's HTTP port (step 3 above)."""
    host, pid = "127.0.0.1", worker.proc.pid
    idle = HealthProbe(host, http_port, worker.target, pid=pid).start()
    time.sleep(3)
    idle_summary = idle.stop().summary()
    rss_before = rss_mb(pid)
    health = HealthProbe(host, http_port, worker.target, pid=pid).start()
    floods = Attack(lambda: header_flood(host, http_port, connections=4, mib_each=16, seconds=10), at_least_s=seconds)
    slow = Attack(lambda: hold_connections(host, http_port, connections=50, seconds=12, trickle_every_s=1.0),
                  at_least_s=seconds)  # fmt: skip
    idle_conns = Attack(lambda: hold_connections(host, http_port, connections=50, seconds=12, trickle_every_s=None),
                        at_least_s=seconds)  # fmt: skip
    for attack in (floods, slow, idle_conns):
        attack.start()
    bodies = send_all(f"http://{host}:{http_port}", hostile_requests(model), seconds=seconds, token="tok-alice")
    flood = floods.result(seconds + 120)
    held = [slow.result(seconds + 120), idle_conns.result(seconds + 120)]
    summary = health.stop().summary()
    flood_5xx = sum(a.startswith("HTTP/1.1 5") for a in flood.answers)
    return {
        "http_requests": bodies.requests,
        "http_5xx": bodies.server_errors + flood_5xx,
        "http_wrong_answers": bodies.wrong,
        "http_statuses": {str(k): v for k, v in sorted(bodies.statuses.items(), key=str)},
        "attacks": {
            "header_flood_rounds": floods.rounds,
            "flood_answers": sorted(set(flood.answers)),
            "slow_rounds": slow.rounds,
            "idle_rounds": idle_conns.rounds,
            "held_open_at_end": sum(h.open_at_end for h in held),
        },  # fmt: skip
        "health": summary,
        "idle_health": idle_summary,
        "rss_mb": {"before": round(rss_before, 1), "peak": summary["peak_rss_mb"], "after": round(rss_mb(pid), 1)},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="chaos requests after the warm-up (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="chaos requests before the first RSS reading")
    p.add_argument("--fuzz", type=int, default=5000, help="fuzzed calls (default 5000)")
    p.add_argument("--stall-seconds", type=float, default=20.0, help="how long 15 MiB requests arrive")
    p.add_argument("--http-seconds", type=float, default=30.0, help="how long the HTTP phase's attacks run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-model", action="store_true", help="the tiny fp32 random model instead of the default")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tokens_file = Path(tmp) / "tokens.txt"
        tokens_file.write_text("".join(f"{t} {tenant}\n" for t, tenant in TOKENS.items()) + f"{ADMIN} ops admin\n")
        model = ("--random-model",) if args.random_model else ()
        worker_args = ["--kv-pages", "48", "--max-step-tokens", "128", "--auth-tokens", str(tokens_file),
                       "--http-port", "0"]  # fmt: skip
        with WorkerProcess(*worker_args, model=model) as worker:
            pid = worker.proc.pid
            http_port = int(worker.lines.get(timeout=30).split()[-1].rsplit(":", 1)[1].split("/")[0])
            with Client(worker.target, token="tok-alice") as c:
                info = c.model_info()
            say(f"worker {info['model_name']} ({info['dtype']}) at {worker.target}, {info['kv_pages']} pages")
            context = info["context_length"]
            vocab = info["vocab_size"]
            workload = Workload.build(args.seed, vocab=vocab, page_size=info["page_size"], max_tokens=96)
            assert max(len(r) for r in workload.references) + 40 + workload.max_tokens <= context
            expected = reference_tokens(worker.target, "tok-alice", workload)
            warm = run_chaos(worker.target, TOKENS, workload, expected, count=args.warmup, seed=args.seed + 1,
                             concurrency=args.concurrency, seconds=600)  # fmt: skip
            wait_idle(worker.target, ADMIN)
            rss_before = rss_mb(pid)
            say(f"warm-up: {warm.requests} requests; worker RSS {rss_before:.1f} MB")
            started = time.monotonic()
            report = run_chaos(worker.target, TOKENS, workload, expected, count=args.requests, seed=args.seed + 2,
                               concurrency=args.concurrency, seconds=1800)  # fmt: skip
            idle = wait_idle(worker.target, ADMIN)
            rss_after = rss_mb(pid)
            say(
                f"chaos: {report.requests} requests in {time.monotonic() - started:.0f} s, {report.cancelled} "
                f"cancelled, {report.aborted} aborted, {report.references_checked} references checked, "
                f"{idle['preemptions']:.0f} preemptions; statuses {dict(report.statuses)}; admin "
                f"{dict(report.admin_calls)}; RSS {rss_after:.1f} MB"
            )
            http = http_phase(worker, http_port, info["model_name"], args.http_seconds)
            say(f"http: {http['http_requests']} requests, statuses {http['http_statuses']}, attacks {http['attacks']}, "
                f"health {http['health']} (idle {http['idle_health']}), RSS {http['rss_mb']}")  # fmt: skip
            fuzz = run_wire_fuzz(worker.target, count=args.fuzz, seconds=1200, seed=args.seed, metadata=ALICE)
            say(f"fuzz: {fuzz.calls} calls, statuses {dict(fuzz.statuses)}")
            half = args.stall_seconds / 2
            parsed = measure_loop_stall(worker.target, seconds=half, payload_mib=3.5, metadata=ALICE)
            say(f"loop stall, 3.5 MiB requests (under the 4 MiB message limit: parsed, then refused): {parsed}")
            over = measure_loop_stall(worker.target, seconds=half, payload_mib=15.0, metadata=ALICE)
            say(f"loop stall, 15 MiB requests (over it: refused by gRPC's core): {over}")
            stall_ms = max(parsed.max_loop_stall_ms, over.max_loop_stall_ms)
            leaks = {t: wait_idle(worker.target, t) for t in [*TOKENS, ADMIN]}
            rss_end = rss_mb(pid)
            worker.terminate()
            exit_code = worker.wait(60)
            log = worker.log()
    s = leaks[ADMIN]
    leaked = int(s["live_leases"])
    pages_ok = s["pages_in_use"] == 0 and s["pages_free"] + s["pages_cached"] == s["pages_total"]
    broken = report.broken + warm.broken + [f"fuzz: {u}" for u in fuzz.unexpected]
    broken += [f"http: {w}" for w in http["http_wrong_answers"]]
    front_max = max(http["health"]["grpc_health_max_ms"], http["health"]["http_health_max_ms"])
    max_health_stall_ms = max(stall_ms, front_max)
    result = {
        "requests": report.requests + warm.requests,
        "cancelled": report.cancelled + warm.cancelled,
        "leaked_leases": leaked,
        "unknown_or_internal": report.unknown_or_internal + warm.unknown_or_internal + fuzz.unknown_or_internal,
        "rss_growth_mb": round(rss_after - rss_before, 1),
        "max_loop_stall_ms": stall_ms,
        "http_requests": http["http_requests"],
        "http_5xx": http["http_5xx"],
        "max_health_stall_ms": max_health_stall_ms,
        "http_health_ms": {k: v for k, v in http["health"].items() if k.endswith("_ms")},
        "http_idle_health_ms": {k: v for k, v in http["idle_health"].items() if k.endswith("_ms")},
        "http_rss_mb": http["rss_mb"],
        "fuzz_calls": fuzz.calls,
        "aborted": report.aborted + warm.aborted,
        "broken_promises": len(broken),
        "pages_accounted": pages_ok,
        "rss_mb": {"after_warmup": round(rss_before, 1), "after_chaos": round(rss_after, 1), "end": round(rss_end, 1)},
        "model": f"{info['model_name']} {info['dtype']}",
        "worker_exit": exit_code,
        "tracebacks_in_log": log.count("Traceback"),
    }
    for line in broken[:10]:
        say(f"BROKEN: {line}")
    print(json.dumps(result), flush=True)
    ok = (
        leaked == 0
        and pages_ok
        and not broken
        and result["unknown_or_internal"] == 0
        and max_health_stall_ms < 100
        and http["http_5xx"] == 0
        and exit_code == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
