"""``llamaspec serve`` bounds a prompt's special-token texts before llama.cpp tokenises it, and stops work in
its worker threads once the client went away (issue 36's last two points), against a real server process on
SmolLM2-135M (``<|im_start|>`` and 16 more special tokens), ``-c 2048 -np 2`` (1024 tokens a slot).

Time bounds are generous (a busy 2-core machine): before the bound, 80,000 ``<|im_start|>`` took 13.6 s to a 400
and 90,000 ``<|im_end|>`` in a chat message 14.8 s; a /v1/responses input of 100k messages (200k special texts
once templated) did not answer within 40 s.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from helpers import real_model
from support.server import Server
from test_server import _error

httpx = pytest.importorskip("httpx")

N_CTX_SEQ = 1024


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("abandon")
    s = Server(["-m", str(real_model("smollm2-135m-q4_1")), "-c", "2048", "-np", "2", "--spec-type", "none",
                "-t", "1"], d / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@contextmanager
def _health_watch(url: str):
    """Poll /health in a thread meanwhile; yields the list of its latencies (s)."""
    times: list[float] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=url, timeout=10) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                times.append(time.monotonic() - t0)
                stop.wait(0.1)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not times and time.monotonic() < deadline:  # polling before the request starts
        time.sleep(0.01)
    try:
        yield times
    finally:
        stop.set()
        th.join(15)


@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": "<|im_start|>" * 80_000, "n_predict": 1}),
    ("/v1/completions", {"prompt": ["hello", "<|endoftext|>" * 75_000], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<|im_end|>" * 90_000}], "max_tokens": 1}),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * 100_000, "max_output_tokens": 1}),
], ids=["completion", "oai-completions", "chat", "responses-100k-messages"])
@pytest.mark.real
def test_special_token_texts_bounded_before_tokenising(srv, http, path, body):
    with _health_watch(srv.url) as health:
        t0 = time.monotonic()
        e = _error(http.post(path, json=body), 400, "exceed_context_size_error")
        took = time.monotonic() - t0
    assert e["n_ctx"] == N_CTX_SEQ and e["n_prompt_tokens"] >= 75_000, e
    assert took < 6, f"{path}: the 400 took {took:.1f} s"
    assert health and max(health) < 1, health
    # the server serves afterwards, and a prompt of special texts that fits is not refused
    r = http.post("/completion", json={"prompt": "<|im_start|>" * 200, "n_predict": 1})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] == 200, r.text


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.real
def test_abandoned_work_stops(srv, http):
    """/tokenize with_pieces of a million astral characters (4M tokens: some 15 s of a worker thread here): the
    client closes its socket after a second; the server logs that it stopped the work and its CPU goes idle,
    instead of running the loop to its end."""
    body = json.dumps({"content": "\U0001d54f" * 1_000_000, "with_pieces": True}, ensure_ascii=False).encode()
    log_before = srv.log.read_text(errors="replace").count("abandoned work stopped: /tokenize")
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(1.5)  # the body is read and the worker runs
    sock.close()
    deadline = time.monotonic() + 10
    while srv.log.read_text(errors="replace").count("abandoned work stopped: /tokenize") == log_before:
        assert time.monotonic() < deadline, "the work was not stopped within 10 s:\n" + srv.log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(0.5)
    c0 = _cpu_s(srv.proc.pid)
    time.sleep(2)
    busy = _cpu_s(srv.proc.pid) - c0
    assert busy < 0.8, f"the server used {busy:.2f} s of CPU in 2 s after the client left"
    assert http.post("/tokenize", json={"content": "hi"}).json()["tokens"]


@pytest.mark.real
def test_tokenize_answers_when_the_client_stays(http):
    """The flag is set only by a disconnect: a client that waits gets the whole answer."""
    r = http.post("/tokenize", json={"content": "\U0001d54f" * 20_000, "with_pieces": True})
    assert r.status_code == 200 and len(r.json()["tokens"]) >= 20_000
