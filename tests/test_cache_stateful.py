"""Random sequences of cache operations against a plain reference model, with check() after every step.

The model is a dict (namespace, token prefix) -> page id, plus the pinned prefixes with their expiry. A prefix is
whole pages, or whole pages plus a partial tail (1..page_size-1 tokens) that a release stored; a later whole page or
longer tail over the same tokens replaces a tail, and a tail already covered by a cached page is not stored.
Deterministic operations (acquire, publish, extend, pin, unpin) must agree with it exactly. Where the cache has a
choice (which leaves to evict), the model only checks the rules: what vanished was a whole subtree's leaves, was
neither pinned nor read by a live lease, and the count is what was asked (capped by what was evictable).
"""

from helpers import FakeClock
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixcache.cache import CacheFullError, PrefixCache
from radixcache.keys import decode

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)
NAMESPACES = st.sampled_from(["", "t"])
PICK = st.integers(0, 1000)


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(2, 20))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.clock = FakeClock()
        self.cache = PrefixCache(num_pages, page_size, clock=self.clock)
        self.model: dict[tuple[str, tuple[int, ...]], int] = {}
        self.pins: dict[tuple[str, tuple[int, ...]], float] = {}
        self.live: list[tuple[object, list[int]]] = []  # (lease, the sequence's tokens)
        self.released: list[object] = []
        self.seen: list[tuple[str, list[int]]] = []
        self.count = 0

    # ---- model helpers -------------------------------------------------------------------------------------
    def path(self, ns: str, tokens: list[int]) -> list[tuple[str, tuple[int, ...]]]:
        """Model keys of the cached whole-page prefix of tokens."""
        out, i = [], 1
        while i * self.ps <= len(tokens) and (ns, tuple(tokens[: i * self.ps])) in self.model:
            out.append((ns, tuple(tokens[: i * self.ps])))
            i += 1
        return out

    def held_pages(self) -> set[int]:
        held = set()
        for lease, _ in self.live:
            held.update(lease.pages)
            if lease._src is not None:
                held.add(lease._src)
        return held

    def sync(self, held: set[int]) -> None:
        """Adopt the cache's contents after an eviction, checking that only allowed pages went away (`held`: the
        pages live leases held before the operation)."""
        actual = {(ns, tuple(decode(key))): page for ns, key, page in self.cache.tree.items()}
        assert actual.items() <= self.model.items(), "eviction changed or added pages"
        gone = self.model.keys() - actual.keys()
        for key in gone:
            assert key not in self.pins, f"pinned prefix {key} was evicted"
            assert self.model[key] not in held, f"page {self.model[key]} of a live lease was evicted"
        for ns, prefix in actual:  # still prefix-closed: leaves went first
            last = len(prefix) % self.ps or self.ps
            assert len(prefix) == last or (ns, prefix[:-last]) in actual
        self.model = actual

    def pick(self, i: int):
        return self.live[i % len(self.live)]

    def computed(self, lease, seq: list[int]) -> list[int]:
        return seq[: min(len(seq), len(lease.pages) * self.ps)]

    def drop_tails(self, ns: str, tokens: list[int], base: int, upto: int) -> None:
        """Forget the partial tails that tokens[base : base + t] for t < upto would have been (now replaced)."""
        for t in range(1, upto):
            self.model.pop((ns, tuple(tokens[: base + t])), None)

    def publish_model(self, lease, tokens: list[int]) -> int:
        added = 0
        for i in range(len(tokens) // self.ps):
            key = (lease.namespace, tuple(tokens[: (i + 1) * self.ps]))
            if key not in self.model:
                self.drop_tails(lease.namespace, tokens, i * self.ps, self.ps)
                self.model[key] = lease.pages[i]
                added += 1
        return added

    def release_model(self, lease, tokens: list[int]) -> None:
        """publish_model, then the trailing partial page as a tail unless a cached page already covers it."""
        self.publish_model(lease, tokens)
        ns, r = lease.namespace, len(tokens) % self.ps
        if not r:
            return
        base, tail = len(tokens) - r, tuple(tokens)
        covered = any(
            kns == ns and len(tail) <= len(prefix) <= base + self.ps and prefix[: len(tail)] == tail
            for kns, prefix in self.model
        )
        if not covered:
            self.drop_tails(ns, tokens, base, r)
            self.model[(ns, tail)] = lease.pages[base // self.ps]

    # ---- rules ---------------------------------------------------------------------------------------------
    @precondition(lambda self: self.seen)
    @rule(i=PICK, cut=st.integers(0, 10), extra=TOKENS)
    def acquire_known(self, i: int, cut: int, extra: list[int]) -> None:
        """A sequence seen before, cut anywhere and continued differently: hits, partial pages, in-flight sharing."""
        ns, tokens = self.seen[i % len(self.seen)]
        self.acquire(ns, tokens[:cut] + extra[: max(1, len(extra) // 3)])

    @rule(ns=NAMESPACES, tokens=TOKENS)
    def acquire(self, ns: str, tokens: list[int]) -> None:
        self.count += 1
        self.seen.append((ns, list(tokens)))
        cap = len(tokens) - 1
        path = self.path(ns, tokens[:cap])
        m = len(path) * self.ps
        rest, best, sources = tuple(tokens[m:cap][: self.ps]), 0, set()
        if self.ps > 1 and rest:
            for (kns, prefix), page in self.model.items():
                if kns == ns and m < len(prefix) <= m + self.ps and prefix[:m] == tuple(tokens[:m]):
                    common = next(
                        (j for j, (a, b) in enumerate(zip(prefix[m:], rest, strict=False)) if a != b),
                        min(len(rest), len(prefix) - m),
                    )
                    common = min(common, self.ps - 1)
                    if common > best:
                        best, sources = common, {page}
                    elif common == best and common:
                        sources.add(page)
        held = self.held_pages() | {self.model[key] for key in path}
        lease = self.cache.acquire(f"r{self.count}", tokens, ns, max_cached=cap)
        assert lease.pages[: len(path)] == [self.model[key] for key in path]
        if lease.copy_from is not None:
            src, dst, k = lease.copy_from.src, lease.copy_from.dst, lease.copy_from.tokens
            assert (k, dst, len(lease.pages)) == (best, lease.pages[-1], len(path) + 1) and src in sources
            assert lease.cached_tokens == m + best
        else:
            assert lease.cached_tokens == m and len(lease.pages) == len(path)
            # dropped only when no page was free or evictable but the copy source itself (evictable now)
            assert best == 0 or self.cache.available_pages() <= 1, "a partial hit was dropped needlessly"
        self.live.append((lease, list(tokens)))
        self.sync(held)

    @rule(ns=NAMESPACES, tokens=TOKENS, i=PICK, known=st.booleans())
    def serve(self, ns: str, tokens: list[int], i: int, known: bool) -> None:
        """A whole request in one step, as the engine runs it: acquire, allocate, publish everything, release."""
        if known and self.seen:
            ns, seen = self.seen[i % len(self.seen)]
            tokens = seen[: i % (len(seen) + 1)] + tokens[:2]
        self.acquire(ns, tokens)
        lease, seq = self.live[-1]
        self.allocate(len(self.live) - 1, -(-len(seq) // self.ps) - len(lease.pages))
        self.release(len(self.live) - 1, publish=True)

    @precondition(lambda self: self.live)
    @rule(i=PICK, n=st.integers(0, 4))
    def allocate(self, i: int, n: int) -> None:
        lease, _ = self.pick(i)
        available, held = self.cache.available_pages(), self.held_pages()
        before = (sorted(self.cache.tree.items()), list(lease.pages), self.cache.allocator.num_free)
        try:
            pages = self.cache.allocate(lease, n)
        except CacheFullError:
            assert n > available
            assert before == (sorted(self.cache.tree.items()), list(lease.pages), self.cache.allocator.num_free)
            return
        assert n <= available and len(pages) == n and lease.pages[-n:] == pages if n else pages == []
        self.sync(held)

    @precondition(lambda self: self.live)
    @rule(i=PICK, extra=TOKENS)
    def grow(self, i: int, extra: list[int]) -> None:
        self.pick(i)[1].extend(extra[:3])  # decoded tokens join the sequence

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def publish(self, i: int) -> None:
        lease, seq = self.pick(i)
        tokens = self.computed(lease, seq)
        expected = self.publish_model(lease, tokens)
        assert self.cache.publish(lease, tokens) == expected

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def extend(self, i: int) -> None:
        lease, seq = self.pick(i)
        held = len(lease.pages)
        path = self.path(lease.namespace, seq)
        gained = self.cache.extend(lease, seq)
        assert gained == max(0, len(path) - held) * self.ps
        assert lease.pages[held:] == [self.model[key] for key in path[held:]]

    @precondition(lambda self: self.live)
    @rule(i=PICK, publish=st.booleans(), short=st.integers(0, 2))
    def release(self, i: int, publish: bool, short: int = 0) -> None:
        """Release, publishing the computed tokens less `short` of them: any count, aligned to a page or not."""
        lease, seq = self.live.pop(i % len(self.live))
        tokens = self.computed(lease, seq) if publish else None
        if tokens is not None:
            tokens = tokens[: max(0, len(tokens) - short)]
            self.release_model(lease, tokens)
        self.cache.release(lease, tokens)
        self.released.append(lease)

    @precondition(lambda self: self.released)
    @rule(i=PICK)
    def release_again(self, i: int) -> None:
        before = self.cache.stats()
        self.cache.release(self.released[i % len(self.released)])
        assert self.cache.stats() == before

    @rule(ns=NAMESPACES, tokens=TOKENS, ttl=st.sampled_from([None, 1.0, 2.5]))
    def pin(self, ns: str, tokens: list[int], ttl: float | None) -> None:
        path = self.path(ns, tokens)
        until = float("inf") if ttl is None else self.clock.now + ttl
        for key in path:
            self.pins[key] = max(self.pins.get(key, until), until)
        assert self.cache.pin(tokens, ns, ttl) == len(path) * self.ps

    @rule(ns=NAMESPACES, tokens=TOKENS)
    def unpin(self, ns: str, tokens: list[int]) -> None:
        was = [key for key in self.path(ns, tokens) if self.pins.pop(key, None) is not None]
        assert self.cache.unpin(tokens, ns) == len(was) * self.ps

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5]))
    def advance_clock(self, dt: float) -> None:
        self.clock.now += dt
        self.pins = {key: until for key, until in self.pins.items() if until > self.clock.now}

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        evictable, held = self.cache.stats().pages_evictable, self.held_pages()
        assert self.cache.evict(n) == min(n, evictable)
        self.sync(held)

    @rule()
    def flush(self) -> None:
        self.pins.clear()
        held = self.held_pages()
        self.cache.flush()
        self.sync(held)
        assert self.cache.stats().pages_evictable == 0 and self.cache.stats().pages_pinned == 0

    @rule(ns=NAMESPACES)
    def flush_namespace(self, ns: str) -> None:
        self.pins = {key: until for key, until in self.pins.items() if key[0] != ns}
        held = self.held_pages()
        others = {key: page for key, page in self.model.items() if key[0] != ns}
        self.cache.flush(ns)
        self.sync(held)
        assert {key: page for key, page in self.model.items() if key[0] != ns} == others, "another namespace changed"
        assert self.cache.flush(ns) == 0, "the flush left pages of its namespace that it could drop"

    # ---- after every step ----------------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        actual = {(ns, tuple(decode(key))): page for ns, key, page in self.cache.tree.items()}
        assert actual == self.model
        stats = self.cache.stats()
        assert stats.pages_pinned == len(self.pins)
        assert stats.live_leases == len(self.live)
        assert stats.pages_free + stats.pages_evictable == self.cache.available_pages()

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for lease, _ in self.live:
            self.cache.release(lease)
        self.cache.check(idle=True)
        self.cache.flush()
        assert self.cache.allocator.num_free == self.cache.num_pages


# Examples, seed and deadline come from the profile (tests/conftest.py: derandomized by default, HYPOTHESIS_PROFILE=long)
CacheMachine.TestCase.settings = settings(stateful_step_count=40)
TestCacheMachine = CacheMachine.TestCase
