"""HttpFront: what every HTTP route shares, whichever API it serves (OpenAI's chat/completions and models in
openai/chat_api.py, its Responses API in openai/responses_api.py, Anthropic's Messages API in
anthropic/messages_api.py), over the one front core (worker/front/core.py).

    front = HttpFront(core, max_body_bytes=...)
    tenant = front.tenant(request); engine = front.engine(); front.check_model(body.model)   # gates (APIError)
    body = await front.body(request, PydanticModel, shape)    # JSON said so, size-limited, parsed under `shape`
    return await front.whole(request, stream, responder, fail=..., done=...)                 # a non-streamed reply
    return front.streamed(events, close=stream.close)                                        # a streamed one (SSE)
    front.keep_running(core.retain(tenant, ids, ttl))          # work that outlives its response (retention pins)

Each API writes its own bodies, events and errors (the app's handlers shape every APIError by its path); only the
machinery is here. A client that disconnects aborts its request at once, streaming or not: its pages are freed in
the engine's next step.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from radixcache.worker.engine.api import EngineLike
from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.engine.stream import EngineStream, StreamClosed
from radixcache.worker.front.core import FrontCore, Refusal
from radixcache.worker.front.refusal_log import RateLimitedWarning
from radixcache.worker.http.errors import HTTP_STATUS, APIError, bad_request
from radixcache.worker.http.json_body import BodyError, BodyShape, parse_body

log = logging.getLogger("radixcache.http")
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


class HttpFront:
    """The HTTP routes' shared state and machinery over `core` (see the module docstring). One per app."""

    def __init__(self, core: FrontCore, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.core = core
        self.max_body_bytes = max_body_bytes
        self._running: set[asyncio.Future[Any]] = set()  # keep_running's tasks, referenced until done

    # -- gates -------------------------------------------------------------------------------------------------
    def tenant(self, request: Request) -> str:
        """The caller's tenant from `Authorization: Bearer <key>`; 401 otherwise."""
        try:
            return self.core.tenant([("authorization", request.headers.get("authorization", ""))])
        except Refusal:
            message = "missing or unknown bearer token (Authorization: Bearer <key>)"
            raise APIError(401, message, code="invalid_api_key") from None

    def engine(self) -> EngineLike:
        """The engine, or 503 while the worker loads its model or drains (the only refusals of core.ready)."""
        try:
            return self.core.ready()
        except Refusal as r:
            raise APIError(HTTP_STATUS[r.kind], r.message, code="unavailable") from None

    @property
    def model_name(self) -> str:
        return self.core.facts.model_name

    def check_model(self, model: str) -> None:
        """404 unless `model` is the one this worker serves."""
        if model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this worker serves {self.model_name!r}", param="model",
                code="model_not_found",
            )  # fmt: skip

    def health(self) -> Response:
        serving = self.core.serving
        return JSONResponse({"status": "serving" if serving else "not serving"}, status_code=200 if serving else 503)

    # -- bodies ------------------------------------------------------------------------------------------------
    async def body(self, request: Request, model: type[BaseModel], shape: BodyShape) -> Any:
        """The body as `model`: JSON said so, at most max_body_bytes, parsed within `shape`'s limits without
        stalling the loop (json_body), then typed by pydantic (cheap: the shape bounds what it holds). Every route
        with a body reads it here."""
        _require_json(request)
        raw = await _read_body(request, self.max_body_bytes)
        try:
            data = await parse_body(raw, shape)
        except BodyError as e:
            client = request.client.host if request.client else "?"
            size = sum(len(piece) for piece in raw)
            _refused_bodies.warn(f"refused an HTTP body from {client} ({size} bytes): {e.message[:200]}")
            raise bad_request(e.message, e.param) from None
        return _validate(model, data)

    # -- replies -----------------------------------------------------------------------------------------------
    async def whole(
        self,
        request: Request,
        stream: EngineStream,
        responder: Any,
        *,
        fail: Callable[[RequestOutput], APIError],
        done: Callable[[], Awaitable[None] | None] | None = None,
    ) -> Response:
        """A non-streamed reply: every output goes to `responder.add`, then `responder.response()` is the body.
        Nothing is sent until the end, so a watcher notices the client leaving and closes the stream (aborting the
        request) at once (499). fail: the APIError raised for a request that failed (FinishReason.ERROR), in the
        route's API. done: called (and awaited, if it returns an awaitable) once the request finished, before the
        response is built."""

        async def watch() -> None:
            await _until_disconnected(request)
            stream.close()

        watcher = asyncio.ensure_future(watch())
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ERROR:
                    raise fail(out)
                responder.add(out)
        except StreamClosed:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        finally:
            watcher.cancel()
            stream.close()
        if done is not None and inspect.isawaitable(finished := done()):
            await finished
        return JSONResponse(responder.response().model_dump())

    @staticmethod
    def streamed(events: AsyncIterator[str], *, close: Callable[[], None]) -> StreamingResponse:
        """A streamed reply: `events` (server-sent events, each "data: ...\\n\\n" or "event: ...") as they come.
        Starlette cancels the generator when the client disconnects, so its own `finally` closes the stream (the
        request is aborted at once); `close` is also called once the response ends, for a client gone before the
        generator ever started (its finally never runs). Close the EngineStream (and anything the reply holds) in
        both."""

        # A coroutine function, so that Starlette runs it on this loop (EngineStream.close must run on the stream's
        # loop): a plain function would be sent to a worker thread, one thread hop per response.
        async def close_after() -> None:
            close()

        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(close_after),
        )  # fmt: skip

    def keep_running(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` in the background, past the response it belongs to (retention pins): the task is referenced
        until it is done, so it is not collected half way."""
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
