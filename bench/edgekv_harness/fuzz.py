"""`edgekv bench fuzz`: every decoder of untrusted bytes, fed mutated real inputs.

Targets (`TARGETS`), each with the errors that count as a clean refusal (`Target.clean`):

    fragment     serial.decode_fragment (and DiskStore.get on the file)   CorruptEntry / a miss
    state_blob   engines.llamacpp_state.parse_seq_state                     UnsupportedLayout
    wire         a /v1/chunks response: protocol.read_frames + AES-GCM      ChunkRejected,
                 + codec.decode_chunk                                       TransportError
    chunk        stream.codec.decode_chunk on a chunk's plaintext           ChunkRejected
    workload     bench.workload.load_jsonl on a JSONL file                  ConfigError
    kv_http      the KV server's app: request bodies, auth headers, paths   any 4xx answer
    serve_http   `edgekv serve`'s app (fake engine): bodies, auth, paths    any 4xx answer

Anything else is a crash: another exception, a 5xx answer, or an accepted input that breaks
the target's contract (a fragment or state of the wrong shape, a chunk that opened although
its bytes were not the ones sealed for that place in that request, a request served without
valid authentication, a workload request with an unusable prompt). A hang is an input still
running after `HANG_S` seconds. Peak RSS is the worker's `ru_maxrss`; the worker's address
space is capped at its size after warm-up plus `MEMORY_MARGIN` (so an allocation sized by a
length field fails as a MemoryError, a crash, instead of going unnoticed).

Seeds are real files: fragment files a real `DiskStore` wrote for the real engine (SmolLM2 via
llama.cpp) and the fake engine, sequence-state blobs llama.cpp produced, requests and
responses recorded on the wire between a real `KVClient` and a real `KVServer`, and the
request bodies the serve tests send. Mutations: bit flips, interesting bytes, truncation,
length-field blowups (1-8 byte fields set to extreme values), splices and block copies between
seeds, plus format-aware ones (a JSON value replaced, digests and MACs recomputed so the
mutation reaches past them, frames swapped between requests, zstd bombs).

Each target runs in a child process (spawned, so no model is inherited); the parent watches a
heartbeat and, on a hang or a hard crash (a signal), kills the child, records the input and
starts a new child at the next one. Input `i` of a target is a pure function of
(seed, target, i, corpus), so every finding is reproducible with `replay`.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import base64
import contextlib
import copy
import hashlib
import io
import json
import multiprocessing
import os
import random
import resource
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_INPUTS", "HANG_S", "TARGETS", "build_corpus", "fuzz_table", "make_target",
           "replay", "add_parser", "run_cli", "run_fuzz", "run_target_inline"]

DEFAULT_INPUTS = 100_000
HANG_S = 2.0  # an input running longer than this is a hang
MEMORY_MARGIN = 2 << 30  # address space a worker may grow by after warm-up
TARGETS = ("fragment", "state_blob", "wire", "chunk", "workload", "kv_http", "serve_http")
SNAPSHOT_EVERY = 250  # inputs between a worker's progress reports

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}<|im_start|>assistant\n")
SECRET = bytes(range(32))  # the fuzz servers' master secret (not a real one)
API_KEY = "fuzz-key-1"


class Crash(Exception):
    """An accepted input that breaks the target's contract."""


# -- mutations ------------------------------------------------------------------------------

