"""The engine: one thread that owns the KV pool, the prefix cache and the model, and runs step after step.

Threads: `submit`, `abort`, `stats` and the admin calls may come from any thread (the gRPC event loop); they hand
work to the engine thread through an inbox and never touch the cache themselves. `on_output` callbacks run on the
engine thread and must not block.

One step: schedule -> build one BatchLayout -> forward -> publish the pages completed -> sample -> emit (a finished
request releases its lease, storing everything it computed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from radixcache.cache import CacheStats, PrefixCache
from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice
from radixcache.worker.attention.base import create_backend
from radixcache.worker.model.tokenizer import IncrementalDetokenizer
from radixcache.worker.request import Constraint, ErrorKind, FinishReason, Request, RequestOutput
from radixcache.worker.sampling import apply_penalties, sample_row, token_logprob
from radixcache.worker.scheduler import Chunk, Scheduler
from radixcache.worker.sequence import SeqStatus, Sequence
from radixcache.worker.structured import ConstraintFailed, GrammarCache
from radixcache.worker.warmup import warm_up

log = logging.getLogger("radixcache.engine")

DEFAULT_KV_MEMORY = 512 * 2**20


class NoText:
    """The detokenizer of a model without a tokenizer: outputs carry token ids only."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class RequestTooLargeError(ValueError):
    """The request can never fit in the KV pool, whatever else is running (gRPC RESOURCE_EXHAUSTED)."""


class DuplicateRequestError(ValueError):
    """A request with this id is still live (gRPC ALREADY_EXISTS): ids are free again once the last output is sent."""


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_pages: int | None = None  # exact page count; else sized from kv_memory_bytes
    kv_memory_bytes: int | None = None  # default DEFAULT_KV_MEMORY
    max_step_tokens: int = 512  # token budget of one step: decodes + prefill chunks
    max_running: int = 64
    cache_enabled: bool = True  # False: same kernels, no lookups and no publishing (the cache-off baseline)
    backend: str = "auto"
    aging_steps: int = 64  # a request waiting this many steps is admitted before any later arrival
    max_pinned: float = 0.5  # share of the KV pool that pins may hold (PinPrefix beyond it: RESOURCE_EXHAUSTED)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ValueError(f"kv_pages must be >= 1, got {self.kv_pages}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError(f"kv_memory_bytes must be >= 1, got {self.kv_memory_bytes}")
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if not 0.0 <= self.max_pinned <= 1.0:
            raise ValueError(f"max_pinned must be a share of the KV pool in [0, 1], got {self.max_pinned}")


