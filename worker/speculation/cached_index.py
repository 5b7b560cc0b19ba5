"""CachedTokenIndex: where a sequence's last tokens occur in what the radix tree holds, inside one namespace.

The tree is keyed by whole prefixes from the root, so "what followed these k tokens anywhere in the cache" needs an
index of its own. This one is an observer of the tree (RadixTree.add_observer; the event sink slot stays the
cache-event hub's): it sees every page the tree starts or stops storing (a partial tail too), by page id, with its
tokens and the page it continues, and keeps

- per page: its namespace, its tokens (fewer than page_size for a tail), the page before it and the pages after it
  (the tree branches only between pages), and the n-gram keys it registered;
- per namespace: hash of MIN_MATCH tokens -> the newest MAX_OCCURRENCES positions (page, slot) where they end.

Exactly the tree's pages, partial tails included (the last, unfinished page of a finished request: often most of a
short answer), and nothing else: the tree tells its observers when any page leaves, a tail too, so a flushed or
evicted token is never drafted, nor a page id reused by another namespace read as this one's. A page leaves the
index when the tree drops it, or, past `max_tokens` indexed tokens, when it is the oldest stored (the tree keeps
it; it just stops being drafted from). Costs: per stored page, page_size dict updates; per lookup,
one dict get and a few token comparisons. Engine thread only (the tree's thread).
"""

from __future__ import annotations

from collections.abc import Sequence

from radixcache.keys import decode
from radixcache.worker.speculation.vote import MAX_MATCH, MAX_OCCURRENCES, MIN_MATCH, Candidate

# Tokens indexed at most by default: ~250 bytes each (measured, BENCHMARKS.md "Speculative decoding"), so ~64 MB.
DEFAULT_INDEX_TOKENS = 1 << 18


class _Page:
    __slots__ = ("children", "keys", "namespace", "parent", "stamp", "tokens")

    def __init__(self, namespace: str, tokens: tuple[int, ...], parent: int | None, stamp: int) -> None:
        self.namespace = namespace
        self.tokens = tokens  # tuples here and in the occurrence table: the cyclic GC stops tracking them
        self.parent = parent  # the page before this one, if indexed
        self.children: list[int] = []  # indexed pages continuing this one, oldest first
        self.keys: tuple[int, ...] = ()  # n-gram keys ending at this page's last len(keys) tokens
        self.stamp = stamp


