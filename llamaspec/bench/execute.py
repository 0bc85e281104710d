"""The benchmark run, step by step (:func:`run_benchmark`): the machine and the models, the costs, one runner
per engine, which (engine, mode) configurations run (the support matrix), starting them, the warm-up, the
interleaved schedule of recorded runs, the output checks (:mod:`.analysis`) and the report (:mod:`.report`)."""
from __future__ import annotations

import logging
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .. import _llama as llama
from .._llama.model import supports_gpu_offload
from ..errors import UsageError
from .analysis import check_outputs, summarise
from .config import BenchConfig, Outcome, Plan, Progress, no_progress, reference_name, trimmed_draft_for
from .modes import Mode
from .report import build_report
from .runners import (BenchPrompt, LlamaCppPythonRunner, LlamaspecRunner, NativeRunner, Runner, RunSettings,
                      prepare_prompts)
from .stats import RunResult, schedule

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)

log = logging.getLogger("llamaspec")


def run_benchmark(cfg: BenchConfig, progress: Progress = no_progress) -> dict:
    """Run everything ``cfg`` asks for and return the report dictionary (JSON-serialisable)."""
    cfg.validate()
    res = cfg.settings()
    t_start = time.time()
    machine = machine_info()
    progress("phase", text="loading models")
    models = Models.load(cfg, res)
    runners: dict[str, Runner] = {}
    costs: dict | None = None
    log_dir = tempfile.mkdtemp(prefix="llamaspec-bench-")
    try:
        prompts = prepare_prompts(models.target, cfg.prompts)
        check_fit(cfg, prompts)
        if cfg.measure_costs:
            progress("phase", text="measuring verify-cost curve and draft/target cost")
            costs = measure_costs(models.target, models.draft, res.threads, threads_batch=res.threads_batch,
                                  threads_draft=res.threads_draft, draft_trimmed=trimmed_draft_for(cfg))
        add_runners(runners, cfg, models, res, log_dir)
        plan = plan_configs(cfg, runners)

        progress("phase", text="starting engines and servers")
        start_engines(runners, plan)
        if cfg.warmup and plan.configs:
            progress("phase", text="warm-up (not recorded)")
            warm_up(runners, plan.configs, prompts[0], min(8, cfg.n_predict))
        results = run_schedule(cfg, runners, plan.configs, prompts, progress)
        native = {e: r for e, r in runners.items() if isinstance(r, NativeRunner)}
        commands = {f"{e}/{m}": shlex.join(c) for e, r in native.items() for m, c in r.commands.items()}
        for r in native.values():
            r.close()  # stop servers before the analysis

        progress("phase", text="checking token equality")
        divergences, n_checked, parity = check_outputs(cfg, results, prompts, models.target, res.threads)
    finally:
        for name, r in runners.items():
            try:
                r.close()
            except Exception as ex:  # pragma: no cover
                log.warning("bench: closing the %s runner failed (skipped): %s", name, ex)
        models.close()
        try:
            os.rmdir(log_dir)
        except OSError:
            pass
    summary = summarise(results, cfg.modes, cfg.engines, costs)
    try:
        machine["loadavg_at_end"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    out = Outcome(prompts, costs, plan, results, commands, divergences, n_checked, parity)
    return build_report(cfg, res, out, summary=summary, reference=reference_name(cfg), machine=machine, t_start=t_start,
                        file_type=file_type(cfg.target), gpu_offload=supports_gpu_offload())


def machine_info() -> dict:
    """CPU model, cores available, platform, Python version and the load average at the start."""
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


def file_type(path: str) -> str | None:
    """The GGUF's ``general.file_type`` (its quantisation), or None where it cannot be read."""
    out = None
    try:
        with llama.Model(path, vocab_only=True) as vm:
            out = vm.meta("general.file_type")
    except Exception as ex:  # pragma: no cover - the report says None
        log.warning("bench: could not read general.file_type of %s (the report gives none): %s", path, ex)
    return out


def measure_costs(target: llama.Model, draft: llama.Model | None, threads: int, *, threads_batch: int | None = None,
                  threads_draft: int | None = None, draft_trimmed: str | None = None) -> dict:
    """Target verify-cost curve and draft/target cost ratio (§6 probe; ms of one decode with logits);
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


@dataclass
class Models:
    """The target and the draft, loaded once for the llamaspec runner, the cost measures and the output checks."""

    target: llama.Model
    draft: llama.Model | None

    @classmethod
    def load(cls, cfg: BenchConfig, res: RunSettings) -> Models:
        target = llama.Model(cfg.target, n_gpu_layers=cfg.n_gpu_layers, rpc_servers=cfg.rpc_servers, **res.placement)
        draft = (llama.Model(cfg.draft, n_gpu_layers=res.n_gpu_layers_draft, rpc_servers=cfg.rpc_servers_draft,
                             **res.placement) if cfg.draft else None)
        return cls(target, draft)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.target.close()


def check_fit(cfg: BenchConfig, prompts: Sequence[BenchPrompt]) -> None:
    """Every prompt fits the batch, and with ``-n`` generated tokens the context."""
    too_long = [p.id for p in prompts if len(p.tokens) + cfg.n_predict + 2 > cfg.n_ctx or len(p.tokens) > cfg.n_batch]
    if too_long:
        raise UsageError(f"prompt(s) {', '.join(too_long)} do not fit: prompt + -n must fit -c {cfg.n_ctx} and the "
                         f"prompt must fit -b {cfg.n_batch}; raise them or lower -n")


def add_runners(runners: dict[str, Runner], cfg: BenchConfig, models: Models, settings: RunSettings, log_dir: str) -> None:
    """One runner per engine of ``cfg``, added to ``runners`` as it is made (so the caller closes what was made)."""
    for e in cfg.engines:
        if e == "llamaspec":
            runners[e] = LlamaspecRunner(models.target, models.draft, settings)
        elif e in ("native", "native-server"):
            runners[e] = NativeRunner(cfg.target, cfg.draft, settings, native_dir=cfg.native_dir,
                                      force_server=(e == "native-server"), log_dir=log_dir)
        elif e == "llama-cpp-python":
            runners[e] = LlamaCppPythonRunner(cfg.target, settings)


def plan_configs(cfg: BenchConfig, runners: dict[str, Runner]) -> Plan:
    """The support matrix: every mode on every engine that runs it (native-server is left out where it would
    repeat native's llama-server run)."""
    plan = Plan()
    for m in cfg.modes:
        for e in cfg.engines:
            why = runners[e].supports(m)
            if why is None and e == "native-server" and "native" in runners and runners["native"].supports(m) is None \
                    and runners["native"].tool(m) == runners[e].tool(m):
                why = "same run as native (llama-server)"
            if why is None:
                plan.configs.append((e, m))
            else:
                plan.skipped.append({"engine": e, "mode": m.name, "reason": why})
    for e in cfg.engines:
        reasons = {s["reason"] for s in plan.skipped if s["engine"] == e}
        if e.startswith("native") and any("not built" in r for r in reasons):
            plan.notes.append(f"{e}: " + "; ".join(sorted(r for r in reasons if "not built" in r)) + " — its runs were skipped")
    if not plan.configs:
        raise UsageError("no engine supports any requested mode: " + "; ".join(f"{s['engine']}/{s['mode']}: {s['reason']}"
                                                                              for s in plan.skipped))
    return plan


def start_engines(runners: dict[str, Runner], plan: Plan) -> None:
    """Prepare every configuration (load engines, start servers); one that fails is skipped with a note."""
    for e, m in list(plan.configs):
        try:
            runners[e].prepare(m)
        except Exception as ex:  # a server that does not start is reported, not fatal
            plan.configs.remove((e, m))
            plan.skipped.append({"engine": e, "mode": m.name, "reason": f"failed to start: {ex}"})
            plan.notes.append(f"{e}/{m.name} failed to start: {ex}")


def warm_up(runners: dict[str, Runner], configs: Sequence[tuple[str, Mode]], prompt: BenchPrompt, n_predict: int) -> None:
    """One short unrecorded run per configuration."""
    for e, m in configs:
        try:
            runners[e].run(m, prompt, n_predict, -1)
        except Exception as ex:  # the real runs will report it
            log.warning("bench: warm-up of %s/%s failed (skipped; the recorded runs report it): %s", e, m.name, ex)


def run_schedule(cfg: BenchConfig, runners: dict[str, Runner], configs: Sequence[tuple[str, Mode]],
                 prompts: Sequence[BenchPrompt], progress: Progress) -> list[RunResult]:
    """Every configuration on every prompt, ``cfg.repeats`` times, interleaved (:func:`.stats.schedule`); a run
    that raises is recorded with its error."""
    results: list[RunResult] = []
    order = schedule(cfg.repeats, len(prompts), len(configs))
    progress("start", total=len(order))
    for i, (rep, pi, ci) in enumerate(order):
        e, m = configs[ci]
        p = prompts[pi]
        progress("run", done=i, total=len(order), label=f"r{rep + 1} {p.id} {e} {m.name}")
        try:
            res = runners[e].run(m, p, cfg.n_predict, rep)
        except Exception as ex:
            res = RunResult(engine=e, mode=m.name, prompt_id=p.id, category=p.category, repeat=rep,
                            tool=runners[e].tool(m), error=f"{type(ex).__name__}: {ex}")
        results.append(res)
    progress("run", done=len(order), total=len(order), label="done")
    return results
