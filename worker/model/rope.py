"""Rotary position embeddings: the frequencies of each layer kind and the rotation itself.

A model has one or two rotations: every layer's (rope_theta with rope_scaling), and with rope_local_theta set
(Gemma 3) an unscaled one of that base for its sliding layers. Frequencies are computed as transformers computes
them (same operations, float32), so rotated q/k match it bit for bit in float32.

longrope (Phi-3): transformers picks the short or the long factors per forward, by the longest sequence in it, so
the K of one cached prefix would be rotated two ways as a sequence grows past original_max_position_embeddings.
Here the choice is made once, as vLLM makes it: the long factors when the served context
(max_position_embeddings) exceeds original_max_position_embeddings, else the short ones. Identical to
transformers for every sequence of a short-context checkpoint, and for sequences longer than
original_max_position_embeddings of a long-context one.
"""

from __future__ import annotations

import math

import torch

from radixcache.worker.model.config import ModelConfig


def rope_frequencies(config: ModelConfig, *, local: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, attention_factor) of the global layers' rotation, or with local=True of
    the sliding layers' (config.rope_local_theta, unscaled). attention_factor multiplies cos and sin (longrope)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if local:
        assert config.rope_local_theta is not None, "no local rotation configured"
        return 1.0 / (config.rope_local_theta**exponents), 1.0
    scaling = config.rope_scaling
    kind = None if scaling is None else scaling["rope_type"]
    if kind == "longrope":
        return _longrope(config, exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(config, exponents)
    return inv_freq, 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(config: ModelConfig, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek V2/V3): frequencies blended between interpolated (divided by factor) and extrapolated ones
    by a linear ramp over the dimensions between the beta_fast and beta_slow correction bounds (truncated to whole
    dimensions unless truncate is false); attention_factor mscale(mscale) / mscale(mscale_all_dim) when both are
    set, else mscale(1). As transformers computes them, in float32."""
    scaling = config.rope_scaling
    assert scaling is not None
    dim, base, factor = config.rotary_dim, config.rope_theta, float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim else _yarn_mscale(factor)
        )
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base**exponents
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _longrope(config: ModelConfig, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    scaling = config.rope_scaling
    assert scaling is not None
    original = int(scaling["original_max_position_embeddings"])
    long = config.max_position_embeddings > original  # once, for every position (see the module docstring)
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / (ext * config.rope_theta**exponents)
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention_factor)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed_sin [T, 1, rotary_dim] for the step's positions (see `rotate`), scaled by attention_factor."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    sin = freqs.sin()
    cos = freqs.cos().repeat(1, 2)
    signed_sin = torch.cat((-sin, sin), dim=-1)
    if attention_factor != 1.0:
        cos, signed_sin = cos * attention_factor, signed_sin * attention_factor
    return cos.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [T, heads, D] with cos/signed_sin [T, 1, R] over the first R dimensions (half-split pairing: element i
    pairs with i + R/2; dimensions R.. pass through unrotated).

    signed_sin is sin with its first half negated, so the rotation is x*cos + roll(x, R/2)*signed_sin: the same
    products as Hugging Face's x*cos + cat(-x2, x1)*sin (negation is exact), in 4 ops instead of 6."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + x.roll(rotary // 2, -1) * signed_sin
    head = x[..., :rotary]
    return torch.cat((head * cos + head.roll(rotary // 2, -1) * signed_sin, x[..., rotary:]), dim=-1)
