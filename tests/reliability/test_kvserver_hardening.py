"""The KV server under hostile clients: size limits, slow clients, connection caps,
authentication that fails closed, replayed chunks, other tenants and models, and good clients
served all the while. In-process servers (fake engine, short limits) for the precise checks;
the real `edgekv kv-server` process (default limits) for the ones its wiring decides."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgekv import CacheConfig, ChunkRejected, EdgeKV, TransportError, open_store
from edgekv.engines.fake import FakeAdapter
from edgekv.kvserver.server import KVServer, Limits, load_secret
from edgekv.stream.client import KVClient
from edgekv.stream.codec import SessionCipher, decode_chunk, derive_session_keys
from edgekv.stream.costmodel import CostModel
from edgekv.stream.protocol import (
    AUTH_SCHEME,
    auth_header,
    open_proof,
    read_frames,
    request_mac,
    tenant_secret,
)
from tests.stream.loaderkit import Device

from ..conftest import real_stack, share_probes

SECRET = b"h" * 32
PROMPT = [2 + i % 250 for i in range(64 * 4)] + [7, 8, 9]  # 4 full chunks of 64 + a tail
OTHER = [3 + (i * 7) % 250 for i in range(64 * 2)] + [5]  # another prompt, ids < 257
LIMITS = Limits(request_timeout_s=1.5, write_timeout_s=1.5, max_connections=16,
                max_connections_per_client=6, refused_timeout_s=1.0, max_sessions=32,
                max_body_bytes=64 * 1024, max_keys=4096)


@contextlib.contextmanager
def kv_server(tmp: Path, limits: Limits = LIMITS, tag: str = "fake-model"):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp, reuse_granularity="chunk")
    store = open_store(cfg)
    engine = EdgeKV(FakeAdapter(tag=tag), store, cfg)
    srv = KVServer(store, SECRET, fingerprint=engine.fingerprint, model="fake", chunk_size=64,
                   engine=engine, limits=limits)
    srv.start_background()
    try:
        yield srv
    finally:
        srv.shutdown()
        store.close()


@pytest.fixture
def srv(tmp_path):
    with kv_server(tmp_path / "server") as s:
        yield s


def url_of(srv: KVServer) -> str:
    host, port = srv.address
    return f"http://{host}:{port}"


def client(srv: KVServer, **kw) -> KVClient:
    return KVClient(url_of(srv), kw.pop("secret", SECRET), timeout_s=kw.pop("timeout_s", 10),
                    **kw)


def raw(addr: tuple[str, int], data: bytes, *, source: str = "127.0.0.1",
        timeout: float = 10.0) -> bytes:
    """Send `data` on a fresh connection (from `source`) and read until the server closes."""
    with socket.create_connection(addr, timeout=timeout, source_address=(source, 0)) as s:
        s.sendall(data)
        out = b""
        with contextlib.suppress(OSError):
            while part := s.recv(65536):
                out += part
        return out


def request_bytes(method: str, path: str, body: bytes = b"",
                  headers: dict[str, str] | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: kv", "Connection: close",
            f"Content-Length: {len(body)}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


class Session:
    """A session opened by hand, to send requests the client would never send."""

    def __init__(self, srv: KVServer, tenant: str = "", secret: bytes = SECRET) -> None:
        self.srv = srv
        nonce = os.urandom(16)
        body = json.dumps({"client_nonce": nonce.hex(), "tenant": tenant, "fingerprint": "",
                           "proof": open_proof(secret, tenant, nonce, "").hex()}).encode()
        r = json.loads(split_body(raw(srv.address, request_bytes("POST", "/v1/session", body))))
        self.sid = r["session"]
        self.enc, self.mac = derive_session_keys(secret, nonce, bytes.fromhex(r["server_nonce"]))
        self.seq = 0

    def sign(self, path: str, body: bytes, seq: int | None = None) -> dict[str, str]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return {"Authorization": auth_header(self.sid, seq,
                                             request_mac(self.mac, "POST", path, seq, body))}

    def post(self, path: str, obj: object, seq: int | None = None) -> tuple[int, bytes]:
        body = json.dumps(obj).encode()
        out = raw(self.srv.address, request_bytes("POST", path, body, self.sign(path, body, seq)))
        return status_of(out), split_body(out)


def split_body(response: bytes) -> bytes:
    head, _, body = response.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        return out
    return body


# -- size limits ------------------------------------------------------------------------------

def test_oversized_bodies_are_refused_with_413(srv):
    s = Session(srv)
    big = json.dumps({"keys": ["a" * 64] * 2000}).encode()  # ~140 KB > 64 KB
    out = raw(srv.address, request_bytes("POST", "/v1/has", big, s.sign("/v1/has", big)))
    assert status_of(out) == 413 and b"TooLarge" in out
    # a body without a declared length (chunked) is counted as it arrives
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in [big[i:i + 8192] for i in
                                                                range(0, len(big), 8192)])
    head = (f"POST /v1/has HTTP/1.1\r\nHost: kv\r\nConnection: close\r\nTransfer-Encoding: "
            f"chunked\r\nAuthorization: {s.sign('/v1/has', big)['Authorization']}\r\n\r\n")
    assert status_of(raw(srv.address, head.encode() + chunked + b"0\r\n\r\n")) == 413
    # a head over the limit (16 KiB) is refused before anything else: by h11 (400) if it
    # comes in pieces, else by the server (431)
    for pad in (20_000, 300_000):
        assert status_of(raw(srv.address, request_bytes("GET", "/v1/info", b"",
                                                        {"X-Pad": "x" * pad}))) in (400, 431)


def test_too_many_keys_are_refused(tmp_path):
    with kv_server(tmp_path / "s", Limits(max_keys=8)) as srv:
        st, body = Session(srv).post("/v1/has", {"keys": ["a" * 64] * 9})
        assert st == 400 and b"at most 8" in body


def test_malformed_requests_are_400_and_never_500(srv):
    s = Session(srv)
    cases = [{"keys": "x"}, {"keys": [1, 2]}, {"keys": ["../etc/passwd"]}, {"keys": None},
             {"keys": ["A" * 64]}, [], "text", {"tokens": [-1]}, {"tokens": [True]},
             {"tokens": [2**40]}, {"tokens": "abc"}, {"prompt": {"a": 1}}, {}]
    for path in ("/v1/has", "/v1/precompute", "/v1/chunks"):
        for obj in cases:
            st, body = s.post(path, obj)
            assert st == 400, (path, obj, st, body)
    st, _ = s.post("/v1/chunks", {"keys": [], "codec": "zip"})
    assert st == 400


# -- slow clients -----------------------------------------------------------------------------

def drip(addr: tuple[str, int], data: bytes, every_s: float, source: str = "127.0.0.1",
         result: dict | None = None) -> dict:
    """Send `data` a byte at a time; when the server closes, say when and what it answered."""
    result = {} if result is None else result
    t0 = time.monotonic()
    s = socket.create_connection(addr, timeout=30, source_address=(source, 0))
    try:
        for i in range(len(data)):
            try:
                s.sendall(data[i:i + 1])
            except OSError:
                break
            time.sleep(every_s)
            s.setblocking(False)
            try:
                got = s.recv(65536)
                if got is not None:
                    result["answer"] = result.get("answer", b"") + got
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            finally:
                s.setblocking(True)
        s.settimeout(10)
        with contextlib.suppress(OSError):
            while part := s.recv(65536):
                result["answer"] = result.get("answer", b"") + part
    finally:
        s.close()
    result["closed_after_s"] = time.monotonic() - t0
    return result


@pytest.mark.parametrize("phase", ["headers", "body", "after_keepalive"])
def test_slowloris_is_cut_while_good_clients_are_served(srv, phase):
    s = Session(srv)
    body = json.dumps({"keys": ["b" * 64]}).encode()
    data = request_bytes("POST", "/v1/has", body, s.sign("/v1/has", body))
    if phase == "body":  # headers at once, then the body a byte at a time
        head, _, rest = data.partition(b"\r\n\r\n")
        sock = socket.create_connection(srv.address)
        sock.sendall(head + b"\r\n\r\n")
        t0 = time.monotonic()
        answer = b""
        with contextlib.suppress(OSError):
            for i in range(len(rest)):
                sock.sendall(rest[i:i + 1])
                time.sleep(0.1)
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            while part := sock.recv(65536):
                answer += part
        sock.close()
        result = {"answer": answer, "closed_after_s": time.monotonic() - t0}
    elif phase == "after_keepalive":  # one good request, then a slow one on the same socket
        good = request_bytes("GET", "/v1/info").replace(b"Connection: close", b"Connection: "
                                                        b"keep-alive")
        sock = socket.create_connection(srv.address)
        sock.sendall(good)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        with contextlib.suppress(OSError):
            for i in range(len(data)):
                sock.sendall(data[i:i + 1])
                time.sleep(0.1)
        sock.close()
        result = {"closed_after_s": time.monotonic() - t0}
    else:
        result = {}
        t = threading.Thread(target=drip, args=(srv.address, data, 0.1), kwargs={
            "result": result})
        t.start()
        served = 0
        while t.is_alive():  # good clients meanwhile
            t1 = time.monotonic()
            assert client(srv).info()["chunk_size"] == 64
            assert time.monotonic() - t1 < 5
            served += 1
            time.sleep(0.1)
        t.join()
        assert served >= 3
    # the request was far from complete when the deadline passed
    assert result["closed_after_s"] < LIMITS.request_timeout_s + 6
    assert result["closed_after_s"] < len(data) * 0.1 * 0.8
    if phase == "headers":
        assert status_of(result.get("answer", b"")) == 408
    assert srv.connections.stats["timed_out"] >= 1


def test_a_client_that_does_not_read_is_cut(srv):
    KVClient(url_of(srv), SECRET).precompute(PROMPT)
    keys = EdgeKV(FakeAdapter(), srv.store, CacheConfig(chunk_size=64)).chunk_keys(PROMPT)
    s = Session(srv)
    body = json.dumps({"keys": keys[:1] * 900}).encode()  # ~15 MB of frames
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(srv.address)
    sock.sendall(request_bytes("POST", "/v1/chunks", body, s.sign("/v1/chunks", body)))
    deadline = time.monotonic() + 60
    while srv.connections.stats["write_stalled"] == 0:
        assert time.monotonic() < deadline, "the stalled reader was never cut"
        assert client(srv).info()["fingerprint"]  # others are served meanwhile
        time.sleep(0.2)
    sock.close()


# -- connection caps --------------------------------------------------------------------------

@pytest.fixture
def patient(tmp_path):
    """The short limits, but idle connections are kept 10 s (the caps test holds some)."""
    with kv_server(tmp_path / "patient", dataclasses.replace(LIMITS, request_timeout_s=10)) as s:
        yield s


def test_connection_caps_refuse_the_excess_and_keep_serving_others(patient):
    srv = patient
    bad = []
    try:
        for _ in range(LIMITS.max_connections_per_client):
            bad.append(socket.create_connection(srv.address, source_address=("127.0.0.2", 0)))
        time.sleep(0.2)
        # one more from the same address: answered 503 at once, not held
        extra = raw(srv.address, request_bytes("GET", "/v1/info"), source="127.0.0.2")
        assert status_of(extra) == 503 and b"TooManyConnections" in extra
        # another address is served
        assert client(srv).info()["chunk_size"] == 64
        # the global cap: fill it from a third address, the next is refused
        for _ in range(LIMITS.max_connections - LIMITS.max_connections_per_client):
            bad.append(socket.create_connection(srv.address, source_address=("127.0.0.3", 0)))
        time.sleep(0.2)
        assert status_of(raw(srv.address, request_bytes("GET", "/v1/info"))) == 503
        assert srv.connections.stats["refused"] >= 2
    finally:
        for s in bad:
            s.close()
    # once the idle connections have gone, everyone is served again
    deadline = time.monotonic() + 20
    while True:
        out = raw(srv.address, request_bytes("GET", "/v1/info"))
        if status_of(out) == 200:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)


# -- authentication fails closed --------------------------------------------------------------

def test_requests_without_valid_authentication_are_refused(srv):
    KVClient(url_of(srv), SECRET).precompute(PROMPT)
    keys = EdgeKV(FakeAdapter(), srv.store, CacheConfig(chunk_size=64)).chunk_keys(PROMPT)
    s = Session(srv)
    body = json.dumps({"keys": keys}).encode()
    good = s.sign("/v1/has", body)["Authorization"]
    sid, seq, mac = good.split(" ", 1)[1].split(":")
    other = Session(srv)
    garbled = {
        "missing": None, "empty": "", "scheme only": AUTH_SCHEME, "bearer": f"Bearer {mac}",
        "lowercase scheme": good.replace(AUTH_SCHEME, AUTH_SCHEME.lower()),
        "truncated mac": good[:-2], "flipped mac": good[:-1] + ("0" if good[-1] != "0" else "1"),
        "unknown session": good.replace(sid, "0" * 32),
        "other session's id": good.replace(sid, other.sid),
        "seq zero": good.replace(f":{seq}:", ":0:"),
        "seq huge": good.replace(f":{seq}:", ":" + "9" * 30 + ":"),
        "binary junk": "\x00\x01" * 5, "long": "x" * 9000,
    }
    for what, header in garbled.items():
        headers = {} if header is None else {"Authorization": header}
        out = raw(srv.address, request_bytes("POST", "/v1/has", body, headers))
        assert status_of(out) in (400, 401, 403), (what, out[:200])
        assert b'"has"' not in out, what
    # the request the header was made for goes through, once; its replay does not
    first = raw(srv.address, request_bytes("POST", "/v1/has", body, {"Authorization": good}))
    assert status_of(first) == 200 and json.loads(split_body(first))["has"] == [True] * 4
    again = raw(srv.address, request_bytes("POST", "/v1/has", body, {"Authorization": good}))
    assert status_of(again) == 401 and b"replay" in again
    # a valid header on another body
    other_body = json.dumps({"keys": keys[:1]}).encode()
    h = s.sign("/v1/has", body)
    assert status_of(raw(srv.address, request_bytes("POST", "/v1/has", other_body, h))) == 401
    # precompute and chunks refuse just the same
    for path in ("/v1/precompute", "/v1/chunks"):
        b = json.dumps({"tokens": PROMPT, "keys": keys}).encode()
        out = raw(srv.address, request_bytes("POST", path, b))
        assert status_of(out) == 401
        out = raw(srv.address, request_bytes("POST", path, b, {"Authorization": good[:-3]}))
        assert status_of(out) == 401


def test_sessions_need_a_proof_of_the_secret(srv):
    nonce = os.urandom(16)

    def open_(obj: dict) -> int:
        return status_of(raw(srv.address, request_bytes("POST", "/v1/session",
                                                        json.dumps(obj).encode())))

    base = {"client_nonce": nonce.hex(), "tenant": "", "fingerprint": ""}
    assert open_(base) == 401  # no proof
    assert open_({**base, "proof": "zz" * 32}) == 401  # garbled
    assert open_({**base, "proof": open_proof(b"w" * 32, "", nonce, "").hex()}) == 401  # wrong
    good = {**base, "proof": open_proof(SECRET, "", nonce, "").hex()}
    assert open_({**good, "tenant": "t1"}) == 401  # the proof names the tenant
    assert open_({**good, "client_nonce": "00" + nonce.hex()[2:]}) == 401
    assert open_(good) == 200
    assert open_(good) == 401  # the same open, replayed
    # the client refuses a server that cannot prove the secret (e.g. an impostor)
    with pytest.raises(TransportError, match="authentication"):
        KVClient(url_of(srv), b"x" * 32).open_session()


def test_wrong_secret_never_gets_a_chunk(srv, tmp_path):
    KVClient(url_of(srv), SECRET).precompute(PROMPT)
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path / "dev")
    kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    h = Device(kv, KVClient(url_of(srv), b"x" * 32, timeout_s=5))
    r = h.generate(PROMPT, max_tokens=2, strategy="stream")
    assert r.streamed_chunks == 0 and "authentication" in (r.fallback or "")
    assert np.array_equal(r.first_logits, FakeAdapter().prefill(PROMPT, align=64))
    kv.store.close()


def test_expired_and_evicted_sessions_are_reopened_by_the_client(tmp_path):
    with kv_server(tmp_path / "s", Limits(max_sessions=2, request_timeout_s=5)) as srv:
        c = client(srv)
        c.precompute(PROMPT)
        first = c._session
        for _ in range(3):
            Session(srv)  # pushes c's session out of the table
        assert c.has(["0" * 64]) == [False]  # 403, reopened, retried
        assert c._session != first


# -- replay of sealed chunks ------------------------------------------------------------------

class CannedProxy:
    """Forwards to the server, except that /v1/chunks requests get `canned` (a recorded whole
    response) when it is set: a replay by a man in the middle."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.canned = target, None
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        req = b""
        while b"\r\n\r\n" not in req:
            req += c.recv(65536)
        head, _, body = req.partition(b"\r\n\r\n")
        n = sum(int(ln.split(b":")[1]) for ln in head.lower().split(b"\r\n")
                if ln.startswith(b"content-length:"))
        while len(body) < n:
            body += c.recv(65536)
        try:
            if b"/v1/chunks" in head and self.canned is not None:
                c.sendall(self.canned)
                return
            c.sendall(raw(self.target, head + b"\r\nConnection: close\r\n\r\n" + body))
        finally:
            c.close()

    def close(self) -> None:
        self.sock.close()


