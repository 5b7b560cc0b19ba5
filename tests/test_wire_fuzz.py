"""Wire fuzzing (issue 10): hypothesis-built and corrupt requests against a worker with the real engine.

Every call ends OK or with a documented status (never UNKNOWN or INTERNAL), the worker stays SERVING, and no lease
or page is left behind. `make soak` runs the same driver (tests/wire_fuzz.py) for thousands of calls.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loop_stall import measure_loop_stall
from wire_fuzz import run_wire_fuzz
from worker_harness import ThreadedWorker

from radixcache.client import Client
from radixcache.worker.cli import load_model, parser
from radixcache.worker.engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def worker():
    """The --random-model worker (character tokenizer with a chat template, context 2048), a small pool."""
    loaded, _, _ = load_model(parser().parse_args(["--random-model", "--device", "cpu"]))
    engine = Engine(loaded, EngineConfig(page_size=16, kv_pages=48, max_step_tokens=128, backend="torch"))
    with ThreadedWorker(engine, max_message_bytes=16 << 20) as w:
        yield w


def test_fuzzed_calls_never_end_unknown_or_internal_and_leak_nothing(worker):
    report = run_wire_fuzz(worker.target, count=250, seconds=18, seed=0)
    assert report.calls >= 50, report
    assert report.unexpected == [], report.unexpected[:5]
    assert report.statuses["OK"] > 0 and report.statuses["INVALID_ARGUMENT"] > 0, report.statuses
    with Client(worker.target) as c:
        deadline = time.monotonic() + 10
        while (s := c.stats())["running"] or s["waiting"] or s["live_leases"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        assert s["pages_in_use"] == 0 and s["pages_free"] + s["pages_cached"] == s["pages_total"], s
        assert c.generate_text(token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True).completion_tokens == 2
    worker.engine.call(lambda: worker.engine.cache.check(idle=True))
    with grpc.insecure_channel(worker.target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_15_mib_prompts_are_refused_while_the_loop_keeps_answering(worker):
    """Before issue 10 a 15 MiB prompt was tokenized on the event loop: health answered after 84 s."""
    report = measure_loop_stall(worker.target, seconds=2.0, senders=1, payload_mib=15.0)  # the worker allows 16
    assert report.big_requests >= 2 and set(report.statuses) == {"INVALID_ARGUMENT"}, report
    assert report.probes >= 5 and report.max_loop_stall_ms < 3000, report  # generous: this machine is shared
