"""What an engine refuses at submit, before anything is allocated, and the errors every rule raises: the engine's
own checks (token ids in the vocabulary, the prompt and max_tokens inside the context, the request inside the KV
pool). The front's rule book (worker/front/validation.py) builds on these; an in-process caller that skips the
front still meets them here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radixcache.worker.engine.api import RequestTooLargeError
from radixcache.worker.engine.request import Request


class InvalidArgument(ValueError):
    """A request field is out of range; the message names it and the allowed range."""


class ContextOverflow(InvalidArgument):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context (fronts that have a code for it,
    as OpenAI's context_length_exceeded, tell it apart). The message ends with OpenAI's own sentence ("This model's
    maximum context length is N tokens."), which LangChain, LiteLLM and pydantic-ai look for before they trim or
    summarise a conversation. prompt_tokens / max_tokens: the exact figures, where known (fronts that quote them in
    their own words, as Anthropic's "prompt is too long: N tokens > M maximum")."""

    def __init__(
        self, message: str, context_length: int, *, prompt_tokens: int | None = None, max_tokens: int | None = None
    ) -> None:
        super().__init__(f"{message}. This model's maximum context length is {context_length} tokens.")
        self.context_length = context_length
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens


def check_token_ids(ids: Sequence[int], vocab_size: int, name: str) -> None:
    """Every id in [0, vocab_size); min/max first, so the common valid case costs no Python loop."""
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise InvalidArgument(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def check_prompt_length(num_tokens: int, context_length: int) -> None:
    if num_tokens < 1:
        raise InvalidArgument("the prompt encodes to no tokens")
    if num_tokens >= context_length:
        raise ContextOverflow(
            f"the prompt has {num_tokens} tokens; the context allows at most {context_length - 1} "
            f"(context length {context_length}, leaving room for one generated token)",
            context_length,
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
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )


class EngineGeometry(Protocol):
    """The facts of a host (an Engine, a FleetEngine) that decide what it can take."""

    vocab_size: int
    context_length: int
    page_size: int
    num_pages: int


def check_engine_request(request: Request, engine: EngineGeometry) -> None:
    """What an engine of this geometry refuses at submit, before anything is allocated: the same rules as the
    front's checks (a caller in process may skip those), plus the KV pool's size. InvalidArgument, or
    RequestTooLargeError for a request that can never fit in the pool. The cluster's FleetEngine runs it too, so
    a request is routed only if a replica would take it."""
    context_length, page_size, num_pages = engine.context_length, engine.page_size, engine.num_pages
    prompt = len(request.prompt_ids)
    check_token_ids(request.prompt_ids, engine.vocab_size, "token_ids.ids")
    check_token_ids(request.sampling.stop_token_ids, engine.vocab_size, "stop_token_ids")
    check_prompt_length(prompt, context_length)
    check_room(prompt, request.sampling.max_tokens, context_length)
    pages = -(-(prompt + request.sampling.max_tokens) // page_size)
    if pages > num_pages:
        raise RequestTooLargeError(
            f"prompt + max_tokens = {prompt + request.sampling.max_tokens} tokens need {pages} KV pages; "
            f"this worker has {num_pages} pages of {page_size} tokens"
        )
