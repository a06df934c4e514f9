"""`edgekv kv-server`: holds precomputed KV chunks and streams them, encrypted, by chunk key.

A real HTTP server (loopback by default) on the project's one HTTP stack: a FastAPI app run
by uvicorn, on a socket bound by `serve.runner.bind` before it serves, in the foreground
(`serve_forever`) or on a background thread (`start_background`). Store reads, precompute and
encryption run in Starlette's threadpool, never on the event loop; a chunk stream is a
`StreamingResponse` that reads, seals and sends one chunk per frame as the client takes them.
The wire protocol (`protocol.py`) is unchanged: paths, JSON bodies, error objects
`{"error": "Type: message"}` with 400 (bad input), 403 (unknown session), 404 (no route),
500, and the chunked stream of frames.

Chunks live in the disk store by default or in Redis (`--store redis://...`), so several
server processes can serve one store. They are read whole, through the cache's own
`ChunkReader` (every layer, verified), so a store whose fragments are kept in layer groups is
served too: a chunk goes out as one fragment of every layer. With an engine (the default),
`POST /v1/precompute` computes a context's chunks with the same model and engine as the
device, aligned the same way, so streamed KV is bit-identical to what the device would compute.
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
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..compactor import merge_layers
from ..config import config_default
from ..errors import EdgeKVError
from ..lookup import ChunkReader
from ..serve.errors import client_gone_response
from ..serve.runner import bind, uvicorn_server
from ..store.base import FragmentStore
from .codec import LEVELS, SessionCipher, derive_session_key, encode_chunk
from .protocol import FRAME, MISSING, OK, aad

__all__ = ["KVServer", "load_secret"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a larger request body is refused (400)
SHUTDOWN_GRACE_S = 1  # shutdown(): requests in flight get this long to finish, then are cut


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


class _JSON(JSONResponse):
    """JSON as the protocol has always written it (`json.dumps` with its defaults)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


