"""Chained chunk keys and the model fingerprint.

A chunk's key is SHA-256(parent key, model fingerprint, the chunk's token ids): one chain, as in
vLLM's prefix cache, so the key of chunk i names the *whole prefix* up to its end. That matters
because the K/V of a token depend on every token before it; two chunks with equal token ids
but different prefixes have different KV and must never share a key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NewType

import numpy as np

__all__ = [
    "KV_SERVER_TENANTS",
    "SERVE_TENANTS",
    "TENANT_NAMESPACES",
    "ChunkKey",
    "ModelFingerprint",
    "StoreKey",
    "chain_of",
    "chunk_keys",
    "file_sha256",
    "next_key",
    "passage_key",
    "store_key",
    "tenant_root",
    "token_bytes",
]

# A chunk's chain key: names the whole prefix up to the chunk's end (see `next_key`).
ChunkKey = NewType("ChunkKey", str)


@dataclass(frozen=True, slots=True)
class StoreKey:
    """Where a fragment of one chunk is stored: the chunk's chain key and the layer range it
    holds (None: every layer of the model). Typed, so nothing parses a name to learn the
    chain; `name` is its spelling in a tier (a file name, a Redis key), the only place the
    `.L<lo>-<hi>` suffix exists."""

    chain: ChunkKey
    layers: tuple[int, int] | None = None

    @classmethod
    def of(cls, chain_key: str, layers: tuple[int, int], n_layer: int) -> StoreKey:
        """The key of layers [lo, hi) of `chain_key` in an `n_layer`-layer model."""
        whole = tuple(layers) == (0, n_layer)
        return cls(ChunkKey(chain_key), None if whole else (int(layers[0]), int(layers[1])))

    @property
    def name(self) -> str:
        if self.layers is None:
            return self.chain
        return f"{self.chain}.L{self.layers[0]}-{self.layers[1]}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What a KV tensor is bound to: the weights, the architecture and the KV layout."""

    file_sha256: str
    architecture: str
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    kv_dtype: str  # "f16" or "f32"
    engine: str  # numerics differ between engines, so strict reuse stays within one
    rope: str = ""  # RoPE base and dimensions, e.g. "base=100000,dims=64"

    @property
    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def n_embd_k(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def n_embd_v(self) -> int:
        return self.n_head_kv * self.head_dim_v

    @property
    def kv_bytes_per_token(self) -> int:
        return self.n_layer * (self.n_embd_k + self.n_embd_v) * (2 if self.kv_dtype == "f16" else 4)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32, the form hashed and stored everywhere."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def root_digest(fingerprint: str) -> bytes:
    return hashlib.sha256(b"edgekv-root\0" + fingerprint.encode()).digest()


def next_key(parent: str, fingerprint: str,
             token_ids: Sequence[int] | np.ndarray) -> ChunkKey:
    """Key of the chunk holding `token_ids` after the chunk keyed `parent` ("" = start)."""
    h = hashlib.sha256(bytes.fromhex(parent) if parent else root_digest(fingerprint))
    h.update(fingerprint.encode())
    h.update(token_bytes(token_ids))
    return ChunkKey(h.hexdigest())


# Who named a tenant: `edgekv serve` (API-key hashes and clients' `cache_salt`) or the KV
# server (tenant names proven by their secret, and the device that names its KV-server tenant
# through `EdgeKV.generate(salt=...)`, the library's default). The same salt in two namespaces
# is two tenants: a kv-server tenant "bob" never owns serve's `cache_salt="bob"` chain, even
# over one shared store.
SERVE_TENANTS = "serve"
KV_SERVER_TENANTS = "kv-server"
TENANT_NAMESPACES = (SERVE_TENANTS, KV_SERVER_TENANTS)


def tenant_root(fingerprint: str, salt: str, namespace: str) -> str:
    """The parent key of a tenant's first chunk: "" without a salt (the untenanted chain,
    shared by everyone), else a key derived from the namespace and the salt. Every later key
    hashes its parent, so one tenant's chain never meets another's (no reuse across tenants,
    hence no timing channel between them), and a stored fragment still verifies by its own
    parent key and tokens, without knowing the salt."""
    if namespace not in TENANT_NAMESPACES:
        raise ValueError(f"tenant namespace {namespace!r} is not one of {TENANT_NAMESPACES}")
    if not salt:
        return ""
    h = hashlib.sha256(b"edgekv-tenant\0" + namespace.encode() + b"\0" + fingerprint.encode()
                       + b"\0" + salt.encode())
    return h.hexdigest()


def passage_key(fingerprint: str, token_ids: Sequence[int],
                anchor: Sequence[int] = (), root: str = "") -> str:
    """Key of a passage's own KV (passage reuse): model, the tokens it was computed after
    (`anchor`, e.g. BOS) and its tokens, in a namespace of its own (never a chain key); `root`
    (`tenant_root`), so that one tenant's passages are never placed for another's."""
    h = hashlib.sha256(b"edgekv-passage\0" + fingerprint.encode() + b"\0"
                       + (root.encode() + b"\0" if root else b""))
    h.update(token_bytes(anchor) + b"\0" + token_bytes(token_ids))
    return "p" + h.hexdigest()[1:]


def chunk_keys(fingerprint: str, token_ids: Sequence[int], chunk_size: int,
               root: str = "") -> list[ChunkKey]:
    """Keys of the full chunks of `token_ids` (after `root`, see `tenant_root`); a trailing
    partial chunk gets none."""
    keys: list[ChunkKey] = []
    parent = root
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        parent = next_key(parent, fingerprint, token_ids[start : start + chunk_size])
        keys.append(parent)
    return keys


def store_key(chain_key: str, layers: tuple[int, int], n_layer: int) -> str:
    """The name in a tier of the fragment of chunk `chain_key` holding layers [lo, hi)
    (`StoreKey.of(...).name`): the chain key itself when that is every layer of the model,
    else `<chain key>.L<lo>-<hi>`."""
    return StoreKey.of(chain_key, layers, n_layer).name


def chain_of(key: str) -> ChunkKey:
    """The chain key of the chunk a stored name belongs to, for callers that only have the
    name (a tier's listing); code that builds keys carries `StoreKey.chain` instead."""
    return ChunkKey(key.split(".", 1)[0])


def file_sha256(path: Path, memo_dir: Path | None = None) -> str:
    """SHA-256 of a (large) file, memoised by (path, size, mtime) so start-up stays fast."""
    path = Path(path).resolve()
    st = path.stat()
    memo_key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo: Path | None = None
    if memo_dir is not None:
        memo = Path(memo_dir) / "fingerprints" / memo_key
        try:
            text = memo.read_text().strip()
            if len(text) == 64:
                return text
        except OSError:
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(digest)
            os.replace(tmp, memo)
        except OSError:
            pass
    return digest