class CachedTokenIndex:
    """An EventSink (radixcache.events) over one tree's page records; see the module docstring."""

    def __init__(self, page_size: int, *, max_tokens: int = DEFAULT_INDEX_TOKENS) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.max_pages = max(1, max_tokens // page_size)
        self._pages: dict[int, _Page] = {}  # in store order, oldest first
        self._grams: dict[str, dict[int, tuple[int, ...]]] = {}
        self._stamp = 0

    @property
    def indexed_tokens(self) -> int:
        """Token slots of the pages indexed (a tail counts as a whole page): what max_tokens bounds."""
        return len(self._pages) * self.page_size

    def indexed_pages(self) -> dict[int, tuple[str, list[int]]]:
        """page id -> (namespace, tokens) of every page indexed (what a test compares with the tree's pages)."""
        return {page: (e.namespace, list(e.tokens)) for page, e in self._pages.items()}

    # --- EventSink ----------------------------------------------------------------------------------------------
    def stored(self, namespace: str, after: int | None, pages: list[int], key: bytes) -> None:
        ps = self.page_size
        history = self._tokens_before(after, MIN_MATCH - 1)
        tokens = history + decode(key)  # a key ending mid-page: its last page is a tail of fewer tokens
        grams = self._grams.setdefault(namespace, {})
        parent = after if after in self._pages else None
        n = MIN_MATCH
        for i, page in enumerate(pages):
            if page in self._pages:  # never stored twice without a removal; stay exact if it happens
                self._drop(page)
            self._stamp += 1
            start = len(history) + i * ps
            entry = _Page(namespace, tuple(tokens[start : start + ps]), parent, self._stamp)
            keys = []
            for end in range(max(start, n - 1), start + len(entry.tokens)):
                gram = hash(tuple(tokens[end - n + 1 : end + 1]))
                keys.append(gram)
                where = grams.get(gram)
                position = page * ps + end - start
                grams[gram] = (position,) if where is None else (*where, position)[-MAX_OCCURRENCES:]
            entry.keys = tuple(keys)
            if parent is not None:
                self._pages[parent].children.append(page)
            self._pages[page] = entry
            parent = page
        while len(self._pages) > self.max_pages:
            self._drop(next(iter(self._pages)))

    def removed(self, pages: list[int]) -> None:
        for page in pages:
            if page in self._pages:
                self._drop(page)

    def cleared(self, namespace: str) -> None:
        for page in [p for p, e in self._pages.items() if e.namespace == namespace]:  # none, if events are exact
            self._drop(page)
        self._grams.pop(namespace, None)

    def relocated(self, old: list[int], new: list[int]) -> None:
        """The tree moved these pages' tokens to other page ids (a --kv-demote demotion or its undoing): the same
        entries under the new ids, their n-gram positions and links renamed (parents are renamed before children,
        as the tree lists them)."""
        ps = self.page_size
        for was, now in zip(old, new, strict=True):
            entry = self._pages.pop(was, None)
            if entry is None:
                continue
            grams = self._grams.get(entry.namespace, {})
            first = len(entry.tokens) - len(entry.keys)
            for j, gram in enumerate(entry.keys, start=first):
                where = grams.get(gram)
                if where is not None and was * ps + j in where:
                    grams[gram] = tuple(now * ps + j if p == was * ps + j else p for p in where)
            if entry.parent is not None:
                siblings = self._pages[entry.parent].children
                siblings[siblings.index(was)] = now
            for child in entry.children:
                self._pages[child].parent = now
            self._pages[now] = entry  # (now the newest stored: it leaves last when max_tokens is reached)

    def _drop(self, page: int) -> None:
        entry = self._pages.pop(page)
        grams = self._grams.get(entry.namespace, {})
        ps = self.page_size
        first = len(entry.tokens) - len(entry.keys)
        for j, gram in enumerate(entry.keys, start=first):
            where = grams.get(gram)
            if where is not None and page * ps + j in where:
                rest = tuple(p for p in where if p != page * ps + j)
                if rest:
                    grams[gram] = rest
                else:
                    del grams[gram]
        if entry.parent is not None:
            self._pages[entry.parent].children.remove(page)
        for child in entry.children:
            self._pages[child].parent = None

    def _tokens_before(self, page: int | None, n: int) -> list[int]:
        """The last n tokens up to and including `page` (fewer near the root or where the index has no page)."""
        out: list[int] = []
        while page is not None and len(out) < n:
            entry = self._pages.get(page)
            if entry is None:
                break
            out[:0] = entry.tokens
            page = entry.parent
        return out[-n:] if n else []

    # --- lookups ------------------------------------------------------------------------------------------------
    def candidates(self, namespace: str, tokens: Sequence[int], key: int, limit: int) -> list[Candidate]:
        """Occurrences, in `namespace` only, of the last MIN_MATCH tokens of `tokens` (`key` is their hash), each
        with up to `limit` tokens that followed it (through the newest page continuing it)."""
        grams = self._grams.get(namespace)
        where = grams.get(key) if grams else None
        if not where:
            return []
        ps, out = self.page_size, []
        for pos in reversed(where):
            page, slot = divmod(pos, ps)
            entry = self._pages[page]
            match = self._match_back(entry, slot, tokens)
            if match < MIN_MATCH:  # a hash collision
                continue
            following = self._follow(entry, slot + 1, limit)
            if following:
                out.append(Candidate(match, False, entry.stamp, following))
        return out

    def _match_back(self, entry: _Page, slot: int, tokens: Sequence[int]) -> int:
        """How many of the last tokens of `tokens` equal the tokens ending at (entry, slot), up to MAX_MATCH."""
        match, last = 0, len(tokens) - 1
        page_tokens = entry.tokens
        while match < MAX_MATCH and match <= last:
            if slot < 0:
                if entry.parent is None:
                    break
                entry = self._pages[entry.parent]
                page_tokens, slot = entry.tokens, len(entry.tokens) - 1
            if page_tokens[slot] != tokens[last - match]:
                break
            match += 1
            slot -= 1
        return match

    def _follow(self, entry: _Page, slot: int, limit: int) -> list[int]:
        out: list[int] = []
        while len(out) < limit:
            if slot >= len(entry.tokens):
                if not entry.children:
                    break
                entry, slot = self._pages[entry.children[-1]], 0
            take = entry.tokens[slot : slot + limit - len(out)]
            out += take
            slot += len(take)
        return out
