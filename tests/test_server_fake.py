"""The gRPC server over real loopback sockets, against FakeEngine (server-only behaviour: validation, streaming,
cancellation, deadlines, auth, health, reflection, shutdown). The real engine is exercised in test_e2e_*."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import threading
import time
import urllib.request

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fake_engine import FAILS_AFTER_ONE_TOKEN, NO_CAPACITY, SLOW_PREFILL, FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from worker_harness import ThreadedWorker, wait_until

from radixcache.client import AsyncClient, Chat, Client
from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc
from radixcache.worker.engine.request import FinishReason

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def worker():
    w = ThreadedWorker(FakeEngine()).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture
def client(worker):
    with Client(worker.target) as c:
        yield c


def test_streaming_order_and_completeness(client, worker):
    chunks = list(client.generate("hello", max_tokens=10))
    assert len(chunks) == 10  # one message per engine step
    assert [c.completion_tokens for c in chunks] == list(range(1, 11))
    assert all(c.prompt_tokens == 6 for c in chunks)  # BOS + 5 bytes
    assert [c.finish_reason for c in chunks] == [None] * 9 + ["length"]
    assert "".join(c.text for c in chunks) == "abcdefghij"
    assert len({c.request_id for c in chunks}) == 1 and chunks[0].request_id
    done = client.generate_text("hello", max_tokens=3, request_id="mine")
    assert (done.text, done.request_id, done.completion_tokens) == ("abc", "mine", 3)
    # the default max_tokens is SamplingParams' (16)
    assert client.generate_text(token_ids=[5, 6, 7]).completion_tokens == 16


BAD = [
    (dict(), "no input"),
    (dict(text=""), "text must not be empty"),
    (dict(token_ids=[]), "token_ids.ids must hold"),
    (dict(token_ids=[5, 259]), "token_ids.ids[1] = 259 is outside the vocabulary [0, 259)"),
    (dict(token_ids=[5, -1]), "outside the vocabulary"),
    (dict(text="x", max_tokens=0), "max_tokens must be >= 1"),
    (dict(text="x", max_tokens=10_000), "max_tokens must be in [1, 510]"),
    (dict(text="x" * 500, max_tokens=12), "max_tokens must be in [1, 11]: the prompt has 501 tokens"),
    (dict(text="x" * 600), "the context allows at most 511"),
    (dict(text="x", temperature=-0.5), "temperature must be >= 0"),
    (dict(text="x", temperature=float("nan")), "temperature must be >= 0 and finite, got nan"),
    (dict(text="x", temperature=float("inf")), "temperature must be >= 0 and finite, got inf"),
    (dict(text="x", top_p=float("nan")), "top_p must be in (0, 1], got nan"),
    (dict(text="x", min_p=float("inf")), "min_p must be in [0, 1], got inf"),
    (dict(text="x" * 100_000), "the context allows at most 511 prompt tokens"),
    (dict(messages=[{"role": "user", "content": "x"}] * 600), "messages must hold at most 511 messages"),
    (dict(messages=[{"role": "user", "content": "x" * 600}]), "messages hold at least 600 bytes of content"),
    (dict(text="x", stop_token_ids=[5] * 257), "stop_token_ids allows at most 256"),
    (dict(text="x", top_p=0.0), "top_p must be in (0, 1]"),
    (dict(text="x", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(text="x", top_k=-2), "top_k must be -1 (off) or >= 1"),
    (dict(text="x", min_p=1.5), "min_p must be in [0, 1]"),
    (dict(text="x", min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role must be one of system, user"),
    (dict(messages=[]), "messages must hold at least one"),
    (dict(text="x", stop=["s"] * 17), "stop allows at most 16"),
    (dict(text="x", stop=["s" * 257]), "each stop string must have 1..256"),
    (dict(text="x", stop=[""]), "each stop string must have 1..256"),
    (dict(text="x", stop_token_ids=[999]), "stop_token_ids[0] = 999 is outside"),
    (dict(text="x", top_logprobs=21), "top_logprobs must be in [0, 20]"),
    (dict(text="x", request_id="r" * 129), "request_id must have at most 128"),
    (dict(text="x", cache_key="k" * 257), "cache_key must have at most 256"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_invalid_argument_and_the_worker_still_serves(worker, kwargs, message):
    kwargs = dict(kwargs)  # popped below: leave the shared parameter intact for a rerun in the same process
    stub = pb_grpc.RadixCacheStub(grpc.insecure_channel(worker.target))
    req = pb.GenerateRequest(request_id=kwargs.pop("request_id", ""))
    if "text" in kwargs:
        req.text = kwargs.pop("text")
    if "token_ids" in kwargs:
        req.token_ids.ids.extend(kwargs.pop("token_ids"))
    if "messages" in kwargs:
        msgs = kwargs.pop("messages")
        req.messages.SetInParent()
        for m in msgs:
            req.messages.messages.add(**m)
    for k, v in kwargs.items():
        if isinstance(v, list):
            getattr(req, k).extend(v)
        else:
            setattr(req, k, v)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    assert worker.engine.submitted == []  # rejected before anything reached the engine
    with Client(worker.target) as c:
        assert c.generate_text("still here", max_tokens=2).text == "ab"


def test_a_cache_key_reaches_the_engines_request(worker):
    with Client(worker.target) as c:
        c.generate_text("hello", max_tokens=1, cache_key="conversation-7")
        c.generate_text("hello", max_tokens=1)
    assert [r.cache_key for r in worker.engine.submitted] == ["conversation-7", ""]  # for the cluster's router


def test_oversized_message_is_resource_exhausted():
    with ThreadedWorker(FakeEngine(), max_message_bytes=64 * 1024) as w, Client(w.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate_text("x" * 100_000, max_tokens=1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's own check of the receive limit
        assert c.generate_text("ok", max_tokens=1).text == "a"


def test_by_default_grpc_refuses_a_message_over_4_mib_and_http_takes_16_mib_bodies():
    """gRPC's own 4 MiB default: a bigger message is refused by gRPC's core before Python copies it (a 15 MiB one
    cost the event loop 100+ ms in grpc's receive copy with the old 16 MiB default). HTTP bodies, parsed in
    slices, keep 16 MiB: the same 5 MiB prompt reaches validation there (400 naming the field, not 413)."""
    with ThreadedWorker(FakeEngine(), http_port=0) as w, Client(w.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate_text("x" * (5 << 20), max_tokens=1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            c.generate_text("x" * (3 << 20), max_tokens=1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # parsed, then refused by its size
        body = {"model": "fake", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
        r = httpx.post(f"http://127.0.0.1:{w.server.http_port}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text[:300]
        assert c.generate_text("ok", max_tokens=1).text == "a"


def test_request_that_can_never_fit_is_resource_exhausted():
    engine = FakeEngine(num_pages=8, page_size=4)  # 32 tokens of KV
    with ThreadedWorker(engine) as w, Client(w.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate_text("y" * 40, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "need 12 KV pages; this worker has 8 pages of 4 tokens" in e.value.details()


def test_request_that_cannot_fit_beside_pinned_pages_is_resource_exhausted(client):
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text(NO_CAPACITY, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cannot hold this request" in e.value.details()


def test_error_in_one_request_is_internal_and_others_are_unaffected(client):
    other = client.generate("fine", max_tokens=30)
    first = next(other)
    with pytest.raises(grpc.RpcError) as e:
        client.generate_text(FAILS_AFTER_ONE_TOKEN, max_tokens=30)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected failure" in e.value.details()
    rest = list(other)
    assert first.completion_tokens + len(rest) == 30 and rest[-1].finish_reason == "length"


def ended(worker, request_id: str, timeout: float = 30.0) -> FinishReason | None:
    """How the engine ended `request_id` (None if it has not ended within `timeout`)."""
    wait_until(lambda: request_id in worker.engine.finished, timeout)
    return worker.engine.finished.get(request_id)


def test_cancel_mid_decode_aborts_the_engine_request(client, worker):
    stream = client.generate("decode", max_tokens=400, request_id="decode-1")
    assert next(stream).completion_tokens == 1
    stream.close()  # leaving the loop cancels the call
    assert ended(worker, "decode-1") is FinishReason.ABORTED  # not LENGTH: the server aborted it


def test_cancel_mid_prefill_aborts_the_engine_request(worker):
    worker.engine.slow_prefill = 60.0
    stub = pb_grpc.RadixCacheStub(grpc.insecure_channel(worker.target))
    call = stub.Generate(pb.GenerateRequest(text=f"{SLOW_PREFILL} prefill", max_tokens=5, request_id="prefill-1"))
    assert wait_until(lambda: worker.engine.stats().running == 1)
    call.cancel()
    assert ended(worker, "prefill-1") is FinishReason.ABORTED


def test_deadline_exceeded_aborts_the_engine_request(client, worker):
    worker.engine.slow_prefill = 60.0
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(f"{SLOW_PREFILL} prefill", max_tokens=5, timeout=0.3, request_id="late-1"))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ended(worker, "late-1") is FinishReason.ABORTED


def test_abort_rpc_and_duplicate_request_id(client, worker):
    stream = client.generate("long", max_tokens=400, request_id="job-1")
    next(stream)
    with pytest.raises(grpc.RpcError) as e:
        next(client.generate("again", request_id="job-1"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert client.abort("job-1") is True
    last = list(stream)[-1]
    assert last.finish_reason == "aborted"
    assert client.abort("job-1") is False
    assert client.abort("never-was") is False


def test_tokenize_model_info_stats_flush(client, worker):
    assert client.tokenize("hi") == [1, ord("h") + 3, ord("i") + 3]
    chat_ids = client.tokenize(messages=[{"role": "user", "content": "hi"}])
    assert chat_ids[0] == 4  # the template's "\x01", encoded without an extra BOS
    info = client.model_info()
    assert info["vocab_size"] == 259 and info["context_length"] == 512 and info["page_size"] == 4
    assert info["kv_pages"] == 256 and info["eos_token_ids"] == [2] and info["model_name"] == "fake"
    client.generate_text("fill", max_tokens=2)
    s = client.stats()
    assert s["pages_total"] == 256 and s["queried_tokens"] == 5  # the engine's numbers, relayed
    assert client.generate_text("fill", max_tokens=2).cached_tokens > 0
    client.flush()
    assert worker.engine.flushed == [""]  # the caller's namespace only (no auth: ""), never None (= all)
    assert client.generate_text("fill", max_tokens=2).cached_tokens == 0


def test_pin_computes_then_pins_and_unpin(client, worker):
    assert client.pin("a system prompt", ttl_seconds=60) == 16  # 16 of 16 tokens: computed first, then pinned
    assert len(worker.engine.submitted) == 1 and worker.engine.submitted[0].sampling.max_tokens == 1
    assert client.pin("a system prompt") == 16  # cached now: pinned without computing
    assert len(worker.engine.submitted) == 1
    assert client.unpin("a system prompt") == 16
    with pytest.raises(grpc.RpcError) as e:
        client.pin("x", ttl_seconds=-1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds must be > 0" in e.value.details()


def test_chat_second_turn_hits_the_whole_first_turn(client):
    chat = Chat(client, system="be brief", max_tokens=5)
    first = chat.send("hello")
    second = chat.send("and again")
    assert first.cached_tokens == 0
    assert second.cached_tokens == first.prompt_tokens + first.completion_tokens
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]


def test_health_transitions_and_reflection():
    w = ThreadedWorker(FakeEngine(step_s=0.01)).start(attach=False)
    try:
        ch = grpc.insecure_channel(w.target)
        health = health_pb2_grpc.HealthStub(ch)
        check = lambda service="": health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status  # noqa: E731
        assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            Client(w.target).generate_text("x")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        w.attach()
        assert check() == check("radixcache.v1.RadixCache") == health_pb2.HealthCheckResponse.SERVING

        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert "radixcache.v1.RadixCache" in services and "grpc.health.v1.Health" in services

        # draining: NOT_SERVING while the in-flight stream finishes
        stream = Client(w.target).generate("busy", max_tokens=60)
        next(stream)
        stopper = threading.Thread(target=w.server and (lambda: w.run(w.server.stop(10), timeout=20)))
        stopper.start()
        assert wait_until(lambda: check() == health_pb2.HealthCheckResponse.NOT_SERVING)
        rest = list(stream)
        assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 60
        stopper.join(20)
    finally:
        w.stop()


def test_graceful_stop_under_load_completes_streams():
    w = ThreadedWorker(FakeEngine(step_s=0.01)).start()
    try:
        with Client(w.target) as c:
            streams = [c.generate(f"load {i}", max_tokens=40) for i in range(4)]
            for s in streams:
                next(s)
            results: list = []
            readers = [threading.Thread(target=lambda s=s: results.append(list(s)[-1])) for s in streams]
            for t in readers:
                t.start()
            w.run(w.server.stop(10), timeout=20)
            for t in readers:
                t.join(10)
            assert [r.finish_reason for r in results] == ["length"] * 4
            with pytest.raises(grpc.RpcError):
                c.generate_text("after", max_tokens=1, timeout=2)
    finally:
        w.stop()


TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}


def test_auth_and_tenant_isolation():
    with ThreadedWorker(FakeEngine(), auth_tokens=TOKENS) as w:
        for token in (None, "wrong"):
            with Client(w.target, token=token) as c, pytest.raises(grpc.RpcError) as e:
                c.generate_text("x")
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with Client(w.target, token=token) as c, pytest.raises(grpc.RpcError) as e:
                c.stats()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        Client(w.target).wait_ready(5)  # health stays open
        prompt = "the shared system prompt " * 4
        with Client(w.target, token="tok-alice") as alice, Client(w.target, token="tok-bob") as bob:
            assert alice.generate_text(prompt, max_tokens=2).cached_tokens == 0
            assert bob.generate_text(prompt, max_tokens=2).cached_tokens == 0
            assert alice.generate_text(prompt, max_tokens=2).cached_tokens > 0
            # the namespace comes from the token, and a tenant cannot abort another's request
            stream = alice.generate("mine", max_tokens=300, request_id="r1")
            next(stream)
            assert bob.abort("r1") is False
            assert alice.abort("r1") is True
            assert list(stream)[-1].finish_reason == "aborted"
        assert {r.namespace for r in w.engine.submitted} == {"alice", "bob"}
        assert {r.request_id.split("/")[0] for r in w.engine.submitted} == {"alice", "bob"}


def test_metrics_endpoint():
    with ThreadedWorker(FakeEngine(), metrics_port=0) as w, Client(w.target) as c:
        c.generate_text("measure me", max_tokens=4)
        body = urllib.request.urlopen(f"http://127.0.0.1:{w.server.metrics_port}/metrics", timeout=5).read().decode()
        for name in (
            "radixcache_time_to_first_token_seconds_count 1.0",
            "radixcache_time_per_output_token_seconds_count 1.0",
            'radixcache_requests_total{finish_reason="length"} 1.0',
            "radixcache_prompt_tokens_total 11.0",
            'radixcache_cache_pages{state="free"}',
            "radixcache_cache_hit_rate",
            "radixcache_requests_running 0.0",
            "radixcache_preemptions_total",
        ):
            assert name in body, name


def test_async_client(worker):
    async def go() -> None:
        async with AsyncClient(worker.target) as c:
            await c.wait_ready(5)
            chunks = [ch async for ch in c.generate("async", max_tokens=5)]
            assert "".join(ch.text for ch in chunks) == "abcde" and chunks[-1].finish_reason == "length"
            assert (await c.generate_text("x", max_tokens=2)).text == "ab"
            assert (await c.stats())["pages_total"] == 256
            assert (await c.model_info())["vocab_size"] == 259
            assert await c.tokenize("a") == [1, 100]
            gen = c.generate("cancel me", max_tokens=400, request_id="async-1")
            await gen.__anext__()
            await gen.aclose()

    asyncio.run(go())
    assert ended(worker, "async-1") is FinishReason.ABORTED


def self_signed_certificate(folder) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1 and localhost (PEM files in `folder`)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def test_tls(tmp_path):
    key, cert = self_signed_certificate(tmp_path)
    with ThreadedWorker(FakeEngine(), tls_cert=cert, tls_key=key) as w:
        with Client(w.target, tls_ca=cert) as c:
            assert c.generate_text("secure", max_tokens=3).text == "abc"
        with Client(w.target) as plain, pytest.raises(grpc.RpcError):
            plain.generate_text("x", timeout=2)


UNDECODABLE = [
    ("/radixcache.v1.RadixCache/Generate", b"\x12\x02\xff\xfe"),  # text: invalid UTF-8
    ("/radixcache.v1.RadixCache/Generate", b"\x12\x03\xed\xa0\x80"),  # text: a lone surrogate (U+D800)
    ("/radixcache.v1.RadixCache/Generate", b"\xff\xff\xff"),  # corrupt wire format
    ("/radixcache.v1.RadixCache/Tokenize", b"\x0a\x04ab\xc3("),  # text: a truncated 2-byte character
    ("/radixcache.v1.RadixCache/PinPrefix", b"\x0a\x05ab"),  # a length running past the end
    ("/radixcache.v1.RadixCache/Abort", b"\x0a\x01\x80"),
    ("/grpc.health.v1.Health/Check", b"\xff\xff\xff"),
]


def test_undecodable_payloads_are_invalid_argument_with_one_log_line(worker, caplog):
    with grpc.insecure_channel(worker.target) as ch:
        for _ in range(3):
            for method, raw in UNDECODABLE:
                streaming = method.endswith("/Generate")
                call = ch.unary_stream(method) if streaming else ch.unary_unary(method)
                with pytest.raises(grpc.RpcError) as e:
                    list(call(raw, timeout=5)) if streaming else call(raw, timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, e.value.details())
                assert e.value.details().startswith("the request cannot be decoded: ")
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(logged) == 1 and "undecodable request to" in logged[0].getMessage(), [r.getMessage() for r in logged]
    assert not any(r.exc_info for r in caplog.records)  # no traceback per call
    assert worker.engine.submitted == []
    with Client(worker.target) as c:
        assert c.generate_text("still here", max_tokens=2).text == "ab"


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_v1_and_v1alpha(worker, version):
    """Newer grpcurl and most tools speak reflection v1; older ones v1alpha. Both list and describe the service."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as r  # v1's messages are the same, field for field

    with grpc.insecure_channel(worker.target) as ch:
        call = ch.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=r.ServerReflectionRequest.SerializeToString,
            response_deserializer=r.ServerReflectionResponse.FromString,
        )
        asks = [
            r.ServerReflectionRequest(list_services=""),
            r.ServerReflectionRequest(file_containing_symbol="radixcache.v1.RadixCache"),
            r.ServerReflectionRequest(file_containing_symbol=f"grpc.reflection.{version}.ServerReflection"),
        ]
        listed, service, itself = list(call(iter(asks), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"radixcache.v1.RadixCache", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b) for b in service.file_descriptor_response.file_descriptor_proto
    ]
    assert files[0].name == "radixcache/v1/radixcache.proto" and files[0].service[0].name == "RadixCache"
    assert itself.WhichOneof("message_response") == "file_descriptor_response"


