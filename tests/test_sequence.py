"""A Sequence's own promises, without a model: what each output carries (tokens, text, logprobs, counts, timings),
when the detokenizer's held-back bytes are flushed, where stop strings cut, seeds per sample, the grammar hook."""

from __future__ import annotations

import time

from radixcache.worker.engine.request import ErrorKind, FinishReason, Request, SamplingParams, TokenLogprob
from radixcache.worker.engine.sequence import Sequence, stop_prefix_at_end

PARTIAL = 50  # a token whose bytes are half of a character: no text until the next token or a flush
REPLACEMENT = "\ufffd"  # what a flush makes of bytes that never became a character


class HoldingDetokenizer:
    """Token ids decode to fixed pieces; PARTIAL holds its text back until the next push, or flushes as U+FFFD."""

    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces = pieces
        self.held = False

    def push(self, token_id: int) -> str:
        if token_id == PARTIAL:
            self.held = True
            return ""
        text = ("é" if self.held else "") + self.pieces[token_id]
        self.held = False
        return text

    def flush(self) -> str:
        text = REPLACEMENT if self.held else ""
        self.held = False
        return text


PIECES = {1: "ab", 2: "cd", 3: "STOP", 4: ".x.", 5: "x"}


def make(prompt=(7, 8, 9), index: int = 0, **sampling) -> Sequence:
    sampling.setdefault("max_tokens", 10)
    return Sequence(
        Request("r", list(prompt), SamplingParams(**sampling)),
        on_output=lambda out: None,
        detokenizer=HoldingDetokenizer(PIECES),
        stop_token_ids=frozenset({99}),
        index=index,
    )


def test_stop_prefix_at_end_counts_only_proper_prefixes():
    assert stop_prefix_at_end("say xy", ("xyz",)) == 2
    assert stop_prefix_at_end("say xy", ("xyz", "y!")) == 2  # the longest tail that begins any of them
    assert stop_prefix_at_end("say", ("xyz",)) == 0
    # A whole stop string is not "the start of one": append_token has ended the request on it already.
    assert stop_prefix_at_end("abc", ("bc",)) == 0
    assert stop_prefix_at_end("", ("bc",)) == 0


def test_each_output_carries_its_tokens_logprobs_and_counts():
    seq = make(prompt=(7, 8, 9), max_tokens=3)
    seq.cached_tokens = 2
    first, second = TokenLogprob(1, -0.5, [(1, -0.5), (2, -1.0)]), TokenLogprob(2, -0.25)
    seq.append_token(1, first)
    out = seq.take_output()
    assert (out.token_ids, out.text, out.logprobs) == ([1], "ab", [first])
    assert (out.prompt_tokens, out.cached_tokens, out.completion_tokens) == (3, 2, 1)
    seq.append_token(2, second)
    out = seq.take_output()
    assert (out.token_ids, out.text, out.logprobs, out.completion_tokens) == ([2], "cd", [second], 2)
    seq.append_token(1, None)  # logprobs were not asked for: none recorded, none sent
    out = seq.take_output()
    assert (out.logprobs, out.finish_reason, out.completion_tokens) == ([], FinishReason.LENGTH, 3)


def test_nothing_new_means_no_output():
    seq = make()
    assert seq.take_output() is None
    seq.append_token(1, None)
    assert seq.take_output() is not None
    assert seq.take_output() is None  # already sent: not again


def test_time_to_first_token_on_the_first_output_only_and_per_token_time_at_the_end():
    seq = make(max_tokens=3)
    seq.arrival = time.monotonic() - 5.0  # it waited five seconds in the queue
    seq.append_token(1, None)
    out = seq.take_output()
    assert out.time_to_first_token is not None and 5.0 <= out.time_to_first_token < 6.0
    assert out.time_per_output_token is None
    seq.first_token_at -= 10.0  # as if the next two tokens took ten seconds
    first_token_at = seq.first_token_at
    seq.append_token(2, None)
    out = seq.take_output()
    assert out.time_to_first_token is None and out.time_per_output_token is None  # only on the first / last output
    seq.append_token(1, None)
    assert seq.first_token_at == first_token_at  # the first token's time is kept, not moved
    out = seq.take_output()
    assert out.finish_reason is FinishReason.LENGTH
    assert 5.0 <= out.time_per_output_token < 5.5  # ten seconds over the two tokens after the first


def test_per_token_time_needs_two_tokens():
    for max_tokens in (1, 2):
        seq = make(max_tokens=max_tokens)
        for _ in range(max_tokens):
            seq.append_token(1, None)
        seq.first_token_at -= 4.0
        out = seq.take_output()
        assert out.finished
        if max_tokens == 1:
            assert out.time_per_output_token is None  # no time between tokens to speak of
        else:
            assert 4.0 <= out.time_per_output_token < 4.5


