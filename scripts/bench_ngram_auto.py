#!/usr/bin/env python
"""No draft model: llamaspec's default (``--spec-type auto`` = ngram-lookup behind its gain gate) against
llama-cpp-python's prompt lookup (``Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))``) and
plain decoding, interleaved in one run (issue 12, "No draft model" target).

Per model, per repeat, per prompt, the engines run back to back (order reversed every other time: A B C,
C B A). Reported per prompt: decode tokens/s (median over repeats) of each engine, the ratios auto/lookup,
auto/plain and lookup/plain, and their medians per kind (copy-heavy: edits, refactors, summaries, grounded
QA; free: chat, lists, code completion). Outputs are compared with llamaspec plain (greedy); a divergence is
checked by teacher-forcing the shared prefix: a near-tie when both tokens are within 0.5 of the top logit.
Drafter time per round (llamaspec's ngram-lookup: its draft + accept + begin time; prompt lookup: its
``__call__``) shows what each drafter costs in Python.

    python scripts/bench_ngram_auto.py --models gemma3-270m-f32,smollm2-135m-f32 -n 128 --repeats 2 \\
        --json docs/benchmarks/ngram-auto.json --markdown docs/benchmarks/ngram-auto.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llamaspec import _llama as llama  # noqa: E402
from llamaspec.bench.modes import parse_mode  # noqa: E402
from llamaspec.bench.prompts import load_prompts  # noqa: E402
from llamaspec.bench.runners import LlamaCppPythonRunner, RunSettings, prepare_prompts  # noqa: E402
from llamaspec.engine import Engine  # noqa: E402
from llamaspec.models import resolve_model  # noqa: E402
from llamaspec.params import SpecParams  # noqa: E402

COPY_KINDS = ("code-edit", "code-refactor", "summarisation", "qa")
ENGINES = ("ls-plain", "ls-auto", "lcp-lookup")
TIE_TOL = 0.5


def kind_of(category: str) -> str:
    return "copy" if category in COPY_KINDS else "free"


class Timed:
    """Wraps prompt lookup's ``__call__`` to time it (its cost per round, in Python)."""

    def __init__(self, inner):
        self.inner, self.t, self.n = inner, 0.0, 0

    def __call__(self, input_ids, /, **kw):
        t0 = time.perf_counter()
        d = self.inner(input_ids, **kw)
        self.t += time.perf_counter() - t0
        self.n += 1
        return d


def run_ls(eng: Engine, toks, n: int) -> dict:
    before = {d["type"]: dict(d) for d in eng.drafter_stats()}
    r = eng.generate(list(toks), n_predict=n, sampling=llama.SamplingParams(temp=0.0))
    st = r.stats
    out = dict(tps=st.decode_tokens_per_second, n=len(r.tokens), tokens=list(r.tokens), drafted=st.n_drafted,
               accepted=st.n_accepted, steps=st.n_verif_steps, rounds=st.n_target_decodes)
    for d in eng.drafter_stats():
        b = before.get(d["type"], {})
        us = sum(d[k] - b.get(k, 0) for k in ("t_draft_us", "t_accept_us", "t_begin_us"))
        out["drafter_ms"] = us / 1e3
        out["skips"] = {k: v - b.get("auto", {}).get(k, 0) for k, v in d.get("auto", {}).items()
                        if isinstance(v, int)}
    return out


def tie_check(ctx: llama.Context, prefix, a: int, b: int) -> dict:
    ctx.memory.clear(True)
    ctx.decode_tokens(list(prefix), 0, 0)
    lg = np.array(ctx.logits(-1), dtype=np.float64)
    top = float(lg.max())
    ga, gb = top - float(lg[a]), top - float(lg[b])
    return {"gap_ref": round(ga, 4), "gap_other": round(gb, 4), "near_tie": bool(ga <= TIE_TOL and gb <= TIE_TOL)}


