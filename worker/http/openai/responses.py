"""Engine outputs -> OpenAI responses: whole (non-streaming) or as chunks (streaming), for chat and completions.

One responder per request. Feed it every RequestOutput (any sample, in engine order) with `add`, which returns the
chunks to stream now; `response()` gives the whole response once every sample has finished. Both views are built
from the same per-sample state, so the streamed deltas concatenate to exactly the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixcache.worker.engine.request import FinishReason, RequestOutput, TokenLogprob
from radixcache.worker.front.tool_calls import ToolCall, ToolCallParser
from radixcache.worker.http.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    FunctionCallOut,
    PromptTokensDetails,
    TokenLogprobOut,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobOut,
    Usage,
)

FINISH_REASONS = {
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "abort",  # the worker shut down before it could finish (no drain left)
}

TokenText = Callable[[int], str]  # a token id's text, special tokens included (for logprobs)


@dataclass
class _Sample:
    """One choice's state: what was generated and what was already streamed."""

    index: int
    parser: ToolCallParser | None
    text: list[str] = field(default_factory=list)  # shown text (tool-call blocks removed when parsed)
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    finish: str | None = None


def usage(
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    draft_tokens: int = 0,
    accepted_draft_tokens: int = 0,
    cache_miss_reason: str = "",
    cache_match_end: str = "",
) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=cached_tokens,
            cache_miss_reason=cache_miss_reason or None,
            cache_match_end=cache_match_end or None,
        ),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=accepted_draft_tokens,
            rejected_prediction_tokens=draft_tokens - accepted_draft_tokens,
        ),
    )


class _Responder:
    """closes_at_stop: the request stops at the tool-call closing tag (parallel_tool_calls false, ToolChoice.stop),
    so a generation that ends on a stop string with a block open has closed it."""

    def __init__(
        self, *, request_id: str, model: str, n: int, token_text: TokenText, parse_tools: bool,
        closes_at_stop: bool = False,
    ) -> None:  # fmt: skip
        self.id, self.model, self.token_text = request_id, model, token_text
        self.closes_at_stop = closes_at_stop
        self.samples = [_Sample(i, ToolCallParser() if parse_tools else None) for i in range(n)]
        self.prompt_tokens = self.cached_tokens = 0
        self.cache_miss_reason = self.cache_match_end = ""

    def _record(self, out: RequestOutput) -> tuple[_Sample, str, list[ToolCall]]:
        """Update out's sample; returns it with the text and tool calls this output makes certain."""
        sample = self.samples[out.index]
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.cache_miss_reason, self.cache_match_end = out.cache_miss_reason, out.cache_match_end
        sample.completion_tokens = out.completion_tokens
        sample.draft_tokens, sample.accepted_draft_tokens = out.draft_tokens, out.accepted_draft_tokens
        sample.logprobs += out.logprobs
        text, calls = out.text, []
        if sample.parser is not None:
            parsed = sample.parser.push(out.text)
            text, calls = parsed.text, parsed.calls
            if out.finish_reason is not None:
                # Cut by max_tokens: the call as far as it got, never the markup.
                rest = sample.parser.finish(
                    truncated=out.finish_reason is FinishReason.LENGTH,
                    closed=self.closes_at_stop and out.finish_reason is FinishReason.STOP_STRING,
                )
                text, calls = text + rest.text, calls + rest.calls
        if out.finish_reason is not None:
            sample.finish = FINISH_REASONS.get(out.finish_reason, "stop")
            if sample.finish == "stop" and (sample.calls or calls):
                sample.finish = "tool_calls"
        sample.text.append(text)
        sample.calls += calls
        return sample, text, calls

    def usage(self) -> Usage:
        return usage(
            self.prompt_tokens,
            self.cached_tokens,
            sum(s.completion_tokens for s in self.samples),
            sum(s.draft_tokens for s in self.samples),
            sum(s.accepted_draft_tokens for s in self.samples),
            self.cache_miss_reason,
            self.cache_match_end,
        )

    def _top(self, top: list[tuple[int, float]]) -> list[TopLogprobOut]:
        out = []
        for token_id, logprob in top:
            text = self.token_text(token_id)
            out.append(TopLogprobOut(token=text, logprob=logprob, bytes=list(text.encode("utf-8"))))
        return out

    def _token_logprobs(self, logprobs: list[TokenLogprob]) -> list[TokenLogprobOut]:
        out = []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            out.append(
                TokenLogprobOut(
                    token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")), top_logprobs=self._top(lp.top)
                )
            )
        return out


