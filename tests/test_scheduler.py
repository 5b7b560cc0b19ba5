"""The scheduler's policy, driven step by step without a model: the step's token budget, who is preempted and how
often, aging, what is published, and what pins must leave free. The engine does what `advance` does here."""

from __future__ import annotations

from radixcache.cache import PrefixCache
from radixcache.pool import KVPool, KVShape
from radixcache.worker.request import FinishReason, Request, SamplingParams
from radixcache.worker.scheduler import Chunk, Scheduler
from radixcache.worker.sequence import Sequence

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


def make_seq(name: str, prompt, max_tokens: int = 8) -> Sequence:
    return Sequence(
        Request(name, list(prompt), SamplingParams(max_tokens=max_tokens)),
        on_output=lambda out: None,
        detokenizer=SilentDetokenizer(),
        stop_token_ids=frozenset(),
    )


def advance(sched: Scheduler) -> list[Chunk]:
    """One engine step with a model that always answers token 7: compute the chunks, publish, sample, finish."""
    chunks, failed = sched.schedule()
    assert not failed
    for chunk in chunks:
        seq, samples = chunk.seq, chunk.samples
        seq.num_computed += chunk.num_new
        sched.published(seq)
        if samples:
            seq.append_token(7, None)
            if seq.finish_reason is not None:
                sched.finish(seq)
    return chunks


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
    assert "c" in victims and sched.preemptions == len(victims) >= 2
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_generated == 12 for s in seqs)
    sched.cache.check(idle=True)


def test_a_request_that_waits_too_long_goes_before_better_cache_hits():
    sched = make_scheduler(max_running=2, aging=3)
    system = list(range(500, 516))  # a shared prefix the cache holds: every hit request starts with it
    warm = make_seq("warm", system + [1], max_tokens=1)
    sched.add(warm)
    while sched.has_work():
        advance(sched)
    long_runner = make_seq("long", [9], max_tokens=50)
    sched.add(long_runner)
    advance(sched)  # one slot of two is now taken for good
    cold = make_seq("cold", range(900, 905), max_tokens=1)  # nothing cached: last in cache order
    sched.add(cold)
    admitted_at = None
    for step in range(1, 8):
        sched.add(make_seq(f"hit{step}", system + [step], max_tokens=1))  # a better hit arrives every step
        chunks = advance(sched)
        if "cold" in planned(chunks):
            admitted_at = step
            break
    # waited steps 1, 2, 3 -> it ages at its fourth schedule and then nothing overtakes it
    assert admitted_at == 4


def test_no_live_request_promises_no_pages():
    sched = make_scheduler()
    assert sched.promised_pages() == 0
    sched.add(make_seq("s", range(1, 10), max_tokens=7))  # 16 tokens at most: 4 pages
    assert sched.promised_pages() == 4
