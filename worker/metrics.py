"""Prometheus metrics of one worker, in a private registry (so a test process can run several workers).

Request-level metrics (tokens, finish reasons, time to first token, time per output token) are recorded by the
server as streams finish; cache and scheduler gauges are read from `engine.stats()` at scrape time. The same figures
are also exported under vLLM's names and labels (worker/vllm_metrics.py has the table), for tools written for vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixcache.worker import vllm_metrics
from radixcache.worker.engine.request import RequestOutput

PAGE_STATES = ("free", "cached", "evictable", "pinned", "in_use")
# The tiers below the pool, as CacheStats names their figures (radixcache.cache): copied through by name.
TIER_FIGURES = (
    "spilled_pages",
    "spill_dropped_pages",
    "host_pages",
    "host_bytes",
    "host_capacity_bytes",
    "disk_pages",
    "disk_bytes",
    "disk_capacity_bytes",
    "disk_queued_pages",
    "disk_dropped_pages",
    "disk_evicted_pages",
    "disk_corrupt_pages",
    "disk_write_errors",
    "disk_ready",
    "store_loaded_pages",
    "store_pages",
    "store_queued_pages",
    "store_written_pages",
    "store_skipped_pages",
    "store_dropped_pages",
    "store_corrupt_pages",
    "store_unavailable_errors",
    "store_ready",
)
STORE_COUNTERS = (  # the fleet's store (--kv-remote): name, help
    ("written_pages", "pages this worker wrote to the fleet's store"),
    ("skipped_pages", "pages not written: the fleet's store had them (once per fleet)"),
    ("dropped_pages", "pages not written: the queue was full or the store unavailable"),
    ("loaded_pages", "pages loaded from the fleet's store into the pool"),
    ("corrupt_pages", "objects in the fleet's store that failed the page check (removed, never served)"),
    ("unavailable_errors", "calls to the fleet's store that failed or ran past their deadline"),
)
# Window paging (radixcache.window_parts), copied through by name too.
WINDOW_FIGURES = ("window_slots_total", "window_slots_free", "window_parts_idle", "window_parts_dropped")


def flatten_stats(stats: Any) -> dict[str, float]:
    """engine.stats() (EngineStats with a nested radixcache CacheStats) -> one flat dict with stable names.

    Missing fields read as 0 (the server tests' FakeEngine reports only some). hit_rate is the cache's: hit tokens
    over every lookup, a preempted request's re-admission included.
    """
    cache = getattr(stats, "cache", None)

    def c(name: str) -> float:
        return float(getattr(cache, name, 0) or 0)

    def e(name: str) -> float:
        return float(getattr(stats, name, 0) or 0)

    queried, hit = c("queried_tokens"), c("hit_tokens")
    rows_exact = float(bool(getattr(stats, "rows_exact", True)))
    host_hit, disk_hit, store_hit = e("host_hit_tokens"), e("disk_hit_tokens"), e("store_hit_tokens")
    return {
        "rows_exact": rows_exact,
        "pages_total": c("pages_total"),
        "pages_free": c("pages_free"),
        "pages_cached": c("pages_cached"),
        "pages_evictable": c("pages_evictable"),
        "pages_pinned": c("pages_pinned"),
        "max_pinned_pages": c("max_pinned_pages"),
        "pages_in_use": c("pages_in_use"),
        "queried_tokens": queried,
        "hit_tokens": hit,
        "hit_rate": hit / queried if queried else 0.0,
        "evicted_pages": c("evicted_pages"),
        "live_leases": c("live_leases"),
        "preemptions": e("preemptions"),
        "running": e("running"),
        "waiting": e("waiting"),
        "steps": e("steps"),
        "host_hit_tokens": host_hit,
        "disk_hit_tokens": disk_hit,
        "store_hit_tokens": store_hit,
        "device_hit_tokens": max(0.0, hit - host_hit - disk_hit - store_hit),
        "draft_tokens": e("draft_tokens"),
        "accepted_draft_tokens": e("accepted_draft_tokens"),
        "draft_steps": e("draft_steps"),
        "kv_bytes_per_token": e("kv_bytes_per_token"),
        "pages_demoted": c("pages_demoted"),
        "demoted_pages": c("demoted_pages"),
        "promoted_pages": c("promoted_pages"),
    } | {name: c(name) for name in TIER_FIGURES + WINDOW_FIGURES}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Any | None], model_name: Callable[[], str]) -> None:
        self._stats, self._model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        raw = self._stats()
        if raw is None:  # still loading the model
            return
        s = flatten_stats(raw)
        pages = GaugeMetricFamily("radixcache_cache_pages", "KV pages by state", labels=["state"])
        for state in PAGE_STATES:
            pages.add_metric([state], s[f"pages_{state}"])
        yield pages
        yield GaugeMetricFamily("radixcache_cache_pages_total", "KV pages in the pool", value=s["pages_total"])
        yield GaugeMetricFamily("radixcache_cache_hit_rate", "hit tokens / queried tokens", value=s["hit_rate"])
        yield CounterMetricFamily(
            "radixcache_cache_queried_tokens", "prompt tokens looked up", value=s["queried_tokens"]
        )
        yield CounterMetricFamily("radixcache_cache_hit_tokens", "prompt tokens found cached", value=s["hit_tokens"])
        by_tier = CounterMetricFamily(
            "radixcache_cache_hit_tokens_by_tier", "prompt tokens found cached, by where they were", labels=["tier"]
        )
        for tier in ("device", "host", "disk", "store"):
            by_tier.add_metric([tier], s[f"{tier}_hit_tokens"])
        yield by_tier
        yield from _tier_metrics(s)
        yield from _store_metrics(s)
        yield from _window_metrics(s)
        yield CounterMetricFamily("radixcache_cache_evicted_pages", "pages evicted for room", value=s["evicted_pages"])
        yield CounterMetricFamily("radixcache_preemptions", "requests preempted", value=s["preemptions"])
        yield GaugeMetricFamily("radixcache_requests_running", "requests in the batch", value=s["running"])
        yield GaugeMetricFamily("radixcache_requests_waiting", "requests waiting for admission", value=s["waiting"])
        yield GaugeMetricFamily(
            "radixcache_cache_live_leases", "running sequences' cache leases", value=s["live_leases"]
        )
        yield CounterMetricFamily(
            "radixcache_spec_draft_tokens", "speculative draft tokens checked", value=s["draft_tokens"]
        )
        yield CounterMetricFamily(
            "radixcache_spec_accepted_tokens",
            "draft tokens that were the sampled token (acceptance rate: accepted / draft)",
            value=s["accepted_draft_tokens"],
        )
        yield CounterMetricFamily(
            "radixcache_spec_draft_steps", "sequence-steps that checked a draft", value=s["draft_steps"]
        )
        yield GaugeMetricFamily(
            "radixcache_rows_exact",
            "1 when the start-up row check found a token's logits batch-independent; 0: speculation is off",
            value=s["rows_exact"],
        )
        yield GaugeMetricFamily(
            "radixcache_kv_bytes_per_token", "KV page bytes per token, scales included", value=s["kv_bytes_per_token"]
        )
        yield GaugeMetricFamily(
            "radixcache_cache_pages_demoted", "cached pages held demoted (--kv-demote)", value=s["pages_demoted"]
        )
        yield CounterMetricFamily(
            "radixcache_cache_demoted_pages", "pages demoted instead of evicted (--kv-demote)", value=s["demoted_pages"]
        )
        yield CounterMetricFamily(
            "radixcache_cache_promoted_pages", "demoted pages brought back by a hit", value=s["promoted_pages"]
        )
        yield from vllm_metrics.engine_families(s, self._model_name())


def _window_metrics(s: dict[str, float]) -> Iterator[Metric]:
    """Window paging's slots (nothing for a model without sliding layers paged apart)."""
    if not s["window_slots_total"]:
        return
    slots = GaugeMetricFamily("radixcache_window_slots", "sliding layers' window slots by state", labels=["state"])
    idle, free = s["window_parts_idle"], s["window_slots_free"]
    for state, value in (("read", s["window_slots_total"] - free - idle), ("idle", idle), ("free", free)):
        slots.add_metric([state], value)
    yield slots
    yield CounterMetricFamily(
        "radixcache_window_parts_dropped",
        "idle window parts given back for room (their pages stay cached for the global layers)",
        value=s["window_parts_dropped"],
    )


def _tier_metrics(s: dict[str, float]) -> Iterator[Metric]:
    """The tiers below the pool (nothing without one)."""
    if not (s["host_capacity_bytes"] or s["disk_capacity_bytes"]):
        return
    pages = GaugeMetricFamily("radixcache_tier_pages", "pages held below the KV pool", labels=["tier"])
    size = GaugeMetricFamily("radixcache_tier_bytes", "bytes held below the KV pool", labels=["tier"])
    bound = GaugeMetricFamily("radixcache_tier_capacity_bytes", "the bound of each tier", labels=["tier"])
    for tier in ("host", "disk"):
        if s[f"{tier}_capacity_bytes"]:
            pages.add_metric([tier], s[f"{tier}_pages"])
            size.add_metric([tier], s[f"{tier}_bytes"])
            bound.add_metric([tier], s[f"{tier}_capacity_bytes"])
    yield from (pages, size, bound)
    yield CounterMetricFamily("radixcache_tier_spilled_pages", "evicted pages written below", value=s["spilled_pages"])
    yield CounterMetricFamily(
        "radixcache_tier_spill_dropped_pages",
        "evicted pages a full write queue refused",
        value=s["spill_dropped_pages"],
    )
    yield CounterMetricFamily(
        "radixcache_disk_corrupt_pages",
        "disk pages found damaged (deleted, never served)",
        value=s["disk_corrupt_pages"],
    )
    yield GaugeMetricFamily("radixcache_disk_queued_pages", "pages waiting to be written", value=s["disk_queued_pages"])


def _store_metrics(s: dict[str, float]) -> Iterator[Metric]:
    """The fleet's shared store (--kv-remote; nothing until it has answered or failed once)."""
    if not (s["store_ready"] or s["store_unavailable_errors"] or s["store_written_pages"] or s["store_pages"]):
        return
    yield GaugeMetricFamily("radixcache_store_ready", "1 while the fleet's store answers", value=s["store_ready"])
    yield GaugeMetricFamily(
        "radixcache_store_pages", "pages this worker knows the fleet's store holds", value=s["store_pages"]
    )
    yield GaugeMetricFamily(
        "radixcache_store_queued_pages", "pages waiting to be written to the store", value=s["store_queued_pages"]
    )
    for name, about in STORE_COUNTERS:
        yield CounterMetricFamily(f"radixcache_store_{name}", about, value=s[f"store_{name}"])


class WorkerMetrics:
    """The metrics of one worker. `stats` returns engine.stats(), or None while there is no engine yet; `model_name`
    the served model's name (vLLM's names carry it as a label; read at each use, as it is known once loaded)."""

    def __init__(self, stats: Callable[[], Any | None], model_name: Callable[[], str] = lambda: "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixcache_requests", "finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("radixcache_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("radixcache_cached_tokens", "prompt tokens served from the cache", registry=r)
        self.completion_tokens = Counter("radixcache_completion_tokens", "generated tokens", registry=r)
        self.cache_misses = Counter(
            "radixcache_cache_lookups",
            "admitted requests by why the cache served no more of the prompt (radixcache.miss_reasons)",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "radixcache_time_to_first_token_seconds",
            "from submission to the first generated token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.acceptance = Histogram(
            "radixcache_spec_request_acceptance",
            "per finished sample that was given drafts: accepted draft tokens / draft tokens",
            buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.tpot = Histogram(
            "radixcache_time_per_output_token_seconds",
            "mean time between generated tokens, per request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        r.register(_EngineCollector(stats, model_name))
        self.vllm = vllm_metrics.VllmRequestMetrics(r, model_name)
        self._http: Any = None
        self._thread: threading.Thread | None = None

    def attached(self) -> None:
        """The engine is attached (its model's name known): vLLM's request series show from now on, at 0."""
        self.vllm.show()

    def observe(self, out: RequestOutput, *, first: bool) -> None:
        """Record one RequestOutput of a stream (first: the stream's first output)."""
        self.vllm.observe(out, first=first)
        if first:
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            if out.cache_miss_reason:
                self.cache_misses.labels(reason=out.cache_miss_reason).inc()
        if out.time_to_first_token is not None:
            self.ttft.observe(out.time_to_first_token)
        if out.finish_reason is not None:
            self.requests.labels(finish_reason=out.finish_reason.value).inc()
            self.completion_tokens.inc(out.completion_tokens)
            if out.time_per_output_token is not None:
                self.tpot.observe(out.time_per_output_token)
            if out.draft_tokens:
                self.acceptance.observe(out.accepted_draft_tokens / out.draft_tokens)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on host:port (0 = a free port) from a daemon thread; returns the port."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
