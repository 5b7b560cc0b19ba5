"""The gRPC front's adapter: protobuf request messages -> the plain values `validation` checks. No rules here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixcache.worker.front.validation import PromptInput, SamplingValues

SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "logprobs", "top_logprobs", "n",
    "presence_penalty", "frequency_penalty", "speculate",
)  # fmt: skip


class ChatMessagesView(Sequence):
    """ChatMessage protos seen as {"role", "content"} dicts, made one at a time: validation counts the messages
    before it reads any, so a million tiny messages are refused without building a million dicts."""

    def __init__(self, messages: Any) -> None:
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        m = self._messages[i]
        return {"role": m.role, "content": m.content}


def prompt_input(message: Any) -> PromptInput:
    """The `input` oneof (text | token_ids | messages) of a GenerateRequest, TokenizeRequest, (Un)PinPrefixRequest or
    ExplainPrefixRequest."""
    kind = message.WhichOneof("input")
    if kind == "text":
        return PromptInput(text=message.text)
    if kind == "token_ids":
        return PromptInput(token_ids=message.token_ids.ids)  # a read-only view, copied only once valid
    if kind == "messages":
        return PromptInput(messages=ChatMessagesView(message.messages.messages))
    return PromptInput()


def sampling_values(request: Any) -> SamplingValues:
    """A GenerateRequest's sampling fields; a field without presence set stays None (SamplingParams' default)."""
    present = {name: getattr(request, name) for name in SAMPLING_FIELDS if request.HasField(name)}
    return SamplingValues(stop=request.stop, stop_token_ids=request.stop_token_ids, **present)


def constraint_values(request: Any) -> tuple[str | None, str]:
    """A GenerateRequest's `constraint` oneof as (kind, text); (None, "") when unset or json_object is false."""
    kind = request.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not request.json_object):
        return None, ""
    return kind, "" if kind == "json_object" else getattr(request, kind)
