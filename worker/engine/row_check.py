"""The worker's start-up check of its own rows: is a token's logits row the same bits however its step is formed?

Speculation on == off and greedy output identical batched rest on it (worker/model/row_tiles.py makes it so by
construction on the CPUs measured; this checks the machine actually serving, with its real model, backend, device,
dtype and thread count). One prompt, computed on pages leased as the warm-up leases them (never published):
- "decode alone": a prefill of all but the last CHECKED tokens, then one decode a step (the reference);
- "decode in a batch": the same decodes, each in a step beside another sequence's decode;
- "verify draft": the last CHECKED tokens as one chunk of a step (as a speculation verify is), beside a decode;
- "prefill chunk": the whole prompt as one chunk, beside another sequence's prefill.
Every way's logits after those positions must equal the reference's. The engine turns speculation off when they do
not (Engine.start), says so in one log line, in GetModelInfo (rows_exact, row_check) and in /metrics
(radixcache_rows_exact).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from radixcache.cache import Lease
from radixcache.cache_base import BaseCache
from radixcache.pool import KVPool
from radixcache.worker.attention import AttentionBackend, BatchLayout
from radixcache.worker.engine.warmup import WARM_UP_OWNER, lease_slice

CHECKED = 4  # positions compared in every way (a verify chunk of one last token and three drafts)
PROMPT_TOKENS = 72  # a prefill chunk past the 32- and 64-row marks where CPU kernels change their order


@dataclass(frozen=True, slots=True)
class RowCheck:
    """The outcome: `exact` when every way matched; `detail` says what was compared or what differed."""

    exact: bool
    detail: str
    checked: bool = True  # False when the pool or context was too small to run it (exact is then assumed)


def _prompt_len(page_size: int, num_pages: int, context_length: int) -> int | None:
    """The longest prompt <= PROMPT_TOKENS whose three sequences fit the pool and the context, or None."""
    n = min(PROMPT_TOKENS, context_length - CHECKED - 1)
    while n > 2 * CHECKED:
        pages = 2 * -(-n // page_size) + -(-(n + CHECKED + 1) // page_size)
        if pages <= num_pages:
            return n
        n -= 1
    return None


def check_rows(
    model: torch.nn.Module, pool: KVPool, cache: BaseCache, backend: AttentionBackend, vocab: int, context: int
) -> RowCheck:
    """Compare a prompt's last CHECKED logits rows computed four ways (the module docstring). Leases its pages from
    `cache` under WARM_UP_OWNER and releases them unpublished. Call under torch.inference_mode()."""
    ps = cache.page_size
    n = _prompt_len(ps, pool.num_pages, context)
    if n is None:
        return RowCheck(True, "not run: the pool is too small for it", checked=False)
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(n)]
    other = [rng.randrange(3, vocab) for _ in range(n + CHECKED + 1)]
    device = pool.kv.device
    leases = [cache.acquire(WARM_UP_OWNER, [0] * n, "", max_cached=0, count=False) for _ in range(3)]
    a, b, c = leases  # a: the reference and the verify; b: the batched decodes; c: the other sequence

    def run(parts: list[tuple[Lease, int, list[int]]]) -> torch.Tensor:
        layout = BatchLayout.build(
            [lease_slice(cache, lease, start, len(ids)) for lease, start, ids in parts], ps, device
        )
        ids_t = torch.tensor([t for _, _, ids in parts for t in ids], dtype=torch.long, device=device)
        return model(ids_t, layout, pool, backend, all_logits=True)

    try:
        cache.allocate(a, -(-n // ps))
        cache.allocate(b, -(-n // ps))
        cache.allocate(c, -(-(n + CHECKED + 1) // ps))
        head, tail = n - CHECKED, prompt[n - CHECKED :]
        ways: dict[str, list[torch.Tensor]] = {}
        run([(a, 0, prompt[:head]), (b, 0, prompt[:head]), (c, 0, other[:head])])
        ways["decode alone"] = [run([(a, head + j, [t])])[0] for j, t in enumerate(tail)]
        ways["decode in a batch"] = [run([(c, head + j, [other[head + j]]), (b, head + j, [t])])[1] for j, t in enumerate(tail)]  # fmt: skip
        # a's K/V at the checked positions are rewritten with what the chunk computes: the same inputs
        verify = run([(c, n, [other[n]]), (a, head, tail)])
        ways["verify draft"] = list(verify[1:])
        chunk = run([(c, 0, other[: n + 1]), (b, 0, prompt)])
        ways["prefill chunk"] = list(chunk[n + 1 + head :])
        reference = ways.pop("decode alone")
        for way, rows in ways.items():
            for j, (row, ref) in enumerate(zip(rows, reference, strict=True)):
                if not torch.equal(row, ref):
                    at = head + j
                    return RowCheck(False, f"the logits after position {at} of a decode alone and a {way} differ")
        return RowCheck(True, f"a decode alone, in a batch, as a verify draft and in a prefill chunk of {n} agree")
    finally:
        for lease in reversed(leases):
            cache.release(lease)
