"""Attention backends over the paged KV pool, all consuming one BatchLayout per step."""

from radixcache.worker.attention.layout import BatchLayout, SequenceSlice

__all__ = ["BatchLayout", "SequenceSlice"]
