"""The records a step is planned in: a Chunk per sequence that computes, a Failure per sequence that cannot, the
StepPlan that holds both, and Waiting, a waiting sequence with what the cache holds of it (admission's order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixcache.worker.engine.sequence import Sequence


@dataclass
class Chunk:
    """num_new of seq's tokens from seq.num_computed on, then the draft tokens (not in seq.tokens) to verify."""

    seq: Sequence
    num_new: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence's tokens, so its last row yields the next token."""
        return self.seq.num_computed + self.num_new == len(self.seq.tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (what the step's budget counts)."""
        return self.num_new + len(self.draft)

    @property
    def num_rows(self) -> int:
        """Rows of logits the chunk yields: its last token's, then one per draft token."""
        return 1 + len(self.draft)


@dataclass(frozen=True, slots=True)
class Failure:
    """A sequence that must end with an error this step (NO_CAPACITY): it cannot fit, even alone."""

    seq: Sequence
    message: str


@dataclass(slots=True)
class StepPlan:
    """What one step computes: the chunks (decodes first, then prefills, each group in admission order), and the
    sequences that must fail."""

    chunks: list[Chunk]
    failed: list[Failure]


@dataclass(slots=True)  # one per waiting sequence each step: not frozen (a frozen __init__ costs ~5x)
class Waiting:
    """A waiting sequence, and how many of its tokens the cache holds now (in memory; a tier load may add more)."""

    seq: Sequence
    cached: int


# (sequence, most tokens) -> draft tokens to verify after the sequence's last token
Proposer = Callable[[Sequence, int], list[int]]
