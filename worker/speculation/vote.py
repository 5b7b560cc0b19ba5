"""Candidates for a draft and how they are chosen.

A candidate is an earlier occurrence of a sequence's last MIN_MATCH tokens (in the tree or in the sequence itself)
with what followed it there. `match` is how many of the sequence's last tokens agree with the tokens before the
occurrence (at least MIN_MATCH, at most MAX_MATCH compared), `recency` orders occurrences of one source (larger is
newer), `own` marks the sequence's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_MATCH = 3  # the shortest match that drafts: with fewer tokens of context a continuation is mostly a guess
MAX_MATCH = 32  # tokens compared backwards at most (a longer match drafts no more: drafts are capped lower)
MAX_OCCURRENCES = 4  # occurrences kept per n-gram in an index (the newest)


@dataclass(frozen=True)
class Candidate:
    match: int
    own: bool
    recency: int
    tokens: list[int]  # the continuation, at most the draft limit long

    @property
    def rank(self) -> tuple[int, bool, int]:
        return (self.match, self.own, self.recency)


def vote(candidates: list[Candidate], limit: int) -> list[int]:
    """The draft the candidates agree on, at most `limit` tokens (and no longer than the best match: a short match
    is a weak guess, so it drafts few tokens).

    Token by token: the next token is the one the most live candidates continue with (hits); a tie goes to the
    candidate with the longest match, then to the sequence's own tokens, then to the newest. Candidates that
    continue otherwise drop out; the draft ends where no live candidate continues.
    """
    if not candidates:
        return []
    limit = min(limit, max(c.match for c in candidates))
    draft: list[int] = []
    alive = candidates
    while len(draft) < limit:
        depth = len(draft)
        groups: dict[int, list[Candidate]] = {}
        for c in alive:
            if len(c.tokens) > depth:
                groups.setdefault(c.tokens[depth], []).append(c)
        if not groups:
            break
        token, alive = max(groups.items(), key=lambda kv: (len(kv[1]), max(c.rank for c in kv[1])))
        draft.append(token)
    return draft
