"""llamaspec's defaults against native llama.cpp at its best fixed draft length, from a ``llamaspec bench --json``
report (issue 12's first target).

    llamaspec bench -m gemma3-270m-f32 -md gemma3-270m-q4km --engines llamaspec,native-server \\
        --modes plain,default,draft-simple:3,draft-simple:6,draft-simple:10 --json report.json
    python scripts/best_fixed_ratio.py report.json [--markdown out.md]

Per prompt: decode tokens/s of llamaspec ``default`` (median over repeats), of each native engine at every fixed
``draft-simple:N`` it ran (median over repeats) and its best N for that prompt, the ratio default / best native
(the best N is chosen per prompt, after the fact: a bound no fixed setting reaches), and the speedups over plain.
Prints the table and the median ratios per engine and per prompt category.

``--total``: tokens per second of the whole request (prompt and generation: ``n_predicted / (t_prompt_s +
t_decode_s)``, the same formula for every engine) instead of decode tokens per second. The two engines put the
draft model's prompt in different phases: ``llama-speculative-simple`` decodes the prompt into the draft context
with the target's, inside its "encoded" time (its decode time leaves it out), while llamaspec catches the draft
context up when the draft model first drafts (inside decode time; never, where n-gram copies serve the whole
request). Decode rates alone therefore charge llamaspec for work they do not charge the peer for; the totals
charge both for everything.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def _tps(r: dict, total: bool) -> float | None:
    if r.get("error"):
        return None
    if not total:
        return r.get("decode_tokens_per_second") or None
    t = (r.get("t_prompt_s") or 0.0) + (r.get("t_decode_s") or 0.0)
    return r["n_predicted"] / t if t > 0 and r.get("n_predicted") else None


def _median_tps(runs: list[dict], total: bool = False) -> float:
    v = [x for x in (_tps(r, total) for r in runs) if x]
    return statistics.median(v) if v else 0.0


def analyse(report: dict, mode: str = "default", total: bool = False) -> dict:
    """Per prompt and per native engine: llamaspec ``mode`` against the engine's best fixed draft length (decode
    tokens per second, or with ``total`` those of the whole request).

    >>> run = lambda e, m, tps, tp: {"engine": e, "mode": m, "prompt_id": "p", "n_predicted": 10,
    ...                              "t_prompt_s": tp, "t_decode_s": 10 / tps, "decode_tokens_per_second": tps}
    >>> rep = {"runs": [run("llamaspec", "plain", 10, 0.5), run("llamaspec", "default", 20, 0.5),
    ...                 run("native", "draft-simple:8", 20, 1.0), run("native", "draft-simple:4", 10, 0.5)]}
    >>> analyse(rep)["summary"]["native"]["median"], round(analyse(rep, total=True)["summary"]["native"]["median"], 2)
    (1.0, 1.5)
    """
    by: dict[tuple, list[dict]] = defaultdict(list)
    cat: dict[str, str] = {}
    for r in report["runs"]:
        by[r["engine"], r["mode"], r["prompt_id"]].append(r)
        cat[r["prompt_id"]] = r.get("category", "")
    prompts = sorted(cat, key=lambda p: (cat[p], p))
    natives = sorted({e for e, m, _ in by if e != "llamaspec" and m.startswith("draft-simple")})
    rows = []
    for p in prompts:
        d = _median_tps(by.get(("llamaspec", mode, p), []), total)
        plain = _median_tps(by.get(("llamaspec", "plain", p), []), total)
        row = {"prompt": p, "category": cat[p], "default_tps": d, "plain_tps": plain, "native": {}}
        for e in natives:
            fixed = {m: _median_tps(by[(e2, m, p2)], total) for (e2, m, p2) in by if e2 == e and p2 == p and m.startswith("draft-simple")}
            if not fixed:
                continue
            best = max(fixed, key=fixed.get)
            row["native"][e] = {"best_mode": best, "best_tps": fixed[best], "ratio": d / fixed[best] if fixed[best] else 0.0,
                                "all": fixed}
        rows.append(row)
    summary = {}
    for e in natives:
        ratios = [r["native"][e]["ratio"] for r in rows if e in r["native"] and r["default_tps"]]
        per_cat = defaultdict(list)
        for r in rows:
            if e in r["native"] and r["default_tps"]:
                per_cat[r["category"]].append(r["native"][e]["ratio"])
        summary[e] = {"median": statistics.median(ratios) if ratios else None,
                      "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None,
                      "per_category": {c: statistics.median(v) for c, v in sorted(per_cat.items())}}
    return {"rows": rows, "summary": summary, "mode": mode, "total": total}


def markdown(a: dict, source: str) -> str:
    m = a.get("mode", "default")
    what = "tokens/s of the whole request (prompt + generation)" if a.get("total") else "decode tokens/s"
    out = [f"Source: `{source}`, llamaspec mode `{m}`, {what}", "",
           f"| prompt | category | plain tok/s | llamaspec {m} tok/s (x plain) | " +
           " | ".join(f"{e}: best fixed (tok/s) | {m} / {e}" for e in a["summary"]) + " |",
           "|---|---|---:|---:|" + "---|---:|" * len(a["summary"])]
    for r in a["rows"]:
        sp = f"{r['default_tps']:.1f} ({r['default_tps'] / r['plain_tps']:.2f}x)" if r["plain_tps"] else f"{r['default_tps']:.1f}"
        cells = []
        for e in a["summary"]:
            n = r["native"].get(e)
            cells += [f"{n['best_mode']} ({n['best_tps']:.1f})", f"{n['ratio']:.2f}"] if n else ["", ""]
        out.append(f"| {r['prompt']} | {r['category']} | {r['plain_tps']:.1f} | {sp} | " + " | ".join(cells) + " |")
    out.append("")
    for e, s in a["summary"].items():
        if s["median"] is None:
            continue
        cats = ", ".join(f"{c} {v:.2f}" for c, v in s["per_category"].items())
        out.append(f"- {m} / {e} at its best fixed n_max per prompt: median **{s['median']:.2f}** "
                   f"(min {s['min']:.2f}, max {s['max']:.2f}); per category: {cats}")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--mode", default="default", help="the llamaspec mode to compare (default: %(default)s)")
    ap.add_argument("--total", action="store_true", help="whole-request tokens/s (prompt + generation; docstring)")
    args = ap.parse_args()
    a = analyse(json.loads(Path(args.report).read_text()), args.mode, args.total)
    md = markdown(a, args.report)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)


if __name__ == "__main__":
    main()
