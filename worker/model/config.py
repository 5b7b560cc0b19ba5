"""ModelConfig: the one description of a Llama-family decoder, validated on construction.

`ModelConfig.from_hf_config(config_json_dict)` accepts Hugging Face configs of LlamaForCausalLM,
MistralForCausalLM and Qwen2ForCausalLM, written by transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x
(`rope_parameters`).

Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not implemented by the attention
backends. Instead of rejecting such checkpoints, the usable context is capped at the window:
`max_position_embeddings = min(max_position_embeddings, sliding_window)`. Within that length full causal
attention and sliding-window attention are the same computation, so outputs stay exact; the engine must refuse
sequences longer than `max_position_embeddings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    qkv_bias:  q/k/v projections have a bias (Qwen2 always; Llama when attention_bias).
    o_bias:    o_proj has a bias (Llama when attention_bias).
    rope_scaling: None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"}.
    eos_token_ids: every id that ends generation (HF allows a list).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2 (RoPE rotates pairs), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in _ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(_ROPE_TYPES)}")
            if kind == "default":
                self.rope_scaling = None
            else:
                missing = [
                    k
                    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                    if k not in self.rope_scaling
                ]
                if missing:
                    raise ValueError(f"llama3 rope_scaling is missing {', '.join(missing)}")
                self.rope_scaling = {**self.rope_scaling, "rope_type": "llama3"}
        if self.sliding_window is not None and self.sliding_window < self.max_position_embeddings:
            # Within the window, sliding-window attention is full causal attention: cap the context (see module doc).
            self.max_position_embeddings = self.sliding_window
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        for name, value in (("bos_token_id", self.bos_token_id),):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary (size {self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; ValueError names an unsupported architecture or setting."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(hf.get("model_type", ""), None)
        if arch not in SUPPORTED_ARCHITECTURES:
            named = arch or hf.get("model_type") or "<none given>"
            raise ValueError(f"unsupported architecture {named!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")

        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling")
        if legacy:
            rope.update(legacy)
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = hf.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
            sliding = None
        bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else bias,
            o_bias=bias if arch == "LlamaForCausalLM" else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
        )
