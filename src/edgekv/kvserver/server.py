"""`edgekv kv-server`: holds precomputed KV chunks and streams them, encrypted, by chunk key.

A real HTTP server (loopback by default) on the project's one HTTP stack: a FastAPI app run
by uvicorn, on a socket bound by `http.binding.bind` before it serves, in the foreground
(`serve_forever`) or on a background thread (`start_background`). Store reads, precompute and
encryption run in Starlette's threadpool, never on the event loop; a chunk stream is a
`StreamingResponse` that reads, seals and sends one chunk per frame as the client takes them.
The wire protocol is in `protocol.py`: paths, JSON bodies, authentication, error objects
`{"error": "Type: message"}` and the chunked stream of frames.

Chunks live in the disk store by default or in Redis (`--store redis://...`), so several
server processes can serve one store. They are read whole, through the cache's own
`ChunkReader` (every layer, verified), so a store whose fragments are kept in layer groups is
served too: a chunk goes out as one fragment of every layer. With an engine (the default),
`POST /v1/precompute` computes a context's chunks with the same model and engine as the
device, aligned the same way, so streamed KV is bit-identical to what the device would compute.

Hardening (`Limits`; see docs/reliability.md):
- every request but `GET /v1/info` is authenticated (protocol.py) and refused when it is not:
  missing, garbled or wrong authentication and replayed requests are 401, unknown sessions
  and requests for another model 403; nothing is read from the store before that;
- a body over `max_body_bytes` is a 413, a list over `max_keys` keys a 400;
- a client must deliver each whole request (headers and body) within `request_timeout_s` of
  its connection being ready for one (slowloris), and take what it is sent: a response that
  cannot be written for `write_timeout_s` closes the connection;
- at most `max_connections` connections, `max_connections_per_client` of them from one
  address; a connection over a cap is answered 503 at once (twice the cap: dropped);
- sessions are bounded (`max_sessions`, oldest dropped) and expire (`session_ttl_s`);
- a chunk goes only to the tenant whose key chain it is in (`_owns`), and only if it was
  made by this server's model;
- nothing a client sent (prompt, tokens) is logged; an internal error is logged by type and
  place, never by message, and answered with a bare 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from ..config import KVServerConfig
from ..core.match import ChunkReader
from ..errorlog import log_internal_error
from ..errors import EdgeKVError
from ..fragment import KVFragment
from ..http.binding import bind, uvicorn_server
from ..http.errors import client_gone_response
from ..keys import KV_SERVER_TENANTS, next_key, tenant_root
from ..store.base import FragmentStore
from ..store.compactor import merge_layers
from ..stream.codec import LEVELS, SessionCipher, derive_session_keys, encode_chunk
from ..stream.protocol import (
    FRAME,
    MISSING,
    OK,
    AuthFailed,
    aad,
    accept_proof,
    check_tenant,
    open_proof,
    parse_auth,
    request_mac,
    tenant_secret,
)

__all__ = ["KVServer", "Limits", "load_secret"]

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1  # shutdown(): requests in flight get this long to finish, then are cut
_CHUNK_KEY = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may take of the server (see the module docstring)."""

    max_body_bytes: int = 1 << 20  # ~15k keys or a 2k-token prompt many times over
    max_keys: int = 4096  # keys in one /v1/has or /v1/chunks
    request_timeout_s: float = 15.0  # to deliver a whole request (headers and body)
    write_timeout_s: float = 30.0  # a response that cannot be written this long is cut
    max_connections: int = 128
    max_connections_per_client: int = 32
    max_sessions: int = 4096
    max_header_bytes: int = 16 * 1024  # h11's limit on a request's head (then 400)
    refused_timeout_s: float = 2.0  # a connection over a cap gets this long to ask

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_keys, self.max_connections,
               self.max_connections_per_client, self.max_sessions) < 1 or min(
                self.request_timeout_s, self.write_timeout_s, self.refused_timeout_s) <= 0:
            raise EdgeKVError(f"kv-server limits must be positive: {self}")


