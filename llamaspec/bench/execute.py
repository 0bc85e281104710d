"""The steps of a benchmark run: the models, one runner per engine, which (engine, mode) configurations run
(the support matrix), starting them, the warm-up, and the interleaved schedule of recorded runs."""
from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from typing import Sequence

from .. import _llama as llama
from ..errors import UsageError
from .config import BenchConfig, Progress, Resolved
from .modes import Mode
from .runners import BenchPrompt, LlamaCppPythonRunner, LlamaspecRunner, NativeRunner, Runner, RunSettings
from .stats import RunResult, schedule

log = logging.getLogger("llamaspec")


@dataclass
class Models:
    """The target and the draft, loaded once for the llamaspec runner, the cost measures and the output checks."""

    target: llama.Model
    draft: llama.Model | None

    @classmethod
    def load(cls, cfg: BenchConfig, res: Resolved) -> Models:
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


@dataclass
class Plan:
    """The (engine, mode) configurations that run, those skipped (and why), and notes for the report."""

    configs: list[tuple[str, Mode]] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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


def native_commands(runners: dict[str, Runner]) -> dict[str, str]:
    """The command lines the native runners ran, by ``engine/mode``."""
    return {f"{e}/{m}": " ".join(shlex.quote(x) for x in c)
            for e, r in runners.items() if isinstance(r, NativeRunner) for m, c in r.commands.items()}


def stop_native(runners: dict[str, Runner]) -> None:
    for r in runners.values():
        if isinstance(r, NativeRunner):
            r.close()  # stop servers before the analysis


def close_runners(runners: dict[str, Runner]) -> None:
    for name, r in runners.items():
        try:
            r.close()
        except Exception as ex:  # pragma: no cover
            log.warning("bench: closing the %s runner failed (skipped): %s", name, ex)


def remove_log_dir(log_dir: str) -> None:
    try:
        os.rmdir(log_dir)
    except OSError:
        pass


@dataclass
class Outcome:
    """What the runs produced, for the report: the prompts, the costs, the plan, the runs, the native commands,
    and the output checks (divergences, how many runs were compared, drafted / accepted parity)."""

    prompts: list[BenchPrompt]
    costs: dict | None
    plan: Plan
    results: list[RunResult]
    commands: dict[str, str]
    divergences: list[dict]
    n_checked: int
    parity: list[dict]
