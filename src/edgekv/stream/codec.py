"""Chunk codec for the wire: quantize (optional), compress (zstd), encrypt (AES-GCM).

Levels:
- "f16": the fragment as stored, bit for bit (lossless for llama.cpp's f16 KV): the only level
  that keeps strict fidelity, so the default.
- "int8": per-channel symmetric int8 (scale = max|x| / 127 per layer and channel, over the
  chunk's tokens), in the spirit of CacheGen's per-channel quantization. ~2x smaller.
- "int4": per-channel asymmetric 4-bit (min/max per layer and channel, 16 levels), two values a
  byte. ~4x smaller.
Quantized levels change the KV and therefore the output; their cost is measured by the stream
benchmark and they are never used unless asked for.

Encryption: AES-256-GCM with a per-session key; the associated data binds a frame to its
session and chunk key, so a tampered, truncated or swapped frame fails authentication.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import ChunkRejected, ConfigError, CorruptEntry
from ..fragment import KVFragment
from ..serial import fragment_from_parts, fragment_header, pack, unpack

__all__ = ["LEVELS", "SessionCipher", "decode_chunk", "derive_session_key", "encode_chunk",
           "quantize_error"]

LEVELS = ("f16", "int8", "int4")


def _q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = x.astype(np.float32)
    scale = np.abs(x).max(axis=1, keepdims=True) / 127.0  # [L, 1, E]
    scale[scale == 0] = 1.0
    return np.clip(np.rint(x / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


def _dq8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * scale).astype(np.float16)


def _q4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = x.astype(np.float32)
    lo = x.min(axis=1, keepdims=True)
    step = (x.max(axis=1, keepdims=True) - lo) / 15.0
    step[step == 0] = 1.0
    q = np.clip(np.rint((x - lo) / step), 0, 15).astype(np.uint8).reshape(-1)
    if q.size % 2:
        q = np.append(q, np.uint8(0))
    packed = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)
    return packed, lo.astype(np.float32), step.astype(np.float32)


def _dq4(packed: np.ndarray, lo: np.ndarray, step: np.ndarray,
         shape: tuple[int, ...]) -> np.ndarray:
    q = np.empty(packed.size * 2, np.uint8)
    q[0::2], q[1::2] = packed & 0x0F, packed >> 4
    out = q[: int(np.prod(shape))].reshape(shape)
    return (out.astype(np.float32) * step + lo).astype(np.float16)


def encode_chunk(frag: KVFragment, level: str = "f16", *, zstd_level: int = 3) -> bytes:
    import zstandard

    if level not in LEVELS:
        raise ConfigError(f"codec level {level!r} is not one of {LEVELS}")
    header: dict[str, object] = {**fragment_header(frag), "codec": level}
    arrays: dict[str, np.ndarray | None] = {"token_ids": frag.token_ids,
                                            "embedding": frag.embedding}
    if level == "f16":
        arrays.update(keys=frag.keys, values=frag.values)
    elif level == "int8":
        for name in ("keys", "values"):
            q, s = _q8(getattr(frag, name))
            arrays.update({f"{name}_q": q, f"{name}_scale": s})
    else:
        for name in ("keys", "values"):
            t = getattr(frag, name)
            q, lo, step = _q4(t)
            arrays.update({f"{name}_q": q, f"{name}_lo": lo, f"{name}_step": step})
            header[f"{name}_shape"] = list(t.shape)
    return zstandard.ZstdCompressor(level=zstd_level).compress(pack(header, arrays))


def decode_chunk(data: bytes) -> KVFragment:
    import zstandard

    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 30)
        header, arrays = unpack(raw)
    except (zstandard.ZstdError, CorruptEntry) as e:
        raise ChunkRejected(f"chunk does not decode: {e}") from None
    level = header.pop("codec", None)
    parts = {k: v for k, v in arrays.items() if k in ("token_ids", "embedding")}
    try:
        if level == "f16":
            parts.update(keys=arrays["keys"], values=arrays["values"])
        elif level == "int8":
            for name in ("keys", "values"):
                parts[name] = _dq8(arrays[f"{name}_q"], arrays[f"{name}_scale"])
        elif level == "int4":
            for name in ("keys", "values"):
                spec: Any = header.pop(f"{name}_shape")  # malformed: TypeError, below
                shape = tuple(int(x) for x in spec)
                parts[name] = _dq4(arrays[f"{name}_q"], arrays[f"{name}_lo"],
                                   arrays[f"{name}_step"], shape)
        else:
            raise ChunkRejected(f"unknown codec level {level!r}")
        return fragment_from_parts(header, parts)
    except (KeyError, ValueError, TypeError, CorruptEntry) as e:
        raise ChunkRejected(f"chunk payload is malformed: {e}") from None


def quantize_error(frag: KVFragment, level: str) -> dict[str, float]:
    """Max and mean absolute error of a level on one fragment (K and V together)."""
    back = decode_chunk(encode_chunk(frag, level))
    d = np.concatenate([(back.keys.astype(np.float32) - frag.keys.astype(np.float32)).ravel(),
                        (back.values.astype(np.float32) - frag.values.astype(np.float32)).ravel()])
    return {"max_abs": float(np.abs(d).max()), "mean_abs": float(np.abs(d).mean())}


class SessionCipher:
    """AES-256-GCM for one session; `aad` names what a frame is (session + chunk key)."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if len(key) != 32:
            raise ConfigError("session key must be 32 bytes (AES-256)")
        self._aead = AESGCM(key)

    def seal(self, plaintext: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, plaintext, aad)

    def open(self, frame: bytes, aad: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        if len(frame) < 28:
            raise ChunkRejected("frame too short to be authentic")
        try:
            return self._aead.decrypt(frame[:12], frame[12:], aad)
        except InvalidTag:
            raise ChunkRejected(
                "chunk failed authentication (tampered, truncated or misplaced)") from None


def derive_session_key(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HKDF-SHA256 over a pre-shared secret and both sides' nonces: a fresh key per session."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=client_nonce + server_nonce,
                info=b"edgekv-session-v1").derive(secret)

