"""The caches' integrity check, kept apart from the operations it verifies (as radixcache.tree_check is the tree's).

Invariants checked: every page is free or held and its refcount is its holders (the tree node that stores it, plus one
per lease that reads it, plus one for a lease's pending copy source); every lease has an owner, is live, reads only
pages under its lock (in its own namespace, or its salted one), and never a demoted page; each node's recorded locks are the leases that
lock it; the window parts and the tiers hold their own invariants; with `idle` (no request running) a live lease is a
leak. Every failure is an AssertionError naming the broken invariant and the owner of any lease involved.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from radixcache.tree_check import check_tree

if TYPE_CHECKING:
    from radixcache.eviction import Eviction
    from radixcache.lease import Lease
    from radixcache.lease_windows import LeaseWindows
    from radixcache.node import Node
    from radixcache.pages import PageAllocator
    from radixcache.tier import CacheTier
    from radixcache.tree import RadixTree


def check_prefix_cache(
    tree: RadixTree,
    room: Eviction,
    windows: LeaseWindows,
    tier: CacheTier | None,
    leases: Collection[Lease],
    *,
    idle: bool,
) -> None:
    """A PrefixCache's invariants: its pages (the pool's and any demoted copies, `room`'s), tree, leases, window
    parts and tiers."""
    num_pages = room.allocator.num_pages
    room.allocator.check()
    room.check()
    check_tree(tree)
    expected = [0] * room.total_pages
    in_tree: dict[int, Node] = {}
    for stored in tree.nodes():
        for page in stored.pages:
            expected[page] += 1
            in_tree[page] = stored
            assert (page >= num_pages) == stored.demoted, (
                f"node {stored.id} ({'' if stored.demoted else 'not '}demoted) stores page {page}"
            )
    locks: dict[int, int] = {}
    readers: dict[int, list[str]] = {}
    for lease in leases:
        who = _check_registered(lease)
        held = lease.pages + ([lease._src] if lease._src is not None else [])
        assert not held or max(held) < num_pages, f"{who} holds a demoted page"
        for page in held:
            expected[page] += 1
            readers.setdefault(page, []).append(lease.owner)
            node = in_tree.get(page)
            assert node is None or node.lock > 0, f"{who} reads page {page} in unlocked node {node.id}"
        names = (lease.namespace,) if lease._salted_ns is None else (lease.namespace, lease._salted_ns)
        own = [tree._roots.get(ns) for ns in names]  # a salted lease locks in its namespace and its salted one
        for node in (lease._node, lease._shared_node):
            if node is None:
                continue
            assert not node.evicted, f"{who} locks evicted node {node.id}"
            locks[node.id] = locks.get(node.id, 0) + 1
            while node.parent is not None:
                node = node.parent
            assert any(node is root for root in own), (
                f"{who} (namespace {lease.namespace!r}) locks a node of another namespace"
            )
    for node in tree.nodes():
        assert node.own_locks == locks.get(node.id, 0), f"node {node.id}: {node.own_locks} locks recorded, " + (
            f"{locks.get(node.id, 0)} leases hold one"
        )
    _check_refcounts(expected, room.allocator_of, in_tree, readers)
    windows.check(leases, set(in_tree))
    _check_idle(leases, idle)
    if tier is not None:
        tier.check()


def check_cache_off(allocator: PageAllocator, windows: LeaseWindows, leases: Collection[Lease], *, idle: bool) -> None:
    """A CacheOff's invariants: its pages are held by its leases only, and their window parts."""
    allocator.check()
    expected = [0] * allocator.num_pages
    readers: dict[int, list[str]] = {}
    for lease in leases:
        _check_registered(lease)
        for page in lease.pages:
            expected[page] += 1
            readers.setdefault(page, []).append(lease.owner)
    _check_refcounts(expected, lambda page: allocator, {}, readers)
    windows.check(leases, set())
    _check_idle(leases, idle)


def _check_registered(lease: Lease) -> str:
    """A live lease's own invariants; returns how to name it."""
    assert lease.owner, "a live lease has no owner"
    who = f"lease of {lease.owner!r}"
    assert not lease.released, f"{who} is released but still registered"
    return who


def _check_refcounts(
    expected: list[int],
    allocator_of: Callable[[int], PageAllocator],
    in_tree: Collection[int],
    readers: dict[int, list[str]],
) -> None:
    """Each page's refcount (in the allocator its id belongs to) is its holders' count."""
    for page, want in enumerate(expected):
        got = allocator_of(page).refcount(page)
        if got != want:
            tree = "the tree" if page in in_tree else "not the tree"
            raise AssertionError(
                f"page {page}: refcount {got} but {want} holders ({tree}; leases: {readers.get(page, [])}); "
                + ("leaked page" if got > want else "a holder lost its reference")
            )


def _check_idle(leases: Collection[Lease], idle: bool) -> None:
    if idle and leases:
        owners = sorted({lease.owner for lease in leases})
        raise AssertionError(f"{len(leases)} leases leaked while idle, owned by {owners}")
