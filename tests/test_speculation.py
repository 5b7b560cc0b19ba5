"""The drafter's parts without a model: the index follows the tree's whole pages exactly (and per namespace), the
vote, the sequence's own index, and the backoff."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from radixcache.cache import PrefixCache
from radixcache.keys import TOKEN_BYTES, decode, encode
from radixcache.tree import RadixTree
from radixcache.worker.speculation import (
    MIN_MATCH,
    CachedTokenIndex,
    Candidate,
    Drafter,
    OwnTokenIndex,
    Speculator,
    vote,
)


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


def drafted_sequence(tokens: list[int], *, max_tokens: int = 100, speculate: bool = True, matcher=None):
    """A DraftedSequence without the engine: `num_prompt` tokens of prompt, nothing generated yet."""
    sampling = SimpleNamespace(max_tokens=max_tokens, speculate=speculate)
    return SimpleNamespace(
        tokens=list(tokens), num_computed=len(tokens) - 1, draft_state=None, draft_tokens=0,
        accepted_draft_tokens=0, request=SimpleNamespace(namespace="", sampling=sampling), matcher=matcher,
        finish_reason=None, num_generated=0,
    )  # fmt: skip


class ScriptedSampler:
    """The engine's sampler for one sequence: row i appends answers[i] (and ends the request at `ends_at`)."""

    def __init__(self, seq, answers: list[int], ends_at: int | None = None) -> None:
        self.seq, self.answers, self.ends_at, self.rows = seq, answers, ends_at, []

    def __call__(self, i: int) -> None:
        self.rows.append(i)
        self.seq.tokens.append(self.answers[i])
        if i == self.ends_at:
            self.seq.finish_reason = "stop"


class AskedDrafter(Drafter):
    """A drafter that drafts as much as it is allowed (token 9), and remembers how much that was."""

    def __init__(self) -> None:
        super().__init__(None)
        self.asked: list[int] = []

    def propose(self, seq, limit: int) -> list[int]:
        self.asked.append(limit)
        return [9] * limit


@pytest.mark.parametrize(
    "answers,ends_at,accepted,rows",
    [
        ([5, 6, 9], None, 2, [0, 1, 2]),  # the third row disagrees: two accepted, the sampled 9 is the next token
        ([5, 6, 7, 8], None, 3, [0, 1, 2, 3]),  # all accepted: the row after the last draft token samples too
        ([4], None, 0, [0]),  # the first row disagrees: nothing accepted, the step is a plain decode
        ([5, 6, 7], 1, 2, [0, 1]),  # the second token ends the request: accepted, never computed
    ],
)
def test_verify_accepts_the_draft_as_far_as_the_sequences_own_sampler_agrees(answers, ends_at, accepted, rows):
    seq = drafted_sequence([1, 2, 3])
    sampler = ScriptedSampler(seq, answers, ends_at)
    verdict = Speculator(Drafter(None), max_draft=8, context_length=100).verify(seq, [5, 6, 7], sampler)
    assert (verdict.drafted, verdict.accepted) == (3, accepted) and sampler.rows == rows
    assert seq.tokens == [1, 2, 3, *answers[: len(rows)]]  # only tokens the sampler drew
    # an accepted token's K/V was computed by the step, except a last one: the next step starts after them
    assert seq.num_computed == 2 + accepted - (ends_at is not None)
    assert (seq.draft_tokens, seq.accepted_draft_tokens) == (3, accepted)


def test_a_rejected_draft_backs_the_sequence_off():
    seq = drafted_sequence([1, 2, 3, 4, 1, 2, 3])
    speculator = Speculator(Drafter(None), max_draft=8, context_length=100)
    draft = speculator.draft(seq, 8)
    assert draft == [4, 1, 2]  # its own earlier tokens, up to the match's length
    speculator.verify(seq, draft, ScriptedSampler(seq, [7]))
    assert seq.draft_state.skip == 1 and speculator.draft(seq, 8) == []


def test_a_draft_leaves_room_for_the_token_after_it_and_obeys_the_request():
    drafter = AskedDrafter()
    speculator = Speculator(drafter, max_draft=8, context_length=20)
    assert speculator.draft(drafted_sequence(range(5)), 6) == [9] * 6  # the scheduler's limit
    assert speculator.draft(drafted_sequence(range(5)), 50) == [9] * 8  # max_draft
    assert len(speculator.draft(drafted_sequence(range(5), max_tokens=4), 50)) == 3  # + the token sampled after it
    assert len(speculator.draft(drafted_sequence(range(17)), 50)) == 3  # the context's last slots
    assert speculator.draft(drafted_sequence(range(19), max_tokens=1), 50) == []  # no room: the drafter is not asked
    assert drafter.asked == [6, 8, 3, 3]
    assert speculator.draft(drafted_sequence(range(5), speculate=False), 50) == []  # the request opted out
    grammar = SimpleNamespace(accepts_prefix=lambda tokens: 2)
    assert speculator.draft(drafted_sequence(range(5), matcher=grammar), 50) == [9, 9]  # what its grammar allows
    with pytest.raises(ValueError, match="max_draft"):
        Speculator(drafter, max_draft=0, context_length=20)
