"""A token's logits are the same bits however its engine step is formed: the embedded model, in bf16 (its own dtype)
and fp32, the token computed as a decode of its own, as one of a batch of decodes, as a draft row of a verify chunk
and as a row of a prefill chunk cut elsewhere. Greedy output identical with the cache and speculation on and off,
batched, rests on it: in 16-bit one last-bit difference inside a step flips a rounding now and then, and the answer
drifts from there (tests/test_engine_speculation.py shows it end to end)."""

from __future__ import annotations

import random

import pytest
import torch

from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
from radixcache.worker.cli import default_model_path
from radixcache.worker.model.llama import attention_options
from radixcache.worker.model.loader import load_checkpoint

PAGE = 16
SEQS, LENGTH = 4, 224


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def loaded(request):
    return load_checkpoint(default_model_path(), dtype=request.param)


def logits_as(
    loaded, steps: list[list[tuple[int, int, int]]], tokens: list[list[int]], start: KVPool | None = None
) -> tuple[dict[tuple, torch.Tensor], KVPool]:
    """Run `steps` (each a batch of (sequence, cached, new)) in order on a fresh pool (holding a copy of `start`'s
    K/V when given) whose sequences already hold their first `cached` tokens' K/V where a step starts from them
    (each step computes its new tokens' K/V itself). Returns ({(sequence, position): the logits after the token at
    position} for every token computed, the pool after the steps)."""
    model, mc = loaded.model, loaded.config
    dtype = next(model.parameters()).dtype
    per_seq = -(-LENGTH // PAGE)
    pool = KVPool(KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim), page_size=PAGE, num_pages=SEQS * per_seq,
                  dtype=dtype)  # fmt: skip
    if start is not None:
        pool.kv.copy_(start.kv)
    backend = create_backend("torch", num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                             dtype=dtype, attention=attention_options(mc))  # fmt: skip
    out = {}
    with torch.inference_mode():
        for step in steps:
            slices = [SequenceSlice(list(range(s * per_seq, (s + 1) * per_seq)), c, n) for s, c, n in step]
            ids = torch.tensor([t for s, c, n in step for t in tokens[s][c : c + n]])
            logits = model(ids, BatchLayout.build(slices, PAGE), pool, backend, all_logits=True)
            rows = [(s, p) for s, c, n in step for p in range(c, c + n)]
            out.update({row: logits[i] for i, row in enumerate(rows)})
    return out, pool


def test_a_tokens_logits_are_the_same_bits_as_a_decode_a_batch_member_a_verify_row_and_a_chunk_row(loaded):
    rng = random.Random(0)
    tokens = [[rng.randrange(3, loaded.config.vocab_size) for _ in range(LENGTH)] for _ in range(SEQS)]
    prefill = [(s, 0, 150 + 10 * s) for s in range(SEQS)]  # every sequence's prefix, one chunk each
    decodes = range(30)  # the tokens after each prefix: sequence s's positions 150 + 10 s + j
    # The prefix is computed once, and every way of decoding after it starts from a copy of its pool: a way is
    # compared where it forms a step differently, never on a repeat of the same step (that would test the kernels'
    # run-to-run reproducibility, which an ISA cap on an AMX CPU does not keep: tests/test_row_tiles.py).
    prefix, after_prefix = logits_as(loaded, [prefill], tokens)
    ways = {
        # one token a step, alone: the reference
        "decode alone": [[(s, 150 + 10 * s + j, 1)] for s in range(SEQS) for j in decodes],
        # batches of 4 decodes of different lengths
        "decode in a batch": [[(s, 150 + 10 * s + j, 1) for s in range(SEQS)] for j in decodes],
        # verify chunks of 10 rows (a last token and 9 drafts) next to other sequences' decodes
        "verify chunks": [[(1, 160 + j, 1), (0, 150 + 10 * j, 10), (2, 170 + j, 1)] for j in range(3)],
    }
    got = {way: logits_as(loaded, steps, tokens, after_prefix)[0] for way, steps in ways.items()}
    # the prefill cut elsewhere: the positions are rows inside one long chunk, and its decodes follow from them
    got["chunk rows"] = logits_as(loaded, [[(0, 0, 120)], [(0, 120, 65), (3, 0, 9)]], tokens)[0]
    reference = {**prefix, **got.pop("decode alone")}
    for way, rows in got.items():
        compared = [row for row in rows if row in reference]
        assert len(compared) >= 30
        for row in compared:
            assert torch.equal(rows[row], reference[row]), f"{way}: the logits after (sequence, position) {row} differ"
