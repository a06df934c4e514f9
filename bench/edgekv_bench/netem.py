"""The kernel's network emulation, for the benchmarks and tests: `NetnsLink` is a network
namespace with a veth pair shaped by Linux `tc netem` (delay, rate, loss), for a server started
inside it, where root allows. The device's own user-space shaper is the product's
(`edgekv.stream.shaper.Shaper`)."""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["NetnsLink", "netns_available"]


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
