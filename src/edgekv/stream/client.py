"""Client for the KV server: sessions, availability, and streamed, authenticated chunks.

Every call has a timeout (connect, and per read: a stalled stream raises `StreamTimeout`), a
dropped connection raises `TransportError`, and a frame that fails AES-GCM or decoding raises
`ChunkRejected`; the hybrid executor turns each into local compute.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import secrets
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..config import config_default
from ..errors import ChunkRejected, StreamTimeout, TransportError
from ..fragment import KVFragment
from .codec import SessionCipher, decode_chunk, derive_session_key
from .netem import Shaper
from .protocol import FRAME, MISSING, OK, aad

__all__ = ["BackgroundStream", "KVClient", "Received"]


@dataclass(frozen=True, slots=True)
class Received:
    key: str
    fragment: KVFragment | None  # None: the server does not hold it
    wire_bytes: int
    at_s: float  # seconds since the stream request was sent


@dataclass
class KVClient:
    url: str
    secret: bytes
    # connect and per-read (stall) timeout; default: CacheConfig.stream_timeout_s
    timeout_s: float = config_default("stream_timeout_s")
    shaper: Shaper | None = None
    _session: str | None = field(default=None, repr=False)
    _cipher: SessionCipher | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        u = urlsplit(self.url)
        if u.scheme != "http" or not u.hostname:
            raise TransportError(f"KV server URL {self.url!r} must look like http://HOST:PORT")
        self._host, self._port = u.hostname, u.port or 80

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)

    @contextlib.contextmanager
    def _exchange(self, method: str, path: str,
                  body: Any = None) -> Iterator[http.client.HTTPResponse]:
        """One request on a fresh connection (shaped, if a shaper is set); every socket or
        HTTP failure inside comes out as StreamTimeout or TransportError."""
        conn = self._conn()
        try:
            if self.shaper:
                self.shaper.on_request()
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            yield conn.getresponse()
        except TimeoutError as e:
            raise StreamTimeout(
                f"KV server {self.url} {path}: no progress in {self.timeout_s}s") from e
        except (OSError, http.client.HTTPException) as e:
            raise TransportError(f"KV server {self.url} {path} failed: {e}") from e
        finally:
            conn.close()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        with self._exchange(method, path, body) as resp:
            payload = resp.read()
        if resp.status != 200:
            raise TransportError(f"KV server {path} answered {resp.status}: {payload[:200]!r}")
        try:
            obj = json.loads(payload)
        except ValueError as e:
            raise TransportError(f"KV server {path} sent invalid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise TransportError(f"KV server {path} sent {type(obj).__name__}, not an object")
        return obj

    def info(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/info"))

    def open_session(self) -> str:
        nonce = secrets.token_bytes(16)
        r = self._call("POST", "/v1/session", {"client_nonce": nonce.hex()})
        self._session = str(r["session"])
        self._cipher = SessionCipher(derive_session_key(self.secret, nonce,
                                                        bytes.fromhex(r["server_nonce"])))
        return self._session

    def has(self, keys: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._call("POST", "/v1/has", {"keys": list(keys)})["has"]]

    def precompute(self, tokens: Sequence[int]) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/precompute", {"tokens": list(tokens)}))

    def stream(self, keys: Sequence[str],
               codec: str = "f16") -> Generator[Received, None, None]:
        """Yield chunks in key order as they arrive."""
        if self._session is None or self._cipher is None:
            self.open_session()
        sid, cipher = self._session, self._cipher
        assert sid is not None and cipher is not None
        t0 = time.perf_counter()
        with self._exchange("POST", "/v1/chunks",
                            {"session": sid, "keys": list(keys), "codec": codec}) as resp:
            if resp.status == 403:
                self._session = None
                raise TransportError(
                    "KV server rejected the session; a new one is opened next time")
            if resp.status != 200:
                raise TransportError(
                    f"KV server /v1/chunks answered {resp.status}: {resp.read()[:200]!r}")
            for key in keys:
                head = self._read(resp, FRAME.size)
                length, status = FRAME.unpack(head)
                if status == MISSING:
                    yield Received(key, None, len(head), time.perf_counter() - t0)
                    continue
                if status != OK or length > 1 << 30:
                    raise ChunkRejected(f"bad frame header for {key[:12]} (status {status})")
                sealed = self._read(resp, length)
                frag = decode_chunk(cipher.open(sealed, aad(sid, key)))
                if frag.chain_key != key:
                    raise ChunkRejected(f"server sent chunk {frag.chain_key[:12]} for {key[:12]}")
                yield Received(key, frag, len(head) + length, time.perf_counter() - t0)

    def _read(self, resp: http.client.HTTPResponse, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = resp.read(min(n - len(buf), 64 * 1024))
            if not part:
                raise TransportError(f"KV stream ended early ({len(buf)} of {n} bytes)")
            buf += part
            if self.shaper:
                self.shaper.on_bytes(len(part))
        return bytes(buf)


class BackgroundStream:
    """One `KVClient.stream` on a background thread: (index, Received) items arrive on `q`,
    then None at the end, or the exception that ended it."""

    def __init__(self, client: KVClient, keys: Sequence[tuple[int, str]], codec: str) -> None:
        self.q: queue.Queue[tuple[int, Received] | BaseException | None] = queue.Queue()
        self.pending = [i for i, _ in keys]
        self.cancelled = False  # set when the reader no longer needs this stream
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(client, keys, codec), daemon=True)
        self._thread.start()

    def _run(self, client: KVClient, keys: Sequence[tuple[int, str]], codec: str) -> None:
        try:
            idx = [i for i, _ in keys]
            for n, rec in enumerate(client.stream([k for _, k in keys], codec)):
                if self.cancelled:
                    return  # closing the generator closes the connection
                self.q.put((idx[n], rec))
            self.q.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            self.q.put(e)
