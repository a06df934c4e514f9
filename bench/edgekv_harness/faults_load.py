"""The load rows of `edgekv bench faults`, `edgekv serve` under 8 concurrent loopback clients.

`serve_load`: for `duration` seconds, good requests (streamed, checked against their cold
output), malformed ones (must be 4xx) and clients that disconnect mid-request. Reported:
unexpected errors (anything but the answers and the documented 4xx/429), 429s, p50/p99 TTFT,
throughput and the server's RSS sampled every second (flat memory: its growth after warm-up).
Entries: every fragment file seen complete in the server's store (sampled each second and at
the end) is acknowledged; one that cannot be read (checksum verified) after the server stops
is lost. The server's own evictions are not reported by key, so an eviction would count as
lost here (the disk tier's 2 GiB is far above what a run writes).

`serve_kill_under_load`: the same server at its defaults while 8 clients stream good
requests, killed with SIGKILL `kills` times and started again at once on the same port and
cache directory, as a supervisor restarts it. Every request must end in a correct answer or
an error the client sees (the connection refused or cut, a 503 while the model loads, a 429);
one that hangs is lost. Recovery runs from the kill to the first correct answer, sent after
the kill, that reused the cache (`cached_tokens` > 0); each recovery is split into the
restart's listening socket, its first `/health` 200 and that answer.

A client thread that raises, or a server that dies while loading, fails the row
(`HarnessError`): no count is then reported."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import statistics
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .faults_kit import (
    HarnessError,
    Watched,
    child_env,
    cold_texts,
    edgekv_cmd,
    fault_prompts,
    fragment_files,
    make_row,
    new_cache_dir,
    readable_entries,
)

__all__ = ["load_fault", "serve_kill"]

CLIENTS = 8
# bodies the server must refuse with a 4xx (JSON that is not JSON, wrong types, missing or
# empty fields, out-of-range numbers, an unknown field)
MALFORMED: tuple[bytes, ...] = (
    b"{not json", b"[]", b'{"prompt": 5}', b'{"max_tokens": 4}',
    b'{"prompt": "hi", "max_tokens": "5"}', b'{"prompt": "", "max_tokens": 4}',
    b'{"prompt": "hi", "max_tokens": -1}', b'{"prompt": "hi", "temperature": "hot"}',
    b'{"prompt": "hi", "n_bogus": 1}', b'{"prompt": [[1, 2], [3]], "max_tokens": 2}',
    b'\xff\xfe\x00garbage',
)


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000.0, 1)


def _serve_cmd(cache: Path, o: dict[str, Any], port: int) -> list[str]:
    """`edgekv serve` at its defaults (slots as the probe allows) on `cache`."""
    cmd = ["serve", "--port", str(port), "--cache-dir", str(cache), "--n-ctx", str(o["n_ctx"])]
    if o["model"]:
        cmd += ["--model", str(o["model"])]
    return edgekv_cmd(*cmd)


def _start(cmd: list[str], cache: Path, errf: Any) -> tuple[subprocess.Popen[bytes], str]:
    """The server process and its base URL, once its socket listens (before the model loads)."""
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, env=child_env(cache))
    assert server.stdout is not None
    line = server.stdout.readline().decode()
    if "listening on " not in line:
        server.wait()
        raise HarnessError(f"edgekv serve exited with status {server.returncode} before it "
                           "listened (see its stderr)")
    return server, line.split("listening on ", 1)[1].split()[0]


def _stop(server: subprocess.Popen[bytes]) -> None:
    """Stop (SIGTERM, then SIGKILL) and reap a server; its stdout closed."""
    from edgekv.serve.runner import stop_process

    stop_process(server)
    if server.stdout is not None:
        server.stdout.close()


def _wait_healthy(url: str, server: subprocess.Popen[bytes], poll_s: float = 0.5) -> str:
    """Poll `/health` until 200 (the model loaded); the served model's id."""
    import httpx

    with httpx.Client(base_url=url, timeout=600) as c:
        while c.get("/health").status_code != 200:
            if server.poll() is not None:
                raise HarnessError(f"edgekv serve exited with status {server.returncode} "
                                   "while loading")
            time.sleep(poll_s)
        return str(c.get("/v1/models").json()["data"][0]["id"])