def test_a_replayed_chunk_is_rejected(srv, tmp_path):
    KVClient(url_of(srv), SECRET).precompute(PROMPT)
    keys = EdgeKV(FakeAdapter(), srv.store, CacheConfig(chunk_size=64)).chunk_keys(PROMPT)
    proxy = CannedProxy(srv.address)
    try:
        c = KVClient(f"http://127.0.0.1:{proxy.port}", SECRET, timeout_s=10)
        got = list(c.stream(keys))  # through the proxy, untouched: all four arrive
        assert [r.fragment.chain_key for r in got] == keys
        # record the server's answer to one of c's requests (same session, same keys) ...
        sid, seq, mac_key = c._signed()
        body = json.dumps({"keys": keys, "codec": "f16"}).encode()
        recorded = raw(srv.address, request_bytes("POST", "/v1/chunks", body, {
            "Authorization": auth_header(sid, seq, request_mac(mac_key, "POST", "/v1/chunks",
                                                               seq, body))}))
        assert status_of(recorded) == 200
        # ... and play it back as the answer to c's next request: it does not open
        proxy.canned = recorded
        with pytest.raises(ChunkRejected, match="authentication"):
            list(c.stream(keys))
        # nor in another session
        with pytest.raises(ChunkRejected, match="authentication"):
            list(KVClient(f"http://127.0.0.1:{proxy.port}", SECRET, timeout_s=10).stream(keys))
        # the device computes instead, and answers as if cold
        cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path / "dev")
        kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
        r = Device(kv, KVClient(f"http://127.0.0.1:{proxy.port}", SECRET, timeout_s=10),
                         CostModel(bandwidth_Bps=1e9)).generate(PROMPT, max_tokens=2,
                                                                 strategy="stream")
        assert r.streamed_chunks == 0 and "authentication" in (r.fallback or "")
        assert np.array_equal(r.first_logits, FakeAdapter().prefill(PROMPT, align=64))
        kv.store.close()
    finally:
        proxy.close()


