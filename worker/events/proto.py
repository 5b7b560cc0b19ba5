"""Cache events <-> radixcache.v1 messages (SubscribeCacheEvents). Snapshots go out in parts of bounded size."""

from __future__ import annotations

from collections.abc import Iterator

from radixcache.events import CacheEvent, NamespaceCleared, PagesRemoved, PagesStored
from radixcache.tier import MEDIUM_DEVICE
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.worker.events.hub import EVENTS, RESET, SNAPSHOT, EventBatch

KINDS = {
    SNAPSHOT: pb.CACHE_EVENT_BATCH_KIND_SNAPSHOT,
    EVENTS: pb.CACHE_EVENT_BATCH_KIND_EVENTS,
    RESET: pb.CACHE_EVENT_BATCH_KIND_RESET,
}
SNAPSHOT_PART_TOKENS = 1 << 16  # tokens per snapshot message, so a large cache never meets the message size limit


def event_to_proto(event: CacheEvent) -> pb.CacheEvent:
    if isinstance(event, PagesStored):
        stored = pb.PagesStored(
            page_hashes=event.page_hashes, token_ids=event.token_ids, medium=event.medium, group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind or "", sliding_window=event.kv_cache_spec_sliding_window or 0,
        )  # fmt: skip
        if event.parent_hash is not None:
            stored.parent_hash = event.parent_hash
        return pb.CacheEvent(namespace=event.namespace, stored=stored)
    if isinstance(event, PagesRemoved):
        removed = pb.PagesRemoved(page_hashes=event.page_hashes, medium=event.medium, group_idx=event.group_idx)
        return pb.CacheEvent(namespace=event.namespace, removed=removed)
    if isinstance(event, NamespaceCleared):
        return pb.CacheEvent(namespace=event.namespace, cleared=pb.NamespaceCleared())
    raise TypeError(f"not a cache event: {event!r}")


def event_from_proto(message: pb.CacheEvent) -> CacheEvent:
    which = message.WhichOneof("event")
    if which == "stored":
        s = message.stored
        parent = s.parent_hash if s.HasField("parent_hash") else None
        return PagesStored(
            message.namespace, parent, list(s.page_hashes), list(s.token_ids), s.medium or MEDIUM_DEVICE,
            s.group_idx, s.kv_cache_spec_kind or None, s.sliding_window or None,
        )  # fmt: skip
    if which == "removed":
        removed = message.removed
        return PagesRemoved(
            message.namespace, list(removed.page_hashes), removed.medium or MEDIUM_DEVICE, removed.group_idx
        )
    if which == "cleared":
        return NamespaceCleared(message.namespace)
    raise ValueError(f"a CacheEvent without an event: {message!r}")


def batch_to_proto(batch: EventBatch, page_size: int, kv_dtype: str | None = None) -> Iterator[pb.CacheEventBatch]:
    """One message per batch; a snapshot in parts of about SNAPSHOT_PART_TOKENS tokens (at least one part). Every
    message names the page size and KV precision the hashes were computed with."""
    kind = KINDS[batch.kind]
    kv = kv_dtype or ""
    if batch.kind != SNAPSHOT:
        events = [event_to_proto(e) for e in batch.events]
        yield pb.CacheEventBatch(
            kind=kind, sequence=batch.sequence, events=events, page_size=page_size, timestamp=batch.timestamp,
            kv_dtype=kv,
        )  # fmt: skip
        return
    part: list[pb.CacheEvent] = []
    tokens = 0
    for event in batch.events:
        part.append(event_to_proto(event))
        tokens += len(event.token_ids) if isinstance(event, PagesStored) else 0
        if tokens >= SNAPSHOT_PART_TOKENS:
            yield pb.CacheEventBatch(
                kind=kind, sequence=batch.sequence, events=part, page_size=page_size, timestamp=batch.timestamp,
                kv_dtype=kv,
            )  # fmt: skip
            part, tokens = [], 0
    yield pb.CacheEventBatch(
        kind=kind,
        sequence=batch.sequence,
        events=part,
        snapshot_complete=True,
        page_size=page_size,
        timestamp=batch.timestamp,
        kv_dtype=kv,
    )
