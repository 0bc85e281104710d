"""Research benchmarks (issue 25), outside the wheel: ``--trace`` (multi-turn sessions against running servers),
``--copy-set`` (the copy-heavy prompt set against llama-cpp-python's prompt lookup) and ``--pool-soak`` (the
shared n-gram pool's memory over many requests), run from a clone as ``llamaspec bench`` with one more mode:

    python -m benchmarks.research --trace -m gemma3-270m-f32 -n 64 --repeats 2 --json trace.json

Every option of ``llamaspec bench`` is taken (the same command, with these modes' options added); the package
does not import this folder."""
from __future__ import annotations

import shlex
import sys

import click

from llamaspec.cli._common import err_console, option_group

MODES = ("trace", "copy_set", "pool_soak")

_OPTIONS = [
    click.option("--trace", is_flag=True,
                 help="Trace mode: multi-turn sessions (edit loop, chat with regenerate, shared document, n=4, free "
                      "text) replayed against llamaspec serve and llama-server over HTTP, no draft model; tokens/s per "
                      "trace and variant, ratios to plain and to llama-server's best (benchmarks/trace.py)."),
    click.option("--traces", "trace_names", default=None, help="Trace mode: comma list of traces (default: all)."),
    click.option("--trace-variants", default=None,
                 help="Trace mode: comma list of ls-plain, ls-defaults, ls-nopool, native-plain, native-spec-default, "
                      "native-ngram-mod, native-ngram-mod:M:MIN:MAX (default: all but ls-nopool)."),
    click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True, help="Trace mode: turns per trace."),
    click.option("--trace-restart", type=click.Choice(["trace", "server"]), default="trace", show_default=True,
                 help="Trace mode: a fresh server per (repeat, trace, variant), or one per (repeat, variant)."),
    click.option("--trace-scale", type=float, default=1.0, show_default=True,
                 help="Trace mode: fraction of the long texts kept (tiny test models with a short context)."),
    click.option("--exact", is_flag=True,
                 help="Trace / soak: flash attention off and an F32 KV cache (greedy outputs comparable across runs)."),
    click.option("--copy-set", is_flag=True,
                 help="Copy-set mode: the copy-heavy prompt set (benchmarks/data/copy-set.jsonl) with llama_cpp.Llama "
                      "plain and with prompt lookup (--lookup-n), and llamaspec's defaults without a draft model, "
                      "interleaved, greedy; per prompt and half, llamaspec over the best prompt-lookup setting."),
    click.option("--copy-file", default=None, help="Copy-set mode: another copy-set JSONL (id, half, user[, prompt])."),
    click.option("--copy-half", type=click.Choice(["all", "tune", "held-out"]), default="all", show_default=True,
                 help="Copy-set mode: which half of the set to run."),
    click.option("--copy-format", type=click.Choice(["auto", "chat", "gemma", "plain"]), default="auto", show_default=True,
                 help="Copy-set mode: the user message in the model's chat template (chat), in Gemma's turn markers "
                      "(gemma), or as 'User: ... Assistant:' (plain); auto: chat, else gemma for a Gemma model, else plain."),
    click.option("--lookup-n", default="10,2", show_default=True,
                 help="Copy-set mode: num_pred_tokens of the prompt-lookup settings (10 = its default)."),
    click.option("--pool-soak", is_flag=True,
                 help="Soak mode: many requests through one Engine (defaults, no draft model), the shared pool's "
                      "tokens, index entries and bytes checked against its bound after every step."),
    click.option("--soak-requests", type=click.IntRange(min=1), default=1000, show_default=True, help="Soak mode: requests."),
    click.option("--soak-pool-tokens", type=click.IntRange(min=0), default=16384, show_default=True,
                 help="Soak mode: the pool's bound (--spec-pool-tokens)."),
]


def pop_extra_options(kw: dict) -> dict:
    names = ("trace", "trace_names", "trace_variants", "turns", "trace_restart", "trace_scale", "exact", "copy_set",
             "copy_file", "copy_half", "copy_format", "lookup_n", "pool_soak", "soak_requests", "soak_pool_tokens")
    return {n: kw.pop(n, None) for n in names}  # (absent from the plain bench command)


