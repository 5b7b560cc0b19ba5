"""Anthropic Messages bodies -> the plain values the front core takes: the conversation as chat messages (Hugging
Face's shape, what chat templates render), tools as ToolSpecs, tool_choice as a ToolChoice, output_config.format as
a constraint, sampling values, and the cache_control breakpoints. Anything that would change the output and is not
served gets 400 naming it; no range rule lives here (validation.py has them, for every front).

The conversation: `system` (a string or text blocks) is one system message; a user message's text blocks become a
user message and each tool_result block a tool message (in their order); an assistant message's text blocks are its
content and its tool_use blocks its tool_calls (thinking blocks are skipped: this worker writes none, and a client
may send them back). Text blocks of one message are joined with a blank line.

A breakpoint (`cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a system block, a tool, or a message's
content block; or at the top level: the last block of the last message) marks the prompt up to the end of that
block. It is kept as that conversation cut right after the block (`Breakpoint.prompt`), which cache_control.py
renders and tokenizes to find the prefix's tokens: on a system block, the tools and the system prompt so far; on a
tool, the tools so far and the whole system prompt (chat templates write both before the first message); on a
message block, everything before it in the conversation, and that message up to and including it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from radixcache.worker.engine.request import MAX_STOP_STRINGS
from radixcache.worker.front.tool_calls import ToolChoice, ToolSpec, template_tools
from radixcache.worker.front.validation import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_TOOLS,
    ModelLimits,
    PromptInput,
    SaltInput,
    SamplingValues,
)
from radixcache.worker.http.anthropic.protocol import CountTokensRequest, MessagesRequest
from radixcache.worker.http.errors import bad_request
from radixcache.worker.http.json_body import ArrayRule, BodyShape
from radixcache.worker.http.openai.requests import shape_of

# Accepted and ignored: they never change what is generated here.
IGNORED = frozenset({
    "metadata", "service_tier", "speed", "inference_geo", "diagnostics", "context_management", "user_profile_id",
    "workspace_id",
})  # fmt: skip
TTL_S = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # Anthropic's limit
JOIN = "\n\n"  # between the text blocks of one message
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
THINKING = ("enabled", "disabled", "adaptive")


@dataclass(frozen=True)
class Breakpoint:
    """One cache_control breakpoint: the block it marks (by the request's names), its TTL, and the conversation cut
    right after that block."""

    where: str  # "system[1]", "tools[0]", "messages[3].content[2]"
    ttl: str  # "5m" or "1h"
    prompt: PromptInput

    @property
    def ttl_s(self) -> float:
        return TTL_S[self.ttl]


@dataclass(frozen=True)
class MessagesInput:
    """What the Messages endpoint needs from a body."""

    prompt: PromptInput
    specs: list[ToolSpec]
    tool_choice: ToolChoice
    constraint: tuple[str | None, str]  # as validation.constraint takes it
    constraint_param: str  # the field that asked for it: tool_choice or output_config.format
    sampling: SamplingValues
    stop_sequences: tuple[str, ...]
    stream: bool
    prewarm: bool  # max_tokens 0: compute the prompt into the cache, generate nothing
    breakpoints: list[Breakpoint] = field(default_factory=list)
    keep: tuple[int | None, float | None] = (None, None)  # (priority, retention_seconds): soft retention
    salt: SaltInput | None = None  # the vendor fields cache_salt* (validation.check_cache_salt)


@dataclass(frozen=True)
class _Block:
    """A content block, checked: text (text, tool_result's content) or a tool call (tool_use)."""

    kind: str  # "text", "tool_use" or "tool_result"
    text: str = ""
    call: dict[str, Any] | None = None  # tool_use: the chat template's tool_calls entry
    tool_use_id: str | None = None  # tool_result
    ttl: str | None = None  # its cache_control breakpoint's TTL, if any


@dataclass(frozen=True)
class _Turn:
    role: str
    blocks: tuple[_Block, ...]


def messages_body_shape(limits: ModelLimits) -> BodyShape:
    """What a Messages (or count_tokens) body may hold, checked while it is parsed (worker/http/json_body.py, as
    for the OpenAI routes): messages, their content blocks (a turn of parallel tool results holds many: 4x the
    OpenAI parts' limit), system blocks, tools, stop sequences."""
    rules = {
        ("messages",): ArrayRule(MAX_CHAT_MESSAGES, "messages"),
        ("messages", "*", "content"): ArrayRule(4 * MAX_CONTENT_PARTS, "content blocks"),
        ("system",): ArrayRule(MAX_CONTENT_PARTS, "system blocks"),
        ("tools",): ArrayRule(MAX_TOOLS, "tools"),
        ("stop_sequences",): ArrayRule(MAX_STOP_STRINGS, "stop sequences"),
    }
    return shape_of(limits, rules)


def _ttl(value: Any, where: str) -> str | None:
    """A cache_control value's TTL ("5m" when unset); None for no cache_control."""
    if value is None:
        return None
    param = f"{where}.cache_control" if where else "cache_control"
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise bad_request(f"{param} must be {{'type': 'ephemeral', 'ttl': '5m' | '1h'}}, got {value!r}", param)
    ttl = value.get("ttl", "5m")
    if ttl not in TTL_S:
        raise bad_request(f"{param}.ttl must be one of 5m, 1h; got {ttl!r}", f"{param}.ttl")
    return ttl


def _text_blocks(content: Any, where: str) -> tuple[str, str | None]:
    """A string, or a list of text blocks (a system prompt, a tool_result's content): (the text, the TTL of the last
    cache_control among the blocks)."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    texts, ttl = [], None
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(
                f"{where}[{j}]: only text blocks ({{'type': 'text', 'text': ...}}) are supported, got type {kind!r}",
                f"{where}[{j}]",
            )
        texts.append(block["text"])
        ttl = _ttl(block.get("cache_control"), f"{where}[{j}]") or ttl
    return JOIN.join(texts), ttl


def _system(system: str | list[dict[str, Any]] | None) -> list[_Block]:
    if system is None or isinstance(system, str):
        return [_Block("text", system)] if system else []
    blocks = []
    for j, block in enumerate(system):
        where = f"system[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where} must be a text block ({{'type': 'text', 'text': ...}})", where)
        blocks.append(_Block("text", block["text"], ttl=_ttl(block.get("cache_control"), where)))
    return blocks


def _block(block: Any, role: str, where: str) -> _Block | None:
    """One content block of a message, checked (None: a block that is skipped)."""
    kind = block.get("type") if isinstance(block, dict) else None
    ttl = _ttl(block.get("cache_control"), where) if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return _Block("text", block["text"], ttl=ttl)
    if kind == "tool_use" and role == "assistant":
        name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
        if not isinstance(name, str) or not name or not isinstance(call_id, str):
            raise bad_request(f"{where}: a tool_use block needs a name and an id", where)
        if not isinstance(arguments, dict):
            raise bad_request(f"{where}.input must be an object", f"{where}.input")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        return _Block("tool_use", call=call, ttl=ttl)
    if kind == "tool_result" and role == "user":
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
        text, inner = _text_blocks(block.get("content", ""), f"{where}.content")
        return _Block("tool_result", text, tool_use_id=call_id, ttl=ttl or inner)
    if kind in SKIPPED_BLOCKS and role == "assistant":
        return None
    allowed = "text, tool_use, thinking" if role == "assistant" else "text, tool_result"
    raise bad_request(f"{where}.type must be one of {allowed} in a {role} message; got {kind!r}", f"{where}.type")


def _turns(messages: list[dict[str, Any]]) -> list[_Turn]:
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be one of user, assistant; got {role!r}", f"{where}.role")
        unknown = set(message) - {"role", "content"}
        if unknown:
            name = sorted(unknown)[0]
            raise bad_request(f"{where}.{name} is not supported by this server", f"{where}.{name}")
        if isinstance(content, str):
            blocks = [_Block("text", content)]
        elif isinstance(content, list) and content:
            found = (_block(b, role, f"{where}.content[{j}]") for j, b in enumerate(content))
            blocks = [b for b in found if b is not None]
        else:
            raise bad_request(f"{where}.content must be a string or a non-empty list of blocks", f"{where}.content")
        turns.append(_Turn(role, tuple(blocks)))
    if turns and turns[-1].role == "assistant":
        raise bad_request(
            f"messages[{len(turns) - 1}]: the conversation ends with an assistant message; prefilling the reply is "
            "not supported by this server (end with a user message)",
            f"messages[{len(turns) - 1}]",
        )
    return turns


def _chat_turn(turn: _Turn) -> list[dict[str, Any]]:
    """A turn as chat messages: an assistant's one message (text, then its calls); a user's text runs as user
    messages and each tool_result as a tool message, in order."""
    if turn.role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": JOIN.join(b.text for b in turn.blocks if b.kind == "text")}  # fmt: skip
        calls = [b.call for b in turn.blocks if b.kind == "tool_use"]
        if calls:
            message["tool_calls"] = calls
        return [message]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for b in turn.blocks:
        if b.kind == "text":
            texts.append(b.text)
            continue
        if texts:
            out.append({"role": "user", "content": JOIN.join(texts)})
            texts = []
        out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text})
    if texts or not out:
        out.append({"role": "user", "content": JOIN.join(texts)})
    return out


def _chat(system: Sequence[_Block], turns: Sequence[_Turn]) -> list[dict[str, Any]]:
    head = [{"role": "system", "content": JOIN.join(b.text for b in system)}] if system else []
    return head + [m for turn in turns for m in _chat_turn(turn)]


def _breakpoints(
    system: list[_Block], turns: list[_Turn], specs: list[ToolSpec], tool_ttls: list[str | None],
    top_level: str | None,
) -> list[Breakpoint]:  # fmt: skip
    """Every breakpoint, in the prompt's order, with its cut conversation. A system or tools cut ends with an empty
    user turn, so that every template renders it and the cut runs to where the first message's content begins."""
    opening = _Turn("user", (_Block("text", ""),))
    found = []
    for k, ttl in enumerate(tool_ttls):
        if ttl is not None:
            tools = template_tools(specs[: k + 1])
            found.append(Breakpoint(f"tools[{k}]", ttl, PromptInput(messages=_chat(system, [opening]), tools=tools)))
    everything = template_tools(specs)
    for j, block in enumerate(system):
        if block.ttl is not None:
            cut = PromptInput(messages=_chat(system[: j + 1], [opening]), tools=everything)
            found.append(Breakpoint(f"system[{j}]", block.ttl, cut))
    marks = [(i, j, b.ttl) for i, t in enumerate(turns) for j, b in enumerate(t.blocks) if b.ttl is not None]
    if top_level is not None and turns:
        marks.append((len(turns) - 1, len(turns[-1].blocks) - 1, top_level))
    for i, j, ttl in marks:
        cut_turns = turns[:i] + [replace(turns[i], blocks=turns[i].blocks[: j + 1])]
        cut = PromptInput(messages=_chat(system, cut_turns), tools=everything)
        found.append(Breakpoint(f"messages[{i}].content[{j}]", ttl, cut))
    if len(found) > MAX_BREAKPOINTS:
        raise bad_request(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {len(found)}.",
            "cache_control",
        )
    return found


def tool_specs(tools: list[dict[str, Any]] | None) -> tuple[list[ToolSpec], list[str | None]]:
    """Client tools ({"name", "description", "input_schema"}, type "custom" or unset) -> ToolSpecs, and each tool's
    breakpoint TTL. Server tools (web search, code execution, ...) are not served."""
    specs, ttls = [], []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        if tool.get("type", "custom") != "custom":
            raise bad_request(
                f"{where}.type {tool.get('type')!r} is not supported: only client tools (name, description, "
                "input_schema) are served here",
                f"{where}.type",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema must be a JSON schema (an object)", f"{where}.input_schema")
        description = tool.get("description")
        specs.append(ToolSpec(name, description if isinstance(description, str) else None, schema))
        ttls.append(_ttl(tool.get("cache_control"), where))
    return specs, ttls


def tool_choice(choice: dict[str, Any] | None, specs: list[ToolSpec]) -> ToolChoice:
    """auto | any | tool (by name) | none, with disable_parallel_tool_use: at most one call."""
    if choice is None:
        return ToolChoice("auto")
    kind, parallel = choice.get("type"), choice.get("disable_parallel_tool_use") is not True
    if kind == "auto":
        wanted = ToolChoice("auto", parallel=parallel)
    elif kind == "any":
        wanted = ToolChoice("required", parallel=parallel)
    elif kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name must name a tool when tool_choice.type is tool", "tool_choice.name")
        wanted = ToolChoice("required", (name,), parallel=parallel)
    elif kind == "none":
        wanted = ToolChoice("none")
    else:
        raise bad_request(f"tool_choice.type must be one of auto, any, tool, none; got {kind!r}", "tool_choice.type")
    problem = wanted.check(specs)
    if problem is not None:
        raise bad_request(f"tool_choice {problem}", "tool_choice")
    return wanted


def _output_format(config: dict[str, Any] | None) -> tuple[str | None, str]:
    """output_config.format {"type": "json_schema", "schema": ...} -> a constraint; effort and the rest are ignored."""
    spec = (config or {}).get("format")
    if spec is None:
        return None, ""
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise bad_request(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config.format"
        )
    return "json_schema", json.dumps(spec["schema"])


def _refuse_unsupported(body: CountTokensRequest) -> None:
    for name in body.model_extra or {}:
        if name not in IGNORED:
            raise bad_request(f"{name} is not supported by this server", name)
    thinking = body.thinking
    if thinking is not None and thinking.get("type") not in THINKING:
        raise bad_request(f"thinking.type must be one of {', '.join(THINKING)}", "thinking.type")


def parse_prompt(body: CountTokensRequest) -> tuple[PromptInput, list[ToolSpec], ToolChoice, list[Breakpoint]]:
    """What a body's prompt is: the chat prompt, the tools, the tool choice and the breakpoints (count_tokens
    needs only these)."""
    _refuse_unsupported(body)
    specs, tool_ttls = tool_specs(body.tools)
    choice = tool_choice(body.tool_choice, specs)
    system, turns = _system(body.system), _turns(body.messages)
    if not turns:
        raise bad_request("messages must hold at least one message", "messages")
    top_level = _ttl(body.cache_control, "")
    breakpoints = _breakpoints(system, turns, specs, tool_ttls, top_level)
    return PromptInput(messages=_chat(system, turns), tools=template_tools(specs)), specs, choice, breakpoints


def parse_messages(body: MessagesRequest) -> MessagesInput:
    prompt, specs, choice, breakpoints = parse_prompt(body)
    if body.max_tokens < 0:
        raise bad_request(
            f"max_tokens must be >= 0 (0: compute the prompt into the cache, generating nothing), got "
            f"{body.max_tokens}",
            "max_tokens",
        )
    forced = choice.constraint(specs)
    wanted = _output_format(body.output_config)
    if forced[0] is not None and wanted[0] is not None:
        raise bad_request("set output_config.format or a forcing tool_choice (any, tool), not both", "output_config")
    stops = tuple(body.stop_sequences or ())
    salt = SaltInput(body.cache_salt, body.cache_salt_shared_tokens, body.cache_salt_share_system)
    sampling = SamplingValues(
        max_tokens=body.max_tokens or 1,  # prewarm: one token is computed, and not shown
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=stops + tuple(s for s in choice.stop() if s not in stops),
    )
    return MessagesInput(
        prompt=prompt,
        specs=specs,
        tool_choice=choice,
        constraint=forced if forced[0] is not None else wanted,
        constraint_param="tool_choice" if forced[0] is not None else "output_config.format",
        sampling=sampling,
        stop_sequences=stops,
        stream=bool(body.stream),
        prewarm=body.max_tokens == 0,
        breakpoints=breakpoints,
        keep=(body.priority, body.retention_seconds),
        salt=None if salt == SaltInput() else salt,
    )
