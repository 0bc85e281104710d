"""n-gram drafter flags with llama.cpp's names and ranges (§2.2)."""
from __future__ import annotations

import click

_KINDS = ("simple", "map-k", "map-k4v")

OPTIONS = [
    click.option("--spec-ngram-mod-n-min", type=int, default=None, help="ngram-mod: min draft length, 0..1024 (default 48)."),
    click.option("--spec-ngram-mod-n-max", type=int, default=None, help="ngram-mod: max draft length, 0..1024 (default 64)."),
    click.option("--spec-ngram-mod-n-match", type=int, default=None, help="ngram-mod: n-gram length to match, 1..1024 (default 24)."),
]
for _k in _KINDS:
    _u = _k.replace("-", "_")
    OPTIONS += [
        click.option(f"--spec-ngram-{_k}-size-n", f"ngram_{_u}_size_n", type=int, default=None,
                     help=f"ngram-{_k}: key length n, 1..1024 (default 12)."),
        click.option(f"--spec-ngram-{_k}-size-m", f"ngram_{_u}_size_m", type=int, default=None,
                     help=f"ngram-{_k}: draft length m, 1..1024 (default 48)."),
        click.option(f"--spec-ngram-{_k}-min-hits", f"ngram_{_u}_min_hits", type=int, default=None,
                     help=f"ngram-{_k}: min hits, >= 1 (default 1)."),
    ]
OPTIONS += [
    click.option("-lcs", "--lookup-cache-static", type=str, default=None, help="ngram-cache: static cache file (read)."),
    click.option("-lcd", "--lookup-cache-dynamic", type=str, default=None, help="ngram-cache: dynamic cache file (read)."),
    click.option("--spec-ngram-fix-quirks", is_flag=True,
                 help="Fix the n-gram drafters' llama.cpp quirks (more acceptance; default: behave like llama.cpp)."),
]


def apply_ngram_options(p, kw: dict) -> None:
    """Validate and copy the n-gram flags into SpecParams ``p`` (llama.cpp's ranges and messages)."""
    from llamaspec.errors import UsageError

    def rng(name, v, lo, hi, what):
        if v is None:
            return None
        if not lo <= v <= hi:
            raise UsageError(f"{name}: {what} must be between {lo} and {hi} inclusive, got {v}")
        return v

    v = rng("--spec-ngram-mod-n-min", kw.get("spec_ngram_mod_n_min"), 0, 1024, "ngram n-min")
    if v is not None:
        p.ngram_mod.n_min = v
    v = rng("--spec-ngram-mod-n-max", kw.get("spec_ngram_mod_n_max"), 0, 1024, "ngram n-max")
    if v is not None:
        p.ngram_mod.n_max = v
    v = rng("--spec-ngram-mod-n-match", kw.get("spec_ngram_mod_n_match"), 1, 1024, "ngram n-match")
    if v is not None:
        p.ngram_mod.n_match = v
    for k in _KINDS:
        u = k.replace("-", "_")
        target = getattr(p, f"ngram_{u}")
        v = rng(f"--spec-ngram-{k}-size-n", kw.get(f"ngram_{u}_size_n"), 1, 1024, "ngram size N")
        if v is not None:
            target.size_n = v
        v = rng(f"--spec-ngram-{k}-size-m", kw.get(f"ngram_{u}_size_m"), 1, 1024, "ngram size M")
        if v is not None:
            target.size_m = v
        v = kw.get(f"ngram_{u}_min_hits")
        if v is not None:
            if v < 1:
                raise UsageError(f"--spec-ngram-{k}-min-hits: ngram min hits must be at least 1, got {v}")
            target.min_hits = v
    p.ngram_fix_quirks = bool(kw.get("spec_ngram_fix_quirks"))
    if kw.get("lookup_cache_static"):
        p.ngram_cache.lookup_cache_static = kw["lookup_cache_static"]
    if kw.get("lookup_cache_dynamic"):
        p.ngram_cache.lookup_cache_dynamic = kw["lookup_cache_dynamic"]
