"""`edgekv serve`: an OpenAI-compatible HTTP server over `EdgeKV.generate`.

`create_app` builds the ASGI app (FastAPI) over an EdgeKV or a loader; `run` binds a socket,
loads the model in the background and serves with uvicorn. Needs the `serve` extra:
`pip install 'edgekv[serve]'`.
"""

from __future__ import annotations

from .app import ServeOptions, create_app
from .errors import APIError
from .runner import bind, load_edgekv, run

__all__ = ["APIError", "ServeOptions", "bind", "create_app", "load_edgekv", "run"]
