"""The scheduler's policy, driven step by step without a model: the step's token budget, who is preempted and how
often, aging, what is published, and what pins must leave free. The engine does what `advance` does here."""

from __future__ import annotations

from radixcache.cache import PrefixCache
from radixcache.pool import KVPool, KVShape
from radixcache.worker.engine.request import FinishReason, Request, SamplingParams
from radixcache.worker.engine.scheduler import Chunk, Scheduler
from radixcache.worker.engine.sequence import Sequence
from radixcache.worker.engine.tenant_counts import TenantCounts

PAGE = 4


class SilentDetokenizer:
    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def make_scheduler(num_pages: int = 64, *, step_tokens: int = 64, max_running: int = 8, aging: int = 64):
    cache = PrefixCache(num_pages, PAGE)
    pool = KVPool(KVShape(1, 1, 2), page_size=PAGE, num_pages=num_pages)
    return Scheduler(cache, pool, max_step_tokens=step_tokens, max_running=max_running, aging_steps=aging)


def make_seq(name: str, prompt, max_tokens: int = 8, namespace: str = "") -> Sequence:
    return Sequence(
        Request(name, list(prompt), SamplingParams(max_tokens=max_tokens), namespace=namespace),
        on_output=lambda out: None,
        detokenizer=SilentDetokenizer(),
        stop_token_ids=frozenset(),
    )


def advance(sched: Scheduler) -> list[Chunk]:
    """One engine step with a model that always answers token 7: compute the chunks, publish, sample, finish."""
    plan = sched.schedule()
    assert not plan.failed
    for chunk in plan.chunks:
        seq, samples = chunk.seq, chunk.samples
        seq.num_computed += chunk.num_new
        sched.published(seq)
        if samples:
            seq.append_token(7, None)
            if seq.finish_reason is not None:
                sched.finish(seq)
    return plan.chunks


def totals(sched: Scheduler) -> TenantCounts:
    """The scheduler's counters summed over every tenant (what the worker's stats report)."""
    return sched.counts.total()


