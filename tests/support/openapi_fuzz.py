"""Schemathesis against a live ``llamaspec serve``: the server's own ``GET /openapi.json``
(:mod:`llamaspec.server.openapi`) drives requests to every operation in three modes (:data:`MODES`):
``positive`` (Hypothesis cases that fit the schemas), ``negative`` (bodies, query and path parameters that
violate them, raw bytes) and ``coverage`` (Schemathesis's deterministic cases: boundary values, every wrong
type, missing required fields, unexpected methods). The Hypothesis cases go with random extra headers and
content types and, one in ten, a wrong API key; ``/health`` is polled every second throughout.

Used by ``tests/test_schemathesis.py`` (bounded) and ``scripts/fuzz_openapi.py`` (long). Needs the
``schemathesis`` package (the ``dev`` extra; its Python API: ``openapi.from_dict``, ``as_strategy``,
``iter_coverage_cases``, ``Case.call`` / ``validate_response``).

The checks (:data:`CHECK_NAMES`): no 5xx (``not_a_server_error``), every status, content type and header
documented, every JSON body and SSE event matching its response schema, every negative case refused with a
4xx (``negative_data_rejection``: the schemas are no stricter than the server), 405 for an unexpected method.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

__all__ = ["KEY", "MODES", "CHECK_NAMES", "server_args", "Report", "fuzz"]

KEY = "sk-fuzz"
#: Hypothesis cases that fit the schemas, cases that violate them, Schemathesis's coverage cases
MODES = ("positive", "negative", "coverage")
#: the tiny llama's ids that stand in for FIM tokens
FIM = {"pre": 60, "suf": 61, "mid": 62, "sep": 59, "rep": 58}
#: the Schemathesis checks every answer goes through
CHECK_NAMES = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
               "response_schema_conformance", "response_headers_conformance", "negative_data_rejection",
               "unsupported_method")
#: content types sent instead of application/json (the server reads every body as JSON)
CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=latin-1", "application/octet-stream", "*/*", "", "garbage")


def server_args(d: Path) -> list[str]:
    """``llamaspec serve`` arguments for a fuzz run: the tiny models (written to ``d``), 2 slots of 256 tokens,
    a draft model, every optional route on (``--metrics``, ``--props``, ``--slot-save-path``), an API key and
    small limits (so that a fuzzed request stays cheap)."""
    from .fim import with_fim_tokens
    from llamaspec.testing.tiny_models import write_model

    # FIM tokens (three of the tiny vocabulary's ids) so that /infill answers, not a 501
    target = with_fim_tokens(write_model("llama", d / "plain.gguf"), d / "llama.gguf", **FIM)
    draft = write_model("llama-draft", d / "llama-draft.gguf")
    (d / "slots").mkdir(exist_ok=True)
    return ["-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "--no-spec-draft-adaptive",
            "-np", "2", "-c", "512", "-b", "32", "-t", "1", "--chat-template", "chatml", "--metrics", "--props",
            "--slot-save-path", str(d / "slots"), "--api-key", KEY, "--max-request-generations", "4",
            "--max-prompt-chars", "4000", "--max-stop", "4", "--max-stop-chars", "16", "--max-json-depth", "16",
            "--max-body-size", "65536"]


@dataclass
class Report:
    """What a run saw."""

    examples: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    #: (operation, mode, check name, status, message and curl) of the failed checks, at most ``keep`` per check
    failures: list = field(default_factory=list)
    failed_checks: Counter = field(default_factory=Counter)
    #: (operation, status, curl) of every answer >= 500
    server_errors: list = field(default_factory=list)
    transport_errors: list = field(default_factory=list)
    health: Counter = field(default_factory=Counter)
    #: the slowest /health answer, seconds
    health_max_s: float = 0.0
    #: "mode operation" pairs with no case to generate (negative mode, nothing to make invalid)
    unsatisfiable: list = field(default_factory=list)
    seconds: float = 0.0
    timed_out: bool = False

    def add(self, other: "Report") -> None:
        """Count ``other``'s run in this one (several passes of a long run)."""
        self.examples += other.examples
        for mine, theirs in ((self.by_status, other.by_status), (self.by_operation, other.by_operation),
                             (self.failed_checks, other.failed_checks), (self.health, other.health)):
            mine.update(theirs)
        self.failures += other.failures
        self.server_errors += other.server_errors
        self.transport_errors += other.transport_errors
        self.health_max_s = max(self.health_max_s, other.health_max_s)
        self.seconds += other.seconds
        self.timed_out = self.timed_out or other.timed_out

    @property
    def ok(self) -> bool:
        """No answer >= 500, no failed check, no transport error, /health 200 every time."""
        return (not self.n_5xx and not self.failed_checks and not self.transport_errors
                and set(self.health) <= {200})

    def to_json(self) -> dict:
        return {"ok": self.ok, "requests": self.examples, "seconds": round(self.seconds, 1), "n_5xx": self.n_5xx,
                "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
                "by_operation": dict(sorted(self.by_operation.items())),
                "failed_checks": dict(self.failed_checks), "health": {str(k): v for k, v in self.health.items()},
                "health_max_ms": round(self.health_max_s * 1e3), "failures": self.failures,
                "server_errors": self.server_errors, "transport_errors": self.transport_errors}

    @property
    def n_5xx(self) -> int:
        return sum(n for code, n in self.by_status.items() if code >= 500)

    def summary(self) -> str:
        lines = [f"{self.examples} requests in {self.seconds:.1f} s"
                 + (" (time limit reached)" if self.timed_out else ""),
                 "status codes: " + ", ".join(f"{c}: {n}" for c, n in sorted(self.by_status.items())),
                 f">= 500: {self.n_5xx}; transport errors: {len(self.transport_errors)}",
                 "/health: " + ", ".join(f"{c}: {n}" for c, n in sorted(self.health.items(), key=str))
                 + f" (slowest {self.health_max_s * 1e3:.0f} ms)",
                 "failed checks: " + (", ".join(f"{k}: {n}" for k, n in sorted(self.failed_checks.items())) or "none")]
        if self.unsatisfiable:
            lines.append("nothing to generate: " + ", ".join(self.unsatisfiable))
        lines += ["  per operation: " + ", ".join(f"{k} {n}" for k, n in sorted(self.by_operation.items()))]
        for op, mode, name, status, text in self.failures[:20]:
            lines.append(f"  FAILED {name} on {op} ({mode}, {status}): {text}")
        for op, status, curl in self.server_errors[:20]:
            lines.append(f"  {status} on {op}: {curl}")
        for op, err in self.transport_errors[:20]:
            lines.append(f"  transport error on {op}: {err}")
        return "\n".join(lines)


