"""Multi-head latent attention (DeepSeek V2 / V3), attending over latent pages with the up-projections absorbed.

Per token and layer the cache holds one latent: c = kv_a_layernorm(the first kv_lora_rank outputs of
kv_a_proj_with_mqa) followed by k_pe = the last qk_rope_head_dim outputs, roped (one key "head" every query head
shares). How a pool page holds it: radixcache/pool.py, "Latent pages". No per-head key or value is ever formed:

    q_h = [q_nope_h | q_pe_h]                     (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj; q_pe roped)
    q_lat_h = q_nope_h @ W_UK_h                   W_UK_h: head h's key rows of kv_b_proj, [qk_nope_head_dim, R]
    s_h(j) = scale * ([q_lat_h | q_pe_h] . [c_j | k_pe_j])
    o_h = (softmax(s_h) @ c) @ W_UV_h^T           W_UV_h: head h's value rows of kv_b_proj, [v_head_dim, R]
    out = o_proj([o_1 | ... | o_H])

which is transformers' expanded attention (k_h = [W_UK_h c | k_pe], v_h = W_UV_h c) with the products
reassociated: equal in exact arithmetic, within float rounding of it. The attention itself is single-KV-head
attention of head_dim R + P whose values are the same latents (AttentionOptions.latent: forward hands the backend
each new latent as two halves, which the pool stores token-contiguous, and the torch backend reads every position's
latent back whole by token row); its output's first R dimensions are softmax(s) @ c. Every step, prefill
included, takes this one path, so a token's result is the same bits as a decode, a batch member, a verify row or a
chunk row (the torch backend's promise); the absorbed products run a fixed number of rows at a time
(worker/model/row_tiles.py) for the same reason.

RoPE: DeepSeek rotates interleaved pairs (ModelConfig.mla_rope_layout): V2 as a complex product in float32, its
output left interleaved; V3 returns the rotated pairs as [evens | odds]; mla_rotate reproduces each.
"""

from __future__ import annotations

import torch
from torch import nn

from radixcache.pool import KVLayer
from radixcache.worker.attention.base import AttentionBackend
from radixcache.worker.attention.layout import BatchLayout
from radixcache.worker.model.config import ModelConfig
from radixcache.worker.model.row_tiles import by_row_tiles, row_tile

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV2RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def mla_rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, layout: str) -> torch.Tensor:
    """RoPE of [T, heads, P] by ModelConfig.mla_rope_layout, with cos / signed_sin [T, 1, P] as rope.cos_sin gives
    them (half-split: frequency i at i and i + P/2). "pairs" and "pairs_split" rotate pairs (x_2i, x_2i+1) by
    frequency i: the evens and odds are gathered to [evens | odds], rotated half-split, and for "pairs" interleaved
    back (in float32: transformers' complex product, cos / sin given in float32)."""
    if layout == "halves":
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
    split = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    if layout == "pairs_split":
        return split * cos + split.roll(x.shape[-1] // 2, -1) * signed_sin
    xf = split.float()
    rotated = xf * cos + xf.roll(x.shape[-1] // 2, -1) * signed_sin
    evens, odds = rotated.chunk(2, dim=-1)
    return torch.stack((evens, odds), dim=-1).flatten(-2).to(x.dtype)


def _per_head(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [T, H, a] @ weights [H, a, b] -> [T, H, b], each head's product GEMM-tiled to a fixed row count."""
    t, heads, a = x.shape
    tile = row_tile(x.dtype)
    if x.device.type != "cpu":
        return torch.bmm(x.transpose(0, 1), weights).transpose(0, 1)
    flat = x.reshape(t, heads * a)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return torch.bmm(rows.view(-1, heads, a).transpose(0, 1), weights).transpose(0, 1).reshape(rows.shape[0], -1)

    return by_row_tiles(flat, product, tile).view(t, heads, -1)


class UpProjection(nn.Module):
    """kv_b_proj's weight [H * (nope + v), R], held but never run as a projection (it is absorbed): not an
    nn.Linear, so packing and int8 weight quantization leave it as the checkpoint has it."""

    def __init__(self, rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, rank))


class LatentAttention(nn.Module):
    """DeepSeek's attention; parameters named as transformers' (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). forward writes each new token's latent into the layer's
    latent pages and attends over them (see the module docstring)."""

    def __init__(self, config: ModelConfig, layer_idx: int, linear: type[nn.Linear], norm: type[nn.Module]) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.rope_layout = config.mla_rope_layout
        qk = self.nope + self.rope
        hidden = config.hidden_size
        self.q_lora = config.q_lora_rank is not None
        if config.q_lora_rank is None:
            self.q_proj = linear(hidden, self.heads * qk, bias=False)
        else:
            self.q_a_proj = linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = norm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linear(config.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = norm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = UpProjection(self.rank, self.heads * (self.nope + self.v_dim))
        self.o_proj = linear(self.heads * self.v_dim, hidden, bias=False)
        self._absorbed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV^T [H, R, v]) from kv_b_proj, contiguous; recomputed when its weight changes."""
        weight = self.kv_b_proj.weight
        if self._absorbed is None or self._absorbed[0] is not weight or self._absorbed[1].dtype != weight.dtype:
            w = weight.detach().view(self.heads, self.nope + self.v_dim, self.rank)
            uk = w[:, : self.nope].contiguous()
            uv_t = w[:, self.nope :].transpose(1, 2).contiguous()
            self._absorbed = (weight, uk, uv_t)
        return self._absorbed[1], self._absorbed[2]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: BatchLayout,
        kv_layer: KVLayer,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x)))
        else:
            q = self.q_proj.forward(x)
        q = q.view(t, self.heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        compressed = self.kv_a_proj_with_mqa.forward(x)
        c = self.kv_a_layernorm.forward(compressed[:, : self.rank].contiguous())
        k_pe = compressed[:, None, self.rank :]
        # q_pe and k_pe rotate together: one [T, H + 1, P] tensor
        rotated = mla_rotate(torch.cat((q_pe, k_pe), dim=1), cos, sin, self.rope_layout)
        q_pe, k_pe = rotated.split([self.heads, 1], dim=1)
        uk, uv_t = self.absorbed()
        q_lat = _per_head(q_nope.contiguous(), uk)
        query = torch.cat((q_lat, q_pe.to(q_lat.dtype)), dim=-1)
        latent = torch.cat((c, k_pe[:, 0].to(c.dtype)), dim=-1)[:, None, :]  # [T, 1, R + P]
        half = latent.shape[-1] // 2
        out = backend.forward(self.layer_idx, query, latent[..., :half], latent[..., half:], kv_layer, layout)
        o = _per_head(out[..., : self.rank].contiguous(), uv_t)  # [T, H, v]
        return self.o_proj.forward(o.reshape(t, self.heads * self.v_dim))
