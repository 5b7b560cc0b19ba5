"""Anthropic's Messages API over the front core: POST /v1/messages and POST /v1/messages/count_tokens, on the same
HTTP app, port and tokens as the OpenAI routes (worker/http/app.py mounts them).

A request's body becomes the front core's plain values (requests.py) and goes through the same admit as every other
front: validation, tokenizing off the loop with the tenant's remembered replies, tool-call constraints, submit. Its
outputs become a message or its event stream (output.py); its cache_control breakpoints become pins
(cache_control.py), set while it runs and counted in its usage. Auth: `x-api-key: <key>` (Anthropic's header) or
`Authorization: Bearer <key>`, the same keys and tenants as the OpenAI routes. Errors are Anthropic's shape
(errors.py): the app's handlers write every APIError raised here that way.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.engine.stream import EngineStream
from radixcache.worker.front.core import Refusal, RefusalKind
from radixcache.worker.http.anthropic.cache_control import BreakpointPins
from radixcache.worker.http.anthropic.errors import error_body, refusal_error
from radixcache.worker.http.anthropic.output import MessagesResponder, sse
from radixcache.worker.http.anthropic.protocol import CountTokensRequest, MessagesRequest, TokensCount
from radixcache.worker.http.anthropic.requests import messages_body_shape, parse_messages, parse_prompt
from radixcache.worker.http.errors import APIError
from radixcache.worker.http.front import HttpFront

SHUT_DOWN = "the worker shut down before the reply was complete"


class MessagesEndpoint:
    """The two routes, over an HttpFront (its gates, body reading and replies; the app's handlers shape the
    errors)."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front

    def tenant(self, request: Request) -> str:
        """The caller's tenant from x-api-key, else from a bearer token: the same keys either way."""
        key = request.headers.get("x-api-key")
        credentials = [("authorization", f"Bearer {key}" if key else request.headers.get("authorization", ""))]
        try:
            return self.front.core.tenant(credentials)
        except Refusal:
            raise APIError(401, "invalid x-api-key (send x-api-key: <key> or Authorization: Bearer <key>)") from None

    # -- routes ------------------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        tenant = self.tenant(request)
        engine = self.front.engine()
        body = await self.front.body(request, MessagesRequest, messages_body_shape(self.front.core.limits))
        self.front.check_model(body.model)
        parsed = parse_messages(body)
        message_id = "msg_" + uuid.uuid4().hex
        core = self.front.core
        try:
            stream = await core.admit(
                tenant, message_id, parsed.prompt, parsed.sampling, parsed.constraint,
                remember=False if parsed.prewarm else None,  # a pre-warm's one token is no reply to remember
                keep=parsed.keep,
                salt=parsed.salt,
            )  # fmt: skip
        except Refusal as r:
            raise refusal_error(r, constraint_param=parsed.constraint_param) from None
        tokenizer = engine.tokenizer
        try:  # the stream is open: whatever fails now must close it
            # A salted prompt's breakpoints pin nothing: a pin computes unsalted what is not cached.
            breakpoints = parsed.breakpoints if parsed.salt is None else []
            pins = BreakpointPins(core, tenant, breakpoints, stream.request.prompt_ids)
            responder = MessagesResponder(
                message_id=message_id, model=self.front.model_name,
                parse_tools=parsed.tool_choice.parses(parsed.specs), closes_at_stop=bool(parsed.tool_choice.stop()),
                stop_sequences=parsed.stop_sequences, prewarm=parsed.prewarm,
                generated_text=lambda: tokenizer.decode(stream.generated[0]),
            )  # fmt: skip
        except BaseException:
            stream.close()
            raise
        if parsed.stream:
            return self._sse(stream, responder, pins, parsed.constraint_param)
        return await self._whole(request, stream, responder, pins, parsed.constraint_param)

    async def count_tokens(self, request: Request) -> Response:
        tenant = self.tenant(request)
        self.front.engine()
        body = await self.front.body(request, CountTokensRequest, messages_body_shape(self.front.core.limits))
        self.front.check_model(body.model)
        prompt, _, _, _ = parse_prompt(body)
        try:
            ids, _ = await self.front.core.tokenize(prompt, tenant=tenant)  # the ids a request would submit
        except Refusal as r:
            raise refusal_error(r) from None
        return JSONResponse(TokensCount(input_tokens=len(ids)).model_dump())

    # -- the way through --------------------------------------------------------------------------------------
    @staticmethod
    def _failure(out: RequestOutput, constraint_param: str) -> APIError:
        """A request that ended before its reply was complete (failed, or aborted by a worker shutting down)."""
        if out.finish_reason is FinishReason.ABORTED:
            return refusal_error(Refusal(RefusalKind.UNAVAILABLE, SHUT_DOWN))
        refusal = Refusal.of_failure(out.error_kind, f"the request failed: {out.error}")
        return refusal_error(refusal, constraint_param=constraint_param)

    async def _whole(
        self, request: Request, stream: EngineStream, responder: MessagesResponder, pins: BreakpointPins,
        constraint_param: str,
    ) -> Response:  # fmt: skip
        async def done() -> None:
            if responder.finish_reason is FinishReason.ABORTED:  # the worker stopped: not a whole reply
                raise refusal_error(Refusal(RefusalKind.UNAVAILABLE, SHUT_DOWN))
            responder.finish(await pins.creation(responder.cached_tokens))

        try:
            return await self.front.whole(
                request, stream, responder, fail=lambda out: self._failure(out, constraint_param), done=done
            )
        finally:
            pins.cancel()

    def _sse(
        self, stream: EngineStream, responder: MessagesResponder, pins: BreakpointPins, constraint_param: str
    ) -> Response:
        async def events() -> AsyncIterator[str]:
            try:
                async for out in stream:
                    if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORTED):
                        failure = self._failure(out, constraint_param)
                        yield sse(error_body(failure.status, failure.message))
                        return
                    for event in responder.add(out):
                        yield sse(event)
                responder.finish(await pins.creation(responder.cached_tokens))
                for event in responder.last_events():
                    yield sse(event)
            finally:
                stream.close()
                pins.cancel()

        def close() -> None:
            stream.close()
            pins.cancel()

        return self.front.streamed(events(), close=close)
