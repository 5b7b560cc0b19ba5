"""Where a refused value sits in a request (FieldPath) and the error every rule raises about one (InvalidArgument,
and ContextOverflow for a prompt or max_tokens past the context). The bottom of the engine room: SamplingParams'
value rules (worker/engine/request.py), the engine's rules at submit (worker/engine/checks.py) and the front's
(worker/front/validation.py) all raise these, and import nothing to do it.

Every refusal names where it is: InvalidArgument.field, a FieldPath in the engine's names (gRPC's, which every
front's plain values keep). Each front maps it to its own API's names with a table (worker/grpc/servicer.py,
worker/http/openai/errors.py, worker/http/anthropic/errors.py); nobody reads a message to find the field."""

from __future__ import annotations

from dataclasses import dataclass


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
