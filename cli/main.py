"""``llamaspec`` console script: click commands with rich rendering (no library logic here)."""
from __future__ import annotations

import click

from llamaspec import __version__

from ._common import CliState, setup_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="llamaspec")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv includes llama.cpp's log).")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def main(verbose: int, debug: bool) -> None:
    """Speculative decoding for llama.cpp models, orchestrated in Python."""
    CliState.debug = debug
    setup_logging(verbose, debug)


def _register() -> None:
    from .bench import bench
    from .generate import generate
    from .ngram_cache import ngram_cache
    from .probe import probe

    main.add_command(bench)
    main.add_command(generate)
    main.add_command(probe)
    main.add_command(ngram_cache)
    try:
        from .models import models
    except ImportError:  # pragma: no cover - during development only
        return
    main.add_command(models)


_register()

if __name__ == "__main__":  # pragma: no cover
    main()
