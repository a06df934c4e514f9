"""The exception hierarchy of EdgeKV, in one place.

    EdgeKVError
    ├── ConfigError            a setting is out of range
    ├── PromptError            a prompt that cannot be answered as given (empty, too long):
    │                          carries OpenAI's error `code` and the request field at fault
    ├── Cancelled              the caller stopped a generation before it began
    ├── ModelNotFound          no GGUF file where one was expected
    ├── EngineError            the engine failed or is missing
    │   └── UnsupportedLayout  the engine's KV state is in a layout EdgeKV cannot slice safely
    ├── FragmentError          a KVFragment violates an invariant (names field, value, range)
    │   └── IncompatibleFragment  a valid fragment that does not belong to this model/request
    ├── StoreError             a store could not do what was asked
    │   └── CorruptEntry       an entry failed its checksum or could not be decoded
    └── TransportError         the KV server could not be reached or answered wrongly
        ├── StreamTimeout      no progress within the deadline
        └── ChunkRejected      a chunk failed authentication, decoding or verification
"""

from __future__ import annotations

__all__ = [
    "Cancelled",
    "ConfigError",
    "CorruptEntry",
    "EdgeKVError",
    "EngineError",
    "FragmentError",
    "IncompatibleFragment",
    "ModelNotFound",
    "PromptError",
    "ChunkRejected",
    "StoreError",
    "StreamTimeout",
    "TransportError",
    "UnsupportedLayout",
]


class EdgeKVError(Exception):
    """Base class of every error EdgeKV raises on purpose."""


class ConfigError(EdgeKVError, ValueError):
    """A configuration value is invalid."""


class PromptError(EdgeKVError, ValueError):
    """A prompt that cannot be answered as given (empty, or longer than the context window
    allows with `max_tokens` more); `code` is OpenAI's name for the case (a server answers it
    as a 400 by this code, never by the message), `param` the request field at fault."""

    def __init__(self, message: str, code: str = "invalid_value",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


class Cancelled(EdgeKVError):
    """The caller asked a generation to stop before it began (a server's client went away
    while it waited for another generation's prompt chunks)."""


class ModelNotFound(EdgeKVError, FileNotFoundError):
    """The model file could not be found."""


class EngineError(EdgeKVError, RuntimeError):
    """The inference engine failed or is not installed."""


class UnsupportedLayout(EngineError):
    """The engine's KV state layout is not one EdgeKV knows how to slice and reassemble."""


class FragmentError(EdgeKVError, ValueError):
    """A KV fragment violates one of its invariants."""


class IncompatibleFragment(FragmentError):
    """A well-formed fragment that may not be injected here (other model, tokens or layout)."""


class StoreError(EdgeKVError, OSError):
    """A fragment store failed."""


class CorruptEntry(StoreError):
    """A stored entry is damaged (checksum, truncation, undecodable header)."""


class TransportError(EdgeKVError, ConnectionError):
    """The KV server could not be reached, or its answer was unusable."""


class StreamTimeout(TransportError, TimeoutError):
    """A stream made no progress within its deadline."""


class ChunkRejected(TransportError):
    """A streamed chunk failed authentication (AES-GCM), decoding or verification."""
