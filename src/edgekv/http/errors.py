"""A client that hung up while sending its body: nothing to answer, only to count."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["CLIENT_GONE", "client_gone_response"]

CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the metrics count it


async def client_gone_response(request: Request, e: Exception) -> Response:
    """The client hung up while sending its body: nothing to answer, only to count."""
    return Response(status_code=CLIENT_GONE)
