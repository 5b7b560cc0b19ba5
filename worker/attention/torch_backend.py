"""Pure-torch paged attention: runs on any device, the reference every other backend is checked against.

Per step, begin_step turns the page tables into flat row indices for every token of every sequence: a layer
[pages, 2, page_size, KVH, D] viewed as rows [pages*2*page_size, KVH, D] (a view, no copy) holds token (page, slot)'s
K at row page*2*page_size + slot and its V page_size rows later. Sequences that add one token (decode) are attended
to together: their pages' K and V blocks are gathered whole into a padded [B, pages * page_size] batch and one call
of torch's fused attention runs with a length mask. Sequences that add several tokens
(prefill chunks) are attended to one at a time with torch's fused scaled_dot_product_attention (their cost is
compute, not Python overhead).
Scores, softmax and the weighted sum run in float32 whatever the pool dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixcache.worker.attention.base import AttentionBackend
from radixcache.worker.attention.layout import BatchLayout


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None  # [Bd] rows of q that belong to decode sequences
    # [2 * Bd * P] blocks of the layer viewed as [pages * 2, page_size, KVH, D] (block 2p: page p's K, 2p + 1: its
    # V): every decode sequence's P pages' K blocks, then their V blocks (padding repeats a sequence's last page)
    decode_blocks: torch.Tensor | None
    decode_visible: torch.Tensor | None  # [Bd, 1, 1, P * page_size] True where a position is the sequence's; None: all
    write_rows: torch.Tensor  # [2T]: row of each new token's K (first T) and V (last T) in the layer's rows view
    # (q_start, q_end, slots[L], visible[n, L] True = may attend, or None when there is no cached prefix)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    # Built by the first layer of the step, once the KV head count is known; shared by every later layer.
    prefill_head_rows: list[torch.Tensor] | None = None


def _page_table(layout: BatchLayout, seqs: list[int], lens: list[int], device: torch.device) -> torch.Tensor:
    """[len(seqs), P] the pages holding each sequence's first lens[i] tokens, P = the most any needs; a shorter
    sequence's row repeats its last page (callers mask those positions)."""
    ps = layout.page_size
    sel = torch.tensor(seqs, dtype=torch.int64, device=device)
    start = layout.kv_indptr[:-1].to(torch.int64)[sel]
    last = start + torch.tensor([-(-n // ps) - 1 for n in lens], dtype=torch.int64, device=device)
    page_idx = torch.minimum(start[:, None] + torch.arange(-(-max(lens) // ps), device=device), last[:, None])
    return layout.kv_indices.to(torch.int64)[page_idx]


def _flat_slots(layout: BatchLayout, seq: int, device: torch.device) -> torch.Tensor:
    """[L] K row of positions 0..L-1 of sequence `seq` (L its length after this step; V is page_size rows later)."""
    ps, total = layout.page_size, layout.seq_lens[seq]
    pages = _page_table(layout, [seq], [total], device)[0]
    pos = torch.arange(total, device=device)
    return pages[pos // ps] * (2 * ps) + pos % ps


def _head_rows(slots: torch.Tensor, kvh: int) -> torch.Tensor:
    """[B, L] token rows -> flat [B*KVH*L] rows of the layer viewed as [rows, D], ordered (sequence, head, position).

    One index_select with these lands K/V head-major ([B, KVH, L, D]) as batched matmul and SDPA want them: gathering
    token-major and transposing afterwards reads the whole gathered K/V a second time (measured 2-3x slower)."""
    heads = torch.arange(kvh, device=slots.device)[None, :, None]
    return (slots[:, None, :] * kvh + heads).flatten()


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, device: str | torch.device = "cpu", **options: object) -> None:
        super().__init__(device, **options)  # type: ignore[arg-type]
        self._plan: _Plan | None = None
        self._layout: BatchLayout | None = None

    def begin_step(self, layout: BatchLayout) -> None:
        device = layout.positions.device
        decode = [b for b, n in enumerate(layout.num_new) if n == 1]
        starts = [0]
        for n in layout.num_new:
            starts.append(starts[-1] + n)
        decode_rows = decode_blocks = decode_visible = None
        if decode:
            decode_rows = torch.tensor([starts[b] for b in decode], dtype=torch.int64, device=device)
            decode_blocks, decode_visible = _decode_blocks(layout, decode, device)
        prefills = []
        for b, n in enumerate(layout.num_new):
            if n == 1:
                continue
            total = layout.seq_lens[b]
            slots = _flat_slots(layout, b, device)
            visible = None  # no cached prefix: plain causal attention
            if n < total:
                q_pos = torch.arange(total - n, total, device=device)
                visible = torch.arange(total, device=device)[None, :] <= q_pos[:, None]  # [n, L]
            prefills.append((starts[b], starts[b + 1], slots, visible))
        k_rows = layout.write_pages * (2 * layout.page_size) + layout.write_slots
        write_rows = torch.cat((k_rows, k_rows + layout.page_size))
        self._plan = _Plan(decode_rows, decode_blocks, decode_visible, write_rows, prefills)
        self._layout = layout

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        layout: BatchLayout,
    ) -> torch.Tensor:
        if self._layout is not layout or self._plan is None:
            self.begin_step(layout)
        plan = self._plan
        assert plan is not None
        _, _, page_size, kvh, dim = kv_layer.shape
        # Rows view of the layer; K rows are the plan's indices, V rows the same shifted by page_size.
        rows = kv_layer.view(-1, kvh, dim)
        # The step's new K and V in one indexed copy (same effect as AttentionBackend.write_kv).
        rows.index_copy_(0, plan.write_rows, torch.cat((k, v)).to(rows.dtype))
        k_flat, v_flat = rows, rows[page_size:]
        num_tokens, heads, _ = q.shape
        group = heads // kvh
        qf = q.float() * (1.0 / math.sqrt(dim))
        if plan.decode_rows is not None and not plan.prefills and plan.decode_rows.numel() == num_tokens:
            return self._decode(qf, rows, page_size, plan, group).to(q.dtype)
        out = torch.empty(num_tokens, heads, dim, dtype=torch.float32, device=q.device)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(qf[plan.decode_rows], rows, page_size, plan, group)
        if plan.prefill_head_rows is None:
            plan.prefill_head_rows = [_head_rows(slots[None], kvh) for _, _, slots, _ in plan.prefills]
        for (start, end, _, visible), head_rows in zip(plan.prefills, plan.prefill_head_rows, strict=True):
            keys = k_flat.view(-1, dim).index_select(0, head_rows).view(kvh, -1, dim).float()  # [KVH, L, D]
            values = v_flat.view(-1, dim).index_select(0, head_rows).view(kvh, -1, dim).float()
            qs = qf[start:end].transpose(0, 1)[None]  # [1, H, n, D]
            # torch's fused attention (flash-style on CPU): ~3x faster than scores -> softmax -> matmul at 1k
            # tokens, and it never materialises the [H, n, L] score matrix.
            o = F.scaled_dot_product_attention(
                qs, keys[None], values[None], attn_mask=visible, is_causal=visible is None, scale=1.0, enable_gqa=True
            )
            out[start:end] = o[0].transpose(0, 1)
        return out.to(q.dtype)

    @staticmethod
    def _decode(qf: torch.Tensor, rows: torch.Tensor, page_size: int, plan: _Plan, group: int) -> torch.Tensor:
        """One query per sequence, all sequences in one call of torch's fused attention. Returns float32 [Bd, H, D].

        K and V are gathered a whole page at a time (page_size * KVH * D contiguous values: a plain memory copy,
        ~2x faster than gathering one head's row at a time) into [Bd, P * page_size, KVH, D]; the kernel reads
        them head by head through strides, without another copy.
        rows: the layer viewed as [pages * 2 * page_size, KVH, D] (a token's V is page_size rows after its K)."""
        assert plan.decode_blocks is not None
        bd, heads, dim = qf.shape
        kvh = heads // group
        blocks = rows.view(-1, page_size, kvh, dim)  # [pages * 2, page_size, KVH, D]
        kv = blocks.index_select(0, plan.decode_blocks).view(2, bd, -1, kvh, dim).float()  # [2, Bd, L, KVH, D]
        keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [Bd, KVH, L, D], strided
        out = F.scaled_dot_product_attention(
            qf.view(bd, heads, 1, dim), keys, values, attn_mask=plan.decode_visible, scale=1.0, enable_gqa=True
        )
        return out.view(bd, heads, dim)


def _decode_blocks(
    layout: BatchLayout, seqs: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(blocks, visible) of _Plan for the decode sequences `seqs`."""
    ps = layout.page_size
    lens = [layout.seq_lens[b] for b in seqs]
    pages = _page_table(layout, seqs, lens, device)
    blocks = torch.cat((2 * pages.flatten(), 2 * pages.flatten() + 1))
    width = pages.shape[1] * ps
    visible = None
    if any(n != width for n in lens):
        tokens = torch.arange(width, device=device)[None, :]
        visible = (tokens < torch.tensor(lens, device=device)[:, None])[:, None, None, :]
    return blocks, visible
