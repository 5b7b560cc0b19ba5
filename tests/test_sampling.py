"""Sampling filters, seeds and the stop-string hold-back of streamed text."""

from __future__ import annotations

import torch

from radixcache.worker.engine.request import FinishReason, Request, SamplingParams
from radixcache.worker.engine.sampling import filtered_probs, new_generator, sample_row, token_logprob
from radixcache.worker.engine.sequence import Sequence

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def kept(params: SamplingParams) -> list[int]:
    return filtered_probs(LOGITS, params).nonzero().flatten().tolist()


def test_filters_keep_what_they_promise():
    assert kept(SamplingParams(temperature=1.0)) == [0, 1, 2, 3, 4]
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [0, 1]  # 0.5 < 0.7, 0.5+0.2 reaches it
    assert kept(SamplingParams(temperature=1.0, top_p=0.71)) == [0, 1, 2]
    assert kept(SamplingParams(temperature=1.0, min_p=0.3)) == [0, 1, 2]  # >= 0.3 x 0.5
    assert kept(SamplingParams(temperature=1.0, top_p=0.01)) == [0]  # the best token always survives
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs[:2], torch.tensor([0.5, 0.2]) / 0.7)


def test_filters_apply_in_the_documented_order_each_on_what_the_previous_kept():
    # top-k, then min-p, then top-p over the mass the earlier filters kept (filtered_probs' docstring; vLLM's order).
    # top_k=2 keeps 0.5 and 0.2; 0.5 alone is 0.5 / 0.7 = 71% of that >= 60%. Top-p first would keep both
    # (0.5 < 0.6 of the whole), and top-k after it changes nothing.
    assert kept(SamplingParams(temperature=1.0, top_k=2, top_p=0.6)) == [0]
    # min_p=0.3 keeps 0.5, 0.2, 0.15 (mass 0.85); 0.5 + 0.2 is 82% of that >= 80%. Top-p first would keep three.
    assert kept(SamplingParams(temperature=1.0, min_p=0.3, top_p=0.8)) == [0, 1]


def test_greedy_is_argmax_and_seeds_reproduce():
    assert sample_row(LOGITS, SamplingParams(), new_generator(None)) == 0
    params = SamplingParams(temperature=1.0)
    draws = [sample_row(LOGITS, params, g) for g in [new_generator(7)] * 50]
    again = [sample_row(LOGITS, params, g) for g in [new_generator(7)] * 50]
    assert draws == again
    assert len(set(draws)) > 1


def test_logprobs_are_the_models_with_top_alternatives():
    lp = token_logprob(LOGITS, 2, top_n=2)
    assert abs(lp.logprob - float(LOGITS[2])) < 1e-6
    assert [t for t, _ in lp.top] == [0, 1]


class ScriptedDetokenizer:
    """Each token id decodes to a fixed piece of text."""

    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces = pieces

    def push(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def stream(stop: tuple[str, ...], pieces: dict[int, str], tokens: list[int], max_tokens: int = 10):
    seq = Sequence(
        Request("s", [1], SamplingParams(max_tokens=max_tokens, stop=stop)),
        on_output=lambda out: None,
        detokenizer=ScriptedDetokenizer(pieces),
        stop_token_ids=frozenset({99}),
    )
    deltas = []
    for t in tokens:
        seq.append_token(t, None)
        out = seq.take_output()
        deltas.append(out.text)
        if out.finished:
            return deltas, out.finish_reason
    return deltas, None


def test_stop_string_split_across_tokens_never_leaks():
    pieces = {1: "Hello ", 2: "wor", 3: "ld!", 4: " more"}
    deltas, reason = stream(("world",), pieces, [1, 2, 3, 4])
    assert reason is FinishReason.STOP_STRING
    assert deltas == ["Hello ", "", ""]


def test_text_that_is_not_a_stop_string_is_released_in_order():
    pieces = {1: "ab", 2: "cd", 3: "ef"}
    deltas, reason = stream(("xyz",), pieces, [1, 2, 3], max_tokens=3)
    assert reason is FinishReason.LENGTH
    assert deltas == ["ab", "cd", "ef"]  # nothing here can begin "xyz", so nothing waits


def test_only_a_possible_stop_prefix_waits():
    pieces = {1: "say x", 2: "y", 3: "!"}
    deltas, reason = stream(("xyz",), pieces, [1, 2, 3], max_tokens=3)
    assert deltas == ["say ", "", "xy!"]


def test_stop_token_ends_without_its_text():
    deltas, reason = stream((), {1: "a", 99: "<eos>"}, [1, 99])
    assert reason is FinishReason.STOP_TOKEN
    assert "".join(deltas) == "a"


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_best_token():
    """Valid but extreme values (issue 10): they used to make torch.multinomial see inf/NaN and fail the request."""
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10
    best = int(torch.argmax(logits))
    for temperature in (1e-38, 1e-45, 5e-324, 1e-30, 2e-38):
        assert sample_row(logits, SamplingParams(temperature=temperature), new_generator(1)) == best, temperature
    for top_p in (1e-46, 5e-324, 1e-20):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        assert sample_row(logits, params, new_generator(2)) == best, top_p
        assert kept(SamplingParams(temperature=1.0, top_p=top_p)) == [0]
    for params in (SamplingParams(temperature=1e300), SamplingParams(temperature=1e-30, top_p=1e-40, min_p=1.0)):
        probs = filtered_probs(logits, params)
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-5
