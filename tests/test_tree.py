import itertools
import random

import pytest
from helpers import FakeClock

from radixcache.keys import common_prefix, decode, encode
from radixcache.node import PathPins
from radixcache.tree import RadixTree
from radixcache.tree_check import check_tree


def snapshot(tree: RadixTree) -> list:
    return sorted(tree.items()), sorted((n.id, n.key, tuple(n.pages)) for n in tree.nodes())


def seq(*tokens: int) -> bytes:
    return encode(list(tokens))


def test_key_format_roundtrip_and_order() -> None:
    tokens = [0, 1, 255, 256, 31999, 2**32 - 1]
    assert decode(encode(tokens)) == tokens
    assert len(encode(tokens)) == 4 * len(tokens)
    # bytes order is token order (partial-page lookup relies on it)
    pairs = [[1, 2], [1, 300], [2, 0], [256, 1]]
    assert sorted(pairs) == sorted(pairs, key=encode)
    assert decode(encode(b"\x05\x06")) == [5, 6]  # a bytes object is token ids, not a raw key
    with pytest.raises(ValueError, match="token ids"):
        encode([-1])


def test_insert_match_compressed_and_split() -> None:
    tree = RadixTree(2)
    r = tree.insert(seq(1, 2, 3, 4, 5, 6), [10, 11, 12])
    assert r.new_pages == [10, 11, 12] and r.existing == 0 and r.duplicates == []
    assert len(list(tree.nodes())) == 2  # root + one compressed edge
    r = tree.insert(seq(1, 2, 3, 4, 7, 8), [20, 21, 22])
    assert r.new_pages == [22] and r.existing == 2 and r.duplicates == [20, 21]
    assert len(list(tree.nodes())) == 4  # the edge was split after two pages
    m = tree.match(seq(1, 2, 3, 4, 7, 8, 9, 9))
    assert m.pages == [10, 11, 22] and m.tokens == 6 and m.partial_tokens == 0
    assert m.node is r.node
    assert tree.match(seq(1, 2, 3, 4, 5, 6), "other").pages == []  # other namespace: a miss
    check_tree(tree)


def test_insert_of_a_prefix_stores_nothing_and_ends_at_a_node() -> None:
    tree = RadixTree(1)
    tree.insert(seq(1, 2, 3, 4), [0, 1, 2, 3])
    r = tree.insert(seq(1, 2), [0, 1])
    assert r.new_pages == [] and r.existing == 2 and r.duplicates == []
    assert r.node is not None and r.node.pages == [0, 1]  # split, so a lock there covers exactly [1, 2]
    assert len(list(tree.nodes())) == 3
    assert tree.cut(r.node, 2) is r.node and tree.cut(r.node, 1).pages == [0]
    assert tree.insert(seq(), []).node is None
    with pytest.raises(ValueError, match="need"):
        tree.insert(seq(1), [0, 1])
    check_tree(tree)


def test_match_never_changes_structure() -> None:
    tree = RadixTree(4)
    rng = random.Random(1)
    pages = itertools.count()
    for _ in range(30):
        n = rng.randrange(1, 6)
        toks = [rng.randrange(3) for _ in range(4 * n)]
        tree.insert(encode(toks), [next(pages) for _ in range(n)])
    before = snapshot(tree)
    for _ in range(200):
        toks = [rng.randrange(3) for _ in range(rng.randrange(0, 25))]
        tree.match(encode(toks))
        tree.match(encode(toks), touch=False)
    assert snapshot(tree) == before
    check_tree(tree)


