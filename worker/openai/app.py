"""The OpenAI-compatible HTTP front (FastAPI): /v1/models, /v1/chat/completions, /v1/completions, /health.

It serves the same engine as the gRPC servicer, through the same pieces: the bearer-token Authenticator (tenant =
cache namespace), worker/validation.py (what is valid; tokenizing off the event loop) and EngineStream (the bridge
from the engine thread; closing it aborts the request). `front` is the gRPC servicer, or anything with its
attributes: engine (None while loading), model_info, limits, draining, auth, metrics.

A client that disconnects aborts its request at once, streaming or not: its pages are freed in the engine's next
step. Errors are OpenAI's shape (errors.py): 400 bad input, 401 auth, 404 model or route, 413 too large, 503 while
loading or draining, 500 for a failure inside one request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixcache.worker.engine import DuplicateRequestError, RequestTooLargeError
from radixcache.worker.engine_stream import EngineStream, StreamClosed, engine_request_id
from radixcache.worker.openai.errors import APIError, bad_request, param_of
from radixcache.worker.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from radixcache.worker.openai.requests import ParsedRequest, parse_chat, parse_completion
from radixcache.worker.openai.responses import ChatResponder, CompletionResponder
from radixcache.worker.request import ErrorKind, FinishReason, RequestOutput
from radixcache.worker.request import Request as EngineRequest
from radixcache.worker.validation import (
    InvalidArgument,
    check_prompt_input,
    constraint,
    sampling_params,
    tokenize_off_loop,
)

log = logging.getLogger("radixcache.openai")

DEFAULT_MAX_BODY_BYTES = 16 << 20
ERROR_STATUS = {ErrorKind.NO_CAPACITY: 503, ErrorKind.UNAVAILABLE: 503, ErrorKind.INTERNAL: 500, None: 500}


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


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; at most {limit} are accepted", code="too_large")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="too_large")
    return bytes(body)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", None) from None
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

    def __init__(self, front: Any, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.front = front
        self.max_body_bytes = max_body_bytes

    # -- gates -------------------------------------------------------------------------------------------------
    def tenant(self, request: Request) -> str:
        tenant = self.front.auth.tenant([("authorization", request.headers.get("authorization", ""))])
        if tenant is None:
            raise APIError(401, "missing or unknown bearer token (Authorization: Bearer <key>)", code="invalid_api_key")
        return tenant

    def engine(self) -> Any:
        if self.front.draining:
            raise APIError(503, "the worker is shutting down", code="unavailable")
        if self.front.engine is None:
            raise APIError(503, "the worker is still loading its model", code="unavailable")
        return self.front.engine

    @property
    def model_name(self) -> str:
        return self.front.model_info.model_name

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this worker serves {self.model_name!r}", param="model",
                code="model_not_found",
            )  # fmt: skip

    # -- endpoints ---------------------------------------------------------------------------------------------
    def health(self) -> Response:
        serving = self.front.engine is not None and not self.front.draining
        return JSONResponse({"status": "serving" if serving else "not serving"}, status_code=200 if serving else 503)

    def models(self, request: Request) -> ModelList:
        self.tenant(request)
        self.engine()
        card = ModelCard(id=self.model_name, max_model_len=int(self.front.model_info.context_length))
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
        body = _parse(model, await _read_body(request, self.max_body_bytes))
        self.check_model(body.model)
        parsed = parse(body)
        common = {
            "model": self.model_name,
            "n": parsed.sampling.n or 1,
            "token_text": self._token_text(engine),
            "logprobs": bool(parsed.sampling.logprobs),
        }
        responder: ChatResponder | CompletionResponder
        if chat:
            responder = ChatResponder(
                request_id="chatcmpl-" + uuid.uuid4().hex, parse_tools=parsed.parse_tools, **common
            )
        else:
            responder = CompletionResponder(request_id="cmpl-" + uuid.uuid4().hex, **common)
        stream = await self._open(engine, tenant, responder.id, parsed, prompt_param=prompt_param, chat=chat)
        if parsed.stream:
            return self._sse(stream, responder, parsed.include_usage)
        return await self._whole(request, stream, responder)

    # -- the way through validation to the engine -------------------------------------------------------------
    @staticmethod
    def _token_text(engine: Any) -> Callable[[int], str]:
        tokenizer = engine.tokenizer

        def text(token_id: int) -> str:
            if tokenizer is None:
                return f"<{token_id}>"
            return tokenizer.decode([token_id], skip_special_tokens=False)

        return text

    async def _open(
        self, engine: Any, tenant: str, request_id: str, parsed: ParsedRequest, *, prompt_param: str, chat: bool
    ) -> EngineStream:
        """Validate (the same functions as gRPC: cheap checks, tokenizing text and messages in a thread, exact checks),
        submit."""
        limits = self.front.limits
        renames = {"max_tokens": parsed.max_tokens_param, "top_logprobs": parsed.top_logprobs_param}
        try:
            check_prompt_input(parsed.prompt, engine.tokenizer, limits)  # refused before tokenizing: bad sizes
            sampling_params(parsed.sampling, prompt_tokens=None, limits=limits)  # and bad sampling values
            ids, _ = await tokenize_off_loop(parsed.prompt, engine.tokenizer, limits)
            values = parsed.sampling
            if chat and values.max_tokens is None:
                # Chat's default (OpenAI's): as long as the reply can be, bounded by the context and the KV pool.
                info = self.front.model_info
                room = min(limits.context_length, info.kv_pages * info.page_size) - len(ids)
                values = dataclasses.replace(values, max_tokens=max(1, room))
            sampling = sampling_params(values, prompt_tokens=len(ids), limits=limits)
        except InvalidArgument as e:
            raise bad_request(str(e), param_of(str(e), prompt_param=prompt_param, renames=renames)) from None
        try:  # structured output: checked, then compiled (and cached) in a worker thread
            wanted = constraint(*parsed.constraint)
            if wanted is not None:
                await asyncio.get_running_loop().run_in_executor(None, engine.compile_constraint, wanted)
        except ValueError as e:  # InvalidArgument or ConstraintError: the schema / grammar is the caller's
            raise bad_request(f"{parsed.constraint_param}: {e}", parsed.constraint_param) from None
        request = EngineRequest(
            engine_request_id(tenant, request_id), ids, sampling, namespace=tenant, constraint=wanted
        )
        stream = EngineStream(engine, request, self.front.metrics)
        try:
            stream.open()
        except RequestTooLargeError as e:
            raise APIError(413, str(e), param=prompt_param, code="too_large") from None
        except DuplicateRequestError as e:  # ids are fresh uuids: not the caller's doing
            raise APIError(500, str(e)) from None
        except ValueError as e:
            raise bad_request(str(e), param_of(str(e), prompt_param=prompt_param, renames=renames)) from None
        except RuntimeError as e:
            raise APIError(503, f"the worker is not accepting requests: {e}", code="unavailable") from None
        return stream

    @staticmethod
    def _failure(out: RequestOutput) -> APIError:
        return APIError(ERROR_STATUS[out.error_kind], f"the request failed: {out.error}")

    async def _whole(self, request: Request, stream: EngineStream, responder: Any) -> Response:
        """Non-streaming: nothing is sent until the end, so a watcher notices the client leaving and closes the
        stream (aborting the request) at once."""

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
        return JSONResponse(responder.response().model_dump())

    def _sse(self, stream: EngineStream, responder: Any, include_usage: bool) -> StreamingResponse:
        # Starlette cancels this generator when the client disconnects (it listens for http.disconnect while it
        # streams), which closes the stream: the request is aborted at once.
        async def events() -> AsyncIterator[str]:
            try:
                for chunk in responder.first_chunks():
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                async for out in stream:
                    if out.finish_reason is FinishReason.ERROR:
                        yield f"data: {json.dumps(self._failure(out).body())}\n\n"
                        break
                    for chunk in responder.add(out):
                        yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                else:
                    if include_usage:
                        yield f"data: {responder.usage_chunk().model_dump_json()}\n\n"
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


def create_app(front: Any, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app of the OpenAI front over `front` (see the module docstring)."""
    api = OpenAIFront(front, max_body_bytes=max_body_bytes)
    app = FastAPI(title="radixcache", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, "internal error while serving this request").body(), status_code=500)

    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    return app