@dataclass
class EngineStats:
    running: int
    waiting: int
    preemptions: int
    steps: int
    finished_requests: int
    prompt_tokens: int  # over every admitted request
    cached_tokens: int  # of those, served from the cache
    generated_tokens: int
    inflight_shared_tokens: int  # cached tokens that a still-running request had just computed
    cache: CacheStats = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def validate_request(request: Request, vocab_size: int, context_length: int, page_size: int, num_pages: int) -> None:
    """What an engine of this geometry refuses before anything is allocated (also checked by the cluster's ingress,
    which routes a request only if any replica would take it): ValueError, or RequestTooLargeError for a request
    that can never fit in the KV pool."""
    vocab, context = vocab_size, context_length
    bad = next((t for t in request.prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    for t in request.sampling.stop_token_ids:
        if not 0 <= t < vocab:
            raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab})")
    prompt = len(request.prompt_ids)
    if prompt >= context:
        raise ValueError(f"the prompt has {prompt} tokens; the context holds {context}, leaving no room to generate")
    if prompt + request.sampling.max_tokens > context:
        raise ValueError(
            f"max_tokens must be in [1, {context - prompt}] for this {prompt}-token prompt "
            f"(context length {context}), got {request.sampling.max_tokens}"
        )
    pages = -(-(prompt + request.sampling.max_tokens) // page_size)
    if pages > num_pages:
        raise RequestTooLargeError(
            f"prompt + max_tokens = {prompt + request.sampling.max_tokens} tokens need {pages} KV pages; "
            f"this worker has {num_pages} pages of {page_size} tokens"
        )


class Engine:
    def __init__(self, loaded: Any, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer  # None for a random test model: token ids in, token ids out
        self._eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self._eos_ids |= self.tokenizer.eos_token_ids
        self.device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        mc = self.model_config
        shape = KVShape(layers=mc.num_layers, kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)
        if self.config.kv_pages is not None:
            self.pool = KVPool(
                shape, page_size=self.config.page_size, num_pages=self.config.kv_pages, dtype=dtype, device=self.device
            )
        else:
            self.pool = KVPool.from_budget(
                shape,
                page_size=self.config.page_size,
                budget_bytes=self.config.kv_memory_bytes or DEFAULT_KV_MEMORY,
                dtype=dtype,
                device=self.device,
            )
        self.cache = PrefixCache(
            self.pool.num_pages,
            self.config.page_size,
            enabled=self.config.cache_enabled,
            max_pinned_pages=int(self.config.max_pinned * self.pool.num_pages),
        )
        self.backend = create_backend(
            self.config.backend,
            self.device,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
        )
        self.scheduler = Scheduler(
            self.cache,
            self.pool,
            max_step_tokens=self.config.max_step_tokens,
            max_running=self.config.max_running,
            aging_steps=self.config.aging_steps,
        )
        # Structured outputs: grammars compile on the submitting thread, masks are applied on this one.
        self.grammars = GrammarCache(self.tokenizer, mc.vocab_size, self._eos_ids)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._live_ids: set[str] = set()
        self._samples: dict[str, list[Sequence]] = {}  # request id -> its unfinished samples (engine thread only)
        self._ids_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stop_at: float | None = None  # set by shutdown: abort what is left after this moment
        self._steps = self._finished = self._generated = 0

    # --- facts the server needs -------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def kv_bytes(self) -> int:
        return self.pool.nbytes

    @property
    def max_pinned_pages(self) -> int:
        """The pin budget in pages (EngineConfig.max_pinned of the pool)."""
        return self.cache.max_pinned_pages

    @property
    def context_length(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Warm up (a prefill, a decode and a mixed step, so the first request does not pay for kernel compilation
        or lazy initialisation; see _warm_up), then run the loop."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        with torch.inference_mode():
            self._warm_up()
        self._thread = threading.Thread(target=self._loop, name="radixcache-engine", daemon=True)
        self._thread.start()

    def step(self) -> bool:
        """Without the thread (tests, in-process benchmarks): take queued calls, run one step. False when idle."""
        if self._thread is not None:
            raise RuntimeError("step() drives an engine that was not start()ed; this one runs its own thread")
        with torch.inference_mode():
            self._drain_inbox(block=False)
            if not self.scheduler.has_work():
                return False
            self._step_guarded()
        return True

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step until nothing is running or waiting; returns the number of steps."""
        for n in range(max_steps):
            if not self.step():
                return n
        raise RuntimeError(f"still busy after {max_steps} steps")

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with drain, let in-flight ones finish (abort what is left at `timeout`)."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9) if drain else time.monotonic()
        with self._ids_lock:  # every accepted request's _add is queued before this stop mark
            self._accepting = False
            if self._thread is None:
                return
            self._inbox.put(lambda: setattr(self, "_stop_at", deadline))
        self._thread.join()
        self._thread = None

    # --- calls from other threads ---------------------------------------------------------------------------
    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None:
        """Queue a request. Raises ValueError / RequestTooLargeError before anything is allocated.

        With sampling.n > 1, on_output receives the outputs of n samples (RequestOutput.index), each ending with
        its own finish_reason; the prompt is computed once and its pages shared by the samples.
        """
        self._validate(request)
        stop_ids = set(request.sampling.stop_token_ids)
        if not request.sampling.ignore_eos:
            stop_ids |= self._eos_ids
        samples = [
            Sequence(request, on_output, self._detokenizer(), frozenset(stop_ids), index=i)
            for i in range(request.sampling.n)
        ]
        if request.constraint is not None:  # compiles here, on the caller's thread, if not cached
            for seq in samples:  # every sample walks the grammar on its own
                seq.matcher = self.grammars.matcher(request.constraint)
        with self._ids_lock:  # atomic with shutdown(): a request is either refused or seen by the loop
            if not self._accepting:
                raise RuntimeError("the engine is shutting down and accepts no new requests")
            if request.request_id in self._live_ids:
                raise DuplicateRequestError(f"request_id {request.request_id!r} is already running; ids must be unique")
            self._live_ids.add(request.request_id)
            self._inbox.put(lambda: self._add(samples))

    def abort(self, request_id: str) -> bool:
        """End a request (all its samples) with FinishReason.ABORTED, freeing its pages. False if it is not live."""
        with self._ids_lock:
            if request_id not in self._live_ids:
                return False
        self._inbox.put(lambda: self._abort(request_id))
        return True

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compile and cache a constraint's grammar (thread-safe; may take milliseconds, so keep it off an event
        loop). Raises ConstraintError (a ValueError) naming the problem. submit() compiles too, on a cache miss."""
        self.grammars.compile(constraint)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread (where the cache lives) and return its result."""
        if self._thread is None:
            return fn()
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed back to the caller
                future.set_exception(exc)

        thread = self._thread
        self._inbox.put(run)
        while True:
            try:
                return future.result(timeout=0.1)
            except TimeoutError:
                if not thread.is_alive() and not future.done():
                    return fn()  # the loop ended before taking our call; nothing else touches the cache now

    def stats(self) -> EngineStats:
        return self.call(self._stats)

    def flush_cache(self, namespace: str | None = None) -> int:
        """Drop what no running request reads: one tenant's namespace, or (None) every namespace."""
        return self.call(lambda: self.cache.flush(namespace))

    def pin(self, token_ids: list[int], namespace: str = "", ttl_s: float | None = None) -> int:
        """Pin the cached whole pages of token_ids. Raises radixcache.cache.PinBudgetError (nothing pinned) past the
        pin budget, or when it would take pages a live request was promised: pins never starve running requests."""
        return self.call(
            lambda: self.cache.pin(token_ids, namespace, ttl=ttl_s, keep_unpinned=self.scheduler.promised_pages())
        )

    def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        return self.call(lambda: self.cache.unpin(token_ids, namespace))

    # --- validation (caller's thread; reads only immutable facts) -------------------------------------------
    def _validate(self, request: Request) -> None:
        validate_request(request, self.vocab_size, self.context_length, self.page_size, self.num_pages)

    # --- the engine thread -----------------------------------------------------------------------------------
    def _detokenizer(self) -> Any:
        return IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else NoText()

    def _add(self, samples: list[Sequence]) -> None:
        """Queue sample 0; the others wait on it until its prompt is computed (see _fork)."""
        first, *others = samples
        first.forks = others
        self._samples[first.request_id] = list(samples)
        self.scheduler.add(first)

    def _live_sequences(self) -> list[Sequence]:
        return [seq for samples in self._samples.values() for seq in samples]

    def _abort(self, request_id: str) -> None:
        for seq in list(self._samples.get(request_id, ())):
            self._end(seq, FinishReason.ABORTED)

    def _end(
        self,
        seq: Sequence,
        reason: FinishReason | None = None,
        error: str | None = None,
        kind: ErrorKind = ErrorKind.INTERNAL,
    ) -> None:
        """Finish seq (release everything first, so a callback failure cannot leak), then send its last output.

        A sample that ends before its prompt was computed (abort, error) ends the samples waiting on it the same
        way. The request id is free again once its last sample has ended.
        """
        if seq.status is SeqStatus.FINISHED:
            return
        if error is not None:
            seq.error_kind = kind
        self.scheduler.finish(seq, reason, error)
        samples = self._samples.get(seq.request_id, [])
        if seq in samples:
            samples.remove(seq)
        if not samples:
            self._samples.pop(seq.request_id, None)
            self._finished += 1
            with self._ids_lock:
                self._live_ids.discard(seq.request_id)
        self._emit(seq)
        forks, seq.forks = seq.forks, []
        for other in forks:
            self._end(other, seq.finish_reason, seq.error, seq.error_kind or kind)

    def _emit(self, seq: Sequence) -> None:
        out = seq.take_output()
        if out is None:
            return
        try:
            seq.on_output(out)
        except Exception:
            log.exception("on_output of %s failed; aborting it", seq.name)
            if out.finish_reason is None:
                self._abort(seq.request_id)

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    self._drain_inbox(block=not self.scheduler.has_work())
                    if self._stop_at is not None and (
                        not self.scheduler.has_work() or time.monotonic() >= self._stop_at
                    ):
                        for seq in self._live_sequences():
                            self._end(seq, FinishReason.ABORTED)
                        return
                    if self.scheduler.has_work():
                        self._step_guarded()
        finally:
            # However the loop ends, nobody is left waiting: refuse new work, end what is queued, answer calls.
            with self._ids_lock:
                self._accepting = False
            self._drain_inbox(block=False)
            self._fail_everything("the engine stopped")

    def _step_guarded(self) -> None:
        try:
            self._step()
        except Exception:  # a bug, not a bad request: fail what is in flight, keep serving
            log.exception("engine step failed; failing the requests in flight")
            self._fail_everything("internal error in the engine")

    def _fail_everything(self, message: str) -> None:
        for seq in self._live_sequences():
            try:
                self._end(seq, FinishReason.ERROR, message)
            except Exception:
                log.exception("could not end %s cleanly", seq.name)

    def _drain_inbox(self, block: bool) -> None:
        try:
            task = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                try:
                    task()
                except Exception:  # one bad call must not take the engine thread down with it
                    log.exception("engine call failed")
                task = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.preemptions,
            steps=self._steps,
            finished_requests=self._finished,
            prompt_tokens=self.scheduler.prompt_tokens,
            cached_tokens=self.scheduler.cached_tokens,
            generated_tokens=self._generated,
            inflight_shared_tokens=self.scheduler.inflight_shared_tokens,
            cache=self.cache.stats(),
        )

    # --- one step ----------------------------------------------------------------------------------------------
    def _step(self) -> None:
        chunks, failed = self.scheduler.schedule()
        for seq, message in failed:
            self._end(seq, FinishReason.ERROR, message, ErrorKind.NO_CAPACITY)
        if not chunks:
            return
        try:
            logits = self._forward(chunks)
        except Exception:
            if len(chunks) == 1:
                log.exception("forward failed for %s", chunks[0].seq.name)
                self._end(chunks[0].seq, FinishReason.ERROR, "internal error while computing this request")
                return
            # Find the culprit: rerun one by one, so one bad request does not fail its batch-mates.
            for chunk in chunks:
                try:
                    self._advance([chunk], self._forward([chunk]))
                except Exception:
                    log.exception("forward failed for %s", chunk.seq.name)
                    self._end(chunk.seq, FinishReason.ERROR, "internal error while computing this request")
            self._steps += 1
            return
        self._advance(chunks, logits)
        self._steps += 1

    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        ids: list[int] = []
        slices = []
        for c in chunks:
            start = c.seq.num_computed
            ids.extend(c.seq.tokens[start : start + c.num_new])
            slices.append(SequenceSlice(c.seq.lease.pages, start, c.num_new))
        layout = BatchLayout.build(slices, self.page_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model(input_ids, layout, self.pool, self.backend).float().cpu()

    def _advance(self, chunks: list[Chunk], logits: torch.Tensor) -> None:
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # one pass for the batch, not one per row
        allowed = self._constrained_logits(chunks, logits)
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            try:
                samples = chunk.samples
                seq.num_computed += chunk.num_new
                self.scheduler.published(seq)
                if samples:
                    if not finite[row]:
                        raise FloatingPointError("non-finite logits")
                    self._sample(seq, logits[row], allowed.get(row))
                    if seq.forks:  # the forks' matchers are at the start too: the same mask holds for them
                        self._fork(seq, logits[row], allowed.get(row))
                self._end_or_emit(seq)
            except Exception as exc:
                self._sampling_failed(seq, exc)

    def _end_or_emit(self, seq: Sequence) -> None:
        if seq.finish_reason is not None:
            self._end(seq)
        else:
            self._emit(seq)

    def _fork(self, first: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        """first's prompt is computed and its first token sampled: start the request's other samples from a copy
        of its prompt, each drawing its own first token from the same logits (and the same constrained logits:
        every sample's grammar is still at its start)."""
        forks, first.forks = first.forks, []
        for seq in forks:
            try:
                if self.scheduler.fork(first, seq):
                    self._sample(seq, logits, allowed)
                    self._end_or_emit(seq)
            except Exception as exc:
                self._sampling_failed(seq, exc)

    def _sampling_failed(self, seq: Sequence, exc: Exception) -> None:
        """End a request whose sampling raised; the others go on. A constraint that failed mid-generation is one
        log line (its message is short by construction); anything else is a bug and gets its traceback."""
        if isinstance(exc, ConstraintFailed):
            log.warning("request %s: %s", seq.name, exc)
            self._end(seq, FinishReason.ERROR, str(exc))
            return
        log.error("request %s failed", seq.name, exc_info=exc)
        self._end(seq, FinishReason.ERROR, "internal error while sampling this request")

    def _constrained_logits(self, chunks: list[Chunk], logits: torch.Tensor) -> dict[int, torch.Tensor]:
        """Row -> that row's logits with the tokens its grammar forbids at -inf, for the constrained rows that
        sample this step (all masks of the batch in one call)."""
        rows = [r for r, c in enumerate(chunks) if c.seq.matcher is not None and c.samples]
        if not rows:
            return {}
        masked = self.grammars.mask_logits(logits, rows, [chunks[r].seq.matcher for r in rows])
        return dict(zip(rows, masked, strict=True))

    def _sample(self, seq: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        """Sample from `allowed` (the constrained logits) when given; logprobs stay those of the model's logits."""
        params = seq.request.sampling
        base = logits if allowed is None else allowed
        token = sample_row(apply_penalties(base, seq.generated, params), params, seq.generator)
        logprob = token_logprob(logits, token, params.top_logprobs) if params.logprobs else None
        seq.append_token(token, logprob)
        self._generated += 1
        if seq.finish_reason is None and len(seq.tokens) >= self.context_length:
            seq.finish_reason = FinishReason.LENGTH

    def _warm_up(self) -> None:
        """A short prefill, a decode and a mixed batch (worker/warmup.py), so kernels compile before any request.
        Under backend 'auto', a backend other than torch that fails them is replaced by torch, with a warning."""
        try:
            warm_up(self.model, self.pool, self.cache, self.backend)
        except Exception as exc:
            if self.backend.name == "torch":
                raise
            if self.config.backend != "auto":
                raise RuntimeError(
                    f"attention backend {self.backend.name!r} failed its start-up warm-up ({type(exc).__name__}: "
                    f"{exc}); use backend 'auto' or 'torch'"
                ) from exc
            log.warning(
                "attention backend %s failed its start-up warm-up (%s: %s); falling back to the torch backend",
                self.backend.name, type(exc).__name__, exc, exc_info=True,
            )  # fmt: skip
            self.backend = create_backend("torch", self.device)
            warm_up(self.model, self.pool, self.cache, self.backend)
