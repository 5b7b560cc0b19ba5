"""What the gRPC path costs: the same workload through the client to a worker process, and through engine.submit
in this process, measured side by side in one run (same model, same engine config, cold caches, distinct prompts).

    .venv/bin/python scripts/grpc_overhead.py [--requests 20] [--max-tokens 64] [--prompt 32] [--model PATH]

Prints, for sequential requests (latency) and for all requests at once (throughput): wall time, mean time to first
token, mean time per request, tokens/s, and the gRPC/in-process ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from worker_process import WorkerProcess  # noqa: E402

from radixcache.client import Client  # noqa: E402


def prompts(n: int, length: int, salt: int, vocab: int) -> list[list[int]]:
    return [[3 + (i * 31 + r * 17 + salt * 7) % (vocab - 3) for i in range(length)] for r in range(n)]


def run_grpc(target: str, work: list[list[int]], max_tokens: int, concurrent: bool) -> tuple[float, list[float]]:
    ttfts: list[float] = []
    lock = threading.Lock()

    def one(c: Client, p: list[int]) -> None:
        t0 = time.perf_counter()
        first = None
        n = 0
        for chunk in c.generate(token_ids=p, max_tokens=max_tokens, ignore_eos=True):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
        assert n == max_tokens
        with lock:
            ttfts.append(first or 0.0)

    with Client(target) as c:
        t0 = time.perf_counter()
        if concurrent:
            threads = [threading.Thread(target=one, args=(c, p)) for p in work]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for p in work:
                one(c, p)
        return time.perf_counter() - t0, ttfts


def run_engine(
    engine, work: list[list[int]], max_tokens: int, concurrent: bool, salt: str
) -> tuple[float, list[float]]:
    from radixcache.worker.engine.request import Request, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ttfts: list[float] = []

    def submit(i: int, p: list[int]) -> threading.Event:
        done = threading.Event()
        t0 = time.perf_counter()
        state = {"first": None, "n": 0}

        def on_output(out) -> None:
            if state["first"] is None and out.token_ids:
                state["first"] = time.perf_counter() - t0
            state["n"] += len(out.token_ids)
            if out.finished:
                assert state["n"] == max_tokens
                ttfts.append(state["first"] or 0.0)
                done.set()

        engine.submit(Request(f"{salt}-{i}", p, sampling), on_output)
        return done

    t0 = time.perf_counter()
    if concurrent:
        for d in [submit(i, p) for i, p in enumerate(work)]:
            d.wait()
    else:
        for i, p in enumerate(work):
            submit(i, p).wait()
    return time.perf_counter() - t0, ttfts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--model", help="checkpoint folder (default: --random-model)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from radixcache.worker.cli import load_model, parser
    from radixcache.worker.engine.engine import Engine, EngineConfig

    serve_args = ["--page-size", "16", "--kv-memory", "256MiB", "--device", "cpu"]
    model_args = ("--model", args.model) if args.model else ("--random-model",)
    loaded, name, _ = load_model(parser().parse_args([*model_args, *serve_args]))
    engine = Engine(loaded, EngineConfig(page_size=16, kv_memory_bytes=256 << 20, backend="torch"))
    engine.start()
    vocab = loaded.config.vocab_size
    rows = []
    with WorkerProcess(*serve_args, model=model_args) as worker:
        for rep in range(args.repeats):
            for concurrent in (False, True):
                salt = rep * 2 + int(concurrent)
                work = prompts(args.requests, args.prompt, salt, vocab)
                # alternate the order, so neither path always runs first
                g = run_grpc(worker.target, work, args.max_tokens, concurrent)
                e = run_engine(engine, work, args.max_tokens, concurrent, f"r{salt}")
                rows.append((rep, "concurrent" if concurrent else "sequential", g, e))
    engine.shutdown()
    tokens = args.requests * args.max_tokens
    print(
        f"model {name}, {args.requests} requests x {args.max_tokens} tokens (prompt {args.prompt}), torch backend, CPU"
    )
    print(f"{'rep':>3} {'mode':<11} {'path':<10} {'wall s':>7} {'tok/s':>7} {'mean TTFT ms':>12} {'ratio':>6}")
    for rep, mode, g, e in rows:
        for path, (wall, ttft) in (("in-proc", e), ("gRPC", g)):
            ratio = wall / e[0]
            print(
                f"{rep:>3} {mode:<11} {path:<10} {wall:7.3f} {tokens / wall:7.0f} "
                f"{1000 * statistics.mean(ttft):12.2f} {ratio:6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
