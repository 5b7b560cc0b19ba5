"""Which Host names the HTTP front answers: a guard against DNS rebinding.

A web page on evil.example can make the visitor's browser resolve evil.example to 127.0.0.1 and then send requests
to a worker on the visitor's localhost, with `Host: evil.example:PORT`; with auth off (the default) it could then
generate, or read the answers. Browsers always send the name they resolved, so refusing names that are not this
server's stops it. IP literals are always accepted: a rebinding page never uses one.

    allowed = allowed_hosts(bind_host, names)   # None: any Host
    app.add_middleware(HostCheck, allowed=allowed)

The rule (`allowed_hosts`): bound to a loopback address (the default, 127.0.0.1), the front answers `localhost`
and `*.localhost` (which browsers resolve to loopback themselves); with `--http-allowed-hosts` it answers those
names too, whatever it binds ("*": any name). Bound beyond loopback without the flag, it answers any Host: the
port is on the network then, and the names it is reached by (a load balancer's, a Kubernetes service's) are not
known here; auth (`--auth-tokens`) is what protects it. `GET /health` answers any Host: what it tells ("serving")
is harmless, and load balancers' probes name whatever they like.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from starlette.responses import JSONResponse

from radixcache.worker.http.errors import APIError
from radixcache.worker.http.openai.errors import error_body

LOOPBACK_NAMES = frozenset({"localhost"})


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, names: Iterable[str] | None = None) -> frozenset[str] | None:
    """The Host names answered (IP literals aside) for a front bound to `bind_host`; None: any (see the module
    docstring). `names`: --http-allowed-hosts."""
    given = [n.strip().lower().rstrip(".") for n in names or () if n.strip()]
    if "*" in given:
        return None
    if given:
        return LOOPBACK_NAMES | frozenset(given)
    return LOOPBACK_NAMES if is_loopback(bind_host) else None


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "Example.COM.:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


def host_allowed(header: str | None, allowed: frozenset[str] | None) -> bool:
    if allowed is None or header is None:  # no Host at all: HTTP/1.0, never a browser
        return True
    name = host_name(header)
    if name in allowed or _is_ip(name):
        return True
    return name.endswith(".localhost") and "localhost" in allowed


class HostCheck:
    """ASGI middleware: a request whose Host is not allowed is answered 400 in OpenAI's error shape, unread."""

    def __init__(self, app: Any, allowed: frozenset[str] | None) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.allowed is not None and scope["path"] != "/health":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not host_allowed(header, self.allowed):
                error = APIError(
                    400,
                    f"Host {header!r} is not a name this server answers to; start it with --http-allowed-hosts "
                    "naming it",
                    code="invalid_host",
                )
                await JSONResponse(error_body(error), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)
