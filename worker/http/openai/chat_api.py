"""The OpenAI front's routes over the front core: /v1/models, /v1/chat/completions, /v1/completions, /health, and
the machinery the other HTTP routes share (bodies read and parsed under limits, the refusal -> status table,
whole and streamed replies, retention pins). The app that serves them with the Responses and Messages routes is
worker/http/app.py.

It serves the same engine as the gRPC servicer, through the same front core (worker/front/core.py: the bearer-token
tenant = cache namespace, validation, tokenizing off the event loop, constraint compiling, submit); this module is
the OpenAI wire mapping only: bodies in (requests.py), chunks and responses out (responses.py), refusals as OpenAI
errors (errors.py).

A client that disconnects aborts its request at once, streaming or not: its pages are freed in the engine's next
step. Errors are OpenAI's shape (errors.py): 400 bad input (a body past json_body's limits included) or a Host it
does not answer to (host_check), 401 auth, 404 model or route, 405 method, 413 too large, 415 a body not said to be
JSON, 503 while loading or draining, 500 for a failure inside one request.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.engine.stream import EngineStream, StreamClosed
from radixcache.worker.front.core import FrontCore, Refusal
from radixcache.worker.front.refusal_log import RateLimitedWarning
from radixcache.worker.http.errors import APIError, bad_request
from radixcache.worker.http.json_body import BodyError, BodyShape, parse_body
from radixcache.worker.http.openai.errors import api_error, error_body
from radixcache.worker.http.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from radixcache.worker.http.openai.requests import ParsedRequest, body_shape, parse_chat, parse_completion
from radixcache.worker.http.openai.responses import ChatResponder, CompletionResponder

log = logging.getLogger("radixcache.openai")
_refused_bodies = RateLimitedWarning(log)  # one short line, not one per hostile request

DEFAULT_MAX_BODY_BYTES = 16 << 20


def _pydantic_param(error: dict[str, Any]) -> str:
    """A pydantic error location as the request field it names: ("messages", 0, "role") -> "messages[0].role".
    Union branches ("str", "list[int]", ...) in the location are not fields and end the path."""
    path = ""
    for part in error.get("loc", ()):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            path += f".{part}" if path else part
        else:
            break
    return path


async def _read_body(request: Request, limit: int) -> list[bytes]:
    """The body as the pieces it arrived in (json_body joins what it needs: 16 MB copied is milliseconds the loop
    serves no one)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; at most {limit} are accepted", code="too_large")
    pieces, size = [], 0
    async for piece in request.stream():
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="too_large")
    return pieces


