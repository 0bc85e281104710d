"""The benchmark run: configurations (engine x mode), interleaved schedule, analysis, report dictionary."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .. import _llama as llama
from .._llama.model import supports_gpu_offload
from ..errors import UsageError
from ..params import SpecParams
from .modes import Mode
from .prompts import Prompt
from .runners import (ENGINES, BenchPrompt, LlamaCppPythonRunner, LlamaspecRunner, NativeRunner, Runner, RunSettings,
                      prepare_prompts)
from .stats import RunResult, aggregate, first_divergence, per_group_tps, schedule

SCHEMA_VERSION = 1
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)

Progress = Callable[..., None]


@dataclass
class BenchConfig:
    target: str
    draft: str | None
    modes: list[Mode]
    engines: list[str]
    prompts: list[Prompt]
    n_predict: int = 128
    repeats: int = 3
    n_ctx: int = 1024
    n_batch: int = 512
    threads: int = 0  # 0 = all available cores
    threads_batch: int = 0  # 0 = same as threads
    threads_draft: int = 0  # 0 = same as threads
    n_gpu_layers: int = 0  # the bench's default: every engine on the CPU; -1 = all layers
    n_gpu_layers_draft: int | None = None  # None = same as n_gpu_layers
    main_gpu: int | None = None  # None = llama.cpp's default
    split_mode: str | None = None
    tensor_split: tuple[float, ...] | None = None
    rpc_servers: tuple[str, ...] | None = None  # --rpc: the target's layers on llama.cpp RPC servers
    rpc_servers_draft: tuple[str, ...] | None = None  # --rpc-draft (default: the draft stays local)
    flash_attn: bool = True
    seed: int = 42
    spec: SpecParams = field(default_factory=SpecParams)
    warmup: bool = True
    measure_costs: bool = True
    near_tie_tol: float = 0.5
    native_dir: str | None = None
    pair: str | None = None
    target_name: str | None = None
    draft_name: str | None = None
    prompts_file: str | None = None
    quick: bool = False
    command: str | None = None

    def validate(self) -> None:
        bad = [e for e in self.engines if e not in ENGINES]
        if bad:
            raise UsageError(f"unknown engine {bad[0]!r}; known: {', '.join(ENGINES)}")
        if not self.engines:
            raise UsageError("--engines is empty")
        if self.n_predict < 2:
            raise UsageError("-n must be >= 2 (decode speed needs at least two generated tokens)")
        if self.repeats < 1:
            raise UsageError("--repeats must be >= 1")
        if not self.prompts:
            raise UsageError("no prompts")
        others = [e for e in self.engines if e != "llamaspec"]
        if (self.rpc_servers or self.rpc_servers_draft) and others:
            raise UsageError(f"--rpc / --rpc-draft work with --engines llamaspec only (not {', '.join(others)}): "
                             "ggml-rpc-server serves one client at a time and this process holds the connection")


def _nop(*_a, **_k) -> None:
    pass


def _machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover
        pass
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    return {"cpu": cpu, "n_cpus_available": llama.default_threads(), "platform": platform.platform(),
            "python": sys.version.split()[0], "loadavg_at_start": load}


def measure_costs(target: llama.Model, draft: llama.Model | None, threads: int, *, threads_batch: int | None = None,
                  threads_draft: int | None = None, draft_trimmed: str | None = None) -> dict:
    """Target verify-cost curve and draft/target cost ratio (spec §6 probe; ms of one decode with logits);
    with ``draft_trimmed`` (the trimmed copy the ``default`` modes draft with) its cost ratio too."""
    from ..probe import measure_verify_curve, recommend_draft_length

    curve = measure_verify_curve(target, sizes=VERIFY_SIZES, n_threads=threads, n_threads_batch=threads_batch)
    out: dict = {"verify_curve_ms": {str(k): round(v, 4) for k, v in curve.items()},
                 "verify_cost_rel": {str(k): round(v / curve[1], 4) for k, v in curve.items()}}
    if draft is not None:
        d = measure_verify_curve(draft, sizes=(1,), n_threads=threads_draft or threads, n_threads_batch=threads_batch)
        out["draft_ms_1"] = round(d[1], 4)
        out["target_ms_1"] = round(curve[1], 4)
        out["cost_ratio"] = d[1] / curve[1]
        if draft_trimmed is not None:
            tm = llama.Model(draft_trimmed, use_mmap=False)
            try:
                dt = measure_verify_curve(tm, sizes=(1,), n_threads=threads_draft or threads, n_threads_batch=threads_batch)
            finally:
                tm.close()
            out["draft_trimmed_ms_1"] = round(dt[1], 4)
            out["cost_ratio_trimmed"] = dt[1] / curve[1]
        out["recommended_draft_n_max"] = [
            {"acceptance": a, "n_max": k, "expected_speedup": round(s, 3)}
            for a in (0.6, 0.7, 0.8, 0.9)
            for k, s in [recommend_draft_length(a, out["cost_ratio"], curve)]
        ]
    return out


class _TieChecker:
    """Teacher-forces a shared prefix on the target and looks at the logits where two outputs part."""

    def __init__(self, model: llama.Model, cfg: BenchConfig, threads: int):
        self.ctx = llama.Context(model, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_threads=threads, flash_attn=cfg.flash_attn,
                             n_threads_batch=cfg.threads_batch or threads)
        self.model = model

    def check(self, prefix: Sequence[int], ref_tok: int, other_tok: int | None, tol: float) -> dict:
        import numpy as np

        self.ctx.memory.clear(True)
        self.ctx.decode_tokens(list(prefix), 0, 0)
        lg = np.array(self.ctx.logits(-1), dtype=np.float64)
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

    def close(self) -> None:
        self.ctx.close()


def _trim_eog(tokens: Sequence[int], vocab: llama.Vocab) -> list[int]:
    t = list(tokens)
    while t and vocab.is_eog(t[-1]):
        t.pop()
    return t


def _text_divergence(ref_tokens: Sequence[int], text: str, vocab: llama.Vocab) -> int | None:
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


def _trimmed_draft_for(cfg: BenchConfig) -> str | None:
    """The trimmed draft the ``default`` modes will load (llamaspec.models.trim; cached), or None."""
    if not cfg.draft or cfg.n_gpu_layers:
        return None
    for m in cfg.modes:
        if m.is_default and m.uses_draft:
            keep, asked = m.spec_params(cfg.spec).draft_trim()
            if keep:
                from ..models.trim import draft_path

                path, trimmed = draft_path(cfg.draft, keep, asked)
                return str(path) if trimmed else None
    return None


def run_benchmark(cfg: BenchConfig, progress: Progress = _nop) -> dict:
    """Run everything ``cfg`` asks for and return the report dictionary (JSON-serialisable)."""
    cfg.validate()
    threads = cfg.threads or llama.default_threads()
    threads_batch, threads_draft = cfg.threads_batch or threads, cfg.threads_draft or threads
    ngl_draft = cfg.n_gpu_layers if cfg.n_gpu_layers_draft is None else cfg.n_gpu_layers_draft
    placement = dict(main_gpu=cfg.main_gpu, split_mode=cfg.split_mode, tensor_split=cfg.tensor_split)
    t_start = time.time()
    notes: list[str] = []
    skipped: list[dict] = []
    machine = _machine()

    progress("phase", text="loading models")
    model = llama.Model(cfg.target, n_gpu_layers=cfg.n_gpu_layers, rpc_servers=cfg.rpc_servers, **placement)
    model_dft = (llama.Model(cfg.draft, n_gpu_layers=ngl_draft, rpc_servers=cfg.rpc_servers_draft, **placement)
                 if cfg.draft else None)
    runners: dict[str, Runner] = {}
    results: list[RunResult] = []
    costs: dict | None = None
    log_dir = tempfile.mkdtemp(prefix="llamaspec-bench-")
    try:
        bprompts = prepare_prompts(model, cfg.prompts)
        too_long = [p.id for p in bprompts if len(p.tokens) + cfg.n_predict + 2 > cfg.n_ctx or len(p.tokens) > cfg.n_batch]
        if too_long:
            raise UsageError(f"prompt(s) {', '.join(too_long)} do not fit: prompt + -n must fit -c {cfg.n_ctx} and the "
                             f"prompt must fit -b {cfg.n_batch}; raise them or lower -n")
        if cfg.measure_costs:
            progress("phase", text="measuring verify-cost curve and draft/target cost")
            costs = measure_costs(model, model_dft, threads, threads_batch=threads_batch, threads_draft=threads_draft,
                                  draft_trimmed=_trimmed_draft_for(cfg))

        settings = RunSettings(cfg.n_ctx, cfg.n_batch, threads, cfg.flash_attn, cfg.seed, cfg.spec,
                               threads_batch=threads_batch, threads_draft=threads_draft, n_gpu_layers=cfg.n_gpu_layers,
                               n_gpu_layers_draft=ngl_draft, **placement)
        for e in cfg.engines:
            if e == "llamaspec":
                runners[e] = LlamaspecRunner(model, model_dft, settings)
            elif e in ("native", "native-server"):
                runners[e] = NativeRunner(cfg.target, cfg.draft, settings, native_dir=cfg.native_dir,
                                          force_server=(e == "native-server"), log_dir=log_dir)
            elif e == "llama-cpp-python":
                runners[e] = LlamaCppPythonRunner(cfg.target, settings)

        configs: list[tuple[str, Mode]] = []
        for m in cfg.modes:
            for e in cfg.engines:
                why = runners[e].supports(m)
                if why is None and e == "native-server" and "native" in runners and runners["native"].supports(m) is None \
                        and runners["native"].tool(m) == runners[e].tool(m):
                    why = "same run as native (llama-server)"
                if why is None:
                    configs.append((e, m))
                else:
                    skipped.append({"engine": e, "mode": m.name, "reason": why})
        for e in cfg.engines:
            reasons = {s["reason"] for s in skipped if s["engine"] == e}
            if e.startswith("native") and any("not built" in r for r in reasons):
                notes.append(f"{e}: " + "; ".join(sorted(r for r in reasons if "not built" in r)) + " — its runs were skipped")
        if not configs:
            raise UsageError("no engine supports any requested mode: " + "; ".join(f"{s['engine']}/{s['mode']}: {s['reason']}" for s in skipped))

        progress("phase", text="starting engines and servers")
        for e, m in list(configs):
            try:
                runners[e].prepare(m)
            except Exception as ex:  # a server that does not start is reported, not fatal
                configs.remove((e, m))
                skipped.append({"engine": e, "mode": m.name, "reason": f"failed to start: {ex}"})
                notes.append(f"{e}/{m.name} failed to start: {ex}")

        if cfg.warmup and configs:
            progress("phase", text="warm-up (not recorded)")
            for e, m in configs:
                try:
                    runners[e].run(m, bprompts[0], min(8, cfg.n_predict), -1)
                except Exception:  # the real runs will report it
                    pass

        order = schedule(cfg.repeats, len(bprompts), len(configs))
        progress("start", total=len(order))
        for i, (rep, pi, ci) in enumerate(order):
            e, m = configs[ci]
            p = bprompts[pi]
            progress("run", done=i, total=len(order), label=f"r{rep + 1} {p.id} {e} {m.name}")
            try:
                res = runners[e].run(m, p, cfg.n_predict, rep)
            except Exception as ex:
                res = RunResult(engine=e, mode=m.name, prompt_id=p.id, category=p.category, repeat=rep,
                                tool=runners[e].tool(m), error=f"{type(ex).__name__}: {ex}")
            results.append(res)
        progress("run", done=len(order), total=len(order), label="done")

        commands = {f"{e}/{m}": " ".join(shlex.quote(x) for x in c)
                    for e, r in runners.items() if isinstance(r, NativeRunner) for m, c in r.commands.items()}
        for r in runners.values():
            if isinstance(r, NativeRunner):
                r.close()  # stop servers before the analysis

        progress("phase", text="checking token equality")
        divergences, n_checked, parity = _check_outputs(cfg, results, bprompts, model, threads)
    finally:
        for r in runners.values():
            try:
                r.close()
            except Exception:  # pragma: no cover
                pass
        model_dft_close = model_dft.close if model_dft is not None else None
        if model_dft_close:
            model_dft_close()
        model.close()
        try:
            os.rmdir(log_dir)
        except OSError:
            pass

    summary = summarise(results, cfg.modes, cfg.engines, costs)
    errors = [{"engine": r.engine, "mode": r.mode, "prompt_id": r.prompt_id, "repeat": r.repeat, "error": r.error}
              for r in results if r.error]
    try:
        machine["loadavg_at_end"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    file_type = None
    try:
        with llama.Model(cfg.target, vocab_only=True) as vm:
            file_type = vm.meta("general.file_type")
    except Exception:  # pragma: no cover
        pass
    return {
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "duration_s": round(time.time() - t_start, 1),
        "machine": machine,
        "settings": {
            "pair": cfg.pair, "target": cfg.target_name or cfg.target, "draft": cfg.draft_name or cfg.draft,
            "target_path": cfg.target, "draft_path": cfg.draft, "target_file_type": file_type,
            "modes": [m.name for m in cfg.modes], "engines": list(cfg.engines),
            "prompts": cfg.prompts_file or "shipped (llamaspec/bench/prompts.jsonl)", "n_prompts": len(cfg.prompts),
            "prompt_tokens": {p.id: len(p.tokens) for p in bprompts},
            "n_predict": cfg.n_predict, "repeats": cfg.repeats, "n_ctx": cfg.n_ctx, "n_batch": cfg.n_batch,
            "threads": threads, "threads_batch": threads_batch, "threads_draft": threads_draft,
            "n_gpu_layers": cfg.n_gpu_layers, "n_gpu_layers_draft": ngl_draft, "main_gpu": cfg.main_gpu,
            "split_mode": cfg.split_mode, "tensor_split": list(cfg.tensor_split) if cfg.tensor_split else None,
            "rpc_servers": list(cfg.rpc_servers or []), "rpc_servers_draft": list(cfg.rpc_servers_draft or []),
            "gpu_offload_supported": supports_gpu_offload(), "flash_attn": cfg.flash_attn, "kv_cache": "f16", "sampling": "greedy (temp 0)",
            "seed": cfg.seed, "warmup": cfg.warmup, "quick": cfg.quick,
            "draft_n_max": cfg.spec.draft.n_max, "draft_n_min": cfg.spec.draft.n_min,
            "ngram_mod": vars(cfg.spec.ngram_mod).copy(), "ngram_simple": vars(cfg.spec.ngram_simple).copy(),
            "ngram_map_k": vars(cfg.spec.ngram_map_k).copy(), "near_tie_tol": cfg.near_tie_tol,
            "schedule": "per prompt, every configuration back to back; order reversed on odd repeats (A B C, C B A)",
        },
        "native_commands": commands,
        "costs": costs,
        "notes": notes,
        "skipped": skipped,
        "errors": errors,
        **summary,
        "equality": {"reference": _reference_name(cfg), "n_compared": n_checked, "divergences": divergences,
                     "stats_parity": parity},
        "runs": [r.to_dict(with_tokens=False) for r in results],
    }


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
    import dataclasses

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
    import dataclasses

    from .modes import parse_modes

    names = {f.name for f in dataclasses.fields(RunResult)}
    results = [RunResult(**{k: v for k, v in d.items() if k in names}) for d in report["runs"]]
    modes = parse_modes(report["settings"]["modes"])
    out = dict(report)
    out.update(summarise(results, modes, report["settings"]["engines"], report.get("costs")))
    return out


def _reference_name(cfg: BenchConfig) -> str:
    for e in ("llamaspec", "native-server", "native", "llama-cpp-python"):
        if e in cfg.engines:
            return f"{e}/plain"
    return ""  # pragma: no cover


def _check_outputs(cfg: BenchConfig, results: list[RunResult], prompts: list[BenchPrompt], model: llama.Model,
                   threads: int) -> tuple[list[dict], int, list[dict]]:
    """Compare every greedy output with the reference (plain, repeat 0): first divergence per
    (engine, mode, prompt), classified as a near-tie or not; and drafted/accepted parity between
    llamaspec and native where the token streams are identical."""
    modes = {m.name: m for m in cfg.modes}
    vocab = model.vocab
    ref_engine = _reference_name(cfg).split("/")[0]
    ref: dict[str, list[int]] = {}
    for r in results:
        if r.engine == ref_engine and r.mode == "plain" and r.error is None and r.tokens is not None and r.prompt_id not in ref:
            ref[r.prompt_id] = _trim_eog(r.tokens, vocab)
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
            other = _trim_eog(r.tokens, vocab)
            idx = first_divergence(rt, other)
            if idx is not None and (idx >= len(rt) or idx >= len(other)):
                idx = None  # one stream is a prefix of the other: a length difference, not a divergence
            other_tok = other[idx] if idx is not None else None
        elif r.text is not None:
            idx = _text_divergence(rt, r.text, vocab)
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
        checker = _TieChecker(model, cfg, threads)
        try:
            for d in divs:
                prefix = list(ptoks[d["prompt_id"]]) + ref[d["prompt_id"]][: d["index"]]
                if len(prefix) >= cfg.n_ctx:
                    continue
                info = checker.check(prefix, d["ref_token"], d["other_token"], cfg.near_tie_tol)
                d.update({k: (round(v, 5) if isinstance(v, float) else v) for k, v in info.items()})
                d["ref_piece"] = vocab.token_to_piece(d["ref_token"], special=True).decode("utf-8", "replace")
                if d["other_token"] is not None:
                    d["other_piece"] = vocab.token_to_piece(d["other_token"], special=True).decode("utf-8", "replace")
        finally:
            checker.close()
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
