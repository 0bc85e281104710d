"""Shared CLI plumbing: consoles, logging, error handling, model resolution."""
from __future__ import annotations

import functools
import logging
import sys
from typing import Callable

from rich.console import Console

from llamaspec.errors import LlamaSpecError

# stdout carries only generated text / machine output; everything for humans goes to stderr
err_console = Console(stderr=True, highlight=False)


class CliState:
    debug = False


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

    with _Progress() as prog:
        path = models.resolve_model(name, cache_dir=cache_dir, progress=prog)
    return str(path)


class _Progress:
    """Adapter from the library's progress callback to a rich progress bar on stderr (created lazily)."""

    def __init__(self):
        self._p = None
        self._tasks: dict[str, int] = {}

    def __enter__(self):
        return self

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        if self._p is None:
            self._p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                               console=err_console, transient=False)
            self._p.start()
        if stage not in self._tasks:
            self._tasks[stage] = self._p.add_task(stage, total=total)
        self._p.update(self._tasks[stage], completed=done, total=total)

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.stop()
