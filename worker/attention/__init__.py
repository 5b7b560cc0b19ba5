"""Attention backends over the paged KV pool, all consuming one BatchLayout per step."""

from radixcache.worker.attention.base import AttentionBackend, available_backends, create_backend, register_backend
from radixcache.worker.attention.layout import BatchLayout, SequenceSlice

__all__ = [
    "AttentionBackend",
    "BatchLayout",
    "SequenceSlice",
    "available_backends",
    "create_backend",
    "register_backend",
]
