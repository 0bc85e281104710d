"""The guard around native calls that talk to RPC servers: they run on one worker thread, and ggml's
process-global abort hook (``ggml_set_abort_callback``) parks the thread that hit an RPC error instead of
returning into ``abort()``; a failure, or no reply within :data:`DECODE_TIMEOUT_S`, is remembered for the
process and every later call raises :class:`~llamaspec.errors.RpcError` at once. Also the count of models
holding a connection to each server (ggml keeps one per server), which names the servers that are gone.

Part of :mod:`llamaspec._llama.rpc` (use that module).
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import queue
import socket
import sys
import threading
import time
from typing import Callable, Sequence

from ..errors import RpcError
from .log import _router as _log_router
from .rpc_ggml import ggml, setup_lock
from .rpc_protocol import split_endpoint

log = logging.getLogger("llamaspec")

#: seconds one decode (or state save/load, free) over RPC may take before the servers count as stuck
DECODE_TIMEOUT_S = float(os.environ.get("LLAMASPEC_RPC_TIMEOUT", "120"))

_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


class _State:
    def __init__(self) -> None:
        self.failure: str | None = None
        self.message: str | None = None  # the error line, with the servers that are gone (computed once)
        self.cv = threading.Condition()
        self.worker: threading.Thread | None = None
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.abort_cb = None
        #: endpoint -> models loaded on it (ggml holds one connection)
        self.in_use: collections.Counter[str] = collections.Counter()

    def fail(self, why: str) -> None:
        with self.cv:
            if self.failure is None:
                self.failure = why
            self.cv.notify_all()


_state = _State()


def failure() -> str | None:
    """Why RPC failed in this process (None while it works)."""
    return _state.failure


def _refuses(endpoint: str, timeout: float = 0.5) -> bool:
    """True when nothing accepts a TCP connection at ``endpoint`` (a server we are connected to would not
    answer a HELLO: it serves one client at a time, so only the connect tells)."""
    try:
        socket.create_connection(split_endpoint(endpoint), timeout=timeout).close()
        return False
    except OSError:
        return True


def _failure_error(what: str = "") -> RpcError:
    if _state.message is None:
        down = [ep for ep in list(_state.in_use) if _refuses(ep)]
        who = f"RPC server {', '.join(down)} is gone" if down else "an RPC server failed"
        _state.message = (f"{who}: {_state.failure or 'unknown error'}; the models on RPC servers cannot be used any "
                          "more in this process (restart the server and this process)")
    return RpcError(_state.message if not what else f"{_state.message} [during {what}]")


def check_alive(what: str = "") -> None:
    """:class:`RpcError` when an RPC server failed earlier in this process."""
    if _state.failure is not None:
        raise _failure_error(what)


def _on_abort(message: bytes) -> None:  # pragma: no cover - called from C, on the thread that hit the abort
    text = (message or b"").decode("utf-8", errors="replace").strip()
    th = threading.current_thread()
    rpc = "rpc" in text.lower() or th is _state.worker
    if rpc and th is not threading.main_thread():
        short = text.split(": ", 1)[-1] if ": " in text else text
        _state.fail(short)
        try:
            log.debug("ggml abort on an RPC thread, parked instead: %s", text)
        except Exception:  # noqa: BLE001
            pass
        threading.Event().wait()  # never returns: returning would let ggml call abort()
    try:
        sys.stderr.write(f"{text}\n")
    except Exception:  # noqa: BLE001
        pass


def _worker_loop() -> None:
    while True:
        fn, args, box, done = _state.jobs.get()
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            # what llama.cpp logged during the call is the caller's (its error message may quote it)
            _log_router.keep(_log_router.take_errors(), box["caller"])
            done.set()
            with _state.cv:
                _state.cv.notify_all()


def _ensure_worker() -> None:
    with setup_lock:
        if _state.abort_cb is None:
            cb = _ABORT_CB(_on_abort)
            ggml().ggml_set_abort_callback(ctypes.cast(cb, ctypes.c_void_p))
            _state.abort_cb = cb  # keep the trampoline alive for the life of the process
        if _state.worker is None:
            t = threading.Thread(target=_worker_loop, name="llamaspec-rpc", daemon=True)
            t.start()
            _state.worker = t


def call(fn: Callable, *args, what: str = "an RPC call", timeout: float | None = None):
    """Run ``fn(*args)`` (a native call that may talk to RPC servers) on the RPC worker thread and return
    its result. :class:`RpcError` when a server failed (now or before) or ``timeout`` seconds passed."""
    check_alive(what)
    _ensure_worker()
    if threading.current_thread() is _state.worker:
        return fn(*args)
    box: dict = {"caller": threading.get_ident()}
    done = threading.Event()
    _state.jobs.put((fn, args, box, done))
    deadline = None if timeout is None else time.monotonic() + timeout
    with _state.cv:
        while not done.is_set():
            if _state.failure is not None:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                _state.fail(f"no reply from the RPC servers within {timeout:g} s (server stuck, or the network?); "
                            "raise LLAMASPEC_RPC_TIMEOUT if this decode is simply slow")
                break
            _state.cv.wait(0.5 if left is None else min(0.5, left))
    if not done.is_set():
        raise _failure_error(what)
    if "error" in box:
        raise box["error"]
    return box["result"]


def call_or_leak(fn: Callable, *args, what: str = "freeing") -> bool:
    """For frees: run ``fn`` guarded; False (and the native object is left allocated) when RPC failed."""
    if _state.failure is not None:
        log.debug("RPC failed earlier: %s skipped (the native object stays allocated)", what)
        return False
    try:
        call(fn, *args, what=what, timeout=DECODE_TIMEOUT_S)
        return True
    except RpcError as e:
        log.debug("%s skipped: %s", what, e)
        return False



def acquire(endpoints: Sequence[str]) -> None:
    """A model now holds a connection to these servers (the pre-check would block on them)."""
    with setup_lock:
        _state.in_use.update(set(endpoints))


def release(endpoints: Sequence[str]) -> None:
    with setup_lock:
        _state.in_use -= collections.Counter(set(endpoints))  # (keeps the positive counts only)


def connected(endpoint: str) -> bool:
    """Whether a model holds a connection to ``endpoint`` (a connected server would not answer a second client)."""
    return bool(_state.in_use.get(endpoint))
