"""`llamaspec models list | pull NAME | path NAME`.

Registered into the main group by cli/main.py (``main.add_command(models)``). Errors are raised as
llamaspec errors; the main group turns them into one red line and an exit code.

Fetching shows ``_common.progress_bar()``, the bar every command that resolves a model uses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import click
from rich.console import Console
from rich.table import Table

from llamaspec import models as registry
from llamaspec.errors import FetchError

from ._common import handle_errors, progress_bar


def _registry(ctx: click.Context) -> registry.Registry:
    return registry.load_registry(ctx.obj.get("models_toml") if ctx.obj else None)


def _fmt_size(n_bytes: Optional[float]) -> str:
    if n_bytes is None:
        return "?"
    mb = n_bytes / 1e6
    return f"{mb / 1000:.2f} GB" if mb >= 1000 else f"{mb:.1f} MB"


def _model_rows(reg: registry.Registry, cache: Path) -> list[dict[str, Any]]:
    rows = []
    for name, e in reg.models.items():
        p = registry.cached_path(name, registry=reg, cache_dir=cache)
        size = p.stat().st_size if p is not None else (e.size_mb * 1e6 if e.size_mb is not None else None)
        src: dict[str, Any] = {"kind": e.kind}
        if e.kind == "pypi":
            src.update(pypi=list(e.pypi), file=e.file, parts=list(e.parts))
        elif e.kind == "path":
            src.update(path=str(e.path))
        elif e.kind == "url":
            src.update(url=e.url)
        elif e.kind == "hf":
            src.update(hf=e.hf)
        elif e.derive is not None:
            src.update({"from": e.derive.source, "op": e.derive.op})
            if e.derive.type:
                src["type"] = e.derive.type
            if e.derive.n_layer:
                src["n_layer"] = e.derive.n_layer
        rows.append({
            "name": name,
            "kind": e.kind,
            "source": src,
            "source_text": e.source_text(),
            "size_bytes": int(size) if size is not None else None,
            "sha256": e.sha256,
            "cached": p is not None,
            "path": str(p) if p is not None else None,
            "description": e.description,
            "default": name == reg.default_model,
        })
    return rows


@click.group("models")
@click.option("--models-toml", type=click.Path(dir_okay=False), default=None,
              help="Model registry to read (default: $LLAMASPEC_MODELS_TOML, else the models.toml of llamaspec).")
@click.pass_context
def models(ctx: click.Context, models_toml: Optional[str]) -> None:
    """List, fetch and locate the named models of models.toml."""
    ctx.ensure_object(dict)
    ctx.obj["models_toml"] = models_toml


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Model cache (default: $LLAMASPEC_CACHE or ~/.cache/llamaspec).")
@click.pass_context
@handle_errors
def list_cmd(ctx: click.Context, as_json: bool, cache_dir: Optional[str]) -> None:
    """Show the models and target+draft pairs, and which models are cached."""
    reg = _registry(ctx)
    cache = registry.cache_dir(cache_dir)
    rows = _model_rows(reg, cache)
    pairs = [
        {"name": p.name, "target": p.target, "draft": p.draft, "description": p.description,
         "default": p.name == reg.default_pair, **dict(p.info)}
        for p in reg.pairs.values()
    ]
    if as_json:
        click.echo(json.dumps({
            "registry": [str(s) for s in reg.sources],
            "cache_dir": str(cache),
            "default_model": reg.default_model,
            "default_pair": reg.default_pair,
            "models": rows,
            "pairs": pairs,
        }, indent=2))
        return
    console = Console()
    wide = console.width >= 160  # room for cache paths
    with_desc = console.width >= 110
    t = Table(title="Models", title_justify="left")
    t.add_column("name", style="bold", no_wrap=True)
    t.add_column("source", overflow="fold")
    t.add_column("size", justify="right", no_wrap=True)
    t.add_column("cached" if not wide else "cached at", overflow="fold")
    if with_desc:
        t.add_column("description")
    for r in rows:
        name = r["name"] + (" [green]*[/]" if r["default"] else "")
        if r["cached"]:
            cached = f"[green]{r['path']}[/]" if wide else "[green]yes[/]"
        else:
            cached = "[dim]no[/]"
        cells = [name, r["source_text"], _fmt_size(r["size_bytes"]), cached]
        t.add_row(*(cells + [r["description"]] if with_desc else cells))
    console.print(t)
    pt = Table(title="Pairs (target + draft)", title_justify="left")
    pt.add_column("name", style="bold", no_wrap=True)
    pt.add_column("target")
    pt.add_column("draft")
    pt.add_column("agreement", justify="right")
    pt.add_column("cost ratio", justify="right")
    if with_desc:
        pt.add_column("description")
    for p in pairs:
        agr = p.get("agreement")
        cr = p.get("cost_ratio")
        cells = [
            p["name"] + (" [green]*[/]" if p["default"] else ""), p["target"], p["draft"],
            f"{agr:.0%}" if isinstance(agr, (int, float)) else "", f"{cr:.2f}" if isinstance(cr, (int, float)) else "",
        ]
        pt.add_row(*(cells + [p["description"]] if with_desc else cells))
    console.print(pt)
    console.print(f"[dim]* default.  cache: {cache}  (`llamaspec models path NAME` prints a path)\n"
                  f"registry: {', '.join(str(s) for s in reg.sources)}[/]")


def _names_to_models(reg: registry.Registry, names: tuple[str, ...]) -> list[str]:
    """Model names to pull; a pair name stands for its target and draft."""
    out: list[str] = []
    for n in names or (reg.default_model,):
        if n not in reg.models and n in reg.pairs:
            out += [reg.pairs[n].target, reg.pairs[n].draft]
        else:
            out.append(n)
    return list(dict.fromkeys(out))


@models.command("pull")
@click.argument("names", nargs=-1)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Model cache (default: $LLAMASPEC_CACHE or ~/.cache/llamaspec).")
@click.option("--verify", is_flag=True, help="Re-hash cached files and fetch again any that do not match.")
@click.pass_context
@handle_errors
def pull_cmd(ctx: click.Context, names: tuple[str, ...], cache_dir: Optional[str], verify: bool) -> None:
    """Fetch (or derive) models into the cache and print their paths.

    NAMES are model or pair names (a pair pulls its target and draft); none: the default model.
    """
    reg = _registry(ctx)
    paths = []
    with progress_bar() as progress:
        for name in _names_to_models(reg, names):
            paths.append(registry.pull(name, registry=reg, cache_dir=cache_dir, progress=progress, verify=verify))
    for p in paths:
        click.echo(str(p))


@models.command("path")
@click.argument("name", required=False)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, help="Model cache (default: $LLAMASPEC_CACHE or ~/.cache/llamaspec).")
@click.option("--no-fetch", is_flag=True, help="Fail (exit 1) instead of fetching when the model is not cached.")
@click.pass_context
@handle_errors
def path_cmd(ctx: click.Context, name: Optional[str], cache_dir: Optional[str], no_fetch: bool) -> None:
    """Print the local path of a model (default: the default model), fetching it if needed."""
    reg = _registry(ctx)
    if no_fetch:
        try:
            p = registry.resolve_model(name, registry=reg, cache_dir=cache_dir, fetch=False)
        except FetchError:
            shown = name or reg.default_model
            raise FetchError(
                f"model {shown!r} is not in the cache ({registry.cache_dir(cache_dir)}); "
                f"run `llamaspec models pull {shown}`"
            ) from None
    else:
        with progress_bar() as progress:
            p = registry.resolve_model(name, registry=reg, cache_dir=cache_dir, progress=progress)
    click.echo(str(p))
