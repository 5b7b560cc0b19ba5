"""Python clients of a radixcache worker: `Client` (blocking) and `AsyncClient` (asyncio).

    from radixcache.client import Client
    with Client("127.0.0.1:50051") as c:
        for chunk in c.generate("The capital of France is", max_tokens=32):
            print(chunk.text, end="", flush=True)

generate() yields one Chunk per engine step. Leaving the loop early (break, an exception, closing the iterator)
cancels the call, which aborts the request on the worker and frees its pages. Errors are grpc.RpcError with the
worker's status code and message (INVALID_ARGUMENT names the bad field). Imports only grpc and the stubs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixcache.v1 import radixcache_pb2 as pb
from radixcache.v1 import radixcache_pb2_grpc as pb_grpc

MiB = 1 << 20
Message = Mapping[str, str]  # {"role": ..., "content": ...}

_FINISH = {
    pb.FINISH_REASON_STOP_TOKEN: "stop_token",
    pb.FINISH_REASON_STOP_STRING: "stop_string",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "aborted",
}
_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "n",  # samples of the prompt; their chunks interleave, told apart by Chunk.index
    "presence_penalty",
    "frequency_penalty",
    "speculate",  # False: no draft tokens for this request (same output; only speed differs)
)
# Structured output (at most one): json_schema (a dict or JSON text), json_object=True, regex, ebnf (GBNF or Lark).
_CONSTRAINTS = ("json_schema", "json_object", "regex", "ebnf")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Chunk:
    """One streamed message: the tokens of one engine step and their text."""

    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None  # "stop_token" | "stop_string" | "length" | "aborted" on the last chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0  # which sample (n > 1)
    draft_tokens: int = 0  # speculative decoding, this sample so far: draft tokens checked
    accepted_draft_tokens: int = 0  # and of those, the ones that were the sampled token
    cache_miss_reason: str = ""  # on the last chunk: why the cache served no more of the prompt (or "")
    cache_match_end: str = ""  # on the last chunk: how the cache's match ended

    @classmethod
    def from_proto(cls, m: pb.GenerateResponse) -> Chunk:
        return cls(
            request_id=m.request_id,
            token_ids=list(m.token_ids),
            text=m.text,
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_tokens,
            completion_tokens=m.completion_tokens,
            finish_reason=_FINISH.get(m.finish_reason),
            logprobs=[
                TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in m.logprobs
            ],
            index=m.index,
            draft_tokens=m.draft_tokens,
            accepted_draft_tokens=m.accepted_draft_tokens,
            cache_miss_reason=m.cache_miss_reason,
            cache_match_end=m.cache_match_end,
        )


@dataclass
class Completion:
    """A whole completion (generate_text)."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    cache_miss_reason: str = ""
    cache_match_end: str = ""

    @classmethod
    def join(cls, chunks: Sequence[Chunk]) -> Completion:
        """The completion of one sample's chunks (generate_text refuses n > 1: group generate()'s by index)."""
        if any(c.index for c in chunks):
            raise ValueError("chunks of several samples (n > 1): group generate()'s chunks by Chunk.index")
        last = chunks[-1]
        return cls(
            request_id=last.request_id,
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            completion_tokens=last.completion_tokens,
            finish_reason=last.finish_reason,
            draft_tokens=last.draft_tokens,
            accepted_draft_tokens=last.accepted_draft_tokens,
            cache_miss_reason=last.cache_miss_reason,
            cache_match_end=last.cache_match_end,
        )


def _pin_request(
    text: str | None, token_ids: Sequence[int] | None, messages: Sequence[Message] | None, ttl_seconds: float | None
) -> pb.PinPrefixRequest:
    req = pb.PinPrefixRequest()
    _set_input(req, text, token_ids, messages)
    if ttl_seconds is not None:
        req.ttl_seconds = ttl_seconds
    return req


