"""vLLM's Prometheus names beside ours, so that dashboards, autoscalers and llm-d's scorers written for vLLM read a
radixcache worker unchanged. Our own names (worker/metrics.py) stay as they are; these are the same figures under
vLLM's names, meanings and labels: every series has `model_name` (the served model name) and `engine` ("0": one
engine per worker).

| vLLM name (prometheus type)                      | ours / how it is computed                                           |
|--------------------------------------------------|---------------------------------------------------------------------|
| vllm:num_requests_running (gauge)                | radixcache_requests_running                                         |
| vllm:num_requests_waiting (gauge)                | radixcache_requests_waiting                                         |
| vllm:kv_cache_usage_perc (gauge, 0..1)           | (pages_total - free - evictable) / pages_total: pages held by       |
|                                                  | requests or pins; vLLM counts cached, unreferenced blocks as free   |
| vllm:prefix_cache_queries_total (counter)        | radixcache_cache_queried_tokens (tokens looked up, re-admissions    |
|                                                  | of preempted requests included, as vLLM V1 counts them)             |
| vllm:prefix_cache_hits_total (counter)           | radixcache_cache_hit_tokens (tokens found cached, any tier)         |
| vllm:num_preemptions_total (counter)             | radixcache_preemptions                                              |
| vllm:prompt_tokens_total (counter)               | radixcache_prompt_tokens (each admitted request's prompt, once)     |
| vllm:generation_tokens_total (counter)           | generated tokens, counted as they stream (ours: at the finish)      |
| vllm:request_success_total{finished_reason}      | radixcache_requests{finish_reason}: stop_token and stop_string ->   |
| (counter)                                        | stop, length -> length, aborted -> abort, error -> error            |
| vllm:time_to_first_token_seconds (histogram)     | radixcache_time_to_first_token_seconds (vLLM's buckets)             |
| vllm:time_per_output_token_seconds (histogram)   | radixcache_time_per_output_token_seconds: one observation per       |
|                                                  | finished sample, its mean gap (vLLM: every gap)                     |
| vllm:inter_token_latency_seconds (histogram)     | each gap between two outputs of a sample that carry tokens (an      |
|                                                  | output of several accepted drafts is one gap, as in vLLM)           |
| vllm:e2e_request_latency_seconds (histogram)     | submission to the finish, one observation per finished sample       |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixcache.worker.engine.request import FinishReason, RequestOutput

LABELS = ("model_name", "engine")
ENGINE = "0"
# Our finish reasons -> vLLM's finished_reason label values.
FINISHED_REASON = {
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "abort",
    FinishReason.ERROR: "error",
}
# vLLM's bucket boundaries, so that histogram_quantile over both fleets compares like with like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def kv_cache_usage(s: dict[str, float]) -> float:
    """The fraction of KV pages neither free nor evictable (flatten_stats' figures); 0 for an empty pool."""
    total = s["pages_total"]
    if not total:
        return 0.0
    held = total - s["pages_free"] - s["pages_evictable"]
    return min(1.0, max(0.0, held / total))


def engine_families(s: dict[str, float], model_name: str) -> Iterator[Metric]:
    """The scrape-time figures under vLLM's names, from flatten_stats' dict (the one WorkerMetrics' collector read
    for ours: both sets come from the same engine.stats() call)."""
    labels = [model_name, ENGINE]

    def one(family: GaugeMetricFamily | CounterMetricFamily, value: float) -> Metric:
        family.add_metric(labels, value)
        return family

    yield one(GaugeMetricFamily("vllm:num_requests_running", "requests in the batch", labels=LABELS), s["running"])
    yield one(
        GaugeMetricFamily("vllm:num_requests_waiting", "requests waiting for admission", labels=LABELS),
        s["waiting"],
    )
    yield one(
        GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "fraction of KV pages held by requests or pins (1 = full)", labels=LABELS
        ),
        kv_cache_usage(s),
    )
    yield one(
        CounterMetricFamily("vllm:prefix_cache_queries", "prompt tokens looked up in the cache", labels=LABELS),
        s["queried_tokens"],
    )
    yield one(
        CounterMetricFamily("vllm:prefix_cache_hits", "prompt tokens found in the cache", labels=LABELS),
        s["hit_tokens"],
    )
    yield one(CounterMetricFamily("vllm:num_preemptions", "requests preempted", labels=LABELS), s["preemptions"])


class VllmRequestMetrics:
    """The per-request figures under vLLM's names, recorded as outputs stream (observe, from WorkerMetrics.observe).
    `model_name()` is read at each observation: the worker learns its model's name only once it is loaded."""

    def __init__(self, registry: CollectorRegistry, model_name: Callable[[], str]) -> None:
        r, self._model_name = registry, model_name
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of admitted requests", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "generated tokens", LABELS, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "finished requests by why they finished", [*LABELS, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "from submission to the first generated token", LABELS,
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds", "mean time between generated tokens, per finished sample", LABELS,
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "time between two outputs of a sample that carry tokens", LABELS,
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "from submission to the finish, per sample", LABELS,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._named: str | None = None

    def show(self) -> dict[str, str]:
        """Make every series exist (at 0) under the current model name, as vLLM's exist from start-up, so that a
        rate() over them starts with the first request, not after it; returns the labels. Call it once the model's
        name is known (WorkerMetrics.attached); observe calls it when the name changed."""
        name = self._model_name()
        labels = {"model_name": name, "engine": ENGINE}
        if name != self._named:
            for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.itl, self.e2e):
                metric.labels(**labels)
            for reason in dict.fromkeys(FINISHED_REASON.values()):
                self.request_success.labels(**labels, finished_reason=reason)
            self._named = name
        return labels

    def observe(self, out: RequestOutput, *, first: bool) -> None:
        labels = self.show()
        if first:
            self.prompt_tokens.labels(**labels).inc(out.prompt_tokens)
        if out.token_ids:
            self.generation_tokens.labels(**labels).inc(len(out.token_ids))
        if out.time_to_first_token is not None:
            self.ttft.labels(**labels).observe(out.time_to_first_token)
        if out.inter_token_latency is not None:
            self.itl.labels(**labels).observe(out.inter_token_latency)
        if out.finish_reason is not None:
            reason = FINISHED_REASON[out.finish_reason]
            self.request_success.labels(**labels, finished_reason=reason).inc()
            if out.time_per_output_token is not None:
                self.tpot.labels(**labels).observe(out.time_per_output_token)
            if out.e2e_latency is not None:
                self.e2e.labels(**labels).observe(out.e2e_latency)
