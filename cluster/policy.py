"""The routing decision, apart from Ray: the replica where the request's first token should come soonest.

Each candidate gets a cost, in tokens of prefill work, estimating what stands between the request and its first
token there:

    cost = uncached                                the prompt tokens it would compute: all, less its cached prefix
                                                   (in the device, then in a tier below it)
         + weights.tier     x loaded               the tokens of the pages right after the device's that a tier
                                                   below holds (host memory, disk): loaded, not computed
         + weights.store    x from_store           of those, the tokens only the fleet's store holds (any
                                                   replica loads them): scored at the store's own load cost
                                                   instead of the tier's
         + weights.queued   x queued_tokens        prefill tokens already queued there
         + weights.requests x requests             requests running or waiting there (each slows every step)
         + weights.kv       x new x kv_busy        new = uncached + loaded, the tokens needing fresh pages;
                                                   kv_busy: the share of its KV pool held by running requests or
                                                   pins; the fuller, the likelier the new pages wait for room
         + weights.evict    x evicted x uses       cached tokens its new pages would push out of a full pool (its
                                                   pages less what it caches and was sent, when known), each
                                                   counted as often as routed prompts used its page (at least
                                                   once), and at weights.tier / weights.store where a tier below
                                                   or the fleet's store keeps a copy: where pools are full
                                                   everywhere, a new prefix displaces the least asked-for cache,
                                                   the cheapest to get back (cluster.reuse)
         - weights.hint     x hinted               when no replica's events (or prompts in flight) show any of
                                                   the prompt's pages: the tokens of its leading pages the
                                                   router's hints say it sent there last (cluster.hints), worth
                                                   more than cached there (LoadWeights.hint): after a flush or an
                                                   engine reset a conversation goes back where it was, and the
                                                   fleet keeps its partition

and the cheapest wins. Ties: `cheapest` lists those within TIE_TOKENS of it, and, when no candidate has a cache
advantage over another (every one hits the same tokens, none at all included) and load is balanced, those within
`tie_share` of the tokens to compute: load figures are up to a report period old (a request or two, a few percent
of a pool), so differences that small are noise, and prompts that share nothing must not pile up wherever the noise
points. `Policy.pick`, the router's, takes the tied one it chose least recently (deterministic, and it counts
concurrent decisions that have not reached a replica yet); `choose` picks one at random. With the default weights a
cached prefix keeps its requests until the
queue there is longer than recomputing it elsewhere: 1,024 cached tokens outweigh 1,024 queued ones, or 256 running
requests (the imbalance rule below steps in long before). A prefix on a replica's disk tier scores below the same
prefix in another's device and above nothing: with the default tier weight, 1,024 tokens to load cost ~51; from
the fleet's store (dearer to load than a replica's own disk) ~96: device > host/disk > store > nothing.

A request with a cache key (OpenAI's prompt_cache_key, Request.cache_key) goes to its key's home replica unless
the fleet is imbalanced: `key_home` picks it by rendezvous hashing of (tenant, key, replica) over the candidates,
so every router agrees on it without sharing state, and a replica joining or leaving moves only the keys it wins
or held. The client asked for the key's requests to stay together: its conversation's pages are then where it goes.

Two rules of SGLang's cache-aware router come first. When the request counts are imbalanced (the busiest and the
idlest differ by more than `balance_abs` AND the busiest has more than `balance_rel` times the idlest's), the cache
is ignored and load alone decides (the eviction term too: it weighs cached pages). A match shorter than `min_match_pages` pages (device and tier together) counts as none.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from radixcache.tier import MEDIUM_STORE

DEFAULT_BALANCE_ABS = 8
DEFAULT_BALANCE_REL = 1.5
DEFAULT_MIN_MATCH_PAGES = 1
DEFAULT_TIE_SHARE = 0.5
TIE_TOKENS = 1.0


@dataclass(frozen=True)
class RoutingThresholds:
    balance_abs: int = DEFAULT_BALANCE_ABS
    balance_rel: float = DEFAULT_BALANCE_REL
    min_match_pages: int = DEFAULT_MIN_MATCH_PAGES
    tie_share: float = DEFAULT_TIE_SHARE  # of the tokens to compute: the load noise tolerated between equal hits

    def __post_init__(self) -> None:
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if not self.balance_rel >= 1.0:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")
        if self.min_match_pages < 1:
            raise ValueError(f"min_match_pages must be >= 1, got {self.min_match_pages}")
        if not 0.0 <= self.tie_share <= 1.0:
            raise ValueError(f"tie_share must be in [0, 1], got {self.tie_share}")


@dataclass(frozen=True)
class LoadWeights:
    """How much each load term weighs against one uncached prompt token (see the module docstring)."""

    queued: float = 1.0  # a queued prefill token delays the first token as much as one of the request's own
    requests: float = 4.0  # tokens per request running or waiting there (its decode row in each step of the prefill)
    kv: float = 1.0  # x uncached tokens x busy share of the KV pool
    evict: float = 1.0  # per cached token pushed out (a token to recompute, should it be asked for again)
    # Per token of a matched page held below the device (host memory, disk): loading it costs this share of
    # computing it. bench/tier_bench.py (BENCHMARKS.md, "Disk tier"): a 1,024-token prefix re-hit from the disk
    # came 19.3x sooner than its cold prefill (disk_rehit_ttft_speedup), so 1 / 19.3 ~ 0.05. Host memory loads
    # faster still; the disk's figure is used for both (an upper bound).
    tier: float = 0.05
    # Per token of the leading pages the hints say were sent to a replica, when no events show them anywhere. The
    # prefix is computed either way; going back keeps the fleet's partition: sent elsewhere, it lands in a pool
    # sized for that replica's own prefixes, one of which it pushes out (a recompute later). So a hinted token
    # counts twice a cached one: after a flush, the first of a burst queues a prefill at its home, and the next one
    # homed there must still follow (at 1.0 it went where nothing was queued, and that pool thrashed:
    # tests/test_cluster_hints.py); a queue of two prefills there still sends it elsewhere.
    hint: float = 2.0
    # Per token of a matched page only the fleet's store holds (any replica loads it over the network).
    # bench/store_bench.py (BENCHMARKS.md, "The fleet's store"): a 1,024-token prefix re-hit from the store came
    # 10.6x sooner than its cold prefill (cross_replica_rehit_speedup; 12.3x in a second run), so 1 / 10.6 ~ 0.094:
    # dearer than the disk, so a replica's own tier wins over another loading the same prefix from the store.
    store: float = 0.094

    def __post_init__(self) -> None:
        for name in ("queued", "requests", "kv", "evict", "tier", "hint", "store"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"load weight {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Candidate:
    replica: Hashable
    requests: int  # running or waiting there
    matched_pages: int  # leading pages of the prompt it holds in the device (or will: in flight)
    queued_tokens: int = 0  # prefill tokens queued there
    kv_busy: float = 0.0  # share of its KV pool held by running requests or pins, in [0, 1]
    free_tokens: int | None = None  # room in its pool before anything cached is evicted (None: not known yet)
    victim_uses: tuple[int, ...] = ()  # request counts of the pages it would evict next, in eviction order
    # where below the device each of those keeps a copy (a tier's medium, "STORE"; None: nowhere), in that order
    victim_media: tuple[str | None, ...] = ()
    tier_pages: int = 0  # the prompt's pages right after matched_pages that a tier below the device holds
    store_pages: int = 0  # of tier_pages, those only the fleet's store holds (none of this replica's own tiers)
    hinted_pages: int = 0  # leading pages of the prompt the router last sent here (cluster.hints)


def imbalanced(requests: Sequence[int], t: RoutingThresholds) -> bool:
    hi, lo = max(requests), min(requests)
    return hi - lo > t.balance_abs and hi > t.balance_rel * lo


def cost(
    c: Candidate,
    prompt_tokens: int,
    cached_tokens: int,
    w: LoadWeights,
    page_size: int = 1,
    loaded_tokens: int = 0,
    hinted_tokens: int = 0,
    store_tokens: int = 0,
) -> float:
    """Estimated tokens of prefill work before this request's first token on `c` (see the module docstring):
    `cached_tokens` hit in the device, the next `loaded_tokens` loaded from a tier below it (`store_tokens` of them
    from the fleet's store); less the affinity of `hinted_tokens` computed where the hints send them."""
    uncached = max(0, prompt_tokens - cached_tokens - loaded_tokens)
    new = uncached + loaded_tokens
    store_tokens = min(store_tokens, loaded_tokens)
    load = uncached + w.tier * (loaded_tokens - store_tokens) + w.store * store_tokens + w.kv * new * c.kv_busy
    load += w.queued * c.queued_tokens + w.requests * c.requests
    return load + w.evict * eviction_tokens(c, new, page_size, w) - w.hint * hinted_tokens


def eviction_tokens(c: Candidate, uncached: int, page_size: int, w: LoadWeights | None = None) -> float:
    """Cached tokens `uncached` new tokens would push out of `c`'s pool, each weighted by its page's uses, and by
    what getting it back costs: a recompute, or where a tier below keeps a copy (c.victim_media) a load from it,
    at the weight its hits are scored with (a pool that spills into the fleet's store loses little by it)."""
    if c.free_tokens is None or uncached <= c.free_tokens:
        return 0
    w = w or LoadWeights()
    pages = -(-(uncached - c.free_tokens) // page_size)
    named = c.victim_uses[:pages]
    media = c.victim_media[: len(named)]
    worth = [1.0 if m is None else w.store if m == MEDIUM_STORE else w.tier for m in media]
    worth += [1.0] * (len(named) - len(worth))
    return page_size * (sum(max(1, n) * x for n, x in zip(named, worth, strict=True)) + pages - len(named))


def cheapest(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    page_size: int,
    t: RoutingThresholds | None = None,
    w: LoadWeights | None = None,
) -> list[Candidate]:
    """The candidates a request of `prompt_tokens` tokens may go to: the cheapest and those tied with it (see the
    module docstring), in the order given; candidates must not be empty."""
    if not candidates:
        raise ValueError("no candidate replicas")
    t, w = t or RoutingThresholds(), w or LoadWeights()
    use_cache = not imbalanced([c.requests for c in candidates], t)
    shown = any(c.matched_pages + c.tier_pages >= t.min_match_pages for c in candidates)  # events show a prefix

    def hits(c: Candidate) -> tuple[int, int, int, int]:
        """(tokens hit in the device, tokens then loaded from a tier, of those from the fleet's store, tokens
        hinted): one token is always computed."""
        if not use_cache:
            return 0, 0, 0, 0
        if c.matched_pages + c.tier_pages >= t.min_match_pages:
            device = min(c.matched_pages * page_size, prompt_tokens - 1)
            loaded = min(c.tier_pages * page_size, prompt_tokens - 1 - device)
            return device, loaded, min(c.store_pages * page_size, loaded), 0
        if not shown and c.hinted_pages >= t.min_match_pages:
            return 0, 0, 0, min(c.hinted_pages * page_size, prompt_tokens - 1)
        return 0, 0, 0, 0

    if not use_cache:  # load alone decides: what a new prefix would evict is a cache consideration too
        w = dataclasses.replace(w, evict=0.0)
    found = [hits(c) for c in candidates]
    costs = [
        cost(c, prompt_tokens, device, w, page_size, loaded, hinted, store)
        for c, (device, loaded, store, hinted) in zip(candidates, found, strict=True)
    ]
    best = min(costs)
    tolerance = TIE_TOKENS
    if use_cache and len(set(found)) == 1:  # no cache advantage anywhere: small load differences are noise
        device, loaded, _, _ = found[0]
        tolerance += t.tie_share * (prompt_tokens - device - loaded)
    return [c for c, x in zip(candidates, costs, strict=True) if x <= best + tolerance]


def choose(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    page_size: int,
    t: RoutingThresholds | None = None,
    w: LoadWeights | None = None,
    rng: random.Random | None = None,
) -> Candidate:
    """One of the cheapest, at random."""
    return (rng or random).choice(cheapest(candidates, prompt_tokens, page_size, t, w))


def key_home(namespace: str, cache_key: str, replicas: Sequence[Hashable]) -> Hashable:
    """The replica a tenant's cache key belongs on: the one whose hash with the key is highest (rendezvous hashing;
    replicas must not be empty)."""
    if not replicas:
        raise ValueError("no candidate replicas")
    key = f"{len(namespace)}:{namespace}{cache_key}".encode()

    def score(replica: Hashable) -> bytes:
        return blake2b(key + b"\0" + str(replica).encode(), digest_size=8).digest()

    return max(replicas, key=score)


class Policy:
    """The router's decision: thresholds, weights, and which of tied candidates it chose least recently. Not
    thread-safe."""

    def __init__(self, thresholds: RoutingThresholds | None = None, weights: LoadWeights | None = None) -> None:
        self.thresholds = thresholds or RoutingThresholds()
        self.weights = weights or LoadWeights()
        self.ties = 0  # decisions that had several cheapest candidates
        self.decisions = 0
        self._chosen_at: dict[Hashable, int] = {}  # replica -> the decision that last chose it

    def pick(
        self, candidates: Sequence[Candidate], prompt_tokens: int, page_size: int, *, namespace: str = "",
        cache_key: str = "",
    ) -> Candidate:  # fmt: skip
        """The cheapest candidate (of tied ones, the least recently chosen, then by name), or with a cache key and
        balanced load, the key's home."""
        if cache_key and not imbalanced([c.requests for c in candidates], self.thresholds):
            home = key_home(namespace, cache_key, [c.replica for c in candidates])
            chosen = next(c for c in candidates if c.replica == home)
        else:
            tied = cheapest(candidates, prompt_tokens, page_size, self.thresholds, self.weights)
            if len(tied) > 1:
                self.ties += 1
            chosen = min(tied, key=lambda c: (self._chosen_at.get(c.replica, -1), str(c.replica)))
        self.decisions += 1
        self._chosen_at[chosen.replica] = self.decisions
        return chosen

    def forget(self, replica: Hashable) -> None:
        """The replica is gone (its turn with it)."""
        self._chosen_at.pop(replica, None)
