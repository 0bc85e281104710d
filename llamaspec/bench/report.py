"""The report dictionary (:func:`build_report`) and its rendering: markdown, JSON, PNG plot (all written
atomically) and a rich table."""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import time
from typing import TYPE_CHECKING, Callable

from .._io import write_atomic  # noqa: F401  (re-exported for callers of report.write_atomic)
from ..errors import UsageError
from .prompts import CATEGORIES

if TYPE_CHECKING:
    from .config import BenchConfig, Outcome
    from .native import RunSettings

SCHEMA_VERSION = 1


def portable_paths(value, cache: str | None = None, home: str | None = None, cwd: str | None = None):
    """``value`` (a report, or any part: strings, lists, dicts) with this machine's paths made portable: the model
    cache becomes ``~/.cache/llamaspec`` (``$LLAMASPEC_CACHE`` when set elsewhere), the working directory's
    files relative paths and the rest of the home directory ``~``; a committed report names no user's files.

    >>> portable_paths({"m": "/h/u/.cache/llamaspec/g/g.gguf", "c": ["/w/native/bin/x", "-m", "/h/u/a.gguf"]},
    ...                cache="/h/u/.cache/llamaspec", home="/h/u", cwd="/w")
    {'m': '~/.cache/llamaspec/g/g.gguf', 'c': ['native/bin/x', '-m', '~/a.gguf']}
    """
    if cache is None:
        from ..models import cache_dir
        cache = str(cache_dir())
    home = os.path.expanduser("~") if home is None else home
    cwd = os.getcwd() if cwd is None else cwd
    default_cache = os.path.join(home, ".cache", "llamaspec")
    subs = [(cache.rstrip("/") + "/", "~/.cache/llamaspec/" if cache.rstrip("/") == default_cache else "$LLAMASPEC_CACHE/")]
    subs += [(d.rstrip("/") + "/", new) for d, new in ((cwd, ""), (home, "~/")) if len(d.rstrip("/")) > 1]
    subs.sort(key=lambda x: -len(x[0]))  # the longest prefix first (a cache or checkout inside the home)

    def fix(v):
        if isinstance(v, str):
            for old, new in subs:
                v = re.sub(r"(^|(?<=[\s=\"'`(]))" + re.escape(old), new.replace("\\", "\\\\"), v)
            return v
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        return v
    return fix(value)


def load_lines(report: dict) -> list[str]:
    """The report's line on the load beside the run (``bench --load``), if it says.

    >>> load_lines({"load": {"description": "2 busy-loop processes", "cores_used": 1.93, "wall_s": 60.0}})
    ['- load beside the run: 2 busy-loop processes (1.93 cores used on average over 60 s)']
    """
    ld = report.get("load")
    if not ld:
        return []
    used = f" ({ld['cores_used']:.2f} cores used on average over {ld['wall_s']:.0f} s)" if "cores_used" in ld else ""
    return [f"- load beside the run: {ld['description']}{used}"]


