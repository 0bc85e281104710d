"""Draft/target vocabulary compatibility, rule by rule (§11).

llama.cpp only says "draft model vocab type must match target model to use speculation"; here every rule
is evaluated and reported, so the user sees *which* rule failed.

The check works on any object with the attributes of :class:`VocabInfo` (a real ``_llama.Vocab`` has
them), so it can be tested with plain Python objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

MAX_SIZE_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE
CHECK_START_TOKEN_ID = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID


class VocabInfo(Protocol):
    type: int
    n_tokens: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool

    def get_text(self, token: int) -> bytes: ...


@dataclass
class RuleResult:
    rule: str
    ok: bool
    detail: str

    def to_dict(self) -> dict:
        return {"rule": self.rule, "ok": self.ok, "detail": self.detail}


def check_vocab_compat(tgt: VocabInfo, dft: VocabInfo) -> list[RuleResult]:
    """Evaluate the five rules of §11; compatible iff every result is ``ok``.

    >>> class V:
    ...     def __init__(self, n, texts=None): self.type, self.n_tokens, self.bos, self.eos = 1, n, 1, 2; \
self.add_bos, self.add_eos = True, False; self.texts = texts or {}
    ...     def get_text(self, t): return self.texts.get(t, b"t%d" % t)
    >>> [r.ok for r in check_vocab_compat(V(100), V(100))]
    [True, True, True, True, True]
    >>> [r.rule for r in check_vocab_compat(V(100), V(300, {7: b"x"})) if not r.ok]
    ['size', 'text']
    """
    out: list[RuleResult] = []
    out.append(RuleResult("type", tgt.type == dft.type, f"vocab type target={tgt.type} draft={dft.type}"))
    ok = tgt.add_bos == dft.add_bos and (not tgt.add_bos or tgt.bos == dft.bos)
    out.append(RuleResult("bos", ok, f"add_bos target={tgt.add_bos} draft={dft.add_bos}, bos target={tgt.bos} draft={dft.bos}"))
    ok = tgt.add_eos == dft.add_eos and (not tgt.add_eos or tgt.eos == dft.eos)
    out.append(RuleResult("eos", ok, f"add_eos target={tgt.add_eos} draft={dft.add_eos}, eos target={tgt.eos} draft={dft.eos}"))
    diff = abs(tgt.n_tokens - dft.n_tokens)
    out.append(
        RuleResult("size", diff <= MAX_SIZE_DIFFERENCE, f"n_tokens target={tgt.n_tokens} draft={dft.n_tokens} (difference {diff}, max {MAX_SIZE_DIFFERENCE})")
    )
    first_bad = _first_text_mismatch(tgt.get_text, dft.get_text, CHECK_START_TOKEN_ID, min(tgt.n_tokens, dft.n_tokens))
    if first_bad is None:
        out.append(RuleResult("text", True, f"token texts identical for ids {CHECK_START_TOKEN_ID}..{min(tgt.n_tokens, dft.n_tokens) - 1}"))
    else:
        i = first_bad
        out.append(RuleResult("text", False, f"token {i} differs: target={tgt.get_text(i)!r} draft={dft.get_text(i)!r}"))
    return out


def _first_text_mismatch(a: Callable[[int], bytes], b: Callable[[int], bytes], start: int, end: int) -> int | None:
    for i in range(start, end):
        if a(i) != b(i):
            return i
    return None


def is_compatible(results: list[RuleResult]) -> bool:
    return all(r.ok for r in results)


def incompatibility_message(results: list[RuleResult]) -> str:
    bad = [r for r in results if not r.ok]
    return "draft model vocab is incompatible with the target: " + "; ".join(f"{r.rule}: {r.detail}" for r in bad)
