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
from .tenant import TENANT, tenant_of

__all__ = ["HEALTH", "PUBLIC", "GuardMiddleware", "CorsMiddleware", "PrefixMiddleware", "EXCEPTION_HANDLERS"]

log = logging.getLogger("llamaspec.server")

#: routes that need neither a loaded model nor an API key
HEALTH = ("/health", "/v1/health")
#: routes that need no API key: llama-server's public endpoints with ``--api-key`` (the model list names the
#: model's file, and the API description the server's limits: both need the key, as in llama-server)
PUBLIC = HEALTH


class GuardMiddleware:
    """llama-server's pre-routing: 503 while loading (except /health), then the API key (except public
    routes); CORS preflights pass."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self.keys = [k.encode("utf-8") for k in state.config.api_keys]

    def _authorized(self, headers: dict[bytes, bytes]) -> bytes | None:
        """The configured key the request gave (None: none of them)."""
        given = []
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given.append(auth[7:].strip())
        if b"x-api-key" in headers:
            given.append(headers[b"x-api-key"].strip())
        return next((k for g in given for k in self.keys if hmac.compare_digest(g, k)), None)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope.get("path", "")
            err, key = None, None
            if path not in HEALTH and not self.state.ready:
                err = unavailable("Loading model")
            elif self.keys and path not in PUBLIC:
                key = self._authorized(dict(scope.get("headers") or []))
                if key is None:
                    err = invalid_api_key()
            if err is not None:
                await JSONResponse(err.to_dict(), status_code=err.code)(scope, receive, send)
                return
            if key is not None:  # the shared n-gram pool keeps each key's text to itself (server/tenant.py)
                token = TENANT.set(tenant_of(key))
                try:
                    await self.app(scope, receive, send)
                finally:
                    TENANT.reset(token)
                return
        await self.app(scope, receive, send)


def _is_local_origin(origin: str) -> bool:
    from urllib.parse import urlsplit

    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class CorsMiddleware:
    """llama-server's CORS: ``Access-Control-Allow-Origin`` on every answer (``--cors-origins *`` with
    credentials echoes the request's Origin, ``localhost`` echoes local origins only, anything else is sent as
    it is); every ``OPTIONS`` request is a preflight answered 200 at once (before the API key and the 503 while
    loading), with ``--cors-methods``, ``--cors-headers`` and ``--cors-credentials``. The names are spelled
    as llama-server sends them (clients that compare them case-sensitively exist)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        c = state.config
        self.origins, self.credentials = c.cors_origins, c.cors_credentials
        self.preflight = [(b"Access-Control-Allow-Credentials", b"true" if c.cors_credentials else b"false"),
                          (b"Access-Control-Allow-Methods", c.cors_methods.encode("latin-1", "replace")),
                          (b"Access-Control-Allow-Headers", c.cors_headers.encode("latin-1", "replace"))]

    def _allow_origin(self, origin: str) -> str | None:
        if self.origins == "*" and self.credentials:
            return origin or None
        if self.origins == "localhost":
            return origin if origin and _is_local_origin(origin) else None
        return self.origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = dict(scope.get("headers") or []).get(b"origin", b"").decode("latin-1")
        allow = self._allow_origin(origin)
        extra = [(b"Access-Control-Allow-Origin", allow.encode("latin-1", "replace"))] if allow is not None else []
        if scope.get("method") == "OPTIONS":
            await send({"type": "http.response.start", "status": 200,
                        "headers": extra + self.preflight + [(b"Content-Type", b"text/html"), (b"Content-Length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if not extra:
            await self.app(scope, receive, send)
            return

        async def send_with_origin(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_origin)


class PrefixMiddleware:
    """``--api-prefix /p``: the routes live under ``/p`` (a path outside it is a 404)."""

    def __init__(self, app, prefix: str):
        self.app = app
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""

    async def __call__(self, scope, receive, send):
        if self.prefix and scope["type"] == "http":
            path = scope.get("path", "")
            if path == self.prefix or path.startswith(self.prefix + "/"):
                scope = {**scope, "path": path[len(self.prefix):] or "/", "root_path": self.prefix}
            else:
                err = ApiError(404, "File Not Found", "not_found_error")
                await JSONResponse(err.to_dict(), status_code=404)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error_handler(request: HttpRequest, exc: Exception):
    """An :class:`ApiError` with its headers (``Retry-After`` when the queue is full)."""
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.to_dict(), status_code=exc.code, headers=exc.headers)


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
