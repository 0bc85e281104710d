"""What the runs show: the greedy outputs checked against the reference (first divergence, near-tie or not,
drafted / accepted parity with native), and the summaries (rows, per-category and per-prompt medians)."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Sequence

from .. import _llama as llama
from .config import BenchConfig, reference_name
from .modes import Mode, parse_modes
from .runners import BenchPrompt
from .stats import RunResult, aggregate, first_divergence, per_group_tps


def tie_info(ctx: llama.Context, prefix: Sequence[int], ref_tok: int, other_tok: int | None, tol: float) -> dict:
    """Teacher-force the shared ``prefix`` on the target's ``ctx`` and look at the logits where two outputs part."""
    import numpy as np

    ctx.memory.clear(True)
    ctx.decode_tokens(list(prefix), 0, 0)
    lg = np.array(ctx.logits(-1), dtype=np.float64)
    order = np.argsort(-lg)
    top, second = float(lg[order[0]]), float(lg[order[1]])
    d = {"top_token": int(order[0]), "top2_gap": top - second, "ref_logit_gap": top - float(lg[ref_tok])}
    if other_tok is not None:
        d["other_logit_gap"] = top - float(lg[other_tok])
        d["ref_other_gap"] = abs(float(lg[ref_tok]) - float(lg[other_tok]))
        d["near_tie"] = bool(d["ref_other_gap"] <= tol and d["ref_logit_gap"] <= tol and d["other_logit_gap"] <= tol)
    else:
        d["near_tie"] = bool(d["top2_gap"] <= tol and d["ref_logit_gap"] <= tol)
    return d


def trim_eog(tokens: Sequence[int], vocab: llama.Vocab) -> list[int]:
    t = list(tokens)
    while t and vocab.is_eog(t[-1]):
        t.pop()
    return t


def text_divergence(ref_tokens: Sequence[int], text: str, vocab: llama.Vocab) -> int | None:
    """First token index where ``text`` departs from the pieces of ``ref_tokens`` (None: one is a prefix of
    the other)."""
    pieces = [vocab.token_to_piece(t, special=True) for t in ref_tokens]
    ref = b"".join(pieces)
    other = text.encode("utf-8")
    n = min(len(ref), len(other))
    ci = next((i for i in range(n) if ref[i] != other[i]), None)
    if ci is None:
        return None
    acc = 0
    for ti, p in enumerate(pieces):
        acc += len(p)
        if ci < acc:
            return ti
    return len(pieces)  # pragma: no cover


def check_outputs(cfg: BenchConfig, results: list[RunResult], prompts: list[BenchPrompt], model: llama.Model,
                  threads: int) -> tuple[list[dict], int, list[dict]]:
    """Compare every greedy output with the reference (plain, repeat 0): first divergence per
    (engine, mode, prompt), classified as a near-tie or not; and drafted/accepted parity between
    llamaspec and native where the token streams are identical."""
    modes = {m.name: m for m in cfg.modes}
    vocab = model.vocab
    ref_engine = reference_name(cfg).split("/")[0]
    ref: dict[str, list[int]] = {}
    for r in results:
        if r.engine == ref_engine and r.mode == "plain" and r.error is None and r.tokens is not None and r.prompt_id not in ref:
            ref[r.prompt_id] = trim_eog(r.tokens, vocab)
    ptoks = {p.id: p.tokens for p in prompts}
    found: dict[tuple, dict] = {}
    identical: dict[tuple, bool] = {}
    n_checked = 0
    for r in results:
        m = modes.get(r.mode)
        if r.error or m is None or not m.exact or r.prompt_id not in ref:
            continue
        if r.engine == ref_engine and r.mode == "plain" and r.repeat == 0:
            continue
        rt = ref[r.prompt_id]
        if r.tokens is not None:
            other = trim_eog(r.tokens, vocab)
            idx = first_divergence(rt, other)
            if idx is not None and (idx >= len(rt) or idx >= len(other)):
                idx = None  # one stream is a prefix of the other: a length difference, not a divergence
            other_tok = other[idx] if idx is not None else None
        elif r.text is not None:
            idx = text_divergence(rt, r.text, vocab)
            other_tok = None
        else:
            continue
        n_checked += 1
        key = (r.engine, r.mode, r.prompt_id)
        identical[(r.engine, r.mode, r.prompt_id, r.repeat)] = idx is None
        if idx is None:
            continue
        if key in found:
            found[key]["repeats"].append(r.repeat)
            continue
        found[key] = {"engine": r.engine, "mode": r.mode, "prompt_id": r.prompt_id, "index": idx, "repeats": [r.repeat],
                      "ref_token": rt[idx], "other_token": other_tok, "compared": "tokens" if r.tokens is not None else "text"}
    divs = list(found.values())
    if divs:
        with llama.Context(model, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_threads=threads, flash_attn=cfg.flash_attn,
                           n_threads_batch=cfg.threads_batch or threads) as ctx:
            for d in divs:
                prefix = list(ptoks[d["prompt_id"]]) + ref[d["prompt_id"]][: d["index"]]
                if len(prefix) >= cfg.n_ctx:
                    continue
                info = tie_info(ctx, prefix, d["ref_token"], d["other_token"], cfg.near_tie_tol)
                d.update({k: (round(v, 5) if isinstance(v, float) else v) for k, v in info.items()})
                d["ref_piece"] = vocab.token_to_piece(d["ref_token"], special=True).decode("utf-8", "replace")
                if d["other_token"] is not None:
                    d["other_piece"] = vocab.token_to_piece(d["other_token"], special=True).decode("utf-8", "replace")
    parity = []
    by = {(r.engine, r.mode, r.prompt_id): r for r in results if r.repeat == 0 and r.error is None}
    for (e, mode, pid), r in sorted(by.items()):
        if e != "llamaspec" or mode == "plain" or r.n_drafted is None:
            continue
        for ne in ("native", "native-server"):
            n = by.get((ne, mode, pid))
            if n is None or n.n_drafted is None:
                continue
            same = identical.get(("llamaspec", mode, pid, 0), False) and identical.get((ne, mode, pid, 0), False)
            if not same:
                continue
            parity.append({"mode": mode, "prompt_id": pid, "native_engine": ne, "native_tool": n.tool,
                           "llamaspec": [r.n_drafted, r.n_accepted, r.n_verif_steps],
                           "native": [n.n_drafted, n.n_accepted, n.n_verif_steps],
                           "match": (r.n_drafted, r.n_accepted, r.n_verif_steps) == (n.n_drafted, n.n_accepted, n.n_verif_steps)})
    return divs, n_checked, parity


