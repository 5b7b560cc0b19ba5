"""worker/engine/row_check.py: the worker checks at start-up that a token's logits do not depend on its step, and a
worker whose rows differ turns speculation off and says so (log, GetModelInfo, /metrics) instead of silently serving
batch-dependent answers (issue 36)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from engine_fixtures import tiny_model

from radixcache.worker.cli import default_model_path
from radixcache.worker.engine.config import EngineConfig
from radixcache.worker.engine.engine import Engine
from radixcache.worker.engine.request import Request, RequestOutput, SamplingParams
from radixcache.worker.metrics import flatten_stats
from radixcache.worker.model.loader import load_checkpoint
from radixcache.worker.server import describe


class StepDependentModel(torch.nn.Module):
    """The model, plus a last-bit change to every logit that grows with the step's token count: what a GEMM kernel
    that sums in another order for another row count does to a row."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids, layout, pool, backend, **kw):  # noqa: ANN001, ANN003, ANN201
        logits = self.inner(ids, layout, pool, backend, **kw)
        return logits + 1e-3 * ids.shape[0]


def started(loaded, speculate: int = 4) -> Engine:
    engine = Engine(loaded, EngineConfig(speculate=speculate, kv_pages=64, page_size=16))
    engine.start()
    return engine


def test_the_default_models_rows_pass_the_check_and_speculation_stays_on():
    engine = started(load_checkpoint(default_model_path()))
    try:
        check = engine.row_check
        assert check.checked and check.exact, check.detail
        assert "prefill chunk" in check.detail
        assert engine.speculator is not None and engine.scheduler.propose is not None
        facts = describe(engine)
        assert facts.rows_exact and facts.speculate == 4
        assert flatten_stats(engine.stats())["rows_exact"] == 1.0
    finally:
        engine.shutdown()


def test_a_worker_whose_rows_depend_on_the_step_turns_speculation_off_and_says_why(caplog):
    loaded = tiny_model()
    loaded.model = StepDependentModel(loaded.model)
    with caplog.at_level(logging.WARNING, logger="radixcache.engine"):
        engine = started(loaded)
    try:
        check = engine.row_check
        assert check.checked and not check.exact
        assert "differ" in check.detail and "decode alone" in check.detail
        assert engine.speculator is None and engine.scheduler.propose is None
        facts = describe(engine)
        assert not facts.rows_exact and facts.speculate == 0 and facts.row_check == check.detail
        assert flatten_stats(engine.stats())["rows_exact"] == 0.0
        lines = [r.getMessage() for r in caplog.records if "row check failed" in r.getMessage()]
        assert len(lines) == 1 and "speculation turned off" in lines[0]
        done = threading.Event()
        tokens: list[int] = []

        def sink(out: RequestOutput) -> None:
            tokens.extend(out.token_ids)
            if out.finish_reason is not None:
                done.set()

        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.submit(Request("r", list(range(5, 25)), params), sink)
        assert done.wait(30) and len(tokens) == 4  # it still serves, without drafts
    finally:
        engine.shutdown()


@pytest.mark.parametrize("pages", [1, 3])
def test_a_pool_too_small_for_the_check_is_said_to_be_unchecked(pages):
    loaded = tiny_model()
    engine = Engine(loaded, EngineConfig(kv_pages=pages, page_size=4))
    engine.start()
    try:
        assert not engine.row_check.checked and engine.row_check.exact
        assert "not run" in engine.row_check.detail
    finally:
        engine.shutdown()
