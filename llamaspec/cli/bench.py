"""``llamaspec bench``: llamaspec, native llama.cpp and llama-cpp-python side by side, in one run."""
from __future__ import annotations

import shlex
import sys
import tempfile
from typing import Callable

import click

from ._common import check_output_path, err_console, handle_errors, option_group, resolve_model_arg
from .device_options import device_options, pop_device_options
from .ngram_options import apply_ngram_options, ngram_options

DEFAULT_MODES = "plain,draft-simple,ngram-mod,ngram-simple,ngram-map-k,lookup"
DEFAULT_ENGINES = "llamaspec,native,llama-cpp-python"
QUICK_PROMPTS, QUICK_CHARS, QUICK_N = 3, 200, 24


@click.command()
@click.option("--quick", is_flag=True,
              help=f"Smoke test: tiny random models (written to a temporary folder), {QUICK_PROMPTS} short prompts, "
                   f"-n {QUICK_N}, 1 repeat; native engines are skipped when not built.")
@click.option("--server", "server_mode", is_flag=True,
              help="Server mode: aggregate decode tokens/s of concurrent HTTP clients against llamaspec serve and "
                   "llama-server (engines llamaspec, native), same models, draft-simple (--spec-draft-n-max/-n-min; --modes "
                   "is not used), -np and prompts, interleaved; 2 repeats unless --repeats.")
@click.option("--clients", default="1,4,8", show_default=True, help="Server mode: comma list of concurrent client counts.")
@click.option("--requests-per-client", type=click.IntRange(min=1), default=None,
              help="Server mode: requests each client sends per measurement (default: the prompts shared out, at "
                   "least one each; --quick: 32, so a tiny model's measurement lasts long enough to time).")
@click.option("--sweep", is_flag=True,
              help="Server mode: the concurrency sweep, 1,2,4,8,16 clients on -np 16 (unless --clients / -np), "
                   "llamaspec's defaults against llama-server plain and with draft-simple at n_max 3 and 8 (without a "
                   "draft model: llamaspec's n-gram default against llama-server plain and --spec-default).")
@click.option("--server-variants", "server_variants", default=None,
              help="Server mode: comma list of SERVER:SETTING to compare (ls:defaults, ls:auto, ls:plain, ls:draft[:N], "
                   "ls:parity[:N], native:plain, native:draft[:N], native:spec-default, native:ngram-mod; default: the "
                   "--sweep comparison, or on --quick each server plain and at a fixed draft length).")
@click.option("-np", "--parallel", "n_parallel", type=click.IntRange(min=1), default=4, show_default=True,
              help="Server mode: server slots (-np) of both servers.")
@click.option("--pair", default=None, help="Target+draft pair from models.toml (default: the registry's default pair).")
@click.option("-m", "--model", default=None, help="Target model (name or GGUF path) instead of --pair.")
@click.option("-md", "--draft-model", "draft_model", default=None, help="Draft model (name or GGUF path), with -m.")
@click.option("--modes", default=DEFAULT_MODES, show_default=True,
              help="Comma list: plain, draft-simple, ngram-mod, ngram-simple, ngram-map-k, ngram-map-k4v, "
                   "A+B (a chain), synth:L (draft-simple with synthetic mean length L), lookup[:N] "
                   "(llama-cpp-python prompt lookup, num_pred_tokens N), TYPES:N (the draft model's n_max fixed at N), "
                   "default; any of them with @tN runs with N threads (plain@t1).")
@click.option("--engines", default=DEFAULT_ENGINES, show_default=True,
              help="Comma list: llamaspec, native (llama-speculative-simple for draft-simple, llama-server otherwise), "
                   "native-server (llama-server for every mode), llama-cpp-python.")
@click.option("--prompts", "prompts_file", default=None, help="JSONL prompt file (\"prompt\", optional \"id\", \"category\"); default: the shipped set.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use only the first N prompts (one per category first).")
@click.option("-n", "--n-predict", type=click.IntRange(min=2), default=128, show_default=True, help="Tokens to generate per prompt.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Repeats of the whole interleaved pass.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=1024, show_default=True, help="Context size (all engines).")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Batch and micro-batch size (all engines).")
@device_options(bench=True)
@click.option("-fa", "--flash-attn", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="Flash attention, the same for every engine (llama-cpp-python has no 'auto').")
@click.option("--seed", type=click.IntRange(min=0, max=0xFFFFFFFE), default=42, show_default=True, help="Sampling seed (synthetic acceptance draws from it).")
@click.option("--spec-draft-n-max", type=click.IntRange(min=1), default=3, show_default=True, help="Draft length for draft-simple and synth modes.")
@click.option("--spec-draft-n-min", type=click.IntRange(min=0), default=0, show_default=True, help="Minimum draft length (draft-simple).")
@click.option("--native-dir", default=None, help="Folder with bin/llama-server and bin/llama-speculative-simple (default: ./native).")
@click.option("--no-warmup", is_flag=True, help="Skip the unrecorded warm-up run of every configuration.")
@click.option("--no-costs", is_flag=True, help="Skip measuring the verify-cost curve (no predicted speedup / efficiency).")
@click.option("--near-tie-tol", type=float, default=0.5, show_default=True, help="Logit tolerance that classifies a divergence as a near-tie.")
@click.option("--json", "json_path", default=None, help="Write the full report (settings, rows, every run) as JSON.")
@click.option("--markdown", "md_path", default=None, help="Write the report as markdown.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG plot (speedup by mode and engine, decode tokens/s).")
@click.option("--cache-dir", default=None, help="Model cache directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar (plain log lines on stderr instead).")
@click.option("--from-json", "from_json", default=None,
              help="Run nothing: recompute the summary of a saved --json report and write the outputs again.")
