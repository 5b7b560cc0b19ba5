"""Pure-torch paged attention: runs on any device, the reference every other backend is checked against.

Row-exact: a query row's output is a function of that row alone (its query, the keys and values it sees), the same
bits whether it is a decode of its own, one of a batch of decodes, a draft in a verify chunk of speculation or a row
of a prefill chunk cut anywhere. In a 16-bit model a last-bit difference inside attention flips the rounding of its
output now and then, and a greedy answer drifts from there: this is what keeps greedy output identical with the
cache and speculation on and off, batched. How (torch's CPU kernels and MKL's sgemm, measured; tests/test_attention.py
checks it on this machine's kernels):
- Scores and weighted sums are explicit batched matmuls. torch's fused attention sums in orders that depend on the
  key length and on the number of queries (a decode row and the same row in a chunk differed in most elements).
- Every product multiplies exactly GEMM_ROWS query rows at a time (a sequence's query rows are repeated until its
  rows times the group size is a multiple, and longer products run GEMM_ROWS rows a call): a product of a fixed row
  count is one kernel whatever the step. MKL picks its summation order from the row count, in families that differ
  by CPU and instruction set (on an AVX2 EPYC 1, 2-3 and >= 4 rows; under MKL's AVX2 path on a Xeon 2, 3, 8, 20
  and 32 rows each differed from 16). Every score product has at least MIN_WIDTH columns (1, 2-3, 4-11 and >= 12
  columns also sum differently).
- The weighted sum over positions is cut at fixed absolute positions into slices of at most SLICE_TOKENS (whole
  spans of pages), summed in order. MKL splits a longer inner dimension into blocks chosen from its length (193-384
  in halves), so a padded width would change a row's sum; inside a slice, padding with zero weights changes nothing.
- Softmax over at least MIN_WIDTH columns (torch reduces a row shorter than one vector in another order); masked and
  padded columns are -inf, which changes nothing either.

Per step, begin_step plans each distinct window of the model's layers (worker/attention/window.py; a window-paged
sliding layer through the layout's window table, `BatchLayout.windowed()`). Sequences that
add at most BATCHED_ROWS tokens (decodes, verify chunks, short chunks) are attended to together: their pages' K and
V are gathered whole, head-major, into [B, KVH, P * page_size, D] (one index_select of the rows; padding repeats a
sequence's last page), their query rows padded to the most any has, with a position mask. Longer chunks are
attended to one at a time, their query rows in blocks of at most BLOCK_ROWS whose scores stay under
SCORE_BLOCK_ELEMENTS, each block over the columns it can see. A sliding layer starts each sequence's gather at the
first page its window needs, moved back to a span boundary by repeating that page (masked, never the pages before
it, which may hold anything), so the slices fall at the same positions.
Scores, softmax and the weighted sum run in float32 whatever the pool dtype; a soft cap (Gemma 2) is applied to the
scores before the mask.

Quantized pools (int8, fp8_e4m3, int4: radixcache.kv_codec) are written through the layer's codec and read back
dequantized inside the gathers: the batched sequences a tile of about DECODE_TILE_TOKENS positions at a time (gather
a tile's int8/fp8/int4 blocks, dequantize them while they sit in the CPU's cache, one batched matmul for the scores),
so the full-precision K/V of a step is never materialised; the step's scores are softmaxed together, then the values
are read back the same way. Every position is read back from the pool, the step's own new tokens too, so a token
attends to the same stored values whether it was computed this step or came from the cache. For int4 (keys stored
Hadamard-rotated) the queries are rotated the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from radixcache.kv_codec import hadamard
from radixcache.pool import KVLayer
from radixcache.worker.attention import window as win
from radixcache.worker.attention.base import AttentionBackend
from radixcache.worker.attention.layout import BatchLayout

# Positions per tile of the quantized batched path: a tile's dequantized K (B x 256 x KVH x D floats) stays in the L2
# cache. Measured at b8 x 4k, 4 KV heads of 64 (one thread): 256 -> 26 ms per layer, 128 -> 33, 512 -> 49, 1024 -> 57.
DECODE_TILE_TOKENS = 256

# Long chunks form their scores a block of query rows at a time, at most this many float32 elements (16 MiB): a
# 512-token chunk of a 16-head model over an 8k prefix would otherwise hold 268 MB of scores at once. Measured on a
# 1,500-token prefill of 12 heads (one thread): 2^24 -> 467 ms per layer, 2^22 -> 236, 2^20 -> 336.
SCORE_BLOCK_ELEMENTS = 1 << 22
# And at most this many query rows a block: a block's scores are a rectangle up to its last row's position, so
# smaller blocks skip more of a causal chunk's upper triangle (a 512-token prefill of 12 heads: one block 42 ms per
# layer, blocks of 128 rows 19; fewer rows cost more calls).
BLOCK_ROWS = 128

# Sequences adding at most this many tokens are attended to together (a verify chunk is 1 + its draft tokens).
BATCHED_ROWS = 16

GEMM_ROWS = 16  # query rows of every product (see the module docstring)
GEMM_COLUMNS = 16  # score products are whole blocks of this many columns (see `_scores`)
SLICE_TOKENS = 128  # the longest inner dimension of a weighted sum's product
MIN_WIDTH = 16  # columns of every softmax, at least


def span_pages(page_size: int) -> int:
    """Pages per span: slices of the weighted sum never cross a span boundary (absolute page multiples of this)."""
    return max(1, SLICE_TOKENS // page_size)


def slices(start: int, end: int, page_size: int) -> list[tuple[int, int]]:
    """The weighted sum's slices of columns start..end of a gather whose column 0 is at a span boundary: cut at every
    span boundary and, inside a span longer than SLICE_TOKENS (pages longer than that), every SLICE_TOKENS."""
    span = span_pages(page_size) * page_size
    cuts = []
    for s in range(start - start % span, end, span):
        cuts.extend(c for c in range(s, min(s + span, end), SLICE_TOKENS) if c > start)
    bounds = [start, *cuts, end]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass
class _Rows:
    """Query rows attended to together over one gather: `rows` per sequence of the gather (padding repeats a real
    row), columns c0..c1 of it (the rest invisible to every one of them)."""

    q_index: torch.Tensor  # [B * rows] the step's q row of each (sequence, row)
    rows: int
    hidden: torch.Tensor | None  # [B, 1, rows, 1, c1 - c0 - mask_from] True where a column is masked; None: none is
    mask_from: int  # the first column (from c0) any row masks: before it every row sees every column
    c0: int
    c1: int
    slices: list[tuple[int, int]]  # the weighted sum's slices, relative to c0
    first: int  # the real rows are the first `first` rows of every sequence...
    real: torch.Tensor | None  # ...or these of the B * rows (None: the first ones)
    dest: torch.Tensor | None  # and their rows in the step's output (None: all of them, in order)


@dataclass
class _Gather:
    """Pages gathered once per layer: `batch` sequences' `pages` [B, P], column 0 of each at a span boundary."""

    pages: torch.Tensor
    batch: int
    width: int  # P * page_size
    rows: list[_Rows] | None  # None: a long chunk's, blocked at the first layer that knows the head count
    chunk: tuple[int, int, int] | None = None  # a long chunk's (first q row, new tokens, total)
    first: int = 0  # a long chunk's first column position
    head_rows: torch.Tensor | None = None  # [2 * B * KVH * width] K rows then V rows, head-major (see _head_rows)
    token_rows: torch.Tensor | None = None  # latent pages: [B * width] token rows (page * page_size + slot)