def load_secret(path: Path, create: bool = False) -> bytes:
    """The pre-shared (master) secret: 32 random bytes, hex in a 0600 file."""
    p = Path(path)
    if not p.exists():
        if not create:
            raise EdgeKVError(f"no KV secret at {p}; copy the server's secret file there "
                              "or pass --secret-file")
        if not p.parent.exists():
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("KV secret %s is readable by other users (mode %o); making it 0600", p,
                    stat.S_IMODE(mode))
        try:
            p.chmod(0o600)
        except OSError as e:
            raise EdgeKVError(f"{p} is readable by other users and cannot be made private "
                              f"({e}); chmod 600 it") from None
    text = p.read_text().strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise EdgeKVError(f"{p} does not hold a hex secret") from None
    if len(raw) < 16:
        raise EdgeKVError(f"{p}: the secret must be at least 16 bytes")
    return raw


# -- refusals -------------------------------------------------------------------------------

class _Refusal(Exception):
    """A request answered with an error object and `status`."""

    KINDS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
             408: "RequestTimeout", 413: "TooLarge", 501: "NotImplemented"}

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def response(self) -> Response:
        return _json({"error": f"{self.KINDS.get(self.status, 'Error')}: {self}"}, self.status,
                     {"WWW-Authenticate": "EdgeKV-HMAC-SHA256"} if self.status == 401 else None)


def _json(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(content).encode(), status_code=status, headers=headers,
                    media_type="application/json")


def _log_internal(e: BaseException, where: str) -> None:
    """An internal error, by type and place only (its message may hold request data), the
    traceback at DEBUG: the policy `edgekv serve` follows too (`errorlog`)."""
    log_internal_error(log, e, where=f"kv-server {where}")


def _guarded(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Any]:
    """A route whose every failure is answered, never raised: refusals with their status,
    bad input 400 (its message is about the client's own request), anything else a bare 500."""

    async def route(request: Request) -> Response:
        try:
            return await fn(request)
        except _Refusal as e:
            return e.response()
        except AuthFailed as e:
            return _Refusal(401, str(e)).response()
        except ClientDisconnect:
            raise
        except (ValueError, TypeError, KeyError, EdgeKVError) as e:
            return _json({"error": f"BadRequest: {type(e).__name__}: {str(e)[:200]}"}, 400)
        except Exception as e:  # noqa: BLE001 - answered and logged, never raised
            _log_internal(e, request.scope.get("path", "?"))
            return _json({"error": "InternalError: see the server log"}, 500)

    route.__name__ = fn.__name__
    return route


async def _no_route(request: Request, e: Exception) -> Response:
    """Routing refusals as the protocol words them: a path (or a method on it) that does not
    exist is a 404 for GET and POST; other methods are not implemented (501)."""
    status = e.status_code if isinstance(e, HTTPException) else 500
    if status not in (404, 405):
        return _json({"error": str(getattr(e, "detail", e))}, status)
    if request.method not in ("GET", "POST"):
        return _json({"error": f"Unsupported method ({request.method!r})"}, 501)
    path, query = request.url.path, request.scope.get("query_string", b"")
    target = f"{path}?{query.decode('latin-1')}" if query else path
    return _json({"error": f"no route {target[:200]}"}, 404)


def _hex(value: object, name: str, lo: int, hi: int) -> bytes:
    if not isinstance(value, str) or not lo * 2 <= len(value) <= hi * 2:
        raise ValueError(f"{name} must be {lo}-{hi} bytes of hex")
    return bytes.fromhex(value)


def _keys(body: dict[str, Any], limit: int) -> list[str]:
    keys = body.get("keys")
    if not isinstance(keys, list) or len(keys) > limit:
        raise ValueError(f"keys must be a list of at most {limit} chunk keys")
    if not all(isinstance(k, str) and _CHUNK_KEY.match(k) for k in keys):
        raise ValueError("a chunk key is 64 lowercase hex digits")
    return keys


# -- sessions -------------------------------------------------------------------------------

class _Session:
    """One client session: its keys, its tenant, and the request numbers it has used."""

    WINDOW = 256  # a request may arrive up to this many numbers late (parallel requests)

    __slots__ = ("cipher", "created", "mac_key", "max_seq", "root", "seen", "tenant")

    def __init__(self, cipher: SessionCipher, mac_key: bytes, tenant: str, root: str) -> None:
        self.cipher, self.mac_key, self.tenant, self.root = cipher, mac_key, tenant, root
        self.created = time.time()
        self.max_seq, self.seen = 0, 0  # seen: bit i = request max_seq - i was accepted

    def accept(self, seq: int) -> bool:
        """Whether request number `seq` is new (then it is recorded): each number once."""
        if seq > self.max_seq:
            shift = seq - self.max_seq
            self.seen = ((self.seen << shift) | 1) & ((1 << self.WINDOW) - 1)
            self.max_seq = seq
            return True
        age = self.max_seq - seq
        if age >= self.WINDOW or self.seen >> age & 1:
            return False
        self.seen |= 1 << age
        return True