@option_group(ngram_options(bench=True))
@click.option("--load", "load_busy", type=click.IntRange(min=0), default=0, show_default=True,
              help="Run the comparison with this many busy-loop processes beside it on the same cores (a busy machine).")
@click.option("--load-decode", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also this many processes decoding a llama.cpp model plainly beside the run (--load-model).")
@click.option("--load-model", default=None, help="Model the --load-decode processes decode (default: the target).")
@click.option("--load-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Threads of each --load-decode process.")
@handle_errors
def bench(quick, server_mode, clients, requests_per_client, sweep, server_variants, n_parallel, pair, model, draft_model,
          modes, engines, prompts_file, limit, n_predict, repeats, ctx_size, batch_size, flash_attn, seed, spec_draft_n_max,
          spec_draft_n_min, native_dir, no_warmup, no_costs, near_tie_tol, json_path, md_path, plot_path, cache_dir,
          no_progress, from_json, load_busy, load_decode, load_model, load_threads, **ngram_kw):
    """Benchmark llamaspec against native llama.cpp and llama-cpp-python on the same models and settings.

    Every configuration (engine x mode) runs on every prompt back to back, in alternating order on
    successive repeats, in one process tree; models are loaded (and servers started) before timing.
    The report gives decode tokens/s (median, min, max), acceptance, speedup over plain, the
    llamaspec/native ratio, the efficiency against the speedup model, and any token divergence.
    """
    from llamaspec.bench import BenchConfig, load_prompts, parse_modes, run_benchmark
    from llamaspec.bench.load import LoadSpec
    from llamaspec.bench.prompts import quick_subset
    from llamaspec.errors import UsageError
    from llamaspec.params import SpecParams

    dev = pop_device_options(ngram_kw)  # -ngl -ngld -mg -sm -ts -t -tb -td, the same for every engine
    server_mode = server_mode or sweep  # the sweep is a server benchmark
    if server_variants and not server_mode:
        raise UsageError("--server-variants compares servers: add --server (or --sweep)")
    if server_mode and (dev["rpc_servers"] or dev["rpc_servers_draft"]):
        raise UsageError("--rpc / --rpc-draft are not supported with bench --server (use llamaspec serve --rpc and "
                         "bench without --server)")
    for p, flag in ((json_path, "--json"), (md_path, "--markdown"), (plot_path, "--plot")):
        check_output_path(p, flag)
    if plot_path:
        from llamaspec.bench.report import require_matplotlib

        require_matplotlib()
    if from_json:
        return _emit(_saved_report(from_json), json_path, md_path, plot_path)
    given = _given()
    spec = SpecParams()
    spec.draft.n_max, spec.draft.n_min = spec_draft_n_max, spec_draft_n_min
    apply_ngram_options(spec, ngram_kw)

    tmpdir = None
    if quick:
        if pair or model or draft_model:
            raise UsageError("--quick uses the tiny test models: drop --pair / -m / -md")
        from llamaspec.testing import make_all

        tmpdir = tempfile.TemporaryDirectory(prefix="llamaspec-bench-quick-")
        paths = make_all(tmpdir.name, ["llama", "llama-draft"])
        target, draft = str(paths["llama"]), str(paths["llama-draft"])
        target_name, draft_name = "tiny llama (random weights)", "tiny llama-draft (perturbed copy)"
        n_predict = n_predict if given("n_predict") else QUICK_N
        repeats = repeats if given("repeats") else 1
        ctx_size = ctx_size if given("ctx_size") else 256
        # the tiny models rarely repeat long n-grams in a few tokens: short keys make the n-gram drafters draft
        if not any(given(k) for k in ("spec_ngram_mod_n_match", "spec_ngram_mod_n_min", "spec_ngram_mod_n_max")):
            spec.ngram_mod.n_match, spec.ngram_mod.n_min, spec.ngram_mod.n_max = 2, 1, 8
        for kind in ("simple", "map_k"):
            if not any(given(f"ngram_{kind}_size_{x}") for x in "nm"):
                q = getattr(spec, f"ngram_{kind}")
                q.size_n, q.size_m = 2, 8
    else:
        if pair and (model or draft_model):
            raise UsageError("--pair names both models: drop -m / -md, or drop --pair")
        if draft_model and not model:
            raise UsageError("-md needs -m (or use --pair)")
        if model:
            target_name, draft_name = model, draft_model
        else:
            from llamaspec.models import load_registry

            reg = load_registry()
            pname = pair or reg.default_pair
            p = reg.pair(pname)
            target_name, draft_name, pair = p.target, p.draft, pname
        target = resolve_model_arg(target_name, cache_dir)
        draft = resolve_model_arg(draft_name, cache_dir) if draft_name else None

    load = LoadSpec(busy=load_busy, decode=load_decode, threads=load_threads,
                    model=(resolve_model_arg(load_model, cache_dir) if load_model else target) if load_decode else None)
    prompts = load_prompts(prompts_file)
    if quick:
        prompts = quick_subset(prompts, limit or QUICK_PROMPTS, QUICK_CHARS)
    elif limit:
        prompts = quick_subset(prompts, limit)
    command = "llamaspec " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None
    from llamaspec.bench.load import sigterm_unwinds

    restore = sigterm_unwinds()
    try:
        if server_mode:
            from llamaspec.bench.server_mode import run_server_benchmark

            if sweep:
                clients = clients if given("clients") else "1,2,4,8,16"
                n_parallel = n_parallel if given("n_parallel") else 16
            cfg = _server_config(given, quick, target=target, draft=draft, prompts=prompts, clients=clients,
                                 engines=engines, n_parallel=n_parallel, n_predict=n_predict, repeats=repeats,
                                 ctx_size=ctx_size, batch_size=batch_size, dev=dev, draft_n_max=spec_draft_n_max,
                                 draft_n_min=spec_draft_n_min, seed=seed, native_dir=native_dir,
                                 requests_per_client=requests_per_client or (32 if quick else 0), target_name=target_name,
                                 draft_name=draft_name, variants=server_variants, command=command)
            report = _with_load(load, lambda: run_server_benchmark(cfg, lambda t: err_console.print(f"[dim]{t}[/]",
                                                                                                   highlight=False)))
        else:
            cfg = BenchConfig(
                target=target, draft=draft, modes=parse_modes(modes),
                engines=[e.strip() for e in engines.split(",") if e.strip()], prompts=prompts, n_predict=n_predict,
                repeats=repeats, n_ctx=ctx_size, n_batch=batch_size, threads=dev["n_threads"] or 0,
                threads_batch=dev["n_threads_batch"] or 0, threads_draft=dev["n_threads_draft"] or 0,
                # the bench's CPU default (-ngl 0) would leave RPC servers empty: with --rpc, all layers go to them
                n_gpu_layers=(-1 if dev["rpc_servers"] else 0) if dev["n_gpu_layers"] is None else dev["n_gpu_layers"],
                n_gpu_layers_draft=dev["n_gpu_layers_draft"], main_gpu=dev["main_gpu"], split_mode=dev["split_mode"],
                tensor_split=tuple(dev["tensor_split"]) if dev["tensor_split"] is not None else None,
                flash_attn=flash_attn == "on", rpc_servers=dev["rpc_servers"], rpc_servers_draft=dev["rpc_servers_draft"],
                seed=seed, spec=spec, warmup=not no_warmup, measure_costs=not no_costs, near_tie_tol=near_tie_tol,
                native_dir=native_dir, pair=pair, target_name=target_name, draft_name=draft_name,
                prompts_file=prompts_file, quick=quick, command=command,
            )
            report = _with_load(load, lambda: _run_with_progress(cfg, run_benchmark, no_progress))
    finally:
        restore()
        if tmpdir is not None:
            tmpdir.cleanup()
    _emit(report, json_path, md_path, plot_path)


def _given() -> Callable[[str], bool]:
    """``given(name)``: whether the command line (not the default) set option ``name``."""
    ctx = click.get_current_context()
    return lambda name: ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT


def _saved_report(path: str) -> dict:
    """``--from-json``: a saved report, its summary recomputed from its runs."""
    import json
    from pathlib import Path

    from llamaspec.bench.analysis import resummarise
    from llamaspec.errors import UsageError

    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--from-json: file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"--from-json: {path} is not a JSON report") from None
    if not isinstance(saved, dict) or "runs" not in saved or "settings" not in saved:
        raise UsageError(f"--from-json: {path} is not a llamaspec bench report")
    return resummarise(saved)


