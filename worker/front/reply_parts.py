"""A generated reply as the parts an API shows, in order: text and tool calls. Shared by the fronts that show a
reply as a list of items or content blocks (the Responses API's output items, Anthropic's content blocks).

    parts = ReplyParts(parse_tools=True, closes_at_stop=False)
    for out in stream:                      # one sample's RequestOutputs, in order
        for part in parts.add(out):         # Text(delta) or Call(call, partial)
            ...

The text is the generated text exactly (a conversation sent back then renders to the very tokens the worker
generated, worker/front/generated.py), but for the whitespace around tool-call blocks, which is not content: whitespace is
held back until visible text follows it, dropped before a call, and after a call dropped until visible text comes.
Calls come whole (worker/front/tool_calls.py's parser holds a block back until it closes); a call cut by max_tokens comes
at the end, as far as it got, marked partial.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixcache.worker.engine.request import FinishReason, RequestOutput
from radixcache.worker.front.tool_calls import ToolCall, ToolCallParser


@dataclass(frozen=True)
class Text:
    delta: str


@dataclass(frozen=True)
class Call:
    call: ToolCall
    partial: bool = False  # cut by max_tokens: the arguments are JSON text as far as it got


class ReplyParts:
    """parse_tools: generated <tool_call> blocks become Calls (else everything is text). closes_at_stop: the request
    stops at the tool-call closing tag (ToolChoice.stop), so a generation that ends on a stop string with a block
    open has closed it."""

    def __init__(self, *, parse_tools: bool, closes_at_stop: bool = False) -> None:
        self.parser = ToolCallParser() if parse_tools else None
        self.closes_at_stop = closes_at_stop
        self._held = ""  # whitespace at the end of the text so far
        self._after_call = False  # a call was the last thing shown: whitespace now is not content
        self.calls = 0

    def add(self, out: RequestOutput) -> list[Text | Call]:
        """The parts one output makes certain (its finish flushes what was held back)."""
        text, calls, partial = out.text, [], []
        if self.parser is not None:
            parsed = self.parser.push(out.text)
            text, calls = parsed.text, list(parsed.calls)
            if out.finish_reason is not None:
                rest = self.parser.finish(
                    truncated=out.finish_reason is FinishReason.LENGTH,
                    closed=self.closes_at_stop and out.finish_reason is FinishReason.STOP_STRING,
                )
                text, calls = text + rest.text, calls + rest.calls
                partial = rest.calls if out.finish_reason is FinishReason.LENGTH else []
        parts: list[Text | Call] = self._text(text)
        for call in calls:
            parts.append(Call(call, partial=call in partial))
            self._held, self._after_call = "", True
            self.calls += 1
        if out.finish_reason is not None and not self._after_call:
            parts += self._text("", flush=True)
        return parts

    def _text(self, delta: str, *, flush: bool = False) -> list[Text | Call]:
        text = self._held + delta
        if self._after_call:
            text = text.lstrip()
        visible = text if flush else text.rstrip()
        self._held = text[len(visible) :]
        if not visible:
            return []
        self._after_call = False
        return [Text(visible)]