def _checks(names) -> list:
    from schemathesis import checks

    checks.load_all_checks()
    return [getattr(checks, n) for n in names]


def _headers(key: str):
    """Random extra headers: a content type, an Accept, an unknown header, and now and then a wrong key."""
    from hypothesis import strategies as st

    value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=20).map(str.strip)
    wrong_key = st.sampled_from(["Bearer wrong", "Basic Zm9vOmJhcg==", "", "Bearer " + key + "x"])
    extra = st.fixed_dictionaries({}, optional={
        "Content-Type": st.sampled_from(CONTENT_TYPES),
        "Accept": st.sampled_from(["*/*", "text/event-stream", "application/xml", "", "garbage"]),
        "X-Fuzz": value, "Origin": st.sampled_from(["http://localhost:1", "null", "https://x.example"])})
    # one request in ten with a wrong key
    return st.tuples(extra, st.integers(0, 9), wrong_key).map(
        lambda t: {**t[0], "Authorization": t[2]} if t[1] == 3 else t[0])


def _description(case) -> str:
    """What a case is (a coverage case's scenario: "max_tokens: Incorrect type"), or ""."""
    data = getattr(getattr(case.meta, "phase", None), "data", None)
    return getattr(data, "description", None) or ""


def _curl(case, headers: dict, url: str) -> str:
    return case.as_curl_command(headers=headers, base_url=url)[:2000]


def _bind(send: Callable, mode: str, label: str) -> Callable:
    """``send`` for one operation and mode, as a function of Hypothesis's arguments."""
    def one(case, extra) -> None:
        send(case, extra, mode, label)

    return one


def _coverage(schema, op, limit: int | None) -> list:
    """Schemathesis's coverage cases of ``op`` (boundary values, every wrong type, missing required fields,
    unexpected methods), at most ``limit`` of them spread evenly (None: all)."""
    from schemathesis import GenerationMode

    cases = list(schema.iter_coverage_cases(op, generation_modes=list(GenerationMode),
                                            generation_config=schema.config.generation_for(operation=op)))
    if limit is not None and len(cases) > limit:
        step = len(cases) / limit
        cases = [cases[int(i * step)] for i in range(limit)]
    return cases


