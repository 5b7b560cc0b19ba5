"""The radix tree's node and the results of its operations (`Match`, `InsertResult` and its `Duplicate`s, `PathPins`,
`PinRecord`).

A node holds a compressed edge: a run of pages (`key`, `pages`) with no branching inside. Every page is whole except
possibly the last page of a leaf, a partial tail (`tail` valid tokens). The fields are the tree's to change; callers
hold nodes only as handles (for `RadixTree.lock`/`unlock`/`cut`).
"""

from __future__ import annotations

from dataclasses import dataclass


class Node:
    __slots__ = (
        "key", "first", "pages", "parent", "children", "sorted_keys", "access", "lock", "own_locks",
        "pin_until", "pin_ref", "ev_key", "id", "evicted", "tail", "partial_children", "namespace",
        "demoted", "full_children", "keep_priority", "kept_until",
    )  # fmt: skip

    def __init__(self, key: bytes, pages: list[int], parent: Node | None, node_id: int, access: int) -> None:
        self.key = key  # the edge's tokens, encoded: whole pages, except a leaf's last page may hold `tail` tokens
        self.first = key  # the very object keying this node in parent.children (its hash is cached)
        self.pages = pages  # page ids, one per page of `key`; replaced, never mutated in place
        self.parent = parent
        self.children: dict[bytes, Node] = {}  # first page bytes -> child
        # Sorted children keys, page_size > 1 only (partial hits). Eviction leaves stale entries behind (cheaper than
        # a bisect per evicted node); lookups skip and drop them, and the list is rebuilt when half of it is stale.
        self.sorted_keys: list[bytes] | None = None
        self.access = access
        self.lock = 0  # leases locking this node or a descendant
        self.own_locks = 0  # leases whose deepest node is this one
        self.pin_until: float | None = None  # None: not pinned; math.inf: pinned without TTL
        self.pin_ref = 0  # pinned nodes in this subtree, itself included
        self.ev_key: int | None = None  # where radixcache.lru lists it: None (not evictable), RECENT or a key
        self.id = node_id
        self.evicted = False
        self.tail = 0  # valid tokens in the last page when it is a partial tail (then a leaf), else 0
        self.partial_children = 0  # children whose only page is a partial tail (their `first` is shorter than a page)
        self.namespace: str = parent.namespace if parent is not None else ""  # its root's (the tree sets roots' own)
        self.demoted = False  # its pages are demoted copies (cache --kv-demote): listed in the demoted LRU
        self.full_children = 0  # children that are not demoted (all of them, without demotion)
        self.keep_priority = 0  # soft retention (radixcache.retention): this priority while the clock < kept_until
        self.kept_until = 0.0


class Match:
    """Result of `RadixTree.match`: `pages` whole cached pages in token order; `node` the deepest node they reach
    (None when nothing matched), of which the first `node_pages` pages are on the path (fewer than all when the match
    ends inside an edge); optionally a partial page: `partial_page` holds the next `partial_tokens` tokens
    (1..page_size-1) in its first slots and lives in `partial_node` (`node` itself, or a child of it where
    it is the first page). A partial tail the key runs through is reported that way, never as a whole page."""

    __slots__ = ("pages", "node", "node_pages", "partial_node", "partial_page", "partial_tokens", "page_size")

    def __init__(self, pages: list[int], node: Node | None, used: int, pnode: Node | None, ppage: int, k: int, ps: int):
        self.pages, self.node, self.node_pages, self.partial_node = pages, node, used, pnode
        self.partial_page, self.partial_tokens, self.page_size = ppage, k, ps

    @property
    def tokens(self) -> int:
        return len(self.pages) * self.page_size + self.partial_tokens

    def read_pages(self) -> list[int]:
        """The pages a hit reads, in token order: the whole ones, then the partial one (if any)."""
        return self.pages + [self.partial_page] if self.partial_tokens else self.pages


@dataclass(frozen=True, slots=True)
class Duplicate:
    """An insert's page `pages[index]` sits where the tree already holds `tree_page`: the same tokens, another page."""

    index: int
    tree_page: int


class InsertResult:
    """Result of `RadixTree.insert`: `node` holds the last inserted page (None for an empty insert); `new_pages`
    are the caller's pages the tree now stores (the caller adds the tree's reference); `existing` counts leading
    pages already cached; `duplicates` lists the caller's pages that sit where the tree already holds another page
    (the tree's page wins; the caller may free its copy); `replaced` lists tree pages that held a partial tail the
    insert covered with a whole page or a longer tail (the tree no longer stores them: the caller drops the tree's
    reference)."""

    __slots__ = ("node", "new_pages", "existing", "replaced", "_given", "_segments")

    def __init__(
        self, node: Node | None, new_pages: list[int], given: list[int], segments: list, replaced: list[int]
    ) -> None:
        self.node, self.new_pages, self._given, self._segments = node, new_pages, given, segments
        self.existing = len(given) - len(new_pages)
        self.replaced = replaced

    @property
    def duplicates(self) -> list[int]:
        return [self._given[d.index] for d in self.cached_instead()]

    def cached_instead(self) -> list[Duplicate]:
        """Each caller's page that sits where the tree already holds a different page with the same tokens.
        Computed on demand: it is O(existing pages)."""
        given = self._given
        return [
            Duplicate(start + j, q)
            for start, cached in self._segments
            for j, (p, q) in enumerate(zip(given[start : start + len(cached)], cached, strict=True))
            if p != q
        ]


@dataclass(frozen=True, slots=True)
class PathPins:
    """Pages of a key's cached whole-page prefix that are pinned, and those that are not (what a pin would add)."""

    pinned: int
    unpinned: int


@dataclass(frozen=True, slots=True)
class PinRecord:
    """One pinned node: its namespace, the key from the root through it, and `until` on the tree's clock
    (math.inf: no TTL). Pinning each key again until then rebuilds the pins."""

    namespace: str
    key: bytes
    until: float
