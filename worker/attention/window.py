"""Which cached positions a query attends to: the one rule every backend's masks and page tables follow.

A query at position q of a global layer sees key positions 0..q. A sliding layer of window W sees the last W of
them, its own included: q - W < k <= q (transformers' sliding_window_overlay; FlashInfer's window_left = W - 1).
A step's sliding-layer queries of one sequence start at its first new position, so the block-table pages wholly
before that position's window are never read: `skipped_pages` says how many, and the backends start each
sequence's table there (a cache may give those pages back).
"""

from __future__ import annotations

import torch

from radixcache.worker.attention.layout import BatchLayout


def first_visible(position: int, window: int | None) -> int:
    """The earliest key position a query at `position` sees."""
    return 0 if window is None else max(0, position - window + 1)


def skipped_pages(layout: BatchLayout, window: int | None) -> list[int]:
    """Per sequence of the step: leading pages of its block table that no query of this step sees (all 0 for a
    global layer)."""
    if window is None:
        return [0] * layout.batch_size
    ps = layout.page_size
    return [
        first_visible(total - new, window) // ps for total, new in zip(layout.seq_lens, layout.num_new, strict=True)
    ]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [..., n, L]: True where the query at q_pos[..., i] may attend to the key at k_pos[..., j] (causal, and
    within the window). q_pos [..., n] and k_pos [..., L] broadcast over their leading dimensions."""
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    mask = k <= q
    return mask if window is None else mask & (k > q - window)
