"""Which sequences compute which tokens in the next step, and what happens when pages run out.

Policy, in order, each step (`schedule`):
1. Decodes: every running sequence with one token left to compute gets it (they are latency-bound and cheap).
2. Prefills already running continue, chunked to the step's remaining token budget.
3. Drafts (speculative decoding, with a `propose` callback): from the budget left, into pages nobody else needs
   (scheduler/drafts.py).
4. Waiting requests are admitted, ordered by cached-prefix length (longest first, so hits are taken before
   they are evicted), with aging: a request waiting more than `aging_steps` steps goes first, in arrival order.
   Admission goes by phase: the tiers (a prompt that continues into a tier waits for its load:
   scheduler/tier_loads.py), the pins (a request they leave no room is refused: scheduler/pins.py), a request whose
   prefix another running request is computing right now waits for those pages to be published instead of
   computing them twice, then the pages (its prompt must fit beside a reserve of one page per running sequence:
   scheduler/allocation.py). A request that does not fit with nothing running is refused as too big, unless a
   load under way for another waiting request locks pages it needs: it waits for that load to let go.
When pages run out mid-step, the most recently admitted running sequence is preempted by recompute: its computed
pages are published to the tree first, so its re-admission mostly hits.

Samples 2..n of a request (n > 1) are not queued: once sample 0 has computed the prompt, `fork` starts each of them
from a copy of its prompt (the cache's pages for what the tree holds, copied slots for the rest).

Every exit (finish, abort, error, preemption) goes through `_release`, which publishes what was computed and
returns the lease: no path leaks a page. Counters go to the request's tenant only (worker/engine/tenant_counts.py).
"""

from __future__ import annotations

from radixcache.cache import CacheFullError, Lease
from radixcache.cache_base import BaseCache
from radixcache.pool import KVPool
from radixcache.worker.engine.request import FinishReason
from radixcache.worker.engine.scheduler.allocation import Pages
from radixcache.worker.engine.scheduler.drafts import add_drafts
from radixcache.worker.engine.scheduler.pins import promised_pages, room_beside_pins
from radixcache.worker.engine.scheduler.plan import Chunk, Failure, Proposer, StepPlan, Waiting
from radixcache.worker.engine.scheduler.tier_loads import TierLoads
from radixcache.worker.engine.sequence import SeqStatus, Sequence
from radixcache.worker.engine.tenant_counts import TenantTable
from radixcache.worker.engine.tiers import EngineTiers

# Past this many waiting requests, ordering by cached prefix costs more than it saves: fall back to arrival order.
MAX_SORTED_WAITING = 128


