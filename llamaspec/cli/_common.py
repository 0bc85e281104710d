"""Shared CLI plumbing: consoles, logging, error handling, model resolution."""
from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from rich.console import Console

from llamaspec.errors import LlamaSpecError

if TYPE_CHECKING:
    from llamaspec.models import ProgressFn

# stdout carries only generated text / machine output; everything for humans goes to stderr
err_console = Console(stderr=True, highlight=False)


class CliState:
    debug = False
    verbose = 0  # the group's -v count (generate shows its full statistics with it)


def setup_logging(verbose: int, debug: bool) -> None:
    from rich.logging import RichHandler

    level = logging.WARNING
    if verbose == 1:
        level = logging.INFO
    elif verbose >= 2 or debug:
        level = logging.DEBUG
    root = logging.getLogger("llamaspec")
    root.handlers[:] = [RichHandler(console=err_console, show_path=False, show_time=False, markup=False)]
    root.setLevel(level)
    # llama.cpp's own log lines are very chatty, and its errors reach the user as our one-line errors:
    # show them with -v (warnings) and -vv (everything)
    native = {0: logging.CRITICAL + 1, 1: logging.WARNING}.get(verbose, logging.DEBUG)
    logging.getLogger("llamaspec.llama_cpp").setLevel(logging.DEBUG if debug else native)


def option_group(opts: list) -> Callable:
    """A decorator adding the click options ``opts`` to a command, in this order."""

    def deco(f):
        for opt in reversed(opts):
            f = opt(f)
        return f

    return deco


def fail(message: str, code: int = 1) -> None:
    """Print one clear error line on stderr and exit with ``code``."""
    from rich.markup import escape

    err_console.print("[bold red]error:[/] " + escape(message), soft_wrap=True)
    sys.exit(code)


def handle_errors(fn: Callable) -> Callable:
    """Turn library errors into one clear line and an exit code (2 usage, 1 runtime); --debug keeps tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LlamaSpecError as e:
            if CliState.debug:
                raise
            fail(str(e), getattr(e, "exit_code", 1))
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            sys.exit(130)
        except BrokenPipeError:
            sys.stderr.close()
            sys.exit(0)
        except MemoryError:
            if CliState.debug:
                raise
            fail("out of memory: use a smaller model, a smaller --ctx-size or fewer parallel slots", 1)
        except OSError as e:
            if CliState.debug:
                raise
            fail(f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e), 1)

    return wrapper


def check_output_path(path: str | None, flag: str) -> None:
    """Fail before any work when an output file cannot be written (its folder is missing)."""
    if not path:
        return
    from pathlib import Path

    from llamaspec.errors import UsageError

    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag}: folder {parent} does not exist; create it or choose another path")


def resolve_model_arg(name: str | None, cache_dir: str | None = None) -> str:
    """Model name from models.toml, or a path; fetched with a progress bar when needed."""
    from llamaspec import models

    with progress_bar() as progress:
        path = models.resolve_model(name, cache_dir=cache_dir, progress=progress)
    return str(path)


@contextlib.contextmanager
def progress_bar(console: Optional[Console] = None) -> Iterator[ProgressFn]:
    """A ``progress(stage, done, total)`` callback (``llamaspec.models.ProgressFn``) drawing one rich bar
    per stage on stderr. The bar appears on the first report only, so nothing is drawn when the model
    is already cached.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar: Optional[Progress] = None
    tasks: dict[str, Any] = {}

    def callback(stage: str, done: int, total: Optional[int]) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                           TransferSpeedColumn(), TimeRemainingColumn(), console=console or err_console, transient=False)
            bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    try:
        yield callback
    finally:
        if bar is not None:
            bar.stop()