def load_fault(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    import httpx

    prompts = fault_prompts(o["requests"], o["seed"])
    texts = cold_texts(prompts, o)
    cache = new_cache_dir(work / "cache")
    errf = (work / "serve.stderr").open("wb")
    server, url = _start(_serve_cmd(cache, o, 0), cache, errf)
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    model = _wait_healthy(url, server)
    lock = threading.Lock()
    stats: dict[str, Any] = {"good": 0, "answered": 0, "wrong": 0, "lost": 0, "malformed": 0,
                             "disconnects": 0, "unexpected": [], "status": {}, "tokens": 0}
    ttfts: list[float] = []
    rss: list[tuple[float, float]] = []
    seen: set[str] = set()  # fragment files seen complete in the server's store
    store_dir = cache / "store"
    stop = threading.Event()
    t_start = time.perf_counter()
    deadline = t_start + float(o["duration"])

    def count(status: int | str) -> None:
        with lock:
            stats["status"][str(status)] = stats["status"].get(str(status), 0) + 1

    def good(cl: httpx.Client, i: int) -> None:
        body = {"model": model, "prompt": prompts[i], "max_tokens": o["max_tokens"],
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        for _attempt in range(60):
            t0 = time.perf_counter()
            first: float | None = None
            text, usage = [], 0
            with cl.stream("POST", "/v1/completions", json=body) as r:
                count(r.status_code)
                if r.status_code == 429:  # documented back-pressure: wait and retry
                    r.read()
                    time.sleep(0.5)
                    continue
                if r.status_code != 200:
                    with lock:
                        stats["unexpected"].append(f"good -> {r.status_code}")
                    break
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    piece = "".join(ch.get("text", "") for ch in chunk.get("choices", []))
                    if piece and first is None:
                        first = time.perf_counter()
                    text.append(piece)
                    if chunk.get("usage"):
                        usage = int(chunk["usage"].get("completion_tokens", 0))
            with lock:
                stats["answered"] += 1
                stats["tokens"] += usage
                stats["wrong"] += "".join(text) != texts[i]
                ttfts.append((first or time.perf_counter()) - t0)
            return
        with lock:
            stats["lost"] += 1

    def malformed(cl: httpx.Client, rng: random.Random) -> None:
        body = rng.choice(MALFORMED)
        r = cl.post("/v1/completions", content=body,
                    headers={"content-type": "application/json"})
        count(r.status_code)
        if not (400 <= r.status_code < 500):
            with lock:
                stats["unexpected"].append(f"malformed {body[:30]!r} -> {r.status_code}")

    def disconnect(cl: httpx.Client, rng: random.Random, i: int) -> None:
        if rng.random() < 0.5:  # a streamed request dropped after its first bytes
            body = {"model": model, "prompt": prompts[i], "max_tokens": o["max_tokens"],
                    "temperature": 0, "stream": True}
            with cl.stream("POST", "/v1/completions", json=body) as r:
                count(r.status_code)
                for _ in r.iter_bytes():
                    break
        else:  # half a request on a raw socket, then gone
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"pro")
            count("cut")

    def client(k: int) -> None:
        rng = random.Random(o["seed"] * 100 + k)
        with httpx.Client(base_url=url, timeout=600) as cl:
            while time.perf_counter() < deadline:
                x, i = rng.random(), rng.randrange(len(prompts))
                try:
                    if x < 0.7:
                        with lock:
                            stats["good"] += 1
                        good(cl, i)
                    elif x < 0.85:
                        with lock:
                            stats["malformed"] += 1
                        malformed(cl, rng)
                    else:
                        with lock:
                            stats["disconnects"] += 1
                        disconnect(cl, rng, i)
                except httpx.HTTPError as e:
                    with lock:
                        stats["unexpected"].append(f"{type(e).__name__}: {e}")
                        if x < 0.7:
                            stats["lost"] += 1

    def sample() -> None:
        while not stop.wait(1.0):
            m = _rss_mb(server.pid)
            if m is not None:
                rss.append((time.perf_counter() - t_start, m))
            seen.update(fragment_files(store_dir))

    sampler = Watched(sample)
    sampler.start()
    threads = [Watched(client, k, name=f"client-{k}") for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t_start
    stop.set()
    sampler.join()
    seen.update(fragment_files(store_dir))
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            healthy = c.get("/health").status_code == 200
    except httpx.HTTPError:  # a dead server is a finding (server_alive), not a harness crash
        healthy = False
    alive = server.poll() is None
    _stop(server)
    errf.close()
    Watched.check([sampler, *threads])
    lost_entries = len(seen - readable_entries(store_dir, seen))
    warm = [m for t, m in rss if t >= 0.25 * elapsed] or [m for _, m in rss]
    n_req = stats["good"] + stats["malformed"] + stats["disconnects"]
    return make_row(
        "serve_load", runs=CLIENTS, requests=n_req, wrong_outputs=stats["wrong"],
        lost_requests=stats["lost"], lost_entries=lost_entries, recovery_s=None,
        how=f"`edgekv serve`, {CLIENTS} loopback clients for {elapsed:.0f} s: 70% good "
        "(streamed, greedy), 15% malformed bodies, 15% disconnects (mid-stream or half a "
        "request)", good=stats["good"], malformed=stats["malformed"],
        disconnects=stats["disconnects"], errors=len(stats["unexpected"]),
        unexpected=stats["unexpected"][:10], status_counts=stats["status"],
        http_429=stats["status"].get("429", 0),
        ttft_ms_p50=_pct(ttfts, 0.5), ttft_ms_p99=_pct(ttfts, 0.99),
        throughput_rps=round(stats["answered"] / elapsed, 3),
        tokens_per_s=round(stats["tokens"] / elapsed, 2),
        rss_mb_after_warmup=round(warm[0], 1) if warm else None,
        rss_mb_end=round(warm[-1], 1) if warm else None,
        rss_mb_max=round(max(m for _, m in rss), 1) if rss else None,
        rss_growth_mb=round(warm[-1] - warm[0], 1) if warm else None,
        rss_mb_median=round(statistics.median(warm), 1) if warm else None,
        rss_samples=len(rss), server_alive=alive, healthy_after=healthy,
        acked_entries=len(seen),
        notes="no store fault: entries are checked after the server stops; recovery: not "
        "applicable")


# -- kill -9 of the server while clients stream ------------------------------------------------

RECOVERY_WAIT_S = 180.0  # a restart with no correct cached answer by then did not recover
RETRY_S = 0.25  # a client's retry after an error without Retry-After (the SDK's order)


class _Streams:
    """`CLIENTS` threads that stream good requests until `stop`, each ending in an answer
    (kept as (sent, finished, correct, cached tokens)) or an error the client saw, counted by
    kind: `refused` (no server listening), `cut` (the stream ended before `[DONE]`), `503`
    (loading), `429` (queue full); `timeout` (no byte for `read_s`) is a lost request. A
    client retries after an error: after the server's `Retry-After` where it sent one, else
    after `RETRY_S`."""

    def __init__(self, url: str, model: str, prompts: list[str], texts: list[str],
                 o: dict[str, Any], read_s: float = 120.0) -> None:
        self.url, self.model, self.prompts, self.texts, self.o = url, model, prompts, texts, o
        self.read_s = read_s
        self.lock = threading.Lock()
        self.done: list[tuple[float, float, bool, int]] = []
        self.errors: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.stop = threading.Event()
        self.wait = threading.local()  # a client's next retry delay
        self.threads = [Watched(self._client, k, name=f"client-{k}") for k in range(CLIENTS)]

    def _one(self, cl: Any, i: int) -> str | None:
        """One streamed request: None for a full answer (recorded), else the error's kind
        (a refusal's `Retry-After` kept in `self.wait`, as the openai SDK honours it)."""
        import httpx

        body = {"model": self.model, "prompt": self.prompts[i], "max_tokens":
                self.o["max_tokens"], "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        sent, text, cached, finished = time.time(), [], 0, False
        try:
            with cl.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    with contextlib.suppress(ValueError):
                        self.wait.value = float(r.headers.get("retry-after", ""))
                    return str(r.status_code)
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        finished = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return "stream_error"
                        text += [c.get("text", "") for c in chunk.get("choices", [])]
                        details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                        cached = int(details.get("cached_tokens") or cached)
        except httpx.TimeoutException:
            return "timeout"
        except httpx.ConnectError:
            return "refused"
        except httpx.TransportError:  # reset or closed mid-response: the kill, seen
            return "cut"
        if not finished:
            return "cut"
        with self.lock:
            self.done.append((sent, time.time(), "".join(text) == self.texts[i], cached))
        return None

    def _client(self, k: int) -> None:
        import httpx

        rng = random.Random(self.o["seed"] * 100 + k)
        timeout = httpx.Timeout(10.0, read=self.read_s)
        with httpx.Client(base_url=self.url, timeout=timeout) as cl:
            while not self.stop.is_set():
                self.wait.value = RETRY_S
                kind = self._one(cl, rng.randrange(len(self.prompts)))
                if kind is None:
                    continue
                with self.lock:
                    self.errors[kind] += 1
                    if kind not in ("refused", "cut", "503", "429", "timeout"):
                        self.unexpected.append(kind)
                time.sleep(min(self.wait.value, 10.0))

    def first_answer(self, after: float, *, cached: bool, wait_s: float) -> float | None:
        """When the first correct answer sent after `after` (and reusing the cache, if
        `cached`) finished; None if none did within `wait_s`."""
        deadline = time.time() + wait_s
        while True:
            with self.lock:
                ok = [end for sent, end, right, c in self.done
                      if sent > after and right and (c > 0 or not cached)]
            if ok:
                return min(ok)
            if time.time() > deadline or any(t.error for t in self.threads):
                return None
            time.sleep(0.02)


def serve_kill(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """`edgekv serve` killed with SIGKILL `kills` times while 8 clients stream (see the module
    doc): at a uniform random moment 0-3 s after the running process's first correct answer,
    then started again at once with the same command."""
    prompts = fault_prompts(o["requests"], o["seed"])
    texts = cold_texts(prompts, o)
    cache = new_cache_dir(work / "cache")
    store_dir = cache / "store"
    errf = (work / "serve.stderr").open("wb")
    server, url = _start(_serve_cmd(cache, o, 0), cache, errf)
    cmd = _serve_cmd(cache, o, int(url.rsplit(":", 1)[1]))  # restarts reuse the port
    streams = _Streams(url, _wait_healthy(url, server), prompts, texts, o)
    for t in streams.threads:
        t.start()
    rng = random.Random(o["seed"])
    seen: set[str] = set()
    each: list[dict[str, float | None]] = []
    started = time.time()
    try:
        for _ in range(int(o["kills"])):
            if streams.first_answer(started, cached=False, wait_s=RECOVERY_WAIT_S) is None:
                raise HarnessError("no correct answer from the running server within "
                                   f"{RECOVERY_WAIT_S:g} s")
            time.sleep(rng.uniform(0.0, 3.0))
            seen.update(fragment_files(store_dir))
            killed = time.time()
            server.send_signal(signal.SIGKILL)
            _stop(server)
            server, _ = _start(cmd, cache, errf)
            listen = time.time()
            _wait_healthy(url, server, poll_s=0.05)
            healthy = time.time()
            answer = streams.first_answer(killed, cached=True, wait_s=RECOVERY_WAIT_S)
            each.append({"listen_s": round(listen - killed, 3),
                         "health_s": round(healthy - killed, 3),
                         "answer_s": None if answer is None else round(answer - killed, 3)})
            started = listen
        time.sleep(2.0)  # the last restart serves a while before the counts are taken
    finally:
        streams.stop.set()
        for t in streams.threads:
            t.join(streams.read_s + 15.0)
        seen.update(fragment_files(store_dir))
        alive = server.poll() is None
        _stop(server)
        errf.close()
    Watched.check(streams.threads)
    if any(t.is_alive() for t in streams.threads):
        raise HarnessError("a client thread never returned")
    return _kill_row(streams, each, seen, store_dir, alive)


def _kill_row(streams: _Streams, each: list[dict[str, float | None]], seen: set[str],
              store_dir: Path, alive: bool) -> dict[str, Any]:
    answered = len(streams.done)
    wrong = sum(not right for _s, _e, right, _c in streams.done)
    lost = streams.errors["timeout"] + len(streams.unexpected)
    recov = [r["answer_s"] for r in each]
    ok = [r for r in each if r["answer_s"] is not None]
    worst = max(ok, key=lambda r: r["answer_s"] or 0.0) if ok else None
    return make_row(
        "serve_kill_under_load", runs=len(each), requests=answered + sum(streams.errors.values()),
        wrong_outputs=wrong, lost_requests=lost,
        lost_entries=len(seen - readable_entries(store_dir, seen)), recovery_s=recov,
        how=f"`edgekv serve` (its defaults) while {CLIENTS} loopback clients stream; SIGKILL "
        f"at a uniform random moment 0-3 s after the running process's first correct answer, "
        f"{len(each)} times, each followed at once by the same command on the same port and "
        "cache directory; recovery: the kill to the first correct answer sent after it that "
        "reused the cache",
        answered=answered, client_errors=dict(streams.errors), unexpected=streams.unexpected[:10],
        cached_answers=sum(c > 0 for _s, _e, _r, c in streams.done),
        recovery_parts_s=each,
        listen_s_median=_median([r["listen_s"] for r in each]),
        health_s_median=_median([r["health_s"] for r in each]),
        worst=worst, acked_entries=len(seen), server_alive_at_end=alive,
        notes="client errors are what a client saw while the server was down or loading "
        "(refused, cut mid-stream, 503); lost requests: none of those and no answer (a hang)")


def _median(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return round(statistics.median(v), 3) if v else None
