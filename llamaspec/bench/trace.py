"""Trace benchmark (issue 25): multi-turn sessions replayed against running servers over HTTP, tokens/s per trace.

Real traffic repeats itself across requests; these traces do, as an agent or a chat client would:

* ``edit-loop``: a file edited turn after turn; each turn's prompt holds the previous turn's output (the
  file as it now is) plus the next instruction.
* ``chat-regenerate``: a chat where the user presses "regenerate" (the same prompt again) and goes on with
  a follow-up that quotes the answer, regenerated once more.
* ``shared-doc``: several clients at once, each asking its own questions about one shared document.
* ``n4``: one prompt, four sampled choices at once (temperature 0.8, four seeds: ``n = 4`` as the server
  fans it out).
* ``free``: distinct prompts that share nothing (the check that the pool costs nothing where it cannot help).

Each (repeat, server, trace) runs on a freshly started server by default (``restart="trace"``: no pool, prompt
cache or n-gram state carried from another trace or repeat; ``"server"``: one start per repeat and server,
traces in order); servers alternate their order per repeat. A short warm-up request follows each start.
Tokens/s of a trace = generated tokens (``timings.predicted_n``) over its wall time, requests of a turn sent
concurrently where the trace says so. Greedy except ``n4``; ``cache_prompt`` on (as clients use servers).

Servers (``--servers``): ``pool`` (``llamaspec serve`` defaults: auto with the shared pool), ``nopool``
(``--spec-pool-tokens 0``), ``plain`` (llamaspec ``--spec-type none``), ``native-default`` (llama-server
``--spec-default``), ``native-plain`` (llama-server without speculation); native ones are skipped when the
binary is missing.

    python scripts/bench_trace.py -m gemma3-270m-f32 --repeats 2 --json out.json --markdown out.md
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import LlamaSpecError
from .native import LOOPBACK, SERVER, _http, find_tool
from .server_mode import HttpServer

__all__ = ["TRACES", "SERVERS", "TraceConfig", "run_traces", "render_markdown", "main"]

DOC = """The Harbour Street Library opens at nine in the morning from Monday to Saturday and closes at six in the \
evening, except on Thursdays, when it stays open until eight. On Sundays it is closed. Members may borrow up to \
twelve items at a time: books for three weeks, films and music for one week. A loan can be renewed twice, online or \
at the desk, unless another member has reserved the item. Late returns cost twenty cents per day for books and fifty \
cents per day for films, up to a maximum of five euros per item. Children under fourteen pay no late fees. The \
reading room on the first floor is a quiet zone: phone calls are not allowed there, and laptops must be muted. \
Group study rooms on the second floor can be booked for up to three hours per day, at most one week in advance. \
Printing costs ten cents per black-and-white page and forty cents per colour page; scanning is free. The library \
offers free wireless access; the network name is HarbourLib and no password is needed. Every first Saturday of the \
month there is a book sale in the entrance hall, and every Wednesday afternoon at four a story hour for children \
aged four to eight. Lost membership cards can be replaced at the desk for two euros."""

CODE = '''def parse_order(line):
    """Parse one order line: id, customer, amount."""
    parts = line.strip().split(",")
    order_id = int(parts[0])
    customer = parts[1].strip()
    amount = float(parts[2])
    return order_id, customer, amount


def total_by_customer(lines):
    """Sum the amounts per customer."""
    totals = {}
    for line in lines:
        order_id, customer, amount = parse_order(line)
        totals[customer] = totals.get(customer, 0.0) + amount
    return totals


def largest_order(lines):
    """The order with the largest amount."""
    best = None
    for line in lines:
        order = parse_order(line)
        if best is None or order[2] > best[2]:
            best = order
    return best
'''

EDITS = ["Rename the function parse_order to read_order everywhere.",
         "Rename the variable amount to value everywhere.",
         "Add a type hint for the argument lines in every function: lines: list[str].",
         "Change the docstring of total_by_customer to say: Sum the values per customer."]

QUESTIONS = [["When does the library close on Thursdays?", "How long can I borrow a film?"],
             ["How much does a late book cost per day?", "Is printing in colour more expensive?"],
             ["Can I make phone calls in the reading room?", "When is the story hour?"]]

FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain in a few sentences why the sky is blue.",
        "Describe a walk through a forest in autumn.",
        "Give three tips for learning to cook at home."]


def chat(user: str) -> str:
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


@dataclass
class Step:
    """One turn: the prompts sent together (each with its seed), greedy unless ``temp``."""
    prompts: list[str]
    seeds: list[int] = field(default_factory=list)
    temp: float = 0.0


#: fraction of the document / the file / the questions kept (``--scale``: small models with a short context)
SCALE = [1.0]


def _cut(text: str) -> str:
    return text if SCALE[0] >= 1.0 else text[: max(16, int(len(text) * SCALE[0]))]


def edit_loop(turns: int, ask: Callable[[Step], list[str]]) -> None:
    text = _cut(CODE)
    for i in range(turns):
        out = ask(Step([chat(f"Here is a Python file:\n\n{text}\n{EDITS[i % len(EDITS)]} Reply with the whole "
                             "file and nothing else.")]))
        text = out[0] or text


def chat_regenerate(turns: int, ask: Callable[[Step], list[str]]) -> None:
    history = ""
    qs = [_cut(q) for q in ("What are three good habits for sleeping well?", "Explain the second habit in more detail.",
                            "Summarise your advice in one paragraph.")]
    for i in range(max(1, turns - 1)):
        prompt = history + chat(qs[i % len(qs)])
        ask(Step([prompt]))
        out = ask(Step([prompt]))  # "regenerate"
        history = prompt + out[0] + "<end_of_turn>\n"


def shared_doc(turns: int, ask: Callable[[Step], list[str]]) -> None:
    for t in range(min(turns, 2)):
        ask(Step([chat(f"Read this notice:\n\n{_cut(DOC)}\n\nQuestion: {qs[t % len(qs)]}") for qs in QUESTIONS]))


def n4(turns: int, ask: Callable[[Step], list[str]]) -> None:
    for t in range(max(1, turns // 2)):
        ask(Step([chat(f"Write a short product description for a {['wooden', 'steel'][t % 2]} garden bench.")] * 4,
                 seeds=[11 + t * 4 + j for j in range(4)], temp=0.8))


def free(turns: int, ask: Callable[[Step], list[str]]) -> None:
    for i in range(turns):
        ask(Step([chat(FREE[i % len(FREE)])]))


TRACES: dict[str, Callable[[int, Callable[[Step], list[str]]], None]] = {
    "edit-loop": edit_loop, "chat-regenerate": chat_regenerate, "shared-doc": shared_doc, "n4": n4, "free": free}
#: server name -> (engine, extra flags)
SERVERS: dict[str, tuple[str, list[str]]] = {
    "pool": ("llamaspec", []), "nopool": ("llamaspec", ["--spec-pool-tokens", "0"]),
    "plain": ("llamaspec", ["--spec-type", "none"]),
    "native-default": ("native", ["--spec-default"]), "native-plain": ("native", [])}
REPETITIVE = ("edit-loop", "chat-regenerate", "shared-doc", "n4")


@dataclass
class TraceConfig:
    model: str
    servers: tuple[str, ...] = ("pool", "nopool", "native-default", "native-plain")
    traces: tuple[str, ...] = tuple(TRACES)
    turns: int = 4
    n_predict: int = 128
    repeats: int = 2
    n_parallel: int = 4
    n_ctx: int = 8192
    threads: int = 0
    restart: str = "trace"  # or "server"
    #: fraction of the long texts kept (small models with a short context)
    scale: float = 1.0
    #: flash attention off and an F32 KV cache on every server: batch shapes do not move the logits, so greedy
    #: outputs of llamaspec with and without the pool must be equal (tests; slower)
    exact: bool = False
    native_dir: str | None = None


def _command(name: str, cfg: TraceConfig) -> Callable[[int], list[str]] | None:
    engine, extra = SERVERS[name]
    common = ["-c", str(cfg.n_ctx), "-np", str(cfg.n_parallel), "--temp", "0"]
    if cfg.exact:
        common += ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    if cfg.threads:
        common += ["-t", str(cfg.threads), "-tb", str(cfg.threads)]
    if engine == "llamaspec":
        return lambda port: [sys.executable, "-m", "llamaspec.cli.main", "serve", "-m", cfg.model, "--host", LOOPBACK,
                             "--port", str(port), *common, *extra]
    binary = find_tool(SERVER, cfg.native_dir)
    if binary is None:
        return None
    return lambda port: [str(binary), "-m", cfg.model, "--host", LOOPBACK, "--port", str(port), "--no-webui",
                         "-ngl", "0", *common, *extra]


def _complete(srv: HttpServer, prompt: str, n_predict: int, temp: float, seed: int) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": temp, "seed": seed, "cache_prompt": True,
            "stream": False, **({"top_k": 1} if temp == 0 else {"top_k": 40, "top_p": 0.95})}
    try:
        return json.loads(_http(srv.base + "/completion", body).decode("utf-8"))
    except urllib.error.HTTPError as e:
        raise LlamaSpecError(f"{srv.label}: HTTP {e.code}: {e.read()[:300]!r}") from None


def run_trace(srv: HttpServer, trace: str, cfg: TraceConfig) -> dict:
    tot = {"predicted_n": 0, "draft_n": 0, "draft_n_accepted": 0, "requests": 0}
    outputs: list[str] = []

    def ask(step: Step) -> list[str]:
        res: list[dict | None] = [None] * len(step.prompts)

        def one(i: int) -> None:
            seed = step.seeds[i] if i < len(step.seeds) else 42
            res[i] = _complete(srv, step.prompts[i], cfg.n_predict, step.temp, seed)

        if len(step.prompts) == 1:
            one(0)
        else:
            ths = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(step.prompts))]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
        texts = []
        for r in res:
            if r is None:
                raise LlamaSpecError(f"{srv.label}: a request of {trace} failed (log: {srv.log_path})")
            t = r.get("timings", {})
            tot["predicted_n"] += int(t.get("predicted_n", r.get("tokens_predicted", 0)))
            tot["draft_n"] += int(t.get("draft_n", 0))
            tot["draft_n_accepted"] += int(t.get("draft_n_accepted", 0))
            tot["requests"] += 1
            texts.append(r.get("content", ""))
        outputs.extend(texts)
        return texts

    t0 = time.perf_counter()
    TRACES[trace](cfg.turns, ask)
    wall = time.perf_counter() - t0
    return {**tot, "wall_s": round(wall, 4), "tokens_per_s": round(tot["predicted_n"] / wall, 3) if wall > 0 else 0.0,
            "outputs": outputs}


def _start(name: str, cmd, log_dir: str) -> HttpServer:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"} if SERVERS[name][0] == "llamaspec" else None
    srv = HttpServer(name, cmd, log_dir, env=env)
    srv.start()
    _complete(srv, "Hello", 4, 0.0, 1)  # warm-up (graphs, caches), not timed
    return srv


def run_traces(cfg: TraceConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    log_dir = tempfile.mkdtemp(prefix="llamaspec-trace-")
    SCALE[0] = cfg.scale
    cmds, skipped = {}, {}
    for name in cfg.servers:
        if name not in SERVERS:
            raise LlamaSpecError(f"unknown server {name!r} (known: {', '.join(SERVERS)})")
        c = _command(name, cfg)
        if c is None:
            skipped[name] = f"{SERVER} is not built"
        else:
            cmds[name] = c
    names = list(cmds)
    runs = []
    for rep in range(cfg.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            groups = [[t] for t in cfg.traces] if cfg.restart == "trace" else [list(cfg.traces)]
            for group in groups:
                srv = _start(name, cmds[name], log_dir)
                try:
                    for trace in group:
                        r = run_trace(srv, trace, cfg)
                        progress(f"rep {rep} {name:15s} {trace:16s} {r['tokens_per_s']:8.2f} tok/s "
                                 f"({r['predicted_n']} tokens, {r['wall_s']:.2f} s)")
                        runs.append({"repeat": rep, "server": name, "trace": trace, **r})
                finally:
                    srv.stop()
    return {"date": _dt.datetime.now().isoformat(timespec="seconds"), "config": {**cfg.__dict__},
            "skipped": skipped, "runs": runs, "summary": summarise(runs), "log_dir": log_dir}


def summarise(runs: Sequence[dict]) -> list[dict]:
    """Per trace: median tokens/s of every server and its ratio to ``nopool`` / ``plain`` / ``native-*``."""
    traces = list(dict.fromkeys(r["trace"] for r in runs))
    servers = list(dict.fromkeys(r["server"] for r in runs))
    out = []
    for t in traces:
        med = {s: statistics.median(r["tokens_per_s"] for r in runs if r["trace"] == t and r["server"] == s)
               for s in servers if any(r["trace"] == t and r["server"] == s for r in runs)}
        row = {"trace": t, "tokens_per_s": {s: round(v, 2) for s, v in med.items()}}
        if "pool" in med:
            row["pool_vs"] = {s: round(med["pool"] / v, 3) for s, v in med.items() if s != "pool" and v > 0}
        if t != "n4":  # llamaspec's servers: greedy output must not depend on drafting (llama-server may differ)
            flat = [r["outputs"] for r in runs if r["trace"] == t and SERVERS[r["server"]][0] == "llamaspec"]
            row["greedy_outputs_equal"] = all(o == flat[0] for o in flat) if flat else None
        out.append(row)
    return out


def render_markdown(report: dict) -> str:
    rows = report["summary"]
    servers = list(dict.fromkeys(s for r in rows for s in r["tokens_per_s"]))
    others = [s for s in servers if s != "pool"]
    head = ["trace", *[f"{s} tok/s" for s in servers], *[f"pool / {s}" for s in others], "llamaspec outputs equal"]
    lines = [f"Trace benchmark, {report['date']}, model `{report['config']['model']}`, "
             f"{report['config']['repeats']} repeats (medians)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["trace"], *[str(r["tokens_per_s"].get(s, "")) for s in servers],
                 *[f"x{r.get('pool_vs', {}).get(s, float('nan')):.2f}" for s in others],
                 {True: "yes", False: "no", None: "n/a (sampled)"}[r.get("greedy_outputs_equal")]]
        lines.append("| " + " | ".join(cells) + " |")
    if report.get("skipped"):
        lines += ["", "Skipped: " + ", ".join(f"{k} ({v})" for k, v in report["skipped"].items())]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="model name (models.toml) or GGUF path")
    ap.add_argument("--servers", default=",".join(TraceConfig.servers))
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-np", "--n-parallel", type=int, default=4)
    ap.add_argument("-c", "--ctx-size", type=int, default=8192)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--restart", choices=("trace", "server"), default="trace")
    ap.add_argument("--native-dir", default=None)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the long texts kept (tiny test models)")
    ap.add_argument("--exact", action="store_true", help="-fa off, F32 KV on every server (outputs comparable)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args(argv)
    model = a.model
    if not os.path.exists(model):
        from ..models import resolve_model

        model = str(resolve_model(model))
    cfg = TraceConfig(model=model, servers=tuple(s for s in a.servers.split(",") if s),
                      traces=tuple(t for t in a.traces.split(",") if t), turns=a.turns, n_predict=a.n_predict,
                      repeats=a.repeats, n_parallel=a.n_parallel, n_ctx=a.ctx_size, threads=a.threads,
                      restart=a.restart, native_dir=a.native_dir, scale=a.scale, exact=a.exact)
    for t in cfg.traces:
        if t not in TRACES:
            ap.error(f"unknown trace {t!r} (known: {', '.join(TRACES)})")
    report = run_traces(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    md = render_markdown(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    print(md)
    return 0
