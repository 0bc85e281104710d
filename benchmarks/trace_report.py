"""The trace benchmark's summary and markdown (:mod:`.trace`): per trace, tokens/s of every variant (median,
min and max over the interleaved repeats), its ratio to plain decoding and to llama-server's best variant on
that trace, and the issue's targets for llamaspec's defaults.

Plain = ``ls-plain`` (llamaspec serve without speculation) when it ran, else ``native-plain``. llama-server's
best = the native variant with the highest median on that trace (plain included: speculation may lose).

>>> runs = [dict(trace="free", variant=v, engine=e, tokens_per_s=t, draft_n=0, draft_n_accepted=0, outputs=["a"])
...         for v, e, t in (("ls-plain", "llamaspec", 20.0), ("ls-defaults", "llamaspec", 19.6),
...                         ("native-plain", "native", 21.0), ("native-spec-default", "native", 20.0))]
>>> row = summarise(runs, ["free"])[0]
>>> row["plain"], row["best_native"], row["vs_plain"]["ls-defaults"], row["target"]
('ls-plain', 'native-plain', 0.98, {'variant': 'ls-defaults', 'vs_plain_min': 0.97, 'vs_best_native_min': None, 'met': True})
"""
from __future__ import annotations

import statistics
from typing import Sequence

from .copy_set import fmt_duration
from .trace_sessions import REPETITIVE

__all__ = ["summarise", "render_markdown", "TARGETS"]

#: issue 25: llamaspec's defaults against plain and llama-server's best; (x plain, x best llama-server)
TARGETS = {"repetitive": (2.0, 1.3), "free": (0.97, None)}
MAIN = "ls-defaults"


def _target(trace: str) -> tuple[float, float | None]:
    return TARGETS["repetitive"] if trace in REPETITIVE else TARGETS["free"]


def summarise(runs: Sequence[dict], traces: Sequence[str]) -> list[dict]:
    """One row per trace (module docstring)."""
    out = []
    for t in traces:
        rs = [r for r in runs if r["trace"] == t]
        if not rs:
            continue
        variants = list(dict.fromkeys(r["variant"] for r in rs))
        engine = {r["variant"]: r["engine"] for r in rs}
        tps, acc = {}, {}
        for v in variants:
            xs = [r["tokens_per_s"] for r in rs if r["variant"] == v]
            tps[v] = {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2),
                      "n": len(xs)}
            dn = sum(r["draft_n"] for r in rs if r["variant"] == v)
            acc[v] = {"drafted": dn, "accepted": sum(r["draft_n_accepted"] for r in rs if r["variant"] == v)}
        plain = next((p for p in ("ls-plain", "native-plain") if p in tps), None)
        natives = [v for v in variants if engine[v] == "native"]
        best = max(natives, key=lambda v: tps[v]["median"]) if natives else None

        def ratio(v: str, ref: str | None) -> float | None:
            if ref is None or tps[ref]["median"] <= 0:
                return None
            return round(tps[v]["median"] / tps[ref]["median"], 3)

        row = {"trace": t, "kind": "repetitive" if t in REPETITIVE else "free", "tokens_per_s": tps, "drafts": acc,
               "plain": plain, "best_native": best,
               "vs_plain": {v: ratio(v, plain) for v in variants}, "vs_best_native": {v: ratio(v, best) for v in variants}}
        if MAIN in tps:
            lo_plain, lo_native = _target(t)
            rp, rn = row["vs_plain"][MAIN], row["vs_best_native"][MAIN]
            met = (rp is not None and rp >= lo_plain) and (lo_native is None or (rn is not None and rn >= lo_native))
            row["target"] = {"variant": MAIN, "vs_plain_min": lo_plain, "vs_best_native_min": lo_native, "met": met}
        if t != "n4":  # llamaspec's servers, greedy: the output must not depend on drafting (llama-server may differ)
            flat = [r["outputs"] for r in rs if r["engine"] == "llamaspec"]
            row["llamaspec_outputs_equal"] = all(o == flat[0] for o in flat) if flat else None
        out.append(row)
    return out


def _x(v: float | None) -> str:
    return "–" if v is None else f"×{v:.2f}"