def test_frames_are_bound_to_request_and_place(srv):
    """The same chunk sealed for request 1 does not open as request 2's, nor at another
    place in the same response, nor in another session (protocol level)."""
    KVClient(url_of(srv), SECRET).precompute(PROMPT)
    keys = EdgeKV(FakeAdapter(), srv.store, CacheConfig(chunk_size=64)).chunk_keys(PROMPT)
    s, t = Session(srv), Session(srv)
    r1 = s.post("/v1/chunks", {"keys": keys[:2]})[1]
    r2 = s.post("/v1/chunks", {"keys": keys[:2]})[1]
    r3 = t.post("/v1/chunks", {"keys": keys[:2]})[1]

    def read(resp: bytes, sess: Session, seq: int, ks: list[str]) -> list:
        buf = memoryview(resp)
        pos = [0]

        def take(n: int) -> bytes:
            if pos[0] + n > len(buf):
                raise TransportError("short")
            pos[0] += n
            return bytes(buf[pos[0] - n:pos[0]])

        return [f for _, f, _ in read_frames(take, ks, sess.sid, seq,
                                             SessionCipher(sess.enc).open, decode_chunk)]

    assert [f.chain_key for f in read(r1, s, 1, keys[:2])] == keys[:2]
    assert [f.chain_key for f in read(r2, s, 2, keys[:2])] == keys[:2]
    for resp, sess, seq, ks in [(r1, s, 2, keys[:2]), (r3, s, 1, keys[:2]),
                                (r3, s, 2, keys[:2]), (r2, t, 1, keys[:2])]:
        with pytest.raises(ChunkRejected):
            read(resp, sess, seq, ks)
    # the two frames of one response, swapped
    a_len = int.from_bytes(r1[:4], "little") + 5
    swapped = r1[a_len:] + r1[:a_len]
    with pytest.raises(ChunkRejected):
        read(swapped, s, 1, keys[:2])


