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
session, request and chunk key (`protocol.aad`), so a tampered, truncated, swapped or replayed
frame fails authentication.

Decoding never trusts a length or shape field: the zstd frame is decompressed in steps up to a
bound (`max_plain_bytes`: never more than 32x the compressed size, a ratio KV never reaches),
and every array's shape is checked against the others before anything is computed from it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import ChunkRejected, ConfigError, CorruptEntry
from ..fragment import KVFragment
from ..serial import fragment_from_parts, fragment_header, pack, unpack

__all__ = ["LEVELS", "SessionCipher", "decode_chunk", "derive_session_keys", "encode_chunk",
           "max_plain_bytes", "quantize_error"]

LEVELS = ("f16", "int8", "int4")
MAX_CHUNK_BYTES = 1 << 30  # a decompressed chunk is never larger than this
MAX_RATIO = 32  # nor this many times its compressed size (f16 KV compresses < 2x) ...
MIN_BOUND = 16 << 20  # ... unless it is this small
F16_LIMIT = 65519.0  # the largest magnitude that still rounds to a finite float16


def _q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = x.astype(np.float32)
    scale = np.abs(x).max(axis=1, keepdims=True) / 127.0  # [L, 1, E]
    scale[scale == 0] = 1.0
    return np.clip(np.rint(x / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


def _dq8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if (q.dtype != np.int8 or q.ndim != 3 or scale.dtype != np.float32
            or scale.shape != (q.shape[0], 1, q.shape[2])):
        raise ChunkRejected(f"int8 chunk: values {q.dtype}{q.shape} and scales "
                            f"{scale.dtype}{scale.shape} do not match")
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.all(np.abs(scale) * 127 <= F16_LIMIT)  # inf and NaN fail too
    if not ok:
        raise ChunkRejected("int8 chunk: a scale is not finite or overflows float16")
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
    if len(shape) != 3 or not all(1 <= d <= 1 << 31 for d in shape):
        raise ChunkRejected(f"int4 chunk: shape {shape} is not 3 positive sizes")
    n = shape[0] * shape[1] * shape[2]
    side = (shape[0], 1, shape[2])
    if (packed.dtype != np.uint8 or packed.ndim != 1 or packed.size != (n + 1) // 2
            or lo.dtype != np.float32 or step.dtype != np.float32
            or lo.shape != side or step.shape != side):
        raise ChunkRejected(f"int4 chunk: {packed.size} packed bytes, bounds {lo.shape} and "
                            f"{step.shape} do not fit shape {shape}")
    with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN are refused just below
        ok = np.all(np.abs(lo) + 15 * np.abs(step) <= F16_LIMIT)
    if not ok:
        raise ChunkRejected("int4 chunk: a bound is not finite or overflows float16")
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


def max_plain_bytes(compressed: int) -> int:
    """The most a chunk of `compressed` bytes may decompress to."""
    return min(MAX_CHUNK_BYTES, max(MIN_BOUND, MAX_RATIO * compressed))


def _decompress(data: bytes) -> bytes:
    """One zstd frame, decompressed in 1 MiB steps up to `max_plain_bytes`: neither a
    declared content size nor a decompression bomb makes us allocate more."""
    import zstandard

    limit = max_plain_bytes(len(data))
    try:
        declared = zstandard.get_frame_parameters(data).content_size
        if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
            raise ChunkRejected(f"chunk declares {declared} bytes, over its {limit}-byte bound")
        parts, size = [], 0
        with zstandard.ZstdDecompressor().stream_reader(data) as r:
            while part := r.read(1 << 20):
                size += len(part)
                if size > limit:
                    raise ChunkRejected(f"chunk decompresses past its {limit}-byte bound")
                parts.append(part)
    except zstandard.ZstdError as e:
        raise ChunkRejected(f"chunk does not decompress: {e}") from None
    return b"".join(parts)


def decode_chunk(data: bytes) -> KVFragment:
    """The fragment in a chunk; ChunkRejected (and nothing else) for any damage."""
    raw = _decompress(data)
    try:
        header, arrays = unpack(raw)
    except CorruptEntry as e:
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
                spec: Any = header.pop(f"{name}_shape")
                if not isinstance(spec, list) or not all(
                        type(x) is int for x in spec):  # noqa: E721 - bool is no size
                    raise ChunkRejected(f"int4 chunk: {name}_shape is not a list of sizes")
                shape = tuple(spec)
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


def derive_session_keys(secret: bytes, client_nonce: bytes,
                        server_nonce: bytes) -> tuple[bytes, bytes]:
    """HKDF-SHA256 over a pre-shared secret and both sides' nonces: fresh keys per session,
    (AES-256-GCM key for chunks, HMAC key for requests)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    keys = HKDF(algorithm=hashes.SHA256(), length=64, salt=client_nonce + server_nonce,
                info=b"edgekv-session-v2").derive(secret)
    return keys[:32], keys[32:]