def test_partial_page_hit_at_a_node_boundary_and_mid_edge() -> None:
    tree = RadixTree(4)
    tree.insert(seq(1, 2, 3, 4, 5, 6, 7, 8), [0, 1])
    tree.insert(seq(1, 2, 3, 4, 5, 6, 9, 9), [0, 2])
    tree.insert(seq(1, 2, 3, 4, 7, 7, 7, 7), [0, 3])
    # boundary: after page 0 the best of three children shares 3 tokens (5 6 7)
    m = tree.match(seq(1, 2, 3, 4, 5, 6, 7, 0))
    assert m.pages == [0] and (m.partial_page, m.partial_tokens) == (1, 3) and m.tokens == 7
    assert m.partial_node is not None and m.partial_node.parent is m.node
    # a query that ends inside a page: its tail matches the first slots
    m = tree.match(seq(1, 2, 3, 4, 5, 6))
    assert m.pages == [0] and m.partial_tokens == 2 and m.partial_page in (1, 2)
    # mid-edge: a tail shorter than a page inside a compressed edge
    tree2 = RadixTree(4)
    tree2.insert(seq(*range(1, 13)), [7, 8, 9])
    m = tree2.match(seq(1, 2, 3, 4, 5, 6, 99))
    assert m.pages == [7] and (m.partial_page, m.partial_tokens) == (8, 2) and m.partial_node is m.node
    assert tree2.match(seq(5, 6)).tokens == 0
    # page size 1 never reports a partial page
    tree3 = RadixTree(1)
    tree3.insert(seq(1, 2), [0, 1])
    assert tree3.match(seq(1, 3)).partial_tokens == 0


def test_partial_page_picks_the_longest_of_many_children() -> None:
    tree = RadixTree(8)
    rng = random.Random(3)
    best = None
    query = [5] * 8 + [1, 2, 3, 4, 5, 6, 7, 8]
    for page in range(1, 200):
        tail = [rng.randrange(4) + 1 for _ in range(8)]
        tree.insert(encode([5] * 8 + tail), [0, page])
        common = next((i for i, (a, b) in enumerate(zip(tail, query[8:], strict=True)) if a != b), 8)
        if best is None or common > best[0]:
            best = (common, page)
    m = tree.match(encode(query))
    if best[0] == 8:
        assert m.pages == [0, best[1]]
    else:
        assert m.partial_tokens == best[0] and m.pages == [0]
    check_tree(tree)


def test_lru_eviction_order_skips_locked_and_pinned_leaves() -> None:
    tree = RadixTree(1)
    a = tree.insert(seq(1, 1), [0, 1]).node
    tree.insert(seq(2, 2), [2, 3])
    tree.insert(seq(3, 3), [4, 5])
    tree.insert(seq(4, 4), [6, 7])
    tree.match(seq(1, 1))  # a is now the most recently used
    tree.lock(tree.match(seq(2, 2)).node)  # locked: never evicted
    tree.pin(seq(3, 3))  # pinned: never evicted
    assert tree.evictable_pages == 4
    assert tree.evict(2) == [6, 7]  # the LRU unlocked, unpinned leaf
    assert tree.evict(1) == [1]  # the tail of `a` first: exactly the pages asked for
    assert a.pages == [0] and not a.evicted
    assert tree.evict(10) == [0]
    assert tree.evictable_pages == 0 and tree.evict(10) == []
    check_tree(tree)


def test_eviction_is_leaf_first() -> None:
    tree = RadixTree(1)
    tree.insert(seq(1, 2, 3), [0, 1, 2])
    tree.insert(seq(1, 2, 4), [0, 1, 3])
    tree.match(seq(1, 2, 3))
    assert tree.evict(1) == [3]
    assert tree.evict(1) == [2]  # the other leaf; only then the shared parent
    assert sorted(tree.evict(2)) == [0, 1]
    assert tree.cached_pages == 0
    check_tree(tree)


def test_lock_protects_the_whole_path_and_unlock_releases_it() -> None:
    tree = RadixTree(2)
    leaf = tree.insert(seq(1, 2, 3, 4), [0, 1]).node
    tree.insert(seq(1, 2, 9, 9), [0, 2])  # splits: leaf keeps the lower half, its lock must cover the upper
    tree.lock(leaf)
    assert tree.evictable_pages == 1 and tree.evict(5) == [2]
    assert tree.cached_pages == 2
    tree.unlock(leaf)
    with pytest.raises(ValueError, match="no lock"):
        tree.unlock(leaf)
    assert sorted(tree.evict(5)) == [0, 1]
    check_tree(tree)


