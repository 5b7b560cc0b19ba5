"""The KV precisions by name (no torch here: routers and indexers import it): what `--kv-dtype` takes, what a page's
`kv_dtype` says, and which of them change a page's identity.

Full precision (fp32, bf16, fp16) stores the model's own values: a page's identity (its event hash, see
radixcache.events) is what it has always been. A quantized precision (int8, fp8_e4m3, int4) stores other values, so
a page computed at one must never be taken for a page at another: `identity_tag` is what the page hash folds in.
How each precision encodes a vector: radixcache.kv_codec.
"""

from __future__ import annotations

FULL_PRECISION_KV_DTYPES = ("fp32", "bf16", "fp16")
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3", "int4")
KV_DTYPES = FULL_PRECISION_KV_DTYPES + QUANTIZED_KV_DTYPES

_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}


def canonical_kv_dtype(name: str) -> str:
    """'float16' / 'FP16' / 'fp8' -> the precision's name ('fp16', 'fp8_e4m3'); ValueError naming the choices."""
    canonical = _ALIASES.get(name.lower(), name.lower())
    if canonical not in KV_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(KV_DTYPES)}")
    return canonical


def identity_tag(kv_dtype: str | None) -> bytes:
    """b"" for full precision (and None: not said); for a quantized precision, its name with a length byte in
    front, padded with zero bytes to 2 (mod 4) bytes. The padding keeps every tagged hash input 2 bytes off the
    4-byte token grid of an untagged one, so no tagged input ever equals an untagged input (and the length byte
    keeps two tags apart)."""
    if kv_dtype is None:
        return b""
    name = canonical_kv_dtype(kv_dtype)
    if name in FULL_PRECISION_KV_DTYPES:
        return b""
    tag = bytes([len(name)]) + name.encode("ascii")
    return tag + b"\0" * ((2 - len(tag)) % 4)