async def _raw_body(request: Request) -> bytes:
    """The request body; over `MAX_BODY_BYTES` it is a 400, as the declared length or as read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ValueError("request body too large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise ValueError("request body too large")
        parts.append(part)
    return b"".join(parts)


RawBody = Annotated[bytes, Depends(_raw_body)]


def _parse(raw: bytes) -> dict[str, Any]:
    obj = json.loads(raw or b"{}")
    if not isinstance(obj, dict):
        raise ValueError("request body must be a JSON object")
    return obj


async def _error_response(request: Request, e: Exception) -> Response:
    """Every refusal as `{"error": "Type: message"}`: 403 for an unknown session, 400 for bad
    input, 500 for anything else (uvicorn then logs it)."""
    bad_input = (KeyError, ValueError, TypeError, EdgeKVError)
    code = 403 if isinstance(e, PermissionError) else (400 if isinstance(e, bad_input) else 500)
    return _JSON({"error": f"{type(e).__name__}: {e}"}, status_code=code)


async def _no_route(request: Request, e: Exception) -> Response:
    """Routing refusals as the protocol words them: a path (or a method on it) that does not
    exist is a 404 for GET and POST; other methods are not implemented (501)."""
    status = e.status_code if isinstance(e, HTTPException) else 500
    if status not in (404, 405):
        return _JSON({"error": str(getattr(e, "detail", e))}, status_code=status)
    if request.method not in ("GET", "POST"):
        return _JSON({"error": f"Unsupported method ({request.method!r})"}, status_code=501)
    path, query = request.url.path, request.scope.get("query_string", b"")
    target = f"{path}?{query.decode('latin-1')}" if query else path
    return _JSON({"error": f"no route {target}"}, status_code=404)


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
        # bound now: `address` is known (port 0 resolved) and clients may connect at once;
        # they are answered as soon as the server runs
        self._sock = bind(host, port)
        host_, port_ = self._sock.getsockname()[:2]
        self._address = (str(host_), int(port_))
        self._server = uvicorn_server(self._build_app(), log_level=None, lifespan="off",
                                      graceful_s=SHUTDOWN_GRACE_S, host_logging=True)
        self._state = "new"  # -> "running" -> "closed"; a KVServer serves once
        self._state_lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def serve_forever(self) -> None:
        """Serve in this thread until `shutdown()` (from another thread) or, in the main
        thread, SIGINT/SIGTERM (uvicorn stops gracefully, then re-raises the signal)."""
        self._claim()
        self._serve()

    def start_background(self) -> threading.Thread:
        self._claim()
        t = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        t.start()
        return t

    def shutdown(self) -> None:
        """Stop serving and close the socket: no new connections; requests in flight get
        `SHUTDOWN_GRACE_S` to finish, then are cut. Returns once the server has stopped; safe
        to call on a server never started, and more than once."""
        with self._state_lock:
            running, self._state = self._state == "running", "closed"
        if running:
            self._server.should_exit = True  # uvicorn looks every 0.1 s
            if not self._stopped.wait(SHUTDOWN_GRACE_S + 5):
                self._server.force_exit = True
                self._stopped.wait(5)
        self._sock.close()
        # a precompute cut by the grace period still runs in its worker thread: let it end,
        # so that the caller may close the engine and the store once this returns
        if self._engine_lock.acquire(timeout=60):
            self._engine_lock.release()
        else:
            log.warning("kv-server: a precompute is still running after shutdown")

    def _claim(self) -> None:
        with self._state_lock:
            if self._state != "new":
                raise EdgeKVError(f"this KVServer is {self._state}: a KVServer serves once; "
                                  "make a new one")
            self._state = "running"

    def _serve(self) -> None:
        host, port = self.address
        log.info("kv-server on http://%s:%d", f"[{host}]" if ":" in host else host, port)
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._sock.close()
            self._stopped.set()

    def _build_app(self) -> FastAPI:
        """The ASGI app (FastAPI) that `serve_forever` runs."""
        app = FastAPI(title="edgekv kv-server", docs_url=None, redoc_url=None,
                      openapi_url=None)
        app.add_api_route("/v1/info", self._info, methods=["GET"])
        app.add_api_route("/v1/session", self._open_session, methods=["POST"])
        app.add_api_route("/v1/has", self._has, methods=["POST"])
        app.add_api_route("/v1/precompute", self._precompute, methods=["POST"])
        app.add_api_route("/v1/chunks", self._chunks, methods=["POST"])
        for bad in (PermissionError, KeyError, ValueError, TypeError, EdgeKVError, Exception):
            app.add_exception_handler(bad, _error_response)
        app.add_exception_handler(HTTPException, _no_route)
        app.add_exception_handler(ClientDisconnect, client_gone_response)
        return app

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
            if self._state == "closed":
                raise EdgeKVError("the kv-server is shutting down")
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

    # -- routes: the sync ones run in Starlette's threadpool ----------------------------

    async def _info(self) -> Response:
        return _JSON({"fingerprint": self.fingerprint, "model": self.model,
                      "chunk_size": self.chunk_size, "codecs": list(LEVELS)})

    def _open_session(self, raw: RawBody) -> Response:
        return _JSON(self.open_session(bytes.fromhex(_parse(raw)["client_nonce"])))

    def _has(self, raw: RawBody) -> Response:
        return _JSON({"has": [self.reader.contains(k) for k in _parse(raw)["keys"]]})

    def _precompute(self, raw: RawBody) -> Response:
        return _JSON(self.precompute(_parse(raw)))

    def _chunks(self, raw: RawBody) -> Response:
        body = _parse(raw)
        codec = body.get("codec", "f16")
        if codec not in LEVELS:
            raise ValueError(f"codec must be one of {LEVELS}")
        keys = [str(k) for k in body["keys"]]
        frames = self.frames(str(body["session"]), keys, codec)
        first = next(frames, None)  # an unknown session raises here: a 403, not a cut stream
        # each further frame is read and sealed in the threadpool when the client has taken
        # the previous ones; a failure mid-stream cuts the body (no last chunk) and is logged
        return StreamingResponse(itertools.chain([first] if first is not None else [], frames),
                                 media_type="application/octet-stream")
