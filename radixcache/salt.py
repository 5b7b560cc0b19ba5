"""Cache salts: a request's salted pages share nothing with pages of another salt, or of none, in the same namespace.

A salt (vLLM's `cache_salt`) is a string a client chooses. `CacheSalt(salt, shared_tokens)` may leave a leading span
unsalted: its first `shared_tokens` tokens, rounded DOWN to a whole page (`shared_pages`), so that a page is either
wholly shared or wholly salted. That span is looked up and stored in the request's own namespace like any unsalted
prompt (every salt and no salt share it); the pages after it live in the salted namespace

    salted_namespace(namespace, salt, shared_hash) = namespace + "#salt:" + 16 hex digits of
        BLAKE2b(len(salt) as 4 bytes big-endian || salt (UTF-8) || shared_hash as 8 bytes big-endian, digest_size=8)

where shared_hash is the page hash (radixcache.events, full precision) of the shared span's last page, or 0 without
one. That namespace is a root of its own in the tree, so it is reached only from that exact span with that exact salt:
a lookup with another salt, or none, cannot match a salted page, and the salted pages' hashes (in events, tier keys
and router indexes) are those of the salted namespace: they name the salt, and the shared span keeps its unsalted
hashes. "#" never occurs in a tenant's name (radixcache.worker.front.auth), so no tenant can name a salted namespace.

What a salt protects, and what not: another client of the same tenant (namespace) that does not know the salt cannot
hit, and so cannot time, the salted pages. A salt is not an identity: whoever knows it shares the pages. Tenants
(the namespaces, from --auth-tokens) stay the trust boundary; a salt only divides one tenant's cache further.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from radixcache.events import page_hashes

SALT_SEPARATOR = "#salt:"  # between a namespace and its salt's digest (never in a tenant's name)


@dataclass(frozen=True, slots=True)
class CacheSalt:
    """A request's salt and the leading tokens it leaves unsalted (rounded down to a page by the cache)."""

    salt: str
    shared_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.salt:
            raise ValueError("a cache salt must not be empty (no salt is None)")
        if self.shared_tokens < 0:
            raise ValueError(f"shared_tokens must be >= 0, got {self.shared_tokens}")

    def shared_pages(self, page_size: int) -> int:
        """Whole pages of the unsalted span."""
        return self.shared_tokens // page_size


def salted_namespace(namespace: str, salt: str, shared_hash: int) -> str:
    """The namespace of the salted pages that follow a shared span ending in the page of `shared_hash` (0: none)."""
    raw = salt.encode("utf-8")
    digest = blake2b(len(raw).to_bytes(4, "big") + raw + shared_hash.to_bytes(8, "big"), digest_size=8).hexdigest()
    return f"{namespace}{SALT_SEPARATOR}{digest}"


def owner_namespace(namespace: str) -> str:
    """The tenant's namespace of a (possibly salted) namespace."""
    return namespace.split(SALT_SEPARATOR, 1)[0]


def salted_split(tokens: Sequence[int], page_size: int, namespace: str, salt: CacheSalt) -> tuple[int, str | None]:
    """Where `tokens` leave the shared span (a multiple of page_size) and the namespace of what follows it; None
    while the tokens do not go past the span (nothing of them is salted yet)."""
    shared = salt.shared_pages(page_size) * page_size
    if len(tokens) <= shared:
        return shared, None
    hashes = page_hashes(tokens[:shared], page_size, namespace) if shared else [0]
    return shared, salted_namespace(namespace, salt.salt, hashes[-1])


def salted_page_hashes(
    tokens: Sequence[int], page_size: int, namespace: str, salt: CacheSalt, *, kv_dtype: str | None = None
) -> list[int]:
    """The page hashes of `tokens` salted so, as a worker's events name them: the shared span's in `namespace`,
    then the rest's in the salted namespace (whose first page continues no parent). What a router looks up."""
    shared, salted = salted_split(tokens, page_size, namespace, salt)
    head = page_hashes(tokens[:shared], page_size, namespace, kv_dtype=kv_dtype)
    if salted is None:
        return head
    return head + page_hashes(tokens[shared:], page_size, salted, kv_dtype=kv_dtype)
