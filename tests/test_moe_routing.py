"""DeepSeek V2 / V3 mixture-of-experts routing against transformers' own MoE modules (DeepseekV2Moe,
DeepseekV3MoE) on the same weights: the experts chosen and their weights bit for bit from the same router logits
(ties included), the block's output (routed experts + shared experts) within 1e-5. No attention is involved: the
MLA attention these architectures need is not served yet."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import copy_experts

from radixcache.worker.model import ModelConfig
from radixcache.worker.model.llama import sparse_moe


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


HIDDEN, EXPERTS, TOP_K, GROUPS, TOPK_GROUP, MOE_I, SHARED = 64, 16, 4, 4, 2, 16, 2


def ours_for(router: str, **fields) -> ModelConfig:
    shape = dict(
        vocab_size=8, hidden_size=HIDDEN, intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=4,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=MOE_I, moe_n_group=GROUPS,
        moe_topk_group=TOPK_GROUP, shared_expert_intermediate_size=MOE_I * SHARED,
    )  # fmt: skip
    return ModelConfig(**{**shape, "moe_router": router, **fields})


def randomised(module, seed: int):
    """transformers' module with every parameter drawn (std 0.25) and, for V3, a correction bias that matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
        bias = getattr(module.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return module.eval()


def v3(norm_topk_prob: bool, seed: int = 0):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=GROUPS,
        topk_group=TOPK_GROUP, n_shared_experts=SHARED, moe_intermediate_size=MOE_I, routed_scaling_factor=2.5,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    cfg._experts_implementation = "eager"
    theirs = randomised(DeepseekV3MoE(cfg), seed)
    ours = sparse_moe(ours_for("deepseek_v3", norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)).eval()
    copy_experts(theirs, ours)
    return theirs, ours


def v2(topk_method: str, seed: int = 0):
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    cfg = transformers.DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=GROUPS,
        topk_group=TOPK_GROUP, n_shared_experts=SHARED, moe_intermediate_size=MOE_I, routed_scaling_factor=1.5,
        topk_method=topk_method,
    )  # fmt: skip
    cfg._experts_implementation = "eager"
    theirs = randomised(DeepseekV2Moe(cfg), seed)
    limited = topk_method == "group_limited_greedy"
    ours = sparse_moe(ours_for("deepseek_v2", moe_group_limited=limited, routed_scaling_factor=1.5)).eval()
    copy_experts(theirs, ours)
    return theirs, ours


def compare(theirs, ours, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing bit for bit from transformers' logits, and the block's output; returns (logits, experts)."""
    with torch.no_grad():
        logits, want_weights, want_experts = theirs.gate(x)
        weights, experts = ours.routing(logits, ours.e_score_correction_bias)
        assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)
        assert weights.dtype == torch.float32
        torch.testing.assert_close(ours.forward(x), theirs(x[None])[0], atol=1e-5, rtol=0)
    return logits, experts


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_routing_and_block_match_transformers(norm_topk_prob):
    theirs, ours = v3(norm_topk_prob)
    x = torch.randn(48, HIDDEN, generator=torch.Generator().manual_seed(1))
    logits, experts = compare(theirs, ours, x)
    groups = experts // (EXPERTS // GROUPS)
    assert all(len(set(row.tolist())) <= TOPK_GROUP for row in groups)  # only the chosen groups' experts
    scores = logits.sigmoid()
    unbiased = scores.topk(TOP_K, dim=-1)[1].sort(-1).values
    assert not torch.equal(unbiased, experts.sort(-1).values)  # the bias and the group limit change choices
    with torch.no_grad():
        weights, _ = ours.routing(logits, ours.e_score_correction_bias)
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.full((48,), 2.5), atol=1e-5, rtol=0)


def test_deepseek_v3_ties_pick_what_transformers_picks():
    # Experts 1, 5 and 9 (groups 0, 1, 2) get the same router row and bias, and groups 0 and 3 the same rows
    # throughout: equal scores inside a group, across groups, and equal group scores.
    theirs, _ = v3(True)
    with torch.no_grad():
        w, b = theirs.gate.weight, theirs.gate.e_score_correction_bias
        for e in (5, 9):
            w[e], b[e] = w[1], b[1]
        w[12:16], b[12:16] = w[0:4], b[0:4]
    ours = sparse_moe(ours_for("deepseek_v3", norm_topk_prob=True, routed_scaling_factor=2.5)).eval()
    copy_experts(theirs, ours)
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(2))
    _, experts = compare(theirs, ours, x)
    assert any(len(set(row.tolist()) & {1, 5, 9}) in (1, 2) for row in experts)  # a tie at the cut


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_and_block_match_transformers(topk_method):
    theirs, ours = v2(topk_method)
    x = torch.randn(48, HIDDEN, generator=torch.Generator().manual_seed(3))
    _, experts = compare(theirs, ours, x)
    spread = max(len(set((row // (EXPERTS // GROUPS)).tolist())) for row in experts)
    assert (spread <= TOPK_GROUP) == (topk_method == "group_limited_greedy")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"moe_router": "noaux_tc"}, "unknown router 'noaux_tc'"),
        ({"moe_n_group": 3}, "n_group 3 does not divide the 16 experts"),
        ({"moe_topk_group": 5}, "topk_group must be in"),
        ({"moe_n_group": 16, "moe_topk_group": 4}, "two best experts"),
        ({"moe_n_group": 4, "moe_topk_group": 1, "num_experts_per_tok": 5}, "hold fewer than 5"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ],
)
def test_routing_it_cannot_run_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ours_for("deepseek_v3", **fields)
