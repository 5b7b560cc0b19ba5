"""Window parts in the cache (radixcache.window_parts): the sliding layers' slots of a window-paged pool.

What a user relies on: a long sequence of a sliding-window model holds the sliding layers' values of its last window
only; a prefix hit is served only where the window after it is still held (so it reads exactly what a recompute
would); and nothing leaks: random operations with check() after each, against the prefix rule.
"""

import random

import pytest
from helpers import FakeClock
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixcache.cache import CacheFullError, PrefixCache
from radixcache.cache_off import CacheOff
from radixcache.event_log import EventLog
from radixcache.events import PageIndex, hash_key_pages, namespace_prefix, records_page_index
from radixcache.keys import TOKEN_BYTES, encode
from radixcache.window_parts import first_needed_page


def windowed(num_pages=64, page_size=4, window=8, slots=64) -> PrefixCache:
    return PrefixCache(num_pages, page_size, window=window, window_slots=slots)


def used_slots(cache: PrefixCache) -> int:
    s = cache.stats()
    return s.window_slots_total - s.window_slots_free - s.window_parts_idle


def grow(cache: PrefixCache, lease, tokens: list[int], upto: int) -> None:
    """What the engine does for a sequence computing tokens[:upto]: pages for them, publish, slide."""
    need = -(-upto // cache.page_size) - len(lease.pages)
    if need > 0:
        cache.allocate(lease, need)
    cache.publish(lease, tokens[:upto])
    cache.slide(lease, upto)


def test_a_growing_sequence_holds_the_window_parts_of_its_last_window_only():
    cache = windowed(num_pages=64, page_size=4, window=8)
    tokens = list(range(200))
    lease = cache.acquire("a", tokens)
    for upto in range(1, 200):
        grow(cache, lease, tokens, upto)
        # pages of positions upto-7..upto (the next query's window), one more where it straddles
        assert used_slots(cache) <= -(-7 // 4) + 2
        cache.check()
    assert len(lease.pages) == 50  # the global layers keep every page
    cache.release(lease, tokens[:199])
    cache.check(idle=True)


def test_without_the_tree_a_sequence_gives_its_old_window_parts_back_at_once():
    cache = CacheOff(64, 4, window=8, window_slots=8)  # 8 slots carry a 200-token sequence
    tokens = list(range(200))
    lease = cache.acquire("a", tokens)
    for upto in range(1, 200):
        grow(cache, lease, tokens, upto)
    assert cache.stats().window_slots_free >= 8 - 4
    cache.release(lease, tokens[:199])
    assert cache.stats().window_slots_free == 8
    cache.check(idle=True)


def test_a_hit_is_cut_to_where_the_window_after_it_is_still_held():
    cache = windowed(num_pages=64, page_size=4, window=8, slots=16)
    tokens = list(range(100))
    lease = cache.acquire("a", tokens)
    for upto in range(1, 101):
        grow(cache, lease, tokens, upto)
    cache.release(lease, tokens)
    # Every page is cached (full parts); the window parts the tree kept idle: all 16 slots' worth at most.
    assert cache.stats().pages_cached == 25
    # Its end continues with a full hit: the last window's parts are held idle.
    assert cache.match_length(tokens + [7], "") == 100
    # Other sequences take every slot: the idle parts go, least recently used first.
    other = cache.acquire("b", list(range(1000, 1060)))
    cache.allocate(other, 15)
    assert cache.stats().window_parts_dropped > 0
    cut = cache.match_length(tokens + [7], "")
    assert cut < 100
    # the rule: every page with one of the positions cut-7..cut-1 has its window part; the next page does not
    pages = cache.tree.match(encode(tokens), "").pages
    first = first_needed_page(cut, 8, 4)
    assert all(cache.window.slot[p] >= 0 for p in pages[first : -(-cut // 4)])
    assert cut == 0 or cut % 4 == 0
    lease = cache.acquire("c", tokens + [7])
    assert lease.cached_tokens == cut and len(lease.pages) == cut // 4
    cache.check()
    cache.release(lease)
    cache.release(other)
    cache.check(idle=True)


def test_a_hit_ending_inside_a_page_copies_the_window_part_too():
    cache = windowed(num_pages=32, page_size=4, window=8)
    tokens = list(range(30))
    lease = cache.acquire("a", tokens)
    grow(cache, lease, tokens, 30)
    cache.release(lease, tokens)
    second = cache.acquire("b", tokens[:27] + [99, 98])
    assert second.copy_from is not None and second.cached_tokens == 27
    src, dst = second.copy_from.src, second.copy_from.dst
    s_src, s_dst = cache.window_slots([src, dst])
    assert s_src >= 0 and s_dst >= 0 and s_src != s_dst
    cache.copied(second)
    cache.check()
    cache.release(second)
    cache.check(idle=True)


def test_when_slots_run_out_allocation_fails_cleanly_for_the_caller_to_preempt():
    cache = windowed(num_pages=64, page_size=4, window=8, slots=6)
    a = cache.acquire("a", list(range(40)))
    cache.allocate(a, 6)  # a prefill chunk of 24 tokens: every page written this step needs its part
    b = cache.acquire("b", list(range(100, 140)))
    with pytest.raises(CacheFullError, match="window slots"):
        cache.allocate(b, 1)
    cache.check()
    cache.slide(a, 24)  # a's next query at 24 reads positions 17..24: pages 4 and 5 only
    cache.allocate(b, 1)
    cache.check()
    for lease in (a, b):
        cache.release(lease)
    cache.check(idle=True)


def test_window_parts_refuse_demotion_and_tiers():
    with pytest.raises(ValueError, match="demotion or tiers"):
        PrefixCache(8, 4, window=8, window_slots=8, demoted_pages=4, transcode=lambda s, d: None)


# ---- random operations ---------------------------------------------------------------------------------------
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=24)
PICK = st.integers(0, 1000)


class WindowMachine(RuleBasedStateMachine):
    """Acquire / grow / publish / extend / release / evict / flush in any order, with few slots: check() after each
    step, and every acquire obeys the prefix rule (the window after a hit is held; nothing is served past a page
    whose window part is gone)."""

    @initialize(
        page_size=st.sampled_from([1, 2, 3, 4]),
        num_pages=st.integers(4, 24),
        window=st.integers(1, 9),
        slots=st.integers(3, 10),
        enabled=st.sampled_from([True, True, True, False]),
    )
    def setup(self, page_size: int, num_pages: int, window: int, slots: int, enabled: bool) -> None:
        self.ps, self.window = page_size, window
        parts = {"window": window, "window_slots": slots}
        if enabled:
            self.cache = PrefixCache(num_pages, page_size, clock=FakeClock(), **parts)
        else:
            self.cache = CacheOff(num_pages, page_size, **parts)
        self.live: list[tuple[object, list[int], int]] = []  # (lease, its tokens, computed)
        self.seen: list[list[int]] = []
        self.count = 0

    def pick(self, i: int):
        return self.live[i % len(self.live)]

    def _acquire(self, tokens: list[int]) -> None:
        self.count += 1
        self.seen.append(list(tokens))
        lease = self.cache.acquire(f"r{self.count}", tokens, max_cached=len(tokens) - 1)
        h = lease.cached_tokens
        pages = lease.pages if lease.copy_from is None else lease.pages[:-1] + [lease.copy_from.src]
        needed = pages[first_needed_page(h, self.window, self.ps) : -(-h // self.ps)]
        assert all(self.cache.window.slot[p] >= 0 for p in needed), "a hit whose window is not held"
        if lease.copy_from is not None:
            self.cache.copied(lease)
        self.live.append((lease, list(tokens), h))

    @rule(tokens=TOKENS)
    def acquire(self, tokens: list[int]) -> None:
        self._acquire(tokens)

    @precondition(lambda self: self.seen)
    @rule(i=PICK, cut=st.integers(0, 24), extra=TOKENS)
    def acquire_known(self, i: int, cut: int, extra: list[int]) -> None:
        tokens = self.seen[i % len(self.seen)]
        self._acquire(tokens[:cut] + extra[: max(1, len(extra) // 4)])

    @precondition(lambda self: self.live)
    @rule(i=PICK, n=st.integers(1, 8))
    def compute(self, i: int, n: int) -> None:
        """The engine's step for one sequence: pages for n more tokens (preempted when none), publish, slide."""
        lease, tokens, done = self.pick(i)
        upto = min(len(tokens), done + n)
        if upto <= done:
            return
        need = -(-upto // self.ps) - len(lease.pages)
        try:
            if need > 0:
                self.cache.allocate(lease, need)
        except CacheFullError:
            self._release(i, publish=True)
            return
        self.cache.publish(lease, tokens[:upto])
        self.cache.slide(lease, upto)
        self.live[i % len(self.live)] = (lease, tokens, upto)

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def extend(self, i: int) -> None:
        lease, tokens, done = self.pick(i)
        if done == len(lease.pages) * self.ps:
            gained = self.cache.extend(lease, tokens)
            self.live[i % len(self.live)] = (lease, tokens, done + gained)

    def _release(self, i: int, publish: bool) -> None:
        lease, tokens, done = self.live.pop(i % len(self.live))
        self.cache.release(lease, tokens[:done] if publish else None)

    @precondition(lambda self: self.live)
    @rule(i=PICK, publish=st.booleans())
    def release(self, i: int, publish: bool) -> None:
        self._release(i, publish)

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule()
    def flush(self) -> None:
        self.cache.flush()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check(idle=not self.live)
            for lease, _, _ in self.live:
                assert all(self.cache.window.slot[p] >= 0 for p in lease.pages[lease._wfirst :])


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


# ---- the window group's events -------------------------------------------------------------------------------
def page_hashes_by_id(cache: PrefixCache) -> dict[int, tuple[str, int]]:
    """Page id -> (namespace, page hash) of every whole page the tree holds, from its records alone."""
    out, bpp = {}, cache.page_size * TOKEN_BYTES
    for namespace, after, pages, key in cache.tree.page_records():
        parent = None if after is None else out[after][1]
        for page, h in zip(pages, hash_key_pages(key, bpp, namespace_prefix(namespace), parent), strict=False):
            out[page] = (namespace, h)
            parent = h
    return out


def window_group(cache: PrefixCache) -> dict[str, set[int]]:
    """What group 1 must say: the whole tree pages that still have their window part, by namespace."""
    out: dict[str, set[int]] = {}
    held = set(cache.window_pages())
    for page, (namespace, h) in page_hashes_by_id(cache).items():
        if page in held:
            out.setdefault(namespace, set()).add(h)
    return out


def test_the_window_groups_events_replay_to_the_pages_that_keep_their_window_parts():
    cache = windowed(num_pages=64, page_size=4, window=8, slots=12)
    log = EventLog(4, strict=True, window=8)
    cache.set_event_sink(log)
    index = PageIndex(strict=True)
    rng = random.Random(0)
    for i in range(12):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(10, 40))]
        lease = cache.acquire(f"r{i}", tokens, f"t{i % 2}")
        done = lease.cached_tokens
        while done < len(tokens):
            done = min(len(tokens), done + 4)
            grow(cache, lease, tokens, done)
        cache.release(lease, tokens)
        if i == 8:
            cache.evict(5)
        for event in log.drain():
            index.apply(event)
        assert index.as_dict() == records_page_index(cache.tree.page_records(), 4)
        assert index.window_dict() == window_group(cache)
    assert cache.stats().window_parts_dropped > 0  # group 1 lost pages that group 0 kept
    assert sum(map(len, index.window_dict().values())) < sum(map(len, index.as_dict().values()))
    # a subscriber that starts later, from a snapshot, knows the same
    late = EventLog(4, strict=True, window=8)
    cache.set_event_sink(late)
    late.snapshot(cache.tree.page_records(), window=cache.window_pages())
    (snapshot,) = late.drain()
    fresh = PageIndex(strict=True)
    fresh.load(snapshot.events)
    assert fresh.window_dict() == window_group(cache) and fresh.as_dict() == index.as_dict()
    group1 = [e for e in snapshot.events if e.group_idx]
    assert group1 and all(
        e.kv_cache_spec_kind == "sliding_window" and e.kv_cache_spec_sliding_window == 8 for e in group1
    )


def test_a_vllm_subscriber_reads_the_window_group_as_vllm_declares_it():
    import msgpack
    from vllm_kv_events import current

    from radixcache.worker.events.vllm_format import event_batch, vllm_event

    cache = windowed(num_pages=16, page_size=4, window=8, slots=4)
    log = EventLog(4, strict=True, window=8)
    cache.set_event_sink(log)
    tokens = list(range(24))
    lease = cache.acquire("a", tokens)
    for upto in range(4, 25, 4):
        grow(cache, lease, tokens, upto)
    cache.release(lease, tokens)
    other = cache.acquire("b", list(range(100, 116)))
    cache.allocate(other, 4)  # four slots: the tree's idle parts go
    decoder, stored_type, removed_type, _ = current()
    wire = msgpack.packb(event_batch(1.0, [vllm_event(e, 4) for e in log.drain()]))
    events = decoder.decode(wire).events
    stored = [e for e in events if isinstance(e, stored_type)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == [
        (0, "full_attention", None),
        (1, "sliding_window", 8),
    ] * 6  # each step's page, in both groups
    removed = [e for e in events if isinstance(e, removed_type)]
    assert removed and all(e.group_idx == 1 for e in removed)  # windows given back; the pages stay cached
    assert {h for e in removed for h in e.block_hashes} <= {h for e in stored for h in e.block_hashes}
    cache.release(other)
