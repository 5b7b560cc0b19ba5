"""ObjectStore: what the remote tier (radixcache.remote_tier) needs of a fleet's shared key-value store, and the
address a worker is given for one (`serve --kv-remote mooncake://HOST:PORT`).

Every call takes a deadline (`timeout`, seconds) and either answers within it or raises `StoreUnavailable`: the
store is down, unreachable, too slow, or said something that is neither a value nor "no such object". A miss is
never an error (get: None; exists: False), so the tier can tell "the fleet does not have it" from "the fleet cannot
be asked". Implementations: radixcache.mooncake_store.MooncakeObjectStore (imported only when a worker is given
--kv-remote); tests use an in-memory fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

STORE_SCHEMES = ("mooncake",)


class StoreUnavailable(RuntimeError):
    """The store did not answer within the deadline, or answered with an error."""


class ObjectStore(Protocol):
    def connect(self, timeout: float) -> None:
        """Join the store (idempotent once it worked); StoreUnavailable when it cannot within `timeout`."""
        ...

    def get(self, key: str, timeout: float) -> bytes | None:
        """The object's bytes, or None when there is no such object."""
        ...

    def get_many(self, keys: list[str], timeout: float) -> list[bytes | None]:
        """Each object's bytes (None: no such object), in one call: a run of pages costs one round trip."""
        ...

    def put(self, key: str, data: bytes, timeout: float) -> None:
        """Store `data` under `key` (an existing object may keep its old value: callers check `exists` first)."""
        ...

    def exists(self, key: str, timeout: float) -> bool: ...

    def exists_many(self, keys: list[str], timeout: float) -> list[bool]:
        """`exists` of each key, in one call."""
        ...

    def put_many(self, keys: list[str], datas: list[bytes], timeout: float) -> None:
        """`put` of each (key, data), in one call (StoreUnavailable: none may be assumed written)."""
        ...

    def remove(self, key: str, timeout: float) -> None:
        """Remove the object if it is there (a missing one is no error)."""
        ...

    def remove_prefix(self, prefix: str, timeout: float) -> None:
        """Remove every object whose key starts with `prefix`."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StoreAddress:
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def parse_store_url(url: str, field: str = "kv_remote") -> StoreAddress:
    """`mooncake://HOST:PORT` (the master's RPC address) as a StoreAddress; ValueError naming `field` otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in STORE_SCHEMES:
        raise ValueError(f"{field} must look like mooncake://HOST:PORT, got {url!r}")
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must look like mooncake://HOST:PORT (a port in 1-65535), got {url!r}")
    return StoreAddress(scheme, host.strip("[]"), int(port))
