"""What worker/grpc/servicer.py promises a gRPC client, field by field and status by status (issue 16: each of these
tests kills mutants that test_server_fake.py let survive; see docs/MUTATION.md).

A ScriptedEngine (FakeEngine plus exact replies and refusals) sits behind a real server on 127.0.0.1, so every
assertion is about what crosses the wire: each GenerateResponse field, the status code *and* the message of every
refusal (a client shows or logs it), which namespace and TTL a pin reaches the engine with, the shutdown and loading
answers of every RPC.
"""

from __future__ import annotations

import logging
import re
import threading

import grpc
import pytest
from fake_engine import BOS, FAILS_AFTER_ONE_TOKEN, NO_CAPACITY, OFFSET, SLOW_PREFILL, FakeEngine
from worker_harness import RPC_CALLS, ThreadedWorker, wait_until

from radixcache.cache import PinBudgetError, PrefixCache
from radixcache.events import page_hashes
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc
from radixcache.worker.engine.api import DuplicateRequestError, RequestTooLargeError
from radixcache.worker.engine.request import (
    Constraint,
    ErrorKind,
    FinishReason,
    RequestOutput,
    TokenLogprob,
)
from radixcache.worker.engine.structured import ConstraintError
from radixcache.worker.grpc.servicer import RadixCacheServicer

pytestmark = pytest.mark.timeout(60)

TOKENS = {"tok-alice": "alice", "tok-bob": "bob", "tok-ops": "ops"}
ALICE, BOB, OPS = ((("authorization", f"Bearer {t}"),) for t in ("tok-alice", "tok-bob", "tok-ops"))


def ids_of(text: str) -> list[int]:
    """What FakeEngine's byte tokenizer makes of a text prompt."""
    return [BOS, *(b + OFFSET for b in text.encode())]


