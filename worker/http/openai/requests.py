"""OpenAI request bodies -> the plain values worker/front/validation.py checks (the same rules as gRPC), plus the
parameters this front refuses: anything that would change the output and is not served gets 400 naming it.

No range rule lives here: a max_tokens of 0, a temperature of -1 or a role of "robot" are refused by validation,
with the message gRPC callers get.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixcache.worker.engine.request import MAX_CONSTRAINT_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from radixcache.worker.front.tool_calls import TOOL_CHOICE_MODES, ToolChoice, ToolSpec, template_tools
from radixcache.worker.front.validation import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_JSON_DEPTH,
    MAX_JSON_ITEMS,
    MAX_SCHEMA_BYTES,
    MAX_TOOL_ARGUMENTS_BYTES,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    MESSAGES,
    FieldPath,
    InvalidArgument,
    ModelLimits,
    PromptInput,
    SaltInput,
    SamplingValues,
    check_strict_schema,
    tool_call_arguments,
)
from radixcache.worker.http.errors import bad_request
from radixcache.worker.http.json_body import ArrayRule, BodyShape
from radixcache.worker.http.openai.protocol import ChatCompletionRequest, ChatMessageIn, CompletionRequest, Tool

# Accepted and ignored: they never change what is generated.
IGNORED_PARAMS = frozenset({"user", "store", "metadata", "service_tier", "safety_identifier"})
# prompt_cache_retention -> how long what a request computed stays pinned (inside the pin budget; None: not pinned).
# The disk tier (issue 25) will keep "24h" there instead, where one is configured.
RETENTION_S = {None: None, "in_memory": None, "24h": 24 * 3600.0}


def body_shape(limits: ModelLimits) -> BodyShape:
    """What a chat or completions body may hold, by validation's limits, checked while it is parsed (json_body):
    a body with more messages, tools, parts, stop strings or token ids than any request may have is refused before
    it is built, naming the field."""
    token_ids = ArrayRule(max(1, limits.max_prompt_tokens), "token ids")
    rules = {
        ("messages",): ArrayRule(MAX_CHAT_MESSAGES, "messages"),
        ("messages", "*", "content"): ArrayRule(MAX_CONTENT_PARTS, "content parts"),
        ("messages", "*", "tool_calls"): ArrayRule(MAX_TOOL_CALLS, "tool calls"),
        ("tools",): ArrayRule(MAX_TOOLS, "tools"),
        ("stop",): ArrayRule(MAX_STOP_STRINGS, "strings"),
        ("stop_token_ids",): ArrayRule(MAX_STOP_TOKEN_IDS, "ids"),
        ("prompt",): token_ids,  # or a batch of one prompt
        ("prompt", "*"): token_ids,
    }
    return shape_of(limits, rules)


def shape_of(limits: ModelLimits, rules: dict[tuple[str, ...], ArrayRule]) -> BodyShape:
    """A body shape with validation's depth, value-count and string-length limits (every route's) and a route's
    array rules. No string is longer than a prompt the context holds or a constraint, tool schema or tool call's
    arguments (validation's largest non-prompt strings), so a longer one is refused while it is parsed."""
    longest = None
    if limits.max_prompt_bytes is not None:  # characters <= UTF-8 bytes, so a longer string cannot fit
        longest = max(limits.max_prompt_bytes, MAX_CONSTRAINT_CHARS, MAX_SCHEMA_BYTES, MAX_TOOL_ARGUMENTS_BYTES)
    return BodyShape(
        max_depth=MAX_JSON_DEPTH,
        max_items=MAX_JSON_ITEMS + limits.context_length,
        rules=rules,
        max_string_chars=longest,
    )


@dataclass(frozen=True)
class ParsedRequest:
    """What a front handler needs from a chat or completions body."""

    prompt: PromptInput
    sampling: SamplingValues
    stream: bool
    include_usage: bool
    parse_tools: bool = False  # chat with tools (tool_choice "auto"): generated <tool_call> blocks become tool_calls
    tool_choice: ToolChoice = ToolChoice()
    max_tokens_param: str = "max_tokens"  # the field that set max_tokens, for error messages
    top_logprobs_param: str = "top_logprobs"
    # Structured output, as validation.constraint takes it: (kind, text), and the parameter that asked for it
    constraint: tuple[str | None, str] = (None, "")
    constraint_param: str = "response_format"
    cache_key: str = ""  # prompt_cache_key: Request.cache_key, the cluster router's hint
    retention_s: float | None = None  # prompt_cache_retention: pin the prompt and reply this long (None: not)
    keep: tuple[int | None, float | None] = (None, None)  # (priority, retention_seconds): soft retention
    salt: SaltInput | None = None  # cache_salt and its shared span (validation.check_cache_salt)


def salt_input(body: Any) -> SaltInput | None:
    """A body's cache_salt fields as sent (None when none is set)."""
    value = SaltInput(body.cache_salt, body.cache_salt_shared_tokens, body.cache_salt_share_system)
    return None if value == SaltInput() else value


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    for name in body.model_extra or {}:
        if name not in IGNORED_PARAMS:
            raise bad_request(f"{name} is not supported by this server", name)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def response_format(rf: dict[str, Any] | None, param: str = "response_format") -> tuple[str | None, str]:
    """response_format -> a constraint's (kind, text): text (none), json_object, or json_schema {"schema": ...};
    `strict: true` is OpenAI's strict mode (validation.check_strict_schema)."""
    kind = None if rf is None else rf.get("type")
    if kind in (None, "text"):
        return None, ""
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        assert rf is not None
        spec = rf.get("json_schema") if param == "response_format" else rf  # Responses' text.format is flat
        schema = spec.get("schema") if isinstance(spec, dict) else None
        where = f"{param}.json_schema" if param == "response_format" else param
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"{where}.schema must be a JSON schema (an object)", where)
        if isinstance(spec, dict) and spec.get("strict") is True:
            strict_schema(schema, f"{param} {spec.get('name', '')!r}", param)
        return "json_schema", json.dumps(schema)
    raise bad_request(f"{param}.type must be one of text, json_object, json_schema; got {kind!r}", param)