# -- tenants and models -----------------------------------------------------------------------

def test_a_tenant_never_gets_another_tenants_chunks(srv):
    a = client(srv, tenant="acme", secret=tenant_secret(SECRET, "acme"))
    b = client(srv, tenant="bolt", secret=tenant_secret(SECRET, "bolt"))
    default = client(srv)
    keys_a = a.precompute(PROMPT)["keys"]
    keys_b = b.precompute(PROMPT)["keys"]
    keys_0 = default.precompute(OTHER)["keys"]
    assert not set(keys_a) & set(keys_b)  # one prompt, a chain per tenant
    assert a.has(keys_a) == [True] * 4 and b.has(keys_b) == [True] * 4
    for c, foreign in [(b, keys_a), (a, keys_b), (default, keys_a), (a, keys_0)]:
        assert c.has(foreign) == [False] * len(foreign)
        assert [r.fragment for r in c.stream(foreign)] == [None] * len(foreign)
    assert [r.fragment.chain_key for r in a.stream(keys_a)] == keys_a
    # a tenant's name with another tenant's secret does not open a session
    with pytest.raises(TransportError, match="401"):
        client(srv, tenant="acme", secret=tenant_secret(SECRET, "bolt")).open_session()
    # after a restart (no memory of who precomputed what) the chains still decide
    srv._owner.clear()
    assert b.has(keys_a) == [False] * 4 and a.has(keys_a) == [True] * 4


