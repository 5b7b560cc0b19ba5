"""OpenAI's chat/completions and models routes over the front core: /v1/models, /v1/chat/completions and
/v1/completions. The app that serves them with the Responses and Messages routes is worker/http/app.py; what every
HTTP route shares (gates, bodies, whole and streamed replies, background work) is worker/http/front.py.

It serves the same engine as the gRPC servicer, through the same front core (worker/front/core.py: the bearer-token
tenant = cache namespace, validation, tokenizing off the event loop, constraint compiling, submit); this module is
the OpenAI wire mapping only: bodies in (requests.py), chunks and responses out (responses.py), refusals as OpenAI
errors (errors.py).

Errors are OpenAI's shape (errors.py): 400 bad input (a body past json_body's limits included) or a Host it does not
answer to (host_check), 401 auth, 404 model or route, 405 method, 413 too large, 415 a body not said to be JSON, 503
while loading or draining, 500 for a failure inside one request.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.engine.stream import EngineStream
from radixcache.worker.front.core import Refusal
from radixcache.worker.http.errors import APIError
from radixcache.worker.http.front import HttpFront
from radixcache.worker.http.openai.errors import api_error, error_body
from radixcache.worker.http.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from radixcache.worker.http.openai.requests import ParsedRequest, body_shape, parse_chat, parse_completion
from radixcache.worker.http.openai.responses import ChatResponder, CompletionResponder


def failure(out: RequestOutput, parsed: ParsedRequest) -> APIError:
    """A request that failed after it was admitted, as an OpenAI error (a constraint's, naming the parameter that
    asked for it)."""
    refusal = Refusal.of_failure(out.error_kind, f"the request failed: {out.error}")
    return api_error(refusal, constraint_param=parsed.constraint_param)


class ChatEndpoint:
    """/v1/models, /v1/chat/completions and /v1/completions over an HttpFront; app.create_app wires them to routes."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front

    def models(self, request: Request) -> ModelList:
        self.front.tenant(request)
        self.front.engine()
        name = self.front.model_name
        card = ModelCard(id=name, root=name, max_model_len=int(self.front.core.facts.context_length))
        return ModelList(data=[card])

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, parse_chat, prompt_param="messages", chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, parse_completion, prompt_param="prompt", chat=False)

    async def _generate(
        self, request: Request, model: type[BaseModel], parse: Callable[[Any], ParsedRequest], *, prompt_param: str,
        chat: bool,
    ) -> Response:  # fmt: skip
        front = self.front
        tenant = front.tenant(request)
        engine = front.engine()
        body = await front.body(request, model, body_shape(front.core.limits))
        front.check_model(body.model)
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
                self._retain(tenant, stream, parsed.retention_s)

        if parsed.stream:
            return self._sse(stream, responder, parsed, done)
        return await front.whole(request, stream, responder, fail=lambda out: failure(out, parsed), done=done)

    def _retain(self, tenant: str, stream: EngineStream, ttl_s: float) -> None:
        """Pin what a finished request computed (its prompt and first sample's reply but the last, uncomputed,
        token) for ttl_s, in the background: the response is not held up by it. Never a salted one: a pin computes
        what is not cached, unsalted, where every client of the tenant would hit it."""
        if stream.request.cache_salt is not None:
            return
        ids = list(stream.request.prompt_ids) + stream.generated[0][:-1]
        self.front.keep_running(self.front.core.retain(tenant, ids, ttl_s))

    # -- the way through validation to the engine -------------------------------------------------------------
    def _responder(
        self, engine: Any, stream: EngineStream, request_id: str, parsed: ParsedRequest, *, chat: bool
    ) -> ChatResponder | CompletionResponder:
        """The response builder of an admitted request, sized by its validated sampling (n, logprobs)."""
        sampling = stream.request.sampling
        common = {"request_id": request_id, "model": self.front.model_name, "n": sampling.n,
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
            return await self.front.core.admit(
                tenant, request_id, parsed.prompt, parsed.sampling, parsed.constraint, fill_max_tokens=chat,
                cache_key=parsed.cache_key, keep=parsed.keep, salt=parsed.salt,
            )  # fmt: skip
        except Refusal as r:
            names = {"max_tokens": parsed.max_tokens_param, "top_logprobs": parsed.top_logprobs_param}
            raise api_error(
                r, prompt_param=prompt_param, constraint_param=parsed.constraint_param, names=names
            ) from None

    def _sse(
        self, stream: EngineStream, responder: Any, parsed: ParsedRequest, done: Callable[[], None] | None = None
    ) -> Response:
        async def events() -> AsyncIterator[str]:
            try:
                for chunk in responder.first_chunks():
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                async for out in stream:
                    if out.finish_reason is FinishReason.ERROR:
                        yield f"data: {json.dumps(error_body(failure(out, parsed)))}\n\n"
                        break
                    for chunk in responder.add(out):
                        yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                else:
                    if parsed.include_usage:
                        yield f"data: {responder.usage_chunk().model_dump_json()}\n\n"
                    if done is not None:
                        done()
                yield "data: [DONE]\n\n"
            finally:
                stream.close()

        return self.front.streamed(events(), close=stream.close)