@dataclass
class _Plan:
    # per window: [2T] row of each new token's K (first T) and V (last T) in the layer's rows view (in window slots
    # for a window-paged sliding layer)
    write_rows: dict[int | None, torch.Tensor]
    windows: dict[int | None, list[_Gather]]


def _table(
    layout: BatchLayout, seqs: list[int], skip: list[int], device: torch.device
) -> tuple[torch.Tensor, list[int], int]:
    """(pages [len(seqs), P], first position of each row, P * page_size): each sequence's pages from its block table's
    page skip[b] on, moved back to a span boundary by repeating page skip[b], padded by repeating its last page."""
    ps, span = layout.page_size, span_pages(layout.page_size)
    used = [-(-layout.seq_lens[b] // ps) for b in seqs]
    lead = [skip[b] % span for b in seqs]
    cols = max(max(ld + u - skip[b] for ld, u, b in zip(lead, used, seqs, strict=True)), -(-MIN_WIDTH // ps))
    sel = torch.tensor(seqs, dtype=torch.int64, device=device)
    base = layout.kv_indptr[:-1].to(torch.int64)[sel][:, None]
    low = torch.tensor([skip[b] for b in seqs], dtype=torch.int64, device=device)[:, None]
    high = torch.tensor(used, dtype=torch.int64, device=device)[:, None] - 1
    idx = low - torch.tensor(lead, dtype=torch.int64, device=device)[:, None] + torch.arange(cols, device=device)
    idx = torch.minimum(torch.maximum(idx, low), high)
    first = [(skip[b] - ld) * ps for b, ld in zip(seqs, lead, strict=True)]
    return layout.kv_indices.to(torch.int64)[base + idx], first, cols * ps


def _head_rows(pages: torch.Tensor, page_size: int, kvh: int) -> torch.Tensor:
    """[B, P] pages -> flat [B * KVH * P * page_size] rows of a layer viewed as one row per (K row, head), ordered
    (sequence, head, position): one index_select lands K (or V, page_size token rows later) head-major, as the
    batched matmuls want it (a page gather then a transpose reads everything twice)."""
    slots = (pages[:, :, None] * (2 * page_size) + torch.arange(page_size, device=pages.device)).flatten(1)
    heads = torch.arange(kvh, device=pages.device)[None, :, None]
    return (slots[:, None, :] * kvh + heads).flatten()


def _tile_bounds(pages: int, page_size: int) -> list[tuple[int, int]]:
    """(first, end) pages of each tile of the quantized batched path: whole spans of about DECODE_TILE_TOKENS, and a
    last tile of fewer than MIN_WIDTH positions joins the one before (a score product that narrow sums differently)."""
    per_tile = max(1, DECODE_TILE_TOKENS // (span_pages(page_size) * page_size)) * span_pages(page_size)
    starts = list(range(0, pages, per_tile))
    if len(starts) > 1 and (pages - starts[-1]) * page_size < MIN_WIDTH:
        starts.pop()
    return list(zip(starts, [*starts[1:], pages], strict=True))


def _products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) for a [X, M, K] with M a multiple of GEMM_ROWS, GEMM_ROWS rows of a per call."""
    rows = a.shape[1]
    assert rows % GEMM_ROWS == 0, rows
    if rows == GEMM_ROWS:
        return torch.bmm(a, b)
    return torch.cat([torch.bmm(a[:, r : r + GEMM_ROWS], b) for r in range(0, rows, GEMM_ROWS)], dim=1)


def _scores(q3: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q3 [X, M, D] @ keys [X, D, W] with every product GEMM_COLUMNS-aligned: MKL computes the last W % 16 columns
    of a product in another order than whole blocks of 16 (its AVX2 path), so a ragged width's last columns come
    from a product of the last GEMM_COLUMNS columns instead. W >= MIN_WIDTH."""
    width = keys.shape[2]
    tail = width % GEMM_COLUMNS
    if tail == 0 or width < GEMM_COLUMNS:  # (narrower only if a pool holds fewer than MIN_WIDTH positions)
        return _products(q3, keys)
    whole = _products(q3, keys[:, :, : width - tail])
    last = _products(q3, keys[:, :, width - GEMM_COLUMNS :])[:, :, GEMM_COLUMNS - tail :]
    return torch.cat((whole, last), dim=2)


def _hidden(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, R, 1, W] True where the query at q_pos [B, R] may not see the key at k_pos [B, W]."""
    return (~win.visible(q_pos, k_pos, window))[:, None, :, None, :]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    tile_full_precision = False  # bench/kv_precision_bench.py tiles full-precision pages too, to compare

    def __init__(self, device: str | torch.device = "cpu", **options: object) -> None:
        super().__init__(device, **options)  # type: ignore[arg-type]
        self._plan: _Plan | None = None
        self._layout: BatchLayout | None = None
        group = (self.num_heads // self.num_kv_heads) if self.num_heads and self.num_kv_heads else 1
        # query rows per sequence come in steps of this many, so that rows x group fills whole products
        self._row_step = GEMM_ROWS // math.gcd(GEMM_ROWS, group)

    def begin_step(self, layout: BatchLayout) -> None:
        starts = [0]
        for n in layout.num_new:
            starts.append(starts[-1] + n)
        windows, write_rows = {}, {}
        for w in self.attention.distinct_windows:
            read = layout if w is None else layout.windowed()  # a window-paged sliding layer: its window slots
            windows[w] = self._window_plan(read, w, starts)
            k_rows = read.write_pages * (2 * read.page_size) + read.write_slots
            write_rows[w] = torch.cat((k_rows, k_rows + read.page_size))
        self._plan = _Plan(write_rows, windows)
        self._layout = layout

    def _rows(self, n: int) -> int:
        """Query rows per sequence for n real ones: the fewest >= n that fill whole products of GEMM_ROWS rows."""
        return -(-n // self._row_step) * self._row_step

    def _window_plan(self, layout: BatchLayout, window: int | None, starts: list[int]) -> list[_Gather]:
        device = layout.positions.device
        skip = win.skipped_pages(layout, window)
        batched = [b for b, n in enumerate(layout.num_new) if n <= BATCHED_ROWS]
        gathers = []
        if batched:
            gathers.append(self._batched(layout, window, batched, skip, starts, device))
        for b, n in enumerate(layout.num_new):
            if n > BATCHED_ROWS:
                pages, first, width = _table(layout, [b], skip, device)
                gathers.append(_Gather(pages, 1, width, None, (starts[b], n, layout.seq_lens[b]), first[0]))
        return gathers

    def _batched(
        self,
        layout: BatchLayout,
        window: int | None,
        seqs: list[int],
        skip: list[int],
        starts: list[int],
        device: torch.device,
    ) -> _Gather:
        """The gather and rows of the sequences attended to together."""
        ps = layout.page_size
        pages, first, width = _table(layout, seqs, skip, device)
        news = [layout.num_new[b] for b in seqs]
        totals = [layout.seq_lens[b] for b in seqs]
        rows = self._rows(max(news))
        q_index = [starts[b] + (r if r < n else 0) for b, n in zip(seqs, news, strict=True) for r in range(rows)]
        hidden = None
        cut = any(win.first_visible(t - n, window) > f for t, n, f in zip(totals, news, first, strict=True))
        if cut or max(news) > 1 or any(t != width for t in totals):
            q_pos = torch.tensor(
                [[t - n + (r if r < n else 0) for r in range(rows)] for t, n in zip(totals, news, strict=True)],
                device=device,
            )
            k_pos = torch.tensor(first, device=device)[:, None] + torch.arange(width, device=device)
            hidden = _hidden(q_pos, k_pos, window)
        i64 = dict(dtype=torch.int64, device=device)
        real = None
        if min(news) != max(news):
            real = torch.tensor([i * rows + r for i, n in enumerate(news) for r in range(n)], **i64)
        dest = None
        if len(seqs) != layout.batch_size:  # else the real rows are the step's rows, in order
            dest = torch.tensor([starts[b] + r for b, n in zip(seqs, news, strict=True) for r in range(n)], **i64)
        q_index_t = torch.tensor(q_index, **i64)
        spec = _Rows(q_index_t, rows, hidden, 0, 0, width, slices(0, width, ps), max(news), real, dest)
        return _Gather(pages, len(seqs), width, [spec])

    def _blocks(self, g: _Gather, heads: int, window: int | None, device: torch.device) -> list[_Rows]:
        """A long chunk's query rows in blocks of bounded scores, each over the columns its rows can see."""
        assert g.chunk is not None and self._layout is not None
        ps = self._layout.page_size
        start, n, total = g.chunk
        per_block = max(1, min(BLOCK_ROWS, SCORE_BLOCK_ELEMENTS // (heads * g.width)))
        out = []
        for r0 in range(0, n, per_block):
            r1 = min(n, r0 + per_block)
            rows = self._rows(r1 - r0)
            pos = [total - n + min(r, r1 - 1) for r in range(r0, r0 + rows)]  # padding repeats the last real row
            lo = win.first_visible(pos[0], window) - g.first
            c0 = slices(0, lo + 1, ps)[-1][0] if lo > 0 else 0  # the slice its first visible column is in
            c1 = min(g.width, max(pos[-1] + 1 - g.first, c0 + MIN_WIDTH))
            while c1 - c0 < MIN_WIDTH and c0 > 0:  # a softmax row of fewer columns would sum differently
                c0 = slices(0, c0, ps)[-1][0]
            # Columns before the first row's own position + 1 are seen by every row, unless a window cuts them.
            mask_from = 0 if win.first_visible(pos[-1], window) - g.first > c0 else max(0, pos[0] + 1 - g.first - c0)
            k_pos = g.first + torch.arange(c0 + mask_from, c1, device=device)
            hidden = _hidden(torch.tensor([pos], device=device), k_pos[None], window)
            if not bool(hidden.any()):
                hidden = None
            q_index = torch.tensor([start + p - (total - n) for p in pos], dtype=torch.int64, device=device)
            dest = torch.arange(start + r0, start + r1, device=device)
            sl = [(a - c0, e - c0) for a, e in slices(c0, c1, ps)]
            out.append(_Rows(q_index, rows, hidden, mask_from, c0, c1, sl, r1 - r0, None, dest))
        return out

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
        window = self.attention.window(layer_idx)
        layer = KVLayer.of(kv_layer)
        # The step's new K and V in one indexed copy, encoded at the layer's precision (as AttentionBackend.write_kv).
        layer.write_rows(plan.write_rows[window], k, v)
        num_tokens, heads, dim = q.shape
        out = None
        for g in plan.windows[window]:
            if g.rows is None:
                g.rows = self._blocks(g, heads, window, q.device)
            for spec, o in zip(g.rows, self._attend_gather(q, layer, g), strict=True):
                if spec.dest is None:
                    return o
                if out is None:
                    out = torch.empty(num_tokens, heads, dim, dtype=q.dtype, device=q.device)
                out.index_copy_(0, spec.dest, o)
        assert out is not None
        return out

    def _attend_gather(self, q: torch.Tensor, layer: KVLayer, g: _Gather) -> Iterable[torch.Tensor]:
        """Each of g's row sets attended: [real rows, H, D] in q's dtype."""
        assert g.rows is not None
        ps, kvh, dim = layer.page_size, layer.values.shape[3], q.shape[2]
        if self.attention.latent and layer.codec.rotate_keys:
            raise ValueError("latent (MLA) pages cannot be read at int4: its rotated keys would turn one latent half")
        if (layer.codec.quantized or self.tile_full_precision) and g.chunk is None and not self.attention.latent:
            bounds = _tile_bounds(g.pages.shape[1], ps)

            def tiles(which: int):  # noqa: ANN202
                for j, e in bounds:
                    blocks = (2 * g.pages[:, j:e] + which).flatten()
                    yield j * ps, layer.gather_heads(blocks, which, g.batch, torch.float32)

            spec = g.rows[0]
            yield self._attend(q, layer, spec, tiles(0), tiles(1), tiled=True)
            return
        if self.attention.latent:  # a latent page: one latent per token, read whole as its key and its value
            if not layer.latent:
                raise ValueError("latent attention reads latent pages: the pool must be built with latent=True")
            if g.token_rows is None:
                slots = torch.arange(ps, device=g.pages.device)
                g.token_rows = (g.pages[:, :, None] * ps + slots).flatten()
            kk = layer.gather_latents(g.token_rows, torch.float32).view(g.batch, kvh, g.width, dim)
            for spec in g.rows:
                c0, c1 = spec.c0, spec.c1
                yield self._attend(q, layer, spec, [(0, kk[:, :, c0:c1])], [(0, kk[:, :, c0:c1])])
            return
        if g.head_rows is None:  # K rows, then V rows (page_size token rows later)
            k_rows = _head_rows(g.pages, ps, kvh)
            g.head_rows = torch.cat((k_rows, k_rows + ps * kvh))
        shape = (g.batch, kvh, g.width, dim)
        if layer.codec.quantized:  # K and V dequantized with their own scales
            k_rows = g.head_rows[: g.head_rows.numel() // 2]  # gather_head_rows finds V from K rows
            kk = layer.gather_head_rows(k_rows, 0, torch.float32).view(shape)
            vv = layer.gather_head_rows(k_rows, 1, torch.float32).view(shape)
        else:  # K and V in one gather, widened once
            kk, vv = layer.gather_head_rows(g.head_rows, 0, torch.float32).view(2, *shape)
        for spec in g.rows:
            c0, c1 = spec.c0, spec.c1
            yield self._attend(q, layer, spec, [(0, kk[:, :, c0:c1])], [(0, vv[:, :, c0:c1])])

    def _attend(
        self,
        q: torch.Tensor,
        layer: KVLayer,
        spec: _Rows,
        keys: Iterable[tuple[int, torch.Tensor]],
        values: Iterable[tuple[int, torch.Tensor]],
        tiled: bool = False,
    ) -> torch.Tensor:
        """Rows `spec` of q [T, H, D] over columns c0..c1 of a gather, given as (first column relative to c0,
        [B, KVH, n, D]) tiles in order, keys first: [real rows, H, D] in q's dtype."""
        heads, dim = q.shape[1], q.shape[2]
        key_tiles = iter(keys)
        c_first, k0 = next(key_tiles)
        b, kvh = k0.shape[0], k0.shape[1]
        group, rows, width = heads // kvh, spec.rows, spec.c1 - spec.c0
        qs = q.index_select(0, spec.q_index)
        if layer.codec.rotate_keys:  # keys are stored rotated: q.k is unchanged when q turns the same way
            qs = hadamard(qs)
        # [B, KVH, rows * G, D], float32, scaled (one copy: gather, then transpose and widen together)
        q4 = torch.empty(b, kvh, rows, group, dim, dtype=torch.float32, device=q.device)
        q4.copy_(qs.view(b, rows, kvh, group, dim).transpose(1, 2))
        q4 = q4.mul_(self.attention.scale or 1.0 / math.sqrt(dim)).view(b, kvh, rows * group, dim)
        q3 = q4.view(b * kvh, rows * group, dim)  # batched matmuls on 3-D views: torch.matmul's reshapes cost more
        if not tiled:
            scores = _scores(q3, k0.flatten(0, 1).transpose(1, 2)).view(b, kvh, rows * group, width)
        else:
            scores = torch.empty(b, kvh, rows * group, width, dtype=torch.float32, device=q.device)
            for c, kt in ((c_first, k0), *key_tiles):
                tile = scores[..., c : c + kt.shape[2]]
                tile.copy_(_scores(q3, kt.flatten(0, 1).transpose(1, 2)).view_as(tile))
        if self.attention.soft_cap is not None:
            cap = self.attention.soft_cap
            scores = torch.tanh(scores / cap).mul_(cap)
        if spec.hidden is not None:
            scores.view(b, kvh, rows, group, width)[..., spec.mask_from :].masked_fill_(spec.hidden, float("-inf"))
        # in place (the same bits as torch.softmax): a long chunk's block of scores is tens of MB
        probs = torch.ops.aten._softmax.out(scores, -1, False, out=scores).view(b * kvh, rows * group, width)
        out = None
        for c, vt in values:
            parts = spec.slices if not tiled else slices(c, c + vt.shape[2], layer.page_size)
            v3 = vt.flatten(0, 1)
            for a, e in parts:
                part = _products(probs[:, :, a:e], v3[:, a - c : e - c])
                out = part if out is None else out.add_(part)
        assert out is not None
        # [B, KVH, rows, G, D] -> the real rows [n, H, D] in q's dtype
        rows_first = out.view(b, kvh, rows, group, dim).transpose(1, 2)
        if spec.real is None:
            result = torch.empty(b, spec.first, heads, dim, dtype=q.dtype, device=q.device)
            result.view(b, spec.first, kvh, group, dim).copy_(rows_first[:, : spec.first])
            return result.view(-1, heads, dim)
        result = torch.empty(b, rows, heads, dim, dtype=q.dtype, device=q.device)
        result.view(b, rows, kvh, group, dim).copy_(rows_first)
        return result.view(-1, heads, dim).index_select(0, spec.real)