def build_report(cfg: BenchConfig, res: RunSettings, out: Outcome, *, summary: dict, reference: str, machine: dict,
                 t_start: float, file_type: str | None, gpu_offload: bool) -> dict:
    """The JSON-serialisable report of a run: settings, costs, skipped runs and errors, the summary rows, the
    equality check against ``reference`` and every run (without its tokens)."""
    errors = [{"engine": r.engine, "mode": r.mode, "prompt_id": r.prompt_id, "repeat": r.repeat, "error": r.error}
              for r in out.results if r.error]
    return {
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": portable_paths(cfg.command),
        "duration_s": round(time.time() - t_start, 1),
        "machine": machine,
        "settings": {
            "pair": cfg.pair, "target": cfg.target_name or portable_paths(cfg.target),
            "draft": cfg.draft_name or portable_paths(cfg.draft),
            "target_path": portable_paths(cfg.target), "draft_path": portable_paths(cfg.draft), "target_file_type": file_type,
            "modes": [m.name for m in cfg.modes], "engines": list(cfg.engines),
            "prompts": cfg.prompts_file or "shipped (llamaspec/bench/prompts.jsonl)", "n_prompts": len(cfg.prompts),
            "prompt_tokens": {p.id: len(p.tokens) for p in out.prompts},
            "n_predict": cfg.n_predict, "repeats": cfg.repeats, "n_ctx": cfg.n_ctx, "n_batch": cfg.n_batch,
            "threads": res.threads, "threads_batch": res.threads_batch, "threads_draft": res.threads_draft,
            "n_gpu_layers": cfg.n_gpu_layers, "n_gpu_layers_draft": res.n_gpu_layers_draft, "main_gpu": cfg.main_gpu,
            "split_mode": cfg.split_mode, "tensor_split": list(cfg.tensor_split) if cfg.tensor_split else None,
            "rpc_servers": list(cfg.rpc_servers or []), "rpc_servers_draft": list(cfg.rpc_servers_draft or []),
            "gpu_offload_supported": gpu_offload, "flash_attn": cfg.flash_attn, "kv_cache": "f16", "sampling": "greedy (temp 0)",
            "seed": cfg.seed, "warmup": cfg.warmup, "quick": cfg.quick,
            "draft_n_max": cfg.spec.draft.n_max, "draft_n_min": cfg.spec.draft.n_min,
            "ngram_mod": vars(cfg.spec.ngram_mod).copy(), "ngram_simple": vars(cfg.spec.ngram_simple).copy(),
            "ngram_map_k": vars(cfg.spec.ngram_map_k).copy(), "near_tie_tol": cfg.near_tie_tol,
            "schedule": "per prompt, every configuration back to back; order reversed on odd repeats (A B C, C B A)",
        },
        "native_commands": portable_paths(out.commands),
        "costs": out.costs,
        "notes": out.plan.notes,
        "skipped": out.plan.skipped,
        "errors": errors,
        **summary,
        "equality": {"reference": reference, "n_compared": out.n_checked, "divergences": out.divergences,
                     "stats_parity": out.parity},
        "runs": [r.to_dict(with_tokens=False) for r in out.results],
    }


def write_json(report: dict, path: str | os.PathLike) -> None:
    write_atomic(path, json.dumps(report, indent=1, sort_keys=False, default=str) + "\n")  # str: unexpected types


# -------------------------------------------------------------------------------------------------
# formatting helpers
# -------------------------------------------------------------------------------------------------


def f_num(v, digits: int = 1, suffix: str = "") -> str:
    """
    >>> f_num(12.345), f_num(None), f_num(0.5, 2, "x")
    ('12.3', '–', '0.50x')
    """
    return "–" if v is None else f"{v:.{digits}f}{suffix}"


def f_pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def f_pos(v, n: int = 4) -> str:
    """
    >>> f_pos([0.9, 0.81, 0.7, 0.6, 0.5])
    '0.90 0.81 0.70 0.60 …'
    >>> f_pos(None)
    '–'
    """
    if not v:
        return "–"
    s = " ".join(f"{x:.2f}" for x in v[:n])
    return s + (" …" if len(v) > n else "")


def row_cells(row: dict) -> dict[str, str]:
    """The display cells of one aggregate row (shared by markdown and the rich table)."""
    tps = row["decode_tps"]
    spec = row.get("spec") or {}
    return {
        "engine": row["engine"],
        "mode": row["mode"],
        "tool": row.get("tool") or "",
        "tok/s": f_num(tps["median"]),
        "min–max": f"{f_num(tps['min'])}–{f_num(tps['max'])}" if tps["median"] is not None else "–",
        "prompt ms": f_num(row.get("prompt_ms_median"), 0),
        "acc rate": f_pct(spec.get("acceptance_rate")) if spec else "–",
        "mean len": f_num(spec.get("mean_accepted_length"), 2) if spec else "–",
        "a": f_num(row.get("per_token_acceptance"), 2),
        "acc/pos": f_pos(spec.get("accepted_per_pos")) if spec else "–",
        "speedup": f_num(row.get("speedup"), 2, "x"),
        "ls/native": f_num(row.get("ratio_llamaspec_native"), 2),
        "predicted": f_num(row.get("predicted_speedup"), 2, "x"),
        "efficiency": f_pct(row.get("efficiency")),
    }


