"""Responses API request bodies -> the plain values the front core takes: input items as chat messages (Hugging
Face's shape, what chat templates render), tools as ToolSpecs, tool_choice as a ToolChoice, text.format as a
constraint, and sampling values. Anything that would change the output and is not served gets 400 naming it.

Items: a string is one user message; a list holds messages (role user / system / developer / assistant, content a
string or input_text / output_text parts), function_call items (they join the assistant turn before them, as the
model wrote them: content, then calls) and function_call_output items (tool messages). Reasoning items are skipped
(this worker never writes them; the Agents SDK may send some back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixcache.worker.front.tool_calls import ToolChoice, ToolSpec
from radixcache.worker.front.validation import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_TOOLS,
    FieldPath,
    ModelLimits,
    SaltInput,
    SamplingValues,
)
from radixcache.worker.http.errors import bad_request
from radixcache.worker.http.json_body import ArrayRule, BodyShape
from radixcache.worker.http.openai.requests import (
    RETENTION_S,
    client_arguments,
    response_format,
    salt_input,
    shape_of,
    strict_schema,
    tool_choice,
)
from radixcache.worker.http.openai.responses_protocol import ResponsesRequest

# Accepted and ignored: they never change what is generated here.
IGNORED = frozenset({"user", "safety_identifier", "service_tier", "metadata", "include", "stream_options"})
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def responses_body_shape(limits: ModelLimits) -> BodyShape:
    """What a Responses body may hold (requests.body_shape's rules, by the Responses API's field names), checked
    while it is parsed: input items, their content parts, tools."""
    rules = {
        # messages, and the function_call items that join an assistant turn (the messages are counted again later)
        ("input",): ArrayRule(2 * MAX_CHAT_MESSAGES, "input items"),
        ("input", "*", "content"): ArrayRule(MAX_CONTENT_PARTS, "content parts"),
        ("tools",): ArrayRule(MAX_TOOLS, "tools"),
    }
    return shape_of(limits, rules)


TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ResponsesInput:
    """What the Responses endpoint needs from a body."""

    messages: list[dict[str, Any]]  # the input items as chat messages (without the instructions)
    instructions: str | None
    specs: list[ToolSpec]
    tool_choice: ToolChoice
    constraint: tuple[str | None, str]
    constraint_param: str
    sampling: SamplingValues
    stream: bool
    store: bool
    previous_response_id: str | None
    cache_key: str
    retention_s: float | None
    keep: tuple[int | None, float | None] = (None, None)  # (priority, retention_seconds): soft retention
    salt: SaltInput | None = None


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or the concatenated text parts (images and files are not served)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}.content[{j}]: only text parts (input_text, output_text) are supported, got type {kind!r}",
                f"{where}.content[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _arguments(raw: Any, i: int) -> Any:
    """input[i].arguments, a function call's arguments."""
    where = FieldPath.of("input", i, "arguments")
    if not isinstance(raw, str):
        raise bad_request(f"{where} must be a string of JSON", str(where))
    return client_arguments(raw, where)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad_request(
                    f"{where}.role must be one of user, system, developer, assistant; got {item.get('role')!r}",
                    f"{where}.role",
                )
            out.append({"role": role, "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad_request(f"{where}: a function_call needs a name and a call_id", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(item.get("arguments"), i)}}  # fmt: skip
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported by this server", f"{where}.type")
    return out


def tool_specs(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    """The Responses API's function tools ({"type": "function", "name", "description", "parameters", "strict"})."""
    specs = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise bad_request(f"{where}.type {tool.get('type')!r} is not supported: only function tools", where)
        name, parameters = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema (an object)", f"{where}.parameters")
        if tool.get("strict") is True:
            strict_schema(parameters or {}, f"function {name!r}", f"{where}.parameters")
        specs.append(ToolSpec(name, tool.get("description"), parameters, tool.get("strict") is True))
    return specs


def _refuse_unsupported(body: ResponsesRequest) -> None:
    for name in body.model_extra or {}:
        if name not in IGNORED:
            raise bad_request(f"{name} is not supported by this server", name)
    if body.background:
        raise bad_request("background is not supported by this server", "background")
    if body.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported by this server: the input is never cut", "truncation")
    if body.top_logprobs:
        raise bad_request(
            "top_logprobs is not supported by the Responses API here; use chat completions", "top_logprobs"
        )
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise bad_request("max_tool_calls must be >= 1", "max_tool_calls")


def parse_responses(body: ResponsesRequest) -> ResponsesInput:
    _refuse_unsupported(body)
    specs = tool_specs(body.tools)
    parallel = body.parallel_tool_calls if body.max_tool_calls != 1 else False
    choice = tool_choice(body.tool_choice, parallel, specs)
    forced = choice.constraint(specs)
    wanted = response_format(body.text.format if body.text else None, "text.format")
    if forced[0] is not None and wanted[0] is not None:
        raise bad_request("set text.format or a forced tool_choice, not both", "text.format")
    messages = input_messages(body.input)
    if not messages and body.previous_response_id is None:
        raise bad_request("input must hold at least one item", "input")
    sampling = SamplingValues(
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=choice.stop(),
    )
    return ResponsesInput(
        messages=messages,
        instructions=body.instructions or None,
        specs=specs,
        tool_choice=choice,
        constraint=forced if forced[0] is not None else wanted,
        constraint_param="tool_choice" if forced[0] is not None else "text.format",
        sampling=sampling,
        stream=bool(body.stream),
        store=body.store is not False,
        previous_response_id=body.previous_response_id,
        cache_key=body.prompt_cache_key or "",
        retention_s=RETENTION_S[body.prompt_cache_retention],
        keep=(body.priority, body.retention_seconds),
        salt=salt_input(body),
    )
