"""The C heap of a long-running server (glibc malloc): the free memory given back after requests (issue 21).

glibc gives each thread that allocates its own arena (up to 8 per core) and keeps what a thread freed there
for that arena's later use: resident, unless it lies at the top of the arena. One request can leave tens of
MB that way: a JSON schema such as ``{"anyOf": [{"type": "string", "maxLength": i} for i in range(300)]}``
becomes a 375 kB grammar whose ``llama_sampler_init_grammar`` peaks near 20 MB in the worker thread that
submits it. Nothing leaks (the memory in use stays flat), but each arena keeps its own high-water mark, so
the server's RSS rose in steps under ``scripts/load_faults.py`` (+31 MB in 4 minutes, which one
``malloc_trim(0)`` gave back at once).

:class:`Trimmer` runs :func:`trim` (``malloc_trim(0)``: the free pages of every arena back to the kernel,
under a millisecond on average for a server's heap) after requests end, at most once per ``interval``
seconds, on the thread that polls it: the server's dispatcher, never the event loop nor the engine thread.
A no-op where the C library is not glibc. Fewer arenas (``MALLOC_ARENA_MAX=2`` in the environment) lower the
level a little more, but threads in native code at once (tokenising, grammars, decoding) then wait for each
other's arena: the server leaves that choice to the environment.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import time
from typing import Callable

__all__ = ["INTERVAL", "Trimmer", "is_glibc", "trim"]

log = logging.getLogger("llamaspec")

#: the least seconds between two trims
INTERVAL = 1.0


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, None elsewhere (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no such symbol)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def is_glibc() -> bool:
    return _malloc_trim() is not None


def trim() -> bool:
    """``malloc_trim(0)``: whether it gave memory back (False where that is not glibc)."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


class Trimmer:
    """:func:`trim` after requests end, at most once per ``interval`` seconds: :meth:`request` (any thread)
    asks for one, :meth:`poll` (one thread, often: it costs nothing when there is nothing to do) runs it
    when one is asked for and the last is ``interval`` seconds ago; one asked for too early waits for a
    later poll."""

    def __init__(self, interval: float = INTERVAL, *, trim_fn: Callable[[], object] = trim,
                 clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self._trim, self._clock = trim_fn, clock
        self._pending = threading.Event()
        self._last = float("-inf")
        #: trims run and the seconds they took, all and the longest
        self.n_trims = 0
        self.seconds = 0.0
        self.max_seconds = 0.0

    def request(self) -> None:
        self._pending.set()

    @property
    def pending(self) -> bool:
        return self._pending.is_set()

    def poll(self) -> bool:
        """Trim if one is asked for and due; whether it did."""
        if not self._pending.is_set():
            return False
        now = self._clock()
        if now - self._last < self.interval:
            return False
        self._pending.clear()
        self._last = now
        t0 = time.perf_counter()
        try:
            self._trim()
        except Exception:  # noqa: BLE001 - a trim is an optimisation: it never stops its caller
            log.debug("malloc_trim failed", exc_info=True)
        dt = time.perf_counter() - t0
        self.n_trims += 1
        self.seconds += dt
        self.max_seconds = max(self.max_seconds, dt)
        return True
