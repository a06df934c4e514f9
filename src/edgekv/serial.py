"""A self-verifying binary container for one `KVFragment`.

    b"EKVF" | u16 version | u32 header length | header (JSON) | tensors | SHA-256 of all before

The trailing digest covers every byte, so truncation, bit flips and a swapped header are all
caught on read and surface as `CorruptEntry` (which stores turn into a logged miss).
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from .errors import CorruptEntry, FragmentError
from .fragment import KVFragment

__all__ = ["FORMAT_VERSION", "decode_fragment", "encode_fragment", "pack", "peek_header", "unpack"]

MAGIC = b"EKVF"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<4sHI")
_DIGEST = 32
_SCALARS = (
    "model_fingerprint", "chain_key", "token_start", "token_end", "layer_start", "layer_end",
    "layer_stride", "n_layer_model", "created_at", "expires_at", "hit_count", "content_hash",
    "parent_key", "head_start", "head_end",
)
_ARRAYS = ("token_ids", "keys", "values", "embedding")


def pack(header: dict[str, object], arrays: dict[str, np.ndarray | None]) -> bytes:
    """Header (JSON) + little-endian arrays + SHA-256 trailer."""
    parts: list[bytes] = []
    offset = 0
    tensors: dict[str, object] = {}
    for name, arr in arrays.items():
        if arr is None:
            continue
        arr = np.ascontiguousarray(arr)
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        tensors[name] = {"dtype": arr.dtype.str.lstrip("<>|="), "shape": list(arr.shape),
                         "offset": offset, "nbytes": len(data)}
        parts.append(data)
        offset += len(data)
    head = json.dumps({**header, "tensors": tensors}, sort_keys=True).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head + b"".join(parts)
    return body + hashlib.sha256(body).digest()


def unpack(blob: bytes | memoryview) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """Inverse of `pack`; raises CorruptEntry on any damage."""
    header, payload = _split(blob)
    tensors = header.pop("tensors", None)
    if not isinstance(tensors, dict):
        raise CorruptEntry("header.tensors is not an object")
    arrays: dict[str, np.ndarray] = {}
    try:
        for name, meta in tensors.items():
            off, n = int(meta["offset"]), int(meta["nbytes"])
            if off < 0 or off + n > len(payload):
                raise CorruptEntry(f"tensor {name} lies outside the entry")
            arr = np.frombuffer(payload[off : off + n], dtype=np.dtype("<" + meta["dtype"]))
            arrays[name] = arr.reshape(meta["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptEntry(f"malformed tensor table: {e!r}") from None
    return header, arrays


def encode_fragment(frag: KVFragment) -> bytes:
    return pack({name: getattr(frag, name) for name in _SCALARS},
                {name: getattr(frag, name) for name in _ARRAYS})


def fragment_from_parts(header: dict[str, object], arrays: dict[str, np.ndarray]) -> KVFragment:
    try:
        kwargs: dict[str, object] = {name: header[name] for name in _SCALARS}
        for name, arr in arrays.items():
            if name not in _ARRAYS:
                raise CorruptEntry(f"unknown tensor {name!r}")
            kwargs[name] = arr
        return KVFragment(**kwargs)  # type: ignore[arg-type]
    except FragmentError as e:
        raise CorruptEntry(f"entry decodes to an invalid fragment: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptEntry(f"malformed entry header: {e!r}") from None


def fragment_header(frag: KVFragment) -> dict[str, object]:
    return {name: getattr(frag, name) for name in _SCALARS}


def _split(blob: bytes | memoryview) -> tuple[dict[str, object], memoryview]:
    view = memoryview(blob)
    if len(view) < _PREFIX.size + _DIGEST:
        raise CorruptEntry(f"entry is truncated ({len(view)} bytes)")
    magic, version, head_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, this EdgeKV reads {FORMAT_VERSION}")
    body, digest = view[:-_DIGEST], view[-_DIGEST:]
    if hashlib.sha256(body).digest() != bytes(digest):
        raise CorruptEntry("checksum mismatch (entry damaged or truncated)")
    start = _PREFIX.size
    try:
        header = json.loads(bytes(view[start : start + head_len]))
    except ValueError as e:
        raise CorruptEntry(f"undecodable header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object")
    return header, body[start + head_len :]


def peek_header(blob: bytes | memoryview) -> dict[str, object]:
    """The verified header alone (no tensor copies)."""
    return _split(blob)[0]


def decode_fragment(blob: bytes | memoryview) -> KVFragment:
    header, arrays = unpack(blob)
    return fragment_from_parts(header, arrays)
