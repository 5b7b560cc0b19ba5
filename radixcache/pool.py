"""KV pool: the tensors that hold every cached key and value, addressed by page, at one precision per arena.

Layout (one `PageArena` per precision; `PageArena.__init__` is the one place that shapes the tensors): values
[layers, pages, 2, page_size, kv_heads, stored_dim] in the precision's storage dtype (stored_dim = head_dim, or
head_dim / 2 for int4's packed nibbles) and, for precisions with per-token scales (int8, int4), scales [layers,
pages, 2, page_size, kv_heads] in fp16. For one layer, `pool.layer(i)` is the values [pages, 2, page_size, kv_heads,
stored_dim]: FlashInfer's NHD paged layout with K at index 0 and V at 1; `pool.kv_layer(i)` is the `KVLayer` an
attention backend reads and writes through (values, scales and how to decode them). How each precision encodes a
vector: `radixcache.kv_codec`.

Page ids: the main arena (the pool's `kv_dtype`, where requests write) holds ids 0..main_pages-1; with demotion
(`demoted_pages`), a second arena of int4 pages holds the ids after it. Which page belongs to whom is decided by
`radixcache.cache`; this module only owns the storage.

A page moves in and out of the pool whole, as a `radixcache.page_data.PageData` (`read_page` / `write_page`): its
K/V in its arena's storage dtype plus the scales its precision needs, named by its `kv_dtype`.

Latent pages (multi-head latent attention: DeepSeek V2/V3, worker/model/mla.py; a pool built with `latent=True`):
per token and layer the model caches one vector of D = kv_lora_rank + qk_rope_head_dim values, latent = [c | k_pe]
(c: kv_a_layernorm's output, k_pe: the roped shared key part), and nothing else: no separate K and V. Such a pool
has the tensors of an ordinary pool of KVShape(layers, kv_heads=1, head_dim=D / 2) (D must be even; 576 = 2 x 288
for DeepSeek V3), but its bytes are token-contiguous: one layer's values [pages, 2, page_size, 1, D / 2] are
contiguous per page, and a latent page's 2 x page_size rows of D / 2 are read as page_size rows of D, so token
(page, slot)'s latent in layer i is the D contiguous values values[i].view(pages, page_size, D)[page, slot] (its
first half at half-row page * 2 * page_size + 2 * slot, its second half at the next; `KVLayer.latent_tokens`).
`latent_tokens()[..., :R]` is then FlashInfer's ckv_cache [pages, page_size, R] and `[..., R:]` its kpe_cache,
views with unit-strided rows of stride D. A page's bytes are D values per token and layer (no half left empty), and
every codec encodes row by row (one row = D / 2 values with its own scale), so everything that moves or hashes
whole pages (PageData, tiers, the fleet store, transcode for demotion) moves latent pages unchanged; copies of a
slot range (`copy_prefix`) move whole latents along the slot axis. What the bytes mean is the model's, named by the
fingerprint (its config, and "latent_layout": worker/engine/fingerprint.py).
At a quantized kv_dtype: int8 keeps a fp16 scale per half-row (two per latent: scales.view(pages, page_size, 2) is
(first-half scale, second-half scale) per token); fp8_e4m3 one per-layer scale for the whole latent (both halves
of a latent may share a block, so a latent arena's V scales are set to its K scales). int4 is refused for latent
pages at start-up (its rotated keys would rotate the first half, which is also the value: worker/engine/step.py,
check_latent_pages); demoted int4 copies are never read by attention, and transcode round-trips them row by row.
Window paging never combines with latent pages.

Window paging (`window_layers`, a model's sliding layers, with `window_slots` > 0): those layers live apart, in a
window arena of `window_slots` slots, so that a page can give back its sliding layers' values while keeping its
global ones (radixcache.window_parts decides which page holds which slot). The main arena then holds the other
layers only; `kv_layer(i)` maps a model layer to its arena, and a backend reads a sliding layer's pages through
their window slots (BatchLayout's window table). Demotion and whole-page transfers (tiers) need every layer in the
page, so they do not combine with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixcache.kv_codec import KVCodec, codec_of, hadamard, kv_dtype_name
from radixcache.page_data import PageData

__all__ = ["KVLayer", "KVPool", "KVShape", "PageArena", "kv_bytes_per_token", "kv_dtype_name", "parse_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'float16' / torch.float32 -> torch.dtype, with an error naming the accepted spellings."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str | torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + the scale of a quantized precision)."""
    return codec_of(dtype).bytes_per_token(layers, kv_heads, head_dim)


