"""The routing decision, apart from Ray: longest cached prefix, unless the load is imbalanced.

Like SGLang's cache-aware router: when the busiest and the idlest replica differ by more than `balance_abs`
requests AND the busiest has more than `balance_rel` times the idlest's, the least loaded replica wins whatever it
caches; otherwise the replica holding the longest prefix wins (ties to the less loaded), and when no replica holds at
least `min_match_pages` pages of the prompt, the least loaded one does. Remaining ties go to the replica holding the
fewest pages (so new prefixes spread over the fleet's memory, as SGLang's router does), then at random.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

DEFAULT_BALANCE_ABS = 8
DEFAULT_BALANCE_REL = 1.5
DEFAULT_MIN_MATCH_PAGES = 1


@dataclass(frozen=True)
class RoutingThresholds:
    balance_abs: int = DEFAULT_BALANCE_ABS
    balance_rel: float = DEFAULT_BALANCE_REL
    min_match_pages: int = DEFAULT_MIN_MATCH_PAGES

    def __post_init__(self) -> None:
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if not self.balance_rel >= 1.0:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")
        if self.min_match_pages < 1:
            raise ValueError(f"min_match_pages must be >= 1, got {self.min_match_pages}")


@dataclass(frozen=True)
class Candidate:
    replica: Hashable
    load: int  # requests queued or running there
    matched_pages: int  # leading pages of the prompt it holds
    held_pages: int = 0  # pages it holds (or will, in flight) in all


def imbalanced(loads: Sequence[int], t: RoutingThresholds) -> bool:
    hi, lo = max(loads), min(loads)
    return hi - lo > t.balance_abs and hi > t.balance_rel * lo


def choose(candidates: Sequence[Candidate], t: RoutingThresholds, rng: random.Random | None = None) -> Candidate:
    """The replica a request goes to (candidates must not be empty)."""
    if not candidates:
        raise ValueError("no candidate replicas")
    rng = rng or random
    loads = [c.load for c in candidates]
    best_match = max(c.matched_pages for c in candidates)
    if not imbalanced(loads, t) and best_match >= t.min_match_pages:
        pool = [c for c in candidates if c.matched_pages == best_match]
    else:
        pool = list(candidates)
    best = min((c.load, c.held_pages) for c in pool)
    return rng.choice([c for c in pool if (c.load, c.held_pages) == best])