def test_a_client_of_another_model_is_refused(srv, tmp_path):
    other_fp = EdgeKV(FakeAdapter(tag="another-model"), srv.store,
                      CacheConfig(chunk_size=64)).fingerprint
    with pytest.raises(TransportError, match="403"):
        client(srv, fingerprint=other_fp).open_session()
    s = Session(srv)
    st, body = s.post("/v1/chunks", {"keys": ["a" * 64], "fingerprint": other_fp})
    assert st == 403 and b"model" in body
    right = client(srv, fingerprint=srv.fingerprint)
    assert all(r.fragment is not None for r in right.stream(right.precompute(PROMPT)["keys"]))


# -- everything at once -----------------------------------------------------------------------

@pytest.fixture
def roomy(tmp_path):
    """The short limits, but a global cap that four misbehaving addresses cannot fill (each
    is held to its per-address cap: the cap that protects good clients from a bad one)."""
    with kv_server(tmp_path / "roomy", dataclasses.replace(LIMITS, max_connections=64)) as s:
        yield s


def test_good_clients_are_served_while_bad_ones_misbehave(roomy):
    srv = roomy
    keys = client(srv).precompute(PROMPT)["keys"]
    stop = threading.Event()
    errors: list[str] = []

    def attack(kind: str) -> None:
        src = {"slowloris": "127.0.0.2", "flood": "127.0.0.3"}.get(kind, "127.0.0.4")
        s = Session(srv) if kind == "replay" else None
        while not stop.is_set():
            try:
                if kind == "slowloris":
                    drip(srv.address, request_bytes("POST", "/v1/has", b"{}"), 0.2, source=src)
                elif kind == "flood":
                    socks = [socket.create_connection(srv.address, source_address=(src, 0))
                             for _ in range(LIMITS.max_connections_per_client + 3)]
                    time.sleep(0.5)
                    for x in socks:
                        x.close()
                elif kind == "garbage":
                    raw(srv.address, os.urandom(300) + b"\r\n\r\n", source=src)
                    raw(srv.address, request_bytes("POST", "/v1/chunks", b"{" * 5000), source=src)
                    raw(srv.address, request_bytes("POST", "/v1/has", b"x" * 100_000,
                                                   {"Authorization": "Bearer x"}), source=src)
                elif kind == "replay" and s is not None:
                    s.post("/v1/has", {"keys": keys}, seq=1)
                    s.post("/v1/precompute", {"tokens": [2**40]})
            except OSError:
                pass  # refused or cut: that is the point

    attackers = [threading.Thread(target=attack, args=(k,), daemon=True)
                 for k in ("slowloris", "slowloris", "flood", "garbage", "replay")]
    for t in attackers:
        t.start()
    served, latencies = 0, []

    until = time.monotonic() + 3 * LIMITS.request_timeout_s  # past the slow clients' deadline

    def good(n: int) -> None:
        nonlocal served
        c = client(srv, timeout_s=10)
        i = 0
        while i < n or time.monotonic() < until:
            i += 1
            t0 = time.monotonic()
            try:
                got = list(c.stream(keys))
                assert [r.fragment.chain_key for r in got] == keys
                assert c.has(keys) == [True] * 4
                served += 1
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)

    try:
        goods = [threading.Thread(target=good, args=(15,)) for _ in range(2)]
        for t in goods:
            t.start()
        for t in goods:
            t.join(120)
    finally:
        stop.set()
        for t in attackers:
            t.join(20)
    assert not errors, errors[:3]
    assert served >= 30 and max(latencies) < 10
    stats = srv.connections.stats
    assert stats["timed_out"] >= 1 and stats["refused"] + stats["dropped"] >= 1


