"""Soft retention on an agent-session trace: do a few long system prompts survive a flood of one-off prompts?

    .venv/bin/python bench/retention_bench.py [--rounds 8] [--smoke]

The trace (seeded, the same for both policies): `agents` agent sessions, each with its own long system prompt
(--system tokens), take turns; each turn is the system prompt plus a fresh question (64 tokens) and asks its prompt
to be kept (priority 10, retention 600 s). After every turn `flood` one-off prompts (--one-off tokens) arrive: new
ones, except that one in three repeats one of the last four (what a cache without retention would still catch).
The pool holds the system prompts and not much more. One request at a time, 4 generated tokens each. Retained
pages are bounded by the pin budget (radixcache.retention): --max-pinned 100% here, so that it is not what binds.

It runs through the real engine in this process (worker.engine.Engine, torch backend, one thread, speculation
off; a random two-layer Llama-shaped model, since what is measured is what the cache keeps, not the model), once
with `--eviction-policy lru` and once with `priority`, and prints, per policy, the long prompts' hit rate (their
cached tokens over their system tokens, turns after the first round: the first is cold under either policy) and the
one-off prompts' hit rate (cached over prompt tokens), then whether the greedy answers agree (the cache never
changes an answer; the script exits 1 if not). The LAST line is one JSON object. --smoke (tests/
test_bench_smoke.py): two rounds at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SMOKE_HELP  # noqa: E402

from radixcache.retention import Retention  # noqa: E402
from radixcache.worker.engine.engine import Engine, EngineConfig  # noqa: E402
from radixcache.worker.engine.request import Request, SamplingParams  # noqa: E402
from radixcache.worker.model.config import ModelConfig  # noqa: E402
from radixcache.worker.model.loader import random_model  # noqa: E402

PAGE = 16
QUESTION = 64
KEEP = Retention(priority=10, seconds=600.0)
SHAPE = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
    max_position_embeddings=8192,
)  # fmt: skip


def trace(agents: int, rounds: int, flood: int, system: int, one_off: int, seed: int = 3) -> list[tuple]:
    """(kind, agent or -1, prompt) in arrival order; kind "agent" (retained) or "one_off"."""
    rng = random.Random(seed)
    systems = [[rng.randrange(8, 1000) for _ in range(system)] for _ in range(agents)]
    recent: list[list[int]] = []
    jobs: list[tuple] = []
    for _ in range(rounds):
        for a in range(agents):
            jobs.append(("agent", a, systems[a] + [rng.randrange(8, 1000) for _ in range(QUESTION)]))
            for _ in range(flood):
                if recent and rng.random() < 1 / 3:
                    prompt = rng.choice(recent[-4:])
                else:
                    prompt = [rng.randrange(8, 1000) for _ in range(one_off)]
                    recent.append(prompt)
                jobs.append(("one_off", -1, prompt))
    return jobs


def run(loaded, jobs: list[tuple], policy: str, pages: int, system: int, agents: int) -> dict:
    engine = Engine(loaded, EngineConfig(page_size=PAGE, kv_pages=pages, max_running=4, max_step_tokens=1024,
                                         backend="torch", speculate=0, eviction_policy=policy,
                                         max_pinned=1.0))  # fmt: skip
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    cached: dict[str, int] = {}
    answers: dict[str, list[int]] = {}

    def sink(out) -> None:  # noqa: ANN001
        cached[out.request_id] = out.cached_tokens
        answers.setdefault(out.request_id, []).extend(out.token_ids)

    start = time.perf_counter()
    for i, (kind, _, prompt) in enumerate(jobs):
        engine.submit(Request(f"{kind}-{i}", prompt, params, retention=KEEP if kind == "agent" else None), sink)
        engine.run_until_idle()
    seconds = time.perf_counter() - start
    engine.cache.check(idle=True)
    agent_ids = [f"agent-{i}" for i, (kind, _, _) in enumerate(jobs) if kind == "agent"][agents:]  # warm turns
    one_offs = [(f"one_off-{i}", len(p)) for i, (kind, _, p) in enumerate(jobs) if kind == "one_off"]
    return {
        "long": sum(min(cached[r], system) for r in agent_ids) / (system * len(agent_ids)),
        "one_off": sum(cached[r] for r, _ in one_offs) / sum(n for _, n in one_offs),
        "evicted": engine.cache.stats().evicted_pages,
        "seconds": seconds,
        "answers": answers,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--flood", type=int, default=3, help="one-off prompts after each agent turn")
    p.add_argument("--system", type=int, default=1024, help="tokens of each agent's system prompt")
    p.add_argument("--one-off", type=int, default=384, help="tokens of each one-off prompt")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.system, args.one_off = 2, 128, 64
    torch.set_num_threads(1)
    # The system prompts, one turn's question and answer, and room for about two one-offs.
    pages = args.agents * args.system // PAGE + 2 * args.one_off // PAGE + 8
    jobs = trace(args.agents, args.rounds, args.flood, args.system, args.one_off)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# retention bench: {args.agents} agents x {args.rounds} rounds, {args.system}-token system prompts, "
          f"{args.flood} one-offs of {args.one_off} after each turn; {pages} pages of {PAGE}; load: {load}")  # fmt: skip
    loaded = random_model(ModelConfig(**SHAPE), seed=0, std=0.05)
    with torch.inference_mode():
        runs = {policy: run(loaded, jobs, policy, pages, args.system, args.agents) for policy in ("lru", "priority")}
    lru, prio = runs["lru"], runs["priority"]
    print(f"{'':30} {'lru':>10} {'priority':>10}")
    print(f"{'long prompts: hit rate':30} {lru['long']:>10.3f} {prio['long']:>10.3f}")
    print(f"{'one-off prompts: hit rate':30} {lru['one_off']:>10.3f} {prio['one_off']:>10.3f}")
    print(f"{'pages evicted':30} {lru['evicted']:>10,} {prio['evicted']:>10,}")
    print(f"{'seconds':30} {lru['seconds']:>10.1f} {prio['seconds']:>10.1f}")
    same = lru["answers"] == prio["answers"]
    print(f"# greedy answers identical under both policies: {same}")
    result = {
        "smoke": args.smoke,
        "agents": args.agents,
        "rounds": args.rounds,
        "requests": len(jobs),
        "pages": pages,
        "long_prompt_hit_rate_lru": round(lru["long"], 4),
        "long_prompt_hit_rate_priority": round(prio["long"], 4),
        "one_off_hit_rate_lru": round(lru["one_off"], 4),
        "one_off_hit_rate_priority": round(prio["one_off"], 4),
        "evicted_pages_lru": lru["evicted"],
        "evicted_pages_priority": prio["evicted"],
        "answers_identical": same,
        "speculate": 0,
    }
    print(json.dumps(result))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
