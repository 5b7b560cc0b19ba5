"""Admission's pin phase: pins (PinPrefix, cache_control, saved pins) may never starve a request the worker took.

A request's pages at most are its prompt and every token it may generate (`total_pages`). The largest of those over
the live requests stays unpinned (`promised_pages`: the engine passes it to every pin), so any request that was taken
can run to its end, preempting the others if need be. A new request is refused before it starts when the pins it
does not read leave it too little of the pool (`room_beside_pins`): pins cannot grow past a live request's needs, so
this is the only moment they can block it.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixcache.cache_base import BaseCache
from radixcache.worker.engine.sequence import Sequence


def total_pages(seq: Sequence, page_size: int) -> int:
    """Pages seq holds at most: its prompt and every token it may generate."""
    return -(-(seq.num_prompt + seq.request.sampling.max_tokens) // page_size)


def promised_pages(seqs: Iterable[Sequence], page_size: int) -> int:
    """Pages the largest of `seqs` may need alone (0 for none)."""
    return max((total_pages(s, page_size) for s in seqs), default=0)


def room_beside_pins(cache: BaseCache, seq: Sequence) -> str | None:
    """None if seq fits in the pool beside the pins it does not read; else why not (the refusal's message)."""
    need, total = total_pages(seq, cache.page_size), cache.num_pages
    if need <= total - cache.pinned_pages():
        return None
    pinned = cache.pinned_pages(seq.tokens, seq.request.namespace)
    if need <= total - pinned:
        return None
    return (
        f"the KV cache cannot hold this request: prompt + max_tokens need {need} pages and {pinned} of the "
        f"{total} pages are pinned (PinPrefix; at most {cache.max_pinned_pages} by --max-pinned)"
    )
