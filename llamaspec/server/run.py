"""Run the app with uvicorn on a socket bound before anything loads (a busy port is a one-line error).

The model loads in a thread after the server listens, so ``/health`` answers 503 meanwhile; a model that
fails to load stops the server and :func:`serve` raises the loading error. SIGTERM drains: new generations
get 503 (and ``/health`` too) while the running ones have ``--shutdown-timeout`` seconds to finish, then end
with an error event; the process exits 0. A second SIGTERM stops at once; SIGINT stops without a drain.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..errors import LlamaSpecError
from . import cancel
from .app import ServerConfig, ServerState, create_app
from .errors import unavailable
from .protocol import head_buffer_size, protocol_class

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

__all__ = ["serve", "bind", "ServeError"]

log = logging.getLogger("llamaspec.server")

#: seconds uvicorn waits for open connections and tasks once it stops (then it cancels them)
GRACEFUL_S = 3


class ServeError(LlamaSpecError):
    """The server could not listen (address in use, no permission, unknown host)."""


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening socket on ``host:port`` (IPv6 when the host is one; a path ending in ``.sock`` is a UNIX
    socket, as llama-server's ``--host``)."""
    if host.endswith(".sock"):
        return _bind_unix(host)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
    family, _, proto, _, addr = infos[0]
    # The protocol must be IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose
    # proto says TCP, and without it a response written in two parts waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port and hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:  # "::" binds IPv6 only, as llama-server with several addresses
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _bind_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(path).st_mode):  # a stale socket of an earlier run
                os.unlink(path)
        sock.bind(path)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {path}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _hosts(host: str) -> list[str]:
    hosts = [h.strip() for h in host.split(",") if h.strip()]
    if not hosts:
        raise ServeError(f"--host: expected an address (or a comma list), got {host!r}")
    return hosts


def _url(sock: socket.socket, host: str, scheme: str) -> str:
    if host.endswith(".sock"):
        return f"unix:{host}"
    port = sock.getsockname()[1]
    return f"{scheme}://{host if ':' not in host else f'[{host}]'}:{port}"


def serve(config: ServerConfig, loader: Callable[[], "Engine"], *, host: str = "127.0.0.1", port: int = 8080,
          on_ready: Callable[[ServerState, str], None] | None = None, log_level: str = "warning",
          access_log: bool = False, reuse_port: bool = False, ssl_keyfile: str | None = None,
          ssl_certfile: str | None = None) -> None:
    """Serve until interrupted (SIGINT / SIGTERM). Raises the model's loading error, or :class:`ServeError`.
    ``host``: one address or a comma list (each bound on ``port``; ``*.sock`` = a UNIX socket)."""
    import uvicorn

    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ServeError("HTTPS needs both --ssl-key-file and --ssl-cert-file")
    socks: list[socket.socket] = []
    try:
        for h in _hosts(host):
            socks.append(bind(h, port, reuse_port=reuse_port))
    except ServeError:
        for s in socks:
            s.close()
        raise
    scheme = "https" if ssl_certfile else "http"
    url = ", ".join(_url(s, h, scheme) for s, h in zip(socks, _hosts(host)))
    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises SIGINT / SIGTERM after its graceful shutdown; a server stopped that way has
            # done what was asked of it, so the command exits 0
            with super().capture_signals():
                try:
                    yield
                finally:
                    captured = getattr(self, "_captured_signals", None)
                    if isinstance(captured, list):
                        captured.clear()

        def handle_exit(self, sig, frame) -> None:
            # SIGTERM drains (docs/limits.md): new generations get 503 while the running ones have
            # --shutdown-timeout seconds; a second SIGTERM stops at once. SIGINT stops as before. Either way
            # the process is gone within a bound, whatever is still running (_Deadline).
            if drain.begin(sig, self):
                deadline.arm(config.limits.shutdown_timeout + _Drain.GRACE + GRACEFUL_S + 0.5)
                return
            deadline.arm(GRACEFUL_S + 2.0)
            if drain.started is not None:
                self.should_exit = self.force_exit = True
                state.cancel_all()
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            drain.tick(self)
            return await super().on_tick(counter)

    state = ServerState(config)
    drain = _Drain(state, config.limits.shutdown_timeout)
    deadline = _Deadline()
    app = create_app(state, loader=loader)
    limits = config.limits
    server = _Server(uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                                           ws="none", timeout_graceful_shutdown=GRACEFUL_S,
                                           # h11 and asyncio whatever else is installed: httptools lowercases the
                                           # header names (llama-server's clients read Access-Control-Allow-Origin
                                           # and Process-Start-Time-Unix as spelled), and with uvloop + httptools
                                           # no faster request was measured here (interleaved, 1-token requests);
                                           # h11 with the request-head checks and deadlines (server/protocol.py)
                                           http=protocol_class(limits), loop="asyncio", timeout_keep_alive=30,
                                           h11_max_incomplete_event_size=head_buffer_size(limits),
                                           limit_concurrency=limits.max_connections,
                                           ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile))

    def failed(_exc: BaseException) -> None:
        server.should_exit = True

    state.on_load_failed = failed
    if on_ready is not None:
        state.on_ready = lambda st: on_ready(st, url)
    try:
        server.run(sockets=socks)
    finally:
        for s in socks:
            s.close()
        if server.force_exit:  # uvicorn skips the lifespan's shutdown then
            state.shutdown()
    if state.load_error is not None:
        raise state.load_error


