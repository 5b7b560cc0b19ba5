"""The sparse mixture-of-experts MLP (Qwen3-MoE; DeepSeek V2/V3's routing and shared experts): a router picks each
token's top-k experts, and each token runs only those.

Routing (`Routing`) is each architecture's as transformers defines it, down to its torch.topk calls, so equal
scores pick the same experts: Qwen3-MoE's softmax top-k (norm_topk_prob), DeepSeek V2's softmax with optional
group-limited greedy choice, DeepSeek V3's sigmoid scores with e_score_correction_bias and group-limited top-k;
routed_scaling_factor. A token's output is sum over its experts e, in ascending e, of weight_e * expert_e(x)
(transformers adds expert by expert in that order, starting from zeros), plus the shared experts' MLP where the
architecture has one.

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
from dataclasses import dataclass

import torch
from torch import nn

# transformers 5's fused 3-D expert tensors (no ".weight" suffix) -> the per-expert names they hold, in order
_FUSED_EXPERTS = {".mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), ".mlp.experts.down_proj": ("down_proj",)}


ROUTERS = ("softmax", "deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class Routing:
    """How router logits [T, E] pick each token's top_k experts and weight them, as transformers defines it:

    - "softmax" (Qwen3-MoE): logits in the model's dtype; softmax in float32; torch.topk (sorted); with
      norm_topk_prob the weights divided by their sum; weights cast to the logits' dtype.
    - "deepseek_v2": float32 logits; softmax; without group_limited, topk(sorted=False); with it (topk_method
      "group_limited_greedy"), only the topk_group of n_group expert groups with the highest best score compete
      (the others' scores set to 0); weights times routed_scaling_factor (no renormalisation: transformers' V2
      router has none).
    - "deepseek_v3": float32 logits; scores = sigmoid; experts are chosen on scores + e_score_correction_bias: the
      topk_group groups with the highest sum of their two best biased scores, then topk(sorted=False) over those
      groups' experts (the rest -inf); weights are the chosen experts' unbiased scores, with norm_topk_prob divided
      by (their sum + 1e-20), times routed_scaling_factor; they stay float32.
    Every topk is the call transformers makes, so tied scores choose the same experts.
    """

    kind: str
    top_k: int
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_limited: bool = False  # deepseek_v2's topk_method "group_limited_greedy"

    def __post_init__(self) -> None:
        if self.kind not in ROUTERS:
            raise ValueError(f"unknown router {self.kind!r}; supported: {', '.join(ROUTERS)}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")

    @property
    def float32_logits(self) -> bool:
        """The router's product runs in float32 (its input cast up; its weight must be float32)."""
        return self.kind != "softmax"

    def check_experts(self, num_experts: int) -> None:
        """ValueError unless `num_experts` experts can be routed: top_k of them, in n_group equal groups, the
        groups that compete holding at least top_k experts (and, for deepseek_v3, two each)."""
        if self.top_k > num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} exceeds the {num_experts} experts")
        if num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} does not divide the {num_experts} experts")
        per_group = num_experts // self.n_group
        grouped = self.kind == "deepseek_v3" or (self.kind == "deepseek_v2" and self.group_limited)
        if grouped and self.topk_group * per_group < self.top_k:
            raise ValueError(f"topk_group {self.topk_group} groups of {per_group} experts hold fewer than {self.top_k}")
        if self.kind == "deepseek_v3" and per_group < 2:
            raise ValueError(
                f"deepseek_v3 routing ranks groups by their two best experts: n_group {self.n_group} "
                f"leaves {per_group} per group"
            )

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], experts [T, top_k] int64); bias: deepseek_v3's e_score_correction_bias [E]."""
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype), experts
        if self.kind == "deepseek_v2":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.group_limited:
                best = scores.view(-1, self.n_group, scores.shape[-1] // self.n_group).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(best, scores.shape[-1]), 0.0)
            weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            return weights * self.routed_scaling_factor, experts
        if bias is None:
            raise ValueError("deepseek_v3 routing needs e_score_correction_bias")
        scores = logits.sigmoid()
        biased = scores + bias
        group_scores = biased.view(-1, self.n_group, scores.shape[-1] // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        biased = biased.masked_fill(~self._group_mask(group_scores, scores.shape[-1]), float("-inf"))
        experts = torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts

    def _group_mask(self, group_scores: torch.Tensor, num_experts: int) -> torch.Tensor:
        """[T, E] bool: the experts of each token's topk_group best groups (group_scores [T, n_group])."""
        chosen = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
        t, groups = group_scores.shape
        return mask[:, :, None].expand(t, groups, num_experts // groups).reshape(t, num_experts)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP over [T, hidden] rows: each row's routed experts' weighted sum (combine), plus the
    shared experts' MLP of every row where the architecture has one (DeepSeek: routed sum + shared(x)).

    make_expert() builds one routed expert (a gated MLP: [n, hidden] -> [n, hidden]); make_router(hidden, experts)
    the router's linear map (no bias; HF's mlp.gate); shared: the shared experts as one MLP, or None. They come
    from the decoder so that its row-exact projection class is used. deepseek_v3 routing adds the parameter
    e_score_correction_bias [E] (HF names it mlp.gate.e_score_correction_bias). With DeepSeek routing the router's
    product runs in float32, so its weight must stay float32 in a 16-bit model, as transformers keeps it
    (_keep_in_fp32_modules_strict): CausalLM.keep_float32_routers, which the loader calls."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        routing: Routing,
        make_expert: Callable[[], nn.Module],
        make_router: Callable[[int, int], nn.Module],
        shared: nn.Module | None = None,
    ) -> None:
        super().__init__()
        routing.check_experts(num_experts)
        self.routing = routing
        self.gate = make_router(hidden_size, num_experts)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.shared_experts = shared
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False) if routing.kind == "deepseek_v3" else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k] int64) of each row of x [T, hidden] (Routing's order and dtypes)."""
        logits = self.gate.forward(x.float() if self.routing.float32_logits else x)
        return self.routing(logits, self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = combine(x, weights, experts, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts.forward(x)


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
        out.index_add_(0, rows, y.to(out.dtype))  # float32 weights (DeepSeek V3) multiply first, as transformers
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