COLUMNS = ["engine", "mode", "tool", "tok/s", "min–max", "prompt ms", "acc rate", "mean len", "a", "acc/pos",
           "speedup", "ls/native", "predicted", "efficiency"]


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def esc(x: str) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# -------------------------------------------------------------------------------------------------
# markdown
# -------------------------------------------------------------------------------------------------


def headline(report: dict) -> list[str]:
    """One-line answers: speedups per engine and mode, llamaspec/native ratios."""
    lines = []
    rows = report["rows"]
    for r in rows:
        if r["mode"] == "plain" or r.get("speedup") is None:
            continue
        s = f"{r['engine']} {r['mode']}: {f_num(r['decode_tps']['median'])} tok/s, {f_num(r['speedup'], 2)}x over plain"
        if r.get("ratio_llamaspec_native") is not None:
            s += f", {f_num(r['ratio_llamaspec_native'], 2)} of native"
        if r.get("ratio_llamaspec_native_server") is not None:
            s += f" ({f_num(r['ratio_llamaspec_native_server'], 2)} of native-server)"
        if r.get("spec"):
            s += f", acceptance {f_pct(r['spec'].get('acceptance_rate'))}"
        lines.append(s)
    plain = {r["engine"]: r for r in rows if r["mode"] == "plain"}
    if "llamaspec" in plain and "native" in plain and plain["llamaspec"].get("ratio_llamaspec_native"):
        lines.insert(0, f"plain: llamaspec {f_num(plain['llamaspec']['decode_tps']['median'])} tok/s = "
                        f"{f_num(plain['llamaspec']['ratio_llamaspec_native'], 2)} of native "
                        f"({f_num(plain['native']['decode_tps']['median'])} tok/s)")
    return lines