_I8 = (0, 1, 0x7F, 0x80, 0xFF)
_I16 = (0, 1, 0x7FFF, 0x8000, 0xFFFF)
_I32 = (0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, 1 << 16, 1 << 24, 1 << 30)
_I64 = (0, 1, 1 << 31, 1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
_BY_WIDTH = {1: _I8, 2: _I16, 4: _I32, 8: _I64}


def _pos(rng: random.Random, n: int) -> int:
    """A position in n bytes, half of the time in the first 4 KiB (where headers are)."""
    if n <= 0:
        return 0
    return rng.randrange(min(n, 4096)) if rng.random() < 0.5 else rng.randrange(n)


def set_int(rng: random.Random, b: bytearray, pos: int, width: int) -> None:
    """A length-field blowup: `width` bytes at `pos` set to an extreme or nearby value."""
    vals = _BY_WIDTH[width]
    r = rng.random()
    if r < 0.6:
        v = rng.choice(vals)
    elif r < 0.8:
        v = len(b) + rng.randint(-16, 16)
    else:
        old = int.from_bytes(b[pos:pos + width].ljust(width, b"\0"), "little")
        v = old + rng.choice((-1, 1, -2, 2, 8, 1 << 8, 1 << 16))
    v %= 1 << (8 * width)
    b[pos:pos + width] = v.to_bytes(width, rng.choice(("little", "little", "big")))


def mutate_bytes(rng: random.Random, data: bytes, others: Sequence[bytes] = (),
                 max_len: int = 8 << 20) -> bytes:
    """1-8 byte-level mutations: bit flips, interesting bytes, truncation, length-field
    blowups, splices with another seed, block copies, inserts and deletes."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 8))):
        if not b:
            b = bytearray(rng.randbytes(rng.randrange(1, 64)))
            continue
        op = rng.randrange(10)
        n = len(b)
        if op == 0:
            i = _pos(rng, n)
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[_pos(rng, n)] = rng.choice(_I8)
        elif op == 2:
            del b[rng.randrange(n):]
        elif op == 3:
            width = rng.choice((1, 2, 4, 4, 8))
            if n >= width:
                set_int(rng, b, min(_pos(rng, n), n - width), width)
        elif op == 4 and others:
            other = rng.choice(others)
            i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
            b = b[:i] + other[j:j + rng.randrange(1, 1 << rng.randrange(1, 16))] + (
                b[i:] if rng.random() < 0.5 else b"")
        elif op == 5:
            i = _pos(rng, n)
            blk = b[i:i + rng.randrange(1, 256)]
            j = rng.randrange(n + 1)
            b[j:j] = blk * rng.choice((1, 1, 2, 16))
        elif op == 6:
            i = _pos(rng, n)
            del b[i:i + rng.randrange(1, 256)]
        elif op == 7:
            i = _pos(rng, n)
            b[i:i + 8] = rng.randbytes(min(8, n - i))
        elif op == 8:
            b[rng.randrange(n + 1):0] = rng.randbytes(rng.randrange(1, 32))
        else:
            i = _pos(rng, n)
            b[i] = (b[i] + rng.choice((-1, 1, 16, -16))) % 256
        if len(b) > max_len:
            del b[max_len:]
    return bytes(b)


_DEEP = 100_000  # nesting of the "deep" JSON value (past any recursion limit)


def _pool(rng: random.Random) -> Any:
    """A JSON value of a kind decoders trip over."""
    return rng.choice((
        None, True, False, 0, -1, 1, 2, 63, 64, 65, 2**31 - 1, 2**31, -2**31, 2**32, 2**53,
        2**63, 2**64, 10**30, 10**400, 1e308, -1e308, 0.5, -0.0, 1e-300, float("nan"),
        float("inf"), float("-inf"), "", "a", "0", "-1", "f2", "i4", "<f2", "O", "V8", "U4",
        "x" * 4096, "\ud800", "\u2028", "\x00", "é" * 10, "0" * 64, "f" * 64, "../../etc",
        [], {}, [0], [1, 2, 3], [-1], [2**31, 2], [0] * 64, [[1]], [{}], {"a": 1}, {"": None},
        [[[[[[[[[[[]]]]]]]]]]], {"a": {"b": {"c": {}}}}))


def _walk(obj: Any, path: tuple[Any, ...] = (), out: list[tuple[Any, ...]] | None = None,
          limit: int = 400) -> list[tuple[Any, ...]]:
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    out.append(path)
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:64]:
            _walk(v, (*path, k), out, limit)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            _walk(v, (*path, i), out, limit)
    return out


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def mutate_json(rng: random.Random, obj: Any) -> Any:
    """1-3 structural mutations of a JSON value: a node replaced (by an awkward value, another
    node, a neighbour of a number), removed, duplicated, wrapped, or a key added."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.choice((1, 1, 2, 3))):
        paths = _walk(obj)
        path = rng.choice(paths)
        op = rng.randrange(8)
        if not path:
            if op < 2:
                return _pool(rng)
            if isinstance(obj, dict):
                obj[rng.choice(("extra", "tensors", "keys", "prompt", "tokens", "x" * 300))] = (
                    _pool(rng))
            continue
        parent, last = _get(obj, path[:-1]), path[-1]
        cur = parent[last]
        if op <= 2:
            parent[last] = _pool(rng)
        elif op == 3:
            parent[last] = copy.deepcopy(_get(obj, rng.choice(paths)))
        elif op == 4 and isinstance(cur, (int, float)) and not isinstance(cur, bool):
            parent[last] = rng.choice((cur + 1, cur - 1, -cur, cur * 2**rng.randrange(1, 64),
                                       float(cur) if abs(cur) < 1e300 else cur, str(cur),
                                       [cur]))
        elif op == 5:
            del parent[last]
        elif op == 6:
            parent[last] = rng.choice(([cur], {"v": cur}, [cur, cur]))
        elif isinstance(cur, list) and 0 < len(cur) < 200:
            cur.extend(copy.deepcopy(cur[: rng.randrange(1, len(cur) + 1)])
                       * rng.choice((1, 2, 50)))
        elif isinstance(cur, str):
            parent[last] = rng.choice((cur[: len(cur) // 2], cur + cur, cur.upper(), cur[::-1],
                                       cur + "\ud800", cur.encode("utf-8", "surrogatepass").hex()))
        else:
            parent[last] = None
    return obj


def dumps_json(rng: random.Random, obj: Any) -> bytes:
    """`obj` as JSON text (NaN/Infinity as Python writes them), now and then with its first
    nested value replaced by one nested past any recursion limit."""
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.03:
        deep = "[" * _DEEP + "]" * _DEEP
        i = text.find("[")
        text = (text[:i] + deep + text[i + 1:]) if i >= 0 else deep
    return text.encode("utf-8", "surrogatepass")


# -- the ASGI driver (HTTP targets) ---------------------------------------------------------

class AsgiDriver:
    """Calls an ASGI app in process, one request at a time, on its own event loop: the app's
    whole stack (routing, body reading, validation, handlers, responses) without sockets."""

    def __init__(self, app: Any, *, lifespan: bool = False) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._lifespan: tuple[asyncio.Queue[Any], asyncio.Task[Any]] | None = None
        if lifespan:
            self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        q: asyncio.Queue[Any] = asyncio.Queue()
        started: asyncio.Future[None] = self.loop.create_future()

        async def send(msg: dict[str, Any]) -> None:
            if msg["type"] == "lifespan.startup.complete":
                started.set_result(None)
            elif msg["type"] == "lifespan.startup.failed":
                started.set_exception(RuntimeError(msg.get("message", "startup failed")))

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                 "state": {}}
        task = self.loop.create_task(self.app(scope, q.get, send))
        await q.put({"type": "lifespan.startup"})
        await started
        self._lifespan = (q, task)

    def request(self, method: str, path: str, headers: Sequence[tuple[str, str]],
                body: bytes, parts: int = 1) -> tuple[int, bytes]:
        return self.loop.run_until_complete(self._request(method, path, headers, body, parts))

    async def _request(self, method: str, path: str, headers: Sequence[tuple[str, str]],
                       body: bytes, parts: int) -> tuple[int, bytes]:
        cut = sorted({0, len(body), *(len(body) * k // parts for k in range(1, parts))})
        pieces = [body[a:b] for a, b in zip(cut, cut[1:])] or [b""]
        done = asyncio.Event()
        status: list[int] = []
        out: list[bytes] = []

        async def receive() -> dict[str, Any]:
            if pieces:
                piece = pieces.pop(0)
                return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status.append(int(msg["status"]))
            elif msg["type"] == "http.response.body":
                out.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    done.set()

        raw_path = path.encode("utf-8", "surrogateescape")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": method, "scheme": "http", "path": path,
                 "raw_path": raw_path, "query_string": b"", "root_path": "",
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                             for k, v in headers],
                 "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000), "state": {}}
        try:
            await self.app(scope, receive, send)
        finally:
            done.set()
        if not status:
            raise Crash("the app sent no response")
        return status[0], b"".join(out)

    def close(self) -> None:
        if self._lifespan is not None:
            q, task = self._lifespan
            q.put_nowait({"type": "lifespan.shutdown"})
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(asyncio.wait_for(task, 30))
        self.loop.close()


# -- targets --------------------------------------------------------------------------------

@dataclass
class Target(abc.ABC):
    """One decoder under fuzz: `generate(rng)` makes an input from the seeds, `run(input)`
    returns True if it was accepted, False for a clean refusal (an exception in `clean`, or
    an answer the target documents), and raises anything else."""

    name: str
    corpus: Path
    index: int = 0  # the number of the input being generated (set by the runners)
    clean: tuple[type[BaseException], ...] = ()
    clean_doc: str = ""
    seeds: list[Any] = field(default_factory=list)
    seed_note: str = ""

    def setup(self) -> None:  # noqa: B027 - optional hook: most targets need none
        """Prepare what every input shares (a server, a store)."""

    @abc.abstractmethod
    def generate(self, rng: random.Random) -> Any:
        """One input, made from the seeds with `rng`."""

    @abc.abstractmethod
    def run(self, x: Any) -> bool:
        """Decode `x`: True if accepted, False if cleanly refused; anything else raises."""

    def close(self) -> None:  # noqa: B027 - optional hook: most targets hold nothing
        """Release what `setup` made."""

    def clean_error(self, e: BaseException) -> bool:
        return isinstance(e, self.clean)

    def _files(self, sub: str, pattern: str) -> list[Path]:
        files = sorted(p for p in (self.corpus / sub).glob(pattern)
                       if p.name not in ("SOURCE.json", "meta.json"))
        if not files:
            raise FileNotFoundError(f"no seeds in {self.corpus / sub}; build the corpus first")
        return files


def _note(corpus: Path, sub: str) -> str:
    try:
        return json.loads((corpus / sub / "SOURCE.json").read_text())["source"]
    except (OSError, ValueError, KeyError):
        return sub


class FragmentTarget(Target):
    """Fragment files: `decode_fragment`, and 1 in 16 inputs as a file `DiskStore.get`
    reads (a damaged file must be a logged miss)."""

    def setup(self) -> None:
        from edgekv.errors import CorruptEntry
        from edgekv.store.disk import DiskStore

        self.clean = (CorruptEntry,)
        self.clean_doc = "CorruptEntry; DiskStore.get: None (a miss)"
        self.seeds = [p.read_bytes() for p in self._files("fragment", "*.ekv")]
        self.seed_note = _note(self.corpus, "fragment")
        self._tmp = Path(tempfile.mkdtemp(prefix="edgekv-fuzz-disk-"))
        self.store = DiskStore(self._tmp, 1 << 30)

    def generate(self, rng: random.Random) -> bytes:
        from edgekv.serial import _PREFIX

        seed = rng.choice(self.seeds)
        r = rng.random()
        if r < 0.35:
            return mutate_bytes(rng, seed, self.seeds)
        body = seed[:-32]
        if r < 0.65:  # mutate, then reseal: the decoder past the digest
            body = mutate_bytes(rng, body, [s[:-32] for s in self.seeds])
        else:  # a JSON mutation of the header, repacked
            head_len = struct.unpack_from("<I", body, 6)[0]
            header = json.loads(body[_PREFIX.size:_PREFIX.size + head_len])
            new = dumps_json(rng, mutate_json(rng, header))
            payload = body[_PREFIX.size + head_len:]
            if rng.random() < 0.2:
                payload = mutate_bytes(rng, payload)
            body = body[:6] + struct.pack("<I", len(new)) + new + payload
            if rng.random() < 0.15:
                b = bytearray(body)
                set_int(rng, b, 6, 4)  # the header length itself
                body = bytes(b)
        return body + hashlib.sha256(body).digest()

    def run(self, x: bytes) -> bool:
        from edgekv.serial import decode_fragment

        if hashlib.sha256(x).digest()[0] < 16:  # 1 in 16: through the disk store
            key = "f" + hashlib.sha256(x).hexdigest()[:40]
            path = self.store._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(x)
            frag = self.store.get(key)
            self.store.delete(key)
            if frag is None:
                return False
        else:
            frag = decode_fragment(x)
        if frag.keys.shape[:2] != (len(frag.layer_indices), frag.span):
            raise Crash(f"fragment of shape {frag.keys.shape} accepted")
        return True

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


class StateBlobTarget(Target):
    """llama.cpp sequence-state blobs, parsed with the real model's dimensions."""

    def setup(self) -> None:
        from edgekv.errors import UnsupportedLayout

        self.clean = (UnsupportedLayout,)
        self.clean_doc = "UnsupportedLayout"
        meta = json.loads((self.corpus / "state_blob" / "meta.json").read_text())
        self.dims = {k: int(meta[k]) for k in ("n_layer", "n_embd_k", "n_embd_v")}
        self.seeds = [p.read_bytes() for p in self._files("state_blob", "*.bin")]
        self.fields = [self._fields(s) for s in self.seeds]
        self.seed_note = _note(self.corpus, "state_blob")

    def _fields(self, blob: bytes) -> list[tuple[int, int]]:
        """(offset, width) of every header field of a well-formed blob."""
        f = [(0, 4), (4, 4), (8, 4), (12, 4)]
        n = struct.unpack_from("<I", blob, 12)[0]
        f += [(16 + 12 * i + j, 4) for i in range(min(n, 8)) for j in (0, 4, 8)]
        off = 16 + 12 * n
        if n == 0:
            return f
        v_trans = struct.unpack_from("<I", blob, off)[0]
        f += [(off, 4), (off + 4, 4)]
        off += 8
        d = self.dims
        for _ in range(d["n_layer"]):
            f += [(off, 4), (off + 4, 8)]
            row = struct.unpack_from("<Q", blob, off + 4)[0]
            off += 12 + row * n
        for _ in range(d["n_layer"]):
            if v_trans:
                f += [(off, 4), (off + 4, 4), (off + 8, 4)]
                el, width = struct.unpack_from("<II", blob, off + 4)
                off += 12 + el * width * n
            else:
                f += [(off, 4), (off + 4, 8)]
                row = struct.unpack_from("<Q", blob, off + 4)[0]
                off += 12 + row * n
        return f

    def generate(self, rng: random.Random) -> bytes:
        k = rng.randrange(len(self.seeds))
        seed = self.seeds[k]
        if rng.random() < 0.5:
            return mutate_bytes(rng, seed, self.seeds)
        b = bytearray(seed)
        for _ in range(rng.choice((1, 1, 2, 3))):
            off, width = rng.choice(self.fields[k])
            set_int(rng, b, off, width)
        if rng.random() < 0.2:
            del b[rng.randrange(len(b)):]
        return bytes(b)

    def run(self, x: bytes) -> bool:
        from edgekv.engines.llamacpp_state import parse_seq_state

        st = parse_seq_state(x, n_layer=self.dims["n_layer"], n_embd_k=self.dims["n_embd_k"],
                             n_embd_v=self.dims["n_embd_v"])
        d = self.dims
        if (st.keys.shape != (d["n_layer"], st.n_tokens, d["n_embd_k"])
                or st.values.shape != (d["n_layer"], st.n_tokens, d["n_embd_v"])):
            raise Crash(f"state of shapes {st.keys.shape}/{st.values.shape} accepted")
        return True


@dataclass(frozen=True)
class _Capture:
    """A recorded /v1/chunks exchange and what the client knew to read it."""

    body: bytes  # the response body (frames)
    session: str
    seq: int
    keys: tuple[str, ...]
    enc_key: bytes
    frames: tuple[tuple[int, int], ...]  # each frame's sealed bytes (offset, end); missing: 0, 0


class WireTarget(Target):
    """/v1/chunks responses as the client reads them (`protocol.read_frames`, AES-GCM,
    `decode_chunk`), mutated, and with frames swapped in from other requests and sessions: an
    accepted chunk whose sealed bytes are not the ones the server sealed for that place in
    that request is a crash (a replay or forgery that got through)."""

    def setup(self) -> None:
        from edgekv.errors import ChunkRejected, TransportError
        from edgekv.stream.codec import SessionCipher
        from edgekv.stream.protocol import FRAME, MISSING

        self.clean = (ChunkRejected, TransportError)
        self.clean_doc = "ChunkRejected, TransportError (stream ended early)"
        self.caps: list[_Capture] = []
        for p in self._files("wire", "*.json"):
            meta = json.loads(p.read_text())
            body = p.with_suffix(".bin").read_bytes()
            frames, off = [], 0
            for _ in meta["keys"]:
                length, status = FRAME.unpack_from(body, off)
                off += FRAME.size
                frames.append((0, 0) if status == MISSING else (off, off + length))
                off += 0 if status == MISSING else length
            self.caps.append(_Capture(body, meta["session"], meta["seq"], tuple(meta["keys"]),
                                      bytes.fromhex(meta["enc_key"]), tuple(frames)))
        self.ciphers = [SessionCipher(c.enc_key) for c in self.caps]
        self.seeds = [c.body for c in self.caps]
        self.seed_note = _note(self.corpus, "wire")
        # small captures more often: most of the format is in the frame headers
        self.weights = [1.0 / (1 + len(c.body) / 65536) for c in self.caps]

    def generate(self, rng: random.Random) -> tuple[int, bytes]:
        from edgekv.stream.protocol import FRAME

        k = rng.choices(range(len(self.caps)), self.weights)[0]
        cap = self.caps[k]
        r = rng.random()
        if r < 0.4:
            return k, mutate_bytes(rng, cap.body, self.seeds)
        # frame level: the frames as a list, some replaced, swapped, duplicated or cut
        frames = [cap.body[a - FRAME.size:b] if b else FRAME.pack(0, 1) for a, b in cap.frames]
        for _ in range(rng.choice((1, 1, 2))):
            op = rng.randrange(6)
            i = rng.randrange(len(frames))
            if op <= 1:  # a frame from another request or session (a replay)
                other = rng.choice(self.caps)
                a, b = rng.choice(other.frames)
                frames[i] = other.body[a - FRAME.size:b] if b else FRAME.pack(0, 1)
            elif op == 2 and len(frames) > 1:
                j = rng.randrange(len(frames))
                frames[i], frames[j] = frames[j], frames[i]
            elif op == 3:
                frames.insert(i, frames[rng.randrange(len(frames))])
            elif op == 4:
                fb = bytearray(frames[i])
                set_int(rng, fb, rng.choice((0, 0, 4)) if len(fb) > 4 else 0, rng.choice((4, 1)))
                frames[i] = bytes(fb)
            else:
                frames[i] = mutate_bytes(rng, frames[i])
        return k, b"".join(frames)

    def run(self, x: tuple[int, bytes]) -> bool:
        from edgekv.errors import TransportError
        from edgekv.stream.codec import decode_chunk
        from edgekv.stream.protocol import read_frames

        k, data = x
        cap = self.caps[k]
        buf = io.BytesIO(data)
        last: list[int] = [0, 0]

        def read(n: int) -> bytes:
            start = buf.tell()
            got = buf.read(n)
            if len(got) < n:
                raise TransportError(f"KV stream ended early ({len(got)} of {n} bytes)")
            last[:] = [start, start + n]
            return got

        accepted = False
        for i, frag, _ in read_frames(read, list(cap.keys), cap.session, cap.seq,
                                      self.ciphers[k].open, decode_chunk):
            if frag is None:
                continue
            a, b = cap.frames[i]
            if not b or data[last[0]:last[1]] != cap.body[a:b]:
                raise Crash(f"frame {i} opened although it is not the one sealed there")
            accepted = True
        return accepted


class ChunkTarget(Target):
    """Chunk plaintexts (`decode_chunk`: zstd, container, dequantization, fragment checks):
    raw mutations of the compressed bytes, mutations of the decompressed container (resealed
    and recompressed), header JSON mutations, lying zstd content sizes and zstd bombs."""

    def setup(self) -> None:
        import zstandard

        from edgekv.errors import ChunkRejected

        self.clean = (ChunkRejected,)
        self.clean_doc = "ChunkRejected"
        self.seeds = [p.read_bytes() for p in self._files("chunk", "*.zst")]
        d = zstandard.ZstdDecompressor()
        self.plain = [d.decompress(s) for s in self.seeds]
        self.seed_note = _note(self.corpus, "chunk")
        self.zc = zstandard.ZstdCompressor(level=1)
        self.zc_nosize = zstandard.ZstdCompressor(level=1, write_content_size=False)

    def generate(self, rng: random.Random) -> bytes:
        from edgekv.serial import _PREFIX

        k = rng.randrange(len(self.seeds))
        r = rng.random()
        if r < 0.3:
            return mutate_bytes(rng, self.seeds[k], self.seeds)
        if r < 0.36:  # a bomb, or a frame that lies about its size
            if rng.random() < 0.5:
                return self.zc_nosize.compress(b"\0" * rng.choice((1 << 20, 40 << 20)))
            b = bytearray(self.zc.compress(self.plain[k]))
            set_int(rng, b, 5, rng.choice((1, 2, 4, 8)) if len(b) > 13 else 1)
            return bytes(b)
        body = self.plain[k][:-32]
        if r < 0.65:
            body = mutate_bytes(rng, body, [p[:-32] for p in self.plain])
        else:
            head_len = struct.unpack_from("<I", body, 6)[0]
            header = json.loads(body[_PREFIX.size:_PREFIX.size + head_len])
            new = dumps_json(rng, mutate_json(rng, header))
            body = body[:6] + struct.pack("<I", len(new)) + new + body[_PREFIX.size + head_len:]
        out = body + hashlib.sha256(body).digest()
        return (self.zc if rng.random() < 0.8 else self.zc_nosize).compress(out)

    def run(self, x: bytes) -> bool:
        from edgekv.stream.codec import decode_chunk

        frag = decode_chunk(x)
        if frag.keys.shape[:2] != (len(frag.layer_indices), frag.span):
            raise Crash(f"chunk of shape {frag.keys.shape} accepted")
        return True


class WorkloadTarget(Target):
    """JSONL workload files, written to disk and read by `load_jsonl`."""

    def setup(self) -> None:
        from edgekv.errors import ConfigError

        self.clean = (ConfigError,)
        self.clean_doc = "ConfigError"
        self.seeds = [p.read_bytes() for p in self._files("workload", "*.jsonl")]
        self.seed_note = _note(self.corpus, "workload")
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self._tmp = Path(tempfile.mkdtemp(prefix="edgekv-fuzz-jsonl-", dir=base))
        self.path = self._tmp / "workload.jsonl"

    def generate(self, rng: random.Random) -> bytes:
        seed = rng.choice(self.seeds)
        r = rng.random()
        if r < 0.4:
            return mutate_bytes(rng, seed, self.seeds)
        lines = seed.split(b"\n")
        i = rng.randrange(len(lines))
        if r < 0.85 and lines[i].strip():
            try:
                lines[i] = dumps_json(rng, mutate_json(rng, json.loads(lines[i])))
            except ValueError:
                lines[i] = mutate_bytes(rng, lines[i])
        else:
            lines.insert(i, rng.choice((b"", b"\r", b"\xef\xbb\xbf{}",
                                        b'{"prompt": "a\xe2\x80\xa8b"}',
                                        b'{"prompt": "\\ud800"}', b'{"prompt": 1}', b"\xff\xfe",
                                        b'{"prompt": "x", "max_tokens": true}',
                                        b'{"prompt": "x", "max_tokens": 1e400}', b"[]", b"null")))
        return b"\n".join(lines)

    def run(self, x: bytes) -> bool:
        from edgekv_bench.workload import load_jsonl

        self.path.write_bytes(x)
        reqs = load_jsonl(self.path)
        for r in reqs:
            if (not isinstance(r.prompt, str) or not r.prompt or type(r.max_tokens) is not int
                    or r.max_tokens < 1):
                raise Crash(f"request {r.prompt!r:.40} / max_tokens {r.max_tokens!r} accepted")
            r.prompt.encode("utf-8")  # a lone surrogate would fail here, in the tokenizer
        return True

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)


@dataclass(frozen=True)
class _HttpInput:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    auth: str  # "fresh" (validly signed now), "none", "bad"
    parts: int = 1


def _http_seeds(corpus: Path, sub: str) -> list[dict[str, Any]]:
    out = []
    for p in sorted((corpus / sub).glob("*.json")):
        if p.name == "SOURCE.json":
            continue
        d = json.loads(p.read_text())
        d["body"] = base64.b64decode(d.pop("body_b64"))
        out.append(d)
    if not out:
        raise FileNotFoundError(f"no seeds in {corpus / sub}; build the corpus first")
    return out


def _mutate_body(rng: random.Random, body: bytes, others: Sequence[bytes]) -> bytes:
    r = rng.random()
    if r < 0.25 or not body:
        return mutate_bytes(rng, body, others, max_len=2 << 20)
    try:
        obj = json.loads(body)
    except ValueError:
        return mutate_bytes(rng, body, others)
    if r < 0.3:  # twice over, or just over 1 MiB (the KV server's size limit)
        text = dumps_json(rng, obj)
        return text * rng.choice((2, (1 << 20) // max(1, len(text)) + 1))
    return dumps_json(rng, mutate_json(rng, obj))


class KVHttpTarget(Target):
    """The KV server's ASGI app (fake engine, RAM store): recorded requests with mutated bodies
    (re-signed, so the mutation reaches the handlers), garbled, missing, replayed or foreign
    authentication, unknown paths and methods. Clean: any 4xx; a 200 is a crash unless the
    request was validly signed (or needs no signature)."""

    PUBLIC = {("GET", "/v1/info"), ("POST", "/v1/session")}

    def setup(self) -> None:
        from edgekv.config import CacheConfig
        from edgekv.core.pipeline import EdgeKV
        from edgekv.engines.fake import FakeAdapter
        from edgekv.kvserver.server import KVServer
        from edgekv.store.memory import MemoryStore

        self.clean_doc = "an answer of 400, 401, 403, 404, 413 or 501 (unknown method)"
        self.seeds = _http_seeds(self.corpus, "kv_http")
        self.bodies = [s["body"] for s in self.seeds]
        self.seed_note = _note(self.corpus, "kv_http")
        self._tmp = Path(tempfile.mkdtemp(prefix="edgekv-fuzz-kv-"))
        cfg = CacheConfig(chunk_size=64, cache_dir=self._tmp, reuse_granularity="chunk")
        self.store = MemoryStore(64 << 20)
        self.kv = EdgeKV(FakeAdapter(n_ctx=1024), self.store, cfg)
        self.server = KVServer(self.store, SECRET, fingerprint=self.kv.fingerprint,
                               model="fake", chunk_size=64, engine=self.kv)
        self.driver = AsgiDriver(self.server.app)
        self.seq = 0
        self.old: list[_HttpInput] = []  # validly signed requests already sent (replays)
        self._open()
        # chunks to ask for: the recorded prompt's, precomputed here
        for s in self.seeds:
            if s["path"] == "/v1/precompute":
                self._send(self._signed("POST", "/v1/precompute", s["body"]))

    def _open(self) -> None:
        from edgekv.stream.codec import derive_session_keys
        from edgekv.stream.protocol import open_proof

        nonce = os.urandom(16)
        body = json.dumps({"client_nonce": nonce.hex(), "tenant": "", "fingerprint": "",
                           "proof": open_proof(SECRET, "", nonce, "").hex()}).encode()
        status, out = self.driver.request("POST", "/v1/session", [], body)
        r = json.loads(out)
        self.sid = r["session"]
        self.mac_key = derive_session_keys(SECRET, nonce, bytes.fromhex(r["server_nonce"]))[1]
        self.seq = 0

    def _signed(self, method: str, path: str, body: bytes,
                headers: tuple[tuple[str, str], ...] = ()) -> _HttpInput:
        from edgekv.stream.protocol import auth_header, request_mac

        self.seq += 1
        h = auth_header(self.sid, self.seq, request_mac(self.mac_key, method, path, self.seq,
                                                         body))
        return _HttpInput(method, path, (*headers, ("authorization", h)), body, "fresh")

    def _send(self, x: _HttpInput) -> tuple[int, bytes]:
        hdrs = (("content-type", "application/json"), ("content-length", str(len(x.body))),
                *x.headers)
        return self.driver.request(x.method, x.path, hdrs, x.body, x.parts)

    def generate(self, rng: random.Random) -> _HttpInput:
        from edgekv.stream.protocol import AUTH_SCHEME

        s = rng.choice(self.seeds)
        method, path, body = s["method"], s["path"], s["body"]
        if rng.random() < 0.7:
            body = _mutate_body(rng, body, self.bodies)
        if rng.random() < 0.05:
            method = rng.choice(("GET", "PUT", "DELETE", "PATCH", "POST"))
        if rng.random() < 0.05:
            path = rng.choice(("/", "/v1", "/v1/chunks/", "/v1/has?x=1", "/v1/../v1/has",
                               "/v1/%00", "/" + "a" * 5000, "/v1/info", "/v1/session"))
        parts = rng.choice((1, 1, 1, 2, 7))
        if (method, path) in self.PUBLIC:
            return _HttpInput(method, path, (), body, "none", parts)
        r = rng.random()
        if r < 0.6:  # signed now, over the mutated body: reaches the handler
            return self._remember(rng, self._signed(method, path, body), parts)
        if r < 0.68 and self.old:  # an old request, replayed byte for byte
            old = rng.choice(self.old)
            return _HttpInput(old.method, old.path, old.headers, old.body, "bad", parts)
        if r < 0.76:
            return _HttpInput(method, path, (), body, "none", parts)
        x = self._signed(method, path, body)
        h = x.headers[-1][1]
        g = rng.randrange(7)
        if g == 0:
            h = h[: rng.randrange(len(h))]
        elif g == 1:
            i = rng.randrange(len(AUTH_SCHEME) + 1, len(h))
            h = h[:i] + rng.choice([c for c in "0123456789abcdefg:Z " if c != h[i]]) + h[i + 1:]
        elif g == 2:
            h = h.replace(AUTH_SCHEME, rng.choice(("Bearer", "Basic", "edgekv-hmac-sha256")))
        elif g == 3:
            h = h.replace(self.sid, os.urandom(16).hex())
        elif g == 4:
            h = h + rng.choice((":1", ",x", ":", "0"))  # (trailing blanks are no change)
        elif g == 5:
            h = rng.choice(("", " ", AUTH_SCHEME, f"{AUTH_SCHEME} ::", "x" * 9000))
        else:  # a valid header for another body
            return _HttpInput(method, path, x.headers, body + b" ", "bad", parts)
        return _HttpInput(method, path, (("authorization", h),), body, "bad", parts)

    def _remember(self, rng: random.Random, x: _HttpInput, parts: int) -> _HttpInput:
        x = _HttpInput(x.method, x.path, x.headers, x.body, x.auth, parts)
        if len(self.old) < 64:
            self.old.append(x)
        elif rng.random() < 0.05:
            self.old[rng.randrange(64)] = x
        return x

    def run(self, x: _HttpInput) -> bool:
        status, out = self._send(x)
        if status >= 500 and status != 501:  # 501: a method the protocol does not have
            raise Crash(f"{x.method} {x.path[:40]} answered {status}: {out[:120]!r}")
        if status == 403 and x.auth == "fresh" and b"session" in out:
            self._open()  # our session went (the fuzz opened thousands): a new one
            return False
        if status == 200 and (x.method, x.path) not in self.PUBLIC and x.auth != "fresh":
            raise Crash(f"{x.method} {x.path} served without valid authentication")
        if status == 401 and x.auth == "fresh":
            raise Crash(f"a validly signed request was refused: {out[:120]!r}")
        return status == 200

    def close(self) -> None:
        self.driver.close()
        self.server.shutdown()
        shutil.rmtree(self._tmp, ignore_errors=True)


class ServeHttpTarget(Target):
    """`edgekv serve`'s ASGI app over the fake engine (with a chat template and an API key):
    recorded OpenAI request bodies, mutated; garbled or missing keys; other paths. Clean: any
    4xx (429 included); a 5xx, an exception or a 200 without the key is a crash."""

    def setup(self) -> None:
        from edgekv.config import CacheConfig
        from edgekv.core.pipeline import EdgeKV
        from edgekv.engines.fake import FakeAdapter
        from edgekv.serve import ServeOptions, create_app
        from edgekv.store.memory import MemoryStore

        class ChatFake(FakeAdapter):
            def chat_template(self) -> str:
                return CHATML

        self.clean_doc = "an answer of 400, 401, 404, 405, 413 or 429"
        self.seeds = _http_seeds(self.corpus, "serve_http")
        self.bodies = [s["body"] for s in self.seeds]
        self.seed_note = _note(self.corpus, "serve_http")
        self._tmp = Path(tempfile.mkdtemp(prefix="edgekv-fuzz-serve-"))
        cfg = CacheConfig(chunk_size=64, cache_dir=self._tmp, reuse_granularity="chunk")
        self.kv = EdgeKV(ChatFake(n_ctx=256), MemoryStore(32 << 20), cfg)
        app = create_app(self.kv, model_id="fake-model",
                         options=ServeOptions(api_keys=(API_KEY,)))
        self.driver = AsgiDriver(app, lifespan=True)
        ready = app.state.server.scheduler.ready
        if not ready.wait(30):
            raise RuntimeError("the serve app did not become ready")

    def generate(self, rng: random.Random) -> _HttpInput:
        s = rng.choice(self.seeds)
        method, path, body = s["method"], s["path"], s["body"]
        if rng.random() < 0.75:
            body = _mutate_body(rng, body, self.bodies)
        if rng.random() < 0.05:
            method = rng.choice(("GET", "PUT", "DELETE", "POST"))
        if rng.random() < 0.05:
            path = rng.choice(("/", "/v1", "/v1/models/" + "x" * 300, "/v1/models/default",
                               "/v1/chat/completions/", "/health", "/metrics", "/v1/embeddings"))
        r = rng.random()
        good = ("authorization", f"Bearer {API_KEY}")
        if r < 0.8:
            return _HttpInput(method, path, (good,), body, "fresh", rng.choice((1, 1, 3)))
        bad = rng.choice(("", "Bearer", "Bearer ", f"Bearer {API_KEY}x", f"bearer {API_KEY[:-1]}",
                          f"Basic {API_KEY}", "Bearer " + "k" * 8000, f"Bearer  {API_KEY} x"))
        return _HttpInput(method, path, (("authorization", bad),) if bad else (), body, "bad")

    def run(self, x: _HttpInput) -> bool:
        hdrs = (("content-type", "application/json"), ("content-length", str(len(x.body))),
                *x.headers)
        status, out = self.driver.request(x.method, x.path, hdrs, x.body, x.parts)
        if status >= 500:
            raise Crash(f"{x.method} {x.path[:40]} answered {status}: {out[:160]!r}")
        open_paths = x.path in ("/health", "/metrics")
        if status == 200 and x.auth != "fresh" and not open_paths:
            raise Crash(f"{x.method} {x.path} served without a valid API key")
        return status == 200

    def close(self) -> None:
        self.driver.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


class _SelfTest(Target):
    """Checks the watchdog: input 7 hangs, input 23 kills its worker, the rest alternate
    between accepted and a clean error."""

    def setup(self) -> None:
        self.clean, self.clean_doc, self.seeds = (ValueError,), "ValueError", [b""]

    def generate(self, rng: random.Random) -> int:
        return self.index

    def run(self, x: int) -> bool:
        if x == 7:
            time.sleep(3600)
        if x == 23:
            os.kill(os.getpid(), 9)
        if x % 2:
            raise ValueError("odd")
        return True


_CLASSES: dict[str, type[Target]] = {
    "fragment": FragmentTarget, "state_blob": StateBlobTarget, "wire": WireTarget,
    "chunk": ChunkTarget, "workload": WorkloadTarget, "kv_http": KVHttpTarget,
    "serve_http": ServeHttpTarget, "_selftest": _SelfTest,
}


def make_target(name: str, corpus: Path) -> Target:
    """Target `name` over the seeds in `corpus`, set up and ready to `generate` and `run`."""
    if name not in _CLASSES:  # (_selftest is no target: it checks the watchdog)
        raise ValueError(f"unknown fuzz target {name!r}; choose from {', '.join(TARGETS)}")
    t = _CLASSES[name](name, Path(corpus))
    t.setup()
    return t


def input_rng(seed: int, target: str, i: int) -> random.Random:
    return random.Random(f"edgekv-fuzz:{seed}:{target}:{i}")


# -- one input, classified ------------------------------------------------------------------

def _signature(e: BaseException) -> str:
    """Type and the innermost edgekv frame: one signature per bug, not per input."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "edgekv" in f.filename and "edgekv_harness" not in f.filename]
    pick = ours or list(frames)
    where = f"{Path(pick[-1].filename).name}:{pick[-1].lineno}" if pick else "?"
    return f"{type(e).__name__} at {where}"


def classify(target: Target, x: Any) -> tuple[str, str | None]:
    """("accepted" | "clean" | "crash", crash signature)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a decoder that warns on hostile input is sloppy
            return ("accepted" if target.run(x) else "clean"), None
    except Crash as e:
        return "crash", f"contract: {str(e)[:120]}"
    except RecursionError as e:
        return "crash", _signature(e)
    except Exception as e:  # noqa: BLE001 - the point: anything not clean is a finding
        if target.clean_error(e):
            return "clean", None
        return "crash", _signature(e)
    except BaseException as e:  # noqa: BLE001 - MemoryError is an Exception; SystemExit etc.
        return "crash", _signature(e)


@dataclass
class Tally:
    inputs: int = 0
    accepted: int = 0
    clean: int = 0
    crashes: int = 0
    hangs: int = 0
    crash_kinds: dict[str, int] = field(default_factory=dict)
    crash_inputs: dict[str, list[int]] = field(default_factory=dict)
    hang_inputs: list[int] = field(default_factory=list)
    slowest_s: float = 0.0

    def add(self, i: int, outcome: str, sig: str | None, seconds: float) -> None:
        self.inputs += 1
        self.slowest_s = max(self.slowest_s, seconds)
        if outcome == "accepted":
            self.accepted += 1
        elif outcome == "clean":
            self.clean += 1
        else:
            self.crashes += 1
            assert sig is not None
            self.crash_kinds[sig] = self.crash_kinds.get(sig, 0) + 1
            seen = self.crash_inputs.setdefault(sig, [])
            if len(seen) < 5:
                seen.append(i)

    def merge(self, other: Tally) -> None:
        self.inputs += other.inputs
        self.accepted += other.accepted
        self.clean += other.clean
        self.crashes += other.crashes
        self.hangs += other.hangs
        self.slowest_s = max(self.slowest_s, other.slowest_s)
        self.hang_inputs += other.hang_inputs
        for k, v in other.crash_kinds.items():
            self.crash_kinds[k] = self.crash_kinds.get(k, 0) + v
            self.crash_inputs.setdefault(k, []).extend(other.crash_inputs.get(k, []))


def run_target_inline(target: Target, inputs: int, *, seed: int = 0, start: int = 0,
                      hang_s: float = HANG_S) -> Tally:
    """Fuzz `target` in this process (the fast tests): an input over `hang_s` counts as a
    hang once it returns (a real hang would stop the caller: `run_fuzz` guards with a
    child process)."""
    import logging

    t = Tally()
    # refusals log a warning per input by design; silenced here only, and put back after (a
    # level left on the shared logger would hide later callers' warnings)
    store_log = logging.getLogger("edgekv.store")
    level = store_log.level
    store_log.setLevel(logging.CRITICAL)
    try:
        for i in range(start, start + inputs):
            target.index = i
            x = target.generate(input_rng(seed, target.name, i))
            t0 = time.perf_counter()
            outcome, sig = classify(target, x)
            dt = time.perf_counter() - t0
            t.add(i, outcome, sig, dt)
            if dt > hang_s:
                t.hangs += 1
                t.hang_inputs.append(i)
    finally:
        store_log.setLevel(level)
    return t


def replay(name: str, corpus: Path, i: int, seed: int = 0) -> tuple[Any, str, str | None]:
    """Input `i` of target `name` again, and what it does now (to debug a finding)."""
    t = make_target(name, corpus)
    try:
        t.index = i
        x = t.generate(input_rng(seed, name, i))
        return (x, *classify(t, x))
    finally:
        t.close()


# -- the worker process and its watchdog ----------------------------------------------------

def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _worker(name: str, corpus: str, seed: int, start: int, stop: int, skip: list[int],
            conn: Any, beat: Any) -> None:
    """Child: set up `name`, warm up on the seeds, cap the address space, then run inputs
    [start, stop) except `skip`, reporting a cumulative `Tally` every `SNAPSHOT_EVERY`."""
    import logging

    logging.disable(logging.CRITICAL)  # refusals log warnings by design; the tally counts
    target = make_target(name, Path(corpus))
    for k in range(min(len(target.seeds), 8)):  # warm-up: lazy imports, thread pools
        target.index = -1 - k
        classify(target, target.generate(input_rng(seed, name, target.index)))
    limit = _vm_bytes() + MEMORY_MARGIN
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    t = Tally()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    skipped = set(skip)
    last = time.monotonic()
    for i in range(start, stop):
        if i in skipped:
            continue
        target.index = i
        x = target.generate(input_rng(seed, name, i))
        beat[0], beat[1] = i, time.monotonic()
        t0 = time.perf_counter()
        outcome, sig = classify(target, x)
        dt = time.perf_counter() - t0
        beat[1] = 0.0
        t.add(i, outcome, sig, dt)
        if (i - start) % SNAPSHOT_EVERY == 0 or time.monotonic() - last > 2:
            last = time.monotonic()
            conn.send(("progress", i + 1, t))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = {"peak_rss_mb": round(rss / 1024, 1), "warm_rss_mb": round(rss0 / 1024, 1),
            "rss_limit_mb": round(limit / 2**20), "seed_corpus": target.seed_note,
            "clean": target.clean_doc, "seeds": len(target.seeds)}
    with contextlib.suppress(Exception):
        target.close()
    conn.send(("done", stop, t, info))


def _fuzz_one(name: str, corpus: Path, inputs: int, seed: int, hang_s: float,
              progress: Callable[[str], None] | None) -> dict[str, Any]:
    """Run target `name` in child processes under a watchdog; its row."""
    ctx = multiprocessing.get_context("spawn")
    total = Tally()
    info: dict[str, Any] = {}
    start, skip = 0, list[int]()
    t0 = time.monotonic()
    restarts = 0
    peak = 0.0
    while start < inputs:
        beat = ctx.Array("d", [-1.0, 0.0], lock=False)
        parent, child = ctx.Pipe(duplex=False)
        env = {"MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            proc = ctx.Process(target=_worker, args=(name, str(corpus), seed, start, inputs,
                                                      skip, child, beat), daemon=True)
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        snap_at, snap = start, Tally()
        finished = False
        hung_at: int | None = None
        shown = time.monotonic()
        while True:
            while parent.poll():
                try:
                    msg = parent.recv()
                except EOFError:
                    break
                snap_at, snap = msg[1], msg[2]
                if msg[0] == "done":
                    info = msg[3]
                    finished = True
            if finished or not proc.is_alive():
                break
            began = beat[1]
            if began and time.monotonic() - began > hang_s:
                hung_at = int(beat[0])
                proc.kill()
                break
            if progress and time.monotonic() - shown > 10:
                shown = time.monotonic()
                progress(f"{name}: {total.inputs + snap.inputs}/{inputs} inputs, "
                         f"{total.crashes + snap.crashes} crashes, {total.hangs} hangs")
            time.sleep(0.05)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        while not finished and parent.poll():  # a last report sent just before the end
            try:
                msg = parent.recv()
            except EOFError:
                break
            snap_at, snap = msg[1], msg[2]
            if msg[0] == "done":
                info, finished = msg[3], True
        parent.close()
        total.merge(snap)
        if finished:
            peak = max(peak, float(info.get("peak_rss_mb", 0)))
            break
        # killed (a hang) or died (a signal, or the setup failed): the input in flight is
        # recorded and skipped, the inputs after the last report are run again
        restarts += 1
        at = hung_at if hung_at is not None else int(beat[0])
        if at < 0:
            raise RuntimeError(f"fuzz worker for {name} died before its first input "
                               f"(exit code {proc.exitcode})")
        if hung_at is not None:
            total.hangs += 1
            total.hang_inputs.append(at)
        else:
            total.add(at, "crash", f"worker died (exit code {proc.exitcode})", 0.0)
        skip = sorted({*skip, at})
        start = snap_at  # inputs before it are in `total`; from it on they run again
        if restarts > 50:
            raise RuntimeError(f"fuzz target {name}: over 50 hangs or worker deaths")
    row = {"target": name, "inputs": total.inputs + total.hangs, "crashes": total.crashes,
           "hangs": total.hangs, "peak_rss_mb": peak, "clean_errors": total.clean,
           "accepted": total.accepted, "seconds": round(time.monotonic() - t0, 1),
           "slowest_input_s": round(total.slowest_s, 3), "seed_corpus": info.get("seed_corpus"),
           "seeds": info.get("seeds"), "clean": info.get("clean"),
           "warm_rss_mb": info.get("warm_rss_mb"), "rss_limit_mb": info.get("rss_limit_mb"),
           "crash_kinds": total.crash_kinds,
           "crash_inputs": {k: v[:5] for k, v in total.crash_inputs.items()},
           "hang_inputs": total.hang_inputs[:20], "worker_restarts": restarts}
    return row


# -- the seed corpus ------------------------------------------------------------------------

class _Recorder:
    """A loopback TCP proxy that records each connection's bytes, both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[tuple[bytearray, bytearray]] = []
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            rec = (bytearray(), bytearray())
            self.conns.append(rec)
            s = socket.create_connection(self.target)
            self._socks += [c, s]
            for src, dst, buf in ((c, s, rec[0]), (s, c, rec[1])):
                t = threading.Thread(target=self._pump, args=(src, dst, buf), daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, buf: bytearray) -> None:
        forward = True
        try:
            while data := src.recv(65536):
                buf += data
                if forward:
                    try:
                        dst.sendall(data)
                    except OSError:  # the reader left (after its last frame): keep recording
                        forward = False
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> list[tuple[bytes, bytes]]:
        self.sock.close()
        for t in self._threads:
            t.join(10)
        for s in self._socks:
            s.close()
        return [(bytes(a), bytes(b)) for a, b in self.conns]


def _parse_exchange(req: bytes, resp: bytes) -> tuple[dict[str, Any], int, bytes]:
    """(request: method, path, headers, body), response status, response body (de-chunked)."""
    import h11

    server = h11.Connection(h11.SERVER)
    server.receive_data(req)
    server.receive_data(b"")
    request, body = None, b""
    while True:
        ev = server.next_event()
        if isinstance(ev, h11.Request):
            request = ev
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif ev in (h11.NEED_DATA, h11.PAUSED) or isinstance(ev, (h11.EndOfMessage,
                                                                    h11.ConnectionClosed)):
            break
    assert request is not None
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=request.method, target=request.target,
                            headers=request.headers))
    client.send(h11.EndOfMessage()) if not body else client.send(h11.Data(data=body))
    if body:
        client.send(h11.EndOfMessage())
    client.receive_data(resp)
    client.receive_data(b"")
    status, out = 0, b""
    while True:
        try:
            ev = client.next_event()
        except h11.RemoteProtocolError:  # the client hung up after its last frame
            break
        if isinstance(ev, h11.Response):
            status = ev.status_code
        elif isinstance(ev, h11.Data):
            out += ev.data
        elif ev in (h11.NEED_DATA, h11.PAUSED) or isinstance(ev, (h11.EndOfMessage,
                                                                    h11.ConnectionClosed)):
            break
    headers = [(k.decode(), v.decode("latin-1")) for k, v in request.headers]
    return ({"method": request.method.decode(), "path": request.target.decode(),
             "headers": headers, "body": body}, status, out)


def _record_kv_traffic(out: Path, engine: Any, store: Any, name: str, prompt: Sequence[int],
                       chunk_size: int) -> None:
    """Real client/server traffic through a recording proxy: precompute, availability, chunk
    streams (several requests and two sessions over the same chunks, every codec, missing
    keys), and the requests a tenant and a wrong secret make."""
    from edgekv.kvserver.server import KVServer
    from edgekv.stream.client import KVClient
    from edgekv.stream.codec import derive_session_keys
    from edgekv.stream.protocol import tenant_secret

    srv = KVServer(store, SECRET, fingerprint=engine.fingerprint, model=name,
                   chunk_size=chunk_size, engine=engine)
    srv.start_background()
    rec = _Recorder(srv.address)
    url = f"http://127.0.0.1:{rec.port}"
    try:
        c = KVClient(url, SECRET, timeout_s=120)
        c.info()
        keys = c.precompute(prompt)["keys"]
        c.has(keys + ["0" * 64])
        for codec in ("f16", "f16", "int8", "int4"):
            list(c.stream(keys[:2] + ["f" * 64], codec))
        c2 = KVClient(url, SECRET, timeout_s=120, fingerprint=engine.fingerprint)
        list(c2.stream(keys[:2]))
        list(c2.stream(keys[1:3] if len(keys) > 2 else keys[:1]))
        t = KVClient(url, tenant_secret(SECRET, "tenant-b"), tenant="tenant-b", timeout_s=120)
        list(t.stream(keys[:1]))
        t.has(keys[:1])
        with contextlib.suppress(Exception):
            KVClient(url, b"wrong" * 8, timeout_s=30).has(keys[:1])
    finally:
        conns = rec.close()
        srv.shutdown()
    (out / "kv_http").mkdir(parents=True, exist_ok=True)
    (out / "wire").mkdir(parents=True, exist_ok=True)
    sessions: dict[str, bytes] = {}  # session id -> AES key, from the recorded opens
    secrets_by_tenant = {"": SECRET, "tenant-b": tenant_secret(SECRET, "tenant-b")}
    for n, (req, resp) in enumerate(conns):
        if not req:
            continue
        r, status, body = _parse_exchange(req, resp)
        (out / "kv_http" / f"{name}-{n:03d}.json").write_text(json.dumps(
            {"method": r["method"], "path": r["path"],
             "body_b64": base64.b64encode(r["body"]).decode()}))
        if r["path"] == "/v1/session" and status == 200:
            q, a = json.loads(r["body"]), json.loads(body)
            secret = secrets_by_tenant.get(q.get("tenant", ""))
            if secret is not None:
                sessions[a["session"]] = derive_session_keys(
                    secret, bytes.fromhex(q["client_nonce"]), bytes.fromhex(a["server_nonce"]))[0]
        if r["path"] == "/v1/chunks" and status == 200:
            auth = dict(r["headers"])["authorization"].split(" ", 1)[1].split(":")
            if auth[0] not in sessions:
                continue
            (out / "wire" / f"{name}-{n:03d}.bin").write_bytes(body)
            (out / "wire" / f"{name}-{n:03d}.json").write_text(json.dumps(
                {"session": auth[0], "seq": int(auth[1]),
                 "keys": json.loads(r["body"])["keys"], "enc_key": sessions[auth[0]].hex()}))


def _serve_requests() -> list[dict[str, Any]]:
    sys_msg: dict[str, Any] = {"role": "system", "content": "You are the hub's assistant. " * 4}
    chats = [
        {"model": "fake-model", "temperature": 0, "max_tokens": 4,
         "messages": [sys_msg, {"role": "user", "content": "How do lights pair?"}]},
        {"model": "fake-model", "temperature": 0.7, "top_p": 0.9, "seed": 7, "stream": True,
         "stream_options": {"include_usage": True}, "max_completion_tokens": 3,
         "stop": ["\n", "User:"], "cache_salt": "tenant-1", "user": "u1",
         "messages": [sys_msg, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                      {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "What about thermostats?", "name": "bob"}]},
        {"model": "default", "messages": [{"role": "developer", "content": "Be brief."},
                                          {"role": "user", "content": "ok"}],
         "max_tokens": 2, "frequency_penalty": 0, "logprobs": False, "tools": [], "n": 1,
         "metadata": {"k": "v"}, "response_format": {"type": "text"}},
    ]
    comps = [
        {"model": "fake-model", "prompt": "The hub's ring light", "max_tokens": 3,
         "temperature": 0},
        {"model": "fake-model", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "stream": True},
        {"model": "fake-model", "prompt": ["one prompt"], "max_tokens": 2, "echo": False},
        {"model": "fake-model", "prompt": [[5, 6, 7]], "max_tokens": 1, "seed": 3,
         "suffix": "", "best_of": 1},
    ]
    out: list[dict[str, Any]] = [{"method": "POST", "path": "/v1/chat/completions", "body": c}
                                 for c in chats]
    out += [{"method": "POST", "path": "/v1/completions", "body": c} for c in comps]
    out += [{"method": "GET", "path": p, "body": None}
            for p in ("/v1/models", "/v1/models/fake-model", "/health")]
    return out


def _source(out: Path, sub: str, text: str) -> None:
    (out / sub).mkdir(parents=True, exist_ok=True)
    (out / sub / "SOURCE.json").write_text(json.dumps({"source": text}))


def build_corpus(out: Path, *, real: bool = True, model: str | None = None,
                 light: bool = False, adapter: Any = None) -> dict[str, str]:
    """Write the seed corpus under `out` from real files: fragment files a DiskStore wrote,
    sequence-state blobs from llama.cpp, chunk plaintexts, recorded KV traffic, workloads and
    serve requests. `real=False` (or no llama.cpp): the fake engine's files only. `light`
    (the tests): of the real engine only a few fragments and state blobs, no recorded
    traffic; `adapter`: a LlamaCppAdapter to use (left open) instead of loading one."""
    import numpy as np

    from edgekv.config import CacheConfig
    from edgekv.core.pipeline import EdgeKV
    from edgekv.engines.fake import FakeAdapter
    from edgekv.serial import decode_fragment
    from edgekv.store import open_store
    from edgekv.store.memory import MemoryStore
    from edgekv.stream.codec import LEVELS, encode_chunk
    from edgekv_bench.texts import MANUAL, QUESTIONS, SYSTEM_PROMPT
    from edgekv_bench.workload import chat_workload, seed_workload

    out.mkdir(parents=True, exist_ok=True)
    for sub in ("fragment", "state_blob", "chunk"):
        (out / sub).mkdir(exist_ok=True)
    notes: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="edgekv-fuzz-corpus-"))
    frags: list[Any] = []

    def store_files(cfg: CacheConfig, tag: str, limit: int) -> list[Path]:
        files = sorted((cfg.cache_dir / "store" / "fragments").glob("*/*.ekv"))
        files = sorted(files, key=lambda p: p.stat().st_size)[:limit]
        for i, p in enumerate(files):
            shutil.copy(p, out / "fragment" / f"{tag}-{i:02d}.ekv")
            frags.append(decode_fragment(p.read_bytes()))
        return files

    try:
        # -- the fake engine: small files, every layout -----------------------------------
        # token ids inside the fake vocabulary (1..256): the kv-server checks them
        fake_prompt = [1 + i % 256 for i in range(64 * 4 + 5)]
        for lpf in (0, 3):
            cfg = CacheConfig(chunk_size=64, cache_dir=work / f"fake{lpf}",
                              layers_per_fragment=lpf, reuse_granularity="chunk")
            kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
            kv.generate(fake_prompt, max_tokens=1)
            kv.generate(fake_prompt[:130] + [9] * 70, max_tokens=1, salt="tenant-a")
            kv.store.close()
            store_files(cfg, f"fake-lpf{lpf}", 6)
        fake_kv = EdgeKV(FakeAdapter(), MemoryStore(64 << 20), CacheConfig(
            chunk_size=64, cache_dir=work / "fake-srv", reuse_granularity="chunk"))
        _record_kv_traffic(out, fake_kv, fake_kv.store, "fake", fake_prompt, 64)
        sources = {"fragment": "fragment files a DiskStore wrote (fake engine",
                   "state_blob": "", "chunk": "encode_chunk of those fragments, every level "
                   "(fake engine", "wire": "recorded KVClient/KVServer traffic (fake engine",
                   "kv_http": "recorded KVClient requests (fake engine"}
        # -- the real engine: SmolLM2 through llama.cpp -------------------------------------
        have_real, own_adapter = adapter is not None, adapter is None
        if real and adapter is None:
            try:
                from edgekv.engines.llamacpp import LlamaCppAdapter

                adapter = LlamaCppAdapter(model, n_ctx=1024)
                have_real = True
            except Exception as e:  # noqa: BLE001 - no llama.cpp or no model: fake seeds only
                notes["real_engine"] = f"unavailable: {e}"
        if have_real:
            fp = adapter.fingerprint
            text = SYSTEM_PROMPT + "\n\n" + MANUAL
            ids = adapter.tokenize(text)[:200]
            for lpf in (6,) if light else (6, 0):
                cfg = CacheConfig(chunk_size=64, cache_dir=work / f"real{lpf}",
                                  layers_per_fragment=lpf, reuse_granularity="chunk")
                kv = EdgeKV(adapter, open_store(cfg), cfg)
                kv.generate(ids[: 64 * (1 if light else 2) + 3], max_tokens=1)
                kv.store.close()
                store_files(cfg, f"smollm2-lpf{lpf}", 2 if light else 4 if lpf else 1)
            lengths = (3, 17) if light else (3, 17, 64)
            for n in lengths:
                adapter.clear_kv_cache()
                adapter.prefill(ids[:n], align=n)
                (out / "state_blob" / f"smollm2-{n}tok.bin").write_bytes(
                    adapter.read_state_blob())
            adapter.clear_kv_cache()
            (out / "state_blob" / "meta.json").write_text(json.dumps(
                {"n_layer": fp.n_layer, "n_embd_k": fp.n_embd_k, "n_embd_v": fp.n_embd_v,
                 "model": adapter.model_path.name}))
            if not light:
                cfg = CacheConfig(chunk_size=64, cache_dir=work / "real-srv",
                                  layers_per_fragment=10, reuse_granularity="chunk")
                real_kv = EdgeKV(adapter, open_store(cfg), cfg)
                q = adapter.tokenize("\nQuestion: " + QUESTIONS[0] + "\nAnswer:",
                                     add_bos=False)
                _record_kv_traffic(out, real_kv, real_kv.store, "smollm2", ids[:130] + q, 64)
                real_kv.store.close()
            if own_adapter:
                adapter.close()
            for k in ("fragment", "chunk") if light else sources:
                sources[k] += f" and the real engine, {adapter.model_path.name} via llama.cpp"
            sources["state_blob"] = (f"llama_state_seq_get_data of {adapter.model_path.name} "
                                     f"(llama.cpp) holding {', '.join(map(str, lengths))} "
                                     "tokens")
        else:
            # no llama.cpp: a blob in llama.cpp's layout, assembled (the parser's own writer)
            from edgekv.engines.llamacpp_state import assemble_seq_state

            rng = np.random.default_rng(0)
            for n in (3, 17):
                kk = rng.standard_normal((4, n, 8)).astype(np.float16)
                vv = rng.standard_normal((4, n, 8)).astype(np.float16)
                (out / "state_blob" / f"synthetic-{n}tok.bin").write_bytes(
                    bytes(assemble_seq_state(kk, vv, v_trans=n == 3)))
            (out / "state_blob" / "meta.json").write_text(json.dumps(
                {"n_layer": 4, "n_embd_k": 8, "n_embd_v": 8, "model": "synthetic"}))
            sources["state_blob"] = "assembled blobs in llama.cpp's layout (no llama.cpp here"
        for k in sources:
            if sources[k].count("(") > sources[k].count(")"):
                sources[k] += ")"
        # -- chunk plaintexts ---------------------------------------------------------------
        small = sorted(frags, key=lambda f: f.keys.nbytes)
        picks = small[:4] + small[-2:] if len(small) > 6 else small
        for i, f in enumerate(picks):
            for level in LEVELS:
                (out / "chunk" / f"{i:02d}-{level}.zst").write_bytes(encode_chunk(f, level))
        # -- workloads (JSONL) ----------------------------------------------------------------
        wl = out / "workload"
        wl.mkdir(exist_ok=True)
        for name, reqs in (("seed", seed_workload(12, seed=1)), ("chat", chat_workload(8))):
            lines = [json.dumps({"prompt": "\n".join(c for _, c in r.messages or ()),
                                 "cluster": r.cluster, "max_tokens": r.max_tokens})
                     for r in reqs]
            (wl / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        (wl / "minimal.jsonl").write_text('{"prompt": "Hello"}\n\n{"prompt": "Bye", '
                                          '"max_tokens": 3}\n')
        sources["workload"] = "JSONL files of the seed and chat workloads' requests"
        # -- serve requests -----------------------------------------------------------------
        sv = out / "serve_http"
        sv.mkdir(exist_ok=True)
        for i, r in enumerate(_serve_requests()):
            body = b"" if r["body"] is None else json.dumps(r["body"]).encode()
            (sv / f"{i:02d}.json").write_text(json.dumps(
                {"method": r["method"], "path": r["path"],
                 "body_b64": base64.b64encode(body).decode()}))
        sources["serve_http"] = ("OpenAI chat/completions request bodies as the serve tests "
                                 "send them")
        for k, v in sources.items():
            _source(out, k, v)
        notes.update(sources)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return notes


def _corpus_main(out: str, real: bool, model: str | None, conn: Any) -> None:
    try:
        conn.send(("ok", build_corpus(Path(out), real=real, model=model)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", "".join(traceback.format_exception(e))))


def build_corpus_isolated(out: Path, *, real: bool = True,
                          model: str | None = None) -> dict[str, str]:
    """`build_corpus` in a spawned child, so the model never enters the fuzzing processes."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_corpus_main, args=(str(out), real, model, child))
    proc.start()
    child.close()
    try:
        kind, value = parent.recv()
    except EOFError:
        kind, value = "error", f"the corpus builder died (exit code {proc.exitcode})"
    proc.join(60)
    if kind != "ok":
        raise RuntimeError(f"building the fuzz corpus failed:\n{value}")
    return dict(value)


# -- the benchmark --------------------------------------------------------------------------

def run_fuzz(targets: Sequence[str] | None = None, inputs: int = DEFAULT_INPUTS, *,
             seed: int = 0, corpus: Path | None = None, real: bool = True,
             model: str | None = None, hang_s: float = HANG_S,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fuzz each target with `inputs` inputs; the result with one row per target."""
    from edgekv_bench.report import environment

    names = list(targets or TARGETS)
    for n in names:
        if n not in TARGETS:
            raise ValueError(f"unknown fuzz target {n!r}; choose from {', '.join(TARGETS)}")
    own = corpus is None
    root = Path(tempfile.mkdtemp(prefix="edgekv-fuzz-")) if own else Path(corpus)  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        notes = build_corpus_isolated(root, real=real, model=model) if own else {}
        corpus_s = time.monotonic() - t0
        rows = []
        for n in names:
            if progress:
                progress(f"{n}: fuzzing ({inputs} inputs)")
            rows.append(_fuzz_one(n, root, inputs, seed, hang_s, progress))
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "inputs_per_target": inputs, "seed": seed, "hang_s": hang_s,
            "memory_margin_mb": MEMORY_MARGIN >> 20, "corpus_s": round(corpus_s, 1),
            "corpus": notes, "environment": environment()}


def fuzz_table(res: dict[str, Any]) -> str:
    from edgekv_bench.markdown import table

    rows = [[r["target"], r["inputs"], r["crashes"], r["hangs"], r["peak_rss_mb"],
             r["clean_errors"], r["accepted"], r["seconds"], r.get("clean") or "-"]
            for r in res["rows"]]
    text = table(["target", "inputs", "crashes", "hangs", "peak RSS MB", "clean errors",
                  "accepted", "s", "clean means"], rows)
    kinds = [f"- {r['target']}: {k} x{v} (inputs {r['crash_inputs'].get(k)})"
             for r in res["rows"] for k, v in r["crash_kinds"].items()]
    seeds = [f"- {r['target']}: {r['seeds']} seeds, {r['seed_corpus']}" for r in res["rows"]]
    text += (f"\n\nPer target {res['inputs_per_target']} inputs (seed {res['seed']}); a hang is "
             f"an input running over {res['hang_s']} s; each worker's address space is capped at "
             f"its warm size + {res['memory_margin_mb']} MiB.\n\nSeed corpora:\n"
             + "\n".join(seeds))
    if kinds:
        text += "\n\nCrashes:\n" + "\n".join(kinds)
    return text


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """`edgekv bench fuzz [--inputs N] [--targets a,b] [--seed S] [--model GGUF]`."""
    names = [t for t in (getattr(args, "targets", None) or "").split(",") if t] or None
    inputs = getattr(args, "inputs", None) or DEFAULT_INPUTS
    res = run_fuzz(names, inputs, seed=getattr(args, "seed", 0) or 0,
                   model=getattr(args, "model", None),
                   progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    return res, fuzz_table(res)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """`edgekv bench fuzz` (registered by the CLI where a checkout holds this harness)."""
    from edgekv_bench.options import bench_parser

    p = bench_parser(sub, "fuzz", "mutation fuzzing of every decoder of untrusted bytes and "
                     "the HTTP bodies: crashes, hangs, memory (checkout only)", run_cli)
    p.add_argument("--inputs", type=int, help=f"inputs per target (default {DEFAULT_INPUTS})")
    p.add_argument("--targets", help="comma-separated targets (default: all): "
                   + ", ".join(TARGETS))
    p.add_argument("--seed", type=int, default=0, help="RNG seed")
    return p
