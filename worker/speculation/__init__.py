"""Speculative decoding drafted from what the worker already holds (issue 26).

- `cached_index.CachedTokenIndex`: an n-gram index over the whole pages the radix tree holds, per namespace, kept in
  step with the tree through its observer hook (stored / removed / cleared page records).
- `own_index.OwnTokenIndex`: the same over one sequence's own prompt and output.
- `vote.Candidate` / `vote.vote`: earlier occurrences of a sequence's last tokens, and the draft their
  continuations agree on (hits, then match length, then recency).
- `drafter.Drafter`: what the engine calls: `propose(seq, limit)` before a step, `verified(seq, drafted,
  accepted)` after it. Verification itself is the engine's (worker/engine/engine.py): the draft rides in the sequence's
  chunk, and each draft token is kept only if it equals the token the request's own sampler draws there.
"""

from radixcache.worker.speculation.cached_index import DEFAULT_INDEX_TOKENS, CachedTokenIndex
from radixcache.worker.speculation.drafter import Drafter, DraftState
from radixcache.worker.speculation.own_index import OwnTokenIndex
from radixcache.worker.speculation.vote import MIN_MATCH, Candidate, vote

__all__ = [
    "DEFAULT_INDEX_TOKENS",
    "MIN_MATCH",
    "CachedTokenIndex",
    "Candidate",
    "DraftState",
    "Drafter",
    "OwnTokenIndex",
    "vote",
]
