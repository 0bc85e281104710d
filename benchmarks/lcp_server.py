"""``llamaspec serve`` against llama-server and llama-cpp-python's own batched server (``examples/server/server.py``
of the 0.3.36 sdist), interleaved, with an optional load beside them (issue 33: "llamaspec serve at 1, 4 and 8
clients >= x0.95 of the best of llama-server's settings and of llama-cpp-python's batched server (plain and
prompt-lookup) under the same load, with and without a draft model").

    python -m benchmarks.lcp_server --lcp-python PY --lcp-server server.py -m gemma3-270m-f32 [-md gemma3-270m-q4km]
        [--load 1] [--clients 1,4,8] [-np 8] [-n 64] [--repeats 2] [--limit 8] [--native-dir native]
        [--variants ls:defaults,ls:plain,native:plain,native:plain@t1,lcp:plain,lcp:lookup,lcp:plain@t1] --json OUT

``--lcp-python`` is an interpreter with that server's dependencies (llama-cpp-python 0.3.36, fastapi, uvicorn,
jinja2, numpy, openai, pydantic, safetensors, websockets); ``--lcp-server`` the script, taken from the sdist
(``tar xzf llama_cpp_python-0.3.36.tar.gz llama_cpp_python-0.3.36/examples/server/server.py``; the sdist is in
``native/downloads`` after ``scripts/build_llama_cpp.sh``). It answers the OpenAI routes only, so it is sent the
same token prompts on ``/v1/completions`` (``max_tokens``, temperature 0) and its ``usage.completion_tokens``
are counted; ``llamaspec serve`` and llama-server get ``/completion`` as in ``llamaspec bench --server``.
``lcp:lookup`` is its ``draft_model: prompt-lookup-decoding`` (num_pred_tokens 16, max_ngram_size 2, its
defaults); ``@tN`` gives any server N threads. The same 8 prompts are sent at every client count and repeat:
llama-cpp-python's server always reuses its cached prefixes, so llamaspec and llama-server are sent
``cache_prompt: true`` (their default) unless ``--no-cache-prompt`` (before 2026-12-07 they were sent ``false``,
and llama-cpp-python's server alone skipped the prompts it had seen: its second repeat ran 1.5x its first).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llamaspec import models
from llamaspec.bench.load import BackgroundLoad, LoadSpec, sigterm_unwinds
from llamaspec.bench.execute import machine_info
from llamaspec.bench.prompts import load_prompts, quick_subset
from llamaspec.bench.native import HttpServer
from llamaspec.bench.server_mode import ServerBenchConfig, make_server, measure
from llamaspec.bench.server_variants import parse_variants

LOOPBACK = "127.0.0.1"


class LcpServer(HttpServer):
    """llama-cpp-python's example server: a JSON config file, the OpenAI completion route, ``/healthz``."""

    health_path = "/healthz"

    def complete(self, tokens, n_predict, seed, conn=None, cache_prompt=None):
        # (its prefix cache is always on: no request field turns it off)
        body = {"prompt": list(tokens), "max_tokens": n_predict, "temperature": 0.0, "seed": seed, "stream": False}
        r = conn.post_json("/v1/completions", body, self.label) if conn is not None else self._once(body)
        return {"tokens_predicted": int(r.get("usage", {}).get("completion_tokens", 0))}

    def _once(self, body):
        conn = self.connect()
        try:
            return conn.post_json("/v1/completions", body, self.label)
        finally:
            conn.close()


def lcp_server(key: str, args, log_dir: str) -> LcpServer:
    setting, _, threads = key.partition("@t")
    t = int(threads) if threads else os.cpu_count() or 1
    model = {"path": args.target, "n_ctx": args.ctx_size, "n_seq_max": args.parallel, "n_batch": args.batch_size,
             "threads": t, "threads_batch": t, "store_logits": False}
    if setting == "lcp:lookup":
        model["draft_model"] = "prompt-lookup-decoding"
    elif setting != "lcp:plain":
        raise SystemExit(f"unknown llama-cpp-python setting {key!r}: lcp:plain or lcp:lookup, with @tN")

    def cmd(port: int) -> list[str]:
        cfg = Path(log_dir) / f"{key.replace(':', '-').replace('@', '-')}.json"
        cfg.write_text(json.dumps({"server": {"host": LOOPBACK, "port": port}, "model": model}))
        return [args.lcp_python, args.lcp_server, "-C", str(cfg)]

    label = f"llama-cpp-python server {setting.split(':')[1]}" + (f" @t{threads}" if threads else "")
    return LcpServer(label, cmd, log_dir)


def summary(runs: list[dict]) -> list[dict]:
    """Per client count and llamaspec setting: its median tokens/s over the repeats and the ratio to the best
    llama-server and the best llama-cpp-python setting of the same client count."""
    med: dict[tuple[str, int], float] = {}
    kind: dict[str, str] = {}
    for r in runs:
        med.setdefault((r["variant"], r["clients"]), [])
        med[(r["variant"], r["clients"])].append(r["tokens_per_s"])
        kind[r["variant"]] = r["engine"]
    med = {k: statistics.median(v) for k, v in med.items()}
    rows = []
    for c in sorted({c for _, c in med}):
        def best(engine):
            xs = [(t, k) for (k, cc), t in med.items() if cc == c and kind[k] == engine]
            return max(xs) if xs else (None, None)
        (bn, kn), (bl, kl) = best("native"), best("lcp")
        for (k, cc), t in med.items():
            if cc == c and kind[k] == "llamaspec":
                rows.append({"clients": c, "variant": k, "tps": round(t, 2),
                             "best_native": kn, "best_native_tps": bn and round(bn, 2),
                             "ratio_vs_native": round(t / bn, 3) if bn else None,
                             "best_lcp": kl, "best_lcp_tps": bl and round(bl, 2),
                             "ratio_vs_lcp": round(t / bl, 3) if bl else None})
    return rows


