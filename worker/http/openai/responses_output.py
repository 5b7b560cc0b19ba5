"""Engine outputs -> a Responses API response: the whole object, or the official event sequence when streaming:

    response.created, response.in_progress,
    per text item:  response.output_item.added, response.content_part.added, response.output_text.delta ...,
                    response.output_text.done, response.content_part.done, response.output_item.done
    per call:       response.output_item.added, response.function_call_arguments.delta,
                    response.function_call_arguments.done, response.output_item.done
    then response.completed (response.incomplete when cut by max_output_tokens; response.failed on a failure).

One responder per request (one sample: the Responses API has no n). Both views are built from the same state, so
the deltas concatenate to the final text. The text and the calls are worker/front/reply_parts.py's: the generated text
exactly, but for the whitespace around tool-call blocks.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.front.reply_parts import ReplyParts, Text
from radixcache.worker.front.tool_calls import ToolCall
from radixcache.worker.http.openai.requests import template_arguments
from radixcache.worker.http.openai.responses_protocol import (
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)

Event = dict[str, Any]


def sse(event: Event) -> str:
    """One server-sent event as OpenAI writes them: the type as the event name, the event as JSON data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponsesResponder:
    """`echo`: the request fields a response object repeats (instructions, tools, tool_choice, temperature, ...).
    parse_tools / closes_at_stop: as ChatResponder's (generated <tool_call> blocks become function_call items)."""

    def __init__(self, *, response_id: str, model: str, echo: dict[str, Any], parse_tools: bool, closes_at_stop: bool) -> None:  # fmt: skip
        self.object = ResponseObject(id=response_id, model=model, status="in_progress", **echo)
        self.parts = ReplyParts(parse_tools=parse_tools, closes_at_stop=closes_at_stop)
        self._message: OutputMessage | None = None  # the text item being written
        self._sequence = 0
        self.finish: FinishReason | None = None

    # -- events ----------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def response(self) -> ResponseObject:
        """The response object as it stands (final once the last output was added)."""
        return self.object

    def _snapshot(self) -> dict[str, Any]:
        return self.object.model_dump()

    def first_events(self) -> list[Event]:
        snapshot = self._snapshot()  # the same object twice: nothing happened in between
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def add(self, out: RequestOutput) -> list[Event]:
        """Record one output; the events it makes certain."""
        events = []
        for part in self.parts.add(out):
            if isinstance(part, Text):
                events += self._text(part.delta)
            else:
                events += self._close_text() + self._call(part.call, truncated=part.partial)
        if out.finish_reason is not None:
            self.finish = out.finish_reason
            self.object.usage = ResponseUsage(
                input_tokens=out.prompt_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=out.cached_tokens,
                    cache_write_tokens=out.prompt_tokens - out.cached_tokens,
                    cache_miss_reason=out.cache_miss_reason or None,
                    cache_match_end=out.cache_match_end or None,
                ),
                output_tokens=out.completion_tokens,
                total_tokens=out.prompt_tokens + out.completion_tokens,
            )
            cut = out.finish_reason is FinishReason.LENGTH
            events += self._close_text(incomplete=cut)
            self.object.status = "incomplete" if cut else "completed"
            self.object.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
            self.object.completed_at = float(int(time.time()))
        return events

    def _text(self, visible: str) -> list[Event]:
        events = []
        if self._message is None:
            self._message = OutputMessage(id="msg_" + uuid.uuid4().hex, status="in_progress", content=[])
            self.object.output.append(self._message)
            index = len(self.object.output) - 1
            events.append(
                self._event("response.output_item.added", output_index=index, item=self._message.model_dump())
            )
            self._message.content.append(OutputText(text=""))
            part = self._message.content[0].model_dump()
            events.append(self._event("response.content_part.added", item_id=self._message.id, output_index=index, content_index=0, part=part))  # fmt: skip
        self._message.content[0].text += visible
        events.append(
            self._event(
                "response.output_text.delta", item_id=self._message.id, output_index=self._index(self._message),
                content_index=0, delta=visible, logprobs=[],
            )
        )  # fmt: skip
        return events

    def _index(self, item: Any) -> int:
        return next(i for i, x in enumerate(self.object.output) if x is item)

    def _close_text(self, *, incomplete: bool = False) -> list[Event]:
        message, self._message = self._message, None
        if message is None:
            return []
        message.status = "incomplete" if incomplete else "completed"
        index, part = self._index(message), message.content[0]
        return [
            self._event(
                "response.output_text.done",
                item_id=message.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[],
            ),  # fmt: skip
            self._event(
                "response.content_part.done",
                item_id=message.id,
                output_index=index,
                content_index=0,
                part=part.model_dump(),
            ),  # fmt: skip
            self._event("response.output_item.done", output_index=index, item=message.model_dump()),
        ]

    def _call(self, call: ToolCall, *, truncated: bool) -> list[Event]:
        item = FunctionCall(id="fc_" + uuid.uuid4().hex, status="in_progress", call_id=call.id, name=call.name, arguments="")  # fmt: skip
        self.object.output.append(item)
        index = len(self.object.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=item.model_dump())]
        item.arguments = call.arguments
        item.status = "incomplete" if truncated else "completed"
        events += [
            self._event(
                "response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=call.arguments
            ),  # fmt: skip
            self._event(
                "response.function_call_arguments.done", item_id=item.id, output_index=index, arguments=call.arguments
            ),  # fmt: skip
            self._event("response.output_item.done", output_index=index, item=item.model_dump()),
        ]
        return events

    def last_events(self) -> list[Event]:
        kind = "response.incomplete" if self.object.status == "incomplete" else "response.completed"
        return [self._event(kind, response=self._snapshot())]

    def failed_events(self, message: str) -> list[Event]:
        self._close_text(incomplete=True)
        self.object.status = "failed"
        self.object.error = ResponseError(code="server_error", message=message)
        return [self._event("response.failed", response=self._snapshot())]

    # -- the reply as a conversation turn ---------------------------------------------------------------------
    def reply_message(self) -> dict[str, Any]:
        """The reply as a chat message (Hugging Face's shape), as responses_input.py maps output items sent back."""
        message: dict[str, Any] = {"role": "assistant", "content": self.object.output_text}
        calls = [item for item in self.object.output if isinstance(item, FunctionCall)]
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": template_arguments(c.arguments)},
                }  # fmt: skip
                for c in calls
            ]
        return message
