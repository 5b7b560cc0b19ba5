"""The batch layout: built once per engine step, consumed by the model and every attention backend.

It is FlashInfer's paged format (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) plus what a pure-torch
backend and the model need (positions, the page and slot each new token's K/V is written to, and which row of
the step's tokens yields each sequence's next-token logits).

With window paging (radixcache.window_parts: the sliding layers' values in window slots), every sequence also has a
window table: the slot of each page of its block table (-1 for a page whose window part is gone, which no sliding
query of the step reads). `windowed()` is the same layout with those slots in place of the page ids: what a
backend hands a sliding layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's part of a step.

    pages:      its block table; must cover num_cached + num_new tokens (extra trailing pages are ignored).
    num_cached: tokens whose K/V is already in those pages (positions 0..num_cached-1).
    num_new:    tokens computed this step (positions num_cached..num_cached+num_new-1); >= 1.
    window:     with window paging, the window slot of each page in `pages` (-1: none); else None.
    """

    pages: list[int]
    num_cached: int
    num_new: int
    window: list[int] | None = None

    @property
    def total(self) -> int:
        return self.num_cached + self.num_new


@dataclass
class BatchLayout:
    page_size: int
    qo_indptr: torch.Tensor  # int32 [B+1]: new tokens of sequence b are rows qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # int32 [B+1]: pages of sequence b are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # int32 [pages in use]
    kv_last_page_len: torch.Tensor  # int32 [B]: tokens in each sequence's last page after this step (1..page_size)
    positions: torch.Tensor  # int64 [T]: absolute position of every new token
    write_pages: torch.Tensor  # int64 [T]: page each new token's K/V is written to
    write_slots: torch.Tensor  # int64 [T]: slot inside that page
    logits_indices: torch.Tensor  # int64 [B]: row of each sequence's last new token
    seq_lens: list[int]  # host copy: total tokens per sequence after this step
    num_new: list[int]  # host copy: new tokens per sequence
    is_decode: bool  # every sequence adds exactly one token
    # window paging: kv_indices and write_pages in window slots (-1 where a page has none); None without it
    window_kv_indices: torch.Tensor | None = None
    window_write_pages: torch.Tensor | None = None
    _windowed: BatchLayout | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def windowed(self) -> BatchLayout:
        """This layout in window slots (what a window-paged sliding layer reads and writes); itself without window
        paging. Built once per step."""
        if self.window_kv_indices is None:
            return self
        if self._windowed is None:
            self._windowed = dataclasses.replace(
                self, kv_indices=self.window_kv_indices, write_pages=self.window_write_pages,
                window_kv_indices=None, window_write_pages=None,
            )  # fmt: skip
        return self._windowed

    @classmethod
    def build(cls, seqs: list[SequenceSlice], page_size: int, device: str | torch.device = "cpu") -> BatchLayout:
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        qo_indptr, kv_indptr, kv_indices, last_len = [0], [0], [], []
        positions, write_pages, write_slots, logits_indices = [], [], [], []
        windowed = seqs[0].window is not None
        window_indices: list[int] = []
        window_writes: list[int] = []
        for seq in seqs:
            if seq.num_new < 1 or seq.num_cached < 0:
                raise ValueError(f"bad slice: num_cached={seq.num_cached}, num_new={seq.num_new}")
            used = -(-seq.total // page_size)
            if len(seq.pages) < used:
                raise ValueError(f"{seq.total} tokens need {used} pages, block table has {len(seq.pages)}")
            table = seq.pages[:used]
            kv_indices.extend(table)
            kv_indptr.append(len(kv_indices))
            last_len.append(seq.total - (used - 1) * page_size)
            for pos in range(seq.num_cached, seq.total):
                positions.append(pos)
                write_pages.append(table[pos // page_size])
                write_slots.append(pos % page_size)
            if windowed:
                slots = seq.window[:used]  # type: ignore[index]
                if len(slots) < used or (seq.window is None):
                    raise ValueError("with window paging every sequence needs a window slot per page")
                window_indices.extend(max(s, 0) for s in slots)  # (a page without one is never read: any slot)
                for pos in range(seq.num_cached, seq.total):
                    slot = slots[pos // page_size]
                    if slot < 0:
                        raise ValueError(f"position {pos} is written this step but its page has no window slot")
                    window_writes.append(slot)
            qo_indptr.append(qo_indptr[-1] + seq.num_new)
            logits_indices.append(qo_indptr[-1] - 1)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            page_size=page_size,
            qo_indptr=i32(qo_indptr),
            kv_indptr=i32(kv_indptr),
            kv_indices=i32(kv_indices),
            kv_last_page_len=i32(last_len),
            positions=i64(positions),
            write_pages=i64(write_pages),
            write_slots=i64(write_slots),
            logits_indices=i64(logits_indices),
            seq_lens=[s.total for s in seqs],
            num_new=[s.num_new for s in seqs],
            is_decode=all(s.num_new == 1 for s in seqs),
            window_kv_indices=i32(window_indices) if windowed else None,
            window_write_pages=i64(window_writes) if windowed else None,
        )
