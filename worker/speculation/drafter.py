"""Drafter: the draft for one sequence's next step, from the tree's index and the sequence's own tokens.

The Speculator (worker/speculation/speculator.py) calls `propose(seq, limit)` for the scheduler while it plans a
step (the scheduler then trims the draft to the step's token budget and to pages it can have without preempting
anyone) and `verified(seq, drafted, accepted)` once the step has checked it. What a draft may never do is the
Speculator's to enforce: change an output, or reach the tree unverified.

Policy, all per sequence:
- draft only where the last MIN_MATCH tokens occurred before (in the tree, same namespace, or earlier in the
  sequence): a prompt with nothing to draft from costs one dict lookup per step;
- at most as many tokens as the best match is long (and `limit`);
- back off after a draft of which nothing was accepted: skip the next 1, 3, 7, then 15 chances, so a sequence
  whose context repeats without its output following pays little; one accepted token resets it.
"""

from __future__ import annotations

from radixcache.worker.speculation.cached_index import CachedTokenIndex
from radixcache.worker.speculation.sequence import DraftedSequence, DraftState
from radixcache.worker.speculation.vote import MIN_MATCH, vote

MAX_BACKOFF = 15  # chances skipped at most after failed drafts


class Drafter:
    """Drafts for every sequence of one engine. `index`: the tree's CachedTokenIndex, or None (cache off)."""

    def __init__(self, index: CachedTokenIndex | None) -> None:
        self.index = index

    def propose(self, seq: DraftedSequence, limit: int) -> list[int]:
        """Up to `limit` tokens that may follow seq.tokens, or [] (nothing matched long enough, or backing off)."""
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = DraftState()
        if state.skip:
            state.skip -= 1
            return []
        tokens = seq.tokens
        state.own.catch_up(tokens)
        if limit < 1 or len(tokens) < MIN_MATCH:
            return []
        key = hash(tuple(tokens[-MIN_MATCH:]))
        found = state.own.candidates(tokens, key, limit)
        if self.index is not None:
            found += self.index.candidates(seq.request.namespace, tokens, key, limit)
        return vote(found, limit)

    def verified(self, seq: DraftedSequence, drafted: int, accepted: int) -> None:
        state = seq.draft_state
        if state is None or drafted == 0:
            return
        if accepted:
            state.failures = 0
        else:
            state.failures += 1
            state.skip = min(2**state.failures - 1, MAX_BACKOFF)
