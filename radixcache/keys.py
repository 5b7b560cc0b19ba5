"""Key format of the radix tree: a token sequence encoded once as `bytes`, 4 bytes per token, big-endian.

A page of tokens is then a slice of 4 x page_size bytes, so a child lookup is one dict lookup on the first page's
bytes, an edge comparison is one `bytes.startswith` (memcmp), and bytes order equals token order (the tree finds the
best partial page by bisection over its children's sorted keys).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

TOKEN_BYTES = 4
assert array("I").itemsize == TOKEN_BYTES, "this platform's C unsigned int is not 4 bytes"


def encode(tokens: Sequence[int]) -> bytes:
    """Token ids -> key bytes (4 bytes per token, big-endian). A bytes object is read as token ids, one per byte."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        tokens = list(tokens)  # array() would take raw bytes as machine words
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tobytes()


def decode(key: bytes) -> list[int]:
    """Key bytes -> token ids (the inverse of `encode`)."""
    arr = array("I", key)
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tolist()


def common_prefix(a: bytes, b: bytes) -> int:
    """Length in bytes of the common prefix of a and b (divide by TOKEN_BYTES for whole tokens)."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    if a == b:
        return n
    x = int.from_bytes(a, "big") ^ int.from_bytes(b, "big")
    return n - 1 - (x.bit_length() - 1) // 8