def test_pins_with_ttl_and_unpin() -> None:
    clock = FakeClock(100.0)
    tree = RadixTree(2, clock=clock)
    tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 1, 2])
    assert tree.pin(seq(1, 2, 3, 4, 7), ttl=10) == 4  # whole cached pages only; splits at the pin boundary
    assert tree.pinned_pages == 2 and tree.evictable_pages == 1
    assert tree.evict(3) == [2]
    clock.now += 5
    assert tree.pin(seq(1, 2), ttl=20) == 2  # extends page 0 to t+25; page 1 still expires at t+10
    clock.now += 6
    assert tree.evictable_pages == 1 and tree.pinned_pages == 1
    assert tree.evict(3) == [1]
    check_tree(tree)
    assert tree.pin(seq(1, 2)) == 2  # no TTL: forever
    clock.now += 1000
    assert tree.evictable_pages == 0
    assert tree.unpin(seq(1, 2, 3, 4)) == 2 and tree.unpin(seq(1, 2)) == 0
    assert tree.evict(3) == [0]
    assert tree.pin(seq(8, 8)) == 0
    with pytest.raises(ValueError, match="ttl"):
        tree.pin(seq(1, 2), ttl=0)
    check_tree(tree)


def test_flush_drops_pins_and_unlocked_nodes_only() -> None:
    tree = RadixTree(1)
    locked = tree.insert(seq(1, 2), [0, 1]).node
    tree.insert(seq(1, 2, 3), [0, 1, 2])
    tree.insert(seq(5), [5])
    tree.pin(seq(5))
    tree.lock(locked)
    assert sorted(tree.flush()) == [2, 5]
    assert tree.pinned_pages == 0 and tree.cached_pages == 2
    assert tree.match(seq(1, 2)).pages == [0, 1]
    tree.unlock(locked)
    assert sorted(tree.flush()) == [0, 1]
    check_tree(tree)


def test_namespaces_never_share_nodes() -> None:
    tree = RadixTree(1)
    tree.insert(seq(1, 2), [0, 1], "alice")
    assert tree.match(seq(1, 2), "bob").tokens == 0
    assert tree.match(seq(1, 2)).tokens == 0
    r = tree.insert(seq(1, 2), [2, 3], "bob")
    assert r.new_pages == [2, 3]
    assert tree.match(seq(1, 2), "alice").pages == [0, 1]
    assert tree.match(seq(1, 2), "bob").pages == [2, 3]
    assert sorted(tree.namespaces()) == ["alice", "bob"]
    check_tree(tree)


