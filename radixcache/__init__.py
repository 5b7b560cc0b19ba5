"""radixcache: a radix tree of token prefixes over refcounted, paged KV blocks.

This package is the cache itself (no model, no gRPC). Importing it must stay cheap: torch is loaded only by the
modules that need tensors (`radixcache.pool`), so `radixcache generate` and the client never pay for it.
"""

__version__ = "0.1.0"
