"""`make bench`: a small version of every serving benchmark, one table, and a JSON object as the LAST line.

    .venv/bin/python bench/run_all.py [--tiny] [--skip-decode] [--smoke]

Runs, each in its own process (so torch settings and memory do not leak between them): hf_baseline.py (gsp and
unique through transformers' generate), serve_bench.py (cache-on and cache-off workers side by side: gsp, multiturn,
unique; plots into bench/plots/), decode_floor.py. Sizes are the scripts' defaults (scaled to a 2-core CPU), or
minimal ones with --tiny (the plumbing on the real checkpoint: the figures mean nothing). Results:
bench/results/*.json. --smoke runs every script in its own --smoke mode (the two-layer checkpoint, seconds), files
under bench/results/smoke/; each script's last line is its JSON, and the LAST line of all is the summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PLOTS, REPO, RESULTS, SMOKE_HELP, SMOKE_RESULTS, bench_checkpoint  # noqa: E402

HERE = Path(__file__).resolve().parent
TINY_GSP = ["--groups", "2", "--prompts", "3", "--system", "64", "--question", "8", "--output", "4"]
TINY_UNIQUE = ["--unique-n", "2", "--unique-prompt", "32", "--unique-output", "4"]
TINY_MT = ["--mt-rounds", "3", "--mt-system", "64", "--mt-user", "8", "--mt-output", "4", "--unique-repeats", "1"]


def run(script: str, *args: str) -> None:
    cmd = [sys.executable, str(HERE / script), *args]
    print(f"$ {' '.join(Path(c).name if i < 2 else c for i, c in enumerate(cmd))}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="minimal sizes: checks the plumbing in about a minute")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--threads", default="1", help="torch threads of every process (workers, HF, decode)")
    p.add_argument("--plots", default=str(PLOTS))
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    start = time.perf_counter()
    bench_checkpoint(args.smoke)
    results = SMOKE_RESULTS if args.smoke else RESULTS
    if args.smoke and args.plots == str(PLOTS):
        args.plots = str(SMOKE_RESULTS / "plots")
    smoke = ["--smoke"] if args.smoke else []
    gsp = TINY_GSP if args.tiny else []
    unique = TINY_UNIQUE if args.tiny else []
    threads = ["--threads", args.threads]
    run("hf_baseline.py", *smoke, *gsp, *unique, *threads, "--out", str(results / "hf.json"))
    serve_args = [*smoke, *gsp, *unique, *(TINY_MT if args.tiny else []), *threads, "--plots", args.plots]
    if args.tiny:
        serve_args += ["--sweep", "1,8"]
    run("serve_bench.py", *serve_args, "--hf-json", str(results / "hf.json"), "--out", str(results / "serve.json"))
    if not args.skip_decode:
        decode = ["--context", "64", "--steps", "3", "--batches", "1,4,16"] if args.tiny else []
        run("decode_floor.py", *smoke, *decode, *threads, "--out", str(results / "decode_floor.json"))

    serve = json.loads((results / "serve.json").read_text())
    hf = json.loads((results / "hf.json").read_text())
    dec = json.loads((results / "decode_floor.json").read_text()) if not args.skip_decode else {}
    print_table(serve, hf, dec)
    g, mt, u = serve["gsp"], serve["multiturn"], serve["unique"]
    sweep = g["throughput_vs_concurrency"]["cache_on"]
    summary: dict[str, Any] = {
        "gsp_ttft_speedup": ratio(g["cache_off"]["ttft_p50_s"], g["cache_on"]["ttft_p50_s"]),
        # Same concurrency on both sides: radixcache with hf's batch size as its number of concurrent clients.
        "gsp_throughput_vs_hf": ratio(sweep[str(hf["gsp"]["batch_size"])], hf["gsp"]["throughput_tok_s"]),
        "gsp_hit_rate_of_max": round(g["cache_on"]["hit_rate_of_max"], 4),
        "multiturn_ttft_speedup": ratio(
            mt["cache_off"]["ttft_p50_rounds3plus_s"], mt["cache_on"]["ttft_p50_rounds3plus_s"]
        ),
        "unique_overhead": round(u["overhead"], 4),
        "decode_b1_over_floor": round(dec["b1_over_floor"], 3) if dec else None,
        "decode_b16_over_b1": round(dec["b16_over_b1"], 3) if dec and "b16_over_b1" in dec else None,
        "gsp_best_throughput_vs_hf": ratio(max(sweep.values()), hf["gsp"]["throughput_tok_s"]),
        "unique_overhead_abba_sums": round(u["overhead_abba_sums"], 4),
        "gsp_throughput_vs_cache_off": ratio(g["cache_on"]["throughput_tok_s"], g["cache_off"]["throughput_tok_s"]),
        "unique_throughput_vs_hf": ratio(u["cache_on"]["throughput_tok_s"], hf["unique"]["throughput_tok_s"]),
        "multiturn_hit_rate_of_max": round(mt["cache_on"]["hit_rate_of_max"], 4),
        "greedy_outputs_identical_on_off": bool(g.get("outputs_identical")) and bool(mt.get("outputs_identical")),
        "cache_check": dec.get("cache_check"),
        "decode_speculate": dec.get("speculate"),
        "tiny": args.tiny,
        "smoke": args.smoke,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary))


def print_table(serve: dict[str, Any], hf: dict[str, Any], dec: dict[str, Any]) -> None:
    def ms(x: float) -> str:
        return f"{1000 * x:9.0f}"

    print()
    head = f"{'workload / system':<28}{'tok/s':>9}{'TTFT p50':>9}{'p90':>9}{'p99':>9}{'TPOT p50':>9}{'p99':>9}"
    print(head + f"{'cached':>9}{'hit %':>7}{'max %':>7}")
    print("-" * (len(head) + 23))
    for name in ("gsp", "multiturn", "unique"):
        w = serve[name]
        systems = [(f"{name} radixcache cache on", w["cache_on"]), (f"{name} radixcache cache off", w["cache_off"])]
        if name in hf:
            systems.append((f"{name} transformers b{hf[name]['batch_size']}", hf[name]))
        for label, s in systems:
            line = f"{label:<28}{s['throughput_tok_s']:9.1f}{ms(s['ttft_p50_s'])}{ms(s['ttft_p90_s'])}"
            line += f"{ms(s['ttft_p99_s'])}{ms(s['tpot_p50_s'])}{ms(s['tpot_p99_s'])}"
            if "hit_rate" in s:
                line += f"{s['cached_tokens']:9d}{100 * s['hit_rate']:7.1f}{100 * s['max_hit_rate']:7.1f}"
            print(line)
    mt = serve["multiturn"]
    rounds = mt["cache_on"]["ttft_p50_by_round_s"]
    print(
        "multiturn TTFT p50 by round (ms), on / off: "
        + ", ".join(
            f"r{r} {1000 * rounds[r]:.0f}/{1000 * mt['cache_off']['ttft_p50_by_round_s'][r]:.0f}" for r in rounds
        )
    )
    u = serve["unique"]
    walls = {k: ", ".join(f"{w:.2f}" for w in u[k]["walls_s"]) for k in ("cache_on", "cache_off")}
    print(
        f"unique walls (s; order {' '.join(x.replace('cache_', '') for x in u['order'])}): on {walls['cache_on']};"
        f" off {walls['cache_off']}; min on/min off {u['overhead']:.3f}, ABBA sums {u['overhead_abba_sums']:.3f}"
    )
    sweep = serve["gsp"]["throughput_vs_concurrency"]["cache_on"]
    print("gsp cache-on throughput by concurrency: " + ", ".join(f"{c}: {t:.1f} tok/s" for c, t in sweep.items()))
    if dec:
        print(
            f"copy bandwidth {dec['copy_bandwidth_bytes_s'] / 1e9:.2f} GB/s (read+write), "
            f"read bandwidth {dec['read_bandwidth_bytes_s'] / 1e9:.2f} GB/s; {dec['threads']} torch thread(s)"
        )
        for r in dec["rows"]:
            print(
                f"decode batch {r['batch']:<3} ctx {r['context_tokens'] / r['batch']:5.0f}: {1000 * r['step_s']:7.1f}"
                f" ms/step (median {1000 * r['step_median_s']:.1f}), floor {1000 * r['floor_s']:6.1f} ms (x{r['over_floor']:.2f}), {r['tokens_per_s']:7.1f} tok/s"
            )


if __name__ == "__main__":
    main()
