"""EventLog: the tree's event sink. Records by page id on the cache's thread; names pages by hash when drained.

The tree reports what it knows, page ids (`radixcache.events.EventSink`); subscribers want page hashes (`radixcache.events`). Hashing a
page costs about a microsecond, more than the tree spends inserting it, so the recording side (`stored`, `removed`,
`cleared`, `snapshot`, called on the thread that owns the cache) only appends a tuple to a deque, and `drain` (any
one consumer thread, e.g. an asyncio loop) turns the records into events in order, keeping the map page id ->
(namespace, hash) of every page the events have stored.

Snapshots: `snapshot(tree.page_records(), token)` (on the cache's thread) puts the tree's current pages into the record stream, so
`drain` returns a `Snapshot` exactly between the events before it and those after: a consumer that starts from it
and applies what follows is exact. The map is rebuilt from each snapshot.

Tiers (radixcache.tiering): `tier_stored(medium, key)` / `tier_removed(medium, namespace, hash)` record what a tier
below the device started or stopped holding (already named by hash), drained as PagesStored / PagesRemoved with that
medium; a snapshot's `tier` part lists what the tiers hold at that point.

Window paging (`window` = W, radixcache.events' group 1): each PagesStored is followed by the same pages stored in
group 1; `window_removed(pages)` (the cache: parts given back while their pages stay cached) drains as a group-1
PagesRemoved, and a page removed from the tree leaves group 1 first. A snapshot's `window` part lists the tree pages
that still have their parts.

Bounded: beyond `max_pending` undrained records the log drops them all and records `LOST` instead; drain then returns
`LOST` and ignores records until the next snapshot (every consumer must start over from that snapshot).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from radixcache.events import (
    SLIDING_WINDOW_KIND,
    WINDOW_GROUP,
    CacheEvent,
    NamespaceCleared,
    PageRecord,
    PagesRemoved,
    PagesStored,
    hash_key_pages,
    namespace_prefix,
)
from radixcache.keys import TOKEN_BYTES, decode
from radixcache.tier import PageKey, TierRecord

log = logging.getLogger("radixcache.events")


@dataclass(frozen=True)
class Snapshot:
    """Every page the cache held at this point of the stream, as one PagesStored per node, parents first."""

    token: object  # what the snapshot's requester passed, to recognise its own
    events: list[PagesStored]


LOST = "lost"  # drained when records were dropped: consumers must wait for the next Snapshot
_STORED, _REMOVED, _CLEARED, _SNAPSHOT, _RELOCATED, _TIER_STORED, _TIER_REMOVED, _WINDOW_REMOVED = range(8)


class EventLog:
    """An EventSink that buffers records for one consumer. See the module docstring for the threads' parts."""

    def __init__(
        self,
        page_size: int,
        *,
        on_pending: Callable[[], None] | None = None,
        max_pending: int = 1_000_000,
        strict: bool = False,
        kv_dtype: str | None = None,
        window: int | None = None,
        spec_kind: str | None = None,
    ) -> None:
        """on_pending: called (on the recording thread) when records arrive and no drain is due yet, e.g. to
        schedule one on a loop; it must not block. strict: an inconsistency raises instead of being logged (tests).
        kv_dtype: the pages' KV precision, part of their hashes (radixcache.events). The log starts in step with an
        empty tree; attach it to a tree that holds pages only with a snapshot. window: the sliding layers' W of a
        window-paged cache (its window group's events, see the module docstring); None: no such group. spec_kind:
        group 0's kv_cache_spec_kind on every PagesStored (MLA_KIND for a model's latent pages); None: full
        attention."""
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.window = window
        self.spec_kind = spec_kind
        self._windowed: set[int] = set()  # page ids whose window part group 1 holds
        self.max_pending = max_pending
        self.strict = strict
        self._bpp = page_size * TOKEN_BYTES
        self._records: deque = deque()
        self._on_pending = on_pending
        self._due = False  # a drain is scheduled (on_pending was called and that drain has not started yet)
        self._synced = True  # the map below matches the tree as of the last drained record
        self._pages: dict[int, tuple[str, int]] = {}  # page id -> (namespace, hash), for every page stored
        self._prefixes: dict[str, bytes] = {}

    # ---- the recording side (the cache's thread) -------------------------------------------------------------
    def _push(self, record: tuple) -> None:
        records = self._records
        if len(records) >= self.max_pending:
            records.clear()
            record = (LOST,)
        records.append(record)
        if not self._due and self._on_pending is not None:
            self._due = True
            self._on_pending()

    def stored(self, namespace: str, after: int | None, pages: list[int], key: bytes) -> None:
        # _push inlined: this runs on every insert that stores pages
        records = self._records
        if len(records) < self.max_pending:
            records.append((_STORED, namespace, after, pages, key))
            if not self._due and self._on_pending is not None:
                self._due = True
                self._on_pending()
        else:
            self._push((_STORED, namespace, after, pages, key))

    def removed(self, pages: list[int]) -> None:
        if pages:
            self._push((_REMOVED, pages))

    def cleared(self, namespace: str) -> None:
        self._push((_CLEARED, namespace))

    def relocated(self, old: list[int], new: list[int]) -> None:
        self._push((_RELOCATED, old, new))

    def window_removed(self, pages: list[int]) -> None:
        """These tree pages no longer have their window part (window paging); their pages stay cached."""
        if pages:
            self._push((_WINDOW_REMOVED, pages))

    def snapshot(
        self,
        records: Iterable[PageRecord],
        token: object = None,
        tier: Iterable[TierRecord] = (),
        window: Iterable[int] = (),
    ) -> None:
        """Record the tree's current pages, `RadixTree.page_records()`, what the tiers hold,
        `PrefixCache.tier_records()`, and the pages with window parts, `PrefixCache.window_pages()` (call it on the
        cache's thread, between tree operations, so that the records and the stream agree)."""
        self._push((_SNAPSHOT, token, list(records), list(tier), set(window)))

    def tier_stored(self, medium: str, key: PageKey) -> None:
        self._push((_TIER_STORED, medium, key))

    def tier_removed(self, medium: str, namespace: str, page_hash: int) -> None:
        self._push((_TIER_REMOVED, medium, namespace, page_hash))

    @property
    def pending(self) -> int:
        return len(self._records)

    # ---- the consuming side (one consumer thread) -------------------------------------------------------------
    def drain(self) -> list[CacheEvent | Snapshot | str]:
        """Everything recorded so far, in order: CacheEvents, Snapshots, and LOST where records were dropped."""
        self._due = False  # before taking records: one recorded after this schedules the next drain
        records = self._records
        out: list[CacheEvent | Snapshot | str] = []
        while records:
            record = records.popleft()
            kind = record[0]
            if kind == _SNAPSHOT:
                out.append(self._load(record[1], record[2], record[3], record[4]))
            elif kind == LOST:
                self._lose(out)
            elif self._synced:
                try:
                    event = self._event(record)
                except KeyError as exc:
                    if self.strict:
                        raise
                    log.error("cache events out of step (page %s unknown); consumers restart from a snapshot", exc)
                    self._lose(out)
                    continue
                if isinstance(event, list):
                    out.extend(event)
                elif event is not None:
                    out.append(event)
        return out

    def discard(self) -> None:
        """Drop what is recorded, snapshots included (nobody listens): the log is out of step until the next
        snapshot, so keeping no map meanwhile costs nothing."""
        self._due = False
        self._records.clear()
        self._synced = False
        self._pages.clear()
        self._windowed.clear()

    def _lose(self, out: list) -> None:
        self._synced = False
        self._pages.clear()
        self._windowed.clear()
        out.append(LOST)

    def _prefix(self, namespace: str) -> bytes:
        prefix = self._prefixes.get(namespace)
        if prefix is None:
            prefix = self._prefixes[namespace] = namespace_prefix(namespace, self.kv_dtype)
        return prefix

    def _event(self, record: tuple) -> CacheEvent | list[CacheEvent] | None:
        kind = record[0]
        if kind == _STORED:
            stored = self._stored(self._pages, *record[1:])
            return stored if stored is None or self.window is None else [stored, self._window_stored(stored, record[3])]
        if kind == _REMOVED:
            pages = self._pages
            out: list[CacheEvent] = []
            if self.window is not None:
                out = self._window_gone(record[1])
            first = pages.pop(record[1][0])
            hashes = [first[1]] + [pages.pop(p)[1] for p in record[1][1:]]
            return [*out, PagesRemoved(first[0], hashes)]
        if kind == _WINDOW_REMOVED:
            return self._window_gone(record[1])
        if kind == _RELOCATED:  # same pages under other ids: no event (a partial tail was never named: skipped)
            pages = self._pages
            moved = [(new, pages.pop(old)) for old, new in zip(record[1], record[2], strict=True) if old in pages]
            pages.update(moved)
            return None
        if kind == _TIER_STORED:
            return _tier_stored(record[1], record[2], self.spec_kind)
        if kind == _TIER_REMOVED:
            return PagesRemoved(record[2], [record[3]], record[1])
        return NamespaceCleared(record[1])

    def _stored(
        self, pages: dict[int, tuple[str, int]], namespace: str, after: int | None, ids: list[int], key: bytes
    ) -> PagesStored | None:
        bpp = self._bpp
        whole = len(key) // bpp
        if whole == 0:  # only a partial tail: not a page yet
            return None
        key = key[: whole * bpp]
        parent = None if after is None else pages[after][1]
        hashes = hash_key_pages(key, bpp, self._prefix(namespace), parent)
        for page, h in zip(ids[:whole], hashes, strict=True):  # ids may hold one more: the partial tail
            pages[page] = (namespace, h)
        return PagesStored(namespace, parent, hashes, decode(key), kv_cache_spec_kind=self.spec_kind)

    def _window_stored(self, event: PagesStored, ids: list[int]) -> PagesStored:
        """Group 1's copy of a store: the same pages, which have their window parts when stored."""
        self._windowed.update(ids[: len(event.page_hashes)])
        return self._as_window(event)

    def _as_window(self, event: PagesStored) -> PagesStored:
        return PagesStored(
            event.namespace, event.parent_hash, event.page_hashes, event.token_ids, event.medium,
            WINDOW_GROUP, SLIDING_WINDOW_KIND, self.window,
        )  # fmt: skip

    def _window_gone(self, ids: list[int]) -> list[CacheEvent]:
        """Group 1's removal of those of `ids` it holds (partial tails and pages already gone are not in it), one
        event per namespace."""
        by_ns: dict[str, list[int]] = {}
        for page in ids:
            if page in self._windowed:
                self._windowed.discard(page)
                namespace, h = self._pages[page]
                by_ns.setdefault(namespace, []).append(h)
        return [PagesRemoved(ns, hashes, group_idx=WINDOW_GROUP) for ns, hashes in by_ns.items()]

    def _load(self, token: object, records: list, tier: list[TierRecord], window: set[int]) -> Snapshot:
        pages: dict[int, tuple[str, int]] = {}
        self._pages = pages
        self._windowed = set()
        events = []
        for record in records:
            stored = self._stored(pages, *record)
            if stored is None:
                continue
            events.append(stored)
            if self.window is not None:
                events += self._window_runs(stored, record[2], window)
        events += [_tier_stored(record.medium, record.key, self.spec_kind) for record in tier]
        self._synced = True
        return Snapshot(token, events)

    def _window_runs(self, stored: PagesStored, ids: list[int], window: set[int]) -> list[PagesStored]:
        """Group 1's part of a snapshot's node: its runs of pages that have their window parts."""
        out, start, ps = [], None, self.page_size
        n = len(stored.page_hashes)
        for i in range(n + 1):
            has = i < n and ids[i] in window
            if has and start is None:
                start = i
            elif not has and start is not None:
                parent = stored.parent_hash if start == 0 else stored.page_hashes[start - 1]
                run = PagesStored(stored.namespace, parent, stored.page_hashes[start:i],
                                  stored.token_ids[start * ps : i * ps])  # fmt: skip
                out.append(self._as_window(run))
                self._windowed.update(ids[start:i])
                start = None
        return out


def _tier_stored(medium: str, key: PageKey, spec_kind: str | None) -> PagesStored:
    parent = key.parent_hash or None
    return PagesStored(key.namespace, parent, [key.page_hash], decode(key.tokens), medium, kv_cache_spec_kind=spec_kind)
