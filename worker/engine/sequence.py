"""One request's life inside the engine: its tokens, how many are computed, its lease, and its output stream.

A Sequence owns the text side of generation too: incremental detokenization and stop strings, holding back any
text that could still become the start of a stop string so a stop string is never split across two messages and
never leaks into the output.
"""

from __future__ import annotations

import enum
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixcache.cache import Lease
from radixcache.miss_reasons import CacheMiss
from radixcache.tiering import LoadJob
from radixcache.worker.engine.request import ErrorKind, FinishReason, Request, RequestOutput, TokenLogprob
from radixcache.worker.engine.sampling import new_generator
from radixcache.worker.engine.structured import GrammarMatcher
from radixcache.worker.speculation import DraftState


def stop_prefix_at_end(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that begins some stop string: held back until we know it is not one."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class Detokenizer(Protocol):
    """What a Sequence asks of its detokenizer (the model's IncrementalDetokenizer; tests pass scripted ones)."""

    def push(self, token_id: int) -> str:
        """The text `token_id` completes (may be "")."""
        ...

    def flush(self) -> str:
        """What is still held back, at the end."""
        ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    on_output: Callable[[RequestOutput], None]
    detokenizer: Detokenizer
    stop_token_ids: frozenset[int]
    index: int = 0  # which of the request's n samples this is
    tokens: list[int] = field(default_factory=list)  # prompt + generated; the last one may be uncomputed
    num_computed: int = 0  # tokens whose K/V is in lease.pages
    lease: Lease | None = None
    published_tokens: int = 0  # whole pages of `tokens` already put into the tree
    status: SeqStatus = SeqStatus.WAITING
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission (what users are told)
    cache_miss: CacheMiss | None = None  # why that admission's lookup served no more (radixcache.miss_reasons)
    admitted_once: bool = False
    admit_order: int = -1  # larger = admitted later; the preemption victim is the largest
    arrival: float = field(default_factory=time.monotonic)
    waited_steps: int = 0
    first_token_at: float | None = None
    last_output_at: float | None = None  # when the last output carrying tokens was taken (inter-token gaps)
    generator: torch.Generator = field(init=False)  # made in __post_init__, from the request's seed
    text: str = ""  # everything detokenized so far
    emitted_chars: int = 0  # how much of `text` was sent
    pending_ids: list[int] = field(default_factory=list)  # sampled this step, not yet sent
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    # other sequence -> common prefix length; weak, so a finished sequence is not kept alive by a waiting one
    lcp_cache: weakref.WeakKeyDictionary[Sequence, int] = field(default_factory=weakref.WeakKeyDictionary)
    # Structured output: the grammar state after the generated tokens (kept through preemption with them)
    matcher: GrammarMatcher | None = None
    # The tiers below memory (radixcache.tiering): the load of this prompt's pages under way, how often the tiers
    # were looked at since the last admission, and tokens loaded for it by medium (counted at its next admission)
    load_job: LoadJob | None = None
    tier_probes: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)
    # Speculation (worker/speculation, which reads a Sequence as a DraftedSequence): the drafter's state, and draft
    # tokens verified / accepted so far
    draft_state: DraftState | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt_ids)
        seed = self.request.sampling.seed
        if seed is not None:
            seed += self.index  # sample i: seed + i (wrapping past the largest seed torch accepts)
            seed = seed - 2**64 if seed >= 2**64 else seed
        self.generator = new_generator(seed)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def name(self) -> str:
        """Unique per sample (the owner of its lease): the request id, plus "#i" for samples after the first."""
        return self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def prefilling(self) -> bool:
        """True while more than the one last token is left to compute (prompt, or recompute after preemption)."""
        return len(self.tokens) - self.num_computed > 1

    def common_prefix(self, other: Sequence) -> int:
        """Length of the token prefix shared with `other` (cached: prompts never change)."""
        known = self.lcp_cache.get(other)
        if known is None:
            a, b = self.request.prompt_ids, other.request.prompt_ids
            n = min(len(a), len(b))
            known = next((i for i in range(n) if a[i] != b[i]), n)
            self.lcp_cache[other] = known
        return known

    # --- outputs -------------------------------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """Record a sampled token; decide whether it ends the request (stop token, stop string, completed constraint, length)."""
        sampling = self.request.sampling
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.tokens.append(token_id)
        self.pending_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        if token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP_TOKEN
            return
        self.text += self.detokenizer.push(token_id)
        if sampling.stop:
            # A stop string completed by this token starts in the unsent text: take_output holds back every tail
            # that could begin one, so nothing before emitted_chars can.
            hits = [i for i in (self.text.find(s, self.emitted_chars) for s in sampling.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = FinishReason.STOP_STRING
                return
        if self.matcher is not None:
            self.matcher.consume(token_id)
            if self.matcher.done:  # the grammar allows nothing more (an EOS the mask forced would add nothing)
                self.finish_reason = FinishReason.STOP_TOKEN
                return
        if self.num_generated >= sampling.max_tokens:
            self.finish_reason = FinishReason.LENGTH

    def take_output(self) -> RequestOutput | None:
        """What became ready since the last output, or None if nothing did and the request goes on."""
        if self.finish_reason is not None and self.finish_reason not in (
            FinishReason.STOP_STRING,
            FinishReason.ABORTED,
            FinishReason.ERROR,
        ):
            self.text += self.detokenizer.flush()
        ready = len(self.text)
        if self.finish_reason is None and self.request.sampling.stop:
            ready = max(self.emitted_chars, ready - stop_prefix_at_end(self.text, self.request.sampling.stop))
        delta = self.text[self.emitted_chars : ready]
        if not self.pending_ids and not delta and self.finish_reason is None:
            return None
        self.emitted_chars = ready
        out = RequestOutput(
            request_id=self.request_id,
            token_ids=self.pending_ids,
            text=delta,
            prompt_tokens=self.num_prompt,
            cached_tokens=self.cached_tokens,
            cache_miss_reason=self.cache_miss.reason if self.cache_miss is not None else "",
            cache_match_end=self.cache_miss.match_end if self.cache_miss is not None else "",
            completion_tokens=self.num_generated,
            logprobs=self.pending_logprobs,
            finish_reason=self.finish_reason,
            error=self.error,
            error_kind=self.error_kind,
            index=self.index,
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
        )
        if self.pending_ids and self.first_token_at is not None and self.num_generated == len(self.pending_ids):
            out.time_to_first_token = self.first_token_at - self.arrival
        now = time.monotonic()
        if self.finish_reason is not None and self.first_token_at is not None and self.num_generated > 1:
            out.time_per_output_token = (now - self.first_token_at) / (self.num_generated - 1)
        if self.pending_ids:
            if self.last_output_at is not None:
                out.inter_token_latency = now - self.last_output_at
            self.last_output_at = now
        if self.finish_reason is not None:
            out.e2e_latency = now - self.arrival
        self.pending_ids, self.pending_logprobs = [], []
        return out
