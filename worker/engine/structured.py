"""Structured outputs: JSON-schema, regex and EBNF constraints turned into per-step token masks (llguidance).

Three pieces, each with one job:
- `GrammarCache` compiles a `Constraint` against the model's tokenizer once and keeps the result (a pristine
  matcher) in an LRU keyed by the constraint's text. Compiling drops the GIL inside llguidance; callers run it on
  their own thread (the gRPC front in a worker thread, `Engine.submit` on the caller's), never on the engine thread.
  An invalid schema / regex / grammar raises `ConstraintError` (a ValueError) naming the problem.
- `GrammarMatcher` is one request's copy of a compiled grammar, advanced with every token the request samples.
  It lives on the Sequence with the generated tokens, so preemption by recompute (which keeps those tokens) leaves
  it in step: there is nothing to replay.
- `GrammarCache.mask_logits` fills the masks of all constrained rows of a step into one bitmask and applies them to
  the logits in one tensor operation.

llguidance is an optional dependency (`pip install radixcache[structured]`), imported on first use.
Vocabulary: masks cover max(model vocab, tokenizer vocab) ids; ids the tokenizer does not know (the model's
padding rows) are never allowed, so a constrained request cannot sample one.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from radixcache.worker.engine.request import Constraint

# JSON is written on one line as json.dumps writes it ('{"a": 1, "b": [2, 3]}'). Free whitespace would let a model
# fill max_tokens with newlines instead of closing the value; a schema may still change this under "x-guidance".
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept; a pristine matcher is small (the token tables are shared)
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit t of word w allows token 32 * w + t


# llguidance's resource limits (LLParserLimits), its defaults except two. verbose_errors off: an error is one short
# line, never the parser state and the whole grammar (45 KB in a log line for a big schema). Regex analysis fuel
# 200k (~4 ms) instead of 1M: `(x{1000}){1000}` then fails its first mask in ~0.1 s instead of ~0.9 s. The others
# (items per Earley row 2000, per step 50k, lexer states 250k, grammar symbols 500k) bound each step; the probe
# below catches grammars that pass them at compile time and blow up on the first tokens.
LEXER_FUEL = 200_000
# A grammar whose first two masks take longer than this to compute is refused: every step of a constrained request
# computes its mask on the engine thread, so a slow grammar would stall everyone's tokens.
PROBE_BUDGET_S = 0.5
MAX_ERROR_CHARS = 300
_SOURCE_LINE = re.compile(r"^\s*\d+ \| ")  # llguidance quotes the grammar's lines after a Lark error


class ConstraintError(ValueError):
    """The constraint cannot be compiled or served: the message names the field and the problem."""


class ConstraintFailed(RuntimeError):
    """A grammar that compiled failed while sampling (a resource limit llguidance hit mid-generation, or a masking
    bug): the request ends with an error; the message is one short line."""


def short_error(message: str) -> str:
    """llguidance's error as one line of at most MAX_ERROR_CHARS: no quoted grammar, no state dump."""
    lines = []
    for line in message.replace("<non-verbose/>", "").strip().splitlines():
        if _SOURCE_LINE.match(line) or line.startswith(("<state>", "<grammar>")):
            break
        lines.append(line.strip())
    text = " ".join(x for x in lines if x)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # an optional extra
        raise ConstraintError(
            "structured outputs need the llguidance package on the worker: pip install 'radixcache[structured]'"
        ) from e
    return llguidance


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) for a constraint; ConstraintError for input it cannot even read."""
    llg = _llguidance()
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            return llg.grammar_from("ebnf", text)  # GBNF (root ::= ...) is converted to Lark; Lark as is
    except ValueError as e:
        raise ConstraintError(f"{kind}: {e}") from e
    raise ConstraintError(f"unknown constraint kind {kind!r}")


class GrammarMatcher:
    """One request's grammar state. `consume(token)` after each sampled token; `done` once the grammar is complete."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self.consumed = 0

    def consume(self, token_id: int) -> None:
        """Advance by one sampled token. ConstraintFailed if the grammar does not allow it or hit a limit."""
        if not self._m.consume_token(token_id):
            raise ConstraintFailed(f"the constraint failed at token {token_id}: {short_error(self._m.get_error())}")
        self.consumed += 1

    def accepts_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from its current state (which stays as it is): a draft
        is cut there, so a constrained request never verifies a token its grammar refuses."""
        return int(self._m.validate_tokens(tokens))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (e.g. the top-level JSON object is closed)."""
        return self._m.is_stopped()

    @property
    def raw(self) -> Any:
        return self._m


