"""From engine requests to HTTP: one dispatcher thread for the whole server, and the response that watches
the client.

The engine runs in its own thread (``Engine.start()``). One :class:`Dispatcher` thread moves the chunks of
every engine request to the event loop (``loop.call_soon_threadsafe``): it waits for the engine's steps
(``Engine.wait``), takes the chunks of every request that has output, and runs the cancels, so no wait on
the engine happens on the event loop and no thread is made per request. Tokenising, templating and
submitting run in a small pool of worker threads (:func:`in_worker`), or on the event loop for a small
request (``routes._inline``: tens of microseconds). :class:`GenerationResponse` is the ASGI response of
``/completion``, ``/v1/completions`` and ``/v1/chat/completions``: while it waits for chunks it also waits
for the client's ``http.disconnect``; a client that goes away (before the prompt is processed, while
it is, or mid-stream) cancels its engine requests, which frees their slots at the next step.

Streams are llama-server's: nothing is sent until the first chunk, so an error before it is a plain HTTP
error; then ``data: {json}\\n\\n`` events, a keep-alive comment (``:\\n\\n``) when nothing was sent for
``sse_ping_interval`` seconds, and an ``data: {"error": ...}`` event if a request fails mid-stream.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Iterator

import anyio

from ..slot import Chunk, FinishReason
from .errors import ApiError, unavailable

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

log = logging.getLogger("llamaspec.server")

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

#: worker threads for tokenising, templating and submitting (per event loop)
WORKERS = 4
_LIMITERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter]" = weakref.WeakKeyDictionary()


async def in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in one of :data:`WORKERS` threads, off the event loop."""
    loop = asyncio.get_running_loop()
    limiter = _LIMITERS.get(loop)
    if limiter is None:
        limiter = _LIMITERS[loop] = anyio.CapacityLimiter(WORKERS)
    return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else dumps(obj)) + b"\n\n"


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
        if not self.stream:
            for i, r in enumerate(self.reqs):
                if hasattr(r, "add_done_callback"):
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
    __slots__ = ("group", "i", "req", "it", "pollable", "told")

    def __init__(self, group: JobGroup, i: int, req: "Request"):
        self.group, self.i, self.req = group, i, req
        self.it: Iterator[Chunk] = iter(req.chunks())
        #: a request that says when it has output is never waited on (a test double may not say)
        self.pollable = hasattr(req, "has_output")
        #: a whole response's request tells its group itself when it is done (JobGroup.open): its end does not
        #: wake this thread, which only drops the watch (and asks for a heap trim) on its next turn
        self.told = not group.stream and hasattr(req, "add_done_callback")


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
        return self._wake.is_set() or any(not w.pollable or (w.req.has_output if w.group.stream else w.req.done and
                                                             not w.told) for w in self._watched)

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
                while not w.pollable or w.req.has_output:
                    ch = next(w.it, None)
                    if ch is None:
                        finished = True
                        break
                    moved = True
                    if w.group.stream:
                        items.append((w.i, ch))
                        if not w.pollable and not w.group.post_many(items):  # it blocks between chunks: at once
                            break
                        items = [] if not w.pollable else items
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


