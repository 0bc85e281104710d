"""Local ``ggml-rpc-server`` processes for tests and benchmarks (issue 13).

:class:`RpcServers` starts N servers on free loopback ports and stops them again; :func:`rpc_build` says
where a llama.cpp library with RPC and the server binary are, or why they are not there (a skip reason).
Nothing here imports llama_cpp: the library is chosen when llama_cpp is first imported, so RPC code runs
in a child process with ``LLAMA_CPP_LIB_PATH`` set (:func:`child_env`).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from .server import free_port

REPO = Path(__file__).resolve().parents[2]
SERVER_NAMES = ("ggml-rpc-server", "rpc-server")


def _has_rpc_lib(d: Path) -> bool:
    return any((d / f"libggml-rpc{ext}").exists() for ext in (".so", ".dylib", ".dll")) and \
        any((d / f"libllama{ext}").exists() for ext in (".so", ".dylib", ".dll"))


def rpc_build(native_dir: str | os.PathLike | None = None) -> tuple[Path | None, Path | None, str]:
    """``(library dir, server binary, why not)``: the RPC library is ``$LLAMA_CPP_LIB_PATH`` when it holds
    ``libggml-rpc``, else ``NATIVE/lib`` (``NATIVE``: ``native_dir``, ``$LLAMASPEC_NATIVE_DIR`` or the
    checkout's ``native/``); the server is ``NATIVE/bin/ggml-rpc-server``. ``why`` is empty when both exist."""
    native = Path(native_dir or os.environ.get("LLAMASPEC_NATIVE_DIR") or REPO / "native")
    lib = None
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    for d in ([Path(env)] if env else []) + [native / "lib"]:
        if _has_rpc_lib(d):
            lib = d
            break
    server = next((native / "bin" / n for n in SERVER_NAMES if (native / "bin" / n).is_file()), None)
    if server is None:
        found = next((shutil.which(n) for n in SERVER_NAMES if shutil.which(n)), None)
        server = Path(found) if found else None
    why = []
    if lib is None:
        why.append(f"no llama.cpp library with RPC (LLAMA_CPP_LIB_PATH={env or 'unset'}, {native / 'lib'})")
    if server is None:
        why.append(f"no ggml-rpc-server ({native / 'bin'})")
    if why:
        why.append("build them with scripts/build_llama_cpp.sh --rpc")
    return lib, server, "; ".join(why)


def child_env(lib_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process that must load the RPC library."""
    env = dict(os.environ)
    env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


class RpcServers:
    """``n`` ggml-rpc-server processes on 127.0.0.1 (CPU device, ``threads`` each); a context manager."""

    def __init__(self, server: str | os.PathLike, n: int = 2, *, threads: int = 1, log_dir: str | os.PathLike | None = None,
                 startup_timeout: float = 30.0):
        self.server = Path(server)
        self.threads = threads
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen] = []
        self.log_dir = Path(log_dir) if log_dir else None
        self.startup_timeout = startup_timeout

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self) -> "RpcServers":
        for i, port in enumerate(self.ports):
            out = open(self.log_dir / f"rpc-{port}.log", "wb") if self.log_dir else subprocess.DEVNULL
            self.procs.append(subprocess.Popen([str(self.server), "-H", "127.0.0.1", "-p", str(port), "-t", str(self.threads)],
                                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + self.startup_timeout
        for p, port in zip(self.procs, self.ports):
            while True:
                if p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"ggml-rpc-server on port {port} exited with {p.returncode}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"ggml-rpc-server on port {port} did not listen within {self.startup_timeout:g} s")
                    time.sleep(0.1)
        return self

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` (a crash, as far as the client can tell)."""
        p = self.procs[i]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def __enter__(self) -> "RpcServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
