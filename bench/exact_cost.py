"""What exact rows cost: the model's forward with every CPU product in fixed row tiles (as served) against the same
forward with each product one free-shaped call (the kernels' own choice per step size, batch-dependent rows).

    .venv/bin/python bench/exact_cost.py [--dtype bfloat16] [--prefill 512] [--context 256] [--reps 5] [--smoke]

The embedded default model, the torch attention backend, one process. Timed: a prefill chunk of --prefill tokens,
and decode steps of batch 1 and 8 over --context-token contexts. The two ways alternate A B B A ... so drift on a
shared machine falls on both; each figure is the median of --reps rounds. The last line is one JSON object:
decode_b1_ratio, decode_b8_ratio, prefill_ratio (exact time / free time: 1.0 costs nothing), and the tok/s behind
them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend, torch_backend
from radixcache.worker.cli import default_model_path
from radixcache.worker.model import llama, packed, quant, row_tiles
from radixcache.worker.model.llama import attention_options
from radixcache.worker.model.loader import load_checkpoint

PAGE = 16


@contextlib.contextmanager
def free_shapes() -> Iterator[None]:
    """Every product one call of the step's own shape, as torch would run it without row tiles."""

    def whole(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], tile: int) -> torch.Tensor:
        return product(x)

    saved = (row_tiles.by_row_tiles, torch_backend._products, torch_backend._scores)
    for module in (llama, packed, quant):
        module.by_row_tiles = whole  # type: ignore[attr-defined]
    torch_backend._products = torch.bmm  # type: ignore[assignment]
    torch_backend._scores = torch.bmm  # type: ignore[assignment]
    try:
        yield
    finally:
        for module in (llama, packed, quant):
            module.by_row_tiles = saved[0]  # type: ignore[attr-defined]
        torch_backend._products, torch_backend._scores = saved[1], saved[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny sizes, two rounds")
    args = parser.parse_args()
    if args.smoke:
        args.prefill, args.context, args.reps = 64, 32, 2
    loaded = load_checkpoint(default_model_path(), dtype=args.dtype)
    model, mc = loaded.model, loaded.config
    dtype = next(model.parameters()).dtype
    per_seq = -(-(max(args.prefill, args.context) + 1) // PAGE)
    seqs = 8
    pool = KVPool(KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim), page_size=PAGE, num_pages=seqs * per_seq,
                  dtype=dtype)  # fmt: skip
    backend = create_backend("torch", num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                             dtype=dtype, attention=attention_options(mc))  # fmt: skip
    gen = torch.Generator().manual_seed(0)

    def run(slices: list[tuple[int, int, int]]) -> float:
        layout = BatchLayout.build(
            [SequenceSlice(list(range(s * per_seq, (s + 1) * per_seq)), c, n) for s, c, n in slices], PAGE
        )
        ids = torch.randint(3, mc.vocab_size, (sum(n for _, _, n in slices),), generator=gen)
        start = time.perf_counter()
        model(ids, layout, pool, backend)
        return time.perf_counter() - start

    steps = {
        "prefill": [(0, 0, args.prefill)],
        "decode_b1": [(0, args.context, 1)],
        "decode_b8": [(s, args.context, 1) for s in range(seqs)],
    }
    tokens = {"prefill": args.prefill, "decode_b1": 1, "decode_b8": seqs}
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for s in range(seqs):  # the contexts the decodes read
            run([(s, 0, args.context)])
        for rnd in range(args.reps):
            order = ("exact", "free") if rnd % 2 == 0 else ("free", "exact")
            for way in order:
                with free_shapes() if way == "free" else contextlib.nullcontext():
                    for name, step in steps.items():
                        run(step)  # warm the shapes
                        times.setdefault((way, name), []).append(min(run(step) for _ in range(3)))
    result: dict[str, object] = {"dtype": args.dtype, "threads": torch.get_num_threads()}
    for name in steps:
        exact = statistics.median(times[("exact", name)])
        free = statistics.median(times[("free", name)])
        result[f"{name}_ratio"] = round(exact / free, 3)
        result[f"{name}_exact_tok_s"] = round(tokens[name] / exact, 1)
        result[f"{name}_free_tok_s"] = round(tokens[name] / free, 1)
        print(f"{name:10s} exact {tokens[name] / exact:9.1f} tok/s   free {tokens[name] / free:9.1f} tok/s   "
              f"cost x{exact / free:.3f}")  # fmt: skip
    result["prefill_ratio"] = result.pop("prefill_ratio")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
