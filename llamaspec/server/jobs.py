"""From engine requests to HTTP: the engine requests of one HTTP request (:class:`JobGroup`) and the one
dispatcher thread of the whole server (:class:`Dispatcher`).

The engine runs in its own thread (``Engine.start()``). One :class:`Dispatcher` thread moves the chunks of
every streamed engine request to the event loop (``loop.call_soon_threadsafe``): it waits for the engine's steps
(``Engine.wait``), takes the chunks of every request that has output, and runs the cancels, so no wait on
the engine happens on the event loop and no thread is made per request. A whole (non-stream) response only
needs each request's end, which the request posts itself (``Request.add_done_callback``). Tokenising,
templating and submitting run in a small pool of worker threads (:func:`in_worker`), or on the event loop for
a small request (``pipeline._inline``: tens of microseconds). The ASGI response that reads a group is
:class:`~llamaspec.server.respond.GenerationResponse`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

import anyio

from ..slot import Chunk, FinishReason
from . import cancel
from .errors import ApiError, unavailable

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

log = logging.getLogger("llamaspec.server")


class ServedRequest(Protocol):
    """What the server reads of an engine request (:class:`llamaspec.request.Request` is one; a test double
    implements the same)."""

    id: int
    finish_reason: FinishReason | None
    error: str | None

    @property
    def done(self) -> bool: ...

    @property
    def has_output(self) -> bool:
        """Chunks are waiting to be read, or the request is done (reading one then does not block)."""

    def chunks(self) -> Iterator[Chunk]: ...

    def cancel(self) -> None: ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


#: worker threads for tokenising, templating and submitting (per event loop)
WORKERS = 4
_LIMITERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter]" = weakref.WeakKeyDictionary()


async def in_worker(fn: Callable[..., Any], *args: Any, request: Any = None) -> Any:
    """``fn(*args)`` in one of :data:`WORKERS` threads, off the event loop. With ``request`` (a Starlette
    request whose body was read) the work is abandoned when its client disconnects meanwhile: its ASGI
    ``receive`` is watched for ``http.disconnect`` and the work's :class:`~llamaspec.server.cancel.Flag` set, which
    its loops check (:func:`llamaspec.server.cancel.check`); a SIGTERM's drain sets it too."""
    loop = asyncio.get_running_loop()
    limiter = _LIMITERS.get(loop)
    if limiter is None:
        limiter = _LIMITERS[loop] = anyio.CapacityLimiter(WORKERS)
    if request is None:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)
    flag = cancel.Flag()
    cancel.register(flag)
    watcher = loop.create_task(_watch_disconnect(request.receive, flag))
    try:
        return await anyio.to_thread.run_sync(cancel.run_flagged, flag, fn, *args, limiter=limiter)
    except cancel.Abandoned as e:
        cancel.note_stopped(request.url.path, e.error)
        raise e.error from None
    finally:
        watcher.cancel()
        await asyncio.wait({watcher})  # done before the response listens to receive itself (an outer cancel raises)