def _command() -> str | None:
    return "python -m benchmarks.research " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _target(pair, model, draft_model, cache_dir, default: str) -> tuple[str, str]:
    from llamaspec.errors import UsageError

    from llamaspec.cli._common import resolve_model_arg

    if draft_model:
        raise UsageError("--trace / --copy-set / --pool-soak run without a draft model: drop -md")
    if pair:
        from llamaspec.models import load_registry

        model = load_registry().pair(pair).target
    name = model or default
    return name, resolve_model_arg(name, cache_dir)


def run_extra(x: dict, given, *, pair, model, draft_model, cache_dir, n_predict, repeats, ctx_size, n_parallel, dev,
              native_dir, json_path, md_path, near_tie_tol, no_progress, limit, run_with_progress) -> None:
    """Run the one issue-25 mode asked for (``x``: :func:`pop_extra_options`); ``run_with_progress``: the bench's
    progress display (``bench._run_with_progress``)."""
    from llamaspec.bench.report import write_atomic, write_json
    from llamaspec.errors import LlamaSpecError, UsageError

    asked = [m for m in MODES if x[m]]
    if len(asked) > 1:
        raise UsageError("--trace, --copy-set and --pool-soak are separate runs: give one")
    mode = asked[0]
    threads = dev["n_threads"] or 0
    say = (lambda t: err_console.print(f"[dim]{t}[/]", highlight=False))
    if mode == "trace":
        from benchmarks.trace import DEFAULT_VARIANTS, TraceConfig, run_traces
        from benchmarks.trace_report import render_markdown
        from benchmarks.trace_sessions import TRACES

        name, path = _target(pair, model, draft_model, cache_dir, "gemma3-270m-f32")
        cfg = TraceConfig(model=str(path), model_name=name,
                          variants=tuple(v for v in (x["trace_variants"] or ",".join(DEFAULT_VARIANTS)).split(",") if v.strip()),
                          traces=tuple(t.strip() for t in (x["trace_names"] or ",".join(TRACES)).split(",") if t.strip()),
                          turns=x["turns"], n_predict=n_predict, repeats=repeats, n_parallel=n_parallel,
                          n_ctx=ctx_size if given("ctx_size") else 8192, threads=threads, restart=x["trace_restart"],
                          scale=x["trace_scale"], exact=x["exact"], native_dir=native_dir, command=_command())
        report = run_traces(cfg, progress=say)
        md = render_markdown(report)
    elif mode == "copy_set":
        report, md = _copy_set(x, given, say, pair=pair, model=model, draft_model=draft_model, cache_dir=cache_dir,
                               n_predict=n_predict, repeats=repeats, ctx_size=ctx_size, threads=threads, dev=dev,
                               near_tie_tol=near_tie_tol, no_progress=no_progress, limit=limit, run=run_with_progress)
    else:
        from benchmarks.copy_set import fmt_duration, probe_plain_tps
        from benchmarks.pool_soak import render_soak_markdown, run_soak

        name, path = _target(pair, model, draft_model, cache_dir, "smollm2-135m-q4_1")
        n = n_predict if given("n_predict") else 16
        threads = threads or 1  # memory, not speed: one thread does not fight other work for the cores
        tps = probe_plain_tps(str(path), threads, 512, "Note 0: apple river stone cloud garden window bridge.", n=16)
        say(f"pool soak: {x['soak_requests']} requests of {n} tokens on {name}, pool bound {x['soak_pool_tokens']} "
            f"tokens, -np {n_parallel}, {threads} thread(s); estimated runtime: at most "
            f"{fmt_duration(x['soak_requests'] * (n / max(tps, 1e-3) + 0.1))} (one request at a time at {tps:.0f} tok/s "
            "plain, measured now; slots run together)")
        report = run_soak(str(path), n_requests=x["soak_requests"], pool_tokens=x["soak_pool_tokens"],
                          n_parallel=n_parallel, n_predict=n, n_ctx=ctx_size if given("ctx_size") else 512,
                          threads=threads, exact=x["exact"], progress=say)
        report["model"] = name
        md = render_soak_markdown(report, _command())
    click.echo(md)
    if json_path:
        write_json(report, json_path)
    if md_path:
        write_atomic(md_path, md)
    if mode == "pool_soak" and not report["ok"]:
        raise LlamaSpecError("the pool went over its bound: " + "; ".join(report["violations"][:3]))


