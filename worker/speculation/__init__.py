"""Speculative decoding drafted from what the worker already holds (issue 26): draft, verify and accept live here.

- `speculator.Speculator`: what the engine holds and calls: `draft(seq, limit)` is the scheduler's Proposer while it
  plans a step, `verify(seq, draft, sample)` checks a draft after the step's forward pass and accepts what the
  request's own sampler agrees with (the one call from the step). The scheduler decides only how much of a draft
  fits the step's budget and pages (worker/engine/scheduler/drafts.py).
- `drafter.Drafter`: a sequence's draft from the two indexes below, with the vote and a backoff.
- `cached_index.CachedTokenIndex`: an n-gram index over the whole pages the radix tree holds, per namespace, kept in
  step with the tree through its observer hook (stored / removed / cleared page records).
- `own_index.OwnTokenIndex`: the same over one sequence's own prompt and output.
- `vote.Candidate` / `vote.vote`: earlier occurrences of a sequence's last tokens, and the draft their
  continuations agree on (hits, then match length, then recency).
- `sequence`: what speculation keeps on a sequence (DraftState) and reads of it (DraftedSequence).
"""

from radixcache.worker.speculation.cached_index import DEFAULT_INDEX_TOKENS, CachedTokenIndex
from radixcache.worker.speculation.drafter import Drafter
from radixcache.worker.speculation.own_index import OwnTokenIndex
from radixcache.worker.speculation.sequence import DraftedSequence, DraftState
from radixcache.worker.speculation.speculator import Speculator, Verdict
from radixcache.worker.speculation.vote import MIN_MATCH, Candidate, vote

__all__ = [
    "DEFAULT_INDEX_TOKENS",
    "MIN_MATCH",
    "CachedTokenIndex",
    "Candidate",
    "DraftState",
    "DraftedSequence",
    "Drafter",
    "OwnTokenIndex",
    "Speculator",
    "Verdict",
    "vote",
]
