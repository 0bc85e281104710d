"""The server settings ``llamaspec bench --server`` compares: each a server (``llamaspec serve`` or llama-server)
and its speculation flags, named ``SERVER:SETTING`` (``--server-variants``, or the ``--sweep`` presets).

``ls`` is ``llamaspec serve``, ``native`` is llama-server:

* ``ls:defaults``: llamaspec's defaults (with a draft model: draft-simple with the adaptive length; without
  one: ngram-lookup over the request's own text); ``ls:auto``: ``--spec-type auto`` (n-grams of the request, then the draft model when
  there is one, each used per slot while it pays); ``ls:plain``: no speculation;
* ``ls:draft:N``: draft-simple at the fixed length ``N`` (``--no-spec-draft-adaptive``); ``ls:parity:N``:
  the same with ``--spec-parity`` (llama.cpp's exact behaviour);
* ``native:plain``, ``native:draft:N`` (draft-simple, ``--spec-draft-n-max N``), ``native:spec-default``
  (llama-server's ``--spec-default``), ``native:ngram-mod``.

``N`` defaults to ``--spec-draft-n-max``. Any setting with ``@tN`` runs that server with ``N`` threads (``-t``,
``-tb``, ``-td``; ``native:plain@t1``): an anchor at its best thread count beside llamaspec choosing its own.

>>> [v.key for v in parse_variants("ls:defaults,native:plain,native:draft:8", draft="d.gguf", n_max=3)]
['ls:defaults', 'native:plain', 'native:draft:8']
>>> parse_variants("native:draft", draft="d.gguf", n_max=3)[0].args
('-md', 'd.gguf', '--spec-type', 'draft-simple', '--spec-draft-n-max', '3', '--spec-draft-n-min', '0')
>>> v = parse_variants("native:draft:8@t1", draft="d.gguf", n_max=3)[0]; v.key, v.args[-6:]
('native:draft:8@t1', ('-t', '1', '-tb', '1', '-td', '1'))
>>> parse_variants("ls:draft:4", draft=None, n_max=3)
Traceback (most recent call last):
...
llamaspec.errors.UsageError: --server-variants ls:draft:4 needs a draft model (-md or --pair)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["ServerVariant", "parse_variants", "sweep_variants", "ENGINES"]

#: the two servers, by prefix
ENGINES = {"ls": "llamaspec", "native": "native"}
_SETTINGS = {"ls": ("defaults", "auto", "plain", "draft", "parity"),
             "native": ("plain", "draft", "spec-default", "ngram-mod")}


@dataclass(frozen=True)
class ServerVariant:
    key: str  # e.g. "native:draft:3"
    engine: str  # "llamaspec" | "native"
    label: str  # a readable name for reports
    args: tuple[str, ...]  # the speculation flags (after the flags both servers share)


def _label(engine: str, setting: str, n: int | None) -> str:
    server = "llamaspec serve" if engine == "llamaspec" else "llama-server"
    what = {"defaults": "defaults", "auto": "auto", "plain": "plain", "spec-default": "--spec-default",
            "ngram-mod": "ngram-mod", "draft": f"draft n_max {n}", "parity": f"draft n_max {n} parity"}[setting]
    return f"{server} {what}"


def parse_variants(text: str, draft: str | None, n_max: int, n_min: int = 0) -> list[ServerVariant]:
    """``SERVER:SETTING[:N]`` items (module docstring) to variants; a clear UsageError for anything else."""
    out: list[ServerVariant] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        threads = None
        if "@t" in item:
            item, _, t = item.partition("@t")
            if not t.isdigit() or int(t) < 1:
                raise UsageError(f"--server-variants {item}@t{t}: @tN needs a thread count N >= 1")
            threads = int(t)
        parts = item.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ENGINES or parts[1] not in _SETTINGS[parts[0]]:
            choices = ", ".join(f"{p}:{s}" for p, ss in _SETTINGS.items() for s in ss)
            raise UsageError(f"--server-variants: unknown setting {item!r} (valid: {choices}; draft and parity take "
                             f"an optional :N)")
        prefix, setting = parts[0], parts[1]
        n: int | None = None
        if len(parts) == 3:
            if setting not in ("draft", "parity") or not parts[2].isdigit() or int(parts[2]) < 1:
                raise UsageError(f"--server-variants {item}: only draft and parity take a length, a positive integer")
            n = int(parts[2])
        engine = ENGINES[prefix]
        needs_draft = setting in ("draft", "parity")
        if needs_draft and not draft:
            raise UsageError(f"--server-variants {item} needs a draft model (-md or --pair)")
        args: list[str] = []
        if setting in ("draft", "parity"):
            n = n or n_max
            args = ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(n),
                    "--spec-draft-n-min", str(n_min)]
            if engine == "llamaspec":
                args.append("--spec-parity" if setting == "parity" else "--no-spec-draft-adaptive")
        elif setting == "defaults" and draft:
            args = ["-md", str(draft)]
        elif setting == "plain" and engine == "llamaspec":  # (llamaspec serve drafts n-grams unless told not to)
            args = ["--spec-type", "none"]
        elif setting == "auto":
            args = (["-md", str(draft)] if draft else []) + ["--spec-type", "auto"]
        elif setting == "spec-default":
            args = ["--spec-default"]
        elif setting == "ngram-mod":
            args = ["--spec-type", "ngram-mod"]
        key = f"{prefix}:{setting}" + (f":{n}" if n is not None else "")
        label = _label(engine, setting, n)
        if threads is not None:
            args += ["-t", str(threads), "-tb", str(threads), "-td", str(threads)]
            key, label = f"{key}@t{threads}", f"{label} ({threads} thread{'s' if threads > 1 else ''})"
        if any(v.key == key for v in out):
            continue
        out.append(ServerVariant(key, engine, label, tuple(args)))
    if not out:
        raise UsageError("--server-variants: give at least one setting")
    return out


def sweep_variants(draft: str | None) -> str:
    """The ``--sweep`` comparison: llamaspec's defaults against llama-server's best settings (issue 24).

    >>> sweep_variants("d.gguf")
    'ls:defaults,native:plain,native:draft:3,native:draft:8'
    >>> sweep_variants(None)
    'ls:defaults,native:plain,native:spec-default'
    """
    if draft:
        return "ls:defaults,native:plain,native:draft:3,native:draft:8"
    return "ls:defaults,native:plain,native:spec-default"


def plot_server_png(report: dict, path) -> None:
    """Aggregate tokens/s by concurrent clients, one line per setting (min–max whiskers over the repeats),
    and below it llamaspec's ratio to the best llama-server setting at each client count."""
    from .report import pyplot, save_png

    plt = pyplot()
    rows = report["rows"]
    keys = list(dict.fromkeys(r["variant"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), gridspec_kw={"height_ratios": [2.2, 1]}, sharex=True)
    for k in keys:
        rs = sorted((r for r in rows if r["variant"] == k), key=lambda r: r["clients"])
        xs = [r["clients"] for r in rs]
        ys = [r["tps_median"] for r in rs]
        err = [[y - r["tps_min"] for y, r in zip(ys, rs)], [r["tps_max"] - y for y, r in zip(ys, rs)]]
        style = "-o" if rs[0]["engine"] == "llamaspec" else "--s"
        ax1.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=rs[0]["server"], lw=2.2 if style == "-o" else 1.4)
        if rs[0]["engine"] == "llamaspec":
            ratio = [(r["clients"], r["ratio_vs_native"]) for r in rs if r.get("ratio_vs_native") is not None]
            if ratio:
                ax2.plot(*zip(*ratio), "-o", label=f"{rs[0]['server']} / best llama-server")
    ax1.set_ylabel("aggregate tokens/s")
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    s = report["settings"]
    ax1.set_title(f"{s['target']} + {s['draft']}, -np {s['n_parallel']}, n_predict {s['n_predict']}", fontsize=9)
    ax2.axhline(1.0, color="grey", lw=1)
    ax2.set_ylabel("ratio")
    ax2.set_xlabel("concurrent clients")
    ax2.grid(alpha=0.3)
    if ax2.lines[1:]:
        ax2.legend(fontsize=8)
    xs = sorted({r["clients"] for r in rows})
    ax2.set_xticks(xs, [str(x) for x in xs])
    save_png(fig, path)
