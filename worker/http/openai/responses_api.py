"""The OpenAI Responses API over the front core: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request's input items become chat messages after its instructions (responses_input.py) and go through the same
front core as chat completions (validation, tokenizing off the loop, constraints, submit). With `store` (OpenAI's
default) the finished response is kept per tenant (response_store.py): its body for GET, and its conversation as
exact token ids for `previous_response_id`. A follow-up continues from those ids: the new items are rendered after
the stored conversation and only they are tokenized (FrontCore.continue_from), so the follow-up's prompt begins with
every token the worker computed for the previous turn, and what that turn computed stays pinned for the store's pin
TTL inside the pin budget, so the follow-up hits even when other requests evict. As OpenAI does, the instructions
of a previous response are not carried over: a follow-up states its own (the same ones keep the prefix).
"""

from __future__ import annotations

import uuid
from array import array
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.engine.stream import EngineStream
from radixcache.worker.front.core import Refusal
from radixcache.worker.front.tool_calls import template_tools
from radixcache.worker.front.validation import CheckedPrompt, PromptInput
from radixcache.worker.http.errors import APIError
from radixcache.worker.http.front import HttpFront
from radixcache.worker.http.openai.errors import api_error
from radixcache.worker.http.openai.response_store import ResponseStore, StoredResponse
from radixcache.worker.http.openai.responses_input import ResponsesInput, parse_responses, responses_body_shape
from radixcache.worker.http.openai.responses_output import ResponsesResponder, sse
from radixcache.worker.http.openai.responses_protocol import DeletedResponse, ResponsesRequest

# validation's field names that the Responses API calls otherwise (the conversation is its `input`).
NAMES = {"max_tokens": "max_output_tokens", "messages": "input"}


