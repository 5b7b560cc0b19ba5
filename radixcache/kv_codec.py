"""KV precisions: how a page stores one token's K or V vector of one KV head, and how it is read back.

The precisions (what `--kv-dtype` takes and a page's `kv_dtype` says):
- fp32, bf16, fp16: the values themselves.
- int8: q = round(x / s) in -127..127, s = max|x| / 127 per token and KV head, kept as an fp16 scale beside the page's
  values (2 bytes per 64..128 values: int8 pages cost 0.52x of fp16 at head_dim 64, 0.51x at 128).
- int4: the same with -7..7 (s = max|x| / 7), stored as q + 8 in 4 bits, two values a byte: byte j of a head holds
  element j in its low nibble and element j + head_dim / 2 in its high one (the two halves unpack with one mask and
  one shift each, no interleaving). Keys are first rotated by the orthonormal Hadamard transform over head_dim
  (`hadamard`), and so are the queries that read them (`KVCodec.rotate_keys`): q.k is unchanged, and an outlier
  channel of K, which per-token scales quantize badly, is spread over every channel. Measured on the embedded
  model's held-out text (BENCHMARKS.md): the rotation halves the KL divergence of int4 pages (0.031 -> 0.015 nats).
- fp8_e4m3: x / s in float8 e4m3 (saturated at +-448), s one float32 scale per layer for K and one for V, held by the
  pool (1.0 unless the pool is given others): FlashInfer's fp8 kernels take exactly that (k_scale, v_scale).

Every encoding reads only the vector it encodes, elementwise or with one max over head_dim (and the Hadamard
transform is a fixed sequence of additions, not a GEMM whose blocking could depend on the batch), so a token's
stored bytes never depend on the other tokens of its step: a prefix hit reads exactly what a recompute writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixcache.kv_dtypes import KV_DTYPES, QUANTIZED_KV_DTYPES, canonical_kv_dtype

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


@dataclass(frozen=True)
class KVCodec:
    """One precision. `storage`: the tensor dtype of a page's values; `pack`: values per stored element along
    head_dim; `levels`: the largest |q| of an integer code (0: not an integer code); `token_scales`: an fp16 scale per
    token and KV head; `layer_scales`: one float32 scale per layer for K and one for V (held by the pool)."""

    name: str
    storage: torch.dtype
    pack: int = 1
    levels: int = 0
    token_scales: bool = False
    layer_scales: bool = False
    rotate_keys: bool = False

    @property
    def quantized(self) -> bool:
        return self.storage not in (torch.float32, torch.bfloat16, torch.float16)

    def stored_dim(self, head_dim: int) -> int:
        if head_dim % self.pack:
            raise ValueError(f"{self.name} KV pages need an even head_dim, got {head_dim}")
        return head_dim // self.pack

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int) -> int:
        """Bytes one token costs in a page, scales included: 2 (K, V) x layers x kv_heads x (values + scale)."""
        element = torch.empty((), dtype=self.storage).element_size()
        per_head = self.stored_dim(head_dim) * element + (2 if self.token_scales else 0)
        return 2 * layers * kv_heads * per_head

    def encode(self, x: torch.Tensor, layer_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., head_dim] (any float dtype) -> (values [..., stored_dim] in `storage`, fp16 scales [...] or None).
        For fp8, `layer_scale` is the scale of this layer's K or V."""
        if not self.quantized:
            return x.to(self.storage), None
        if self.layer_scales:
            scaled = x.float() if layer_scale == 1.0 else x.float() / layer_scale
            return scaled.clamp_(-FP8_MAX, FP8_MAX).to(self.storage), None
        xf = x.float()
        # The scale is rounded to fp16 first and the values divided by the rounded scale: decode is then exact.
        scale = (xf.abs().amax(dim=-1) / self.levels).to(torch.float16)
        divisor = scale.float().masked_fill_(scale == 0, 1.0).unsqueeze(-1)
        q = torch.round(xf / divisor).clamp_(-self.levels, self.levels)
        if self.pack == 1:
            return q.to(self.storage), scale
        u = (q + (self.levels + 1)).to(torch.uint8)
        low, high = u.chunk(2, dim=-1)
        return low | (high << 4), scale

    def decode(
        self, values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, layer_scale: float = 1.0
    ) -> torch.Tensor:
        """(values [..., stored_dim], scales [...]) -> [..., head_dim] in `dtype` (what encode stored, exactly for
        the integer codes: q * scale)."""
        if not self.quantized:
            return values.to(dtype)
        if self.layer_scales:
            out = values.to(dtype)
            return out if layer_scale == 1.0 else out.mul_(layer_scale)
        if self.pack == 1:
            q = values.to(dtype)
        else:  # the nibbles are q + 8 in 0..15: subtract in int8 (exact), then widen once
            q = torch.cat((values & 15, values >> 4), dim=-1).view(torch.int8).sub_(self.levels + 1).to(dtype)
        assert scales is not None
        return q.mul_(scales.to(dtype).unsqueeze(-1))


CODECS: dict[str, KVCodec] = {
    "fp32": KVCodec("fp32", torch.float32),
    "bf16": KVCodec("bf16", torch.bfloat16),
    "fp16": KVCodec("fp16", torch.float16),
    "int8": KVCodec("int8", torch.int8, levels=127, token_scales=True),
    "fp8_e4m3": KVCodec("fp8_e4m3", torch.float8_e4m3fn, layer_scales=True),
    "int4": KVCodec("int4", torch.uint8, pack=2, levels=7, token_scales=True, rotate_keys=True),
}
assert tuple(CODECS) == KV_DTYPES and all(CODECS[n].quantized for n in QUANTIZED_KV_DTYPES)
_TORCH_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def kv_dtype_name(dtype: str | torch.dtype) -> str:
    """torch.float32 / 'float32' / 'fp32' / 'int8' -> the precision's name; ValueError naming the choices."""
    if isinstance(dtype, torch.dtype):
        if dtype in _TORCH_NAMES:
            return _TORCH_NAMES[dtype]
        raise ValueError(f"{dtype} is not a KV precision; use one of {', '.join(KV_DTYPES)}")
    return canonical_kv_dtype(dtype)


def codec_of(dtype: str | torch.dtype) -> KVCodec:
    """The codec of a precision (any spelling kv_dtype_name takes)."""
    return CODECS[kv_dtype_name(dtype)]


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] times the orthonormal Walsh-Hadamard matrix of size D (its own inverse), computed in float32 by
    log2 butterflies of additions (row-independent, so a token's result never depends on its batch). D that is not
    a power of two is rotated in blocks of its largest power-of-two divisor."""
    d = x.shape[-1]
    block = d & -d  # the largest power of two dividing d
    y = x.float().reshape(-1, d // block, block)
    h = 1
    while h < block:
        y = y.view(y.shape[0], -1, 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(x.shape).mul_(1.0 / math.sqrt(block))
