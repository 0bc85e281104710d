"""A body over ``--max-body-size`` (issue 35): the client that is still writing it reads the 413 the server
meant to send, instead of a connection reset (the server drains the rest, up to a bound, before answering),
against a real ``llamaspec serve`` on 127.0.0.1 (tiny model)."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from support.server import Server
from test_server import _error

httpx = pytest.importorskip("httpx")

LIMIT = 65536


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from llamaspec.testing.tiny_models import write_model

    d = tmp_path_factory.mktemp("body")
    s = Server(["-m", str(write_model("llama", d / "llama.gguf")), "--spec-type", "none", "-c", "256", "-t", "1",
                "--max-body-size", str(LIMIT)], d / "server.log")
    yield s
    s.stop()


def _urllib_post(url: str, body: bytes) -> tuple[int, dict]:
    """urllib (``Connection: close``, the body written after the head): the client that got a reset."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("size", [1 << 20, 32 << 20])
def test_a_large_body_gets_a_readable_413(srv, size):
    """Megabytes past the limit, with a Content-Length: more than the sockets buffer, so a server that answers
    and closes at once resets the connection under the client's writes."""
    body = b'{"prompt": "' + b"x" * size + b'"}'
    for _ in range(3):  # a reset is a race: each try must read the answer
        code, err = _urllib_post(srv.url + "/completion", body)
        assert code == 413 and err["error"]["type"] == "invalid_request_error", err
        assert str(LIMIT) in err["error"]["message"] and "--max-body-size" in err["error"]["message"]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/completion", content=body, headers={"Content-Type": "application/json"})
        _error(r, 413, "invalid_request_error")
        assert c.get("/health").status_code == 200  # the same connection still serves


def test_a_chunked_body_over_the_limit_gets_a_readable_413(srv):
    def chunks():  # no Content-Length: counted while it arrives
        yield b'{"prompt": "'
        for _ in range(256):
            yield b"x" * 8192
        yield b'"}'

    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/completion", content=chunks(), headers={"Content-Type": "application/json"})
        _error(r, 413, "invalid_request_error")


def test_past_the_drain_bound_the_connection_closes(srv):
    """Draining is bounded: a client announcing gigabytes gets the 413 and a closed connection, not a server
    that reads them all."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10000000000\r\n\r\n" + b"x" * 4096)
        data = b""
        while True:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            data += got
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
