"""Schemathesis against a real ``llamaspec serve`` process on 127.0.0.1 (tiny models, a draft, 2 slots, an API
key, every optional route on: tests/support/openapi_fuzz.py), driven by the server's own live
``/openapi.json``: every operation gets positive cases (bodies that fit its schema), negative ones (bodies,
query and path parameters that violate it, raw bytes) and some of Schemathesis's coverage cases (boundary
values, each wrong type, missing required fields, unexpected methods), each sent with random extra headers
and content types and, now and then, a wrong key. Required: no answer >= 500, no transport error, every
Schemathesis check passing (``not_a_server_error``, status codes, content types and response bodies as
documented, SSE events included, negative data refused with a 4xx, 405 for unexpected methods), ``/health``
200 throughout and the process alive. Bounded (derandomized, ~40 s on 2 cores); ``scripts/fuzz_openapi.py``
runs it long."""
from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("schemathesis")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from support.load_run import ServerProcess  # noqa: E402
from support.openapi_fuzz import KEY, MODES, fuzz, server_args  # noqa: E402

#: per operation: Hypothesis cases in each of the positive and negative modes, and coverage cases
EXAMPLES, COVERAGE = 3, 8
SECONDS = 50.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("schemathesis")
    srv = ServerProcess(server_args(d), d / "server.log", ready_timeout=120)
    yield srv
    rc = srv.terminate(30)
    assert rc == 0, srv.tail()


@pytest.mark.timeout(300)
def test_schemathesis_every_operation(server):
    t0 = time.monotonic()
    rep = fuzz(server.url, max_examples=EXAMPLES, coverage_limit=COVERAGE, seconds=SECONDS, modes=MODES)
    text = rep.summary() + "\n--- server log ---\n" + server.tail()
    print(rep.summary())
    assert rep.n_5xx == 0 and not rep.server_errors, text
    assert not rep.transport_errors and not rep.failures and not rep.failed_checks, text
    assert server.proc.poll() is None, text
    assert set(rep.health) == {200} and rep.health[200] >= 25, text
    # every operation was reached, in every mode that has something to send
    ops = {op for op in rep.by_operation}
    assert len(ops) == 25 and not rep.timed_out, text
    assert {200, 400, 401, 405} <= set(rep.by_status), text
    assert rep.examples >= 300, text
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200
    r = httpx.get(server.url + "/slots", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and not any(s["is_processing"] for s in r.json()), r.text
    assert time.monotonic() - t0 < SECONDS + 30
