"""How much work one request, and the whole server, may ask for (``llamaspec serve``'s ``--max-*`` flags).

* prompts x ``n`` per request: ``--max-request-generations`` (64); over it a 400 ``invalid_request_error``
* generations queued or running, server-wide: ``--max-queued-generations`` (1024); a 503 ``unavailable_error``
  with ``Retry-After``
* prompt text per request (every prompt, or every message, together): ``--max-prompt-chars`` (1048576); 400
* stop strings per request: ``--max-stop`` (16); characters per stop string: ``--max-stop-chars`` (1024); 400
* JSON nesting of a body: ``--max-json-depth`` (64); 400 naming the top-level field
* alternatives a request's grammar (``grammar``, a JSON schema, a forced tool call's) has open at once:
  ``--max-grammar-alternatives`` (512, 0 = none; llamaspec._llama.grammar_cost); 400 naming the field
* the request body: ``--max-body-size`` (8388608 bytes), counted while it arrives; 413
* the request head (:mod:`llamaspec.server.protocol`, before any route): the URL ``--max-url-bytes`` (8192; 414),
  the header lines ``--max-header-bytes`` (16384 together; 431) and ``--max-headers`` (100; 431), its head and
  its body each within ``--timeout`` seconds (600; 408); open connections ``--max-connections`` (1024; 503)

Prompt tokens are bounded by the slot's context (400 ``exceed_context_size_error``). docs/limits.md says
the same for users. Every message names the limit, the value and the flag.

>>> check_depth('{"prompt": [[1]]}', 3)
>>> check_depth('{"a": 1, "prompt": [[[1]]]}', 3)
Traceback (most recent call last):
...
llamaspec.server.errors.ApiError: Field 'prompt': the body nests 4 levels deep, over the limit of 3 (--max-json-depth)
>>> check_text({"prompt": ["ok", "a\\ud800"]})
Traceback (most recent call last):
...
llamaspec.server.errors.ApiError: Field 'prompt[1]': the text holds a lone UTF-16 surrogate (\\ud800) at character 1, which is not valid Unicode: send the character itself or a complete surrogate pair
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest

from .._llama.grammar_limits import MAX_ALTERNATIVES
from .errors import ApiError, invalid

__all__ = ["Limits", "Admission", "parse_json", "check_depth", "check_text", "check_generations", "check_chars",
           "over", "body_too_large", "queue_full", "read_body"]


@dataclass(frozen=True)
class Limits:
    """The server's bounds (see the module docstring)."""

    max_request_generations: int = 64
    max_queued_generations: int = 1024
    max_prompt_chars: int = 1 << 20
    max_stop: int = 16
    max_stop_chars: int = 1024
    max_json_depth: int = 64
    max_body_size: int = 8 << 20
    #: alternatives a request's grammar may have open at once; 0 = no limit
    max_grammar_alternatives: int = MAX_ALTERNATIVES
    #: bytes of a request's URL (its request target), of its header lines together, and how many header lines
    max_url_bytes: int = 8192
    max_header_bytes: int = 16384
    max_headers: int = 100
    #: seconds a request's head, and then its body, may take to arrive (llama-server's --timeout); 0 = no limit
    timeout: float = 600.0
    #: connections open at once (uvicorn's limit_concurrency: past it 503)
    max_connections: int = 1024
    #: seconds a SIGTERM waits for running requests before it ends them with an error event
    shutdown_timeout: float = 10.0
    #: seconds a client is told to wait when the queue is full
    retry_after: int = 1


def over(what: str, limit: int, name: str, *, field: str | None = None) -> ApiError:
    """400 naming the field (when there is one), what was asked, the limit and its flag (the limit's name:
    ``max_stop`` is ``--max-stop``)."""
    head = f"Field '{field}': " if field else ""
    return invalid(f"{head}{what}, over the limit of {limit} (--{name.replace('_', '-')})")


def body_too_large(n: int | None, limit: int) -> ApiError:
    got = f"{n} bytes" if n is not None else "more bytes than that"
    return ApiError(413, f"the request body has {got}, over the limit of {limit} bytes (--max-body-size)",
                    "invalid_request_error")


def queue_full(n_busy: int, n_new: int, limit: int, retry_after: int) -> ApiError:
    return ApiError(503, f"the server has {n_busy} generations queued or running and this request adds {n_new}, "
                         f"over the limit of {limit} (--max-queued-generations); retry later",
                    "unavailable_error", headers={"Retry-After": str(retry_after)})


def check_generations(n_prompts: int, n_cmpl: int, limits: Limits) -> None:
    """400 when prompts x ``n`` is over ``--max-request-generations``."""
    if n_prompts * n_cmpl > limits.max_request_generations:
        raise over(f"this request asks for {n_prompts * n_cmpl} generations ({n_prompts} prompts x n = {n_cmpl})",
                   limits.max_request_generations, "max_request_generations")


def check_chars(field: str, n: int, limits: Limits) -> None:
    """400 when ``n`` characters of prompt text are over ``--max-prompt-chars``."""
    if n > limits.max_prompt_chars:
        raise over(f"{n} characters of prompt text", limits.max_prompt_chars, "max_prompt_chars", field=field)


