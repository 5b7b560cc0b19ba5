"""What structured outputs cost: decode step time with a JSON-schema constraint vs without, at batch 1 and 16, and
grammar compile time per schema, cold and cached.

    python bench/constrained_bench.py [--quick] [--threads N] [--smoke]

Models: the shipped default model (4M parameters, its own 4,096-token vocabulary) and, without --quick, the ~125M
random Llama of the serving benchmarks with the default model's tokenizer (32,000-row vocabulary, so 27,904 padding
rows are masked too). Constrained and unconstrained runs alternate (ABBA) on the same engine; each decode run has
every request go to max_tokens (the schema asks for more than that), so both sides decode the same batch for the
same number of steps. Prints a table; the LAST line is one JSON object with constrained_step_overhead_b1 and
constrained_step_overhead_b16 (constrained / unconstrained median decode step wall time, for the largest model
measured) and the same ratios of CPU time per step (constrained_step_cpu_overhead_b*), steadier on a busy machine.
Plain decode: speculation is off (speculate=0; the JSON says so), so both sides decode one token per step.
--smoke: the default model, one run per side of 4 tokens (seconds; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import LLAMA_125M, REPO, SMOKE_HELP  # noqa: E402

from radixcache.worker.engine.engine import Engine, EngineConfig  # noqa: E402
from radixcache.worker.engine.request import Constraint, Request, SamplingParams  # noqa: E402
from radixcache.worker.engine.structured import GrammarCache  # noqa: E402
from radixcache.worker.model.config import ModelConfig  # noqa: E402
from radixcache.worker.model.loader import load_checkpoint, random_model  # noqa: E402

DEFAULT_MODEL = REPO / "worker" / "default_model"
SPECULATE = 0  # plain decode: both sides one token per sequence per step

# Longer than any decode run: a list of at least 40 records, so no constrained request ends before max_tokens.
LONG_OUTPUT = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3},
        },
        "required": ["id", "name", "tags"],
        "additionalProperties": False,
    },
}

TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["search", "open_url", "run_python", "send_email"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 200},
                "url": {"type": "string", "pattern": "^https?://[a-z0-9.-]+(/[a-zA-Z0-9._-]*)*$"},
                "code": {"type": "string"},
                "to": {"type": "array", "items": {"type": "string", "pattern": "^[a-z.]+@[a-z.]+$"}, "maxItems": 5},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600},
                "dry_run": {"type": "boolean"},
            },
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

WIDE = {
    "type": "object",
    "properties": {f"field_{i:02d}": {"type": ["string", "integer", "null"]} for i in range(60)},
    "required": [f"field_{i:02d}" for i in range(0, 60, 3)],
}

COMPILE_CASES = {
    "nested object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "id": {"type": "integer", "minimum": 0}},
                "required": ["name", "id"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "enum + array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "sizes": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["color", "sizes"],
    },
    "string patterns": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        "required": ["date", "code"],
    },
    "tool call": TOOL_CALL,
    "long list of records": LONG_OUTPUT,
    "60 properties": WIDE,
}


def model_125m() -> object:
    loaded = load_checkpoint(DEFAULT_MODEL)  # for its tokenizer
    config = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **LLAMA_125M})
    big = random_model(config, seed=0)
    big.tokenizer = loaded.tokenizer
    return big


def decode_step_ms(
    engine: Engine, prompts: list[list[int]], constraint: Constraint | None, max_tokens: int
) -> tuple[float, float]:
    """Submit one request per prompt, step past every prefill, then time the decode steps to the end.

    Returns (wall, CPU) milliseconds per step; CPU time (all threads of this process) is what a busy machine
    disturbs least."""
    firsts: set[str] = set()
    lengths: dict[str, int] = {}

    def on_output(out) -> None:
        if out.token_ids:
            firsts.add(out.request_id)
        lengths[out.request_id] = out.completion_tokens

    tag = "c" if constraint is not None else "u"
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit(Request(f"{tag}{i}-{time.monotonic_ns()}", p, params, constraint=constraint), on_output)
    while len(firsts) < len(prompts):
        engine.step()
    steps0 = engine.stats().steps
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.run_until_idle()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    steps = engine.stats().steps - steps0
    short = [n for n in lengths.values() if n != max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests ended before max_tokens: the two sides would not be comparable")
    return wall / steps * 1e3, cpu / steps * 1e3


def overhead(engine: Engine, batch: int, reps: int, max_tokens: int, log: list[str], name: str) -> tuple[float, float]:
    """(wall, CPU) ratio of the median decode step, constrained / unconstrained."""
    tok = engine.tokenizer
    prompts = [tok.encode(f"<|bos|>Record {i}: the list of items is", add_special_tokens=False) for i in range(batch)]
    constraint = Constraint("json_schema", json.dumps(LONG_OUTPUT))
    engine.compile_constraint(constraint)
    decode_step_ms(engine, prompts, None, 4)  # warm-up of both paths
    decode_step_ms(engine, prompts, constraint, 4)
    free: list[tuple[float, float]] = []
    constrained: list[tuple[float, float]] = []
    for rep in range(reps):  # ABBA: drift on a shared machine falls on both sides
        order = [(None, free), (constraint, constrained)]
        for c, out in order if rep % 2 == 0 else order[::-1]:
            out.append(decode_step_ms(engine, prompts, c, max_tokens))
    ratios = []
    for k, what in ((0, "wall"), (1, "cpu ")):
        a, b = statistics.median(x[k] for x in free), statistics.median(x[k] for x in constrained)
        ratios.append(b / a)
        log.append(
            f"{name:<20} b{batch:<2} {what}: unconstrained {a:7.2f} ms/step, json_schema {b:7.2f} ms/step  "
            f"x{b / a:.3f}   (runs: {', '.join(f'{x[k]:.1f}' for x in free)} | "
            f"{', '.join(f'{x[k]:.1f}' for x in constrained)})"
        )
    return ratios[0], ratios[1]


def compile_times(loaded, log: list[str]) -> dict[str, dict[str, float]]:
    start = time.perf_counter()
    cache = GrammarCache(loaded.tokenizer, loaded.config.vocab_size, set(loaded.config.eos_token_ids))
    cache.mask_vocab  # noqa: B018 (builds the token tables: once per worker)
    log.append(f"token tables of the tokenizer (once per worker): {(time.perf_counter() - start) * 1e3:.1f} ms")
    out = {}
    for name, schema in COMPILE_CASES.items():
        constraint = Constraint("json_schema", json.dumps(schema))
        cache.clear()
        t0 = time.perf_counter()
        cache.compile(constraint)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        matcher = cache.matcher(constraint)  # a cache hit plus the request's copy
        cached = time.perf_counter() - t0
        logits = torch.zeros(1, loaded.config.vocab_size)
        t0 = time.perf_counter()
        cache.mask_logits(logits, [0], [matcher])
        first_mask = time.perf_counter() - t0
        out[name] = {"cold_ms": cold * 1e3, "cached_ms": cached * 1e3, "first_mask_ms": first_mask * 1e3}
        log.append(
            f"compile {name:<22} cold {cold * 1e3:8.2f} ms   cached {cached * 1e3:6.3f} ms   "
            f"first mask {first_mask * 1e3:6.2f} ms   ({len(json.dumps(schema))} chars)"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the default model only, fewer repetitions")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.max_tokens = 4
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    reps = 1 if args.smoke else 2 if args.quick else 4
    models = [("default model (4M)", load_checkpoint(DEFAULT_MODEL))]
    if not (args.quick or args.smoke):
        models.append(("random llama 125M", model_125m()))
    log: list[str] = []
    result: dict[str, object] = {}
    for name, loaded in models:
        engine = Engine(loaded, EngineConfig(page_size=16, kv_pages=1024, cache_enabled=False, speculate=SPECULATE))
        with torch.inference_mode():
            engine.runner.warm_up(engine.cache)
        short = f"{name.split()[0]}_{name.split()[-1].strip('()')}"
        for batch in (1, 16):
            wall, cpu = overhead(engine, batch, reps, args.max_tokens, log, name)
            result[f"constrained_step_overhead_b{batch}"] = round(wall, 4)  # the last (largest) model's
            result[f"constrained_step_cpu_overhead_b{batch}"] = round(cpu, 4)
            result[f"{short}_overhead_b{batch}"] = round(wall, 4)
            result[f"{short}_cpu_overhead_b{batch}"] = round(cpu, 4)
        print("\n".join(log[-4:]), flush=True)
    compile_log: list[str] = []
    compiled = compile_times(models[0][1], compile_log)
    print("\n".join(compile_log))
    result["compile_cold_ms_max"] = round(max(c["cold_ms"] for c in compiled.values()), 3)
    result["compile_cached_ms_max"] = round(max(c["cached_ms"] for c in compiled.values()), 4)
    result["threads"] = torch.get_num_threads()
    result["speculate"] = SPECULATE
    result["quick"] = args.quick
    result["smoke"] = args.smoke
    result["elapsed_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
