"""Pure-torch paged attention: runs on any device, the reference every other backend is checked against.

Per step, begin_step turns the page tables into flat row indices for every token of every sequence: a layer
[pages, 2, page_size, KVH, D] viewed as rows [pages*2*page_size, KVH, D] (a view, no copy) holds token (page, slot)'s
K at row page*2*page_size + slot and its V page_size rows later. Sequences that add one token (decode) are attended
to together: their pages' K and V blocks are gathered whole into a padded [B, pages * page_size] batch and one call
of torch's fused attention runs with a length mask. Sequences that add several tokens
(prefill chunks) are attended to one at a time with torch's fused scaled_dot_product_attention (their cost is
compute, not Python overhead).
Each distinct window of the model's layers (worker/attention/window.py) gets its own gathers and masks per step; a
sliding layer's start at the first page its window needs. With a soft cap (Gemma 2), which torch's fused kernel
does not have, scores are computed, capped, masked and softmaxed explicitly.
Scores, softmax and the weighted sum run in float32 whatever the pool dtype.

Quantized pools (int8, fp8_e4m3, int4: radixcache.kv_codec) are written through the layer's codec and read back
dequantized inside the gathers, a tile at a time: decode sequences are attended to in tiles of about
DECODE_TILE_TOKENS positions (gather a tile's int8/fp8/int4 blocks, dequantize them while they sit in the CPU's
cache, one batched matmul for the scores), so the full-precision K/V of a step is never materialised; the step's
scores are softmaxed together, then the values are read back the same way. Every position is read back from the
pool, the step's own new tokens too, so a token attends to the same stored values whether it was computed this
step or came from the cache. For int4 (keys stored Hadamard-rotated) the queries are rotated the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixcache.kv_codec import hadamard
from radixcache.pool import KVLayer
from radixcache.worker.attention import window as win
from radixcache.worker.attention.base import AttentionBackend
from radixcache.worker.attention.layout import BatchLayout

# Positions per tile of the quantized decode path: a tile's dequantized K (B x 256 x KVH x D floats) stays in the L2
# cache. Measured at b8 x 4k, 4 KV heads of 64 (one thread): 256 -> 26 ms per layer, 128 -> 33, 512 -> 49, 1024 -> 57.
DECODE_TILE_TOKENS = 256

# The explicit (soft-capped) path forms scores a block of queries at a time, at most this many float32 elements
# (64 MiB): a 512-token chunk of a 16-head model over an 8k prefix would otherwise hold 268 MB of scores at once.
SCORE_BLOCK_ELEMENTS = 1 << 24


@dataclass
class _WindowPlan:
    """The gathers and masks of one window (None: the global layers) for one step."""

    # [2 * Bd * P] blocks of the layer viewed as [pages * 2, page_size, KVH, D] (block 2p: page p's K, 2p + 1: its
    # V): every decode sequence's P pages' K blocks, then their V blocks (padding repeats a sequence's last page)
    decode_blocks: torch.Tensor | None
    decode_visible: torch.Tensor | None  # [Bd, 1, 1, P * page_size] True where a position is seen; None: all
    # (q_start, q_end, slots[L], visible[n, L] True = may attend, or None for plain causal attention)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    # [2T]: row of each new token's K (first T) and V (last T) in the layer's rows view (window slots for a
    # window-paged sliding layer)
    write_rows: torch.Tensor
    # Built by the first layer of the step, once the KV head count is known; shared by every later layer.
    prefill_head_rows: list[torch.Tensor] | None = None
    # Quantized pools, built by the first layer that needs them: (first position, K blocks [Bd * n], V blocks
    # [Bd * n]) per tile of n pages of the decode page table
    decode_tiles: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None  # [Bd] rows of q that belong to decode sequences
    windows: dict[int | None, _WindowPlan]


def _page_table(
    layout: BatchLayout, seqs: list[int], first: list[int], lens: list[int], device: torch.device
) -> torch.Tensor:
    """[len(seqs), P] the pages holding lens[i] tokens of each sequence from its block table's page first[i] on,
    P = the most any needs; a shorter sequence's row repeats its last page (callers mask those positions)."""
    ps = layout.page_size
    sel = torch.tensor(seqs, dtype=torch.int64, device=device)
    start = layout.kv_indptr[:-1].to(torch.int64)[sel] + torch.tensor(first, dtype=torch.int64, device=device)
    last = start + torch.tensor([-(-n // ps) - 1 for n in lens], dtype=torch.int64, device=device)
    page_idx = torch.minimum(start[:, None] + torch.arange(-(-max(lens) // ps), device=device), last[:, None])
    return layout.kv_indices.to(torch.int64)[page_idx]


def _flat_slots(layout: BatchLayout, seq: int, first_page: int, device: torch.device) -> torch.Tensor:
    """[L] K row of positions first_page * page_size .. total-1 of sequence `seq` (V is page_size rows later)."""
    ps = layout.page_size
    held = layout.seq_lens[seq] - first_page * ps
    pages = _page_table(layout, [seq], [first_page], [held], device)[0]
    pos = torch.arange(held, device=device)
    return pages[pos // ps] * (2 * ps) + pos % ps


def _head_rows(slots: torch.Tensor, kvh: int) -> torch.Tensor:
    """[B, L] token rows -> flat [B*KVH*L] rows of the layer viewed as [rows, D], ordered (sequence, head, position).

    One index_select with these lands K/V head-major ([B, KVH, L, D]) as batched matmul and SDPA want them: gathering
    token-major and transposing afterwards reads the whole gathered K/V a second time (measured 2-3x slower)."""
    heads = torch.arange(kvh, device=slots.device)[None, :, None]
    return (slots[:, None, :] * kvh + heads).flatten()


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    soft_cap: float | None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of q [B, H, n, D] (already scaled) over keys/values [B, KVH, L, D], float32 -> [B, H, n, D].

    visible: bool, broadcastable to [B, 1, n, L]; None = every key (causal=False) or plain causal attention over
    n == L positions (causal=True). With soft_cap, which torch's fused kernel lacks, the scores are formed
    explicitly (visible must then be given)."""
    if soft_cap is None:
        # torch's fused attention (flash-style on CPU): ~3x faster than scores -> softmax -> matmul at 1k
        # tokens, and it never materialises the [H, n, L] score matrix.
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, is_causal=causal and visible is None, scale=1.0, enable_gqa=True
        )
    assert visible is not None, "soft-capped attention needs an explicit mask"
    b, heads, n, dim = q.shape
    kvh, length = keys.shape[1], keys.shape[2]
    group = heads // kvh
    visible = visible.reshape(-1, 1, 1, n, length)
    out = torch.empty(b, heads, n, dim, dtype=torch.float32, device=q.device)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (b * heads * length))  # query rows per block: scores stay bounded
    for start in range(0, n, rows):
        end = min(n, start + rows)
        qb = q[:, :, start:end].reshape(b, kvh, group * (end - start), dim)
        scores = qb @ keys.transpose(-1, -2)  # [B, KVH, group * rows, L]
        scores = (torch.tanh(scores / soft_cap) * soft_cap).view(b, kvh, group, end - start, length)
        scores = scores.masked_fill(~visible[..., start:end, :], float("-inf"))
        probs = scores.softmax(-1).view(b, kvh, group * (end - start), length)
        out[:, :, start:end] = (probs @ values).view(b, heads, end - start, dim)
    return out


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
        decode_rows = None
        if decode:
            decode_rows = torch.tensor([starts[b] for b in decode], dtype=torch.int64, device=device)
        windows = {
            w: self._window_plan(layout if w is None else layout.windowed(), w, decode, starts, device)
            for w in self.attention.distinct_windows
        }
        self._plan = _Plan(decode_rows, windows)
        self._layout = layout

    def _window_plan(
        self, layout: BatchLayout, window: int | None, decode: list[int], starts: list[int], device: torch.device
    ) -> _WindowPlan:
        ps = layout.page_size
        explicit = self.attention.soft_cap is not None  # the soft-capped path always takes a mask
        skip = win.skipped_pages(layout, window)
        blocks = decode_visible = None
        if decode:
            blocks, decode_visible = _decode_blocks(layout, decode, skip, window, explicit, device)
        prefills = []
        for b, n in enumerate(layout.num_new):
            if n == 1:
                continue
            total, first = layout.seq_lens[b], skip[b] * ps
            slots = _flat_slots(layout, b, skip[b], device)
            visible = None  # no cached prefix and a window that never cuts the chunk: plain causal attention
            if explicit or n < total or win.first_visible(total - 1, window) > 0:
                q_pos = torch.arange(total - n, total, device=device)
                visible = win.visible(q_pos, torch.arange(first, total, device=device), window)  # [n, L]
            prefills.append((starts[b], starts[b + 1], slots, visible))
        k_rows = layout.write_pages * (2 * ps) + layout.write_slots
        return _WindowPlan(blocks, decode_visible, prefills, torch.cat((k_rows, k_rows + ps)))

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor | KVLayer,
        layout: BatchLayout,
    ) -> torch.Tensor:
        if self._layout is not layout or self._plan is None:
            self.begin_step(layout)
        plan = self._plan
        assert plan is not None
        wplan = plan.windows[self.attention.window(layer_idx)]
        layer = KVLayer.of(kv_layer)
        kvh = layer.values.shape[3]
        # The step's new K and V in one indexed copy, encoded at the layer's precision (as AttentionBackend.write_kv).
        layer.write_rows(wplan.write_rows, k, v)
        num_tokens, heads, dim = q.shape
        cap = self.attention.soft_cap
        qf = q.float() * (self.attention.scale or 1.0 / math.sqrt(dim))
        if layer.codec.rotate_keys:  # keys are stored rotated: q.k is unchanged when q turns the same way
            qf = hadamard(qf)
        decode = self.decode_kernel(layer)
        if plan.decode_rows is not None and not wplan.prefills and plan.decode_rows.numel() == num_tokens:
            return decode(qf, layer, wplan, cap).to(q.dtype)
        out = torch.empty(num_tokens, heads, dim, dtype=torch.float32, device=q.device)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = decode(qf[plan.decode_rows], layer, wplan, cap)
        if wplan.prefill_head_rows is None:
            wplan.prefill_head_rows = [_head_rows(slots[None], kvh) for _, _, slots, _ in wplan.prefills]
        for (start, end, _, visible), head_rows in zip(wplan.prefills, wplan.prefill_head_rows, strict=True):
            keys = layer.gather_head_rows(head_rows, 0, torch.float32).view(kvh, -1, dim)  # [KVH, L, D]
            values = layer.gather_head_rows(head_rows, 1, torch.float32).view(kvh, -1, dim)
            qs = qf[start:end].transpose(0, 1)[None]  # [1, H, n, D]
            out[start:end] = _attend(qs, keys[None], values[None], visible, cap, causal=True)[0].transpose(0, 1)
        return out.to(q.dtype)

    def decode_kernel(self, layer: KVLayer):  # noqa: ANN201 (one of the two static methods below)
        """How decode rows attend over `layer`: the tiled, dequantizing path for quantized pages, one fused call of
        torch's attention over whole gathered pages otherwise."""
        return self._decode_tiled if layer.codec.quantized else self._decode

    @staticmethod
    def _decode(qf: torch.Tensor, layer: KVLayer, plan: _WindowPlan, soft_cap: float | None) -> torch.Tensor:
        """One query per sequence, all sequences in one attention call. Returns float32 [Bd, H, D].

        K and V are gathered a whole page at a time (page_size * KVH * D contiguous values: a plain memory copy,
        ~2x faster than gathering one head's row at a time) into [Bd, P * page_size, KVH, D]; the kernel reads
        them head by head through strides, without another copy. Full-precision layers only."""
        assert plan.decode_blocks is not None
        bd, heads, dim = qf.shape
        kvh = layer.values.shape[3]
        blocks = layer.values.view(-1, layer.page_size, kvh, dim)  # [pages * 2, page_size, KVH, D]
        kv = blocks.index_select(0, plan.decode_blocks).view(2, bd, -1, kvh, dim).float()  # [2, Bd, L, KVH, D]
        keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [Bd, KVH, L, D], strided
        out = _attend(qf.view(bd, heads, 1, dim), keys, values, plan.decode_visible, soft_cap)
        return out.view(bd, heads, dim)

    @staticmethod
    def _decode_tiled(qf: torch.Tensor, layer: KVLayer, plan: _WindowPlan, soft_cap: float | None) -> torch.Tensor:
        """The decode attention of a quantized layer, tile by tile (see the module docstring). float32 [Bd, H, D]."""
        assert plan.decode_blocks is not None
        bd, heads, dim = qf.shape
        if plan.decode_tiles is None:
            plan.decode_tiles = _decode_tiles(plan.decode_blocks, bd, layer.page_size)
        kvh = layer.values.shape[3]
        group = heads // kvh
        q4 = qf.view(bd, kvh, group, dim)
        tiles = plan.decode_tiles
        width = tiles[-1][0] + tiles[-1][1].numel() // bd * layer.page_size
        scores = torch.empty(bd, kvh, group, width, dtype=torch.float32, device=qf.device)
        for start, k_blocks, _ in tiles:
            keys = layer.gather_heads(k_blocks, 0, bd, torch.float32)  # [Bd, KVH, n, D]
            torch.matmul(q4, keys.transpose(-1, -2), out=scores[..., start : start + keys.shape[2]])
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap).mul_(soft_cap)
        if plan.decode_visible is not None:
            scores.masked_fill_(~plan.decode_visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.zeros(bd, kvh, group, dim, dtype=torch.float32, device=qf.device)
        for start, _, v_blocks in tiles:
            values = layer.gather_heads(v_blocks, 1, bd, torch.float32)
            out.add_(torch.matmul(probs[..., start : start + values.shape[2]], values))
        return out.view(bd, heads, dim)


def _decode_blocks(
    layout: BatchLayout, seqs: list[int], skip: list[int], window: int | None, explicit: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(blocks, visible) of _WindowPlan for the decode sequences `seqs`, each read from page skip[b] on; visible is
    None when every gathered position is seen (unless `explicit`)."""
    ps = layout.page_size
    first = [skip[b] for b in seqs]
    totals = [layout.seq_lens[b] for b in seqs]
    held = [t - f * ps for t, f in zip(totals, first, strict=True)]
    pages = _page_table(layout, seqs, first, held, device)
    blocks = torch.cat((2 * pages.flatten(), 2 * pages.flatten() + 1))
    width = pages.shape[1] * ps
    cut = any(win.first_visible(t - 1, window) > f * ps for t, f in zip(totals, first, strict=True))
    if not (explicit or cut or any(n != width for n in held)):
        return blocks, None
    k_pos = torch.tensor(first, device=device)[:, None] * ps + torch.arange(width, device=device)  # [Bd, width]
    q_pos = torch.tensor(totals, device=device)[:, None] - 1  # [Bd, 1]
    return blocks, win.visible(q_pos, k_pos, window)[:, None, :, :]  # [Bd, 1, 1, width]


def _decode_tiles(blocks: torch.Tensor, bd: int, page_size: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The decode blocks (every sequence's P K blocks, then their V blocks) cut into tiles of whole pages along the
    positions: (first position, K blocks [Bd * n], V blocks [Bd * n]) per tile, sequence-major inside a tile."""
    k_blocks, v_blocks = blocks.view(2, bd, -1)
    per_tile = max(1, DECODE_TILE_TOKENS // page_size)
    pages = k_blocks.shape[1]
    return [
        (j * page_size, k_blocks[:, j : j + per_tile].flatten(), v_blocks[:, j : j + per_tile].flatten())
        for j in range(0, pages, per_tile)
    ]
