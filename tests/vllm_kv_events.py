"""vLLM's KV-event msgspec structs, declared as vLLM declares them, to decode the worker's ZMQ messages the way a
vLLM subscriber does (written here from vLLM's vllm/distributed/kv_events.py, not imported: vLLM is no dependency).

`current()`: vLLM >= 0.26 (PR #42892): the batch stays positional (array_like), each event is a map tagged by its
class name under "type". `legacy()`: vLLM before it, every struct array_like; the fields as of vLLM's lora_name
(#27577), the last layout radixcache published before. Each returns the decoder of a whole payload and the three
event classes (BlockStored, BlockRemoved, AllBlocksCleared).
"""

# No `from __future__ import annotations`: msgspec resolves these classes' annotations, which name classes local to a
# function.
from typing import Any

import msgspec

ExternalBlockHash = bytes | int  # vLLM's ExternalBlockHash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # positional in both layouts
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def current() -> tuple[msgspec.msgpack.Decoder, type, type, type]:
    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return msgspec.msgpack.Decoder(KVEventBatch), BlockStored, BlockRemoved, AllBlocksCleared


def legacy() -> tuple[msgspec.msgpack.Decoder, type, type, type]:
    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return msgspec.msgpack.Decoder(KVEventBatch), BlockStored, BlockRemoved, AllBlocksCleared
