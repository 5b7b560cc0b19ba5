"""Small test helpers shared by many test modules (one copy each, not one per module)."""

from __future__ import annotations

from radixcache.events import records_page_index
from radixcache.tree import RadixTree


class FakeClock:
    """A clock that moves only when a test sets or advances `now` (pass it as a `clock=` argument)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tree_index(tree: RadixTree) -> dict[str, dict[int, int | None]]:
    """The page hashes `tree` holds ({namespace: {hash: parent}}), computed from its keys: what an exact replay of
    its events must give."""
    return records_page_index(tree.page_records(), tree.page_size)