def render_markdown(report: dict) -> str:
    cfg, rows = report["config"], report["summary"]
    est = report.get("estimate") or {}
    lines = ["# Trace benchmark (issue 25)", "",
             f"- date: {report['date']}, duration {report.get('duration_s', 0) / 60:.1f} min"
             + (f" (estimated up front: {fmt_duration(est['estimate_s'])})" if est else ""),
             f"- command: `{report.get('command') or 'python -m benchmarks.research --trace'}`",
             f"- model `{cfg.get('model_name') or cfg['model']}`, no draft model; {cfg['n_predict']} tokens per request, "
             f"{cfg['turns']} turns, {cfg['repeats']} repeat(s), -np {cfg['n_parallel']}, -c {cfg['n_ctx']}"
             + (f", -t {cfg['threads']}" if cfg.get("threads") else "")
             + (", exact (-fa off, F32 KV)" if cfg.get("exact") else "") + (f", texts scaled ×{cfg['scale']}" if cfg.get("scale", 1) != 1 else ""),
             f"- schedule: {'a fresh server per (repeat, trace, variant)' if cfg['restart'] == 'trace' else 'one server per (repeat, variant), traces in order'}; "
             "for each trace the variants back to back, order reversed on odd repeats (A B C, C B A)",
             f"- machine: {report.get('machine', {}).get('cpus')} CPUs, load average at the end "
             f"{report.get('machine', {}).get('loadavg_end')}", "", "## Variants", "", "| variant | server and flags |", "|---|---|"]
    for k, v in report["variants"].items():
        lines.append(f"| {k} | {v['label']} |")
    lines += ["", "## Against the targets", "",
              "llamaspec's defaults (`ls-defaults`) against plain and llama-server's best variant per trace. Targets "
              f"(issue 25): repetitive traces ×{TARGETS['repetitive'][0]} plain and ×{TARGETS['repetitive'][1]} "
              f"llama-server's best; free text ×{TARGETS['free'][0]} plain or better.", "",
              "| trace | kind | ls-defaults tok/s | plain tok/s | llama-server best (variant) tok/s | × plain | × llama-server best | target | met |",
              "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        tps = r["tokens_per_s"]
        if MAIN not in tps:
            continue
        tg = r.get("target", {})
        best = r["best_native"]
        want = f"×{tg['vs_plain_min']} plain" + (f", ×{tg['vs_best_native_min']} best" if tg.get("vs_best_native_min") else "")
        lines.append(f"| {r['trace']} | {r['kind']} | {tps[MAIN]['median']:.1f} | "
                     f"{tps[r['plain']]['median']:.1f} ({r['plain']}) | "
                     + (f"{tps[best]['median']:.1f} ({best})" if best else "–")
                     + f" | {_x(r['vs_plain'][MAIN])} | {_x(r['vs_best_native'][MAIN])} | {want} | "
                     f"{'yes' if tg.get('met') else 'no'} |")
    lines += ["", "## Per trace", ""]
    for r in rows:
        tps = r["tokens_per_s"]
        eq = r.get("llamaspec_outputs_equal")
        lines += [f"### {r['trace']} ({r['kind']})", "",
                  "| variant | tok/s median (min–max) | × plain | × llama-server best | drafted | accepted |",
                  "|---|---:|---:|---:|---:|---:|"]
        for v, t in tps.items():
            d = r["drafts"][v]
            lines.append(f"| {v} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) | {_x(r['vs_plain'][v])} | "
                         f"{_x(r['vs_best_native'][v])} | {d['drafted']} | {d['accepted']} |")
        lines.append("")
        if eq is not None:
            lines += [f"llamaspec's greedy outputs on this trace, every variant and repeat: "
                      f"{'all equal' if eq else 'not all equal'}"
                      + ("" if eq or cfg.get("exact") else " (without --exact, batched and single-token logits differ "
                         "slightly: a near-tie may flip)") + ".", ""]
    lines += ["tok/s: generated tokens (`timings.predicted_n`, all requests of the trace) / wall time of the trace "
              "(prompt processing included), median over repeats; drafted / accepted: the servers' `timings`, summed "
              "over repeats. × plain: against `" + (rows[0]["plain"] if rows else "ls-plain") + "`; × llama-server best: "
              "against the native variant with the highest median on that trace."]
    if report.get("skipped"):
        lines += ["", "Skipped: " + ", ".join(f"{k} ({v})" for k, v in report["skipped"].items())]
    return "\n".join(lines) + "\n"