def strict_schema(schema: Any, owner: str, param: str) -> None:
    """validation.check_strict_schema, as a 400 naming `param`."""
    try:
        check_strict_schema(schema, owner)
    except InvalidArgument as e:
        raise bad_request(str(e), param) from None


def tool_specs(tools: list[Tool] | None) -> list[ToolSpec]:
    """Chat's tools -> ToolSpecs (a strict function's parameters are checked as OpenAI checks them)."""
    specs = []
    for i, tool in enumerate(tools or ()):
        f = tool.function
        if f.strict:
            strict_schema(f.parameters or {}, f"function {f.name!r}", f"tools[{i}].function.parameters")
        specs.append(ToolSpec(f.name, f.description, f.parameters, bool(f.strict)))
    return specs


def _named(entry: Any) -> str | None:
    """The function name of {"type": "function", "function": {"name"}} (chat) or {"type": "function", "name"}."""
    if not isinstance(entry, dict) or entry.get("type") != "function":
        return None
    function = entry.get("function", entry)
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def tool_choice(choice: Any, parallel: bool | None, specs: list[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice (chat's or the Responses API's shapes) -> a ToolChoice: "auto" | "none" | "required",
    a named function, or {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}} (chat; the Responses API
    writes mode and tools at the top level); parallel_tool_calls False: at most one call."""
    usage = f"{param} must be auto, none, required, a function ({{'type': 'function', ...}}) or allowed_tools"
    one = parallel is not False
    if choice is None or isinstance(choice, str):
        mode = choice or "auto"
        if mode not in TOOL_CHOICE_MODES:
            raise bad_request(f"{usage}; got {choice!r}", param)
        wanted = ToolChoice(mode, parallel=one)
    elif _named(choice) is not None:
        wanted = ToolChoice("required", (_named(choice),), parallel=one)  # type: ignore[arg-type]
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("allowed_tools", choice)
        entries = allowed.get("tools") if isinstance(allowed, dict) else None
        names = [_named(t) for t in entries] if isinstance(entries, list) else [None]
        mode = allowed.get("mode") if isinstance(allowed, dict) else None
        if mode not in ("auto", "required") or None in names:
            raise bad_request(
                f"{param}: allowed_tools takes a mode (auto or required) and tools [{{'type': 'function', ...}}]",
                param,
            )
        wanted = ToolChoice(mode, tuple(names), parallel=one)  # type: ignore[arg-type]
    else:
        raise bad_request(usage, param)
    problem = wanted.check(specs)
    if problem is not None:
        raise bad_request(f"{param} {problem}", param)
    return wanted


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _sampling(body: ChatCompletionRequest | CompletionRequest, **overrides: Any) -> SamplingValues:
    values: dict[str, Any] = {
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "stop": _stop(body.stop),
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": body.ignore_eos,
        "n": body.n,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "speculate": body.speculate,
    }
    values.update(overrides)
    return SamplingValues(**values)


def _content(message: ChatMessageIn, i: int) -> str:
    """A message's text: a string, or the concatenated text parts (other kinds of parts are not served)."""
    if message.content is None:
        return ""  # e.g. an assistant turn that only calls tools
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported, got "
                f"type {part.get('type')!r}",
                f"messages[{i}].content[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def template_arguments(raw: str) -> Any:
    """Tool-call arguments as chat templates expect them (an object), when the string is one; else as sent (text
    that is not JSON, or nests deeper than json.loads goes). For what the model generated; a client's: client_arguments."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def client_arguments(raw: str, param: FieldPath) -> Any:
    """A client's tool-call arguments, the field `param` (by the route's names; validation.tool_call_arguments:
    size-checked before they are parsed), or a 400 naming it."""
    try:
        return tool_call_arguments(raw, param)
    except InvalidArgument as e:
        raise bad_request(str(e), str(param)) from None


def chat_messages(messages: list[ChatMessageIn]) -> list[dict[str, Any]]:
    """The messages as chat templates read them (Hugging Face's shape): role, content, and for tool use
    tool_calls [{"id", "type", "function": {"name", "arguments": {...}}}] / tool_call_id / name."""
    out = []
    for i, m in enumerate(messages):
        if m.model_extra:
            name = next(iter(m.model_extra))
            raise bad_request(f"messages[{i}].{name} is not supported by this server", f"messages[{i}].{name}")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m, i)}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": client_arguments(
                            call.function.arguments, MESSAGES.at(i, "tool_calls", j, "function", "arguments")
                        ),
                    },
                }
                for j, call in enumerate(m.tool_calls)
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def parse_chat(body: ChatCompletionRequest) -> ParsedRequest:
    _refuse_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    specs = tool_specs(body.tools)
    choice = tool_choice(body.tool_choice, body.parallel_tool_calls, specs)
    forced = choice.constraint(specs)
    wanted = response_format(body.response_format)
    if forced[0] is not None and wanted[0] is not None:
        raise bad_request("set response_format or a forced tool_choice, not both", "response_format")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    sampling = _sampling(
        body,
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs,
        stop=_stop(body.stop) + tuple(s for s in choice.stop() if s not in _stop(body.stop)),
    )
    return ParsedRequest(
        prompt=PromptInput(messages=chat_messages(body.messages), tools=template_tools(specs)),
        sampling=sampling,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        parse_tools=choice.parses(specs),
        tool_choice=choice,
        max_tokens_param=max_param,
        constraint=forced if forced[0] is not None else wanted,
        constraint_param="tool_choice" if forced[0] is not None else "response_format",
        cache_key=body.prompt_cache_key or "",
        retention_s=RETENTION_S[body.prompt_cache_retention],
        keep=(body.priority, body.retention_seconds),
        salt=salt_input(body),
    )


def _completion_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> PromptInput:
    if isinstance(prompt, str):
        return PromptInput(text=prompt)
    if prompt and all(isinstance(p, int) for p in prompt):
        return PromptInput(token_ids=list(prompt))  # type: ignore[arg-type]
    if len(prompt) > 1:
        raise bad_request("prompt: a batch of prompts is not supported; send one prompt per request", "prompt")
    if not prompt:
        return PromptInput(token_ids=[])  # validation names what is missing
    (one,) = prompt
    return PromptInput(text=one) if isinstance(one, str) else PromptInput(token_ids=list(one))


def parse_completion(body: CompletionRequest) -> ParsedRequest:
    _refuse_unsupported(body)
    if body.echo:
        raise bad_request("echo is not supported by this server", "echo")
    if body.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of other than n is not supported by this server", "best_of")
    sampling = _sampling(
        body,
        logprobs=None if body.logprobs is None else True,
        top_logprobs=body.logprobs,
    )
    return ParsedRequest(
        prompt=_completion_prompt(body.prompt),
        sampling=sampling,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        top_logprobs_param="logprobs",
        constraint=response_format(body.response_format),
        keep=(body.priority, body.retention_seconds),
        salt=salt_input(body),
    )
