"""llama-server's pre-routing (503 while the model loads, the API key) and the exception handlers that
answer every error as ``{"error": {"code", "message", "type"}}``."""
from __future__ import annotations

import hmac
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from ..errors import LlamaSpecError
from .errors import ApiError, api_error, invalid_api_key, unavailable
from .state import ServerState

__all__ = ["HEALTH", "PUBLIC", "GuardMiddleware", "EXCEPTION_HANDLERS"]

log = logging.getLogger("llamaspec.server")

#: routes that need neither a loaded model nor an API key
HEALTH = ("/health", "/v1/health")
#: routes that need no API key (llama-server's public endpoints)
PUBLIC = HEALTH + ("/models", "/v1/models")


class GuardMiddleware:
    """llama-server's pre-routing: 503 while loading (except /health), then the API key (except public
    routes); CORS preflights pass."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self.keys = [k.encode("utf-8") for k in state.config.api_keys]

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = []
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given.append(auth[7:].strip())
        if b"x-api-key" in headers:
            given.append(headers[b"x-api-key"].strip())
        return any(hmac.compare_digest(g, k) for g in given for k in self.keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope.get("path", "")
            err = None
            if path not in HEALTH and not self.state.ready:
                err = unavailable("Loading model")
            elif self.keys and path not in PUBLIC and not self._authorized(dict(scope.get("headers") or [])):
                err = invalid_api_key()
            if err is not None:
                await JSONResponse(err.to_dict(), status_code=err.code)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error_handler(request: HttpRequest, exc: Exception):
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.to_dict(), status_code=exc.code)


async def _http_error_handler(request: HttpRequest, exc: Exception):
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = ApiError(404, "File Not Found", "not_found_error")
    elif exc.status_code == 405:
        err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}", "invalid_request_error")
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    return JSONResponse(err.to_dict(), status_code=err.code, headers=getattr(exc, "headers", None))


async def _library_error_handler(request: HttpRequest, exc: Exception):
    err = api_error(exc)
    if not isinstance(err, ApiError):
        log.error("unexpected error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
        err = ApiError(500, f"{type(exc).__name__}: {exc}", "server_error")
    return JSONResponse(err.to_dict(), status_code=err.code)


#: the app's exception handlers: ApiError as it is, Starlette's 404 / 405 in llama-server's shape, the library's
#: errors mapped by :func:`~llamaspec.server.errors.api_error`, anything else a 500 ``server_error``
EXCEPTION_HANDLERS = {ApiError: _api_error_handler, HTTPException: _http_error_handler,
                      LlamaSpecError: _library_error_handler, Exception: _library_error_handler}
