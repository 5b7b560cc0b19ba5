"""The radix tree's structural integrity check, kept apart from the operations it verifies.

`check_tree` recomputes from scratch everything the tree maintains incrementally (subtree lock and pin counts, page
counters, the evictable LRU listing, pin expiries, sorted child keys, partial-child counts) and compares.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from radixcache.keys import TOKEN_BYTES

if TYPE_CHECKING:
    from radixcache.tree import RadixTree


def check_tree(tree: RadixTree) -> None:
    """Assert the tree's structural invariants: parent/child links, edge lengths, subtree lock and pin counts, the
    evictable list (exactly the unprotected leaves, keyed by current access), page counters, no page held twice, no
    evicted node reachable; partial tails only as the last page of an unpinned leaf; sibling keys prefix-free.
    Raises AssertionError naming the node and the broken invariant."""
    bpp, seen = tree.bpp, set()
    cached = protected = pinned = leaves = partial = demoted = protected_demoted = retained = 0
    stamped = 0
    by_namespace: dict[str, list[int]] = {}  # namespace -> [cached, pinned]
    for namespace, root in tree._roots.items():
        assert root.parent is None and not root.pages and not root.key, f"root of {namespace!r} is malformed"
        counts = by_namespace.setdefault(namespace, [0, 0])
        stack = [root]
        while stack:
            node = stack.pop()
            assert not node.evicted, f"evicted node {node.id} is reachable in namespace {namespace!r}"
            assert node.namespace == namespace, f"node {node.id} says namespace {node.namespace!r}, is in {namespace!r}"
            counts[0] += len(node.pages)
            counts[1] += len(node.pages) if node.pin_until is not None else 0
            assert node is root or (
                node.pages and (len(node.pages) - 1) * bpp < len(node.key) <= len(node.pages) * bpp
            ), f"bad edge {node.id}"
            tail = len(node.key) % bpp // TOKEN_BYTES
            assert node.tail == tail and len(node.key) % TOKEN_BYTES == 0, f"node {node.id}: tail {node.tail}"
            assert not tail or not node.children, f"node {node.id} has a partial tail and children"
            assert not tail or node.pin_until is None, f"node {node.id}: a partial tail is pinned"
            partial += tail > 0
            firsts = sorted(node.children)
            assert not any(b.startswith(a) for a, b in itertools.pairwise(firsts)), f"node {node.id}: keys nest"
            short = sum(len(first) < bpp for first in firsts)
            assert node.partial_children == short, f"node {node.id}: {node.partial_children} partial children"
            locks, pins = node.own_locks, int(node.pin_until is not None)
            full = sum(not child.demoted for child in node.children.values())
            assert node.full_children == full, f"node {node.id}: {node.full_children} full-precision children, {full}"
            for first, child in node.children.items():
                assert child.parent is node and child.key[:bpp] == first is child.first, f"bad link {child.id}"
                locks += child.lock
                pins += child.pin_ref
                stack.append(child)
            sk = node.sorted_keys
            if bpp > TOKEN_BYTES and node.children:
                assert sk is not None and all(a < b for a, b in itertools.pairwise(sk)), f"node {node.id} keys"
                assert set(node.children) <= set(sk), f"sorted keys of node {node.id} miss a child"
                assert len(sk) <= 2 * len(node.children) + 8, f"node {node.id}: too many stale sorted keys"
            else:
                assert sk is None, f"node {node.id} has sorted keys but no children"
            assert node.lock == locks, f"node {node.id}: lock {node.lock}, locks below {locks}"
            assert node.pin_ref == pins, f"node {node.id}: pin_ref {node.pin_ref}, pins below {pins}"
            for page in node.pages:
                assert page not in seen, f"page {page} is stored twice in the tree"
                seen.add(page)
            cached += len(node.pages)
            protected += len(node.pages) if node.lock or node.pin_ref else 0
            if node.demoted:
                demoted += len(node.pages)
                protected_demoted += len(node.pages) if node.lock or node.pin_ref else 0
            pinned += len(node.pages) if node.pin_until is not None else 0
            if tree._stamped.get(node.id) is node:
                stamped += 1
                retained += len(node.pages)
            # Listed: unprotected, and a leaf (demoted), or without full-precision children (not demoted).
            below = node.children if node.demoted else full
            evictable = node is not root and not below and not node.lock and not node.pin_ref
            leaves += evictable
            if node.ev_key is not None:
                assert evictable, f"node {node.id} is listed as evictable but is not"
                lru = tree._dlru if node.demoted else tree._lru  # each class of leaves has its own LRU
                assert lru.listed(node), f"node {node.id} is listed at a stale place (or in the wrong LRU)"
            else:
                assert not evictable, f"evictable node {node.id} is not listed"
    tree._lru.check()
    tree._dlru.check()
    assert leaves == len(tree._lru) + len(tree._dlru), "the evictable lists hold unreachable nodes"
    counters = (tree.cached_pages, tree.protected_pages, tree.pinned_pages, tree.partial_pages)
    assert (cached, protected, pinned, partial) == counters, (
        f"counters (cached, protected, pinned, partial) {counters} != recomputed {(cached, protected, pinned, partial)}"
    )
    for i, (name, table) in enumerate((("cached", tree.namespace_cached), ("pinned", tree.namespace_pinned))):
        recount = {ns: c[i] for ns, c in by_namespace.items() if c[i]}
        assert table == recount, f"pages {name} per namespace {table} != recomputed {recount}"
    assert (tree.demoted_pages, tree.protected_demoted_pages) == (demoted, protected_demoted), (
        f"demoted page counters {(tree.demoted_pages, tree.protected_demoted_pages)} != {(demoted, protected_demoted)}"
    )
    assert stamped == len(tree._stamped), "a retention stamp names a node that is not in the tree"
    assert retained == tree.retained_pages, f"retained pages {tree.retained_pages} != recomputed {retained}"
    stamps = sorted((n.kept_until, n.id) for n in tree._stamped.values())
    assert list(tree._stamps) == stamps, "retention stamps out of sync"
    finite = sorted((n.pin_until, n.id) for n in tree._pinned.values() if n.pin_until != math.inf)
    assert list(tree._expiry) == finite, "pin expiry list out of sync"
