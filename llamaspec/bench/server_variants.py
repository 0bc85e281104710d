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

``N`` defaults to ``--spec-draft-n-max``.

>>> [v.key for v in parse_variants("ls:defaults,native:plain,native:draft:8", draft="d.gguf", n_max=3)]
['ls:defaults', 'native:plain', 'native:draft:8']
>>> parse_variants("native:draft", draft="d.gguf", n_max=3)[0].args
('-md', 'd.gguf', '--spec-type', 'draft-simple', '--spec-draft-n-max', '3', '--spec-draft-n-min', '0')
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
        if any(v.key == key for v in out):
            continue
        out.append(ServerVariant(key, engine, _label(engine, setting, n), tuple(args)))
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
