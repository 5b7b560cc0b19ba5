"""Decides what a request may contain, for every front (gRPC, OpenAI HTTP, in-process): plain Python values in,
a checked prompt and SamplingParams out, InvalidArgument (naming the field and the allowed range, its `field` a
FieldPath) otherwise.

Fronts translate their wire format into the plain values here (PromptInput, SamplingValues); the front core
(worker/front/core.py) runs each rule once per admission, in this order:
1. the cheap checks, in microseconds to milliseconds and before anything is tokenized or allocated:
   `check_request_id`, `check_prompt_input` (shape and sizes: a text that cannot fit the context, too many
   messages, too much chat content; it returns the CheckedPrompt that rendering takes), `sampling_params` (the value
   rules) and `constraint`;
2. `render` (the slow part: chat template + tokenizer; `render_off_loop` runs it in a worker thread), unchecked;
3. `fit_max_tokens`: an unset max_tokens once the prompt's length is known;
4. the engine's own rules at submit (worker/engine/checks.py: the prompt's length and ids, stop token ids, room in
   the context and the KV pool), which are decided there and nowhere else.

SamplingParams.__post_init__ holds the sampling rules that need nothing but the values (ranges, finiteness, counts);
the rules that need the model's vocabulary or context are the engine's; this module adds what only a front sees
(text, chat messages, tools, Unicode), so each rule lives in one place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixcache.retention import MAX_PRIORITY, MAX_RETENTION_SECONDS, Retention
from radixcache.worker.engine.checks import check_prompt_length, check_token_ids
from radixcache.worker.engine.field_errors import (
    CONSTRAINT,
    PROMPT,
    TOKEN_IDS,
    ContextOverflow,
    FieldPath,
    InvalidArgument,
)
from radixcache.worker.engine.request import (
    CONSTRAINT_KINDS,
    MAX_CONSTRAINT_CHARS,
    MAX_SCHEMA_DEPTH,
    Constraint,
    SamplingParams,
)
from radixcache.worker.front.generated import Reply, encode_rendered

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_KEY_CHARS = 256  # a routing hint (prompt_cache_key): hashed per routing decision
MAX_CHAT_MESSAGES = 1024  # (stop strings and stop token ids: request.py's SamplingParams has their limits)
MAX_TOOLS = 128  # tool (function) definitions of one request, as OpenAI allows
MAX_TOOL_CALLS = 64  # tool calls of one assistant message
MAX_TOOL_ARGUMENTS_BYTES = 1 << 16  # one tool call's arguments as JSON
MAX_CONTENT_PARTS = 64  # parts of one message's content (the HTTP front's [{"type": "text", "text": ...}, ...])
MAX_SCHEMA_BYTES = MAX_CONSTRAINT_CHARS  # one tool's parameters as compact JSON (a response format: the constraint's)
# A request body (HTTP) nests objects and arrays at most this deep (a schema inside it ~5 levels down), and holds at
# most this many JSON values and keys beside its prompt's token ids; both are checked while it is parsed
# (worker/http/json_body.py), so what a body costs to parse and validate is bounded by these, not by its size.
MAX_JSON_DEPTH = 2 * MAX_SCHEMA_DEPTH  # a refused schema is named by its own check
MAX_JSON_ITEMS = 1 << 15
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens
# The heads of the fields that fronts name as one parameter: the prompt (its kinds, and the prompt as a whole), and
# the structured-output constraint (its kinds, and the constraint as a whole).
PROMPT_FIELDS = frozenset({PROMPT.head, "text", TOKEN_IDS.head})
CONSTRAINT_FIELDS = frozenset({CONSTRAINT.head, *CONSTRAINT_KINDS})
MESSAGES = FieldPath.of("messages")
TOOLS = FieldPath.of("tools")
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))  # the values a front may set


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str: ...


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model; build it once per model with `of()`.

    max_bytes_per_token: at most this many UTF-8 bytes of input text become one token, so a text of B bytes encodes
    to at least ceil(B / max_bytes_per_token) tokens. None when the tokenizer gives no such bound (then sizes are
    only checked after tokenizing).
    """

    vocab_size: int
    context_length: int
    max_bytes_per_token: int | None = None

    @classmethod
    def of(cls, tokenizer: Any, *, vocab_size: int, context_length: int) -> ModelLimits:
        bound = getattr(tokenizer, "max_bytes_per_token", None) if tokenizer is not None else None
        return cls(vocab_size=vocab_size, context_length=context_length, max_bytes_per_token=bound)

    @property
    def max_prompt_tokens(self) -> int:
        return self.context_length - 1  # leaves room for one generated token

    @property
    def max_prompt_bytes(self) -> int | None:
        """The most UTF-8 bytes a text may have and still fit the context (None: unknown before tokenizing)."""
        return None if self.max_bytes_per_token is None else self.max_prompt_tokens * self.max_bytes_per_token