def test_listening_is_announced_only_once_the_worker_serves():
    """A script that waits for "listening on" must be able to call at once (it used to come 3-5 s early)."""
    from radixcache.worker.server import ServerOptions, describe, run_worker

    events: list[str] = []
    answers: list[str] = []

    def load_engine():
        time.sleep(0.3)  # loading a model
        engine = FakeEngine()
        engine.start()
        events.append("loaded")
        return engine, describe(engine, model_name="fake")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def call_at_once(target: str) -> None:  # what the newcomer's script does right after the line
            try:
                with Client(target) as c:
                    answers.append(c.generate_text("hi", max_tokens=2, timeout=5).text)
            finally:
                loop.call_soon_threadsafe(stop.set)

        def on_listening(host: str, port: int) -> None:
            events.append("listening")
            threading.Thread(target=call_at_once, args=(f"{host}:{port}",)).start()

        await run_worker(ServerOptions(port=0, grace_period=1), load_engine, on_listening=on_listening, stop_event=stop)

    asyncio.run(main())
    assert events == ["loaded", "listening"] and answers == ["ab"]


def test_prompts_are_tokenized_off_the_loop_and_oversized_ones_never(worker):
    """A 15 MiB prompt used to be tokenized on the event loop, stalling every stream and health for seconds."""
    tokenizer = worker.engine.tokenizer
    encoded: list[tuple[str, int]] = []  # (thread, characters) of every encode call
    plain_encode = tokenizer.encode

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append((threading.current_thread().name, len(text)))
        return plain_encode(text, add_special_tokens)

    tokenizer.encode = spy
    huge = "x" * (3 << 20)  # under the default message limit (4 MiB): gRPC lets it through to the worker
    chat = [{"role": "user", "content": huge[: 1 << 20]}] * 3
    with Client(worker.target) as c:
        calls = [
            lambda: c.generate_text(huge),
            lambda: c.generate_text(messages=chat),
            lambda: c.tokenize(huge),
            lambda: c.tokenize(messages=chat),
            lambda: c.pin(huge),
            lambda: c.unpin(huge),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "511" in e.value.details()
        assert c.generate_text("small", max_tokens=2).text == "ab"
        assert c.tokenize(messages=[{"role": "user", "content": "hi"}])
        c.pin("a prefix")
        c.unpin("a prefix")
    assert max(n for _, n in encoded) < 100  # the huge ones were refused from their size, never tokenized
    assert len(encoded) >= 4 and "test-worker-loop" not in {thread for thread, _ in encoded}
