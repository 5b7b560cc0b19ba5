"""The drafter's parts without a model: the index follows the tree's whole pages exactly (and per namespace), the
vote, the sequence's own index, and the backoff."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from radixcache.cache import PrefixCache
from radixcache.keys import TOKEN_BYTES, decode, encode
from radixcache.tree import RadixTree
from radixcache.worker.speculation import MIN_MATCH, CachedTokenIndex, Candidate, Drafter, OwnTokenIndex, vote


def tree_pages(tree: RadixTree) -> dict[int, tuple[str, list[int]]]:
    """page id -> (namespace, tokens) of every page the tree holds (a partial tail: its valid tokens)."""
    bpp = tree.page_size * TOKEN_BYTES
    return {page: (ns, decode(key[(len(key) - 1) // bpp * bpp :])) for ns, key, page in tree.items()}


def key_of(index: CachedTokenIndex, tokens: list[int]) -> int:
    return hash(tuple(tokens[-MIN_MATCH:]))


@pytest.mark.parametrize("page_size,demoted", [(1, 0), (3, 0), (4, 0), (3, 48), (4, 48)])
def test_the_index_holds_exactly_the_trees_pages_through_inserts_tails_evictions_and_flushes(page_size, demoted):
    """With --kv-demote (demoted > 0) pages also move to other ids and back: the index follows them (relocated)."""
    rng = random.Random(page_size)
    transcode = (lambda src, dst: None) if demoted else None  # no pool here: only the page ids matter
    cache = PrefixCache(16 if demoted else 64, page_size, demoted_pages=demoted, transcode=transcode)
    index = CachedTokenIndex(page_size)
    cache.add_observer(index)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for step in range(300):
        op = rng.random()
        ns = rng.choice(["", "t"])
        if op < 0.7:
            tokens = rng.choice(stems)[: rng.randrange(1, 12)] + [rng.randrange(50) for _ in range(rng.randrange(9))]
            lease = cache.acquire(f"r{step}", tokens, ns)
            try:
                cache.allocate(lease, -(-len(tokens) // page_size) - len(lease.pages))
            except Exception:  # full of locked pages: give it back
                cache.release(lease)
                continue
            cache.release(lease, tokens)  # whole pages and a partial tail
        elif op < 0.9:
            cache.evict(rng.randrange(1, 6))
        else:
            cache.flush(ns if rng.random() < 0.7 else None)
        assert index.indexed_pages() == tree_pages(cache.tree), f"step {step}"
    cache.check(idle=True)
    if demoted:
        assert cache.stats().demoted_pages > 0 and cache.stats().promoted_pages > 0  # both moves were exercised


def test_a_continuation_runs_through_the_newest_page_after_it_and_a_match_back_across_pages():
    tree = RadixTree(2)
    index = CachedTokenIndex(2)
    tree.add_observer(index)
    tree.insert(encode([1, 2, 3, 4, 5, 6, 7, 8]), [0, 1, 2, 3])
    tree.insert(encode([1, 2, 3, 4, 5, 6, 9, 9]), [0, 1, 2, 4])  # [5 6] now continues with [7 8] or, newer, [9 9]
    tokens = [0, 0, 2, 3, 4]  # ends like positions 1..3: a match of 3 tokens, backwards across a page boundary
    found = index.candidates("", tokens, key_of(index, tokens), 4)
    assert [(c.match, c.tokens) for c in found] == [(3, [5, 6, 9, 9])]
    tokens = [1, 2, 3, 4]  # the whole prefix matches: 4 tokens
    assert [(c.match, c.tokens) for c in index.candidates("", tokens, key_of(index, tokens), 3)] == [(4, [5, 6, 9])]
    assert index.candidates("other", tokens, key_of(index, tokens), 3) == []  # another namespace holds nothing
    assert index.candidates("", [7, 2, 3], key_of(index, [7, 2, 3]), 3) == []  # [7 2 3] occurs nowhere


def test_drafts_come_only_from_the_requests_own_namespace():
    cache = PrefixCache(32, 4)
    index = CachedTokenIndex(4)
    cache.add_observer(index)
    secret = [11, 12, 13, 14, 15, 16, 17, 18]
    lease = cache.acquire("a", secret, "tenant-a")
    cache.allocate(lease, 2)
    cache.release(lease, secret)
    drafter = Drafter(index)
    for namespace, expect in (("tenant-b", []), ("tenant-a", [15, 16, 17])):
        seq = SimpleNamespace(tokens=[1, 12, 13, 14], request=SimpleNamespace(namespace=namespace), draft_state=None)
        assert drafter.propose(seq, 3) == expect
    cache.flush("tenant-a")  # flushed tokens are never drafted again
    seq = SimpleNamespace(tokens=[1, 12, 13, 14], request=SimpleNamespace(namespace="tenant-a"), draft_state=None)
    assert drafter.propose(seq, 3) == [] and index.indexed_pages() == {}


def test_the_index_keeps_at_most_max_tokens_dropping_the_oldest_pages():
    tree = RadixTree(2)
    index = CachedTokenIndex(2, max_tokens=4)
    tree.add_observer(index)
    tree.insert(encode([1, 2, 3, 4, 5, 6]), [0, 1, 2])
    assert sorted(index.indexed_pages()) == [1, 2] and index.indexed_tokens == 4  # page 0 left the index
    assert tree.cached_pages == 3  # not the tree
    tokens = [9, 3, 4, 5]
    assert [(c.match, c.tokens) for c in index.candidates("", tokens, key_of(index, tokens), 2)] == [(3, [6])]
    tokens = [1, 2, 3, 4]  # its gram ends in an indexed page, but its first token was in the dropped one
    assert index.candidates("", tokens, key_of(index, tokens), 2) == []
    tree.evict(3)
    assert index.indexed_pages() == {}


def test_the_vote_takes_the_most_hits_then_the_longest_match_and_never_drafts_past_the_best_match():
    a = Candidate(5, False, 1, [7, 8, 9, 10, 11, 12])
    b = Candidate(3, False, 2, [7, 8, 1])
    c = Candidate(4, True, 9, [7, 2, 2])
    assert vote([a, b, c], 8) == [7, 8, 9, 10, 11]  # 7 by three, 8 by two, then a alone up to its match of 5
    assert vote([b, c], 8) == [7, 2, 2]  # one hit each: the longer match (c) wins the tie
    assert vote([Candidate(3, False, 1, [1, 2, 3]), Candidate(3, True, 0, [4])], 8) == [4]  # then own tokens
    assert vote([Candidate(3, False, 1, [1]), Candidate(3, False, 2, [2])], 8) == [2]  # then the newest
    assert vote([a], 2) == [7, 8] and vote([], 4) == []


def test_the_sequences_own_index_finds_earlier_occurrences_but_not_the_current_one():
    own = OwnTokenIndex()
    tokens = [5, 1, 2, 3, 4, 9, 1, 2, 3]
    own.catch_up(tokens)
    found = own.candidates(tokens, hash(tuple(tokens[-3:])), 4)
    assert [(c.match, c.tokens) for c in found] == [(3, [4, 9, 1, 2])]
    tokens.append(4)  # one more token: indexed on the next catch-up, and [2 3 4] occurred once before
    own.catch_up(tokens)
    found = own.candidates(tokens, hash(tuple(tokens[-3:])), 2)
    assert [(c.match, c.tokens) for c in found] == [(4, [9, 1])]


def test_a_failed_draft_backs_off_1_3_7_then_15_chances_and_an_accepted_one_resets_it():
    drafter = Drafter(None)
    seq = SimpleNamespace(tokens=[1, 2, 3, 4, 1, 2, 3], request=SimpleNamespace(namespace=""), draft_state=None)
    assert drafter.propose(seq, 2) == [4, 1]
    skipped = []
    for _ in range(5):
        drafter.verified(seq, 2, 0)  # nothing of it accepted
        n = 0
        while not drafter.propose(seq, 2):
            n += 1
        skipped.append(n)
    assert skipped == [1, 3, 7, 15, 15]
    seq.draft_state.skip = 0
    drafter.verified(seq, 2, 1)
    assert seq.draft_state.failures == 0 and drafter.propose(seq, 2) == [4, 1]
