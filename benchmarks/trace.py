"""Trace benchmark (issue 25, ``python -m benchmarks.research --trace``): multi-turn sessions replayed against running
servers over HTTP, tokens/s per trace and server setting.

The sessions (edit loop, chat with regenerate, shared document, ``n = 4``, free text) are in
:mod:`.trace_sessions`; the summary and the markdown in :mod:`.trace_report`.

**Schedule.** With ``restart="trace"`` (the default) every (repeat, trace, variant) runs on a freshly started
server: no pool, prompt cache or n-gram state is carried from another trace or repeat. For each trace the
variants run back to back, in forward order on even repeats and reversed on odd ones (A B C, C B A), so slow
drift of a shared machine hits every variant of a trace alike. ``restart="server"``: one start per (repeat,
variant), the traces in order on it (what a long-running server sees). A short warm-up request follows each
start. Tokens/s of a trace = generated tokens (``timings.predicted_n``) over its wall time, the requests of a
turn sent concurrently where the trace says so. Greedy except ``n4``; ``cache_prompt`` on (as clients use
servers).

**Variants** (``--trace-variants``), each a server and its speculation flags (:data:`VARIANTS`):
``ls-plain`` (``llamaspec serve --spec-type none``), ``ls-defaults`` (its defaults without a draft model:
``auto``, the request's own n-grams plus the shared pool), ``ls-nopool`` (the same, ``--spec-pool-tokens 0``),
``native-plain`` (llama-server without speculation), ``native-spec-default`` (``--spec-default``) and
``native-ngram-mod`` (``--spec-type ngram-mod`` at the sample settings of llama.cpp's speculative-decoding docs,
https://github.com/ggml-org/llama.cpp/blob/master/docs/speculative.md,
n_match 24, n_min 48, n_max 64 -- the values ``--spec-default`` sets too, so these two rows are one setting
measured twice); ``native-ngram-mod:M:MIN:MAX`` sets other values (the docs suggest lower n_min / n_max for
dense models). Native variants are skipped when the binary is missing.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from typing import Callable

from llamaspec.errors import LlamaSpecError, UsageError
from llamaspec.bench.native import LOOPBACK, SERVER, _http, find_tool
from llamaspec.bench.server_mode import HttpServer
from .trace_sessions import FREE, SCALE, TRACES, Step, chat, requests_per_trace

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "TraceConfig", "TraceVariant", "parse_variants", "plan", "run_traces"]

#: llama.cpp's speculative-decoding docs (module docstring), "n-gram Mod", sample usage
NGRAM_MOD_DOC = (24, 48, 64)


@dataclass(frozen=True)
class TraceVariant:
    key: str
    engine: str  # "llamaspec" | "native"
    label: str
    args: tuple[str, ...]


def _ngram_mod_args(m: int, lo: int, hi: int) -> tuple[str, ...]:
    return ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", str(m), "--spec-ngram-mod-n-min", str(lo),
            "--spec-ngram-mod-n-max", str(hi))


VARIANTS: dict[str, TraceVariant] = {v.key: v for v in (
    TraceVariant("ls-plain", "llamaspec", "llamaspec serve --spec-type none", ("--spec-type", "none")),
    TraceVariant("ls-defaults", "llamaspec", "llamaspec serve defaults (auto: own n-grams + shared pool)", ()),
    TraceVariant("ls-nopool", "llamaspec", "llamaspec serve defaults, --spec-pool-tokens 0", ("--spec-pool-tokens", "0")),
    TraceVariant("native-plain", "native", "llama-server", ()),
    TraceVariant("native-spec-default", "native", "llama-server --spec-default", ("--spec-default",)),
    TraceVariant("native-ngram-mod", "native", "llama-server --spec-type ngram-mod 24/48/64 (llama.cpp's sample settings)",
                 _ngram_mod_args(*NGRAM_MOD_DOC)),
)}
DEFAULT_VARIANTS = ("ls-plain", "ls-defaults", "native-plain", "native-spec-default", "native-ngram-mod")


def parse_variants(text: str) -> list[TraceVariant]:
    """Comma list of variant keys (module docstring).

    >>> [v.key for v in parse_variants("ls-plain, native-ngram-mod:16:8:32")]
    ['ls-plain', 'native-ngram-mod:16:8:32']
    >>> parse_variants("native-ngram-mod:16:8:32")[0].args[-4:]
    ('--spec-ngram-mod-n-min', '8', '--spec-ngram-mod-n-max', '32')
    >>> parse_variants("pool")
    Traceback (most recent call last):
    ...
    llamaspec.errors.UsageError: --trace-variants: unknown variant 'pool' (known: ls-plain, ls-defaults, ls-nopool, native-plain, native-spec-default, native-ngram-mod, native-ngram-mod:M:MIN:MAX)
    """
    out: list[TraceVariant] = []
    for key in (x.strip() for x in text.split(",")):
        if not key:
            continue
        if key in VARIANTS:
            v = VARIANTS[key]
        elif key.startswith("native-ngram-mod:"):
            parts = key.split(":")[1:]
            if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1:
                raise UsageError(f"--trace-variants {key}: native-ngram-mod:N_MATCH:N_MIN:N_MAX takes three integers")
            m, lo, hi = (int(p) for p in parts)
            v = TraceVariant(key, "native", f"llama-server --spec-type ngram-mod {m}/{lo}/{hi}", _ngram_mod_args(m, lo, hi))
        else:
            raise UsageError(f"--trace-variants: unknown variant {key!r} (known: {', '.join(VARIANTS)}, "
                             "native-ngram-mod:M:MIN:MAX)")
        if v.key not in {x.key for x in out}:
            out.append(v)
    if not out:
        raise UsageError("--trace-variants is empty")
    return out


@dataclass
class TraceConfig:
    model: str
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    traces: tuple[str, ...] = tuple(TRACES)
    turns: int = 4
    n_predict: int = 128
    repeats: int = 3
    n_parallel: int = 4
    n_ctx: int = 8192
    threads: int = 0
    restart: str = "trace"  # or "server"
    #: fraction of the long texts kept (small models with a short context)
    scale: float = 1.0
    #: flash attention off and an F32 KV cache on every server: batch shapes do not move the logits, so greedy
    #: outputs of llamaspec with and without speculation must be equal (tests; slower)
    exact: bool = False
    native_dir: str | None = None
    model_name: str | None = None
    command: str | None = None
    #: print the runtime estimate first (one extra server start and a 32-token request)
    estimate: bool = True
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        for t in self.traces:
            if t not in TRACES:
                raise UsageError(f"--traces: unknown trace {t!r} (known: {', '.join(TRACES)})")
        if not self.traces:
            raise UsageError("--traces is empty")
        if self.restart not in ("trace", "server"):
            raise UsageError(f"--trace-restart must be trace or server, not {self.restart!r}")
        if self.turns < 1 or self.repeats < 1:
            raise UsageError("--turns and --repeats must be >= 1")
        parse_variants(",".join(self.variants))


def _command(v: TraceVariant, cfg: TraceConfig) -> Callable[[int], list[str]] | None:
    common = ["-c", str(cfg.n_ctx), "-np", str(cfg.n_parallel), "--temp", "0"]
    if cfg.exact:
        common += ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    if cfg.threads:
        common += ["-t", str(cfg.threads), "-tb", str(cfg.threads)]
    if v.engine == "llamaspec":
        return lambda port: [sys.executable, "-m", "llamaspec.cli.main", "serve", "-m", cfg.model, "--host", LOOPBACK,
                             "--port", str(port), *common, *v.args]
    binary = find_tool(SERVER, cfg.native_dir)
    if binary is None:
        return None
    return lambda port: [str(binary), "-m", cfg.model, "--host", LOOPBACK, "--port", str(port), "--no-webui",
                         "-ngl", "0", *common, *v.args]


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
        errs: list[BaseException] = []

        def one(i: int) -> None:
            seed = step.seeds[i] if i < len(step.seeds) else 42
            try:
                res[i] = _complete(srv, step.prompts[i], cfg.n_predict, step.temp, seed)
            except BaseException as e:  # noqa: BLE001 - reported below, on the calling thread
                errs.append(e)

        if len(step.prompts) == 1:
            one(0)
        else:
            ths = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(step.prompts))]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
        if errs:
            raise LlamaSpecError(f"{srv.label}: a request of {trace} failed: {errs[0]} (log: {srv.log_path})")
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


def _start(v: TraceVariant, cmd, log_dir: str) -> HttpServer:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"} if v.engine == "llamaspec" else None
    srv = HttpServer(v.key, cmd, log_dir, env=env)
    srv.start()
    _complete(srv, "Hello", 4, 0.0, 1)  # warm-up (graphs, caches), not timed
    return srv


def plan(cfg: TraceConfig, keys: list[str]) -> list[tuple[int, list[str], str]]:
    """``(repeat, traces, variant)`` per server start, in run order (module docstring).

    >>> c = TraceConfig("m", traces=("a", "b"), repeats=2)
    >>> plan(c, ["x", "y"])
    [(0, ['a'], 'x'), (0, ['a'], 'y'), (0, ['b'], 'x'), (0, ['b'], 'y'), (1, ['a'], 'y'), (1, ['a'], 'x'), (1, ['b'], 'y'), (1, ['b'], 'x')]
    >>> c.restart = "server"; plan(c, ["x", "y"])
    [(0, ['a', 'b'], 'x'), (0, ['a', 'b'], 'y'), (1, ['a', 'b'], 'y'), (1, ['a', 'b'], 'x')]
    """
    out = []
    for rep in range(cfg.repeats):
        order = keys if rep % 2 == 0 else keys[::-1]
        if cfg.restart == "trace":
            out += [(rep, [t], k) for t in cfg.traces for k in order]
        else:
            out += [(rep, list(cfg.traces), k) for k in order]
    return out


def estimate(cfg: TraceConfig, variants: list[TraceVariant], cmds: dict, log_dir: str, n_starts: int) -> dict:
    """Start the plainest variant once, time the start and a 32-token greedy request: the run's runtime at
    that speed (an upper bound for the decode part: speculative variants are faster, prompts come on top)."""
    v = next((x for k in ("ls-plain", "native-plain") for x in variants if x.key == k), variants[0])
    t0 = time.perf_counter()
    srv = _start(v, cmds[v.key], log_dir)
    t_start = time.perf_counter() - t0
    try:
        r = _complete(srv, chat(FREE[0]), 32, 0.0, 1)
    finally:
        srv.stop()
    t = r.get("timings", {})
    tps = float(t.get("predicted_n", 0)) / (float(t.get("predicted_ms", 0.0)) / 1e3) if t.get("predicted_ms") else 0.0
    n_tok = cfg.repeats * len(variants) * cfg.n_predict * sum(requests_per_trace(tr, cfg.turns) for tr in cfg.traces)
    est = n_starts * (t_start + 1.0) + (n_tok / tps if tps > 0 else 0.0)
    return {"probe_variant": v.key, "start_s": round(t_start, 2), "plain_tps": round(tps, 2), "max_tokens": n_tok,
            "n_starts": n_starts, "estimate_s": round(est)}


def run_traces(cfg: TraceConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    from .trace_report import summarise

    cfg.validate()
    t_begin = time.time()
    log_dir = tempfile.mkdtemp(prefix="llamaspec-trace-")
    SCALE[0] = cfg.scale
    variants, cmds, skipped = [], {}, {}
    for v in parse_variants(",".join(cfg.variants)):
        c = _command(v, cfg)
        if c is None:
            skipped[v.key] = f"{SERVER} is not built (scripts/build_llama_cpp.sh --targets tools)"
        else:
            variants.append(v)
            cmds[v.key] = c
    if not variants:
        raise UsageError("no variant can run: " + "; ".join(f"{k}: {why}" for k, why in skipped.items()))
    schedule = plan(cfg, [v.key for v in variants])
    by_key = {v.key: v for v in variants}
    est = None
    if cfg.estimate:
        est = estimate(cfg, variants, cmds, log_dir, len(schedule))
        from .copy_set import fmt_duration

        progress(f"estimated runtime: about {fmt_duration(est['estimate_s'])} ({est['n_starts']} server starts of "
                 f"~{est['start_s']:.0f} s, at most {est['max_tokens']} tokens at {est['plain_tps']:.1f} tok/s plain; "
                 "speculative variants are faster)")
    runs = []
    for i, (rep, group, key) in enumerate(schedule):
        v = by_key[key]
        srv = _start(v, cmds[key], log_dir)
        try:
            for trace in group:
                r = run_trace(srv, trace, cfg)
                progress(f"[{i + 1}/{len(schedule)}] rep {rep} {trace:16s} {key:22s} {r['tokens_per_s']:8.2f} tok/s "
                         f"({r['predicted_n']} tokens, {r['wall_s']:.2f} s)")
                runs.append({"repeat": rep, "variant": key, "engine": v.engine, "trace": trace, **r})
        finally:
            srv.stop()
    return {"kind": "trace", "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "duration_s": round(time.time() - t_begin, 1), "command": cfg.command,
            "config": {k: v for k, v in cfg.__dict__.items() if k != "extra"},
            "variants": {v.key: {"engine": v.engine, "label": v.label, "args": list(v.args),
                                 "command": " ".join(cmds[v.key](0))} for v in variants},
            "estimate": est, "skipped": skipped, "runs": runs, "summary": summarise(runs, cfg.traces),
            "machine": {"cpus": os.cpu_count(), "loadavg_end": [round(x, 2) for x in os.getloadavg()]}}
