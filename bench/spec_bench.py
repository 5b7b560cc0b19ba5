"""Speculative decoding drafted from the radix tree (issue 26): an agentic trace and unique prompts, speculation off
against on, side by side in one process, one thread.

    .venv/bin/python bench/spec_bench.py [--speculate 8] [--quick] [--smoke]

The trace (bench/traces/agentic.json, described in BENCHMARKS.md) is an agent loop: every step resends the whole
history; tool results quote the last tool call; retried steps resend a prompt unchanged; tool calls are JSON under a
schema. It runs on the trained embedded model (the headline: random weights repeat themselves and flatter
speculation) and on the ~125M random-weight bench model (with the embedded model's tokenizer, for the schema).

For each model: batch 1 (the sessions one after another), batch 8 (eight sessions at once) and unique prompts: one
untimed run on each engine, then off, on, on, off (--reps times) on fresh caches; a figure is the sum of its runs.
Tokens per second are per CPU second of this process (one torch thread: robust to the other load on a shared
machine; on a quiet one it is the wall clock), the wall-clock ratios beside them.
The trace is greedy, so every output must be the same on and off (`greedy_identical`).

Unique prompts are random tokens, 16 requests one after another: `unique` sampled at temperature 1 with a seed each
(nothing to draft from: the drafter looks every step and finds almost nothing; the same tokens on and off),
`unique_greedy` greedy (a model may copy its prompt, and then drafts pay).

The LAST line is one JSON object: agentic_speedup_b1 / agentic_speedup_b8 (tokens per second on / off, embedded
model), accepted_per_step (accepted draft tokens per verification, embedded model, batch 1), unique_overhead (on /
off time of `unique`, embedded model), greedy_identical, seeded_identical, and everything per model under "models".
--smoke: the embedded model only, one session of the trace's first four steps (8 tokens each), one unique prompt,
one repetition (seconds; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import LLAMA_125M, SMOKE_HELP  # noqa: E402

from radixcache.worker.cli import default_model_path  # noqa: E402
from radixcache.worker.engine.engine import Engine, EngineConfig  # noqa: E402
from radixcache.worker.engine.request import Constraint, Request, RequestOutput, SamplingParams  # noqa: E402
from radixcache.worker.model.config import ModelConfig  # noqa: E402
from radixcache.worker.model.loader import load_checkpoint, random_model  # noqa: E402

TRACE = Path(__file__).resolve().parent / "traces" / "agentic.json"
CONFIG_125M = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **LLAMA_125M})


# --- the trace -------------------------------------------------------------------------------------------------
class Session:
    """One agent session of the trace: yields its next request, takes the answer (see agentic.json's description).

    Prompts are built at the token level (turns rendered with the embedded model's chat markup and appended), so
    each step's prompt extends the history token for token, as an agent server continuing its own tokens does."""

    def __init__(self, trace: dict[str, Any], task: str, tokenizer: Any, context: int) -> None:
        self.tok = tokenizer
        self.trace = trace
        self.context = context
        self.steps = list(trace["steps"])
        self.history = self._turn("system", trace["system"], bos=True) + self._turn("user", task)
        self.schema = Constraint("json_schema", json.dumps(trace["tool_call_schema"]))
        self.pending: tuple[list[int], int, Constraint | None] | None = None  # the last generating step's request
        self.last_output: list[int] = []

    def _text(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _turn(self, role: str, content: str, bos: bool = False) -> list[int]:
        return self._text(("<|bos|>" if bos else "") + f"<|{role}|>\n{content}<|end|>\n")

    def next_request(self) -> tuple[list[int], SamplingParams, Constraint | None] | None:
        """The next generating step's (prompt, sampling, constraint), applying tool steps on the way; None at the end
        (or when the next step would not fit the model's context)."""
        while self.steps:
            step = self.steps.pop(0)
            kind = step["kind"]
            if kind == "tool":
                quote = self._text(f"<|user|>\nTool result: {self.trace['tool_result']}") + self.last_output
                self.history = self.history + quote + self._text("}<|end|>\n")
                continue
            if kind == "retry":
                assert self.pending is not None, "a retry needs an earlier step"
                prompt, max_tokens, constraint = self.pending
                self.history = prompt[: -len(self._text("<|assistant|>\n"))]
            else:
                prompt = self.history + self._text("<|assistant|>\n")
                max_tokens = step["max_tokens"]
                constraint = self.schema if kind == "call" else None
            if len(prompt) + max_tokens > self.context:
                return None
            self.pending = (prompt, max_tokens, constraint)
            return prompt, SamplingParams(max_tokens=max_tokens), constraint
        return None

    def answer(self, output: list[int]) -> None:
        assert self.pending is not None
        self.last_output = list(output)
        self.history = self.pending[0] + self.last_output + self._text("<|end|>\n")


@dataclass
class Run:
    wall: float = 0.0
    cpu: float = 0.0  # this process's CPU seconds (one torch thread: what the work costs, whatever else runs)
    tokens: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    draft_steps: int = 0
    steps: int = 0

    def add(self, other: Run) -> None:
        self.wall += other.wall
        self.cpu += other.cpu
        self.tokens += other.tokens
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.draft_steps += other.draft_steps
        self.steps += other.steps

    @property
    def tps(self) -> float:
        """Generated tokens per CPU second (on a quiet machine, per wall second)."""
        return self.tokens / self.cpu if self.cpu else 0.0

    @property
    def wall_tps(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


def drive(engine: Engine, sources: list[Any], concurrency: int) -> Run:
    """Run `sources` (Sessions, or lists of ready requests) with at most `concurrency` of them active at once;
    each active source has one request in flight. Returns the wall time, generated tokens and every output."""
    engine.flush_cache()
    engine.run_until_idle()
    before = engine.stats()
    run = Run()
    queue = list(enumerate(sources))
    active: dict[str, tuple[int, Any, int]] = {}  # request id -> (source index, source, step number)
    done: dict[str, list[RequestOutput]] = {}
    steps_of: dict[int, int] = {}

    def start(index: int, source: Any) -> bool:
        item = source.next_request()
        if item is None:
            return False
        prompt, params, constraint = item
        step = steps_of.get(index, 0)
        steps_of[index] = step + 1
        rid = f"s{index}-{step}"
        active[rid] = (index, source, step)
        engine.submit(
            Request(rid, prompt, params, constraint=constraint), lambda o: done.setdefault(o.request_id, []).append(o)
        )
        return True

    def fill() -> None:
        while queue and len(active) < concurrency:
            index, source = queue.pop(0)
            if not start(index, source):
                continue

    t0, c0 = time.perf_counter(), time.process_time()
    fill()
    while active:
        engine.step()
        for rid in [r for r in active if done.get(r) and done[r][-1].finished]:
            index, source, _ = active.pop(rid)
            tokens = [t for o in done[rid] for t in o.token_ids]
            run.outputs[rid] = tokens
            run.tokens += len(tokens)
            source.answer(tokens)
            if not start(index, source):
                fill()
    run.wall, run.cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.stats()
    run.drafted = after.draft_tokens - before.draft_tokens
    run.accepted = after.accepted_draft_tokens - before.accepted_draft_tokens
    run.draft_steps = after.draft_steps - before.draft_steps
    run.steps = after.steps - before.steps
    engine.cache.check(idle=True)
    return run


class Prompts:
    """A source of independent requests (the unique-prompt workloads): greedy, or sampled at temperature 1 with a
    seed per prompt (the same tokens on and off)."""

    def __init__(self, prompts: list[list[int]], max_tokens: int, sampled: bool) -> None:
        self.items = [
            (p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=float(sampled), seed=i), None)
            for i, p in enumerate(prompts)
        ]

    def next_request(self) -> tuple[list[int], SamplingParams, None] | None:
        return self.items.pop(0) if self.items else None

    def answer(self, output: list[int]) -> None:
        pass


# --- measuring ---------------------------------------------------------------------------------------------------
def side_by_side(off: Engine, on: Engine, make: Any, concurrency: int, reps: int) -> tuple[Run, Run, bool]:
    """One untimed run on each engine (the CPU kernels of this workload's shapes get built), then `reps` times off,
    on, on, off, with fresh sources each time; (off total, on total, every output identical)."""
    totals = {"off": Run(), "on": Run()}
    outputs: list[dict[str, list[int]]] = [drive(engine, make(), concurrency).outputs for engine in (off, on)]
    for name, engine in (("off", off), ("on", on), ("on", on), ("off", off)) * reps:
        run = drive(engine, make(), concurrency)
        totals[name].add(run)
        outputs.append(run.outputs)
    identical = all(o == outputs[0] for o in outputs)
    return totals["off"], totals["on"], identical


def measure_model(name: str, loaded: Any, args: argparse.Namespace, trace: dict[str, Any]) -> dict[str, Any]:
    def engine(speculate: int) -> Engine:
        e = Engine(loaded, EngineConfig(page_size=16, kv_pages=args.kv_pages, max_step_tokens=512, speculate=speculate))
        with torch.inference_mode():
            e.runner.warm_up(e.cache)
        return e

    off, on = engine(0), engine(args.speculate)
    context = loaded.config.max_position_embeddings
    tasks = trace["tasks"][: args.sessions]

    def sessions() -> list[Session]:
        return [Session(trace, task, loaded.tokenizer, context) for task in tasks]

    rng = random.Random(7)
    vocab = min(loaded.tokenizer.vocab_size, loaded.config.vocab_size)
    unique = [[rng.randrange(16, vocab) for _ in range(args.unique_prompt)] for _ in range(args.unique)]

    def unique_sampled() -> list[Prompts]:
        return [Prompts(unique, args.unique_tokens, sampled=True)]

    def unique_greedy() -> list[Prompts]:
        return [Prompts(unique, args.unique_tokens, sampled=False)]

    results: dict[str, Any] = {}
    identical = {"greedy": True, "seeded": True}
    workloads = (
        ("b1", sessions, 1, "greedy"),
        ("b8", sessions, 8, "greedy"),
        ("unique", unique_sampled, 1, "seeded"),
        ("unique_greedy", unique_greedy, 1, "greedy"),
    )
    for label, make, conc, kind in workloads:
        a, b, same = side_by_side(off, on, make, conc, args.reps)
        identical[kind] &= same
        results[label] = {
            "off_tps": round(a.tps, 2),
            "on_tps": round(b.tps, 2),
            "speedup": round(b.tps / a.tps, 3) if a.tps else 0.0,
            "time_ratio": round(b.cpu / a.cpu, 4) if a.cpu else 0.0,
            "wall_speedup": round(b.wall_tps / a.wall_tps, 3) if a.wall_tps else 0.0,
            "wall_time_ratio": round(b.wall / a.wall, 4) if a.wall else 0.0,
            "tokens": b.tokens // (2 * args.reps),
            "steps_off": a.steps // (2 * args.reps),
            "steps_on": b.steps // (2 * args.reps),
            "drafted": b.drafted // (2 * args.reps),
            "accepted": b.accepted // (2 * args.reps),
            "acceptance": round(b.accepted / b.drafted, 3) if b.drafted else 0.0,
            "accepted_per_step": round(b.accepted / b.draft_steps, 3) if b.draft_steps else 0.0,
            "identical": same,
        }
        r = results[label]
        print(
            f"{name:9} {label:13} off {r['off_tps']:8.1f} tok/cpu-s  on {r['on_tps']:8.1f}  x{r['speedup']:5.2f} "
            f"(wall x{r['wall_speedup']:5.2f})  "
            f"steps {r['steps_off']:5d} -> {r['steps_on']:5d}  drafted {r['drafted']:5d} accepted {r['accepted']:5d} "
            f"({r['acceptance']:.0%}, {r['accepted_per_step']:.2f}/verify)  identical {same}",
            flush=True,
        )
    results["greedy_identical"], results["seeded_identical"] = identical["greedy"], identical["seeded"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speculate", type=int, default=EngineConfig().speculate or 8, help="draft tokens (on)")
    parser.add_argument("--sessions", type=int, default=8, help="agent sessions of the trace (at most 8)")
    parser.add_argument("--unique", type=int, default=16, help="unique prompts")
    parser.add_argument("--unique-prompt", type=int, default=64, help="tokens per unique prompt")
    parser.add_argument("--unique-tokens", type=int, default=48, help="tokens generated per unique prompt")
    parser.add_argument("--kv-pages", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2, help="off-on-on-off repetitions per figure")
    parser.add_argument("--models", default="embedded,125m", help="comma-separated: embedded, 125m")
    parser.add_argument("--dtype", default=None, help="the embedded model's dtype (default: its checkpoint's, bf16)")
    parser.add_argument("--quick", action="store_true", help="3 sessions, 3 unique prompts, 1 repetition")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.unique, args.reps = 3, 3, 1
    trace = json.loads(TRACE.read_text())
    if args.smoke:
        args.sessions, args.unique, args.unique_prompt, args.unique_tokens, args.reps = 1, 1, 16, 8, 1
        args.models, args.kv_pages = "embedded", 256
        steps = trace["steps"][:4]  # plan, call, tool, retry: every kind of step but the answer
        trace["steps"] = [s | {"max_tokens": min(8, s["max_tokens"])} if "max_tokens" in s else s for s in steps]
    torch.set_num_threads(args.threads)
    embedded = load_checkpoint(default_model_path(), dtype=args.dtype)
    models: dict[str, Any] = {}
    for name in args.models.split(","):
        if name == "embedded":
            loaded = embedded
        elif name == "125m":
            loaded = random_model(CONFIG_125M, seed=0)
            # ids the tokenizer lacks decode to "" and a schema never allows them
            loaded.tokenizer = embedded.tokenizer
        else:
            raise SystemExit(f"unknown model {name!r}")
        models[name] = measure_model(name, loaded, args, trace)
    head = models.get("embedded") or next(iter(models.values()))
    print(
        json.dumps(
            {
                "agentic_speedup_b1": head["b1"]["speedup"],
                "agentic_speedup_b8": head["b8"]["speedup"],
                "accepted_per_step": head["b1"]["accepted_per_step"],
                "unique_overhead": head["unique"]["time_ratio"],
                "greedy_identical": all(m["greedy_identical"] for m in models.values()),
                "seeded_identical": all(m["seeded_identical"] for m in models.values()),
                "speculate": args.speculate,
                "threads": args.threads,
                "smoke": args.smoke,
                "models": models,
            }
        )
    )


if __name__ == "__main__":
    main()
