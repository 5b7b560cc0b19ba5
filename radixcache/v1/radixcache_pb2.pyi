from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]

class CacheEventBatchKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_EVENT_BATCH_KIND_UNSPECIFIED: _ClassVar[CacheEventBatchKind]
    CACHE_EVENT_BATCH_KIND_SNAPSHOT: _ClassVar[CacheEventBatchKind]
    CACHE_EVENT_BATCH_KIND_EVENTS: _ClassVar[CacheEventBatchKind]
    CACHE_EVENT_BATCH_KIND_RESET: _ClassVar[CacheEventBatchKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason
CACHE_EVENT_BATCH_KIND_UNSPECIFIED: CacheEventBatchKind
CACHE_EVENT_BATCH_KIND_SNAPSHOT: CacheEventBatchKind
CACHE_EVENT_BATCH_KIND_EVENTS: CacheEventBatchKind
CACHE_EVENT_BATCH_KIND_RESET: CacheEventBatchKind

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "messages", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n", "presence_penalty", "frequency_penalty", "speculate", "cache_key", "priority", "retention_seconds", "cache_salt", "cache_salt_shared_tokens", "cache_salt_share_system", "json_schema", "json_object", "regex", "ebnf")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_SHARE_SYSTEM_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    n: int
    presence_penalty: float
    frequency_penalty: float
    speculate: bool
    cache_key: str
    priority: int
    retention_seconds: float
    cache_salt: str
    cache_salt_shared_tokens: int
    cache_salt_share_system: bool
    json_schema: str
    json_object: bool
    regex: str
    ebnf: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., speculate: _Optional[bool] = ..., cache_key: _Optional[str] = ..., priority: _Optional[int] = ..., retention_seconds: _Optional[float] = ..., cache_salt: _Optional[str] = ..., cache_salt_shared_tokens: _Optional[int] = ..., cache_salt_share_system: _Optional[bool] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason", "logprobs", "index", "draft_tokens", "accepted_draft_tokens", "cache_miss_reason", "cache_match_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHE_MATCH_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    draft_tokens: int
    accepted_draft_tokens: int
    cache_miss_reason: str
    cache_match_end: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., cache_miss_reason: _Optional[str] = ..., cache_match_end: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: ChatMessages
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "prompt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "model_path", "architecture", "vocab_size", "context_length", "page_size", "kv_pages", "kv_bytes", "backend", "dtype", "device", "cache_enabled", "eos_token_ids", "max_pinned_pages", "speculate", "layer_kinds", "sliding_window", "kv_dtype", "kv_bytes_per_token", "kv_demote", "kv_demoted_pages", "rows_exact", "row_check")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    LAYER_KINDS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_DEMOTE_FIELD_NUMBER: _ClassVar[int]
    KV_DEMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ROWS_EXACT_FIELD_NUMBER: _ClassVar[int]
    ROW_CHECK_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_path: str
    architecture: str
    vocab_size: int
    context_length: int
    page_size: int
    kv_pages: int
    kv_bytes: int
    backend: str
    dtype: str
    device: str
    cache_enabled: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_pinned_pages: int
    speculate: int
    layer_kinds: _containers.RepeatedScalarFieldContainer[str]
    sliding_window: int
    kv_dtype: str
    kv_bytes_per_token: int
    kv_demote: str
    kv_demoted_pages: int
    rows_exact: bool
    row_check: str
    def __init__(self, model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_pages: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., cache_enabled: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_pinned_pages: _Optional[int] = ..., speculate: _Optional[int] = ..., layer_kinds: _Optional[_Iterable[str]] = ..., sliding_window: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., kv_demote: _Optional[str] = ..., kv_demoted_pages: _Optional[int] = ..., rows_exact: _Optional[bool] = ..., row_check: _Optional[str] = ...) -> None: ...

class GetCacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("pages_total", "pages_free", "pages_cached", "pages_evictable", "pages_pinned", "pages_in_use", "queried_tokens", "hit_tokens", "hit_rate", "evicted_pages", "preemptions", "running", "waiting", "live_leases", "steps", "max_pinned_pages", "kv_dtype", "kv_bytes_per_token", "pages_demoted", "demoted_pages", "promoted_pages", "disk_pages", "disk_bytes", "disk_capacity_bytes", "host_pages", "spilled_pages", "spill_dropped_pages", "disk_corrupt_pages", "disk_hit_tokens", "host_hit_tokens", "disk_ready", "draft_tokens", "accepted_draft_tokens", "draft_steps", "store_hit_tokens", "store_pages", "store_loaded_pages", "store_queued_pages", "store_written_pages", "store_skipped_pages", "store_dropped_pages", "store_corrupt_pages", "store_unavailable_errors", "store_ready", "replicas", "window_slots_total", "window_slots_free", "window_parts_idle", "window_parts_dropped")
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    PAGES_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    PAGES_PINNED_FIELD_NUMBER: _ClassVar[int]
    PAGES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGES_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SPILL_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_READY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    STORE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_LOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_QUEUED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_SKIPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_UNAVAILABLE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    STORE_READY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PARTS_IDLE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PARTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    pages_total: int
    pages_free: int
    pages_cached: int
    pages_evictable: int
    pages_pinned: int
    pages_in_use: int
    queried_tokens: int
    hit_tokens: int
    hit_rate: float
    evicted_pages: int
    preemptions: int
    running: int
    waiting: int
    live_leases: int
    steps: int
    max_pinned_pages: int
    kv_dtype: str
    kv_bytes_per_token: int
    pages_demoted: int
    demoted_pages: int
    promoted_pages: int
    disk_pages: int
    disk_bytes: int
    disk_capacity_bytes: int
    host_pages: int
    spilled_pages: int
    spill_dropped_pages: int
    disk_corrupt_pages: int
    disk_hit_tokens: int
    host_hit_tokens: int
    disk_ready: bool
    draft_tokens: int
    accepted_draft_tokens: int
    draft_steps: int
    store_hit_tokens: int
    store_pages: int
    store_loaded_pages: int
    store_queued_pages: int
    store_written_pages: int
    store_skipped_pages: int
    store_dropped_pages: int
    store_corrupt_pages: int
    store_unavailable_errors: int
    store_ready: bool
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaCacheStats]
    window_slots_total: int
    window_slots_free: int
    window_parts_idle: int
    window_parts_dropped: int
    def __init__(self, pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., pages_cached: _Optional[int] = ..., pages_evictable: _Optional[int] = ..., pages_pinned: _Optional[int] = ..., pages_in_use: _Optional[int] = ..., queried_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., hit_rate: _Optional[float] = ..., evicted_pages: _Optional[int] = ..., preemptions: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., live_leases: _Optional[int] = ..., steps: _Optional[int] = ..., max_pinned_pages: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., pages_demoted: _Optional[int] = ..., demoted_pages: _Optional[int] = ..., promoted_pages: _Optional[int] = ..., disk_pages: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., host_pages: _Optional[int] = ..., spilled_pages: _Optional[int] = ..., spill_dropped_pages: _Optional[int] = ..., disk_corrupt_pages: _Optional[int] = ..., disk_hit_tokens: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., disk_ready: _Optional[bool] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., draft_steps: _Optional[int] = ..., store_hit_tokens: _Optional[int] = ..., store_pages: _Optional[int] = ..., store_loaded_pages: _Optional[int] = ..., store_queued_pages: _Optional[int] = ..., store_written_pages: _Optional[int] = ..., store_skipped_pages: _Optional[int] = ..., store_dropped_pages: _Optional[int] = ..., store_corrupt_pages: _Optional[int] = ..., store_unavailable_errors: _Optional[int] = ..., store_ready: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[ReplicaCacheStats, _Mapping]]] = ..., window_slots_total: _Optional[int] = ..., window_slots_free: _Optional[int] = ..., window_parts_idle: _Optional[int] = ..., window_parts_dropped: _Optional[int] = ...) -> None: ...

