"""What an engine refuses at submit, before anything is allocated: the engine's own checks (token ids in the
vocabulary, the prompt and max_tokens inside the context, the request inside the KV pool). They run once per request,
at submit (Engine.submit, FleetEngine.submit), whoever the caller is: the front core (worker/front/core.py) leaves
them to the engine, and an in-process caller that skips the front meets them here.

They raise what every rule raises (the front's in worker/front/validation.py, SamplingParams' own in request.py):
InvalidArgument naming the field, or ContextOverflow (worker/engine/field_errors.py, below request.py so that
SamplingParams can raise them too); RequestTooLargeError for a request that can never fit in the pool."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radixcache.worker.engine.api import RequestTooLargeError
from radixcache.worker.engine.field_errors import (
    PROMPT,
    STOP_TOKEN_IDS,
    TOKEN_IDS,
    ContextOverflow,
    FieldPath,
    InvalidArgument,
)
from radixcache.worker.engine.request import Request


def check_token_ids(ids: Sequence[int], vocab_size: int, field: FieldPath) -> None:
    """Every id in [0, vocab_size); min/max first, so the common valid case costs no Python loop. The first id
    outside is named: field[i]."""
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise InvalidArgument.at(field.at(i), f" = {t} is outside the vocabulary [0, {vocab_size})")


def check_prompt_length(num_tokens: int, context_length: int) -> None:
    """A prompt of num_tokens tokens: at least one, and room left in the context for one generated token."""
    if num_tokens < 1:
        raise InvalidArgument("the prompt encodes to no tokens", PROMPT)
    if num_tokens >= context_length:
        raise ContextOverflow(
            f"the prompt has {num_tokens} tokens; the context allows at most {context_length - 1} "
            f"(context length {context_length}, leaving room for one generated token)",
            context_length,
            PROMPT,
            prompt_tokens=num_tokens,
        )


def check_room(prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """prompt + max_tokens must fit the context."""
    room = context_length - prompt_tokens
    if max_tokens > room:
        raise ContextOverflow(
            f"max_tokens must be in [1, {room}]: the prompt has {prompt_tokens} tokens and the context "
            f"length is {context_length}; got {max_tokens}",
            context_length,
            FieldPath.of("max_tokens"),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )


class EngineGeometry(Protocol):
    """The facts of a host (an Engine, a FleetEngine) that decide what it can take (read only: attributes or
    properties)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...


def check_engine_request(request: Request, engine: EngineGeometry) -> None:
    """What an engine of this geometry refuses at submit, before anything is allocated: the prompt's length, its
    ids and the stop token ids in the vocabulary, max_tokens inside the context, and the request inside the KV
    pool. InvalidArgument, or RequestTooLargeError for a request that can never fit in the pool. These rules are
    decided here only: the front core leaves them to submit (it checks the values the engine does not see: text,
    messages, sampling values). The cluster's FleetEngine runs it too, so a request is routed only if a replica
    would take it."""
    context_length, page_size, num_pages = engine.context_length, engine.page_size, engine.num_pages
    prompt = len(request.prompt_ids)
    check_prompt_length(prompt, context_length)  # first: O(1), and it bounds the loop over the ids
    check_token_ids(request.prompt_ids, engine.vocab_size, TOKEN_IDS)
    check_token_ids(request.sampling.stop_token_ids, engine.vocab_size, STOP_TOKEN_IDS)
    check_room(prompt, request.sampling.max_tokens, context_length)
    pages = -(-(prompt + request.sampling.max_tokens) // page_size)
    if pages > num_pages:
        raise RequestTooLargeError(
            f"prompt + max_tokens = {prompt + request.sampling.max_tokens} tokens need {pages} KV pages; "
            f"this worker has {num_pages} pages of {page_size} tokens"
        )
