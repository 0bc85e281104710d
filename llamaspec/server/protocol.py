"""The HTTP/1.1 connection of ``llamaspec serve``: uvicorn's h11 protocol with a web server's checks on what a
client sends before any route runs (docs/limits.md, "The connection").

* a request head over h11's buffer (``--max-url-bytes`` + ``--max-header-bytes``, h11's own
  ``max_incomplete_event_size``, for a head that arrives in parts), a URL over ``--max-url-bytes`` (414),
  header lines over ``--max-header-bytes`` together or more than ``--max-headers`` of them (431), checked on
  every request h11 parses (a head that arrives at once is never measured by h11);
* ``Content-Length`` together with ``Transfer-Encoding`` (RFC 9112 6.1: a request a proxy in front may frame
  otherwise, the request-smuggling pattern): 400;
* ``--timeout`` seconds for a request's head (from the connection, or the end of the previous response) and as
  many for its body (from the end of its head): past them 408 and the connection is closed (slowloris), a
  connection that sent nothing is closed without an answer.

Every refusal is an error in llama-server's shape with ``Connection: close``, and the connection is closed:
what followed on it (a pipelined, or smuggled, request) is never read.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:  # pragma: no cover
    from .limits import Limits

__all__ = ["protocol_class", "head_buffer_size", "check_head"]

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 414: b"URI Too Long", 431: b"Request Header Fields Too Large"}


def head_buffer_size(limits: "Limits") -> int:
    """h11's ``max_incomplete_event_size``: the longest request head it buffers while it arrives (a request line
    of the longest URL, every header byte allowed, and room for the method, version and line ends)."""
    return limits.max_url_bytes + limits.max_header_bytes + 1024


def check_head(event: h11.Request, limits: "Limits") -> tuple[int, str] | None:
    """``(status, message)`` when the request head ``event`` is refused, else None.

    >>> from llamaspec.server.limits import Limits
    >>> lim = Limits(max_url_bytes=16, max_header_bytes=64, max_headers=3)
    >>> req = lambda target="/", headers=(): h11.Request(method="GET", target=target, headers=[("Host", "x"), *headers])
    >>> check_head(req(), lim) is None
    True
    >>> check_head(req("/" + "a" * 20), lim)
    (414, 'the request URL has 21 bytes, over the limit of 16 (--max-url-bytes)')
    >>> check_head(req(headers=[("a", "1")] * 3), lim)[0], check_head(req(headers=[("x", "y" * 60)]), lim)[0]
    (431, 431)
    >>> check_head(req(headers=[("Content-Length", "5"), ("Transfer-Encoding", "chunked")]), lim)[0]
    400
    """
    if len(event.target) > limits.max_url_bytes:
        return 414, f"the request URL has {len(event.target)} bytes, over the limit of {limits.max_url_bytes} (--max-url-bytes)"
    headers = event.headers
    if len(headers) > limits.max_headers:
        return 431, f"the request has {len(headers)} header lines, over the limit of {limits.max_headers} (--max-headers)"
    size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
    if size > limits.max_header_bytes:
        return 431, (f"the request's header lines have {size} bytes, over the limit of {limits.max_header_bytes} "
                     "(--max-header-bytes)")
    names = {k for k, _ in headers}  # h11 lowercases them
    if b"content-length" in names and b"transfer-encoding" in names:
        return 400, ("the request has both Content-Length and Transfer-Encoding: its body has two framings "
                     "(RFC 9112 6.1); send one of them")
    return None


class _Connection(h11.Connection):
    """h11's server connection that checks each request head (:func:`check_head`) and remembers why it refused
    a request (``refusal``: the status and message the answer carries)."""

    def __init__(self, limits: "Limits"):
        super().__init__(h11.SERVER, max_incomplete_event_size=head_buffer_size(limits))
        self.limits = limits
        self.refusal: tuple[int, str] | None = None

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            if self.refusal is None:
                status = e.error_status_hint if e.error_status_hint in _REASONS else 400
                if status == 431 and b"\n" not in self.trailing_data[0]:  # still in the request line
                    status, msg = 414, f"the request URL is over {self.limits.max_url_bytes} bytes (--max-url-bytes)"
                elif status == 431:
                    msg = (f"the request head is over {head_buffer_size(self.limits)} bytes (--max-url-bytes "
                           "+ --max-header-bytes)")
                else:
                    msg = f"invalid HTTP request: {e}"
                self.refusal = (status, msg)
            raise
        if type(event) is h11.Request:
            why = check_head(event, self.limits)
            if why is not None:
                self.refusal = why
                raise h11.RemoteProtocolError(why[1], why[0])
        return event


def _answer(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with a llama-server error body and ``Connection: close``."""
    body = json.dumps({"error": {"code": status, "message": message, "type": "invalid_request_error"}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, _REASONS.get(status, b"Error"), len(body))) + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :func:`check_head` on every request and the ``--timeout`` deadlines of a
    request's head and body (see the module docstring). ``limits`` is set by :func:`protocol_class`."""

    limits: "Limits"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self.limits)  # (nothing has used uvicorn's yet)
        self._deadline = None  # the timer of the phase below
        self._phase: str | None = None  # "head" / "body": what the client has yet to send

    # -- the refusals ------------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn when h11 (or :class:`_Connection`) refused what the client sent: the answer, then
        the connection closes (nothing more is read from it)."""
        status, message = self.conn.refusal or (400, msg)
        self._refuse(status, message)

    def _refuse(self, status: int, message: str) -> None:
        self._stop_deadline()
        self._phase = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the route (if one runs) hears http.disconnect; its answer goes nowhere
            self.cycle.message_event.set()
        if not self.transport.is_closing():
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_answer(status, message))
            self.transport.close()

    # -- the deadlines -----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc) -> None:
        self._stop_deadline()
        self._phase = None
        super().connection_lost(exc)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _track(self) -> None:
        """Start the deadline of what the client is to send now (its next head, or its body), once per phase."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        self._stop_deadline()
        self._phase = phase
        if phase is not None and self.limits.timeout > 0:
            self._deadline = self.loop.call_later(self.limits.timeout, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self._phase != phase or self.transport.is_closing():
            return
        t = f"{self.limits.timeout:g}"
        if phase == "head" and not self.conn.trailing_data[0]:  # nothing sent: an idle connection, closed
            self._phase = None
            self.transport.close()
            return
        what = "request head" if phase == "head" else "request body"
        self._refuse(408, f"the {what} did not arrive within {t} s (--timeout)")


def protocol_class(limits: "Limits") -> type[LimitedH11Protocol]:
    """The protocol class uvicorn is given (``uvicorn.Config(http=...)``), bound to ``limits``."""
    return type("LlamaspecH11Protocol", (LimitedH11Protocol,), {"limits": limits})
