"""OpenAI request bodies -> the plain values worker/validation.py checks (the same rules as gRPC), plus the
parameters this front refuses: anything that would change the output and is not served gets 400 naming it.

No range rule lives here: a max_tokens of 0, a temperature of -1 or a role of "robot" are refused by validation,
with the message gRPC callers get.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixcache.worker.openai.errors import bad_request
from radixcache.worker.openai.protocol import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from radixcache.worker.openai.tool_calls import tool_call_grammar
from radixcache.worker.validation import PromptInput, SamplingValues

# Accepted and ignored: they never change what is generated.
IGNORED_PARAMS = frozenset(
    {"user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"}
)
TOOL_CHOICES = ("auto", "none", "required")  # or {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True)
class ParsedRequest:
    """What a front handler needs from a chat or completions body."""

    prompt: PromptInput
    sampling: SamplingValues
    stream: bool
    include_usage: bool
    parse_tools: bool = False  # chat with tools (tool_choice "auto"): generated <tool_call> blocks become tool_calls
    max_tokens_param: str = "max_tokens"  # the field that set max_tokens, for error messages
    top_logprobs_param: str = "top_logprobs"
    # Structured output, as validation.constraint takes it: (kind, text), and the parameter that asked for it
    constraint: tuple[str | None, str] = (None, "")
    constraint_param: str = "response_format"


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    for name in body.model_extra or {}:
        if name not in IGNORED_PARAMS:
            raise bad_request(f"{name} is not supported by this server", name)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def _response_format(body: ChatCompletionRequest | CompletionRequest) -> tuple[str | None, str]:
    """response_format -> a constraint's (kind, text): text (none), json_object, or json_schema {"schema": ...}."""
    rf = body.response_format
    kind = None if rf is None else rf.get("type")
    if kind in (None, "text"):
        return None, ""
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema (an object)", "response_format.json_schema"
            )
        return "json_schema", json.dumps(schema)
    raise bad_request(
        f"response_format.type must be one of text, json_object, json_schema; got {kind!r}", "response_format"
    )


def _tool_choice(body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> tuple[str | None, str]:
    """tool_choice "required" / {"type": "function", "function": {"name"}} -> a constraint forcing one tool call."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None, ""
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request(
                "tool_choice must be auto, none, required or {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
    elif choice not in TOOL_CHOICES:
        raise bad_request(
            f"tool_choice must be auto, none, required or a named function; got {choice!r}", "tool_choice"
        )
    if not tools:
        raise bad_request("tool_choice requires tools", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among tools", "tool_choice")
    if body.response_format is not None and _response_format(body)[0] is not None:
        raise bad_request("set response_format or a forced tool_choice, not both", "response_format")
    return "ebnf", tool_call_grammar(tools, name)


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


def _arguments(raw: str) -> Any:
    """Tool-call arguments as chat templates expect them (an object), when the string is one; else as sent."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


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
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def parse_chat(body: ChatCompletionRequest) -> ParsedRequest:
    _refuse_unsupported(body)
    choice = body.tool_choice
    if body.parallel_tool_calls is False:
        raise bad_request("parallel_tool_calls=false is not supported by this server", "parallel_tool_calls")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    sampling = _sampling(
        body,
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs,
    )
    return ParsedRequest(
        prompt=PromptInput(messages=chat_messages(body.messages), tools=tools),
        sampling=sampling,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        parse_tools=bool(tools) and choice != "none",
        max_tokens_param=max_param,
        **_constraint(body, tools),
    )


def _constraint(body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    forced = _tool_choice(body, tools)
    if forced[0] is not None:
        return {"constraint": forced, "constraint_param": "tool_choice"}
    return {"constraint": _response_format(body)}


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
        constraint=_response_format(body),
    )