@dataclass(frozen=True)
class PromptInput:
    """A prompt as a front received it: exactly one of text, token ids or chat messages ({"role", "content"}).

    tools: with messages, the tool (function) definitions the chat template renders, as Hugging Face's
    apply_chat_template takes them ([{"type": "function", "function": {"name", "description", "parameters"}}]).
    """

    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None

    @property
    def kind(self) -> str | None:
        given = [k for k in ("text", "token_ids", "messages") if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidArgument(f"set exactly one of text, token_ids or messages; got {' and '.join(given)}", PROMPT)
        return given[0] if given else None


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt that passed check_prompt_input: what rendering reads, so that nothing is checked twice.

    kind: "text", "token_ids" or "messages". at_least_tokens: a lower bound on its length in tokens. messages: chat
    messages, checked and copied for the template (None for the other kinds)."""

    prompt: PromptInput
    kind: str
    at_least_tokens: int
    messages: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class PromptSize:
    """A prompt's size as read before its request is parsed (gRPC: off the wire bytes), for `check_prompt_size`.

    kind: "text" or "messages" (None: not known; nothing is checked). text_bytes: the text's UTF-8 size.
    messages: how many chat messages; content_bytes: their content's UTF-8 size in all.
    """

    kind: str | None
    text_bytes: int = 0
    messages: int = 0
    content_bytes: int = 0


@dataclass(frozen=True)
class SamplingValues:
    """A request's sampling fields as sent; None (or empty) = unset, which takes SamplingParams' default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    speculate: bool | None = None  # False: no draft tokens for this request


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument.at(
            FieldPath.of("request_id"), f" must have at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
        )
    _utf8_size(request_id, FieldPath.of("request_id"))


def check_cache_key(cache_key: str) -> None:
    """A request's routing hint (Request.cache_key): at most MAX_CACHE_KEY_CHARS characters of valid Unicode."""
    if len(cache_key) > MAX_CACHE_KEY_CHARS:
        raise InvalidArgument.at(
            FieldPath.of("cache_key"), f" must have at most {MAX_CACHE_KEY_CHARS} characters, got {len(cache_key)}"
        )
    _utf8_size(cache_key, FieldPath.of("cache_key"))


def retention(priority: int | None, retention_seconds: float | None) -> Retention | None:
    """A request's soft retention (radixcache.retention): `priority` 0..MAX_PRIORITY (0 or unset: none) with
    `retention_seconds` in (0, MAX_RETENTION_SECONDS]; one without the other names the missing one."""
    if priority is None and retention_seconds is None:
        return None
    if isinstance(priority, bool) or not isinstance(priority, int | None) or not 0 <= (priority or 0) <= MAX_PRIORITY:
        raise InvalidArgument.at(
            FieldPath.of("priority"), f" must be an integer in 0..{MAX_PRIORITY}, got {priority!r}"
        )
    if priority is None:
        raise InvalidArgument.at(FieldPath.of("priority"), " must be set with retention_seconds")
    if isinstance(retention_seconds, bool) or not isinstance(retention_seconds, int | float | None):
        raise InvalidArgument.at(FieldPath.of("retention_seconds"), f" must be a number, got {retention_seconds!r}")
    if retention_seconds is None:
        raise InvalidArgument.at(FieldPath.of("retention_seconds"), " must be set with priority")
    if not 0 < retention_seconds <= MAX_RETENTION_SECONDS:  # also refuses NaN and infinities
        raise InvalidArgument.at(
            FieldPath.of("retention_seconds"), f" must be in (0, {MAX_RETENTION_SECONDS:g}], got {retention_seconds}"
        )
    return Retention(priority, float(retention_seconds)) if priority else None


MAX_CACHE_SALT_CHARS = 256  # a cache salt (radixcache.salt): hashed once per lookup
MAX_SALT_SHARED_TOKENS = 1 << 31  # the unsalted span, in tokens (a count past the prompt only shares all of it)
CACHE_SALT = FieldPath.of("cache_salt")
SALT_SHARED_TOKENS = FieldPath.of("cache_salt_shared_tokens")
SALT_SHARE_SYSTEM = FieldPath.of("cache_salt_share_system")


@dataclass(frozen=True)
class SaltInput:
    """A request's cache salt as sent (any JSON or protobuf value; checked by check_cache_salt): the salt, and the
    leading span it leaves unsalted, either `shared_tokens` tokens or (`share_system`) the tokens of the prompt's
    leading system messages as the chat template renders them. None / False: unset."""

    salt: object = None
    shared_tokens: object = None
    share_system: object = False


@dataclass(frozen=True)
class CheckedSalt:
    """A valid salt: `shared_tokens` is the unsalted span's length, None when `share_system` says the front counts it
    from the rendered system messages."""

    salt: str
    shared_tokens: int | None
    share_system: bool


def check_cache_salt(value: SaltInput, prompt_kind: str) -> CheckedSalt | None:
    """A request's cache salt: a non-empty string of at most MAX_CACHE_SALT_CHARS characters of valid Unicode (None:
    no salt), with at most one of shared_tokens (an integer in [0, MAX_SALT_SHARED_TOKENS]) and share_system (a
    boolean, for chat messages only); either one without a salt is refused too, so a mistake never goes unsalted."""
    salt, shared, system = value.salt, value.shared_tokens, value.share_system
    if salt is None:
        if shared is not None or system:
            where = SALT_SHARED_TOKENS if shared is not None else SALT_SHARE_SYSTEM
            raise InvalidArgument.at(where, " needs a cache_salt")
        return None
    if not isinstance(salt, str) or not salt:
        raise InvalidArgument.at(CACHE_SALT, f" must be a non-empty string, got {type(salt).__name__} {salt!r:.40}")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument.at(CACHE_SALT, f" must have at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    _utf8_size(salt, CACHE_SALT)
    if not isinstance(system, bool):
        raise InvalidArgument.at(SALT_SHARE_SYSTEM, f" must be a boolean, got {type(system).__name__}")
    if shared is not None:
        if system:
            raise InvalidArgument.at(SALT_SHARED_TOKENS, " and cache_salt_share_system exclude each other: set one")
        if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= MAX_SALT_SHARED_TOKENS:
            raise InvalidArgument.at(
                SALT_SHARED_TOKENS, f" must be an integer in [0, {MAX_SALT_SHARED_TOKENS}], got {shared!r:.40}"
            )
        return CheckedSalt(salt, shared, False)
    if system and prompt_kind != "messages":
        raise InvalidArgument.at(SALT_SHARE_SYSTEM, f" needs chat messages, the prompt is {prompt_kind}")
    return CheckedSalt(salt, None if system else 0, system)


def system_span(checked: CheckedPrompt, tokenizer: TokenizerLike | None, ids: Sequence[int]) -> int:
    """The tokens of a chat prompt's leading system messages as its template renders them alone (without the
    generation prompt): the length of what that rendering has in common with the whole prompt's `ids`, so a
    template that writes them otherwise before a user turn never shares more than both have. Slow: off the loop."""
    system = list(itertools.takewhile(lambda m: m.get("role") == "system", checked.messages or []))
    if not system or tokenizer is None:
        return 0
    alone = dataclasses.replace(checked, messages=system)
    head, _ = render(alone, tokenizer, add_generation_prompt=False)
    n = 0
    for a, b in zip(head, ids, strict=False):
        if a != b:
            break
        n += 1
    return n


def check_ttl(ttl_seconds: float | None) -> None:
    """A pin's lifetime: unset (no expiry) or a finite number of seconds > 0."""
    if ttl_seconds is not None and not (ttl_seconds > 0 and math.isfinite(ttl_seconds)):
        raise InvalidArgument.at(
            FieldPath.of("ttl_seconds"), f" must be > 0 and finite (or unset: no expiry), got {ttl_seconds}"
        )


def _utf8_size(text: str, where: FieldPath) -> int:
    """len(text) in UTF-8; a lone surrogate (possible from JSON's \\ud800 escapes) is an InvalidArgument."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidArgument.at(where, f" is not valid Unicode: {e.reason} at character {e.start}") from None


def _over(num_bytes: int, limits: ModelLimits) -> bool:
    return limits.max_prompt_bytes is not None and num_bytes > limits.max_prompt_bytes


def _at_least_tokens(num_bytes: int, limits: ModelLimits) -> int:
    if limits.max_bytes_per_token is None:
        return 1
    return -(-num_bytes // limits.max_bytes_per_token)


def chat_messages(messages: Sequence[Mapping[str, Any]], limits: ModelLimits) -> list[dict[str, Any]]:
    """[{"role", "content", ...}] checked (count, roles, content type, total size) and copied for the template."""
    if not messages:
        raise InvalidArgument.at(MESSAGES, " must hold at least one message")
    check_message_count(len(messages), limits)
    out = []
    chars = 0
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise InvalidArgument.at(MESSAGES.at(i, "role"), f" must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        if not isinstance(content, str):
            raise InvalidArgument.at(MESSAGES.at(i, "content"), f" must be a string, got {type(content).__name__}")
        _message_fields(m, MESSAGES.at(i))
        chars += len(content)
        out.append(dict(m))
    # Characters <= UTF-8 bytes: too many characters is too many bytes, without encoding megabytes to count them.
    size = (
        chars
        if _over(chars, limits)
        else sum(_utf8_size(m["content"], MESSAGES.at(i, "content")) for i, m in enumerate(out))
    )
    check_content_bytes(size, limits)
    return out


def check_message_count(count: int, limits: ModelLimits) -> None:
    """At most MAX_CHAT_MESSAGES messages, and fewer than the context has tokens."""
    most = min(MAX_CHAT_MESSAGES, limits.max_prompt_tokens)
    if count > most:
        raise InvalidArgument.at(MESSAGES, f" must hold at most {most} messages, got {count}")


def check_content_bytes(size: int, limits: ModelLimits) -> None:
    """Chat messages' content of `size` UTF-8 bytes in all can fit the context."""
    if _over(size, limits):
        raise ContextOverflow(
            f"messages hold at least {size} bytes of content; a prompt that fits the context "
            f"({limits.max_prompt_tokens} tokens) holds at most {limits.max_prompt_bytes} bytes with this model's "
            "tokenizer",
            limits.context_length,
            MESSAGES,
        )


def _message_fields(message: Mapping[str, Any], where: FieldPath) -> None:
    """A message's fields beside role and content (tool use: name, tool_call_id, tool_calls) are valid text."""
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            _utf8_size(message[key], where.at(key))
    calls = message.get("tool_calls") or ()
    if len(calls) > MAX_TOOL_CALLS:
        raise InvalidArgument.at(
            where.at("tool_calls"), f" must hold at most {MAX_TOOL_CALLS} tool calls, got {len(calls)}"
        )
    for j, call in enumerate(calls):
        if isinstance(call.get("id"), str):
            _utf8_size(call["id"], where.at("tool_calls", j, "id"))
        function = call.get("function") or {}
        if isinstance(function.get("name"), str):
            _utf8_size(function["name"], where.at("tool_calls", j, "function", "name"))
        if "arguments" in function:  # JSON text, or the object it holds
            arguments = where.at("tool_calls", j, "function", "arguments")
            _tool_arguments_size(_json_size(function["arguments"], arguments), arguments)


def _tool_arguments_size(size: int, where: FieldPath) -> None:
    if size > MAX_TOOL_ARGUMENTS_BYTES:
        raise InvalidArgument.at(where, f" must have at most {MAX_TOOL_ARGUMENTS_BYTES} bytes as JSON, got {size}")


def tool_call_arguments(text: str, where: FieldPath) -> Any:
    """A tool call's arguments (JSON text, as OpenAI sends them) as chat templates expect them: the object the text
    holds, or the text itself when it is not JSON. Its size is checked before it is parsed."""
    _tool_arguments_size(len(text), where)  # characters <= bytes: a cheap first bound
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json.loads goes
        return text


def check_tools(tools: Sequence[Mapping[str, Any]]) -> None:
    """Tool definitions: at most MAX_TOOLS, names and descriptions valid text, parameters at most MAX_SCHEMA_BYTES
    of JSON."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument.at(TOOLS, f" must hold at most {MAX_TOOLS} tools, got {len(tools)}")
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        for key in ("name", "description"):
            if isinstance(function.get(key), str):
                _utf8_size(function[key], TOOLS.at(i, "function", key))
        if function.get("parameters") is not None:
            parameters = TOOLS.at(i, "function", "parameters")
            size = _json_size(function["parameters"], parameters)
            if size > MAX_SCHEMA_BYTES:
                raise InvalidArgument.at(parameters, f" must have at most {MAX_SCHEMA_BYTES} bytes as JSON, got {size}")


def _json_size(value: Any, where: FieldPath) -> int:
    """The UTF-8 size of `value` as compact JSON (a string as itself); a lone surrogate anywhere in it is an
    InvalidArgument naming `where`."""
    if isinstance(value, str):
        return _utf8_size(value, where)
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidArgument.at(where, f" must be JSON: {e}") from None
    return _utf8_size(text, where)


def check_prompt_input(prompt: PromptInput, tokenizer: TokenizerLike | None, limits: ModelLimits) -> CheckedPrompt:
    """The cheap checks of a prompt, before any tokenizing: what is missing or empty, chat messages and tools, and
    anything whose size alone proves it cannot fit the context (a text of B bytes has at least
    ceil(B / max_bytes_per_token) tokens; token ids are counted, never read: their values are the engine's to check,
    at submit, or `check_prompt_ids` where nothing is submitted). Returns the CheckedPrompt that `render` takes.
    """
    kind = prompt.kind
    if kind is None:
        raise InvalidArgument("no input: set exactly one of text, token_ids or messages", PROMPT)
    if kind != "token_ids" and tokenizer is None:
        raise InvalidArgument.at(FieldPath.of(kind), ": this worker's model has no tokenizer; send token_ids instead")
    if kind == "token_ids":
        ids = prompt.token_ids or ()
        if not ids:
            raise InvalidArgument.at(TOKEN_IDS, " must hold at least one token")
        # The length first, so that an id list the context cannot hold is never copied (the engine checks it again
        # at submit: O(1)).
        check_prompt_length(len(ids), limits.context_length)
        return CheckedPrompt(prompt, kind, len(ids))
    if kind == "messages":
        messages = chat_messages(prompt.messages or (), limits)
        check_tools(prompt.tools or ())
        return CheckedPrompt(prompt, kind, 1, messages)  # a template may drop or trim content: no tighter bound
    text = prompt.text or ""
    if not text:
        raise InvalidArgument.at(FieldPath.of("text"), " must not be empty")
    num_bytes = len(text) if _over(len(text), limits) else _utf8_size(text, FieldPath.of("text"))  # chars <= bytes
    return CheckedPrompt(prompt, kind, check_text_bytes(num_bytes, limits))


def check_prompt_size(size: PromptSize, limits: ModelLimits) -> None:
    """The size rules of check_prompt_input, on sizes alone: a prompt refused here would be refused there with the
    same error, only later (after megabytes were parsed and decoded). Passing says nothing: check it in full."""
    if size.kind == "text":
        check_text_bytes(size.text_bytes, limits)
    elif size.kind == "messages":
        check_message_count(size.messages, limits)
        check_content_bytes(size.content_bytes, limits)


def check_text_bytes(num_bytes: int, limits: ModelLimits) -> int:
    """A text of `num_bytes` UTF-8 bytes can fit the context; returns the fewest tokens it can have."""
    at_least = _at_least_tokens(num_bytes, limits)
    if at_least > limits.max_prompt_tokens:
        raise ContextOverflow(
            f"text has at least {num_bytes} bytes, so at least {at_least} tokens with this model's tokenizer (at most "
            f"{limits.max_bytes_per_token} bytes per token); the context allows at most {limits.max_prompt_tokens} "
            f"prompt tokens (at most {limits.max_prompt_bytes} bytes)",
            limits.context_length,
            FieldPath.of("text"),
        )
    return at_least


def render(
    checked: CheckedPrompt,
    tokenizer: TokenizerLike | None,
    replies: Mapping[int, Reply] | None = None,
    *,
    add_special_tokens: bool = True,
    add_generation_prompt: bool = True,
) -> tuple[list[int], str]:
    """The token ids of a checked prompt, and the text they encode ("" for token ids). Slow: run it off the event
    loop (render_off_loop). Checks nothing more than that the chat template renders the messages.

    Chat messages are rendered with the model's chat template plus the assistant's generation prompt; the template
    writes the special tokens (BOS) itself, so the rendered text is encoded without adding them again. `replies`
    (message index -> remembered generation, worker/front/generated.py): those assistant turns keep the ids the model
    generated where the template wrote their exact text. The length is not checked against the context: Tokenize
    reports any length, and an admitted prompt meets the engine's check at submit. add_special_tokens (text only) and
    add_generation_prompt (messages only) are for a front that only tokenizes (vLLM's /tokenize): what is admitted
    is always rendered with both.
    """
    if checked.kind == "token_ids":
        return list(checked.prompt.token_ids or ()), ""
    assert tokenizer is not None  # check_prompt_input refuses text and messages without one
    if checked.kind == "text":
        text = checked.prompt.text or ""
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens)), text
    messages, render_messages = chat_renderer(checked, tokenizer, add_generation_prompt=add_generation_prompt)
    rendered = render_chat(render_messages, messages)
    return encode_rendered(tokenizer, rendered, render_messages, messages, replies or {}), rendered


def render_prompt(
    prompt: PromptInput,
    tokenizer: TokenizerLike | None,
    limits: ModelLimits,
    replies: Mapping[int, Reply] | None = None,
) -> tuple[list[int], str]:
    """check_prompt_input, then render: for a caller that has a prompt to check and render in one go."""
    return render(check_prompt_input(prompt, tokenizer, limits), tokenizer, replies)


def chat_renderer(
    checked: CheckedPrompt, tokenizer: TokenizerLike, *, add_generation_prompt: bool = True
) -> tuple[list[dict[str, Any]], Callable[[list[dict[str, Any]]], str]]:
    """A checked chat prompt's messages, and the function that renders a conversation with the model's template
    (generation prompt included unless add_generation_prompt is false, the prompt's tools as the template's
    `tools`)."""
    assert checked.messages is not None, "a chat prompt"
    tools = checked.prompt.tools
    variables = {"tools": list(tools)} if tools else {}

    def render_messages(conversation: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **variables)

    return checked.messages, render_messages


def render_chat(render_messages: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]]) -> str:
    """render_messages(messages), the template's refusal as an InvalidArgument naming messages."""
    try:
        return render_messages(messages)
    except Exception as e:  # no template (ValueError), or the template rejects the conversation (TemplateError)
        raise InvalidArgument.at(MESSAGES, f": the model's chat template cannot render them: {e}") from e


async def render_off_loop(
    checked: CheckedPrompt, tokenizer: TokenizerLike | None, replies: Mapping[int, Reply] | None = None, **options: bool
) -> tuple[list[int], str]:
    """render, for a front's event loop: in a worker thread, so a long text or chat template never stalls other
    streams; token ids in place (nothing to tokenize, and a thread hop would only add latency). options: render's
    add_special_tokens / add_generation_prompt."""
    if checked.kind == "token_ids":
        return render(checked, tokenizer)
    work = functools.partial(render, checked, tokenizer, replies, **options)
    return await asyncio.get_running_loop().run_in_executor(None, work)


def check_prompt_ids(checked: CheckedPrompt, ids: Sequence[int], limits: ModelLimits, *, fit: bool) -> None:
    """The engine's prompt rules (worker/engine/checks.py), for a prompt that is not submitted (Tokenize, pins):
    token ids sent by the client in the vocabulary, and with fit, a length that leaves room to generate. An admitted
    prompt meets them at submit instead."""
    if checked.kind == "token_ids":
        check_token_ids(ids, limits.vocab_size, TOKEN_IDS)
    if fit:
        check_prompt_length(len(ids), limits.context_length)


def sampling_params(values: SamplingValues, limits: ModelLimits) -> SamplingParams:
    """SamplingParams from a request's sampling values (unset values take SamplingParams' defaults), every value
    rule run once: SamplingParams' own, then the stop strings' Unicode. Cheap: call it before tokenizing.

    An unset max_tokens is min(default, what the shortest prompt leaves of the context) until fit_max_tokens gives it
    its value with the prompt's length. The rules that need that length (room in the context, the KV pool) and the
    vocabulary (stop_token_ids) are the engine's, checked at submit.
    """
    kwargs: dict[str, Any] = {"stop": tuple(values.stop), "stop_token_ids": tuple(values.stop_token_ids)}
    for name in _SAMPLING_FIELDS:
        value = getattr(values, name, None)
        if value is not None and name not in kwargs:
            kwargs[name] = value
    kwargs.setdefault("max_tokens", max(1, min(DEFAULT_MAX_TOKENS, limits.max_prompt_tokens)))
    params = SamplingParams(**kwargs)  # InvalidArgument naming the field and the range
    # After SamplingParams has bounded their counts:
    for i, s in enumerate(params.stop):
        _utf8_size(s, FieldPath.of("stop", i))
    return params


def fit_max_tokens(
    params: SamplingParams, values: SamplingValues, prompt_tokens: int, limits: ModelLimits, *, up_to: int | None = None
) -> SamplingParams:
    """An unset max_tokens, once the prompt's length is known: min(default, what the context leaves), or with up_to
    (the most tokens a request may hold, e.g. the KV pool's: OpenAI chat's default) as long as the reply can be;
    never below 1 (a prompt that fills the context is refused at submit, naming the prompt). A max_tokens that was
    set is kept: whether it fits is the engine's rule (check_room). SamplingParams is frozen and checks itself, so a
    changed max_tokens is one more construction, only when it differs."""
    if values.max_tokens is not None:
        return params
    room = (limits.context_length if up_to is None else min(limits.context_length, up_to)) - prompt_tokens
    max_tokens = max(1, room if up_to is not None else min(DEFAULT_MAX_TOKENS, room))
    return params if max_tokens == params.max_tokens else dataclasses.replace(params, max_tokens=max_tokens)


def constraint(kind: str | None, text: str = "") -> Constraint | None:
    """A structured-output constraint from a front's plain values: kind one of request.CONSTRAINT_KINDS (None: no
    constraint), text the JSON schema (JSON text), regex or grammar ("" for json_object). Refusals name the kind
    (the request's field), or CONSTRAINT for a kind that is none of them.

    Checks what needs no tokenizer (non-empty, size, the schema is JSON); whether it compiles is checked next by
    Engine.compile_constraint (ConstraintError, also a ValueError), still before anything is allocated.
    """
    if kind is None:
        return None
    where = FieldPath.of(kind) if kind in CONSTRAINT_KINDS else CONSTRAINT
    try:
        wanted = Constraint(kind, text)  # first: it bounds the size
    except ValueError as e:  # Constraint names the field and the limit
        raise InvalidArgument(str(e), where) from e
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgument.at(where, f" is not valid JSON: {e}") from e
        except RecursionError:
            raise InvalidArgument.at(where, " is nested too deeply") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument.at(where, f" must be a JSON object, got a JSON {type(schema).__name__}")
        depth = json_depth(schema, MAX_SCHEMA_DEPTH)
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidArgument.at(where, f" nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays")
        if isinstance(schema, dict) and "x-guidance" in schema:
            # The server's grammar options (one-line JSON layout, no free whitespace) hold for every request; a
            # schema that asks for others is refused rather than silently served differently than it asks.
            raise InvalidArgument.at(where, ': "x-guidance" (grammar options) is set by the server, not the schema')
    return wanted


def json_depth(value: Any, limit: int) -> int:
    """How deeply `value` (parsed JSON) nests lists and dicts (a scalar: 0, [] or {}: 1), counted up to limit + 1:
    iterative, so a hostile depth costs no recursion and stops at the first path past the limit."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def check_strict_schema(schema: Any, owner: str) -> None:
    """OpenAI's strict mode (`strict: true` on a json_schema response format or a function): every object schema
    says `additionalProperties: false` and lists each of its properties in `required`. InvalidArgument naming the
    rule and where it is broken, in OpenAI's words ("Invalid schema for response_format 'person': In
    context=('properties', 'address'), ..."); `owner` names the schema ("response_format 'person'")."""

    def visit(node: Any, context: tuple[Any, ...]) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                visit(item, (*context, i))
            return
        if not isinstance(node, dict):
            return
        is_object = node.get("type") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"])
        if is_object or "properties" in node:
            where = f"Invalid schema for {owner}: In context={context!r}"
            if node.get("additionalProperties") is not False:
                raise InvalidArgument(f"{where}, 'additionalProperties' is required to be supplied and to be false.")
            properties = node.get("properties") or {}
            required = node.get("required")
            missing = [k for k in properties if not isinstance(required, list) or k not in required]
            if missing:
                raise InvalidArgument(
                    f"{where}, 'required' is required to be supplied and to be an array including every key in "
                    f"properties. Missing {missing[0]!r}."
                )
            extra = [k for k in required or () if k not in properties]
            if extra:
                raise InvalidArgument(f"{where}, 'required' names {extra[0]!r}, which is not in properties.")
        for key in ("properties", "$defs", "definitions", "patternProperties"):
            for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
                visit(sub, (*context, key, name))
        for key in ("items", "prefixItems", "anyOf", "allOf", "oneOf", "not", "additionalProperties"):
            if key in node:
                visit(node[key], (*context, key))

    visit(schema, ())