def run_to_end(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.add(seq)
    while sched.has_work():
        advance(sched)


def planned(chunks: list[Chunk]) -> dict[str, int]:
    return {c.seq.name: c.num_new for c in chunks}


def test_every_running_decode_gets_its_token_while_the_budget_lasts():
    sched = make_scheduler(step_tokens=3)
    seqs = [make_seq(f"s{i}", [i + 1], max_tokens=4) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert planned(advance(sched)) == {"s0": 1, "s1": 1, "s2": 1}  # three one-token prompts, budget 3
    for _ in range(3):  # then three decodes a step, down to the last token of the budget
        assert planned(advance(sched)) == {"s0": 1, "s1": 1, "s2": 1}
    assert not sched.has_work()


def test_running_prefills_share_the_step_budget_and_newcomers_get_what_is_left():
    sched = make_scheduler(step_tokens=8)
    a, b, c = make_seq("a", range(100, 103)), make_seq("b", range(200, 220)), make_seq("c", range(300, 304))
    for seq in (a, b, c):
        sched.add(seq)
    assert planned(advance(sched)) == {"a": 3, "b": 5}  # admitted in order until the budget is spent
    assert planned(advance(sched)) == {"a": 1, "b": 7}  # a decodes, b continues with the rest
    assert planned(advance(sched)) == {"a": 1, "b": 7}
    assert planned(advance(sched)) == {"a": 1, "b": 1, "c": 4}  # b's last prompt token, then c is admitted
    for _ in range(20):
        chunks = advance(sched)
        assert sum(chunk.num_new for chunk in chunks) <= 8
        if not sched.has_work():
            break
    assert not sched.has_work()


def test_a_page_boundary_never_costs_a_step():
    sched = make_scheduler()
    seq = make_seq("s", [1, 2, 3], max_tokens=9)  # decodes cross into new pages at tokens 4 and 8
    sched.add(seq)
    steps = 0
    while sched.has_work():
        assert planned(advance(sched)) == {"s": 3 if steps == 0 else 1}
        steps += 1
    assert steps == 9 and seq.finish_reason is FinishReason.LENGTH


def test_only_whole_computed_pages_are_published():
    sched = make_scheduler(step_tokens=6)
    seq = make_seq("s", range(1, 11))
    sched.add(seq)
    advance(sched)  # 6 of 10 prompt tokens computed: one whole page
    assert sched.cache.match_length(list(range(1, 11))) == PAGE
    advance(sched)  # all 10: two whole pages (the partial one is published only at release)
    assert sched.cache.match_length(list(range(1, 11))) == 2 * PAGE
    sched.cache.check()


def test_the_newest_request_is_preempted_and_counted_each_time():
    # 6 pages of 4 tokens: three 3-token prompts fit, but not three requests growing to 15 tokens (4 pages) each.
    sched = make_scheduler(num_pages=6)
    seqs = [make_seq(name, range(base, base + 3), max_tokens=12) for name, base in (("a", 100), ("b", 200), ("c", 300))]
    for seq in seqs:
        sched.add(seq)
    victims: list[str] = []
    for _ in range(200):
        before = [s.name for s in sched.running]
        advance(sched)
        waiting = {s.name for s in sched.waiting}
        gone = [name for name in before if name in waiting]
        assert gone == before[len(before) - len(gone) :], (gone, before)  # always the most recently admitted
        victims += gone
        if not sched.has_work():
            break
    assert not sched.has_work()
    assert "c" in victims and totals(sched).preemptions == len(victims) >= 2
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_generated == 12 for s in seqs)
    sched.cache.check(idle=True)


def test_a_request_that_waits_too_long_goes_before_better_cache_hits():
    sched = make_scheduler(max_running=3, aging=3)
    system = list(range(500, 516))  # a shared prefix the cache holds: every hit request starts with it
    run_to_end(sched, make_seq("warm", system + [1], max_tokens=1))
    sched.add(make_seq("long", [9], max_tokens=4))  # holds one of the three slots through step 3
    advance(sched)
    cold = make_seq("cold", range(900, 903), max_tokens=1)  # nothing cached: last in cache order
    sched.add(cold)
    for step in range(1, 4):
        hits = [make_seq(f"hit{step}{k}", system + [step, k], max_tokens=1) for k in range(2)]  # better hits
        for hit in hits:
            sched.add(hit)
        started = planned(advance(sched))
        assert set(started) == {"long", hits[0].name, hits[1].name}, step  # they take both free slots
    last_hit = make_seq("last_hit", system + [4], max_tokens=1)
    sched.add(last_hit)
    started = planned(advance(sched))
    # waited steps 1, 2, 3 -> it ages at its fourth schedule and goes first, once; a better hit still fits beside it
    assert set(started) == {"cold", "last_hit"} and cold.admit_order < last_hit.admit_order
    assert not sched.waiting


def test_no_live_request_promises_no_pages():
    sched = make_scheduler()
    assert sched.promised_pages() == 0
    sched.add(make_seq("s", range(1, 10), max_tokens=7))  # 16 tokens at most: 4 pages
    assert sched.promised_pages() == 4


def test_pins_a_request_does_not_read_must_leave_room_for_all_it_may_need():
    sched = make_scheduler(num_pages=8)
    shared, other = list(range(100, 108)), list(range(200, 208))  # two pages each
    run_to_end(
        sched, make_seq("w1", shared + [1], max_tokens=1, namespace="t1"), make_seq("w2", other + [1], max_tokens=1)
    )
    assert sched.cache.pin(shared, "t1") == 8 and sched.cache.pin(other) == 8  # 4 of 8 pages pinned
    # 24 tokens = 6 pages; it reads t1's two pinned pages, so only the other two pinned pages are out of its reach
    reader = make_seq("reader", shared + list(range(300, 309)), max_tokens=7, namespace="t1")
    too_big = make_seq("too_big", shared + list(range(300, 309)), max_tokens=11, namespace="t1")  # 7 pages
    stranger = make_seq("stranger", shared + list(range(300, 309)), max_tokens=7)  # same tokens, no pins to read
    for seq in (reader, too_big, stranger):
        sched.add(seq)
    plan = sched.schedule()
    chunks, refused = plan.chunks, {f.seq.name: f.message for f in plan.failed}
    assert set(refused) == {"too_big", "stranger"}
    assert "need 7 pages and 2 of the 8 pages are pinned" in refused["too_big"]
    assert "need 6 pages and 4 of the 8 pages are pinned" in refused["stranger"]
    assert [c.seq.name for c in chunks] == ["reader"] and reader.cached_tokens == 8


def test_waiting_requests_go_longest_cache_hit_first_within_their_own_namespace():
    sched = make_scheduler(max_running=1)
    prefix = list(range(100, 108))
    run_to_end(sched, make_seq("warm", prefix + [1], max_tokens=1))
    # arrival order: short_hit, other_tenant, long_hit; one is admitted per step (max_running=1)
    short_hit = make_seq("short_hit", prefix[:7] + [50, 51], max_tokens=1)  # its lookup (all but the last token): 7
    other_tenant = make_seq("other_tenant", prefix + [60], max_tokens=1, namespace="t1")  # 8 cached, not for t1
    long_hit = make_seq("long_hit", prefix + [70], max_tokens=1)  # 8
    order = []
    for seq in (short_hit, other_tenant, long_hit):
        sched.add(seq)
    while sched.has_work():
        order += [name for name in planned(advance(sched)) if name not in order]
    assert order == ["long_hit", "short_hit", "other_tenant"]


def test_a_long_queue_is_served_in_arrival_order():
    for queued, expected_first in ((128, "hit"), (129, "first")):
        sched = make_scheduler(num_pages=1024, max_running=1)
        prefix = list(range(100, 108))
        run_to_end(sched, make_seq("warm", prefix + [1], max_tokens=1))
        seqs = [make_seq(f"cold{i}", [1000 + i, 1], max_tokens=1) for i in range(queued - 2)]
        seqs = [make_seq("first", [999, 1], max_tokens=1)] + seqs + [make_seq("hit", prefix + [2], max_tokens=1)]
        for i, seq in enumerate(seqs):
            seq.arrival = 1000.0 + i
        for seq in reversed(seqs):  # the queue's list order is not its arrival order (preempted ones go in front)
            sched.add(seq)
        assert list(planned(advance(sched))) == [expected_first], queued  # past 128, sorting costs more than it saves


def test_a_request_waits_for_the_pages_another_is_computing_instead_of_computing_them_twice():
    prompt = list(range(100, 113))  # 13 tokens: three whole pages and one token
    sched = make_scheduler()
    unrelated = make_seq("unrelated", [5, 6, 7], namespace="t2")  # running before the others, in another tenant
    first = make_seq("first", prompt)
    two_pages = make_seq("two_pages", prompt[:8] + [900, 901])
    one_page = make_seq("one_page", prompt[:4] + [900, 901])
    less_than_a_page = make_seq("less_than_a_page", prompt[:3] + [900, 901])
    other_tenant = make_seq("other_tenant", prompt[:8] + [900, 901], namespace="t1")
    # a prompt inside first's: its last token is never served from the cache, whoever computes it
    inside_five, inside_four = make_seq("inside_five", prompt[:5]), make_seq("inside_four", prompt[:4])
    for seq in (unrelated, first, two_pages, one_page, less_than_a_page, other_tenant, inside_five, inside_four):
        sched.add(seq)
    started = planned(advance(sched))
    assert set(started) == {"unrelated", "first", "less_than_a_page", "other_tenant", "inside_four"}
    started = planned(advance(sched))  # first's pages are in the tree now: the waiting ones hit them
    assert {"two_pages", "one_page", "inside_five"} <= set(started)
    assert (two_pages.cached_tokens, one_page.cached_tokens, inside_five.cached_tokens) == (8, 4, 4)
    assert other_tenant.cached_tokens == 0


def test_a_request_is_admitted_as_soon_as_the_shared_pages_are_computed():
    prompt = list(range(100, 113))
    sched = make_scheduler(step_tokens=8)
    first = make_seq("first", prompt)
    sched.add(first)
    assert planned(advance(sched)) == {"first": 8}  # two pages computed and published, five tokens to go
    second = make_seq("second", prompt[:8] + [900, 901])
    sched.add(second)
    assert planned(advance(sched)) == {"first": 5, "second": 2}  # nothing left to wait for: it starts now
    assert second.cached_tokens == 8


def test_a_newcomer_needs_its_prompt_pages_plus_a_reserve_page_per_running_request():
    prefix = list(range(500, 507)) + [7]  # what "warm" leaves in the cache: two pages, evictable
    cases = [  # (prompt, admitted): 6 pages fit beside the running request, 7 do not
        (list(range(200, 224)), True),
        (list(range(200, 225)), False),
        # pages it finds in the cache count once: locking them takes them out of what can be evicted
        (prefix + list(range(200, 216)), True),
        (prefix + list(range(200, 217)), False),
    ]
    for prompt, admitted in cases:
        sched = make_scheduler(num_pages=10)
        run_to_end(sched, make_seq("warm", prefix[:7], max_tokens=1))
        running = make_seq("running", range(100, 108), max_tokens=20)
        sched.add(running)
        advance(sched)  # 8 prompt tokens + 1 sampled: it reserves 3 pages next step, 7 are left (2 cached)
        newcomer = make_seq("newcomer", prompt, max_tokens=1)
        sched.add(newcomer)
        plan = sched.schedule()
        assert not plan.failed and ("newcomer" in planned(plan.chunks)) is admitted, (len(prompt), prompt[0])


def test_a_request_too_big_for_the_whole_pool_fails_with_its_page_count():
    sched = make_scheduler(num_pages=4)
    sched.add(make_seq("huge", range(100, 120), max_tokens=1))  # 20 tokens: 5 pages of 4
    sched.add(make_seq("small", range(200, 203), max_tokens=1))
    plan = sched.schedule()
    assert [(f.seq.name, f.message) for f in plan.failed] == [
        (
            "huge",
            "the KV cache cannot hold this request: prompt + max_tokens need 6 pages and 0 of the 4 pages are pinned (PinPrefix; at most 4 by --max-pinned)",
        )
    ]
    assert planned(plan.chunks) == {"small": 3}  # the next one is still served in the same step


def test_a_starving_request_that_does_not_fit_blocks_the_queue_behind_it():
    sched = make_scheduler(num_pages=10, aging=2)
    sched.add(make_seq("running", range(100, 108), max_tokens=20))
    advance(sched)
    big, small = make_seq("big", range(200, 225), max_tokens=1), make_seq("small", range(300, 303), max_tokens=1)
    sched.add(big)
    sched.add(small)
    assert set(planned(advance(sched))) == {"running", "small"}  # big does not fit yet; small overtakes it
    assert set(planned(advance(sched))) == {"running"}  # big has waited 2 steps: it starves now
    late = make_seq("late", range(400, 403), max_tokens=1)
    sched.add(late)
    for _ in range(3):
        assert "late" not in planned(advance(sched))  # nothing overtakes a starving request
    assert big in sched.waiting and late in sched.waiting


def test_statistics_count_first_admissions_cache_hits_and_hits_on_running_requests():
    sched = make_scheduler(num_pages=6)
    assert totals(sched) == TenantCounts()
    seqs = [make_seq(name, range(base, base + 3), max_tokens=12) for name, base in (("a", 100), ("b", 200), ("c", 300))]
    run_to_end(sched, *seqs)
    counts = totals(sched)
    assert counts.preemptions >= 1
    assert counts.prompt_tokens == 9  # a preempted request's recompute is not a new prompt
    assert counts.cached_tokens == 0  # nor are the pages it finds again a hit: it was counted at its first admission
    prefix = list(range(500, 508))
    long_runner = make_seq("long_runner", prefix + [1], max_tokens=10)
    sched.add(long_runner)
    advance(sched)
    reader = make_seq("reader", prefix + [2], max_tokens=1)  # hits the two pages long_runner computed, still running
    one_token = make_seq("one_token", prefix[:1] + [2, 3], max_tokens=1)  # and one token of them
    other_tenant = make_seq("other_tenant", range(600, 609), max_tokens=1, namespace="t1")
    run_to_end(sched, reader, one_token, other_tenant)
    assert (reader.cached_tokens, one_token.cached_tokens, other_tenant.cached_tokens) == (8, 1, 0)
    counts = totals(sched)
    assert (counts.prompt_tokens, counts.cached_tokens, counts.inflight_shared_tokens) == (9 * 4 + 3, 9, 9)
    assert sched.counts.of("t1").prompt_tokens == 9 and sched.counts.of("t1").cached_tokens == 0  # its own only
    while sched.has_work():
        advance(sched)
    # a hit on a finished request's pages is not a hit on a running one, whoever else of the tenant runs
    unrelated = make_seq("unrelated", range(700, 703), max_tokens=5)
    sched.add(unrelated)
    advance(sched)
    run_to_end(sched, make_seq("late_reader", prefix + [3], max_tokens=1))
    counts = totals(sched)
    assert (counts.cached_tokens, counts.inflight_shared_tokens) == (17, 9)


def test_requests_admitted_together_each_leave_a_page_to_grow_into():
    sched = make_scheduler(num_pages=5)
    first, second = make_seq("first", range(100, 108)), make_seq("second", range(200, 208))  # two full pages each
    sched.add(first)
    sched.add(second)
    # both prompts fit (4 of 5 pages), but then two decodes would need a new page each with one left
    assert planned(advance(sched)) == {"first": 8}
    assert totals(sched).preemptions == 0


def test_the_newest_request_steps_back_itself_when_it_cannot_grow():
    for num_pages, prompt_len in ((5, 2), (5, 5)):  # two requests; they cannot both grow to the end
        sched = make_scheduler(num_pages=num_pages)
        seqs = [make_seq(name, range(base, base + prompt_len), max_tokens=8) for name, base in (("a", 100), ("b", 200))]
        run_to_end(sched, *seqs)  # advance() asserts that nothing fails: the newest waits, it is not refused
        assert totals(sched).preemptions >= 1, num_pages
        assert all(s.finish_reason is FinishReason.LENGTH and s.num_generated == 8 for s in seqs)


def prefilled(sched: Scheduler, parent: Sequence) -> None:
    """Compute parent's prompt in one step and give each of its pages distinct K/V, as the engine does before fork."""
    sched.add(parent)
    plan = sched.schedule()
    assert planned(plan.chunks) == {parent.name: parent.num_prompt} and not plan.failed
    parent.num_computed += parent.num_prompt
    sched.published(parent)
    for j, page in enumerate(parent.lease.pages):
        sched.pages.pool.kv[:, page] = float(j + 1)
    parent.append_token(7, None)


def sample(parent: Sequence, index: int) -> Sequence:
    return Sequence(parent.request, lambda out: None, SilentDetokenizer(), frozenset(), index=index)


def test_a_fork_of_a_prompt_shorter_than_a_page_copies_its_slots():
    sched = make_scheduler()
    parent = make_seq("p", [100, 101], max_tokens=2)
    prefilled(sched, parent)
    child = sample(parent, 1)
    assert sched.fork(parent, child)
    assert child.lease.pages != parent.lease.pages and child.published_tokens == 0
    assert bool((sched.pages.pool.kv[:, child.lease.pages[0], :, :2] == 1.0).all())
    child.append_token(7, None)
    while sched.has_work():
        advance(sched)
    sched.cache.check(idle=True)


def test_a_fork_shares_the_prompts_whole_pages_and_copies_only_its_partial_page():
    sched = make_scheduler()
    parent = make_seq("p", range(100, 110), max_tokens=3, namespace="t1")  # 10 tokens: two whole pages and two
    prefilled(sched, parent)
    parent.cached_tokens = 4  # what sample 0 was told; every sample of the request reports the same
    queried = sched.cache.stats().queried_tokens
    child = sample(parent, 1)
    assert sched.fork(parent, child)
    assert child in sched.running and child.num_computed == 10 and child.cached_tokens == 4
    assert child.lease.pages[:2] == parent.lease.pages[:2]  # the tree's pages, read by both
    assert len(child.lease.pages) == 3 and child.lease.pages[2] != parent.lease.pages[2]  # its own last page
    assert bool((sched.pages.pool.kv[:, child.lease.pages[2], :, :2] == 3.0).all())  # holding the two prompt slots
    assert child.published_tokens == 8  # the two whole pages are in the tree already
    assert sched.cache.stats().queried_tokens == queried  # not a lookup of its own: the request's was counted
    child.append_token(7, None)
    while sched.has_work():
        advance(sched)
    assert parent.num_generated == child.num_generated == 3
    assert totals(sched).prompt_tokens == 10
    sched.cache.check(idle=True)


def test_a_fork_without_a_free_page_waits_first_in_line_and_computes_its_prompt_later():
    sched = make_scheduler(num_pages=3)
    parent = make_seq("p", range(100, 110), max_tokens=2)  # its three pages are the whole pool
    prefilled(sched, parent)
    child = sample(parent, 1)
    assert not sched.fork(parent, child)
    assert child.lease is None and sched.waiting == [child] and child.waited_steps == sched.aging_steps
    sched.cache.check()
    while sched.has_work():
        advance(sched)
    assert child.finish_reason is FinishReason.LENGTH and child.num_generated == 2
    assert totals(sched).prompt_tokens == 10  # the request's prompt, counted once for both samples
    sched.cache.check(idle=True)


def test_a_preempted_request_can_be_ended_while_it_waits():
    sched = make_scheduler(num_pages=5)
    seqs = [make_seq(name, range(base, base + 2), max_tokens=8) for name, base in (("a", 100), ("b", 200))]
    for seq in seqs:
        sched.add(seq)
    while totals(sched).preemptions == 0:
        advance(sched)
    victim = sched.waiting[0]
    sched.finish(victim, FinishReason.ABORTED)  # the client went away while it waited to be recomputed
    assert victim.finish_reason is FinishReason.ABORTED and victim not in sched.waiting
    while sched.has_work():
        advance(sched)
    sched.cache.check(idle=True)  # no lease left behind, no page held


def test_a_draft_takes_only_the_budget_left_and_pages_no_running_sequence_needs():
    """Drafts (speculation) after every running chunk: from the budget left, into the slots their pages still have
    and the pages beyond one reserve page per running sequence, so a draft never makes anyone be preempted."""
    cache = PrefixCache(4, PAGE)
    pool = KVPool(KVShape(1, 1, 2), page_size=PAGE, num_pages=4)
    asked: list[int] = []

    def propose(seq: Sequence, limit: int) -> list[int]:
        asked.append(limit)
        return [9] * limit  # a draft as long as allowed (this test's model never agrees with it)

    sched = Scheduler(cache, pool, max_step_tokens=6, max_running=8, propose=propose)
    a, b = make_seq("a", [1, 2, 3], max_tokens=5), make_seq("b", [4, 5, 6], max_tokens=5)  # 2 pages each at most
    drafts = []
    for seq in (a, b):
        sched.add(seq)
    while sched.has_work():
        chunks = advance(sched)
        drafts.append({c.seq.name: len(c.draft) for c in chunks})
    assert totals(sched).preemptions == 0
    assert drafts[1] == {"a": 0, "b": 0}  # both at a page's last slot, the 2 free pages are the reserve: no draft
    assert drafts[2] == {"a": 3, "b": 1}  # a new page each: a drafts into its free slots, b gets the budget left
    assert drafts[3] == {"a": 2, "b": 2} and drafts[4] == {"a": 1, "b": 1}
    assert asked[:4] == [4, 4, 4, 1]  # the budget after the two decodes (6 - 2), less what a's draft took


def test_a_draft_may_take_spare_pages_when_there_are_some():
    cache = PrefixCache(16, PAGE)
    pool = KVPool(KVShape(1, 1, 2), page_size=PAGE, num_pages=16)
    sched = Scheduler(cache, pool, max_step_tokens=16, max_running=8, propose=lambda seq, limit: [9] * min(limit, 8))
    seq = make_seq("a", [1, 2, 3], max_tokens=12)
    sched.add(seq)
    advance(sched)  # the prompt, then its first token
    (chunk,) = advance(sched)
    assert len(chunk.draft) == 8 and len(seq.lease.pages) == 3  # 1 + 8 tokens from position 3: pages 0..2
    assert totals(sched).preemptions == 0
