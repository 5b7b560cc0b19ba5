"""Admission's tier phase: the waiting prompts that continue into a tier below memory are loaded before they run.

Before a waiting request is admitted, the tiers are looked at past what memory holds of its prompt (for the first
MAX_TIER_LOADS waiting ones in admission order); pages found there are loaded by the tier link's loader thread while
the request keeps waiting (it is not admitted until its load is through; nobody else waits), then published, so its
admission hits them. Requests wanting the same pages share one load. What a load brought is counted, by medium, as
the tenant's tier hits at its next admission. The tiers are the engine's (worker/engine/tiers.py), handed in.
"""

from __future__ import annotations

from radixcache.tiering import STEP_WRITE_BUDGET_S, WRITE_BUDGET_PER_TOKEN_S
from radixcache.worker.engine.scheduler.plan import Waiting
from radixcache.worker.engine.sequence import Sequence
from radixcache.worker.engine.tenant_counts import TenantCounts
from radixcache.worker.engine.tiers import EngineTiers

# Loads from the tiers in flight at most (each holds a lease and, once through, the pages it brings), and how often
# one waiting request may start one before it is admitted (a load whose pages were evicted again before admission).
MAX_TIER_LOADS = 4
MAX_TIER_PROBES = 3


class TierLoads:
    """The scheduler's side of the tiers: `tiers` None (no tier configured) makes every method a no-op."""

    def __init__(self, tiers: EngineTiers | None, page_size: int) -> None:
        self.tiers = tiers
        self.page_size = page_size

    def pump(self, last_step_tokens: int, room_coming: bool = False) -> None:
        """Before anyone is admitted: loads that arrived go into the tree (one that does not fit yet waits, whole,
        while `room_coming`: running requests will give pages back), and the write-through gets its budget (a
        base, and more for each token the last step computed)."""
        if self.tiers is not None:
            self.tiers.pump(STEP_WRITE_BUDGET_S + WRITE_BUDGET_PER_TOKEN_S * last_step_tokens, room_coming)

    def has_arrivals(self) -> bool:
        return self.tiers is not None and self.tiers.has_arrivals()

    def holding(self) -> bool:
        """Nobody is admitted yet: the fleet's store is still being joined (EngineTiers.joining_store, bounded)."""
        return self.tiers is not None and self.tiers.joining_store

    def prefetch(self, ordered: list[Waiting], waiting: list[Sequence]) -> None:
        """Start loads for the first of `ordered` (admission order) whose prompt continues into a tier."""
        tiers = self.tiers
        if tiers is None or not tiers.active:
            return
        inflight = len({id(s.load_job) for s in waiting if s.load_job is not None and not s.load_job.finished})
        for candidate in ordered[: 2 * MAX_TIER_LOADS]:
            if inflight >= MAX_TIER_LOADS:
                return
            seq = candidate.seq
            if seq.load_job is not None or seq.tier_probes >= MAX_TIER_PROBES:
                continue
            seq.tier_probes += 1
            # every whole page of the prompt: admission reads all but its last token, copying the page it ends in
            salt = seq.request.cache_salt
            if salt is not None:  # a salted prompt loads nothing: its salted pages live in a namespace of their own
                continue
            job = tiers.start_load(seq.name, seq.tokens, seq.request.namespace, len(seq.tokens))
            if job is None:
                seq.tier_probes = MAX_TIER_PROBES  # nothing there: look again only after its next admission
            else:
                seq.load_job = job
                inflight += job.waiters == 1

    def arrived(self, seq: Sequence) -> bool:
        """False while seq's load from a tier is under way; once through, note what it brought."""
        job = seq.load_job
        if job is None:
            return True
        if not job.finished:
            return False
        seq.load_job = None
        if not job.loaded:  # nothing came (the fleet's store answers "maybe" until asked): do not ask again
            seq.tier_probes = MAX_TIER_PROBES
        for medium, pages in job.loaded.items():
            seq.tier_tokens[medium] = seq.tier_tokens.get(medium, 0) + pages * self.page_size
        return True

    def locking_for_others(self, seq: Sequence) -> bool:
        """A load other than seq's own locks the prefix it extends until it is through, so pages seq cannot get
        now may be free then (the tier link decides, as it does for a load waiting for room)."""
        return self.tiers is not None and self.tiers.loads_holding(besides=seq.load_job)

    def drop(self, seq: Sequence) -> None:
        """seq ended: it waits for its load no more."""
        if seq.load_job is not None:
            if self.tiers is not None:
                self.tiers.cancel(seq.load_job)
            seq.load_job = None

    @staticmethod
    def count_hits(seq: Sequence, cached: int, counts: TenantCounts) -> None:
        """At an admission that hit `cached` tokens: those its loads brought back count as the tenant's tier hits
        (by medium; the rest hit memory). seq may look into the tiers again before its next admission."""
        for medium, tokens in seq.tier_tokens.items():
            served = min(tokens, cached)
            counts.add_tier_hit(medium, served)
            cached -= served
        seq.tier_tokens = {}
        seq.tier_probes = 0
