"""EngineConfig: every knob of one engine (pool size, paging, batching, cache on/off, backend, speculation),
validated once."""

from __future__ import annotations

from dataclasses import dataclass

from radixcache.kv_dtypes import KV_DTYPES
from radixcache.object_store import parse_store_url
from radixcache.retention import check_policy

DEFAULT_KV_MEMORY = 512 * 2**20
DEFAULT_KV_DISK = 16 * 2**30
DEFAULT_REMOTE_BUFFER = 64 * 2**20
MAX_REMOTE_REPLICAS = 8
DISK_WRITE_POLICIES = ("through", "evict")
# On by default: the torch attention backend is row-exact (a verified draft's row is the same bits as the decode step
# that would have computed it, in 16-bit too: worker/attention/torch_backend.py), so greedy output is the same on and
# off. 8 is what BENCHMARKS.md measured (the trace's accepted runs average 5-6 tokens).
DEFAULT_SPECULATE = 8
MAX_SPECULATE = 64
DEMOTE_DTYPES = ("int4", "int8")  # what cold pages may be demoted to (smaller than the pages' own precision)
WINDOW_PAGING = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_pages: int | None = None  # exact page count; else sized from kv_memory_bytes
    kv_memory_bytes: int | None = None  # default DEFAULT_KV_MEMORY
    max_step_tokens: int = 512  # token budget of one step: decodes + prefill chunks
    max_running: int = 64
    cache_enabled: bool = True  # False: same kernels, no lookups and no publishing (the cache-off baseline)
    backend: str = "auto"
    aging_steps: int = 64  # a request waiting this many steps is admitted before any later arrival
    max_pinned: float = 0.5  # share of the KV pool that pins may hold (PinPrefix beyond it: RESOURCE_EXHAUSTED)
    # The tiers below the pool (radixcache.tiering): evicted pages go to host memory (kv_host_bytes), then to the
    # disk store under kv_disk_dir/<fingerprint> (within kv_disk_bytes), and lookups continue there. None: off.
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = DEFAULT_KV_DISK
    kv_disk_queue_pages: int = 256  # pages waiting to be written at most; past it eviction drops pages (counted)
    kv_host_bytes: int | None = None
    # "through": every computed page is queued for the disk at once (a crash loses only the queue); "evict": pages
    # are written when evicted (and at shutdown), so a crash loses what memory held
    kv_disk_write: str = "through"
    # The fleet's shared store below the disk (radixcache.remote_tier): "mooncake://HOST:PORT" (the master's RPC
    # address); its metadata server (default http://HOST:8080/metadata); this worker's address for the store (default:
    # its address on the route to the master); memory this worker contributes to the store (0: the store services
    # hold it all) and its staging buffer; copies per page; every call's deadline. None: off.
    kv_remote: str | None = None
    kv_remote_metadata: str | None = None
    kv_remote_host: str | None = None
    kv_remote_segment_bytes: int = 0
    kv_remote_buffer_bytes: int = DEFAULT_REMOTE_BUFFER
    kv_remote_replicas: int = 1
    kv_remote_timeout_s: float = 1.0
    speculate: int = DEFAULT_SPECULATE  # draft tokens per sequence per step at most (worker/speculation); 0: off
    kv_dtype: str = "auto"  # KV page precision (radixcache.kv_codec): auto = the model's dtype
    kv_demote: str | None = None  # demote cold leaves to this precision instead of evicting them (None: off)
    kv_demote_share: float = 0.5  # with kv_demote: the share of the KV memory that holds demoted pages
    # Sliding layers' values paged apart, given back out of the window (radixcache.window_parts): auto = whenever
    # the model has sliding layers and nothing moves whole pages (demotion, tiers); on / off
    kv_window_paging: str = "auto"
    # What eviction takes first (radixcache.retention): "lru", or "priority" (requests' retention kept longer)
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ValueError(f"kv_pages must be >= 1, got {self.kv_pages}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError(f"kv_memory_bytes must be >= 1, got {self.kv_memory_bytes}")
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        check_policy(self.eviction_policy)
        if self.kv_disk_bytes < 1:
            raise ValueError(f"kv_disk_bytes must be >= 1, got {self.kv_disk_bytes}")
        if self.kv_disk_queue_pages < 1:
            raise ValueError(f"kv_disk_queue_pages must be >= 1, got {self.kv_disk_queue_pages}")
        if self.kv_disk_write not in DISK_WRITE_POLICIES:
            raise ValueError(
                f"kv_disk_write must be one of {', '.join(DISK_WRITE_POLICIES)}, got {self.kv_disk_write!r}"
            )
        if self.kv_host_bytes is not None and self.kv_host_bytes < 1:
            raise ValueError(f"kv_host_bytes must be >= 1, got {self.kv_host_bytes}")
        self._check_remote()
        if not 0 <= self.speculate <= MAX_SPECULATE:
            raise ValueError(f"speculate must be in [0, {MAX_SPECULATE}] draft tokens (0: off), got {self.speculate}")
        if self.kv_dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"kv_dtype must be one of auto, {', '.join(KV_DTYPES)}; got {self.kv_dtype!r}")
        if self.kv_demote is not None and self.kv_demote not in DEMOTE_DTYPES:
            raise ValueError(f"kv_demote must be one of {', '.join(DEMOTE_DTYPES)} (or unset); got {self.kv_demote!r}")
        if self.kv_demote is not None and not self.cache_enabled:
            raise ValueError("kv_demote needs the prefix cache (it demotes cached pages); drop one of the two")
        if self.kv_demote is not None and self.kv_demote == self.kv_dtype:
            raise ValueError(f"kv_demote {self.kv_demote} is the KV dtype itself: demoting would save nothing")
        if not 0.0 < self.kv_demote_share < 1.0:
            raise ValueError(f"kv_demote_share must be in (0, 1), got {self.kv_demote_share}")
        if self.kv_window_paging not in WINDOW_PAGING:
            raise ValueError(
                f"kv_window_paging must be one of {', '.join(WINDOW_PAGING)}, got {self.kv_window_paging!r}"
            )
        if self.kv_window_paging == "on" and self.moves_whole_pages:
            raise ValueError(
                "kv_window_paging on keeps a page's sliding layers apart, and demotion and tiers below memory move "
                "whole pages: drop one of the two"
            )
        if not 0.0 <= self.max_pinned <= 1.0:
            raise ValueError(f"max_pinned must be a share of the KV pool in [0, 1], got {self.max_pinned}")

    def _check_remote(self) -> None:
        if self.kv_remote is None:
            return
        parse_store_url(self.kv_remote)
        if not self.cache_enabled:
            raise ValueError("kv_remote keeps cached pages in the fleet's store: it needs the cache")
        if self.kv_remote_metadata is not None and not self.kv_remote_metadata.startswith(("http://", "https://")):
            raise ValueError(f"kv_remote_metadata must be an http:// URL, got {self.kv_remote_metadata!r}")
        if self.kv_remote_segment_bytes < 0:
            raise ValueError(f"kv_remote_segment_bytes must be >= 0, got {self.kv_remote_segment_bytes}")
        if self.kv_remote_buffer_bytes < 2**20:
            raise ValueError(f"kv_remote_buffer_bytes must be >= 1MiB, got {self.kv_remote_buffer_bytes}")
        if not 1 <= self.kv_remote_replicas <= MAX_REMOTE_REPLICAS:
            raise ValueError(f"kv_remote_replicas must be in [1, {MAX_REMOTE_REPLICAS}], got {self.kv_remote_replicas}")
        if not 0.0 < self.kv_remote_timeout_s <= 60.0:
            raise ValueError(f"kv_remote_timeout_s must be in (0, 60] seconds, got {self.kv_remote_timeout_s}")

    @property
    def moves_whole_pages(self) -> bool:
        """Demotion or a tier below memory: they move a page with every layer in it (no window paging then)."""
        return (
            self.kv_demote is not None
            or self.kv_disk_dir is not None
            or self.kv_host_bytes is not None
            or self.kv_remote is not None
        )
