"""Each tenant's request counters, so that a tenant's GetCacheStats shows its own traffic and nobody else's.

The scheduler counts admissions and preemptions, the engine tokens generated and requests finished, all on the
engine thread (no lock). Tenants are namespaces, which the tokens file bounds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


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
    draft_tokens: int = 0  # speculative draft tokens checked
    accepted_draft_tokens: int = 0  # of those, the sampled token
    draft_steps: int = 0  # sequence-steps that checked a draft


def tenant_table() -> defaultdict[str, TenantCounts]:
    return defaultdict(TenantCounts)
