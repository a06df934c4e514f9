"""The load row of `edgekv bench faults`: `edgekv serve` under 8 concurrent loopback clients
for `duration` seconds, mixing good requests (streamed, checked against their cold output),
malformed ones (must be 4xx) and clients that disconnect mid-request. Reported: unexpected
errors (anything but the answers and the documented 4xx/429), 429s, p50/p99 TTFT, throughput
and the server's RSS sampled every second (flat memory: its growth after warm-up). Entries:
every fragment file seen complete in the server's store (sampled each second and at the end)
is acknowledged; one that cannot be read (checksum verified) after the server stops is lost.
The server's own evictions are not reported by key, so an eviction would count as lost here
(the disk tier's 2 GiB is far above what a run writes). A client thread that raises, or a
server that dies while loading, fails the row (`HarnessError`): no count is then reported."""

from __future__ import annotations

import json
import random
import socket
import statistics
import subprocess
import threading
import time
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

__all__ = ["load_fault"]

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


def load_fault(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    import httpx

    prompts = fault_prompts(o["requests"], o["seed"])
    texts = cold_texts(prompts, o)
    cache = new_cache_dir(work / "cache")
    cmd = ["serve", "--port", "0", "--cache-dir", str(cache), "--n-ctx", str(o["n_ctx"])]
    if o["model"]:
        cmd += ["--model", str(o["model"])]
    errf = (work / "serve.stderr").open("wb")
    server = subprocess.Popen(edgekv_cmd(*cmd), stdout=subprocess.PIPE, stderr=errf,
                              env=child_env(cache))
    assert server.stdout is not None
    url = server.stdout.readline().decode().split("listening on ", 1)[1].split()[0]
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with httpx.Client(base_url=url, timeout=600) as c:
        while c.get("/health").status_code != 200:
            if server.poll() is not None:
                raise HarnessError(f"edgekv serve exited with status {server.returncode} "
                                   "while loading")
            time.sleep(0.5)
        model = c.get("/v1/models").json()["data"][0]["id"]
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
    from edgekv.serve.runner import stop_process

    stop_process(server)
    server.stdout.close()
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
