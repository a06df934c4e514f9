"""Client for the KV server: sessions, availability, and streamed, authenticated chunks.

Every call has a timeout (connect, and per read: a stalled stream raises `StreamTimeout`), a
dropped connection raises `TransportError`, and a frame that fails AES-GCM or decoding raises
`ChunkRejected`; the hybrid executor turns each into local compute. Sessions are opened with a
proof of the (tenant's) secret and the server must prove it too; every later request is
signed with the session's request key and numbered (`protocol.py`). A session the server no
longer knows (403) is reopened once, transparently.
"""

from __future__ import annotations

import contextlib
import hmac
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
from ..errors import StreamTimeout, TransportError
from ..fragment import KVFragment
from .codec import SessionCipher, decode_chunk, derive_session_keys
from .protocol import (
    accept_proof,
    auth_header,
    check_tenant,
    open_proof,
    read_frames,
    request_mac,
)
from .shaper import Shaper

__all__ = ["BackgroundStream", "KVClient", "Received"]


@dataclass(frozen=True, slots=True)
class Received:
    key: str
    fragment: KVFragment | None  # None: the server does not hold it
    wire_bytes: int
    at_s: float  # seconds since the stream request was sent


@dataclass
class KVClient:
    """`secret`: the server's secret, or for a `tenant` that tenant's secret
    (`protocol.tenant_secret`). `fingerprint`: this device's model; a server of another model
    then refuses the session (403) instead of answering every chunk missing."""

    url: str
    secret: bytes = field(repr=False)
    # connect and per-read (stall) timeout; default: StreamConfig.timeout_s
    timeout_s: float = config_default("stream_timeout_s")
    shaper: Shaper | None = None
    tenant: str = ""
    fingerprint: str | None = None
    _session: str | None = field(default=None, repr=False)
    _cipher: SessionCipher | None = field(default=None, repr=False)
    _mac_key: bytes = field(default=b"", repr=False)
    _seq: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        u = urlsplit(self.url)
        if u.scheme != "http" or not u.hostname:
            raise TransportError(f"KV server URL {self.url!r} must look like http://HOST:PORT")
        self._host, self._port = u.hostname, u.port or 80
        check_tenant(self.tenant)

    def _conn(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port,
                                          timeout=timeout_s or self.timeout_s)

    @contextlib.contextmanager
    def _exchange(self, method: str, path: str, body: Any = None,
                  signed: tuple[str, int, bytes] | None = None, timeout_s: float | None = None
                  ) -> Iterator[http.client.HTTPResponse]:
        """One request on a fresh connection (shaped, if a shaper is set), signed with
        `signed` = (session, seq, request key) if given; every socket or HTTP failure inside
        comes out as StreamTimeout or TransportError."""
        conn = self._conn(timeout_s)
        try:
            if self.shaper:
                self.shaper.on_request()
            data = b"" if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data else {}
            if signed is not None:
                sid, seq, key = signed
                headers["Authorization"] = auth_header(
                    sid, seq, request_mac(key, method, path, seq, data))
            conn.request(method, path, body=data or None, headers=headers)
            yield conn.getresponse()
        except TransportError:  # ours, from the caller's block (ChunkRejected): as it is
            raise
        except TimeoutError as e:
            raise StreamTimeout(
                f"KV server {self.url} {path}: no progress in {timeout_s or self.timeout_s}s"
            ) from e
        except (OSError, http.client.HTTPException) as e:
            raise TransportError(f"KV server {self.url} {path} failed: {e}") from e
        finally:
            conn.close()

    def _signed(self) -> tuple[str, int, bytes]:
        """(session, next request number, request key), opening a session if none is open."""
        if self._session is None:
            self.open_session()
        with self._lock:
            assert self._session is not None
            self._seq += 1
            return self._session, self._seq, self._mac_key

    def _call(self, method: str, path: str, body: Any = None, *, auth: bool = True,
              timeout_s: float | None = None) -> Any:
        for attempt in (0, 1):
            with self._exchange(method, path, body, self._signed() if auth else None,
                                timeout_s) as resp:
                payload = resp.read()
            if resp.status == 403 and auth and attempt == 0 and b"session" in payload:
                self._session = None  # expired or forgotten: one new session, one retry
                continue
            break
        if resp.status != 200:
            raise TransportError(f"KV server {path} answered {resp.status}"
                                 f"{' (authentication failed)' if resp.status == 401 else ''}"
                                 f": {payload[:200]!r}")
        try:
            obj = json.loads(payload)
        except ValueError as e:
            raise TransportError(f"KV server {path} sent invalid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise TransportError(f"KV server {path} sent {type(obj).__name__}, not an object")
        return obj

    def info(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/info", auth=False))

    def open_session(self) -> str:
        """A new session; the server must prove it holds the secret (else TransportError)."""
        nonce = secrets.token_bytes(16)
        fp = self.fingerprint or ""
        r = self._call("POST", "/v1/session", {
            "client_nonce": nonce.hex(), "tenant": self.tenant, "fingerprint": fp,
            "proof": open_proof(self.secret, self.tenant, nonce, fp).hex()}, auth=False)
        try:
            sid, server_nonce = str(r["session"]), bytes.fromhex(r["server_nonce"])
            proof = bytes.fromhex(r["proof"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransportError(f"KV server sent a malformed session: {e!r}") from None
        if not hmac.compare_digest(proof, accept_proof(self.secret, self.tenant, nonce,
                                                       server_nonce, sid)):
            raise TransportError("KV server failed authentication: it does not hold this "
                                 "secret (wrong server, or a man in the middle)")
        enc, mac = derive_session_keys(self.secret, nonce, server_nonce)
        with self._lock:
            self._session, self._cipher, self._mac_key, self._seq = (
                sid, SessionCipher(enc), mac, 0)
        return sid

    def has(self, keys: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._call("POST", "/v1/has", {"keys": list(keys)})["has"]]

    def precompute(self, tokens: Sequence[int], timeout_s: float | None = None
                   ) -> dict[str, Any]:
        """Ask the server's engine to compute and store `tokens`' chunks (it runs the prompt:
        give it a `timeout_s` that allows for that; default the client's)."""
        return dict(self._call("POST", "/v1/precompute", {"tokens": list(tokens)},
                               timeout_s=timeout_s))

    def stream(self, keys: Sequence[str],
               codec: str = "f16") -> Generator[Received, None, None]:
        """Yield chunks in key order as they arrive."""
        keys = list(keys)
        body: dict[str, Any] = {"keys": keys, "codec": codec}
        if self.fingerprint:
            body["fingerprint"] = self.fingerprint
        for attempt in (0, 1):
            signed = self._signed()
            cipher = self._cipher
            assert cipher is not None
            t0 = time.perf_counter()
            with self._exchange("POST", "/v1/chunks", body, signed) as resp:
                if resp.status == 403 and attempt == 0:
                    payload = resp.read()
                    if b"session" in payload:
                        self._session = None  # reopened once, then asked again
                        continue
                    raise TransportError(f"KV server refused the chunks: {payload[:200]!r}")
                if resp.status != 200:
                    raise TransportError(
                        f"KV server /v1/chunks answered {resp.status}: {resp.read()[:200]!r}")
                for i, frag, nbytes in read_frames(lambda n: self._read(resp, n), keys,
                                                   signed[0], signed[1], cipher.open,
                                                   decode_chunk):
                    yield Received(keys[i], frag, nbytes, time.perf_counter() - t0)
                return

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
