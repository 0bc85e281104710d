"""What a benchmark run is asked to do: :class:`BenchConfig`, its validation and the settings derived from it; and
what it did (:class:`Plan`, :class:`Outcome`), for the report."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .. import _llama as llama
from ..errors import UsageError
from ..params import SpecParams
from .modes import Mode
from .prompts import Prompt
from .runners import ENGINES, BenchPrompt, RunSettings
from .stats import RunResult

Progress = Callable[..., None]


def no_progress(*_a, **_k) -> None:
    """The default :data:`Progress`: reports nothing."""


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

    def settings(self) -> RunSettings:
        """What every engine's runs share, with the defaults filled in (threads, the draft's layers)."""
        threads = self.threads or llama.default_threads()
        return RunSettings(self.n_ctx, self.n_batch, threads, self.flash_attn, self.seed, self.spec,
                           threads_batch=self.threads_batch or threads, threads_draft=self.threads_draft or threads,
                           n_gpu_layers=self.n_gpu_layers,
                           n_gpu_layers_draft=self.n_gpu_layers if self.n_gpu_layers_draft is None else self.n_gpu_layers_draft,
                           main_gpu=self.main_gpu, split_mode=self.split_mode, tensor_split=self.tensor_split,
                           threads_given=bool(self.threads or self.threads_batch or self.threads_draft))


def reference_name(cfg: BenchConfig) -> str:
    """The run every greedy output is compared with: the first engine's plain run, llamaspec first."""
    for e in ("llamaspec", "native-server", "native", "llama-cpp-python"):
        if e in cfg.engines:
            return f"{e}/plain"
    return ""  # pragma: no cover


def trimmed_draft_for(cfg: BenchConfig) -> str | None:
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


@dataclass
class Plan:
    """The (engine, mode) configurations that run, those skipped (and why), and notes for the report."""

    configs: list[tuple[str, Mode]] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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