# -- secrets and logs -------------------------------------------------------------------------

def test_the_secret_file_is_private(tmp_path, caplog):
    p = tmp_path / "new" / "dir" / "kv.secret"
    load_secret(p, create=True)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700
    p.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert len(load_secret(p)) == 32
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and "readable by other users" in caplog.text


def test_the_server_logs_no_request_content(srv, caplog):
    secret_text = "Tell nobody: my PIN is 8412 " * 30
    c = client(srv)
    with caplog.at_level(logging.DEBUG):
        c.precompute(list(range(1, 200)))
        s = Session(srv)
        s.post("/v1/precompute", {"prompt": secret_text})
        s.post("/v1/precompute", {"prompt": secret_text * 100})  # over the context: refused
        s.post("/v1/has", {"keys": [secret_text]})
    assert "8412" not in caplog.text


# -- the real process -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from edgekv.engines.models import default_model_path

    real_stack("the kv-server process", "llama_cpp", check=default_model_path)
    tmp = tmp_path_factory.mktemp("kvreal")
    log = open(tmp / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgekv", "-v", "kv-server", "--port", "0", "--cache-dir",
         str(share_probes(tmp / "cache")), "--secret-file", str(tmp / "secret"),
         "--n-ctx", "1024"],
        stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        log.close()
        raise RuntimeError(f"kv-server did not start: {line!r} "
                           f"{(tmp / 'server.log').read_text()[-2000:]}")
    url = line.split("listening on ")[1].split()[0]
    yield url, bytes.fromhex((tmp / "secret").read_text()), tmp / "server.log"
    proc.kill()
    proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]
    log.close()


