"""The configuration, one object per part, every number saying where it comes from: the
cache's own (`CacheConfig`: chunks, tiers, reuse, semantic routing, passages, decoding), the
device's SparKV client (`StreamConfig`) and the KV server (`KVServerConfig`). Each reads
`EDGEKV_<NAME>` variables (`from_env`); a field's NAME is its part's prefix and the field
(`stream_timeout_s` is `StreamConfig.timeout_s`, `kv_session_ttl_s` `KVServerConfig.session_ttl_s`),
as when the three were one object."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .fragment import MAX_SPAN, MIN_SPAN

__all__ = ["CacheConfig", "KVServerConfig", "StreamConfig", "config_default", "default_cache_dir"]

MIB = 1024 * 1024


def default_cache_dir() -> Path:
    """`$EDGEKV_CACHE_DIR`, else `$XDG_CACHE_HOME/edgekv`, else `~/.cache/edgekv`."""
    env = os.environ.get("EDGEKV_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgekv"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    # Tokens per chunk. Seed: 128-token fragments; a full chunk spans [64, 2048] tokens
    # (`fragment.MIN_SPAN`, `MAX_SPAN`; only a chain's trailing partial chunk is shorter).
    chunk_size: int = 128
    # Layers per stored fragment; 0 means all layers in one fragment. A prefix is reusable only
    # when every layer of every chunk is present, so splitting trades lookups for flexibility.
    layers_per_fragment: int = 0
    # RAM tier capacity. ~23 KB of f16 KV per SmolLM2 token -> 256 MiB holds ~11k tokens.
    ram_capacity_bytes: int = 256 * MIB
    # Disk tier capacity; entries are evicted past it (see `eviction`).
    disk_capacity_bytes: int = 2048 * MIB
    # Who evicts past a tier's capacity. "leaf": the prefix index, leaf chunks only, never a
    # chunk whose descendants are held (SGLang's radix cache), the leaf whose second-to-last
    # access is oldest first (LRU-2: a chunk read once goes before one read again); "leaf-lru":
    # leaves only, least recently used first. Measured by `edgekv bench pressure`: no orphaned
    # bytes, where "lru", each tier's own LRU, evicts chain heads first, because a hit touches
    # the head before the tail, and leaves their descendants held where no lookup can reach
    # them.
    eviction: str = "leaf"
    # Seed (EdgeSync-LLM fragment.go): TTL 30 min, >= 5 hits promotes to 7 days.
    ttl_s: float = 30 * 60.0
    promoted_ttl_s: float = 7 * 24 * 3600.0
    promote_hits: int = 5
    # How far strict reuse may go. "auto": the batch-invariance probe (engines/probe.py) runs
    # once per engine build + model + CPU + settings; where the engine computes the same
    # numbers whatever the batch shape, reuse ends at any token and prefill runs in one batch
    # (measured: an AMD AVX2 llama.cpp build with flash attention off, 12/12 schedules), else
    # whole chunks with chunk-aligned prefill (the same build with flash attention on: 6/12;
    # Gemma 3's Q4_K weights: 3/12). "chunk": whole chunks without probing.
    reuse_granularity: str = "auto"
    # Where whole-chunk reuse applies (the probe failed): also reuse a verified common prefix
    # that ends inside a chunk (a stored successor's leading tokens). Off by default: the KV
    # and the remaining tokens are then computed in batches of other shapes than a cold run's,
    # which on such an engine changes numbers: measured on an AVX512 build, 11% of 16-token
    # greedy continuations changed. Tokens are verified, so it is far from the approximate
    # mode, but it is not bit-exact there. (On a batch-invariant engine it is always on.)
    partial_reuse: bool = False
    # A successor fragment is read only if it restores at least this many more tokens
    # (reading ~3 MB to save a handful of ~2 ms tokens is a loss).
    min_reuse_tokens: int = 16
    # Seed (EdgeSync-LLM): EXACT >= 0.92, PARTIAL >= 0.75, else MISS; top-k candidates checked.
    semantic_exact: float = 0.92
    semantic_partial: float = 0.75
    semantic_k: int = 4
    # Inject similar-but-different KV (the seed's behaviour). Off: reuse is token-verified.
    approximate: bool = False
    # Passage reuse (docs/passages.md): passages marked by the caller are cached alone and
    # placed anywhere, a budget of their tokens recomputed (changes output, labelled, never
    # written back). Policy "epic" (first tokens of each passage) or "blend" (most deviating
    # tokens); budget below 1: a fraction of the passage tokens, from 1: tokens per passage.
    passage_reuse: bool = False
    passage_policy: str = "epic"
    passage_budget: float = 16
    # Semantic index additions between rewrites of its file. The file is rewritten whole, so
    # not after every request (also on sweep, clear, compaction and close); entries lost in a
    # crash only lower approximate-mode recall until a rebuild: strict reuse never reads it.
    index_save_every: int = 16
    # Speculative decoding (engines/spec.py): "ngram" drafts tokens from n-grams of the
    # request's own prompt and answer and verifies them in one batch, the output bit-identical
    # to plain decoding; only where the batch-invariance probe's draft schedule passes (else
    # decoding stays plain, and says why). "none": one token a step. Default "none": see
    # `edgekv bench spec` (its last run: `git show 31f77bb:docs/bench/spec.md`).
    speculative: str = "none"
    # The tier behind RAM (disk, Redis) written by a thread of its own after a request has
    # stored its KV in RAM (`store.behind.WriteBehind`): the request goes on at once, and
    # the fragments are read from RAM (or the queue) until written. A process killed before
    # the queue drains loses those writes (a cache: the next request recomputes them).
    # None: the program's default. Off in the library (a store that returns has written);
    # on in `edgekv serve` (--write-behind / --no-write-behind), where the writes otherwise
    # ran on a slot's thread beside the other slots' decoding.
    write_behind: bool | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        if not MIN_SPAN <= self.chunk_size <= MAX_SPAN:
            raise ConfigError(
                f"chunk_size={self.chunk_size} is outside [{MIN_SPAN}, {MAX_SPAN}] (a full "
                "chunk's span range); "
                "pick e.g. 128"
            )
        if self.layers_per_fragment < 0:
            raise ConfigError(
                f"layers_per_fragment={self.layers_per_fragment} must be >= 0 (0 = all)")
        for name in ("ram_capacity_bytes", "disk_capacity_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.ttl_s <= self.promoted_ttl_s:
            raise ConfigError(
                f"ttl_s={self.ttl_s} must be > 0 and <= promoted_ttl_s={self.promoted_ttl_s}"
            )
        if self.promote_hits < 1:
            raise ConfigError(f"promote_hits={self.promote_hits} must be >= 1")
        if not 0.0 <= self.semantic_partial <= self.semantic_exact <= 1.0:
            raise ConfigError(
                f"semantic thresholds must satisfy 0 <= partial ({self.semantic_partial}) <= "
                f"exact ({self.semantic_exact}) <= 1")
        if self.reuse_granularity not in ("auto", "chunk"):
            raise ConfigError(f"reuse_granularity={self.reuse_granularity!r}: use 'auto' (probe "
                              "the engine, reuse to any token where it is batch-invariant) or "
                              "'chunk' (whole chunks only)")
        if self.eviction not in ("leaf", "leaf-lru", "lru"):
            raise ConfigError(f"eviction={self.eviction!r}: use 'leaf' (the prefix index evicts "
                              "leaf chunks first, LRU-2), 'leaf-lru' (leaf chunks, least "
                              "recently used first) or 'lru' (each tier its own LRU)")
        if self.speculative not in ("none", "ngram"):
            raise ConfigError(f"speculative={self.speculative!r}: use 'none' (one token a "
                              "step) or 'ngram' (n-gram drafts verified in one batch)")
        if self.semantic_k < 1:
            raise ConfigError(f"semantic_k={self.semantic_k} must be >= 1")
        _positive(self, "", ("index_save_every",))
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))

    @classmethod
    def from_env(cls, **overrides: object) -> CacheConfig:
        """Read `EDGEKV_<FIELD>` variables (e.g. `EDGEKV_CHUNK_SIZE=256`), then apply overrides.
        Each is parsed by its field's type: numbers, booleans (1/true/yes/on), lower-case
        words (`reuse_granularity`); the cache directory comes from `default_cache_dir`."""
        return cls(**_env_values(cls, "", overrides))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """The device's SparKV client (`stream.client`, `stream.hybrid`); `EDGEKV_STREAM_<FIELD>`."""

    PREFIX = "stream_"
    # connect and per-read timeout. A read that makes no progress this long is a stalled
    # server: the device computes the rest itself.
    timeout_s: float = 5.0
    # How long one streamed chunk may keep the device idle, in multiples of the client timeout
    # (plus twice its predicted transfer time): a server that trickles bytes never trips the
    # per-read timeout, so the wait itself has a deadline. The all-stream baseline waits for
    # every chunk by design, so it gets the longer one.
    wait_timeouts: float = 2.0
    patient_wait_timeouts: float = 10.0
    # Times the hybrid executor may re-plan from measured throughput in one request: each
    # re-plan opens a new stream (a round trip), and three cover a link estimate that is off
    # in either direction without letting a flapping link re-plan every chunk.
    max_replans: int = 3

    def __post_init__(self) -> None:
        _positive(self, self.PREFIX, ("timeout_s", "wait_timeouts", "patient_wait_timeouts"))
        if self.max_replans < 0:
            raise ConfigError(f"stream_max_replans={self.max_replans} must be >= 0")

    @classmethod
    def from_env(cls, **overrides: object) -> StreamConfig:
        return cls(**_env_values(cls, cls.PREFIX, overrides))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class KVServerConfig:
    """The KV server (`kvserver`, `edgekv kv-server`); `EDGEKV_KV_<FIELD>`."""

    PREFIX = "kv_"
    # a session's AES-GCM key is forgotten this long after it was opened; the client then
    # opens a new one (one extra round trip an hour).
    session_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        _positive(self, self.PREFIX, ("session_ttl_s",))

    @classmethod
    def from_env(cls, **overrides: object) -> KVServerConfig:
        return cls(**_env_values(cls, cls.PREFIX, overrides))  # type: ignore[arg-type]


