"""Engine outputs -> an Anthropic message: the whole object, or the streamed event sequence:

    message_start (the message, content empty, usage of the prompt), ping,
    per block:  content_block_start, content_block_delta (text_delta / input_json_delta) ..., content_block_stop,
    message_delta (stop_reason, stop_sequence, the usage totals), message_stop;
    a failure after the stream began: an error event.

One responder per request (one sample: the Messages API has no n). message_start waits for the first output, which
carries the prompt's token counts. Both views are built from the same state (worker/front/reply_parts.py: the text
exactly as generated but for the whitespace around calls; calls whole), so the deltas concatenate to the blocks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pydantic_core

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.front.reply_parts import ReplyParts, Text
from radixcache.worker.front.tool_calls import ToolCall
from radixcache.worker.http.anthropic.protocol import CacheCreation, Message, TextBlock, ToolUseBlock, Usage

Event = dict[str, Any]


def sse(event: Event) -> str:
    """One server-sent event as Anthropic writes them: the type as the event name, the event as JSON data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def tool_input(call: ToolCall, partial: bool) -> dict[str, Any]:
    """A call's arguments as the tool_use block's input; a call cut by max_tokens: what of it parses."""
    try:
        value = pydantic_core.from_json(call.arguments, allow_partial=partial)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesResponder:
    """parse_tools / closes_at_stop: as ReplyParts takes them. stop_sequences: the request's (stop_sequence names the
    one that ended the reply). prewarm (max_tokens 0): the one computed token is not shown. generated_text: the
    decoded text of every generated token (a stop sequence included), read once at the end."""

    def __init__(
        self, *, message_id: str, model: str, parse_tools: bool, closes_at_stop: bool, stop_sequences: tuple[str, ...],
        prewarm: bool, generated_text: Callable[[], str],
    ) -> None:  # fmt: skip
        self.message = Message(id=message_id, model=model, content=[], usage=Usage(input_tokens=0, output_tokens=0))
        self.parts = ReplyParts(parse_tools=parse_tools, closes_at_stop=closes_at_stop)
        self.stop_sequences, self.prewarm, self.generated_text = stop_sequences, prewarm, generated_text
        self.started = False
        self.finish_reason: FinishReason | None = None
        self.prompt_tokens = self.cached_tokens = 0
        self.cache_miss_reason = self.cache_match_end = ""
        self._text: TextBlock | None = None  # the text block being written
        self._raw: list[str] = []  # the text as the engine sent it (a stop sequence cut off)

    # -- events ----------------------------------------------------------------------------------------------
    def add(self, out: RequestOutput) -> list[Event]:
        """Record one output; the events it makes certain."""
        events: list[Event] = []
        if not self.started:
            self.started = True
            self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
            self.cache_miss_reason, self.cache_match_end = out.cache_miss_reason, out.cache_match_end
            self.message.usage = self._usage(0, CacheCreation())
            events += [{"type": "message_start", "message": self.message.model_dump()}, {"type": "ping"}]
        self._raw.append(out.text)
        self.message.usage.output_tokens = 0 if self.prewarm else out.completion_tokens
        for part in [] if self.prewarm else self.parts.add(out):
            if isinstance(part, Text):
                events += self._write(part.delta)
            else:
                events += self._close_text() + self._call(part.call, part.partial)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            events += self._close_text()
            self.message.stop_reason, self.message.stop_sequence = self._stop(out.finish_reason)
        return events

    def _write(self, delta: str) -> list[Event]:
        events = []
        if self._text is None:
            self._text = TextBlock(text="")
            self.message.content.append(self._text)
            events.append({"type": "content_block_start", "index": self._index, "content_block": {"type": "text", "text": ""}})  # fmt: skip
        self._text.text += delta
        events.append({"type": "content_block_delta", "index": self._index, "delta": {"type": "text_delta", "text": delta}})  # fmt: skip
        return events

    @property
    def _index(self) -> int:
        return len(self.message.content) - 1

    def _close_text(self) -> list[Event]:
        if self._text is None:
            return []
        self._text = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _call(self, call: ToolCall, partial: bool) -> list[Event]:
        block = ToolUseBlock(id="toolu_" + uuid.uuid4().hex[:24], name=call.name, input=tool_input(call, partial))
        self.message.content.append(block)
        start = block.model_dump() | {"input": {}}  # the input comes as JSON text, in deltas
        events: list[Event] = [{"type": "content_block_start", "index": self._index, "content_block": start}]
        if call.arguments:
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events.append({"type": "content_block_delta", "index": self._index, "delta": delta})
        return events + [{"type": "content_block_stop", "index": self._index}]

    def _stop(self, finish: FinishReason) -> tuple[str, str | None]:
        if finish is FinishReason.LENGTH or self.prewarm:
            return "max_tokens", None
        if finish is FinishReason.STOP_STRING:
            matched = self._matched_stop()
            if matched is not None:
                return "stop_sequence", matched
        return ("tool_use" if self.parts.calls else "end_turn"), None

    def _matched_stop(self) -> str | None:
        """Which of the request's stop sequences ended the reply: the one that follows the text sent (the shortest,
        when several do); None when it was the tool-call closing tag (disable_parallel_tool_use)."""
        if not self.stop_sequences:
            return None
        sent, generated = "".join(self._raw), self.generated_text()
        for stop in sorted(self.stop_sequences, key=len):
            if generated.startswith(stop, len(sent)):
                return stop
        return None

    def _usage(self, output_tokens: int, created: CacheCreation) -> Usage:
        new = created.ephemeral_5m_input_tokens + created.ephemeral_1h_input_tokens
        return Usage(
            input_tokens=self.prompt_tokens - self.cached_tokens - new,
            output_tokens=output_tokens,
            cache_read_input_tokens=self.cached_tokens,
            cache_creation_input_tokens=new,
            cache_creation=created,
            cache_miss_reason=self.cache_miss_reason or None,
            cache_match_end=self.cache_match_end or None,
        )

    def finish(self, created: CacheCreation) -> None:
        """Settle the usage once the breakpoints are pinned (cache_control.BreakpointPins.creation)."""
        self.message.usage = self._usage(self.message.usage.output_tokens, created)

    def last_events(self) -> list[Event]:
        """After finish(): message_delta with the totals (cumulative, as Anthropic sends them), message_stop."""
        usage = self.message.usage
        totals = {
            "input_tokens": usage.input_tokens,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
            "output_tokens": usage.output_tokens,
        }
        delta = {"stop_reason": self.message.stop_reason, "stop_sequence": self.message.stop_sequence}
        return [{"type": "message_delta", "delta": delta, "usage": totals}, {"type": "message_stop"}]

    def response(self) -> Message:
        return self.message
