"""The step's room for drafts (speculative decoding): which chunks carry one, how long, and into which pages.

What a sequence's draft is comes from the Proposer (worker/speculation's Speculator.draft); how much of it the step
computes is decided here. A running sequence whose chunk ends at its last token and that has generated a token
already may carry draft tokens after it, verified in the same forward pass. They come after every running sequence's
own chunk and before admissions, from the budget left, oldest sequence first, and only into pages that need no
preemption: the slots its pages still have, plus pages beyond what running prefills were promised and the reserve of
one page per running sequence. A draft never preempts or fails anyone.
"""

from __future__ import annotations

from radixcache.cache import CacheFullError
from radixcache.worker.engine.scheduler.allocation import Pages
from radixcache.worker.engine.scheduler.plan import Chunk, Proposer
from radixcache.worker.engine.sequence import Sequence


def add_drafts(chunks: list[Chunk], budget: int, propose: Proposer, pages: Pages, running: list[Sequence]) -> int:
    """Give the chunks that end at their sequence's last token a draft, in order, within `budget` tokens and the
    pages nobody else needs (allocated to their leases here). Returns the tokens drafted."""
    ps = pages.page_size
    spare = pages.cache.available_pages() - pages.promised_to_prefills(running) - len(running)
    drafted = 0
    for chunk in chunks:
        seq = chunk.seq
        if budget - drafted < 1 or not chunk.samples or seq.num_generated == 0 or seq.lease is None:
            continue
        draft = propose(seq, budget - drafted)
        if not draft:
            continue
        end = seq.num_computed + chunk.num_new
        held = len(seq.lease.pages)
        draft = draft[: held * ps - end + max(0, spare) * ps]
        need = pages.pages_for(end + len(draft)) - held
        if need > 0:
            try:
                pages.cache.allocate(seq.lease, need)
            except CacheFullError:  # spare counted evictable pages that are not (cannot happen; stay safe)
                draft = draft[: held * ps - end]
                need = 0
            spare -= need
        chunk.draft = draft
        drafted += len(draft)
    return drafted