async def _watch_disconnect(receive: Callable[[], Any], flag: "cancel.Flag") -> None:
    """Set ``flag`` once the client disconnects (the body was read: ``receive`` has nothing else to say)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            flag.set(cancel.client_gone())
            return


class JobGroup:
    """The engine requests of one HTTP request. Once :meth:`open` ran (on the event loop) their chunks
    arrive on one asyncio queue as ``(index, chunk)``, and ``(index, None)`` once request ``index`` is
    done; the :class:`Dispatcher` puts them there (chunks produced before are kept by the requests)."""

    def __init__(self, reqs: "list[Request]", on_close: Callable[["JobGroup"], None] | None = None,
                 dispatcher: "Dispatcher | None" = None):
        self.reqs = reqs
        self.n_done = 0
        self.closed = False
        #: request index -> the error it ended with when the engine could not say (closed under it)
        self.failures: dict[int, ApiError] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events: asyncio.Queue[tuple[int, Chunk | None]] | None = None
        #: whether the response reads the chunks as they come (a stream); a whole response only needs to know
        #: when each request is done, so the dispatcher does not hand it every token
        self.stream = True
        self._on_close = on_close
        self._own = dispatcher is None
        self._dispatcher = dispatcher or Dispatcher(None)
        #: requests whose end was posted (once each: by the request's done callback or by the dispatcher)
        self._ended: set[int] = set()
        self._ended_lock = threading.Lock()

    def open(self) -> None:
        """Start receiving the chunks (on the event loop; idempotent). A whole response hears of each request's
        end from the request itself (its done callback posts to the event loop from the engine's thread), not
        through the dispatcher's thread: one thread hop fewer per response."""
        if self.events is not None:
            return
        self.loop = asyncio.get_running_loop()
        self.events = asyncio.Queue()
        if self._own:
            self._dispatcher.start()
        self._dispatcher.watch(self)
        for i, r in enumerate(self.reqs):
            if not self.stream:
                r.add_done_callback(lambda _r, i=i: self.post_done(i))

    def post_done(self, i: int) -> bool:
        """Post that request ``i`` is done, the first time only (any thread); False when the loop is gone."""
        with self._ended_lock:
            if i in self._ended:
                return True
            self._ended.add(i)
        return self.post((i, None))

    def post(self, item: tuple[int, Chunk | None]) -> bool:
        """Hand one event to the event loop (any thread); False when the loop is gone."""
        return self.post_many([item])

    def post_many(self, items: list[tuple[int, Chunk | None]]) -> bool:
        """Hand events to the event loop in one wake-up (any thread); False when the loop is gone."""
        if not items:
            return True
        try:
            self.loop.call_soon_threadsafe(_put_all, self.events, items)
            return True
        except RuntimeError:  # the event loop is gone (shutdown): nobody will read this request
            return False

    @property
    def all_done(self) -> bool:
        return self.n_done == len(self.reqs)

    async def next(self) -> tuple[int, Chunk | None]:
        self.open()
        item = await self.events.get()
        if item[1] is None:
            self.n_done += 1
        return item

    def error(self, i: int) -> ApiError | None:
        """The HTTP error of request ``i`` once it is done (None when it finished normally)."""
        return self.failures.get(i) or request_error(self.reqs[i])

    def cancel(self) -> None:
        """Cancel every request that is not done yet (any thread; the dispatcher thread runs the cancels)."""
        reqs = [r for r in self.reqs if not r.done]
        if reqs:  # (a response that ran to its end cancels nothing: the dispatcher is not woken for it)
            self._dispatcher.cancel(reqs)

    def close(self) -> None:
        self.closed = True
        self.cancel()
        if self._own:
            self._dispatcher.stop()
        if self._on_close is not None:
            self._on_close(self)
            self._on_close = None


def _put_all(queue: "asyncio.Queue", items: list) -> None:
    for item in items:
        queue.put_nowait(item)


class _Watch:
    __slots__ = ("group", "i", "req", "it")

    def __init__(self, group: JobGroup, i: int, req: "Request"):
        self.group, self.i, self.req = group, i, req
        self.it: Iterator[Chunk] = iter(req.chunks())


class Dispatcher:
    """The one thread that moves every watched request's chunks to its group's event loop and runs the
    cancels (see the module docstring). ``engine`` is waited on for output (``Engine.wait``); None, or an
    engine without ``wait``, is polled. ``trimmer`` (a :class:`llamaspec.malloc.Trimmer`) is asked for a heap
    trim whenever a watched request ends, and polled on every turn of the thread (so the trim runs here)."""

    def __init__(self, engine: Any, trimmer: Any = None):
        self._engine = engine
        self._trimmer = trimmer
        self._lock = threading.Lock()
        self._new: list[_Watch] = []
        self._watched: list[_Watch] = []
        self._cancels: deque["Request"] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="llamaspec-dispatch", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver what is there, then end the thread."""
        self._stop = True
        self._wake.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def watch(self, group: JobGroup) -> None:
        with self._lock:
            self._new.extend(_Watch(group, i, r) for i, r in enumerate(group.reqs))
        self._wake.set()

    def cancel(self, reqs: "Iterable[Request]") -> None:
        if not self.running:  # no thread (shutting down): at once
            for r in reqs:
                r.cancel()
            return
        with self._lock:
            self._cancels.extend(reqs)
        self._wake.set()

    @property
    def has_output(self) -> bool:
        """What ``Engine.wait`` waits for: a watched stream has output, a watched request of a whole response
        is done, or there is news for this thread (evaluated by the engine thread after each step)."""
        # (a whole response's request tells its group itself when it is done, JobGroup.open: its end does not
        # wake this thread, which only drops the watch, and asks for a heap trim, on its next turn)
        return self._wake.is_set() or any(w.group.stream and w.req.has_output for w in self._watched)

    def _run(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                self._watched += self._new
                self._new = []
                cancels = list(self._cancels)
                self._cancels.clear()
            for r in cancels:
                try:
                    r.cancel()
                except Exception:  # noqa: BLE001 - an engine closed meanwhile: the request is done anyway
                    log.debug("cancel of request %s failed", getattr(r, "id", "?"), exc_info=True)
            moved = self._deliver()
            if self._trimmer is not None:
                self._trimmer.poll()
            if self._stop:
                self._fail_rest("the server is shutting down")
                return
            if not self._watched:
                self._wake.wait(1.0)
            elif not moved:
                self._wait()

    def _wait(self) -> None:
        try:
            self._engine.wait_until(lambda: self.has_output, 1.0)
        except Exception as e:  # noqa: BLE001 - a closed engine (or a step that failed in this thread)
            if getattr(self._engine, "closed", False):
                self._fail_rest("the server is shutting down")
            else:
                log.warning("waiting for the engine failed: %s: %s", type(e).__name__, e)
            self._wake.wait(0.05)

    def _deliver(self) -> bool:
        moved, keep = False, []
        for w in self._watched:
            if w.group.closed:  # the response is over (its requests were cancelled)
                if self._trimmer is not None:
                    self._trimmer.request()
                continue
            finished = False
            items: list[tuple[int, Chunk | None]] = []
            try:
                while w.req.has_output:
                    ch = next(w.it, None)
                    if ch is None:
                        finished = True
                        break
                    moved = True
                    if w.group.stream:
                        items.append((w.i, ch))
                if not w.group.post_many(items):
                    w.group.closed = True
                    w.req.cancel()
            except Exception as e:  # noqa: BLE001 - reported as the request's error
                log.exception("request %s: reading its output failed", getattr(w.req, "id", "?"))
                if not w.req.done:
                    w.req.cancel()
                w.group.failures[w.i] = ApiError(500, f"reading the request's output failed: {e}", "server_error")
                finished = True
            if finished:
                moved = True
                w.group.post_done(w.i)
                if self._trimmer is not None:  # what the request allocated is free now (its sampler too)
                    self._trimmer.request()
            elif not w.group.closed:
                keep.append(w)
        self._watched = keep
        return moved

    def _fail_rest(self, message: str) -> None:
        """End every watched request that is not done (the engine is gone)."""
        self._deliver()
        for w in self._watched:
            if not w.req.done:
                w.group.failures[w.i] = unavailable(message)
            w.group.post_done(w.i)
        self._watched = []


def request_error(req: "Request") -> ApiError | None:
    """The HTTP error of a request that did not finish normally (None when it did)."""
    if req.finish_reason is FinishReason.ERROR:
        return ApiError(500, req.error or "the request failed", "server_error")
    if req.finish_reason is FinishReason.ABORT:
        return ApiError(503, "the request was cancelled: the server is shutting down", "unavailable_error")
    return None
