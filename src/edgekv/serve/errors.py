"""OpenAI-style error objects: one exception type that carries its HTTP status.

Clients written for OpenAI (the `openai` package, LangChain, curl scripts) branch on the status
code and read `error.message`, `error.type` and `error.code`; every refusal the server makes,
from a malformed body to a full queue, is raised as an `APIError` and rendered the same way.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..errors import ConfigError, EdgeKVError, PromptError
from ..http.errors import CLIENT_GONE, client_gone_response

__all__ = [
    "APIError", "CLIENT_GONE", "api_error_response", "bad_request", "client_gone_response",
    "from_library_error", "http_error_response",
]



class APIError(Exception):
    """A request the server answers with an error object instead of a completion."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}

    def body(self) -> dict[str, Any]:
        """The wire form: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, *, code: str = "invalid_value",
                param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def from_library_error(e: EdgeKVError) -> APIError:
    """Map an error the library raised, by its type, never its message: a `PromptError`
    (the context rule, an empty prompt) is a 400 with the code and field it carries, a
    `ConfigError` a 400; anything else is a server fault (500): the server validates before it
    queues, with the library's own rule."""
    if isinstance(e, PromptError):
        return bad_request(str(e), code=e.code, param=e.param)
    if isinstance(e, ConfigError):
        return bad_request(str(e))
    return APIError(500, f"the engine failed: {e}", type="server_error",
                    code="internal_error")


async def api_error_response(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def http_error_response(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method) as OpenAI error objects."""
    if e.status_code == 404:
        msg = (f"no route {request.method} {request.url.path}; the API is under /v1 "
               "(POST /v1/chat/completions, POST /v1/completions, GET /v1/models), the page "
               "at / (unless --no-ui)")
        code: str | None = "not_found"
    elif e.status_code == 405:
        msg, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        msg, code = str(e.detail), None
    return JSONResponse(APIError(e.status_code, msg, code=code).body(),
                        status_code=e.status_code, headers=e.headers)
