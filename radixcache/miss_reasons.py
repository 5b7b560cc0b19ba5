"""Why a lookup stopped where it did: one reason from a closed set of stable names, and how the tree's match ended.

Every lookup (PrefixCache.acquire, CacheOff.acquire) gets a CacheMiss on its lease; the engine tells it to the user
in each response's usage (`cache_miss_reason`, `cache_match_end`) and counts it in /metrics. `explain` (the admin
call behind `radixcache explain`) gives the same answer page by page, without touching the cache.

The reasons (REASONS), decided in this order from what the lookup already has (its match, O(1) more):
- hit_full: everything the lookup could serve was served (admission serves all but the prompt's last token).
- window_prefix_rule: the tree holds more, but a sliding-window layer's prefix rule (radixcache.window_parts
  `hit_limit`) cut the hit where a window part is gone.
- no_room: the tree holds more, but no page could be had to serve it (a demoted page not brought back, or the copy
  of a partial page).
- evicted / evicted_to_host / evicted_to_disk / evicted_to_store: the tree recently held the next page and evicted it
  (radixcache.recent_evictions, a bounded hint); with tiers below memory, the medium is where eviction handed it (a
  load would have brought it back had the tier kept it).
- shorter_than_page: what is left after the whole pages matched is under one page and no cached page begins with
  any of it: whole pages are cached as soon as computed, a shorter rest only as a finished request's partial tail.
- no_shared_prefix: nothing cached in the namespace continues the prompt past the hit (0 tokens or more).
- cache_off: the worker runs with --no-cache.

Not a reason, on purpose: "another namespace holds it". Telling a tenant that some other tenant has cached its
prompt is the cross-tenant side channel namespaces exist to close (the same leak as cache timing), and finding out
would cost a walk of every other namespace; it is neither looked up nor reported.

How the match ended (MATCH_ENDS), from the tree's own match before any cut: prompt_end (the lookup ran out of
tokens), diverged (the tree goes on with other tokens at `cached_tokens`: inside a page or at a page boundary),
path_end (the cached path ends there: at a page boundary, or a partial tail's last token). The cache off: none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from radixcache.keys import TOKEN_BYTES
from radixcache.tier import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_STORE

if TYPE_CHECKING:
    from radixcache.node import Match
    from radixcache.tree import RadixTree

HIT_FULL = "hit_full"
WINDOW_PREFIX_RULE = "window_prefix_rule"
NO_ROOM = "no_room"
EVICTED = "evicted"
EVICTED_TO_HOST = "evicted_to_host"
EVICTED_TO_DISK = "evicted_to_disk"
EVICTED_TO_STORE = "evicted_to_store"
SHORTER_THAN_PAGE = "shorter_than_page"
NO_SHARED_PREFIX = "no_shared_prefix"
CACHE_OFF = "cache_off"
REASONS = (
    HIT_FULL,
    WINDOW_PREFIX_RULE,
    NO_ROOM,
    EVICTED,
    EVICTED_TO_HOST,
    EVICTED_TO_DISK,
    EVICTED_TO_STORE,
    SHORTER_THAN_PAGE,
    NO_SHARED_PREFIX,
    CACHE_OFF,
)
# An evicted page's reason by the medium of the tier it was handed to ("" : none below memory).
EVICTED_TO = {"": EVICTED, MEDIUM_HOST: EVICTED_TO_HOST, MEDIUM_DISK: EVICTED_TO_DISK, MEDIUM_STORE: EVICTED_TO_STORE}

PROMPT_END = "prompt_end"
DIVERGED = "diverged"
PATH_END = "path_end"
MATCH_ENDS = (PROMPT_END, DIVERGED, PATH_END)


@dataclass(frozen=True, slots=True)
class CacheMiss:
    """Why a lookup served what it did: `reason` (REASONS) and how the tree's match ended (`match_end`, MATCH_ENDS;
    "" with the cache off)."""

    reason: str
    match_end: str


CACHE_OFF_MISS = CacheMiss(CACHE_OFF, "")
# Every CacheMiss a lookup can get, made once (a lookup allocates none).
_MISSES = {(reason, end): CacheMiss(reason, end) for reason in REASONS for end in MATCH_ENDS}


class MatchStop(NamedTuple):
    """Where a tree match of a lookup stopped, read right after the match (before a lease cuts the edges it locks):
    the tokens the tree holds of the lookup, how the match ended (MATCH_ENDS), its whole pages, and whether the page
    after them was recently evicted from there. (A tuple: one is made per lookup.)"""

    tokens: int
    end: str
    whole: int
    evicted: bool


def match_stop(tree: RadixTree, m: Match, key: bytes, namespace: str, limit: int) -> MatchStop:
    """The MatchStop of match `m` of `key` (the lookup's `limit` tokens, encoded). O(1): reads the nodes the match
    ends at, and one set membership."""
    ps, whole = tree.page_size, len(m.pages)
    evicted = False
    if limit - whole * ps >= ps and (m.node is None or m.node_pages == len(m.node.pages)):  # at a node's end
        bpp = ps * TOKEN_BYTES
        evicted = tree.evicted_after(m.node, namespace, key[whole * bpp : (whole + 1) * bpp])
    return MatchStop(m.tokens, match_end(tree, m, limit, namespace), whole, evicted)


def match_end(tree: RadixTree, m: Match, limit: int, namespace: str) -> str:
    """How the tree's match `m` of a lookup of `limit` tokens ended (MATCH_ENDS)."""
    if m.tokens >= limit:
        return PROMPT_END
    node = m.node
    if m.partial_tokens:
        p = m.partial_node
        return PATH_END if p is not None and p.tail and m.partial_tokens == p.tail else DIVERGED
    if node is not None and m.node_pages < len(node.pages):
        return DIVERGED  # inside an edge: the next page is cached with other tokens
    anchor = node if node is not None else tree.root(namespace)
    return DIVERGED if anchor is not None and anchor.children else PATH_END


def diagnose(stop: MatchStop, limit: int, page_size: int, *, served: int, cut: str | None, below: str) -> CacheMiss:
    """The CacheMiss of a lookup of `limit` tokens whose match stopped at `stop` and that served `served` tokens;
    `cut`: the reason (WINDOW_PREFIX_RULE, NO_ROOM) that took `served` below what the tree holds, if one did;
    `below`: the medium of the first tier below memory ("" for none)."""
    if served >= limit > 0:
        return _MISSES[HIT_FULL, stop.end]
    if cut is not None and served < stop.tokens:
        return _MISSES[cut, stop.end]
    if stop.evicted:
        return _MISSES[EVICTED_TO.get(below, EVICTED), stop.end]
    if limit - stop.whole * page_size < page_size and stop.tokens == stop.whole * page_size:
        return _MISSES[SHORTER_THAN_PAGE, stop.end]
    return _MISSES[NO_SHARED_PREFIX, stop.end]