class ResponsesEndpoint:
    """The three routes, over an HttpFront (its gates, body reading and replies) and a ResponseStore."""

    def __init__(self, front: HttpFront, store: ResponseStore) -> None:
        self.front, self.store = front, store

    # -- routes ------------------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        tenant = self.front.tenant(request)
        engine = self.front.engine()
        body = await self.front.body(request, ResponsesRequest, responses_body_shape(self.front.core.limits))
        self.front.check_model(body.model)
        parsed = parse_responses(body)
        previous = self._previous(tenant, parsed)
        conversation = (previous.conversation if previous else []) + parsed.messages
        system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
        chat = PromptInput(messages=system + conversation, tools=template_tools(parsed.specs))
        prompt: PromptInput | CheckedPrompt = chat
        prompt_text = ""
        try:
            if previous is not None:  # checked here, and then not again by admit
                prompt = self.front.core.check_prompt(chat)
                continued = await self.front.core.continue_from(previous.prefixes(), prompt)
                # a salt sharing the system messages counts them in the messages: it keeps them (and re-renders)
                if continued is not None and not (parsed.salt is not None and parsed.salt.share_system is True):
                    prompt, prompt_text = PromptInput(token_ids=continued[0]), continued[1]
            response_id = "resp_" + uuid.uuid4().hex
            stream = await self.front.core.admit(
                tenant, response_id, prompt, parsed.sampling, parsed.constraint, fill_max_tokens=True,
                cache_key=parsed.cache_key, remember=True, keep=parsed.keep, salt=parsed.salt,
            )  # fmt: skip
        except Refusal as r:
            raise self._error(r, parsed) from None
        responder = ResponsesResponder(
            response_id=response_id, model=self.front.model_name, echo=_echo(body, parsed),
            parse_tools=parsed.tool_choice.parses(parsed.specs), closes_at_stop=bool(parsed.tool_choice.stop()),
        )  # fmt: skip
        turn = _Turn(tenant, parsed, conversation, prompt_text or stream.prompt_text, engine.tokenizer)
        if parsed.stream:
            return self._sse(stream, responder, turn)
        return await self._whole(request, stream, responder, turn)

    async def retrieve(self, request: Request, response_id: str) -> Response:
        stored = self.store.get(self.front.tenant(request), response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.body)

    async def delete(self, request: Request, response_id: str) -> Response:
        if not self.store.delete(self.front.tenant(request), response_id):
            raise _not_found(response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    # -- the way through --------------------------------------------------------------------------------------
    def _previous(self, tenant: str, parsed: ResponsesInput) -> StoredResponse | None:
        if parsed.previous_response_id is None:
            return None
        stored = self.store.get(tenant, parsed.previous_response_id)
        if stored is None:
            raise APIError(
                400, f"Previous response with id {parsed.previous_response_id!r} not found.",
                param="previous_response_id", code="previous_response_not_found",
            )  # fmt: skip
        return stored

    @staticmethod
    def _error(refusal: Refusal, parsed: ResponsesInput) -> APIError:
        return api_error(refusal, prompt_param="input", constraint_param=parsed.constraint_param, names=NAMES)

    @classmethod
    def _failure(cls, out: RequestOutput, parsed: ResponsesInput) -> APIError:
        return cls._error(Refusal.of_failure(out.error_kind, f"the request failed: {out.error}"), parsed)

    def _finished(self, stream: EngineStream, responder: ResponsesResponder, turn: _Turn) -> None:
        """Store the finished response (with `store`) and pin what it computed, in the background."""
        generated = stream.generated[0]
        ids = list(stream.request.prompt_ids) + generated
        if turn.parsed.store and turn.tokenizer is not None:
            decode = turn.tokenizer.decode
            self.store.put(
                turn.tenant,
                StoredResponse(
                    id=responder.object.id,
                    body=responder.object.model_dump(),
                    token_ids=array("i", ids),
                    text=turn.prompt_text + decode(generated, skip_special_tokens=False),
                    generated_text_without_last=turn.prompt_text + decode(generated[:-1], skip_special_tokens=False),
                    conversation=turn.conversation + [responder.reply_message()],
                    instructions=turn.parsed.instructions,
                ),
            )
        ttl = max(self.store.pin_ttl_s if turn.parsed.store else 0.0, turn.parsed.retention_s or 0.0)
        if ttl > 0 and turn.parsed.salt is None:  # a pin computes unsalted what is not cached: never a salted turn
            self.front.keep_running(self.front.core.retain(turn.tenant, ids[:-1], ttl))

    async def _whole(self, request: Request, stream: EngineStream, responder: ResponsesResponder, turn: _Turn) -> Response:  # fmt: skip
        return await self.front.whole(
            request, stream, responder, fail=lambda out: self._failure(out, turn.parsed),
            done=lambda: self._finished(stream, responder, turn),
        )  # fmt: skip

    def _sse(self, stream: EngineStream, responder: ResponsesResponder, turn: _Turn) -> Response:
        async def events() -> AsyncIterator[str]:
            try:
                for event in responder.first_events():
                    yield sse(event)
                async for out in stream:
                    if out.finish_reason is FinishReason.ERROR:
                        for event in responder.failed_events(f"the request failed: {out.error}"):
                            yield sse(event)
                        return
                    for event in responder.add(out):
                        yield sse(event)
                self._finished(stream, responder, turn)
                for event in responder.last_events():
                    yield sse(event)
            finally:
                stream.close()

        return self.front.streamed(events(), close=stream.close)


class _Turn:
    """What finishing a response needs besides its stream and responder."""

    def __init__(
        self, tenant: str, parsed: ResponsesInput, conversation: list[dict[str, Any]], prompt_text: str, tokenizer: Any
    ) -> None:
        self.tenant, self.parsed, self.conversation = tenant, parsed, conversation
        self.prompt_text, self.tokenizer = prompt_text, tokenizer


def _echo(body: ResponsesRequest, parsed: ResponsesInput) -> dict[str, Any]:
    """The request fields a response object repeats."""
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": parsed.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": (body.text.format if body.text and body.text.format else {"type": "text"})},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": list(body.tools or ()),
        "user": body.user,
        "metadata": dict(body.metadata or {}),
        "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
    }


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id {response_id!r}.", param="response_id", code="not_found")
