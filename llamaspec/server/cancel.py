"""Work in a worker thread stops when nobody waits for it any more (issue 36).

:func:`~llamaspec.server.jobs.in_worker` given the HTTP request watches its ASGI ``receive`` for
``http.disconnect`` while the worker runs, and sets the work's :class:`Flag`; a SIGTERM's drain sets every flag
(the work's answer would be a 503 anyway). The long loops of that work (the Responses API's input items, the chat
messages, the special-token count of a prompt, ``/tokenize``'s pieces) call :func:`check` every few thousand
items: it raises :class:`Abandoned`, a ``BaseException`` so that no ``except Exception`` on the way (a template
falling back to another renderer) swallows it, and ``in_worker`` answers with the flag's error. A native call
(llama.cpp tokenising a prompt) cannot be interrupted: it is bounded before it starts instead
(:mod:`llamaspec.server.prompt_bound`).
"""
from __future__ import annotations

import contextvars
import logging
import threading
import weakref

from .errors import ApiError

log = logging.getLogger("llamaspec.server")

#: how often the loops look at their flag (items between two checks)
EVERY = 4096


class Abandoned(BaseException):
    """The work's client went away (or the server is stopping): stop it."""

    def __init__(self, error: ApiError):
        super().__init__(error.message)
        self.error = error


class Flag:
    """Set once the work of one request is abandoned; ``error`` is its answer then."""

    __slots__ = ("_event", "error", "__weakref__")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: ApiError | None = None

    def set(self, error: ApiError) -> None:
        if self.error is None:
            self.error = error
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


_current: contextvars.ContextVar[Flag | None] = contextvars.ContextVar("llamaspec_cancel", default=None)
_live: "weakref.WeakSet[Flag]" = weakref.WeakSet()
_lock = threading.Lock()
#: works stopped early since the process started (a test and /metrics-style probes read it)
stopped = 0


def current() -> Flag | None:
    return _current.get()


def check() -> None:
    """Raise :class:`Abandoned` when the work running in this thread was abandoned (no-op elsewhere)."""
    flag = _current.get()
    if flag is not None and flag.is_set():
        raise Abandoned(flag.error or ApiError(400, "the work was abandoned"))


def run_flagged(flag: Flag, fn, *args):
    """``fn(*args)`` with ``flag`` as this thread's flag (what :func:`check` reads)."""
    token = _current.set(flag)
    try:
        return fn(*args)
    finally:
        _current.reset(token)


def register(flag: Flag) -> None:
    with _lock:
        _live.add(flag)


def note_stopped(what: str, error: ApiError) -> None:
    """Count and log one work stopped early."""
    global stopped
    with _lock:
        stopped += 1
    log.warning("abandoned work stopped: %s (%s)", what, error.message)


def cancel_all(error: ApiError) -> int:
    """Set every live flag (a SIGTERM's drain); how many."""
    with _lock:
        flags = list(_live)
    for f in flags:
        f.set(error)
    return len(flags)


def client_gone() -> ApiError:
    return ApiError(400, "the client disconnected before the answer was ready")