def bench_model(name: str, prompts, args, log) -> dict:
    path = str(resolve_model(name))
    model = llama.Model(path)
    bps = prepare_prompts(model, prompts)
    kw = dict(n_ctx=args.ctx, n_batch=512, n_threads=args.threads, flash_attn=True)
    auto = SpecParams()
    auto.add_types("auto")
    engines = {"ls-plain": Engine(model, **kw), "ls-auto": Engine(model, spec=auto, **kw)}
    settings = RunSettings(n_ctx=args.ctx, n_batch=512, threads=args.threads, flash_attn=True, seed=0, spec=SpecParams())
    lcp = LlamaCppPythonRunner(path, settings)
    lookup_mode = parse_mode(f"lookup:{args.lookup_n}")
    lcp.prepare(lookup_mode)
    timed = Timed(lcp.drafts[lookup_mode.name].inner)
    lcp.drafts[lookup_mode.name].inner = timed

    def run(engine: str, bp, n: int) -> dict:
        if engine == "lcp-lookup":
            t0, n0 = timed.t, timed.n
            r = lcp.run(lookup_mode, bp, n, 0)
            return dict(tps=r.decode_tps, n=r.n_predicted, tokens=list(r.tokens or []), drafted=r.n_drafted,
                        accepted=r.n_accepted, steps=r.n_verif_steps, rounds=timed.n - n0,
                        drafter_ms=(timed.t - t0) * 1e3)
        return run_ls(engines[engine], bp.tokens, n)

    for e in ENGINES:  # warm-up (graph building, first allocations): not recorded
        run(e, bps[0], 8)
    runs: list[dict] = []
    t_start = time.time()
    for rep in range(args.repeats):
        for pi, bp in enumerate(bps):
            order = list(ENGINES) if (rep + pi) % 2 == 0 else list(reversed(ENGINES))
            for e in order:
                r = run(e, bp, args.n)
                r.update(engine=e, prompt=bp.id, category=bp.category, kind=kind_of(bp.category), repeat=rep)
                runs.append(r)
                log(f"{name} rep {rep} {bp.id:22s} {e:10s} {r['tps']:6.1f} tok/s  drafted {r['drafted']} "
                    f"accepted {r['accepted']}")
    wall = time.time() - t_start
    # equality against llamaspec plain (first repeat), near-tie-aware
    ref = {r["prompt"]: r["tokens"] for r in runs if r["engine"] == "ls-plain" and r["repeat"] == 0}
    ctx = llama.Context(model, n_ctx=args.ctx, n_batch=512, n_threads=args.threads, flash_attn=True)
    eq = []
    by_id = {bp.id: bp for bp in bps}
    for r in runs:
        a, b = ref[r["prompt"]], r["tokens"]
        m = min(len(a), len(b))
        i = next((j for j in range(m) if a[j] != b[j]), None)
        item = {"engine": r["engine"], "prompt": r["prompt"], "repeat": r["repeat"], "equal": i is None}
        if i is not None:
            item.update(index=i, **tie_check(ctx, list(by_id[r["prompt"]].tokens) + a[:i], a[i], b[i]))
        eq.append(item)
    ctx.close()
    for e in engines.values():
        e.close()
    lcp.close()
    model.close()
    return {"model": name, "wall_s": round(wall, 1), "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
            "equality": eq}