def is_stateful(mode: Mode) -> bool:
    """ngram-mod keeps its n-gram pool across requests (llama-server does too): from the second repeat on it
    has seen the same prompt and continuation, so its first repeat ("cold") and later ones ("warm") are
    reported as separate rows."""
    return "ngram-mod" in mode.types


def split_stateful(results: Sequence[RunResult], modes: Sequence[Mode]) -> tuple[list[RunResult], list[str]]:
    """Relabel the runs of stateful modes ``MODE cold`` (repeat 1) / ``MODE warm`` (later repeats); return the
    runs and the row order of mode labels.

    >>> from llamaspec.bench.modes import parse_modes
    >>> rs = [RunResult("e", "ngram-mod", "p", "c", i) for i in range(3)] + [RunResult("e", "plain", "p", "c", 0)]
    >>> out, order = split_stateful(rs, parse_modes("plain,ngram-mod"))
    >>> [r.mode for r in out], order
    (['ngram-mod cold', 'ngram-mod warm', 'ngram-mod warm', 'plain'], ['plain', 'ngram-mod cold', 'ngram-mod warm'])
    """
    stateful = {m.name for m in modes if is_stateful(m)}
    repeats = {r.repeat for r in results}
    out = []
    for r in results:
        if r.mode in stateful:
            r = dataclasses.replace(r, mode=f"{r.mode} {'cold' if r.repeat == min(repeats) else 'warm'}")
        out.append(r)
    order: list[str] = []
    for m in modes:
        if m.name in stateful:
            order.append(f"{m.name} cold")
            if len(repeats) > 1:
                order.append(f"{m.name} warm")
        else:
            order.append(m.name)
    return out, order


def summarise(results: Sequence[RunResult], modes: Sequence[Mode], engines: Sequence[str], costs: dict | None) -> dict:
    """Rows (one per engine and mode label), per-category and per-prompt medians."""
    labelled, row_modes = split_stateful(results, modes)
    mode_order = {m: i for i, m in enumerate(row_modes)}
    eng_order = {e: i for i, e in enumerate(engines)}
    # native-server without its own plain run (deduplicated) is compared with native's llama-server plain run
    have = {(r.engine, r.mode) for r in results}
    reference = {"native-server": "native"} if ("native-server", "plain") not in have else {}
    model_kw = dict(cost_ratio=(costs or {}).get("cost_ratio"), cost_ratio_trimmed=(costs or {}).get("cost_ratio_trimmed"),
                    verify_curve=(costs or {}).get("verify_curve_ms"), reference=reference)
    rows = aggregate(labelled, **model_kw)
    # the speedup model per prompt kind: measured a and k of that kind's runs, the same c and v curve
    by_cat: dict[str, list[RunResult]] = defaultdict(list)
    for r in labelled:
        by_cat[r.category or "-"].append(r)
    per_cat_model = []
    for cat, rs in by_cat.items():
        for row in aggregate(rs, **model_kw):
            if row["mode"] != "plain" and row.get("speedup") is not None:
                per_cat_model.append({"engine": row["engine"], "mode": row["mode"], "category": cat,
                                      "speedup": row["speedup"], "per_token_acceptance": row["per_token_acceptance"],
                                      "mean_draft_length": (row["spec"] or {}).get("mean_draft_length"),
                                      "predicted_speedup": row["predicted_speedup"], "efficiency": row["efficiency"]})
    rows.sort(key=lambda r: (mode_order.get(r["mode"], 99), eng_order.get(r["engine"], 99)))
    cat_tps = per_group_tps(labelled, lambda r: (r.engine, r.mode, r.category))
    prompt_tps = per_group_tps(labelled, lambda r: (r.engine, r.mode, r.prompt_id))
    return {
        "row_modes": row_modes,
        "rows": rows,
        "per_category": [{"engine": k[0], "mode": k[1], "category": k[2], "decode_tps_median": v} for k, v in cat_tps.items()],
        "per_category_model": per_cat_model,
        "per_prompt": [{"engine": k[0], "mode": k[1], "prompt_id": k[2], "decode_tps_median": v} for k, v in prompt_tps.items()],
    }


def resummarise(report: dict) -> dict:
    """Recompute rows and medians of a saved report from its runs (after a change of the analysis)."""
    names = {f.name for f in dataclasses.fields(RunResult)}
    results = [RunResult(**{k: v for k, v in d.items() if k in names}) for d in report["runs"]]
    modes = parse_modes(report["settings"]["modes"])
    out = dict(report)
    out.update(summarise(results, modes, report["settings"]["engines"], report.get("costs")))
    return out
