"""Test helpers for the streaming tests: a byte-flipping TCP proxy and a silent server."""

from __future__ import annotations

import socket
import threading


class TamperProxy:
    """Forwards 127.0.0.1:<port> to a target; can stall the reply after `stall_at` bytes, and
    flips one byte of the server's reply stream at `flip_at` (counted over the whole
    connection) on connections whose request contains `only_path`."""

    def __init__(self, target: tuple[str, int], flip_at: int = -1, only_path: bytes = b"/v1/chunks",
                 stall_at: int = -1):
        self.target, self.flip_at, self.only_path = target, flip_at, only_path
        self.stall_at = stall_at  # stop forwarding (but keep the connection open) after N bytes
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.flipped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        s = socket.create_connection(self.target)
        req = c.recv(65536)
        tamper = self.only_path in req
        s.sendall(req)

        def up() -> None:
            try:
                while data := c.recv(65536):
                    s.sendall(data)
            except OSError:
                pass

        threading.Thread(target=up, daemon=True).start()
        seen = 0
        try:
            while data := s.recv(65536):
                if tamper and 0 <= self.stall_at < seen + len(data):
                    c.sendall(data[: max(0, self.stall_at - seen)])
                    threading.Event().wait(60)  # a stalled peer: silent, connection open
                    return
                if tamper and seen <= self.flip_at < seen + len(data):
                    b = bytearray(data)
                    b[self.flip_at - seen] ^= 0x20
                    data = bytes(b)
                    self.flipped += 1
                seen += len(data)
                c.sendall(data)
        except OSError:
            pass
        finally:
            c.close()
            s.close()

    def close(self) -> None:
        self.sock.close()


class SilentServer:
    """Accepts connections and never answers (a stalled peer)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
                self.conns.append(c)
            except OSError:
                return

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()