def markdown(report: dict) -> str:
    s = report["settings"]
    out = ["# llamaspec serve vs llama-server vs llama-cpp-python's batched server", "", "```", report["command"], "```", "",
           f"{report['created']} · load: {report['load']['description']} (cores used {report['load'].get('cores_used')}) · "
           f"load average at start {report['machine'].get('loadavg_at_start')} · {report['duration_s']} s", "",
           f"Target {s['target']}, draft {s['draft']}; -np {s['n_parallel']}, -c {s['n_ctx']}; {s['n_prompts']} prompts, "
           f"{s['n_predict']} tokens, greedy; {s['repeats']} repeats, servers alternating; aggregate tokens/s; "
           f"prompt cache {'on' if s.get('cache_prompt', False) else 'off for llamaspec and llama-server'}.", "",
           "| clients | setting | tokens/s (median of repeats, min - max) |", "|---:|---|---:|"]
    groups: dict = {}
    for r in report["runs"]:
        groups.setdefault((r["clients"], r["server"]), []).append(r["tokens_per_s"])
    for (c, name), v in sorted(groups.items()):
        out.append(f"| {c} | {name} | {statistics.median(v):.1f} ({min(v):.1f} - {max(v):.1f}) |")
    out += ["", "| clients | llamaspec setting | tok/s | best llama-server (setting) | ratio | best llama-cpp-python (setting) | ratio |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["summary"]:
        out.append(f"| {r['clients']} | {r['variant']} | {r['tps']} | {r['best_native_tps']} ({r['best_native']}) | "
                   f"{r['ratio_vs_native']} | {r['best_lcp_tps']} ({r['best_lcp']}) | {r['ratio_vs_lcp']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    sigterm_unwinds()  # through the finally below, which stops every server and the load
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lcp-python", required=True)
    ap.add_argument("--lcp-server", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-md", "--model-draft", default=None)
    ap.add_argument("--variants", default="ls:defaults,ls:plain,native:plain,native:plain@t1,lcp:plain,lcp:lookup,lcp:plain@t1")
    ap.add_argument("--load", type=int, default=0)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("-np", "--parallel", type=int, default=8)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--spec-draft-n-max", type=int, default=8)
    ap.add_argument("--native-dir", default=None)
    ap.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
                    help="llamaspec and llama-server reuse a slot's cached prompt (their default; llama-cpp-python's "
                         "server always reuses its prefix cache); --no-cache-prompt: they decode every prompt whole")
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    args.target = str(models.resolve_model(args.model))
    draft = str(models.resolve_model(args.model_draft)) if args.model_draft else None
    clients = [int(x) for x in args.clients.split(",")]
    prompts = quick_subset(load_prompts(None), args.limit)
    from llamaspec import _llama as llama
    from llamaspec.bench.runners import prepare_prompts

    with llama.Model(args.target, vocab_only=True) as vm:
        tokens = [p.tokens for p in prepare_prompts(vm, prompts)]
    log_dir = tempfile.mkdtemp(prefix="llamaspec-lcp-bench-")
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    ours = parse_variants(",".join(k for k in keys if not k.startswith("lcp:")), draft, args.spec_draft_n_max) \
        if any(not k.startswith("lcp:") for k in keys) else []
    servers: dict[str, tuple[str, HttpServer]] = {}
    cfg = ServerBenchConfig(target=args.target, draft=draft, prompts=prompts, n_parallel=args.parallel,
                            n_ctx=args.ctx_size, n_batch=args.batch_size, seed=args.seed, native_dir=args.native_dir)
    for v in ours:
        servers[v.key] = (v.engine, make_server(v, cfg, log_dir))
    for k in keys:
        if k.startswith("lcp:"):
            servers[k] = ("lcp", lcp_server(k, args, log_dir))
    t0 = time.time()
    runs: list[dict] = []
    load = BackgroundLoad(LoadSpec(busy=args.load))
    try:
        for key, (_, s) in servers.items():
            print(f"starting {s.label}", file=sys.stderr, flush=True)
            s.start()
            s.complete(tokens[0], 8, args.seed)  # warm-up
        with load:
            order = list(servers)
            for rep in range(args.repeats):
                for c in clients:
                    for key in (order if rep % 2 == 0 else order[::-1]):
                        engine, s = servers[key]
                        m = measure(s, tokens, c, args.n_predict, args.seed, cache_prompt=args.cache_prompt)
                        print(f"r{rep + 1} {c} client(s) {s.label}: {m['tokens_per_s']} tok/s", file=sys.stderr, flush=True)
                        runs.append({"engine": engine, "variant": key, "server": s.label, "clients": c, "repeat": rep, **m})
    finally:
        for _, s in servers.values():
            s.stop()
    report = {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              # this machine's interpreter and script paths stay out of a report that gets committed
              "command": "python -m benchmarks.lcp_server " + " ".join(argv if argv is not None else sys.argv[1:])
              .replace(args.lcp_python, "VENV/bin/python").replace(args.lcp_server, "server.py"),
              "duration_s": round(time.time() - t0, 1), "machine": machine_info(), "load": load.summary(),
              "settings": {"target": args.model, "draft": args.model_draft, "n_parallel": args.parallel,
                           "n_ctx": args.ctx_size, "n_predict": args.n_predict, "n_prompts": len(tokens),
                           "repeats": args.repeats, "variants": keys, "cache_prompt": args.cache_prompt},
              "summary": summary(runs), "runs": runs}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
