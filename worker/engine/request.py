"""What the server hands the engine (Request, SamplingParams) and what the engine streams back (RequestOutput).

Validation lives here, in __post_init__, so every entry point (gRPC, in-process, benchmarks) rejects the same bad
input with the same message, before anything is allocated. Messages name the field and the allowed range.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

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
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # NaN fails both comparisons
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # the closed range also rejects NaN and infinities
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"each stop string must have 1..{MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # also rejects NaN
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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
    index: int = 0  # which sample, in [0, sampling.n)
    draft_tokens: int = 0  # speculation: draft tokens verified for this sample so far
    accepted_draft_tokens: int = 0  # of those, the ones that were the sampled token (emitted without a step each)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