def summarise(res: dict) -> dict:
    runs = res["runs"]
    per: dict = {}
    for r in runs:
        per.setdefault(r["prompt"], {"category": r["category"], "kind": r["kind"]}).setdefault(r["engine"], []).append(r)
    rows = []
    for pid, d in per.items():
        row = {"prompt": pid, "category": d["category"], "kind": d["kind"]}
        for e in ENGINES:
            rs = d.get(e, [])
            row[e] = statistics.median(x["tps"] for x in rs) if rs else None
            if rs and e != "ls-plain":
                dr = sum(x["drafted"] or 0 for x in rs)
                row[f"{e}:acc"] = (sum(x["accepted"] or 0 for x in rs) / dr) if dr else None
                row[f"{e}:drafted"] = dr / len(rs)
                rounds = sum(x["rounds"] or 0 for x in rs)
                row[f"{e}:drafter_ms_per_round"] = sum(x.get("drafter_ms", 0.0) for x in rs) / rounds if rounds else None
        if not all(row[e] for e in ENGINES):  # e.g. the model ends the text at once: nothing to compare
            continue
        row["auto/lookup"] = row["ls-auto"] / row["lcp-lookup"]
        row["auto/plain"] = row["ls-auto"] / row["ls-plain"]
        row["lookup/plain"] = row["lcp-lookup"] / row["ls-plain"]
        rows.append(row)
    kinds = {}
    for k in ("copy", "free", "all"):
        sel = [r for r in rows if k == "all" or r["kind"] == k]
        if sel:
            kinds[k] = {q: round(statistics.median(r[q] for r in sel), 3) for q in ("auto/lookup", "auto/plain", "lookup/plain")}
            kinds[k]["min auto/plain"] = round(min(r["auto/plain"] for r in sel), 3)
            kinds[k]["n"] = len(sel)
    by_cat = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["auto/plain"])
    return {"rows": rows, "kinds": kinds, "min_auto_plain_by_category": {c: round(min(v), 3) for c, v in by_cat.items()}}


