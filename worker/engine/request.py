"""What the server hands the engine (Request, SamplingParams) and what the engine streams back (RequestOutput).

Validation lives here, in __post_init__, so every entry point (gRPC, in-process, benchmarks) rejects the same bad
input with the same message, before anything is allocated. Messages name the field and the allowed range;
SamplingParams raises InvalidArgument carrying the field too (its `field`), a value of the wrong type included.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixcache.worker.engine.field_errors import FieldPath, InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts (the wire's int64 fits)
MAX_SAMPLES = 16  # n: completions of one prompt, computed once and shared
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "ebnf")
MAX_CONSTRAINT_CHARS = 65536
# JSON containers a json_schema may nest (a pydantic model nested 10 deep uses ~25); worker/front/validation.py refuses
# deeper ones. llguidance's own reader stops at 128 with a message naming a column; the tool-call grammar adds 5
# levels around a tool's parameters.
MAX_SCHEMA_DEPTH = 64


class FinishReason(str, enum.Enum):
    STOP_TOKEN = "stop_token"  # an EOS or one of stop_token_ids was sampled
    STOP_STRING = "stop_string"  # the text reached one of the stop strings (not included in the output)
    LENGTH = "length"  # max_tokens reached, or the context is full
    ABORTED = "aborted"  # cancelled by the client, Abort(), or shutdown without drain
    ERROR = "error"  # a failure inside this request; others are unaffected


class ErrorKind(str, enum.Enum):
    """Why a request ended with FinishReason.ERROR; the server maps it to a gRPC status."""

    INTERNAL = "internal"  # a failure inside this request (INTERNAL); the others are unaffected
    NO_CAPACITY = (
        "no_capacity"  # it cannot fit in the KV cache even alone, e.g. beside pinned pages (RESOURCE_EXHAUSTED)
    )
    UNAVAILABLE = "unavailable"  # the replica serving it went away mid-stream (cluster only; UNAVAILABLE)
    CONSTRAINT = "constraint"  # its structured-output constraint compiled but could not go on (INVALID_ARGUMENT)


@dataclass(frozen=True)
class SamplingParams:
    """Defaults: greedy (temperature 0), 16 tokens, no top-k/top-p/min-p filtering."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # same seed, same output, regardless of the rest of the batch
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # the log-probability of each sampled token
    top_logprobs: int = 0  # and this many alternatives per position
    n: int = 1  # completions of the prompt; sample i is seeded with seed + i
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted from it once per time it was generated
    speculate: bool = True  # False: no draft tokens for this request (same output either way; only speed differs)

    def __post_init__(self) -> None:
        # One rule per field, in the fields' order: the first value refused is the one named. A value of the wrong
        # type (from a loosely typed front, e.g. JSON) fails its rule's comparison and is named the same way.
        for where, rule in _SAMPLING_RULES:
            name = where.head
            try:
                problem = rule(name, getattr(self, name))
            except TypeError as e:
                raise InvalidArgument(f"a sampling value has the wrong type: {e}", where) from None
            if problem is not None:
                raise InvalidArgument(problem, where)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _max_tokens(name: str, v: int) -> str | None:
    return f"{name} must be >= 1, got {v}" if v < 1 else None


def _temperature(name: str, v: float) -> str | None:
    ok = v >= 0.0 and math.isfinite(v)  # NaN fails both comparisons
    return None if ok else f"{name} must be >= 0 and finite, got {v}"


def _top_k(name: str, v: int) -> str | None:
    return f"{name} must be -1 (off) or >= 1, got {v}" if v < -1 or v == 0 else None


def _top_p(name: str, v: float) -> str | None:
    return None if 0.0 < v <= 1.0 else f"{name} must be in (0, 1], got {v}"  # also refuses NaN and infinities


def _min_p(name: str, v: float) -> str | None:
    return None if 0.0 <= v <= 1.0 else f"{name} must be in [0, 1], got {v}"


def _seed(name: str, v: int | None) -> str | None:
    ok = v is None or SEED_RANGE[0] <= v <= SEED_RANGE[1]
    return None if ok else f"{name} must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {v}"