def _set_input(msg: Any, text: str | None, token_ids: Sequence[int] | None, messages: Sequence[Message] | None) -> None:
    given = [x is not None for x in (text, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of text, token_ids or messages")
    if text is not None:
        msg.text = text
    elif token_ids is not None:
        msg.token_ids.ids.extend(token_ids)
    else:
        for m in messages or ():
            msg.messages.messages.add(role=m["role"], content=m["content"])


def generate_request(
    text: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Message] | None = None,
    request_id: str = "",
    cache_key: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; sampling keywords left out (or None) take the worker's defaults. The keywords also take
    one constraint: json_schema (a dict or JSON text), json_object=True, regex or ebnf. cache_key: the routing hint
    (a cluster sends a tenant's requests with one key to one replica while load allows)."""
    known = _SAMPLING + _CONSTRAINTS
    unknown = set(sampling) - set(known)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    constraints = [name for name in _CONSTRAINTS if sampling.get(name) is not None]
    if len(constraints) > 1:
        raise ValueError(f"give at most one constraint; got {', '.join(constraints)}")
    req = pb.GenerateRequest(request_id=request_id, cache_key=cache_key)
    _set_input(req, text, token_ids, messages)
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "json_schema" and not isinstance(value, str):
            req.json_schema = json.dumps(value)
        elif name in ("stop", "stop_token_ids"):
            getattr(req, name).extend([value] if isinstance(value, str) else value)
        else:
            setattr(req, name, value)
    return req


def _stats(m: pb.CacheStats) -> dict[str, Any]:
    """The counters by name; on a cluster, "replicas" lists each replica's as {"replica_id", counters...}."""
    d: dict[str, Any] = {f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields if f.name != "replicas"}
    d["replicas"] = [{"replica_id": r.replica_id, **_stats(r.stats)} for r in m.replicas]
    return d


def _model_info(m: pb.ModelInfo) -> dict[str, Any]:
    d: dict[str, Any] = {f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields}
    d["eos_token_ids"] = list(m.eos_token_ids)
    d["layer_kinds"] = list(m.layer_kinds)
    return d


def channel_options(max_message_bytes: int = 16 * MiB) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Pings keep a connection alive through a long prefill; the worker accepts one per >= 10 s.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]


class _Base:
    def __init__(self, token: str | None) -> None:
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()

    @staticmethod
    def _credentials(tls_ca: str | bytes | None) -> grpc.ChannelCredentials:
        root = tls_ca if isinstance(tls_ca, bytes) or tls_ca is None else open(tls_ca, "rb").read()
        return grpc.ssl_channel_credentials(root_certificates=root)


class Client(_Base):
    """Blocking client. `target` is "host:port"; `token` a bearer token (auth); `tls_ca` a CA PEM path/bytes, or
    tls=True to use the system roots."""

    def __init__(
        self, target: str, *, token: str | None = None, tls_ca: str | bytes | None = None, tls: bool = False
    ) -> None:
        super().__init__(token)
        if tls or tls_ca is not None:
            self._channel = grpc.secure_channel(target, self._credentials(tls_ca), options=channel_options())
        else:
            self._channel = grpc.insecure_channel(target, options=channel_options())
        self._stub = pb_grpc.RadixCacheStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the worker's health check says SERVING; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = self._health.Check(health_pb2.HealthCheckRequest(), timeout=max(0.1, deadline - time.monotonic()))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the worker was not SERVING within {timeout} s")
            time.sleep(0.05)

    def generate(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Stream a completion, one Chunk per engine step. Sampling keywords: max_tokens, temperature, top_k, top_p,
        min_p, seed, stop, stop_token_ids, ignore_eos, logprobs, top_logprobs, n, presence_penalty,
        frequency_penalty, speculate; cache_key (the routing hint); and at most one constraint: json_schema (dict or
        JSON text), json_object=True, regex, ebnf."""
        req = generate_request(text, token_ids=token_ids, messages=messages, request_id=request_id, **sampling)
        call = self._stub.Generate(req, timeout=timeout, metadata=self._metadata)
        return self._iterate(call)

    @staticmethod
    def _iterate(call: Any) -> Iterator[Chunk]:
        try:
            for m in call:
                yield Chunk.from_proto(m)
        finally:
            call.cancel()  # a no-op after a complete stream; aborts the request when the caller stopped early

    def generate_text(self, text: str | None = None, **kwargs: Any) -> Completion:
        """Generate and return the whole completion."""
        return Completion.join(list(self.generate(text, **kwargs)))

    def tokenize(self, text: str | None = None, *, messages: Sequence[Message] | None = None) -> list[int]:
        req = pb.TokenizeRequest()
        _set_input(req, text, None, messages)
        return list(self._stub.Tokenize(req, metadata=self._metadata).token_ids)

    def model_info(self) -> dict[str, Any]:
        return _model_info(self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata))

    def stats(self) -> dict[str, Any]:
        return _stats(self._stub.GetCacheStats(pb.GetCacheStatsRequest(), metadata=self._metadata))

    def flush(self) -> int:
        return self._stub.FlushCache(pb.FlushCacheRequest(), metadata=self._metadata).pages_flushed

    def pin(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        ttl_seconds: float | None = None,
    ) -> int:
        """Pin a prefix (computing it first if it is not cached); returns the tokens pinned (whole pages)."""
        req = _pin_request(text, token_ids, messages, ttl_seconds)
        return self._stub.PinPrefix(req, metadata=self._metadata).pinned_tokens

    def unpin(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
    ) -> int:
        req = pb.UnpinPrefixRequest()
        _set_input(req, text, token_ids, messages)
        return self._stub.UnpinPrefix(req, metadata=self._metadata).unpinned_tokens

    def explain(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        timeout: float | None = None,
    ) -> pb.ExplainPrefixResponse:
        """What a Generate of this prompt would be served from the caller's own namespace now, page by page, and why
        no more (ExplainPrefix; changes nothing in the cache)."""
        req = pb.ExplainPrefixRequest()
        _set_input(req, text, token_ids, messages)
        return self._stub.ExplainPrefix(req, timeout=timeout, metadata=self._metadata)

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._metadata).aborted

    def cache_events(self, timeout: float | None = None) -> Iterator[pb.CacheEventBatch]:
        """The worker's cache event stream (SubscribeCacheEvents; needs an admin token when the worker uses auth), as
        radixcache.v1 CacheEventBatch messages: a SNAPSHOT (in parts, the last with snapshot_complete), then EVENTS
        batches with consecutive sequence numbers; RESET and a new SNAPSHOT when this reader fell behind."""
        call = self._stub.SubscribeCacheEvents(
            pb.SubscribeCacheEventsRequest(), timeout=timeout, metadata=self._metadata
        )
        try:
            yield from call
        finally:
            call.cancel()


class AsyncClient(_Base):
    """asyncio client (grpc.aio); the same methods as Client, awaitable; generate() is an async iterator."""

    def __init__(
        self, target: str, *, token: str | None = None, tls_ca: str | bytes | None = None, tls: bool = False
    ) -> None:
        super().__init__(token)
        if tls or tls_ca is not None:
            self._channel = grpc.aio.secure_channel(target, self._credentials(tls_ca), options=channel_options())
        else:
            self._channel = grpc.aio.insecure_channel(target, options=channel_options())
        self._stub = pb_grpc.RadixCacheStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = await self._health.Check(
                    health_pb2.HealthCheckRequest(), timeout=max(0.1, deadline - time.monotonic())
                )
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the worker was not SERVING within {timeout} s")
            await asyncio.sleep(0.05)

    async def generate(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Chunk]:
        req = generate_request(text, token_ids=token_ids, messages=messages, request_id=request_id, **sampling)
        call = self._stub.Generate(req, timeout=timeout, metadata=self._metadata)
        try:
            async for m in call:
                yield Chunk.from_proto(m)
        finally:
            call.cancel()

    async def generate_text(self, text: str | None = None, **kwargs: Any) -> Completion:
        return Completion.join([c async for c in self.generate(text, **kwargs)])

    async def tokenize(self, text: str | None = None, *, messages: Sequence[Message] | None = None) -> list[int]:
        req = pb.TokenizeRequest()
        _set_input(req, text, None, messages)
        return list((await self._stub.Tokenize(req, metadata=self._metadata)).token_ids)

    async def model_info(self) -> dict[str, Any]:
        return _model_info(await self._stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata))

    async def stats(self) -> dict[str, Any]:
        return _stats(await self._stub.GetCacheStats(pb.GetCacheStatsRequest(), metadata=self._metadata))

    async def flush(self) -> int:
        return (await self._stub.FlushCache(pb.FlushCacheRequest(), metadata=self._metadata)).pages_flushed

    async def pin(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        ttl_seconds: float | None = None,
    ) -> int:
        req = _pin_request(text, token_ids, messages, ttl_seconds)
        return (await self._stub.PinPrefix(req, metadata=self._metadata)).pinned_tokens

    async def unpin(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
    ) -> int:
        req = pb.UnpinPrefixRequest()
        _set_input(req, text, token_ids, messages)
        return (await self._stub.UnpinPrefix(req, metadata=self._metadata)).unpinned_tokens

    async def explain(
        self,
        text: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        timeout: float | None = None,
    ) -> pb.ExplainPrefixResponse:
        """Client.explain, awaited."""
        req = pb.ExplainPrefixRequest()
        _set_input(req, text, token_ids, messages)
        return await self._stub.ExplainPrefix(req, timeout=timeout, metadata=self._metadata)

    async def cache_events(self, timeout: float | None = None) -> AsyncIterator[pb.CacheEventBatch]:
        """Client.cache_events, as an async iterator."""
        call = self._stub.SubscribeCacheEvents(
            pb.SubscribeCacheEventsRequest(), timeout=timeout, metadata=self._metadata
        )
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> bool:
        return (await self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._metadata)).aborted
