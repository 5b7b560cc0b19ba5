"""Speculator: speculative decoding for one engine, draft, verify and accept in one place.

One engine step holds a whole round (gpt-fast's speculative_decode keeps the three together too; here the forward
pass between them is the engine's):
1. draft: while the scheduler plans the step it asks `draft(seq, limit)` for the tokens to verify after seq's last
   one: the Drafter's proposal, no longer than max_draft, `limit`, what max_tokens and the context leave room for,
   none for a request that opted out, and only what its grammar would accept. The scheduler then fits the draft into
   the step's budget and spare pages (worker/engine/scheduler/drafts.py), and the draft rides in seq's chunk, one
   logits row per token.
2. verify and accept, after the forward pass: `verify(seq, draft, sample)` samples seq's next token from its first row
   exactly as without a draft (same penalties, grammar mask, logprobs and generator: `sample` is the engine's), and
   goes on to the next row only while the token sampled equals the draft token there. Every token emitted is one the
   request's own sampler drew, so the output is the same with speculation on or off. Each accepted draft token's
   K/V was computed by the step: it counts as computed (num_computed moves), so only verified tokens are ever
   published; the K/V written for rejected ones sits past num_computed and is overwritten by the next step.

Engine thread only. The sequence is anything with DraftedSequence's attributes (worker/speculation/sequence.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixcache.cache import PrefixCache
from radixcache.worker.speculation.cached_index import DEFAULT_INDEX_TOKENS, CachedTokenIndex
from radixcache.worker.speculation.drafter import Drafter
from radixcache.worker.speculation.sequence import DraftedSequence


@dataclass(slots=True)  # one per drafted sequence each step: not frozen (a frozen __init__ costs ~5x)
class Verdict:
    """What one step's check of one sequence's draft found: tokens drafted, and how many were accepted."""

    drafted: int
    accepted: int


class Speculator:
    """Drafts of at most `max_draft` tokens, from `drafter`, for sequences of a model of `context_length`."""

    def __init__(self, drafter: Drafter, *, max_draft: int, context_length: int) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.drafter = drafter
        self.max_draft = max_draft
        self.context_length = context_length

    @classmethod
    def over(cls, cache: PrefixCache | None, *, max_draft: int, context_length: int) -> Speculator:
        """A Speculator drafting from each sequence's own tokens and, with a cache (None: the cache is off), from
        the tree's pages in the sequence's namespace (a CachedTokenIndex that observes the cache)."""
        index = None
        if cache is not None:
            pool_tokens = cache.num_pages * cache.page_size
            index = CachedTokenIndex(cache.page_size, max_tokens=min(pool_tokens, DEFAULT_INDEX_TOKENS))
            cache.add_observer(index)
        return cls(Drafter(index), max_draft=max_draft, context_length=context_length)

    def draft(self, seq: DraftedSequence, limit: int) -> list[int]:
        """The scheduler's Proposer: seq's draft, at most `limit` tokens (see the module docstring, step 1)."""
        params = seq.request.sampling
        room = min(
            self.max_draft,
            limit,
            params.max_tokens - seq.num_generated - 1,  # the token after an accepted draft is sampled too
            self.context_length - len(seq.tokens),
        )
        if room < 1 or not params.speculate:
            return []
        draft = self.drafter.propose(seq, room)
        if draft and seq.matcher is not None:
            draft = draft[: seq.matcher.accepts_prefix(draft)]
        return draft

    def verify(self, seq: DraftedSequence, draft: list[int], sample: Callable[[int], None]) -> Verdict:
        """Accept as much of seq's `draft` as seq's own sampler agrees with (the module docstring, step 2).

        `sample(i)` appends seq's next token sampled from the step's row i for seq (0: after its last token, i:
        after draft token i-1), with the mask its grammar has at that point, and raises on non-finite logits. Rows
        are sampled in order, as if each were a step of its own, stopping after the first sampled token that differs
        from the draft or ends the request (its K/V is computed, but a last token never counts as computed)."""
        accepted = 0
        for i in range(len(draft) + 1):
            sample(i)
            if i == len(draft) or seq.tokens[-1] != draft[i]:
                break
            accepted += 1
            if seq.finish_reason is not None:
                break
            seq.num_computed += 1
        seq.draft_tokens += len(draft)
        seq.accepted_draft_tokens += accepted
        self.drafter.verified(seq, len(draft), accepted)
        return Verdict(len(draft), accepted)
