"""llama.cpp's backend start-up and its log lines, routed into :mod:`logging`.

llama.cpp logs in fragments through one process-wide callback. :class:`_LogRouter` joins them into lines,
hands them to the ``llamaspec.llama_cpp`` logger and keeps the last WARNING/ERROR lines of each thread, so that
a failed call can say *why* it failed (:func:`_last_native_error`) with the lines its own thread logged: never
another request's (a failed slot restore's line in a later grammar error).
"""
from __future__ import annotations

import ctypes
import logging
import re
import threading

# (llama_cpp/__init__ imports the high-level Llama class, which installs its own log callback that
# prints to stderr; ours replaces it in ``backend_init``)
from llama_cpp import llama_cpp as native

_native_log = logging.getLogger("llamaspec.llama_cpp")

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the previous line)
_GGML_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_GGML_LOG_CONT = 5


class _LogRouter:
    """Routes llama.cpp's log lines into ``logging`` and remembers the last error lines.

    llama.cpp logs in fragments (level CONT = 5 continues the previous line); fragments are joined until a
    newline. The last few WARNING/ERROR lines of each thread are kept (llama.cpp logs on the thread of the call
    that fails) so that a failed call can say *why* it failed.

    The callback can run inside itself on one thread: any allocation in it may start the garbage collector,
    whose finalizers (an unclosed ``Llama``, a context) free native objects that log. The lock is therefore
    re-entrant, and lines are handed to ``logging`` after it is released.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._level = logging.INFO
        #: thread ident -> its last WARNING/ERROR lines (at most KEEP threads: the oldest are forgotten)
        self._errors: dict[int, list[str]] = {}
        self._lock = threading.RLock()

        @native.llama_log_callback
        def _cb(level: int, text: bytes, user_data) -> None:  # pragma: no cover - called from C
            try:
                self.feed(int(level), text.decode("utf-8", errors="replace") if text else "")
            except Exception:  # never raise into C
                pass

        self.callback = _cb

    def feed(self, level: int, text: str) -> None:
        lines = []
        with self._lock:
            if level != _GGML_LOG_CONT:
                self._level = _GGML_LEVELS.get(level, logging.DEBUG)
            self._buf += text
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                if line.strip():
                    lines.append((self._level, line))
                    if self._level >= logging.WARNING:
                        self.keep([line.strip()])
        for lvl, line in lines:
            if _native_log.isEnabledFor(lvl):
                _native_log.log(lvl, "%s", line)

    KEEP = 64  # threads whose lines are kept

    def keep(self, lines: list[str], ident: int | None = None) -> None:
        """Remember ``lines`` for thread ``ident`` (default: this one; the RPC worker hands its calls' lines
        to their callers)."""
        if not lines:
            return
        with self._lock:
            key = threading.get_ident() if ident is None else ident
            mine = self._errors.pop(key, [])  # (re-inserted: the dict's order is the threads' last lines)
            mine.extend(lines)
            del mine[:-8]
            self._errors[key] = mine
            while len(self._errors) > self.KEEP:
                del self._errors[next(iter(self._errors))]

    def take_errors(self) -> list[str]:
        """The calling thread's remembered lines (and forget them)."""
        with self._lock:
            return self._errors.pop(threading.get_ident(), [])


_router = _LogRouter()
_backend_ready = False
_backend_lock = threading.Lock()


def backend_init() -> None:
    """Initialise the llama.cpp backend once and route its logs into ``logging`` (idempotent)."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        native.llama_log_set(_router.callback, ctypes.c_void_p(0))
        native.llama_backend_init()
        _backend_ready = True


def _forget_native_errors() -> None:
    """Drop this thread's remembered error lines (before a call whose failure :func:`_last_native_error`
    explains)."""
    _router.take_errors()


def _last_native_error(default: str = "") -> str:
    """The most telling recent llama.cpp warning/error line of this thread ("error loading model: ..." beats
    "failed")."""
    errs = _router.take_errors()
    if not errs:
        return default
    text = "\n".join(errs)
    # llama.cpp sometimes logs fragments without a newline: cut each message at the next "func_name:" prefix
    match = re.search(r"error loading model: (.*?)(?=\w+: |\n|$)", text)
    if match:
        return match.group(1).strip()
    for line in reversed(errs):
        if "error" in line or "failed" in line:
            return line.strip()
    return errs[-1]
