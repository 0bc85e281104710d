"""The load & fault run of ``scripts/load_faults.py``: a real ``llamaspec serve`` process on 127.0.0.1, the
greedy references computed alone, ``clients`` concurrent clients for ``duration`` seconds drawing from the
mix (:mod:`.load_mix`) while ``/health``, ``/slots`` and ``/metrics`` are polled, then the checks at the end
(slots idle, the references again, resident memory, a SIGTERM drain that exits 0) and a report
(:func:`report`; ``report["ok"]`` is False on any failure).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from . import server
from .load_client import Result, execute, greedy_outcome, is_failure
from .faults import MESSAGE as INJECTED
from .load_mix import NEAR_TIE, WORDS, Call, MixContext, draw_call, greedy_pool

#: the folder that holds this package (tests/): a launcher module runs from it
SUPPORT_ROOT = Path(__file__).resolve().parents[1]

__all__ = ["RunConfig", "ServerProcess", "run", "report"]

HOST = server.HOST


@dataclass
class RunConfig:
    server_args: list[str]  # `llamaspec serve` arguments besides --host / --port
    clients: int = 64
    duration: float = 600.0
    seed: int = 0
    request_timeout: float = 120.0  # seconds one request may take before it counts as a hang
    pool: int = 12  # greedy requests with a reference answer
    near_tie: float = 0.01  # log-prob gap under which a greedy divergence is a near-tie, not a failure
    health_limit: float = 5.0  # the slowest /health answer allowed, seconds
    rss_limit_mb: float = 20.0  # RSS growth allowed: last quarter's median minus the median after the warm-up
    warmup: float = 0.25  # the fraction of the run before the memory baseline
    max_body: int = 1 << 20
    max_prompt_chars: int = 1 << 18
    log: str = "load-faults-server.log"
    #: the server's address-space limit (RLIMIT_AS), GB: a memory blow-up kills the server, not the machine; 0: none
    memory_limit_gb: float = 16.0
    #: native failures to inject during the load (support.faults: "decode=0.002,drafter=0.005,...")
    inject: str = ""


class ServerProcess(server.ServerProcess):
    """``llamaspec serve`` (through ``launcher``, a module of tests/, when given) on a free loopback port, its log
    in ``log``, ready once created; ``memory_limit_gb`` caps its address space (0: no cap)."""

    def __init__(self, args: list[str], log: Path, ready_timeout: float = 300.0, memory_limit_gb: float = 0.0,
                 launcher: list[str] | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if launcher:  # a launcher module of this package (support.faults): its folder, tests/, on the child's path
            env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        super().__init__([sys.executable, "-m", *(launcher or ["llamaspec.cli.main"]), "serve", "--host", HOST, *args],
                         env=env, cwd=os.getcwd(), log=log, ready_timeout=ready_timeout,
                         address_space=int(memory_limit_gb * 2 ** 30))
        #: while this file exists the server injects faults (``--inject``; None: it does not)
        self.inject_flag: Path | None = None
        self.start()

    def rss_mb(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a drain); the exit code, None if it did not exit in ``timeout`` s (then killed)."""
        self.stop_timeout = timeout  # (stop_signal: SIGTERM, the base class's default)
        code = self.stop()
        return None if self.killed else code


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@dataclass
class Record:
    by_kind: dict = field(default_factory=lambda: defaultdict(Counter))
    failures: list = field(default_factory=list)
    near_ties: list = field(default_factory=list)
    latency: list = field(default_factory=list)
    ttft: list = field(default_factory=list)
    tokens: int = 0
    greedy: Counter = field(default_factory=Counter)
    health: list = field(default_factory=list)
    health_bad: list = field(default_factory=list)
    polls: Counter = field(default_factory=Counter)
    rss: list = field(default_factory=list)
    kind_latency: dict = field(default_factory=lambda: defaultdict(list))

    def add(self, res: Result, cfg: RunConfig, pool) -> None:
        c = res.call
        if (res.outcome == "500" or res.outcome.startswith("error-event")) and INJECTED in res.detail:
            res.outcome = "injected"  # an injected native failure, confined to its request: as it should be
        if c.case is not None and res.outcome == "200":
            res.outcome, why = greedy_outcome(pool[c.case], res.text, cfg.near_tie)
            res.detail = why or res.detail
            self.greedy[res.outcome] += 1
        self.by_kind[c.kind][res.outcome] += 1
        self.kind_latency[c.kind].append(res.latency)
        if res.outcome == NEAR_TIE:
            self.near_ties.append(_describe(res))
        if is_failure(res) and res.outcome != "injected":
            self.failures.append(_describe(res))
        elif c.normal and res.outcome in ("200", NEAR_TIE):
            self.latency.append(res.latency)
            if res.ttft is not None:
                self.ttft.append(res.ttft)
            self.tokens += res.n_tokens


