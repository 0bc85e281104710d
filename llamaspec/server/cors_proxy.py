"""``GET`` / ``POST /cors-proxy?url=...``: llama-server's CORS proxy for its web UI's MCP clients
(``--ui-mcp-proxy``, off by default: then a 403 ``feature_disabled``, so the server is never an open proxy).

The target is an ``http://`` or ``https://`` URL without credentials. Nothing of the client's own request
headers is forwarded (its ``Authorization``, ``X-Api-Key``, cookies stay here) except those it names
explicitly: ``X-Llama-Server-Proxy-Header-NAME: value`` is sent as ``NAME: value`` (``Accept-Encoding``,
``Transfer-Encoding`` and ``Content-Length`` are left out, the body is sent as it came). The target's status,
headers (less ``Server``, ``Date``, ``Transfer-Encoding``, ``Content-Length``, ``Keep-Alive`` and its
``Access-Control-*``) and body come back as they arrive (a stream stays a stream). A redirect is followed (as
llama-server's client does) only to a URL that passes the same check as the client's (a 502 naming the redirect
otherwise), and an ``Authorization`` / ``Cookie`` header the client named is not sent to another host. The proxy
ignores the ``*_proxy`` environment variables. With ``--api-key`` the route needs the key, as every other one.
"""
from __future__ import annotations

import logging
import urllib.error
import urllib.request
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse

from .errors import ApiError, invalid
from .limits import read_body

if TYPE_CHECKING:  # pragma: no cover
    from .state import ServerState

__all__ = ["cors_proxy", "PROXY_HEADER_PREFIX"]

log = logging.getLogger("llamaspec.server")

PROXY_HEADER_PREFIX = "x-llama-server-proxy-header-"
_NOT_FORWARDED = ("accept-encoding", "transfer-encoding", "content-length", "host")
_NOT_RETURNED = ("server", "date", "transfer-encoding", "content-length", "keep-alive", "connection")
#: seconds to wait for the target (llama-server: 10 minutes)
TIMEOUT = 600.0
_CHUNK = 65536


def _target(url: str | None) -> str:
    if not url:
        raise invalid("Query parameter 'url': give the URL to proxy (/cors-proxy?url=https://...)")
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as e:
        raise invalid(f"Query parameter 'url': not a URL ({e})") from None
    if parts.scheme not in ("http", "https"):
        raise invalid(f"Query parameter 'url': unsupported URL scheme {parts.scheme!r} (http or https)")
    if not host:
        raise invalid("Query parameter 'url': invalid target URL: missing host")
    if parts.username is not None or parts.password is not None:
        raise invalid("Query parameter 'url': authentication in the target URL is not supported")
    return url


def forwarded_headers(headers) -> dict[str, str]:
    """The headers the target gets: only the client's ``X-Llama-Server-Proxy-Header-*`` ones, unprefixed.

    >>> forwarded_headers({"Authorization": "Bearer k", "x-llama-server-proxy-header-accept": "text/plain"})
    {'accept': 'text/plain'}
    """
    out: dict[str, str] = {}
    for key, value in headers.items():
        low = key.lower()
        if not low.startswith(PROXY_HEADER_PREFIX):
            continue
        name = key[len(PROXY_HEADER_PREFIX):]
        if name and name.lower() not in _NOT_FORWARDED:
            out[name] = value
    return out


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, each new URL checked as the client's was (:func:`_target`)."""

    def http_error_302(self, req, fp, code, msg, headers):
        location = headers.get("location") or headers.get("uri")
        if location:
            try:
                _target(urljoin(req.full_url, location))
            except ApiError as e:
                fp.close()
                why = e.message.split(": ", 1)[-1]
                raise ApiError(502, f"proxy error: the target's redirect ({code}) is not followed: {why}",
                               "server_error") from None
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urlsplit(newurl).netloc != urlsplit(req.full_url).netloc:
            for name in ("Authorization", "Cookie"):  # the client's credentials stay with the host it named
                new.headers.pop(name, None)
                new.headers.pop(name.capitalize(), None)
        return new


def _open(method: str, url: str, headers: dict[str, str], body: bytes):
    """The target's response (an error status is a response too); ApiError 502 when it cannot be reached."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),  # never an environment proxy
                                         _CheckedRedirects())
    req = urllib.request.Request(url, data=body if method == "POST" else None, headers=headers, method=method)
    try:
        return opener.open(req, timeout=TIMEOUT)
    except urllib.error.HTTPError as e:
        return e
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ApiError(502, f"proxy error: the target could not be reached ({reason})", "server_error") from None


async def cors_proxy(request: HttpRequest):
    state: "ServerState" = request.app.state.llamaspec
    if not state.config.mcp_proxy:
        return JSONResponse({"error": {"code": 403, "message": "this feature is disabled (start the server with "
                                                               "--ui-mcp-proxy to enable /cors-proxy)",
                                       "type": "feature_disabled"}}, status_code=403)
    url = _target(request.query_params.get("url"))
    body = await read_body(request, state.config.limits) if request.method == "POST" else b""
    headers = forwarded_headers(request.headers)
    log.info("proxying %s request to %s", request.method, url)
    resp = await anyio.to_thread.run_sync(_open, request.method, url, headers, body)
    status = getattr(resp, "status", None) or resp.getcode()
    out_headers = {k: v for k, v in resp.headers.items()
                   if k.lower() not in _NOT_RETURNED and not k.lower().startswith("access-control-")}
    media_type = out_headers.pop("Content-Type", None) or out_headers.pop("content-type", None)

    async def stream():
        try:
            while True:
                data = await anyio.to_thread.run_sync(resp.read1 if hasattr(resp, "read1") else resp.read, _CHUNK)
                if not data:
                    return
                yield data
        except OSError as e:
            log.warning("cors-proxy: reading from %s failed: %s", url, e)
        finally:
            resp.close()

    return StreamingResponse(stream(), status_code=status, headers=out_headers, media_type=media_type)
