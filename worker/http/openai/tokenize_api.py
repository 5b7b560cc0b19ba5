"""vLLM's /tokenize and /detokenize over the front core, for tools written against vLLM's server.

    POST /tokenize   {"prompt": str, "add_special_tokens"?: bool}                 -> {"count", "max_model_len",
                     {"messages": [...], "add_generation_prompt"?: bool}              "tokens", "token_strs"?}
    POST /detokenize {"tokens": [int]}                                              -> {"prompt": str}

A text or chat is tokenized exactly as the front core tokenizes what it admits (FrontCore.tokenize: the same checks,
the tenant's remembered replies, off the event loop), so the ids are those a completion or chat request with the
same prompt would submit (with the default flags). `model`, when sent, must be the served model. token_strs (only
with return_token_strs) are each id's text decoded alone, where vLLM shows the vocabulary's raw token strings.
Auth as on every route (a bearer token from --auth-tokens); errors are OpenAI's shape, 400 naming the field.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixcache.worker.engine.checks import FieldPath, InvalidArgument, check_token_ids
from radixcache.worker.front.core import Refusal
from radixcache.worker.front.validation import PromptInput
from radixcache.worker.http.errors import bad_request
from radixcache.worker.http.front import HttpFront
from radixcache.worker.http.json_body import ArrayRule
from radixcache.worker.http.openai.errors import api_error
from radixcache.worker.http.openai.requests import body_shape, chat_messages, shape_of
from radixcache.worker.http.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

TOKENS = FieldPath.of("tokens")


class TokenizeEndpoint:
    """The two routes over an HttpFront (its gates and body reading); app.create_app wires them."""

    def __init__(self, front: HttpFront) -> None:
        self.front = front

    async def tokenize(self, request: Request) -> Response:
        front = self.front
        tenant = front.tenant(request)
        engine = front.engine()
        body = await front.body(request, TokenizeRequest, body_shape(front.core.limits))
        self._check_common(body)
        prompt, param, options = self._prompt(body)
        try:
            ids, _ = await front.core.tokenize(prompt, tenant=tenant, **options)
        except Refusal as r:
            raise api_error(r, prompt_param=param) from None
        strs = None
        if body.return_token_strs:
            tokenizer = engine.tokenizer
            strs = await asyncio.to_thread(lambda: [tokenizer.decode([i], skip_special_tokens=False) for i in ids])
        reply = TokenizeResponse(
            count=len(ids), max_model_len=int(front.core.facts.context_length), tokens=ids, token_strs=strs
        )
        return JSONResponse(reply.model_dump(exclude_none=True))

    async def detokenize(self, request: Request) -> Response:
        front = self.front
        front.tenant(request)
        engine = front.engine()
        limits = front.core.limits
        # No list of ids longer than the context is a sequence this model holds: refused while it is parsed.
        shape = shape_of(limits, {("tokens",): ArrayRule(max(1, limits.context_length), "token ids")})
        body = await front.body(request, DetokenizeRequest, shape)
        self._check_common(body)
        try:
            check_token_ids(body.tokens, limits.vocab_size, TOKENS)
        except InvalidArgument as e:
            raise bad_request(str(e), str(e.field or TOKENS)) from None  # tokens[i], as pydantic's type errors
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise bad_request("tokens: this worker's model has no tokenizer to decode them with", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    def _check_common(self, body: TokenizeRequest | DetokenizeRequest) -> None:
        """No field this route does not serve; `model`, when sent, the served one."""
        for name in body.model_extra or {}:
            raise bad_request(f"{name} is not supported by this server", name)
        if body.model is not None:
            self.front.check_model(body.model)

    @staticmethod
    def _prompt(body: TokenizeRequest) -> tuple[PromptInput, str, dict[str, bool]]:
        """The prompt as the front core's plain value, the parameter its refusals name, and render's options."""
        if (body.prompt is None) == (body.messages is None):
            given = "both" if body.prompt is not None else "neither"
            raise bad_request(f"set exactly one of prompt or messages; got {given}", "prompt")
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            return PromptInput(text=body.prompt), "prompt", {"add_special_tokens": add_special}
        if body.add_special_tokens:
            raise bad_request(
                "add_special_tokens: with messages the chat template writes the special tokens; it must be false",
                "add_special_tokens",
            )
        options = {"add_generation_prompt": body.add_generation_prompt}
        return PromptInput(messages=chat_messages(body.messages)), "messages", options
