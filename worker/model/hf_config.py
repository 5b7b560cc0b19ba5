"""Hugging Face config.json -> ModelConfig's fields, one reader per architecture family (the supported set).

Reads configs written by transformers 4.x (`rope_theta` + `rope_scaling`, Gemma 3's `rope_local_base_freq`,
`sliding_window_pattern`) and 5.x (`rope_parameters`, per layer type for Gemma 3; `layer_types`). A field the file
omits takes transformers' class default for that architecture (save_pretrained of older versions dropped values
equal to the defaults). Anything a reader cannot serve exactly is a ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_HF_LAYER_KINDS = {"full_attention": "global", "sliding_attention": "sliding"}


def model_config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields for a parsed config.json (ModelConfig.from_hf_config validates them); ValueError names an
    unsupported architecture or setting."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(hf.get("model_type", ""), None)
    if arch not in SUPPORTED_ARCHITECTURES:
        named = arch or hf.get("model_type") or "<none given>"
        hint = (
            " (only its text model, Gemma3ForCausalLM, is supported)"
            if named == "Gemma3ForConditionalGeneration"
            else ""
        )
        raise ValueError(f"unsupported architecture {named!r}{hint}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return _READERS[arch](hf, arch)


def _common(
    hf: dict[str, Any],
    arch: str,
    *,
    rms_norm_eps: float,
    tie: bool = False,
    head_dim: int | None = None,
    context: int = 4096,
) -> dict[str, Any]:
    """The fields every architecture reads the same way (the keyword arguments: its class defaults)."""
    eos = hf.get("eos_token_id")
    return {
        "architecture": arch,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim", head_dim),
        "rms_norm_eps": float(hf.get("rms_norm_eps", rms_norm_eps)),
        "max_position_embeddings": hf.get("max_position_embeddings", context),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", tie)),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_ids": tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
    }


def _activation(hf: dict[str, Any], default: str = "silu") -> str:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or default
    return "silu" if act == "swish" else act


def _rope(params: dict[str, Any] | None, legacy: dict[str, Any] | None, theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from transformers 5's rope_parameters and/or 4's rope_scaling."""
    rope = dict(params or {})
    if legacy:
        rope.update(legacy)
    theta = float(rope.pop("rope_theta", theta))
    rope.pop("partial_rotary_factor", None)
    kind = rope.get("rope_type", rope.get("type", "default"))
    return theta, (rope if kind != "default" else None)


