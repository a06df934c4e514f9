"""How both servers (`edgekv serve`, `edgekv kv-server`) log a request that failed inside.

The policy: at ERROR, the exception's type, where it happened (the last frames as
`file:line function`, code locations only) and the request's id, which the client also got in
its response. Never the exception's message or the request: a message may quote the prompt
or a key, and a log is read by more people than the prompt's owner. The whole traceback,
message included, is logged at DEBUG, for an operator who turns it on to debug
(`logging.getLogger("edgekv").setLevel(logging.DEBUG)`, or `edgekv -v` for INFO and up).
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

__all__ = ["log_internal_error"]


def log_internal_error(log: logging.Logger, e: BaseException, *, where: str,
                       request_id: str = "") -> None:
    """Log `e`, an unexpected failure of request `request_id` in `where`, by the policy."""
    frames = traceback.extract_tb(e.__traceback__)
    at = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:])
    rid = f" request {request_id}" if request_id else ""
    log.error("internal error %s in %s%s (at %s)", type(e).__name__, where, rid, at or "?")
    log.debug("internal error in %s%s: the traceback", where, rid, exc_info=e)
