"""n samples of one prompt (computed once, pages shared) and OpenAI's presence / frequency penalties, in-process."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import tiny_model

from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from radixcache.worker.engine.sampling import apply_penalties


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class Samples:
    """on_output target for one request: outputs per sample index."""

    def __init__(self) -> None:
        self.by_index: dict[int, list[RequestOutput]] = {}

    def __call__(self, out: RequestOutput) -> None:
        self.by_index.setdefault(out.index, []).append(out)

    def tokens(self, index: int) -> list[int]:
        return [t for o in self.by_index[index] for t in o.token_ids]

    def finishes(self) -> dict[int, list[FinishReason]]:
        return {i: [o.finish_reason for o in outs if o.finish_reason] for i, outs in self.by_index.items()}


def run(model, prompt: list[int], params: SamplingParams, **config) -> tuple[Samples, Engine]:
    config.setdefault("kv_pages", 256)
    config.setdefault("page_size", 4)
    engine = Engine(model, EngineConfig(**config))
    sink = Samples()
    engine.submit(Request("r", prompt, params), sink)
    engine.run_until_idle()
    engine.cache.check(idle=True)
    return sink, engine


PROMPT = list(range(5, 35))  # 30 tokens: 7 whole pages of 4 and a partial one


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_n_samples_compute_the_prompt_once_and_differ(model, cache_enabled):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4, ignore_eos=True)
    sink, engine = run(model, PROMPT, params, cache_enabled=cache_enabled)
    assert sorted(sink.by_index) == [0, 1, 2, 3]
    assert all(f == [FinishReason.LENGTH] for f in sink.finishes().values())
    samples = [sink.tokens(i) for i in range(4)]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) == 4, "seeded samples must differ from each other"
    stats = engine.stats()
    assert stats.prompt_tokens == len(PROMPT)  # admitted (and computed) once, not four times
    assert stats.steps == 12  # one prefill step, then the four samples decode together
    # Sample i is what a single request seeded with seed + i draws (the copied prompt K/V equal computed ones).
    for i in (0, 3):
        alone, _ = run(model, PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i, ignore_eos=True))
        assert alone.tokens(0) == samples[i]
    again, _ = run(model, PROMPT, params, cache_enabled=cache_enabled)
    assert [again.tokens(i) for i in range(4)] == samples


def test_n_samples_fall_back_to_computing_the_prompt_when_no_page_is_left(model):
    # 9 pages: the first sample takes 8 for its prompt + 2 tokens; no page is left to copy the others' tails.
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=3, n=3, ignore_eos=True)
    sink, engine = run(model, PROMPT, params, kv_pages=9)
    assert [len(sink.tokens(i)) for i in range(3)] == [2, 2, 2]
    expected = [
        run(model, PROMPT, SamplingParams(max_tokens=2, temperature=1.0, seed=3 + i))[0].tokens(0) for i in range(3)
    ]
    assert [sink.tokens(i) for i in range(3)] == expected


def test_abort_ends_every_sample_and_frees_pages(model):
    engine = Engine(model, EngineConfig(kv_pages=256, page_size=4))
    sink = Samples()
    engine.submit(Request("r", PROMPT, SamplingParams(max_tokens=50, temperature=1.0, n=3, ignore_eos=True)), sink)
    engine.step()  # prefill + fork
    engine.step()
    assert engine.abort("r")
    engine.run_until_idle()
    assert sink.finishes() == {i: [FinishReason.ABORTED] for i in range(3)}
    engine.cache.check(idle=True)
    assert not engine.abort("r")  # the id is free again


def test_abort_before_the_prompt_is_computed_ends_the_waiting_samples(model):
    engine = Engine(model, EngineConfig(kv_pages=256, page_size=4))
    sink = Samples()
    engine.submit(Request("r", PROMPT, SamplingParams(max_tokens=5, n=2)), sink)
    engine.abort("r")
    engine.run_until_idle()
    assert sink.finishes() == {0: [FinishReason.ABORTED], 1: [FinishReason.ABORTED]}
    engine.cache.check(idle=True)


def test_n_is_validated():
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=17)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=float("nan"))


def test_penalties_follow_openai_semantics():
    logits = torch.zeros(6)
    generated = [2, 2, 2, 4]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, generated, params)
    assert out.tolist() == [0.0, 0.0, -(0.5 + 3 * 0.25), 0.0, -(0.5 + 0.25), 0.0]
    assert logits.tolist() == [0.0] * 6  # the model's logits (and so logprobs) are untouched
    assert apply_penalties(logits, [], params) is logits
    assert apply_penalties(logits, generated, SamplingParams()) is logits


@pytest.mark.parametrize("presence, frequency", [(-2.0, 0.0), (0.5, -1.0), (2.0, 2.0)])
def test_greedy_decoding_picks_the_best_penalized_token(model, presence, frequency):
    """Each token is the argmax of logprob - frequency * count - presence * (count > 0) over the tokens generated
    before it (logprobs are the model's, unpenalized; a shift of every logit leaves their order alone)."""
    prompt = list(range(40, 60))
    plain, _ = run(model, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    params = SamplingParams(
        max_tokens=30, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency, logprobs=True,
        top_logprobs=20,
    )  # fmt: skip
    sink, _ = run(model, prompt, params)
    steps = [lp for o in sink.by_index[0] for lp in o.logprobs]
    counts: dict[int, int] = {}

    def score(token: int, logprob: float) -> float:
        c = counts.get(token, 0)
        return logprob - frequency * c - presence * (c > 0)

    for lp in steps:
        best = max(score(t, v) for t, v in lp.top)
        assert score(lp.token_id, lp.logprob) >= best - 1e-4
        counts[lp.token_id] = counts.get(lp.token_id, 0) + 1
    assert sink.tokens(0) != plain.tokens(0), "the penalty should change this output"
