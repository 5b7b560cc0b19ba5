"""The decoder every supported architecture is (Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Gemma 2/3, Phi-3), in plain
torch, reading and writing K/V through a KVPool; ModelConfig's switches select each architecture's parts (a layer's
MLP is dense or a mixture of experts: worker/model/moe.py).

One forward = one engine step over a BatchLayout: the step's new tokens of every sequence, flattened to [T].
Parameter names follow Hugging Face's (model.embed_tokens, model.layers.N.self_attn.*, model.norm, lm_head) except
two fused projections: qkv_proj = [q_proj; k_proj; v_proj] and gate_up_proj = [gate_proj; up_proj] (Phi-3's
checkpoints store them fused already). `load_weights` takes HF tensor names and writes them into the right slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixcache.pool import KVLayer, KVPool
from radixcache.worker.attention.base import AttentionBackend, AttentionOptions
from radixcache.worker.attention.layout import BatchLayout
from radixcache.worker.model.config import ModelConfig
from radixcache.worker.model.mla import LatentAttention
from radixcache.worker.model.moe import SparseMoE, split_fused_experts
from radixcache.worker.model.rope import cos_sin, rope_frequencies, rotate
from radixcache.worker.model.row_tiles import by_row_tiles, row_tile


class RMSNorm(nn.Module):
    """RMS normalisation scaled by weight, or with plus_one by (1 + weight) (Gemma's norms, whose checkpoints store
    the weight centred on 0)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel: bit-identical to the three-step form below in float32, and 1.5x faster at decode
            # sizes (measured: 11.7 vs 17.2 us for [1, 768], one thread).
            weight = self.weight + 1.0 if self.plus_one else self.weight
            return F.rms_norm(x, self.weight.shape, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:  # Gemma scales in float32 and casts last
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        # Llama casts back before the weight, as the reference implementation does.
        return self.weight * xf.to(x.dtype)


def attention_options(config: ModelConfig) -> AttentionOptions:
    """What the attention backend must compute for this model (create the backend with it)."""
    return AttentionOptions(
        scale=None if config.query_pre_attn_scalar is None and not config.is_mla else config.attention_scale,
        soft_cap=config.attn_logit_softcap,
        windows=config.layer_windows,
        latent=config.is_mla,
        latent_dims=(config.kv_lora_rank, config.qk_rope_head_dim) if config.is_mla else None,
    )


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's final logits); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


@torch.no_grad()
def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], skip: nn.Module | None = None) -> int:
    """Replace every nn.Linear of `model` (but `skip`) by make(linear), in place. Returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child is not skip
    ]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose CPU products are computed a fixed number of rows at a time, so
    a row's result never depends on the step it is in (worker/model/row_tiles.py). CUDA is left alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dim() != 2:
            return super().forward(x)
        return by_row_tiles(x, super().forward, row_tile(x.dtype))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # per head, over head_dim, before RoPE (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_plus_one)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_plus_one)

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
        qkv = self.qkv_proj.forward(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm.forward(q), self.k_norm.forward(k)), dim=1)
        # q and k rotate together: one [T, H + KVH, D] tensor, one set of ops per layer.
        q, k = rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(self.layer_idx, q, k, v, kv_layer, layout)
        return self.o_proj.forward(out.reshape(t, self.q_size))


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma); of
    intermediate_size (default config.intermediate_size; a mixture-of-experts' experts: moe_intermediate_size)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=config.mlp_bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj.forward(act * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals. With sandwich_norms (Gemma 2/3) each block's output is
    normalised before its residual add: post_attention_layernorm then normalises the attention output, and the MLP
    sits between pre_feedforward_layernorm and post_feedforward_layernorm."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps, plus_one = config.rms_norm_eps, config.norm_plus_one
        self.input_layernorm = RMSNorm(config.hidden_size, eps, plus_one)
        self.self_attn: Attention | LatentAttention = (
            LatentAttention(config, layer_idx, Linear, RMSNorm) if config.is_mla else Attention(config, layer_idx)
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, plus_one)
        self.mlp = MLP(config) if config.mlp_kinds[layer_idx] == "dense" else sparse_moe(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, plus_one)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, plus_one)
        # Which of the model's rotations this layer uses (CausalLM.rotations): sliding layers may have their own.
        self.rotation = int(config.layer_kinds[layer_idx] == "sliding" and config.rope_local_theta is not None)

    def forward(self, x, cos, sin, layout, kv_layer, backend):  # noqa: ANN001, ANN201 (hot path, typed above)
        # Submodules are called through .forward: nn.Module.__call__ costs ~10 us a call in hook bookkeeping (no
        # hooks are used here), about 1 ms of a batch-1 decode step over 12 layers.
        attn = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, layout, kv_layer, backend)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp.forward(self.post_attention_layernorm.forward(x))
        x = x + self.post_attention_layernorm.forward(attn)
        return x + self.post_feedforward_layernorm.forward(self.mlp.forward(self.pre_feedforward_layernorm.forward(x)))


def sparse_moe(config: ModelConfig) -> SparseMoE:
    """A "moe" layer's MLP: its experts, shared experts and router built of this module's row-exact Linear."""
    shared = config.shared_expert_intermediate_size
    return SparseMoE(
        config.hidden_size,
        config.num_experts,
        config.moe_routing,
        make_expert=lambda: MLP(config, config.moe_intermediate_size),
        make_router=lambda n_in, n_out: Linear(n_in, n_out, bias=False),
        shared=MLP(config, shared) if shared else None,
    )


class Backbone(nn.Module):
    """Holds the HF `model.*` submodules so parameter names match checkpoints."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one)


