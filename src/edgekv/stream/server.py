"""`edgekv kv-server`: holds precomputed KV chunks and streams them, encrypted, by chunk key.

A real HTTP server process (stdlib ThreadingHTTPServer, loopback by default). Chunks live in
the disk store by default or in Redis (`--store redis://...`), so several server processes can
serve one store. They are read whole, through the cache's own `ChunkReader` (every layer,
verified), so a store whose fragments are kept in layer groups is served too: a chunk goes out
as one fragment of every layer. With an engine (the default), `POST /v1/precompute` computes
a context's chunks with the same model and engine as the device, aligned the same way, so
streamed KV is bit-identical to what the device would compute.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ..compactor import merge_layers
from ..config import config_default
from ..errors import EdgeKVError
from ..lookup import ChunkReader
from ..store.base import FragmentStore
from .codec import LEVELS, SessionCipher, derive_session_key, encode_chunk
from .protocol import FRAME, MISSING, OK, aad

__all__ = ["KVServer", "load_secret"]

log = logging.getLogger(__name__)


def load_secret(path: Path, create: bool = False) -> bytes:
    """The pre-shared secret (32 random bytes, hex in a 0600 file)."""
    p = Path(path)
    if not p.exists():
        if not create:
            raise EdgeKVError(f"no KV secret at {p}; copy the server's secret file there "
                              "or pass --secret-file")
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    text = p.read_text().strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise EdgeKVError(f"{p} does not hold a hex secret") from None
    if len(raw) < 16:
        raise EdgeKVError(f"{p}: the secret must be at least 16 bytes")
    return raw


class KVServer:
    """`reader` reads `store`'s chunks (`ChunkReader.for_model`); with an engine (an `EdgeKV`
    over the same store) it defaults to the engine's. `session_ttl_s`: see
    `CacheConfig.kv_session_ttl_s` (its default)."""

    def __init__(self, store: FragmentStore, secret: bytes, *, fingerprint: str,
                 model: str, chunk_size: int, engine: Any = None,
                 reader: ChunkReader | None = None, host: str = "127.0.0.1",
                 port: int = 0, session_ttl_s: float | None = None) -> None:
        if reader is None:
            if engine is None:
                raise EdgeKVError("KVServer needs a reader (ChunkReader.for_model(store, "
                                  "fingerprint, layers_per_fragment)) or an engine")
            reader = engine.reader
        self.store, self.secret, self.engine, self.reader = store, secret, engine, reader
        self.fingerprint, self.model, self.chunk_size = fingerprint, model, chunk_size
        self.session_ttl_s = (config_default("kv_session_ttl_s") if session_ttl_s is None
                              else session_ttl_s)  # CacheConfig.kv_session_ttl_s
        self._sessions: dict[str, tuple[SessionCipher, float]] = {}
        self._lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        log.info("kv-server on http://%s:%d", *self.address)
        self.httpd.serve_forever(poll_interval=0.2)

    def start_background(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, daemon=True)
        t.start()
        return t

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- request handling ----------------------------------------------------------------

    def _session(self, sid: str) -> SessionCipher | None:
        with self._lock:
            now = time.time()
            for k in [k for k, (_, t) in self._sessions.items() if now - t > self.session_ttl_s]:
                del self._sessions[k]
            entry = self._sessions.get(sid)
            return entry[0] if entry else None

    def open_session(self, client_nonce: bytes) -> dict[str, str]:
        server_nonce = secrets.token_bytes(16)
        sid = secrets.token_hex(16)
        cipher = SessionCipher(derive_session_key(self.secret, client_nonce, server_nonce))
        with self._lock:
            self._sessions[sid] = (cipher, time.time())
        return {"session": sid, "server_nonce": server_nonce.hex()}

    def precompute(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.engine is None:
            raise EdgeKVError("this server has no engine (started with --no-engine)")
        prompt = body.get("tokens") if body.get("tokens") is not None else body.get("prompt")
        if not prompt:
            raise EdgeKVError("precompute needs 'tokens' (list of ints) or 'prompt' (string)")
        with self._engine_lock:
            tokens = self.engine.prepare(prompt, max_tokens=1)
            r = self.engine.generate(tokens, max_tokens=1)
            keys = self.engine.chunk_keys(tokens)
        return {"keys": keys, "stored": r.stored_fragments, "prompt_tokens": len(tokens)}

    def frames(self, sid: str, keys: list[str], codec: str) -> Iterator[bytes]:
        cipher = self._session(sid)
        if cipher is None:
            raise PermissionError("unknown or expired session; open a new one")
        for key in keys:
            chunk = self.reader.read(key, time.time(), [])
            if chunk is None or chunk.head.model_fingerprint != self.fingerprint:
                yield FRAME.pack(0, MISSING)
                continue
            frag = chunk.head if len(chunk.fragments) == 1 else merge_layers(chunk.fragments)
            sealed = cipher.seal(encode_chunk(frag, codec), aad(sid, key))
            yield FRAME.pack(len(sealed), OK) + sealed

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("kv-server: " + fmt, *args)

            def _json(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict[str, Any]:
                n = int(self.headers.get("Content-Length") or 0)
                if n > 64 << 20:
                    raise ValueError("request body too large")
                obj = json.loads(self.rfile.read(n) or b"{}")
                if not isinstance(obj, dict):
                    raise ValueError("request body must be a JSON object")
                return obj

            def do_GET(self) -> None:
                if self.path == "/v1/info":
                    self._json(200, {"fingerprint": server.fingerprint, "model": server.model,
                                     "chunk_size": server.chunk_size, "codecs": list(LEVELS)})
                else:
                    self._json(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:
                self._streaming = False
                try:
                    body = self._body()
                    if self.path == "/v1/session":
                        self._json(200, server.open_session(bytes.fromhex(body["client_nonce"])))
                    elif self.path == "/v1/has":
                        self._json(200, {"has": [server.reader.contains(k)
                                                 for k in body["keys"]]})
                    elif self.path == "/v1/precompute":
                        self._json(200, server.precompute(body))
                    elif self.path == "/v1/chunks":
                        self._stream(body)
                    else:
                        self._json(404, {"error": f"no route {self.path}"})
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away mid-stream: nothing to answer
                except Exception as e:  # noqa: BLE001 - answer, never kill the server thread
                    if getattr(self, "_streaming", False):
                        log.warning("kv-server: stream aborted: %s", e)
                        self.close_connection = True  # the body is cut: the client sees it
                        return
                    bad_input = (KeyError, ValueError, TypeError, EdgeKVError)
                    code = 403 if isinstance(e, PermissionError) else (
                        400 if isinstance(e, bad_input) else 500)
                    self._json(code, {"error": f"{type(e).__name__}: {e}"})

            def _stream(self, body: dict[str, Any]) -> None:
                codec = body.get("codec", "f16")
                if codec not in LEVELS:
                    raise ValueError(f"codec must be one of {LEVELS}")
                keys = [str(k) for k in body["keys"]]
                frames = server.frames(str(body["session"]), keys, codec)
                first = next(frames, None)  # raises PermissionError before headers are sent
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._streaming = True
                for frame in itertools.chain([first] if first is not None else [], frames):
                    self.wfile.write(f"{len(frame):x}\r\n".encode() + frame + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        return Handler

