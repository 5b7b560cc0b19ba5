"""ModelConfig: the one description of a served decoder, validated on construction.

Every supported architecture is the same pre-norm decoder (embed -> N x [norm, attention, residual, norm, GLU MLP,
residual] -> norm -> LM head) with a few switches, which this dataclass names: q/k norms (Qwen3, Gemma 3), Gemma's
(1 + w) norms, norms around each sublayer's output ("sandwich", Gemma 2/3), scaled embeddings, the GLU activation,
the attention scale, soft-capped attention and final logits (Gemma 2), per-layer attention kinds (global or
sliding over the last `sliding_window` positions), RoPE variants (llama3, linear, longrope, partial rotary, a
separate base for sliding layers), and per layer a dense gated MLP or a sparse mixture of experts (Qwen3-MoE:
worker/model/moe.py).

`ModelConfig.from_hf_config(config_json_dict)` reads a Hugging Face config.json of each supported architecture
(worker/model/hf_config.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from radixcache.worker.model.hf_config import SUPPORTED_ARCHITECTURES, model_config_fields
from radixcache.worker.model.moe import Routing

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_KINDS = ("global", "sliding")
MLP_KINDS = ("dense", "moe")
# rope type -> the keys its rope_scaling dict must hold
_ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# How an MLA model lays out the qk_rope_head_dim dimensions it rotates (worker/model/mla.py, mla_rotate):
# "pairs" rotates interleaved pairs (x0, x1), (x2, x3)... and leaves them interleaved (DeepSeek V2's complex product);
# "pairs_split" rotates the same pairs and returns them as [evens | odds] (DeepSeek V3, rope_interleave true);
# "halves" pairs element i with i + D/2, as every other model here (DeepSeek V3, rope_interleave false).
MLA_ROPE_LAYOUTS = ("pairs", "pairs_split", "halves")


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder.

    qkv_bias / o_bias / mlp_bias: those projections have a bias (Qwen2: q/k/v; Llama when attention_bias).
    hidden_act:    the GLU's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
    qk_norm:       q and k are RMS-normalised per head (weight [head_dim]) before RoPE (Qwen3, Gemma 3).
    norm_plus_one: every RMSNorm scales by (1 + weight) instead of weight (Gemma), computed in float32.
    sandwich_norms: the attention and MLP outputs are normalised before their residual add, and the MLP input by
                   its own norm (Gemma 2/3: post_attention_layernorm, pre_/post_feedforward_layernorm).
    embedding_scale: embeddings are multiplied by this, rounded to the model dtype (Gemma: sqrt(hidden_size)).
    query_pre_attn_scalar: the attention scale is query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    attn_logit_softcap / final_logit_softcap: scores (after scaling) and final logits become
                   cap * tanh(x / cap) (Gemma 2); None: not capped.
    layer_kinds:   per layer, "global" (attends to every earlier position) or "sliding" (the last sliding_window
                   positions, its own included). None: every layer sliding when sliding_window is set, else global.
                   A sliding_window >= max_position_embeddings never cuts: every layer becomes global, the window None.
    rope_scaling:  None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
                   "original_max_position_embeddings"}, {"rope_type": "linear", "factor"} or {"rope_type":
                   "longrope", "short_factor", "long_factor", "original_max_position_embeddings", optional "factor"
                   and "attention_factor"} (see worker/model/rope.py for which factors longrope uses).
    rope_local_theta: the RoPE base of sliding layers, unscaled (Gemma 3's rope_local_base_freq); None: sliding
                   layers rotate like global ones.
    partial_rotary_factor: the share of each head's dimensions RoPE rotates (the leading ones; Phi-4-mini 0.75).
    eos_token_ids: every id that ends generation (HF allows a list).
    num_experts / num_experts_per_tok / moe_intermediate_size / norm_topk_prob: a "moe" layer's MLP is
                   num_experts gated MLPs of moe_intermediate_size; each token runs the num_experts_per_tok its
                   router ranks highest (softmax in float32, then top-k), weighted by their probabilities
                   (renormalised to sum to 1 with norm_topk_prob). 0 experts: every layer dense.
    mlp_kinds:     per layer, "dense" (the gated MLP of intermediate_size) or "moe". None: every layer "moe" when
                   num_experts > 0, else "dense".
    moe_router:    how the experts are chosen and weighted: "softmax" (Qwen3-MoE), "deepseek_v2", "deepseek_v3"
                   (worker/model/moe.py, Routing), with moe_n_group / moe_topk_group (group-limited choice; V2 only
                   with moe_group_limited) and routed_scaling_factor.
    shared_expert_intermediate_size: a "moe" layer also runs one gated MLP of this size on every token, added to
                   the experts' sum (DeepSeek: moe_intermediate_size x n_shared_experts); 0: none.
    kv_lora_rank:  > 0: multi-head latent attention (DeepSeek V2/V3, worker/model/mla.py): each token caches one
                   latent of kv_lora_rank values plus qk_rope_head_dim roped key values per layer (a latent page,
                   radixcache/pool.py), queries are q_lora_rank-compressed (None: one q_proj), each head's key is
                   qk_nope_head_dim up-projected + qk_rope_head_dim shared roped dims, its value v_head_dim; head_dim
                   is then qk_rope_head_dim (the rotated dims, as transformers sets it) and mla_rope_layout says how
                   they are paired (MLA_ROPE_LAYOUTS). 0: ordinary attention.
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
    layer_kinds: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embedding_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    mlp_kinds: tuple[str, ...] | None = None
    moe_router: str = "softmax"
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_group_limited: bool = False
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_rope_layout: str = "halves"

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
        if self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        for name in ("rms_norm_eps", "rope_theta", "rope_local_theta", "embedding_scale", "query_pre_attn_scalar"):
            _positive(name, getattr(self, name))
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            _positive(name, getattr(self, name))
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and rotate an even number of "
                f"dimensions (>= 2) of head_dim {self.head_dim}"
            )
        self._check_layer_kinds()
        self._check_mlp_kinds()
        self._check_mla()
        self.rope_scaling = self._checked_rope_scaling(self.rope_scaling)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(f"bos_token_id {self.bos_token_id} is outside the vocabulary (size {self.vocab_size})")

    def _check_layer_kinds(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 tokens, got {self.sliding_window}")
        if self.layer_kinds is None:
            kind = "sliding" if self.sliding_window is not None else "global"
            self.layer_kinds = (kind,) * self.num_layers
        self.layer_kinds = tuple(self.layer_kinds)
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"unknown layer kind {unknown[0]!r}; each layer is one of {', '.join(LAYER_KINDS)}")
        if "sliding" in self.layer_kinds and self.sliding_window is None:
            raise ValueError("sliding layers need sliding_window (tokens each one attends to)")
        if self.sliding_window is not None and self.sliding_window >= self.max_position_embeddings:
            # A window no sequence can outgrow never cuts: the layers are global (Phi-3.5's 262144 in a 128k context).
            self.layer_kinds, self.sliding_window = ("global",) * self.num_layers, None

    def _check_mlp_kinds(self) -> None:
        if self.mlp_kinds is None:
            self.mlp_kinds = ("moe" if self.num_experts > 0 else "dense",) * self.num_layers
        self.mlp_kinds = tuple(self.mlp_kinds)
        if len(self.mlp_kinds) != self.num_layers:
            raise ValueError(f"mlp_kinds has {len(self.mlp_kinds)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.mlp_kinds) - set(MLP_KINDS))
        if unknown:
            raise ValueError(f"unknown MLP kind {unknown[0]!r}; each layer's MLP is one of {', '.join(MLP_KINDS)}")
        if "moe" not in self.mlp_kinds:
            return
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1 for a mixture-of-experts layer, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size is None or self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}"
            )
        _positive("routed_scaling_factor", self.routed_scaling_factor)
        self.moe_routing.check_experts(self.num_experts)

    def _check_mla(self) -> None:
        if self.kv_lora_rank < 0:
            raise ValueError(f"kv_lora_rank must be >= 0, got {self.kv_lora_rank}")
        scaling = self.rope_scaling or {}
        if not self.is_mla:
            if scaling.get("rope_type", scaling.get("type")) == "yarn":
                raise ValueError("rope_scaling type 'yarn' is supported for DeepSeek V2/V3 (MLA) models only")
            return
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported with MLA (DeepSeek: default or yarn)")
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 for multi-head latent attention, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"head_dim {self.head_dim} must equal qk_rope_head_dim {self.qk_rope_head_dim} (MLA)")
        if (self.kv_lora_rank + self.qk_rope_head_dim) % 2:
            raise ValueError(
                f"kv_lora_rank + qk_rope_head_dim must be even (a latent page stores it as two half-rows), got "
                f"{self.kv_lora_rank} + {self.qk_rope_head_dim}"
            )
        if self.mla_rope_layout not in MLA_ROPE_LAYOUTS:
            raise ValueError(f"unknown mla_rope_layout {self.mla_rope_layout!r}; one of {', '.join(MLA_ROPE_LAYOUTS)}")
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"num_key_value_heads {self.num_kv_heads} must equal num_attention_heads (MLA)")
        for name in ("qkv_bias", "qk_norm", "sandwich_norms", "norm_plus_one"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported with multi-head latent attention")
        if self.attn_logit_softcap is not None or self.sliding_window is not None or self.partial_rotary_factor != 1:
            raise ValueError("soft caps, sliding windows and partial rotary are not supported with MLA")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek V2/V3): the cache holds latent pages."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """(kv_heads, head_dim) of the pool's pages (radixcache.pool.KVShape): the model's KV heads, or for MLA one
        "head" of D / 2 (D = kv_lora_rank + qk_rope_head_dim): the tensor shape of a latent pool (built with
        latent=True), whose page holds each token's latent as D contiguous values, two half-rows of D / 2
        (radixcache/pool.py, latent pages)."""
        assert self.head_dim is not None
        if self.is_mla:
            return 1, (self.kv_lora_rank + self.qk_rope_head_dim) // 2
        return self.num_kv_heads, self.head_dim

    @property
    def moe_routing(self) -> Routing:
        """How a "moe" layer routes (ValueError naming the field for a router it cannot run)."""
        return Routing(
            self.moe_router, self.num_experts_per_tok, self.norm_topk_prob, self.routed_scaling_factor,
            self.moe_n_group, self.moe_topk_group, self.moe_group_limited,
        )  # fmt: skip

    def _checked_rope_scaling(self, scaling: dict[str, Any] | None) -> dict[str, Any] | None:
        if scaling is None:
            return None
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return None
        if kind not in _ROPE_KEYS:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, {', '.join(_ROPE_KEYS)}")
        missing = [k for k in _ROPE_KEYS[kind] if k not in scaling]
        if missing:
            raise ValueError(f"{kind} rope_scaling is missing {', '.join(missing)}")
        for key in ("factor", "attention_factor", "original_max_position_embeddings"):
            _positive(f"rope_scaling {key}", scaling.get(key))
        if kind == "yarn":
            for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                value = scaling.get(key)
                if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                    raise ValueError(f"yarn rope_scaling {key} must be a finite number >= 0, got {value!r}")
        if kind == "longrope":
            for key in ("short_factor", "long_factor"):
                factors = scaling[key]
                if not isinstance(factors, list | tuple) or len(factors) != self.rotary_dim // 2:
                    raise ValueError(f"longrope {key} must list {self.rotary_dim // 2} numbers (rotary_dim / 2)")
                for value in factors:
                    _positive(f"longrope {key} entry", value)
        return {**scaling, "rope_type": kind}

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates (all of them unless partial_rotary_factor < 1)."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: None for a global layer, sliding_window for a sliding one."""
        assert self.layer_kinds is not None
        return tuple(self.sliding_window if kind == "sliding" else None for kind in self.layer_kinds)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every layer's attention scores. MLA: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5,
        times mscale ** 2 under yarn with mscale_all_dim (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for a
        factor > 1), as transformers' yarn_apply_mscale."""
        assert self.head_dim is not None
        if self.is_mla:
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            scaling = self.rope_scaling or {}
            factor, all_dim = float(scaling.get("factor") or 1.0), scaling.get("mscale_all_dim")
            if scaling.get("rope_type") == "yarn" and all_dim and factor > 1:
                mscale = 0.1 * all_dim * math.log(factor) + 1.0
                scale = scale * mscale * mscale
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def checkpoint_fuses_projections(self) -> bool:
        """The checkpoint stores qkv_proj and gate_up_proj fused, as this model holds them (Phi-3)."""
        return self.architecture == "Phi3ForCausalLM"

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; ValueError names an unsupported architecture or setting."""
        return cls(**model_config_fields(hf))
