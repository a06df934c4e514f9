"""What is checked before a request reaches the queue: its key, its size, its tenant.

Tenants: each API key is a tenant. Its cache chain is salted with a hash of the key (never the
key itself, which is then neither stored nor logged), plus the request's `cache_salt` (vLLM's
convention), so one tenant's cached prefixes are never reused for another, and timing cannot
reveal what another tenant asked. Without keys, `cache_salt` alone separates chains.

Where keys come from (`api_keys`): `--api-key-file PATH` (one key per line) and the environment
variable `EDGEKV_API_KEYS` (comma-separated) keep them out of the process list;
`--api-key KEY` works too, but every user of the machine can read it in `ps` and
`/proc/<pid>/cmdline`. A source that is named but yields no key is an error, never a server
left open by accident.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from starlette.requests import Request
from starlette.types import Receive

from ..errors import ConfigError
from .errors import APIError

__all__ = ["KEYS_ENV", "Tenant", "api_keys", "authenticate", "read_body", "wait_disconnect"]

log = logging.getLogger(__name__)

KEYS_ENV = "EDGEKV_API_KEYS"  # comma-separated API keys, beside --api-key / --api-key-file

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


def api_keys(keys: Sequence[str] = (), files: Sequence[str | Path] = (),
             environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The server's API keys: `keys` (from `--api-key`), each file's (one key per line; blank
    lines and lines starting with `#` are skipped) and `EDGEKV_API_KEYS` in `environ`
    (default: os.environ; comma-separated), in that order, each once. Raises ConfigError for
    a file that cannot be read, a file or a set variable without keys, or a key with
    whitespace in it."""
    env = os.environ if environ is None else environ
    found: list[str] = []
    for k in keys:
        found.append(_checked(k, "an --api-key"))
    for f in files:
        found += _read_key_file(Path(f))
    if KEYS_ENV in env:
        items = [k.strip() for k in env[KEYS_ENV].split(",")]
        if not any(items):
            raise ConfigError(f"{KEYS_ENV} is set but holds no key; give comma-separated "
                              "keys, or unset it to serve without keys")
        found += [_checked(k, f"a key in {KEYS_ENV}") for k in items if k]
    return tuple(dict.fromkeys(found))


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
                       "with one of the server's keys (--api-key-file, EDGEKV_API_KEYS or "
                       "--api-key)",
                       type="authentication_error", code="missing_api_key", headers=challenge)
    found = False
    for k in keys:  # compare with every key, in constant time, so timing tells nothing
        found |= hmac.compare_digest(token.encode(), k.encode())
    if not found:
        raise APIError(401, "invalid API key: use one of the server's keys (--api-key-file, "
                       "EDGEKV_API_KEYS or --api-key)",
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


# -- private helpers ----------------------------------------------------------------------

def _checked(key: str, what: str) -> str:
    key = key.strip()
    if not key:
        raise ConfigError(f"{what} is empty; give non-empty keys")
    if any(c.isspace() for c in key) or not key.isprintable():
        raise ConfigError(f"{what} holds whitespace or a control character; a key is one word "
                          "(it is sent as `Authorization: Bearer <key>`)")
    return key


def _read_key_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the API key file {path} ({e}); give a readable file "
                          "with one key per line") from None
    keys = [_checked(line, f"line {i} of {path}")
            for i, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key (only blank lines or "
                          "comments); put one key per line, or drop --api-key-file to serve "
                          "without keys")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the API key file %s is readable by other users (mode %o); "
                    "`chmod 600` it", path, stat.S_IMODE(mode))
    return keys
