"""Qwen3-MoE: the sparse MoE block against transformers' own (routing, ties, norm_topk_prob), each token running
only the experts it picked, the checkpoint's expert tensors in both layouts, the refusals, and the engine serving a
tiny random Qwen3MoeForCausalLM with transformers' greedy tokens: cache cold and warm, page sizes 1 / 7 / 16,
batched, speculation on and off. (tests/test_model_parity.py runs the hit / chunk / preemption cases and the 1e-4
logit bound on the same fixture, as for every supported architecture.)"""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import build_checkpoint, copy_experts, hf_config, hf_greedy
from row_ways import assert_same_bits_alone_batched_and_verified
from safetensors.torch import load_file, save_file

from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import create_backend
from radixcache.worker.engine.engine import Engine, EngineConfig
from radixcache.worker.engine.request import Request, SamplingParams
from radixcache.worker.model import ModelConfig, load_checkpoint
from radixcache.worker.model.llama import attention_options, sparse_moe
from radixcache.worker.model.moe import SparseMoE
from radixcache.worker.model.packed import PackedLinear

ARCH = "Qwen3MoeForCausalLM"
MAX_NEW = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3moe")
    hf = build_checkpoint(folder, ARCH, seed=2)
    return folder, hf


def block_like(hf_block, norm_topk_prob: bool) -> SparseMoE:
    """Our block holding the weights of transformers' Qwen3MoeSparseMoeBlock `hf_block`."""
    cfg = hf_block.experts.config
    ours = sparse_moe(ModelConfig.from_hf_config({**cfg.to_dict(), "norm_topk_prob": norm_topk_prob}))
    copy_experts(hf_block, ours)
    return ours.eval()


def hf_block(norm_topk_prob: bool, seed: int = 0, **overrides):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    cfg = hf_config(ARCH, norm_topk_prob=norm_topk_prob, **overrides)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.set_experts_implementation("eager")
    block = model.model.layers[0].mlp
    assert isinstance(block, Qwen3MoeSparseMoeBlock)
    return block.eval()


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_the_block_routes_and_sums_as_transformers_does(norm_topk_prob):
    theirs = hf_block(norm_topk_prob)
    ours = block_like(theirs, norm_topk_prob)
    x = torch.randn(37, 64)
    with torch.no_grad():
        _, want_weights, want_experts = theirs.gate(x)
        weights, experts = ours.route(x)
        assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)
        assert len(set(experts.flatten().tolist())) == 8  # every expert has rows: the grouping is exercised
        torch.testing.assert_close(ours.forward(x), theirs(x[None])[0], atol=1e-6, rtol=0)


def test_tied_router_probabilities_pick_the_experts_transformers_picks():
    # Experts 2, 5 and 6 get the same router row: equal probabilities, and top-2 must choose among them as
    # torch.topk does in transformers (not, say, the highest index or a stable sort's).
    theirs = hf_block(norm_topk_prob=True, num_experts_per_tok=2)
    with torch.no_grad():
        theirs.gate.weight[5] = theirs.gate.weight[2]
        theirs.gate.weight[6] = theirs.gate.weight[2]
    ours = block_like(theirs, True)
    x = torch.randn(200, 64)
    with torch.no_grad():
        _, _, want = theirs.gate(x)
        _, got = ours.route(x)
        probs = torch.softmax(ours.gate.forward(x), -1, dtype=torch.float32)
    tied = (probs[:, 2] == probs[:, 5]) & (probs[:, 5] == probs[:, 6])
    assert tied.all()
    kth = probs.topk(2, dim=-1).values[:, 1:]
    assert int(((probs >= kth).sum(-1) > 2).sum()) >= 10  # tokens whose top 2 must leave out a tied expert
    assert torch.equal(got, want)
    torch.testing.assert_close(ours.forward(x), theirs(x[None])[0], atol=1e-6, rtol=0)


def test_a_token_runs_only_its_selected_experts():
    ours = block_like(hf_block(norm_topk_prob=True), True)
    x = torch.randn(9, 64)
    seen: dict[int, list[torch.Tensor]] = {}
    for e, expert in enumerate(ours.experts):
        original = expert.forward

        def counting(rows, e=e, original=original):
            seen.setdefault(e, []).append(rows.clone())
            return original(rows)

        expert.forward = counting
    with torch.no_grad():
        _, experts = ours.route(x)
        ours.forward(x)
    for e in range(8):
        picked_by = [t for t in range(9) if e in experts[t].tolist()]
        if not picked_by:
            assert e not in seen, f"expert {e} ran though no token picked it"
            continue
        (rows,) = seen[e]  # one call per expert, on exactly the rows of the tokens that picked it
        assert torch.equal(rows, x[picked_by])
    assert sum(calls[0].shape[0] for calls in seen.values()) == 9 * 2  # k rows a token, not num_experts


