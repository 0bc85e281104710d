"""One client request of ``scripts/load_faults.py`` (:func:`execute`) and what it ended with (:class:`Result`).

httpx (asyncio) sends the calls that read an answer; a raw socket the ones that go away while the server
reads the body or processes the prompt. Every call has a deadline (its own tiny one, or the run's
per-request limit): past it the outcome is ``timeout`` (a hang, unless the call asked for it). A server that
closes or resets the connection is ``reset``; a 200 whose body is no valid answer (not JSON, a stream without
its end event) is ``bad-body``; a stream's error event is ``error-event:CODE``. :func:`greedy_outcome` checks
a greedy answer against its reference and tells a near-tie (the two best tokens within ``tol`` log-prob of
each other where the texts part) from a real mismatch.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from .load_mix import BAD_BODY, DISCONNECTED, MISMATCH, NEAR_TIE, RESET, TIMEOUT, Call, GreedyCase

__all__ = ["Result", "execute", "greedy_outcome", "answer_text", "is_failure"]

HEADERS = {"Content-Type": "application/json"}
RESETS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError, ConnectionError)


@dataclass
class Result:
    call: Call
    outcome: str = ""
    latency: float = 0.0
    ttft: float | None = None
    text: str = ""
    n_tokens: int = 0
    detail: str = ""
    answer: dict | None = field(default=None, repr=False)


def is_failure(r: Result) -> bool:
    """A 5xx, an error event, a reset, a bad body, a wrong greedy answer, or any outcome the call does not
    allow (a timeout included)."""
    o = r.outcome
    if o.startswith("5") or o.startswith("error-event") or o in (RESET, BAD_BODY, MISMATCH):
        return True
    return o != NEAR_TIE and o not in r.call.expect


def answer_text(obj: dict, path: str) -> str:
    """The first choice's text of a whole answer or of one stream event."""
    if path == "/completion":
        return obj.get("content") or ""
    for ch in obj.get("choices") or []:
        if ch.get("index", 0) == 0:
            if "text" in ch:
                return ch["text"] or ""
            part = ch.get("message") or ch.get("delta") or {}
            return part.get("content") or ""
    return ""


def _n_tokens(obj: dict) -> int:
    t = obj.get("timings") or {}
    if "predicted_n" in t:
        return int(t["predicted_n"])
    u = obj.get("usage") or {}
    return int(u.get("completion_tokens") or 0)


