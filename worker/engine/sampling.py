"""Turning one step's logits into tokens: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds,
logprobs.

Every row is processed on its own with its own torch.Generator, so a seeded request draws the same tokens whatever
else shares its batch. Log-probabilities are those of the model (log_softmax of the raw logits), before any
temperature, penalty or filtering, so they stay comparable across sampling settings.
"""

from __future__ import annotations

import torch

from radixcache.worker.engine.request import SamplingParams, TokenLogprob


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded for reproducibility, else from fresh OS entropy."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


# Below float32's smallest normal number, dividing by the temperature loses all precision: the limit of sampling as
# the temperature goes to 0 is the argmax, so such temperatures are greedy.
GREEDY_BELOW_TEMPERATURE = torch.finfo(torch.float32).tiny


def apply_penalties(logits: torch.Tensor, generated: list[int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the tokens generated so far (the prompt does not count):
    logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0). Returns a new tensor; greedy
    decoding sees the penalized logits too."""
    if not params.penalized or not generated:
        return logits
    ids = torch.tensor(generated, dtype=torch.long, device=logits.device)
    counts = torch.bincount(ids, minlength=logits.shape[-1]).to(torch.float32)
    penalty = params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float32)
    return logits.float() - penalty


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, min-p and top-p (float32, one row [vocab]); finite, summing to 1.

    The filters apply in that order, each to what the previous ones kept: top-k keeps the k most likely tokens,
    min-p those at least min_p times the best one (the two commute), and top-p, last as in vLLM, the smallest set
    reaching top_p of the mass still kept (top_k=2, top_p=0.6 over 0.5, 0.2, ... keeps only 0.5: 71% of 0.7).

    The best token always survives every filter, and temperature scales logits relative to the best one (which
    stays at 0), so no temperature or top_p in range can make every probability 0, inf or NaN.
    """
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest set whose mass reaches top_p; the first token always stays, even when top_p * mass
        # underflows float32 (top_p ~ 1e-46).
        keep = mass_before < params.top_p * sorted_probs.sum()
        keep[0] = True
        sorted_probs = torch.where(keep, sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum()


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one row of logits [vocab]."""
    if params.temperature < GREEDY_BELOW_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(logprobs, top_n)
        top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)
