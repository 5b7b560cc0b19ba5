"""worker/engine/tenant_counts.py: each counter is kept once, under its tenant; the worker's figures are the sum."""

from __future__ import annotations

import pytest

from radixcache.tier import MEDIUM_DEVICE, MEDIUM_DISK, MEDIUM_HOST
from radixcache.worker.engine.tenant_counts import COUNTERS, TenantCounts, TenantTable


def test_the_total_adds_up_every_counter_of_every_tenant():
    table = TenantTable()
    for i, name in enumerate(COUNTERS):
        setattr(table["alice"], name, i + 1)
        setattr(table["bob"], name, 100 * (i + 1))
    total = table.total()
    assert [getattr(total, name) for name in COUNTERS] == [101 * (i + 1) for i in range(len(COUNTERS))]
    assert TenantTable().total() == TenantCounts()


def test_a_tenants_own_counts_are_a_copy_and_an_unseen_tenant_is_not_added():
    table = TenantTable()
    table["alice"].prompt_tokens += 5
    mine = table.of("alice")
    mine.prompt_tokens += 1000  # a caller's copy: the table does not change
    assert table.of("alice").prompt_tokens == 5 and table.total().prompt_tokens == 5
    assert table.of("carol") == TenantCounts()
    table.of("carol").preemptions += 1
    assert table.total().preemptions == 0


def test_tier_hits_count_by_medium_and_drafts_by_sequence_step():
    counts = TenantCounts()
    counts.add_tier_hit(MEDIUM_HOST, 16)
    counts.add_tier_hit(MEDIUM_DISK, 32)
    counts.add_tier_hit(MEDIUM_DISK, 4)
    assert (counts.host_hit_tokens, counts.disk_hit_tokens) == (16, 36)
    with pytest.raises(ValueError, match="medium"):
        counts.add_tier_hit(MEDIUM_DEVICE, 1)  # device hits are the cache's own figure, not a tier's
    counts.add_draft(8, 3)
    counts.add_draft(2, 0)
    assert (counts.draft_tokens, counts.accepted_draft_tokens, counts.draft_steps) == (10, 3, 2)
