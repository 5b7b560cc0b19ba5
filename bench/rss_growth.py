"""Resident memory of an in-process engine over many requests of varied sizes (the default bf16 model by default).

    python bench/rss_growth.py [--requests 1000] [--dtype bfloat16] [--weights int8] [--concurrency 8] [--no-row-buckets]
                               [--every 100] [--smoke]

Each step's token count differs (prompts of 1..400 tokens, 1..64 generated, several at once), which is what makes
per-shape kernel caches grow (see worker/model/llama.py `Linear`; --no-row-buckets turns its rounding off, to compare).
Prints RSS every --every requests; the LAST line is one JSON object:
{"dtype", "requests", "rss_after_warmup_mb", "rss_end_mb", "growth_mb"} where the growth is measured from the end of
the first --warmup requests (100) to the end. Bounded: a fixed number of requests, seeded. --smoke: 20 requests of
at most 48 prompt and 4 generated tokens, RSS every 5 (seconds; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SMOKE_HELP  # noqa: E402

from radixcache.worker.engine.engine import Engine, EngineConfig  # noqa: E402
from radixcache.worker.engine.request import Request, SamplingParams  # noqa: E402
from radixcache.worker.model.loader import load_checkpoint  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--dtype", default=None, help="default: the checkpoint's (bfloat16)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=100, help="requests before the baseline is taken")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request at most")
    parser.add_argument("--max-prompt", type=int, default=400, help="prompt tokens per request: fewer than this")
    parser.add_argument("--no-row-buckets", action="store_true", help="GEMMs see each step's exact row count")
    parser.add_argument("--weights", default="full", choices=("full", "int8"))
    parser.add_argument("--every", type=int, default=100, help="print RSS each time this many more requests ended")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.warmup, args.every, args.max_tokens, args.max_prompt = 20, 10, 5, 4, 48
    if args.no_row_buckets:
        from torch import nn

        from radixcache.worker.model import llama

        llama.Linear.forward = nn.Linear.forward
    import radixcache.worker.default_model as default_model

    loaded = load_checkpoint(Path(default_model.__file__).parent, dtype=args.dtype, weights=args.weights)
    engine = Engine(loaded, EngineConfig(kv_pages=256, max_step_tokens=512))
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    done = [0]

    def on_output(out) -> None:
        if out.finished:
            done[0] += 1

    submitted = 0
    baseline = None
    marks = []
    while done[0] < args.requests:
        while submitted < args.requests and submitted - done[0] < args.concurrency:
            prompt = [rng.randrange(7, vocab) for _ in range(rng.randrange(1, args.max_prompt))]
            params = SamplingParams(max_tokens=rng.randrange(1, args.max_tokens + 1), ignore_eos=True)
            engine.submit(Request(f"r{submitted}", prompt, params), on_output)
            submitted += 1
        engine.step()
        if done[0] // args.every > len(marks):  # crossed the next mark (several may finish in one step)
            marks.append((done[0], rss_mb()))
            print(f"{done[0]:5d} requests  rss {marks[-1][1]:8.1f} MB", flush=True)
            if baseline is None and done[0] >= args.warmup:
                baseline = marks[-1][1]
    end = rss_mb()
    baseline = baseline if baseline is not None else marks[0][1]
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    print(
        json.dumps(
            {
                "dtype": dtype,
                "row_buckets": not args.no_row_buckets,
                "weights": args.weights,
                "requests": args.requests,
                "smoke": args.smoke,
                "rss_after_warmup_mb": round(baseline, 1),
                "rss_end_mb": round(end, 1),
                "growth_mb": round(end - baseline, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
