"""What a router knows of each replica's load: the replica's own reports, plus what this router sent it since.

Replicas report `EngineLoad` (worker.engine: requests running and waiting, prefill tokens queued, KV pages busy)
to the EventHub every BUSY_REPORT_PERIOD_S while they have requests (every REPORT_PERIOD_S when idle), and routers
get the newest with every poll (at least that often), so a busy replica's report is up to about two busy periods
old when it is used. Between reports the router adds what it sent itself: each request it routed counts as
running there until its stream ends, and its uncached prompt tokens count as queued until a report that must
include them has arrived (one received more than `report_lag_s` after the request was sent), its stream ended, or
`max_age_s` passed with no report at all (the hub down). With several ingress replicas each router sees the others' requests only
through the reports.

A report is up to a period stale the other way too: requests it counted may have ended since. Those this router
sent (sent long enough before the report to be in it) and saw end after it arrived are taken off its figures, a
request each and its prompt's uncached tokens (a finished request queues nothing), until the next report; without
this, a burst of short requests right after a busy spell all went to the replica that had been idle (the present
trace of bench/cluster_bench.py). The figures never go below zero, nor below what this router has outstanding.

Thread-safe: Serve calls `routed` / `finished` from its own threads, the feed calls `reported` on the router's loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from radixcache.worker.engine.api import EngineLoad

REPORT_PERIOD_S = 0.5  # how often an idle replica reports its load (its liveness to the hub, too)
# ...and one with requests running or waiting. A 1,024-token prefill takes tens of milliseconds on a GPU (and on
# bench/cluster_bench.py's tiny CPU replicas), so a report half a second old still counted prefills long finished,
# and the router sent a conversation away from the replica holding it: the flush_restart trace missed 1-3 of its
# 32 reusable requests in 11 of 20 runs at 0.5 s, none in 12 at 0.1 s (BENCHMARKS.md, "Cluster routing").
BUSY_REPORT_PERIOD_S = 0.1
# A report received this long after a request was sent counts it (the request's way from the router's decision to
# the engine's queue, and the report's way back, take milliseconds; with room for a busy event loop).
REPORT_LAG_S = 0.05


@dataclass
class Sent:
    """One request this router sent (what `LoadView.routed` returns; hand it back to `finished`)."""

    at: float
    tokens: int  # its uncached prompt tokens (0 once it finished)
    prefill: int = 0  # its uncached prompt tokens, kept


@dataclass
class _ReplicaLoad:
    report: EngineLoad | None = None
    report_at: float = float("-inf")  # when it arrived (this router's clock)
    outstanding: int = 0  # requests this router sent there whose stream has not ended
    sent: deque[Sent] = field(default_factory=deque)  # requests sent there that no report covers yet
    ended: int = 0  # requests the last report counted that ended since it arrived
    ended_tokens: int = 0  # ...and their uncached prompt tokens


class LoadView:
    def __init__(
        self, *, report_lag_s: float = REPORT_LAG_S, max_age_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.report_lag_s = report_lag_s
        self.max_age_s = max_age_s
        self.clock = clock
        self._replicas: dict[Hashable, _ReplicaLoad] = {}
        self._lock = threading.Lock()

    def reported(self, replica: Hashable, load: EngineLoad) -> None:
        with self._lock:
            view = self._view(replica)
            view.report, view.report_at = load, self.clock()
            view.ended = view.ended_tokens = 0
            self._prune(view)

    def routed(self, replica: Hashable, prefill_tokens: int) -> Sent:
        with self._lock:
            view = self._view(replica)
            view.outstanding += 1
            sent = Sent(self.clock(), prefill_tokens, prefill_tokens)
            view.sent.append(sent)
            return sent

    def finished(self, replica: Hashable, sent: Sent) -> None:
        """The request's stream ended: it runs no more, and queues nothing."""
        with self._lock:
            sent.tokens = 0
            view = self._replicas.get(replica)
            if view is not None:
                view.outstanding = max(0, view.outstanding - 1)
                if view.report is not None and sent.at <= view.report_at - self.report_lag_s:  # the report has it
                    view.ended += 1
                    view.ended_tokens += sent.prefill

    def withdrawn(self, replica: Hashable, sent: Sent) -> None:
        """The request was counted there but never reached it (a choice Serve did not carry out)."""
        with self._lock:
            sent.tokens = 0
            view = self._replicas.get(replica)
            if view is not None:
                view.outstanding = max(0, view.outstanding - 1)

    def forget(self, replica: Hashable) -> None:
        with self._lock:
            self._replicas.pop(replica, None)

    # -- what the policy reads ---------------------------------------------------------------------------------
    def requests(self, replica: Hashable) -> int:
        """Requests running or waiting there: the replica's count, or this router's own if that is larger."""
        with self._lock:
            view = self._replicas.get(replica)
            if view is None:
                return 0
            reported = view.report.running + view.report.waiting - view.ended if view.report else 0
            return max(reported, view.outstanding)

    def queued_tokens(self, replica: Hashable) -> int:
        """Prefill tokens queued there: the last report's, plus what this router sent that it cannot include yet."""
        with self._lock:
            view = self._replicas.get(replica)
            if view is None:
                return 0
            self._prune(view)
            reported = max(0, view.report.queued_prefill_tokens - view.ended_tokens) if view.report else 0
            return reported + sum(s.tokens for s in view.sent)

    def kv_busy(self, replica: Hashable) -> float:
        """Share of its KV pool held by running requests or pins, by its last report (0 before any)."""
        with self._lock:
            view = self._replicas.get(replica)
            report = view.report if view else None
            return report.pages_busy / report.pages_total if report and report.pages_total else 0.0

    def pages_total(self, replica: Hashable) -> int | None:
        """Its KV pool's size in pages, by its last report (None before any)."""
        with self._lock:
            view = self._replicas.get(replica)
            return view.report.pages_total if view and view.report else None

    def _prune(self, view: _ReplicaLoad) -> None:
        covered = max(view.report_at - self.report_lag_s, self.clock() - self.max_age_s)
        while view.sent and view.sent[0].at <= covered:
            view.sent.popleft()

    def _view(self, replica: Hashable) -> _ReplicaLoad:
        view = self._replicas.get(replica)
        if view is None:
            view = self._replicas[replica] = _ReplicaLoad()
        return view
