"""``llamaspec serve`` at its limits (issue 21): bounded work per request and per server, hostile input, no
thread per generation, and a graceful SIGTERM. Against the real server process (``tests/test_server.py``'s
:class:`Server`), with the tiny ``llama`` model written with an 8192-token training context (long streams),
and small limits so that each one is cheap to reach. docs/limits.md lists the limits and their answers.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from support.server import Server
from test_server import _error, _prompt, _sse, _wait_idle

httpx = pytest.importorskip("httpx")

N_CTX_SEQ = 1024  # -c 2048 over -np 2
LIMITS = ["--max-request-generations", "8", "--max-queued-generations", "12", "--max-prompt-chars", "2000",
          "--max-stop", "4", "--max-stop-chars", "16", "--max-json-depth", "16", "--max-body-size", "65536",
          "--max-grammar-alternatives", "1000"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from llamaspec.testing.tiny_models import write_model

    d = tmp_path_factory.mktemp("limits")
    target = write_model("llama", d / "llama.gguf", n_ctx=8192)
    s = Server(["-m", str(target), "--spec-type", "none", "-np", "2", "-c", "2048", "-b", "64", "-t", "1",
                "--chat-template", "chatml", *LIMITS], d / "server.log")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.log.read_text()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def _raw(http, path: str, raw: bytes, **kw):
    return http.post(path, content=raw, headers={"Content-Type": "application/json"}, **kw)


def _names(err: dict, *words: str) -> None:
    for w in words:
        assert w in err["message"], err


# ---------------------------------------------------------------------------------------------------
# bounded work per request
# ---------------------------------------------------------------------------------------------------
def test_prompts_times_n_is_bounded(http):
    ok = http.post("/v1/completions", json={"prompt": [_prompt(i, 4) for i in range(4)], "n": 2, "max_tokens": 2,
                                            "temperature": 0})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8, ok.text
    e = _error(http.post("/v1/completions", json={"prompt": [_prompt(i, 4) for i in range(3)], "n": 3, "max_tokens": 2}),
               400, "invalid_request_error")
    _names(e, "9 generations", "3 prompts", "8", "--max-request-generations")
    # the user's reports: 200 prompts x n 16 (had not answered after 5 minutes) and 2,000 prompts (a 500
    # "can't start new thread"): both a 400 at once
    for n_prompts, n in ((200, 16), (2000, 1)):
        t0 = time.monotonic()
        e = _error(http.post("/v1/completions", json={"prompt": ["tok_1 tok_2"] * n_prompts, "n": n, "max_tokens": 2}),
                   400, "invalid_request_error")
        assert time.monotonic() - t0 < 5
        _names(e, "--max-request-generations")
    _error(http.post("/v1/completions", json={"prompt": [1, 2], "n": 0}), 400, "invalid_request_error")


def test_prompt_text_is_bounded(http):
    e = _error(http.post("/v1/completions", json={"prompt": "x" * 2001, "max_tokens": 1}), 400, "invalid_request_error")
    _names(e, "prompt", "2001", "2000", "--max-prompt-chars")
    e = _error(http.post("/v1/completions", json={"prompt": ["x" * 1000, "y" * 1001], "max_tokens": 1}), 400,
               "invalid_request_error")
    _names(e, "--max-prompt-chars")
    e = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 1500},
                                                                    {"role": "user", "content": "y" * 600}]}),
               400, "invalid_request_error")
    _names(e, "messages", "--max-prompt-chars")
    e = _error(http.post("/tokenize", json={"content": "x" * 2001}), 400, "invalid_request_error")
    _names(e, "content", "--max-prompt-chars")
    # a token list longer than the context: the context error, before any work
    e = _error(http.post("/v1/completions", json={"prompt": [1] * 5000}), 400, "exceed_context_size_error")
    assert e["n_ctx"] == N_CTX_SEQ


def test_stop_strings_are_bounded(http):
    base = {"prompt": [1, 2], "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json={**base, "stop": ["a", "b", "c", "d"]}).status_code == 200
    e = _error(http.post("/v1/completions", json={**base, "stop": ["a", "b", "c", "d", "e"]}), 400, "invalid_request_error")
    _names(e, "stop", "5", "4", "--max-stop")
    e = _error(http.post("/v1/completions", json={**base, "stop": "z" * 17}), 400, "invalid_request_error")
    _names(e, "stop", "17", "16", "--max-stop-chars")


def test_grammar_alternatives_are_bounded(http):
    """A grammar's alternatives open at once (an enum's values: each costs a pass over the vocabulary per token)
    are bounded by --max-grammar-alternatives: 1000 here, above the default 512 (tests/test_grammar_alternatives.py)."""
    base = {"prompt": [1, 2], "max_tokens": 2, "temperature": 0}
    ok = http.post("/completion", json={**base, "json_schema": {"enum": list(range(500))}})
    assert ok.status_code == 200 and ok.json()["content"] in {str(i) for i in range(500)}, ok.text
    t0 = time.monotonic()
    e = _error(http.post("/completion", json={**base, "json_schema": {"enum": list(range(1500))}}), 400,
               "invalid_request_error")
    assert time.monotonic() - t0 < 5
    _names(e, "json_schema", "1500 alternatives", "1000", "--max-grammar-alternatives")
    g = "root ::= " + " | ".join(f'"{i:x}"' for i in range(1500))
    _names(_error(http.post("/v1/completions", json={**base, "grammar": g}), 400, "invalid_request_error"),
           "grammar", "1500", "--max-grammar-alternatives")


def test_json_depth_is_bounded(http):
    def nested(depth: int) -> bytes:
        return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"

    e = _error(_raw(http, "/v1/completions", nested(16)), 400, "invalid_request_error")
    _names(e, "prompt", "17", "16", "--max-json-depth")
    for depth in (3_000, 30_000):  # was a 500 RecursionError
        e = _error(_raw(http, "/v1/completions", nested(depth)), 400, "invalid_request_error")
        _names(e, "prompt", "--max-json-depth")
    e = _error(_raw(http, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "x": '
                    + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}"), 400, "invalid_request_error")
    _names(e, "'x'", "--max-json-depth")
    # brackets inside strings are text, not nesting
    r = http.post("/v1/completions", json={"prompt": "[[[[[[[[[[[[[[[[[[[[ {{{{{{{{{{{{{{{{{{", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_body_size_is_bounded(http):
    big = json.dumps({"prompt": [1, 2], "pad": "x" * 70_000}).encode()
    e = _error(_raw(http, "/v1/completions", big), 413, "invalid_request_error")
    _names(e, "65536", "--max-body-size")

    def chunks():  # no Content-Length: counted while it arrives
        yield b'{"prompt": [1, 2], "pad": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}'

    e = _error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413,
               "invalid_request_error")
    _names(e, "--max-body-size")
    assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------------
# hostile text and numbers
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udc00"], "max_tokens": 1}', "prompt[1]"),
    ("/completion", b'{"prompt": [1, 2], "stop": ["\\ud800"], "n_predict": 1}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
    ("/tokenize", b'{"content": "\\udfff"}', "content"),
    ("/v1/completions", b'{"prompt": [1, 2], "grammar": "root ::= \\"\\ud800\\""}', "grammar"),
])
def test_lone_surrogates_are_400(http, path, body, field):
    e = _error(_raw(http, path, body), 400, "invalid_request_error")
    _names(e, f"'{field}'", "surrogate")


def test_surrogate_pairs_and_bad_utf8(http):
    r = _raw(http, "/tokenize", b'{"content": "\\ud83d\\ude00"}')  # a pair is one character: fine
    assert r.status_code == 200, r.text
    e = _error(_raw(http, "/v1/completions", b'{"prompt": "\xed\xa0\x80"}'), 400, "invalid_request_error")  # UTF-8 of a surrogate
    _names(e, "UTF-8")
    _error(_raw(http, "/v1/completions", b'{"prompt": "\xff"}'), 400, "invalid_request_error")


def test_repeat_last_n_range(http):
    base = {"prompt": _prompt(3, 8), "n_predict": 40, "temperature": 0, "repeat_penalty": 3.0, "ignore_eos": True,
            "return_tokens": True}
    for bad in (1_000_000_000, N_CTX_SEQ + 1, -2):
        e = _error(http.post("/completion", json={**base, "repeat_last_n": bad}), 400, "invalid_request_error")
        _names(e, "repeat_last_n", str(N_CTX_SEQ))
    out = {}
    for n in (-1, N_CTX_SEQ, 0):
        r = http.post("/completion", json={**base, "repeat_last_n": n})
        assert r.status_code == 200, r.text
        out[n] = r.json()
    # -1 = the context size, as llama-server
    assert out[-1]["generation_settings"]["repeat_last_n"] == N_CTX_SEQ
    assert len(out[-1]["tokens"]) == 40 and out[-1]["tokens"] == out[N_CTX_SEQ]["tokens"]
    assert out[-1]["content"] == out[N_CTX_SEQ]["content"]
    assert out[N_CTX_SEQ]["tokens"] != out[0]["tokens"]  # the penalty does act on this prompt


@pytest.mark.parametrize("field,value", [
    ("top_k", "1099511627776"), ("n_predict", "2147483648"), ("max_tokens", "-2"), ("seed", "4294967296"),
    ("seed", "-2"), ("temperature", "1e400"), ("top_p", "-0.1"), ("min_p", "1.5"), ("repeat_penalty", "-1"),
    ("presence_penalty", '"a"'), ("frequency_penalty", "-1e400"), ("n", "1000000"), ("id_slot", "1099511627776"),
    ("typical_p", '"x"'), ("speculative.n_max", "-1"), ("speculative.n_min", "1099511627776"),
    ("speculative.p_min", "2.0"), ("cache_prompt", "1"), ("n_probs", "1099511627776"), ("min_keep", "-1"),
    ("n_keep", "1099511627776"),
])
def test_numeric_fields_out_of_range(http, field, value):
    raw = b'{"prompt": [1, 2], "max_tokens": 2, "%s": %s}' % (field.encode(), value.encode())
    if field == "max_tokens":
        raw = b'{"prompt": [1, 2], "max_tokens": %s}' % value.encode()
    e = _error(_raw(http, "/v1/completions", raw), 400, "invalid_request_error")
    _names(e, field)


def test_a_field_refused_late_releases_its_generations(http):
    """Found by tests/test_fuzz_server.py: ``"verbose": []`` was refused (400) only after the request's
    generations were submitted, and they were never released: each such request held a place of
    --max-queued-generations (12 here) for good, so that 12 of them made the server answer 503 to everyone."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "verbose": []}
    for _ in range(8):
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1,
                                                                                 "verbose": "yes"})):
            _names(_error(http.post(path, json=body), 400, "invalid_request_error"), "verbose")
    ok = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200, ok.text
    _wait_idle(http)


