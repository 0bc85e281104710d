"""llama-server's command line for ``llamaspec serve``: :class:`ServeCommand` reads it as llama-server does.

Before click parses the arguments, every llama-server flag (:data:`~llamaspec.cli.server_flags.FLAGS`) is
translated: a spelling of one of ``serve``'s own options becomes ours (``--temperature`` -> ``--temp``,
``-no-kvu`` -> ``--no-kv-unified``, ``--backend_sampling`` -> ``--backend-sampling``); a flag llamaspec has
no use for is dropped with its values (one warning line saying why, unless llamaspec already behaves as it
asks); a removed one is a usage error with llama.cpp's hint. The ``LLAMA_ARG_*`` environment variables are
read as llama-server reads them: the variable applies unless the command line gives the same flag,
``LLAMA_ARG_NO_X`` turns an on/off flag off, a switch applies when its value is true (``1``, ``on``,
``true``, ``enabled``). Anything else is left to click, so llamaspec's own flags keep working.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping

import click

from .server_flags import FLAGS, Flag, by_name

__all__ = ["ServeCommand", "translate", "cli_spellings"]

TRUE = ("on", "enabled", "true", "1")
FALSE = ("off", "disabled", "false", "0")
#: ignored on/off flags whose off form asks for what llamaspec does anyway (no web UI, no projector, ...)
_QUIET_WHEN_OFF = {"--ui", "--ui-mcp-proxy", "--agent", "--mmproj-auto", "--mmproj-offload", "--models-autoload",
                   "--reasoning-preserve", "--skip-chat-parsing", "--log-jsonl", "--cache-idle-slots"}


def _option_map(cmd: click.Command) -> dict[str, tuple[click.Option, bool]]:
    """Every spelling of ``cmd``'s options -> (option, is the positive form)."""
    out: dict[str, tuple[click.Option, bool]] = {}
    for p in cmd.params:
        if isinstance(p, click.Option):
            out.update({o: (p, True) for o in p.opts})
            out.update({o: (p, False) for o in p.secondary_opts})
    return out


def cli_spellings(cmd: click.Command, f: Flag) -> tuple[str | None, str | None]:
    """The spellings of ``cmd``'s option that llama-server's ``f`` maps to: (positive form, negative form)."""
    opts = _option_map(cmd)
    for n in f.names + f.neg:
        if n in opts:
            p = opts[n][0]
            return p.opts[0], (p.secondary_opts[0] if p.secondary_opts else None)
    return None, None


def _n_values(p: click.Option) -> int:
    return 0 if (p.is_flag or p.count) else max(1, p.nargs)


def _env_tokens(environ: Mapping[str, str], given: set[Flag], notes: list[str]) -> list[str]:
    """The command-line tokens the ``LLAMA_ARG_*`` variables stand for (flags on the command line win)."""
    out: list[str] = []
    for f in FLAGS:
        if f.env is None:
            continue
        no_env = f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if f.neg and f.env.startswith("LLAMA_ARG_") else None
        if no_env is not None and no_env in environ:
            name, value = no_env, "0"
        elif f.env in environ:
            name, value = f.env, environ[f.env]
        else:
            continue
        if f in given:
            notes.append(f"the command line's {f.key} replaces the environment variable {name}")
            continue
        v = value.strip().lower()
        if f.kind in ("V", "B"):
            if v not in TRUE + FALSE:
                raise click.UsageError(f"environment variable {name}: expected 1/0, on/off, true/false, "
                                       f"enabled/disabled, got {value!r}")
            if f.kind == "B":
                out.append(f.names[0] if v in TRUE else f.neg[0])
            elif v in TRUE:
                out.append(f.names[0])
        elif f.kind == "I":
            try:
                int(value.strip())
            except ValueError:
                raise click.UsageError(f"environment variable {name}: expected an integer, got {value!r}") from None
            out += [f.names[0], value.strip()]
        else:
            out += [f.names[0], value]
    return out


def _exit_action(f: Flag) -> None:
    from llamaspec import __version__

    if f.key == "--version":
        click.echo(f"llamaspec {__version__}: a llama-server-compatible server (the flags of the llama-server of "
                   "llama-cpp-python 0.3.36)")
    elif f.key == "--cache-list":
        from llamaspec.models.cache import cache_dir

        click.echo(f"models in {cache_dir()}: see `llamaspec models list`")
    elif f.key == "--list-devices":
        click.echo("llamaspec uses llama.cpp's default devices: see `llamaspec probe MODEL` for where it runs")
    elif f.key == "--completion-bash":
        names = " ".join(sorted({n for g in FLAGS for n in g.names + g.neg}))
        click.echo(f'complete -W "{names}" llamaspec-serve')
    sys.exit(0)


def translate(cmd: click.Command, args: list[str], environ: Mapping[str, str] | None = None
              ) -> tuple[list[str], list[str]]:
    """llama-server's arguments (and environment) -> ``cmd``'s arguments, and the warning lines to print."""
    environ = os.environ if environ is None else environ
    opts = _option_map(cmd)
    notes: list[str] = []
    given = {f for a in args if (f := by_name(a.split("=", 1)[0] if a.startswith("--") else a)) is not None}
    env_toks = _env_tokens(environ, given, notes)
    out: list[str] = []
    toks = env_toks + list(args)
    n_env = len(env_toks)
    i = 0
    while i < len(toks):
        tok = toks[i]
        from_env = i < n_env
        i += 1
        if tok == "--":
            out += toks[i - 1:]
            break
        name, eq, inline = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if name in opts:  # one of ours, as we spell it: keep it and its values as they are
            p = opts[name][0]
            k = 0 if eq else _n_values(p)
            out += toks[i - 1:i + k]
            i += k
            continue
        f = by_name(name)
        if f is None:
            out.append(tok)  # click reports it
            continue
        if name == "--usage":
            out.append("--help")
            continue
        k = 0 if eq else f.nargs
        if i + k > len(toks):
            raise click.UsageError(f"{name} needs a value" + (" (two values)" if f.nargs == 2 else ""))
        values = ([inline] if eq else []) + toks[i:i + k]
        i += k
        negative = name in f.neg or name.replace("_", "-") in f.neg
        if f.use == "cli":
            pos, neg = cli_spellings(cmd, f)
            if pos is None:  # pragma: no cover - the table and the command disagree (a test checks this)
                raise click.UsageError(f"{name} is not available in this version of llamaspec serve")
            spelled = neg if negative and neg is not None else pos
            out += [spelled, *values] if not eq else [f"{spelled}={inline}"]
        elif f.use == "exit":
            if f.key == "--help":
                out.append("--help")
            else:
                _exit_action(f)
        elif f.use.startswith("gone:"):
            raise click.UsageError(f"{name}: the argument has been removed. {f.use[5:]}")
        elif f.use != "same":
            if f.kind == "I":
                for v in values:
                    try:
                        int(v)
                    except ValueError:
                        raise click.UsageError(f"{name}: expected an integer, got {v!r}") from None
            if not (negative and f.key in _QUIET_WHEN_OFF):
                what = f"{f.key} (from {f.env})" if from_env else name
                notes.append(f"ignoring {what}: {f.use}")
    return out, list(dict.fromkeys(notes))


class ServeCommand(click.Command):
    """A click command that reads llama-server's command line (see the module docstring); the warnings are
    left in ``ctx.meta["llama_server_notes"]`` for the command to print."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        new, notes = translate(self, args)
        ctx.meta["llama_server_notes"] = notes
        return super().parse_args(ctx, new)
