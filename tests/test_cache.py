import pytest
from helpers import FakeClock

from radixcache.cache import CacheFullError, PageCopy, PinBudgetError, PrefixCache
from radixcache.cache_off import CacheOff
from radixcache.keys import encode
from radixcache.pool import KVPool, KVShape


def list_key(tokens) -> bytes:
    return encode(list(tokens))


def serve(cache: PrefixCache, owner: str, tokens: list[int], namespace: str = "", publish: bool = True):
    """What the engine does for one request: acquire, copy, allocate the rest, publish, release."""
    lease = cache.acquire(owner, tokens, namespace, max_cached=len(tokens) - 1)
    need = -(-len(tokens) // cache.page_size) - len(lease.pages)
    cache.allocate(lease, need)
    cache.release(lease, tokens if publish else None)
    return lease


def test_miss_publish_then_hit_shares_pages() -> None:
    cache = PrefixCache(16, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a = cache.acquire("a", prompt, max_cached=6)
    assert a.pages == [] and a.cached_tokens == 0 and a.copy_from is None
    cache.allocate(a, 4)
    assert cache.publish(a, prompt) == 3  # whole pages only
    assert cache.publish(a, prompt) == 0  # again: nothing new
    b = cache.acquire("b", prompt, max_cached=6)
    assert b.pages == a.pages[:3] and b.cached_tokens == 6
    assert all(cache.allocator.refcount(p) == 3 for p in b.pages)  # tree + a + b
    cache.check()
    cache.release(a)
    cache.release(b)
    assert cache.stats().pages_cached == 3 and cache.stats().pages_free == 13
    cache.check(idle=True)


def test_hit_ending_inside_a_page_copies_its_first_slots() -> None:
    cache = PrefixCache(16, 4)
    serve(cache, "a", list(range(12)))  # pages of 0..3, 4..7, 8..11 (the last is published: 12 tokens computed)
    lease = cache.acquire("b", list(range(10)) + [99, 98], max_cached=11)
    src = cache.tree.match(list_key(range(12))).pages[2]
    assert lease.cached_tokens == 10
    assert lease.copy_from == PageCopy(src, lease.pages[-1], 2)
    assert len(lease.pages) == 3 and cache.allocator.refcount(lease.pages[-1]) == 1
    assert cache.allocator.refcount(src) == 2  # the tree and the pending copy
    cache.check()
    cache.allocate(lease, 0)
    assert cache.publish(lease, list(range(10)) + [99, 98]) == 1  # its own third page: a new branch
    assert cache.allocator.refcount(src) == 1  # the copy source is no longer held
    cache.release(lease)
    cache.check(idle=True)
    # a fully cached prompt: max_cached = len - 1 leaves one token to compute, so the last page is copied
    full = cache.acquire("c", list(range(12)), max_cached=11)
    assert full.cached_tokens == 11 and full.copy_from is not None and full.copy_from.tokens == 3
    cache.release(full)
    assert cache.stats().copied_tokens == 5
    cache.check(idle=True)


def test_partial_hit_is_dropped_when_no_page_can_be_allocated() -> None:
    cache = PrefixCache(2, 2)
    serve(cache, "a", [1, 2, 3, 4])
    lease = cache.acquire("b", [1, 2, 3, 9], max_cached=3)  # would copy page 2, but both pages are its path
    assert lease.cached_tokens == 2 and lease.copy_from is None and len(lease.pages) == 1
    assert cache.tree.protected_pages == 1  # only the whole page it reads stays locked, not the one not copied
    assert (cache.stats().hit_tokens, cache.stats().copied_tokens) == (2, 0)
    cache.check()
    cache.release(lease)
    cache.check(idle=True)


def test_publish_dedup_swaps_in_the_tree_page_and_frees_the_copy_at_once() -> None:
    cache = PrefixCache(16, 2)
    prompt = [5, 6, 7, 8, 9]
    a = cache.acquire("a", prompt, max_cached=4)
    b = cache.acquire("b", prompt, max_cached=4)  # both miss: computed twice, concurrently
    cache.allocate(a, 3)
    cache.allocate(b, 3)
    assert cache.publish(a, prompt[:4]) == 2
    free_before = cache.allocator.num_free
    b_copies = b.pages[:2]
    assert cache.publish(b, prompt[:4]) == 0  # duplicates: the tree keeps a's pages
    assert cache.tree.match(list_key(prompt[:4])).pages == a.pages[:2]
    assert b.pages[:2] == a.pages[:2], "b now reads the tree's pages (the same tokens), never holding them twice"
    assert cache.allocator.num_free == free_before + 2 and all(cache.allocator.refcount(p) == 0 for p in b_copies)
    cache.check()
    cache.release(b)
    assert cache.allocator.num_free == free_before + 3  # only b's last page was still its own
    cache.release(a, prompt)
    cache.check(idle=True)
    assert cache.stats().pages_cached == 3 and cache.stats().pages_partial == 1  # + a's tail [9]


def test_release_is_idempotent_and_a_released_lease_is_dead() -> None:
    cache = PrefixCache(8, 1)
    lease = cache.acquire("r1", [1, 2, 3])
    cache.allocate(lease, 3)
    cache.release(lease, [1, 2, 3])
    cache.release(lease)
    cache.release(lease, [1, 2, 3])
    assert lease.released and lease.pages == []
    with pytest.raises(ValueError, match="r1"):
        cache.allocate(lease, 1)
    with pytest.raises(ValueError, match="released"):
        cache.publish(lease, [1])
    cache.check(idle=True)
    assert cache.stats().pages_cached == 3 and cache.stats().pages_free == 5
    with pytest.raises(ValueError, match="a lease needs an owner"):
        cache.acquire("", [1])
    foreign = PrefixCache(8, 1).acquire("r2", [1])
    with pytest.raises(ValueError, match="r2.* belongs to another cache"):
        cache.allocate(foreign, 1)
    with pytest.raises(ValueError, match="cannot allocate a negative number of pages"):
        cache.allocate(cache.acquire("r3", [1]), -1)


def test_publish_more_tokens_than_pages_is_refused() -> None:
    cache = PrefixCache(8, 2)
    lease = cache.acquire("r", [1, 2, 3, 4])
    cache.allocate(lease, 1)
    with pytest.raises(ValueError, match="need 2 pages"):
        cache.publish(lease, [1, 2, 3, 4])
    cache.release(lease)
    cache.check(idle=True)


def test_allocate_evicts_lru_and_fails_cleanly_when_full() -> None:
    cache = PrefixCache(6, 1)
    serve(cache, "old", [1, 2])
    serve(cache, "new", [3, 4])
    serve(cache, "newer", [5, 6])
    cache.match_length([1, 2])  # read-only: does not refresh "old"
    lease = cache.acquire("x", [9, 9, 9])
    assert cache.allocate(lease, 2) and cache.stats().evicted_pages == 2
    assert cache.match_length([1, 2]) == 0 and cache.match_length([3, 4]) == 2
    reader = cache.acquire("reader", [3, 4, 0], max_cached=2)  # locks [3, 4]
    assert reader.cached_tokens == 2
    before = (cache.stats(), sorted(cache.tree.items()), list(lease.pages))
    with pytest.raises(CacheFullError, match=r"needs 5 pages but has 0 free and 2 evictable \(of 6; 2 cached pages"):
        cache.allocate(lease, 5)
    assert (cache.stats(), sorted(cache.tree.items()), list(lease.pages)) == before  # nothing changed
    assert cache.available_pages() == 2
    cache.allocate(lease, 2)  # evicts [5, 6], never the locked [3, 4]
    assert cache.stats().evicted_pages == 4  # counted over both allocations
    assert cache.match_length([3, 4]) == 2 and cache.match_length([5, 6]) == 0
    cache.check()
    cache.release(lease)
    cache.release(reader)
    cache.check(idle=True)


def test_extend_adopts_pages_published_in_flight() -> None:
    cache = PrefixCache(16, 2)
    prompt = list(range(10))
    first = cache.acquire("first", prompt, max_cached=9)
    second = cache.acquire("second", prompt, max_cached=9)
    cache.allocate(first, 5)
    assert cache.extend(second, prompt) == 0  # nothing published yet
    cache.publish(first, prompt[:8])
    assert cache.extend(second, prompt) == 8
    assert second.pages == first.pages[:4]
    assert cache.stats().extended_pages == 4
    cache.check()
    cache.release(first)
    assert cache.evict(100) == 0  # second locks the path
    cache.allocate(second, 1)
    cache.release(second, prompt)
    cache.check(idle=True)
    assert cache.stats().pages_cached == 5


def test_flush_with_live_leases_keeps_them_correct() -> None:
    cache = PrefixCache(16, 2)
    serve(cache, "a", [1, 2, 3, 4, 5])
    serve(cache, "b", [7, 7, 7, 7, 7])
    cache.pin([7, 7, 7, 7])
    live = cache.acquire("live", [1, 2, 3, 4, 9], max_cached=4)
    cache.allocate(live, 1)
    freed = cache.flush()
    assert freed == 4 and cache.stats().pages_pinned == 0  # b's 3 pages and a's tail; `live` reads a's path
    assert cache.stats().pages_evictable == 0
    cache.check()
    assert live.pages[:2] == cache.tree.match(list_key([1, 2, 3, 4])).pages
    cache.publish(live, [1, 2, 3, 4, 9, 9])
    cache.release(live)
    cache.check(idle=True)
    assert cache.flush() == 3 and cache.stats().pages_free == 16
    assert cache.stats().flushed_pages == 7


def test_pin_ttl_expires_on_the_injected_clock() -> None:
    clock = FakeClock()
    cache = PrefixCache(4, 2, clock=clock)
    serve(cache, "sys", [1, 1, 1, 1])
    assert cache.pin([1, 1, 1, 1, 5], ttl=30) == 4
    lease = cache.acquire("x", [2, 2, 2, 2])
    with pytest.raises(CacheFullError, match="0 evictable"):
        cache.allocate(lease, 3)  # 2 free; the pinned 2 cannot go
    clock.now = 29.9
    assert cache.stats().pages_pinned == 2
    clock.now = 30.0
    assert cache.stats().pages_pinned == 0 and cache.available_pages() == 4
    cache.allocate(lease, 3)
    cache.release(lease)
    cache.check(idle=True)
    assert cache.unpin([1, 1]) == 0


def test_a_namespaces_stats_count_only_its_pages_pins_lookups_and_evictions() -> None:
    clock = FakeClock()
    cache = PrefixCache(8, 2, clock=clock)
    serve(cache, "a1", [1, 2, 3, 4], "alice")
    serve(cache, "a2", [1, 2, 3, 4, 5], "alice")  # hits the 4 tokens alice cached
    assert cache.pin([1, 2], "alice", ttl=10) == 2
    serve(cache, "b1", [7, 7, 7, 7, 7, 7], "bob")
    alice, bob, carol = cache.stats("alice"), cache.stats("bob"), cache.stats("carol")
    assert (alice.queried_tokens, alice.hit_tokens, bob.queried_tokens, bob.hit_tokens) == (9, 4, 6, 0)
    assert (alice.pages_cached, alice.pages_pinned, bob.pages_cached, bob.pages_pinned) == (3, 1, 3, 0)
    assert carol.pages_cached == carol.queried_tokens == carol.live_leases == 0
    serve(cache, "b2", [8, 8, 8, 8, 8, 8, 8, 8], "bob")  # 4 pages into a full pool: evicts LRU leaves, not the pin
    alice, bob = cache.stats("alice"), cache.stats("bob")
    assert alice.evicted_pages + bob.evicted_pages == cache.stats().evicted_pages > 0
    assert alice.pages_cached == 3 - alice.evicted_pages and alice.pages_pinned == 1
    clock.now = 10.0  # the pin's TTL runs out: the namespace's pinned count follows
    assert cache.stats("alice").pages_pinned == 0 and cache.stats().pages_pinned == 0
    for view in (alice, bob, carol):  # the pool's capacity is everyone's
        assert view.pages_total == 8 and view.max_pinned_pages == cache.stats().max_pinned_pages
    cache.check(idle=True)


def test_unpin_and_pin_without_ttl() -> None:
    cache = PrefixCache(4, 1)
    serve(cache, "sys", [1, 2, 3])
    assert cache.pin([1, 2, 3]) == 3
    assert cache.evict(10) == 0
    assert cache.unpin([1, 2]) == 2
    assert cache.evict(10) == 0  # [3] is still pinned, so [1, 2] is not a leaf
    assert cache.stats().pages_pinned == 1 and cache.stats().pages_evictable == 0
    assert cache.unpin([1, 2, 3]) == 1
    assert cache.evict(10) == 3
    cache.check(idle=True)


def test_pin_and_unpin_in_a_namespace() -> None:
    cache = PrefixCache(8, 1)
    serve(cache, "a", [1, 2, 3], namespace="alice")
    assert cache.pin([1, 2, 3]) == 0  # not in the default namespace
    assert cache.pin([1, 2, 3], "alice") == 3
    assert cache.unpin([1, 2, 3]) == 0
    assert cache.unpin([1, 2, 3], "alice") == 3
    assert cache.stats().pages_pinned == 0
    cache.check(idle=True)


def test_namespaces_are_isolated() -> None:
    cache = PrefixCache(16, 2)
    serve(cache, "a", [1, 2, 3, 4, 5], namespace="alice")
    assert cache.match_length([1, 2, 3, 4], "bob") == 0
    assert cache.match_length([1, 2, 3, 4]) == 0
    bob = cache.acquire("b", [1, 2, 3, 4, 5], "bob", max_cached=4)
    assert bob.cached_tokens == 0
    alice = cache.acquire("a2", [1, 2, 3, 4, 5], "alice", max_cached=4)
    assert alice.cached_tokens == 4
    assert cache.pin([1, 2, 3, 4], "bob") == 0
    cache.release(bob)
    cache.release(alice)
    cache.check(idle=True)
    assert cache.stats().namespaces == 1


def test_disabled_cache_matches_nothing_and_frees_everything() -> None:
    cache = CacheOff(8, 2)
    for owner in ("a", "b"):
        lease = cache.acquire(owner, [1, 2, 3, 4, 5], max_cached=4)
        assert lease.cached_tokens == 0 and lease.pages == []
        cache.allocate(lease, 3)
        assert cache.publish(lease, [1, 2, 3, 4]) == 0
        assert cache.extend(lease, [1, 2, 3, 4, 5]) == 0
        cache.release(lease, [1, 2, 3, 4, 5])
    assert cache.match_length([1, 2]) == 0 and cache.pin([1, 2]) == 0 and cache.unpin([1, 2]) == 0
    stats = cache.stats()
    assert stats.pages_free == 8 and stats.pages_cached == 0 and stats.hit_tokens == 0
    assert stats.queried_tokens == 10
    cache.check(idle=True)


def test_stats_count_hits_use_and_leases() -> None:
    cache = PrefixCache(16, 2)
    serve(cache, "a", [1, 2, 3, 4, 5])
    lease = cache.acquire("b", [1, 2, 3, 4, 5], max_cached=4)
    cache.allocate(lease, 1)
    s = cache.stats()
    assert (s.queried_tokens, s.hit_tokens) == (10, 4) and s.hit_rate == pytest.approx(0.4)
    assert s.pages_in_use == 3 and s.live_leases == 1 and cache.leases() == [lease]
    assert s.pages_cached == 3 and s.published_pages == 3 and s.pages_partial == 1  # a's tail [5] too
    assert s.pages_evictable == 1  # the tail: b reads only the whole pages before it
    assert (s.pages_total, s.max_pinned_pages, s.evictable_leaves, s.namespaces) == (16, 16, 1, 1)
    assert PrefixCache(16, 2, max_pinned_pages=3).stats().max_pinned_pages == 3
    cache.release(lease)


def test_check_names_the_owner_of_a_leak() -> None:
    cache = PrefixCache(8, 1)
    lease = cache.acquire("req-42", [1, 2])
    cache.allocate(lease, 2)
    cache.check()
    with pytest.raises(AssertionError, match="req-42"):
        cache.check(idle=True)
    cache.allocator.incref([lease.pages[0]])  # a reference nobody owns
    with pytest.raises(AssertionError, match=r"page \d+: refcount 2 but 1 holders .*req-42"):
        cache.check()
    cache.allocator.decref([lease.pages[0]])
    cache.release(lease)
    cache.check(idle=True)


def test_a_lease_locks_only_the_pages_it_reads() -> None:
    cache = PrefixCache(8, 2)
    serve(cache, "long", list(range(12)))  # one edge of 6 pages
    lease = cache.acquire("short", [0, 1, 2, 3, 9, 9], max_cached=5)
    assert lease.cached_tokens == 4 and lease.copy_from is None
    assert cache.stats().pages_evictable == 4  # the 4 pages past what it reads stay evictable
    cache.allocate(lease, 5)  # 2 free + 3 evicted from the tail of the long edge
    assert cache.match_length(list(range(12))) == 6
    cache.check()
    cache.release(lease)
    cache.check(idle=True)


def test_release_stores_the_partial_tail_and_the_next_turn_copies_it() -> None:
    cache = PrefixCache(16, 4)
    turn1 = list(range(10))  # two whole pages and a tail of 2 tokens
    lease = cache.acquire("t1", turn1, max_cached=9)
    cache.allocate(lease, 3)
    assert cache.publish(lease, turn1) == 2 and cache.stats().pages_partial == 0  # while running: whole pages only
    tail = lease.pages[2]
    cache.release(lease, turn1)
    s = cache.stats()
    assert s.pages_cached == 3 and s.pages_partial == 1 and s.published_pages == 3
    assert cache.allocator.refcount(tail) == 1  # the tree's reference only
    assert cache.match_length(turn1 + [50]) == 10 and cache.match_length(turn1[:9]) == 9
    cache.check(idle=True)
    turn2 = turn1 + [50, 51, 52]
    nxt = cache.acquire("t2", turn2, max_cached=len(turn2) - 1)
    assert nxt.cached_tokens == 10 and nxt.copy_from == PageCopy(tail, nxt.pages[-1], 2) and len(nxt.pages) == 3
    assert cache.allocator.refcount(tail) == 2  # the tree and the pending copy
    cache.check()
    cache.allocate(nxt, 1)
    # its own third page, now whole, replaces the tail: the tree drops the old page, which nobody holds any more
    assert cache.publish(nxt, turn2[:12]) == 1
    assert cache.allocator.refcount(tail) == 0 and cache.stats().pages_partial == 0
    assert cache.tree.match(list_key(turn2[:12])).pages == nxt.pages[:3]
    cache.release(nxt, turn2)
    assert cache.stats().pages_partial == 1 and cache.match_length(turn2 + [0]) == 13
    cache.check(idle=True)


def test_a_replaced_tail_stays_alive_for_a_lease_still_copying_from_it() -> None:
    cache = PrefixCache(16, 4)
    serve(cache, "t1", list(range(6)))  # whole page + tail [4, 5]
    tail = cache.tree.match(list_key(range(6))).partial_page
    reader = cache.acquire("reader", list(range(6)) + [7], max_cached=6)
    assert reader.copy_from == PageCopy(tail, reader.pages[-1], 2)
    serve(cache, "writer", list(range(8)) + [0])  # publishes a whole page 4..7 over the tail
    assert cache.tree.match(list_key(range(8))).pages[1] != tail
    assert cache.allocator.refcount(tail) == 1  # only the reader's pending copy holds it now
    cache.check()
    cache.release(reader)
    assert cache.allocator.refcount(tail) == 0
    cache.check(idle=True)


def test_release_dedups_a_tail_the_tree_already_covers() -> None:
    cache = PrefixCache(16, 4)
    serve(cache, "long", list(range(7)))  # tail [4, 5, 6]
    free = cache.allocator.num_free
    serve(cache, "short", list(range(6)))  # its tail [4, 5] is covered by the longer one: kept, its copy freed
    assert cache.allocator.num_free == free and cache.stats().pages_partial == 1
    assert cache.match_length(list(range(7)) + [9]) == 7
    serve(cache, "inside", list(range(3)))  # a tail inside a whole cached page: nothing new either
    assert cache.allocator.num_free == free and cache.stats().pages_cached == 2
    cache.check(idle=True)


def test_a_preempted_sequence_comes_back_token_exact() -> None:
    cache = PrefixCache(8, 4)
    seq = list(range(11))
    lease = cache.acquire("r", seq, max_cached=10)
    cache.allocate(lease, 3)
    cache.release(lease, seq[:7])  # preempted after computing 7 tokens
    again = cache.acquire("r", seq, max_cached=10)
    assert again.cached_tokens == 7 and again.copy_from is not None and again.copy_from.tokens == 3
    cache.release(again)
    # the tail is an evictable leaf like any other, and flush drops it
    assert cache.stats().pages_evictable == 2 and cache.flush() == 2 and cache.stats().pages_partial == 0
    cache.check(idle=True)


def test_tails_are_per_namespace_and_a_disabled_cache_stores_none() -> None:
    cache = PrefixCache(8, 4)
    serve(cache, "a", [1, 2, 3, 4, 5, 6], namespace="alice")
    assert cache.match_length([1, 2, 3, 4, 5, 6, 0], "alice") == 6
    assert cache.match_length([1, 2, 3, 4, 5, 6, 0], "bob") == 0
    off = CacheOff(8, 4)
    serve(off, "a", [1, 2, 3, 4, 5, 6])
    assert off.stats().pages_cached == 0 and off.stats().pages_free == 8
    off.check(idle=True)
    cache.check(idle=True)


def test_flush_of_one_namespace_leaves_the_others_cached():
    cache = PrefixCache(32, 4)
    for ns in ("alice", "bob"):
        lease = cache.acquire(f"{ns}-req", list(range(12)), ns)
        cache.allocate(lease, 3)
        cache.release(lease, list(range(12)))
    cache.pin(list(range(8)), "alice")
    assert cache.flush("alice") == 3  # the pin is dropped with the rest of alice's pages
    assert cache.match_length(list(range(12)), "alice") == 0
    assert cache.match_length(list(range(12)), "bob") == 12
    assert cache.stats().pages_cached == 3
    cache.check()
    assert cache.flush("nobody") == 0
    assert cache.flush() == 3
    cache.check(idle=True)


def test_flush_of_a_namespace_keeps_what_a_live_lease_reads():
    cache = PrefixCache(32, 4)
    first = cache.acquire("a1", list(range(12)), "alice")
    cache.allocate(first, 3)
    cache.release(first, list(range(12)))
    reader = cache.acquire("a2", list(range(12)) + [99], "alice", max_cached=12)
    assert reader.cached_tokens == 12
    assert cache.flush("alice") == 0  # every cached page of alice is read by the live lease
    cache.check()
    cache.release(reader)
    assert cache.flush("alice") == 3
    cache.check(idle=True)


def test_a_copied_hit_lets_go_of_its_source_page() -> None:
    cache = PrefixCache(4, 4)
    first = list(range(1, 15))  # 3 whole pages + a tail of 2: the whole pool
    lease = cache.acquire("first", first)
    cache.allocate(lease, 4)
    cache.release(lease, first)
    b = cache.acquire("b", first[:7] + [99], max_cached=7)  # 1 whole page + 3 tokens of the second: a copy
    dst, k = b.copy_from.dst, b.copy_from.tokens
    assert k == 3 and b.pages[-1] == dst
    before = cache.available_pages()
    cache.copied(b)
    assert cache.available_pages() == before + 1, "the source is evictable again once copied"
    cache.check()
    cache.allocate(b, 2)  # a pool of 4: b's 2 + 2 more, possible only because the source could go
    assert len(b.pages) == 4
    cache.release(b)
    cache.check(idle=True)


def test_a_lookup_acquired_uncounted_counts_once_when_asked() -> None:
    cache = PrefixCache(8, 2)
    lease = cache.acquire("a", [1, 2, 3, 4, 5])
    cache.allocate(lease, 3)
    cache.release(lease, [1, 2, 3, 4, 5])
    tentative = cache.acquire("b", [1, 2, 3, 4, 9], max_cached=4, count=False)
    cache.release(tentative)  # declined: never counted
    assert (cache.stats().queried_tokens, cache.stats().hit_tokens) == (5, 0)
    kept = cache.acquire("c", [1, 2, 3, 4, 9], max_cached=4, count=False)
    cache.count_lookup(kept)
    cache.count_lookup(kept)  # idempotent
    assert (cache.stats().queried_tokens, cache.stats().hit_tokens) == (10, 4)
    cache.release(kept)
    cache.check(idle=True)


def test_pinned_pages_counts_the_pins_a_request_cannot_read() -> None:
    cache = PrefixCache(16, 2)
    serve(cache, "a", [1, 2, 3, 4, 5])
    serve(cache, "b", [7, 8, 9, 10, 11])
    serve(cache, "c", [1, 2, 3, 4, 5], namespace="t")
    assert cache.pin([1, 2, 3, 4]) == 4 and cache.pin([7, 8]) == 2 and cache.pin([1, 2], "t") == 2
    assert cache.pinned_pages() == 4  # everything pinned, in every namespace
    assert cache.pinned_pages([1, 2, 3, 4, 6]) == 2  # its own prefix's 2 pinned pages it can read
    assert cache.pinned_pages([1, 2, 3, 4, 6], "t") == 3  # only t's one pinned page is on its path, not ""'s two
    assert cache.pinned_pages([5, 5, 5]) == 4  # shares nothing
    cache.unpin([1, 2, 3, 4])
    assert cache.pinned_pages() == 2 and cache.pinned_pages([1, 2, 3, 4]) == 2
    assert CacheOff(4, 2).pinned_pages([1, 2]) == 0
    cache.check(idle=True)


def test_copied_keeps_exactly_the_whole_pages_read_locked() -> None:
    # the hit ends inside the third page of one long edge: the lock moves from 3 pages to the 2 read whole
    cache = PrefixCache(16, 2)
    serve(cache, "a", list(range(1, 10)))  # 4 whole pages and a tail, one edge
    lease = cache.acquire("b", [1, 2, 3, 4, 5, 99], max_cached=5)
    src, k = lease.copy_from.src, lease.copy_from.tokens
    assert k == 1 and cache.tree.protected_pages == 3
    cache.copied(lease)
    assert cache.tree.protected_pages == 2 and cache.allocator.refcount(src) == 1  # the tree's reference only
    cache.check()
    cache.release(lease)
    # the hit ends inside the first page of a child: once copied, the lock moves up to the parent's pages
    serve(cache, "c", [1, 2, 3, 4, 70, 71, 72])  # [1 2 3 4] now branches
    lease = cache.acquire("d", [1, 2, 3, 4, 70, 99], max_cached=5)
    assert lease.copy_from is not None and lease.copy_from.tokens == 1
    assert cache.tree.protected_pages == 3  # the whole pages read and the source page, not the child's tail
    cache.copied(lease)
    assert cache.tree.protected_pages == 2
    assert cache.evict(100) > 0 and cache.match_length([1, 2, 3, 4]) == 4  # what it reads stays cached
    cache.check()
    cache.release(lease)
    # under the root: nothing whole is read, nothing stays locked
    lease = cache.acquire("e", [1, 99], max_cached=1)
    assert lease.copy_from is not None and lease.cached_tokens == 1
    cache.copied(lease)
    assert cache.tree.protected_pages == 0
    cache.check()
    cache.release(lease)
    cache.check(idle=True)


def test_a_regrown_tail_is_copied_by_whole_token_slots() -> None:
    cache = PrefixCache(16, 4)
    pool = KVPool(KVShape(1, 1, 1), page_size=4, num_pages=16)
    serve(cache, "t1", [0, 1, 2, 3, 4])  # a whole page and a tail of 1
    first = cache.acquire("t1b", [0, 1, 2, 3, 4, 9])
    src, dst, k = first.copy_from.src, first.copy_from.dst, first.copy_from.tokens
    pool.copy_prefix(src, dst, k)  # a tail as first stored is copied by whole slots too
    assert k == 1 and first.cached_tokens == 5
    cache.release(first)
    serve(cache, "t2", [0, 1, 2, 3, 4, 5, 6])  # a longer tail replaces it, in place
    lease = cache.acquire("t3", [0, 1, 2, 3, 4, 5, 6, 9])
    src, dst, k = lease.copy_from.src, lease.copy_from.dst, lease.copy_from.tokens
    assert k == 3 and lease.cached_tokens == 7
    pool.kv[:, src] = 1.0
    pool.copy_prefix(src, dst, k)  # what the engine does with copy_from
    assert pool.kv[0, dst, :, :3].eq(1.0).all() and pool.kv[0, dst, :, 3].eq(0.0).all()
    cache.release(lease)
    cache.check(idle=True)


def test_the_pin_budget_is_exact_counts_every_node_of_the_path_and_pins_nothing_when_refused() -> None:
    cache = PrefixCache(8, 2, max_pinned_pages=2)
    serve(cache, "a", [1, 2, 3, 4, 5, 6])
    serve(cache, "b", [1, 2, 3, 4, 9, 9])  # [1 2 3 4] -> {[5 6], [9 9]}: the path to [5 6] is two nodes
    with pytest.raises(PinBudgetError) as refused:
        cache.pin([1, 2, 3, 4, 5, 6])
    assert "pinning 3 more pages would hold 3 pinned pages; the pin budget (--max-pinned) is 2 of the 8" in str(
        refused.value
    )
    assert cache.pinned_pages() == 0  # nothing pinned
    assert cache.pin([1, 2, 3, 4]) == 4  # exactly the budget: allowed
    assert cache.pin([1, 2, 3, 4], ttl=10) == 4  # pinned already: costs nothing, always allowed
    with pytest.raises(PinBudgetError):
        cache.pin([1, 2, 3, 4, 9, 9])  # one more page than the budget
    serve(cache, "c", [1, 2, 3, 4], namespace="t")
    with pytest.raises(PinBudgetError):
        cache.pin([1, 2, 3, 4], "t")  # another namespace's pages are new pins
    with pytest.raises(ValueError, match="ttl must be > 0 seconds"):
        cache.pin([1, 2, 3, 4, 9, 9], ttl=0)  # a bad ttl is named before the budget is looked at
    assert PrefixCache(8, 2, max_pinned_pages=100).max_pinned_pages == 8  # clamped to the pool
    assert PrefixCache(8, 2, max_pinned_pages=-1).max_pinned_pages == 0
    cache.check(idle=True)


def test_pins_leave_the_pages_promised_to_running_requests() -> None:
    cache = PrefixCache(8, 2)  # the pin budget is the whole pool
    serve(cache, "a", list(range(16)))  # 8 whole pages: the whole pool
    with pytest.raises(PinBudgetError, match="leaving fewer than the 6 pages a running request was promised"):
        cache.pin(list(range(6)), keep_unpinned=6)  # 3 pinned would leave 5 of 8
    assert cache.pinned_pages() == 0
    assert cache.pin(list(range(6)), keep_unpinned=5) == 6  # leaves exactly 5
    assert cache.pin(list(range(16))) == 16  # no promise: every page may be pinned
    cache.check(idle=True)


def test_extend_adopts_in_steps_in_its_namespace_and_counts_every_page() -> None:
    cache = PrefixCache(16, 2)
    prompt = list(range(8))
    first = cache.acquire("first", prompt, "t")
    second = cache.acquire("second", prompt, "t")
    cache.allocate(first, 4)
    cache.publish(first, prompt[:2])
    assert cache.extend(second, prompt[:2]) == 2  # exactly one more whole page: adopted
    cache.publish(first, prompt[:6])
    assert cache.extend(second, prompt) == 4 and second.pages == first.pages[:3]
    assert cache.stats().extended_pages == 3
    cache.allocate(second, 1)
    assert cache.publish(second, prompt) == 1  # it goes on from the adopted pages
    other = cache.acquire("other", prompt)  # namespace "": nothing of t's
    assert cache.extend(other, prompt) == 0 and other.pages == []
    for lease in (first, second, other):
        cache.release(lease)
    cache.check(idle=True)


def test_evict_counts_every_page_it_frees() -> None:
    cache = PrefixCache(8, 1)
    serve(cache, "a", [1, 2, 3])
    assert cache.evict(1) == 1 and cache.evict(1) == 1
    assert cache.stats().evicted_pages == 2


def test_a_lookup_is_counted_once_with_its_copied_tokens() -> None:
    cache = PrefixCache(8, 2)
    serve(cache, "a", [1, 2, 3, 4, 5])
    lease = cache.acquire("b", [1, 2, 3, 9], count=False)
    assert lease.copy_from is not None
    cache.count_lookup(lease)
    cache.count_lookup(lease)
    s = cache.stats()
    assert (s.queried_tokens, s.hit_tokens, s.copied_tokens) == (9, 3, 1)
    cache.release(lease)
    off = CacheOff(8, 2)
    off.release(off.acquire("c", [1, 2, 3]))
    assert (off.stats().queried_tokens, off.stats().hit_tokens, off.stats().copied_tokens) == (3, 0, 0)


def test_a_request_that_recomputes_publishes_through_a_tail_stored_in_the_same_edge() -> None:
    cache = PrefixCache(16, 4)
    turn1 = list(range(10))
    serve(cache, "t1", turn1)  # published at release only: one edge of two whole pages and the tail [8 9]
    (edge,) = cache.tree._roots[""].children.values()
    assert edge.tail == 2 and len(edge.pages) == 3
    cached = edge.pages[:2]
    turn2 = turn1 + [10, 11, 12]
    lease = cache.acquire("t2", turn2, max_cached=0)  # reads nothing cached (as acquire never cuts the edge)
    cache.allocate(lease, 4)
    assert cache.publish(lease, turn2[:12]) == 1  # its third page replaces the tail while it runs
    assert lease.pages[:2] == cached  # the two it computed again are swapped for the tree's, freeing its copies
    assert cache.tree.match(list_key(turn2[:12])).pages == lease.pages[:3] and cache.stats().pages_partial == 0
    cache.check()
    cache.release(lease, turn2)
    cache.check(idle=True)
