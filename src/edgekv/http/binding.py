"""The listening socket, bound before a server loads anything (a taken port fails at once),
and uvicorn as both of EdgeKV's servers run it on that socket."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, Literal

from ..errors import EdgeKVError

if TYPE_CHECKING:
    import uvicorn

__all__ = ["bind", "uvicorn_server"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0 picks a free port)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise EdgeKVError(f"cannot listen on {host}:{port} ({e}); pick another --port "
                          "(0 picks a free one)") from None
    sock.listen(128)
    return sock


def uvicorn_server(app: Any, *, log_level: str | None = "warning",
                   lifespan: Literal["auto", "on", "off"] = "on",
                   graceful_s: int = 5, host_logging: bool = False) -> uvicorn.Server:
    """uvicorn as both of EdgeKV's servers run it (no websockets), to be run on a socket from
    `bind`: `server.run(sockets=[sock])`; `server.should_exit = True` stops it, letting
    requests in flight finish for up to `graceful_s` seconds. `host_logging`: leave logging
    to the host process (uvicorn's loggers propagate to its handlers) instead of installing
    uvicorn's own configuration; `log_level=None` then leaves their levels alone too."""
    import uvicorn

    own: dict[str, Any] = {} if not host_logging else {"log_config": None}
    return uvicorn.Server(uvicorn.Config(
        app, log_level=log_level, access_log=log_level == "info", ws="none",
        lifespan=lifespan, timeout_graceful_shutdown=graceful_s, **own))
