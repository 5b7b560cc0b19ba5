"""Cache events in the layouts of vLLM's KV-event msgspec structs (what worker.kv_events_zmq publishes).

vLLM encodes an `EventBatch` as a positional msgpack array, `[ts, [event, ...], data_parallel_rank]`, and, since
vLLM PR #42892 (released in 0.26), each event as a map tagged by its class name under "type", fields by name
(`omit_defaults`: a field left at its default None is not sent):

    BlockStored      = {"type": "BlockStored", "block_hashes", "parent_block_hash" (None: first page), "token_ids",
                        "block_size", "lora_id" (None), "medium", "lora_name" (None), "group_idx",
                        "kv_cache_spec_kind", "kv_cache_spec_sliding_window" (only when set)}
    BlockRemoved     = {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

FORMAT_LEGACY ("vllm-legacy") is the layout of vLLM before that PR, every event a positional array too (for
consumers not updated yet): ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"].

A block is a page (block_size = page size), its hash the page hash of radixcache.events (it includes the namespace,
so tenants never collide in one flat index; `extra_keys`, the inputs to vLLM's own hash, do not apply and are left
out). The per-event storage facts come from the event object when it has them (`medium`, `group_idx`,
`kv_cache_spec_kind`, `kv_cache_spec_sliding_window` attributes: a disk tier, sliding-window groups), else today's
values: the worker's KV pool ("GPU" names it, whatever its device), one group of full attention.
"""

from __future__ import annotations

from typing import Any

from radixcache.events import CacheEvent, NamespaceCleared, PagesRemoved, PagesStored

FORMAT_CURRENT, FORMAT_LEGACY = "vllm", "vllm-legacy"
FORMATS = (FORMAT_CURRENT, FORMAT_LEGACY)
MEDIUM = "GPU"  # vLLM's names: "GPU", "CPU_TIER", "DISK"
GROUP_IDX = 0
KV_CACHE_SPEC_KIND = "full_attention"
CLEARED: dict[str, list[Any]] = {FORMAT_CURRENT: [{"type": "AllBlocksCleared"}], FORMAT_LEGACY: [["AllBlocksCleared"]]}


def _fact(event: CacheEvent, name: str, default: Any) -> Any:
    value = getattr(event, name, None)
    return default if value is None else value


def vllm_event(event: CacheEvent, page_size: int, layout: str = FORMAT_CURRENT) -> dict[str, Any] | list | None:
    """The msgpack-ready form of one event in `layout` (None: the event has no vLLM counterpart)."""
    if layout not in FORMATS:
        raise ValueError(f"unknown KV-event format {layout!r}; expected one of {', '.join(FORMATS)}")
    if isinstance(event, NamespaceCleared):  # its pages' removals came first
        return None
    if not isinstance(event, (PagesStored, PagesRemoved)):
        raise TypeError(f"not a cache event: {event!r}")
    medium = _fact(event, "medium", MEDIUM)
    if isinstance(event, PagesRemoved):
        if layout == FORMAT_LEGACY:
            return ["BlockRemoved", event.page_hashes, medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": event.page_hashes,
            "medium": medium,
            "group_idx": _fact(event, "group_idx", GROUP_IDX),
        }
    if layout == FORMAT_LEGACY:
        return ["BlockStored", event.page_hashes, event.parent_hash, event.token_ids, page_size, None, medium, None]
    stored = {
        "type": "BlockStored",
        "block_hashes": event.page_hashes,
        "parent_block_hash": event.parent_hash,
        "token_ids": event.token_ids,
        "block_size": page_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": _fact(event, "group_idx", GROUP_IDX),
        "kv_cache_spec_kind": _fact(event, "kv_cache_spec_kind", KV_CACHE_SPEC_KIND),
    }
    window = getattr(event, "kv_cache_spec_sliding_window", None)
    if window is not None:
        stored["kv_cache_spec_sliding_window"] = window
    return stored


def event_batch(timestamp: float, events: list, data_parallel_rank: int = 0) -> list:
    """An EventBatch (positional in both layouts): [ts, events, data_parallel_rank]."""
    return [timestamp, events, data_parallel_rank]
