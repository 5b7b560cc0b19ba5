"""OwnTokenIndex: where a sequence's last tokens occurred earlier in its own prompt and output.

Built lazily on the sequence's first draft (one pass over the prompt), then one n-gram per generated token. Memory is
one entry per token of the sequence, dropped with it. Preemption keeps the tokens, so the index stays valid.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixcache.worker.speculation.vote import MAX_MATCH, MAX_OCCURRENCES, MIN_MATCH, Candidate


class OwnTokenIndex:
    __slots__ = ("_grams", "_next")

    def __init__(self) -> None:
        self._grams: dict[int, list[int]] = {}  # hash of MIN_MATCH tokens -> end positions, newest last
        self._next = MIN_MATCH - 1  # the next end position to index

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Index every n-gram that has a continuation: those ending before the last token."""
        grams, n = self._grams, MIN_MATCH
        for end in range(self._next, len(tokens) - 1):
            key = hash(tuple(tokens[end - n + 1 : end + 1]))
            ends = grams.get(key)
            if ends is None:
                grams[key] = [end]
            else:
                ends.append(end)
                if len(ends) > MAX_OCCURRENCES:
                    del ends[0]
        self._next = max(self._next, len(tokens) - 1)

    def candidates(self, tokens: Sequence[int], key: int, limit: int) -> list[Candidate]:
        """Earlier occurrences of the last MIN_MATCH tokens (`key` is their hash) and what followed each."""
        ends = self._grams.get(key)
        if not ends:
            return []
        out = []
        last = len(tokens) - 1
        for end in reversed(ends):
            match = 0
            while match < MAX_MATCH and match <= end and tokens[end - match] == tokens[last - match]:
                match += 1
            if match >= MIN_MATCH:  # fewer: a hash collision
                out.append(Candidate(match, True, end, list(tokens[end + 1 : end + 1 + limit])))
        return out
