"""Promises the proto and the README make, checked over the wire against the real engine and cache.

One in-process worker (the `--random-model` model and tokenizer, the real Engine and PrefixCache, the real gRPC
server on a loopback port) with two tenants. Every test uses its own prompts and measures against what it saw
before it started, so the tests do not depend on each other's order.

Where a test must show that something stopped a request early (cancel, deadline), the engine is slowed with
`pace.slow(...)` so that the request could not finish by itself within the bounded wait: the assertion is "freed
and stopped", and the wait is only the bound that a broken build runs into.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from worker_harness import RPC_CALLS, ThreadedWorker, wait_until

from radixcache.client import Client
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc
from radixcache.worker.cli import load_model, parser
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, RequestOutput, SamplingParams

pytestmark = pytest.mark.timeout(120)

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
PAGE = 16
CONTEXT = 2048  # the --random-model context length
FREED_WITHIN = 15.0  # s: the bound on "the engine let the request go"; a slowed request needs >= 30 s to finish


class Pace:
    """Slows every engine step by `delay` seconds (0: full speed), so a long request outlives the RPC."""

    def __init__(self, engine: Engine) -> None:
        self.delay = 0.0
        forward = engine.runner.forward

        def paced(chunks: Any) -> Any:
            if self.delay:
                time.sleep(self.delay)
            return forward(chunks)

        engine.runner.forward = paced  # type: ignore[method-assign]

    @contextlib.contextmanager
    def slow(self, delay: float) -> Iterator[None]:
        self.delay = delay
        try:
            yield
        finally:
            self.delay = 0.0


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ThreadedWorker, Pace]]:
    loaded, _, _ = load_model(parser().parse_args(["--random-model", "--device", "cpu"]))
    engine = Engine(loaded, EngineConfig(page_size=PAGE, kv_pages=256, max_step_tokens=64))
    pace = Pace(engine)
    worker = ThreadedWorker(engine, auth_tokens=TOKENS).start()
    try:
        yield worker, pace
    finally:
        worker.stop()


@pytest.fixture
def worker(served: tuple[ThreadedWorker, Pace]) -> Iterator[ThreadedWorker]:
    w, _ = served
    yield w
    assert wait_idle(w.engine), w.engine.stats()  # every test leaves no request, lease or page behind
    w.engine.call(lambda: w.engine.cache.check(idle=True))


@pytest.fixture
def pace(served: tuple[ThreadedWorker, Pace]) -> Pace:
    return served[1]


@pytest.fixture
def alice(worker: ThreadedWorker) -> Iterator[Client]:
    with Client(worker.target, token="tok-alice") as c:
        yield c


@pytest.fixture
def bob(worker: ThreadedWorker) -> Iterator[Client]:
    with Client(worker.target, token="tok-bob") as c:
        yield c


def idle(engine: Engine) -> bool:
    s = engine.stats()
    return s.running == 0 and s.waiting == 0 and s.cache.live_leases == 0 and s.cache.pages_in_use == 0


def wait_idle(engine: Engine, timeout: float = FREED_WITHIN) -> bool:
    return wait_until(lambda: idle(engine), timeout)


_salts = iter(range(1000, 10**6))


def fresh_ids(n: int) -> list[int]:
    """A prompt no other test sends (ids 3..182: printable characters of the --random-model tokenizer)."""
    salt = next(_salts)
    return [3 + (i * 7 + salt * 13 + (i * salt) % 11) % 180 for i in range(n)]


def in_engine(engine: Engine, prompt: list[int], **sampling: Any) -> list[RequestOutput]:
    """The outputs of one request submitted to the engine directly, not through the server."""
    outs: list[RequestOutput] = []
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        outs.append(out)
        if out.finish_reason is not None:
            done.set()

    engine.submit(Request(f"direct-{next(_salts)}", prompt, SamplingParams(**sampling), namespace="direct"), on_output)
    assert done.wait(60)
    return outs


# --- authentication ------------------------------------------------------------------------------------------------

RPCS = RPC_CALLS


@pytest.mark.parametrize("rpc", list(RPCS))
def test_every_rpc_refuses_a_missing_or_unknown_token(worker, rpc):
    stub = pb_grpc.RadixCacheStub(grpc.insecure_channel(worker.target))
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "tok-alice"),)):
        with pytest.raises(grpc.RpcError) as e:
            RPCS[rpc](stub, metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (rpc, metadata)
    RPCS[rpc](stub, (("authorization", "Bearer tok-alice"),))  # the same call with a known token is served


# --- tenants -------------------------------------------------------------------------------------------------------


def test_flush_cache_empties_only_the_callers_tenant(alice, bob):
    prompt = fresh_ids(5 * PAGE)
    for c in (alice, bob):
        c.generate_text(token_ids=prompt, max_tokens=1)
        assert c.generate_text(token_ids=prompt + [9], max_tokens=1).cached_tokens == 5 * PAGE
    assert bob.flush() >= 5  # bob's five pages, at least
    assert bob.generate_text(token_ids=prompt + [9], max_tokens=1).cached_tokens == 0
    assert alice.generate_text(token_ids=prompt + [9], max_tokens=1).cached_tokens == 5 * PAGE


def test_the_same_request_id_in_two_tenants_at_once(worker, pace, alice, bob):
    prompt = fresh_ids(20)
    with pace.slow(0.02):  # 200 steps: both still run when alice aborts
        a = alice.generate(token_ids=prompt, max_tokens=200, ignore_eos=True, request_id="job-7")
        b = bob.generate(token_ids=prompt, max_tokens=200, ignore_eos=True, request_id="job-7")
        first_a, first_b = next(a), next(b)  # both admitted and streaming: neither was refused as a duplicate
        assert worker.engine.stats().running == 2
        assert alice.abort("job-7") is True  # alice's job-7 only
        rest_a, rest_b = list(a), list(b)
    assert rest_a[-1].finish_reason == "aborted"
    assert rest_b[-1].finish_reason == "length" and rest_b[-1].completion_tokens == 200
    assert {c.request_id for c in [first_a, first_b, *rest_a, *rest_b]} == {"job-7"}


# --- cancellation and deadlines really stop the engine's work --------------------------------------------------------


def test_cancelling_a_stream_mid_decode_stops_the_request(worker, pace, alice):
    engine = worker.engine
    before = engine.stats().generated_tokens
    with pace.slow(0.02):  # 1500 tokens: >= 30 s if nothing stops it
        stream = alice.generate(token_ids=fresh_ids(40), max_tokens=1500, ignore_eos=True)
        got = [next(stream) for _ in range(3)]
        stream.close()  # cancels the call
        assert wait_idle(engine), engine.stats()  # pages and lease freed long before it could have finished
    assert got[-1].completion_tokens >= 3
    assert engine.stats().generated_tokens - before < 300  # and it stopped generating


def test_cancelling_a_stream_mid_prefill_stops_the_request(worker, pace):
    engine = worker.engine
    before = engine.stats().generated_tokens
    stub = pb_grpc.RadixCacheStub(grpc.insecure_channel(worker.target))
    req = pb.GenerateRequest(max_tokens=1000, ignore_eos=True)
    req.token_ids.ids.extend(fresh_ids(1000))  # 16 prefill steps of 64 tokens, then 1000 decodes: >= 30 s
    with pace.slow(0.03):
        call = stub.Generate(req, metadata=(("authorization", "Bearer tok-alice"),))
        assert wait_until(lambda: engine.stats().running == 1, FREED_WITHIN)
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert wait_idle(engine), engine.stats()
    assert engine.stats().generated_tokens - before < 100


def test_a_deadline_stops_the_request(worker, pace, alice):
    engine = worker.engine
    before = engine.stats().generated_tokens
    with pace.slow(0.02):
        with pytest.raises(grpc.RpcError) as e:
            alice.generate_text(token_ids=fresh_ids(40), max_tokens=1500, ignore_eos=True, timeout=1.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_idle(engine), engine.stats()
    assert engine.stats().generated_tokens - before < 750


# --- sampling options over the wire ---------------------------------------------------------------------------------


def test_logprobs_and_top_logprobs_reach_the_client(worker, alice):
    prompt = fresh_ids(30)
    chunks = list(alice.generate(token_ids=prompt, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3))
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert len(tokens) == 8 and [lp.token_id for lp in logprobs] == tokens
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0.0
        values = [p for _, p in lp.top]
        assert values == sorted(values, reverse=True) and math.fsum(math.exp(p) for p in values) <= 1.0 + 1e-5
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))  # greedy: the chosen token is the best
    # exactly what the engine computed (the wire carries float32)
    direct = [lp for out in in_engine(worker.engine, prompt, max_tokens=8, ignore_eos=True, logprobs=True,
                                      top_logprobs=3) for lp in out.logprobs]  # fmt: skip
    assert [lp.token_id for lp in direct] == tokens
    for got, want in zip(logprobs, direct, strict=True):
        assert got.logprob == pytest.approx(want.logprob, rel=1e-6, abs=1e-6)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [p for _, p in got.top] == pytest.approx([p for _, p in want.top], rel=1e-6, abs=1e-6)
    # and none unless asked for
    plain = list(alice.generate(token_ids=prompt, max_tokens=3, ignore_eos=True))
    assert all(c.logprobs == [] for c in plain)
    only_chosen = list(alice.generate(token_ids=prompt, max_tokens=3, ignore_eos=True, logprobs=True))
    assert all(len(lp.top) == 0 for c in only_chosen for lp in c.logprobs)
    assert sum(len(c.logprobs) for c in only_chosen) == 3


def test_a_seed_reproduces_a_sampled_completion(worker, alice):
    prompt = fresh_ids(20)
    kwargs = dict(token_ids=prompt, max_tokens=24, ignore_eos=True, temperature=1.5)
    first = alice.generate_text(seed=1234, **kwargs).token_ids
    assert alice.generate_text(seed=1234, **kwargs).token_ids == first
    direct = [t for out in in_engine(worker.engine, prompt, max_tokens=24, ignore_eos=True, temperature=1.5,
                                     seed=1234) for t in out.token_ids]  # fmt: skip
    assert direct == first
    others = {tuple(alice.generate_text(seed=s, **kwargs).token_ids) for s in (1, 2, 3)}
    assert len(others | {tuple(first)}) > 1  # the seed is what picks the sample


def _first_occurrence_pair(text: str) -> tuple[int, int]:
    """Two positions a < b where 3-character strings first occur in `text` (so the earliest match is known)."""
    starts = [i for i in range(2, len(text) - 3) if text.find(text[i : i + 3]) == i]
    early = next(i for i in starts)
    late = next(i for i in starts if i >= early + 6)
    return early, late


def test_several_stop_strings_stop_at_the_earliest_match_in_the_text(alice):
    prompt = fresh_ids(20)
    kwargs = dict(token_ids=prompt, max_tokens=60, ignore_eos=True, temperature=1.0, seed=99)
    full = alice.generate_text(**kwargs)
    text = full.text
    # Two stops completed by the same token (one character each with this tokenizer): "xyz" and its suffix "yz",
    # the suffix listed first. The earliest match in the text is "xyz"; the first listed would cut one later.
    at = next(
        i
        for i in range(2, len(text) - 3)
        if text.find(text[i : i + 3]) == i and text.find(text[i + 1 : i + 3]) == i + 1
    )
    stops = [text[at + 1 : at + 3], text[at : at + 3]]
    chunks = list(alice.generate(stop=stops, **kwargs))
    sent = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop_string"
    assert sent == text[:at]  # everything before the earliest stop, nothing from the stop on
    assert chunks[-1].completion_tokens < full.completion_tokens
    # and a stop string listed first but found later in the text does not win either
    early, late = _first_occurrence_pair(text)
    got = alice.generate_text(stop=[text[late : late + 3], text[early : early + 3]], **kwargs)
    assert (got.text, got.finish_reason) == (text[:early], "stop_string")


def test_a_single_stop_string_over_the_wire(alice):
    kwargs = dict(token_ids=fresh_ids(20), max_tokens=60, ignore_eos=True, temperature=1.0, seed=5)
    text = alice.generate_text(**kwargs).text
    early, _ = _first_occurrence_pair(text)
    got = alice.generate_text(stop=text[early : early + 3], **kwargs)
    assert (got.text, got.finish_reason) == (text[:early], "stop_string")


# --- pins ----------------------------------------------------------------------------------------------------------


def test_a_pin_with_a_ttl_expires_and_one_without_stays(worker, alice):
    def pinned() -> int:
        return int(alice.stats()["pages_pinned"])

    before = pinned()
    lasting, expiring = fresh_ids(4 * PAGE), fresh_ids(2 * PAGE)
    assert alice.pin(token_ids=lasting) == 4 * PAGE
    assert alice.pin(token_ids=expiring, ttl_seconds=2.0) == 2 * PAGE
    assert pinned() >= before + 4  # the TTL pin may already have lapsed on a slow machine; the other may not
    assert wait_until(lambda: pinned() == before + 4, timeout=30)  # the TTL pin lapsed, the other one stays
    assert alice.unpin(token_ids=lasting) == 4 * PAGE
    assert pinned() == before


# --- validation at its boundaries -----------------------------------------------------------------------------------


def test_validation_boundaries(worker, alice):
    vocab = alice.model_info()["vocab_size"]
    ok = alice.generate_text(token_ids=[5, 6], max_tokens=1, request_id="r" * 128)
    assert ok.request_id == "r" * 128
    bad = [
        (dict(token_ids=[5, 6], max_tokens=1, request_id="r" * 129), "request_id must have at most 128"),
        (dict(token_ids=[5, 6], max_tokens=1, stop_token_ids=[vocab]), f"stop_token_ids[0] = {vocab} is outside"),
    ]
    for kwargs, message in bad:
        with pytest.raises(grpc.RpcError) as e:
            alice.generate_text(**kwargs)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    assert alice.generate_text(token_ids=[5, 6], max_tokens=2, stop_token_ids=[vocab - 1]).completion_tokens >= 1
    assert alice.generate_text(token_ids=[0, 5], max_tokens=1, stop_token_ids=[0]).prompt_tokens == 2  # id 0 is valid
    tool = alice.generate_text(
        messages=[{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"}], max_tokens=2
    )
    assert tool.completion_tokens >= 1 and tool.prompt_tokens > 0
    empty = alice.generate_text(messages=[{"role": "user", "content": ""}], max_tokens=2)
    assert empty.completion_tokens >= 1
    assert alice.tokenize(messages=[{"role": "tool", "content": "x"}]) == alice.tokenize(
        text="<|tool|>\nx</s>\n<|assistant|>\n"
    )


def test_a_full_context_ends_with_length_before_max_tokens(alice):
    prompt = fresh_ids(CONTEXT - 5)
    done = alice.generate_text(token_ids=prompt, ignore_eos=True)  # max_tokens unset: what the context leaves
    assert (done.finish_reason, done.completion_tokens) == ("length", 5)
    exact = alice.generate_text(token_ids=prompt, ignore_eos=True, max_tokens=5)  # exactly the room left
    assert (exact.finish_reason, exact.completion_tokens) == ("length", 5)
    longest = alice.generate_text(token_ids=fresh_ids(CONTEXT - 1), ignore_eos=True)  # the longest prompt allowed
    assert (longest.finish_reason, longest.completion_tokens) == ("length", 1)
    with pytest.raises(grpc.RpcError) as e:  # set beyond the context: refused up front, not cut short
        alice.generate_text(token_ids=prompt, ignore_eos=True, max_tokens=6)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens must be in [1, 5]" in e.value.details()


def test_model_info_describes_the_engine(worker, alice):
    info = alice.model_info()
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["dtype"] == "float32" and info["device"] == "cpu" and info["cache_enabled"] is True
    assert (info["vocab_size"], info["context_length"], info["page_size"], info["kv_pages"]) == (
        194,
        CONTEXT,
        PAGE,
        256,
    )
    assert info["eos_token_ids"] == [1]