def _server_config(given, quick, *, clients, engines, n_parallel, repeats, ctx_size, batch_size, dev, variants, **kw):
    """``--server``: llamaspec serve against llama-server (llamaspec/bench/server_mode.py)."""
    from importlib.util import find_spec

    from llamaspec.bench.server_mode import ServerBenchConfig
    from llamaspec.bench.server_variants import parse_variants
    from llamaspec.errors import UsageError

    missing = [m for m in ("starlette", "uvicorn") if find_spec(m) is None]
    if missing:
        raise UsageError(f'bench --server needs {" and ".join(missing)} for llamaspec serve: pip install "llamaspec[server]"')
    try:
        counts = tuple(int(x) for x in clients.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--clients: a comma list of integers, not {clients!r}") from None
    return ServerBenchConfig(
        clients=counts,
        engines=tuple(e.strip() for e in (engines if given("engines") else "llamaspec,native").split(",") if e.strip()),
        n_parallel=n_parallel, repeats=repeats if given("repeats") or quick else 2,
        n_ctx=ctx_size if given("ctx_size") else ctx_size * n_parallel, n_batch=batch_size,
        # --quick: one thread (tiny models; a busy machine makes llama.cpp's thread pool spin)
        threads=dev["n_threads"] or (1 if quick else 0), n_gpu_layers=dev["n_gpu_layers"] or 0,
        n_gpu_layers_draft=dev["n_gpu_layers_draft"], quick=quick,
        variants=tuple(parse_variants(variants, kw["draft"], kw["draft_n_max"], kw["draft_n_min"])) if variants else None,
        **kw)


def _with_load(load, run) -> dict:
    """``run()`` with the ``--load`` processes beside it (none: as it is); the load goes into the report."""
    from llamaspec.bench.load import BackgroundLoad

    if not load.active:
        report = run()
        report["load"] = {"busy": 0, "decode": 0, "description": "none (quiet machine)"}
        return report
    err_console.print(f"[dim]load beside the run: {load.describe()}[/]", highlight=False)
    with BackgroundLoad(load) as bg:
        report = run()
    report["load"] = bg.summary()
    return report


def _emit(report: dict, json_path, md_path, plot_path) -> None:
    """The report on the terminal (``--server``'s: its markdown, on stdout), then the files asked for."""
    from llamaspec._io import write_atomic
    from llamaspec.bench import report as R

    if report.get("kind") == "server":
        from llamaspec.bench.server_mode import render_server_markdown
        from llamaspec.bench.server_variants import plot_server_png

        md = render_server_markdown(report)
        click.echo(md)
        render, plot = (lambda _r: md), plot_server_png
    else:
        render, plot = R.render_markdown, R.plot_png
        con = err_console
        if not con.is_terminal:  # a log file or a pipe: do not squeeze the table into 80 columns
            from rich.console import Console

            con = Console(stderr=True, width=140, highlight=False)
        con.print(R.rich_table(report))
        for line in R.headline(report):
            con.print(f"  {line}", markup=False, highlight=False)
        eq = report["equality"]
        n_tie = sum(1 for d in eq["divergences"] if d.get("near_tie"))
        con.print(f"token equality: {eq['n_compared']} outputs compared with {eq['reference']}: "
                  f"{len(eq['divergences'])} diverge ({n_tie} near-ties)", markup=False, highlight=False)
        for n in report["notes"]:
            con.print(f"[yellow]note:[/] {n}", highlight=False)
        if report["errors"]:
            con.print(f"[red]{len(report['errors'])} run(s) failed[/]; first: {report['errors'][0]['error']}",
                      highlight=False)
    if json_path:
        R.write_json(report, json_path)
    if md_path:
        write_atomic(md_path, render(report))
    if plot_path:
        plot(report, plot_path)


def _run_with_progress(cfg, run, no_progress: bool) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if no_progress:  # plain lines: the phases, and every tenth of the runs (for logs)
        import time

        t0 = [time.monotonic()]

        def cb(kind, **kw):
            if kind == "phase":
                err_console.print(f"[dim]{kw['text']}[/]", highlight=False)
            elif kind == "start":
                t0[0] = time.monotonic()
            elif kind == "run" and kw["total"] >= 10 and kw["done"] % max(1, kw["total"] // 10) == 0:
                el = time.monotonic() - t0[0]
                err_console.print(f"[dim]run {kw['done']}/{kw['total']}, {el:.0f} s elapsed: {kw['label']}[/]", highlight=False)
        return run(cfg, cb)
    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=False)
    task = None
    with prog:
        def cb(kind, **kw):
            nonlocal task
            if kind == "phase":
                if task is None:
                    prog.console.print(f"[dim]{kw['text']}[/]", highlight=False)
                else:
                    prog.update(task, description=kw["text"])
            elif kind == "start":
                task = prog.add_task("runs", total=kw["total"])
            elif kind == "run" and task is not None:
                prog.update(task, completed=kw["done"], description=kw["label"][:60])
        return run(cfg, cb)
