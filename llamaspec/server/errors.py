"""HTTP errors in llama-server's shape: ``{"error": {"code", "message", "type"}}`` (+ extra fields).

llama-server's type -> code table (``tools/server/server-common.cpp`` ``format_error_response``). Every
client error is a 4xx: the ``openai`` client retries 408/409/429/5xx, so a bad request must never be a 500.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import EngineClosedError, LlamaSpecError, SamplerError, UsageError

#: llama-server's error types and their HTTP codes
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP status ``code``."""

    def __init__(self, code: int, message: str, type: str | None = None, *,  # noqa: A002 - llama-server's name
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.code = code
        self.message = message
        self.type = type or TYPES.get(code, "invalid_request_error")
        #: HTTP headers of the answer (``Retry-After`` for a full queue)
        self.headers = headers
        self.extra = extra

    def to_dict(self) -> dict:
        return {"error": self.error_object()}

    def error_object(self) -> dict:
        return {"code": self.code, "message": self.message, "type": self.type, **self.extra}


def show(v: Any) -> str:
    """A request's value as a message quotes it: its JSON, cut at 60 characters."""
    s = json.dumps(v, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


def invalid(message: str) -> ApiError:
    """400 ``invalid_request_error``."""
    return ApiError(400, message, "invalid_request_error")


def exceed_context(n_prompt_tokens: int, n_ctx: int) -> ApiError:
    """400 ``exceed_context_size_error`` (llama-server's message and extra fields)."""
    return ApiError(400, f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), "
                         "try increasing it", "exceed_context_size_error", n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)


def not_supported(message: str) -> ApiError:
    """501 ``not_supported_error``."""
    return ApiError(501, message, "not_supported_error")


def unavailable(message: str = "Loading model") -> ApiError:
    """503 ``unavailable_error`` (llama-server's answer while the model loads)."""
    return ApiError(503, message, "unavailable_error")


def invalid_api_key() -> ApiError:
    return ApiError(401, "Invalid API Key", "authentication_error")


def api_error(e: BaseException) -> BaseException:
    """The answer to a library error: a 400 for a bad request (:class:`UsageError`, :class:`SamplerError`), a 503
    once the engine is closed, a 500 for any other :class:`LlamaSpecError`; anything else is returned as it is."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (UsageError, SamplerError)):
        return invalid(str(e))
    if isinstance(e, EngineClosedError):
        return unavailable("the server is shutting down")
    if isinstance(e, LlamaSpecError):
        return ApiError(500, str(e), "server_error")
    return e
