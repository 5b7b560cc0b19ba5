"""Bearer-token authentication: a token names a tenant, and the tenant is the caller's cache namespace.

The tokens file is either a JSON object {"<token>": "<tenant>", ...} or text with one "<token> <tenant>" per line
(blank lines and lines starting with # are skipped). Tenants are names made of letters, digits and "._-", so a
tenant name can be joined with a request id without ambiguity.

A token may be marked admin: in JSON {"<token>": {"tenant": "<tenant>", "admin": true}}, in text a third field
"admin" ("<token> <tenant> admin"). Admin tokens may also call what reveals every tenant's data (the cache event
stream); as tenants they are like any other.

Tokens are kept only as SHA-256 digests: the lookup then compares digests, which says nothing (through timing) about
how much of a guessed token was right.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def load_tokens(path: str | Path) -> dict[str, str]:
    """Parse a tokens file into {token: tenant}; ValueError names the bad line or entry."""
    return load_token_file(path)[0]


def _json_entry(path: str | Path, key: str, value: object) -> tuple[str, bool]:
    if isinstance(value, dict):
        unknown = set(value) - {"tenant", "admin"}
        if unknown or "tenant" not in value or not isinstance(value.get("admin", False), bool):
            raise ValueError(f'{path}: key {key[:4]}...: expected "<tenant>" or {{"tenant": ..., "admin": true|false}}')
        return str(value["tenant"]), value.get("admin", False)
    return str(value), False


def load_token_file(path: str | Path) -> tuple[dict[str, str], set[str]]:
    """Parse a tokens file into ({token: tenant}, the tokens marked admin); ValueError names the bad line or entry."""
    text = Path(path).read_text(encoding="utf-8")
    admins: set[str] = set()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        pairs = []
        for k, v in data.items():
            tenant, admin = _json_entry(path, str(k), v)
            pairs.append((str(k), tenant))
            if admin:
                admins.add(str(k))
        where = [f"key {k[:4]}..." for k, _ in pairs]
    else:
        pairs, where = [], []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) == 3 and parts[2] == "admin":
                admins.add(parts[0])
            elif len(parts) != 2:
                raise ValueError(f"{path}:{number}: expected '<token> <tenant>' or '<token> <tenant> admin'")
            pairs.append((parts[0], parts[1]))
            where.append(f"line {number}")
    tokens: dict[str, str] = {}
    for (token, tenant), at in zip(pairs, where, strict=True):
        if not token:
            raise ValueError(f"{path}: {at}: empty token")
        if not TENANT_PATTERN.match(tenant):
            raise ValueError(f"{path}: {at}: tenant {tenant!r} must be 1..64 characters of letters, digits, '._-'")
        if token in tokens and tokens[token] != tenant:
            raise ValueError(f"{path}: {at}: the same token is given to two tenants")
        tokens[token] = tenant
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens, admins


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class Authenticator:
    """Maps the `authorization: Bearer <token>` metadata of a call to a tenant.

    Without tokens (auth disabled) every caller is the anonymous tenant "" and an admin. `admins`: the tokens (among
    `tokens`) marked admin.
    """

    def __init__(self, tokens: Mapping[str, str] | None = None, admins: Iterable[str] = ()) -> None:
        self._tenants = {_digest(t): tenant for t, tenant in (tokens or {}).items()}
        self._admins = {_digest(t) for t in admins}
        if not self._admins <= self._tenants.keys():
            raise ValueError("an admin token must also be a token with a tenant")

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The caller's tenant, or None when auth is enabled and the token is missing or unknown."""
        if not self.enabled:
            return ""
        digest = self._bearer(metadata)
        return None if digest is None else self._tenants.get(digest)

    def is_admin(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether the caller's token is marked admin (always, when auth is disabled)."""
        return not self.enabled or self._bearer(metadata) in self._admins

    @staticmethod
    def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
        for key, value in metadata or ():
            if key.lower() != "authorization":
                continue
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return _digest(token.strip())
        return None