class ScriptedEngine(FakeEngine):
    """FakeEngine, plus:
    - replies[prompt text]: exactly these RequestOutputs (request_id filled in), sent from a thread like the engine's;
    - refusals[prompt text]: submit raises this exception (nothing is queued);
    - compile_constraint records each constraint; a regex "(" does not compile (ConstraintError);
    - pin pins the whole pages of the longest cached prefix (as the real engine does: partly cached prompts pin
      partly) and records (namespace, tokens, ttl) of every call; over_budget[prompt text]: pin raises
      PinBudgetError;
    - stats report `hits` = (queried, hit) tokens, `drafts` = (draft, accepted draft tokens, draft steps) and
      `store_figures` (the fleet's store's figures by name: store_hit_tokens on the engine's stats, the rest on the cache's).
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replies: dict[str, list[RequestOutput]] = {}
        self.refusals: dict[str, Exception] = {}
        self.compiled: list[Constraint] = []
        self.pin_calls: list[tuple[str, int, float | None]] = []
        self.over_budget: dict[str, str] = {}
        self.hits = (0, 0)
        self.drafts = (0, 0, 0)
        self.store_figures: dict[str, int] = {}

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def submit(self, request, on_output) -> None:
        text = self._text(request.prompt_ids)
        if text in self.refusals:
            raise self.refusals[text]
        if text not in self.replies:
            return super().submit(request, on_output)
        self.submitted.append(request)
        outs = [RequestOutput(**{**vars(o), "request_id": request.request_id}) for o in self.replies[text]]
        threading.Thread(target=lambda: [on_output(o) for o in outs], daemon=True).start()

    def compile_constraint(self, constraint: Constraint) -> None:
        self.compiled.append(constraint)
        if constraint.text == "(":
            raise ConstraintError("regex: unclosed group at position 1")

    def pin(self, token_ids, namespace="", ttl_s=None) -> int:
        self.pin_calls.append((namespace, len(token_ids), ttl_s))
        text = self._text(token_ids)
        if text in self.over_budget:
            raise PinBudgetError(self.over_budget[text])
        with self._lock:
            pinned = self._cached_length(token_ids, namespace) // self.page_size * self.page_size
            if pinned:
                self.pins[(namespace, tuple(token_ids))] = ttl_s
            return pinned

    def stats(self, namespace=None):
        s = super().stats(namespace)
        s.cache.queried_tokens, s.cache.hit_tokens = self.hits
        s.draft_tokens, s.accepted_draft_tokens, s.draft_steps = self.drafts
        for name, value in self.store_figures.items():
            setattr(s if name == "store_hit_tokens" else s.cache, name, value)
        return s


class CachingEngine(ScriptedEngine):
    """A ScriptedEngine with a real PrefixCache and `call`: the server gives it a CacheEventHub (cache events)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cache = PrefixCache(64, self.page_size)
        self.cache_lock = threading.Lock()

    def call(self, fn):
        with self.cache_lock:
            return fn()

    def store(self, owner: str, tokens: list[int]) -> None:
        """Cache `tokens` as a finished request would."""
        with self.cache_lock:
            lease = self.cache.acquire(owner, tokens, max_cached=0)
            self.cache.allocate(lease, -(-len(tokens) // self.page_size))
            self.cache.release(lease, tokens)


@pytest.fixture
def worker():
    with ThreadedWorker(ScriptedEngine()) as w:
        yield w


@pytest.fixture
def tenants():
    with ThreadedWorker(ScriptedEngine(), auth_tokens=TOKENS, admin_tokens={"tok-ops"}) as w:
        yield w


def stub_of(w: ThreadedWorker) -> pb_grpc.RadixCacheStub:
    return pb_grpc.RadixCacheStub(grpc.insecure_channel(w.target))


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def out(tokens: list[int], completion: int, *, index: int = 0, reason=None, logprobs=(), **kw) -> RequestOutput:
    return RequestOutput(
        request_id="",
        token_ids=tokens,
        text=bytes(t - OFFSET for t in tokens).decode(),
        prompt_tokens=7,
        cached_tokens=4,
        completion_tokens=completion,
        logprobs=list(logprobs),
        finish_reason=reason,
        index=index,
        **kw,
    )


# ---- GenerateResponse over the wire --------------------------------------------------------------------------------
def test_every_response_field_reaches_the_client(worker):
    """Four samples (n=4) ending with each finish reason; tokens, text, counts, index, logprobs and their top
    alternatives arrive exactly as the engine produced them, under the caller's request_id."""
    a, b, c = (ord(x) + OFFSET for x in "abc")
    lp = [TokenLogprob(a, -0.25, [(a, -0.25), (b, -1.5)]), TokenLogprob(b, -2.0, [(b, -2.0), (c, -3.5)])]
    worker.engine.replies["six"] = [
        out([a, b], 2, logprobs=lp, draft_tokens=3, accepted_draft_tokens=1),
        out([c], 1, index=1, reason=FinishReason.STOP_TOKEN, logprobs=[TokenLogprob(c, -0.5, [(c, -0.5)])]),
        out([c], 3, reason=FinishReason.STOP_STRING, logprobs=[TokenLogprob(c, -0.75, [(c, -0.75)])]),
        out([], 0, index=2, reason=FinishReason.ABORTED),
        out([a], 1, index=3, reason=FinishReason.LENGTH, logprobs=[TokenLogprob(a, -1.0, [(a, -1.0)])]),
    ]
    req = pb.GenerateRequest(text="six", request_id="mine", n=4, logprobs=True, top_logprobs=2)
    got = list(stub_of(worker).Generate(req, timeout=10))

    def message(o: RequestOutput, reason: int) -> pb.GenerateResponse:
        return pb.GenerateResponse(
            request_id="mine",
            token_ids=o.token_ids,
            text=o.text,
            prompt_tokens=7,
            cached_tokens=4,
            completion_tokens=o.completion_tokens,
            finish_reason=reason,
            index=o.index,
            draft_tokens=o.draft_tokens,
            accepted_draft_tokens=o.accepted_draft_tokens,
            logprobs=[
                pb.TokenLogprob(
                    token_id=x.token_id, logprob=x.logprob, top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in x.top]
                )
                for x in o.logprobs
            ],
        )

    reasons = [
        pb.FINISH_REASON_UNSPECIFIED,
        pb.FINISH_REASON_STOP_TOKEN,
        pb.FINISH_REASON_STOP_STRING,
        pb.FINISH_REASON_ABORTED,
        pb.FINISH_REASON_LENGTH,
    ]
    assert got == [message(o, r) for o, r in zip(worker.engine.replies["six"], reasons, strict=True)]
    assert got[0].logprobs[0].top[1].token_id == b and got[0].logprobs[0].top[1].logprob == -1.5  # spelled out
    assert [m.index for m in got] == [0, 1, 0, 2, 3] and list(got[0].token_ids) == [a, b]
    assert (got[0].draft_tokens, got[0].accepted_draft_tokens) == (3, 1)  # speculation's counts, spelled out


def test_a_request_opts_out_of_speculation_on_the_wire(worker):
    stub = stub_of(worker)
    list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2), timeout=10))
    list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2, speculate=False), timeout=10))
    assert [r.sampling.speculate for r in worker.engine.submitted] == [True, False]


