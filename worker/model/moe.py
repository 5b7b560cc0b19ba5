"""The sparse mixture-of-experts MLP (Qwen3-MoE): a router picks each token's top-k experts, and each token runs
only those.

Routing, as transformers defines it for Qwen3-MoE: router logits = x @ gate.T in the model's dtype; probabilities
= softmax over the experts in float32; `torch.topk(probs, k, dim=-1)` (the same call, so equal probabilities pick
the same experts); with norm_topk_prob the k weights are divided by their sum; the weights are cast to the model's
dtype. A token's output is sum over its experts e, in ascending e, of weight_e * expert_e(x) (transformers adds
expert by expert in that order, starting from zeros).

Execution: the (token, expert) pairs are sorted by expert (a stable sort), and each expert that any token picked
runs its gated MLP once, on exactly the rows of the tokens that picked it; the weighted rows are index-added into
the output, expert by expert in ascending order. No expert runs for a token that did not pick it. A token's row
does not depend on the other rows of the step: its experts' products are row-exact (the `Linear` the caller gives,
padded to fixed row counts, or the packed float32 kernel that replaces it) and its sum has a fixed order.

The checkpoint names are transformers': `mlp.gate.weight` (the router) and per expert
`mlp.experts.E.{gate,up,down}_proj.weight`; transformers 5 may hold them fused as 3-D `mlp.experts.gate_up_proj`
[E, 2 * I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I], which `split_fused_experts` turns into the
per-expert names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

# transformers 5's fused 3-D expert tensors (no ".weight" suffix) -> the per-expert names they hold, in order
_FUSED_EXPERTS = {".mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), ".mlp.experts.down_proj": ("down_proj",)}


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP over [T, hidden] rows; see the module docstring for what it computes.

    make_expert() builds one expert (a gated MLP: [n, hidden] -> [n, hidden]); make_router(hidden, experts) the
    router's linear map (no bias). Both come from the decoder so that its row-exact projection class is used."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        make_expert: Callable[[], nn.Module],
        make_router: Callable[[int, int], nn.Module],
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = make_router(hidden_size, num_experts)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k] int64) of each row of x [T, hidden], in topk's order."""
        logits = self.gate.forward(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        return combine(x, weights, experts, self.experts)


def combine(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, modules: nn.ModuleList | list[nn.Module]
) -> torch.Tensor:
    """sum over k of weights[t, k] * modules[experts[t, k]](x[t]) for every row t, each expert run once on the rows
    that chose it, the terms added in ascending expert order (transformers' order). experts: [T, k], distinct per
    row."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(modules)).tolist()  # one host sync per layer: the loop needs it
    rows_of = order // k  # the token of each (token, expert) pair, grouped by expert
    weight_of = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = rows_of[start : start + n]
        y = modules[e].forward(x[rows]) * weight_of[start : start + n, None]
        out.index_add_(0, rows, y)
        start += n
    return out


def split_fused_experts(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every fused 3-D expert tensor (transformers 5's layout, see the module
    docstring) replaced by its per-expert 2-D tensors under the per-expert names; others pass through. A fused
    tensor that is not 3-D, or whose rows do not split into its parts, is a ValueError naming it."""
    for name, tensor in tensors:
        fused = next((f for f in _FUSED_EXPERTS if name.endswith(f)), None)
        if fused is None:
            yield name, tensor
            continue
        parts = _FUSED_EXPERTS[fused]
        if tensor.dim() != 3 or tensor.shape[1] % len(parts):
            raise ValueError(
                f"{name}: expected a 3-D [experts, {len(parts)} x rows, columns] tensor, got {tuple(tensor.shape)}"
            )
        prefix = name[: -len(fused)] + ".mlp.experts"
        for e in range(tensor.shape[0]):
            for part, rows in zip(parts, tensor[e].chunk(len(parts)), strict=True):
                yield f"{prefix}.{e}.{part}.weight", rows
