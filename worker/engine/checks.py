"""What an engine refuses at submit, before anything is allocated, and the errors every rule raises: the engine's
own checks (token ids in the vocabulary, the prompt and max_tokens inside the context, the request inside the KV
pool). They run once per request, at submit (Engine.submit, FleetEngine.submit), whoever the caller is: the front
core (worker/front/core.py) leaves them to the engine, and an in-process caller that skips the front meets them
here. The front's own rules (worker/front/validation.py) raise the same errors.

Every refusal names where it is: InvalidArgument.field, a FieldPath in the engine's names (gRPC's, which every
front's plain values keep). Each front maps it to its own API's names with a table (worker/grpc/servicer.py,
worker/http/openai/errors.py, worker/http/anthropic/errors.py); nobody reads a message to find the field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from radixcache.worker.engine.api import RequestTooLargeError
from radixcache.worker.engine.request import Request


@dataclass(frozen=True)
class FieldPath:
    """Where a value sits in a request: names and list indexes from the request's top, in the engine's names.
    FieldPath.of("messages", 0, "content") reads `messages[0].content`; the head ("messages") is what fronts rename.
    Two names stand for more than one field: PROMPT, the prompt as a whole (the input: text, token ids or messages),
    and CONSTRAINT, the structured-output constraint as a whole (its members are named by their kind)."""

    parts: tuple[str | int, ...]

    @classmethod
    def of(cls, *parts: str | int) -> FieldPath:
        return cls(parts)

    @property
    def head(self) -> str:
        return str(self.parts[0])

    def at(self, *more: str | int) -> FieldPath:
        """A field inside this one: TOKEN_IDS.at(3) is token_ids.ids[3]."""
        return FieldPath(self.parts + more)

    def with_head(self, *head: str | int) -> FieldPath:
        """The same path under another head (a front's own name): messages[0].content -> messages.messages[0].content
        with head ("messages", "messages")."""
        return FieldPath(head + self.parts[1:])

    def __str__(self) -> str:
        out = ""
        for part in self.parts:
            out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
        return out


PROMPT = FieldPath.of("prompt")
CONSTRAINT = FieldPath.of("constraint")
TOKEN_IDS = FieldPath.of("token_ids", "ids")
STOP_TOKEN_IDS = FieldPath.of("stop_token_ids")


class InvalidArgument(ValueError):
    """A request field is out of range; the message names it and the allowed range, `field` says where it is (None:
    the request as a whole). Made with `at(field, says)`, the message is the field's name then `says`, kept apart so
    that a front that calls the field otherwise can say the same in its own words (`worded`)."""

    def __init__(self, message: str, field: FieldPath | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.says: str | None = None  # the message after the field's name, when it begins with it

    @classmethod
    def at(cls, field: FieldPath, says: str) -> InvalidArgument:
        """`field`'s name followed by `says` (" must be >= 1, got 0")."""
        error = cls(f"{field}{says}", field)
        error.says = says
        return error

    def worded(self, name: str) -> str:
        """The message with the field called `name`, where the message begins with the field; else as it is."""
        return str(self) if self.says is None else name + self.says


class ContextOverflow(InvalidArgument):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context (fronts that have a code for it,
    as OpenAI's context_length_exceeded, tell it apart). The message ends with OpenAI's own sentence ("This model's
    maximum context length is N tokens."), which LangChain, LiteLLM and pydantic-ai look for before they trim or
    summarise a conversation. prompt_tokens / max_tokens: the exact figures, where known (fronts that quote them in
    their own words, as Anthropic's "prompt is too long: N tokens > M maximum")."""

    def __init__(
        self,
        message: str,
        context_length: int,
        field: FieldPath,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__(f"{message}. This model's maximum context length is {context_length} tokens.", field)
        self.context_length = context_length
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens


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