# -- connections ----------------------------------------------------------------------------

class _Connections:
    """Open connections, in all and per client address; what was refused or cut, and why."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total = 0
        self.per_peer: dict[str, int] = {}
        self.stats = {"refused": 0, "dropped": 0, "timed_out": 0, "write_stalled": 0}

    def admit(self, peer: str) -> str:
        """Count a new connection: "ok", "refuse" (answer 503) or "drop" (close at once)."""
        self.total += 1
        n = self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        lim = self.limits
        if self.total > 2 * lim.max_connections or n > 2 * lim.max_connections_per_client:
            self.stats["dropped"] += 1
            return "drop"
        if self.total > lim.max_connections or n > lim.max_connections_per_client:
            self.stats["refused"] += 1
            return "refuse"
        return "ok"

    def release(self, peer: str) -> None:
        self.total -= 1
        n = self.per_peer.get(peer, 1) - 1
        if n > 0:
            self.per_peer[peer] = n
        else:
            self.per_peer.pop(peer, None)


async def _too_many(scope: Any, receive: Any, send: Any) -> None:
    body = b'{"error": "TooManyConnections: retry later"}'
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"connection", b"close"),
        (b"retry-after", b"1"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


_TIMEOUT_BODY = b'{"error": "RequestTimeout: the request was not sent in time"}'
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))


def _guarded_protocol(limits: Limits, conns: _Connections) -> type:
    """uvicorn's h11 protocol with the connection caps and the two deadlines uvicorn lacks:
    its keep-alive timer starts only after a first response and is reset by every byte, so
    a client sending its headers (or body) a byte at a time would hold a connection forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    received = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)

    class GuardedH11(H11Protocol):
        _peer: str | None = None
        _deadline: asyncio.TimerHandle | None = None
        _stall: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._peer = self.client[0] if self.client else "?"
            verdict = conns.admit(self._peer)
            if verdict == "drop":
                transport.abort()
                return
            if verdict == "refuse":
                self.app = _too_many  # answered 503 as soon as it asks
                self._arm(limits.refused_timeout_s)
            else:
                self._arm(limits.request_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            if self._peer is not None:
                conns.release(self._peer)
                self._peer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in received:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state not in received:
                self._arm(limits.request_timeout_s)  # the next request on this connection

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall is None:
                self._stall = self.loop.call_later(limits.write_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _cancel(self) -> None:
            self._disarm()
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            conns.stats["timed_out"] += 1
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

        def _stalled(self) -> None:
            self._stall = None
            conns.stats["write_stalled"] += 1
            self.transport.abort()

    return GuardedH11


# -- the server -----------------------------------------------------------------------------

class KVServer:
    """`reader` reads `store`'s chunks (`ChunkReader.for_model`); with an engine (an `EdgeKV`
    over the same store) it defaults to the engine's. `secret` is the master secret (tenant
    "" uses it; see `protocol.tenant_secret`). `session_ttl_s`: see
    `KVServerConfig.session_ttl_s` (its default, `EDGEKV_KV_SESSION_TTL_S`). `limits`: see
    `Limits`."""

    OWNER_MEMO = 16384  # chunk keys whose tenant chain is known, kept (LRU)
    MAX_CHAIN = 8192  # chunks followed back to a chain's root before giving up

    def __init__(self, store: FragmentStore, secret: bytes, *, fingerprint: str,
                 model: str, chunk_size: int, engine: Any = None,
                 reader: ChunkReader | None = None, host: str = "127.0.0.1",
                 port: int = 0, session_ttl_s: float | None = None,
                 limits: Limits | None = None) -> None:
        if reader is None:
            if engine is None:
                raise EdgeKVError("KVServer needs a reader (ChunkReader.for_model(store, "
                                  "fingerprint, layers_per_fragment)) or an engine")
            reader = engine.reader
        self.store, self.secret, self.engine, self.reader = store, secret, engine, reader
        self.fingerprint, self.model, self.chunk_size = fingerprint, model, chunk_size
        self.limits = limits or Limits()
        self.session_ttl_s = (KVServerConfig.from_env().session_ttl_s if session_ttl_s is None
                              else session_ttl_s)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._nonces: OrderedDict[bytes, float] = OrderedDict()  # session opens seen
        self._owner: OrderedDict[str, str] = OrderedDict()  # chunk key -> its chain's root
        self._lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self.connections = _Connections(self.limits)
        self.app = self._build_app()
        # bound now: `address` is known (port 0 resolved) and clients may connect at once;
        # they are answered as soon as the server runs
        self._sock = bind(host, port)
        host_, port_ = self._sock.getsockname()[:2]
        self._address = (str(host_), int(port_))
        self._server = uvicorn_server(self.app, log_level=None, lifespan="off",
                                      graceful_s=SHUTDOWN_GRACE_S, host_logging=True)
        cfg = self._server.config
        cfg.http = _guarded_protocol(self.limits, self.connections)
        cfg.h11_max_incomplete_event_size = self.limits.max_header_bytes
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
        app.add_api_route("/v1/info", _guarded(self._info), methods=["GET"])
        app.add_api_route("/v1/session", _guarded(self._open_session), methods=["POST"])
        app.add_api_route("/v1/has", _guarded(self._has), methods=["POST"])
        app.add_api_route("/v1/precompute", _guarded(self._precompute), methods=["POST"])
        app.add_api_route("/v1/chunks", _guarded(self._chunks), methods=["POST"])
        app.add_exception_handler(HTTPException, _no_route)
        app.add_exception_handler(ClientDisconnect, client_gone_response)
        app.add_middleware(_HeadLimit, limit=self.limits.max_header_bytes)
        return app

    # -- sessions and authentication -----------------------------------------------------

    def open_session(self, client_nonce: bytes, *, tenant: str = "", fingerprint: str = "",
                     proof: bytes | None = None) -> dict[str, str]:
        """A new session for a client that proved it holds `tenant`'s secret; the answer
        proves to the client that this server holds it too."""
        tenant = check_tenant(tenant)
        secret = tenant_secret(self.secret, tenant)
        if proof is None or not hmac.compare_digest(
                proof, open_proof(secret, tenant, client_nonce, fingerprint)):
            raise _Refusal(401, "session refused: the proof does not match this tenant's "
                           "secret" if proof is not None else "session refused: no proof")
        if fingerprint and fingerprint != self.fingerprint:
            raise _Refusal(403, f"this server holds KV of model {self.fingerprint[:12]}, not "
                           f"{fingerprint[:12]}")
        server_nonce = secrets.token_bytes(16)
        sid = secrets.token_hex(16)
        enc, mac = derive_session_keys(secret, client_nonce, server_nonce)
        session = _Session(SessionCipher(enc), mac, tenant,
                           tenant_root(self.fingerprint, tenant, KV_SERVER_TENANTS))
        now = time.time()
        with self._lock:
            self._expire(now)
            if client_nonce in self._nonces:
                raise _Refusal(401, "session refused: this open request was seen before")
            self._nonces[client_nonce] = now
            while len(self._nonces) > 4 * self.limits.max_sessions:
                self._nonces.popitem(last=False)
            self._sessions[sid] = session
            while len(self._sessions) > self.limits.max_sessions:
                self._sessions.popitem(last=False)  # the oldest session goes
        return {"session": sid, "server_nonce": server_nonce.hex(),
                "proof": accept_proof(secret, tenant, client_nonce, server_nonce, sid).hex()}

    def _expire(self, now: float) -> None:
        """Drop expired sessions and remembered nonces (oldest first); under `_lock`."""
        while self._sessions and (
                now - next(iter(self._sessions.values())).created > self.session_ttl_s):
            self._sessions.popitem(last=False)
        while self._nonces and now - next(iter(self._nonces.values())) > self.session_ttl_s:
            self._nonces.popitem(last=False)

    def _session(self, sid: str) -> _Session | None:
        with self._lock:
            self._expire(time.time())
            return self._sessions.get(sid)

    async def _body(self, request: Request) -> bytes:
        """The request body; over `max_body_bytes` it is a 413, declared or as read."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _Refusal(413, f"request body over {limit} bytes")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise _Refusal(413, f"request body over {limit} bytes")
            parts.append(part)
        return b"".join(parts)

    async def _authenticated(self, request: Request) -> tuple[_Session, str, int,
                                                               dict[str, Any]]:
        """(session, its id, request number, JSON body) of a request that proves it holds the
        session key; refused (401/403) before its body is looked at otherwise."""
        sid, seq, mac = parse_auth(request.headers.get("authorization"))
        raw = await self._body(request)
        session = self._session(sid)
        if session is None:
            raise _Refusal(403, "unknown or expired session; open a new one")
        want = request_mac(session.mac_key, request.method, request.scope["path"], seq, raw)
        if not hmac.compare_digest(mac, want):
            raise _Refusal(401, "request authentication failed (wrong session key or a "
                           "tampered request)")
        with self._lock:
            fresh = session.accept(seq)
        if not fresh:
            raise _Refusal(401, f"request {seq} of this session was seen before (replay)")
        return session, sid, seq, _parse(raw)

    # -- tenants -------------------------------------------------------------------------

    def _parent_of(self, key: str) -> str | None:
        """The parent key of stored chunk `key`, verified (its tokens and parent hash to
        `key` under this server's model); None if it is not stored or not right."""
        frag: KVFragment | None = self.store.get(key)
        if frag is None:
            lo, hi = self.reader.layer_groups[0]
            frag = self.store.get(self.reader.store_key(key, lo, hi))
        if (frag is None or frag.model_fingerprint != self.fingerprint or frag.chain_key != key
                or next_key(frag.parent_key, self.fingerprint, frag.token_ids) != key):
            return None
        return frag.parent_key

    def _owns(self, root: str, key: str, parent: str | None = None) -> bool:
        """Whether chunk `key` is in the key chain that starts at `root` (a tenant's): its
        parents are followed back to a chain root ("" or a tenant's) or to a key whose root is
        known. A chain that cannot be followed (a parent missing) is nobody's."""
        path: list[str] = []
        k, found = key, None
        for _ in range(self.MAX_CHAIN):
            with self._lock:
                found = self._owner.get(k)
            if found is not None:
                break
            if parent is None:
                parent = self._parent_of(k)
                if parent is None:
                    return False
            path.append(k)
            if parent in ("", root):
                found = parent
                break
            k, parent = parent, None
        if found is None:
            return False
        self._remember(path, found)
        return found == root

    def _remember(self, keys: list[str], root: str) -> None:
        with self._lock:
            for k in keys:
                self._owner[k] = root
                self._owner.move_to_end(k)
            while len(self._owner) > self.OWNER_MEMO:
                self._owner.popitem(last=False)

    # -- the work (threadpool) -----------------------------------------------------------

    def precompute(self, body: dict[str, Any], tenant: str = "") -> dict[str, Any]:
        if self.engine is None:
            raise EdgeKVError("this server has no engine (started with --no-engine)")
        tokens, prompt = body.get("tokens"), body.get("prompt")
        if tokens is not None:
            vocab = self.engine.adapter.n_vocab
            if not isinstance(tokens, list) or not all(
                    type(t) is int and 0 <= t < vocab  # noqa: E721
                    for t in tokens):
                raise ValueError(f"tokens must be a list of token ids in [0, "
                                 f"{vocab})")
            what: Any = tokens
        elif isinstance(prompt, str):
            what = prompt
        else:
            raise EdgeKVError("precompute needs 'tokens' (list of ints) or 'prompt' (string)")
        if not what:
            raise EdgeKVError("precompute needs 'tokens' (list of ints) or 'prompt' (string)")
        with self._engine_lock:
            if self._state == "closed":
                raise EdgeKVError("the kv-server is shutting down")
            req = self.engine.prepare(what, max_tokens=1, salt=tenant,
                                      namespace=KV_SERVER_TENANTS)
            r = self.engine.generate(req)
        self._remember(list(req.keys), req.root)
        return {"keys": list(req.keys), "stored": r.stored_fragments,
                "prompt_tokens": len(req.tokens)}

    def has(self, session: _Session, keys: list[str]) -> list[bool]:
        return [self.reader.contains(k) and self._owns(session.root, k) for k in keys]

    def frames(self, session: _Session, sid: str, seq: int, keys: list[str],
               codec: str) -> Iterator[bytes]:
        """The response to /v1/chunks: one frame per key; a chunk that is not stored, not
        this model's or not this tenant's is "missing" (its existence is not revealed)."""
        for i, key in enumerate(keys):
            chunk = self.reader.read(key, time.time(), [])
            if (chunk is None or chunk.head.model_fingerprint != self.fingerprint
                    or not self._owns(session.root, key, chunk.head.parent_key)):
                yield FRAME.pack(0, MISSING)
                continue
            frag = chunk.head if len(chunk.fragments) == 1 else merge_layers(chunk.fragments)
            sealed = session.cipher.seal(encode_chunk(frag, codec), aad(sid, seq, i, key))
            yield FRAME.pack(len(sealed), OK) + sealed

    # -- routes --------------------------------------------------------------------------

    async def _info(self, request: Request) -> Response:
        return _json({"fingerprint": self.fingerprint, "model": self.model,
                      "chunk_size": self.chunk_size, "codecs": list(LEVELS)})

    async def _open_session(self, request: Request) -> Response:
        body = _parse(await self._body(request))
        nonce = _hex(body.get("client_nonce"), "client_nonce", 16, 64)
        fingerprint = body.get("fingerprint", "")
        if not isinstance(fingerprint, str) or len(fingerprint) > 128:
            raise ValueError("fingerprint must be a model fingerprint (string)")
        proof = body.get("proof")
        if proof is not None and not (isinstance(proof, str) and re.fullmatch(
                "[0-9a-f]{64}", proof)):
            raise AuthFailed("garbled session proof: expected 64 hex digits")
        return _json(self.open_session(
            nonce, tenant=check_tenant(body.get("tenant", "")), fingerprint=fingerprint,
            proof=bytes.fromhex(proof) if proof is not None else None))

    async def _has(self, request: Request) -> Response:
        session, _, _, body = await self._authenticated(request)
        keys = _keys(body, self.limits.max_keys)
        return _json({"has": await run_in_threadpool(self.has, session, keys)})

    async def _precompute(self, request: Request) -> Response:
        session, _, _, body = await self._authenticated(request)
        return _json(await run_in_threadpool(self.precompute, body, session.tenant))

    async def _chunks(self, request: Request) -> Response:
        session, sid, seq, body = await self._authenticated(request)
        codec = body.get("codec", "f16")
        if codec not in LEVELS:
            raise ValueError(f"codec must be one of {LEVELS}")
        fingerprint = body.get("fingerprint")
        if fingerprint is not None and fingerprint != self.fingerprint:
            raise _Refusal(403, f"this server holds KV of model {self.fingerprint[:12]}, not "
                           f"{str(fingerprint)[:12]}")
        keys = _keys(body, self.limits.max_keys)
        frames = self.frames(session, sid, seq, keys, codec)
        first = await run_in_threadpool(next, frames, None)
        # each further frame is read and sealed in the threadpool when the client has taken
        # the previous ones; a failure mid-stream cuts the body (the client sees too few
        # frames) and is logged by type only
        return StreamingResponse(_cut_on_error([first] if first is not None else [], frames),
                                 media_type="application/octet-stream")


class _HeadLimit:
    """ASGI middleware: a request head over `limit` bytes is a 431. (h11 enforces its limit
    only on a head that arrives in several reads; one that arrives at once passes it.)"""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (
                len(scope.get("raw_path", b"")) + sum(len(k) + len(v) + 4 for k, v in
                                                      scope["headers"]) > self.limit):
            body = b'{"error": "HeadersTooLarge: the request head is over the limit"}'
            await send({"type": "http.response.start", "status": 431, "headers": [
                (b"content-type", b"application/json"), (b"connection", b"close"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _cut_on_error(first: list[bytes], rest: Iterator[bytes]) -> Iterator[bytes]:
    yield from first
    try:
        yield from rest
    except Exception as e:  # noqa: BLE001 - the stream ends short; the client falls back
        _log_internal(e, "/v1/chunks stream")


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw or b"{}")
    except RecursionError:
        raise ValueError("request body nests too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("request body must be a JSON object")
    return obj
