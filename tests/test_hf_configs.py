"""Reading each architecture's config.json (transformers 5 as saved by the fixtures, and transformers 4 spellings
as checkpoints on the Hub have them), the refusals, and RoPE frequencies against transformers' own."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import WINDOW, hf_config

from radixcache.worker.model import ModelConfig
from radixcache.worker.model.rope import cos_sin, rope_frequencies

TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}


def read(arch: str, **fields: object) -> ModelConfig:
    return ModelConfig.from_hf_config({"architectures": [arch], **TINY, **fields})


def test_each_new_architecture_reads_what_it_adds() -> None:
    qwen3 = ModelConfig.from_hf_config(hf_config("Qwen3ForCausalLM").to_dict())
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32 and qwen3.layer_kinds == ("global",) * 2
    gemma2 = ModelConfig.from_hf_config(hf_config("Gemma2ForCausalLM").to_dict())
    assert (gemma2.layer_windows, gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == ((WINDOW, None), 4.0, 8.0)
    assert gemma2.norm_plus_one and gemma2.sandwich_norms and not gemma2.qk_norm
    assert gemma2.embedding_scale == 8.0 and gemma2.attention_scale == 24**-0.5
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.tie_word_embeddings
    gemma3 = ModelConfig.from_hf_config(hf_config("Gemma3ForCausalLM").to_dict())
    assert gemma3.qk_norm and gemma3.attn_logit_softcap is None and gemma3.final_logit_softcap is None
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_scaling) == (
        1e6, 1e4, {"rope_type": "linear", "factor": 4.0}
    )  # fmt: skip
    phi3 = ModelConfig.from_hf_config(hf_config("Phi3ForCausalLM").to_dict())
    assert phi3.checkpoint_fuses_projections and phi3.rotary_dim == 8 and phi3.layer_windows == (None, None)
    assert phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == 16


def test_transformers_4_spellings() -> None:
    gemma3 = read(
        "Gemma3ForCausalLM", num_hidden_layers=12, num_key_value_heads=1, head_dim=16, rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
        sliding_window_pattern=6, query_pre_attn_scalar=16,
    )  # fmt: skip
    assert gemma3.layer_kinds == (("sliding",) * 5 + ("global",)) * 2
    assert (gemma3.rope_local_theta, gemma3.rope_scaling["factor"], gemma3.sliding_window) == (1e4, 8.0, 512)
    assert gemma3.tie_word_embeddings and gemma3.rms_norm_eps == 1e-6  # Gemma's class defaults when omitted
    gemma2 = read("Gemma2ForCausalLM", num_hidden_layers=4, head_dim=16, num_key_value_heads=2)
    assert gemma2.layer_kinds == ("sliding", "global") * 2 and gemma2.sliding_window == 4096
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3 = read(
        "Phi3ForCausalLM", num_hidden_layers=2, rope_scaling={"type": "su", **factors},
        original_max_position_embeddings=4096, max_position_embeddings=131072, sliding_window=2047,
    )  # fmt: skip
    assert (
        phi3.rope_scaling["rope_type"] == "longrope" and phi3.rope_scaling["original_max_position_embeddings"] == 4096
    )
    assert phi3.layer_windows == (2047, 2047) and phi3.max_position_embeddings == 131072  # windowed, not capped
    qwen3 = read(
        "Qwen3ForCausalLM", num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    assert qwen3.layer_windows == (None, 16, 16)  # transformers: layers from max_window_layers on slide
    qwen2 = read("Qwen2ForCausalLM", num_hidden_layers=2, use_sliding_window=False, sliding_window=16)
    assert qwen2.layer_windows == (None, None)


@pytest.mark.parametrize(
    ("arch", "fields", "message"),
    [
        ("Gemma3ForConditionalGeneration", {}, "only its text model, Gemma3ForCausalLM"),
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("Gemma2ForCausalLM", {"layer_types": ["chunked_attention"] * 2}, "layer_types: unsupported kind"),
        ("LlamaForCausalLM", {"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
        ("Phi3ForCausalLM", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                             "original_max_position_embeddings": 8}}, "short_factor must list 8 numbers"),
        ("Phi3ForCausalLM", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                             "long_factor": [1.0] * 8}}, "missing original_max_position_embeddings"),
    ],
)  # fmt: skip
def test_unservable_configs_are_refused_naming_the_field(arch: str, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read(arch, num_hidden_layers=2, **fields)


def test_model_config_validates_layer_kinds() -> None:
    shape = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 8, "num_layers": 2, "num_heads": 4}
    with pytest.raises(ValueError, match="layer_kinds has 1 entries for 2 layers"):
        ModelConfig(**shape, num_kv_heads=2, layer_kinds=("global",))
    with pytest.raises(ValueError, match="sliding layers need sliding_window"):
        ModelConfig(**shape, num_kv_heads=2, layer_kinds=("sliding", "global"))
    with pytest.raises(ValueError, match="unknown layer kind 'local'"):
        ModelConfig(**shape, num_kv_heads=2, layer_kinds=("local", "global"), sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        ModelConfig(**shape, num_kv_heads=2, sliding_window=0)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig(**shape, num_kv_heads=2, partial_rotary_factor=0.1)  # 1.6 of 16 dimensions
    assert ModelConfig(**shape, num_kv_heads=2, sliding_window=4).layer_windows == (4, 4)  # Mistral's default
    wide = ModelConfig(**shape, num_kv_heads=2, sliding_window=4096, max_position_embeddings=4096)
    assert (wide.layer_kinds, wide.sliding_window) == (("global", "global"), None)  # a window that never cuts


def _hf_rotation(hf_cfg, layer_type: str | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """transformers' cos and sin [length, rotary_dim] for positions 0..length-1 (one forward over them)."""
    import transformers

    model = getattr(transformers, hf_cfg.architectures[0])(hf_cfg)
    rotary = model.model.rotary_emb
    x = torch.zeros(1, length, 4)
    args = (layer_type,) if layer_type is not None else ()
    cos, sin = rotary(x, torch.arange(length)[None], *args)
    return cos[0], sin[0]


@pytest.mark.parametrize(
    ("arch", "overrides", "local", "length"),
    [
        ("LlamaForCausalLM", {}, False, 40),  # llama3 scaling
        ("Gemma3ForCausalLM", {}, False, 40),  # linear, global layers
        ("Gemma3ForCausalLM", {}, True, 40),  # the sliding layers' own base
        ("Phi3ForCausalLM", {}, False, 40),  # longrope, long factors (context 512 > 16, sequence 40 > 16)
        ("Phi3ForCausalLM", {"max_position_embeddings": 16}, False, 12),  # short factors: a 16-token context
    ],
)
def test_rope_matches_transformers(arch: str, overrides: dict, local: bool, length: int) -> None:
    hf_cfg = hf_config(arch, **overrides)
    config = ModelConfig.from_hf_config(hf_cfg.to_dict())
    inv_freq, factor = rope_frequencies(config, local=local)
    cos, signed_sin = (t[:, 0] for t in cos_sin(torch.arange(length), inv_freq, factor, torch.float32))
    layer_type = None if arch != "Gemma3ForCausalLM" else ("sliding_attention" if local else "full_attention")
    want_cos, want_sin = _hf_rotation(hf_cfg, layer_type, length)
    half = cos.shape[-1] // 2
    torch.testing.assert_close(cos, want_cos, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat((-signed_sin[:, :half], signed_sin[:, half:]), -1), want_sin, atol=0, rtol=0)