def fuzz(url: str, *, max_examples: int = 20, seconds: float = 60.0, seed: int | None = None,
         modes: tuple[str, ...] = MODES, checks: tuple[str, ...] = CHECK_NAMES, coverage_limit: int | None = None,
         operations: str = "", key: str = KEY, request_timeout: float = 30.0, keep: int = 5,
         health_interval: float = 1.0, log: Callable[[str], None] | None = None) -> Report:
    """Fuzz the server at ``url`` for at most ``seconds``: ``max_examples`` Hypothesis cases per operation in
    the ``positive`` and ``negative`` modes (``seed`` fixes them; None: derandomized), the ``coverage`` cases
    (at most ``coverage_limit`` per operation); ``operations``: only the paths that contain it; ``key``: the
    server's API key; ``log`` gets one line per request."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, settings
    from schemathesis.core.failures import FailureGroup

    # from the live description, as a dict: Schemathesis leaves the operation it loaded a schema from untested
    schema = schemathesis.openapi.from_dict(httpx.get(url + "/openapi.json", timeout=30,
                                                       headers={"Authorization": f"Bearer {key}"}).raise_for_status().json())
    check_fns = _checks(checks)
    auth = {"Authorization": f"Bearer {key}"}
    rep = Report()
    t0 = time.monotonic()
    deadline = t0 + seconds
    session = requests.Session()
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if operations in op.path]
    cfg = settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None,
                   phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))

    def send(case, extra: dict, mode: str, label: str) -> None:
        if time.monotonic() > deadline:
            rep.timed_out = True
            return
        headers = {**auth, **extra}
        rep.examples += 1
        rep.by_operation[label] += 1
        try:
            resp = case.call(base_url=url, session=session, headers=headers, timeout=request_timeout)
        except (requests.RequestException, OSError) as e:
            rep.transport_errors.append((label, f"{type(e).__name__}: {e}"[:300]))
            return
        rep.by_status[resp.status_code] += 1
        if log is not None:
            log(f"{mode:8} {case.method.upper():7} {case.formatted_path:40} {resp.status_code} "
                f"{resp.elapsed.total_seconds() * 1e3:7.1f} ms")
        if resp.status_code >= 500:
            rep.server_errors.append((label, resp.status_code, _curl(case, headers, url)))
        if headers.get("Authorization") != auth["Authorization"]:
            return  # a wrong key: a 401, no other check applies
        try:
            case.validate_response(resp, checks=check_fns, headers=headers, transport_kwargs={"base_url": url})
        except FailureGroup as group:
            what = _description(case)
            for f in group.exceptions:
                name = type(f).__name__
                rep.failed_checks[name] += 1
                seen = sum(1 for x in rep.failures if x[2] == name and x[0] == label)
                if seen < keep:
                    text = " ".join(str(f).split())[:400]
                    rep.failures.append((label, mode, name, resp.status_code,
                                         f"{what}: {text}\n    {_curl(case, headers, url)}"))

    lock = threading.Lock()

    def health() -> None:
        t = time.monotonic()
        try:
            got: int | str = httpx.get(url + "/health", timeout=10).status_code
        except httpx.HTTPError as e:
            got = type(e).__name__
        with lock:
            rep.health[got] += 1
            rep.health_max_s = max(rep.health_max_s, time.monotonic() - t)

    stop = threading.Event()

    def poll() -> None:  # /health throughout, besides after each operation
        while not stop.wait(health_interval):
            health()

    poller = threading.Thread(target=poll, name="fuzz-health", daemon=True)
    poller.start()
    try:
        _run(ops, modes, schema, send, health, rep, cfg, seed, deadline, coverage_limit, _headers(key))
    finally:
        stop.set()
        poller.join()
    rep.seconds = time.monotonic() - t0
    session.close()
    return rep


def _run(ops, modes, schema, send, health, rep: Report, cfg, seed, deadline: float, coverage_limit,
         headers) -> None:
    from hypothesis import given, seed as hseed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    for op in ops:  # every mode for one operation, then the next (a time limit leaves whole operations out)
        for mode in modes:
            if time.monotonic() > deadline:
                rep.timed_out = True
                return
            label = f"{op.method.upper()} {op.path}"
            if mode == "coverage":
                for case in _coverage(schema, op, coverage_limit):
                    send(case, {}, mode, label)
                health()
                continue

            one = cfg(given(case=op.as_strategy(generation_mode=GenerationMode(mode)), extra=headers)(
                _bind(send, mode, label)))
            if seed is not None:
                one = hseed(seed)(one)
            try:
                one()
            except Unsatisfiable:  # negative mode on an operation with nothing to make invalid
                rep.unsatisfiable.append(f"{mode} {label}")
            health()

