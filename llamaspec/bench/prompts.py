"""The benchmark's prompt set: the shipped ``prompts.jsonl`` or a user file.

A prompt file is JSON Lines, one object per line with a ``"prompt"`` field and optional ``"id"`` and
``"category"`` fields; a line that does not start with ``{`` is a plain-text prompt (``\\n`` escapes are
expanded). Blank lines are skipped.

>>> ps = load_prompts()
>>> sorted({p.category for p in ps}) == sorted(CATEGORIES)
True
>>> [p.category for p in quick_subset(ps, 3)]
['code-completion', 'code-edit', 'summarisation']
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

SHIPPED = Path(__file__).with_name("prompts.jsonl")

#: the categories of the shipped set, in report order
CATEGORIES = ("code-completion", "code-edit", "summarisation", "qa", "chat")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Prompts from ``path`` (default: the shipped set). Raises UsageError with the line number on bad input."""
    p = Path(path) if path is not None else SHIPPED
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"prompts file not found: {p}") from None
    except UnicodeDecodeError:
        raise UsageError(f"prompts file {p} is not UTF-8 text") from None
    out: list[Prompt] = []
    seen: set[str] = set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                d = json.loads(line)
                text = d["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError(f"{p}:{i}: a JSON line needs a \"prompt\" field") from None
            if not isinstance(text, str) or not text:
                raise UsageError(f"{p}:{i}: \"prompt\" must be a non-empty string")
            pid = str(d.get("id") or f"p{len(out) + 1}")
            cat = str(d.get("category") or "custom")
        else:
            text = line.replace("\\n", "\n")
            pid, cat = f"p{len(out) + 1}", "custom"
        if pid in seen:
            raise UsageError(f"{p}:{i}: duplicate prompt id {pid!r}")
        seen.add(pid)
        out.append(Prompt(pid, cat, text))
    if not out:
        raise UsageError(f"prompts file {p} holds no prompt")
    return out


def quick_subset(prompts: list[Prompt], n: int, max_chars: int | None = None) -> list[Prompt]:
    """``n`` prompts, one per category first (in file order), each cut to ``max_chars`` characters."""
    chosen: list[Prompt] = []
    cats: set[str] = set()
    for p in prompts:
        if p.category not in cats:
            chosen.append(p)
            cats.add(p.category)
    for p in prompts:
        if p not in chosen:
            chosen.append(p)
    chosen = chosen[:n]
    if max_chars is not None:
        chosen = [Prompt(p.id, p.category, p.text[:max_chars]) for p in chosen]
    return chosen
