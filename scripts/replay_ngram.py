#!/usr/bin/env python
"""Deterministic comparison of n-gram drafting policies on recorded greedy outputs (no timing noise).

``record`` generates each prompt's greedy output once (plain llamaspec) and stores prompt + output tokens.
``replay`` then runs each drafter round by round against that output: a drafted token is accepted when it
equals the recorded token at its position (greedy verification), each round costs ``v(rows)`` from a
verify-cost curve (default: Gemma-3-270M F32 on two unloaded cores, docs/benchmarks/copy-vs-lookup.md), and
the predicted speedup over plain decoding is ``n tokens * v(1) / sum of round costs``. Drafters: llamaspec's
``ngram-lookup`` (the real class, told the same curve) and llama-cpp-python's ``LlamaPromptLookupDecoding``
(the real class, num_pred_tokens 10). What it leaves out: Python and sampling time per round (the same
order for both, see bench_ngram_auto.py --micro) and llama-cpp-python's copy of every row's logits.

    python scripts/replay_ngram.py record gemma3-270m-f32 /tmp/ref-gemma.json -n 128
    python scripts/replay_ngram.py replay /tmp/ref-gemma.json [--curve 1:434,4:725,8:1000,16:1500,32:2950]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COPY_KINDS = ("code-edit", "code-refactor", "summarisation", "qa")
CURVE = {1: 51.07, 2: 65.28, 4: 71.55, 8: 92.72, 16: 110.48, 32: 145.47, 64: 253.70}


def cost(curve: dict, rows: int) -> float:
    ks = sorted(curve)
    if rows in curve:
        return curve[rows]
    lo = max((k for k in ks if k < rows), default=ks[0])
    hi = min((k for k in ks if k > rows), default=None)
    if hi is None:
        k0 = max(k for k in ks if k < lo) if len(ks) > 1 else lo
        slope = (curve[lo] - curve[k0]) / max(lo - k0, 1)
        return curve[lo] + slope * (rows - lo)
    return curve[lo] + (curve[hi] - curve[lo]) * (rows - lo) / (hi - lo)


def record(model_name: str, out: str, n: int, prompts: str, threads: int) -> None:
    from llamaspec import _llama as llama
    from llamaspec.bench.prompts import load_prompts
    from llamaspec.bench.runners import prepare_prompts
    from llamaspec.engine import Engine
    from llamaspec.models import resolve_model

    model = llama.Model(str(resolve_model(model_name)))
    res = {}
    with Engine(model, n_ctx=1536, n_threads=threads, flash_attn=True) as e:
        for p in prepare_prompts(model, load_prompts(prompts)):
            r = e.generate(list(p.tokens), n_predict=n, sampling=llama.SamplingParams(temp=0.0))
            res[p.id] = {"category": p.category, "prompt": list(p.tokens), "out": list(r.tokens)}
            print(p.id, len(r.tokens), file=sys.stderr, flush=True)
    Path(out).write_text(json.dumps(res))


def replay_lookup(prompt, out, curve, n_pred=10):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lk = LlamaPromptLookupDecoding(num_pred_tokens=n_pred)
    seq = list(prompt) + [out[0]]
    i, t, drafted, acc = 1, 0.0, 0, 0
    while i < len(out):
        d = [int(x) for x in lk(np.array(seq, dtype=np.intc))]
        a = 0
        while a < len(d) and i + a < len(out) and d[a] == out[i + a]:
            a += 1
        t += cost(curve, 1 + len(d))
        drafted, acc = drafted + len(d), acc + a
        seq += out[i:i + a + 1]
        i += a + 1
    return t, drafted, acc


def replay_ngram(prompt, out, curve):
    from llamaspec.drafters.base import DraftParams
    from llamaspec.drafters.ngram_lookup import NgramLookup

    d = NgramLookup(1)
    base = curve[1]
    d.verify_cost = lambda k: cost(curve, k + 1) / base
    hist = list(prompt)
    d.begin(0, hist)
    idl, i, t, drafted, acc = out[0], 1, 0.0, 0, 0
    while i < len(out):
        dp = DraftParams(drafting=True, n_max=min(d.n_max, len(out) - i - 1), prompt=tuple(hist), id_last=idl)
        d.draft([dp])
        r = dp.result
        a = 0
        while a < len(r) and r[a] == out[i + a]:
            a += 1
        if r:
            d.accept(0, a, False)
        t += cost(curve, 1 + len(r))
        drafted, acc = drafted + len(r), acc + a
        if i + a >= len(out):
            break
        hist += [idl] + out[i:i + a]
        idl = out[i + a]
        i += a + 1
    return t, drafted, acc


def replay(fn: str, curve: dict) -> dict:
    ref = json.loads(Path(fn).read_text())
    rows = []
    for pid, d in ref.items():
        out = d["out"]
        if len(out) < 2:
            continue
        t_plain = (len(out) - 1) * curve[1]
        tl, dl, al = replay_lookup(d["prompt"], out, curve)
        tn, dn, an = replay_ngram(d["prompt"], out, curve)
        kind = "copy" if d["category"] in COPY_KINDS else "free"
        rows.append({"prompt": pid, "kind": kind, "lookup/plain": t_plain / tl, "ngram/plain": t_plain / tn,
                     "ngram/lookup": tl / tn, "lookup drafted/accepted": f"{dl}/{al}",
                     "ngram drafted/accepted": f"{dn}/{an}"})
    for r in rows:
        print(f"{r['prompt']:22s} {r['kind']}  lookup x{r['lookup/plain']:5.2f} ({r['lookup drafted/accepted']:>7s})  "
              f"ngram-lookup x{r['ngram/plain']:5.2f} ({r['ngram drafted/accepted']:>7s})  ngram/lookup {r['ngram/lookup']:5.2f}")
    summary = {}
    for k in ("copy", "free"):
        sel = [r for r in rows if r["kind"] == k]
        if sel:
            summary[k] = {q: round(statistics.median(r[q] for r in sel), 3) for q in ("ngram/lookup", "ngram/plain", "lookup/plain")}
            summary[k]["min ngram/plain"] = round(min(r["ngram/plain"] for r in sel), 3)
            print(k, json.dumps(summary[k]))
    return {"rows": rows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("model")
    r.add_argument("out")
    r.add_argument("-n", type=int, default=128)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--prompts", default=str(ROOT / "docs/benchmarks/ngram-auto-prompts.jsonl"))
    p = sub.add_parser("replay")
    p.add_argument("ref")
    p.add_argument("--curve", default=None, help="rows:ms,rows:ms,... (default: Gemma-3-270M F32, two cores)")
    a = ap.parse_args()
    if a.cmd == "record":
        record(a.model, a.out, a.n, a.prompts, a.threads)
    else:
        curve = CURVE if a.curve is None else {int(x.split(":")[0]): float(x.split(":")[1]) for x in a.curve.split(",")}
        replay(a.ref, curve)


if __name__ == "__main__":
    main()