def weights_of(model) -> dict[str, torch.Tensor]:
    """Every parameter's values, the packed float32 projections' (oneDNN's layout) as dense [out, in] weights."""
    out = {name: p for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            out[f"{name}.weight"] = module.dense_weight()
    return out


def test_fused_3d_expert_tensors_load_as_the_per_expert_ones(checkpoint, tmp_path):
    folder, _ = checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    fused = {}
    for name in list(tensors):
        if ".mlp.experts." in name and name.endswith(".gate_proj.weight"):
            layer = name.split(".mlp.experts.")[0]
            if f"{layer}.mlp.experts.gate_up_proj" in fused:
                continue
            gate_up, down = [], []
            for e in range(8):
                gate = tensors.pop(f"{layer}.mlp.experts.{e}.gate_proj.weight")
                up = tensors.pop(f"{layer}.mlp.experts.{e}.up_proj.weight")
                gate_up.append(torch.cat((gate, up)))
                down.append(tensors.pop(f"{layer}.mlp.experts.{e}.down_proj.weight"))
            fused[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
            fused[f"{layer}.mlp.experts.down_proj"] = torch.stack(down)
    assert len(fused) == 4  # two sparse layers
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({**tensors, **fused}, str(tmp_path / "model.safetensors"))
    per_expert, from_fused = load_checkpoint(folder), load_checkpoint(tmp_path)
    assert weights_of(per_expert.model).keys() == weights_of(from_fused.model).keys()
    for name, a in weights_of(per_expert.model).items():
        assert torch.equal(a, weights_of(from_fused.model)[name]), name
    del fused["model.layers.2.mlp.experts.down_proj"]
    save_file({**tensors, **fused}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 8 tensors .*model\.layers\.2\.mlp\.experts\.0\.down_proj\.weight"):
        load_checkpoint(tmp_path)


def test_config_reads_transformers_names_and_refuses_what_it_cannot_serve():
    saved = hf_config(ARCH).to_dict()
    assert "num_local_experts" in saved or "num_experts" in saved
    config = ModelConfig.from_hf_config(saved)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.mlp_kinds == ("moe", "dense", "moe") and config.norm_topk_prob and config.qk_norm
    hub = {k: v for k, v in saved.items() if k != "num_local_experts"}  # the Hub's configs spell it num_experts
    stepped = ModelConfig.from_hf_config({**hub, "num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert stepped.num_experts == 4 and stepped.mlp_kinds == ("dense", "moe", "dense")
    for field, value, message in [
        ("use_sliding_window", True, "use_sliding_window"),
        ("decoder_sparse_step", 0, "decoder_sparse_step"),
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
        ("mlp_only_layers", "1", "mlp_only_layers"),
        ("moe_intermediate_size", 0, "moe_intermediate_size"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_config({**saved, field: value})


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def __call__(self, out) -> None:
        self.tokens.setdefault(out.request_id, []).extend(out.token_ids)


@pytest.fixture(scope="module")
def served(checkpoint):
    """The checkpoint loaded, 3 prompts, and transformers' greedy answer to each prompt and to each prompt continued
    by the first 3 tokens of its answer."""
    folder, hf = checkpoint
    rng = random.Random(7)
    prompts = [rng.sample(range(2, 320), 20) for _ in range(3)]
    want = {}
    for i, p in enumerate(prompts):
        want[f"a{i}"], _ = hf_greedy(hf, p, MAX_NEW)
        want[f"c{i}"], _ = hf_greedy(hf, p + want[f"a{i}"][:3], MAX_NEW)
    return load_checkpoint(folder), prompts, want


@pytest.mark.parametrize(("page_size", "speculate"), [(1, 8), (7, 8), (16, 8), (7, 0)])
def test_the_engine_serves_transformers_greedy_tokens(served, page_size, speculate):
    loaded, prompts, want = served
    engine = Engine(loaded, EngineConfig(page_size=page_size, kv_pages=256, speculate=speculate))
    sink = Sink()
    greedy = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    waves = [
        [Request(f"a{i}", p, greedy) for i, p in enumerate(prompts)],  # cold, batched
        # warm: each prompt again (its answer is in the tree: drafts) and continued by its answer's first tokens
        [Request(f"b{i}", p, greedy) for i, p in enumerate(prompts)]
        + [Request(f"c{i}", p + want[f"a{i}"][:3], greedy) for i, p in enumerate(prompts)],
    ]
    for wave in waves:
        for request in wave:
            engine.submit(request, sink)
        engine.run_until_idle()
    engine.cache.check(idle=True)
    for i in range(3):
        assert sink.tokens[f"a{i}"] == want[f"a{i}"] and sink.tokens[f"b{i}"] == want[f"a{i}"]
        assert sink.tokens[f"c{i}"] == want[f"c{i}"]
    stats = engine.stats()
    assert stats.cached_tokens >= 6 * (20 - page_size)  # the second wave hit the first's pages
    assert (stats.accepted_draft_tokens > 0) == (speculate > 0)


def test_bfloat16_routing_keeps_transformers_dtypes():
    theirs = hf_block(norm_topk_prob=True).to(torch.bfloat16)
    ours = block_like(theirs, True).to(torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        _, want_weights, want_experts = theirs.gate(x)
        weights, experts = ours.route(x)
        out = ours.forward(x)
    assert weights.dtype == want_weights.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tokens_logits_are_the_same_bits_alone_and_batched(checkpoint, dtype):
    """What speculation on == off and cache on == off rest on: a token's experts see other rows of the step (their
    row counts change with the batch), and its logits must not."""
    folder, _ = checkpoint
    loaded = load_checkpoint(folder, dtype=dtype)
    mc, page = loaded.config, 8

    def pool_and_backend():
        pool = KVPool(KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim), page_size=page, num_pages=15,
                      dtype=getattr(torch, dtype))  # fmt: skip
        return pool, create_backend("torch", attention=attention_options(mc))

    assert_same_bits_alone_batched_and_verified(loaded, page, pool_and_backend)
