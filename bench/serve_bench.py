"""Serving benchmark over gRPC: N concurrent clients drive radixcache workers with three workloads.

    .venv/bin/python bench/serve_bench.py                      # cache on vs off, side by side, defaults below
    .venv/bin/python bench/serve_bench.py --target HOST:PORT   # drive one running worker (no on/off comparison)

Workloads (token-id prompts, greedy, ignore_eos, exactly --*-output tokens each):
- gsp: SGLang's generated shared prefix: G groups x P prompts; S-token system prompt shared within a group, then
  a Q-token question; O output tokens. Sent by `--concurrency` closed-loop clients, round-robin over groups.
- multiturn: C clients x R rounds; round r+1's prompt = round r's prompt + its answer + U new user tokens.
- unique: nothing shared (what the cache machinery costs when it cannot help); run on, off, off, on (ABBA).

Two workers of the same binary run side by side, one with --no-cache; each workload starts on a flushed cache.
Reports output throughput, TTFT p50/p90/p99, TPOT p50/p99, cached tokens and the hit rate against the workload's
theoretical maximum (common.max_reusable). Writes a JSON result and PNG plots; the LAST line printed is that result
without its per-request records. --smoke: the two-layer smoke checkpoint, a few short requests per workload, files
under bench/results/smoke/ (the figures mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    PLOTS,
    RESULTS,
    SMOKE_HELP,
    SMOKE_RESULTS,
    Job,
    Worker,
    bench_checkpoint,
    gsp_workload,
    max_reusable,
    multiturn_first_round,
    next_round,
    percentile,
    smoke_out,
    unique_workload,
    write_json,
)

from radixcache.client import AsyncClient, Client  # noqa: E402


@dataclass
class Record:
    name: str
    group: int
    round: int
    client: int
    t_send: float
    t_first: float
    t_end: float
    prompt_tokens: int
    cached_tokens: int
    output: list[int]
    prompt: list[int]

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_send

    @property
    def tpot(self) -> float | None:
        n = len(self.output)
        return (self.t_end - self.t_first) / (n - 1) if n > 1 else None


async def _one(client: AsyncClient, job: Job, t0: float) -> Record:
    t_send = time.perf_counter() - t0
    t_first = None
    out: list[int] = []
    prompt_tokens = cached = 0
    async for chunk in client.generate(
        token_ids=job.prompt, max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True, request_id=job.name
    ):
        if chunk.token_ids and t_first is None:
            t_first = time.perf_counter() - t0
        out.extend(chunk.token_ids)
        if chunk.prompt_tokens:
            prompt_tokens, cached = chunk.prompt_tokens, chunk.cached_tokens
    t_end = time.perf_counter() - t0
    if len(out) != job.max_tokens:
        raise RuntimeError(f"{job.name}: {len(out)} tokens streamed, expected {job.max_tokens}")
    return Record(
        job.name, job.group, job.round, job.client, t_send, t_first or t_end, t_end, prompt_tokens, cached, out,
        job.prompt,
    )  # fmt: skip


async def run_queue(target: str, jobs: list[Job], concurrency: int) -> tuple[list[Record], float]:
    """Closed loop: `concurrency` clients, each sending the next job of the queue when its last one ended."""
    async with AsyncClient(target) as client:
        queue: asyncio.Queue[Job] = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        records: list[Record] = []
        t0 = time.perf_counter()

        async def worker() -> None:
            while not queue.empty():
                records.append(await _one(client, queue.get_nowait(), t0))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - t0


async def run_multiturn(target: str, first: list[Job], rounds: int, user: int, seed: int) -> tuple[list[Record], float]:
    """Each client runs its rounds in order; clients run concurrently. The user tokens of round r of client c
    come from a per-client seeded generator, so cache on and cache off see the same prompts when the answers
    agree (greedy with the same kernels: they must)."""
    async with AsyncClient(target) as client:
        records: list[Record] = []
        t0 = time.perf_counter()

        async def conversation(job: Job) -> None:
            rng = random.Random(seed * 1000 + job.client)
            for r in range(rounds):
                rec = await _one(client, job, t0)
                records.append(rec)
                if r + 1 < rounds:
                    job = next_round(job, rec.output, user, rng)

        await asyncio.gather(*(conversation(j) for j in first))
        return records, time.perf_counter() - t0


def summarize(records: list[Record], wall: float, page_size: int = 1) -> dict[str, Any]:
    """Throughput, latency percentiles, and hit rate against the theoretical maximum (arrival = send order)."""
    recs = sorted(records, key=lambda r: r.t_send)
    prompts = [r.prompt for r in recs]
    computed = [r.prompt + r.output[:-1] for r in recs]
    maxima = max_reusable(prompts, computed, page_size)
    prompt_total = sum(r.prompt_tokens for r in recs)
    cached_total = sum(r.cached_tokens for r in recs)
    out_total = sum(len(r.output) for r in recs)
    ttft = [r.ttft for r in recs]
    tpot = [t for t in (r.tpot for r in recs) if t is not None]
    hit = cached_total / prompt_total if prompt_total else 0.0
    max_hit = sum(maxima) / prompt_total if prompt_total else 0.0
    return {
        "requests": len(recs),
        "wall_s": wall,
        "output_tokens": out_total,
        "throughput_tok_s": out_total / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "prompt_tokens": prompt_total,
        "cached_tokens": cached_total,
        "max_cached_tokens": sum(maxima),
        "hit_rate": hit,
        "max_hit_rate": max_hit,
        "hit_rate_of_max": hit / max_hit if max_hit else float("nan"),
    }


def _rows(records: list[Record]) -> list[dict[str, Any]]:
    """Per-request rows for the JSON, in send order, each with the most any cache could have served it."""
    keep = ("name", "group", "round", "client", "t_send", "t_first", "t_end", "prompt_tokens", "cached_tokens")
    recs = sorted(records, key=lambda r: r.t_send)
    maxima = max_reusable([r.prompt for r in recs], [r.prompt + r.output[:-1] for r in recs])
    return [
        {k: v for k, v in asdict(r).items() if k in keep} | {"output_tokens": len(r.output), "max_cached": m}
        for r, m in zip(recs, maxima, strict=True)
    ]


def flushed(target: str) -> None:
    with Client(target) as c:
        c.flush()


def bench_gsp(targets: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    jobs = gsp_workload(args.groups, args.prompts, args.system, args.question, args.output, seed=args.seed)
    result: dict[str, Any] = {"params": {k: getattr(args, k) for k in ("groups", "prompts", "system", "question")}}
    result["params"] |= {"output": args.output, "concurrency": args.concurrency}
    outputs = {}
    for label, target in targets.items():
        flushed(target)
        records, wall = asyncio.run(run_queue(target, jobs, args.concurrency))
        result[label] = summarize(records, wall) | {"records": _rows(records)}
        outputs[label] = {r.name: r.output for r in records}
        print(f"  gsp {label:<9} {_line(result[label])}", flush=True)
    if len(outputs) == 2:
        result["outputs_identical"] = outputs["cache_on"] == outputs["cache_off"]
    # Throughput against concurrency, cache on (the main concurrency comes from the run above).
    sweep = {args.concurrency: result[next(iter(targets))]["throughput_tok_s"]}
    label, target = next(iter(targets.items()))
    for c in args.sweep:
        if c in sweep:
            continue
        flushed(target)
        records, wall = asyncio.run(run_queue(target, jobs, c))
        sweep[c] = summarize(records, wall)["throughput_tok_s"]
        print(f"  gsp {label} concurrency {c}: {sweep[c]:.1f} tok/s", flush=True)
    result["throughput_vs_concurrency"] = {label: {str(k): sweep[k] for k in sorted(sweep)}}
    return result


def bench_multiturn(targets: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    first = multiturn_first_round(args.mt_clients, args.mt_system, args.mt_user, args.mt_output, seed=args.seed + 2)
    result: dict[str, Any] = {
        "params": {
            "clients": args.mt_clients,
            "rounds": args.mt_rounds,
            "system": args.mt_system,
            "user": args.mt_user,
            "output": args.mt_output,
        }
    }
    outputs = {}
    for label, target in targets.items():
        flushed(target)
        records, wall = asyncio.run(run_multiturn(target, first, args.mt_rounds, args.mt_user, args.seed))
        s = summarize(records, wall)
        by_round = {}
        for r in range(args.mt_rounds):
            ttft = [x.ttft for x in records if x.round == r]
            by_round[str(r + 1)] = percentile(ttft, 50)
        late = [x.ttft for x in records if x.round + 1 >= 3]
        s |= {"ttft_p50_by_round_s": by_round, "ttft_p50_rounds3plus_s": percentile(late, 50)}
        result[label] = s | {"records": _rows(records)}
        outputs[label] = {x.name: x.output for x in records}
        print(f"  multiturn {label:<9} {_line(s)} rounds>=3 TTFT p50 {1000 * s['ttft_p50_rounds3plus_s']:.0f} ms")
    if len(outputs) == 2:
        result["outputs_identical"] = outputs["cache_on"] == outputs["cache_off"]
    return result


def bench_unique(targets: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    jobs = unique_workload(args.unique_n, args.unique_prompt, args.unique_output, seed=args.seed + 1)
    labels = list(targets)
    # ABBA (on, off, off, on, ...): a linear drift in machine load cancels out of the sums.
    if len(labels) == 2:
        order = [labels[1 if i % 4 in (1, 2) else 0] for i in range(2 * args.unique_repeats)]
    else:
        order = labels * args.unique_repeats
    walls: dict[str, list[float]] = {label: [] for label in labels}
    summaries: dict[str, dict[str, Any]] = {}
    for label in order:
        flushed(targets[label])
        records, wall = asyncio.run(run_queue(targets[label], jobs, args.concurrency))
        walls[label].append(wall)
        summaries[label] = summarize(records, wall)
    result: dict[str, Any] = {
        "params": {"n": args.unique_n, "prompt": args.unique_prompt, "output": args.unique_output},
        "order": order,
    }
    for label in labels:
        result[label] = summaries[label] | {"walls_s": walls[label], "wall_total_s": sum(walls[label])}
        print(f"  unique {label:<9} walls {', '.join(f'{w:.2f}' for w in walls[label])} s", flush=True)
    if len(labels) == 2:
        # Interference from other processes only ever adds time, so the fastest run of each side is the best
        # estimate of its own cost; the ratio of the ABBA sums is kept beside it.
        result["overhead"] = min(walls["cache_on"]) / min(walls["cache_off"])
        result["overhead_abba_sums"] = result["cache_on"]["wall_total_s"] / result["cache_off"]["wall_total_s"]
    return result


def _line(s: dict[str, Any]) -> str:
    return (
        f"{s['throughput_tok_s']:7.1f} tok/s  TTFT p50 {1000 * s['ttft_p50_s']:7.0f} ms  p90 {1000 * s['ttft_p90_s']:7.0f}"
        f" ms  TPOT p50 {1000 * s['tpot_p50_s']:6.0f} ms  hit {100 * s['hit_rate']:5.1f}% of max"
        f" {100 * s['max_hit_rate']:5.1f}%"
    )


# --- plots ------------------------------------------------------------------------------------------------------
def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    gsp = result.get("gsp")
    if gsp and "cache_on" in gsp:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for label, color in (("cache_on", "tab:blue"), ("cache_off", "tab:red")):
            if label not in gsp:
                continue
            ttft = sorted(r["t_first"] - r["t_send"] for r in gsp[label]["records"])
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", color=color,
                    label=f"{label.replace('_', ' ')} (p50 {1000 * percentile(ttft, 50):.0f} ms)")  # fmt: skip
        p = gsp["params"]
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"gsp TTFT: {p['groups']}x{p['prompts']} prompts, {p['system']}-token shared prefix")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir / "ttft_cache_on_vs_off.png"))

        fig, ax = plt.subplots(figsize=(6.4, 4))
        for name, color in (("gsp", "tab:blue"), ("multiturn", "tab:green")):
            w = result.get(name, {}).get("cache_on")
            if not w:
                continue
            recs = sorted(w["records"], key=lambda r: r["t_end"])
            cached = prompt = best = 0
            xs, ys, ms = [], [], []
            for r in recs:
                cached += r["cached_tokens"]
                best += r["max_cached"]
                prompt += r["prompt_tokens"]
                xs.append(r["t_end"])
                ys.append(100 * cached / prompt)
                ms.append(100 * best / prompt)
            ax.plot(xs, ys, marker="o", ms=3, color=color, label=f"{name} (final {ys[-1]:.1f}%)")
            ax.plot(xs, ms, ls="--", lw=1, color=color, label=f"{name} theoretical max ({ms[-1]:.1f}%)")
        ax.set_xlabel("request completed at (s since the workload started)")
        ax.set_ylabel("cumulative hit rate (% of prompt tokens)")
        ax.set_title("prefix-cache hit rate over time (cache on)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, out_dir / "hit_rate_over_time.png"))

        fig, ax = plt.subplots(figsize=(6.4, 4))
        for label, curve in gsp.get("throughput_vs_concurrency", {}).items():
            xs = [int(k) for k in curve]
            ax.plot(xs, list(curve.values()), marker="o", label=f"radixcache, {label.replace('_', ' ')}")
        c = gsp["params"]["concurrency"]
        if "cache_off" in gsp:
            ax.plot([c], [gsp["cache_off"]["throughput_tok_s"]], "s", color="tab:red", label="radixcache, cache off")
        hf = result.get("hf", {}).get("gsp")
        if hf:
            ax.plot([hf["batch_size"]], [hf["throughput_tok_s"]], "^", color="black",
                    label=f"transformers generate (batch {hf['batch_size']})")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (transformers: batch size)")
        ax.set_ylabel("output tokens / s")
        ax.set_title("gsp throughput against concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, out_dir / "throughput_vs_concurrency.png"))

    mt = result.get("multiturn")
    if mt and "cache_on" in mt:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        rounds = list(mt["cache_on"]["ttft_p50_by_round_s"])
        width = 0.4
        for i, (label, color) in enumerate((("cache_on", "tab:blue"), ("cache_off", "tab:red"))):
            if label in mt:
                ys = [1000 * mt[label]["ttft_p50_by_round_s"][r] for r in rounds]
                ax.bar([k + (i - 0.5) * width for k in range(len(rounds))], ys, width, color=color,
                       label=label.replace("_", " "))  # fmt: skip
        ax.set_xticks(range(len(rounds)), [f"round {r}" for r in rounds])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT p50 (ms, log)")
        ax.set_title("multiturn: TTFT by round")
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
        written.append(_save(fig, out_dir / "multiturn_ttft_by_round.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# --- main -------------------------------------------------------------------------------------------------------
SMOKE_SIZES = {
    "concurrency": 2, "sweep": "1", "groups": 2, "prompts": 2, "system": 48, "question": 8, "output": 3,
    "mt_clients": 2, "mt_rounds": 3, "mt_system": 32, "mt_user": 8, "mt_output": 3, "unique_n": 2,
    "unique_prompt": 16, "unique_output": 3, "unique_repeats": 1, "kv_memory": "16MiB",
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="HF checkpoint (default: build the random ~125M Llama once)")
    p.add_argument("--target", help="drive this running worker (HOST:PORT) instead of starting cache on/off workers")
    p.add_argument("--workloads", default="gsp,multiturn,unique")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop clients (gsp, unique)")
    p.add_argument("--sweep", default="1,8,16", help="more concurrencies for the cache-on gsp throughput curve")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per group")
    p.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--output", type=int, default=8)
    p.add_argument("--mt-clients", type=int, default=2)
    p.add_argument("--mt-rounds", type=int, default=4)
    p.add_argument("--mt-system", type=int, default=512, help="first round's preamble per client")
    p.add_argument("--mt-user", type=int, default=32, help="new user tokens per round")
    p.add_argument("--mt-output", type=int, default=16)
    p.add_argument("--unique-n", type=int, default=8)
    p.add_argument("--unique-prompt", type=int, default=128)
    p.add_argument("--unique-output", type=int, default=16)
    p.add_argument("--unique-repeats", type=int, default=5, help="runs per side (ABBA order)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-memory", default="512MiB")
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker (OMP_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    p.add_argument("--plots", default=str(PLOTS), help="folder for PNGs ('' for none)")
    p.add_argument("--hf-json", type=Path, help="hf_baseline.py result to draw on the throughput plot")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE_SIZES)
        if args.plots == str(PLOTS):  # never over the committed plots
            args.plots = str(SMOKE_RESULTS / "plots")
    args.out = smoke_out(args.out, args.smoke)
    args.sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    workers: list[Worker] = []
    try:
        if args.target:
            targets = {"worker": args.target}
        else:
            model = args.model or bench_checkpoint(args.smoke)
            common = ["--page-size", str(args.page_size), "--kv-memory", args.kv_memory]
            common += ["--max-step-tokens", str(args.max_step_tokens)]
            on = Worker(model, *common, name="cache-on", threads=args.threads)
            off = Worker(model, *common, "--no-cache", name="cache-off", threads=args.threads)
            workers = [on, off]
            for w in workers:
                w.start()
            targets = {"cache_on": on.target, "cache_off": off.target}
        # One short request per worker first: the first gRPC call and the first real-sized forward pay one-time costs.
        warm = unique_workload(2, 64, 2, seed=999)
        for target in targets.values():
            asyncio.run(run_queue(target, warm, 2))
        benches = {"gsp": bench_gsp, "multiturn": bench_multiturn, "unique": bench_unique}
        for name in args.workloads:
            result[name] = benches[name](targets, args)
    finally:
        for w in workers:
            w.stop()
    if args.hf_json and args.hf_json.is_file():
        result["hf"] = json.loads(args.hf_json.read_text())
    write_json(args.out, result)
    if args.plots:
        for path in plot(result, Path(args.plots)):
            print(f"  wrote {path}")
    print(json.dumps(without_records(result)))
    return result


def without_records(result: dict[str, Any]) -> dict[str, Any]:
    """The result without its per-request rows and outputs (what the last line prints)."""
    if not isinstance(result, dict):
        return result
    return {k: without_records(v) for k, v in result.items() if k not in ("records", "outputs")}


if __name__ == "__main__":
    main()
