"""PageData: one KV page, self-contained, as it leaves or enters a KVPool (the disk tier, tests, tools).

A page is its K/V in the pool's storage dtype plus the scales its precision needs (none at full precision), for
every layer: `kv` is [layers, 2 (K, V), page_size, kv_heads, stored_dim] and `scales`, when the precision has any,
has the shape the precision defines (radixcache.pool says which). `kv_dtype` names the precision ("fp32", "bf16",
"fp16", "int8", "fp8_e4m3", "int4"): a page is only ever written back into a page of the same precision and shape.

`to_bytes()` / `PageData.from_bytes(buf)` is the wire and disk format:

    b"RCKVPAGE" | header length (4 bytes, big-endian) | header (UTF-8 JSON) | kv bytes | scales bytes

The header is {"version": 1, "kv_dtype": name, "kv": {"dtype": torch dtype, "shape": [...]}, "scales": {...} or
null}; tensor bytes are the tensors' own memory (C order, little-endian as on every platform torch runs on).
from_bytes checks everything it reads and raises ValueError naming what is wrong; it never trusts a length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"RCKVPAGE"
VERSION = 1
_MAX_HEADER = 4096

# The tensor dtypes a page may be stored in, by the name the header uses.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_NAMES = {dtype: name for name, dtype in STORAGE_DTYPES.items()}


@dataclass(frozen=True, eq=False)
class PageData:
    """One page's K/V (and scales) for every layer, on the CPU, contiguous, owned (not a view of a pool)."""

    kv_dtype: str
    kv: torch.Tensor  # [layers, 2, page_size, kv_heads, stored_dim]
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[1] != 2:
            raise ValueError(f"a page's kv is [layers, 2, page_size, kv_heads, dim], got {tuple(self.kv.shape)}")
        for name, tensor in (("kv", self.kv), ("scales", self.scales)):
            if tensor is not None and tensor.dtype not in _DTYPE_NAMES:
                raise ValueError(f"a page's {name} cannot be stored as {tensor.dtype}")

    @property
    def page_size(self) -> int:
        return int(self.kv.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of K/V and scales (what the page costs in a pool)."""
        return sum(t.numel() * t.element_size() for t in (self.kv, self.scales) if t is not None)

    def equal(self, other: PageData) -> bool:
        """Same precision and bit-identical tensors."""
        mine, theirs = self.scales, other.scales
        if self.kv_dtype != other.kv_dtype or (mine is None) != (theirs is None):
            return False
        same_scales = mine is None or theirs is None or _same(mine, theirs)  # (both None, or neither)
        return _same(self.kv, other.kv) and same_scales

    def to_bytes(self) -> bytes:
        header = {"version": VERSION, "kv_dtype": self.kv_dtype, "kv": _describe(self.kv)}
        header["scales"] = None if self.scales is None else _describe(self.scales)
        head = json.dumps(header, separators=(",", ":")).encode("utf-8")
        parts = [MAGIC, len(head).to_bytes(4, "big"), head, _raw(self.kv)]
        if self.scales is not None:
            parts.append(_raw(self.scales))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> PageData:
        """Parse `to_bytes` output; ValueError (saying what) on a wrong magic, version, header, size or dtype."""
        buf = memoryview(data).cast("B")
        if len(buf) < len(MAGIC) + 4 or bytes(buf[: len(MAGIC)]) != MAGIC:
            raise ValueError("not a KV page: the magic bytes are missing")
        size = int.from_bytes(buf[len(MAGIC) : len(MAGIC) + 4], "big")
        start = len(MAGIC) + 4
        if size > _MAX_HEADER or start + size > len(buf):
            raise ValueError(f"KV page header of {size} bytes does not fit the {len(buf)} bytes given")
        try:
            header = json.loads(bytes(buf[start : start + size]).decode("utf-8"))
            version, kv_dtype = header["version"], header["kv_dtype"]
            specs = [header["kv"], header["scales"]]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"KV page header is unreadable: {exc}") from None
        if version != VERSION:
            raise ValueError(f"KV page format version {version!r}; this build reads version {VERSION}")
        if not isinstance(kv_dtype, str) or specs[0] is None:
            raise ValueError("KV page header names no kv dtype or no kv tensor")
        kv, offset = _read_tensor(buf, start + size, specs[0])
        scales = None
        if specs[1] is not None:
            scales, offset = _read_tensor(buf, offset, specs[1])
        if offset != len(buf):
            raise ValueError(f"KV page has {len(buf) - offset} bytes after its tensors")
        return cls(kv_dtype, kv, scales)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise: NaN payloads and -0.0 count, and float8 (which torch.equal does not compare on the CPU) works.
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _describe(tensor: torch.Tensor) -> dict:
    return {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _read_tensor(buf: memoryview, offset: int, spec: Any) -> tuple[torch.Tensor, int]:
    # `spec` is whatever the header's JSON holds there: a wrong type shows as the TypeError caught below.
    try:
        dtype = STORAGE_DTYPES[spec["dtype"]]
        shape = [int(n) for n in spec["shape"]]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"KV page header has a bad tensor entry {spec!r}") from None
    if any(n < 0 for n in shape) or len(shape) > 8:
        raise ValueError(f"KV page header has a bad shape {shape}")
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if offset + nbytes > len(buf):
        raise ValueError(f"KV page is truncated: a {spec['dtype']} tensor of shape {shape} needs {nbytes} bytes")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), offset
    raw = torch.frombuffer(bytearray(buf[offset : offset + nbytes]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape), offset + nbytes
