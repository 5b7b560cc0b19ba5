"""The typed engine interface every host implements and every front calls: many fronts, one engine interface.

Hosts: `worker.engine.Engine` (one worker: the engine thread over one KV pool) and `cluster.fleet.FleetEngine` (a
fleet: each request routed to a replica). Fronts (the gRPC servicer, the OpenAI app, the cluster ingress) reach
either through `worker.front.FrontCore`, never by name, so a host that misses a method fails the conformance test
(tests/test_engine_conformance.py), not a user.

Threads: `submit` and `abort` are called on the front's event loop and never block; `submit`'s `on_output` may be
called from any thread (the engine's own) and must not block either (EngineStream hands it to the loop). `stats`,
`flush_cache`, `pin`, `unpin` and `compile_constraint` may block for milliseconds: fronts call them from a worker
thread.

Refusals at submit, raised before anything is allocated: `InvalidArgument` (a field out of range, named by its
FieldPath), raised by the engine's rules in worker/engine/checks.py (check_engine_request: the prompt's ids and length,
stop token ids, room in the context; SamplingParams' value rules raise it earlier, when a request is made; the class is
in worker/engine/field_errors.py); `RequestTooLargeError` (can never fit in the KV pool, checks.py too);
`DuplicateRequestError` (the id is live); `EngineStoppedError` (draining or stopped). A request that was accepted ends
with exactly one final output per sample (RequestOutput.finish_reason set; FinishReason.ERROR with an ErrorKind for
failures after acceptance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from radixcache.cache import CacheStats
from radixcache.explain import Explanation
from radixcache.worker.engine.request import Constraint, Request, RequestOutput


class RequestTooLargeError(ValueError):
    """The request can never fit in the KV pool, whatever else is running (gRPC RESOURCE_EXHAUSTED, HTTP 413)."""


class DuplicateRequestError(ValueError):
    """A request with this id is still live (gRPC ALREADY_EXISTS): ids are free again once the last output is sent."""


class EngineStoppedError(RuntimeError):
    """The engine is draining or stopped and accepts no new request (gRPC UNAVAILABLE, HTTP 503)."""


@dataclass
class EngineStats:
    running: int
    waiting: int
    preemptions: int
    steps: int
    finished_requests: int
    prompt_tokens: int  # over every admitted request
    cached_tokens: int  # of those, served from the cache
    generated_tokens: int
    inflight_shared_tokens: int  # cached tokens that a still-running request had just computed
    cache: CacheStats = field(repr=False)  # the cache's own figures (the same tenant's, or the worker's)
    draft_tokens: int = 0  # speculation: draft tokens verified
    accepted_draft_tokens: int = 0  # of those, the ones the sampler drew too (emitted without a step of their own)
    draft_steps: int = 0  # sequence-steps that verified a draft
    # Of the cache's hit tokens (every admission), those loaded back from host memory / the disk / the fleet's
    # store (the rest: device)
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    store_hit_tokens: int = 0
    kv_dtype: str = ""  # the KV pages' precision (radixcache.kv_dtypes)
    kv_bytes_per_token: int = 0  # what one token's K/V costs in a page, scales included
    rows_exact: bool = True  # the start-up row check passed (False: speculation was turned off)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens verified (0 when nothing was drafted)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is, for a cluster router and a health check (cheap: O(requests), no tree walk)."""

    running: int
    waiting: int
    queued_prefill_tokens: int  # tokens live requests still have to prefill (Scheduler.prefill_backlog)
    pages_busy: int  # KV pages neither free nor evictable: held by running requests, or pinned
    pages_total: int
    steps: int  # engine steps so far (a health check sees it advance while there is work)


@dataclass(frozen=True)
class ModelFacts:
    """What a front needs to know about the served model and its engine, without any wire format: the gRPC front
    sends it as `ModelInfo` (same field names), the OpenAI front reads the model name and context from it."""

    model_name: str = ""
    model_path: str = ""
    architecture: str = ""
    vocab_size: int = 0
    context_length: int = 0
    page_size: int = 0
    kv_pages: int = 0
    kv_bytes: int = 0
    backend: str = ""
    dtype: str = ""
    device: str = ""
    cache_enabled: bool = True
    eos_token_ids: tuple[int, ...] = ()
    max_pinned_pages: int = 0
    speculate: int = 0  # draft tokens per sequence per step at most; 0: no speculative decoding
    layer_kinds: tuple[str, ...] = ()  # per layer "global" | "sliding"
    sliding_window: int = 0  # tokens a sliding layer attends to; 0: none slides
    kv_dtype: str = ""
    kv_bytes_per_token: int = 0
    kv_demote: str = ""
    kv_demoted_pages: int = 0
    rows_exact: bool = True  # the start-up row check (worker/engine/row_check.py) passed
    row_check: str = ""  # what it compared, or what differed

    @property
    def kv_tokens(self) -> int:
        """Token slots in the KV pool: no request may need more (prompt + max_tokens)."""
        return self.kv_pages * self.page_size

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_message(cls, message: Any) -> ModelFacts:
        """From any object with the same attribute names (a ModelInfo message, another ModelFacts)."""
        values = {f.name: getattr(message, f.name) for f in fields(cls) if hasattr(message, f.name)}
        if "eos_token_ids" in values:
            values["eos_token_ids"] = tuple(int(t) for t in values["eos_token_ids"])
        if "layer_kinds" in values:
            values["layer_kinds"] = tuple(str(k) for k in values["layer_kinds"])
        return cls(**values)


@runtime_checkable
class EngineLike(Protocol):
    """What a front may call on a host. Facts are read-only attributes; the contract of each call is in the module
    docstring (threads, refusals) and on Engine's methods."""

    tokenizer: Any  # worker.model.tokenizer.Tokenizer, or None (token ids in, token ids out)
    page_size: int
    num_pages: int
    vocab_size: int
    context_length: int

    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def stats(self, namespace: str | None = None) -> EngineStats: ...

    def flush_cache(self, namespace: str | None = None) -> int: ...

    def pin(self, token_ids: Sequence[int], namespace: str = "", ttl_s: float | None = None) -> int: ...

    def unpin(self, token_ids: Sequence[int], namespace: str = "") -> int: ...

    def explain(self, token_ids: Sequence[int], namespace: str = "") -> Explanation: ...

    def compile_constraint(self, constraint: Constraint) -> None: ...


ENGINE_METHODS = ("submit", "abort", "stats", "flush_cache", "pin", "unpin", "explain", "compile_constraint")
ENGINE_FACTS = ("tokenizer", "page_size", "num_pages", "vocab_size", "context_length")