def render_markdown(report: dict) -> str:
    s = report["settings"]
    out: list[str] = []
    title = f"{s['target']}" + (f" + draft {s['draft']}" if s.get("draft") else "")
    out.append(f"# Benchmark: {title}\n")
    m = report.get("machine", {})
    out.append(f"- date: {report.get('created', '')}, duration {report.get('duration_s', '–')} s")
    out.append(f"- machine: {m.get('cpu', '?')}, {m.get('n_cpus_available', '?')} CPUs available, "
               f"load average at start {', '.join(f'{x:.2f}' for x in (m.get('loadavg_at_start') or []))}"
               + (f", at end {', '.join(f'{x:.2f}' for x in m['loadavg_at_end'])}" if m.get("loadavg_at_end") else ""))
    out.extend(load_lines(report))
    if report.get("command"):
        out.append(f"- command: `{report['command']}`")
    out.append(f"- {s['n_prompts']} prompts ({s['prompts']}), {s['n_predict']} tokens each, {s['repeats']} repeat(s); "
               f"context {s['n_ctx']}, batch {s['n_batch']}, {s['threads']} threads, flash attention "
               f"{'on' if s['flash_attn'] else 'off'}, KV {s['kv_cache']}, {s['sampling']}; draft n_max {s['draft_n_max']}; "
               f"ngram-mod n_match/n_min/n_max {s['ngram_mod']['n_match']}/{s['ngram_mod']['n_min']}/{s['ngram_mod']['n_max']}; "
               f"ngram-simple / map-k size_n/size_m {s['ngram_simple']['size_n']}/{s['ngram_simple']['size_m']}")
    out.append(f"- run order: {s['schedule']}")
    out.append("")
    hl = headline(report)
    if hl:
        out.append("## Headline\n")
        out += [f"- {x}" for x in hl]
        out.append("")
    out.append("## Decode speed and acceptance\n")
    out.append(_md_table(COLUMNS, [[row_cells(r)[c] for c in COLUMNS] for r in report["rows"]]))
    out.append("")
    if any(m.endswith(" cold") for m in row_modes(report)):
        out.append("**cold / warm**: ngram-mod keeps its n-gram pool across requests (llama-server does the same), so "
                   "after the first repeat it has already seen each prompt and its continuation and drafts it whole. "
                   "*cold* = first repeat only (the pool holds the earlier prompts of the run, not this one: what a "
                   "new prompt sees); *warm* = later repeats (the same prompt again). Read the cold row for new "
                   "prompts.\n")
    out.append("tok/s: decode tokens per second, median over repeats of each repeat's total over all prompts (min–max "
               "across repeats); prompt ms: median prompt time per prompt; acc rate = accepted / drafted; mean len = 1 + "
               "accepted / verification steps; a = per-token acceptance that reproduces the mean length for the mean "
               "draft length k; acc/pos = share of steps accepting at least i+1 drafts; speedup over plain of the same "
               "engine; ls/native = llamaspec tok/s / native tok/s for the same mode; predicted = (1 - a^(k+1)) / "
               "((1 - a)(k c + v)) (rounds without a draft count as plain steps); efficiency = speedup / predicted.\n")
    # categories
    cats = [c for c in CATEGORIES if any(x["category"] == c for x in report["per_category"])]
    cats += sorted({x["category"] for x in report["per_category"]} - set(cats))
    if cats:
        out.append("## Decode tokens/s by prompt category (median over repeats)\n")
        out.append(_category_table(report, report["per_category"], cats, lambda x: f_num(x["decode_tps_median"])))
        out.append("")
        model = [x for x in report.get("per_category_model", []) if x.get("predicted_speedup")]
        if model:
            out.append("## Speedup against the model by prompt category\n")
            out.append(_category_table(report, model, cats, lambda x: (
                f"{f_num(x['speedup'], 2, 'x')} / {f_num(x['predicted_speedup'], 2, 'x')} "
                f"(a {f_num(x['per_token_acceptance'], 2)}, k {f_num(x['mean_draft_length'], 1)})")))
            out.append("\nachieved speedup over plain / the model's prediction (1 - a^(k+1)) / ((1 - a)(k c + v(k))) from that "
                       "kind's measured per-token acceptance a and mean draft length k, the measured draft cost c (the "
                       "trimmed draft's for default:TYPES) and verify cost v; `default` (auto) counts every draft as "
                       "free (c = 0: n-gram and draft-model drafts are not split here), an upper bound.\n")
    # equality
    eq = report["equality"]
    out.append("## Token equality\n")
    out.append(f"Reference: {eq['reference']} (repeat 1). Compared {eq['n_compared']} greedy outputs (synthetic-acceptance "
               f"modes excluded; llama-speculative-simple is compared by text).")
    if not eq["divergences"]:
        out.append("\nNo divergence: every compared output equals the reference (up to the shorter length).\n")
    else:
        out.append("")
        rows = []
        for d in eq["divergences"]:
            kind = "near-tie" if d.get("near_tie") else ("DIVERGENCE" if "near_tie" in d else "?")
            rows.append([d["engine"], d["mode"], d["prompt_id"], str(d["index"]), kind,
                         f_num(d.get("ref_other_gap", d.get("top2_gap")), 3), repr(d.get("ref_piece", "")),
                         repr(d.get("other_piece", "")) if d.get("other_piece") is not None else "(text)",
                         ",".join(str(r + 1) for r in d["repeats"])])
        out.append(_md_table(["engine", "mode", "prompt", "first index", "kind", "logit gap", "reference token",
                              "other token", "repeats"], rows))
        out.append("\nA near-tie is a divergence where both candidate tokens are within the tolerance "
                   f"({report['settings']['near_tie_tol']}) of the top logit when the shared prefix is teacher-forced "
                   "(batched and single-token decoding give slightly different logits).\n")
    if eq.get("stats_parity"):
        out.append("### Drafted / accepted / steps where the token streams are identical\n")
        rows = [[p["mode"], p["prompt_id"], f"{p['native_engine']} ({p['native_tool']})", "/".join(map(str, p["llamaspec"])),
                 "/".join("–" if x is None else str(x) for x in p["native"]), "yes" if p["match"] else "NO"]
                for p in eq["stats_parity"]]
        n_ok = sum(1 for p in eq["stats_parity"] if p["match"])
        out.append(f"{n_ok} of {len(eq['stats_parity'])} identical.\n")
        out.append(_md_table(["mode", "prompt", "native", "llamaspec drafted/accepted/steps", "native", "same"], rows))
        out.append("")
    # costs
    c = report.get("costs")
    if c:
        out.append("## Cost model inputs\n")
        curve = c["verify_curve_ms"]
        out.append(_md_table(["rows verified"] + list(curve), [["target ms"] + [f_num(v, 2) for v in curve.values()],
                                                             ["relative to 1"] + [f_num(v, 2) for v in c["verify_cost_rel"].values()]]))
        if c.get("cost_ratio") is not None:
            out.append(f"\nDraft/target cost c = {c['draft_ms_1']:.2f} ms / {c['target_ms_1']:.2f} ms = {c['cost_ratio']:.3f} "
                       "(one-token decode with logits, probe.measure_verify_curve).")
            rec = ", ".join(f"a={x['acceptance']}: n_max {x['n_max']} ({x['expected_speedup']}x)" for x in c["recommended_draft_n_max"])
            out.append(f"Draft length the model recommends: {rec}.")
        out.append("")
    if report.get("native_commands"):
        out.append("## Native commands\n")
        for k, v in report["native_commands"].items():
            out.append(f"- {k}: `{v}`")
        out.append("")
    errs = report.get("errors", [])
    extra = ([f"- {n}" for n in report.get("notes", [])]
             + [f"- skipped {sk['engine']} / {sk['mode']}: {sk['reason']}" for sk in report.get("skipped", [])]
             + [f"- error {e['engine']} / {e['mode']} / {e['prompt_id']} (repeat {e['repeat'] + 1}): {e['error']}"
                for e in errs[:20]])
    if len(errs) > 20:
        extra.append(f"- … {len(errs) - 20} more errors in the JSON")
    if extra:
        out.append("## Notes\n")
        out += extra
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def row_modes(report: dict) -> list[str]:
    return report.get("row_modes") or report["settings"]["modes"]