def _require_json(request: Request) -> None:
    """Bodies are JSON, said so: a browser page on another site can POST text/plain or a form to a worker on
    localhost without asking first (no CORS preflight), but not application/json."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415, f"Content-Type must be application/json, got {content_type or 'none'!r}",
            code="unsupported_media_type",
        )  # fmt: skip


def _validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = _pydantic_param(first)
        raise bad_request(f"{param or 'body'}: {first['msg']}", param or None) from None


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIFront:
    """Request handling over `front`'s engine; create_app wires it to routes."""

    def __init__(self, core: FrontCore, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.core = core
        self.max_body_bytes = max_body_bytes
        self._background: set[asyncio.Future[Any]] = set()  # retain() pins running after their response

    # -- gates -------------------------------------------------------------------------------------------------
    def tenant(self, request: Request) -> str:
        try:
            return self.core.tenant([("authorization", request.headers.get("authorization", ""))])
        except Refusal:
            message = "missing or unknown bearer token (Authorization: Bearer <key>)"
            raise APIError(401, message, code="invalid_api_key") from None

    def engine(self) -> Any:
        try:
            return self.core.ready()
        except Refusal as r:
            raise api_error(r) from None

    @property
    def model_name(self) -> str:
        return self.core.facts.model_name

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this worker serves {self.model_name!r}", param="model",
                code="model_not_found",
            )  # fmt: skip

    # -- endpoints ---------------------------------------------------------------------------------------------
    def health(self) -> Response:
        serving = self.core.serving
        return JSONResponse({"status": "serving" if serving else "not serving"}, status_code=200 if serving else 503)

    def models(self, request: Request) -> ModelList:
        self.tenant(request)
        self.engine()
        card = ModelCard(id=self.model_name, max_model_len=int(self.core.facts.context_length))
        return ModelList(data=[card])

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, parse_chat, prompt_param="messages", chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, parse_completion, prompt_param="prompt", chat=False)

    async def _generate(
        self, request: Request, model: type[BaseModel], parse: Callable[[Any], ParsedRequest], *, prompt_param: str,
        chat: bool,
    ) -> Response:  # fmt: skip
        tenant = self.tenant(request)
        engine = self.engine()
        body = await self.body(request, model)
        self.check_model(body.model)
        parsed = parse(body)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        stream = await self._open(tenant, request_id, parsed, prompt_param=prompt_param, chat=chat)
        try:  # only now, with every field valid, is anything sized by the request (one choice per sample)
            responder = self._responder(engine, stream, request_id, parsed, chat=chat)
        except BaseException:
            stream.close()
            raise

        def done() -> None:
            if parsed.retention_s is not None:
                self.retain(tenant, stream, parsed.retention_s)

        if parsed.stream:
            return self._sse(stream, responder, parsed.include_usage, done)
        return await self._whole(request, stream, responder, done)

    def retain(self, tenant: str, stream: EngineStream, ttl_s: float) -> None:
        """Pin what a finished request computed (its prompt and first sample's reply but the last, uncomputed,
        token) for ttl_s, in the background: the response is not held up by it."""
        ids = list(stream.request.prompt_ids) + stream.generated[0][:-1]
        task = asyncio.ensure_future(self.core.retain(tenant, ids, ttl_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def body(self, request: Request, model: type[BaseModel], shape: BodyShape | None = None) -> Any:
        """The body as `model`: JSON said so, at most max_body_bytes, parsed within `shape`'s limits (chat's and
        completions' by default) without stalling the loop (json_body), then typed by pydantic (cheap: the shape
        bounds what it holds). Every route with a body reads it here."""
        _require_json(request)
        raw = await _read_body(request, self.max_body_bytes)
        try:
            data = await parse_body(raw, shape or body_shape(self.core.limits))
        except BodyError as e:
            client = request.client.host if request.client else "?"
            size = sum(len(piece) for piece in raw)
            _refused_bodies.warn(f"refused an HTTP body from {client} ({size} bytes): {e.message[:200]}")
            raise bad_request(e.message, e.param) from None
        return _validate(model, data)

    # -- the way through validation to the engine -------------------------------------------------------------
    def _responder(
        self, engine: Any, stream: EngineStream, request_id: str, parsed: ParsedRequest, *, chat: bool
    ) -> ChatResponder | CompletionResponder:
        """The response builder of an admitted request, sized by its validated sampling (n, logprobs)."""
        sampling = stream.request.sampling
        common = {"request_id": request_id, "model": self.model_name, "n": sampling.n,
                  "token_text": self._token_text(engine), "logprobs": sampling.logprobs}  # fmt: skip
        if chat:
            closes = bool(parsed.tool_choice.stop())
            return ChatResponder(parse_tools=parsed.parse_tools, closes_at_stop=closes, **common)
        return CompletionResponder(**common)

    @staticmethod
    def _token_text(engine: Any) -> Callable[[int], str]:
        tokenizer = engine.tokenizer

        def text(token_id: int) -> str:
            if tokenizer is None:
                return f"<{token_id}>"
            return tokenizer.decode([token_id], skip_special_tokens=False)

        return text

    async def _open(
        self, tenant: str, request_id: str, parsed: ParsedRequest, *, prompt_param: str, chat: bool
    ) -> EngineStream:
        """Through the front core (the same validation, tokenizing and submit as gRPC); refusals as OpenAI errors.
        Chat's default max_tokens (OpenAI's) is as long as the reply can be: what the context and KV pool leave."""
        try:
            return await self.core.admit(
                tenant, request_id, parsed.prompt, parsed.sampling, parsed.constraint, fill_max_tokens=chat,
                cache_key=parsed.cache_key,
            )  # fmt: skip
        except Refusal as r:
            names = {"max_tokens": parsed.max_tokens_param, "top_logprobs": parsed.top_logprobs_param}
            raise api_error(
                r, prompt_param=prompt_param, constraint_param=parsed.constraint_param, names=names
            ) from None

    @staticmethod
    def _failure(out: RequestOutput) -> APIError:
        return api_error(Refusal.of_failure(out.error_kind, f"the request failed: {out.error}"))

    async def _whole(
        self, request: Request, stream: EngineStream, responder: Any,
        done: Callable[[], Awaitable[None] | None] | None = None,
    ) -> Response:  # fmt: skip
        """Non-streaming: nothing is sent until the end, so a watcher notices the client leaving and closes the
        stream (aborting the request) at once. done: called (and awaited, if a coroutine function) once the
        request finished, before the response is built."""

        async def watch() -> None:
            await _until_disconnected(request)
            stream.close()

        watcher = asyncio.ensure_future(watch())
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ERROR:
                    raise self._failure(out)
                responder.add(out)
        except StreamClosed:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        finally:
            watcher.cancel()
            stream.close()
        if done is not None and inspect.isawaitable(finished := done()):
            await finished
        return JSONResponse(responder.response().model_dump())

    def _sse(
        self, stream: EngineStream, responder: Any, include_usage: bool, done: Callable[[], None] | None = None
    ) -> StreamingResponse:
        # Starlette cancels this generator when the client disconnects (it listens for http.disconnect while it
        # streams), which closes the stream: the request is aborted at once.
        async def events() -> AsyncIterator[str]:
            try:
                for chunk in responder.first_chunks():
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                async for out in stream:
                    if out.finish_reason is FinishReason.ERROR:
                        yield f"data: {json.dumps(error_body(self._failure(out)))}\n\n"
                        break
                    for chunk in responder.add(out):
                        yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                else:
                    if include_usage:
                        yield f"data: {responder.usage_chunk().model_dump_json()}\n\n"
                    if done is not None:
                        done()
                yield "data: [DONE]\n\n"
            finally:
                stream.close()

        # The background close covers a client gone before the generator ever started (its finally never runs).
        # A coroutine function, so that Starlette runs it on this loop (close() must run on the stream's loop): a
        # plain function would be sent to a worker thread, one thread hop per response.
        async def close_stream() -> None:
            stream.close()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(close_stream),
        )  # fmt: skip
