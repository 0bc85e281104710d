"""llamaspec's defaults against native llama.cpp at its best fixed draft length, from a ``llamaspec bench --json``
report (issue 12's first target).

    llamaspec bench -m gemma3-270m-f32 -md gemma3-270m-q4km --engines llamaspec,native-server \\
        --modes plain,default,draft-simple:3,draft-simple:6,draft-simple:10 --json report.json
    python scripts/best_fixed_ratio.py report.json [--markdown out.md]

Per prompt: decode tokens/s of llamaspec ``default`` (median over repeats), of each native engine at every fixed
``draft-simple:N`` it ran (median over repeats) and its best N for that prompt, the ratio default / best native
(the best N is chosen per prompt, after the fact: a bound no fixed setting reaches), and the speedups over plain.
Prints the table and the median ratios per engine and per prompt category.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def _median_tps(runs: list[dict]) -> float:
    v = [r["decode_tokens_per_second"] for r in runs if not r.get("error") and r.get("decode_tokens_per_second")]
    return statistics.median(v) if v else 0.0


def analyse(report: dict, mode: str = "default") -> dict:
    by: dict[tuple, list[dict]] = defaultdict(list)
    cat: dict[str, str] = {}
    for r in report["runs"]:
        by[r["engine"], r["mode"], r["prompt_id"]].append(r)
        cat[r["prompt_id"]] = r.get("category", "")
    prompts = sorted(cat, key=lambda p: (cat[p], p))
    natives = sorted({e for e, m, _ in by if e != "llamaspec" and m.startswith("draft-simple")})
    rows = []
    for p in prompts:
        d = _median_tps(by.get(("llamaspec", mode, p), []))
        plain = _median_tps(by.get(("llamaspec", "plain", p), []))
        row = {"prompt": p, "category": cat[p], "default_tps": d, "plain_tps": plain, "native": {}}
        for e in natives:
            fixed = {m: _median_tps(by[(e2, m, p2)]) for (e2, m, p2) in by if e2 == e and p2 == p and m.startswith("draft-simple")}
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
    return {"rows": rows, "summary": summary, "mode": mode}


def markdown(a: dict, source: str) -> str:
    m = a.get("mode", "default")
    out = [f"Source: `{source}`, llamaspec mode `{m}`", "",
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
    args = ap.parse_args()
    a = analyse(json.loads(Path(args.report).read_text()), args.mode)
    md = markdown(a, args.report)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)


if __name__ == "__main__":
    main()