def test_an_error_and_the_sample_index_reach_the_output():
    seq = make(index=2)
    seq.append_token(1, None)
    seq.finish_reason, seq.error, seq.error_kind = FinishReason.ERROR, "boom", ErrorKind.INTERNAL
    out = seq.take_output()
    assert (out.index, out.finish_reason, out.error, out.error_kind) == (
        2,
        FinishReason.ERROR,
        "boom",
        ErrorKind.INTERNAL,
    )
    assert out.text == "ab"


def test_held_back_bytes_wait_mid_stream_and_are_flushed_when_the_request_ends_by_length_or_stop_token():
    seq = make(max_tokens=2)
    seq.append_token(PARTIAL, None)
    out = seq.take_output()
    assert (out.token_ids, out.text) == ([PARTIAL], "")  # half a character is not sent, nor replaced, mid-stream
    seq.append_token(1, None)
    assert seq.take_output().text == "éab"  # completed by the next token

    for end in ("length", "stop_token"):
        seq = make(max_tokens=1 if end == "length" else 5)
        seq.append_token(PARTIAL, None)
        if end == "stop_token":
            seq.take_output()
            seq.append_token(99, None)
        out = seq.take_output()
        assert out.finished and out.text == REPLACEMENT, end  # the bytes that never completed are not lost


def test_a_stop_string_end_does_not_flush_what_follows_it():
    seq = make(stop=("STOP",))
    seq.append_token(1, None)
    seq.take_output()
    seq.append_token(3, None)
    seq.detokenizer.held = True  # bytes after "STOP" in the same token, still held: they must not be sent
    out = seq.take_output()
    assert (out.finish_reason, out.text) == (FinishReason.STOP_STRING, "")


def test_a_stop_string_at_the_very_start_of_the_text_ends_the_request():
    seq = make(stop=("STOP",))
    seq.append_token(3, None)
    out = seq.take_output()
    assert (out.finish_reason, out.text) == (FinishReason.STOP_STRING, "")


def test_the_text_is_cut_at_the_first_occurrence_of_a_stop_string_inside_one_token():
    seq = make(stop=(".",))
    seq.append_token(4, None)  # ".x." : cut before the first dot, not the last
    out = seq.take_output()
    assert (out.finish_reason, out.text) == (FinishReason.STOP_STRING, "")
    seq = make(stop=("x.", "."))
    seq.append_token(1, None)
    seq.append_token(4, None)  # "ab.x.": "." at 2 comes before "x." at 3, though listed second
    out = seq.take_output()
    assert (out.finish_reason, out.text) == (FinishReason.STOP_STRING, "ab")


def test_a_possible_stop_prefix_is_released_when_the_request_ends_another_way():
    seq = make(stop=("xyz",), max_tokens=2)
    seq.append_token(1, None)
    seq.append_token(5, None)  # "abx": the "x" could begin "xyz" ...
    out = seq.take_output()
    assert (out.text, out.finished) == ("abx", True)  # ... but the request ended by length: send it all


def test_sample_seeds_are_the_request_seed_plus_the_index_wrapping_past_the_largest():
    assert make(seed=5, index=0).generator.initial_seed() == 5
    assert make(seed=5, index=2).generator.initial_seed() == 7
    largest = 2**64 - 1
    assert make(seed=largest - 1, index=1).generator.initial_seed() == largest
    assert make(seed=largest, index=1).generator.initial_seed() == 0
    assert make(seed=largest, index=3).generator.initial_seed() == 2


class RecordingMatcher:
    def __init__(self, done_after: int) -> None:
        self.consumed: list[int] = []
        self.done_after = done_after

    def consume(self, token_id: int) -> None:
        self.consumed.append(token_id)

    @property
    def done(self) -> bool:
        return len(self.consumed) >= self.done_after


def test_the_grammar_sees_every_token_and_a_complete_grammar_ends_the_request():
    seq = make(max_tokens=10)
    seq.matcher = RecordingMatcher(done_after=2)
    seq.append_token(1, None)
    assert seq.finish_reason is None
    seq.append_token(2, None)
    assert seq.matcher.consumed == [1, 2]
    assert seq.finish_reason is FinishReason.STOP_TOKEN
    assert seq.take_output().text == "abcd"


def test_common_prefix_is_symmetric_and_remembered():
    a, b, c = make(prompt=(1, 2, 3, 4)), make(prompt=(1, 2, 5)), make(prompt=(1, 2, 3, 4, 6))
    assert a.common_prefix(b) == b.common_prefix(a) == 2
    assert a.common_prefix(c) == 4
    assert a.common_prefix(a) == 4
    # The scheduler asks for every pair each step: the answer is kept, not recomputed.
    assert a.lcp_cache[b] == 2 and a.lcp_cache[c] == 4