class ReplicaCacheStats(_message.Message):
    __slots__ = ("replica_id", "stats")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    stats: CacheStats
    def __init__(self, replica_id: _Optional[str] = ..., stats: _Optional[_Union[CacheStats, _Mapping]] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("pages_flushed",)
    PAGES_FLUSHED_FIELD_NUMBER: _ClassVar[int]
    pages_flushed: int
    def __init__(self, pages_flushed: _Optional[int] = ...) -> None: ...

class PinPrefixRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "ttl_seconds")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    ttl_seconds: float
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class PinPrefixResponse(_message.Message):
    __slots__ = ("pinned_tokens", "prompt_tokens")
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pinned_tokens: int
    prompt_tokens: int
    def __init__(self, pinned_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class UnpinPrefixRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class UnpinPrefixResponse(_message.Message):
    __slots__ = ("unpinned_tokens",)
    UNPINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    unpinned_tokens: int
    def __init__(self, unpinned_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class SubscribeCacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("kind", "sequence", "events", "snapshot_complete", "page_size", "timestamp", "replica_id", "kv_dtype")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    kind: CacheEventBatchKind
    sequence: int
    events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    snapshot_complete: bool
    page_size: int
    timestamp: float
    replica_id: str
    kv_dtype: str
    def __init__(self, kind: _Optional[_Union[CacheEventBatchKind, str]] = ..., sequence: _Optional[int] = ..., events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ..., snapshot_complete: _Optional[bool] = ..., page_size: _Optional[int] = ..., timestamp: _Optional[float] = ..., replica_id: _Optional[str] = ..., kv_dtype: _Optional[str] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("namespace", "stored", "removed", "cleared")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stored: PagesStored
    removed: PagesRemoved
    cleared: NamespaceCleared
    def __init__(self, namespace: _Optional[str] = ..., stored: _Optional[_Union[PagesStored, _Mapping]] = ..., removed: _Optional[_Union[PagesRemoved, _Mapping]] = ..., cleared: _Optional[_Union[NamespaceCleared, _Mapping]] = ...) -> None: ...

class PagesStored(_message.Message):
    __slots__ = ("parent_hash", "page_hashes", "token_ids", "medium", "group_idx", "kv_cache_spec_kind", "sliding_window")
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    parent_hash: int
    page_hashes: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    group_idx: int
    kv_cache_spec_kind: str
    sliding_window: int
    def __init__(self, parent_hash: _Optional[int] = ..., page_hashes: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[str] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class PagesRemoved(_message.Message):
    __slots__ = ("page_hashes", "medium", "group_idx")
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    page_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    group_idx: int
    def __init__(self, page_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ...) -> None: ...

class NamespaceCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExplainPrefixRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class ExplainedPage(_message.Message):
    __slots__ = ("index", "tokens", "served", "state")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    index: int
    tokens: int
    served: int
    state: str
    def __init__(self, index: _Optional[int] = ..., tokens: _Optional[int] = ..., served: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class ExplainPrefixResponse(_message.Message):
    __slots__ = ("prompt_tokens", "page_size", "cacheable_tokens", "cached_tokens", "cache_miss_reason", "cache_match_end", "pages")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHEABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHE_MATCH_END_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    page_size: int
    cacheable_tokens: int
    cached_tokens: int
    cache_miss_reason: str
    cache_match_end: str
    pages: _containers.RepeatedCompositeFieldContainer[ExplainedPage]
    def __init__(self, prompt_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., cacheable_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cache_miss_reason: _Optional[str] = ..., cache_match_end: _Optional[str] = ..., pages: _Optional[_Iterable[_Union[ExplainedPage, _Mapping]]] = ...) -> None: ...
