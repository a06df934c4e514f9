"""A self-verifying binary container for one `KVFragment`.

    b"EKVF" | u16 version | u32 header length | header (JSON) | tensors | SHA-256 of all before

The trailing digest covers every byte, so truncation, bit flips and a swapped header are all
caught on read and surface as `CorruptEntry` (which stores turn into a logged miss). An entry
whose digest is right is still not trusted: the header's length, JSON, tensor table (offsets,
dtypes, shapes) and field types are all checked before an array is made, and `CorruptEntry` is
the only error any input can raise.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct

import numpy as np

from .errors import CorruptEntry, FragmentError
from .fragment import KVFragment

__all__ = ["FORMAT_VERSION", "decode_fragment", "encode_fragment", "encode_fragment_parts", "pack",
           "pack_parts", "peek_header", "unpack"]

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
_STRS = ("model_fingerprint", "chain_key", "content_hash", "parent_key")
_FLOATS = ("created_at", "expires_at")
_INT_LIMIT = 1 << 31  # token positions, layer and head indices and hit counts fit in int32
# the dtypes `pack` writes (KV, quantized KV and its scales, token ids, embeddings)
_DTYPES = frozenset({"f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"})
_ARRAY_DTYPES = {"token_ids": ("i4",), "keys": ("f2", "f4"), "values": ("f2", "f4"),
                 "embedding": ("f2", "f4")}


def pack(header: dict[str, object], arrays: dict[str, np.ndarray | None]) -> bytes:
    """Header (JSON) + little-endian arrays + SHA-256 trailer."""
    return b"".join(pack_parts(header, arrays))


def pack_parts(header: dict[str, object],
               arrays: dict[str, np.ndarray | None]) -> list[bytes | memoryview]:
    """`pack`'s bytes in pieces, the arrays' own memory where it is contiguous and
    little-endian already: written one after another (`DiskStore`), they need no copy of
    the tensors in one buffer, and hashing them releases the GIL."""
    parts: list[bytes | memoryview] = []
    offset = 0
    tensors: dict[str, object] = {}
    for name, arr in arrays.items():
        if arr is None:
            continue
        arr = np.ascontiguousarray(arr)
        data = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))
        tensors[name] = {"dtype": arr.dtype.str.lstrip("<>|="), "shape": list(arr.shape),
                         "offset": offset, "nbytes": data.nbytes}
        parts.append(memoryview(data.data).cast("B"))
        offset += data.nbytes
    head = json.dumps({**header, "tensors": tensors}, sort_keys=True).encode()
    parts.insert(0, _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    parts.append(digest.digest())
    return parts


def _is_int(v: object) -> bool:
    return type(v) is int  # noqa: E721 - bool is an int too, and never a size


def unpack(blob: bytes | memoryview) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """Inverse of `pack`; raises CorruptEntry on any damage."""
    header, payload = _split(blob)
    tensors = header.pop("tensors", None)
    if not isinstance(tensors, dict):
        raise CorruptEntry("header.tensors is not an object")
    arrays: dict[str, np.ndarray] = {}
    for name, meta in tensors.items():
        if not isinstance(meta, dict):
            raise CorruptEntry(f"tensor {name[:40]!r}: its entry is not an object")
        off, n, dt, shape = (meta.get(k) for k in ("offset", "nbytes", "dtype", "shape"))
        if not (_is_int(off) and _is_int(n) and isinstance(dt, str) and dt in _DTYPES
                and isinstance(shape, list) and len(shape) <= 8
                and all(_is_int(d) and 0 <= d < _INT_LIMIT for d in shape)):
            raise CorruptEntry(f"tensor {name[:40]!r}: malformed offset, size, dtype or shape")
        dtype = np.dtype("<" + dt)
        assert isinstance(off, int) and isinstance(n, int)
        if off < 0 or n < 0 or off + n > len(payload):
            raise CorruptEntry(f"tensor {name[:40]!r} lies outside the entry")
        if math.prod(shape) * dtype.itemsize != n:
            raise CorruptEntry(f"tensor {name[:40]!r}: shape {shape} of {dt} is not {n} bytes")
        arrays[name] = np.frombuffer(payload[off : off + n], dtype=dtype).reshape(shape)
    return header, arrays


def encode_fragment(frag: KVFragment) -> bytes:
    return b"".join(encode_fragment_parts(frag))


def encode_fragment_parts(frag: KVFragment) -> list[bytes | memoryview]:
    """`encode_fragment` in pieces (`pack_parts`)."""
    return pack_parts({name: getattr(frag, name) for name in _SCALARS},
                      {name: getattr(frag, name) for name in _ARRAYS})


def _is_text(v: str) -> bool:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_scalars(header: dict[str, object]) -> None:
    """Every scalar present and of its type: strings, finite times, int32-sized integers."""
    for name in _SCALARS:
        if name not in header:
            raise CorruptEntry(f"malformed entry header: {name} is missing")
        v = header[name]
        if name in _STRS:  # digests and keys: short text (a lone surrogate is no text, and
            ok = isinstance(v, str) and len(v) <= 256 and _is_text(v)  # SQLite refuses it)
        elif name in _FLOATS:
            ok = ((isinstance(v, float) and math.isfinite(v))
                  or (_is_int(v) and abs(v) < 1 << 53))  # type: ignore[arg-type]
        else:
            ok = _is_int(v) and -_INT_LIMIT < v < _INT_LIMIT  # type: ignore[operator]
        if not ok:
            raise CorruptEntry(f"malformed entry header: {name} is {type(v).__name__}")


def fragment_from_parts(header: dict[str, object], arrays: dict[str, np.ndarray]) -> KVFragment:
    _check_scalars(header)
    try:
        kwargs: dict[str, object] = {name: header[name] for name in _SCALARS}
        for name, arr in arrays.items():
            if name not in _ARRAYS:
                raise CorruptEntry(f"unknown tensor {name[:40]!r}")
            if arr.dtype.str.lstrip("<>|=") not in _ARRAY_DTYPES[name]:
                raise CorruptEntry(f"tensor {name} has dtype {arr.dtype}")
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
    if head_len > len(body) - start:
        raise CorruptEntry(f"header length {head_len} runs past the entry ({len(body)} bytes)")
    try:
        header = json.loads(bytes(view[start : start + head_len]), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise CorruptEntry(f"undecodable header: {str(e)[:80]}") from None
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object")
    return header, body[start + head_len :]


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number EdgeKV writes")


def peek_header(blob: bytes | memoryview) -> dict[str, object]:
    """The verified header alone (no tensor copies)."""
    return _split(blob)[0]


def decode_fragment(blob: bytes | memoryview) -> KVFragment:
    header, arrays = unpack(blob)
    return fragment_from_parts(header, arrays)