# HF projection name -> (fused parameter name, index of the slice among the fused parts); a name matches as a whole
# dotted component, so a mixture's experts (mlp.experts.E.gate_proj) fuse as the dense MLP does.
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# DeepSeek V3's router correction bias: the checkpoint keeps it on the router (mlp.gate), SparseMoE on itself
_HF_BIAS, _OUR_BIAS = ".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"


class CausalLM(nn.Module):
    """Decoder + LM head over the paged KV pool.

    forward(input_ids[T], layout, kv_pool, backend, all_logits=False):
      - input_ids are the step's new tokens in layout order (sequence by sequence);
      - calls backend.begin_step(layout), then for every layer writes K/V of the new tokens into kv_pool at the
        layout's write positions and attends over each sequence's prefix + new tokens (its window, for a sliding
        layer); the backend must have been created with `attention_options(config)` (ValueError otherwise);
      - returns float32 logits [B, vocab] for the rows at layout.logits_indices (each sequence's last new
        token), [len(rows), vocab] for the given `rows` of the step's tokens (speculation verifies several
        positions of a sequence at once), or [T, vocab] for every token with all_logits=True.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention = attention_options(config)
        self.init_rotations("cpu")

    def init_rotations(self, device: str | torch.device) -> None:
        """(inv_freq, attention_factor) of each rotation on `device`: every layer's, then (rope_local_theta) the
        sliding layers'. Plain attributes, not buffers: module.to(bf16) must not round the frequencies."""
        c = self.config
        kinds = [False] + ([True] if c.rope_local_theta is not None else [])
        self.rotations = [(f.to(device), a) for f, a in (rope_frequencies(c, local=local) for local in kinds)]

    def keep_float32_routers(self) -> None:
        """Put back in float32 the routers that run in float32 (DeepSeek's mlp.gate and its correction bias), as
        transformers keeps them in a 16-bit model (_keep_in_fp32_modules_strict). Call after module.to(dtype)."""
        for module in self.modules():
            if isinstance(module, SparseMoE) and module.routing.float32_logits:
                module.gate.float()
                if module.e_score_correction_bias is not None:
                    module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()

    def tie_weights(self) -> None:
        """Re-share lm_head with the embedding (needed after `to_empty`, which breaks the sharing)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def store_linear_weights_input_major(self) -> None:
        """Keep each projection's weight as a view of a contiguous [in, out] tensor (values unchanged).

        nn.Linear computes x @ W.T; with W stored [out, in], the CPU GEMM runs its transposed-operand kernel, which is
        1.5-2x slower for the few rows of a decode step (measured at 4-16 rows, 1 thread; no change at 512 rows).
        Call after loading. The tied lm_head is skipped: it is also the embedding table, looked up by row.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not self.model.embed_tokens.weight:
                module.weight.data = module.weight.data.t().contiguous().t()

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per rotation, cos and signed_sin [T, 1, rotary_dim] for the step's positions (see `rope.rotate`):
        computed once per step, shared by every layer of that rotation."""
        if self.rotations[0][0].device != positions.device:
            self.init_rotations(positions.device)
        if self.config.mla_rope_layout == "pairs" and self.config.is_mla:
            dtype = torch.float32  # DeepSeek V2 rotates in float32 (its complex product)
        return [cos_sin(positions, inv_freq, factor, dtype) for inv_freq, factor in self.rotations]

    def forward(
        self,
        input_ids: torch.Tensor,
        layout: BatchLayout,
        kv_pool: KVPool,
        backend: AttentionBackend,
        all_logits: bool = False,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids.shape[0] != layout.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} input ids for a layout of {layout.num_tokens} tokens")
        if backend.attention != self.attention:
            raise ValueError(
                f"the {backend.name} backend was created for {backend.attention}, and this "
                f"{self.config.architecture} needs {self.attention}: create it with attention=attention_options(config)"
            )
        backend.begin_step(layout)
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:  # Gemma: rounded to the model dtype first, as transformers does
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        rotations = self.rope(layout.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            cos, sin = rotations[layer.rotation]
            x = layer.forward(x, cos, sin, layout, kv_pool.kv_layer(i), backend)
        if rows is not None and not all_logits:
            x = x[rows]
        elif not all_logits and (layout.logits_indices.shape[0] != x.shape[0]):
            x = x[layout.logits_indices]  # a pure decode step needs every row already
        return soft_cap(self.lm_head.forward(self.model.norm.forward(x)).float(), self.config.final_logit_softcap)

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (slicing fused ones). Returns the parameter slices filled,
        named as in the checkpoint, so the caller can report anything missing; unknown names raise ValueError."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in split_fused_experts(tensors):  # fused 3-D experts are filled (and named) per expert
            if "rotary_emb." in name:
                continue  # some checkpoints store inv_freq; it is recomputed from the config
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, part = name.replace(_HF_BIAS, _OUR_BIAS), None
            for hf, (fused, index) in _FUSED.items():
                if f".{hf}." in name and name.replace(f".{hf}.", f".{fused}.") in params:  # (MLA keeps q_proj)
                    target, part = name.replace(f".{hf}.", f".{fused}."), index
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            param = params[target]
            dest = param if part is None else self._fused_slice(param, target, part)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.add(name)
        return filled

    def expected_weights(self) -> set[str]:
        """Every HF tensor name a checkpoint must provide for this config."""
        parts: dict[str, list[str]] = {}
        for hf, (fused, _) in _FUSED.items():
            if not self.config.checkpoint_fuses_projections:
                parts.setdefault(fused, []).append(hf)
        names = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for fused, hf_names in parts.items():
                if f".{fused}." in name:
                    names.update(name.replace(f".{fused}.", f".{hf}.") for hf in hf_names)
                    break
            else:
                names.add(name.replace(_OUR_BIAS, _HF_BIAS))
        return names

    def _fused_slice(self, param: torch.Tensor, name: str, part: int) -> torch.Tensor:
        c = self.config
        if ".qkv_proj." in name:
            bounds = [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        else:  # gate_up_proj of the dense MLP or of an expert: two halves
            half = param.shape[0] // 2
            bounds = [0, half, 2 * half]
        return param[bounds[part] : bounds[part + 1]]
