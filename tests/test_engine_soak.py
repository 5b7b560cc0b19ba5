"""A bounded random soak of the in-process engine: arrivals, aborts, pins, flushes and memory pressure at once.

Whatever happens, every request gets exactly one final output, greedy answers match the request run alone, and
the cache ends with no live lease and no page held.
"""

from __future__ import annotations

import contextlib
import random

from engine_fixtures import tiny_model
from test_engine import Collector, run_alone

from radixcache.cache import PinBudgetError
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import FinishReason, Request, SamplingParams


def test_random_traffic_with_aborts_pins_and_flushes_leaks_nothing():
    model = tiny_model()
    rng = random.Random(2026)
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    engine = Engine(model, EngineConfig(page_size=4, kv_pages=40, max_step_tokens=64, max_running=12))
    sink = Collector()
    submitted: dict[str, tuple[list[int], SamplingParams]] = {}
    for _ in range(400):
        if len(submitted) < 60 and rng.random() < 0.7:
            rid = f"r{len(submitted)}"
            prompt = rng.choice(prefixes) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]
            greedy = rng.random() < 0.5
            params = SamplingParams(
                max_tokens=rng.randrange(1, 48),
                temperature=0.0 if greedy else 0.8,
                top_k=-1 if greedy else 40,
                seed=None if greedy else rng.randrange(1000),
                ignore_eos=True,
            )
            engine.submit(Request(rid, prompt, params, namespace=rng.choice(["", "tenant-b"])), sink)
            submitted[rid] = (prompt, params)
        roll = rng.random()
        if roll < 0.06 and submitted:
            engine.abort(rng.choice(list(submitted)))
        elif roll < 0.08:
            with contextlib.suppress(PinBudgetError):  # over the budget, or pages a request was promised: refused
                engine.pin(rng.choice(prefixes), rng.choice(["", "tenant-b"]), ttl_s=rng.choice([None, 0.01]))
        elif roll < 0.09:
            engine.flush_cache(rng.choice([None, "", "tenant-b"]))
        elif roll < 0.10:
            engine.unpin(rng.choice(prefixes), rng.choice(["", "tenant-b"]))
        engine.step()
    engine.run_until_idle()

    finished = {rid: [o for o in sink.outputs[rid] if o.finished] for rid in submitted}
    assert all(len(outs) == 1 for outs in finished.values()), "every request ends exactly once"
    reasons = {outs[0].finish_reason for outs in finished.values()}
    assert FinishReason.ABORTED in reasons and FinishReason.LENGTH in reasons
    assert engine.stats().preemptions > 0, "the pool was meant to be too small"
    checked = 0
    for rid, (prompt, params) in submitted.items():
        last = finished[rid][0]
        assert last.completion_tokens <= params.max_tokens
        if params.greedy and last.finish_reason is FinishReason.LENGTH and checked < 6:
            assert sink.tokens(rid) == run_alone(model, prompt, params)
            checked += 1
    assert checked > 0
    for ns in ("", "tenant-b"):
        for prefix in prefixes:
            engine.unpin(prefix, ns)
    engine.cache.check(idle=True)
    stats = engine.cache.stats()
    assert stats.live_leases == 0 and stats.pages_in_use == 0