def _describe(res: Result) -> dict:
    c = res.call
    body = (c.body or b"")[:300].decode("utf-8", "replace")
    return {"kind": c.kind, "method": c.method, "path": c.path, "stream": c.stream, "action": c.action, "arg": c.arg,
            "outcome": res.outcome, "detail": res.detail, "note": c.note, "latency_s": round(res.latency, 3),
            "body": body}


async def _references(client: httpx.AsyncClient, pool, limit: float) -> list[str]:
    """Each greedy case alone: its prompt as tokens, its answer through /completion from those tokens (the
    output's pieces and top-2 gaps) and through its own route (the reference; the two must agree)."""
    problems = []
    for i, case in enumerate(pool):
        b = case.body
        if case.path == "/v1/chat/completions":
            text = (await client.post("/apply-template", json={"messages": b["messages"]})).json()["prompt"]
        else:
            text = b["prompt"]
        if isinstance(text, str):
            r = await client.post("/tokenize", json={"content": text, "add_special": True, "parse_special": True})
            case.prompt_tokens = r.json()["tokens"]
        else:
            case.prompt_tokens = list(text)
        n = b.get("n_predict", b.get("max_tokens"))
        r = await client.post("/completion", json={"prompt": case.prompt_tokens, "n_predict": n, "temperature": 0,
                                                   "n_probs": 2, "return_tokens": True}, timeout=limit)
        tok = r.json()
        probs = tok.get("completion_probabilities") or []
        case.ref_pieces = [bytes(p["bytes"]) for p in probs]
        case.ref_gaps = [(p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"])
                         if len(p["top_logprobs"]) > 1 else 99.0 for p in probs]
        res = await execute(client, HOST, client.base_url.port, Call("reference", "POST", case.path,
                                                                     _json(b), case.stream), limit)
        if res.outcome != "200":
            problems.append(f"reference {i} ({case.path}): {res.outcome} {res.detail}")
        case.ref = res.text
        if res.text != tok.get("content"):
            problems.append(f"reference {i}: {case.path} answered {res.text[:60]!r}, /completion with its prompt's "
                            f"tokens {tok.get('content', '')[:60]!r}")
    return problems


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


async def _recheck(client: httpx.AsyncClient, pool, limit: float) -> list[str]:
    """The greedy cases alone again after the load: the same answers."""
    out = []
    for i, case in enumerate(pool):
        res = await execute(client, HOST, client.base_url.port, Call("recheck", "POST", case.path, _json(case.body),
                                                                     case.stream), limit)
        if res.outcome != "200" or res.text != case.ref:
            out.append(f"case {i} ({case.path}) after the load: {res.outcome} {res.text[:60]!r} != {case.ref[:60]!r}")
    return out


async def _client(cid: int, client, ctx, cfg: RunConfig, rec: Record, deadline: float, port: int) -> None:
    rng = random.Random(f"{cfg.seed}:client:{cid}")
    while time.monotonic() < deadline:
        call = draw_call(rng, ctx)
        res = await execute(client, HOST, port, call, cfg.request_timeout)
        rec.add(res, cfg, ctx.pool)


async def _health(client, rec: Record, cfg: RunConfig, stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = await client.get("/health", timeout=max(cfg.health_limit * 2, 10))
            ok = r.status_code == 200
        except httpx.HTTPError as e:
            ok, r = False, e
        rec.health.append(time.perf_counter() - t0)
        if not ok:
            rec.health_bad.append(str(getattr(r, "status_code", r))[:200])
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def _monitor(client, rec: Record, srv: ServerProcess, stop: asyncio.Event, t0: float) -> None:
    """/slots and /metrics every second; the server's RSS every second."""
    while not stop.is_set():
        rec.rss.append((round(time.monotonic() - t0, 1), srv.rss_mb()))
        for path in ("/slots", "/metrics"):
            try:
                r = await client.get(path, timeout=30)
                rec.polls[f"{path} {r.status_code}"] += 1
            except httpx.HTTPError as e:
                rec.polls[f"{path} {type(e).__name__}"] += 1
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def _idle_slots(client, timeout: float = 30.0) -> tuple[bool, list]:
    deadline = time.monotonic() + timeout
    while True:
        slots = (await client.get("/slots")).json()
        if not any(s.get("is_processing") for s in slots):
            return True, slots
        if time.monotonic() > deadline:
            return False, slots
        await asyncio.sleep(0.1)


async def _context(client) -> tuple[int, int, int, list[int]]:
    props = (await client.get("/props")).json()
    n_ctx = props["default_generation_settings"]["n_ctx"]
    n_vocab = (await client.get("/v1/models")).json()["data"][0]["meta"]["n_vocab"]
    toks = (await client.post("/tokenize", json={"content": " ".join(WORDS)})).json()["tokens"]
    return n_ctx, n_vocab, props["total_slots"], sorted(set(toks)) or [1]


async def _run(cfg: RunConfig, srv: ServerProcess, out: dict, rec: Record) -> None:
    limits = httpx.Limits(max_connections=cfg.clients + 16, max_keepalive_connections=cfg.clients + 16)
    async with httpx.AsyncClient(base_url=srv.url, timeout=httpx.Timeout(cfg.request_timeout * 2), limits=limits) as client:
        n_ctx, n_vocab, n_par, ids = await _context(client)
        ctx = MixContext(n_ctx, n_vocab, n_par, ids, cfg.max_body, cfg.max_prompt_chars)
        ctx.pool = greedy_pool(cfg.seed, ctx, cfg.pool)
        out["reference_problems"] = await _references(client, ctx.pool, cfg.request_timeout)
        out["rss_mb_start"] = srv.rss_mb()
        stop = asyncio.Event()
        t0 = time.monotonic()
        side = [asyncio.create_task(_health(client, rec, cfg, stop)),
                asyncio.create_task(_monitor(client, rec, srv, stop, t0))]
        deadline = t0 + cfg.duration
        if srv.inject_flag is not None:
            srv.inject_flag.touch()  # the faults begin (not during the references)
        tasks = [asyncio.create_task(_client(i, client, ctx, cfg, rec, deadline, srv.port)) for i in range(cfg.clients)]
        await asyncio.sleep(cfg.duration * cfg.warmup)
        out["rss_mb_after_warmup"] = srv.rss_mb()
        await asyncio.gather(*tasks)
        out["duration_s"] = time.monotonic() - t0
        if srv.inject_flag is not None:
            srv.inject_flag.unlink()  # and end before the checks
        stop.set()
        await asyncio.gather(*side)
        out["slots_idle_at_end"], out["slots_at_end"] = await _idle_slots(client)
        out["greedy_after_load"] = await _recheck(client, ctx.pool, cfg.request_timeout)
        m = (await client.get("/metrics")).text
        out["metrics_at_end"] = {ln.split()[0]: float(ln.split()[1]) for ln in m.splitlines()
                                 if ln.startswith(("llamacpp:requests_processing", "llamacpp:requests_deferred"))}
        out["rss_mb_end"] = srv.rss_mb()


def run(cfg: RunConfig) -> dict:
    """Start the server, run the load, stop the server with SIGTERM; the report (:func:`report`)."""
    args = [*cfg.server_args, "--metrics", "--max-body-size", str(cfg.max_body), "--max-prompt-chars",
            str(cfg.max_prompt_chars)]
    flag = Path(f"{cfg.log}.inject-on")
    flag.unlink(missing_ok=True)
    launcher = ["support.faults", "--inject", cfg.inject, "--seed", str(cfg.seed), "--flag", str(flag),
                "--"] if cfg.inject else None
    srv = ServerProcess(args, Path(cfg.log), memory_limit_gb=cfg.memory_limit_gb, launcher=launcher)
    srv.inject_flag = flag if cfg.inject else None
    out: dict = {"server_cmd": srv.cmd}
    rec = Record()
    out.update(reference_problems=[], greedy_after_load=[], slots_idle_at_end=False, slots_at_end=[],
               metrics_at_end={})
    try:
        asyncio.run(_run(cfg, srv, out, rec))
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:  # the server stopped answering (or answered nonsense)
        out["run_error"] = f"the run stopped: {type(e).__name__}: {e}"
    finally:
        out["server_alive_at_end"] = srv.proc.poll() is None
        out["exit_code"] = srv.terminate()
        out["server_log_tail"] = srv.tail(2000) if out["exit_code"] != 0 else ""
    return report(cfg, rec, out)


def _rss_windows(samples: list, duration: float, warmup: float) -> tuple[float | None, float | None]:
    """The median RSS of the quarter after the warm-up and of the last quarter (medians: a large request's
    transient peak is no growth; a leak moves both windows apart)."""
    def med(lo: float, hi: float) -> float | None:
        xs = [m for t, m in samples if m is not None and lo <= t <= hi]
        return round(statistics.median(xs), 1) if xs else None

    w = duration * warmup
    return med(w, w + duration / 4), med(duration * 3 / 4, duration)


def report(cfg: RunConfig, rec: Record, out: dict) -> dict:
    dur = out.get("duration_s") or cfg.duration
    total = sum(sum(c.values()) for c in rec.by_kind.values())
    base, end = _rss_windows(rec.rss, dur, cfg.warmup)
    growth = end - base if base is not None and end is not None else None
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    problems = [*([out["run_error"]] if out.get("run_error") else []), *out["reference_problems"],
                *out["greedy_after_load"]]
    if not out["slots_idle_at_end"] and not out.get("run_error"):
        problems.append("slots still busy 30 s after the last request (a slot leak)")
    if any(out["metrics_at_end"].values()):
        problems.append(f"requests still counted at the end: {out['metrics_at_end']}")
    if out["exit_code"] != 0:
        problems.append(f"SIGTERM: the server exited with {out['exit_code']} (0 expected)")
    if not out["server_alive_at_end"]:
        problems.append("the server died during the run")
    hmax = max(rec.health) if rec.health else None
    if rec.health_bad or hmax is None or hmax > cfg.health_limit:
        problems.append(f"/health: {len(rec.health_bad)} bad answers {rec.health_bad[:3]}, slowest {ms(hmax)} ms "
                        f"(limit {cfg.health_limit} s)")
    if growth is not None and growth > cfg.rss_limit_mb:
        problems.append(f"resident memory grew {growth:.1f} MB after the warm-up (limit {cfg.rss_limit_mb} MB)")
    rep = {
        "ok": not rec.failures and not problems,
        "config": {k: v for k, v in asdict(cfg).items()}, "server_cmd": out["server_cmd"],
        "duration_s": round(dur, 1), "requests": total, "requests_per_s": round(total / dur, 2),
        "n_failures": len(rec.failures), "failures": rec.failures[:200], "problems": problems,
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(rec.by_kind.items())},
        "latency_by_kind_ms": {k: {"p50": ms(_pct(v, 0.5)), "max": ms(max(v))} for k, v in sorted(rec.kind_latency.items())},
        "normal": {"n": len(rec.latency), "latency_p50_ms": ms(_pct(rec.latency, 0.5)),
                   "latency_p99_ms": ms(_pct(rec.latency, 0.99)), "ttft_p50_ms": ms(_pct(rec.ttft, 0.5)),
                   "ttft_p99_ms": ms(_pct(rec.ttft, 0.99)), "tokens": rec.tokens,
                   "tokens_per_s": round(rec.tokens / dur, 1)},
        "greedy": {"checked": sum(rec.greedy.values()), **dict(rec.greedy), "near_ties": rec.near_ties[:50]},
        "health": {"polls": len(rec.health), "bad": len(rec.health_bad), "max_ms": ms(hmax),
                   "p99_ms": ms(_pct(rec.health, 0.99)), "median_ms": ms(statistics.median(rec.health)) if rec.health else None},
        "polls": dict(rec.polls),
        "rss_mb": {"start": out.get("rss_mb_start"), "after_warmup": out.get("rss_mb_after_warmup"),
                   "end": out.get("rss_mb_end"), "max": max((m for _, m in rec.rss if m), default=None),
                   "median_after_warmup": base, "median_last_quarter": end,
                   "growth_after_warmup": None if growth is None else round(growth, 1),
                   "timeline": rec.rss[::5]},
        "slots_idle_at_end": out["slots_idle_at_end"], "metrics_at_end": out["metrics_at_end"],
        "exit_code": out["exit_code"], "server_log_tail": out.get("server_log_tail", ""),
    }
    return rep


def summary(rep: dict) -> str:
    """The report in a few lines."""
    n, h, r, g = rep["normal"], rep["health"], rep["rss_mb"], rep["greedy"]
    lines = [f"{rep['requests']} requests in {rep['duration_s']} s ({rep['requests_per_s']}/s), "
             f"{rep['n_failures']} failures, {len(rep['problems'])} problems: {'OK' if rep['ok'] else 'FAILED'}"]
    for kind, outs in rep["by_kind"].items():
        lat = rep["latency_by_kind_ms"][kind]
        lines.append(f"  {kind:18s} " + ", ".join(f"{o}: {c}" for o, c in outs.items())
                     + f"  (p50 {lat['p50']} ms, max {lat['max']} ms)")
    lines.append(f"normal requests: {n['n']}, latency p50 {n['latency_p50_ms']} ms p99 {n['latency_p99_ms']} ms, "
                 f"TTFT p50 {n['ttft_p50_ms']} ms p99 {n['ttft_p99_ms']} ms, {n['tokens']} tokens "
                 f"({n['tokens_per_s']} tokens/s)")
    lines.append(f"greedy answers checked: {g['checked']} ({', '.join(f'{k}: {v}' for k, v in g.items() if k not in ('checked', 'near_ties'))})")
    lines.append(f"/health: {h['polls']} polls, {h['bad']} bad, median {h['median_ms']} ms, p99 {h['p99_ms']} ms, "
                 f"max {h['max_ms']} ms; /slots, /metrics: {rep['polls']}")
    lines.append(f"server RSS: start {r['start']} MB, after warm-up {r['after_warmup']} MB, end {r['end']} MB, max "
                 f"{r['max']} MB; median {r['median_after_warmup']} MB after the warm-up, {r['median_last_quarter']} "
                 f"MB in the last quarter (growth {r['growth_after_warmup']} MB); slots idle at the end: {rep['slots_idle_at_end']}; "
                 f"SIGTERM exit code {rep['exit_code']}")
    for f in rep["failures"][:20]:
        lines.append(f"  FAIL {f['kind']} {f['method']} {f['path']} stream={f['stream']} {f['action']}: {f['outcome']} "
                     f"{f['detail']} [{f['note']}] {f['body'][:120]!r}")
    for p in rep["problems"]:
        lines.append(f"  PROBLEM {p}")
    return "\n".join(lines)