def _layer_kinds(hf: dict[str, Any], window: int | None, default: Callable[[int], bool]) -> tuple[str, ...]:
    """Per layer "global" / "sliding": config.json's layer_types when given, else default(i) (True = sliding)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        kinds = tuple("sliding" if default(i) else "global" for i in range(n))
    else:
        unknown = sorted(set(types) - set(_HF_LAYER_KINDS))
        if unknown:
            raise ValueError(f"layer_types: unsupported kind {unknown[0]!r} (supported: {', '.join(_HF_LAYER_KINDS)})")
        kinds = tuple(_HF_LAYER_KINDS[t] for t in types)
    # transformers gives a layer of the sliding kind no window when the config has none: it attends globally.
    return kinds if window is not None else ("global",) * len(kinds)


def _llama_family(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Llama, Mistral, Qwen2, Qwen3 (and Qwen3-MoE's attention: _qwen3_moe)."""
    theta, scaling = _rope(hf.get("rope_parameters"), hf.get("rope_scaling"), hf.get("rope_theta", 10000.0))
    window = None if arch == "LlamaForCausalLM" else hf.get("sliding_window")
    bias = bool(hf.get("attention_bias", False))
    qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if arch == "Qwen2ForCausalLM" or qwen3:
        if not hf.get("use_sliding_window", False):
            window = None
        first_sliding = hf.get("max_window_layers", 28)
        kinds = _layer_kinds(hf, window, lambda i: i >= first_sliding)
    else:  # Mistral's window (v0.1) covers every layer; Llama has none
        kinds = _layer_kinds({**hf, "layer_types": None}, window, lambda i: True)
    return dict(
        **_common(hf, arch, rms_norm_eps=1e-6 if qwen3 else 1e-5),
        hidden_act=_activation(hf),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias={"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(arch, bias),
        o_bias=bias if arch == "LlamaForCausalLM" or qwen3 else False,
        mlp_bias=bool(hf.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
        qk_norm=qwen3,
        sliding_window=window,
        layer_kinds=kinds,
    )


def _qwen3_moe(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention; the MLP of layer i is sparse unless i is in mlp_only_layers or (i + 1) is not
    a multiple of decoder_sparse_step (transformers' rule). transformers 5 saves num_experts as num_local_experts."""
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window: sliding-window attention is not supported for Qwen3-MoE")
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be an integer >= 1, got {step!r}")
    dense_only = hf.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
        raise ValueError(f"mlp_only_layers must list layer indices, got {dense_only!r}")
    kinds = tuple(
        "moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(hf["num_hidden_layers"])
    )
    return dict(
        **_llama_family(hf, arch),
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        mlp_kinds=kinds,
    )


def _deepseek(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek V2 / V2-Lite / V3 (R1, Kimi K2's config): multi-head latent attention, the first
    first_k_dense_replace layers dense and the rest mixtures of n_routed_experts with n_shared_experts shared ones.
    V2 routes with softmax scores (topk_method "greedy", or "group_limited_greedy" over n_group groups), V3 with
    sigmoid scores and e_score_correction_bias ("noaux_tc"); any other topk_method or scoring_func is refused, as is
    a rope_scaling other than yarn. Defaults are transformers' class defaults of each version."""
    v3 = arch == "DeepseekV3ForCausalLM"
    method = hf.get("topk_method", "noaux_tc" if v3 else "greedy")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ValueError(f"topk_method {method!r} is not supported for {arch}; supported: {', '.join(methods)}")
    scoring = hf.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"scoring_func {scoring!r} is not supported for {arch}")
    for field in ("ep_size",):
        if hf.get(field, 1) != 1:
            raise ValueError(f"{field} {hf[field]!r}: only a single-device checkpoint layout is supported")
    theta, scaling = _rope(hf.get("rope_parameters"), hf.get("rope_scaling"), hf.get("rope_theta", 10000.0))
    layers = hf["num_hidden_layers"]
    experts = hf.get("n_routed_experts", 256 if v3 else 64)
    dense = hf.get("first_k_dense_replace", 3 if v3 else 0) or 0
    if not isinstance(dense, int) or dense < 0:
        raise ValueError(f"first_k_dense_replace must be an integer >= 0, got {dense!r}")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {hf['moe_layer_freq']!r}: only every layer past first_k_dense_replace sparse")
    moe_i = hf.get("moe_intermediate_size", 2048 if v3 else 1407)
    rope_dim = hf.get("qk_rope_head_dim", 64)
    bias = bool(hf.get("attention_bias", False))
    if bias:
        raise ValueError("attention_bias: DeepSeek attention with biases is not supported")
    interleave = hf.get("rope_interleave", True) if v3 else True
    return dict(
        **{**_common(hf, arch, rms_norm_eps=1e-6, context=4096 if v3 else 2048), "head_dim": rope_dim},
        hidden_act=_activation(hf),
        rope_theta=theta,
        rope_scaling=scaling,
        num_experts=experts,
        num_experts_per_tok=hf.get("num_experts_per_tok") or (8 if v3 else 0),
        moe_intermediate_size=moe_i,
        norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
        mlp_kinds=tuple("dense" if i < dense or experts == 0 else "moe" for i in range(layers)),
        moe_router="deepseek_v3" if v3 else "deepseek_v2",
        moe_n_group=hf.get("n_group") or 1,
        moe_topk_group=hf.get("topk_group") or 1,
        moe_group_limited=method == "group_limited_greedy",
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        shared_expert_intermediate_size=moe_i * (hf.get("n_shared_experts", 1 if v3 else 2) or 0),
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        q_lora_rank=hf.get("q_lora_rank", 1536),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=rope_dim,
        v_head_dim=hf.get("v_head_dim", 128),
        mla_rope_layout=("pairs_split" if interleave else "halves") if v3 else "pairs",
    )


def _gemma(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text): interleaved sliding/global layers, (1 + w) sandwich norms, scaled embeddings,
    GeGLU, query_pre_attn_scalar; Gemma 2 soft-caps, Gemma 3 has q/k norms and a local RoPE base."""
    gemma3 = arch == "Gemma3ForCausalLM"
    if gemma3 and hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal Gemma 3 (text generation) is supported")
    window = hf.get("sliding_window", 4096)
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    kinds = _layer_kinds(hf, window, (lambda i: (i + 1) % pattern != 0) if gemma3 else (lambda i: i % 2 == 0))
    params = hf.get("rope_parameters") or {}
    local_theta = None
    if gemma3:
        # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}; 4: rope_theta, rope_scaling (global
        # layers only), rope_local_base_freq.
        local = params.get("sliding_attention") or {}
        theta, scaling = _rope(params.get("full_attention"), hf.get("rope_scaling"), hf.get("rope_theta", 1e6))
        local_theta, local_scaling = _rope(local, None, hf.get("rope_local_base_freq", 10000.0))
        if local_scaling is not None:
            raise ValueError("rope_parameters.sliding_attention: scaled RoPE on sliding layers is not supported")
    else:
        theta, scaling = _rope(params, hf.get("rope_scaling"), hf.get("rope_theta", 10000.0))
    hidden = hf["hidden_size"]
    return dict(
        **_common(hf, arch, rms_norm_eps=1e-6, tie=True, head_dim=256, context=131072 if gemma3 else 8192),
        hidden_act=_activation(hf, "gelu_pytorch_tanh"),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        qk_norm=gemma3,
        norm_plus_one=True,
        sandwich_norms=True,
        embedding_scale=hidden**0.5,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=hf.get("attn_logit_softcapping", None if gemma3 else 50.0),
        final_logit_softcap=hf.get("final_logit_softcapping", None if gemma3 else 30.0),
        sliding_window=window,
        layer_kinds=kinds,
    )


def _phi3(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused projections in the checkpoint, longrope, partial rotary, a window on
    every layer when sliding_window is set."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    theta, scaling = _rope(params, legacy, hf.get("rope_theta", 10000.0))
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):  # what transformers calls longrope
            scaling["rope_type"] = "longrope"
        if "original_max_position_embeddings" in hf:  # transformers 4 keeps it beside rope_scaling
            scaling.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
    window = hf.get("sliding_window")
    return dict(
        **_common(hf, arch, rms_norm_eps=1e-5),
        hidden_act=_activation(hf),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        sliding_window=window,
        layer_kinds=_layer_kinds({**hf, "layer_types": None}, window, lambda i: True),
    )


_READERS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama_family,
    "MistralForCausalLM": _llama_family,
    "Qwen2ForCausalLM": _llama_family,
    "Qwen3ForCausalLM": _llama_family,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "Gemma2ForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma,
    "Phi3ForCausalLM": _phi3,
}
SUPPORTED_ARCHITECTURES = tuple(_READERS)
