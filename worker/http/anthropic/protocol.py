"""Anthropic's Messages API bodies (the subset radixcache serves), as pydantic models. No serving here.

Requests keep unknown fields (extra="allow") so the front answers 400 naming a field it does not serve; system
blocks, messages, content blocks and tools stay plain dicts here and are read by requests.py, which names the
message, block and field at fault. Responses are built so that the official `anthropic` client parses every field it
declares (anthropic.types.Message, MessageTokensCount).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what makes the prompt, without the generation's fields."""

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # the automatic breakpoint on the last block
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int  # required, as Anthropic has it; 0 computes (and caches) the prompt without generating
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None


# --- responses ---------------------------------------------------------------------------------------------------
class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class CacheCreation(BaseModel):
    """Tokens newly written under a breakpoint, by its TTL."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class Usage(BaseModel):
    """input_tokens + cache_read_input_tokens + cache_creation_input_tokens = the prompt's tokens."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # what the cache served (any cached prefix, not only at breakpoints)
    cache_creation_input_tokens: int = 0  # computed now and pinned under a cache_control breakpoint
    cache_creation: CacheCreation = Field(default_factory=CacheCreation)
    # vendor fields: why the cache served no more (radixcache.miss_reasons' stable names; None: not said)
    cache_miss_reason: str | None = None
    cache_match_end: str | None = None


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokensCount(BaseModel):
    input_tokens: int