class Admission:
    """Generations queued or running, server-wide (any thread): :meth:`reserve` before submitting,
    :meth:`release` once the HTTP request is over."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.n = 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> None:
        lim = self.limits
        with self._lock:
            if self.n + n > lim.max_queued_generations:
                raise queue_full(self.n, n, lim.max_queued_generations, lim.retry_after)
            self.n += n

    def release(self, n: int) -> None:
        with self._lock:
            self.n = max(0, self.n - n)


# ---------------------------------------------------------------------------------------------------
# JSON depth: measured on the text before parsing (the parser recurses), without recursion
# ---------------------------------------------------------------------------------------------------
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{}]', re.S)


def _key(s: str) -> str:
    try:
        k = json.loads(s)
    except ValueError:
        return s[1:-1]
    return json.dumps(k)[1:-1]  # ASCII: a key with a lone surrogate must not reach the UTF-8 encoder


def check_depth(text: str, limit: int) -> None:
    """400 when ``text`` (a JSON document) nests deeper than ``limit``; the message names the top-level
    field it happens in. Quick when the text has no more than ``limit`` brackets."""
    if text.count("[") + text.count("{") <= limit:
        return
    depth, key = 0, None
    for m in _TOKENS.finditer(text):
        tok = m.group(0)
        c = tok[0]
        if c == '"':
            if depth == 1 and m.group(1):
                key = _key(tok[: len(tok) - len(m.group(1))])
        elif c in "[{":
            depth += 1
            if depth > limit:
                raise over(f"the body nests {depth} levels deep", limit, "max_json_depth",
                           field=key if key is not None else None)
        else:
            depth -= 1
            if depth == 0:
                key = None


# ---------------------------------------------------------------------------------------------------
# text: lone surrogates ("\ud800" is valid JSON, but no text: it cannot be encoded as UTF-8)
# ---------------------------------------------------------------------------------------------------
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def maybe_surrogates(text: str) -> bool:
    """Whether the JSON text ``text`` may decode to a string with a lone surrogate (a ``\\uD8xx``-style
    escape; a valid UTF-8 text holds none otherwise)."""
    return _SURROGATE_ESCAPE.search(text) is not None


def check_text(data: Any) -> None:
    """400 naming the first string (value or key) of ``data`` that holds a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m is not None:
                raise invalid(f"Field '{path or 'body'}': the text holds a lone UTF-16 surrogate "
                              f"({json.dumps(m.group(0))[1:-1]}) at character {m.start()}, which is not valid "
                              "Unicode: send the character itself or a complete surrogate pair")
        elif isinstance(v, dict):
            for k in reversed(list(v)):
                name = f"{path}.{_key(json.dumps(k))}" if path else _key(json.dumps(k))
                if _SURROGATE.search(k):
                    stack.append((name, k))
                else:
                    stack.append((name, v[k]))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))) if isinstance(x, (str, list, dict)))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: one decoder for every body (``json.loads`` with an option builds a new decoder per call)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def parse_json(raw: bytes, limits: Limits | None = None) -> dict:
    """The request body as a JSON object, or 400: not UTF-8, not JSON (NaN / Infinity are not JSON), nested
    deeper than ``--max-json-depth``, or a string with a lone surrogate (the message names the field)."""
    limits = limits or Limits()
    if not raw.strip():
        raise invalid("the request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start}: "
                      f"{e.reason})") from None
    check_depth(text, limits.max_json_depth)
    try:
        data = _DECODER.decode(text)
    except RecursionError:
        raise over("the body nests too deep to parse", limits.max_json_depth, "max_json_depth") from None
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, got {type(data).__name__}")
    if maybe_surrogates(text):
        check_text(data)
    return data


#: bytes of a body over ``--max-body-size`` read and dropped before the 413 (a client still writing its body
#: when the server answers and closes gets a connection reset instead of the answer); past them the 413 goes
#: out at once and the connection closes
DRAIN_BYTES = 64 << 20


async def _drain(chunks, n: int) -> None:
    """Read and drop the rest of a body, ``n`` bytes of it already counted, up to :data:`DRAIN_BYTES`."""
    try:
        async for chunk in chunks:
            n += len(chunk)
            if n > DRAIN_BYTES:
                return
    except ClientDisconnect:
        return


async def read_body(request: HttpRequest, limits: Limits) -> bytes:
    """The request's body, read no further than ``--max-body-size`` (413 past it, from ``Content-Length``
    when the client sent one, else while the body arrives; the rest drained first, up to :data:`DRAIN_BYTES`,
    so that the client reads the answer); 400 when the client left before sending it."""
    limit = limits.max_body_size
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        if int(length) <= DRAIN_BYTES:
            await _drain(request.stream(), 0)
        raise body_too_large(int(length), limit)
    parts, n = [], 0
    chunks = request.stream()
    try:
        async for chunk in chunks:
            n += len(chunk)
            if n > limit:
                await _drain(chunks, n)
                raise body_too_large(None, limit)
            parts.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nobody reads the answer
        raise ApiError(400, "the client disconnected before sending the whole body") from None
    return b"".join(parts)
