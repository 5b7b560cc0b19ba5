"""The user's alternative on a CPU: Hugging Face transformers' generate() on the same weights and workloads.

    .venv/bin/python bench/hf_baseline.py [--batch-size 4] [--workloads gsp,unique] [same size flags as serve_bench]
                                          [--smoke]

The honest best use of it: prompts go in batches of --batch-size through one batched generate() each (left
padding when lengths differ; the gsp and unique prompts of one workload have equal lengths, so none is needed),
greedy, exactly the same number of output tokens as the worker produces (min_new_tokens = max_new_tokens, so EOS
cannot end one early). Nothing is reused across calls: that is what generate() offers.

Timing: wall = the whole workload, batch after batch. TTFT of a request = from the start of its batch's generate()
call until the first call of a logits processor, i.e. the batch's prefill forward (which is when the first token
of every request of the batch exists); this is the TTFT of a closed-loop client whose request waits for nothing
but its own batch. TPOT = (end of generate - first token) / (tokens - 1).

Writes the result (with every output) to --out; the LAST line printed is the same JSON without the outputs.
--smoke: the two-layer smoke checkpoint, two requests of a few tokens per workload.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    SMOKE_HELP,
    Job,
    bench_checkpoint,
    gsp_workload,
    percentile,
    smoke_out,
    unique_workload,
    write_json,
)

SMOKE_SIZES = {"batch_size": 2, "groups": 1, "prompts": 2, "system": 32, "question": 8, "output": 3, "unique_n": 2,
               "unique_prompt": 16, "unique_output": 3}  # fmt: skip


class FirstCall:
    """A logits processor that notes when generate() first asks for logits processing (after the prefill)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def run(model: Any, jobs: list[Job], batch_size: int) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    ttft: list[float] = []
    tpot: list[float] = []
    outputs: dict[str, list[int]] = {}
    out_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(jobs), batch_size):
        batch = jobs[i : i + batch_size]
        width = max(len(j.prompt) for j in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, j in enumerate(batch):  # left padding
            ids[row, width - len(j.prompt) :] = torch.tensor(j.prompt)
            mask[row, width - len(j.prompt) :] = 1
        n = batch[0].max_tokens
        first = FirstCall()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([first]),
            )
        end = time.perf_counter()
        new = out[:, width:]
        assert new.shape[1] == n, f"generate() returned {new.shape[1]} new tokens, expected {n}"
        t_first = first.at or end
        for row, j in enumerate(batch):
            outputs[j.name] = new[row].tolist()
            ttft.append(t_first - start)
            if n > 1:
                tpot.append((end - t_first) / (n - 1))
        out_tokens += n * len(batch)
    wall = time.perf_counter() - t0
    return {
        "requests": len(jobs),
        "batch_size": batch_size,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="HF checkpoint (default: the random ~125M Llama of common.py)")
    p.add_argument("--workloads", default="gsp,unique")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--output", type=int, default=8)
    p.add_argument("--unique-n", type=int, default=8)
    p.add_argument("--unique-prompt", type=int, default=128)
    p.add_argument("--unique-output", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the workers get the same)")
    p.add_argument("--out", type=Path, default=RESULTS / "hf.json")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE_SIZES)
    args.out = smoke_out(args.out, args.smoke)
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    path = args.model or bench_checkpoint(args.smoke)
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # Warm-up: the first forward pays one-time costs (allocator, kernels' lazy init).
    with torch.inference_mode():
        model.generate(input_ids=torch.full((1, 64), 100), max_new_tokens=2, do_sample=False, pad_token_id=0)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "threads": torch.get_num_threads()}
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        if name == "gsp":
            jobs = gsp_workload(args.groups, args.prompts, args.system, args.question, args.output, seed=args.seed)
        elif name == "unique":
            jobs = unique_workload(args.unique_n, args.unique_prompt, args.unique_output, seed=args.seed + 1)
        else:
            raise SystemExit(f"hf_baseline: unknown workload {name!r} (gsp, unique)")
        result[name] = run(model, jobs, args.batch_size)
        r = result[name]
        print(
            f"  hf {name:<7} batch {args.batch_size}: {r['throughput_tok_s']:7.1f} tok/s  "
            f"TTFT p50 {1000 * r['ttft_p50_s']:7.0f} ms  TPOT p50 {1000 * r['tpot_p50_s']:6.0f} ms  "
            f"wall {r['wall_s']:.1f} s",
            flush=True,
        )
    write_json(args.out, result)
    print(json.dumps({k: {n: x for n, x in v.items() if n != "outputs"} if isinstance(v, dict) else v
                      for k, v in result.items()}))  # fmt: skip
    return result


if __name__ == "__main__":
    main()