def test_evictable_list_follows_access_time() -> None:
    tree = RadixTree(16)
    rng = random.Random(0)
    keys = [encode([rng.randrange(100) for _ in range(32)]) for _ in range(50)]
    for i, key in enumerate(keys):
        tree.insert(key, [2 * i, 2 * i + 1])
    order = list(range(50))
    rng.shuffle(order)
    for i in order:
        tree.match(keys[i])
    check_tree(tree)
    evicted = [tree.evict(2) for _ in range(50)]
    assert [pages[0] // 2 for pages in evicted] == order


def test_an_unlocked_leaf_keeps_its_age_and_a_touch_makes_it_newest() -> None:
    tree = RadixTree(1)
    a = tree.insert(seq(1), [0]).node
    tree.lock(a)
    tree.insert(seq(2), [1])
    tree.insert(seq(3), [2])
    tree.unlock(a)  # evictable again with its old access time: older than both newer leaves
    assert tree.evict(1) == [0]
    tree.insert(seq(1), [0])
    tree.lock(tree.match(seq(1)).node)
    tree.insert(seq(4), [3])
    tree.unlock(tree.match(seq(1), touch=False).node)  # listed behind newer leaves, by its age
    tree.match(seq(1))  # ... and now used: it becomes the newest
    assert [tree.evict(1) for _ in range(4)] == [[1], [2], [3], [0]]
    check_tree(tree)


def test_a_parent_left_childless_is_evicted_by_its_own_age() -> None:
    tree = RadixTree(1)
    tree.insert(seq(1, 2), [0, 1])
    tree.insert(seq(1, 3), [0, 2])  # splits: parent (1) -> children (2) and (3)
    tree.insert(seq(5), [5])  # newer than the parent
    tree.match(seq(1, 3))
    assert tree.evict(1) == [1]  # the older child
    assert tree.evict(1) == [5]  # (1, 3) was used after (5) was stored: (5) goes before it
    assert tree.evict(1) == [2]
    tree.insert(seq(7), [7])
    tree.insert(seq(1, 4), [0, 4])
    tree.insert(seq(8), [8])
    assert tree.evict(1) == [7]
    assert tree.evict(1) == [4]  # the parent (1) is a leaf again, with the age of its last use ...
    assert tree.evict(1) == [0]  # ... older than (8): it goes first
    assert tree.evict(1) == [8]
    check_tree(tree)


def test_the_older_head_goes_first_whichever_list_holds_it() -> None:
    tree = RadixTree(1)
    tree.insert(seq(1), [1])
    tree.insert(seq(2), [2])
    c = tree.insert(seq(3), [3]).node
    tree.lock(c)
    tree.insert(seq(4), [4])
    tree.unlock(c)  # listed by age: newer than (1) and (2), older than (4)
    assert [tree.evict(1) for _ in range(4)] == [[1], [2], [3], [4]]
    assert c.evicted
    assert tree.evict(0) == [] and tree.evict(-1) == []
    check_tree(tree)


def test_pin_accounting_over_several_nodes_and_expiry_counts() -> None:
    clock = FakeClock(100.0)
    tree = RadixTree(1, clock=clock)
    tree.insert(seq(1, 2, 3), [1, 2, 3])
    tree.insert(seq(1, 2, 4), [1, 2, 4])  # splits (1, 2) from its two children
    tree.insert(seq(7, 8), [7, 8])
    assert tree.pin(seq(1, 2, 3), ttl=10) == 3  # two nodes
    assert tree.pin(seq(7, 8), ttl=30) == 2
    assert tree.pinned_pages == 5
    assert tree.pin(seq(1, 2, 3), ttl=5) == 3  # a shorter TTL never shortens a pin
    clock.now += 8
    assert tree.pinned_pages == 5 and tree.expire() == 0
    clock.now += 3
    assert tree.expire() == 2  # both nodes of the first pin
    assert tree.pinned_pages == 2
    assert tree.pin(seq(1, 2, 4)) == 3
    assert tree.unpin(seq(1, 2, 4)) == 3  # summed over both nodes
    check_tree(tree)


def test_partial_lookup_after_children_were_evicted() -> None:
    tree = RadixTree(4)
    tree.insert(seq(9, 9, 9, 9), [0])
    tree.pin(seq(9, 9, 9, 9))
    for i in range(1, 41):
        tree.insert(seq(9, 9, 9, 9, i, i, i, i), [0, i])
    tree.match(seq(9, 9, 9, 9, 7, 7, 7, 7))  # the newest: evicted last
    assert len(tree.evict(39)) == 39
    check_tree(tree)  # stale sorted keys stay bounded
    m = tree.match(seq(9, 9, 9, 9, 7, 7, 0))
    assert m.partial_page == 7 and m.partial_tokens == 2
    assert tree.match(seq(9, 9, 9, 9, 8, 8)).partial_tokens == 0
    tree.insert(seq(9, 9, 9, 9, 8, 8, 8, 8), [0, 50])  # a key whose stale entry is still listed
    assert tree.match(seq(9, 9, 9, 9, 8, 8)).partial_page == 50
    check_tree(tree)


def test_partial_tail_is_matched_deduped_and_replaced_in_place() -> None:
    tree = RadixTree(4)
    r = tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 1], partial=True)
    assert r.new_pages == [0, 1] and r.node.tail == 2 and tree.partial_pages == 1 and tree.cached_pages == 2
    m = tree.match(seq(1, 2, 3, 4, 5, 6, 9))  # runs through the tail: reported as a partial page, never whole
    assert m.pages == [0] and (m.partial_page, m.partial_tokens) == (1, 2) and m.tokens == 6
    assert m.node is r.node and m.node_pages == 1 and m.partial_node is r.node
    assert tree.match(seq(1, 2, 3, 4, 5, 9)).partial_tokens == 1
    assert tree.match(seq(1, 2, 3, 4, 5, 6)).tokens == 6
    check_tree(tree)
    # a shorter (or equal) tail over the same tokens is covered: nothing stored
    for key, page in ((seq(1, 2, 3, 4, 5), 7), (seq(1, 2, 3, 4, 5, 6), 8)):
        d = tree.insert(key, [0, page], partial=True)
        assert d.new_pages == [] and d.duplicates == [page] and d.replaced == []
    # a longer tail replaces it; then a whole page does, and the edge continues (still one compressed node)
    d = tree.insert(seq(1, 2, 3, 4, 5, 6, 7), [0, 9], partial=True)
    assert d.new_pages == [9] and d.replaced == [1] and d.node is r.node and r.node.tail == 3
    d = tree.insert(seq(*range(1, 13)), [0, 10, 11])
    assert d.new_pages == [10, 11] and d.replaced == [9] and d.node is r.node and r.node.pages == [0, 10, 11]
    assert r.node.tail == 0 and tree.partial_pages == 0 and tree.cached_pages == 3 and len(list(tree.nodes())) == 2
    check_tree(tree)
    with pytest.raises(ValueError, match="need"):
        tree.insert(seq(1, 2, 3, 4), [0, 1], partial=True)  # every page must hold at least one token


