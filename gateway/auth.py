"""Bearer-key authentication: keys from a file (one per line, `#` comments), compared in
constant time; the probes (`/health/live`, `/health/ready`) stay open, everything else — also
`/metrics` — needs a key once keys are set. Also the bind rule: a non-loopback host without a key
is refused unless the operator explicitly allows it. Keys are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError
from gateway.logging import record_error

OPEN_PATHS = frozenset({"/health/live", "/health/ready"})


class AuthConfigError(Exception):
    """The key file or the bind/auth combination is unusable; the service must not start."""


def load_keys(path: Path | None) -> tuple[bytes, ...]:
    if path is None:
        return ()
    try:
        lines = path.expanduser().read_text().splitlines()
    except OSError as exc:
        raise AuthConfigError(f"cannot read the API key file {path}: {exc.strerror or exc}") from None
    keys = tuple(line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise AuthConfigError(f"the API key file {path} holds no key")
    return keys


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or wildcard we cannot prove is local


def check_bind(host: str, keys: tuple[bytes, ...], allow_unauthenticated: bool) -> None:
    if not keys and not is_loopback(host) and not allow_unauthenticated:
        raise AuthConfigError(f"refusing to serve on {host} without an API key: pass --api-key-file, or "
                              "--allow-unauthenticated if something in front of iq36 authenticates")


def key_id(key: bytes) -> str:
    """A stable, non-reversible name for a key: what owns a stored response (never the key)."""
    return hashlib.sha256(b"iq36-key:" + key).hexdigest()[:32]


def owner(scope: Scope) -> str:
    """The key id that authenticated this request ("" when auth is off)."""
    return str(scope.get("state", {}).get("key_id", ""))


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    # Compare against every key (no early exit) so timing does not tell which one matched.
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[bytes, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and token.strip() and key_matches(token.strip(), self.keys):
            scope.setdefault("state", {})["key_id"] = key_id(token.strip())
            await self.app(scope, receive, send)
            return
        error = APIError("invalid_api_key", "missing or invalid API key: send 'Authorization: Bearer <key>'")
        record_error(error.code)
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": error.body_bytes()})
