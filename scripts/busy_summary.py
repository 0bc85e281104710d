"""Tables and a plot of ``llamaspec bench --load`` runs: the defaults against plain decoding and against
llama-speculative-simple at its best fixed n_max, per prompt, at each load level (issue 33).

    llamaspec bench -m gemma3-270m-f32 -md gemma3-270m-q4km --engines llamaspec,native \\
        --modes plain,default,draft-simple:4,draft-simple:8 --prompts docs/benchmarks/ngram-auto-prompts.jsonl \\
        --limit 4 -n 64 --repeats 1 --no-costs --no-progress --load N --json docs/benchmarks/busy-N.json
    python scripts/busy_summary.py docs/benchmarks/busy-0.json docs/benchmarks/busy-1.json ... \\
        --markdown docs/benchmarks/busy-machine.md --plot docs/benchmarks/busy-machine.png

Every ratio is of two configurations of the same interleaved run (same prompts, same load, back to back).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from best_fixed_ratio import _median_tps, analyse  # noqa: E402


def best_plain(rep: dict) -> dict:
    """Per prompt, the fastest plain decoding of the run, ``(tok/s, "engine mode")``: every engine's ``plain``
    and ``plain@tN`` (the anchor at its best thread count) count, llamaspec's own included."""
    by: dict = {}
    for r in rep["runs"]:
        if r["mode"] == "plain" or r["mode"].startswith("plain@"):
            by.setdefault(r["prompt_id"], {}).setdefault(f"{r['engine']} {r['mode']}", []).append(r)
    out = {}
    for p, cands in by.items():
        tps = {k: _median_tps(v) for k, v in cands.items()}
        k = max(tps, key=lambda x: tps[x] or 0.0)
        out[p] = (tps[k], k)
    return out


def level(report: dict) -> str:
    ld = report.get("load") or {}
    t = report["settings"].get("threads")
    given = " -t %s" % t if "-t" in (report.get("command") or "").split() else ""
    return f"{ld.get('description', 'none (quiet machine)')}{given}"


def summarise(path: str) -> dict:
    rep = json.loads(Path(path).read_text())
    a = analyse(rep, "default")
    plains = best_plain(rep)
    rows = []
    for r in a["rows"]:
        nat = r["native"].get("native")
        plain, plain_by = plains.get(r["prompt"], (r["plain_tps"], "llamaspec plain"))
        rows.append({"prompt": r["prompt"], "category": r["category"], "plain": plain, "plain_by": plain_by,
                     "default": r["default_tps"], "vs_plain": r["default_tps"] / plain if plain else None,
                     "native_best": nat["best_tps"] if nat else None, "native_mode": nat["best_mode"] if nat else None,
                     "vs_native": nat["ratio"] if nat else None})
    vp = [r["vs_plain"] for r in rows if r["vs_plain"]]
    vn = [r["vs_native"] for r in rows if r["vs_native"]]
    ld = rep.get("load") or {}
    return {"path": path, "level": level(rep), "cores_used": ld.get("cores_used"), "rows": rows,
            "loadavg": (rep["machine"].get("loadavg_at_start"), rep["machine"].get("loadavg_at_end")),
            "vs_plain": (statistics.median(vp), min(vp)) if vp else None,
            "vs_native": (statistics.median(vn), min(vn)) if vn else None}


def markdown(levels: list[dict]) -> str:
    out = ["| load | prompt | category | best plain tok/s (which) | defaults tok/s | defaults / best plain | "
           "best native (n_max) tok/s | defaults / best native |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for lv in levels:
        for r in lv["rows"]:
            nat = f"{r['native_best']:.1f} ({r['native_mode']})" if r["native_best"] else "–"
            out.append(f"| {lv['level']} | {r['prompt']} | {r['category']} | {r['plain']:.1f} ({r['plain_by']}) | {r['default']:.1f} | "
                       f"{r['vs_plain']:.2f} | {nat} | {r['vs_native']:.2f} |" if r["vs_native"] else
                       f"| {lv['level']} | {r['prompt']} | {r['category']} | {r['plain']:.1f} ({r['plain_by']}) | {r['default']:.1f} | "
                       f"{r['vs_plain']:.2f} | {nat} | – |")
    out += ["", "| load | load cores used | load average start / end | defaults / best plain: median (min) | "
                "defaults / best native: median (min) | report |", "|---|---:|---|---:|---:|---|"]
    for lv in levels:
        la = " / ".join(", ".join(f"{x:.1f}" for x in v) if v else "?" for v in lv["loadavg"])
        vp = f"{lv['vs_plain'][0]:.2f} ({lv['vs_plain'][1]:.2f})" if lv["vs_plain"] else "–"
        vn = f"{lv['vs_native'][0]:.2f} ({lv['vs_native'][1]:.2f})" if lv["vs_native"] else "–"
        out.append(f"| {lv['level']} | {lv['cores_used'] if lv['cores_used'] is not None else 0} | {la} | {vp} | {vn} | "
                   f"`{lv['path']}` |")
    return "\n".join(out) + "\n"


def plot(levels: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for ax, key, title in ((axes[0], "vs_plain", "defaults / plain (same run)"),
                           (axes[1], "vs_native", "defaults / llama-speculative-simple at its best n_max")):
        prompts = sorted({r["prompt"] for lv in levels for r in lv["rows"]})
        w = 0.8 / max(len(levels), 1)
        for i, lv in enumerate(levels):
            vals = {r["prompt"]: r[key] or 0.0 for r in lv["rows"]}
            ax.bar([j + i * w for j in range(len(prompts))], [vals.get(p, 0.0) for p in prompts], w, label=lv["level"])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + w * (len(levels) - 1) / 2 for j in range(len(prompts))])
        ax.set_xticklabels(prompts, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    args = ap.parse_args()
    levels = [summarise(p) for p in args.reports]
    md = markdown(levels)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    if args.plot:
        plot(levels, args.plot)


if __name__ == "__main__":
    main()
