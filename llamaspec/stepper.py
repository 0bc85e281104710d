"""Who runs ``step()``: one thread at a time (native state is never touched by two threads at once), the caller's or the engine thread.

:class:`Stepper` holds the step lock, the condition that wakes waiting consumers, and the optional background
thread of a server. The Engine gives it its step function and asks it to run work now when no step is running
(``run_now``: admission and cancels from ``submit`` / ``cancel``), to make progress for a request (``wait``),
or to step in the background while there is work (``start`` / ``stop``). Native work a caller does outside a
step (``submit`` tokenises and builds samplers) runs inside ``using`` (:func:`native_use`): ``close`` marks the
engine closed, then waits for those calls, so it never frees a model under one and never misses a request
queued by one.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Callable, Iterator

__all__ = ["Stepper", "native_use"]

log = logging.getLogger("llamaspec")


class Stepper:
    def __init__(self, step: Callable[[], object], has_work: Callable[[], bool], is_closed: Callable[[], bool]):
        self._step = step
        self._has_work = has_work
        self._is_closed = is_closed
        #: held while a step (or work done in place of one) runs; reentrant for close() inside a step
        self.lock = threading.RLock()
        self._cv = threading.Condition()
        #: threads waiting for a step's output: (their condition, their event), woken only when it holds
        self._waiters: list[tuple[Callable[[], bool], threading.Event]] = []
        self._wlock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False
        #: calls under way in ``using`` (close waits for them)
        self._users = 0
        self._ucv = threading.Condition()

    @contextlib.contextmanager
    def using(self, check_open: Callable[[], None]) -> Iterator[None]:
        """Native work outside a step: ``check_open()`` (it raises once :meth:`close` began), then the work,
        which :meth:`close` waits for."""
        with self._ucv:
            check_open()
            self._users += 1
        try:
            yield
        finally:
            with self._ucv:
                self._users -= 1
                self._ucv.notify_all()

    def close(self, mark_closed: Callable[[], None]) -> None:
        """Stop the background thread, ``mark_closed()`` (no new ``using``), wait for the calls under way."""
        if self.has_thread:
            self.stop()
        with self._ucv:
            mark_closed()
            self._ucv.wait_for(lambda: self._users == 0)

    def notify(self, engine: bool = True) -> None:
        """After a step (or work done in place of one): wake the idle engine thread (``engine``; not needed
        after its own step), and each waiter whose condition now holds (the others sleep on: a thread woken
        after every step for nothing costs the engine thread the GIL each time)."""
        if engine:
            with self._cv:
                self._cv.notify_all()
        if not self._waiters:  # (read without the lock: a new waiter checks its condition itself)
            return
        with self._wlock:
            waiters = list(self._waiters)
        for ready, ev in waiters:
            try:
                if ready():
                    ev.set()
            except Exception:  # noqa: BLE001 - the waiter evaluates it again itself
                ev.set()

    def step(self):
        """Run one step under the lock, then wake the waiters."""
        with self.lock:
            try:
                return self._step()
            finally:
                self.notify(engine=threading.current_thread() is not self._thread)

    def run_now(self, work: Callable[[], None]) -> None:
        """Do ``work`` at once when no step runs (else the next step does it), then wake the waiters."""
        if self.lock.acquire(blocking=False):
            try:
                if not self._is_closed():
                    work()
            finally:
                self.lock.release()
        self.notify()

    @property
    def threaded(self) -> bool:
        """A background thread runs the steps (one told to stop, still finishing its step, does not)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def wait(self, has_output: Callable[[], bool], timeout: float | None) -> bool:
        """Make progress until ``has_output()``: run a step when no other thread is, else wait for one.
        False when ``timeout`` passed without output."""
        deadline = None if timeout is None else time.monotonic() + timeout
        threaded = self.threaded
        while True:
            if not threaded and self.lock.acquire(blocking=False):
                try:
                    if not has_output():
                        self._step()
                finally:
                    self.lock.release()
                    self.notify()
                return True
            ev = threading.Event()
            entry = (has_output, ev)
            with self._wlock:
                self._waiters.append(entry)
            try:
                if has_output():
                    return True
                # (also woken after at most 50 ms: a condition that changed outside a step is seen then)
                ev.wait(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
            finally:
                with self._wlock:
                    self._waiters.remove(entry)
            if has_output():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def start(self) -> None:
        """Run steps in a background thread while there is work (idempotent). A thread that :meth:`stop`
        left finishing a long step is waited for first: there is never a second one."""
        t = self._thread
        if t is not None and t.is_alive():
            if not self._stop:
                return
            t.join()  # it was told to stop and ends after its step: then a fresh one starts
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="llamaspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the background thread (the current step finishes first)."""
        self._stop = True
        self.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        if t is None or not t.is_alive():  # (a thread still in its step is kept: start() waits for it)
            self._thread = None

    @property
    def has_thread(self) -> bool:
        return self._thread is not None

    def _loop(self) -> None:
        while not self._stop and not self._is_closed():
            if not self._has_work():
                with self._cv:
                    self._cv.wait(0.05)
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - an engine thread must not die; step confines errors to slots
                log.exception("engine step failed")
                time.sleep(0.01)


def native_use(method):
    """An Engine method that does native work outside a step (see :meth:`Stepper.using`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._stepper.using(self._check_open):
            return method(self, *args, **kwargs)

    return run
