"""Wire protocol shared by `server` and `client` (HTTP/1.1 on loopback by default).

    GET  /v1/info                       -> {"fingerprint", "model", "chunk_size", "codecs"}
                                           (public: nothing in it is secret)
    POST /v1/session {"client_nonce", "tenant", "fingerprint"?, "proof"}
                                        -> {"session", "server_nonce", "proof"}
         proof        = HMAC(tenant secret, "open" | tenant | client_nonce | fingerprint)
         server proof = HMAC(tenant secret, "accept" | tenant | client_nonce | server_nonce
                             | session): the client checks that the server knows the secret too
         session keys = HKDF-SHA256(tenant secret, client_nonce + server_nonce): one for
                        AES-GCM, one for request MACs
    every other POST carries `Authorization: EdgeKV-HMAC-SHA256 <session>:<seq>:<mac>`,
         mac = HMAC(request key, method | path | seq | SHA-256(body)); `seq` counts up per
         session and a seq is accepted once (a replayed request is refused)
    POST /v1/has {"keys": [...]}        -> {"has": [bool, ...]}
    POST /v1/precompute {"tokens": [...]} or {"prompt": "..."} -> {"keys": [...], "stored": n}
    POST /v1/chunks {"keys", "codec", "fingerprint"?} -> chunked stream of frames, in key order:
         u32 length | u8 status (0 ok, 1 missing) | sealed chunk (status 0 only)
         sealed = AES-256-GCM(session key, encode_chunk(fragment, codec)),
         associated data = session | seq of the request | index in the request | chunk key,
         so a chunk captured from one request (or session) fails to open in any other

Refusals: 401 (no, garbled or wrong authentication, or a replayed request), 403 (unknown or
expired session, or a request for another model), 400 (bad input), 413 (body too large),
408 (request not received in time), 503 (too many connections).

Tenants: a tenant's secret is `tenant_secret(master, name)`; the master secret's holder (the
server) can derive every tenant's, a tenant cannot derive another's. The default tenant ""
uses the master secret itself. A tenant's chunks live in its own key chain
(`keys.tenant_root`), and the server serves a chunk only to the tenant whose chain it is.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["AUTH_SCHEME", "AuthFailed", "FRAME", "MAX_FRAME_BYTES", "MISSING", "OK", "aad",
           "accept_proof", "auth_header", "check_tenant", "open_proof", "parse_auth",
           "read_frames", "request_mac", "tenant_secret"]

FRAME = struct.Struct("<IB")
OK, MISSING = 0, 1
MAX_FRAME_BYTES = 1 << 30  # a sealed chunk larger than this is refused before it is read
SEAL_OVERHEAD = 28  # AES-GCM: 12-byte nonce + 16-byte tag
AUTH_SCHEME = "EdgeKV-HMAC-SHA256"
_TENANT = re.compile(r"^[A-Za-z0-9._-]{0,64}$")
_AUTH = re.compile(r"^([0-9a-f]{32}):([1-9][0-9]{0,17}):([0-9a-f]{64})$")


class AuthFailed(Exception):
    """A request that does not prove knowledge of its session key (answered 401)."""


def aad(session: str, seq: int, index: int, key: str) -> bytes:
    """What a sealed chunk is bound to: its session, its request, its place and its key."""
    return f"{session}|{seq}|{index}|{key}".encode()


def check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not _TENANT.match(tenant):
        raise ValueError("tenant must be 0-64 characters from [A-Za-z0-9._-]")
    return tenant


def tenant_secret(master: bytes, tenant: str) -> bytes:
    """Tenant `tenant`'s secret, derived from the server's master secret ("" -> the master)."""
    check_tenant(tenant)
    if not tenant:
        return master
    return hmac.new(master, b"edgekv-kv-tenant-v1\0" + tenant.encode(), hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def open_proof(secret: bytes, tenant: str, client_nonce: bytes, fingerprint: str) -> bytes:
    return _mac(secret, b"edgekv-open-v1", tenant.encode(), client_nonce, fingerprint.encode())


def accept_proof(secret: bytes, tenant: str, client_nonce: bytes, server_nonce: bytes,
                 session: str) -> bytes:
    return _mac(secret, b"edgekv-accept-v1", tenant.encode(), client_nonce, server_nonce,
                session.encode())


def request_mac(key: bytes, method: str, path: str, seq: int, body: bytes) -> bytes:
    return _mac(key, b"edgekv-request-v1", method.encode(), path.encode(), str(seq).encode(),
                hashlib.sha256(body).digest())


def auth_header(session: str, seq: int, mac: bytes) -> str:
    return f"{AUTH_SCHEME} {session}:{seq}:{mac.hex()}"


def parse_auth(value: str | None) -> tuple[str, int, bytes]:
    """(session, seq, mac) of an Authorization header; AuthFailed if missing or garbled."""
    if not value:
        raise AuthFailed(f"missing Authorization header ({AUTH_SCHEME}); open a session first")
    scheme, _, rest = value.strip().partition(" ")
    m = _AUTH.match(rest.strip())
    if scheme != AUTH_SCHEME or m is None:
        raise AuthFailed(f"garbled Authorization header: expected '{AUTH_SCHEME} "
                         "<session>:<seq>:<mac>'")
    return m.group(1), int(m.group(2)), bytes.fromhex(m.group(3))


def read_frames(read: Callable[[int], bytes], keys: list[str], session: str, seq: int,
                open_sealed: Callable[[bytes, bytes], bytes],
                decode: Callable[[bytes], Any]) -> Iterator[tuple[int, Any, int]]:
    """Decode a /v1/chunks response: (index, fragment or None if missing, wire bytes) per key.

    `read(n)` returns exactly n bytes or raises (TransportError, StreamTimeout);
    `open_sealed(frame, aad)` authenticates and decrypts (ChunkRejected); `decode(plain)`
    turns a chunk into a fragment (ChunkRejected). A frame header that cannot be right (an
    unknown status, a missing chunk with a body, a length no sealed chunk has) raises
    ChunkRejected before a byte of its body is read, so no length field makes us allocate.
    """
    from ..errors import ChunkRejected

    for i, key in enumerate(keys):
        head = read(FRAME.size)
        length, status = FRAME.unpack(head)
        if status == MISSING:
            if length:
                raise ChunkRejected(f"frame {i}: a missing chunk with a {length}-byte body")
            yield i, None, len(head)
            continue
        if status != OK or not SEAL_OVERHEAD <= length <= MAX_FRAME_BYTES:
            raise ChunkRejected(f"frame {i}: bad header for {key[:12]} (status {status}, "
                                f"length {length})")
        sealed = read(length)
        frag = decode(open_sealed(sealed, aad(session, seq, i, key)))
        if frag.chain_key != key:
            raise ChunkRejected(f"server sent chunk {frag.chain_key[:12]} for {key[:12]}")
        yield i, frag, len(head) + length