def _error_detail(r: httpx.Response, body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return f"{err.get('type')}: {err.get('message')}"[:300]
    except (ValueError, KeyError, TypeError):
        return f"(no error object) {body[:200]!r}"


async def execute(client: httpx.AsyncClient, host: str, port: int, call: Call, limit: float) -> Result:
    """Send ``call`` and return what it ended with (never raises but for cancellation)."""
    res = Result(call)
    t0 = time.perf_counter()
    try:
        coro = _raw(host, port, call, res) if call.action in ("early", "partial") else _http(client, call, res, t0)
        await asyncio.wait_for(coro, call.timeout or limit)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        res.outcome = TIMEOUT
    except RESETS as e:
        res.outcome, res.detail = RESET, f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - a client-side bug must show, not stop the run
        res.outcome, res.detail = BAD_BODY, f"client: {type(e).__name__}: {e}"[:300]
    res.latency = time.perf_counter() - t0
    return res


async def _http(client: httpx.AsyncClient, call: Call, res: Result, t0: float) -> None:
    if not call.stream:
        r = await client.request(call.method, call.path, content=call.body, headers=HEADERS)
        res.outcome = str(r.status_code)
        if r.status_code != 200:
            res.detail = _error_detail(r, r.content)
            return
        if call.path in ("/metrics",):
            return
        try:
            obj = r.json()
        except ValueError:
            res.outcome, res.detail = BAD_BODY, f"not JSON: {r.content[:200]!r}"
            return
        if isinstance(obj, dict):
            res.answer, res.text, res.n_tokens = obj, answer_text(obj, call.path), _n_tokens(obj)
        return
    async with client.stream(call.method, call.path, content=call.body, headers=HEADERS) as r:
        res.outcome = str(r.status_code)
        if r.status_code != 200:
            res.detail = _error_detail(r, await r.aread())
            return
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            res.outcome, res.detail = BAD_BODY, f"a stream answered {r.headers.get('content-type')}"
            return
        await _read_stream(r, call, res, t0)


async def _read_stream(r: httpx.Response, call: Call, res: Result, t0: float) -> None:
    n_events, done, parts = 0, False, []
    if call.action == "events" and call.arg <= 0:
        res.outcome = DISCONNECTED
        return
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if res.ttft is None:
            res.ttft = time.perf_counter() - t0
        n_events += 1
        if payload == "[DONE]":
            done = True
            break
        try:
            obj = json.loads(payload)
        except ValueError:
            res.outcome, res.detail = BAD_BODY, f"event not JSON: {payload[:200]!r}"
            return
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            res.outcome = f"error-event:{err.get('code', '?')}"
            res.detail = str(err.get("message"))[:300]
            return
        parts.append(answer_text(obj, call.path))
        res.n_tokens = _n_tokens(obj) or res.n_tokens
        if call.path == "/completion" and obj.get("stop"):
            done = True  # llama.cpp's native stream: no [DONE]; its last event has "stop": true
        if call.action == "events" and n_events >= call.arg:
            res.outcome = DISCONNECTED
            return
        if call.action == "slow":
            await asyncio.sleep(call.arg)
    res.text = "".join(parts)
    if not done:
        res.outcome, res.detail = BAD_BODY, f"the stream ended without its end event after {n_events} events"


async def _raw(host: str, port: int, call: Call, res: Result) -> None:
    """Send the request on a socket of its own and close it early: ``partial`` half-way through the body,
    ``early`` ``call.arg`` seconds after sending it (an answer that came first is the outcome)."""
    reader, writer = await asyncio.open_connection(host, port)
    body = call.body or b""
    head = (f"{call.method} {call.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        if call.action == "partial":
            writer.write(head + body[:int(len(body) * call.arg)])
            await writer.drain()
            wait = 0.05
        else:
            writer.write(head + body)
            await writer.drain()
            wait = call.arg
        try:
            line = await asyncio.wait_for(reader.readline(), wait) if wait > 0 else b""
        except asyncio.TimeoutError:
            line = b""
        if line.startswith(b"HTTP/1.1 "):
            res.outcome = line.split()[1].decode()
            if res.outcome != "200":  # the error's message (an answer before the client went away)
                res.detail = await _raw_error(reader)
        elif line:
            res.outcome, res.detail = BAD_BODY, f"not an HTTP status line: {line[:100]!r}"
        else:
            res.outcome = DISCONNECTED
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def _raw_error(reader: asyncio.StreamReader) -> str:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
        n = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(n), 2.0)
        err = json.loads(body)["error"]
        return f"{err.get('type')}: {err.get('message')}"[:300]
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, KeyError,
            TypeError, IndexError, OSError) as e:
        return f"(no error object: {type(e).__name__})"


def greedy_outcome(case: GreedyCase, text: str, tol: float) -> tuple[str, str]:
    """``("200", "")`` when ``text`` is the case's reference; else where they part and whether the two best
    tokens there were within ``tol`` log-prob of each other alone (``near-tie``: batched and single-row
    logits differ slightly) or not (``mismatch``)."""
    if text == case.ref:
        return "200", ""
    got, acc, k = text.encode("utf-8", "surrogatepass"), b"", 0
    for k, piece in enumerate(case.ref_pieces):
        if not got.startswith(acc + piece):
            break
        acc += piece
    else:
        k = len(case.ref_pieces)
    c = len(acc.decode("utf-8", "replace"))
    where = f"parts at output token {k} (char {c}): got {text[c:][:40]!r}, alone {case.ref[c:][:40]!r}"
    if k < len(case.ref_gaps) and case.ref_gaps[k] <= tol and len(got) > len(acc):
        return NEAR_TIE, f"{where}; top-2 log-prob gap there {case.ref_gaps[k]:.5f}"
    gap = f"; top-2 gap {case.ref_gaps[k]:.4f}" if k < len(case.ref_gaps) else ""
    return MISMATCH, where + gap
