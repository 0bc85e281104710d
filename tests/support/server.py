"""A server process for tests: the reference ``llama-server`` (``native/bin``, built by
scripts/build_llama_cpp.sh) or ``llamaspec serve``, on a free loopback port.

:class:`ServerProcess` starts a command with ``--port PORT`` added, its stdout and stderr in a log file, waits
until ``/health`` answers 200 and stops it (a signal, then SIGKILL); a server that exits or is not ready in
time fails with the tail of its log. :func:`running` starts several at once; :func:`llama_server` is llama-server
on the native build's libraries; :class:`Server` is ``llamaspec serve`` on 127.0.0.1, ready once created.
"""
from __future__ import annotations

import contextlib
import http.client
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NATIVE_BIN = REPO / "native" / "bin"
LLAMA_SERVER = NATIVE_BIN / "llama-server"
HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback TCP port nothing listens on (now)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``cmd`` plus ``--port PORT`` (a free port) as a process; ``url`` answers once :meth:`start` returns.

    ``log``: the file that gets its stdout and stderr (None: a temporary file, removed by :meth:`stop`);
    ``env``: its environment (None: this process's); ``stop_signal`` / ``stop_timeout``: how :meth:`stop`
    asks it to end before it kills it (``killed`` says it had to); ``address_space``: its RLIMIT_AS in bytes
    (0: none; a memory blow-up then kills the server, not the machine). A context manager: started on entry,
    stopped on exit."""

    def __init__(self, cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike = REPO,
                 log: Path | None = None, ready_timeout: float = 120.0, stop_signal: int = signal.SIGTERM,
                 stop_timeout: float = 10.0, address_space: int = 0):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = [*map(str, cmd), "--port", str(self.port)]
        self.env, self.cwd = env, cwd
        self.ready_timeout, self.stop_signal, self.stop_timeout = ready_timeout, stop_signal, stop_timeout
        self._temp = log is None
        if log is None:
            fd, name = tempfile.mkstemp(prefix="server-", suffix=".log")
            os.close(fd)
            log = Path(name)
        self.log = Path(log)
        self.address_space = address_space
        self.proc: subprocess.Popen | None = None
        self.killed = False
        self._fh = None

    def launch(self) -> "ServerProcess":
        """Start the process (not waiting for it)."""
        self._fh = open(self.log, "wb")
        limit = self.address_space

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, stdout=self._fh, stderr=subprocess.STDOUT, env=self.env,
                                     preexec_fn=cap if limit > 0 else None)
        return self

    def wait_ready(self) -> "ServerProcess":
        """Poll ``/health`` until it answers 200; RuntimeError with the log's tail when the process exits first
        or is not ready in ``ready_timeout`` seconds."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before /health answered{self._where}:\n"
                                   f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (OSError, http.client.HTTPException):  # not listening yet, or 503 while loading
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready after {self.ready_timeout:g} s{self._where}:\n"
                                   f"{self.tail()}")
            time.sleep(0.1)

    def start(self) -> "ServerProcess":
        """:meth:`launch` and :meth:`wait_ready`; stopped again when it does not come up."""
        self.launch()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def name(self) -> str:
        head = self.cmd[:4] if self.cmd[1:2] == ["-m"] else self.cmd[:1]  # python -m MODULE serve
        return f"{' '.join([Path(head[0]).name, *head[1:]])} on port {self.port}"

    @property
    def _where(self) -> str:
        return "" if self._temp else f" (log {self.log})"

    def tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the log."""
        if self._fh is not None and not self._fh.closed:
            self._fh.flush()
        try:
            return self.log.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> int | None:
        """``stop_signal``, up to ``stop_timeout`` seconds for it to exit, then SIGKILL; its exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.killed = True
        if self._fh is not None:
            self._fh.close()
        if self._temp:
            self.log.unlink(missing_ok=True)
        return None if self.proc is None else self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def running(*servers: ServerProcess):
    """Start ``servers`` together (each loads while the others do), wait for all; stop all on exit."""
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()


def native_env() -> dict[str, str]:
    """This environment with the native build's libraries (``native/lib``) first."""
    return dict(os.environ, LD_LIBRARY_PATH=str(NATIVE_BIN.parent / "lib"))


def llama_server(args: list, server: str | os.PathLike = LLAMA_SERVER, **kw) -> ServerProcess:
    """The reference llama-server with ``args`` on the native build's libraries (not started)."""
    return ServerProcess([server, *args], **{"env": native_env(), **kw})


def serve(args: list, module: str = "llamaspec", **kw) -> ServerProcess:
    """``python -m MODULE serve ARGS`` from the repository root (not started)."""
    return ServerProcess([sys.executable, "-m", module, "serve", *args], **kw)


class Server(ServerProcess):
    """``llamaspec serve`` (or ``exe``'s, e.g. the reference llama-server) on 127.0.0.1 with ``args``, its log
    in ``log``; started and ready once created, :meth:`stop` sends SIGINT (a clean exit is code 0)."""

    def __init__(self, args: list[str], log: Path, exe: list[str] | None = None):
        super().__init__([*(exe or [sys.executable, "-m", "llamaspec.cli.main", "serve"]), "--host", HOST, *args],
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, log=log, stop_signal=signal.SIGINT,
                         stop_timeout=15.0)
        self.start()
