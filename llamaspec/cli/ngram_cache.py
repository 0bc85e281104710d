"""``llamaspec ngram-cache build | stats``: make and inspect static n-gram caches (llama.cpp's file format)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ._common import err_console, handle_errors, resolve_model_arg


@click.group("ngram-cache")
def ngram_cache() -> None:
    """Static n-gram caches for the ngram-cache drafter (-lcs / -lcd), interchangeable with llama.cpp's."""


@ngram_cache.command("build")
@click.argument("corpus", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Cache file to write.")
@click.option("-m", "--model", help="Model whose tokenizer is used (name or path; default: models.toml's default).")
@click.option("--all-sizes", is_flag=True, help="Count n-grams of sizes 1..4 (for -lcd), not only 2-grams (llama.cpp's lookup-create).")
@click.option("--merge", is_flag=True, help="Add to an existing OUTPUT instead of replacing it.")
@click.option("--cache-dir", default=None, help="Model cache directory.")
@handle_errors
def build(corpus, output, model, all_sizes, merge, cache_dir):
    """Tokenize CORPUS text files and write their n-gram counts to OUTPUT (what lookup-create does)."""
    from llamaspec import Model
    from llamaspec.drafters.ngram_cache import build_cache, cache_stats, load_cache, merge_cache, save_cache
    from llamaspec.errors import UsageError

    texts = []
    for c in corpus:
        try:
            texts.append(Path(c).read_text(encoding="utf-8", errors="replace") if c != "-" else sys.stdin.read())
        except FileNotFoundError:
            raise UsageError(f"corpus file not found: {c}") from None
        except IsADirectoryError:
            raise UsageError(f"{c} is a directory; give text files") from None
    path = resolve_model_arg(model, cache_dir)
    with Model(path, vocab_only=True) as m:
        token_lists = [m.vocab.tokenize(t, add_special=True, parse_special=False) for t in texts]
    kw = dict(ngram_min=1, ngram_max=4) if all_sizes else {}
    cache = build_cache(token_lists, **kw)
    if merge and Path(output).exists():
        old = load_cache(output)
        merge_cache(old, cache)
        cache = old
    save_cache(cache, output)
    st = cache_stats(cache, top=0)
    err_console.print(f"wrote {output}: {st['n_keys']} keys, {st['n_entries']} entries from "
                      f"{sum(len(t) for t in token_lists)} tokens ({Path(path).name} tokenizer)")


@ngram_cache.command("stats")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, help="Most frequent keys to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@handle_errors
def stats(file, top, as_json):
    """Summarise a cache FILE: keys per n-gram size, entries, counts, most frequent keys."""
    from rich.table import Table

    from llamaspec.drafters.ngram_cache import cache_stats, load_cache

    st = cache_stats(load_cache(file), top=top)
    if as_json:
        sys.stdout.write(json.dumps(st, indent=2, default=str) + "\n")
        return
    t = Table(title=f"{file}")
    t.add_column("field")
    t.add_column("value", justify="right")
    for k, v in st.items():
        if k != "top_keys":
            t.add_row(k, str(v))
    from rich.console import Console

    con = Console()
    con.print(t)
    if st.get("top_keys"):
        tk = Table(title="most frequent keys")
        tk.add_column("key (tokens)")
        tk.add_column("total count", justify="right")
        for row in st["top_keys"]:
            key, count = (row["key"], row["count"]) if isinstance(row, dict) else (row[0], row[1])
            tk.add_row(" ".join(str(x) for x in key if x != -1), str(count))
        con.print(tk)
