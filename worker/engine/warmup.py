"""Start-up warm-up: run every kind of step once before the first request, so kernels compile now, not mid-request.

FlashInfer JIT-compiles a kernel module the first time each wrapper is planned (the prefill module, which also runs
mixed batches, and the decode module): tens of seconds each, and a missing nvcc surfaces there. A decode-only
warm-up left the prefill compile (or its failure) to the first real request, inside the serving loop.
"""

from __future__ import annotations

import torch

from radixcache.cache import Lease
from radixcache.cache_base import BaseCache
from radixcache.pool import KVPool
from radixcache.worker.attention import AttentionBackend, BatchLayout, SequenceSlice

WARM_UP_OWNER = "warm-up"


def lease_slice(cache: BaseCache, lease: Lease, cached: int, new: int) -> SequenceSlice:
    """The SequenceSlice of a start-up lease that has `cached` tokens and computes `new` (its window slots when the
    model slides): what the warm-up and the row check step with."""
    return SequenceSlice(lease.pages, cached, new, cache.window_slots(lease.pages) if cache.window else None)


def warm_up_prompt_len(page_size: int, num_pages: int) -> int | None:
    """Tokens of the warm-up prompts: one page and two more (so a prefill crosses a page boundary and the decodes
    start mid-page), shrunk until both warm-up sequences fit in the pool; at least 2 (a prefill, not a decode).
    None when even that does not fit (a pool of a page or two)."""
    n = page_size + 2
    while n >= 2:
        if -(-(n + 2) // page_size) + -(-n // page_size) <= num_pages:
            return n
        n -= 1
    return None


def warm_up(model: torch.nn.Module, pool: KVPool, cache: BaseCache, backend: AttentionBackend) -> list[str]:
    """Run a short prefill, a decode, then a mixed batch (a decode next to a second prefill) through `model` with
    `backend`; returns the kinds run, in order (a pool too small for that runs one decode only). Raises whatever
    the backend raises, or FloatingPointError if a step gives non-finite logits. Leases its pages from `cache`
    under owner WARM_UP_OWNER and releases them unpublished, so nothing it computed is ever served; call it under
    torch.inference_mode()."""
    ps = cache.page_size
    n = warm_up_prompt_len(ps, pool.num_pages)
    # count=False: not lookups anyone asked for (a fresh worker reports queried_tokens 0)
    first = cache.acquire(WARM_UP_OWNER, [0] * (n or 1), "", max_cached=0, count=False)
    second = cache.acquire(WARM_UP_OWNER, [0] * (n or 1), "", max_cached=0, count=False)

    def part(lease: Lease, cached: int, new: int) -> SequenceSlice:
        return lease_slice(cache, lease, cached, new)

    try:
        if n is None:
            cache.allocate(first, 1)
            steps = [("decode", [part(first, 0, 1)])]
        else:
            cache.allocate(first, -(-(n + 2) // ps))
            cache.allocate(second, -(-n // ps))
            steps = [
                ("prefill", [part(first, 0, n)]),
                ("decode", [part(first, n, 1)]),
                ("mixed", [part(first, n + 1, 1), part(second, 0, n)]),
            ]
        for kind, slices in steps:
            layout = BatchLayout.build(slices, ps, pool.kv.device)
            ids = torch.zeros(layout.num_tokens, dtype=torch.long, device=pool.kv.device)
            logits = model(ids, layout, pool, backend)
            if not bool(torch.isfinite(logits).all()):
                raise FloatingPointError(f"the {backend.name} backend gave non-finite logits in the warm-up {kind}")
        return [kind for kind, _ in steps]
    finally:
        cache.release(second)
        cache.release(first)
