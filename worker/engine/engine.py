"""The engine: one thread that owns the KV pool, the prefix cache and the model, and runs step after step.

Threads: `submit`, `abort`, `stats` and the admin calls may come from any thread (the gRPC event loop); they hand
work to the engine thread through an inbox and never touch the cache themselves. `on_output` callbacks run on the
engine thread and must not block. The typed interface (and its refusals) that fronts rely on: worker/engine/api.py.

Who does what in one step (`_step`): the Scheduler (worker/engine/scheduler/) picks the chunks (and which pages they
write), ModelStep (worker/engine/step.py) computes and samples them, the engine publishes completed pages, emits
outputs and ends what finished (a finished request releases its lease, storing everything it computed). A request's
n samples: worker/engine/samples.py. Speculation (EngineConfig.speculate > 0) is the Speculator's
(worker/speculation/speculator.py): its draft rides in a sequence's chunk, and the step hands the chunk's rows to its
`verify`, which accepts what the request's own sampler agrees with. Every counter is its tenant's
(worker/engine/tenant_counts.py); the worker's stats are their sum.

In process (tests, benchmarks), without the thread:

    engine = Engine(load_checkpoint(path), EngineConfig(page_size=16, kv_pages=1024))
    engine.submit(Request("r1", prompt_ids, SamplingParams(max_tokens=32)), outputs.append)
    engine.run_until_idle()        # or engine.start() (warm-up, then the thread) and engine.shutdown(drain=True)
    engine.cache.check(idle=True)  # nothing leaked
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

from radixcache.cache import PrefixCache
from radixcache.cache_base import BaseCache
from radixcache.cache_off import CacheOff
from radixcache.explain import Explanation
from radixcache.tiering import IDLE_WRITE_BUDGET_S
from radixcache.worker.attention import AttentionBackend
from radixcache.worker.engine.api import (
    DuplicateRequestError,
    EngineLoad,
    EngineStats,
    EngineStoppedError,
    RequestTooLargeError,
)
from radixcache.worker.engine.checks import check_engine_request
from radixcache.worker.engine.config import EngineConfig
from radixcache.worker.engine.request import Constraint, ErrorKind, FinishReason, Request, RequestOutput
from radixcache.worker.engine.row_check import RowCheck
from radixcache.worker.engine.samples import RequestSamples
from radixcache.worker.engine.scheduler import Chunk, Scheduler
from radixcache.worker.engine.sequence import SeqStatus, Sequence
from radixcache.worker.engine.step import ChunkRows, ModelStep
from radixcache.worker.engine.structured import ConstraintFailed, GrammarCache
from radixcache.worker.engine.tenant_counts import TenantCounts, TenantTable
from radixcache.worker.engine.tiers import EngineTiers, build_tier_link
from radixcache.worker.model.loader import LoadedModel
from radixcache.worker.model.tokenizer import IncrementalDetokenizer
from radixcache.worker.speculation import Speculator

__all__ = ["DuplicateRequestError", "Engine", "EngineConfig", "EngineStats", "RequestTooLargeError"]

log = logging.getLogger("radixcache.engine")
T = TypeVar("T")


def _wake() -> None:
    """Put in the inbox to wake an idle engine thread (a load from a tier has arrived)."""


class NoText:
    """The detokenizer of a model without a tokenizer: outputs carry token ids only."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class Engine:
    """One worker's engine (implements EngineLike, worker/engine/api.py)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer  # None for a random test model: token ids in, token ids out
        self._eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self._eos_ids |= self.tokenizer.eos_token_ids
        self.runner = ModelStep(loaded, self.config, self._eos_ids)
        self.device = self.runner.device
        self.pool = self.runner.pool
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        link = build_tier_link(self.pool, self.config, notify=lambda: self._inbox.put(_wake))
        max_pinned = int(self.config.max_pinned * self.pool.num_pages)
        self.cache: BaseCache
        if self.config.cache_enabled:
            self.cache = PrefixCache(
                self.pool.num_pages,
                self.config.page_size,
                max_pinned_pages=max_pinned,
                tier=link,
                demoted_pages=self.pool.demoted_pages,
                transcode=self.pool.transcode,
                window=self.runner.window,
                window_slots=self.pool.window_slots,
                eviction_policy=self.config.eviction_policy,
            )
        else:  # --no-cache: the same leases over the same pages, nothing kept (so nothing for a tier either)
            self.cache = CacheOff(
                self.pool.num_pages,
                self.config.page_size,
                max_pinned_pages=max_pinned,
                window=self.runner.window,
                window_slots=self.pool.window_slots,
            )
        if self.pool.window is not None:
            self.runner.window_slots = self.cache.window_slots
        # The tiers below the pool (worker/engine/tiers.py): None without --kv-disk / --kv-host-memory.
        self.tiers = None if link is None else EngineTiers(link, self.config, self._inbox.put, self._pin)
        self._loaded = loaded  # the fingerprint of the disk tier reads its weights' source
        self.speculator: Speculator | None = None
        if self.config.speculate > 0:
            self.speculator = Speculator.over(
                self.cache if isinstance(self.cache, PrefixCache) else None,  # (CacheOff: the cache is off)
                max_draft=self.config.speculate,
                context_length=self.context_length,
            )
        self.counts = TenantTable()  # every request counter, once, under its tenant (the worker's: the sum)
        self.scheduler = Scheduler(
            self.cache,
            self.pool,
            max_step_tokens=self.config.max_step_tokens,
            max_running=self.config.max_running,
            aging_steps=self.config.aging_steps,
            propose=self.speculator.draft if self.speculator is not None else None,
            tiers=self.tiers,
            counts=self.counts,
        )
        self._live_ids: set[str] = set()
        self._requests: dict[str, RequestSamples] = {}  # request id -> its samples (engine thread only)
        self._ids_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stop_at: float | None = None  # set by shutdown: abort what is left after this moment
        self._steps = 0
        # Engine.start's check of the model's rows (worker/engine/row_check.py); assumed until it runs.
        self.row_check = RowCheck(True, "not run yet", checked=False)

    # --- facts the server needs -------------------------------------------------------------------------------
    @property
    def backend(self) -> AttentionBackend:
        """The attention backend in use (after start(), the one that passed the warm-up)."""
        return self.runner.backend

    @property
    def grammars(self) -> GrammarCache:
        """The structured-output GrammarCache (worker/engine/structured.py)."""
        return self.runner.grammars

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
    def kv_dtype(self) -> str:
        """The KV pages' precision (EngineConfig.kv_dtype, auto resolved): part of every page's hash."""
        return self.pool.kv_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

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
        or lazy initialisation; see ModelStep.warm_up), then run the loop."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        with torch.inference_mode():
            self.runner.warm_up(self.cache)
            self.row_check = self.runner.check_rows(self.cache, self.vocab_size, self.context_length)
        if not self.row_check.exact:
            self._rows_not_exact()
        self.start_tiers()
        self._thread = threading.Thread(target=self._loop, name="radixcache-engine", daemon=True)
        self._thread.start()

    def _rows_not_exact(self) -> None:
        """A token's logits depend on its step here: turn off what promises otherwise (speculation), say why once."""
        was = "speculation turned off" if self.speculator is not None else "speculation was off already"
        self.speculator = None
        self.scheduler.propose = None
        log.warning(
            "row check failed on this machine (%s): %s; greedy output may differ with the batch a request lands in "
            "(GetModelInfo rows_exact=false, radixcache_rows_exact 0)",
            self.row_check.detail, was,
        )  # fmt: skip

    def start_tiers(self) -> None:
        """Open the disk tier in the background (start() does it; call it yourself when driving step())."""
        if self.tiers is not None:
            self.tiers.open_below(self._loaded, self.pool, device=self.device, backend=self.backend.name)

    def wait_tier_ready(self, timeout: float = 60.0) -> bool:
        """Wait until every tier is open and the disk's index rebuilt (True), or timeout (False). Works with and
        without the engine thread."""
        if self.tiers is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._thread is None:
                self._drain_inbox(block=False)
                self.tiers.pump()
            if self.tiers.ready:
                return True
            time.sleep(0.01)
        return self.tiers.ready

    def step(self) -> bool:
        """Without the thread (tests, in-process benchmarks): take queued calls, run one step. False when idle."""
        if self._thread is not None:
            raise RuntimeError("step() drives an engine that was not start()ed; this one runs its own thread")
        with torch.inference_mode():
            self._drain_inbox(block=False)
            if not self.scheduler.has_work():
                return False
            if not self.scheduler.can_step() and self.tiers is not None:
                self.tiers.wait(0.05)  # every waiting request waits for its pages from a tier
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
            thread = self._thread
            if thread is not None:
                self._inbox.put(lambda: setattr(self, "_stop_at", deadline))
        if thread is not None:
            thread.join()
            self._thread = None
        if self.tiers is not None:  # the warm restart: what memory holds goes to the disk, within the grace period
            self.tiers.close(None if timeout is None and drain else deadline)

    # --- calls from other threads ---------------------------------------------------------------------------
    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> None:
        """Queue a request. Raises ValueError / RequestTooLargeError before anything is allocated.

        With sampling.n > 1, on_output receives the outputs of n samples (RequestOutput.index), each ending with
        its own finish_reason; the prompt is computed once and its pages shared by the samples.
        """
        check_engine_request(request, self)  # on the caller's thread: it reads only immutable facts
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
                raise EngineStoppedError("the engine is shutting down and accepts no new requests")
            if request.request_id in self._live_ids:
                raise DuplicateRequestError(f"request_id {request.request_id!r} is already running; ids must be unique")
            self._live_ids.add(request.request_id)
            self._inbox.put(lambda: self._add(RequestSamples(samples)))

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
        self.runner.grammars.compile(constraint)

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread (where the cache lives) and return its result."""
        if self._thread is None:
            return fn()
        future: Future[T] = Future()

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

    def stats(self, namespace: str | None = None) -> EngineStats:
        """The whole worker's figures, or (namespace given) that tenant's own: its requests, tokens and cache view
        (PrefixCache.stats(namespace)), with the pool's capacity and the step count, which are the worker's."""
        return self.call(lambda: self._stats(namespace))

    def load(self) -> EngineLoad:
        return self.call(self._load)

    @property
    def alive(self) -> bool:
        """The engine thread runs (False before start(), after shutdown(), or if the loop died)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def flush_cache(self, namespace: str | None = None) -> int:
        """Drop what no running request reads: one tenant's namespace, or (None) every namespace."""
        return self.call(lambda: self.cache.flush(namespace))

    def pin(self, token_ids: list[int], namespace: str = "", ttl_s: float | None = None) -> int:
        """Pin the cached whole pages of token_ids. Raises radixcache.cache.PinBudgetError (nothing pinned) past the
        pin budget, or when it would take pages a live request was promised: pins never starve running requests."""
        return self.call(lambda: self._pin(token_ids, namespace, ttl_s))

    def _pin(self, token_ids: list[int], namespace: str, ttl_s: float | None) -> int:
        return self.cache.pin(token_ids, namespace, ttl=ttl_s, keep_unpinned=self.scheduler.promised_pages())

    def unpin(self, token_ids: list[int], namespace: str = "") -> int:
        return self.call(lambda: self.cache.unpin(token_ids, namespace))

    def explain(self, token_ids: list[int], namespace: str = "") -> Explanation:
        """What an admission of prompt token_ids in `namespace` would be served now, page by page, and why it would
        stop (radixcache.explain), read on the engine thread without changing the cache (no LRU touch, no lease)."""
        return self.call(lambda: self.cache.explain(token_ids, namespace))

    # --- the engine thread -----------------------------------------------------------------------------------
    def _detokenizer(self) -> IncrementalDetokenizer | NoText:
        return IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else NoText()

    def _add(self, samples: RequestSamples) -> None:
        """Queue sample 0; the others wait in `samples` until its prompt is computed (see _fork)."""
        self._requests[samples.first.request_id] = samples
        self.scheduler.add(samples.first)

    def _live_sequences(self) -> list[Sequence]:
        return [seq for samples in self._requests.values() for seq in samples.unfinished]

    def _abort(self, request_id: str) -> None:
        samples = self._requests.get(request_id)
        for seq in list(samples.unfinished if samples else ()):
            self._end(seq, FinishReason.ABORTED)

    def _end(
        self,
        seq: Sequence,
        reason: FinishReason | None = None,
        error: str | None = None,
        kind: ErrorKind = ErrorKind.INTERNAL,
    ) -> None:
        """Finish seq (release everything first, so a callback failure cannot leak), then send its last output.

        A sample 0 that ends before its prompt was computed (abort, error) ends the samples waiting on it the same
        way. The request id is free again once its last sample has ended.
        """
        if seq.status is SeqStatus.FINISHED:
            return
        if error is not None:
            seq.error_kind = kind
        self.scheduler.finish(seq, reason, error)
        samples = self._requests.get(seq.request_id)
        waiting = samples.end(seq) if samples is not None else []
        if samples is not None and samples.done:
            self._requests.pop(seq.request_id, None)
            self._counts(seq).finished_requests += 1
            with self._ids_lock:
                self._live_ids.discard(seq.request_id)
        self._emit(seq)
        for other in waiting:
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
                    self._drain_inbox(block=not self.scheduler.can_step())
                    if self.tiers is not None:  # the tiers' news (writes landed, loads arrived) while idle too
                        budget = 0.0 if self.scheduler.can_step() else IDLE_WRITE_BUDGET_S
                        self.tiers.pump(budget, room_coming=bool(self.scheduler.running))
                    if self._stop_at is not None and (
                        not self.scheduler.has_work() or time.monotonic() >= self._stop_at
                    ):
                        for seq in self._live_sequences():
                            self._end(seq, FinishReason.ABORTED)
                        return
                    if self.scheduler.can_step():
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

    def _stats(self, namespace: str | None = None) -> EngineStats:
        sched = self.scheduler
        counts = self.counts.total() if namespace is None else self.counts.of(namespace)

        def count(seqs: list[Sequence]) -> int:
            return len(seqs) if namespace is None else sum(seq.request.namespace == namespace for seq in seqs)

        return EngineStats(
            running=count(sched.running),
            waiting=count(sched.waiting),
            steps=self._steps,
            cache=self.cache.stats(namespace),
            **dataclasses.asdict(counts),
            kv_dtype=self.kv_dtype,
            kv_bytes_per_token=self.kv_bytes_per_token,
            rows_exact=self.row_check.exact,
        )

    def _counts(self, seq: Sequence) -> TenantCounts:
        """The counters of seq's tenant (the only ones there are)."""
        return self.counts[seq.request.namespace]

    def _load(self) -> EngineLoad:
        sched = self.scheduler
        return EngineLoad(
            running=len(sched.running),
            waiting=len(sched.waiting),
            queued_prefill_tokens=sched.prefill_backlog(),
            pages_busy=self.pool.num_pages - self.cache.available_pages(),
            pages_total=self.pool.num_pages,
            steps=self._steps,
        )

    # --- one step ----------------------------------------------------------------------------------------------
    def _step(self) -> None:
        """Plan, compute, then advance every chunk; a failed forward pass is retried chunk by chunk."""
        plan = self.scheduler.schedule()
        for failure in plan.failed:
            self._end(failure.seq, FinishReason.ERROR, failure.message, ErrorKind.NO_CAPACITY)
        if not plan.chunks:
            return
        try:
            logits = self.runner.forward(plan.chunks)
        except Exception:
            if not self._forward_alone(plan.chunks):
                return
        else:
            self._advance(plan.chunks, logits)
        self._steps += 1

    def _forward_alone(self, chunks: list[Chunk]) -> bool:
        """The batch's forward pass failed: find the culprit by computing each chunk alone, so one bad request does
        not fail its batch-mates (a batch of one just fails). True when the step went on that way."""
        if len(chunks) == 1:
            log.exception("forward failed for %s", chunks[0].seq.name)
            self._end(chunks[0].seq, FinishReason.ERROR, "internal error while computing this request")
            return False
        for chunk in chunks:
            try:
                self._advance([chunk], self.runner.forward([chunk]))
            except Exception:
                log.exception("forward failed for %s", chunk.seq.name)
                self._end(chunk.seq, FinishReason.ERROR, "internal error while computing this request")
        return True

    def _advance(self, chunks: list[Chunk], logits: torch.Tensor) -> None:
        """After the forward pass, chunk by chunk: what it computed counts, a chunk that reaches its sequence's end
        samples, completed pages are published, a request's other samples fork from its first, and each sequence
        emits or ends. A sequence whose sampling fails ends alone."""
        for chunk, rows in zip(chunks, self.runner.rows(chunks, logits), strict=True):
            seq = chunk.seq
            try:
                samples = chunk.samples  # before num_computed moves past the chunk
                seq.num_computed += chunk.num_new
                if samples:
                    self._take_tokens(seq, chunk.draft, rows)
                self.scheduler.published(seq)
                group = self._requests.get(seq.request_id)
                if samples and group is not None and seq is group.first and group.has_waiting_forks:
                    # the forks' matchers are at the start too: the same mask holds for them
                    self._fork(seq, group.take_forks(), rows.row(0), rows.allowed)
                self._end_or_emit(seq)
            except Exception as exc:
                self._sampling_failed(seq, exc)

    def _take_tokens(self, seq: Sequence, draft: list[int], rows: ChunkRows) -> None:
        """seq's next token from its chunk's first row; with a draft, the Speculator takes as many as it accepts."""

        def sample(i: int) -> None:  # row i: after the last token (with the batch's grammar mask), or draft token i-1
            logits = rows.row(i)
            self._sample(seq, logits, rows.allowed if i == 0 else self.runner.constrained_row(seq, logits))

        if not draft:
            sample(0)
            return
        assert self.speculator is not None  # only the Speculator's Proposer drafts
        verdict = self.speculator.verify(seq, draft, sample)
        self._counts(seq).add_draft(verdict.drafted, verdict.accepted)

    def _end_or_emit(self, seq: Sequence) -> None:
        if seq.finish_reason is not None:
            self._end(seq)
        else:
            self._emit(seq)

    def _fork(
        self, first: Sequence, forks: list[Sequence], logits: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> None:
        """first's prompt is computed and its first token sampled: start the request's other samples from a copy
        of its prompt, each drawing its own first token from the same logits (and the same constrained logits:
        every sample's grammar is still at its start)."""
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
            self._end(seq, FinishReason.ERROR, str(exc), ErrorKind.CONSTRAINT)
            return
        log.error("request %s failed", seq.name, exc_info=exc)
        self._end(seq, FinishReason.ERROR, "internal error while sampling this request")

    def _sample(self, seq: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        self.runner.sample(seq, logits, allowed)
        self.counts[seq.request.namespace].generated_tokens += 1