def _category_table(report: dict, items: list[dict], cats: list[str], cell: Callable[[dict], str]) -> str:
    """One row per engine / mode (report order), one column per prompt category: ``cell(item)``, or – for none."""
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for x in items:
        by.setdefault((x["engine"], x["mode"]), {})[x["category"]] = x
    rows = [[f"{e} / {mo}"] + [cell(v[c]) if c in v else "–" for c in cats]
            for (e, mo), v in sorted(by.items(), key=lambda kv: _row_order(report, kv[0]))]
    return _md_table(["engine / mode"] + cats, rows)


def _row_order(report: dict, key: tuple[str, str]) -> tuple[int, int]:
    modes = row_modes(report)
    engines = report["settings"]["engines"]
    e, m = key
    return (modes.index(m) if m in modes else 99, engines.index(e) if e in engines else 99)


# -------------------------------------------------------------------------------------------------
# rich table
# -------------------------------------------------------------------------------------------------


RICH_COLUMNS = ["engine", "mode", "tok/s", "min–max", "acc rate", "mean len", "speedup", "ls/native", "predicted", "efficiency"]


def rich_table(report: dict):
    from rich.table import Table

    t = Table(title="decode tokens/s and acceptance (median over repeats)", title_justify="left")
    for c in RICH_COLUMNS:
        t.add_column(c, justify="left" if c in ("engine", "mode") else "right", no_wrap=True)
    last_mode = None
    for r in report["rows"]:
        cells = row_cells(r)
        if last_mode is not None and r["mode"] != last_mode:
            t.add_section()
        last_mode = r["mode"]
        t.add_row(*[cells[c] for c in RICH_COLUMNS])
    return t


