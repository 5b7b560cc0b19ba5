"""One token's logits, formed three ways: alone in its step, batched with other sequences' decodes, and inside a
verify chunk beside decodes. What cache on == off and speculation on == off rest on: each way must give the same
bits for the same (sequence, position). Shared by the architecture tests (MoE, MLA) that must keep that promise."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from radixcache.worker.attention import BatchLayout, SequenceSlice

Step = list[tuple[int, int, int]]  # (sequence, first position, tokens) per slice


def assert_same_bits_alone_batched_and_verified(
    loaded: Any, page: int, pool_and_backend: Callable[[], tuple[Any, Any]]
) -> None:
    """Three sequences of 40 random tokens, prefilled together, then decoded 6 tokens each alone, batched, and with
    sequence 1's 6 tokens as one verify chunk beside the others' decodes: every row the ways share is bit-equal.
    `pool_and_backend` gives a fresh KV pool (15 pages of `page` tokens) and backend per way."""
    rng = random.Random(3)
    tokens = [[rng.randrange(2, 320) for _ in range(40)] for _ in range(3)]

    def run(steps: list[Step]) -> dict[tuple[int, int], torch.Tensor]:
        pool, backend = pool_and_backend()
        out = {}
        with torch.inference_mode():
            for step in steps:
                slices = [SequenceSlice(list(range(s * 5, s * 5 + 5)), c, n) for s, c, n in step]
                ids = torch.tensor([t for s, c, n in step for t in tokens[s][c : c + n]])
                logits = loaded.model(ids, BatchLayout.build(slices, page), pool, backend, all_logits=True)
                rows = [(s, p) for s, c, n in step for p in range(c, c + n)]
                out.update({row: logits[i] for i, row in enumerate(rows)})
        return out

    prefill = [(s, 0, 24 + 3 * s) for s in range(3)]
    alone = run([prefill] + [[(s, 24 + 3 * s + j, 1)] for s in range(3) for j in range(6)])
    batched = run([prefill] + [[(s, 24 + 3 * s + j, 1) for s in range(3)] for j in range(6)])
    verify = run([prefill, [(1, 27, 6), (0, 24, 1), (2, 30, 1)]])  # a verify chunk beside decodes
    for way in (batched, verify):
        compared = [row for row in way if row in alone]
        assert len(compared) >= 8
        for row in compared:
            assert torch.equal(way[row], alone[row]), f"(sequence, position) {row}"