def _copy_set(x, given, say, *, pair, model, draft_model, cache_dir, n_predict, repeats, ctx_size, threads, dev,
              near_tie_tol, no_progress, limit, run) -> tuple[dict, str]:
    from llamaspec.bench import BenchConfig, parse_modes, run_benchmark
    from benchmarks.copy_set import (estimate_s, fmt_duration, load_copy_set, modes_for, probe_plain_tps, render_copy_markdown,
                                          render_prompts, summarise_copy)
    from llamaspec.errors import UsageError
    from llamaspec.params import SpecParams

    name, path = _target(pair, model, draft_model, cache_dir, "gemma3-270m-f32")
    items = load_copy_set(x["copy_file"], x["copy_half"])
    if limit:
        items = items[:limit]
    try:
        ns = [int(v) for v in x["lookup_n"].split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--lookup-n: a comma list of integers, not {x['lookup_n']!r}") from None
    if not ns or min(ns) < 1:
        raise UsageError("--lookup-n needs at least one num_pred_tokens >= 1")
    prompts, fmt = render_prompts(items, str(path), x["copy_format"])
    modes = parse_modes(modes_for(ns))
    n_runs = repeats * len(prompts) * (2 + len(set(ns)) + 1)
    tps = probe_plain_tps(str(path), threads, ctx_size, prompts[0].text)
    say(f"copy set: {len(prompts)} prompts x {2 + len(set(ns)) + 1} configurations x {repeats} repeats = {n_runs} runs "
        f"of {n_predict} tokens; estimated runtime: at most {fmt_duration(estimate_s(n_runs, n_predict, tps))} "
        f"(every run at plain speed, {tps:.1f} tok/s measured now)")
    cfg = BenchConfig(target=str(path), draft=None, modes=modes, engines=["llamaspec", "llama-cpp-python"],
                      prompts=prompts, n_predict=n_predict, repeats=repeats, n_ctx=ctx_size, n_batch=512,
                      threads=threads, threads_batch=dev["n_threads_batch"] or 0, spec=SpecParams(), measure_costs=False,
                      near_tie_tol=near_tie_tol, target_name=name, prompts_file=x["copy_file"] or "copy-set.jsonl",
                      command=_command())
    report = run(cfg, run_benchmark, no_progress)
    report["copy_set"] = summarise_copy(report, items)
    report["copy_set"].update(file=x["copy_file"] or "benchmarks/data/copy-set.jsonl", half=x["copy_half"],
                              format=fmt,
                              estimate={"estimate_s": round(estimate_s(n_runs, n_predict, tps)), "plain_tps": round(tps, 2)})
    return report, render_copy_markdown(report)


def command() -> click.Command:
    """``llamaspec bench`` with the research modes' options: one of them runs :func:`run_extra`, else the bench."""
    import copy

    from llamaspec.cli import bench as bench_cli
    from llamaspec.cli._common import check_output_path, handle_errors
    from llamaspec.cli.device_options import pop_device_options

    cmd = copy.copy(bench_cli.bench)
    cmd.params = list(cmd.params)  # (the options below go to this copy only)
    cmd.name = "research"
    plain = cmd.callback

    @handle_errors
    def callback(**kw):
        x = pop_extra_options(kw)
        if not any(x[m] for m in MODES):
            return plain(**kw)
        for path, flag in ((kw["json_path"], "--json"), (kw["md_path"], "--markdown")):
            check_output_path(path, flag)
        dev = pop_device_options(kw)
        return run_extra(x, bench_cli._given(), dev=dev, run_with_progress=bench_cli._run_with_progress,
                         **{k: kw[k] for k in ("pair", "model", "draft_model", "cache_dir", "n_predict", "repeats",
                                               "ctx_size", "n_parallel", "native_dir", "json_path", "md_path",
                                               "near_tie_tol", "no_progress", "limit")})

    cmd.callback = callback
    return option_group(_OPTIONS)(cmd)


def main() -> None:
    command()(prog_name="python -m benchmarks.research")


if __name__ == "__main__":
    main()