def _stop_token_ids(name: str, v: tuple[int, ...]) -> str | None:
    return f"{name} allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}" if len(v) > MAX_STOP_TOKEN_IDS else None


def _stop(name: str, v: tuple[str, ...]) -> str | None:
    if len(v) > MAX_STOP_STRINGS:
        return f"{name} allows at most {MAX_STOP_STRINGS} strings, got {len(v)}"
    for s in v:
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            return f"each stop string must have 1..{MAX_STOP_STRING_CHARS} characters, got {len(s)}"
    return None


def _top_logprobs(name: str, v: int) -> str | None:
    return None if 0 <= v <= MAX_TOP_LOGPROBS else f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {v}"


def _n(name: str, v: int) -> str | None:
    return None if 1 <= v <= MAX_SAMPLES else f"{name} must be in [1, {MAX_SAMPLES}], got {v}"


def _penalty(name: str, v: float) -> str | None:
    ok = -MAX_PENALTY <= v <= MAX_PENALTY  # also refuses NaN
    return None if ok else f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}"


# SamplingParams' value rules, in its fields' order (the fields without one take any value): a rule gets the field's
# name and value and says what is wrong, or None.
_SAMPLING_RULES: tuple[tuple[FieldPath, Callable[[str, Any], str | None]], ...] = (
    (FieldPath.of("max_tokens"), _max_tokens),
    (FieldPath.of("temperature"), _temperature),
    (FieldPath.of("top_k"), _top_k),
    (FieldPath.of("top_p"), _top_p),
    (FieldPath.of("min_p"), _min_p),
    (FieldPath.of("seed"), _seed),
    (FieldPath.of("stop_token_ids"), _stop_token_ids),
    (FieldPath.of("stop"), _stop),
    (FieldPath.of("top_logprobs"), _top_logprobs),
    (FieldPath.of("n"), _n),
    (FieldPath.of("presence_penalty"), _penalty),
    (FieldPath.of("frequency_penalty"), _penalty),
)


@dataclass(frozen=True)
class Constraint:
    """Structured output: the generated text must follow this JSON schema (JSON text), any JSON object, regex or
    EBNF grammar (GBNF or Lark). Hashable: compiled grammars are cached by it. Whether the text compiles is decided
    by worker.structured (ConstraintError), which needs the model's tokenizer."""

    kind: str  # one of CONSTRAINT_KINDS
    text: str = ""  # empty for json_object

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}; got {self.kind!r}")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"{self.kind} must not be empty")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{self.kind} must have at most {MAX_CONSTRAINT_CHARS} characters, got {len(self.text)}")


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    namespace: str = ""  # the tenant; set by the server from the caller's identity, never from the request body
    constraint: Constraint | None = None  # structured output; None = unconstrained
    # A routing hint (OpenAI's prompt_cache_key): in a cluster, requests with the same key go to the same replica
    # while load allows, so a conversation finds its pages where they are. One engine ignores it.
    cache_key: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One engine step's worth of one sample of a request: the tokens that became ready, and the text they complete.

    prompt_tokens / cached_tokens are set on every output (the same for every sample: the prompt is computed once);
    finish_reason only on the last output of each sample. `index` says which of the request's n samples it is.
    """

    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None  # set with FinishReason.ERROR
    error_kind: ErrorKind | None = None  # set with FinishReason.ERROR
    time_to_first_token: float | None = None  # seconds, on the first output that carries a token
    time_per_output_token: float | None = None  # seconds, on the last output
    inter_token_latency: float | None = None  # seconds since this sample's previous output with tokens
    e2e_latency: float | None = None  # seconds from submission to the finish, on the last output
    index: int = 0  # which sample, in [0, sampling.n)
    draft_tokens: int = 0  # speculation: draft tokens verified for this sample so far
    accepted_draft_tokens: int = 0  # of those, the ones that were the sampled token (emitted without a step each)
    cache_miss_reason: str = ""  # why the cache served cached_tokens and no more (radixcache.miss_reasons.REASONS)
    cache_match_end: str = ""  # how the tree's match ended (radixcache.miss_reasons.MATCH_ENDS)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
