"""Tiny random Hugging Face checkpoints of every supported architecture saved to disk, for parity and loader tests.

Every checkpoint is a real folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) built
with transformers' save_pretrained and a byte-level BPE trained here with `tokenizers`, so load_checkpoint runs
its real path. Weights are drawn with a large std so the logits are far from uniform (greedy ties impossible).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a prefix cache shares pages between requests that start the same way",
    "paged attention reads keys and values through a block table",
    "héllo wörld, ça va? 日本語のテキスト and emoji 🙂 too",
] * 8
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer_files(folder: Path, with_chat_template: bool = True) -> None:
    """Train a tiny byte-level BPE (vocab <= VOCAB) and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True}
    if with_chat_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


WINDOW = 8  # the sliding window of the sliding-window fixtures: their test sequences span several windows
# What Gemma 2 and 3 fixtures share: a sliding layer, then a global one, and a scale other than head_dim ** -0.5.
GEMMA = dict(
    head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24
)


# Every tiny config's fields before its architecture's own (hf_config).
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
    initializer_range=0.25,
)


def deepseek_fields(arch: str) -> dict[str, object]:
    """What a tiny DeepSeek V2 / V3 config sets over COMMON, as config.json fields (no transformers needed: also what
    scripts/gpu_check.py builds its MLA model from, with FlashInfer's 512 / 64 latent).

    MLA: 4 heads, latent 32 + roped 8 (a latent page holds 40 values), q_lora_rank 24 (V2 overrides it to None for
    V2-Lite's one q_proj); 3 layers, the first dense (first_k_dense_replace), 8 routed experts in 4 groups, 2 chosen,
    a shared expert. V2 limits groups greedily; V3 scores with sigmoid and a correction bias and scales RoPE with
    yarn (mscale_all_dim changes the softmax scale)."""
    fields: dict[str, object] = dict(
        num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=1.5,
    )  # fmt: skip
    if arch == "DeepseekV2ForCausalLM":
        fields.update(topk_method="group_limited_greedy", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    elif arch == "DeepseekV3ForCausalLM":
        fields.update(
            norm_topk_prob=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
            },
        )  # fmt: skip
    else:
        raise ValueError(arch)
    return fields


def deepseek_config_json(arch: str, **overrides: object) -> dict[str, object]:
    """A tiny DeepSeek config as config.json holds it (COMMON, deepseek_fields, then `overrides`), built without
    transformers: ModelConfig.from_hf_config reads it as it reads hf_config(arch, **overrides).to_dict()
    (tests/test_gpu_check.py checks that)."""
    model_type = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}[arch]
    return {**COMMON, **deepseek_fields(arch), **overrides, "architectures": [arch], "model_type": model_type}


def hf_config(arch: str, **overrides: object):  # noqa: ANN201 (transformers config class)
    """A tiny transformers config of `arch` (hidden 64, 2 layers, 4 heads over 2 KV heads), each exercising what its
    architecture adds: Mistral slides every layer over WINDOW tokens; Gemma 2/3 interleave a sliding and a global
    layer with a query_pre_attn_scalar != head_dim (Gemma 2 soft-caps tightly enough to matter, Gemma 3 scales the
    global RoPE linearly); Phi-3 has longrope with a partial rotary; Qwen3-MoE has 3 layers, the middle one dense."""
    import transformers

    common = dict(COMMON)
    if arch == "LlamaForCausalLM":
        common.update(
            tie_word_embeddings=True,
            attention_bias=True,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        cls = transformers.LlamaConfig
    elif arch == "MistralForCausalLM":
        common.update(sliding_window=WINDOW, head_dim=32, rope_theta=1e6)  # head_dim != hidden/heads
        cls = transformers.MistralConfig
    elif arch == "Qwen2ForCausalLM":
        common.update(num_key_value_heads=1, rope_theta=1e6)  # GQA ratio 4, q/k/v bias
        cls = transformers.Qwen2Config
    elif arch == "Qwen3ForCausalLM":
        common.update(head_dim=32, tie_word_embeddings=True, rope_theta=1e6)  # q/k norms over head_dim 32
        cls = transformers.Qwen3Config
    elif arch == "Qwen3MoeForCausalLM":
        # 8 experts, top 2 renormalised; layer 1 dense (mlp_only_layers), so both MLP kinds load and run.
        common.update(
            num_hidden_layers=3, head_dim=16, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        )  # fmt: skip
        cls = transformers.Qwen3MoeConfig
    elif arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        common.update(deepseek_fields(arch))
        cls = transformers.DeepseekV2Config if arch == "DeepseekV2ForCausalLM" else transformers.DeepseekV3Config
    elif arch == "Gemma2ForCausalLM":
        common.update(GEMMA, attn_logit_softcapping=4.0, final_logit_softcapping=8.0)
        cls = transformers.Gemma2Config
    elif arch == "Gemma3ForCausalLM":
        common.update(
            GEMMA,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
        cls = transformers.Gemma3TextConfig
    elif arch == "Phi3ForCausalLM":
        # longrope: the served context (512) is past original_max_position_embeddings (16), so the long factors
        # apply, as transformers applies them to every sequence longer than 16 tokens (the tests' prompts are).
        common.update(
            max_position_embeddings=512,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
            pad_token_id=None,
        )
        cls = transformers.Phi3Config
    else:
        raise ValueError(arch)
    common.update(overrides)
    cfg = cls(**common)
    cfg.architectures = [arch]
    return cfg


def build_checkpoint(folder: Path, arch: str, seed: int = 0, **overrides: object):  # noqa: ANN201
    """Save a seeded random `arch` checkpoint into `folder`; returns the transformers model (fp32, eval)."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    model = getattr(transformers, arch)(cfg).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the reference: transformers' own expert-by-expert loop
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Default init leaves biases at 0 and norms at 1: randomise them so loading them is tested too.
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith("gate.weight") and "DeepseekV3" in arch:
                param.normal_(0.0, 0.25)  # transformers 5 zero-initialises V3's router: every score would tie
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek V3's router bias: choices must depend on it
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer_files(folder)
    return model


def hf_greedy(model, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001
    """transformers' greedy continuation (recomputing the whole sequence each step) and the float32 logits
    [len(prompt) + max_new - 1, vocab] of every position of the final sequence."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([tokens])).logits[0]
            tokens.append(int(logits[-1].argmax()))
        logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
    return tokens[len(prompt) :], logits


def copy_experts(theirs, ours) -> None:  # noqa: ANN001 (a transformers MoE module, our SparseMoE)
    """transformers' router and fused 3-D experts (and shared experts, if any) into our block."""
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(theirs.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])
        if ours.shared_experts is not None:
            shared = theirs.shared_experts
            ours.shared_experts.gate_up_proj.weight.copy_(torch.cat((shared.gate_proj.weight, shared.up_proj.weight)))
            ours.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