def test_partial_key_ending_inside_a_cached_edge_stores_nothing_and_splits_nothing() -> None:
    tree = RadixTree(4)
    tree.insert(seq(*range(1, 13)), [0, 1, 2])
    before = snapshot(tree)
    d = tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 5], partial=True)
    assert d.new_pages == [] and d.duplicates == [5] and d.replaced == []
    assert snapshot(tree) == before
    d = tree.insert(seq(1, 2, 3, 4, 5, 9), [0, 6], partial=True)  # diverges inside the page: a sibling tail
    assert d.new_pages == [6] and d.node.tail == 2 and d.node.parent.pages == [0]
    assert tree.match(seq(1, 2, 3, 4, 5, 9, 9)).partial_page == 6
    check_tree(tree)


def test_partial_sibling_tails_at_a_node_boundary() -> None:
    tree = RadixTree(4)
    root_edge = tree.insert(seq(1, 2, 3, 4), [0]).node
    a = tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 1], partial=True).node
    b = tree.insert(seq(1, 2, 3, 4, 5, 7, 7), [0, 2], partial=True).node
    assert a.parent is b.parent is root_edge and root_edge.partial_children == 2 and tree.partial_pages == 2
    m = tree.match(seq(1, 2, 3, 4, 5, 7, 7, 7))
    assert m.pages == [0] and (m.partial_page, m.partial_tokens) == (2, 3) and m.partial_node is b
    assert m.node is root_edge
    assert tree.match(seq(1, 2, 3, 4, 5, 6, 0)).partial_page == 1
    check_tree(tree)
    d = tree.insert(seq(1, 2, 3, 4, 5, 6, 7, 8, 9), [0, 3, 4], partial=True)  # whole page over a's tail, then more
    assert d.replaced == [1] and d.new_pages == [3, 4] and d.node is a and a.pages == [3, 4] and a.tail == 1
    assert root_edge.partial_children == 1 and tree.partial_pages == 2
    d = tree.insert(seq(1, 2, 3, 4, 5), [0, 8], partial=True)  # covered by a's whole first page
    assert d.new_pages == [] and d.duplicates == [8]
    assert tree.match(seq(1, 2, 3, 4, 5, 6, 7, 8, 9)).pages == [0, 3]
    check_tree(tree)
    assert sorted(tree.evict(10)) == [0, 2, 3, 4]
    assert tree.partial_pages == 0 and tree.cached_pages == 0
    check_tree(tree)


