"""Network emulation: bandwidth, delay and loss.

`Shaper` works inside the client (portable, any OS): a request waits one RTT before its first
byte, bytes are released no faster than the bandwidth allows, and each 64 KiB segment is lost
with probability `loss`, costing a retransmission stall (max(RTT, 200 ms), TCP's minimum RTO).

`NetnsLink` is the real thing where root allows: a network namespace with a veth pair shaped
by Linux `tc netem` (delay, rate, loss) for a server started inside it.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import time
from dataclasses import dataclass

__all__ = ["NetnsLink", "Shaper", "netns_available"]

SEGMENT = 64 * 1024


@dataclass
class Shaper:
    bandwidth_mbps: float | None = None  # None: unshaped
    rtt_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bandwidth_mbps is not None and self.bandwidth_mbps <= 0:
            raise ValueError(f"bandwidth_mbps={self.bandwidth_mbps} must be > 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss={self.loss} must be in [0, 1)")
        self._rng = random.Random(self.seed)
        self._t0 = 0.0
        self._bytes = 0
        self._seg = 0

    def on_request(self) -> None:
        """A new request: one round trip before anything arrives."""
        if self.rtt_ms > 0:
            time.sleep(self.rtt_ms / 1000.0)
        self._t0, self._bytes, self._seg = time.perf_counter(), 0, 0

    def on_bytes(self, n: int) -> None:
        """`n` more bytes were read: hold them back to the shaped schedule."""
        self._bytes += n
        stall = 0.0
        while self._seg + SEGMENT <= self._bytes:
            self._seg += SEGMENT
            if self.loss and self._rng.random() < self.loss:
                stall += max(self.rtt_ms / 1000.0, 0.2)
        if stall:
            self._t0 += stall  # the schedule slips by the retransmission time
        if self.bandwidth_mbps:
            due = self._t0 + self._bytes * 8 / (self.bandwidth_mbps * 1e6)
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)


def netns_available() -> str | None:
    """None if namespaces, veth and the netem qdisc all work here, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "ip/tc not installed (Debian package iproute2)"
    try:
        with NetnsLink(250):
            return None
    except PermissionError:
        return "not root"
    except subprocess.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip()
        return f"{' '.join(e.cmd[:4])}... failed: {err or e}"
    except OSError as e:
        return str(e)


class NetnsLink:
    """`ip netns` + veth + `tc netem`: host side 10.213.<n>.1, namespace side 10.213.<n>.2.

    Traffic goes only between this machine and a namespace it created itself; both are
    removed on exit."""

    def __init__(self, n: int = 7, *, delay_ms: float = 0.0, rate_mbit: float | None = None,
                 loss_pct: float = 0.0) -> None:
        self.ns, self.host_if, self.ns_if = f"ekv{n}", f"ekvh{n}", f"ekvn{n}"
        self.host_ip, self.ns_ip = f"10.213.{n}.1", f"10.213.{n}.2"
        self.delay_ms, self.rate_mbit, self.loss_pct = delay_ms, rate_mbit, loss_pct

    def _run(self, *cmd: str) -> None:
        subprocess.run(list(cmd), check=True, capture_output=True)

    def __enter__(self) -> NetnsLink:
        self._run("ip", "netns", "add", self.ns)
        try:
            self._run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._run("ip", "link", "set", self.ns_if, "netns", self.ns)
            self._run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            self._run("ip", "link", "set", self.host_if, "up")
            ex = ("ip", "netns", "exec", self.ns)
            self._run(*ex, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            self._run(*ex, "ip", "link", "set", self.ns_if, "up")
            self._run(*ex, "ip", "link", "set", "lo", "up")
            self.shape(self.delay_ms, self.rate_mbit, self.loss_pct)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def shape(self, delay_ms: float, rate_mbit: float | None, loss_pct: float) -> None:
        """Apply netem on both directions (half the delay each way: delay_ms is the RTT)."""
        args = ["netem", "delay", f"{delay_ms / 2:.3f}ms"]
        if rate_mbit:
            args += ["rate", f"{rate_mbit}mbit"]
        if loss_pct:
            args += ["loss", f"{loss_pct}%"]
        self._run("tc", "qdisc", "replace", "dev", self.host_if, "root", *args)
        self._run("ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", self.ns_if,
                  "root", *args)

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]
