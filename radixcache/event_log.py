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

Bounded: beyond `max_pending` undrained records the log drops them all and records `LOST` instead; drain then returns
`LOST` and ignores records until the next snapshot (every consumer must start over from that snapshot).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from radixcache.events import (
    CacheEvent,
    NamespaceCleared,
    PageRecord,
    PagesRemoved,
    PagesStored,
    hash_key_pages,
    namespace_prefix,
)
from radixcache.keys import TOKEN_BYTES, decode
from radixcache.tier import PageKey

log = logging.getLogger("radixcache.events")


@dataclass(frozen=True)
class Snapshot:
    """Every page the cache held at this point of the stream, as one PagesStored per node, parents first."""

    token: object  # what the snapshot's requester passed, to recognise its own
    events: list[PagesStored]


LOST = "lost"  # drained when records were dropped: consumers must wait for the next Snapshot
_STORED, _REMOVED, _CLEARED, _SNAPSHOT, _RELOCATED, _TIER_STORED, _TIER_REMOVED = 0, 1, 2, 3, 4, 5, 6


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
    ) -> None:
        """on_pending: called (on the recording thread) when records arrive and no drain is due yet, e.g. to
        schedule one on a loop; it must not block. strict: an inconsistency raises instead of being logged (tests).
        kv_dtype: the pages' KV precision, part of their hashes (radixcache.events). The log starts in step with an
        empty tree; attach it to a tree that holds pages only with a snapshot."""
        self.page_size = page_size
        self.kv_dtype = kv_dtype
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

    def snapshot(
        self, records: Iterable[PageRecord], token: object = None, tier: Iterable[tuple[str, PageKey]] = ()
    ) -> None:
        """Record the tree's current pages, `RadixTree.page_records()`, and what the tiers hold,
        `PrefixCache.tier_records()` (call it on the cache's thread, between tree operations, so that the records and
        the stream agree)."""
        self._push((_SNAPSHOT, token, list(records), list(tier)))

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
        records, out = self._records, []
        while records:
            record = records.popleft()
            kind = record[0]
            if kind == _SNAPSHOT:
                out.append(self._load(record[1], record[2], record[3]))
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
                if event is not None:
                    out.append(event)
        return out

    def discard(self) -> None:
        """Drop what is recorded, snapshots included (nobody listens): the log is out of step until the next
        snapshot, so keeping no map meanwhile costs nothing."""
        self._due = False
        self._records.clear()
        self._synced = False
        self._pages.clear()

    def _lose(self, out: list) -> None:
        self._synced = False
        self._pages.clear()
        out.append(LOST)

    def _prefix(self, namespace: str) -> bytes:
        prefix = self._prefixes.get(namespace)
        if prefix is None:
            prefix = self._prefixes[namespace] = namespace_prefix(namespace, self.kv_dtype)
        return prefix

    def _event(self, record: tuple) -> CacheEvent | None:
        kind = record[0]
        if kind == _STORED:
            return self._stored(self._pages, *record[1:])
        if kind == _REMOVED:
            pages = self._pages
            first = pages.pop(record[1][0])
            hashes = [first[1]] + [pages.pop(p)[1] for p in record[1][1:]]
            return PagesRemoved(first[0], hashes)
        if kind == _RELOCATED:  # same pages under other ids: no event (a partial tail was never named: skipped)
            pages = self._pages
            moved = [(new, pages.pop(old)) for old, new in zip(record[1], record[2], strict=True) if old in pages]
            pages.update(moved)
            return None
        if kind == _TIER_STORED:
            return _tier_stored(record[1], record[2])
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
        return PagesStored(namespace, parent, hashes, decode(key))

    def _load(self, token: object, records: list, tier: list[tuple[str, PageKey]]) -> Snapshot:
        self._pages = pages = {}
        events = [e for r in records if (e := self._stored(pages, *r)) is not None]
        events += [_tier_stored(medium, key) for medium, key in tier]
        self._synced = True
        return Snapshot(token, events)


def _tier_stored(medium: str, key: PageKey) -> PagesStored:
    return PagesStored(key.namespace, key.parent_hash or None, [key.page_hash], decode(key.tokens), medium)