class _Deadline:
    """The bound on a stop: once a signal asked the server to stop, the process exits (status 0) at the latest
    ``seconds`` later, even when a worker thread is still busy with work nobody waits for any more (templating
    or tokenising a huge abandoned prompt: a thread cannot be interrupted, and the interpreter would wait for it
    at exit). An earlier deadline replaces a later one."""

    def __init__(self):
        self.at: float | None = None
        self._lock = threading.Lock()

    def arm(self, seconds: float) -> None:
        with self._lock:
            at = time.monotonic() + seconds
            if self.at is not None and self.at <= at:
                return
            self.at = at
        threading.Thread(target=self._wait, args=(at,), name="llamaspec-stop-deadline", daemon=True).start()

    def _wait(self, at: float) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        if self.at != at:  # replaced by an earlier one
            return
        with contextlib.suppress(Exception):
            log.warning("the stop's deadline passed with work still running: exiting now")
            for h in logging.getLogger().handlers + log.handlers:
                h.flush()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


class _Drain:
    """The graceful SIGTERM: :meth:`begin` marks the state draining (``check_accepting`` answers 503 and
    ``/health`` 503), :meth:`tick` (every 0.1 s) lets uvicorn stop once no generation is left, or cancels
    the rest when ``timeout`` passed (each then ends with an error event) and stops a second later."""

    GRACE = 1.0  # seconds the cancelled responses get to send their error event

    def __init__(self, state: ServerState, timeout: float):
        self.state, self.timeout = state, timeout
        self.started: float | None = None
        self.cancelled: float | None = None

    def begin(self, sig: int, server) -> bool:
        """Whether ``sig`` started a drain (a first SIGTERM once the model is loaded)."""
        if sig != signal.SIGTERM or self.started is not None or server.should_exit or not self.state.ready:
            return False
        self.started = time.monotonic()
        self.state.draining = True
        # prompts still being prepared in worker threads would only get the drain's 503: stop them now
        n_work = cancel.cancel_all(unavailable("the server is shutting down"))
        log.warning("SIGTERM: draining (%d request(s) running, %d being prepared; at most %.0f s); a second "
                    "SIGTERM stops at once", self.state.n_groups, n_work, self.timeout)
        return True

    def tick(self, server) -> None:
        if self.started is None or server.should_exit:
            return
        now = time.monotonic()
        if self.state.n_groups == 0:
            server.should_exit = True
        elif self.cancelled is None and now - self.started >= self.timeout:
            log.warning("drain timeout: ending %d request(s) with an error", self.state.n_groups)
            self.state.cancel_all()
            self.cancelled = now
        elif self.cancelled is not None and now - self.cancelled >= self.GRACE:
            server.should_exit = True