def _tool_calls(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


class ChatResponder(_Responder):
    """chat.completion / chat.completion.chunk."""

    def __init__(self, *, logprobs: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.logprobs = logprobs

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=choices)

    def first_chunks(self) -> list[ChatCompletionChunk]:
        """Each choice opens with the assistant role, as OpenAI streams it."""
        return [
            self._chunk([ChatChunkChoice(index=s.index, delta=ChatDelta(role="assistant", content=""))])
            for s in self.samples
        ]

    def add(self, out: RequestOutput) -> list[ChatCompletionChunk]:
        sample, text, calls = self._record(out)
        chunks = []
        logprobs = ChatLogprobs(content=self._token_logprobs(out.logprobs)) if self.logprobs else None
        if text or (logprobs is not None and logprobs.content):
            chunks.append(
                self._chunk([ChatChunkChoice(index=sample.index, delta=ChatDelta(content=text), logprobs=logprobs)])
            )
        if calls:
            first = len(sample.calls) - len(calls)
            deltas = [
                ToolCallDelta(index=first + k, id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for k, c in enumerate(calls)
            ]
            chunks.append(self._chunk([ChatChunkChoice(index=sample.index, delta=ChatDelta(tool_calls=deltas))]))
        if sample.finish is not None:
            chunks.append(
                self._chunk([ChatChunkChoice(index=sample.index, delta=ChatDelta(), finish_reason=sample.finish)])
            )
        return chunks

    def usage_chunk(self) -> ChatCompletionChunk:
        chunk = self._chunk([])
        chunk.usage = self.usage()
        return chunk

    def response(self) -> ChatCompletion:
        choices = []
        for s in self.samples:
            content: str | None = "".join(s.text)
            if s.calls:
                content = content.strip() or None  # the blocks were usually surrounded by newlines
            choices.append(
                ChatChoice(
                    index=s.index,
                    message=ChatMessageOut(content=content, tool_calls=_tool_calls(s.calls) or None),
                    finish_reason=s.finish,
                    logprobs=ChatLogprobs(content=self._token_logprobs(s.logprobs)) if self.logprobs else None,
                )
            )
        return ChatCompletion(id=self.id, model=self.model, choices=choices, usage=self.usage())


class CompletionResponder(_Responder):
    """text_completion, whole or as chunks."""

    def __init__(self, *, logprobs: bool = False, **kwargs: object) -> None:
        super().__init__(parse_tools=False, **kwargs)  # type: ignore[arg-type]
        self.logprobs = logprobs
        self._offsets = [0] * len(self.samples)  # characters of text covered by logprobs so far, per sample

    def _completion_logprobs(self, index: int, logprobs: list[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t): v for t, v in lp.top})
            out.text_offset.append(self._offsets[index])
            self._offsets[index] += len(text)
        return out

    def add(self, out: RequestOutput) -> list[Completion]:
        sample, text, _ = self._record(out)
        logprobs = self._completion_logprobs(out.index, out.logprobs) if self.logprobs else None
        if not text and sample.finish is None and not (logprobs and logprobs.tokens):
            return []
        choice = CompletionChoice(index=sample.index, text=text, finish_reason=sample.finish, logprobs=logprobs)
        return [Completion(id=self.id, model=self.model, choices=[choice])]

    def first_chunks(self) -> list[Completion]:
        return []  # completions chunks carry text from the first one on

    def usage_chunk(self) -> Completion:
        return Completion(id=self.id, model=self.model, choices=[], usage=self.usage())

    def response(self) -> Completion:
        self._offsets = [0] * len(self.samples)
        choices = [
            CompletionChoice(
                index=s.index,
                text="".join(s.text),
                finish_reason=s.finish,
                logprobs=self._completion_logprobs(s.index, s.logprobs) if self.logprobs else None,
            )
            for s in self.samples
        ]
        return Completion(id=self.id, model=self.model, choices=choices, usage=self.usage())