class Scheduler:
    """The queues and the step's plan. `tiers`: the engine's tiers below memory (None: none); `counts`: where the
    request counters go (the engine reads the same table); `propose`: the drafts' Proposer (None: no speculation)."""

    def __init__(
        self,
        cache: BaseCache,
        pool: KVPool,
        *,
        max_step_tokens: int,
        max_running: int,
        aging_steps: int = 64,
        propose: Proposer | None = None,
        tiers: EngineTiers | None = None,
        counts: TenantTable | None = None,
    ) -> None:
        self.cache = cache
        self.pages = Pages(cache, pool)
        self.page_size = pool.page_size
        self.loads = TierLoads(tiers, pool.page_size)
        self.propose = propose
        self.counts = counts if counts is not None else TenantTable()
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        self.aging_steps = aging_steps
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.last_step_tokens = 0  # computed by the last step scheduled (the tier's write-through budget)
        self._admitted = 0

    # --- bookkeeping -------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_step(self) -> bool:
        """A step could do something now: something runs, a request could be admitted, or a load has arrived.
        False while every waiting request waits for its load from a tier (the caller may sleep until notified)."""
        if self.running or self.loads.has_arrivals():
            return True
        if self.loads.holding():
            return False
        return any(s.load_job is None or s.load_job.finished for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason | None = None, error: str | None = None) -> None:
        """End a sequence for good: publish what it computed, release its lease, drop it from the queues."""
        if reason is not None:
            seq.finish_reason = reason
            seq.error = error
        self._release(seq)
        self.loads.drop(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        if seq.lease is not None:
            self.cache.release(seq.lease, seq.tokens[: seq.num_computed])
            seq.lease = None
        seq.num_computed = 0
        seq.published_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: keep its tokens (prompt + generated so far), give back its pages to the cache."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.tier_probes = 0  # what it computed may be evicted to a tier before it comes back
        seq.waited_steps = self.aging_steps  # it was already admitted once: don't make it queue again
        self.waiting.insert(0, seq)
        self.counts[seq.request.namespace].preemptions += 1

    def published(self, seq: Sequence) -> None:
        """After a step: put newly completed pages into the tree so concurrent requests can share them, and give
        back the window parts (sliding layers) its next queries no longer read."""
        assert seq.lease is not None
        full = seq.num_computed - seq.num_computed % self.page_size
        if full > seq.published_tokens:
            self.cache.publish(seq.lease, seq.tokens[:full])
            seq.published_tokens = full
        self.cache.slide(seq.lease, seq.num_computed)

    def promised_pages(self) -> int:
        """Pages the largest live request may need alone. Pins must leave them unpinned (scheduler/pins.py)."""
        return promised_pages((*self.running, *self.waiting), self.page_size)

    def prefill_backlog(self) -> int:
        """Prompt tokens the live requests still have to compute (a prompt's last token is its first decode's): a
        running one's rest; a waiting one's prompt less what the cache holds of it now or, if more, what a running
        prefill of its namespace is computing of it (it waits for those pages: `_computing_our_prefix`). A waiting
        request whose prefix is cached, or on its way, queues its question, not its prefix: a router weighing this
        figure no longer sends a conversation away from the replica that holds it. Pages a tier below would load
        count as computed (an upper bound)."""
        prefilling = [s for s in self.running if s.prefilling]
        total = sum(max(0, len(s.tokens) - 1 - s.num_computed) for s in self.running)
        for s in self.waiting:
            prompt = len(s.tokens) - 1
            held = max(s.num_computed, self.cache.match_length(s.tokens[:-1], s.request.namespace,
                                                               salt=s.request.cache_salt))  # fmt: skip
            if s.request.cache_salt is None:  # a salted one waits for no one (_computing_our_prefix)
                coming = (s.common_prefix(o) for o in prefilling if o.request.namespace == s.request.namespace)
                held = max(held, *coming, 0)
            total += max(0, prompt - held)
        return total

    # --- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Chunks to compute this step, and sequences that must fail (they cannot fit even alone)."""
        chunks: dict[Sequence, Chunk] = {}
        failed: list[Failure] = []
        # loads that arrived go into the tree before anyone is admitted (whole: while requests run, they wait for room)
        self.loads.pump(self.last_step_tokens, room_coming=bool(self.running))
        self._continue_running(chunks, failed)
        budget = self.max_step_tokens - sum(c.num_new for c in chunks.values())
        if self.propose is not None:
            budget -= add_drafts(list(chunks.values()), budget, self.propose, self.pages, self.running)
        self._admit(budget, chunks, failed)
        for seq in self.waiting:
            seq.waited_steps += 1
        self.last_step_tokens = sum(c.num_new for c in chunks.values())
        # Decodes first, then prefills: the order rows appear in the batch does not change any result.
        return StepPlan(sorted(chunks.values(), key=lambda c: (c.num_tokens > 1, c.seq.admit_order)), failed)

    def _continue_running(self, chunks: dict[Sequence, Chunk], failed: list[Failure]) -> None:
        """Phases 1 and 2: each running sequence's next tokens, oldest first, while the budget lasts."""
        budget = self.max_step_tokens
        for seq in list(self.running):  # admission order, oldest first; victims are taken from the end
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            want = min(budget, len(seq.tokens) - seq.num_computed)
            if self._reserve(seq, seq.num_computed + want, chunks, failed):
                chunks[seq] = Chunk(seq, want)
                budget -= want

    def _reserve(self, seq: Sequence, upto: int, chunks: dict[Sequence, Chunk], failed: list[Failure]) -> bool:
        """Make seq's block table cover `upto` tokens, preempting newer sequences if needed. False: seq lost."""
        assert seq.lease is not None
        need = self.pages.pages_for(upto) - len(seq.lease.pages)
        while need > 0:
            try:
                self.cache.allocate(seq.lease, need)
                return True
            except CacheFullError as exc:
                victim = self.running[-1]  # the most recently admitted
                if victim is seq and len(self.running) == 1:
                    failed.append(Failure(seq, f"the KV cache cannot hold this request even alone: {exc}"))
                    return False
                chunks.pop(victim, None)
                self.preempt(victim)
                if victim is seq:
                    return False
        return True

    def _admit(self, budget: int, chunks: dict[Sequence, Chunk], failed: list[Failure]) -> None:
        """Phase 4: waiting requests in admission order, phase by phase (the module docstring)."""
        promised = self.pages.promised_to_prefills(self.running)
        if self.loads.holding():
            return  # the fleet's store is being joined: what waits is served from it from the first request
        ordered = self._ordered_waiting()
        self.loads.prefetch(ordered, self.waiting)
        for candidate in ordered:
            if budget == 0 or len(self.running) >= self.max_running:
                return
            seq, cached = candidate.seq, candidate.cached
            if seq.load_job is not None:
                if not self.loads.arrived(seq):
                    continue  # its pages are on their way from a tier: it waits, nobody else does
                cached = self.cache.match_length(seq.tokens[:-1], seq.request.namespace, salt=seq.request.cache_salt)
            if not seq.admitted_once and (why := room_beside_pins(self.cache, seq)) is not None:
                failed.append(Failure(seq, why))
                continue
            if self._computing_our_prefix(seq, cached):
                continue
            lease = self.pages.lease_prompt(seq, cached, promised, len(self.running))
            if lease is None:
                if not self.running and not self.loads.locking_for_others(seq):
                    need = self.pages.prompt_need(seq, cached)
                    failed.append(Failure(seq, f"the KV cache cannot hold this request: it needs {need} more pages"))
                    continue
                if seq.waited_steps >= self.aging_steps:
                    return  # a starving request blocks the queue until it fits: nothing overtakes it forever
                continue
            promised += self.pages.pages_for(len(seq.tokens)) - len(lease.pages)
            self._start(seq, lease)
            want = min(budget, len(seq.tokens) - seq.num_computed)
            chunks[seq] = Chunk(seq, want)
            budget -= want
            if not self._reserve(seq, seq.num_computed + want, chunks, failed):
                return

    def _ordered_waiting(self) -> list[Waiting]:
        """Waiting sequences in admission order, each with how many of its tokens the cache holds now."""
        cached = [
            Waiting(s, self.cache.match_length(s.tokens[:-1], s.request.namespace, salt=s.request.cache_salt))
            for s in self.waiting
        ]
        if len(cached) > MAX_SORTED_WAITING:
            return sorted(cached, key=lambda w: w.seq.arrival)
        starving = sorted((w for w in cached if w.seq.waited_steps >= self.aging_steps), key=lambda w: w.seq.arrival)
        rest = sorted(
            (w for w in cached if w.seq.waited_steps < self.aging_steps), key=lambda w: (-w.cached, w.seq.arrival)
        )
        return starving + rest

    def _computing_our_prefix(self, seq: Sequence, cached: int) -> bool:
        """Another running request is computing pages of seq's prefix that the cache does not hold yet (a salted one
        waits for no one: the pages of another salt are not its, and waiting would tell it they are being made)."""
        if seq.request.cache_salt is not None:
            return False
        for other in self.running:
            if other.request.namespace != seq.request.namespace or not other.prefilling:
                continue
            shared = min(seq.common_prefix(other), len(seq.tokens) - 1)
            if other.num_computed < shared and shared - cached >= self.page_size:
                return True
        return False

    def _start(self, seq: Sequence, lease: Lease) -> None:
        """Admit seq with its lease; count the admission for its tenant (the prompt only at its first)."""
        self.cache.count_lookup(lease)  # each admission (re-admission too) counts its lookup once
        mine = self.counts[seq.request.namespace]
        self.loads.count_hits(seq, lease.cached_tokens, mine)
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.cached_tokens = min(lease.cached_tokens, seq.num_prompt)
            seq.cache_miss = lease.miss
            mine.prompt_tokens += seq.num_prompt
            mine.cached_tokens += seq.cached_tokens
            if lease.cached_tokens > 0 and any(
                other.request.namespace == seq.request.namespace and other.common_prefix(seq) >= lease.cached_tokens
                for other in self.running
            ):
                mine.inflight_shared_tokens += seq.cached_tokens
        self.waiting.remove(seq)
        self._run(seq, lease)

    def _run(self, seq: Sequence, lease: Lease) -> None:
        seq.lease = lease
        seq.num_computed = lease.cached_tokens
        self.running.append(seq)
        seq.status = SeqStatus.RUNNING
        self._admitted += 1
        seq.admit_order = self._admitted

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start `child` (another sample of parent's request) with parent's prompt already computed.

        Call right after parent's prompt was computed and published (its lease still holds every prompt page).
        The child leases the tree's pages of the prompt and gets private copies of the rest (Pages.fork_lease).
        Returns True when the child runs now (sample its first token from the parent's logits); False when no page
        could be had for the copies: the child then waits, like a preempted sequence, to compute its prompt itself.
        """
        assert parent.lease is not None and parent.num_computed >= parent.num_prompt
        child.admitted_once = True  # the request's prompt and cached tokens were counted with sample 0
        child.cached_tokens = parent.cached_tokens
        child.cache_miss = parent.cache_miss
        lease = self.pages.fork_lease(parent, child)
        if lease is None:
            child.waited_steps = self.aging_steps
            self.waiting.insert(0, child)
            return False
        shared = lease.cached_tokens
        child.published_tokens = shared - shared % self.page_size
        self._run(child, lease)
        child.num_computed = parent.num_prompt
        return True
