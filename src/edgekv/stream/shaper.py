"""A user-space link shaper for the SparKV client (`--kv-link`): bandwidth, delay, jitter,
loss and a link that changes mid-request.

`Shaper` works inside the client (portable, any OS, no root: this machine's kernel has no
sch_netem, and tc needs root anyway): a request waits one RTT (plus a uniform jitter in
[-jitter, +jitter], as `tc netem delay RTT JITTER` draws it) before its first byte; bytes are
released no faster than the bandwidth allows; each 64 KiB segment is lost with probability
`loss`, costing a retransmission stall (max(RTT, 200 ms), TCP's minimum RTO) that delays every
later byte, and is held back by a further uniform delay in [0, jitter] that does not
accumulate (segments stay in order, as on one TCP connection). `change_after_bytes` /
`changed_bandwidth_mbps`: once that many payload bytes have passed through this shaper (over
all its requests), the bandwidth becomes the new value (a link that degrades mid-request).
`log` counts what it did (requests, RTTs drawn, losses, the change), for tests and reports.

The kernel's own emulation (`tc netem` in a network namespace, for the benchmarks) is the lab's:
`edgekv_bench.netem`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

__all__ = ["Shaper", "ShaperLog"]

SEGMENT = 64 * 1024
MIN_RTO_S = 0.2  # TCP's minimum retransmission timeout (RFC 6298)


@dataclass
class ShaperLog:
    requests: int = 0
    rtts_s: list[float] = field(default_factory=list)  # the delay drawn for each request
    segments: int = 0
    lost: int = 0
    changed_at_s: float | None = None  # perf_counter time the bandwidth changed, if it did


@dataclass
class Shaper:
    bandwidth_mbps: float | None = None  # None: unshaped
    rtt_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0
    jitter_ms: float = 0.0
    change_after_bytes: int | None = None
    changed_bandwidth_mbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("bandwidth_mbps", "changed_bandwidth_mbps"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name}={v} must be > 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss={self.loss} must be in [0, 1)")
        if self.jitter_ms < 0 or self.rtt_ms < 0:
            raise ValueError("rtt_ms and jitter_ms must be >= 0")
        if (self.change_after_bytes is None) != (self.changed_bandwidth_mbps is None):
            raise ValueError("give both change_after_bytes and changed_bandwidth_mbps, or neither")
        self._rng = random.Random(self.seed)
        self._due = 0.0  # when the bytes read so far are released
        self._released = 0.0  # release time of the last segment (jitter keeps them in order)
        self._bytes = 0  # bytes of the current request
        self._seg = 0
        self._total = 0  # bytes over every request (for the mid-request change)
        self.log = ShaperLog()

    @property
    def current_mbps(self) -> float | None:
        """The bandwidth now in force."""
        if self.change_after_bytes is not None and self._total >= self.change_after_bytes:
            return self.changed_bandwidth_mbps
        return self.bandwidth_mbps

    def on_request(self) -> None:
        """A new request: one round trip (with jitter) before anything arrives."""
        rtt = self.rtt_ms / 1000.0
        if self.jitter_ms:
            rtt = max(0.0, rtt + self._rng.uniform(-self.jitter_ms, self.jitter_ms) / 1000.0)
        self.log.requests += 1
        self.log.rtts_s.append(rtt)
        if rtt > 0:
            time.sleep(rtt)
        self._due = self._released = time.perf_counter()
        self._bytes = self._seg = 0

    def _pace(self, n: int) -> None:
        """Advance the release schedule by `n` bytes, split at the bandwidth change."""
        while n > 0:
            mbps = self.current_mbps
            part = n
            if (self.change_after_bytes is not None and self._total < self.change_after_bytes):
                part = min(n, self.change_after_bytes - self._total)
            if mbps:
                self._due += part * 8 / (mbps * 1e6)
            self._total += part
            n -= part
            if (self.change_after_bytes is not None and self.log.changed_at_s is None
                    and self._total >= self.change_after_bytes):
                self.log.changed_at_s = max(self._due, time.perf_counter())

    def on_bytes(self, n: int) -> None:
        """`n` more bytes were read: hold them back to the shaped schedule."""
        self._bytes += n
        self._pace(n)
        delay = 0.0
        while self._seg + SEGMENT <= self._bytes:
            self._seg += SEGMENT
            self.log.segments += 1
            if self.loss and self._rng.random() < self.loss:
                self.log.lost += 1
                self._due += max(self.rtt_ms / 1000.0, MIN_RTO_S)  # every later byte slips
            if self.jitter_ms:
                delay = max(delay, self._rng.uniform(0.0, self.jitter_ms) / 1000.0)
        release = max(self._released, self._due + delay)
        self._released = release
        wait = release - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
