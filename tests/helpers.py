"""Small test helpers shared by many test modules (one copy each, not one per module)."""

from __future__ import annotations

from typing import Any

from radixcache.events import records_page_index
from radixcache.tree import RadixTree
from radixcache.worker.model.config import ModelConfig

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


class FakeClock:
    """A clock that moves only when a test sets or advances `now` (pass it as a `clock=` argument)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tiny_config(**overrides: Any) -> ModelConfig:
    """The tiny decoder most tests build (TINY), with any field overridden."""
    return ModelConfig(**(TINY | overrides))


def tree_index(tree: RadixTree) -> dict[str, dict[int, int | None]]:
    """The page hashes `tree` holds ({namespace: {hash: parent}}), computed from its keys: what an exact replay of
    its events must give."""
    return records_page_index(tree.page_records(), tree.page_size)