def markdown(report: dict) -> str:
    a = report["args"]
    out = ["# No draft model: llamaspec auto (ngram-lookup) vs llama-cpp-python prompt lookup vs plain", "",
           f"- date: {report['date']}; machine: {report['machine']}",
           f"- command: `{report['command']}`",
           f"- {a['n']} tokens per run, {a['repeats']} repeat(s), {a['threads']} threads, context {a['ctx']}, flash "
           "attention on, greedy; prompt lookup num_pred_tokens "
           f"{a['lookup_n']}; engines interleaved per prompt (A B C, then C B A)",
           "- ls-plain = llamaspec without drafting; ls-auto = llamaspec's default with no draft model "
           "(`--spec-type auto`: ngram-lookup behind its gain gate); lcp-lookup = llama-cpp-python "
           "`LlamaPromptLookupDecoding(num_pred_tokens=10)`", ""]
    for m in report["models"]:
        s = m["summary"]
        out += ["", f"## {m['model']} ({m['wall_s']} s)", "", "| kind | prompts | auto / lookup | auto / plain | lookup / plain | min auto / plain |",
                "|---|---|---|---|---|---|"]
        for k, v in s["kinds"].items():
            out.append(f"| {k} | {v['n']} | {v['auto/lookup']:.2f} | {v['auto/plain']:.2f} | {v['lookup/plain']:.2f} | "
                       f"{v['min auto/plain']:.2f} |")
        out += ["", "| prompt | kind | plain tok/s | auto tok/s | lookup tok/s | auto/lookup | auto/plain | auto acc | "
                "lookup acc | auto drafted | lookup drafted | auto ms/round | lookup ms/round |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def f(x, p=2, pct=False):
            if x is None:
                return "–"
            return f"{100 * x:.0f}%" if pct else f"{x:.{p}f}"

        for r in s["rows"]:
            out.append(f"| {r['prompt']} | {r['kind']} | {f(r['ls-plain'], 1)} | {f(r['ls-auto'], 1)} | {f(r['lcp-lookup'], 1)} | "
                       f"{f(r['auto/lookup'])} | {f(r['auto/plain'])} | {f(r.get('ls-auto:acc'), pct=True)} | "
                       f"{f(r.get('lcp-lookup:acc'), pct=True)} | {f(r.get('ls-auto:drafted'), 0)} | "
                       f"{f(r.get('lcp-lookup:drafted'), 0)} | {f(r.get('ls-auto:drafter_ms_per_round'), 3)} | "
                       f"{f(r.get('lcp-lookup:drafter_ms_per_round'), 3)} |")
        div = [e for e in m["equality"] if not e["equal"]]
        n = len(m["equality"])
        if not div:
            out += ["", f"Outputs: all {n} runs equal llamaspec plain (greedy)."]
        else:
            ties = sum(1 for e in div if e["near_tie"])
            out += ["", f"Outputs: {n - len(div)} of {n} runs equal llamaspec plain; {len(div)} diverge "
                    f"({ties} at near-ties, logit gaps <= {TIE_TOL}):", "",
                    "| engine | prompt | repeat | index | gap ref | gap other | near-tie |", "|---|---|---|---|---|---|---|"]
            for e in div:
                out.append(f"| {e['engine']} | {e['prompt']} | {e['repeat']} | {e['index']} | {e['gap_ref']} | "
                           f"{e['gap_other']} | {e['near_tie']} |")
        out.append("")
    out += ["tok/s: decode tokens per second ((generated - 1) / decode time), median over repeats; ratios per prompt, "
            "then the median per kind. acc: accepted / drafted tokens; drafted: tokens drafted per run; ms/round: the "
            "drafter's own Python time per target decode (ngram-lookup: begin + draft + accept; prompt lookup: its "
            "call).", ""]
    return "\n".join(out)


def micro(model_name: str, sizes=(256, 1024, 4096), rounds: int = 300) -> list[dict]:
    """Drafter cost alone, per round, on a history of ``sizes`` tokens (the prompts' text, tokenized, repeated):
    ngram-lookup's sync + lookup + draft + accept against prompt lookup's call (what each engine pays in
    Python per round, before any decode)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from llamaspec.drafters.base import DraftParams
    from llamaspec.drafters.ngram_lookup import NgramLookup

    model = llama.Model(str(resolve_model(model_name)))
    text = "\n\n".join(p.text for p in load_prompts(ROOT / "docs/benchmarks/ngram-auto-prompts.jsonl"))
    base = model.vocab.tokenize(text, add_special=True, parse_special=True)
    model.close()
    rows = []
    for size in sizes:
        hist = (base * (size // len(base) + 2))[:size]
        src = base[: rounds * 3 + 8]
        d = NgramLookup(1)
        lk = LlamaPromptLookupDecoding(num_pred_tokens=10)
        h = list(hist)
        t0 = time.perf_counter()
        d.begin(0, h)
        t_begin = time.perf_counter() - t0
        t_ng = t_lk = 0.0
        arr = np.array(h + src, dtype=np.intc)
        for r in range(rounds):
            step = h + src[: r * 3]
            id_last = src[r * 3]
            t0 = time.perf_counter()
            dp = DraftParams(drafting=True, n_max=32, prompt=step, id_last=id_last)
            d.draft([dp])
            d.accept(0, min(2, len(dp.result)), False)
            t1 = time.perf_counter()
            lk(arr[: len(step) + 1])
            t2 = time.perf_counter()
            t_ng += t1 - t0
            t_lk += t2 - t1
        rows.append({"history": size, "ngram_lookup_us_per_round": round(t_ng / rounds * 1e6, 1),
                     "ngram_lookup_begin_ms": round(t_begin * 1e3, 2),
                     "prompt_lookup_us_per_call": round(t_lk / rounds * 1e6, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma3-270m-f32,smollm2-135m-f32")
    ap.add_argument("--prompts", default=str(ROOT / "docs/benchmarks/ngram-auto-prompts.jsonl"))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1536)
    ap.add_argument("--lookup-n", type=int, default=10)
    ap.add_argument("--limit", type=int, default=0, help="first N prompts only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--micro", action="store_true", help="only the drafters' own cost per round (no decoding)")
    args = ap.parse_args()
    if args.micro:
        print(json.dumps(micro(args.models.split(",")[0].strip()), indent=1))
        return
    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start",
              "command": "python scripts/bench_ngram_auto.py " + " ".join(sys.argv[1:]),
              "args": vars(args), "models": []}
    for name in args.models.split(","):
        res = bench_model(name.strip(), prompts, args, log)
        res["summary"] = summarise(res)
        report["models"].append(res)
        log(json.dumps({name: res["summary"]["kinds"]}))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    report["machine"] += f", {os.getloadavg()[0]:.2f} at end"
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    md = markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(md)


if __name__ == "__main__":
    main()