@pytest.mark.parametrize(
    "kind,code",
    [
        (ErrorKind.INTERNAL, grpc.StatusCode.INTERNAL),
        (ErrorKind.NO_CAPACITY, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ErrorKind.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
        (None, grpc.StatusCode.INTERNAL),
    ],
)
def test_a_failed_request_ends_with_its_kind_of_status_after_its_tokens(worker, kind, code):
    a = ord("a") + OFFSET
    worker.engine.replies["fail"] = [
        out([a], 1),
        out([], 1, reason=FinishReason.ERROR, error="the replica went away", error_kind=kind),
    ]
    received: list[pb.GenerateResponse] = []
    e = refusal(lambda: received.extend(stub_of(worker).Generate(pb.GenerateRequest(text="fail", request_id="f1"))))
    assert e.code() == code and e.details() == "request 'f1' failed: the replica went away"
    assert [list(m.token_ids) for m in received] == [[a]]  # what came before the failure was delivered


# ---- refusals -----------------------------------------------------------------------------------------------------
REFUSALS = [
    (ValueError("stop_token_ids[0] = 7 is reserved"), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids[0] = 7 is reserved"),
    (
        RuntimeError("the engine is shutting down"),
        grpc.StatusCode.UNAVAILABLE,
        "the worker is not accepting requests: the engine is shutting down",
    ),
    (
        DuplicateRequestError("duplicate request id 'tenant/r'"),  # e.g. retried while the cancelled run winds down
        grpc.StatusCode.ALREADY_EXISTS,
        "request_id 'r' is already running",  # the caller's id, never the engine's (which names the tenant)
    ),
    (RequestTooLargeError("40 tokens can never fit in 8 pages"), grpc.StatusCode.RESOURCE_EXHAUSTED, "40 tokens can never fit in 8 pages"),
]  # fmt: skip


@pytest.mark.parametrize("error,code,details", REFUSALS, ids=[type(r[0]).__name__ for r in REFUSALS])
def test_engine_refusals_at_submit_become_their_status_and_free_the_request_id(worker, error, code, details):
    worker.engine.refusals["refused"] = error
    stub = stub_of(worker)
    e = refusal(lambda: list(stub.Generate(pb.GenerateRequest(text="refused", request_id="r"), timeout=10)))
    assert (e.code(), e.details()) == (code, details)
    # the id is not left marked as running: the same id serves the next request
    done = list(stub.Generate(pb.GenerateRequest(text="fine", request_id="r", max_tokens=2), timeout=10))
    assert done[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_request_id_is_busy_while_running_and_free_once_finished(worker):
    stub = stub_of(worker)
    for _ in range(2):  # the second run reuses the id of the first, which has finished
        done = list(stub.Generate(pb.GenerateRequest(text="hi", request_id="again", max_tokens=2), timeout=10))
        assert done[-1].finish_reason == pb.FINISH_REASON_LENGTH
    running = stub.Generate(pb.GenerateRequest(text="long", request_id="busy", max_tokens=400))
    next(running)
    e = refusal(lambda: next(stub.Generate(pb.GenerateRequest(text="x", request_id="busy"), timeout=10)))
    assert (e.code(), e.details()) == (grpc.StatusCode.ALREADY_EXISTS, "request_id 'busy' is already running")
    running.cancel()


def test_a_constraint_is_compiled_off_the_loop_and_reaches_the_engine(worker):
    stub = stub_of(worker)
    list(stub.Generate(pb.GenerateRequest(text="json please", regex="[a-z]+", max_tokens=2), timeout=10))
    wanted = Constraint("regex", "[a-z]+")
    assert worker.engine.compiled == [wanted] and worker.engine.submitted[-1].constraint == wanted
    list(stub.Generate(pb.GenerateRequest(text="free text", max_tokens=2), timeout=10))
    assert worker.engine.submitted[-1].constraint is None and len(worker.engine.compiled) == 1
    e = refusal(lambda: list(stub.Generate(pb.GenerateRequest(text="x", regex="("), timeout=10)))
    assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "regex: unclosed group at position 1")
    assert len(worker.engine.submitted) == 2  # refused before anything reached the engine


# ---- prompts that fill the context: Tokenize reports them, Generate and PinPrefix refuse them ---------------------
def test_tokenize_reports_any_length_and_the_rendered_prompt(worker):
    stub = stub_of(worker)
    full = "x" * 511  # 512 tokens with BOS: the whole context, no room left to generate
    assert len(stub.Tokenize(pb.TokenizeRequest(text=full), timeout=10).token_ids) == 512
    chat = pb.TokenizeRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    resp = stub.Tokenize(chat, timeout=10)
    assert resp.prompt == "\x01<user>hi</s><assistant>" and list(resp.token_ids) == ids_of(resp.prompt)[1:]
    assert stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10).prompt == "hi"
    too_long = "the prompt has 512 tokens; the context allows at most 511 (context length 512, leaving room for one"
    e = refusal(lambda: list(stub.Generate(pb.GenerateRequest(text=full), timeout=10)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(too_long)
    e = refusal(lambda: stub.PinPrefix(pb.PinPrefixRequest(text=full), timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(too_long)
    assert worker.engine.submitted == [] and worker.engine.pin_calls == []


# ---- pins -----------------------------------------------------------------------------------------------------------
def test_pin_computes_pins_and_unpins_in_the_callers_namespace_with_its_ttl(tenants):
    stub, engine = stub_of(tenants), tenants.engine
    prompt = "a system prompt"  # 16 tokens: four whole pages
    resp = stub.PinPrefix(pb.PinPrefixRequest(text=prompt, ttl_seconds=60), metadata=ALICE, timeout=10)
    assert (resp.pinned_tokens, resp.prompt_tokens) == (16, 16)
    [warm] = engine.submitted  # not cached yet: computed first, in alice's namespace, under an id naming her
    assert warm.namespace == "alice" and warm.sampling.max_tokens == 1 and warm.prompt_ids == ids_of(prompt)
    assert re.fullmatch(r"alice/pin-[0-9a-f]{32}", warm.request_id), warm.request_id
    assert engine.pin_calls == [("alice", 16, 60.0), ("alice", 16, 60.0)]  # before and after computing it
    resp = stub.PinPrefix(pb.PinPrefixRequest(text=prompt, ttl_seconds=5), metadata=ALICE, timeout=10)
    assert (resp.pinned_tokens, resp.prompt_tokens) == (16, 16) and len(engine.submitted) == 1  # cached: no compute
    assert engine.pins == {("alice", tuple(ids_of(prompt))): 5.0}  # the new TTL replaced the old
    stub.PinPrefix(pb.PinPrefixRequest(text=prompt), metadata=ALICE, timeout=10)
    assert engine.pin_calls[-1] == ("alice", 16, None)  # no ttl_seconds: pinned until unpinned
    unpin = pb.UnpinPrefixRequest(text=prompt)
    assert stub.UnpinPrefix(unpin, metadata=BOB, timeout=10).unpinned_tokens == 0  # not bob's pin
    assert stub.UnpinPrefix(unpin, metadata=ALICE, timeout=10).unpinned_tokens == 16
    assert engine.pins == {}


def test_pin_of_a_partly_cached_prefix_computes_the_rest_once(worker):
    stub, engine = stub_of(worker), worker.engine
    list(stub.Generate(pb.GenerateRequest(text="a system prompt", max_tokens=1), timeout=10))  # 16 tokens cached
    longer = "a system prompt, then more"  # 27 tokens: six whole pages, of which four are cached
    resp = stub.PinPrefix(pb.PinPrefixRequest(text=longer), timeout=10)
    assert (resp.pinned_tokens, resp.prompt_tokens) == (24, 27)
    assert len(engine.submitted) == 2 and engine.submitted[-1].prompt_ids == ids_of(longer)  # the rest computed
    assert [n for _, n, _ in engine.pin_calls] == [27, 27]  # pinned what was cached, then the whole pages
    # all of its whole pages are cached now: pinning it again computes nothing (a trailing partial page never pins)
    assert stub.PinPrefix(pb.PinPrefixRequest(text=longer), timeout=10).pinned_tokens == 24
    assert len(engine.submitted) == 2


def test_pin_refusals_carry_their_status_and_reason():
    engine = ScriptedEngine(num_pages=8, page_size=4)  # 32 tokens of KV
    with ThreadedWorker(engine) as w:
        stub = stub_of(w)
        engine.over_budget["budget"] = "pinning 1 page would exceed the pin budget of 0 pages"
        e = refusal(lambda: stub.PinPrefix(pb.PinPrefixRequest(text="budget"), timeout=10))
        assert (e.code(), e.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "pinning 1 page would exceed the pin budget of 0 pages",
        )
        e = refusal(lambda: stub.PinPrefix(pb.PinPrefixRequest(text="y" * 40), timeout=10))  # computing it cannot fit
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details() == (
            "prompt + max_tokens = 42 tokens need 11 KV pages; this worker has 8 pages of 4 tokens"
        )
        e = refusal(
            lambda: stub.PinPrefix(pb.PinPrefixRequest(text=f"{FAILS_AFTER_ONE_TOKEN} prefix"), timeout=10)
        )  # computing fails
        assert (e.code(), e.details()) == (grpc.StatusCode.INTERNAL, "computing the prefix failed: injected failure")
        e = refusal(lambda: stub.PinPrefix(pb.PinPrefixRequest(text=f"{NO_CAPACITY} prefix"), timeout=10))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.details() == "computing the prefix failed: the KV cache cannot hold this request"
        assert engine.pins == {}
        assert stub.PinPrefix(pb.PinPrefixRequest(text="fits"), timeout=10).pinned_tokens == 4  # still serving


# ---- stats ----------------------------------------------------------------------------------------------------------
def test_cache_stats_hit_rate_is_the_fraction_of_queried_tokens(worker):
    worker.engine.hits = (8, 2)
    worker.engine.drafts = (10, 7, 3)
    stats = stub_of(worker).GetCacheStats(pb.GetCacheStatsRequest(), timeout=10)
    assert stats.hit_rate == 0.25 and (stats.queried_tokens, stats.hit_tokens, stats.pages_total) == (8, 2, 256)
    assert (stats.draft_tokens, stats.accepted_draft_tokens, stats.draft_steps) == (10, 7, 3)


STORE_FIGURES = (
    "store_hit_tokens",
    "store_pages",
    "store_loaded_pages",
    "store_queued_pages",
    "store_written_pages",
    "store_skipped_pages",
    "store_dropped_pages",
    "store_corrupt_pages",
    "store_unavailable_errors",
)


def test_cache_stats_report_the_fleets_store_by_name_to_the_client(worker):
    from radixcache.client import Client

    worker.engine.hits = (100, 60)
    worker.engine.store_figures = {name: 11 + i for i, name in enumerate(STORE_FIGURES)} | {"store_ready": 1}
    with Client(worker.target) as client:
        stats = client.stats()  # what `radixcache stats` prints, by name
    assert {name: stats[name] for name in STORE_FIGURES} == {name: 11 + i for i, name in enumerate(STORE_FIGURES)}
    assert stats["store_ready"] is True and stats["hit_tokens"] == 60
    worker.engine.store_figures = {}
    assert not stub_of(worker).GetCacheStats(pb.GetCacheStatsRequest(), timeout=10).store_ready  # without a store


# ---- authentication, loading and shutdown: every RPC ----------------------------------------------------------------
RPCS = {
    **RPC_CALLS,
    "SubscribeCacheEvents": lambda s, md: next(
        iter(s.SubscribeCacheEvents(pb.SubscribeCacheEventsRequest(), metadata=md, timeout=10))
    ),
}


def statuses(w: ThreadedWorker, metadata=None) -> dict[str, tuple[grpc.StatusCode, str]]:
    """RPC name -> (status, details) of calling each RPC of RPCS (each must fail)."""
    stub = stub_of(w)
    found = {}
    for name, call in RPCS.items():
        e = refusal(lambda call=call: call(stub, metadata))
        found[name] = (e.code(), e.details())
    return found


def test_every_rpc_refuses_a_missing_or_unknown_token(tenants):
    for metadata in (None, (("authorization", "Bearer nope"),), (("authorization", "tok-alice"),)):
        expected = (grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        assert statuses(tenants, metadata) == dict.fromkeys(RPCS, expected)
    engine = tenants.engine
    assert (engine.submitted, engine.flushed, engine.pin_calls, engine.pins) == ([], [], [], {})


def test_every_rpc_is_unavailable_while_the_model_loads():
    w = ThreadedWorker(ScriptedEngine()).start(attach=False)
    try:
        loading = (grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        assert statuses(w) == dict.fromkeys(RPCS, loading)
    finally:
        w.stop()


def test_every_rpc_is_unavailable_while_the_worker_drains():
    engine = ScriptedEngine()
    engine.slow_prefill = 60.0
    w = ThreadedWorker(engine).start()
    try:
        busy = stub_of(w).Generate(pb.GenerateRequest(text=SLOW_PREFILL, max_tokens=2, request_id="busy"))
        assert wait_until(lambda: engine.stats().running == 1)
        stopper = threading.Thread(target=lambda: w.run(w.server.stop(30), timeout=40))
        stopper.start()
        assert wait_until(lambda: w.server.core.draining)
        shutting_down = (grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        assert statuses(w) == dict.fromkeys(RPCS, shutting_down)
        busy.cancel()  # the in-flight request is aborted: the drain ends
        stopper.join(40)
        assert not stopper.is_alive() and engine.finished["busy"] is FinishReason.ABORTED
        assert len(engine.submitted) == 1
    finally:
        w.stop()


# ---- cache events --------------------------------------------------------------------------------------------------
def test_cache_events_need_an_engine_that_reports_them_and_an_admin_token(worker, tenants):
    e = refusal(lambda: RPCS["SubscribeCacheEvents"](stub_of(worker), None))  # no auth: everyone is admin
    assert (e.code(), e.details()) == (grpc.StatusCode.UNIMPLEMENTED, "this worker's engine reports no cache events")
    e = refusal(lambda: RPCS["SubscribeCacheEvents"](stub_of(tenants), ALICE))
    assert (e.code(), e.details()) == (grpc.StatusCode.PERMISSION_DENIED, "cache events need a token marked admin")


def test_cache_events_snapshot_then_unavailable_when_the_worker_stops():
    engine = CachingEngine()
    tokens = list(range(10, 22))  # three whole pages
    engine.store("earlier", tokens)
    w = ThreadedWorker(engine, auth_tokens=TOKENS, admin_tokens={"tok-ops"}).start()
    try:
        stream = stub_of(w).SubscribeCacheEvents(pb.SubscribeCacheEventsRequest(), metadata=OPS, timeout=20)
        snapshot = next(stream)
        assert snapshot.kind == pb.CACHE_EVENT_BATCH_KIND_SNAPSHOT and snapshot.snapshot_complete
        assert snapshot.page_size == 4
        assert [list(e.stored.page_hashes) for e in snapshot.events] == [page_hashes(tokens, 4)]
        w.run(w.server.stop(5), timeout=20)
        e = refusal(lambda: list(stream))
        assert (e.code(), e.details()) == (grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
    finally:
        w.stop()


# ---- the deadline ----------------------------------------------------------------------------------------------------
def test_a_deadline_that_runs_out_aborts_the_request_and_logs_nothing(caplog):
    """The handler watches the deadline itself and ends the call quietly: no error and no traceback per call in the
    worker's log (an operator's log must not fill up because clients set short deadlines)."""
    engine = ScriptedEngine()
    engine.slow_prefill = 60.0
    with ThreadedWorker(engine) as w:
        stub = stub_of(w)
        for i in range(3):
            request = pb.GenerateRequest(text=SLOW_PREFILL, max_tokens=2, request_id=f"late-{i}")
            e = refusal(lambda request=request: list(stub.Generate(request, timeout=0.2)))
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert wait_until(lambda i=i: engine.finished.get(f"late-{i}") is FinishReason.ABORTED, 10)
    logged = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert logged == []


class EndingContext:
    """The part of grpc.aio.ServicerContext that _deadline_exceeded uses."""

    def __init__(self, done: bool, fails_with: BaseException) -> None:
        self._done = done
        self.fails_with = fails_with
        self.aborts: list[tuple[grpc.StatusCode, str]] = []

    def done(self) -> bool:
        return self._done

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborts.append((code, details))
        raise self.fails_with


def test_a_deadline_ends_the_call_with_deadline_exceeded_once():
    """The server's own answer when a Generate deadline runs out (a client whose deadline gRPC propagated usually
    reports its own first, so this is checked on the handler's helper directly)."""
    import asyncio

    ended = EndingContext(done=False, fails_with=grpc.aio.AbortError())
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(RadixCacheServicer._deadline_exceeded(ended))
    assert ended.aborts == [(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")]
    already = EndingContext(done=True, fails_with=grpc.aio.AbortError())  # gRPC ended it at the same deadline
    asyncio.run(RadixCacheServicer._deadline_exceeded(already))
    assert already.aborts == []  # a second status is never sent
    gone = EndingContext(done=False, fails_with=RuntimeError("the call is over"))  # ended between check and send
    asyncio.run(RadixCacheServicer._deadline_exceeded(gone))
    assert len(gone.aborts) == 1
