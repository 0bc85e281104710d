"""From engine requests to HTTP: a per-request asyncio bridge and the response that watches the client.

The engine runs in its own thread (``Engine.start()``). Each engine request of an HTTP request gets a small
pump thread that blocks on ``Request.chunks()`` and hands every chunk to the event loop
(``loop.call_soon_threadsafe``), so no handler ever blocks the loop. :class:`GenerationResponse` is the
ASGI response of ``/completion``, ``/v1/completions`` and ``/v1/chat/completions``: while it waits for
chunks it also waits for the client's ``http.disconnect``; a client that goes away (before the prompt is
processed, while it is, or mid-stream) cancels its engine requests, which frees their slots at the next
step.

Streams are llama-server's: nothing is sent until the first chunk, so an error before it is a plain HTTP
error; then ``data: {json}\\n\\n`` events, a keep-alive comment (``:\\n\\n``) when nothing was sent for
``sse_ping_interval`` seconds, and an ``data: {"error": ...}`` event if a request fails mid-stream.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import anyio

from ..slot import Chunk, FinishReason
from .errors import ApiError

if TYPE_CHECKING:  # pragma: no cover
    from ..request import Request

log = logging.getLogger("llamaspec.server")

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else dumps(obj)) + b"\n\n"


class JobGroup:
    """The engine requests of one HTTP request; their chunks arrive on one asyncio queue as
    ``(index, chunk)``, and ``(index, None)`` once request ``index`` is done."""

    def __init__(self, reqs: "list[Request]", on_close: Callable[["JobGroup"], None] | None = None):
        self.reqs = reqs
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[int, Chunk | None]] = asyncio.Queue()
        self.n_done = 0
        self._on_close = on_close
        self._threads = [threading.Thread(target=self._pump, args=(i, r), name=f"llamaspec-req-{r.id}", daemon=True)
                         for i, r in enumerate(reqs)]
        for t in self._threads:
            t.start()

    def _post(self, item: tuple[int, Chunk | None]) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
            return True
        except RuntimeError:  # the event loop is gone (shutdown): nobody will read this request
            return False

    def _pump(self, i: int, req: "Request") -> None:
        try:
            for ch in req.chunks():
                if not self._post((i, ch)):
                    req.cancel()
                    return
        except Exception:  # noqa: BLE001 - the request is reported as failed below
            log.exception("request %d: reading its output failed", req.id)
            if not req.done:
                req.cancel()
        finally:
            self._post((i, None))

    @property
    def all_done(self) -> bool:
        return self.n_done == len(self.reqs)

    async def next(self) -> tuple[int, Chunk | None]:
        item = await self.events.get()
        if item[1] is None:
            self.n_done += 1
        return item

    def cancel(self) -> None:
        """Cancel every request that is not done yet (any thread)."""
        for r in self.reqs:
            if not r.done:
                r.cancel()

    def close(self) -> None:
        self.cancel()
        if self._on_close is not None:
            self._on_close(self)
            self._on_close = None


class Renderer:
    """Turns one route's chunks into its JSON shapes (see ``app.py``)."""

    openai = True  # OpenAI routes end a stream with ``data: [DONE]``

    def stream_chunk(self, i: int, req: "Request", ch: Chunk) -> Iterable[dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def stream_finish(self, i: int, req: "Request") -> Iterable[dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def stream_tail(self, reqs: "list[Request]") -> Iterable[dict]:
        return ()

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
        self.ping_interval = ping_interval if ping_interval and ping_interval > 0 else None
        self.disconnected = False

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    while True:
                        msg = await receive()
                        if msg["type"] == "http.disconnect":
                            self.disconnected = True
                            self.group.cancel()  # frees the slots at the next step
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                try:
                    if self.stream:
                        await self._stream(send)
                    else:
                        await self._whole(send)
                except OSError:  # the client went away while we were sending
                    self.disconnected = True
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self.group.close()
            if self.disconnected:
                log.info("client disconnected: request(s) %s cancelled", ", ".join(str(r.id) for r in self.group.reqs))

    # -- non-stream -------------------------------------------------------------------------------
    async def _whole(self, send: Send) -> None:
        while not self.group.all_done:
            await self.group.next()
        for r in self.group.reqs:
            err = request_error(r)
            if err is not None:
                await send_json(send, err.code, err.to_dict())
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
            err = request_error(group.reqs[i])
            if err is not None and not group.reqs[i].tokens:
                await send_json(send, err.code, err.to_dict())
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
                    out = b"".join(sse(o) for o in rnd.stream_chunk(i, req, ch))
                    if out:
                        await body(out)
                else:
                    err = request_error(req)
                    if err is not None:  # after the first result: an error event, then the stream ends
                        group.cancel()
                        await body(sse({"error": err.error_object()}))
                        break
                    out = b"".join(sse(o) for o in rnd.stream_finish(i, req))
                    if out:
                        await body(out)
            if group.all_done:
                tail = b"".join(sse(o) for o in rnd.stream_tail(group.reqs))
                if rnd.openai:
                    tail += b"data: [DONE]\n\n"
                if tail:
                    await body(tail)
                break
            event = await self._next()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_json(send: Send, status: int, obj: Any) -> None:
    data = dumps(obj)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json; charset=utf-8"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
