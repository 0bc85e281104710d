"""``llamaspec`` console script: click commands with rich rendering (no library logic here)."""
from __future__ import annotations

import click

from llamaspec import __version__

from ._common import CliState, setup_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             invoke_without_command=True)
@click.version_option(__version__, prog_name="llamaspec")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv includes llama.cpp's log).")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, verbose: int, debug: bool) -> None:
    """Speculative decoding for llama.cpp models, orchestrated in Python."""
    CliState.debug = debug
    CliState.verbose = verbose
    setup_logging(verbose, debug)
    if ctx.invoked_subcommand is None:
        click.echo(overview())


def _download_mb(reg, names: list[str]) -> float | None:
    """MB fetched to get these models: the sizes of the downloaded models they are made from."""
    roots: dict[str, float | None] = {}
    for name in names:
        e = reg.models.get(name)
        while e is not None and e.kind == "derive" and e.derive is not None:
            e = reg.models.get(e.derive.source)
        if e is None or e.kind == "path":
            continue
        roots[e.name] = e.size_mb
    if not roots or any(v is None for v in roots.values()):
        return None
    return sum(v for v in roots.values() if v is not None)


def overview() -> str:
    """What ``llamaspec`` with no arguments prints: what it is and the three things to try first."""
    pair_line = "speculate with the default target+draft pair of models.toml"
    probe_args = "MODEL -md DRAFT"
    try:
        from llamaspec.models import load_registry

        reg = load_registry()
        p = reg.pairs.get(reg.default_pair) if reg.default_pair else None
        if p is not None:
            mb = _download_mb(reg, [p.target, p.draft])
            size = f", about {mb:.0f} MB" if mb else ""
            pair_line = (f"speculate with the default pair {p.name}: target {p.target}, draft {p.draft}\n"
                         f"      (fetched on first use{size}); the last line tells how much faster than plain it\n"
                         f"      was (greedy: the same text as the target alone)")
            probe_args = f"{p.target} -md {p.draft}"
    except Exception:  # a broken models.toml must not break the overview; `generate` reports it properly
        pass
    return f"""llamaspec {__version__}: speculative decoding for llama.cpp models. A small draft model (or n-gram
lookup) proposes tokens, the target model checks them all in one batch: the same text, sooner
(greedy output is exactly the target's own).

Try first:

  llamaspec generate "def fibonacci(n):" --temp 0
      {pair_line}

  llamaspec probe {probe_args}
      will speculation pay off? memory level, verify costs, recommended draft length

  llamaspec serve --help
      an OpenAI-compatible server

All commands and options: llamaspec --help, llamaspec COMMAND --help; models: llamaspec models list"""


def _register() -> None:
    from .bench import bench
    from .generate import generate
    from .models import models
    from .ngram_cache import ngram_cache
    from .probe import probe
    from .serve import serve

    for cmd in (bench, generate, probe, ngram_cache, serve, models):
        main.add_command(cmd)


_register()

if __name__ == "__main__":  # pragma: no cover
    main()
