"""Which sequences compute which tokens in the next step, and what happens when pages run out.

Policy, in order, each step:
1. Decodes: every running sequence with one token left to compute gets it (they are latency-bound and cheap).
2. Prefills already running continue, chunked to the step's remaining token budget.
3. Waiting requests are admitted, ordered by cached-prefix length (longest first, so hits are taken before
   they are evicted), with aging: a request waiting more than `aging_steps` steps goes first, in arrival order.
   A request is admitted only if free + evictable pages cover what its prompt still needs plus a reserve of one
   page per running sequence; a request whose prefix another running request is computing right now waits for
   those pages to be published instead of computing them twice.
When pages run out mid-step, the most recently admitted running sequence is preempted by recompute: its computed
pages are published to the tree first, so its re-admission mostly hits.
4. Drafts (speculative decoding, with a `propose` callback): a running sequence whose chunk ends at its last token
   and that has generated a token already may carry draft tokens after it, verified in the same forward pass. They
   come after every running sequence's own chunk and before admissions, from the budget left, and only into pages
   that need no preemption: the slots its pages still have, plus pages beyond what running prefills were promised
   and the reserve of one page per running sequence. A draft never preempts or fails anyone.

With tiers below memory (the cache's `tier`, radixcache.tiering): before a waiting request is admitted, the tiers
are looked at past what memory holds of its prompt (for the first MAX_TIER_LOADS waiting ones in admission order);
pages found there are loaded by the tier's loader thread while the request keeps waiting (it is not admitted until
its load is through; nobody else waits), then published, so its admission hits them. Requests wanting the same
pages share one load.

Samples 2..n of a request (n > 1) are not queued: once sample 0 has computed the prompt, `fork` starts each of them
from a copy of its prompt (the cache's pages for what the tree holds, copied slots for the rest).

Every exit (finish, abort, error, preemption) goes through `_release`, which publishes what was computed and
returns the lease: no path leaks a page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixcache.cache import CacheFullError, Lease
from radixcache.cache_base import BaseCache
from radixcache.pool import KVPool
from radixcache.tier import MEDIUM_DISK, MEDIUM_HOST
from radixcache.tiering import STEP_WRITE_BUDGET_S, WRITE_BUDGET_PER_TOKEN_S
from radixcache.worker.engine.request import FinishReason
from radixcache.worker.engine.sequence import SeqStatus, Sequence
from radixcache.worker.engine.tenant_counts import tenant_table

# Past this many waiting requests, ordering by cached prefix costs more than it saves: fall back to arrival order.
MAX_SORTED_WAITING = 128
# Loads from the tiers in flight at most (each holds a lease and, once through, the pages it brings), and how often
# one waiting request may start one before it is admitted (a load whose pages were evicted again before admission).
MAX_TIER_LOADS = 4
MAX_TIER_PROBES = 3


@dataclass
class Chunk:
    """num_new of seq's tokens from seq.num_computed on, then the draft tokens (not in seq.tokens) to verify."""

    seq: Sequence
    num_new: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence's tokens, so its last row yields the next token."""
        return self.seq.num_computed + self.num_new == len(self.seq.tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (what the step's budget counts)."""
        return self.num_new + len(self.draft)

    @property
    def num_rows(self) -> int:
        """Rows of logits the chunk yields: its last token's, then one per draft token."""
        return 1 + len(self.draft)


# (sequence, most tokens) -> draft tokens to verify after the sequence's last token
Proposer = Callable[[Sequence, int], list[int]]


class Scheduler:
    def __init__(
        self,
        cache: BaseCache,
        pool: KVPool,
        *,
        max_step_tokens: int,
        max_running: int,
        aging_steps: int = 64,
        propose: Proposer | None = None,
    ) -> None:
        self.cache = cache
        self.propose = propose
        self.pool = pool
        self.page_size = pool.page_size
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        self.aging_steps = aging_steps
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.inflight_shared_tokens = 0  # prompt tokens hit while the request that computed them still ran
        self.prompt_tokens = 0  # over first admissions (a preempted request's recompute is not counted again)
        self.cached_tokens = 0
        self.tier_hit_tokens: dict[str, int] = {}  # medium -> admitted tokens that a tier load brought back
        self.last_step_tokens = 0  # computed by the last step scheduled (the tier's write-through budget)
        self.tenants = tenant_table()  # the counters above, per namespace (and the engine's, per worker.tenant_counts)
        self._admitted = 0

    # --- bookkeeping -------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_step(self) -> bool:
        """A step could do something now: something runs, a request could be admitted, or a load has arrived.
        False while every waiting request waits for its load from a tier (the caller may sleep until notified)."""
        if self.running:
            return True
        tier = self.cache.tier
        if tier is not None and tier.has_completions():
            return True
        return any(s.load_job is None or s.load_job.finished for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason | None = None, error: str | None = None) -> None:
        """End a sequence for good: publish what it computed, release its lease, drop it from the queues."""
        if reason is not None:
            seq.finish_reason = reason
            seq.error = error
        self._release(seq)
        self._drop_load(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _drop_load(self, seq: Sequence) -> None:
        if seq.load_job is not None:
            if self.cache.tier is not None:
                self.cache.tier.cancel(seq.load_job)
            seq.load_job = None

    def _release(self, seq: Sequence) -> None:
        if seq.lease is not None:
            self.cache.release(seq.lease, seq.tokens[: seq.num_computed])
            seq.lease = None
        seq.num_computed = 0
        seq.published_tokens = 0

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: keep its tokens (prompt + generated so far), give back its pages to the cache."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.tier_probes = 0  # what it computed may be evicted to a tier before it comes back
        seq.waited_steps = self.aging_steps  # it was already admitted once: don't make it queue again
        self.waiting.insert(0, seq)
        self.preemptions += 1
        self.tenants[seq.request.namespace].preemptions += 1

    def published(self, seq: Sequence) -> None:
        """After a step: put newly completed pages into the tree so concurrent requests can share them, and give
        back the window parts (sliding layers) its next queries no longer read."""
        assert seq.lease is not None
        full = seq.num_computed - seq.num_computed % self.page_size
        if full > seq.published_tokens:
            self.cache.publish(seq.lease, seq.tokens[:full])
            seq.published_tokens = full
        self.cache.slide(seq.lease, seq.num_computed)

    # --- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Chunk], list[tuple[Sequence, str]]]:
        """Chunks to compute this step, and sequences that must fail (they cannot fit even alone)."""
        chunks: dict[Sequence, Chunk] = {}
        failed: list[tuple[Sequence, str]] = []
        if self.cache.tier is not None:  # loads that arrived go into the tree before anyone is admitted
            self.cache.tier.pump(STEP_WRITE_BUDGET_S + WRITE_BUDGET_PER_TOKEN_S * self.last_step_tokens)
        budget = self.max_step_tokens
        for seq in list(self.running):  # admission order, oldest first; victims are taken from the end
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            want = min(budget, len(seq.tokens) - seq.num_computed)
            got = self._reserve(seq, seq.num_computed + want, chunks, failed)
            if got:
                chunks[seq] = Chunk(seq, want)
                budget -= want
        budget = self.max_step_tokens - sum(c.num_new for c in chunks.values())
        if self.propose is not None:
            budget -= self._add_drafts(chunks, budget)
        self._admit(budget, chunks, failed)
        for seq in self.waiting:
            seq.waited_steps += 1
        self.last_step_tokens = sum(c.num_new for c in chunks.values())
        # Decodes first, then prefills: the order rows appear in the batch does not change any result.
        return sorted(chunks.values(), key=lambda c: (c.num_tokens > 1, c.seq.admit_order)), failed

    def _add_drafts(self, chunks: dict[Sequence, Chunk], budget: int) -> int:
        """Give the chunks that end at their sequence's last token a draft, oldest sequence first, within `budget`
        tokens and the pages nobody else needs. Returns the tokens drafted."""
        assert self.propose is not None
        spare = self.cache.available_pages() - self._promised_prefill_pages() - len(self.running)
        drafted = 0
        for chunk in list(chunks.values()):
            seq = chunk.seq
            if budget - drafted < 1 or not chunk.samples or seq.num_generated == 0 or seq.lease is None:
                continue
            draft = self.propose(seq, budget - drafted)
            if not draft:
                continue
            end = seq.num_computed + chunk.num_new
            held = len(seq.lease.pages)
            draft = draft[: held * self.page_size - end + max(0, spare) * self.page_size]
            need = self._pages_for(end + len(draft)) - held
            if need > 0:
                try:
                    self.cache.allocate(seq.lease, need)
                except CacheFullError:  # spare counted evictable pages that are not (cannot happen; stay safe)
                    draft = draft[: held * self.page_size - end]
                    need = 0
                spare -= need
            chunk.draft = draft
            drafted += len(draft)
        return drafted

    def _promised_prefill_pages(self) -> int:
        """Pages that running prefills will still ask for: promised to them, not available to newcomers or drafts."""
        return sum(max(0, self._pages_for(len(s.tokens)) - len(s.lease.pages)) for s in self.running if s.lease)

    def _reserve(
        self, seq: Sequence, upto: int, chunks: dict[Sequence, Chunk], failed: list[tuple[Sequence, str]]
    ) -> bool:
        """Make seq's block table cover `upto` tokens, preempting newer sequences if needed. False: seq lost."""
        assert seq.lease is not None
        need = self._pages_for(upto) - len(seq.lease.pages)
        while need > 0:
            try:
                self.cache.allocate(seq.lease, need)
                return True
            except CacheFullError as exc:
                victim = self.running[-1]  # the most recently admitted
                if victim is seq and len(self.running) == 1:
                    failed.append((seq, f"the KV cache cannot hold this request even alone: {exc}"))
                    return False
                chunks.pop(victim, None)
                self.preempt(victim)
                if victim is seq:
                    return False
        return True

    def _total_pages(self, seq: Sequence) -> int:
        """Pages seq holds at most: its prompt and every token it may generate."""
        return self._pages_for(seq.num_prompt + seq.request.sampling.max_tokens)

    def promised_pages(self) -> int:
        """Pages the largest live request may need alone. Pins must leave them unpinned: with those, any request the
        worker took can run to its end, preempting the others if need be, and never fails for capacity."""
        return max((self._total_pages(s) for s in (*self.running, *self.waiting)), default=0)

    def _pins_leave_room(self, seq: Sequence) -> str | None:
        """None if seq fits in the pool beside the pins it does not read; else why not (it is refused before it
        starts: pins cannot grow past a live request's needs, so this is the only moment they can block it)."""
        need, total = self._total_pages(seq), self.cache.num_pages
        if need <= total - self.cache.pinned_pages():
            return None
        pinned = self.cache.pinned_pages(seq.tokens, seq.request.namespace)
        if need <= total - pinned:
            return None
        return (
            f"the KV cache cannot hold this request: prompt + max_tokens need {need} pages and {pinned} of the "
            f"{total} pages are pinned (PinPrefix; at most {self.cache.max_pinned_pages} by --max-pinned)"
        )

    def _ordered_waiting(self) -> list[tuple[Sequence, int]]:
        """Waiting sequences in admission order, each with how many of its tokens the cache holds now."""
        cached = [(s, self.cache.match_length(s.tokens[:-1], s.request.namespace)) for s in self.waiting]
        if len(cached) > MAX_SORTED_WAITING:
            return sorted(cached, key=lambda sc: sc[0].arrival)
        starving = sorted((sc for sc in cached if sc[0].waited_steps >= self.aging_steps), key=lambda sc: sc[0].arrival)
        rest = sorted(
            (sc for sc in cached if sc[0].waited_steps < self.aging_steps), key=lambda sc: (-sc[1], sc[0].arrival)
        )
        return starving + rest

    def _computing_our_prefix(self, seq: Sequence, cached: int) -> bool:
        """Another running request is computing pages of seq's prefix that the cache does not hold yet."""
        for other in self.running:
            if other.request.namespace != seq.request.namespace or not other.prefilling:
                continue
            shared = min(seq.common_prefix(other), len(seq.tokens) - 1)
            if other.num_computed < shared and shared - cached >= self.page_size:
                return True
        return False

    def _prefetch(self, ordered: list[tuple[Sequence, int]]) -> None:
        """Start loads from the tiers for the first waiting requests whose prompt continues there."""
        tier = self.cache.tier
        if tier is None or not tier.active:
            return
        inflight = len({id(s.load_job) for s in self.waiting if s.load_job is not None and not s.load_job.finished})
        for seq, _ in ordered[: 2 * MAX_TIER_LOADS]:
            if inflight >= MAX_TIER_LOADS:
                return
            if seq.load_job is not None or seq.tier_probes >= MAX_TIER_PROBES:
                continue
            seq.tier_probes += 1
            # every whole page of the prompt: admission reads all but its last token, copying the page it ends in
            job = tier.start_load(seq.name, seq.tokens, seq.request.namespace, len(seq.tokens))
            if job is None:
                seq.tier_probes = MAX_TIER_PROBES  # nothing there: look again only after its next admission
            else:
                seq.load_job = job
                inflight += job.waiters == 1

    def _loaded(self, seq: Sequence) -> bool:
        """False while seq's load from a tier is under way; once through, note what it brought."""
        job = seq.load_job
        if job is None:
            return True
        if not job.finished:
            return False
        seq.load_job = None
        for medium, pages in job.loaded.items():
            seq.tier_tokens[medium] = seq.tier_tokens.get(medium, 0) + pages * self.page_size
        return True

    def _admit(self, budget: int, chunks: dict[Sequence, Chunk], failed: list[tuple[Sequence, str]]) -> None:
        promised = self._promised_prefill_pages()
        ordered = self._ordered_waiting()
        self._prefetch(ordered)
        for seq, cached in ordered:
            if budget == 0 or len(self.running) >= self.max_running:
                return
            if seq.load_job is not None:
                if not self._loaded(seq):
                    continue  # its pages are on their way from a tier: it waits, nobody else does
                cached = self.cache.match_length(seq.tokens[:-1], seq.request.namespace)
            ns, prompt = seq.request.namespace, seq.tokens
            if not seq.admitted_once and (why := self._pins_leave_room(seq)) is not None:
                failed.append((seq, why))
                continue
            if self._computing_our_prefix(seq, cached):
                continue
            # Cheap check first (no lease, so a request that keeps waiting does not count as a lookup every step),
            # then the exact one: the matched pages stop being evictable once the lease locks them.
            fits = self.cache.available_pages() - promised - len(self.running)
            lease = None
            if self._pages_for(len(prompt)) - cached // self.page_size <= fits:
                lease = self.cache.acquire(seq.name, prompt, ns, max_cached=len(prompt) - 1, count=False)
                self._copy_hit(lease)
                need = self._pages_for(len(prompt)) - len(lease.pages)
                if self.cache.available_pages() - promised - need < len(self.running):
                    self.cache.release(lease)
                    lease = None
            if lease is None:
                need = self._pages_for(len(prompt)) - cached // self.page_size
                if not self.running:
                    failed.append((seq, f"the KV cache cannot hold this request: it needs {need} more pages"))
                    continue
                if seq.waited_steps >= self.aging_steps:
                    return  # a starving request blocks the queue until it fits: nothing overtakes it forever
                continue
            self._start(seq, lease)
            promised += need
            want = min(budget, len(prompt) - seq.num_computed)
            chunks[seq] = Chunk(seq, want)
            budget -= want
            if not self._reserve(seq, seq.num_computed + want, chunks, failed):
                return

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start `child` (another sample of parent's request) with parent's prompt already computed.

        Call right after parent's prompt was computed and published (its lease still holds every prompt page).
        The child leases the tree's pages of the prompt and gets private copies of the rest (at least the partial
        last page, which each sample goes on writing). Returns True when the child runs now (sample its first token
        from the parent's logits); False when no page could be had for the copies: the child then waits, like a
        preempted sequence, to compute its prompt itself.
        """
        assert parent.lease is not None and parent.num_computed >= parent.num_prompt
        child.admitted_once = True  # the request's prompt and cached tokens were counted with sample 0
        child.cached_tokens = parent.cached_tokens
        prompt = parent.tokens[: parent.num_prompt]
        # not a lookup of its own: the request's was counted with sample 0
        lease = self.cache.acquire(child.name, prompt, parent.request.namespace, max_cached=len(prompt), count=False)
        self._copy_hit(lease)
        shared = lease.cached_tokens
        try:
            self.cache.allocate(lease, self._pages_for(len(prompt)) - len(lease.pages))
        except CacheFullError:
            self.cache.release(lease)
            child.waited_steps = self.aging_steps
            self.waiting.insert(0, child)
            return False
        for j in range(shared // self.page_size, self._pages_for(len(prompt))):
            slots = min(self.page_size, len(prompt) - j * self.page_size)
            self._copy_slots(parent.lease.pages[j], lease.pages[j], slots)
        child.published_tokens = shared - shared % self.page_size
        self._run(child, lease)
        child.num_computed = len(prompt)
        return True

    def _count_tier_hits(self, seq: Sequence, cached: int) -> None:
        """Of the tokens this admission hit, those its tier loads brought back (by medium; the rest hit memory)."""
        mine = self.tenants[seq.request.namespace]
        for medium, tokens in seq.tier_tokens.items():
            served = min(tokens, cached)
            self.tier_hit_tokens[medium] = self.tier_hit_tokens.get(medium, 0) + served
            field = {MEDIUM_HOST: "host_hit_tokens", MEDIUM_DISK: "disk_hit_tokens"}[medium]
            setattr(mine, field, getattr(mine, field) + served)
            cached -= served
        seq.tier_tokens = {}
        seq.tier_probes = 0

    def _copy_hit(self, lease: Lease) -> None:
        """A hit ending inside a page: copy its slots into the lease's own page, then let go of the source, so that
        admission counts the page once (the lease never holds the same tokens twice). On failure, no lease is left."""
        if lease.copy_from is None:
            return
        try:
            copy = lease.copy_from
            self._copy_slots(copy.src, copy.dst, copy.tokens)
            self.cache.copied(lease)
        except BaseException:
            self.cache.release(lease)
            raise

    def _copy_slots(self, src: int, dst: int, k: int) -> None:
        """The first k token slots of page src into page dst, every layer (window parts too, where both have one)."""
        self.pool.copy_prefix(src, dst, k, *(self.cache.window_slots([src, dst]) or (-1, -1)))

    def _start(self, seq: Sequence, lease: Lease) -> None:
        self.cache.count_lookup(lease)  # each admission (re-admission too) counts its lookup once
        self._count_tier_hits(seq, lease.cached_tokens)
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.cached_tokens = min(lease.cached_tokens, seq.num_prompt)
            self.prompt_tokens += seq.num_prompt
            self.cached_tokens += seq.cached_tokens
            mine = self.tenants[seq.request.namespace]
            mine.prompt_tokens += seq.num_prompt
            mine.cached_tokens += seq.cached_tokens
            if lease.cached_tokens > 0 and any(
                other.request.namespace == seq.request.namespace and other.common_prefix(seq) >= lease.cached_tokens
                for other in self.running
            ):
                self.inflight_shared_tokens += seq.cached_tokens
                mine.inflight_shared_tokens += seq.cached_tokens
        self.waiting.remove(seq)
        self._run(seq, lease)

    def _run(self, seq: Sequence, lease) -> None:
        seq.lease = lease
        seq.num_computed = lease.cached_tokens
        self.running.append(seq)
        seq.status = SeqStatus.RUNNING
        self._admitted += 1
        seq.admit_order = self._admitted
