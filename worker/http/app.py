"""The one HTTP app of the worker (FastAPI): OpenAI's chat/completions and models routes (openai/chat_api.py), its
Responses API (openai/responses_api.py), vLLM's /tokenize and /detokenize (openai/tokenize_api.py) and Anthropic's
Messages API (anthropic/messages_api.py) on one port, with
the same tokens and front core, over one HttpFront (front.py: what the routes share); errors in the shape of the
API a path belongs to (Anthropic's for /v1/messages, OpenAI's elsewhere)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixcache.worker.front.core import FrontCore
from radixcache.worker.http.anthropic import errors as anthropic_errors
from radixcache.worker.http.anthropic.messages_api import MessagesEndpoint
from radixcache.worker.http.errors import APIError
from radixcache.worker.http.front import DEFAULT_MAX_BODY_BYTES, HttpFront
from radixcache.worker.http.host_check import HostCheck
from radixcache.worker.http.openai import errors as openai_errors
from radixcache.worker.http.openai.chat_api import ChatEndpoint
from radixcache.worker.http.openai.response_store import ResponseStore
from radixcache.worker.http.openai.responses_api import ResponsesEndpoint
from radixcache.worker.http.openai.tokenize_api import TokenizeEndpoint

log = logging.getLogger("radixcache.serve")


def create_app(
    core: FrontCore,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts: frozenset[str] | None = None,
    store: ResponseStore | None = None,
) -> FastAPI:
    """The FastAPI app of the HTTP fronts over the front core (see the module docstring). allowed_hosts: the Host
    names it answers (host_check.allowed_hosts; None: any, as behind the cluster's proxy). store: the Responses
    API's stored responses (a default-sized one if None)."""
    front = HttpFront(core, max_body_bytes=max_body_bytes)
    chat = ChatEndpoint(front)
    responses = ResponsesEndpoint(front, store if store is not None else ResponseStore())
    messages = MessagesEndpoint(front)
    tokens = TokenizeEndpoint(front)
    app = FastAPI(title="radixcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HostCheck, allowed=allowed_hosts)

    def error(request: Request, e: APIError) -> JSONResponse:
        """An error in the shape of the API the path belongs to (Anthropic's for /v1/messages, else OpenAI's)."""
        if anthropic_errors.anthropic_path(request.url.path):
            body = anthropic_errors.error_body(e.status, e.message)
        else:
            body = openai_errors.error_body(e)
        return JSONResponse(body, status_code=e.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error(request, APIError(e.status_code, message))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return error(request, APIError(500, "internal error while serving this request"))

    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/v1/models", chat.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat.chat, methods=["POST"])
    app.add_api_route("/v1/completions", chat.completions, methods=["POST"])
    app.state.store = responses.store
    app.add_api_route("/v1/responses", responses.create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
    app.add_api_route("/v1/messages", messages.create, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", tokens.tokenize, methods=["POST"])  # vLLM's paths: no /v1 prefix
    app.add_api_route("/detokenize", tokens.detokenize, methods=["POST"])
    return app