# -------------------------------------------------------------------------------------------------
# plot
# -------------------------------------------------------------------------------------------------


def require_matplotlib() -> None:
    """UsageError (one line) unless matplotlib, an optional dependency, can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("PNG plots need matplotlib: install llamaspec[plot] (pip install 'llamaspec[plot]')") from None


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display), or a UsageError as :func:`require_matplotlib`."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | os.PathLike) -> None:
    """``fig`` laid out and written as a PNG (atomically), then closed."""
    import io

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    pyplot().close(fig)
    write_atomic(path, buf.getvalue())


def plot_png(report: dict, path: str | os.PathLike) -> None:
    """Speedup over plain by mode and engine (left) and decode tokens/s with min–max whiskers (right)."""
    plt = pyplot()
    rows = report["rows"]
    engines = [e for e in report["settings"]["engines"] if any(r["engine"] == e for r in rows)]
    modes = [m for m in row_modes(report) if any(r["mode"] == m for r in rows)]
    by = {(r["engine"], r["mode"]): r for r in rows}
    colors = {"llamaspec": "#1f77b4", "native": "#ff7f0e", "native-server": "#d62728", "llama-cpp-python": "#2ca02c"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.15]})

    def bars(ax, mode_list, value: Callable, err: Callable | None, fmt: str):
        """Per mode, the bars of the engines that ran it, side by side and centred on the tick."""
        seen: set[str] = set()
        for i, m in enumerate(mode_list):
            present = [(e, by[(e, m)]) for e in engines if (e, m) in by and value(by[(e, m)]) is not None]
            w = 0.8 / max(1, len(present))
            for j, (e, r) in enumerate(present):
                v = value(r)
                x = i + (j - (len(present) - 1) / 2) * w
                yerr = None
                if err:
                    a, b = err(r)
                    yerr = [[max(0.0, v - a)], [max(0.0, b - v)]]
                ax.bar([x], [v], w * 0.92, color=colors.get(e), yerr=yerr, capsize=2, label=None if e in seen else e)
                seen.add(e)
                ax.annotate(fmt.format(v), (x, v), ha="center", va="bottom", fontsize=6.5, xytext=(0, 2),
                            textcoords="offset points")
        ax.set_xticks(range(len(mode_list)))
        ax.set_xticklabels(mode_list, rotation=20, ha="right", fontsize=8)

    spec_modes = [m for m in modes if m != "plain"]
    bars(ax1, spec_modes, lambda r: r.get("speedup"), None, "{:.2f}")
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_ylabel("speedup over plain (same engine)")
    ax1.set_title("speedup by mode and engine")
    ax1.legend(fontsize=8)
    bars(ax2, modes, lambda r: r["decode_tps"]["median"], lambda r: (r["decode_tps"]["min"], r["decode_tps"]["max"]), "{:.1f}")
    ax2.set_ylabel("decode tokens/s (median, min–max)")
    ax2.set_title("decode speed")
    s = report["settings"]
    fig.suptitle(f"{s['target']}" + (f" + {s['draft']}" if s.get("draft") else "") +
                 f" — {s['n_prompts']} prompts x {s['n_predict']} tokens, {s['repeats']} repeat(s), {s['threads']} threads",
                 fontsize=10)
    save_png(fig, path)
