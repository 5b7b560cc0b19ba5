"""Chaos (issue 10): a real worker with a small pool, two tenants, concurrent streams with random cancels, deadlines
and Abort calls, pins with TTLs and flushes. Afterwards nothing leaked, every stream ended as promised, and greedy
reference prompts gave the tokens they give on an idle worker. `make soak` runs the same driver (tests/chaos.py) for
thousands of requests."""

from __future__ import annotations

import grpc
import pytest
from chaos import Workload, reference_tokens, run_chaos, wait_idle
from worker_process import WorkerProcess

from radixcache.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
ADMIN = "tok-ops"  # sees the whole worker's figures (a tenant's GetCacheStats shows its own)
PAGE = 16


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens.txt"
    tokens.write_text("".join(f"{t} {tenant}\n" for t, tenant in TOKENS.items()) + f"{ADMIN} ops admin\n")
    args = ["--page-size", str(PAGE), "--kv-pages", "32", "--max-step-tokens", "64", "--auth-tokens", str(tokens)]
    with WorkerProcess(*args) as w:
        yield w
        w.terminate()
        assert w.wait(30) == 0, w.log()[-3000:]


def test_chaos_leaks_nothing_and_keeps_every_promise(worker):
    workload = Workload.build(7, vocab=190, page_size=PAGE, max_tokens=96)
    expected = reference_tokens(worker.target, "tok-alice", workload)
    report = run_chaos(worker.target, TOKENS, workload, expected, count=150, seed=7, concurrency=12, seconds=120)
    assert report.broken == [], report.broken[:5]
    assert report.unknown_or_internal == 0, report.statuses
    assert report.requests == 150 and report.references_checked > 0, report
    assert report.cancelled > 0 and report.aborted > 0, report  # the chaos happened
    assert any(k.startswith("pin") for k in report.admin_calls), report.admin_calls
    for token in [*TOKENS, ADMIN]:  # each tenant's own view, then the worker's: nothing running, no lease
        s = wait_idle(worker.target, token)
        assert (s["running"], s["waiting"], s["live_leases"], s["pages_in_use"]) == (0, 0, 0, 0), s
        assert s["pages_pinned"] <= s["max_pinned_pages"], s
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s  # the worker's: every page free or cached
    assert s["preemptions"] > 0, "the pool was meant to be too small"
    assert reference_tokens(worker.target, "tok-bob", workload) == expected, "still the idle answers afterwards"
    log = worker.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:3000]


def test_a_pin_over_its_budget_is_resource_exhausted_and_pins_nothing(worker):
    with Client(worker.target, token="tok-bob") as bob:
        budget = bob.model_info()["max_pinned_pages"]
        assert budget == 16  # the default --max-pinned: half of the 32 pages
        system = Workload.build(8, vocab=190, page_size=PAGE).prefixes[0]
        long = (system * 20)[: (budget + 2) * PAGE]
        with pytest.raises(grpc.RpcError) as e:
            bob.pin(token_ids=long)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pinned" in e.value.details()
        s = bob.stats()
        assert s["max_pinned_pages"] == budget and s["pages_pinned"] <= budget
        assert bob.pin(token_ids=long[: 2 * PAGE], ttl_seconds=30) == 2 * PAGE  # within the budget: pinned
        assert bob.unpin(token_ids=long[: 2 * PAGE]) == 2 * PAGE
