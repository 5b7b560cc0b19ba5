"""The cache's stateful test (tests/test_cache_stateful.py) with a host tier below it: every rule of the plain cache
still agrees with the model, evicted pages spill, and a `load` rule brings pages back from the tier. check() runs
after every step (names, hashes, tier bounds); a loaded page must hold exactly the tokens of the place the tree puts
it (the fake pool's pages hold their own tokens, so a page loaded under the wrong key or into the wrong slot shows)."""

from __future__ import annotations

from hashlib import blake2b

import test_cache_stateful as base
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from radixcache.cache import PrefixCache
from radixcache.events import page_hashes
from radixcache.host_tier import HostTier
from radixcache.keys import TOKEN_BYTES, decode, encode
from radixcache.tier import PageKey, TierChain
from radixcache.tiering import TierLink


def identity(namespace: str, prefix: bytes) -> bytes:
    """What a page computed for `prefix` holds: its K/V depend on every token before it (16 bytes, fixed)."""
    return blake2b(namespace.encode() + b"\0" + prefix, digest_size=16).digest()


class TokenPool:
    """A pool whose page holds the identity of the prefix computed into it (what read_page / write_page move)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.content: dict[int, bytes] = {}
        self.written: set[int] = set()  # pages a load wrote since the last check

    def read_page(self, page: int) -> bytes:
        return self.content.get(page, bytes(16))  # never computed

    def write_page(self, page: int, data: bytes) -> None:
        self.content[page] = data
        self.written.add(page)


class TieredCacheMachine(base.CacheMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(2, 20), host_pages=st.integers(1, 6))
    def setup(self, page_size: int, num_pages: int, host_pages: int) -> None:  # type: ignore[override]
        super().setup(page_size, num_pages)
        self.pool = TokenPool(num_pages)
        self.host_pages = host_pages
        self.host = HostTier(host_pages * 16)
        self.link = TierLink(self.pool, page_size, tiers=TierChain([self.host]))
        self.cache = PrefixCache(num_pages, page_size, clock=self.clock, tier=self.link)
        self.loads = 0
        self.flushed: set[str | None] = set()  # namespaces flushed since the last sync (their pages are gone)
        flush = self.cache.flush

        def flushing(namespace: str | None = None) -> int:
            self.flushed.add(namespace)
            return flush(namespace)

        self.cache.flush = flushing  # type: ignore[method-assign]

    @rule(ns=base.NAMESPACES, tokens=base.TOKENS)
    def load(self, ns: str, tokens: list[int]) -> None:
        """What the scheduler does before admitting a request: load the pages its prompt continues onto. Tries the
        sequences seen before, newest first, then `tokens`, until one continues into the tier."""
        held = self.held_pages()
        self.loads += 1
        for candidate in [*reversed(self.seen), (ns, tokens)]:
            job = self.link.start_load(f"load{self.loads}", candidate[1], candidate[0], len(candidate[1]))
            if job is not None:
                ns, tokens = candidate
                break
        else:
            return
        assert self.link.wait(10), "the loader did not answer"
        self.link.finish_loads()
        assert job.finished and job.lease.released
        actual = {(kns, tuple(decode(key))): page for kns, key, page in self.cache.tree.items()}
        for key in actual.keys() - self.model.keys():  # new: whole pages of `tokens`, loaded
            kns, prefix = key
            assert kns == ns and len(prefix) % self.ps == 0 and list(prefix) == tokens[: len(prefix)], key
            assert actual[key] in self.pool.written, f"{key} appeared in the tree without being loaded"
        for key in self.model.keys() - actual.keys():  # gone: only tails the loaded pages covered, or evictions
            kns, prefix = key
            covered = kns == ns and len(prefix) % self.ps and list(prefix) == tokens[: len(prefix)]
            assert covered or (key not in self.pins and self.model[key] not in held), f"{key} vanished"
        self.model = actual

    @invariant()
    def pages_hold_their_own_tokens(self) -> None:
        if not hasattr(self, "pool"):
            return
        bpp = self.ps * TOKEN_BYTES
        for ns, key, page in self.cache.tree.items():
            if len(key) % bpp:
                continue  # a partial tail: its page is private to what computed it
            if page in self.pool.written:
                assert self.pool.content[page] == identity(ns, key), f"page {page} was loaded with another's K/V"
            else:
                self.pool.content[page] = identity(ns, key)  # computed by the abstract engine: it holds this now
        self.pool.written.clear()
        stats = self.cache.stats()
        assert stats.host_bytes <= stats.host_capacity_bytes

    def sync(self, held: set[int]) -> None:
        """After pages left the tree: evicted ones went to the host tier (the newest, up to its size, are there);
        flushed ones are gone from it too."""
        before = dict(self.model)
        super().sync(held)
        flushed, self.flushed = self.flushed, set()
        if None in flushed:
            assert not list(self.host.records()), "a flush of everything left pages in the host tier"
            return
        gone = [(ns, p) for ns, p in before.keys() - self.model.keys() if len(p) % self.ps == 0]
        for ns, prefix in gone if len(gone) <= self.host_pages else ():
            h = page_hashes(list(prefix), self.ps, ns)
            key = PageKey(ns, h[-1], h[-2] if len(h) > 1 else 0, encode(prefix[-self.ps :]))
            want = None if ns in flushed else identity(ns, encode(prefix))
            assert self.host.get(key) == want, f"{prefix} left the tree; the host tier holds {self.host.get(key)}"

    def teardown(self) -> None:
        super().teardown()
        self.link.close()


TieredCacheMachine.TestCase.settings = settings(stateful_step_count=40)
TestTieredCacheMachine = TieredCacheMachine.TestCase