# A pool whose every layer slides keeps only window parts; its page ids (bookkeeping, no values) outnumber its
# slots this many times, so the tree can remember prefixes that long beyond what the windows hold.
ALL_SLIDING_PAGES_PER_SLOT = 8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 as its bytes: torch has no index_copy (CPU) and not every gather kernel for it; moving the bytes of a
    1-byte dtype is the same thing. Other dtypes as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@dataclass(frozen=True)
class KVShape:
    """The model-side shape of one token's KV entry."""

    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


def latent_rows(rows: torch.Tensor, page_size: int) -> torch.Tensor:
    """K/V rows (page * 2 * page_size + slot for a token's K, page_size rows later for its V) -> the half-rows a
    latent page keeps them at: page * 2 * page_size + 2 * slot for the first half, the next for the second (the
    module docstring, latent pages). The one place that remaps rows for latent pages."""
    page, within = rows.div(2 * page_size, rounding_mode="floor"), rows.remainder(2 * page_size)
    which, slot = within.div(page_size, rounding_mode="floor"), within.remainder(page_size)
    return page * (2 * page_size) + 2 * slot + which


@dataclass(frozen=True)
class KVLayer:
    """One layer's pages as an attention backend writes and reads them.

    values [pages, 2, page_size, kv_heads, stored_dim] (codec.storage), scales [pages, 2, page_size, kv_heads] (fp16,
    int8/int4) or None, k_scale / v_scale (fp8's per-layer scales). Rows: viewed as [pages * 2 * page_size, ...],
    token (page, slot)'s K is row page * 2 * page_size + slot and its V page_size rows later; blocks: viewed as
    [pages * 2, page_size, ...], block 2p is page p's K and 2p + 1 its V. Every read dequantizes only what it
    gathers (never a full-precision copy of the pool).

    `latent`: the layer holds latent pages (the module docstring): the same tensors, token-contiguous. Writes take
    the K/V rows above and store a token's two halves at half-rows page * 2 * page_size + 2 * slot and the next
    (`latent_rows`), so token (page, slot)'s latent is latent_tokens()[page, slot]; it is read whole by token row
    (page * page_size + slot, `gather_latents`), never by K or V block (gather_heads / gather_head_rows refuse it).
    fp8: one scale for the whole latent (k_scale; the pool sets v_scale to it).
    """

    values: torch.Tensor
    scales: torch.Tensor | None
    codec: KVCodec
    k_scale: float = 1.0
    v_scale: float = 1.0
    latent: bool = False

    @classmethod
    def of(cls, layer: torch.Tensor | KVLayer) -> KVLayer:
        """A KVLayer as is; a bare full-precision layer tensor (tests, tools) wrapped as one."""
        if isinstance(layer, KVLayer):
            return layer
        return cls(layer, None, codec_of(layer.dtype))

    @property
    def page_size(self) -> int:
        return int(self.values.shape[2])

    @property
    def latent_dim(self) -> int:
        """D: the values of one token's latent (2 x head_dim of the pool's shape)."""
        return 2 * int(self.values.shape[3]) * int(self.values.shape[4]) * self.codec.pack

    def write_rows(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' k, v [T, kv_heads, head_dim] at rows `rows` [2T] (their K rows, then their V rows),
        encoded (keys rotated first where the codec says so). A latent layer's k and v are the halves of each
        latent, stored at the half-rows `latent_rows` maps those rows to."""
        codec = self.codec
        if codec.rotate_keys:
            k = hadamard(k)
        kq, ks = codec.encode(k, self.k_scale)
        vq, vs = codec.encode(v, self.v_scale)
        if self.latent:
            rows = latent_rows(rows, self.page_size)
        kvh = self.values.shape[3]
        values = _bytes(self.values).view(-1, kvh, self.values.shape[4])
        values.index_copy_(0, rows, torch.cat((_bytes(kq), _bytes(vq))))
        if self.scales is not None:
            assert ks is not None and vs is not None, "a codec with per-token scales returns them"
            self.scales.view(-1, kvh).index_copy_(0, rows, torch.cat((ks, vs)))

    def write(self, pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """write_rows for tokens addressed by (page [T], slot [T])."""
        k_rows = pages * (2 * self.page_size) + slots
        self.write_rows(torch.cat((k_rows, k_rows + self.page_size)), k, v)

    def latent_tokens(self) -> torch.Tensor:
        """[pages, page_size, D]: a view of a latent layer's values, one token's latent a row (at fp8 the raw
        float8 values, to be multiplied by k_scale). [..., :kv_lora_rank] is FlashInfer's ckv_cache and
        [..., kv_lora_rank:] its kpe_cache: unit-strided rows of stride D. Values only: not for int8 / int4 pages,
        whose latents need their per-row scales (gather_latents)."""
        if not self.latent:
            raise ValueError("latent_tokens: this layer does not hold latent pages")
        if self.codec.token_scales:
            raise ValueError(f"latent_tokens: {self.codec.name} latents need their scales; use gather_latents")
        return self.values.view(self.values.shape[0], self.page_size, self.latent_dim)

    def gather_latents(self, token_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[n, D] in `dtype`: the latents of token rows `token_rows` [n] (page * page_size + slot) of a latent layer,
        dequantized (int8: each half-row with its own scale; fp8: k_scale, the latent's one scale)."""
        if not self.latent:
            raise ValueError("gather_latents: this layer does not hold latent pages")
        n, half = token_rows.numel(), self.values.shape[4]
        if self.scales is None:  # one gather of whole latents
            values = _bytes(self.values).view(-1, 2 * half).index_select(0, token_rows).view(self.values.dtype)
            return self.codec.decode(values, None, dtype, self.k_scale)
        rows = (2 * token_rows[:, None] + torch.arange(2, device=token_rows.device)).flatten()  # its two half-rows
        values = _bytes(self.values).view(-1, half).index_select(0, rows).view(self.values.dtype)
        scales = self.scales.view(-1).index_select(0, rows)
        return self.codec.decode(values, scales, dtype, self.k_scale).view(n, -1)

    def gather_heads(self, blocks: torch.Tensor, which: int, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """[batch, kv_heads, n * page_size / batch, head_dim] in `dtype`, contiguous (head-major, as a batched
        matmul wants it): blocks `blocks` [n] in sequence-major order, all K blocks (which=0) or all V blocks
        (which=1), dequantized. The transpose runs on the stored bytes, before they are widened."""
        self._not_latent("gather_heads")
        _, _, ps, kvh, dim = self.values.shape
        values = _bytes(self.values).view(-1, ps, kvh, dim).index_select(0, blocks)
        values = values.view(batch, -1, kvh, dim).transpose(1, 2).contiguous().view(self.values.dtype)
        scales = None
        if self.scales is not None:
            scales = self.scales.view(-1, ps, kvh).index_select(0, blocks).view(batch, -1, kvh).transpose(1, 2)
        return self.codec.decode(values, scales, dtype, self.v_scale if which else self.k_scale)

    def gather_head_rows(self, head_rows: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, head_dim] in `dtype`: rows `head_rows` [n] of the layer's K (which=0) or V (which=1) viewed as one
        row per (K row, head) (row * kv_heads + head, see write_rows), dequantized."""
        self._not_latent("gather_head_rows")
        kvh, dim = self.values.shape[3], self.values.shape[4]
        offset = which * self.page_size * kvh  # V rows are page_size token rows after K's
        values = _bytes(self.values).view(-1, dim)[offset:].index_select(0, head_rows).view(self.values.dtype)
        scales = None if self.scales is None else self.scales.view(-1)[offset:].index_select(0, head_rows)
        return self.codec.decode(values, scales, dtype, self.v_scale if which else self.k_scale)

    def _not_latent(self, what: str) -> None:
        if self.latent:
            raise ValueError(f"{what} reads K or V blocks; a latent layer has none (gather_latents)")


class PageArena:
    """The storage of `num_pages` pages at one precision, every layer (see the module docstring for the layout).

    `layer_scales` [layers, 2] float32: fp8's per-layer K and V scales (default 1.0), part of every page read.
    `latent`: the pages are latent pages (token-contiguous, see the module docstring): a layer's fp8 V scale is set
    to its K scale (one scale per latent, whatever `layer_scales` says of V), and slot copies move whole latents."""

    def __init__(
        self,
        shape: KVShape,
        kv_dtype: str | torch.dtype,
        *,
        page_size: int,
        num_pages: int,
        device: torch.device,
        layer_scales: torch.Tensor | None = None,
        layers: int | None = None,
        latent: bool = False,
    ) -> None:
        """`layers`: how many of the model's layers this arena holds (default all; 0 for the main arena of a
        window-paged pool whose every layer slides: its pages are then ids without values)."""
        self.codec = codec = codec_of(kv_dtype)
        self.kv_dtype = codec.name
        self.num_pages = num_pages
        self.latent = latent
        layers = shape.layers if layers is None else layers
        self.page_shape = (layers, 2, page_size, shape.kv_heads, codec.stored_dim(shape.head_dim))
        layers, *rest = self.page_shape
        self.values = torch.zeros((layers, num_pages, *rest), dtype=codec.storage, device=device)
        self.scales = None
        if codec.token_scales:
            self.scales = torch.zeros((layers, num_pages, *rest[:-1]), dtype=torch.float16, device=device)
        self.layer_scales = None
        self._layer_floats = [(1.0, 1.0)] * layers
        if codec.layer_scales:
            scales = torch.ones(layers, 2) if layer_scales is None else layer_scales.detach().float().cpu().clone()
            if tuple(scales.shape) != (layers, 2) or not bool((scales > 0).all() and scales.isfinite().all()):
                raise ValueError(f"{codec.name} scales must be [layers={layers}, 2] finite and > 0")
            if latent:  # both halves of a latent may share a block: one scale for the whole latent
                scales[:, 1] = scales[:, 0]
            self.layer_scales = scales
            self._layer_floats = [(float(k), float(v)) for k, v in scales.tolist()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales) if t is not None)

    def layer(self, index: int) -> KVLayer:
        k_scale, v_scale = self._layer_floats[index]
        scales = None if self.scales is None else self.scales[index]
        return KVLayer(self.values[index], scales, self.codec, k_scale, v_scale, self.latent)

    def read_float(self, layer: int, pages: list[int]) -> torch.Tensor:
        """[n, 2, page_size, kv_heads, head_dim] float32: what `pages` (arena-local ids) of one layer hold, keys
        turned back from the rotation they are stored in. (A latent page's [2, page_size] are its 2 x page_size
        half-rows in storage order, not K and V; write_float puts them back where they were, which is all transcode
        needs: every codec encodes row by row.)"""
        index = torch.tensor(pages, device=self.values.device)
        values = _bytes(self.values[layer]).index_select(0, index).view(self.values.dtype)
        scales = [None, None] if self.scales is None else self.scales[layer].index_select(0, index).unbind(1)
        k_scale, v_scale = self._layer_floats[layer]
        k = self.codec.decode(values[:, 0], scales[0], torch.float32, k_scale)
        v = self.codec.decode(values[:, 1], scales[1], torch.float32, v_scale)
        return torch.stack((hadamard(k) if self.codec.rotate_keys else k, v), dim=1)

    def write_float(self, layer: int, pages: list[int], kv: torch.Tensor) -> None:
        """Encode kv [n, 2, page_size, kv_heads, head_dim] (as read_float returns it) into `pages` of one layer."""
        k_scale, v_scale = self._layer_floats[layer]
        k = hadamard(kv[:, 0]) if self.codec.rotate_keys else kv[:, 0]
        kq, ks = self.codec.encode(k, k_scale)
        vq, vs = self.codec.encode(kv[:, 1], v_scale)
        index = torch.tensor(pages, device=self.values.device)
        _bytes(self.values[layer]).index_copy_(0, index, torch.stack((_bytes(kq), _bytes(vq)), dim=1))
        if self.scales is not None:
            assert ks is not None and vs is not None, "a codec with per-token scales returns them"
            self.scales[layer].index_copy_(0, index, torch.stack((ks, vs), dim=1))

    def copy_prefix(self, src: int, dst: int, num_slots: int) -> None:
        """Slots 0..num_slots-1 of page `src` into page `dst`, every layer, with their scales: a token's K and V,
        or for latent pages its whole latent (its two half-rows, viewed [layers, pages, page_size, 2, ...])."""
        values, scales = self.values, self.scales
        if self.latent:
            layers, pages, two, ps, *rest = values.shape
            values = values.view(layers, pages, ps, two, *rest)
            scales = None if scales is None else scales.view(layers, pages, ps, two, *rest[:-1])
            values[:, dst, :num_slots] = values[:, src, :num_slots]
            if scales is not None:
                scales[:, dst, :num_slots] = scales[:, src, :num_slots]
            return
        values[:, dst, :, :num_slots] = values[:, src, :, :num_slots]
        if scales is not None:
            scales[:, dst, :, :num_slots] = scales[:, src, :, :num_slots]

    def read(self, page: int) -> PageData:
        values = self.values[:, page].to("cpu", copy=True).contiguous()
        if self.scales is not None:
            return PageData(self.kv_dtype, values, self.scales[:, page].to("cpu", copy=True).contiguous())
        return PageData(self.kv_dtype, values, None if self.layer_scales is None else self.layer_scales.clone())

    def write(self, page: int, data: PageData) -> None:
        """ValueError, writing nothing, unless `data` is a page of this precision, shape and (fp8) scales."""
        if data.kv_dtype != self.kv_dtype:
            raise ValueError(f"a {data.kv_dtype} page cannot be written into a {self.kv_dtype} KV page")
        if tuple(data.kv.shape) != self.page_shape or data.kv.dtype != self.codec.storage:
            raise ValueError(
                f"a page of shape {tuple(data.kv.shape)} ({data.kv.dtype}) does not fit this pool's pages of "
                f"shape {self.page_shape} ({self.codec.storage})"
            )
        if self.scales is not None:
            want = self.page_shape[:-1]
            if data.scales is None or tuple(data.scales.shape) != want or data.scales.dtype != torch.float16:
                got = None if data.scales is None else (tuple(data.scales.shape), data.scales.dtype)
                raise ValueError(f"a {self.kv_dtype} page needs fp16 scales of shape {want}, got {got}")
        elif self.layer_scales is not None:
            if data.scales is None or not torch.equal(data.scales.float(), self.layer_scales):
                raise ValueError(f"a {self.kv_dtype} page written with other per-layer scales than this pool's")
        elif data.scales is not None:
            raise ValueError(f"a {self.kv_dtype} page has no scales, and this one has some")
        self.values[:, page] = data.kv.to(self.values.device)
        if self.scales is not None:
            assert data.scales is not None  # checked above
            self.scales[:, page] = data.scales.to(self.scales.device)


class KVPool:
    """Paged KV storage for one model shape on one device.

    Contract: the pool never decides ownership. Page ids come from `PrefixCache`/`PageAllocator`; the pool only
    stores values (with their scales) and copies slots between pages (the copy-on-write step of a hit that ends
    inside a page). `dtype`: the KV precision, a name of radixcache.kv_codec (fp32, bf16, fp16, int8, fp8_e4m3,
    int4) or a torch float dtype; `kv_scales`: fp8's per-layer [layers, 2] K/V scales (default 1.0).

    `num_pages` pages at `dtype` (ids 0..num_pages-1: what requests write into and attention reads), and with
    `demoted_pages` that many more at `demote_dtype` (ids num_pages.. : cold copies, never read by attention;
    `transcode` moves pages between the two).

    `latent`: latent (MLA) pages, token-contiguous (the module docstring): `shape` is KVShape(layers, 1, D / 2), the
    main dtype is not int4, fp8's V scales are its K scales, and there is no window paging.
    """

    def __init__(
        self,
        shape: KVShape,
        *,
        page_size: int,
        num_pages: int,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_scales: torch.Tensor | None = None,
        demoted_pages: int = 0,
        demote_dtype: str = "int4",
        window_layers: tuple[int, ...] = (),
        window_slots: int = 0,
        latent: bool = False,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if demoted_pages < 0:
            raise ValueError(f"demoted_pages must be >= 0, got {demoted_pages}")
        self.shape = shape
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.window_layers = tuple(sorted(set(window_layers))) if window_slots else ()
        self.window_slots = window_slots if self.window_layers else 0
        if self.window_layers and (demoted_pages or kv_scales is not None):
            raise ValueError("window paging does not combine with demotion or per-layer fp8 scales")
        if any(not 0 <= i < shape.layers for i in self.window_layers):
            raise ValueError(f"window layers {self.window_layers} must be layers of the model's {shape.layers}")
        if latent and (self.window_layers or shape.kv_heads != 1 or codec_of(dtype).rotate_keys):
            raise ValueError("latent pages have one kv head, no window paging and no int4 (rotated keys)")
        self.latent = latent
        # model layer -> (arena, its index there)
        self._where: list[tuple[bool, int]] = []
        counts = [0, 0]
        for i in range(shape.layers):
            sliding = i in self.window_layers
            self._where.append((sliding, counts[sliding]))
            counts[sliding] += 1
        self.main = PageArena(
            shape, dtype, page_size=page_size, num_pages=num_pages, device=self.device, layer_scales=kv_scales,
            layers=counts[0], latent=latent,
        )  # fmt: skip
        self.window: PageArena | None = None
        if self.window_layers:
            self.window = PageArena(
                shape, dtype, page_size=page_size, num_pages=self.window_slots, device=self.device, layers=counts[1]
            )
        self.demoted: PageArena | None = None
        self.demoted_pages = demoted_pages
        if demoted_pages:
            self.demoted = PageArena(
                shape, demote_dtype, page_size=page_size, num_pages=demoted_pages, device=self.device, latent=latent
            )
            if self.demoted.codec.bytes_per_token(1, 1, shape.head_dim) >= self.main.codec.bytes_per_token(
                1, 1, shape.head_dim
            ):
                raise ValueError(f"demoting {self.main.kv_dtype} pages to {self.demoted.kv_dtype} saves no memory")
        self.codec = self.main.codec
        self.kv_dtype = self.codec.name  # part of a page's identity (event hashes, disk fingerprints)
        self.dtype = self.codec.storage  # the storage dtype of the values
        # every layer of one token, as a sequence inside its window holds it
        self.bytes_per_token = self.codec.bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim)
        self.kv = self.main.values  # [layers, pages, 2, page_size, kv_heads, stored_dim]
        self.scales = self.main.scales  # [layers, pages, 2, page_size, kv_heads] fp16, or None

    @classmethod
    def from_budget(
        cls,
        shape: KVShape,
        *,
        page_size: int,
        budget_bytes: int,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_scales: torch.Tensor | None = None,
        latent: bool = False,
    ) -> KVPool:
        """As many whole pages as fit in `budget_bytes` (bytes per token, scales included, x page_size per page)."""
        per_page = cls.bytes_per_page(shape, page_size, dtype)
        num_pages = budget_bytes // per_page
        if num_pages < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no page of {per_page} bytes")
        return cls(
            shape, page_size=page_size, num_pages=num_pages, dtype=dtype, device=device, kv_scales=kv_scales,
            latent=latent,
        )  # fmt: skip

    @classmethod
    def with_demotion(
        cls,
        shape: KVShape,
        *,
        page_size: int,
        budget_bytes: int,
        dtype: str | torch.dtype,
        demote_dtype: str,
        demote_share: float,
        device: str | torch.device = "cpu",
        kv_scales: torch.Tensor | None = None,
        latent: bool = False,
    ) -> KVPool:
        """`budget_bytes` split: `demote_share` of it for pages at `demote_dtype`, the rest at `dtype`."""
        if not 0.0 < demote_share < 1.0:
            raise ValueError(f"demote_share must be in (0, 1), got {demote_share}")
        per_page = cls.bytes_per_page(shape, page_size, dtype)
        num_pages = int(budget_bytes * (1.0 - demote_share)) // per_page
        demoted = (budget_bytes - num_pages * per_page) // cls.bytes_per_page(shape, page_size, demote_dtype)
        if num_pages < 1 or demoted < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no page of one of the two precisions")
        return cls(
            shape, page_size=page_size, num_pages=num_pages, dtype=dtype, device=device, kv_scales=kv_scales,
            demoted_pages=demoted, demote_dtype=demote_dtype, latent=latent,
        )  # fmt: skip

    @staticmethod
    def bytes_per_page(shape: KVShape, page_size: int, dtype: str | torch.dtype) -> int:
        return page_size * kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, dtype)

    @classmethod
    def with_windows(
        cls,
        shape: KVShape,
        *,
        page_size: int,
        budget_bytes: int | None = None,
        num_pages: int | None = None,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        window_layers: tuple[int, ...],
        slots_needed: int,
    ) -> KVPool:
        """A pool whose sliding layers (`window_layers`) are paged apart, with `slots_needed` window slots (what
        every running window can need, see worker/engine/step.py) but never more than pages: `num_pages` pages exactly, or
        as many as `budget_bytes` holds once the window slots are paid for (more than an all-global pool holds).
        When every layer slides (Mistral), pages cost nothing but their window parts: the whole budget goes to
        slots, and the pool gets ALL_SLIDING_PAGES_PER_SLOT page ids per slot (the prefix tree's reach)."""
        sliding = len(set(window_layers))
        per_token = codec_of(dtype).bytes_per_token
        full = page_size * per_token(shape.layers - sliding, shape.kv_heads, shape.head_dim)
        slot = page_size * per_token(sliding, shape.kv_heads, shape.head_dim)
        slots = slots_needed
        if num_pages is None:
            if budget_bytes is None:
                raise ValueError("a pool needs num_pages or budget_bytes")
            num_pages = budget_bytes // (full + slot)  # every page with its window part: the most slots can need
            if num_pages < 1:
                raise ValueError(f"a budget of {budget_bytes} bytes holds no page of {full + slot} bytes")
            if full == 0:
                slots = num_pages
                num_pages *= ALL_SLIDING_PAGES_PER_SLOT
            elif num_pages > slots_needed:
                num_pages = (budget_bytes - slots_needed * slot) // full
        elif full == 0:
            slots = num_pages
        return cls(
            shape, page_size=page_size, num_pages=num_pages, dtype=dtype, device=device,
            window_layers=tuple(window_layers), window_slots=max(1, min(num_pages, slots)),
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        arenas = (self.main, self.demoted, self.window)
        return sum(a.nbytes for a in arenas if a is not None)

    def bytes_by_kind(self) -> dict[str, int]:
        """KV bytes per layer kind: "global" (every page) and "sliding" (in the page, or in window slots)."""
        if self.window is None:
            return {"global": self.nbytes}
        return {"global": self.main.nbytes, "sliding": self.window.nbytes}

    @property
    def total_pages(self) -> int:
        """Page ids of both arenas: 0..total_pages-1."""
        return self.num_pages + self.demoted_pages

    @property
    def demote_dtype(self) -> str:
        """The demoted pages' precision ("" without demotion)."""
        return self.demoted.kv_dtype if self.demoted is not None else ""

    def layer(self, index: int) -> torch.Tensor:
        """[pages, 2, page_size, kv_heads, stored_dim] values of one layer (NHD, K then V; for latent pages the
        same tensor token-contiguous, KVLayer.latent_tokens), in the storage dtype (window slots instead of pages
        for a window-paged sliding layer)."""
        return self.kv_layer(index).values

    def kv_layer(self, index: int) -> KVLayer:
        """One layer as an attention backend reads and writes it (values, scales, codec); a sliding layer of a
        window-paged pool is addressed by window slots, not page ids."""
        sliding, local = self._where[index]
        if not sliding:
            return self.main.layer(local)
        assert self.window is not None, "a layer is sliding here only in a window-paged pool"
        return self.window.layer(local)

    def is_windowed(self, index: int) -> bool:
        """Whether layer `index` lives in the window arena (read through window slots)."""
        return self._where[index][0]

    def copy_prefix(self, src_page: int, dst_page: int, num_slots: int, src_slot: int = -1, dst_slot: int = -1) -> None:
        """Copy the first `num_slots` token slots of `src_page` into `dst_page`, in every layer, K and V (whole
        latents for latent pages), with their scales. Both are pages at the pool's own precision (requests never copy from demoted pages). In a
        window-paged pool the sliding layers are copied from window slot `src_slot` to `dst_slot` (skipped when
        either is -1: a part nobody will read)."""
        if not 0 < num_slots <= self.page_size:
            raise ValueError(f"num_slots must be in 1..{self.page_size}, got {num_slots}")
        for page in (src_page, dst_page):
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is not one of the pool's {self.num_pages} {self.kv_dtype} pages")
        self.main.copy_prefix(src_page, dst_page, num_slots)
        if self.window is not None and src_slot >= 0 and dst_slot >= 0:
            self.window.copy_prefix(src_slot, dst_slot, num_slots)

    def transcode(self, src_pages: list[int], dst_pages: list[int]) -> None:
        """Write what `src_pages` hold into `dst_pages` at the destination's precision, pairwise, every layer:
        main pages into demoted ones (a demotion) or back. Each list lies in one arena."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} pages cannot be copied into {len(dst_pages)}")
        if self.window is not None:
            raise ValueError("a window-paged pool keeps no page whole: it cannot transcode pages")
        if not src_pages:
            return
        (src, src_ids), (dst, dst_ids) = self._local(src_pages), self._local(dst_pages)
        for layer in range(self.shape.layers):
            dst.write_float(layer, dst_ids, src.read_float(layer, src_ids))

    # ---- whole pages in and out (the disk tier, tests) ------------------------------------------------------
    def read_page(self, page: int) -> PageData:
        """A copy of `page` (every layer, K and V, every slot, its scales) on the CPU; a demoted page comes at the
        demoted precision (PageData.kv_dtype says which)."""
        if self.window is not None:
            raise ValueError("a window-paged pool keeps no page whole: read its pages per arena")
        arena, [local] = self._local([page])
        return arena.read(local)

    def write_page(self, page: int, data: PageData) -> None:
        """Overwrite `page` with `data` (from read_page of a pool of the same precision and shape). ValueError,
        writing nothing, for a page of another kv dtype, shape or scales, or a page id outside the pool."""
        if self.window is not None:
            raise ValueError("a window-paged pool keeps no page whole: write its pages per arena")
        arena, [local] = self._local([page])
        arena.write(local, data)

    def page_kv_dtype(self, page: int) -> str:
        """The precision `page` is stored at: the pool's, or the demoted one."""
        return self._local([page])[0].kv_dtype

    def _local(self, pages: list[int]) -> tuple[PageArena, list[int]]:
        """The arena holding `pages` (all in one) and their ids inside it; ValueError outside the pool."""
        lo, hi = min(pages), max(pages)
        if lo >= 0 and hi < self.num_pages:
            return self.main, list(pages)
        if self.demoted is not None and lo >= self.num_pages and hi < self.total_pages:
            return self.demoted, [p - self.num_pages for p in pages]
        raise ValueError(f"pages {lo}..{hi} are outside the pool's {self.total_pages} pages (or span both arenas)")
