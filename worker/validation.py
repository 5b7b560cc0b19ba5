"""Turns wire requests into engine requests, rejecting bad input before anything is allocated.

Every check raises InvalidArgument with a message that names the field and the allowed range; the server maps it to
INVALID_ARGUMENT. SamplingParams repeats the sampling checks (so in-process callers get the same messages); the ones
here need what only the server knows: the vocabulary, the context length and the prompt's length.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from radixcache.worker.request import Constraint, SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_CHARS = 128
MAX_CHAT_MESSAGES = 4096
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens


class InvalidArgument(ValueError):
    """A request field is out of range; the message names it and the allowed range."""


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id must have at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """ChatMessages -> [{"role", "content"}], checking the roles."""
    items = list(messages.messages)
    if not items:
        raise InvalidArgument("messages must hold at least one message")
    if len(items) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(f"messages must hold at most {MAX_CHAT_MESSAGES} messages, got {len(items)}")
    out = []
    for i, m in enumerate(items):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}")
        out.append({"role": m.role, "content": m.content})
    return out


def render_prompt(message: Any, tokenizer: TokenizerLike | None, vocab_size: int) -> tuple[list[int], str]:
    """The token ids of a request's `input` oneof (text | token_ids | messages), and the text they encode.

    Chat messages are rendered with the model's chat template plus the assistant's generation prompt; the template
    writes the special tokens (BOS) itself, so the rendered text is encoded without adding them again.
    """
    kind = message.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("no input: set exactly one of text, token_ids or messages")
    if kind != "token_ids" and tokenizer is None:
        raise InvalidArgument(f"{kind}: this worker's model has no tokenizer; send token_ids instead")
    if kind == "text":
        if not message.text:
            raise InvalidArgument("text must not be empty")
        return list(tokenizer.encode(message.text)), message.text
    if kind == "token_ids":
        ids = list(message.token_ids.ids)
        if not ids:
            raise InvalidArgument("token_ids.ids must hold at least one token")
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise InvalidArgument(f"token_ids.ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
        return ids, ""
    messages = chat_messages(message.messages)
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # no template (ValueError), or the template rejects the conversation (TemplateError)
        raise InvalidArgument(f"messages: the model's chat template cannot render them: {e}") from e
    return list(tokenizer.encode(rendered, add_special_tokens=False)), rendered


def check_prompt_length(num_tokens: int, context_length: int) -> None:
    if num_tokens < 1:
        raise InvalidArgument("the prompt encodes to no tokens")
    if num_tokens >= context_length:
        raise InvalidArgument(
            f"the prompt has {num_tokens} tokens; the context allows at most {context_length - 1} "
            f"(context length {context_length}, leaving room for one generated token)"
        )


def sampling_params(request: Any, *, prompt_tokens: int, context_length: int, vocab_size: int) -> SamplingParams:
    """SamplingParams from a GenerateRequest's optional fields; unset fields take SamplingParams' defaults.

    max_tokens unset: min(default, what is left of the context). max_tokens set beyond what is left: an error.
    """
    room = context_length - prompt_tokens
    if request.HasField("max_tokens"):
        max_tokens = request.max_tokens
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise InvalidArgument(
                f"max_tokens must be in [1, {room}]: the prompt has {prompt_tokens} tokens and the context "
                f"length is {context_length}; got {max_tokens}"
            )
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    for i, t in enumerate(request.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stop": tuple(request.stop),
        "stop_token_ids": tuple(request.stop_token_ids),
    }
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "logprobs", "top_logprobs"):
        if request.HasField(name):
            kwargs[name] = getattr(request, name)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # SamplingParams' messages already name the field and the range
        raise InvalidArgument(str(e)) from e


def constraint(request: Any) -> Constraint | None:
    """A GenerateRequest's `constraint` oneof as a Constraint (None when unset or json_object is false).

    Checks what needs no tokenizer (non-empty, size, the schema is JSON); whether it compiles is checked next by
    Engine.compile_constraint, still before anything is allocated.
    """
    kind = request.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not request.json_object):
        return None
    text = "" if kind == "json_object" else getattr(request, kind)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"json_schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(f"json_schema must be a JSON object, got a JSON {type(schema).__name__}")
    try:
        return Constraint(kind, text)
    except ValueError as e:  # Constraint names the field and the limit
        raise InvalidArgument(str(e)) from e