class GrammarCache:
    """Compiles constraints for one tokenizer and keeps the last `capacity` of them. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int], capacity: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer  # radixcache Tokenizer, or None (then every constraint is refused)
        self.model_vocab = vocab_size
        self._eos = sorted(eos_ids)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._ll_tokenizer: Any = None
        self.hits = self.misses = 0

    @property
    def mask_vocab(self) -> int:
        """Ids a mask covers (the llguidance tokenizer's vocabulary, at least the model's)."""
        return self._tokenizer_tables().vocab_size

    def _tokenizer_tables(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise ConstraintError("constraints need the model's tokenizer; this worker's model has none")
                self._ll_tokenizer = self._build_tables()
            return self._ll_tokenizer

    def _build_tables(self) -> Any:
        llg = _llguidance()
        n_vocab = max(self.model_vocab, self._tokenizer.vocab_size)
        eos = self._eos or None
        try:  # llguidance reads tokenizer.json itself (byte-level BPE, SentencePiece, ...)
            return llg.LLTokenizer(self._tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos)
        except ValueError as e:
            first_error = e
        try:  # e.g. a word-level tokenizer whose decoder it does not know: give it each token's text instead
            wrapper = llg.TokenizerWrapper(_TokenTexts(self._tokenizer, self._eos))
            return llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)
        except ValueError as e:
            raise ConstraintError(f"structured outputs cannot read this model's tokenizer: {first_error}; {e}") from e

    def compile(self, constraint: Constraint) -> Any:
        """The pristine compiled matcher of `constraint`, from the cache or compiled now (off the engine thread)."""
        with self._lock:
            hit = self._compiled.get(constraint)
            if hit is not None:
                self._compiled.move_to_end(constraint)
                self.hits += 1
                return hit
        tables = self._tokenizer_tables()
        llg = _llguidance()
        limits = llg.LLParserLimits(initial_lexer_fuel=LEXER_FUEL, verbose_errors=False)
        matcher = llg.LLMatcher(tables, grammar_text(constraint), log_level=0, limits=limits)
        if matcher.is_error():
            raise ConstraintError(f"{constraint.kind}: {short_error(matcher.get_error())}")
        self._probe(constraint.kind, matcher)
        with self._lock:
            self.misses += 1
            self._compiled[constraint] = matcher
            self._compiled.move_to_end(constraint)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return matcher

    def _probe(self, kind: str, pristine: Any) -> None:
        """Compute the first mask, take one allowed token and compute the next, on a copy: a grammar that explodes
        there (recursion forcing endless tokens, anyOf blow-ups, huge counted repeats) or is too slow to mask is
        refused now with ConstraintError, instead of failing (or stalling the engine thread) while sampling."""
        started = time.monotonic()
        probe = pristine.deep_copy()
        token = _first_allowed(probe, self._eos)
        if token is not None and not probe.is_error():
            probe.consume_token(token)
            _first_allowed(probe, self._eos)
        elapsed = time.monotonic() - started
        if probe.is_error():
            raise ConstraintError(f"{kind}: the grammar is too complex to serve: {short_error(probe.get_error())}")
        if elapsed > PROBE_BUDGET_S:
            raise ConstraintError(
                f"{kind}: the grammar is too complex to serve: its first two token masks took {elapsed * 1000:.0f} ms "
                f"(at most {PROBE_BUDGET_S * 1000:.0f} ms)"
            )

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher for one request (a copy of the compiled one: microseconds on a cache hit)."""
        pristine = self.compile(constraint)
        with self._lock:
            return GrammarMatcher(pristine.deep_copy())

    def __len__(self) -> int:
        return len(self._compiled)

    def clear(self) -> None:
        """Forget every compiled grammar (the token tables stay)."""
        with self._lock:
            self._compiled.clear()

    # --- one step ------------------------------------------------------------------------------------------
    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> torch.Tensor:
        """logits[rows] with every token its row's grammar forbids set to -inf: a new [len(rows), vocab] tensor.

        llguidance fills one bitmask tensor for the batch (one call per row, without the GIL); one masked_fill applies
        them all. The mask covers max(model, tokenizer) ids, so every logits column has a bit.
        """
        vocab = logits.shape[-1]
        words = -(-self.mask_vocab // 32)
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        # On this thread, one row after another: handing the rows to llguidance's thread pool (LLExecutor) measured
        # slower end to end on a busy CPU (each step waits for the pool's threads to be scheduled), while a mask
        # takes microseconds.
        for i, m in enumerate(matchers):
            m.raw.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
        allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).view(len(rows), -1)[:, :vocab].bool()
        return logits[rows].masked_fill_(~allowed, float("-inf"))


def _first_allowed(matcher: Any, eos: list[int]) -> int | None:
    """Compute the matcher's next mask; the lowest token it allows that is not an EOS (None: none, or an error)."""
    mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    if matcher.is_error():
        return None
    allowed = ((mask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().nonzero().flatten()
    return next((t for t in allowed.tolist() if t not in eos), None)


class _TokenTexts:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes, the special ids, and encode. Only for
    tokenizers whose every token decodes to whole characters (ValueError otherwise: a byte-level token's text would
    be a replacement character, not its bytes)."""

    def __init__(self, tokenizer: Any, eos_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        special = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == ""]
        texts = [tokenizer.decode([t], skip_special_tokens=False) for t in range(tokenizer.vocab_size)]
        if any("\ufffd" in text for text in texts):
            raise ValueError("some tokens are parts of a character")
        self.tokens = [b"" if t in special else text.encode() for t, text in enumerate(texts)]
        self.special_token_ids = special
        self.eos_token_id = eos_ids[0] if eos_ids else (special[0] if special else 0)
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))
