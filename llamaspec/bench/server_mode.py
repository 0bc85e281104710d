"""``llamaspec bench --server``: aggregate decode tokens/s of concurrent HTTP clients against ``llamaspec serve``
and native ``llama-server``, with the same models, ``-np`` and prompts, each server in one or more speculation
settings (:mod:`.server_variants`: by default llamaspec's defaults against llama-server plain and with a draft).

Every server is started once on free loopback ports (never timed). Each measurement sends
``clients * ceil(n_prompts / clients)`` greedy ``POST /completion`` requests, or ``clients * requests_per_client``
(the bench's prompts as token ids, cycled; ``n_predict`` fixed, ``cache_prompt: false``, streaming off) from
``clients`` threads, each sending its next request when its previous one answered, on one keep-alive
connection of its own (as the OpenAI SDK's clients do). Aggregate tokens/s = the sum of the responses'
``timings.predicted_n`` over the wall time from the first request sent to the last response received.
Per repeat, client counts run in order and the servers alternate (A B C on even repeats, C B A on odd
ones), so slow drift of a shared machine hits all alike.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import UsageError
from .execute import machine_info
from .native import LOOPBACK, SERVER, HttpServer, _ngl, find_tool
from .prompts import Prompt
from .report import portable_paths
from .server_variants import ServerVariant, parse_variants, sweep_variants

#: --engines names -> server label
SERVER_LABELS = {"llamaspec": "llamaspec serve", "native": "llama-server", "native-server": "llama-server"}
#: the llama-server setting a llamaspec setting is measured against one to one (the overhead check)
COUNTERPART = {"ls:plain": "native:plain", "ls:draft": "native:draft", "ls:parity": "native:draft"}


@dataclass
class ServerBenchConfig:
    target: str
    draft: str | None
    prompts: list[Prompt]
    clients: tuple[int, ...] = (1, 4, 8)
    engines: tuple[str, ...] = ("llamaspec", "native")
    n_parallel: int = 4
    n_predict: int = 128
    repeats: int = 2
    n_ctx: int = 4096  # total, split over the slots by both servers
    n_batch: int = 512
    threads: int = 0  # 0 = the servers' default
    #: layers of the target / draft in VRAM, both servers (-1: all); 0 = the CPU
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int | None = None
    draft_n_max: int = 3
    draft_n_min: int = 0
    seed: int = 42
    #: requests each client sends per measurement (0: ceil(n_prompts / clients))
    requests_per_client: int = 0
    native_dir: str | None = None
    target_name: str | None = None
    draft_name: str | None = None
    quick: bool = False
    command: str | None = None
    #: the settings compared (server_variants); None: the defaults for the models (``default_variants``)
    variants: tuple[ServerVariant, ...] | None = None

    def chosen_variants(self) -> list[ServerVariant]:
        vs = list(self.variants) if self.variants is not None else parse_variants(
            default_variants(self.draft, self.quick), self.draft, self.draft_n_max, self.draft_n_min)
        wanted = {"native" if e == "native-server" else e for e in self.engines}
        return [v for v in vs if v.engine in wanted]


def default_variants(draft: str | None, quick: bool) -> str:
    """What ``--server`` compares unless told: llamaspec's defaults against llama-server's settings
    (:func:`sweep_variants`); on the tiny random models of ``--quick`` (a draft there costs what its target
    does) the loop's overhead: each server plain and at one fixed draft length.

    >>> default_variants("d", quick=True), default_variants(None, quick=True)
    ('ls:plain,native:plain,ls:parity,native:draft', 'ls:plain,native:plain')
    """
    if quick:
        return "ls:plain,native:plain" + (",ls:parity,native:draft" if draft else "")
    return sweep_variants(draft)


def server_args(cfg: ServerBenchConfig) -> list[str]:
    """Flags both servers take with the same meaning (llama.cpp's spellings)."""
    a = ["-c", str(cfg.n_ctx), "-b", str(cfg.n_batch), "-np", str(cfg.n_parallel), "--temp", "0", "--seed", str(cfg.seed)]
    if cfg.threads:
        a += ["-t", str(cfg.threads), "-tb", str(cfg.threads), "-td", str(cfg.threads)]
    ngld = cfg.n_gpu_layers if cfg.n_gpu_layers_draft is None else cfg.n_gpu_layers_draft
    return a + ["-ngl", _ngl(cfg.n_gpu_layers), "-ngld", _ngl(ngld)]


def make_server(v: ServerVariant, cfg: ServerBenchConfig, log_dir: str) -> HttpServer:
    if v.engine == "llamaspec":
        cmd, own, env = [sys.executable, "-m", "llamaspec.cli.main", "serve"], [], {**os.environ, "PYTHONUNBUFFERED": "1"}
    else:
        binary = find_tool(SERVER, cfg.native_dir)
        if binary is None:
            raise UsageError(f"{SERVER} is not built (scripts/build_llama_cpp.sh --targets tools)")
        cmd, own, env = [str(binary)], ["--no-webui", "--cache-ram", "0"], None
    return HttpServer(v.label, lambda port: [*cmd, "-m", str(cfg.target), "--host", LOOPBACK, "--port", str(port), *own,
                                             *server_args(cfg), *v.args], log_dir, env=env)


def measure(server: HttpServer, prompts: Sequence[Sequence[int]], clients: int, n_predict: int, seed: int,
            per_client: int = 0, **extra) -> dict:
    """One measurement: ``clients`` threads send the requests (prompts cycled to a multiple of ``clients``, or to
    ``clients * per_client``), each on its own keep-alive connection; ``extra``: more body fields."""
    n_req = clients * (per_client or math.ceil(len(prompts) / clients))
    jobs = [prompts[i % len(prompts)] for i in range(n_req)]
    lock = threading.Lock()
    nxt = itertools.count()  # the next job; next() on a count is atomic
    out: list[dict] = []
    errors: list[str] = []

    def client() -> None:
        conn = server.connect()
        try:
            for i in nxt:  # the clients share the count: each takes the next job
                if i >= len(jobs):
                    return
                t0 = time.perf_counter()
                try:
                    r = server.complete(jobs[i], n_predict, seed, conn, **extra)
                except Exception as e:  # reported in the run, not fatal
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                t = r.get("timings", {})
                with lock:
                    out.append({"predicted_n": int(t.get("predicted_n", r.get("tokens_predicted", 0))),
                                "prompt_n": int(t.get("prompt_n", 0)), "draft_n": int(t.get("draft_n", 0)),
                                "draft_n_accepted": int(t.get("draft_n_accepted", 0)),
                                "latency_s": time.perf_counter() - t0})
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    n_tok = sum(r["predicted_n"] for r in out)
    drafted, accepted = sum(r["draft_n"] for r in out), sum(r["draft_n_accepted"] for r in out)
    return {"n_requests": n_req, "n_ok": len(out), "errors": errors[:3], "n_errors": len(errors),
            "predicted_n": n_tok, "wall_s": round(wall, 4), "tokens_per_s": round(n_tok / wall, 3) if wall > 0 else 0.0,
            "draft_n": drafted, "draft_n_accepted": accepted,
            "latency_median_s": round(statistics.median(r["latency_s"] for r in out), 4) if out else None}


def run_server_benchmark(cfg: ServerBenchConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Start the servers, run the interleaved schedule, return the report dictionary (JSON-serialisable)."""
    from .. import _llama as llama
    from .runners import prepare_prompts

    if not cfg.prompts:
        raise UsageError("no prompts")
    if any(c < 1 for c in cfg.clients) or not cfg.clients:
        raise UsageError("--clients needs positive client counts")
    t_start = time.time()
    with llama.Model(cfg.target, vocab_only=True) as vm:
        bprompts = prepare_prompts(vm, cfg.prompts)
    n_ctx_seq = cfg.n_ctx // cfg.n_parallel
    too_long = [p.id for p in bprompts if len(p.tokens) + cfg.n_predict + 2 > n_ctx_seq]
    if too_long:
        raise UsageError(f"prompt(s) {', '.join(too_long)} + -n do not fit a slot (-c {cfg.n_ctx} / -np {cfg.n_parallel}): "
                         "raise -c or lower -n")
    tokens = [p.tokens for p in bprompts]
    notes = [f"{e}: not a server, skipped (server mode runs llamaspec and native)" for e in cfg.engines
             if e not in SERVER_LABELS]
    variants = {v.key: v for v in cfg.chosen_variants()}
    log_dir = tempfile.mkdtemp(prefix="llamaspec-bench-server-")
    servers: dict[str, HttpServer] = {}
    runs: list[dict] = []
    try:
        for key, v in variants.items():
            try:
                s = make_server(v, cfg, log_dir)
            except UsageError as ex:
                notes.append(f"{v.label}: {ex} — its runs were skipped")
                continue
            progress(f"starting {s.label}")
            s.start()
            servers[key] = s
            s.complete(tokens[0], min(8, cfg.n_predict), cfg.seed)  # warm-up, not recorded
        if not servers:
            raise UsageError("no server to measure: " + "; ".join(notes))
        order = list(servers)
        for rep in range(cfg.repeats):
            for c in cfg.clients:
                for key in (order if rep % 2 == 0 else order[::-1]):
                    s = servers[key]
                    progress(f"r{rep + 1} {c} client(s) {s.label}")
                    m = measure(s, tokens, c, cfg.n_predict, cfg.seed, cfg.requests_per_client)
                    runs.append({"engine": variants[key].engine, "variant": key, "server": s.label, "clients": c,
                                 "repeat": rep, **m})
        commands = {key: " ".join(s.command()) for key, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    rows = summarise_server_runs(runs)
    return {
        "kind": "server",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": portable_paths(cfg.command),
        "duration_s": round(time.time() - t_start, 1),
        "machine": machine_info(),
        "settings": {"target": cfg.target_name or portable_paths(cfg.target),
                     "draft": cfg.draft_name or portable_paths(cfg.draft),
                     "n_parallel": cfg.n_parallel, "n_ctx": cfg.n_ctx, "n_ctx_seq": n_ctx_seq, "n_batch": cfg.n_batch,
                     "n_predict": cfg.n_predict, "draft_n_max": cfg.draft_n_max, "draft_n_min": cfg.draft_n_min,
                     "threads": cfg.threads or "server default", "clients": list(cfg.clients),
                     "variants": [f"{k} ({v.label})" for k, v in variants.items() if k in servers], "repeats": cfg.repeats,
                     "n_prompts": len(bprompts), "prompt_tokens": {p.id: len(p.tokens) for p in bprompts},
                     "sampling": "greedy (temperature 0), cache_prompt false, stream false", "quick": cfg.quick,
                     "requests_per_client": cfg.requests_per_client or "ceil(prompts / clients)",
                     "connections": "one keep-alive connection per client",
                     "schedule": "per repeat: client counts in order, servers alternating (A B C, then C B A)"},
        "server_commands": portable_paths(commands),
        "notes": notes,
        "rows": rows,
        "runs": runs,
    }


def summarise_server_runs(runs: Sequence[dict]) -> list[dict]:
    """One row per (setting, clients): median / min / max aggregate tokens/s over the repeats, acceptance;
    llamaspec's rows also get the ratio of medians to the best llama-server setting at that client count
    (``ratio_vs_native``, ``best_native``) and to their one-to-one counterpart (``ratio_vs_counterpart``:
    plain to plain, a fixed draft length to llama-server's draft at that length) where it ran.

    >>> rs = [{"engine": e, "variant": k, "server": k, "clients": 1, "repeat": r, "tokens_per_s": v, "draft_n": 10,
    ...        "draft_n_accepted": 5, "n_errors": 0, "latency_median_s": 1.0}
    ...       for e, k, r, v in [("llamaspec", "ls:plain", 0, 10.0), ("native", "native:plain", 0, 20.0),
    ...                          ("native", "native:draft:3", 0, 25.0), ("llamaspec", "ls:plain", 1, 12.0),
    ...                          ("native", "native:plain", 1, 20.0), ("native", "native:draft:3", 1, 25.0)]]
    >>> [(r["variant"], r["tps_median"], r.get("ratio_vs_native"), r.get("ratio_vs_counterpart"))
    ...  for r in summarise_server_runs(rs)]
    [('ls:plain', 11.0, 0.44, 0.55), ('native:plain', 20.0, None, None), ('native:draft:3', 25.0, None, None)]
    """
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r.get("variant", r["engine"]), r["clients"]), []).append(r)
    first = {k: i for i, k in enumerate(dict.fromkeys(r.get("variant", r["engine"]) for r in runs))}
    rows = []
    for (k, c), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[1][0]["engine"] != "llamaspec", first[kv[0][0]])):
        tps = [r["tokens_per_s"] for r in rs]
        drafted = sum(r["draft_n"] for r in rs)
        lat = [r["latency_median_s"] for r in rs if r["latency_median_s"] is not None]
        rows.append({"engine": rs[0]["engine"], "variant": k, "server": rs[0]["server"], "clients": c, "n_runs": len(rs),
                     "tps_median": round(statistics.median(tps), 2), "tps_min": round(min(tps), 2),
                     "tps_max": round(max(tps), 2),
                     "acceptance": round(sum(r["draft_n_accepted"] for r in rs) / drafted, 4) if drafted else None,
                     "latency_median_s": round(statistics.median(lat), 3) if lat else None,
                     "n_errors": sum(r["n_errors"] for r in rs)})
    for r in rows:
        if r["engine"] != "llamaspec":
            continue
        nat = [x for x in rows if x["engine"] == "native" and x["clients"] == r["clients"] and x["tps_median"] > 0]
        if nat:
            best = max(nat, key=lambda x: x["tps_median"])
            r["ratio_vs_native"], r["best_native"] = round(r["tps_median"] / best["tps_median"], 3), best["server"]
        parts = r["variant"].split(":")
        twin = COUNTERPART.get(":".join(parts[:2]))
        if twin is not None:
            twin += "".join(":" + p for p in parts[2:])
            same = [x for x in nat if x["variant"] == twin or (twin == "native:draft" and x["variant"].startswith("native:draft"))]
            if same:
                r["ratio_vs_counterpart"] = round(r["tps_median"] / same[0]["tps_median"], 3)
    return rows


def render_server_markdown(report: dict) -> str:
    s = report["settings"]
    lines = ["# llamaspec bench --server", ""]
    if report.get("command"):
        lines += ["```", report["command"], "```", ""]
    m = report["machine"]
    from .report import load_lines

    lines += [f"{report['created']} · {m.get('cpu')} · {m.get('n_cpus_available')} CPUs available · load average at start "
              f"{m.get('loadavg_at_start')} · {report['duration_s']} s", "", *[x[2:] for x in load_lines(report)],
              f"Target {s['target']}, draft {s['draft']}; settings: {', '.join(s.get('variants', []))}; "
              f"-np {s['n_parallel']}, -c {s['n_ctx']} ({s['n_ctx_seq']} per slot), -b {s['n_batch']}, threads "
              f"{s['threads']}; {s['n_prompts']} prompts, n_predict {s['n_predict']}, {s['sampling']}; requests per "
              f"client per measurement: {s.get('requests_per_client', 'ceil(prompts / clients)')}, "
              f"{s.get('connections', 'a new connection per request')}; {s['repeats']} "
              f"repeats, {s['schedule']}.", "",
              "Aggregate decode tokens/s = sum of `timings.predicted_n` / wall time from the first request sent to the "
              "last response (prompt processing included in the wall time).", "",
              "| clients | server | tokens/s median | min – max | acceptance | median latency (s) | llamaspec / best llama-server | llamaspec / same setting | errors |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "–"
        ratio = (f"{r['ratio_vs_native']:.2f} ({r['best_native']})" if r.get("ratio_vs_native") is not None else "")
        twin = f"{r['ratio_vs_counterpart']:.2f}" if r.get("ratio_vs_counterpart") is not None else ""
        lines.append(f"| {r['clients']} | {r['server']} | {r['tps_median']:.1f} | {r['tps_min']:.1f} – {r['tps_max']:.1f} | "
                     f"{acc} | {r['latency_median_s']} | {ratio} | {twin} | {r['n_errors']} |")
    if report["notes"]:
        lines += [""] + [f"Note: {n}" for n in report["notes"]]
    if report.get("server_commands"):
        lines += ["", "Server commands:", ""] + [f"- `{c}`" for c in report["server_commands"].values()]
    return "\n".join(lines) + "\n"