# ---------------------------------------------------------------------------------------------------
# per server: the queue, and no thread per generation
# ---------------------------------------------------------------------------------------------------
def _threads(srv) -> int:
    for line in Path(f"/proc/{srv.proc.pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _streams(srv, n_streams: int, n_each: int, started: threading.Event, stop: threading.Event, errors: list):
    """``n_streams`` streaming requests of ``n_each`` long generations each; they leave when ``stop`` is set."""
    body = {"prompt": [_prompt(50 + i, 6) for i in range(n_each)], "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    seen = [0]

    def run() -> None:
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    errors.append(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen[0] += 1
                        if seen[0] >= n_streams:
                            started.set()
                    if stop.is_set():
                        return
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    ts = [threading.Thread(target=run, daemon=True) for _ in range(n_streams)]
    for t in ts:
        t.start()
    return ts


def test_queue_is_bounded_and_no_thread_per_generation(srv, http):
    _wait_idle(http)
    base_threads = _threads(srv)
    started, stop, errors = threading.Event(), threading.Event(), []
    ts = _streams(srv, 2, 6, started, stop, errors)  # 12 generations: the queue is full
    try:
        assert started.wait(30), errors
        time.sleep(0.3)
        during = _threads(srv)
        assert during - base_threads <= 3, f"{during - base_threads} more threads for 12 generations"
        r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        e = _error(r, 503, "unavailable_error")
        _names(e, "12", "--max-queued-generations")
        assert int(r.headers["retry-after"]) >= 1
        assert http.get("/health").status_code == 200
    finally:
        stop.set()
        for t in ts:
            t.join(30)
    assert not errors, errors
    _wait_idle(http)
    deadline = time.monotonic() + 10
    while True:  # the disconnected streams' generations leave the queue
        r = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_health_answers_while_prompts_are_tokenised(srv, http):
    """Tokenising and submitting run off the event loop: /health stays quick while requests with many
    string prompts are prepared."""
    import concurrent.futures as cf

    body = {"prompt": ["tok_1 tok_2 " * 20] * 8, "max_tokens": 1, "temperature": 0}
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(lambda: httpx.post(srv.url + "/v1/completions", json=body, timeout=60)) for _ in range(4)]
        worst = 0.0
        while not all(f.done() for f in futs):
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
        assert all(f.result().status_code in (200, 503) for f in futs)
    assert worst < 2.0


# ---------------------------------------------------------------------------------------------------
# the flags and graceful shutdown
# ---------------------------------------------------------------------------------------------------
def test_limit_flags_in_help_and_checked():
    from click.testing import CliRunner

    from llamaspec.cli.main import main

    r = CliRunner().invoke(main, ["serve", "--help"])
    for flag in ("--max-request-generations", "--max-queued-generations", "--max-prompt-chars", "--max-stop",
                 "--max-stop-chars", "--max-json-depth", "--max-body-size", "--max-grammar-alternatives",
                 "--shutdown-timeout"):
        assert flag in r.output, flag
    r = CliRunner().invoke(main, ["serve", "-m", "/no/such.gguf", "--max-json-depth", "0"])
    assert r.exit_code == 2 and "--max-json-depth" in r.output


def test_sigterm_drains_then_exits_0(tiny_model, tmp_path):
    from llamaspec.testing.tiny_models import write_model

    target = write_model("llama", tmp_path / "llama.gguf", n_ctx=32768)
    s = Server(["-m", str(target), "--spec-type", "none", "-np", "2", "-c", "32768", "-t", "1",
                "--shutdown-timeout", "2"], tmp_path / "drain.log")
    try:
        short = {"prompt": _prompt(1, 4), "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
        long = {**short, "max_tokens": 16000}  # far longer than the drain
        results: dict[str, list] = {}
        started = {"short": threading.Event(), "long": threading.Event()}

        def run(name, body):
            with httpx.Client(base_url=s.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started[name].set()
            results[name] = _sse(lines)

        ts = [threading.Thread(target=run, args=(k, b), daemon=True) for k, b in (("short", short), ("long", long))]
        for t in ts:
            t.start()
        assert started["short"].wait(30) and started["long"].wait(30)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=10)
        _names(_error(r, 503, "unavailable_error"), "shutting down")
        assert httpx.get(s.url + "/health", timeout=10).status_code == 503
        for t in ts:
            t.join(30)
        assert results["short"][-1] == "[DONE]"  # finished within the drain time
        assert "error" in results["long"][-1]  # cut at the drain timeout with an error event
        assert s.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
    finally:
        s.stop()


def test_second_sigterm_stops_at_once(tiny_model, tmp_path):
    from llamaspec.testing.tiny_models import write_model

    target = write_model("llama", tmp_path / "llama.gguf", n_ctx=32768)
    s = Server(["-m", str(target), "--spec-type", "none", "-np", "1", "-c", "32768", "-t", "1",
                "--shutdown-timeout", "60"], tmp_path / "force.log")
    try:
        started = threading.Event()

        def run():
            try:
                with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                                  json={"prompt": [1, 2], "max_tokens": 30000, "ignore_eos": True, "stream": True}) as r:
                    for _ in r.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert started.wait(30)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert s.proc.poll() is None  # draining: up to 60 s
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(10)
        assert time.monotonic() - t0 < 5
        t.join(10)
    finally:
        s.stop()


def test_cli_defaults_are_the_servers():
    from dataclasses import asdict

    from llamaspec.cli.limit_options import DEFAULTS, KEYS
    from llamaspec.server.limits import Limits

    assert {k: asdict(Limits())[k] for k in KEYS} == DEFAULTS


def test_sigterm_exits_in_bounded_time_with_abandoned_work(tmp_path):
    """SIGTERM while worker threads template prompts whose clients left (a template slow enough to run for
    minutes): the drain finds no generation, uvicorn stops, and the process exits 0 within its deadline
    (--shutdown-timeout + 4.5 s) instead of waiting at exit for the threads (issue 36)."""
    from llamaspec.testing.tiny_models import write_model

    target = write_model("llama", tmp_path / "llama.gguf")
    slow = "{% for m in messages %}{% for n in messages %}{% endfor %}{{ m['content'] }}{% endfor %}"
    s = Server(["-m", str(target), "--spec-type", "none", "-np", "1", "-c", "256", "-t", "1", "--jinja",
                "--chat-template", slow, "--shutdown-timeout", "2"], tmp_path / "abandoned.log")
    try:
        body = {"messages": [{"role": "user", "content": "x"}] * 20000, "max_tokens": 1}
        for _ in range(2):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(s.url + "/v1/chat/completions", json=body, timeout=1.5)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # the event loop is free meanwhile
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
    finally:
        s.stop()
