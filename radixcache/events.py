"""Cache events: what the cache stores and drops, named by page hashes that every process computes the same way.

Page hash (stable across processes, machines and restarts; not Python's `hash()`): for the whole pages of a
namespace's token sequence, in order,

    hash(page i) = H(parent(i) as 8 bytes big-endian || len(ns) as 4 bytes big-endian || ns (UTF-8) || the page's
                     page_size token ids, 4 bytes each big-endian)
    H(x)         = the first 8 bytes of BLAKE2b(x, digest_size=8) read big-endian, shifted right by one bit (so it
                   fits a signed and an unsigned 64-bit integer alike), and 1 if that is 0
    parent(i)    = hash(page i-1), and 0 for the first page

So a page's hash names its whole prefix and its namespace: two workers holding the same prefix for the same tenant
(with the same page size) report the same hashes, and a router can hash a prompt with `page_hashes` and look its
pages up. 0 is never a page hash; it stands for "no parent".

KV precision: a worker whose pages are quantized (--kv-dtype int8 / fp8_e4m3 / int4) holds other values for the same
tokens, so its pages get other hashes: the namespace part of the input is followed by the precision's
`radixcache.kv_dtypes.identity_tag` (its name with a length byte, padded to 2 mod 4 bytes, so no tagged input can
equal an untagged one). Full precision (fp32, bf16, fp16, or not said) adds nothing: those hashes are exactly what
they were before precisions existed. Pass the worker's kv dtype to `page_hashes` to look its pages up.

Only whole pages appear. A partial tail (the unfinished last page of a released sequence, see radixcache.cache) is
never reported: a router counting cached pages needs whole pages, and a tail is only ever copied from, never read as
a page. When a longer sequence later covers the tail with a whole page, that page is reported stored.

Events (each for one namespace):
- `PagesStored(namespace, parent_hash, page_hashes, token_ids)`: a run of pages, each the child of the one before;
  the first continues `parent_hash` (None: it starts at the namespace's root). token_ids holds the run's tokens,
  page_size per page.
- `PagesRemoved(namespace, page_hashes)`: pages the cache no longer holds (eviction, flush).
- `NamespaceCleared(namespace)`: after a flush, the namespace holds no page at all (its pages' removals come first).

Where a page lives: `medium` on PagesStored / PagesRemoved, as vLLM's KV events name it: "GPU" (the default) for the
pool the model reads, whatever its device; "CPU" and "DISK" for the tiers below it (radixcache.tier). A page may be
held by several media at once (loaded back from disk, its file stays); each medium's pages replay on their own. A
tier's page arrives as a PagesStored of one page whose parent may live elsewhere (or nowhere).

Window paging (a model with sliding layers paged apart, radixcache.window_parts): the pages' global layers are group
0 (`group_idx` 0, the events above), their sliding layers group 1 (`group_idx` WINDOW_GROUP, `kv_cache_spec_kind`
"sliding_window", `kv_cache_spec_sliding_window` W), as vLLM's hybrid KV cache reports its groups. A page enters
both groups when it is stored (each PagesStored of group 0 is followed by the same one of group 1); group 1 loses
it when its window part is given back (a PagesRemoved of group 1 only: the page stays cached for the global
layers, and a hit is served only up to where the window after it is still held), or with the page. A subscriber
that knows nothing of groups reads group 0 and skips the rest (PageIndex keeps group 1 in `windows`).

Latent pages (an MLA model, radixcache/pool.py): group 0's PagesStored name `kv_cache_spec_kind` MLA_KIND
("mla_attention"), as vLLM reports an MLA model's KV cache group, so a router does not take their bytes for K/V.

Replaying a snapshot (one PagesStored per tree node, parents first) and then the events in order gives exactly the
cache's pages: `PageIndex` does that, `records_page_index` computes the same from a tree's page records directly (what the tests
compare). The recording sink that turns the tree's page ids into these events is `radixcache.event_log.EventLog`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol

from radixcache.keys import TOKEN_BYTES, encode
from radixcache.kv_dtypes import identity_tag
from radixcache.tier import MEDIUM_DEVICE

NO_PARENT = 0  # the parent of a namespace's first page in the hash input (never a page hash itself)
WINDOW_GROUP = 1  # the group of a window-paged pool's sliding layers (vLLM's group_idx)
SLIDING_WINDOW_KIND = "sliding_window"  # its kv_cache_spec_kind
MLA_KIND = "mla_attention"  # group 0's kv_cache_spec_kind when its pages are latent pages (vLLM's MLAAttentionSpec)

# One stored node as a tree reports it: (namespace, the page it continues or None, its pages, its key).
PageRecord = tuple[str, int | None, list[int], bytes]


class EventSink(Protocol):
    """What a RadixTree reports (on its own thread; must be cheap and must not call back into the tree)."""

    def stored(self, namespace: str, after: int | None, pages: list[int], key: bytes) -> None:
        """The tree now stores `pages` for the tokens of `key` (radixcache.keys format), continuing page `after`
        (None: from the namespace's root). If `key` ends mid-page, its last page is a partial tail (not a page yet)."""

    def removed(self, pages: list[int]) -> None:
        """The tree no longer stores these whole pages (reported stored before)."""

    def cleared(self, namespace: str) -> None:
        """A flush left `namespace` without any page (its removals were reported first)."""

    def relocated(self, old: list[int], new: list[int]) -> None:
        """The tokens of pages `old` are now stored in pages `new` (pairwise; a demotion or its undoing): the same
        pages as far as anyone outside is concerned, under other ids. Nothing is stored or removed."""


class FanOut:
    """Several sinks seen as one: each record goes to every sink, in the order given (a RadixTree reports to its
    event sink and its observers through one of these, so its hot path keeps a single None check)."""

    def __init__(self, sinks: Sequence[EventSink]) -> None:
        self.sinks = tuple(sinks)

    def stored(self, namespace: str, after: int | None, pages: list[int], key: bytes) -> None:
        for sink in self.sinks:
            sink.stored(namespace, after, pages, key)

    def removed(self, pages: list[int]) -> None:
        for sink in self.sinks:
            sink.removed(pages)

    def cleared(self, namespace: str) -> None:
        for sink in self.sinks:
            sink.cleared(namespace)

    def relocated(self, old: list[int], new: list[int]) -> None:
        for sink in self.sinks:
            sink.relocated(old, new)


def namespace_prefix(namespace: str, kv_dtype: str | None = None) -> bytes:
    """The namespace's part of every page hash's input: its UTF-8 length (4 bytes big-endian), then the bytes, then
    the KV precision's identity tag (nothing at full precision)."""
    raw = namespace.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw + identity_tag(kv_dtype)


def hash_key_pages(key: bytes, page_bytes: int, ns_prefix: bytes, parent: int | None) -> list[int]:
    """Chained hashes of the whole pages of `key` (radixcache.keys format), the first continuing `parent`."""
    out: list[int] = []
    prev = (parent or NO_PARENT).to_bytes(8, "big")
    for off in range(0, len(key) - page_bytes + 1, page_bytes):
        h = int.from_bytes(blake2b(prev + ns_prefix + key[off : off + page_bytes], digest_size=8).digest(), "big") >> 1
        h = h or 1
        out.append(h)
        prev = h.to_bytes(8, "big")
    return out


def page_hashes(
    tokens: Sequence[int],
    page_size: int,
    namespace: str = "",
    parent: int | None = None,
    *,
    kv_dtype: str | None = None,
) -> list[int]:
    """The page hashes of the whole pages of `tokens` (a trailing partial page has none), as a worker with this
    page size and KV precision (`kv_dtype`: None or a full precision give the same hashes) reports them for
    `namespace`. With `parent`, the tokens continue the page of that hash."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    prefix = namespace_prefix(namespace, kv_dtype)
    return hash_key_pages(encode(tokens), page_size * TOKEN_BYTES, prefix, parent)


@dataclass(frozen=True)
class PagesStored:
    namespace: str
    parent_hash: int | None
    page_hashes: list[int]
    token_ids: list[int]
    medium: str = MEDIUM_DEVICE
    group_idx: int = 0  # WINDOW_GROUP: the sliding layers' part of the pages (window paging); 0 otherwise
    kv_cache_spec_kind: str | None = None  # SLIDING_WINDOW_KIND for group 1, MLA_KIND for latent pages (None: full)
    kv_cache_spec_sliding_window: int | None = None  # group 1's window W


@dataclass(frozen=True)
class PagesRemoved:
    namespace: str
    page_hashes: list[int]
    medium: str = MEDIUM_DEVICE
    group_idx: int = 0


@dataclass(frozen=True)
class NamespaceCleared:
    namespace: str


CacheEvent = PagesStored | PagesRemoved | NamespaceCleared


class ReplayError(ValueError):
    """An event does not fit the state replayed so far (a store of a held page, a removal of an unknown one)."""


class PageIndex:
    """What a subscriber knows of a worker's cache: per namespace, {page hash: parent hash or None}, for the device
    (`pages`) and for each tier below it (`tiers[medium]`).

    `apply` replays events in order; `load` starts over from a snapshot. With `strict`, an event that contradicts the
    state (storing a page already held, removing one not held) raises ReplayError: the stream is then not exact. A
    tier's page need not have its parent in the same tier.
    """

    def __init__(self, *, strict: bool = True) -> None:
        self.strict = strict
        self.pages: dict[str, dict[int, int | None]] = {}
        self.tiers: dict[str, dict[str, dict[int, int | None]]] = {}
        self.windows: dict[str, set[int]] = {}  # group 1 (window paging): pages whose sliding layers are held

    def load(self, snapshot: Iterable[PagesStored]) -> None:
        self.pages, self.tiers, self.windows = {}, {}, {}
        for event in snapshot:
            self.apply(event)

    def apply(self, event: CacheEvent) -> None:
        if isinstance(event, NamespaceCleared):
            self.windows.pop(event.namespace, None)  # (its pages' removals, which came first, emptied it)
            held = self.pages.pop(event.namespace, {})
            if self.strict and held:
                raise ReplayError(f"{event.namespace!r}: cleared, yet {len(held)} pages were never removed")
            return
        if not isinstance(event, PagesStored | PagesRemoved):
            raise TypeError(f"not a cache event: {event!r}")
        if event.group_idx:
            self._apply_window(event)
            return
        device = event.medium == MEDIUM_DEVICE
        media = self.pages if device else self.tiers.setdefault(event.medium, {})
        where = "" if device else f" on {event.medium}"
        if isinstance(event, PagesStored):
            held = media.setdefault(event.namespace, {})
            parent = event.parent_hash
            if self.strict and device and parent is not None and parent not in held:
                raise ReplayError(f"{event.namespace!r}: stored under parent {parent:#x}, which is not held")
            for h in event.page_hashes:
                if self.strict and h in held:
                    raise ReplayError(f"{event.namespace!r}: page {h:#x} stored twice{where}")
                held[h] = parent
                parent = h
        else:
            held = media.get(event.namespace, {})
            for h in event.page_hashes:
                if held.pop(h, 0) == 0 and self.strict:  # a parent is None or a nonzero hash, never 0
                    raise ReplayError(f"{event.namespace!r}: removed page {h:#x}, which is not held{where}")

    def _apply_window(self, event: PagesStored | PagesRemoved) -> None:
        """Group 1: a subset of the device's pages (stored with them, removed on its own or with them)."""
        held = self.windows.setdefault(event.namespace, set())
        device = self.pages.get(event.namespace, {})
        for h in event.page_hashes:
            if isinstance(event, PagesStored):
                if self.strict and (h in held or h not in device):
                    raise ReplayError(f"{event.namespace!r}: window part of {h:#x} stored twice or without its page")
                held.add(h)
            elif h in held:
                held.discard(h)
            elif self.strict:
                raise ReplayError(f"{event.namespace!r}: window part of {h:#x} removed, which is not held")

    def window_dict(self) -> dict[str, set[int]]:
        """Per namespace: the pages whose window part (group 1) is held."""
        return {ns: set(held) for ns, held in self.windows.items() if held}

    def as_dict(self) -> dict[str, dict[int, int | None]]:
        """Per namespace holding at least one page on the device: {page hash: parent hash or None}."""
        return {ns: dict(held) for ns, held in self.pages.items() if held}

    def tier_dict(self, medium: str) -> dict[str, dict[int, int | None]]:
        """The same for one tier below the device ("CPU", "DISK")."""
        return {ns: dict(held) for ns, held in self.tiers.get(medium, {}).items() if held}


def records_page_index(
    records: Iterable[PageRecord], page_size: int, *, kv_dtype: str | None = None
) -> dict[str, dict[int, int | None]]:
    """The pages that `records` (RadixTree.page_records(): parents before children) hold, as `PageIndex.as_dict`
    would after an exact replay; hashed from the records' keys alone (independent of any event), for comparison."""
    bpp = page_size * TOKEN_BYTES
    last_hash: dict[int, int] = {}  # page id -> its hash, for the pages seen so far
    out: dict[str, dict[int, int | None]] = {}
    prefixes: dict[str, bytes] = {}
    for namespace, after, pages, key in records:
        prefix = prefixes.setdefault(namespace, namespace_prefix(namespace, kv_dtype))
        parent = None if after is None else last_hash[after]
        held = out.setdefault(namespace, {})
        for page, h in zip(pages, hash_key_pages(key, bpp, prefix, parent), strict=False):
            held[h] = parent
            last_hash[page] = parent = h
    return {ns: held for ns, held in out.items() if held}
