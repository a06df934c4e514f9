"""Wire protocol shared by `server` and `client` (HTTP/1.1 on loopback by default).

    GET  /v1/info                      -> {"fingerprint", "model", "chunk_size", "codecs"}
    POST /v1/session {"client_nonce"}  -> {"session", "server_nonce"}
         session key = HKDF-SHA256(pre-shared secret, client_nonce + server_nonce)
    POST /v1/has {"keys": [...]}       -> {"has": [bool, ...]}
    POST /v1/precompute {"tokens": [...]} or {"prompt": "..."} -> {"keys": [...], "stored": n}
    POST /v1/chunks {"session", "keys", "codec"} -> chunked stream of frames, in key order:
         u32 length | u8 status (0 ok, 1 missing) | sealed chunk (status 0 only)
         sealed = AES-256-GCM(session key, encode_chunk(fragment, codec)),
         associated data = session id + "|" + chunk key
"""

from __future__ import annotations

import struct

__all__ = ["FRAME", "MISSING", "OK", "aad"]

FRAME = struct.Struct("<IB")
OK, MISSING = 0, 1


def aad(session: str, key: str) -> bytes:
    return f"{session}|{key}".encode()