_Config = CacheConfig | StreamConfig | KVServerConfig
PARTS: tuple[type[_Config], ...] = (CacheConfig, StreamConfig, KVServerConfig)


def _positive(cfg: _Config, prefix: str, names: tuple[str, ...]) -> None:
    for name in names:
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{prefix}{name}={getattr(cfg, name)} must be > 0")


def _env_values(cls: type[_Config], prefix: str, overrides: dict[str, object]
                ) -> dict[str, object]:
    """`EDGEKV_<PREFIX><FIELD>` of each field of `cls`, parsed by the field's type, then the
    overrides that are not None."""
    values: dict[str, object] = {}
    for f in fields(cls):
        name = f"EDGEKV_{(prefix + f.name).upper()}"
        raw = os.environ.get(name)
        if raw is None or f.name == "cache_dir":
            continue
        kind = str(f.type)  # the annotation's text (annotations are postponed)
        try:
            if kind in ("bool", "bool | None"):
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif kind == "float":
                values[f.name] = float(raw)
            elif kind == "int":
                values[f.name] = int(raw)
            else:
                values[f.name] = raw.strip().lower()
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a number") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


def config_default(name: str) -> Any:
    """The default of a setting by its environment name less `EDGEKV_`, lower case
    (`chunk_size`, `stream_timeout_s`, `kv_session_ttl_s`), for objects built without a
    config."""
    for part in PARTS:
        prefix = getattr(part, "PREFIX", "")
        for f in fields(part):
            if prefix + f.name == name:
                return f.default
    raise ConfigError(f"no setting {name!r} (CacheConfig, StreamConfig, KVServerConfig)")
