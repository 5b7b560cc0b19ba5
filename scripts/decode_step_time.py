"""Decode step time of a ~125M-parameter Llama (torch backend) next to its memory-bandwidth floor.

Decode is bandwidth bound: a step reads every weight once (plus the KV cache), so the floor is
bytes read per step / copy bandwidth, both measured in this run. Copy bandwidth counts bytes read + bytes written
by a large tensor copy into a preallocated buffer. Also compares the torch backend's batched decode path with a per-sequence loop.

    .venv/bin/python scripts/decode_step_time.py [--threads 2] [--context 256] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
from radixcache.worker.model import ModelConfig, random_model

CONFIG = ModelConfig(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    max_position_embeddings=2048,
)


def median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 512 * 2**20) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)  # preallocated and touched: time the copy, not page faults
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = random_model(CONFIG, seed=0).model
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_bytes = model.model.embed_tokens.weight.numel() * 4
    read_bytes = weight_bytes - embed_bytes  # a step reads B embedding rows, not the table
    page = 16
    ctx = args.context
    shape = KVShape(CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    backend = create_backend("torch")
    bw = copy_bandwidth()
    print(
        f"params {params / 1e6:.1f}M, fp32 weights {weight_bytes / 2**20:.0f} MiB "
        f"(read per step without the embedding table: {read_bytes / 2**20:.0f} MiB); threads {args.threads}"
    )
    print(f"copy bandwidth (read+write) {bw / 1e9:.1f} GB/s")
    print(f"{'batch':>5} {'context':>7} {'step ms':>8} {'floor ms':>8} {'x floor':>7} {'tok/s':>7}")
    for batch in (1, 16):
        pages_per = -(-(ctx + args.steps + 2) // page)
        pool = KVPool(shape, page_size=page, num_pages=batch * pages_per)
        pool.kv.normal_()
        tables = [list(range(b * pages_per, (b + 1) * pages_per)) for b in range(batch)]
        ids = torch.randint(0, CONFIG.vocab_size, (batch,))
        layout = BatchLayout.build([SequenceSlice(t, ctx, 1) for t in tables], page)
        with torch.no_grad():
            seconds = median_seconds(
                lambda layout=layout, pool=pool, ids=ids: model(ids, layout, pool, backend), args.steps
            )
        kv_bytes = batch * (ctx + 1) * shape.layers * 2 * shape.kv_heads * shape.head_dim * 4
        floor = (read_bytes + kv_bytes) / bw
        print(
            f"{batch:>5} {ctx:>7} {seconds * 1e3:>8.1f} {floor * 1e3:>8.1f} {seconds / floor:>7.1f} {batch / seconds:>7.0f}"
        )

    # The torch backend's decode path: one padded batched matmul vs a Python loop over sequences (one layer).
    batch, kvh, dim, heads = 16, CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.num_heads
    pages_per = -(-(ctx + 1) // page)
    pool = KVPool(KVShape(1, kvh, dim), page_size=page, num_pages=batch * pages_per)
    pool.kv.normal_()
    slices = [SequenceSlice(list(range(b * pages_per, (b + 1) * pages_per)), ctx, 1) for b in range(batch)]
    q, k, v = torch.randn(batch, heads, dim), torch.randn(batch, kvh, dim), torch.randn(batch, kvh, dim)
    batched = BatchLayout.build(slices, page)
    singles = [BatchLayout.build([s], page) for s in slices]

    def run_batched() -> None:
        backend.begin_step(batched)
        backend.forward(0, q, k, v, pool.layer(0), batched)

    def run_loop() -> None:
        for b, single in enumerate(singles):
            backend.begin_step(single)
            backend.forward(0, q[b : b + 1], k[b : b + 1], v[b : b + 1], pool.layer(0), single)

    t_batched, t_loop = median_seconds(run_batched, 20), median_seconds(run_loop, 20)
    print(
        f"decode attention, one layer, batch {batch} x {ctx} ctx: batched {t_batched * 1e3:.2f} ms, "
        f"per-sequence loop {t_loop * 1e3:.2f} ms ({t_loop / t_batched:.1f}x)"
    )


if __name__ == "__main__":
    main()
