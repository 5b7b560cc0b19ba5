"""Each tenant's request counters, kept once: a tenant's GetCacheStats shows its own record, the worker's is the sum.

Every counter of an engine's requests (admissions, tokens, preemptions, tier hits, drafts) lives in exactly one
TenantCounts, the one of the request's namespace, and is bumped there only; `TenantTable.total()` adds them up for
the worker's figures, so the two can never disagree. The scheduler counts admissions, preemptions and tier hits, the
engine tokens generated, requests finished and drafts verified, all on the engine thread (no lock). Tenants are
namespaces, which the tokens file bounds, so a sum over them is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from radixcache.tier import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_STORE


@dataclass
class TenantCounts:
    prompt_tokens: int = 0  # over first admissions
    cached_tokens: int = 0  # of those, served from the cache
    inflight_shared_tokens: int = 0  # cached tokens a still-running request (of the same tenant) had just computed
    preemptions: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    host_hit_tokens: int = 0  # of the cache's hit tokens (every admission), loaded back from host memory
    disk_hit_tokens: int = 0  # ... and from the disk (radixcache.tiering)
    store_hit_tokens: int = 0  # ... and from the fleet's shared store (radixcache.remote_tier)
    draft_tokens: int = 0  # speculative draft tokens checked
    accepted_draft_tokens: int = 0  # of those, the sampled token
    draft_steps: int = 0  # sequence-steps that checked a draft

    def add_tier_hit(self, medium: str, tokens: int) -> None:
        """`tokens` of an admission's hit came back from the tier `medium` (radixcache.tier: host, disk or store)."""
        if medium == MEDIUM_HOST:
            self.host_hit_tokens += tokens
        elif medium == MEDIUM_DISK:
            self.disk_hit_tokens += tokens
        elif medium == MEDIUM_STORE:
            self.store_hit_tokens += tokens
        else:
            raise ValueError(f"no tier hit counter for medium {medium!r}")

    def add_draft(self, drafted: int, accepted: int) -> None:
        """One sequence-step checked a draft of `drafted` tokens and accepted `accepted` of them."""
        self.draft_tokens += drafted
        self.accepted_draft_tokens += accepted
        self.draft_steps += 1


COUNTERS = tuple(f.name for f in fields(TenantCounts))


class TenantTable(dict[str, TenantCounts]):
    """namespace -> its TenantCounts, made on first use (`table[ns].preemptions += 1`). Engine thread only.

    A dict, so the lookup on every sampled token stays a C one; `get` and `of` create nothing."""

    def __missing__(self, namespace: str) -> TenantCounts:
        counts = self[namespace] = TenantCounts()
        return counts

    def of(self, namespace: str) -> TenantCounts:
        """A copy of one tenant's counts (zeros for a tenant never seen, which is not added to the table)."""
        counts = self.get(namespace)
        return TenantCounts() if counts is None else TenantCounts(**{k: getattr(counts, k) for k in COUNTERS})

    def total(self) -> TenantCounts:
        """The worker's counts: every tenant's added up, counter by counter."""
        everyone = list(self.values())
        return TenantCounts(**{k: sum(getattr(c, k) for c in everyone) for k in COUNTERS})
