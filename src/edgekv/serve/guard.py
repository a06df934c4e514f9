"""What is checked before a request reaches the queue: its key, its size, its tenant.

Tenants: each API key is a tenant. Its cache chain is salted with a hash of the key (never the
key itself, which is then neither stored nor logged), plus the request's `cache_salt` (vLLM's
convention), so one tenant's cached prefixes are never reused for another, and timing cannot
reveal what another tenant asked. Without keys, `cache_salt` alone separates chains.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.requests import Request
from starlette.types import Receive

from .errors import APIError

__all__ = ["Tenant", "authenticate", "read_body", "wait_disconnect"]

DRAIN_LIMIT = 16 * 1024 * 1024  # an oversized body is read (and dropped) up to this, so the
# client, still sending, gets its 413 instead of a reset connection


class Tenant:
    """Who a request belongs to: `queue` keys the fair queue, `salt` the cache chain."""

    __slots__ = ("key_hash",)

    def __init__(self, key_hash: str = "") -> None:
        self.key_hash = key_hash

    def salt(self, cache_salt: str | None) -> str:
        if self.key_hash and cache_salt:
            return f"{self.key_hash}:{cache_salt}"
        return self.key_hash or cache_salt or ""

    def queue(self, cache_salt: str | None) -> str:
        # with keys, the key alone: a cache_salt per request must not buy more queue places
        return self.key_hash or cache_salt or ""


def key_hash(key: str) -> str:
    return hashlib.sha256(b"edgekv-serve-tenant\0" + key.encode()).hexdigest()[:32]


def authenticate(request: Request, keys: Sequence[str]) -> Tenant:
    """The tenant of `request`; with keys configured, a missing or unknown key is a 401."""
    if not keys:
        return Tenant()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "missing API key: send the header `Authorization: Bearer <key>` "
                       "with a key given to the server by --api-key",
                       type="authentication_error", code="missing_api_key", headers=challenge)
    found = False
    for k in keys:  # compare with every key, in constant time, so timing tells nothing
        found |= hmac.compare_digest(token.encode(), k.encode())
    if not found:
        raise APIError(401, "invalid API key: use a key given to the server by --api-key",
                       type="authentication_error", code="invalid_api_key", headers=challenge)
    return Tenant(key_hash(token))


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes `limit` bytes."""
    too_big = APIError(413, f"the request body is over the {limit}-byte limit; send a shorter "
                       "prompt", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max(limit, DRAIN_LIMIT):
        raise too_big
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size <= limit:
            parts.append(part)
        elif size > DRAIN_LIMIT:
            break
    if size > limit:
        raise too_big
    return b"".join(parts)


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (call after the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
