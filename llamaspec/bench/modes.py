"""Benchmark modes: what is being measured, independent of the engine that runs it.

A mode is one of

* ``plain`` — no speculation;
* drafter types joined by ``+`` (llama.cpp's ``--spec-type`` names): ``draft-simple``, ``ngram-mod``,
  ``ngram-simple``, ``ngram-map-k``, ``ngram-map-k4v``, ``ngram-mod+draft-simple``, ...;
* ``synth:L`` — draft-simple with synthetic acceptance of mean length ``L`` (``--spec-synth-len``; the
  output is not the model's, so it is left out of the token-equality check);
* ``lookup`` / ``lookup:N`` — llama-cpp-python's ``LlamaPromptLookupDecoding(num_pred_tokens=N)`` (default
  10); only the llama-cpp-python engine runs it;
* ``TYPES:N`` — the same drafters with the draft model's ``n_max`` fixed at ``N`` (``draft-simple:8``), to
  find an engine's best fixed draft length in one run;
* ``default`` — llamaspec's defaults, as ``llamaspec generate`` runs without speculative flags (``auto``:
  ngram-lookup, then the draft model when there is one, adaptive draft length up to
  :data:`~llamaspec.params.ADAPTIVE_DRAFT_N_MAX`, trimmed draft vocabulary where it pays); only the
  llamaspec engine runs it;
* ``default:TYPES`` — the same defaults with the named drafters instead of ``auto`` (``default:draft-simple``);
* any of these with ``@tN`` — run with ``N`` CPU threads for every decode of that mode, whatever ``-t`` says
  (``draft-simple:8@t1``, ``plain@t1``): an anchor's best thread count measured in the same interleaved run as
  llamaspec choosing its own.

>>> [m.name for m in parse_modes("plain, draft-simple,ngram-mod+draft-simple,synth:3,lookup,draft-simple:8,default")]
['plain', 'draft-simple', 'ngram-mod+draft-simple', 'synth:3.0', 'lookup:10', 'draft-simple:8', 'default']
>>> m = parse_mode("default:draft-simple"); m.is_default, m.types, m.spec_params().draft_adaptive_on()
(True, ('draft-simple',), True)
>>> parse_mode("draft-simple:8").spec_params().draft.n_max, parse_mode("default").spec_params().is_auto
(8, True)
>>> parse_mode("ngram-mod+draft-simple").types
('ngram-mod', 'draft-simple')
>>> parse_mode("synth:2.5").exact, parse_mode("ngram-mod").exact
(False, True)
>>> m = parse_mode("draft-simple:8@t1"); m.name, m.n_max, m.threads
('draft-simple:8@t1', 8, 1)
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass

from ..errors import UsageError
from ..params import ADAPTIVE_DRAFT_N_MAX, NAME_TO_TYPE, SpecParams

#: drafter types a mode may name (ngram-cache needs cache files, the others need special models)
MODE_TYPES = ("draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-lookup", "draft-mtp",
              "draft-eagle3", "draft-dflash", "draft-dspark")
#: modes whose drafter reads the -md file (draft-mtp may use the target's own head)
DRAFT_FILE_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark")
DEFAULT_LOOKUP_N = 10


@dataclass(frozen=True)
class Mode:
    name: str
    types: tuple[str, ...] = ()
    synth_len: float | None = None
    lookup_n: int | None = None
    #: the draft model's fixed n_max for this mode (``TYPES:N``); None = the benchmark's --spec-draft-n-max
    n_max: int | None = None
    #: ``default:TYPES``: these drafters with llamaspec's defaults (adaptive length, trimmed draft vocabulary)
    defaults: bool = False
    #: ``@tN``: the CPU threads of every decode of this mode (None: the benchmark's -t, or llamaspec's choice)
    threads: int | None = None

    @property
    def is_default(self) -> bool:
        """llamaspec's own defaults (``auto``, or ``default:TYPES``; adaptive length, trimmed draft
        vocabulary): no other engine has them."""
        return self.types == ("auto",) or self.defaults

    @property
    def kind(self) -> str:
        """``plain``, ``spec`` (a llama.cpp drafter chain) or ``lookup`` (llama-cpp-python's prompt lookup)."""
        if self.lookup_n is not None:
            return "lookup"
        return "spec" if self.types else "plain"

    @property
    def is_plain(self) -> bool:
        return self.kind == "plain"

    @property
    def needs_draft(self) -> bool:
        return any(t in DRAFT_FILE_TYPES for t in self.types)

    @property
    def uses_draft(self) -> bool:
        """Runs with the draft model when there is one (``default`` uses it when given, without needing it)."""
        return self.needs_draft or self.is_default

    @property
    def exact(self) -> bool:
        """Greedy output must equal plain greedy output (false for synthetic acceptance)."""
        return self.synth_len is None

    def spec_params(self, template: SpecParams | None = None) -> SpecParams:
        """The llamaspec parameters for this mode: ``template``'s settings (n_max, n-gram sizes) with this
        mode's types and synthetic length; a named drafter drafts at the fixed length native engines get,
        with the draft's whole vocabulary (only ``default`` has llamaspec's adaptive length and trimmed
        draft vocabulary)."""
        p = copy.deepcopy(template) if template is not None else SpecParams()
        p.types = ["none"]
        if self.types:
            p.add_types(list(self.types))
        if self.is_default:
            p.parity, p.draft_adaptive, p.draft.reuse_kv = False, None, None
            p.draft.n_max = ADAPTIVE_DRAFT_N_MAX
            p.draft.vocab = None  # a trimmed draft vocabulary where it pays
        else:  # a named drafter runs at the fixed length every engine gets, with the draft's whole vocabulary
            p.draft_adaptive = False
            p.draft.vocab = 0
            if self.n_max is not None:
                p.draft.n_max = self.n_max
        p.synth_len = -1.0 if self.synth_len is None else float(self.synth_len)
        p.synth_rates = []
        return p


def parse_mode(text: str) -> Mode:
    s = text.strip()
    if not s:
        raise UsageError("empty mode name in --modes")
    at = re.fullmatch(r"(.+)@t(\S*)", s)
    if at is not None:
        if not at.group(2).isdigit() or int(at.group(2)) < 1:
            raise UsageError(f"mode {s!r}: @tN needs a thread count N >= 1 (e.g. plain@t1)")
        inner = parse_mode(at.group(1))
        return dataclasses.replace(inner, name=f"{inner.name}@t{int(at.group(2))}", threads=int(at.group(2)))
    if s == "plain" or s == "none":
        return Mode("plain")
    if s == "default":
        return Mode("default", types=("auto",))
    if s.startswith("default:"):
        inner = parse_mode(s.split(":", 1)[1])
        if not inner.types or inner.n_max is not None or inner.synth_len is not None or inner.lookup_n is not None:
            raise UsageError(f"mode {s!r}: default:TYPES takes drafter types only (e.g. default:draft-simple)")
        return Mode(f"default:{inner.name}", types=inner.types, defaults=True)
    if s == "lookup" or s.startswith("lookup:"):
        n = DEFAULT_LOOKUP_N
        if ":" in s:
            try:
                n = int(s.split(":", 1)[1])
            except ValueError:
                raise UsageError(f"mode {s!r}: lookup:N needs an integer N (num_pred_tokens)") from None
            if n < 1:
                raise UsageError(f"mode {s!r}: num_pred_tokens must be >= 1")
        return Mode(f"lookup:{n}", lookup_n=n)
    if s.startswith("synth:"):
        try:
            length = float(s.split(":", 1)[1])
        except ValueError:
            raise UsageError(f"mode {s!r}: synth:L needs a number L (mean accepted length)") from None
        if not math.isfinite(length) or length < 1.0:
            raise UsageError(f"mode {s!r}: the synthetic mean length must be >= 1")
        return Mode(f"synth:{length}", types=("draft-simple",), synth_len=length)
    n_max = None
    if ":" in s:
        s, _, n_text = s.partition(":")
        try:
            n_max = int(n_text)
        except ValueError:
            raise UsageError(f"mode {text.strip()!r}: TYPES:N needs an integer N (the draft model's n_max)") from None
        if n_max < 1:
            raise UsageError(f"mode {text.strip()!r}: the draft n_max must be >= 1")
    types = tuple(t.strip() for t in s.split("+"))
    for t in types:
        if t not in MODE_TYPES:
            extra = " (ngram-cache needs cache files: use llamaspec generate -lcs/-lcd)" if t == "ngram-cache" else ""
            known = ", ".join(("plain", "default") + MODE_TYPES + ("TYPES:N", "synth:L", "lookup[:N]"))
            if t in NAME_TO_TYPE and not extra:
                extra = " (not supported by the benchmark)"
            raise UsageError(f"unknown benchmark mode {t!r}{extra}; known: {known}")
    if len(set(types)) != len(types):
        raise UsageError(f"mode {s!r} names a drafter twice")
    if n_max is not None:
        if not any(t.startswith("draft-") for t in types):
            raise UsageError(f"mode {text.strip()!r}: :N sets the draft model's n_max; {s} has no draft-model drafter")
        return Mode(f"{'+'.join(types)}:{n_max}", types=types, n_max=n_max)
    return Mode("+".join(types), types=types)


def parse_modes(text: str | list[str]) -> list[Mode]:
    items = text.split(",") if isinstance(text, str) else [x for t in text for x in t.split(",")]
    out: list[Mode] = []
    for item in items:
        if not item.strip():
            continue
        m = parse_mode(item)
        if m.name not in {x.name for x in out}:
            out.append(m)
    if not out:
        raise UsageError("--modes is empty")
    return out
