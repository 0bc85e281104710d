"""The ASGI response of every generation route (:class:`GenerationResponse`) and the base of their renderers
(:class:`Renderer`, given what it reads of the request it answers: :class:`Served`).

While it waits for its group's chunks (:class:`~llamaspec.server.jobs.JobGroup`) a response also waits for the
client's ``http.disconnect``; a client that goes away (before the prompt is processed, while it is, or
mid-stream) cancels its engine requests, which frees their slots at the next step.

Streams are llama-server's: nothing is sent until the first chunk, so an error before it is a plain HTTP
error; then ``data: {json}\\n\\n`` events, a keep-alive comment (``:\\n\\n``) when nothing was sent for
``sse_ping_interval`` seconds, and an ``data: {"error": ...}`` event if a request fails mid-stream.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import anyio

from ..slot import Chunk
from . import formats
from .jobs import JobGroup
from .probs import ProbsRender

if TYPE_CHECKING:  # pragma: no cover
    from .._llama.vocab import Vocab
    from ..request import Request
    from .parsing import GenParams

__all__ = ["GenerationResponse", "Renderer", "Served", "dumps", "send_json", "sse"]

log = logging.getLogger("llamaspec.server")

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else dumps(obj)) + b"\n\n"


@dataclass(frozen=True)
class Served:
    """What a renderer reads of the request it answers (never the server's state): its fields, the model name it
    echoes, the vocabulary (token texts), whether the server speculates (``draft_n`` in ``timings``), its
    ``generation_settings`` (None once the engine is gone) and ``verbose``."""

    gen: "GenParams"
    model: str
    vocab: "Vocab"
    speculative: bool
    settings: Callable[[], "dict | None"]
    verbose: bool = False


class Renderer:
    """Turns one route's chunks into its JSON shapes (see ``app.py``)."""

    def __init__(self, served: Served):
        self.served, self.gen, self.model = served, served.gen, served.model
        probs = served.gen.options.probs
        self.probs = ProbsRender(served.vocab, probs.post_sampling) if probs is not None else None
        #: the request's tools when its output is parsed into calls (not when its JSON schema is the output)
        tools, self.fmt = self.gen.tools, self.gen.fmt
        self.tools = tools if tools is not None and tools.parse and self.fmt is None else None

    def timings(self, st) -> dict:
        return formats.timings(st, speculative=self.served.speculative)

    def progress(self, ch: Chunk) -> dict:
        """``prompt_progress`` (and ``timings`` with ``timings_per_token``) of a progress chunk."""
        return formats.progress_fields(ch.progress, with_timings=self.gen.timings_per_token,
                                       speculative=self.served.speculative)

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


class GenerationResponse:
    """ASGI response for a generation route: waits for the engine without blocking the event loop and
    cancels the engine requests when the client disconnects (see the module docstring)."""

    def __init__(self, group: JobGroup, renderer: Renderer, *, stream: bool, ping_interval: float = 30.0,
                 done: bool = True):
        self.group = group
        self.renderer = renderer
        self.stream = stream
        self.done = done  # a stream ends with OpenAI's ``data: [DONE]``
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
                if self.done:
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
