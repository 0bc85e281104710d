"""Run the app with uvicorn on a socket bound before anything loads (a busy port is a one-line error).

The model loads in a thread after the server listens, so ``/health`` answers 503 meanwhile; a model that
fails to load stops the server and :func:`serve` raises the loading error.
"""
from __future__ import annotations

import contextlib
import socket
from typing import TYPE_CHECKING, Callable

from ..errors import LlamaSpecError
from .app import ServerConfig, ServerState, create_app

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

__all__ = ["serve", "bind", "ServeError"]


class ServeError(LlamaSpecError):
    """The server could not listen (address in use, no permission, unknown host)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host is one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(config: ServerConfig, loader: Callable[[], "Engine"], *, host: str = "127.0.0.1", port: int = 8080,
          on_ready: Callable[[ServerState, str], None] | None = None, log_level: str = "warning",
          access_log: bool = False) -> None:
    """Serve until interrupted (SIGINT / SIGTERM). Raises the model's loading error, or :class:`ServeError`."""
    import uvicorn

    sock = bind(host, port)
    real_port = sock.getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{real_port}"
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

    state = ServerState(config)
    app = create_app(state, loader=loader)
    server = _Server(uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                                           ws="none", timeout_graceful_shutdown=3, timeout_keep_alive=30))

    def failed(_exc: BaseException) -> None:
        server.should_exit = True

    state.on_load_failed = failed
    if on_ready is not None:
        state.on_ready = lambda st: on_ready(st, url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if state.load_error is not None:
        raise state.load_error
