"""n-gram drafter flags with llama.cpp's names and ranges (§2.2)."""
from __future__ import annotations

import click

_KINDS = ("simple", "map-k", "map-k4v")


def ngram_options(bench: bool = False) -> list:
    """The flags; ``bench``: ``llamaspec bench``'s subset (ngram-mod, and the sizes of ngram-simple and
    ngram-map-k), their help without the ranges."""
    r = (lambda text: "") if bench else (lambda text: text)
    opts = [
        click.option("--spec-ngram-mod-n-min", type=int, default=None, help=f"ngram-mod: min draft length{r(', 0..1024')} (default 48)."),
        click.option("--spec-ngram-mod-n-max", type=int, default=None, help=f"ngram-mod: max draft length{r(', 0..1024')} (default 64)."),
        click.option("--spec-ngram-mod-n-match", type=int, default=None,
                     help=f"ngram-mod: n-gram length to match{r(', 1..1024')} (default 24)."),
    ]
    for k in _KINDS[:2] if bench else _KINDS:
        u = k.replace("-", "_")
        opts += [
            click.option(f"--spec-ngram-{k}-size-n", f"ngram_{u}_size_n", type=int, default=None,
                         help=f"ngram-{k}: key length{r(' n, 1..1024')} (default 12)."),
            click.option(f"--spec-ngram-{k}-size-m", f"ngram_{u}_size_m", type=int, default=None,
                         help=f"ngram-{k}: draft length{r(' m, 1..1024')} (default 48)."),
        ]
        if not bench:
            opts.append(click.option(f"--spec-ngram-{k}-min-hits", f"ngram_{u}_min_hits", type=int, default=None,
                                     help=f"ngram-{k}: min hits, >= 1 (default 1)."))
    return opts if bench else opts + [
        click.option("-lcs", "--lookup-cache-static", type=str, default=None, help="ngram-cache: static cache file (read)."),
        click.option("-lcd", "--lookup-cache-dynamic", type=str, default=None, help="ngram-cache: dynamic cache file (read)."),
        click.option("--spec-ngram-fix-quirks", is_flag=True,
                     help="Fix the n-gram drafters' llama.cpp quirks (more acceptance; default: behave like llama.cpp)."),
    ]


def apply_ngram_options(p, kw: dict) -> None:
    """Validate and copy the n-gram flags into SpecParams ``p`` (llama.cpp's ranges and messages)."""
    from llamaspec.errors import UsageError

    checks = [("--spec-ngram-mod-n-min", "spec_ngram_mod_n_min", p.ngram_mod, "n_min", 0, "ngram n-min"),
              ("--spec-ngram-mod-n-max", "spec_ngram_mod_n_max", p.ngram_mod, "n_max", 0, "ngram n-max"),
              ("--spec-ngram-mod-n-match", "spec_ngram_mod_n_match", p.ngram_mod, "n_match", 1, "ngram n-match")]
    for k in _KINDS:
        u = k.replace("-", "_")
        q = getattr(p, f"ngram_{u}")
        checks += [(f"--spec-ngram-{k}-size-n", f"ngram_{u}_size_n", q, "size_n", 1, "ngram size N"),
                   (f"--spec-ngram-{k}-size-m", f"ngram_{u}_size_m", q, "size_m", 1, "ngram size M"),
                   (f"--spec-ngram-{k}-min-hits", f"ngram_{u}_min_hits", q, "min_hits", 1, None)]
    for flag, key, target, field, lo, what in checks:
        v = kw.get(key)
        if v is None:
            continue
        if what is None and v < lo:
            raise UsageError(f"{flag}: ngram min hits must be at least 1, got {v}")
        if what is not None and not lo <= v <= 1024:
            raise UsageError(f"{flag}: {what} must be between {lo} and 1024 inclusive, got {v}")
        setattr(target, field, v)
    p.ngram_fix_quirks = bool(kw.get("spec_ngram_fix_quirks"))
    if kw.get("lookup_cache_static"):
        p.ngram_cache.lookup_cache_static = kw["lookup_cache_static"]
    if kw.get("lookup_cache_dynamic"):
        p.ngram_cache.lookup_cache_dynamic = kw["lookup_cache_dynamic"]