@pytest.mark.real
def test_real_server_cuts_slow_and_excess_clients_and_serves_good_ones(real_server):
    url, secret, log_path = real_server
    host, port = url.split("//")[1].rsplit(":", 1)
    addr = (host, int(port))
    from edgekv_bench.texts import MANUAL, SYSTEM_PROMPT

    good = KVClient(url, secret, timeout_s=120)
    pin = "PIN 73914 is private"
    prompt = SYSTEM_PROMPT + " " + pin + "\n\n" + MANUAL[:1200]
    keys = good._call("POST", "/v1/precompute", {"prompt": prompt})["keys"]
    assert len(keys) >= 2
    # a slowloris (headers a byte every 0.5 s) and a connection flood from other addresses
    slow: dict = {}
    slow_t = threading.Thread(target=drip, args=(addr, request_bytes("POST", "/v1/has", b"{}")
                                                 * 2, 0.5), kwargs={"source": "127.0.0.2",
                                                                    "result": slow})
    slow_t.start()
    flood = [socket.create_connection(addr, source_address=("127.0.0.3", 0))
             for _ in range(40)]  # over the per-client cap (32)
    try:
        time.sleep(0.5)
        refused = raw(addr, request_bytes("GET", "/v1/info"), source="127.0.0.3")
        assert status_of(refused) == 503
        t0 = time.monotonic()
        while slow_t.is_alive():
            got = list(good.stream(keys))
            assert all(r.fragment is not None for r in got)
            assert time.monotonic() - t0 < 60
            time.sleep(0.2)
    finally:
        for s in flood:
            s.close()
        slow_t.join(60)
    assert 14 < slow["closed_after_s"] < 30  # the default request deadline: 15 s
    assert status_of(slow.get("answer", b"")) == 408
    assert pin not in log_path.read_text()  # -v logs requests, never their content