def test_partial_tails_under_eviction_locks_pins_flush_and_namespaces() -> None:
    tree = RadixTree(4)
    node = tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 1], partial=True).node
    assert tree.evict(1) == [1] and node.pages == [0] and node.tail == 0 and tree.partial_pages == 0  # tail first
    check_tree(tree)
    leaf = tree.insert(seq(1, 2, 3, 4, 5), [0, 2], partial=True).node
    assert leaf.parent is node and len(leaf.first) == 4
    tree.lock(leaf)  # a reader copying from the tail
    d = tree.insert(seq(1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9), [0, 3, 4])  # replaced under the lock, in place
    assert d.replaced == [2] and leaf.pages == [3, 4] and leaf.lock == 1 and not leaf.evicted
    assert tree.evictable_pages == 0
    check_tree(tree)
    tree.unlock(leaf)
    assert tree.evictable_pages == 3
    # pins cover whole pages only: the edge is split before its tail, which stays evictable
    tail = tree.insert(seq(7, 7, 7, 7, 8), [5, 6], partial=True).node
    assert tree.pin(seq(7, 7, 7, 7, 8)) == 4 and tail.pages == [6] and tail.pin_until is None
    check_tree(tree)
    assert sorted(tree.evict(10)) == [0, 3, 4, 6] and tree.cached_pages == tree.pinned_pages == 1
    check_tree(tree)
    tree.insert(seq(5, 5, 5), [9], "other", partial=True)
    assert tree.match(seq(5, 5, 5)).tokens == 0 and tree.match(seq(5, 5, 5), "other").tokens == 3
    assert sorted(tree.flush()) == [5, 9] and tree.partial_pages == 0 and tree.cached_pages == 0
    check_tree(tree)


