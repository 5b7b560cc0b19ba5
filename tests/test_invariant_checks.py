"""The invariant checkers catch what they promise to catch.

`RadixTree.check`, `PrefixCache.check`, `PageAllocator.check` and `LeafLRU.check` are what every cache test (and the
stateful and chaos tests) relies on to notice a corrupted structure: a check that cannot fail would hide every bug
those tests look for. Each case here builds a healthy cache, breaks exactly one invariant by hand, and expects the
check to fail naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from radixcache.cache import Lease, PrefixCache
from radixcache.keys import encode
from radixcache.lru import RECENT, order_key
from radixcache.node import Node
from radixcache.pages import PageAllocator
from radixcache.tree import RadixTree
from radixcache.tree_check import check_tree

PS = 2  # page size: partial tails and sorted child keys only exist for page_size > 1


def healthy() -> tuple[PrefixCache, dict[str, Node]]:
    """A cache holding: [1 2 3 4] -> {[5 6] leaf, [7 8] leaf (locked by a lease)}, a partial tail [9] under the
    root, a pinned (TTL) leaf [11 12 13 14] and a leaf in namespace "b". Returns the cache and its nodes by name."""
    cache = PrefixCache(32, PS, clock=lambda: 100.0)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [11, 12, 13, 14]):
        lease = cache.acquire("w", tokens)
        cache.allocate(lease, 3 - len(lease.pages))
        cache.release(lease, tokens)
    lease = cache.acquire("w", [9])  # a partial tail: a released sequence that ended inside its first page
    cache.allocate(lease, 1)
    cache.release(lease, [9])
    other = cache.acquire("w", [1, 2], "b")
    cache.allocate(other, 1)
    cache.release(other, [1, 2])
    cache.pin([11, 12, 13, 14], ttl=30)
    reader = cache.acquire("reader", [1, 2, 3, 4, 7, 8])
    assert reader.cached_tokens == 6
    tree = cache.tree
    root = tree._roots[""]
    trunk = root.children[encode([1, 2])]
    nodes = {
        "root": root,
        "trunk": trunk,
        "leaf": trunk.children[encode([5, 6])],
        "locked": trunk.children[encode([7, 8])],
        "tail": root.children[encode([9])],
        "pinned": root.children[encode([11, 12])],
        "b": tree._roots["b"].children[encode([1, 2])],
    }
    cache.check()  # healthy as built
    assert nodes["tail"].tail == 1 and nodes["pinned"].pin_until == 130.0 and nodes["locked"].lock == 1
    return cache, nodes


def corrupt_tree(what: Callable[[RadixTree, dict[str, Node]], None], message: str) -> None:
    cache, nodes = healthy()
    what(cache.tree, nodes)
    with pytest.raises(AssertionError, match=message):
        check_tree(cache.tree)


def set_(name: str, field: str, value: object) -> Callable[[RadixTree, dict[str, Node]], None]:
    return lambda tree, nodes: setattr(nodes[name], field, value)


def add_child(parent: str, first: bytes, child: str) -> Callable[[RadixTree, dict[str, Node]], None]:
    return lambda tree, nodes: nodes[parent].children.__setitem__(first, nodes[child])


TREE_CORRUPTIONS = {
    "root with pages": (set_("root", "pages", [31]), "root of '' is malformed"),
    "root with a parent": (lambda t, n: setattr(n["root"], "parent", n["b"]), "root of '' is malformed"),
    "root with a key": (set_("root", "key", encode([1])), "root of '' is malformed"),
    "evicted node reachable": (set_("leaf", "evicted", True), "evicted node .* is reachable"),
    "a page too many": (lambda t, n: setattr(n["leaf"], "pages", n["leaf"].pages + [31]), "bad edge"),
    "a page too few": (set_("trunk", "pages", []), "bad edge"),
    "key longer than its pages": (set_("leaf", "key", encode([5, 6, 7])), "bad edge"),
    "tail count wrong": (set_("tail", "tail", 0), "tail 0"),
    "tail on a whole page": (set_("leaf", "tail", 1), "tail 1"),
    "key not whole tokens": (
        lambda t, n: (setattr(n["pinned"], "key", n["pinned"].key[:-1]), setattr(n["pinned"], "tail", 1)),
        "tail 1",
    ),
    "partial tail with children": (add_child("tail", encode([9, 10]), "leaf"), "has a partial tail and children"),
    "partial tail pinned": (set_("tail", "pin_until", math.inf), "a partial tail is pinned"),
    "sibling keys nest": (add_child("root", encode([11]), "pinned"), "keys nest"),
    "partial children miscounted": (set_("root", "partial_children", 0), "partial children"),
    "child with a wrong parent": (set_("leaf", "parent", None), "bad link"),
    "child under a wrong key": (lambda t, n: setattr(n["leaf"], "first", encode([5, 7])), "bad link"),
    "sorted keys out of order": (lambda t, n: n["trunk"].sorted_keys.reverse(), "keys"),
    "sorted keys miss a child": (lambda t, n: n["trunk"].sorted_keys.pop(), "miss a child"),
    "too many stale sorted keys": (
        lambda t, n: setattr(
            n["trunk"], "sorted_keys", sorted(n["trunk"].sorted_keys + [encode([90 + i, 0]) for i in range(11)])
        ),  # fmt: skip
        "too many stale sorted keys",
    ),
    "a sorted key listed twice": (
        lambda t, n: n["trunk"].sorted_keys.insert(0, n["trunk"].sorted_keys[0]),
        "keys",
    ),
    "sorted keys on a leaf": (set_("leaf", "sorted_keys", []), "has sorted keys but no children"),
    "lock count wrong": (set_("locked", "lock", 2), "lock 1, locks below 2"),  # named at the parent
    "own lock not counted": (set_("leaf", "own_locks", 1), "lock 0, locks below 1"),
    "pin count wrong": (set_("leaf", "pin_ref", 1), "pin_ref 0, pins below 1"),
    "page stored twice": (lambda t, n: setattr(n["b"], "pages", n["leaf"].pages), "stored twice"),
    "cached pages miscounted": (lambda t, n: setattr(t, "cached_pages", t.cached_pages + 1), "counters"),
    "protected pages miscounted": (lambda t, n: setattr(t, "protected_pages", t.protected_pages - 1), "counters"),
    "pinned pages miscounted": (lambda t, n: setattr(t, "pinned_pages", 0), "counters"),
    "partial pages miscounted": (lambda t, n: setattr(t, "partial_pages", 0), "counters"),
    "a locked node listed as evictable": (set_("locked", "ev_key", RECENT), "listed as evictable but is not"),
    "a leaf listed at a stale place": (set_("leaf", "ev_key", 12345), "listed at a stale place"),
    "a leaf keyed for the sorted list but not in it": (
        lambda t, n: setattr(n["leaf"], "ev_key", order_key(n["leaf"])),
        "listed at a stale place",
    ),
    "an evictable leaf not listed": (lambda t, n: t._lru.remove(n["leaf"]), "evictable node .* is not listed"),
    "a pin expiry not listed": (lambda t, n: t._expiry.clear(), "pin expiry list out of sync"),
    "an expiry of no pin listed": (lambda t, n: t._expiry.add((5.0, 999)), "pin expiry list out of sync"),
}


@pytest.mark.parametrize("case", TREE_CORRUPTIONS)
def test_the_tree_check_names_each_broken_invariant(case: str) -> None:
    corrupt_tree(*TREE_CORRUPTIONS[case])


def test_the_tree_check_names_an_unreachable_listed_leaf() -> None:
    cache, nodes = healthy()
    stray = Node(encode([50, 51]), [31], nodes["root"], 999, 1)
    cache.tree._lru.add(stray)
    with pytest.raises(AssertionError, match="hold unreachable nodes"):
        check_tree(cache.tree)


def test_the_lru_check_names_each_broken_order() -> None:
    cache, nodes = healthy()
    lru = cache.tree._lru
    assert len(lru.recent) >= 2
    first = next(iter(lru.recent))
    lru.recent.move_to_end(first)  # the oldest listed as the newest
    with pytest.raises(AssertionError, match="recent evictable leaves are out of order"):
        lru.check()
    lru.recent.move_to_end(first, last=False)
    lru.check()
    lru.ordered.add(12345)  # a key with no node
    with pytest.raises(AssertionError, match="sorted evictable leaves disagree"):
        lru.check()


def test_the_allocator_check_names_each_broken_count() -> None:
    alloc = PageAllocator(4)
    alloc.alloc(2)
    alloc.check()
    alloc._free.append(alloc._free[0])
    with pytest.raises(AssertionError, match="on the free list twice"):
        alloc.check()
    alloc._free.pop()
    alloc._refcounts[alloc._free[0]] = 1
    with pytest.raises(AssertionError, match=r"on the free list with refcount 1"):
        alloc.check()
    alloc._refcounts[alloc._free[0]] = 0
    alloc.check()
    alloc._refcounts[0] = -1  # page 0 is held (off the free list): a decref too many
    with pytest.raises(AssertionError, match="negative refcount"):
        alloc.check()


def corrupt_cache(what: Callable[[PrefixCache, dict[str, Node]], None], message: str) -> None:
    cache, nodes = healthy()
    what(cache, nodes)
    with pytest.raises(AssertionError, match=message):
        cache.check()


def evicted() -> Node:
    node = Node(encode([60, 61]), [30], None, 998, 0)
    node.evicted = True
    return node


def reader(cache: PrefixCache) -> Lease:
    """The one live lease of `healthy`."""
    (lease,) = cache.leases()
    return lease


CACHE_CORRUPTIONS = {
    "a lease without owner": (lambda c, n: setattr(reader(c), "owner", ""), "a live lease has no owner"),
    "a released lease still registered": (lambda c, n: setattr(reader(c), "released", True), "is released but still"),
    "a lease reading an unlocked node": (
        lambda c, n: (setattr(n["leaf"], "lock", 0), reader(c).pages.append(n["leaf"].pages[0])),
        "lease of 'reader' reads page .* in unlocked node",
    ),
    "a lease locking an evicted node": (
        lambda c, n: setattr(reader(c), "_node", evicted()),
        "lease of 'reader' locks evicted node",
    ),
    "a lease locking another namespace": (
        lambda c, n: setattr(reader(c), "namespace", "b"),
        "lease of 'reader' \\(namespace 'b'\\) locks a node of another namespace",
    ),
    "a lock no lease holds": (lambda c, n: setattr(reader(c), "_node", None), "1 locks recorded, 0 leases hold one"),
    "a lock recorded twice": (
        lambda c, n: (setattr(n["locked"], "own_locks", 2), c.tree._adjust(n["locked"], 1, 0)),
        "2 locks recorded, 1 leases hold one",
    ),
    "a private page leaked": (
        lambda c, n: c.allocator.alloc(1),  # a page taken from the free list that nobody holds
        r"refcount 1 but 0 holders \(not the tree; leases: \[\]\); leaked page",
    ),
    "a leaked page": (
        lambda c, n: c.allocator.incref([n["leaf"].pages[0]]),
        r"refcount 2 but 1 holders \(the tree; leases: \[\]\); leaked page",
    ),
    "a lost reference": (
        lambda c, n: c.allocator._refcounts.__setitem__(n["locked"].pages[0], 1),
        r"refcount 1 but 2 holders \(the tree; leases: \['reader'\]\); a holder lost its reference",
    ),
}


@pytest.mark.parametrize("case", CACHE_CORRUPTIONS)
def test_the_cache_check_names_each_broken_invariant(case: str) -> None:
    corrupt_cache(*CACHE_CORRUPTIONS[case])


def test_stale_sorted_keys_up_to_the_bound_are_healthy() -> None:
    cache, nodes = healthy()
    trunk = nodes["trunk"]
    stale = [encode([90 + i, 0]) for i in range(2 * len(trunk.children) + 8 - len(trunk.sorted_keys))]
    trunk.sorted_keys = sorted(trunk.sorted_keys + stale)  # exactly 2 x children + 8: evicted children's keys
    cache.check()
