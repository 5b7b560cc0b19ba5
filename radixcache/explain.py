"""explain: what an admission of a prompt would be served from the cache, page by page, and why it would stop there.

The admin view behind `radixcache explain` (the worker's ExplainPrefix RPC). It reads the tree the way `match_length`
does: no LRU touch, no lease, no page allocated, no demoted page brought back (so a demoted page shows as
"demoted": an admission brings it back where there is room). Like admission it looks at every prompt token but the
last (which is always computed). The reason and the match's end are radixcache.miss_reasons', for the same
lookup. One namespace only: the caller passes its own tenant's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixcache.keys import encode
from radixcache.miss_reasons import WINDOW_PREFIX_RULE, diagnose, match_stop

if TYPE_CHECKING:
    from radixcache.lease_windows import LeaseWindows
    from radixcache.tree import RadixTree

# A page's state in an explanation.
PAGE_HIT = "hit"  # every prompt token of the page is served from a cached page
PAGE_DEMOTED = "demoted"  # served from a demoted copy (brought back at admission where there is room)
PAGE_PARTIAL = "partial"  # its first `served` tokens are served (copied from a cached page); the rest computed
PAGE_CUT = "cut"  # the tree holds (some of) it, but the prefix rule of a sliding-window layer keeps it from a hit
PAGE_MISS = "miss"  # nothing of it is cached
PAGE_STATES = (PAGE_HIT, PAGE_DEMOTED, PAGE_PARTIAL, PAGE_CUT, PAGE_MISS)


@dataclass(frozen=True, slots=True)
class ExplainedPage:
    """Page `index` of the prompt: its `tokens` prompt tokens (page_size, fewer for the last), `served` of them from
    the cache, in `state` (PAGE_STATES)."""

    index: int
    tokens: int
    served: int
    state: str


@dataclass(frozen=True)
class Explanation:
    """A prompt of `prompt_tokens` walked through the cache: a lookup of `cacheable` tokens (all but the last) would be
    served `cached_tokens`; `reason` and `match_end` as radixcache.miss_reasons names them. `pages`: every page up to
    and including the first one not wholly served (the pages after it are not looked at: nothing after is served)."""

    prompt_tokens: int
    page_size: int
    cacheable: int
    cached_tokens: int
    reason: str
    match_end: str
    pages: list[ExplainedPage] = field(default_factory=list)


def explain_prompt(
    tree: RadixTree, windows: LeaseWindows, tokens: Sequence[int], namespace: str, num_pages: int, *, below: str
) -> Explanation:
    """The Explanation of `tokens` in `namespace` (see the module docstring). `num_pages`: page ids from there on are
    demoted copies; `below`: the medium of the first tier below memory ("" for none)."""
    ps = tree.page_size
    limit = max(0, len(tokens) - 1)
    key = encode(tokens[:limit])
    m = tree.match(key, namespace, touch=False)
    served = windows.servable(m)
    stop = match_stop(tree, m, key, namespace, limit)
    miss = diagnose(stop, limit, ps, served=served, cut=WINDOW_PREFIX_RULE, below=below)
    read = m.read_pages()
    pages = []
    for i in range(-(-limit // ps)):
        size = min(ps, limit - i * ps)
        held = ps if i < len(m.pages) else m.partial_tokens if i == len(m.pages) else 0
        got = max(0, min(size, served - i * ps))
        if got == size:
            state = PAGE_DEMOTED if read[i] >= num_pages else PAGE_HIT
        else:
            state = PAGE_PARTIAL if got else PAGE_CUT if held else PAGE_MISS
        pages.append(ExplainedPage(i, size, got, state))
        if got < size:
            break
    return Explanation(len(tokens), ps, limit, served, miss.reason, miss.match_end, pages)


def off_explanation(tokens: Sequence[int], page_size: int, reason: str) -> Explanation:
    """The explanation of a cache that looks nothing up (--no-cache): nothing served, for `reason`."""
    limit = max(0, len(tokens) - 1)
    pages = [ExplainedPage(0, min(page_size, limit), 0, PAGE_MISS)] if limit else []
    return Explanation(len(tokens), page_size, limit, 0, reason, "", pages)
