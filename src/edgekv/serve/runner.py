"""Run the server: bind first, then load the model in the background, then serve.

Why bind before loading: a supervisor (or a test) can connect at once and watch `/health` go
from 503 to 200, instead of guessing when a multi-second model load has finished; and a port
that is taken fails at once, before seconds of loading are wasted.
"""

from __future__ import annotations

import ipaddress
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import CacheConfig
from ..core.pipeline import EdgeKV
from ..core.request import FillStep
from ..errors import EdgeKVError, EngineError
from ..http.binding import bind, uvicorn_server
from .app import ServeOptions, create_app

if TYPE_CHECKING:
    import uvicorn

__all__ = ["bind", "load_edgekv", "run", "stop_process", "uvicorn_server"]

log = logging.getLogger(__name__)


def load_edgekv(model: str | Path | None, config: CacheConfig, *, n_ctx: int = 2048,
                engine: str = "llamacpp", store_url: str | None = None,
                n_threads: int | None = None, flash_attn: bool | None = None,
                semantic: bool = False, prefetch: bool = False,
                fill: FillStep | None = None, staged_probe: bool = False) -> EdgeKV:
    """The EdgeKV the server uses (`open_llamacpp`): RAM in front of the disk store, or of
    `store_url` (`redis://...` shares fragments between server processes); `semantic`,
    `prefetch`, `fill` (SparKV from a KV server) as there. `flash_attn`: llama.cpp's flash
    attention, None for the engine's default (on with EdgeKV's batch-invariant build; exact
    reuse at any token only where the probe passes, elsewhere whole chunks). `staged_probe`:
    a first start probes briefly and serves whole chunks until the rest of the probe, run
    in the background by the app, passes (`EdgeKV`)."""
    from .. import open_llamacpp

    kwargs: dict[str, Any] = {} if flash_attn is None else {"flash_attn": flash_attn}
    return open_llamacpp(model, config, n_ctx=n_ctx, engine=engine, n_threads=n_threads,
                         semantic=semantic, prefetch=prefetch, fill=fill, store_url=store_url,
                         staged_probe=staged_probe, **kwargs)


def run(load: Callable[[], EdgeKV], *, model_id: str, options: ServeOptions,
        host: str = "127.0.0.1", port: int = 8080,
        announce: Callable[[str], None] | None = None, log_level: str = "warning") -> int:
    """Serve until interrupted. `announce` gets the base URL once the socket listens."""
    if not options.api_keys and not _loopback(host):
        log.warning("serving on %s without API keys: anyone who can reach it can use it and "
                    "read its timing; add --api-key-file PATH", host)
    sock = bind(host, port)
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        if server is not None:
            server.should_exit = True

    app = create_app(load, model_id=model_id, options=options, on_load_error=on_load_error)
    server = uvicorn_server(app, log_level=log_level)
    bound_host, bound_port = sock.getsockname()[:2]
    if announce is not None:
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        announce(f"http://{shown}:{bound_port}")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failed:
        e = failed[0]
        if isinstance(e, EdgeKVError):
            raise e
        raise EngineError(f"the model could not be loaded: {e}") from e
    return 0


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """Stop a server process: SIGTERM (uvicorn finishes what is in flight), then SIGKILL
    after `grace_s`; always reaped, so no zombie outlives the caller."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