class Renderer:
    """Turns one route's chunks into its JSON shapes (see ``app.py``)."""

    openai = True  # OpenAI routes end a stream with ``data: [DONE]``

    def stream_chunk(self, i: int, req: "Request", ch: Chunk) -> Iterable[dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def stream_finish(self, i: int, req: "Request") -> Iterable[dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def stream_tail(self, reqs: "list[Request]") -> Iterable[dict]:
        return ()

    def encode(self, obj: Any) -> bytes:
        """One stream event as it goes on the wire (``data: {json}``; a route may add an ``event:`` line)."""
        return sse(obj)

    def whole(self, reqs: "list[Request]") -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


def request_error(req: "Request") -> ApiError | None:
    """The HTTP error of a request that did not finish normally (None when it did)."""
    if req.finish_reason is FinishReason.ERROR:
        return ApiError(500, req.error or "the request failed", "server_error")
    if req.finish_reason is FinishReason.ABORT:
        return ApiError(503, "the request was cancelled: the server is shutting down", "unavailable_error")
    return None


class GenerationResponse:
    """ASGI response for a generation route: waits for the engine without blocking the event loop and
    cancels the engine requests when the client disconnects (see the module docstring)."""

    def __init__(self, group: JobGroup, renderer: Renderer, *, stream: bool, ping_interval: float = 30.0):
        self.group = group
        self.renderer = renderer
        self.stream = stream
        group.stream = stream
        self.ping_interval = ping_interval if ping_interval and ping_interval > 0 else None
        self.disconnected = False

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        self.group.open()
        body = asyncio.current_task()
        running = True

        async def watch() -> None:
            while True:
                try:
                    msg = await receive()
                except Exception:  # noqa: BLE001 - the connection is broken: the body's send will say so
                    return
                if msg["type"] == "http.disconnect":
                    self.disconnected = True
                    self.group.cancel()  # frees the slots at the next step
                    if running and body is not None:
                        body.cancel()
                    return

        # a plain asyncio task, not a task group: it is a tenth of the cost, and this runs once per request
        watcher = asyncio.ensure_future(watch())
        try:
            if self.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except OSError:  # the client went away while we were sending
            self.disconnected = True
        except asyncio.CancelledError:
            if not self.disconnected:  # cancelled from outside (shutdown): not ours to swallow
                raise
            uncancel = getattr(body, "uncancel", None)  # (3.11+) the task goes on as if never cancelled
            if uncancel is not None:
                uncancel()
        finally:
            running = False
            watcher.cancel()
            self.group.close()
            if self.disconnected:
                log.info("client disconnected: request(s) %s cancelled", ", ".join(str(r.id) for r in self.group.reqs))

    # -- non-stream -------------------------------------------------------------------------------
    async def _whole(self, send: Send) -> None:
        while not self.group.all_done:
            await self.group.next()
        for i in range(len(self.group.reqs)):
            err = self.group.error(i)
            if err is not None:
                await send_json(send, err.code, err.to_dict(), err.headers)
                return
        await send_json(send, 200, self.renderer.whole(self.group.reqs))

    # -- stream -----------------------------------------------------------------------------------
    async def _next(self) -> tuple[int, Chunk | None] | None:
        """The next event, or None when ``ping_interval`` passed without one."""
        if self.ping_interval is None:
            return await self.group.next()
        with anyio.move_on_after(self.ping_interval):
            return await self.group.next()
        return None

    async def _stream(self, send: Send) -> None:
        group, rnd = self.group, self.renderer
        first = await group.next()  # nothing is sent before the first result: an early error is an HTTP error
        i, ch = first
        if ch is None:
            err = group.error(i)
            if err is not None and not group.reqs[i].tokens:
                await send_json(send, err.code, err.to_dict(), err.headers)
                return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        event: tuple[int, Chunk | None] | None = first
        while True:
            if event is None:
                await body(b":\n\n")  # keep-alive comment
            else:
                i, ch = event
                req = group.reqs[i]
                if ch is not None:
                    out = b"".join(rnd.encode(o) for o in rnd.stream_chunk(i, req, ch))
                    if out:
                        await body(out)
                else:
                    err = group.error(i)
                    if err is not None:  # after the first result: an error event, then the stream ends
                        group.cancel()
                        await body(sse({"error": err.error_object()}))
                        break
                    out = b"".join(rnd.encode(o) for o in rnd.stream_finish(i, req))
                    if out:
                        await body(out)
            if group.all_done:
                tail = b"".join(rnd.encode(o) for o in rnd.stream_tail(group.reqs))
                if rnd.openai:
                    tail += b"data: [DONE]\n\n"
                if tail:
                    await body(tail)
                break
            event = await self._next()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_json(send: Send, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
    data = dumps(obj)
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json; charset=utf-8"), (b"content-length", str(len(data)).encode()), *extra]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
