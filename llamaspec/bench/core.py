"""The benchmark run, step by step: load the models, measure the costs, plan and start the configurations
(engine x mode), warm up, run the interleaved schedule, check the outputs, summarise, and build the report.

The steps live in :mod:`.config` (the settings), :mod:`.measure` (machine, costs), :mod:`.execute` (models,
runners, schedule), :mod:`.analysis` (output checks, summaries) and :mod:`.report` (the report dictionary);
their public names are also importable from here.
"""
from __future__ import annotations

import tempfile
import time

from .._llama.model import supports_gpu_offload
from .analysis import check_outputs, is_stateful, resummarise, split_stateful, summarise
from .config import BenchConfig, Progress, Resolved, no_progress, reference_name, trimmed_draft_for
from .execute import (Models, Outcome, add_runners, check_fit, close_runners, native_commands, plan_configs, remove_log_dir,
                      run_schedule, start_engines, stop_native, warm_up)
from .measure import VERIFY_SIZES, add_loadavg_at_end, file_type, machine_info, measure_costs
from .report import SCHEMA_VERSION, build_report
from .runners import Runner, prepare_prompts

__all__ = ["SCHEMA_VERSION", "VERIFY_SIZES", "BenchConfig", "Progress", "is_stateful", "measure_costs", "resummarise",
           "run_benchmark", "split_stateful", "summarise"]


def run_benchmark(cfg: BenchConfig, progress: Progress = no_progress) -> dict:
    """Run everything ``cfg`` asks for and return the report dictionary (JSON-serialisable)."""
    cfg.validate()
    res = Resolved.of(cfg)
    t_start = time.time()
    machine = machine_info()
    progress("phase", text="loading models")
    models = Models.load(cfg, res)
    out = _execute(cfg, res, models, progress)  # closes the models
    summary = summarise(out.results, cfg.modes, cfg.engines, out.costs)
    add_loadavg_at_end(machine)
    return build_report(cfg, res, out, summary=summary, reference=reference_name(cfg), machine=machine, t_start=t_start,
                        file_type=file_type(cfg.target), gpu_offload=supports_gpu_offload())


def _execute(cfg: BenchConfig, res: Resolved, models: Models, progress: Progress) -> Outcome:
    """Everything that needs the loaded models: costs, runs and output checks; closes runners and models."""
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
        add_runners(runners, cfg, models, res.run_settings(cfg), log_dir)
        plan = plan_configs(cfg, runners)

        progress("phase", text="starting engines and servers")
        start_engines(runners, plan)
        if cfg.warmup and plan.configs:
            progress("phase", text="warm-up (not recorded)")
            warm_up(runners, plan.configs, prompts[0], min(8, cfg.n_predict))
        results = run_schedule(cfg, runners, plan.configs, prompts, progress)
        commands = native_commands(runners)
        stop_native(runners)

        progress("phase", text="checking token equality")
        divergences, n_checked, parity = check_outputs(cfg, results, prompts, models.target, res.threads)
    finally:
        close_runners(runners)
        models.close()
        remove_log_dir(log_dir)
    return Outcome(prompts, costs, plan, results, commands, divergences, n_checked, parity)