class RecordingSink:
    """An event sink that keeps what the tree reports, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, namespace: str, after: int | None, pages: list[int], key: bytes) -> None:
        self.events.append(("stored", namespace, after, list(pages), key))

    def removed(self, pages: list[int]) -> None:
        self.events.append(("removed", list(pages)))

    def cleared(self, namespace: str) -> None:
        self.events.append(("cleared", namespace))


def test_a_tail_regrown_inside_its_first_page_stays_a_partial_child_after_its_parent() -> None:
    tree, sink = RadixTree(4), RecordingSink()
    tree.set_event_sink(sink)
    edge = tree.insert(seq(*range(1, 13)), [0, 1, 2]).node  # three whole pages
    tail = tree.insert(seq(*range(1, 14)), [0, 1, 2, 5], partial=True).node  # tail [13] below them
    assert tail.parent is edge and edge.partial_children == 1 and tail.tail == 1
    d = tree.insert(seq(*range(1, 15)), [0, 1, 2, 6], partial=True)  # a longer tail [13 14]: replaces it
    assert d.replaced == [5] and d.node is tail and tail.pages == [6] and tail.tail == 2
    assert edge.partial_children == 1 and tree.partial_pages == 1 and tree.cached_pages == 4
    # what replaces the tail continues the edge's last page: a consumer chains its page hashes from there
    assert sink.events[-1] == ("stored", "", 2, [6], seq(13, 14))
    m = tree.match(seq(*range(1, 15), 99))
    assert m.pages == [0, 1, 2] and (m.partial_page, m.partial_tokens) == (6, 2)
    check_tree(tree)


def test_pins_follow_a_path_of_three_nodes_and_never_cut_a_partial_tail() -> None:
    tree = RadixTree(2)
    tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 1, 2])
    tree.insert(seq(1, 2, 3, 4, 9, 9), [0, 1, 3])
    tree.insert(seq(1, 2, 8, 8), [0, 4])  # [1 2] -> {[3 4] -> {[5 6], [9 9]}, [8 8]}
    assert tree.pinned_on_path(seq(1, 2, 3, 4, 5, 6)) == PathPins(pinned=0, unpinned=3)
    assert tree.pin(seq(1, 2, 3, 4, 5, 6, 7)) == 6 and tree.pinned_pages == 3
    assert tree.pinned_on_path(seq(1, 2, 3, 4, 9, 9)) == PathPins(pinned=2, unpinned=1)
    tail = tree.insert(seq(1, 2, 8, 8, 7), [0, 4, 5], partial=True).node  # a tail [7] below [8 8]
    assert tail.tail == 1
    assert tree.pin(seq(1, 2, 8, 8, 7)) == 4  # whole pages only: the tail is neither pinned nor split
    assert tree.pinned_pages == 4 and tail.pages == [5] and tail.pin_until is None
    assert tree.unpin(seq(1, 2, 8, 8, 7)) == 4  # [1 2] and [8 8]; [3 4] and [5 6] stay pinned
    assert tree.pinned_pages == 2
    check_tree(tree)


def test_common_prefix_counts_bytes_up_to_the_first_difference() -> None:
    assert common_prefix(seq(1, 2, 3), seq(1, 2, 3)) == 12
    assert common_prefix(seq(1, 2, 3), seq(1, 2)) == 8  # one is a prefix of the other
    assert common_prefix(seq(1, 2, 3), seq(1, 2, 4)) == 11  # differ in the last byte of the third token
    assert common_prefix(seq(1, 0), seq(1, 128)) == 7  # the highest bit of a byte
    assert common_prefix(seq(1, 2**24), seq(1, 0)) == 4  # the first byte of the second token
    assert common_prefix(seq(7), seq(7 + 2**31)) == 0
    assert common_prefix(b"", seq(1)) == 0


def test_the_oldest_leaf_is_evicted_when_only_the_sorted_list_holds_leaves() -> None:
    tree = RadixTree(1)
    a = tree.insert(seq(1), [0]).node
    b = tree.insert(seq(2), [1]).node
    tree.lock(a)
    tree.unlock(a)  # evictable again with an access older than b's: listed in the sorted list
    tree.lock(b)  # the recent list is now empty
    assert len(tree._lru.recent) == 0 and len(tree._lru.ordered) == 1
    assert tree.evict(1) == [0]
    check_tree(tree)


def test_a_flush_of_every_namespace_reports_each_cleared_namespace() -> None:
    tree, sink = RadixTree(1), RecordingSink()
    tree.insert(seq(1, 2), [0, 1])
    tree.insert(seq(1, 2), [2, 3], "t")
    tree.set_event_sink(sink)
    assert sorted(tree.flush()) == [0, 1, 2, 3]
    assert sorted(e for e in sink.events if e[0] == "cleared") == [("cleared", ""), ("cleared", "t")]


def test_a_match_that_diverges_inside_a_deeper_edge_keeps_the_whole_path() -> None:
    tree = RadixTree(2)
    upper = tree.insert(seq(1, 2, 3, 4), [0, 1]).node
    lower = tree.insert(seq(1, 2, 3, 4, 5, 6, 7, 8), [0, 1, 2, 3]).node
    assert lower.parent is upper and lower.pages == [2, 3]
    m = tree.match(seq(1, 2, 3, 4, 5, 6, 9, 9))
    assert m.pages == [0, 1, 2] and m.node is lower and m.node_pages == 1 and m.tokens == 6
    m = tree.match(seq(1, 2, 3, 4, 5, 6, 7, 9))  # and a partial page after that
    assert m.pages == [0, 1, 2] and (m.partial_page, m.partial_tokens) == (3, 1)
    miss = tree.match(seq(8, 8))
    assert miss.pages == [] and miss.node is None and miss.tokens == 0


def test_insert_takes_whole_pages_unless_told_the_key_ends_in_a_partial_one() -> None:
    tree = RadixTree(2)
    with pytest.raises(ValueError, match="^2 pages need 4 tokens, the key has 3$"):
        tree.insert(seq(1, 2, 3), [0, 1])  # not partial by default
    assert tree.cached_pages == 0
    r = tree.insert(seq(1, 2, 3, 4, 5), [0, 1])  # tokens beyond the pages are not stored
    assert r.new_pages == [0, 1] and tree.match(seq(1, 2, 3, 4, 5)).tokens == 4 and tree.partial_pages == 0
    check_tree(tree)


def test_a_partial_key_covered_by_a_sibling_page_stores_nothing() -> None:
    tree = RadixTree(4)
    parent = tree.insert(seq(1, 2, 3, 4), [0]).node
    tree.insert(seq(1, 2, 3, 4, 5, 6, 7, 8), [0, 1])
    assert parent.partial_children == 0
    d = tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 9], partial=True)  # [5 6] is the start of the cached [5 6 7 8]
    assert d.new_pages == [] and d.duplicates == [9] and tree.partial_pages == 0 and len(parent.children) == 1
    check_tree(tree)


def test_a_partial_key_ending_inside_a_deeper_edge_is_covered_without_a_split() -> None:
    tree = RadixTree(4)
    tree.insert(seq(1, 2, 3, 4), [0])
    lower = tree.insert(seq(*range(1, 13)), [0, 1, 2]).node  # [5 .. 12] below [1 2 3 4]
    before = snapshot(tree)
    d = tree.insert(seq(*range(1, 11)), [0, 1, 7], partial=True)  # ends 2 tokens into the edge's second page
    assert d.new_pages == [] and d.duplicates == [7] and d.node is lower
    assert snapshot(tree) == before
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        RadixTree(0)


def test_observers_hear_what_the_event_sink_hears_and_keep_hearing_it_without_one() -> None:
    tree, events, observer = RadixTree(2), RecordingSink(), RecordingSink()
    tree.set_event_sink(events)
    tree.add_observer(observer)
    tree.add_observer(observer)  # once is enough
    tree.insert(seq(1, 2, 3, 4), [0, 1])
    assert events.events == observer.events == [("stored", "", None, [0, 1], seq(1, 2, 3, 4))]
    tree.set_event_sink(None)  # the hub's slot emptied: the observer is not touched
    tree.insert(seq(1, 2, 5, 6), [0, 2], "t")
    assert len(events.events) == 1 and observer.events[-1] == ("stored", "t", None, [0, 2], seq(1, 2, 5, 6))
    tree.flush("t")
    assert observer.events[-2:] == [("removed", [0, 2]), ("cleared", "t")]
    tree.set_event_sink(events)
    tree.remove_observer(observer)
    heard = len(observer.events)
    assert tree.evict(1) == [1]
    assert events.events[-1] == ("removed", [1]) and len(observer.events) == heard


def test_an_observer_hears_every_partial_tail_leave_and_the_event_sink_never_does() -> None:
    tree, events, observer = RadixTree(4), RecordingSink(), RecordingSink()
    tree.set_event_sink(events)
    tree.add_observer(observer)
    tree.insert(seq(1, 2, 3, 4, 5), [0, 1], partial=True)  # [1 2 3 4] and a tail [5]
    tree.insert(seq(1, 2, 3, 4, 5, 6), [0, 2], partial=True)  # a longer tail replaces it
    assert observer.events[1:] == [("removed", [1]), ("stored", "", 0, [2], seq(5, 6))]
    assert events.events[1:] == [("stored", "", 0, [2], seq(5, 6))]
    assert sorted(tree.evict(1)) == [2]  # the leaf's tail page is the one evicted
    assert observer.events[-1] == ("removed", [2]) and events.events[-1] == ("removed", [])
    tree.insert(seq(7, 7), [3], "t", partial=True)
    tree.flush("t")
    assert observer.events[-2:] == [("removed", [3]), ("cleared", "t")]
    assert ("removed", [3]) not in events.events
